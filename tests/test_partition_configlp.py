"""partition/configlp.py: the configuration LP's bound, against brute force and a formula."""

from __future__ import annotations

import random

import pytest

from ftcompile.cluster import PRESETS
from ftcompile.ir import Edge, Node, OpGraph, TensorMeta, ValueMeta
from ftcompile.partition.configlp import ConfigurationLP, configuration_bound
from ftcompile.partition.exact import partition_exact
from ftcompile.plan import Plan, Problem, Stage, evaluate
from ftcompile.profile import NodeCost, Profile

from test_partition_exact import brute_force, synthetic_problem


@pytest.mark.parametrize("seed", [101, 103, 108, 112, 116, 129])
def test_the_bound_never_exceeds_the_best_plan_brute_force_finds(seed):
    # every assignment of 5 to 7 nodes to 2 or 3 GPUs, priced by evaluate(), free links; memory
    # at 80 to 100 % of the peak of exact's unconstrained plan, so that it binds in most cases
    rng = random.Random(seed)
    n, gpus = rng.choice([5, 6, 7]), rng.choice([2, 3])
    fan = rng.random() < 0.3
    free = synthetic_problem(n, gpus, seed=seed, bandwidth=1e30, fanout=fan)
    peak = evaluate(free, partition_exact(free, time_limit=5, simulate_top=0)).max_memory_bytes
    problem = synthetic_problem(n, gpus, seed=seed, bandwidth=1e30, fanout=fan,
                                gpu_memory=int(rng.choice([0.8, 0.9, 1.0]) * peak))
    best = brute_force(problem, "mixed")
    assert best < float("inf")
    bound = configuration_bound(problem, 0.0, best * 1.5)
    assert 0.0 < bound <= best * (1 + 1e-9)


def _three_equal_nodes():
    # three nodes of equal time on two GPUs, nothing to skip (the last node is the loss, of no
    # cost): one GPU holds two of them, so the best plan is 2/3 of the total, not 1/2
    problem = synthetic_problem(4, 2, seed=0, bandwidth=1e30)
    costs = problem.profile.nodes
    for i in (1, 2, 3):
        costs[i].forward_ms, costs[i].backward_ms, costs[i].recompute_ms = 10.0, 20.0, 0.0
    costs[4].forward_ms = costs[4].backward_ms = costs[4].recompute_ms = 0.0
    for p in problem.profile.params.values():          # no optimizer step to share out
        p.grad_bytes = 0
    return problem


def test_whole_nodes_raise_the_bound_above_total_over_gpus():
    problem = _three_equal_nodes()
    total = 3 * 30.0
    bound = configuration_bound(problem, 0.0, total)
    assert bound == pytest.approx(60.0, abs=2e-3) and bound > total / 2


def _dead_branch(with_loss: bool):
    # x -> op1 -> op2 -> op3 (the loss), and op1 -> op4, a side output nobody reads: op4 has no
    # path to the loss, so a sink stage of its own skips its recomputation on any GPU
    def v():
        return ValueMeta(TensorMeta((1000,), "float32"))
    scalar = ValueMeta(TensorMeta((), "float32"))
    nodes = [Node(0, "x", "input", outputs={"x": v()}), Node(1, "op1", "op", outputs={"h1": v()}),
             Node(2, "op2", "op", outputs={"h2": v()}), Node(3, "op3", "op", outputs={"h3": scalar}, is_loss=with_loss),
             Node(4, "op4", "op", outputs={"h4": v()}), Node(5, "out", "output")]
    edges = [Edge(0, 1, "x", v()), Edge(1, 2, "h1", v()), Edge(2, 3, "h2", v()), Edge(1, 4, "h1", v()),
             Edge(3, 5, "h3", scalar), Edge(4, 5, "h4", v())]
    g = OpGraph(nodes=nodes, edges=edges, params={}, loss="h3" if with_loss else None)
    costs = {i: NodeCost(forward_ms=10.0, backward_ms=20.0, recompute_ms=10.0, activation_bytes=1000) for i in (1, 2, 3, 4)}
    prof = Profile(graph_hash=g.content_hash(), method="analytic", hardware={"name": "synthetic"}, dtype="float32",
                   batch_size=1, optimizer="adam", nodes=costs, params={})
    cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=2, gpu_memory=10**12, bandwidth=1e30)
    return Problem(g, prof, cluster, schedule="async")


