"""autoplan: plan and run a PyTorch training step over an N-D device mesh."""

from autoplan.api import AutoParallel
from autoplan.cost.devices import DEVICE_PROFILES, H100_SXM, DeviceProfile
from autoplan.errors import (
    AutoplanError,
    ConstraintError,
    InfeasiblePlanError,
    InputMismatchError,
    PlanMismatchError,
    SolverLimitError,
    TracingError,
    UnsupportedOpError,
)
from autoplan.plan import Plan
from autoplan.trace.grouped_mm import any_dtype as any_dtype_grouped_mm
from autoplan.trace.regions import local_map

__all__ = [
    "DEVICE_PROFILES",
    "H100_SXM",
    "AutoParallel",
    "AutoplanError",
    "ConstraintError",
    "DeviceProfile",
    "InfeasiblePlanError",
    "InputMismatchError",
    "Plan",
    "PlanMismatchError",
    "SolverLimitError",
    "TracingError",
    "UnsupportedOpError",
    "any_dtype_grouped_mm",
    "local_map",
]
