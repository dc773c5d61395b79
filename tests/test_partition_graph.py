"""Tests of the graph partitioners: multilevel acyclic (partition.acyclic) and METIS + repair
(partition.metis)."""

from __future__ import annotations

import networkx as nx
import re

import pytest

from ftcompile.cluster import PRESETS
from ftcompile.ir import Edge, Node, OpGraph, TensorMeta, ValueMeta
from ftcompile.partition import Infeasible, run_strategy
from ftcompile.partition.acyclic import partition_acyclic
from ftcompile.partition.metis import _metis_parts, acyclic_stages, partition_metis
from ftcompile.plan import Plan, Problem, Stage, check_plan, evaluate, stage_graph
from ftcompile.profile import NodeCost, Profile

MODELS = ["gpt2-tiny", "bert-tiny", "t5-tiny"]
STRATEGIES = ["acyclic", "metis"]


@pytest.fixture(scope="module")
def tiny_problem(request):
    """problem(model, gpus, gpu_memory=None): a Problem on paper-8x2080ti resized, traced once per model."""
    from ftcompile.hardware import load_hardware
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.profile import analytic_profile
    from ftcompile.trace import trace

    cache: dict[str, tuple[OpGraph, Profile]] = {}

    def make(model: str, gpus: int, gpu_memory=None) -> Problem:
        if model not in cache:
            if model == "gpt2-tiny":            # shared with the other test modules (conftest)
                graph = request.getfixturevalue("gpt2_tiny_graph")
            else:
                built = build_model(model, ModelOptions())
                graph = trace(built.model, built.args, built.kwargs)
            cache[model] = graph, analytic_profile(graph, load_hardware("rtx2080ti"), optimizer="adam")
        graph, profile = cache[model]
        cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=gpus, gpu_memory=gpu_memory)
        return Problem(graph, profile, cluster, schedule="async", micro_batches=4)

    return make


def _check_valid(problem: Problem, plan: Plan) -> None:
    check_plan(problem.graph, plan)                 # each op node in one stage; acyclic stage graph
    placed = [n for s in plan.stages for n in s.nodes]
    assert sorted(placed) == sorted(n.id for n in problem.graph.op_nodes())
    assert plan.num_gpus == problem.num_gpus
    assert all(0 <= s.gpu < problem.num_gpus for s in plan.stages)
    cost = evaluate(problem, plan)
    assert cost.feasible, cost.reason
    assert all(g.memory_bytes <= g.memory_limit for g in cost.gpus)
    assert cost.objective_ms >= cost.lower_bound_ms * (1 - 1e-9)


# --------------------------------------------------------------------------- tiny models

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", [2, 3, 4])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plans_are_valid(tiny_problem, model, gpus, strategy):
    problem = tiny_problem(model, gpus)
    plan = run_strategy(strategy, problem)
    _check_valid(problem, plan)
    assert plan.strategy == strategy
    assert plan.info["objective_ms"] == pytest.approx(evaluate(problem, plan).objective_ms)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_acyclic_one_stage_per_gpu_in_topological_order(tiny_problem, model, gpus):
    problem = tiny_problem(model, gpus)
    plan = partition_acyclic(problem)
    assert len({s.gpu for s in plan.stages}) == len(plan.stages) <= gpus
    # every edge between op nodes goes from a block to the same or a later block
    block = {n: s.gpu for s in plan.stages for n in s.nodes}
    for e in problem.graph.edges:
        if e.src in block and e.dst in block:
            assert block[e.src] <= block[e.dst]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_acyclic_refinement_never_worse_than_initial(tiny_problem, model, gpus):
    problem = tiny_problem(model, gpus)
    plan = partition_acyclic(problem)
    assert plan.info["initial_feasible"]
    assert plan.info["objective_ms"] <= plan.info["initial_objective_ms"] * (1 + 1e-12)
    assert evaluate(problem, plan).objective_ms == pytest.approx(plan.info["objective_ms"])


def test_acyclic_is_deterministic(tiny_problem):
    problem = tiny_problem("gpt2-tiny", 3)
    a, b = partition_acyclic(problem, seeds=2), partition_acyclic(problem, seeds=2)
    assert [s.nodes for s in a.stages] == [s.nodes for s in b.stages]


