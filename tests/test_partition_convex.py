"""Seq-pipe is exact over convex stages of the DAG: checked against every chain of ideals.

The graphs have parallel branches (attention's Q/K/V fan-out and fan-in, a mask read by
every block, a classifier head hanging off the trunk); the reference enumerates every
convex split (every chain of ideals, :func:`dags.convex_splits`) and prices each with
evaluate(), sharing no code with the DP.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from ftcompile.partition.base import Infeasible, run_strategy
from ftcompile.partition.convex import attach_side_nodes, build_units, convex_split, is_convex_split
from ftcompile.partition.seq import op_sequence, order_split, partition_seq
from ftcompile.plan import Plan, Stage, evaluate

sys.path.insert(0, os.path.dirname(__file__))
from dags import best_convex, branchy_problem, downsets, total_over_gpus, with_memory  # noqa: E402


def _seq_objective(problem) -> tuple[float, Plan | None]:
    try:
        plan = partition_seq(problem)
    except Infeasible:
        return float("inf"), None
    # the plan returned is the best objective seq found (its fastest in simulation is only noted
    # beside it, for compile's row seq-sim): what the tests compare is what a user gets
    got = evaluate(problem, plan).objective_ms
    assert got == pytest.approx(plan.info["best_objective_ms"], rel=1e-9)
    return got, plan


CASES = [
    # seed, blocks, gpus, schedule, bandwidth, memory (x total / P), heads, mask
    (0, 2, 3, "async", 1e30, None, True, True),
    (1, 2, 3, "async", 1e30, 1.5, True, True),
    (2, 1, 4, "async", 1e30, None, True, True),
    (3, 2, 3, "1f1b", 1e30, 2.0, True, False),
    (4, 2, 3, "gpipe", 2e9, None, True, True),
    (5, 1, 4, "pipedream", 1e30, 3.0, False, True),
    (6, 2, 3, "async", 0.5e9, None, True, True),
    (7, 3, 2, "2bw", 1e30, 1.2, True, True),
]


@pytest.mark.parametrize("seed", range(3))
def test_seq_with_side_nodes(seed):
    # Side nodes: the DP attaches them (when the lattice is large) and refinement frees them again;
    # here the lattice is small, so the search runs on every node and stays exact.
    problem = branchy_problem(seed, blocks=1, gpus=3, side=True)
    reference, _ = best_convex(problem)
    obj, _plan = _seq_objective(problem)
    assert obj == pytest.approx(reference, rel=1e-9)


@pytest.mark.parametrize("seed, blocks, gpus, schedule, bandwidth, memory, heads, mask", CASES)
def test_seq_equals_the_best_convex_split(seed, blocks, gpus, schedule, bandwidth, memory, heads, mask):
    problem = branchy_problem(seed, blocks=blocks, gpus=gpus, schedule=schedule, bandwidth=bandwidth,
                              heads=heads, mask=mask)
    if memory is not None:
        problem = with_memory(problem, total_over_gpus(problem) * memory)
    reference, _ = best_convex(problem)
    obj, plan = _seq_objective(problem)
    assert obj == pytest.approx(reference, rel=1e-9, abs=1e-12)
    if plan is not None:
        assert is_convex_split(problem, [s.nodes for s in plan.stages])
        info = plan.info
        # What it claims holds: the bound is below every convex split, "optimal" means reached.
        if "bound_ms" in info:
            assert info["bound_ms"] <= reference * (1 + 1e-9)
        if info.get("optimal"):
            assert obj <= info["bound_ms"] * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(0, 60, 20))
def test_seq_equals_the_best_convex_split_on_random_dags(start):
    rng = random.Random(start)
    for _ in range(20):
        blocks, gpus = rng.choice([(1, 4), (2, 3), (1, 3), (3, 2)])
        problem = branchy_problem(rng.randrange(10**6), blocks=blocks, gpus=gpus,
                                  schedule=rng.choice(["async", "async", "1f1b", "gpipe", "pipedream", "2bw"]),
                                  bandwidth=rng.choice([1e30, 1e30, 2e9, 0.5e9]),
                                  heads=rng.random() < 0.8, mask=rng.random() < 0.8, tied=rng.random() < 0.3)
        memory = rng.choice([None, 1.2, 1.5, 2.0, 3.0])
        if memory is not None:
            problem = with_memory(problem, total_over_gpus(problem) * memory)
        reference, _ = best_convex(problem)
        obj, plan = _seq_objective(problem)
        assert obj == pytest.approx(reference, rel=1e-9, abs=1e-12)
        if plan is not None and "bound_ms" in plan.info:
            assert plan.info["bound_ms"] <= reference * (1 + 1e-9)


def test_a_fixed_order_misses_the_convex_optimum_that_seq_finds():
    """Attention's branches interleave in any one order: a contiguous split of the graph's order
    cannot keep a branch whole while cutting the trunk right after it. Find a DAG where that
    costs something, and check that seq closes the gap."""
    found = 0
    for seed in range(40):
        problem = branchy_problem(seed, blocks=2, gpus=3)
        order = min(r[0] for r in order_split(problem, op_sequence(problem)))
        reference, _ = best_convex(problem)
        obj, _plan = _seq_objective(problem)
        assert obj == pytest.approx(reference, rel=1e-9)
        if order > reference * (1 + 1e-6):
            found += 1
            break
    assert found > 0, "no DAG where one topological order loses: the test graphs are too simple"


def test_the_dp_alone_is_exact_and_proves_its_bound():
    # Without the incumbents and refinement around it: the DP over upsets by itself.
    for seed in range(6):
        problem = branchy_problem(seed, blocks=2, gpus=3)
        reference, _ = best_convex(problem)
        r = convex_split(problem)
        plan = Plan("dp", problem.num_gpus, [Stage(k, k, s) for k, s in enumerate(r.stages)])
        assert r.complete and r.attached == 0
        assert evaluate(problem, plan).objective_ms == pytest.approx(reference, rel=1e-9)
        assert r.bound_ms <= reference * (1 + 1e-9)
        assert r.bound_ms == pytest.approx(reference, rel=1e-9)     # free links, loose memory: met


def test_bound_with_attached_side_nodes_holds_for_every_convex_split():
    # Attaching side nodes restricts the plans the DP builds; the bound deletes them instead, so it
    # still holds for every convex split of the whole graph.
    for seed in range(3):
        problem = branchy_problem(seed, blocks=1, gpus=3, side=True)
        groups, side = attach_side_nodes(problem, max_share=0.05)
        names = {problem.graph.node(n).name for n in side}
        assert {"counter", "clamp", "b0/view"} <= names
        r = convex_split(problem, units=build_units(problem, groups, side))
        reference, _ = best_convex(problem)
        assert r.complete and r.bound_ms <= reference * (1 + 1e-9)


def test_attached_groups_keep_values_inside():
    problem = branchy_problem(3, blocks=2, gpus=3, side=True)
    groups, side = attach_side_nodes(problem, max_share=0.05)
    assert sorted(n for g in groups for n in g) == sorted(n.id for n in problem.graph.op_nodes())
    units = build_units(problem, groups, side)
    assert units.attached == len(side)
    assert len(downsets(problem)) > units.n


def test_max_and_fixed_stage_counts():
    problem = branchy_problem(1, blocks=2, gpus=4)
    for cap in (1, 2, 3):
        plan = run_strategy("seq", problem, max_stages=cap)
        assert len(plan.stages) <= cap
        reference, _ = best_convex(problem, max_stages=cap)
        assert evaluate(problem, plan).objective_ms == pytest.approx(reference, rel=1e-9)
    plan = partition_seq(problem, stages=2)
    assert len(plan.stages) == 2


def test_no_convex_split_fits_is_proven_and_said():
    problem = with_memory(branchy_problem(0, blocks=2, gpus=3), 1_000_000)
    assert best_convex(problem)[0] == float("inf")
    with pytest.raises(Infeasible) as err:
        partition_seq(problem)
    assert err.value.reason.startswith("no convex split") and "fits" in err.value.reason
    assert err.value.proven


def test_search_that_runs_out_of_time_says_so():
    problem = branchy_problem(2, blocks=3, gpus=3)
    plan = partition_seq(problem, time_limit=0.0)
    assert plan.info["optimal"] is False
    assert "time limit" in plan.info["search"] and "bound_ms" not in plan.info


@pytest.mark.parametrize("seed,blocks", [(0, 1), (1, 2), (2, 2), (3, 1)])
def test_upsets_are_listed_or_refused_at_the_cap_as_brute_force_counts(seed, blocks):
    """all_upsets lists as many upsets as the DAG has ideals (their complements), counted by
    brute force, and refuses exactly above the cap; the greedy antichain its quick refusal
    rests on is one (no path joins two of its units)."""
    import itertools

    import networkx as nx

    from ftcompile.partition.convex import all_upsets, greedy_antichain

    problem = branchy_problem(seed, blocks=blocks, gpus=3)
    units = build_units(problem)
    count = len(downsets(problem))
    listed = all_upsets(units, 10**9)
    assert listed is not None and len(set(listed[0])) == count
    assert all_upsets(units, count) is not None and all_upsets(units, count - 1) is None
    ops = {n.id for n in problem.graph.op_nodes()}
    dag = nx.DiGraph([(e.src, e.dst) for e in problem.graph.edges if e.src in ops and e.dst in ops])
    dag.add_nodes_from(ops)
    anti = greedy_antichain(units)
    assert len(anti) >= 2
    for a, b in itertools.combinations(anti, 2):
        for x, y in itertools.product(units.members[a], units.members[b]):
            assert not nx.has_path(dag, x, y) and not nx.has_path(dag, y, x)
    assert 2 ** len(anti) <= count
    assert all_upsets(units, 2 ** len(anti) - 1) is None       # refused without listing
