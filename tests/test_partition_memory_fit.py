"""Tight memory (issue 12, items 3 and 5): the floor that proves no plan fits, single-node
relief of over-full GPUs, and METIS's memory-balanced retry.

References are independent of the code under test: every plan is priced by evaluate(), the
neighbourhood of a relieved plan is enumerated and priced by the test itself, and part
balance is summed from the profile's own node costs.
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter

import networkx as nx
import pytest

from ftcompile.compile import compile_plan
from ftcompile.partition.base import memory_floor
from ftcompile.partition.metis import _metis_parts, partition_metis
from ftcompile.partition.refine import Refiner
from ftcompile.plan import Plan, PlanError, Stage, check_plan, evaluate, stage_graph

sys.path.insert(0, os.path.dirname(__file__))
from dags import branchy_problem, convex_splits, with_memory  # noqa: E402

SCHEDULES = ["async", "1f1b", "gpipe", "pipedream", "2bw"]


def _random_plan(problem, rng, max_tries=200):
    """A random plan whose stage graph is acyclic: random node -> GPU, then each GPU's nodes
    split into weakly connected stages, kept only when the stage graph has no cycle."""
    ops = [n.id for n in problem.graph.op_nodes()]
    P = problem.num_gpus
    for _ in range(max_tries):
        gpu = {n: rng.randrange(P) for n in ops}
        stages = []
        for g in range(P):
            sub = nx.Graph()
            sub.add_nodes_from(n for n in ops if gpu[n] == g)
            sub.add_edges_from((e.src, e.dst) for e in problem.graph.edges
                               if e.src in sub and e.dst in sub)
            stages += [(g, sorted(c)) for c in nx.connected_components(sub)]
        plan = Plan("random", P, [Stage(i, g, ns) for i, (g, ns) in enumerate(stages)])
        try:
            check_plan(problem.graph, plan)
        except PlanError:
            continue
        return plan
    return None


def _overflow(problem, plan) -> int:
    return sum(max(0, g.memory_bytes - g.memory_limit) for g in evaluate(problem, plan).gpus)


# --------------------------------------------------------------------------- the floor

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("seed", range(3))
def test_no_plan_undercuts_the_memory_floor(schedule, seed):
    """Whatever the plan, the GPU that runs the floor's node holds at least the floor (evaluate)."""
    rng = random.Random(seed)
    problem = branchy_problem(seed, blocks=2, gpus=3, schedule=schedule, tied=seed == 1, side=seed == 2)
    need, nid = memory_floor(problem)
    assert nid is not None and need > problem.memory_reserve
    plans = [p for p in (_random_plan(problem, rng) for _ in range(12)) if p is not None]
    plans += [Plan("convex", 3, [Stage(k, k, s) for k, s in enumerate(split)])
              for split in list(convex_splits(problem))[:: 7]]
    plans.append(Plan("one", 3, [Stage(0, 0, sorted(n.id for n in problem.graph.op_nodes()))]))
    assert len(plans) > 10
    for plan in plans:
        try:
            cost = evaluate(problem, plan)
        except Exception as exc:       # a schedule that cannot run this plan (2bw: too deep)
            assert "stage" in str(exc) or "micro" in str(exc), exc
            continue
        host = next(s.gpu for s in plan.stages if nid in s.nodes)
        assert cost.gpus[host].memory_bytes >= need


@pytest.mark.parametrize("seed, schedule", [(0, "async"), (1, "gpipe"), (2, "1f1b"), (3, "pipedream")])
def test_the_floor_holds_for_every_plan_of_a_small_graph(seed, schedule):
    """Every set partition of the nodes into stages and every GPU assignment (brute force)."""
    import itertools

    from test_partition_exact import synthetic_problem
    from test_partition_memory import _set_partitions

    problem = synthetic_problem(6, 2, seed=seed, fanout=seed % 2 == 1, schedule=schedule)
    need, nid = memory_floor(problem)
    ids = [n.id for n in problem.graph.op_nodes()]
    seen = 0
    for part in _set_partitions(ids):
        for gpus in itertools.product(range(2), repeat=len(part)):
            plan = Plan("all", 2, [Stage(i, g, sorted(ns)) for i, (g, ns) in enumerate(zip(gpus, part))])
            try:
                cost = evaluate(problem, plan)
            except PlanError:          # a cyclic stage graph
                continue
            host = next(s.gpu for s in plan.stages if nid in s.nodes)
            assert cost.gpus[host].memory_bytes >= need
            seen += 1
    assert seen > 100


