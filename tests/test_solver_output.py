"""What the solver prints and logs: nothing on standard output unless asked, and a long MIP's progress
through the logger it is given."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from test_solvers import multi_knapsack

from solvers import solve

ROOT = Path(__file__).resolve().parents[1]

# a fresh process: HiGHS prints its banner when a process makes its first solver instance
KNAPSACK = """
import sys
import numpy as np
from solvers import ModelBuilder, solve

b = ModelBuilder("knapsack")
x = b.add_vars(5, cost=-np.array([10.0, 13.0, 7.0, 8.0, 9.0]))
b.add_rows(np.zeros(5, dtype=int), x, np.array([3.0, 4.0, 2.0, 3.0, 3.0]), -np.inf, 7.0)
for _ in range(2):
    print("objective", solve(b.build(), lp_first=False, verbose=sys.argv[1] == "verbose").objective, flush=True)
"""


def _solve_in_a_new_process(mode: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", KNAPSACK, mode], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_solver_prints_nothing_unless_asked():
    """Two MIP solves print only what the caller prints: no banner (HiGHS's first instance in a
    process writes it before any option can stop it), no log."""
    quiet = _solve_in_a_new_process("quiet")
    assert quiet.stdout == "objective -23.0\nobjective -23.0\n" and quiet.stderr == ""
    verbose = _solve_in_a_new_process("verbose")
    assert verbose.stdout.startswith("Running HiGHS ")  # verbose: the banner, then the solver's log
    assert re.search(r"^Solving MIP model with:", verbose.stdout, re.M), verbose.stdout
    assert verbose.stdout.count("objective -23.0\n") == 2


def test_a_long_mip_logs_its_incumbent_bound_gap_and_seconds(monkeypatch, caplog):
    """Every ``PROGRESS_S`` seconds of the search a line at INFO on the logger given; none at all when
    that logger does not show INFO."""
    import solvers.highs_backend

    monkeypatch.setattr(solvers.highs_backend, "PROGRESS_S", 0.2)
    log = logging.getLogger("autoplan.test_progress")
    caplog.set_level(logging.WARNING, logger=log.name)
    solve(multi_knapsack(300, 15)[0], lp_first=False, time_limit=0.5, log=log)
    assert not caplog.records
    caplog.set_level(logging.INFO, logger=log.name)
    result = solve(multi_knapsack(300, 15)[0], lp_first=False, time_limit=2.0, log=log)
    lines = [r.getMessage() for r in caplog.records if r.name == log.name]
    pattern = r"MIP mkp: incumbent (-?[\d.e+]+|none yet), bound -?[\d.e+]+, gap ([\d.]+%|unknown), (\d+\.\d) s elapsed"
    found = [re.fullmatch(pattern, line) for line in lines]
    # HiGHS calls back at its own pace (seconds apart in some phases on a busy machine), so the
    # count of lines depends on the machine; their spacing and content do not
    assert len(found) >= 2 and all(found), lines
    assert found[-1].group(1) != "none yet" and found[-1].group(2).endswith("%")
    assert float(found[-1].group(1)) >= result.objective  # the incumbent only improves
    seconds = [float(m.group(3)) for m in found]
    assert all(b - a >= 0.2 - 0.05 for a, b in zip(seconds, seconds[1:])), seconds
