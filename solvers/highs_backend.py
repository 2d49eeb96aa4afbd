"""HiGHS backend: passes the model's numpy arrays straight to ``highspy`` (no MPS round trip)."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
import threading
from time import perf_counter
from typing import Any

import numpy as np

from .model import LinearModel
from .result import RawSolution, SolverOptions, SolveStatus

# Model statuses meaning "a limit stopped the solver", not "the model is bad".
_LIMIT_STATUSES = (
    "kTimeLimit",
    "kIterationLimit",
    "kSolutionLimit",
    "kInterrupt",
    "kObjectiveBound",
    "kObjectiveTarget",
    "kMemoryLimit",
)

_PROBING = 1 << 15  # HiGHS's presolve rule bit for probing
# seconds between two progress lines of a MIP (``SolverOptions.log``): its first after as long
PROGRESS_S = 5.0

_first_made = False  # has this process made a ``Highs`` yet (its banner printed or silenced)?
_first_lock = threading.Lock()


def available() -> bool:
    return importlib.util.find_spec("highspy") is not None


def _highs_lp(highspy: Any, model: LinearModel) -> Any:
    """Column-wise ``HighsLp`` without integrality; integrality is switched on separately for MIPs."""
    lp = highspy.HighsLp()
    lp.num_col_ = model.n_cols
    lp.num_row_ = model.n_rows
    lp.offset_ = model.constant
    lp.col_cost_ = model.cost
    lp.col_lower_ = model.col_lb
    lp.col_upper_ = model.col_ub
    lp.row_lower_ = model.row_lo
    lp.row_upper_ = model.row_hi
    a = lp.a_matrix_
    a.format_ = highspy.MatrixFormat.kColwise
    a.num_col_ = model.n_cols
    a.num_row_ = model.n_rows
    a.start_ = model.csc_start
    a.index_ = model.csc_row
    a.value_ = model.csc_val
    return lp


def _quiet_highs(highspy: Any, verbose: bool) -> Any:
    """A new ``Highs``, its banner silenced unless ``verbose``. HiGHS writes its banner (version and
    copyright) to the process's standard output when a process makes its first instance, before any
    option can switch its output off, so on every rank of every run; that first instance is made
    with file descriptor 1 pointed at the null device (HiGHS flushes each line it writes), and
    later ones print nothing until told to."""
    global _first_made
    with _first_lock:
        if _first_made or verbose:
            _first_made = True
            return highspy.Highs()
        sys.stdout.flush()
        try:
            saved = os.dup(1)
        except OSError:  # no standard output (a closed descriptor): nothing to silence
            _first_made = True
            return highspy.Highs()
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.close(null)
            h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _first_made = True
        return h


def _report_progress(h: Any, name: str, log: logging.Logger) -> None:
    """Log the MIP's incumbent, bound and gap every ``PROGRESS_S`` seconds of its run, at INFO.
    HiGHS calls its interrupt callback often during the search (tens of times a second), and its
    own log lines only when its output is on."""
    next_at = PROGRESS_S

    def report(event: Any) -> None:
        nonlocal next_at
        out = event.data_out
        if out.running_time < next_at:
            return
        next_at = out.running_time + PROGRESS_S
        found = math.isfinite(out.mip_primal_bound)
        log.info(
            "MIP %s: incumbent %s, bound %.6g, gap %s, %.1f s elapsed",
            name,
            f"{out.mip_primal_bound:.6g}" if found else "none yet",
            out.mip_dual_bound,
            f"{out.mip_gap:.2%}" if found and math.isfinite(out.mip_gap) else "unknown",
            out.running_time,
        )

    h.cbMipInterrupt.subscribe(report)


def _new_highs(highspy: Any, opts: SolverOptions) -> Any:
    h = _quiet_highs(highspy, opts.verbose)
    h.setOptionValue("output_flag", opts.verbose)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("presolve", "on" if opts.presolve else "off")
    if not opts.probing and h.setOptionValue("presolve_rule_off", _PROBING) != highspy.HighsStatus.kOk:
        raise RuntimeError("this HiGHS refuses presolve_rule_off: probing cannot be switched off")
    h.setOptionValue("mip_rel_gap", float(opts.mip_rel_gap))
    if opts.time_limit is not None:
        h.setOptionValue("time_limit", max(float(opts.time_limit), 0.0))
    if opts.threads is not None:
        h.setOptionValue("threads", int(opts.threads))
    return h


def _run(highspy: Any, h: Any, opts: SolverOptions) -> None:
    refused = h.run() == highspy.HighsStatus.kError and h.getModelStatus() == highspy.HighsModelStatus.kNotset
    if refused and opts.threads is not None:
        # HiGHS's thread pool is process-global and fixed at first use: a run asking for another
        # thread count is refused before any work (no model status) until the pool is rebuilt. It
        # is rebuilt only then, never under a solve running in another thread (runs at once ask
        # for one count), nor after a solve that failed on its own.
        highspy.Highs.resetGlobalScheduler(True)
        h.run()
    if h.getModelStatus() == highspy.HighsModelStatus.kUnboundedOrInfeasible:
        # Presolve may stop without telling which; the simplex on the full model decides.
        h.setOptionValue("presolve", "off")
        h.run()


def _read(highspy: Any, h: Any, is_mip: bool) -> tuple[SolveStatus, np.ndarray | None, float, bool]:
    """Map HiGHS's model status to (status, x, dual bound, hit_limit)."""
    ms = h.getModelStatus()
    info = h.getInfo()
    has_x = info.primal_solution_status == int(highspy.kSolutionStatusFeasible)
    x = np.asarray(h.getSolution().col_value, dtype=np.float64) if has_x else None
    mip_bound = info.mip_dual_bound if is_mip else -math.inf
    if ms == highspy.HighsModelStatus.kOptimal:
        return SolveStatus.OPTIMAL, x, mip_bound if is_mip else info.objective_function_value, False
    if ms == highspy.HighsModelStatus.kInfeasible:
        return SolveStatus.INFEASIBLE, None, math.inf, False
    if ms == highspy.HighsModelStatus.kUnbounded:
        return SolveStatus.UNBOUNDED, x, -math.inf, False
    if ms.name in _LIMIT_STATUSES:
        return (SolveStatus.FEASIBLE if has_x else SolveStatus.NO_SOLUTION), x, mip_bound, True
    return SolveStatus.NO_SOLUTION, None, -math.inf, False


