"""autoplan: plan and run a PyTorch training step over an N-D device mesh."""

from autoplan.api import AutoParallel
from autoplan.constraints import ConstraintError
from autoplan.costs import H100_SXM, DeviceProfile
from autoplan.plan import Plan
from autoplan.strategies import UnsupportedOpError

__all__ = ["H100_SXM", "AutoParallel", "ConstraintError", "DeviceProfile", "Plan", "UnsupportedOpError"]