def test_acyclic_balances_better_than_one_gpu(tiny_problem):
    one = evaluate(tiny_problem("gpt2-tiny", 1), partition_acyclic(tiny_problem("gpt2-tiny", 1)))
    four = evaluate(tiny_problem("gpt2-tiny", 4), partition_acyclic(tiny_problem("gpt2-tiny", 4)))
    assert four.objective_ms < one.objective_ms
    assert four.speedup > 2.0


@pytest.mark.parametrize("strategy", [partition_acyclic, partition_metis])
def test_tight_memory_is_infeasible_with_a_reason(tiny_problem, strategy):
    problem = tiny_problem("bert-tiny", 2, gpu_memory="1MB")
    with pytest.raises(Infeasible) as info:
        strategy(problem)
    assert re.search(r"\d (?:[kMGT]?B)\b", info.value.reason) and "need" in info.value.reason


@pytest.mark.parametrize("strategy", [partition_acyclic, partition_metis])
def test_memory_that_fits_only_when_split(tiny_problem, strategy):
    """A limit below the single-GPU need but above half of it: plans must spread the weights."""
    base = tiny_problem("bert-tiny", 1)
    need = evaluate(base, Plan("one", 1, [Stage(0, 0, [n.id for n in base.graph.op_nodes()])]))
    limit = int(need.max_memory_bytes * 0.8)
    problem = tiny_problem("bert-tiny", 4, gpu_memory=limit)
    try:
        plan = strategy(problem)
    except Infeasible as exc:      # allowed, but then it must say why
        assert exc.reason
        return
    _check_valid(problem, plan)
    assert evaluate(problem, plan).max_memory_bytes <= limit


