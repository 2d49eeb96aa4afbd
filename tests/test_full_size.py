"""Full-size planning (LLaMA-3 8B on a 16x8 fake mesh): slow, run with ``python -m pytest -m slow``.

Speed is reported by ``python -m autoplan.bench``; this checks what the plan is, not how fast it came.
"""

import argparse

import pytest

from autoplan.bench import run_apply, run_plan

pytestmark = pytest.mark.slow


def args(**kw):
    base = {"model": "llama3-8b", "mesh": "16x8", "batch": None, "seq": None, "dtype": "bfloat16", "json": None}
    return argparse.Namespace(**(base | kw))


def test_llama3_8b_plan_is_small_and_optimal():
    result = run_plan(args())
    assert result["ilp"]["n_vars"] <= 50_000
    assert result["solver"]["status"] == "optimal"
    # the first and last layers are re-solved on their own, each ILP one layer's size
    refinements = result["ilp"]["refinements"]
    assert [r["layers"] for r in refinements] == [["layers.0"], ["layers.31"]]
    assert all(r["n_vars"] <= 50_000 and r["status"] == "optimal" for r in refinements)
    assert result["passes"]["round_trips_removed"] > 0
    assert abs(result["ilp"]["objective"] - result["objective_s"]) <= 1e-6 * result["objective_s"]
    assert result["peak_rss_gib"] <= 2.0


def test_llama3_8b_lowering_matches_the_plan():
    result = run_apply(args())
    planned = result["collectives"]["planned"]
    passes = result["passes"]
    assert passes["gather_chains_fused"] > 0 and passes["recompute_chains_tagged"] > 0
    assert passes["reduce_scatter_after_passes"] == planned["reduce_scatter"]
    assert passes["all_reduce_after_passes"] == planned["all_reduce"]