@pytest.mark.parametrize("with_loss", [True, False])
def test_a_side_output_skips_recomputation_on_its_own_gpu_and_the_bound_allows_it(with_loss):
    # GPU 0: op1 (40 ms: interior, recomputes) then op4 in a sink stage of its own (30: skips);
    # GPU 1: op2 and op3, the last stage (60; without a loss node, a sink stage: 60 too).
    # Two GPUs skip recomputation, so the bound must not allow only one: 70 ms is a plan.
    problem = _dead_branch(with_loss)
    # the nodes that must be in the last stage to skip there: op4 is not one of them
    assert problem.feeds_loss == ({1, 2, 3} if with_loss else set())
    assert problem.recomputes(False) and not problem.recomputes(True)
    plan = Plan("by-hand", 2, [Stage(0, 0, [1]), Stage(1, 0, [4]), Stage(2, 1, [2, 3])])
    cost = evaluate(problem, plan)
    assert cost.feasible and cost.objective_ms == pytest.approx(70.0)
    bound = configuration_bound(problem, 0.0, 200.0)
    assert bound <= 70.0 + 1e-9
    if with_loss:       # whole nodes: no plan balances 130 ms of work on two GPUs at 65
        assert bound == pytest.approx(70.0, abs=2e-3)


def test_a_time_limit_returns_the_bound_proven_so_far():
    problem = synthetic_problem(7, 3, seed=101, bandwidth=1e30)
    full = configuration_bound(problem, 0.0, 500.0)
    assert configuration_bound(problem, 0.0, 500.0, time_limit=0.0) == 0.0
    lp = ConfigurationLP(problem)
    again = configuration_bound(problem, 0.0, 500.0, lp=lp)
    assert again == pytest.approx(full, abs=2e-3) and lp.stats["probes"] > 0
    # the columns found are kept: a second bisection on the same LP starts from them
    kept = len(lp.columns)
    assert kept > 2 * len(lp.items)
    assert configuration_bound(problem, 0.0, 500.0, lp=lp) == pytest.approx(full, abs=2e-3)


def test_compile_rows_carry_the_configuration_bound_where_it_is_higher(monkeypatch):
    # the three equal nodes on two GPUs, planned without exact: the searches' bound over every
    # plan is total/P (45 ms); the configuration LP raises it to the best plan's 60 ms, and every row says so
    from ftcompile.compile import compile_plan, every_plan_bound, tighten_bounds

    problem = _three_equal_nodes()
    result = compile_plan(problem, ["seq", "mixed"], jobs=1, time_limit=2, simulate_plans=False)
    # (seq's row has its own bound over convex splits, 60 ms: its search is exhaustive here)
    rows = [r for r in result.results if r.feasible and r.name.startswith("mixed")]
    assert rows and all(r.bound["ms"] == pytest.approx(45.0) for r in rows)
    done = tighten_bounds(result, 10.0)
    assert done["raised"] and done["from_ms"] == pytest.approx(45.0) and done["plan_ms"] == pytest.approx(60.0)
    assert done["ms"] == pytest.approx(60.0, abs=2e-3) and result.info["configuration_bound"] is done
    for r in rows:
        row = r.row()
        assert row["bound_covers"] == "every plan (configuration LP)"
        assert row["bound_ms"] == pytest.approx(done["ms"]) and row["bound_ms"] <= row["objective_ms"]
        assert row["gap"] == pytest.approx(0.0, abs=1e-4)
    # out of time at once: nothing raised, and the rows keep the searches' bound, not a rounded copy of it
    other = compile_plan(problem, ["mixed"], jobs=1, time_limit=2, simulate_plans=False)
    late = tighten_bounds(other, 1e-9)
    assert not late["raised"] and late["ms"] == late["from_ms"] == other.results[0].bound["ms"]
    assert every_plan_bound(other.results, other.lower_bound_ms, late["ms"])["covers"] != "every plan (configuration LP)"
    # nothing left to close, no time, too many nodes, or no plan: not run
    fresh = compile_plan(problem, ["mixed"], jobs=1, time_limit=2, simulate_plans=False)
    monkeypatch.setattr("ftcompile.compile.CONFIGURATION_MAX_NODES", 3)     # (the problem has 4 op nodes)
    assert tighten_bounds(fresh, 10.0) is None and "configuration_bound" not in fresh.info
    assert tighten_bounds(result, 10.0) is None
    assert tighten_bounds(compile_plan(problem, ["seq"], jobs=1, time_limit=2, simulate_plans=False), 0.0) is None


def test_which_stages_recompute_is_read_over_every_2gw_group():
    # 2gw with --recompute: at depth 0 a stage of the first group would recompute and one of the
    # second (where the last stage is) does not; the bounds may charge only what every group runs
    import dataclasses

    problem = dataclasses.replace(_dead_branch(True), schedule="2gw", recompute=True)
    assert problem.program(0, 0).recompute and not problem.program(0, 1).recompute
    assert problem.recomputes(False) and not problem.recomputes(True)
    assert not dataclasses.replace(problem, recompute=False).recomputes(False)
