"""Mixed-pipe against the best plan of all, found by brute force on small branchy DAGs.

Issue 12 asks that Mixed-pipe be within 2 % of the optimum over every plan wherever that
optimum is known, and never infeasible where some plan fits. The reference
(:func:`dags.mixed_plans`) enumerates every set partition of the op nodes into stages whose
stage graph is acyclic and every placement of those stages on the GPUs, and prices each with
evaluate(); it shares no code with the partitioners. The graphs are attention blocks (the
hidden state fans out to Q, K and V, which meet again in the scores and the mix, then a
residual add) with an LM head, and with a mask read by the scores (one more branch).

Memory per GPU: the least any plan needs (then only one or a few plans fit), the limits
under which 5 % and 20 % of the distinct memory figures fall, and unlimited.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache

import pytest

from ftcompile.partition.exact import partition_exact
from ftcompile.partition.mixed import partition_mixed
from ftcompile.plan import evaluate
from ftcompile.simulate import simulate

sys.path.insert(0, os.path.dirname(__file__))
from dags import branchy_problem, mixed_plans, with_memory  # noqa: E402

pytest.importorskip("highspy")

TIGHTNESS = ["least", "5%", "20%", "unlimited"]


@lru_cache(maxsize=None)
def _priced(seed: int, schedule: str, mask: bool):
    """The problem on 2 GPUs and (objective, memory) of every plan of it."""
    problem = branchy_problem(seed, blocks=1, heads=False, mask=mask, gpus=2, schedule=schedule)
    priced = []
    for plan in mixed_plans(problem):
        cost = evaluate(problem, plan)
        priced.append((cost.objective_ms, cost.max_memory_bytes))
    return problem, priced


def _check(seed: int, schedule: str, mask: bool, tightness: str) -> None:
    problem, priced = _priced(seed, schedule, mask)
    mems = sorted({m for _o, m in priced})
    limit = {"least": mems[0], "5%": mems[len(mems) // 20], "20%": mems[len(mems) // 5],
             "unlimited": mems[-1]}[tightness]
    optimum = min(o for o, m in priced if m <= limit)
    tight = with_memory(problem, limit)
    plan = partition_mixed(tight, time_budget_s=3)       # raises Infeasible if it finds no plan
    cost = evaluate(tight, plan)
    assert cost.feasible, cost.reason
    best = plan.info["best_objective_ms"]
    assert best >= optimum * (1 - 1e-9)                  # nothing beats the best plan of all
    assert best <= optimum * 1.02, (best, optimum)
    # The plan returned is the lowest objective found (exact ties by simulation).
    assert cost.objective_ms == pytest.approx(best, rel=1e-9)
    # Its alternative (compile's row mixed-sim), when there is one, may trade objective for a
    # shorter simulated period, never the reverse: no candidate Mixed-pipe simulated that fits
    # is faster.
    alt = plan.info.get("simulated_alternative")
    period = alt["simulated_period_ms"] if alt else simulate(tight, plan).period_ms
    cands = (alt or plan.info).get("simulated_candidates", [])
    fitting = [c["simulated_period_ms"] for c in cands if c["simulated_memory_fits"]]
    assert period <= min(fitting, default=period) * (1 + 1e-6)
    # exact's bound over every plan (its first solve, before any cut) holds, and "optimal" is true
    info = partition_exact(tight, space="mixed", time_limit=10, simulate_top=0).info
    assert info["mip_bound_ms"] <= optimum * (1 + 1e-6)
    if info["optimal"]:
        assert info["objective_ms"] == pytest.approx(optimum, rel=1e-6)


@pytest.mark.parametrize("tightness", TIGHTNESS)
@pytest.mark.parametrize("seed, schedule", [(0, "gpipe"), (1, "async"), (2, "pipedream")])
def test_mixed_is_within_2_percent_of_the_best_plan_of_all(seed, schedule, tightness):
    _check(seed, schedule, False, tightness)


@pytest.mark.slow
@pytest.mark.parametrize("tightness", TIGHTNESS)
@pytest.mark.parametrize("seed, schedule, mask", [(0, "1f1b", True), (3, "1f1b", True), (1, "gpipe", False),
                                                  (3, "pipedream", False), (2, "async", False)])
def test_mixed_is_within_2_percent_of_the_best_plan_of_all_more_cases(seed, schedule, mask, tightness):
    _check(seed, schedule, mask, tightness)