def test_metis_missing_is_infeasible(tiny_problem, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pymetis(name, *args, **kwargs):
        if name == "pymetis":
            raise ImportError("No module named 'pymetis'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pymetis)
    with pytest.raises(Infeasible, match="pymetis is not installed: pip install pymetis"):
        partition_metis(tiny_problem("gpt2-tiny", 2))


# --------------------------------------------------------------------------- hand-made graphs

def _chain_with_skips(n: int, light: int = 4, heavy: int = 4096) -> Problem:
    """x0 -> x1 -> ... with light chain edges and heavy skip edges x_i -> x_{i+2}.

    Cutting the heavy skips is expensive, so METIS splits even from odd nodes,
    and those two parts feed each other both ways: a cyclic quotient.
    """
    def meta(numel: int) -> ValueMeta:
        return ValueMeta(tensor=TensorMeta((numel,), "float32"))

    nodes = [Node(i, f"x{i}", "op", outputs={f"a{i}": meta(light // 4), f"s{i}": meta(heavy // 4)})
             for i in range(n)]
    edges = [Edge(i, i + 1, f"a{i}", meta(light // 4)) for i in range(n - 1)]
    edges += [Edge(i, i + 2, f"s{i}", meta(heavy // 4)) for i in range(n - 2)]
    graph = OpGraph(nodes, edges, params={})
    costs = {i: NodeCost(forward_ms=1.0, backward_ms=2.0, recompute_ms=1.0, activation_bytes=64,
                         output_bytes={}) for i in range(n)}
    profile = Profile("test", "analytic", {"name": "test"}, "float32", 1, "sgd", costs, {})
    cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=2)
    return Problem(graph, profile, cluster)


def test_metis_raw_parts_cyclic_then_repaired():
    problem = _chain_with_skips(12)
    ids = [n.id for n in problem.graph.op_nodes()]
    raw = dict(zip(ids, _metis_parts(problem, ids, 2, 0, False)))
    assert len(set(raw.values())) == 2
    raw_plan = Plan("raw", 2, [Stage(p, p, [n for n in ids if raw[n] == p]) for p in (0, 1)])
    assert not nx.is_directed_acyclic_graph(stage_graph(problem.graph, raw_plan))   # METIS alone: cyclic

    plan = partition_metis(problem)
    _check_valid(problem, plan)
    assert len(plan.stages) > 2                      # the repair had to split the parts
    assert {s.gpu for s in plan.stages} <= {0, 1}
    # each stage stays inside one METIS part (the seed that won)
    won = dict(zip(ids, _metis_parts(problem, ids, 2, plan.info["seed"], plan.info["memory_constraint"])))
    assert all(len({won[n] for n in s.nodes}) == 1 for s in plan.stages)


def test_acyclic_stages_on_alternating_parts():
    """Parts that alternate along a chain need one stage per run of the chain."""
    problem = _chain_with_skips(6)
    stages = acyclic_stages(problem, {i: i % 2 for i in range(6)})
    plan = Plan("t", 2, stages)
    check_plan(problem.graph, plan)
    assert all(len({n % 2 for n in s.nodes}) == 1 for s in stages)


def test_acyclic_stages_keep_parts_whole_when_possible():
    problem = _chain_with_skips(6)
    stages = acyclic_stages(problem, {i: int(i >= 3) for i in range(6)})
    assert sorted(sorted(s.nodes) for s in stages) == [[0, 1, 2], [3, 4, 5]]


def test_acyclic_partitioner_on_skip_graph():
    problem = _chain_with_skips(12)
    plan = partition_acyclic(problem)
    _check_valid(problem, plan)
    assert len(plan.stages) == 2


# --------------------------------------------------------------------------- internals

def test_coarse_levels_are_dags_that_partition_the_nodes(tiny_problem):
    from ftcompile.partition.acyclic import _build_data, _hierarchy, _topo_index

    problem = tiny_problem("t5-tiny", 4)
    data = _build_data(problem)
    levels = _hierarchy(data, problem, 4, None)
    assert len(levels) > 1 and len(levels[-1].members) < len(data.ids)
    for level in levels:
        assert sorted(i for ms in level.members for i in ms) == list(range(len(data.ids)))
        pos = _topo_index(level)                      # raises on a cycle
        assert all(pos[a] < pos[b] for a, b in level.ebytes)


def test_incremental_costs_match_a_fresh_count(tiny_problem):
    """Random legal moves leave the incremental block costs equal to costs counted from scratch."""
    import random

    from ftcompile.partition.acyclic import _build_data, _State

    problem = tiny_problem("gpt2-tiny", 3)
    data = _build_data(problem)
    n, P = len(data.ids), 3
    state = _State(problem, data, [min(P - 1, 3 * i // n) for i in range(n)], P)
    rng = random.Random(0)
    for _ in range(300):
        i = rng.randrange(n)
        b = state.block[i]
        t = b + rng.choice((-1, 1))
        if not 0 <= t < P or state.count[b] == 1:
            continue
        if any(state.block[j] > t for j in data.pred[i]) or any(state.block[j] < t for j in data.succ[i]):
            continue
        state.move([i], t)
    fresh = _State(problem, data, state.block, P)
    for b in range(P):
        assert state.period(b) == pytest.approx(fresh.period(b))
        assert state.memory(b) == pytest.approx(fresh.memory(b))
    # With every block feeding the next, the period is evaluate's; memory is an estimate that
    # counts every term evaluate does except the working sets, send buffers, data and gradients
    # waiting (acyclic checks its plans with evaluate), each at least as evaluate counts it.
    plan = Plan("t", P, [Stage(b, b, [data.ids[i] for i in range(n) if state.block[i] == b]) for b in range(P)])
    cost = evaluate(problem, plan)
    assert [s.depth for s in cost.stages] == [P - 1 - b for b in range(P)]
    for b in range(P):
        g, sc = cost.gpus[b], cost.stages[b]
        assert sc.period_ms == pytest.approx(fresh.period(b))
        est = fresh.memory(b) + problem.memory_reserve       # (the estimate keeps the reserve off the limit)
        left_out = g.transient_bytes + g.send_bytes + g.data_bytes + sc.in_flight * sc.grads_back_bytes
        assert g.memory_bytes - left_out <= est
        assert est <= g.memory_bytes + (fresh.chain.window[b] - 1) * sc.recv_bytes
