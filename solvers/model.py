"""Array-based construction of linear (integer) programs.

Placement ILPs have tens of thousands of columns and hundreds of thousands of nonzeros; building
them term by term through PuLP expressions takes seconds. Here callers hand over numpy COO blocks,
which are converted once to compressed column form (what HiGHS consumes) and row form (what the
per-row PuLP expressions need).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
from numpy.typing import ArrayLike

STRUCTURAL = -1  # row_group value of rows that belong to no user constraint group


def _frozen(a: ArrayLike, dtype: type) -> np.ndarray:
    """Copy into a read-only array so a built model cannot be mutated behind a solver's back."""
    out = np.array(a, dtype=dtype, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class LinearModel:
    """``min cost @ x + constant`` s.t. ``row_lo <= A @ x <= row_hi`` and ``col_lb <= x <= col_ub``.

    ``A`` is kept both column-wise (``csc_*``) and row-wise (``csr_*``) with int32 indices, the
    index width HiGHS uses. ``row_group[i]`` indexes ``groups`` (or is ``STRUCTURAL``); only
    grouped rows are user constraints that an infeasibility diagnosis may relax.
    """

    name: str
    cost: np.ndarray
    col_lb: np.ndarray
    col_ub: np.ndarray
    integer: np.ndarray
    row_lo: np.ndarray
    row_hi: np.ndarray
    csc_start: np.ndarray
    csc_row: np.ndarray
    csc_val: np.ndarray
    csr_start: np.ndarray
    csr_col: np.ndarray
    csr_val: np.ndarray
    row_group: np.ndarray
    groups: tuple[str, ...]
    constant: float = 0.0
    col_names: tuple[str, ...] | None = None
    row_names: tuple[str, ...] | None = None

    @property
    def n_cols(self) -> int:
        return len(self.cost)

    @property
    def n_rows(self) -> int:
        return len(self.row_lo)

    @property
    def n_nonzeros(self) -> int:
        return len(self.csc_val)

    @property
    def n_integer(self) -> int:
        return int(np.count_nonzero(self.integer))

    @cached_property
    def entry_row(self) -> np.ndarray:
        """The row of each row-wise entry (``csr_*``), worked out once: bounds, propagation and
        neighbourhoods sum their entries per row with it, the ascent every few sweeps."""
        return _frozen(np.repeat(np.arange(self.n_rows), np.diff(self.csr_start)), np.int64)

    @cached_property
    def entry_col(self) -> np.ndarray:
        """The column of each column-wise entry (``csc_*``), worked out once."""
        return _frozen(np.repeat(np.arange(self.n_cols), np.diff(self.csc_start)), np.int64)

    def activity(self, x: np.ndarray) -> np.ndarray:
        """``A @ x``, per row."""
        return np.bincount(self.entry_row, weights=self.csr_val * x[self.csr_col], minlength=self.n_rows)

    def reduced_costs(self, y: np.ndarray) -> np.ndarray:
        """``cost - A^T y``, per column: what each column adds to the objective at row multipliers ``y``."""
        return self.cost - np.bincount(self.entry_col, weights=self.csc_val * y[self.csc_row], minlength=self.n_cols)

    def objective_value(self, x: np.ndarray) -> float:
        """Objective of ``x`` including the constant offset."""
        return float(self.cost @ x) + self.constant

    def restricted(self, columns: np.ndarray, values: np.ndarray) -> tuple[LinearModel, np.ndarray, np.ndarray]:
        """The model with ``columns`` held at ``values`` (clipped to their bounds, so a guess never
        overrides a bound, e.g. a pinned binary), over the other columns only: the fixed ones move
        into the row bounds and the constant, so a solver never spends a presolve removing them,
        and so do the columns they hold at 0. Also the full point with the columns left at 0, and
        which are left, for the solution to be written into."""
        fixed = np.asarray(columns, dtype=bool)
        full = np.where(fixed, np.clip(values, self.col_lb, self.col_ub), 0.0)
        entry_row, activity = self.entry_row, self.activity(full)
        # a row left with only positive terms over columns >= 0 and room for none holds them at 0
        # (the pair columns beside a placement fixed off: with every placement fixed, all but ~1 a group)
        free_entry = ~fixed[self.csr_col]
        bad = free_entry & ((self.csr_val <= 0) | (self.col_lb[self.csr_col] != 0))
        closed = (self.row_hi - activity <= 1e-9) & (np.bincount(entry_row, weights=bad, minlength=self.n_rows) == 0)
        fixed = fixed.copy()
        fixed[self.csr_col[closed[entry_row] & free_entry]] = True
        keep = ~fixed
        in_csc = keep[self.entry_col]
        in_csr = keep[self.csr_col]
        new_col = np.cumsum(keep) - 1
        names = self.col_names
        sub = replace(
            self,
            cost=_frozen(self.cost[keep], np.float64),
            col_lb=_frozen(self.col_lb[keep], np.float64),
            col_ub=_frozen(self.col_ub[keep], np.float64),
            integer=_frozen(self.integer[keep], bool),
            row_lo=_frozen(self.row_lo - activity, np.float64),
            row_hi=_frozen(self.row_hi - activity, np.float64),
            csc_start=_frozen(np.r_[0, np.cumsum(np.diff(self.csc_start)[keep])], np.int32),
            csc_row=_frozen(self.csc_row[in_csc], np.int32),
            csc_val=_frozen(self.csc_val[in_csc], np.float64),
            csr_start=_frozen(np.r_[0, np.cumsum(np.bincount(entry_row[in_csr], minlength=self.n_rows))], np.int32),
            csr_col=_frozen(new_col[self.csr_col[in_csr]], np.int32),
            csr_val=_frozen(self.csr_val[in_csr], np.float64),
            constant=self.constant + float(self.cost @ full),
            col_names=None if names is None else tuple(n for n, k in zip(names, keep) if k),
        )
        return sub, full, keep

    def near(self, columns: np.ndarray, hops: int, widest: int | None = None) -> np.ndarray:
        """The columns within ``hops`` steps of ``columns``, a step going from a column to every
        column that shares a row with it (a mask over columns); with ``widest``, not through rows
        of more entries than that."""
        entry_col, entry_row = self.entry_col, self.entry_row
        narrow = np.diff(self.csr_start) <= (self.n_cols if widest is None else widest)
        out = np.asarray(columns, dtype=bool).copy()
        for _ in range(hops):
            rows = np.zeros(self.n_rows, dtype=bool)
            rows[self.csc_row[out[entry_col]]] = True
            out[self.csr_col[(rows & narrow)[entry_row]]] = True
        return out

    def feasibility_model(self, active_groups: Iterable[str]) -> LinearModel:
        """Same constraints with a zero objective and the rows of inactive groups made free.

        The zero objective rules out unboundedness and lets the solver stop at the first feasible
        point, which is all that an infeasibility diagnosis asks.
        """
        active = [self.groups.index(g) for g in active_groups]
        dropped = (self.row_group != STRUCTURAL) & ~np.isin(self.row_group, active)
        return replace(
            self,
            cost=_frozen(np.zeros(self.n_cols), np.float64),
            constant=0.0,
            row_lo=_frozen(np.where(dropped, -np.inf, self.row_lo), np.float64),
            row_hi=_frozen(np.where(dropped, np.inf, self.row_hi), np.float64),
        )


@dataclass(frozen=True)
class _ColBlock:
    cost: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integer: bool
    names: Sequence[str] | None


@dataclass(frozen=True)
class _RowBlock:
    row: np.ndarray  # global row ids
    col: np.ndarray
    val: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    group: int
    names: Sequence[str] | None


def _broadcast(a: ArrayLike, n: int, what: str) -> np.ndarray:
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(n, float(arr))
    if arr.shape != (n,):
        raise ValueError(f"{what} has shape {arr.shape}, expected ({n},)")
    return arr


def _infer_row_count(row: np.ndarray, lo: ArrayLike, hi: ArrayLike, names: Sequence[str] | None) -> int:
    """Row count of a block: from array bounds or names, else from the largest row id used."""
    for bounds in (lo, hi):
        if np.ndim(bounds) == 1:
            return len(np.asarray(bounds))
    if names is not None:
        return len(names)
    return int(row.max()) + 1 if row.size else 0


def _names(blocks: Sequence[_ColBlock] | Sequence[_RowBlock], sizes: list[int], prefix: str) -> tuple[str, ...] | None:
    """Materialise names only when some block named its entries; the rest get ``{prefix}{i}``."""
    if all(b.names is None for b in blocks):
        return None
    out: list[str] = []
    for block, size in zip(blocks, sizes):
        start = len(out)
        out.extend(block.names if block.names is not None else (f"{prefix}{start + i}" for i in range(size)))
    return tuple(out)


def _compress(
    major: np.ndarray, minor: np.ndarray, val: np.ndarray, n_major: int, n_minor: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """COO -> compressed (start, minor, val) along ``major``, summing duplicates and dropping zeros."""
    width = max(n_minor, 1)
    key = major.astype(np.int64) * width + minor
    order = np.argsort(key, kind="stable")
    key, val = key[order], val[order]
    first = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1]))) if key.size else np.zeros(0, np.int64)
    summed = np.add.reduceat(val, first) if first.size else val[:0]
    keep = summed != 0
    key, summed = key[first][keep], summed[keep]
    start = np.zeros(n_major + 1, dtype=np.int64)
    np.cumsum(np.bincount(key // width, minlength=n_major), out=start[1:])
    return start, key % width, summed


class ModelBuilder:
    """Accumulates column and row blocks; ``build()`` assembles them into a ``LinearModel``."""

    def __init__(self, name: str = "model") -> None:
        self.name = name
        self._cols: list[_ColBlock] = []
        self._rows: list[_RowBlock] = []
        self._n_cols = 0
        self._n_rows = 0
        self._groups: dict[str, int] = {}
        self._constant = 0.0

    def add_vars(
        self,
        n: int,
        cost: ArrayLike = 0.0,
        lb: ArrayLike = 0.0,
        ub: ArrayLike = 1.0,
        integer: bool = True,
        names: Sequence[str] | None = None,
    ) -> np.ndarray:
        """Add ``n`` columns (binary by default); returns their contiguous global indices."""
        if names is not None and len(names) != n:
            raise ValueError(f"{len(names)} names for {n} variables")
        block = _ColBlock(_broadcast(cost, n, "cost"), _broadcast(lb, n, "lb"), _broadcast(ub, n, "ub"), integer, names)
        self._cols.append(block)
        self._n_cols += n
        return np.arange(self._n_cols - n, self._n_cols, dtype=np.int64)

    def add_rows(
        self,
        row: ArrayLike,
        col: ArrayLike,
        val: ArrayLike,
        lo: ArrayLike,
        hi: ArrayLike,
        group: str | None = None,
        names: Sequence[str] | None = None,
    ) -> np.ndarray:
        """Add rows ``lo <= sum(val * x[col]) <= hi`` given as COO triplets with block-local row ids.

        The row count comes from array-valued ``lo``/``hi`` or ``names``, else from ``max(row) + 1``.
        Returns the global row indices.
        """
        row = np.asarray(row, dtype=np.int64).ravel()
        col = np.asarray(col, dtype=np.int64).ravel()
        val = np.broadcast_to(np.asarray(val, dtype=np.float64), row.shape).copy()
        if col.shape != row.shape:
            raise ValueError(f"row has {row.size} entries but col has {col.size}")
        m = _infer_row_count(row, lo, hi, names)
        if names is not None and len(names) != m:
            raise ValueError(f"{len(names)} names for {m} rows")
        if row.size and (row.min() < 0 or row.max() >= m):
            raise ValueError(f"row ids must lie in [0, {m})")
        if col.size and (col.min() < 0 or col.max() >= self._n_cols):
            raise ValueError(f"column ids must lie in [0, {self._n_cols})")
        group_id = STRUCTURAL if group is None else self._groups.setdefault(group, len(self._groups))
        block = _RowBlock(
            row + self._n_rows, col, val, _broadcast(lo, m, "lo"), _broadcast(hi, m, "hi"), group_id, names
        )
        self._rows.append(block)
        self._n_rows += m
        return np.arange(self._n_rows - m, self._n_rows, dtype=np.int64)

    def add_constant(self, c: float) -> None:
        """Add a constant to the objective (kept so reported objectives match the caller's cost model)."""
        self._constant += float(c)

    def build(self) -> LinearModel:
        cols, rows = self._cols, self._rows
        n, m = self._n_cols, self._n_rows

        def cat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)

        r = cat([b.row for b in rows], np.int64)
        c = cat([b.col for b in rows], np.int64)
        v = cat([b.val for b in rows], np.float64)
        if r.size >= np.iinfo(np.int32).max:
            raise ValueError("more nonzeros than 32-bit solver indices allow")
        csc_start, csc_row, csc_val = _compress(c, r, v, n, m)
        entry_col = np.repeat(np.arange(n, dtype=np.int64), np.diff(csc_start))
        by_row = np.argsort(csc_row, kind="stable")  # entries are column-major, so this yields row-major order
        csr_start = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(np.bincount(csc_row, minlength=m), out=csr_start[1:])
        return LinearModel(
            name=self.name,
            cost=_frozen(cat([b.cost for b in cols], np.float64), np.float64),
            col_lb=_frozen(cat([b.lb for b in cols], np.float64), np.float64),
            col_ub=_frozen(cat([b.ub for b in cols], np.float64), np.float64),
            integer=_frozen(cat([np.full(len(b.cost), b.integer) for b in cols], bool), bool),
            row_lo=_frozen(cat([b.lo for b in rows], np.float64), np.float64),
            row_hi=_frozen(cat([b.hi for b in rows], np.float64), np.float64),
            csc_start=_frozen(csc_start, np.int32),
            csc_row=_frozen(csc_row, np.int32),
            csc_val=_frozen(csc_val, np.float64),
            csr_start=_frozen(csr_start, np.int32),
            csr_col=_frozen(entry_col[by_row], np.int32),
            csr_val=_frozen(csc_val[by_row], np.float64),
            row_group=_frozen(cat([np.full(len(b.lo), b.group) for b in rows], np.int32), np.int32),
            groups=tuple(self._groups),
            constant=self._constant,
            col_names=_names(cols, [len(b.cost) for b in cols], "x"),
            row_names=_names(rows, [len(b.lo) for b in rows], "r"),
        )