def solve_highs(model: LinearModel, integral: bool, opts: SolverOptions) -> RawSolution:
    """Solve ``model`` with HiGHS, as a MIP if ``integral`` else as its LP relaxation."""
    import highspy

    if model.n_cols == 0:  # HiGHS calls this "empty": optimal, ignoring row bounds and the offset
        tol = 1e-7  # HiGHS's primal feasibility tolerance: these bounds are what fixed columns left
        if np.all((model.row_lo <= tol) & (model.row_hi >= -tol)):
            return RawSolution(SolveStatus.OPTIMAL, np.zeros(0), model.constant, False, 0.0, 0.0)
        return RawSolution(SolveStatus.INFEASIBLE, None, math.inf, False, 0.0, 0.0)
    t0 = perf_counter()
    h = _new_highs(highspy, opts)
    if h.passModel(_highs_lp(highspy, model)) == highspy.HighsStatus.kError:
        raise ValueError(f"HiGHS rejected model {model.name!r} (set verbose=True for its log)")
    is_mip = integral and model.n_integer > 0
    if is_mip:
        cols = np.flatnonzero(model.integer).astype(np.int32)
        h.changeColsIntegrality(len(cols), cols, np.ones(len(cols), dtype=np.uint8))
        if opts.start is not None:
            start = highspy.HighsSolution()
            start.col_value = opts.start
            start.value_valid = True
            h.setSolution(start)
        if opts.log is not None and opts.log.isEnabledFor(logging.INFO):
            _report_progress(h, model.name, opts.log)
    t1 = perf_counter()
    _run(highspy, h, opts)
    status, x, bound, hit_limit = _read(highspy, h, is_mip)
    return RawSolution(status, x, bound, hit_limit, build_time=t1 - t0, solve_time=perf_counter() - t1)
