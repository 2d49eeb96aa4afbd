"""Solver-neutral statuses, results, options and errors."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class SolveStatus(Enum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # stopped by a limit or a loose gap, with an incumbent
    INFEASIBLE = "infeasible"
    UNBOUNDED = "unbounded"
    NO_SOLUTION = "no_solution"


OPTIMALITY_GAP = 1e-6  # relative gap under which a MIP incumbent counts as optimal


def relative_gap(objective: float, bound: float) -> float:
    """``|objective - bound| / max(|objective|, 1e-12)``; infinite when no bound is known."""
    if not (math.isfinite(objective) and math.isfinite(bound)):
        return math.inf
    return abs(objective - bound) / max(abs(objective), 1e-12)


STOP_TIME_LIMIT = "time limit"  # ``SolveResult.stop``: a pass stopped at its time limit
STOP_RESTRICTED = "restricted"  # the best point over the columns kept, against the whole model's bound


def _json_float(v: float) -> float | None:
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class SolveResult:
    """Outcome of ``solve``; ``x`` has integer columns rounded to exact integers. ``stop``: what ended
    the search short of proving ``mip_rel_gap`` where it did, ``STOP_TIME_LIMIT`` (a pass stopped at
    its time limit: ``time_limit``, or ``improve_s`` without one) or ``STOP_RESTRICTED`` (the best
    point over the columns a screen or the priced LP kept, searched to its end, against the whole
    model's bound); ``""`` otherwise."""

    status: SolveStatus
    objective: float
    bound: float
    gap: float
    x: np.ndarray = field(repr=False)
    backend: str
    lp_was_integral: bool
    build_time: float
    solve_time: float
    n_vars: int
    n_rows: int
    n_nonzeros: int
    n_integer: int
    stop: str = ""

    def to_dict(self) -> dict:
        """JSON-friendly view: enum as its value, non-finite floats as None, ``x`` as a list."""
        return {
            "status": self.status.value,
            "objective": _json_float(self.objective),
            "bound": _json_float(self.bound),
            "gap": _json_float(self.gap),
            "x": self.x.tolist(),
            "backend": self.backend,
            "lp_was_integral": self.lp_was_integral,
            "build_time": self.build_time,
            "solve_time": self.solve_time,
            "n_vars": self.n_vars,
            "n_rows": self.n_rows,
            "n_nonzeros": self.n_nonzeros,
            "n_integer": self.n_integer,
            "stop": self.stop,
        }


@dataclass(frozen=True)
class SolveOptions:
    """Every knob of a solve, as one value carried from ``AutoParallel`` through the planner and
    ``autoplan.solve.ilp`` down to ``solve``: a new knob is one field here. Each layer reads its own and
    passes the rest on (a layer that varies one for a call replaces it in a copy).

    ``solve`` reads: ``backend`` ("highs", "cbc" or "auto"), ``time_limit`` (seconds, ``None``: no
    limit), ``mip_rel_gap`` (how far above the bound a point is good enough), ``threads``,
    ``lp_first`` (the LP relaxation before any MIP), ``diagnose`` (name the conflicting groups of
    an infeasible model), ``keep_start`` (a start good enough is kept, the rounding untried),
    ``verbose`` (the backend's own log) and ``log`` (a long MIP's progress at INFO).
    ``improve_s`` (with no time limit, the seconds the MIP may spend improving a feasible point found
    before it: a completed start, a rounding).
    ``autoplan.solve.ilp`` reads: ``polish_s`` (seconds the full MIP may spend improving a seed plan; 0:
    the seed as it is) and ``seed_only`` (no full MIP when no seed is found)."""

    backend: str = "highs"
    time_limit: float | None = None
    mip_rel_gap: float = 1e-6
    threads: int | None = None
    lp_first: bool = True
    diagnose: bool = True
    keep_start: bool = False
    improve_s: float = 30.0
    polish_s: float = 30.0
    seed_only: bool = False
    verbose: bool = False
    log: logging.Logger | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SolverOptions:
    """What every backend honours, for one backend call (``solve`` makes them from ``SolveOptions``)."""

    time_limit: float | None = None
    mip_rel_gap: float = 1e-6
    threads: int | None = None
    verbose: bool = False
    presolve: bool = True
    probing: bool = True  # HiGHS's MIP presolve probes binaries (other backends ignore it)
    start: np.ndarray | None = field(default=None, compare=False)  # a feasible point the MIP search starts from
    # where a long MIP reports its progress (incumbent, bound, gap, seconds) at INFO; HiGHS only
    log: logging.Logger | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RawSolution:
    """What a backend reports for one solve, before ``solve`` turns it into a ``SolveResult``.

    ``bound`` is the dual bound including the objective constant (``-inf`` when the backend does
    not know one); ``hit_limit`` tells a time-limit stop from a genuine failure.
    """

    status: SolveStatus
    x: np.ndarray | None
    bound: float
    hit_limit: bool
    build_time: float
    solve_time: float


class InfeasibleError(Exception):
    """The model has no feasible point; ``groups`` is a minimal conflicting set of user groups.

    An empty ``groups`` means the structural rows conflict on their own.
    """

    def __init__(self, groups: list[str], message: str) -> None:
        super().__init__(message)
        self.groups = list(groups)


class SolverTimeoutError(Exception):
    """The time limit ran out before any feasible point was found."""

    def __init__(self, message: str, time_limit: float | None, backend: str, n_vars: int = 0, n_rows: int = 0) -> None:
        super().__init__(message)
        self.time_limit = time_limit
        self.backend = backend
        self.n_vars, self.n_rows = n_vars, n_rows
