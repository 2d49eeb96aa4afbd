"""autoplan: plan and run a PyTorch training step over an N-D device mesh."""

from autoplan.api import AutoParallel
from autoplan.costs import H100_SXM, DeviceProfile
from autoplan.errors import AutoplanError, ConstraintError, TracingError, UnsupportedOpError
from autoplan.plan import Plan

__all__ = [
    "H100_SXM",
    "AutoParallel",
    "AutoplanError",
    "ConstraintError",
    "DeviceProfile",
    "Plan",
    "TracingError",
    "UnsupportedOpError",
]
