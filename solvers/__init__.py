"""Array-based MILP modelling over HiGHS (direct) and CBC (through PuLP).

Typical use::

    b = ModelBuilder("placement")
    x = b.add_vars(n, cost=c)
    b.add_rows(row, col, val, lo=1.0, hi=1.0, group="input_constraints")
    res = solve(b.build(), time_limit=5.0)
"""

from .model import LinearModel, ModelBuilder
from .pulp_backend import to_pulp
from .result import (
    OPTIMALITY_GAP,
    STOP_RESTRICTED,
    STOP_TIME_LIMIT,
    InfeasibleError,
    SolveOptions,
    SolveResult,
    SolverTimeoutError,
    SolveStatus,
)
from .solve import Screen, solve

__all__ = [
    "OPTIMALITY_GAP",
    "STOP_RESTRICTED",
    "STOP_TIME_LIMIT",
    "Screen",
    "SolveOptions",
    "InfeasibleError",
    "LinearModel",
    "ModelBuilder",
    "SolveResult",
    "SolveStatus",
    "SolverTimeoutError",
    "solve",
    "to_pulp",
]