def test_compile_proves_no_fit_below_the_floor_and_searches_at_it():
    problem = branchy_problem(0, blocks=1, gpus=2)
    need, nid = memory_floor(problem)
    below = compile_plan(with_memory(problem, need - 1), ["seq", "mixed", "metis"], jobs=1, time_limit=2)
    assert below.chosen is None
    assert below.info["proven_no_fit"] and problem.graph.node(nid).name in below.info["proven_no_fit"]
    assert all(not r.feasible and "proven" in r.reason and r.proven_infeasible for r in below.results)
    assert all(row["proven_infeasible"] for row in (r.row() for r in below.results))
    assert below.failure_reasons().count("proven") == 1          # one reason, said once
    # Lifted to the floor the strategies run (whether a plan fits there is theirs to find).
    at = compile_plan(with_memory(problem, need), ["seq"], jobs=1, time_limit=2)
    assert at.info["proven_no_fit"] is None
    assert all("proven" not in (r.reason or "") for r in at.results)


# --------------------------------------------------------------------------- relief by single nodes

def _loss_stage_is_sink(problem, plan) -> bool:
    loss = next(n.id for n in problem.graph.nodes if n.is_loss)
    where = plan.stage_of()
    return not any(True for _ in stage_graph(problem.graph, plan).successors(where[loss]))


def _relieving_move(problem, plan, sink: bool):
    """A single-node move that lowers the total overflow, in the neighbourhood relieve() names:
    a node (not the loss) on an over-full GPU to a stage on another GPU holding one of its
    producers or consumers, emptying no stage, the stage graph acyclic and (when it was) the
    loss stage a sink."""
    over = _overflow(problem, plan)
    cost = evaluate(problem, plan)
    full = {g.gpu for g in cost.gpus if g.memory_bytes > g.memory_limit}
    where = plan.stage_of()
    gpu = {s.id: s.gpu for s in plan.stages}
    size = Counter(where.values())
    loss = next(n.id for n in problem.graph.nodes if n.is_loss)
    for e in problem.graph.edges:
        for n, m in ((e.src, e.dst), (e.dst, e.src)):
            if n not in where or m not in where or n == loss or gpu[where[n]] not in full:
                continue
            s, t = where[n], where[m]
            if gpu[s] == gpu[t] or size[s] == 1:
                continue
            moved = Plan("t", plan.num_gpus, [Stage(x.id, x.gpu, sorted([y for y in x.nodes if y != n]
                                                                         + ([n] if x.id == t else [])))
                                              for x in plan.stages])
            if not nx.is_directed_acyclic_graph(stage_graph(problem.graph, moved)):
                continue
            if sink and not _loss_stage_is_sink(problem, moved):
                continue
            if _overflow(problem, moved) < over:
                return n, t
    return None


@pytest.mark.parametrize("seed", range(6))
def test_relieve_lowers_overflow_to_a_local_optimum(seed):
    rng = random.Random(100 + seed)
    problem = branchy_problem(seed, blocks=2, gpus=rng.choice([2, 3]), schedule=rng.choice(["async", "1f1b"]),
                              tied=seed % 3 == 1)
    tried = 0
    for _ in range(6):
        plan = _random_plan(problem, rng)
        if plan is None:
            continue
        peak = max(g.memory_bytes for g in evaluate(problem, plan).gpus)
        # a limit the start misses by a little: some GPU is over, and moves can help
        tight = with_memory(problem, problem.memory_reserve + int(0.9 * (peak - problem.memory_reserve)))
        before = _overflow(tight, plan)
        assert before > 0
        r = Refiner(tight, {n: s.id for s in plan.stages for n in s.nodes}, {s.id: s.gpu for s in plan.stages})
        moves = r.relieve(max_seconds=60)
        out = Plan("relieved", plan.num_gpus, [Stage(i, g, ns) for i, (g, ns) in enumerate(r.stages())])
        check_plan(tight.graph, out)
        assert len(out.stages) == len(plan.stages)
        after = _overflow(tight, out)
        assert after == r.overflow(tight.cluster.gpu_memory)       # its memory is evaluate's
        assert after <= before and (after < before or moves == 0)
        if after:
            # stopped because no move of its neighbourhood helps, not by accident
            assert _relieving_move(tight, out, _loss_stage_is_sink(tight, plan)) is None
        tried += 1
    assert tried >= 3


