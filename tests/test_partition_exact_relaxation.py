"""exact's MIP is a relaxation of evaluate(), checked on random plans.

The MIP restates evaluate's rules (compute, communication, weights and activations held) as
linear rows; they must stay at or below evaluate's figures for *every* plan, or the bound
exact reports ("no plan is faster than this") and its "no plan fits" proofs are wrong. A
change to evaluate's memory or time rule that the MIP does not follow shows up here.

For each random plan the memory per GPU is set to exactly what evaluate says the plan needs,
so the plan fits with nothing to spare; the MIP with its assignment fixed to the plan's
(:func:`relaxed_objective`) must then accept it, at a value no higher than the plan's objective.
The plans come from a random linear extension of the DAG cut into runs placed on random GPUs
and then merged at random where the stage graph stays acyclic: non-convex stages, several
stages per GPU, stages holding far-apart nodes. They share no code with the partitioners.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
import sys

import networkx as nx
import pytest

from ftcompile.partition.base import MemoryModel
from ftcompile.partition.exact import coarsen, relaxed_objective
from ftcompile.partition.seq import op_sequence
from ftcompile.plan import Plan, Stage, evaluate, stage_graph

sys.path.insert(0, os.path.dirname(__file__))
from dags import branchy_problem, convex_splits, with_memory  # noqa: E402

pytest.importorskip("highspy")


def _linear_extension(problem, units: list[list[int]], rng: random.Random) -> list[int]:
    """A random topological order of ``units`` (groups of op nodes, e.g. exact's blocks)."""
    unit_of = {n: u for u, m in enumerate(units) for n in m}
    g = nx.DiGraph()
    g.add_nodes_from(range(len(units)))
    for e in problem.graph.edges:
        a, b = unit_of.get(e.src), unit_of.get(e.dst)
        if a is not None and b is not None and a != b:
            g.add_edge(a, b)
    indeg = dict(g.in_degree())
    ready = [u for u, d in indeg.items() if d == 0]
    order = []
    while ready:
        u = ready.pop(rng.randrange(len(ready)))
        order.append(u)
        for w in g.successors(u):
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    return order


def random_plan(problem, units: list[list[int]], rng: random.Random) -> Plan:
    order = _linear_extension(problem, units, rng)
    P = problem.num_gpus
    stages: list[list[int]] = []
    gpus: list[int] = []
    cut = rng.choice([min(1.0, 2 / len(order)), 0.1, 0.4])     # a few long stages to many short ones
    for u in order:
        if not stages or rng.random() < cut:
            stages.append([])
            gpus.append(rng.randrange(P))
        stages[-1].extend(units[u])
    plan = Plan("random", P, [Stage(i, g, sorted(ns)) for i, (g, ns) in enumerate(zip(gpus, stages))])
    # merge a few stages sharing a GPU where the stage graph stays acyclic
    for _ in range(3):
        pairs = [(a, b) for a in plan.stages for b in plan.stages if a.id < b.id and a.gpu == b.gpu]
        if not pairs:
            break
        a, b = rng.choice(pairs)
        trial = Plan("random", P, [Stage(s.id, s.gpu, sorted(s.nodes + b.nodes) if s is a else s.nodes)
                                   for s in plan.stages if s is not b])
        if nx.is_directed_acyclic_graph(stage_graph(problem.graph, trial)):
            plan = trial
    return Plan("random", P, [Stage(i, s.gpu, s.nodes) for i, s in enumerate(plan.stages)])


def _check(problem, plan, *, space: str = "mixed", max_nodes: int = 1000) -> None:
    cost = evaluate(problem, plan)
    assert cost.objective_ms > 0
    exact_fit = with_memory(problem, cost.max_memory_bytes)
    assert evaluate(exact_fit, plan).feasible            # the plan fits with nothing to spare
    value = relaxed_objective(exact_fit, plan, space=space, max_nodes=max_nodes)
    assert value is not None, (f"the MIP's memory rows rule out a plan that fits "
                               f"({[(s.gpu, s.nodes) for s in plan.stages]})")
    assert value <= cost.objective_ms * (1 + 1e-6) + 1e-9, (value, cost.objective_ms)


CASES = [
    # (schedule, recompute, graph options)
    ("async", None, {}),
    ("1f1b", None, {"bandwidth": 2e10}),
    ("gpipe", None, {"side": True}),
    ("pipedream", None, {"bandwidth": 2e10, "side": True}),
    ("2bw", None, {"tied": True, "micro_batches": 16}),
    ("2gw", None, {"micro_batches": 16}),
    ("1f1b", True, {"bandwidth": 2e10}),
    ("gpipe", True, {"side": True}),
    ("async", None, {"tied": True, "bandwidth": 2e10}),
]


@pytest.mark.parametrize("schedule, recompute, options", CASES)
def test_mixed_space_rows_hold_for_random_plans(schedule, recompute, options):
    rng = random.Random(hash((schedule, recompute, tuple(sorted(options)))) % 2**32)
    for seed in range(2):
        problem = branchy_problem(seed, gpus=3, schedule=schedule, **options)
        if recompute is not None:
            problem = replace(problem, recompute=recompute)
        units = [[n.id] for n in problem.graph.op_nodes()]
        for _ in range(25):
            _check(problem, random_plan(problem, units, rng))


@pytest.mark.parametrize("schedule, recompute", [("1f1b", None), ("gpipe", True), ("async", None)])
def test_coarsened_mixed_rows_hold_for_random_plans_of_whole_blocks(schedule, recompute):
    rng = random.Random(7)
    problem = branchy_problem(3, gpus=3, schedule=schedule, side=True, bandwidth=2e10)
    if recompute is not None:
        problem = replace(problem, recompute=recompute)
    seq = op_sequence(problem)
    max_nodes = seq.n // 3
    blocks = coarsen(seq, max_nodes, problem.recomputes(False), MemoryModel.of(problem))
    assert blocks.n < seq.n
    for _ in range(25):
        _check(problem, random_plan(problem, blocks.members, rng), max_nodes=max_nodes)


@pytest.mark.parametrize("schedule, recompute", [("1f1b", None), ("gpipe", None), ("pipedream", None),
                                                 ("1f1b", True), ("async", None)])
def test_seq_space_rows_hold_for_convex_splits(schedule, recompute):
    rng = random.Random(11)
    problem = branchy_problem(1, blocks=1, gpus=3, schedule=schedule, bandwidth=2e10)
    if recompute is not None:
        problem = replace(problem, recompute=recompute)
    splits = list(convex_splits(problem))
    for stages in rng.sample(splits, min(40, len(splits))):
        # stage k on GPU k, in the split's order, then the GPUs shuffled (interchangeable)
        perm = rng.sample(range(problem.num_gpus), problem.num_gpus)
        plan = Plan("convex", problem.num_gpus, [Stage(k, perm[k], s) for k, s in enumerate(stages)])
        _check(problem, plan, space="seq")


def test_a_plan_over_the_limit_is_ruled_out_by_its_weights():
    """The check can fail: with less memory than the plan's weights, gradients and optimizer
    state on its fullest GPU, the MIP rules the plan out."""
    problem = branchy_problem(0, gpus=3, schedule="1f1b")
    plan = random_plan(problem, [[n.id] for n in problem.graph.op_nodes()], random.Random(0))
    cost = evaluate(problem, plan)
    static = max(s.param_bytes + s.grad_bytes for s in cost.stages)
    assert relaxed_objective(with_memory(problem, static // 2), plan) is None


def test_a_plan_splitting_a_block_is_refused():
    problem = branchy_problem(0, gpus=2, schedule="1f1b")
    ops = [n.id for n in problem.graph.op_nodes()]
    plan = Plan("x", 2, [Stage(0, 0, ops[:1]), Stage(1, 1, ops[1:])])
    with pytest.raises(ValueError, match="not on one GPU"):
        relaxed_objective(problem, plan, max_nodes=2)


def _traced(model: str, schedule: str, recompute):
    from test_partition_all import problem as zoo_problem

    return replace(zoo_problem(model, 3, schedule=schedule), recompute=recompute)


@pytest.mark.parametrize("model", ["gpt2-tiny", "t5-tiny"])
@pytest.mark.parametrize("schedule, recompute", [("1f1b", None), ("gpipe", True), ("pipedream", None)])
def test_rows_hold_for_random_plans_of_traced_models(model, schedule, recompute):
    """Real HF graphs (hundreds of op nodes, tied embeddings, masks, views of no compute),
    node by node and coarsened into a quarter as many blocks."""
    problem = _traced(model, schedule, recompute)
    rng = random.Random(5)
    units = [[n.id] for n in problem.graph.op_nodes()]
    for _ in range(12):
        _check(problem, random_plan(problem, units, rng))
    seq = op_sequence(problem)
    max_nodes = seq.n // 4
    blocks = coarsen(seq, max_nodes, problem.recomputes(False), MemoryModel.of(problem))
    for _ in range(12):
        _check(problem, random_plan(problem, blocks.members, rng), max_nodes=max_nodes)


# --------------------------------------------------------------------------- cases a review found

def test_a_sink_stage_without_the_loss_skips_recomputation_too():
    """A stage at depth 0 that does not hold the loss (a side output nobody reads downstream)
    skips recomputation in evaluate; the MIP once let only the loss's GPU skip it, 0.01 ms over."""
    opts = dict(blocks=3, heads=True, mask=True, gpus=3, tied=True, side=True, bandwidth=2e10, micro_batches=16)
    problem = replace(branchy_problem(3808, schedule="async", **opts), recompute=True)
    plan = random_plan(problem, [[n.id] for n in problem.graph.op_nodes()], random.Random(3808))
    assert sum(1 for s in evaluate(problem, plan).stages if s.depth == 0) > 1
    _check(problem, plan)


def test_2gw_last_stage_does_not_recompute_in_the_mip_either():
    """A depth-0 stage is in 2gw's second group, which does not recompute there."""
    problem = replace(branchy_problem(4791, blocks=2, heads=True, mask=False, gpus=2, micro_batches=8,
                                      schedule="2gw"), recompute=True)
    assert not problem.recomputes(True)
    plan = random_plan(problem, [[n.id] for n in problem.graph.op_nodes()], random.Random(4791))
    _check(problem, plan)


def test_frozen_tensors_have_no_extra_weight_versions_in_seq_space():
    """pipedream keeps extra versions of trainable weights only; a large frozen embedding must
    not be counted again at each version."""
    from ftcompile.profile import ParamCost

    problem = branchy_problem(0, blocks=1, gpus=3, schedule="pipedream", bandwidth=2e10)
    problem.graph.params["embed.weight"].requires_grad = False
    c = problem.profile.params["embed.weight"]
    problem.profile.params["embed.weight"] = ParamCost(20 * c.bytes, 0, 0)
    problem.__dict__.pop("grad_values", None)              # recomputed for the frozen tensor
    plan = Plan("c", 3, [Stage(0, 0, [1]), Stage(1, 1, [4]), Stage(2, 2, [2, 3] + list(range(5, 13)))])
    _check(problem, plan, space="seq")
