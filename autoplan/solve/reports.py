"""Typed reports of how a plan was solved: the solver's outcome, the ILP's size and the boundary
re-solves. They save to JSON as the plain dicts they replaced, key for key, and read like them too
(``plan.solver["gap"]``, ``plan.ilp.get("n_vars")``), so saved plans and callers keep working."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from solvers import SolveResult


class _ReadsAsDict:
    """``report["key"]`` and ``report.get("key", default)`` read the field of that name."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._names() else default

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def _names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def _known(cls, d: dict) -> dict:
        """The entries of ``d`` that are fields (a plan saved by another version may hold more)."""
        return {k: v for k, v in d.items() if k in cls._names()}


@dataclass(frozen=True)
class SolverReport(_ReadsAsDict):
    """The main solve's outcome (``solvers.SolveResult`` without its solution vector): status,
    objective and bound (seconds, ``None`` where not finite), the gap between them, the backend and
    the model's size. ``build_time`` and ``solve_time`` are wall-clock seconds."""

    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    x: None = None  # the solution vector, never kept in a plan (its strategies say what it chose)
    backend: str = ""
    lp_was_integral: bool = False
    build_time: float = 0.0
    solve_time: float = 0.0
    n_vars: int = 0
    n_rows: int = 0
    n_nonzeros: int = 0
    n_integer: int = 0

    @classmethod
    def of(cls, result: SolveResult) -> SolverReport:
        plain = replace(result, x=np.zeros(0)).to_dict()  # the solution vector, never listed to be dropped
        return cls(**{**cls._known(plain), "x": None})

    @classmethod
    def from_dict(cls, d: dict) -> SolverReport:
        return cls(**cls._known(d))


@dataclass(frozen=True)
class Refinement(_ReadsAsDict):
    """One boundary re-solve: the layers decided on their own, the ILP's size, how it ended, the
    seconds it took (``solve_s``, wall clock) and saved (``gain_s``), and whether its plan was kept."""

    layers: list[str]
    n_vars: int
    n_rows: int
    status: str
    gap: float
    solve_s: float = 0.0  # absent from a plan saved without timings
    gain_s: float = 0.0
    kept: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> Refinement:
        return cls(**cls._known(d))


@dataclass(frozen=True)
class IlpReport(_ReadsAsDict):
    """The main ILP's size (variables, of which edge pairs; rows; strategies dropped as dominated),
    how the graph was folded into it (units; nodes merged into a producer, or clustered into a
    repeated layer's representative; graph nodes), the peak steps bounded, the objective (seconds
    per step), the boundary re-solves and, where most of the forward compute runs replicated
    (``plan.REPLICATED_SHARE``), the objective of the best plan that splits every forward compute
    op that can split (``split_objective``; ``None``: not asked, or no such plan found)."""

    n_vars: int
    n_rows: int
    n_edge_vars: int
    n_dropped_strategies: int
    n_units: int
    n_merged: int
    n_clustered: int
    n_nodes: int
    n_peak_steps: int
    objective: float
    refinements: list[Refinement] = field(default_factory=list)
    split_objective: float | None = None

    @classmethod
    def from_dict(cls, d: dict) -> IlpReport:
        known = cls._known(d)
        return cls(**{**known, "refinements": [Refinement.from_dict(r) for r in known.get("refinements", [])]})