# --------------------------------------------------------------------------- METIS

def test_metis_memory_balance_is_one_weight_metis_balances():
    """pymetis hands METIS a single constraint, so the memory-balanced run must give each node one
    weight (its compute share plus its memory share); the parts then balance that sum. Before,
    an interleaved two-weight list made METIS balance a shifted mix of both (nearly all nodes in
    one part on a chain of equal blocks)."""
    problem = branchy_problem(4, blocks=3, gpus=3)
    prof = problem.profile
    ids = [n.id for n in problem.graph.op_nodes()]
    work = {n: prof.nodes[n].forward_ms + prof.nodes[n].backward_ms + prof.nodes[n].recompute_ms for n in ids}
    mem = {n: prof.nodes[n].param_bytes + prof.nodes[n].grad_bytes + prof.nodes[n].optimizer_bytes
           + prof.nodes[n].activation_bytes for n in ids}
    share = {n: work[n] / sum(work.values()) + mem[n] / sum(mem.values()) for n in ids}
    for seed in range(3):
        parts = dict(zip(ids, _metis_parts(problem, ids, 3, seed, True)))
        total = Counter()
        for n, p in parts.items():
            total[p] += share[n]
        # each part within a third of the whole plus the largest node (METIS cannot split nodes)
        assert len(total) == 3
        assert max(total.values()) <= 2 / 3 + max(share.values()) + 1e-9, total


def test_metis_fits_tight_memory_with_repair():
    """At the least memory any convex split needs (and a little above), METIS's plan, repaired by
    whole stages and single nodes, fits on most of these graphs: the memory-balanced runs and
    the node moves make it (compute-balanced runs with whole-stage moves alone fit fewer)."""
    fits = total = 0
    for seed in range(6):
        for gpus in (2, 3):
            problem = branchy_problem(seed, blocks=2, gpus=gpus, tied=seed % 3 == 2)
            need = min(max(g.memory_bytes for g in evaluate(problem, Plan("bf", gpus, [
                Stage(k, k, s) for k, s in enumerate(split)])).gpus)
                for split in convex_splits(problem) if len(split) == gpus)
            for share in (1.0, 1.05):
                tight = with_memory(problem, int(need * share))
                total += 1
                try:
                    plan = partition_metis(tight)
                except Exception as exc:
                    assert "no METIS partition fits" in str(exc) and "closest" in str(exc)
                    continue
                cost = evaluate(tight, plan)
                assert cost.feasible, cost.reason
                fits += 1
    assert fits >= 0.55 * total, (fits, total)


@pytest.mark.parametrize("seed, gpus", [(1, 2), (4, 3)])
def test_mixed_relieves_its_closest_candidates_when_none_fits(seed, gpus, monkeypatch):
    """At the least memory any convex split needs, Mixed-pipe's own candidates (seq's split left
    out) all overflow a little; single-node relief of the closest ones finds a plan that fits,
    which without it Mixed-pipe does not."""
    import ftcompile.partition.mixed as mixed
    from ftcompile.partition.base import Infeasible

    problem = branchy_problem(seed, blocks=2, gpus=gpus, tied=seed % 3 == 2)
    need = min(max(g.memory_bytes for g in evaluate(problem, Plan("bf", gpus, [
        Stage(k, k, s) for k, s in enumerate(split)])).gpus)
        for split in convex_splits(problem) if len(split) == gpus)
    tight = with_memory(problem, need)
    plan = mixed.partition_mixed(tight, time_budget_s=2, with_convex=False, simulate_top=0)
    assert plan.info.get("relieved") and evaluate(tight, plan).feasible
    check_plan(tight.graph, plan)
    monkeypatch.setattr(mixed, "RELIEVE_TOP", 0)
    with pytest.raises(Infeasible):
        mixed.partition_mixed(tight, time_budget_s=2, with_convex=False, simulate_top=0)
