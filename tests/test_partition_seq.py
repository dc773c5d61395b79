"""Seq-pipe partitioners: the optimal contiguous split (DP) and the uniform / parameter baselines."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import re

import pytest
import torch

from ftcompile.cluster import PRESETS
from ftcompile.hardware import load_hardware
from ftcompile.ir import Edge, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta
from ftcompile.partition.base import Infeasible, run_strategy
from ftcompile.partition.seq import _balanced_cuts, layer_keys, op_sequence, partition_params, partition_seq, partition_uniform
from ftcompile.plan import Plan, Problem, Stage, check_plan, evaluate, stage_graph
from ftcompile.profile import NodeCost, ParamCost, Profile, analytic_profile
from ftcompile.trace import trace


# --------------------------------------------------------------------------- graphs

def _hf_tiny(name: str):
    """A tiny HF model and its inputs, built directly (used when the model zoo is not importable)."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "t5-tiny":
        cfg = tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=1000, use_cache=False,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        cfg._attn_implementation = "eager"
        model = tf.T5ForConditionalGeneration(cfg)
        kw = dict(input_ids=torch.randint(2, 1000, (2, 32)), attention_mask=torch.ones(2, 32, dtype=torch.long),
                  labels=torch.randint(2, 1000, (2, 8)), use_cache=False)
    else:
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=64, use_cache=False)
        cfg._attn_implementation = "eager"
        model = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 1000, (2, 32))
        kw = dict(input_ids=ids, labels=ids, use_cache=False)
    return model, (), kw


_PROBLEMS: dict = {}


def tiny_problem(name: str, gpus: int, **cluster) -> Problem:
    """A traced, analytically profiled tiny model on ``gpus`` GPUs of the paper's cluster (cached)."""
    if name not in _PROBLEMS:
        try:
            from ftcompile.models import ModelOptions, build_model
            built = build_model(name, ModelOptions())
            model, args, kwargs = built.model, built.args, built.kwargs
        except Exception:      # the zoo is not importable: same-shaped models straight from HF
            model, args, kwargs = _hf_tiny(name)
        g = trace(model, args, kwargs, source={"model": name})
        _PROBLEMS[name] = (g, analytic_profile(g, load_hardware("rtx2080ti"), optimizer="adam"))
    g, prof = _PROBLEMS[name]
    return Problem(g, prof, PRESETS["paper-8x2080ti"].with_overrides(gpus=gpus, **cluster))


def synthetic_problem(n: int = 10, gpus: int = 3, *, seed: int = 0, value_bytes: int = 4_000_000,
                      gpu_memory: int = 10**12, schedule: str = "async", bandwidth: float = 12e9,
                      layer_size: int = 2, fanout: bool = False) -> Problem:
    """A hand-built chain of ``n`` op nodes with skip values, random costs and a loss at the end.

    Node ``i`` sends ``h{i}`` to node ``i + 1`` and, every third node, ``s{i}`` to
    node ``i + 3``; each value has one reader, so a Seq-pipe sends each value
    exactly once; with ``fanout`` node 1's output is also read by every node
    from 3 on (a value with many readers, like an attention mask). Nodes come in layers of ``layer_size`` (``layers.K`` scopes),
    each layer reading one parameter; two nodes share ``shared.weight`` (tied).
    """
    rng = random.Random(seed)
    f32 = lambda k: ValueMeta(TensorMeta((k // 4,), "float32"))   # noqa: E731
    nodes = [Node(0, "x", "input", outputs={"x": f32(value_bytes)})]
    edges = [Edge(0, 1, "x", f32(value_bytes))]
    params = {"shared.weight": ParamInfo("shared.weight", "parameter", TensorMeta((250_000,), "float32"))}
    pcost = {"shared.weight": ParamCost(1_000_000, 1_000_000, 2_000_000)}
    costs = {}
    for i in range(1, n + 1):
        layer = (i - 1) // layer_size
        pname = f"layers.{layer}.weight"
        if pname not in params:
            nb = rng.choice([1, 2, 4]) * 1_000_000
            params[pname] = ParamInfo(pname, "parameter", TensorMeta((nb // 4,), "float32"))
            pcost[pname] = ParamCost(nb, nb, 2 * nb)
        reads = [pname] + (["shared.weight"] if i in (1, n) else [])
        outs = {f"h{i}": f32(rng.choice([1, 2, 3]) * value_bytes)} if i < n else \
            {f"h{i}": ValueMeta(TensorMeta((), "float32"))}
        if i % 3 == 0 and i + 3 <= n:
            outs[f"s{i}"] = f32(value_bytes)
            edges.append(Edge(i, i + 3, f"s{i}", outs[f"s{i}"]))
        if i < n:
            edges.append(Edge(i, i + 1, f"h{i}", outs[f"h{i}"]))
        if fanout and i == 1:
            edges.extend(Edge(1, j, "h1", outs["h1"]) for j in range(3, n + 1))
        nodes.append(Node(i, f"op{i}", "op", scope=f"layers.{layer}", scope_class="Block",
                          scopes=[["", "Model"], [f"layers.{layer}", "Block"]], params=reads, outputs=outs,
                          is_loss=(i == n)))
        fwd = rng.uniform(1.0, 10.0)
        costs[i] = NodeCost(forward_ms=fwd, backward_ms=2 * fwd, recompute_ms=fwd,
                            activation_bytes=rng.choice([1, 2, 5]) * 1_000_000)
    nodes.append(Node(n + 1, "out", "output"))
    edges.append(Edge(n, n + 1, f"h{n}", nodes[n].outputs[f"h{n}"]))
    g = OpGraph(nodes=nodes, edges=edges, params=params, loss=f"h{n}")
    prof = Profile(graph_hash=g.content_hash(), method="analytic", hardware={"name": "synthetic"}, dtype="float32",
                   batch_size=1, optimizer="adam", nodes=costs, params=pcost)
    cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=gpus, gpu_memory=gpu_memory, bandwidth=bandwidth)
    return Problem(g, prof, cluster, schedule=schedule)


def brute_force_seq(problem: Problem) -> float:
    """The best evaluate() objective over every contiguous split onto distinct GPUs (inf if none fits)."""
    ids = [n.id for n in problem.graph.op_nodes()]
    best = float("inf")
    for S in range(1, min(problem.num_gpus, len(ids)) + 1):
        for cuts in itertools.combinations(range(1, len(ids)), S - 1):
            bounds = [0, *cuts, len(ids)]
            plan = Plan("bf", problem.num_gpus, [Stage(k, k, ids[bounds[k]:bounds[k + 1]]) for k in range(S)])
            cost = evaluate(problem, plan)
            if cost.feasible:
                best = min(best, cost.objective_ms)
    return best


# --------------------------------------------------------------------------- checks

def assert_valid_seq_plan(problem: Problem, plan: Plan, contiguous: bool | None = None) -> None:
    """Every op node once, acyclic stage graph, memory within limits, one stage per GPU; stages
    contiguous in the graph's order (the baselines) or convex (``seq``: every edge goes forward)."""
    check_plan(problem.graph, plan)
    op_ids = [n.id for n in problem.graph.op_nodes()]
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(op_ids)
    assert nx.is_directed_acyclic_graph(stage_graph(problem.graph, plan))
    cost = evaluate(problem, plan)
    assert cost.feasible, cost.reason
    assert all(g.memory_bytes <= problem.cluster.gpu_memory for g in cost.gpus)
    pos = {n: i for i, n in enumerate(op_ids)}
    if contiguous is None:
        contiguous = plan.strategy != "seq"
    if contiguous:
        for s in plan.stages:
            p = sorted(pos[n] for n in s.nodes)
            assert p == list(range(p[0], p[-1] + 1)), f"stage {s.id} is not contiguous"
    else:
        where = {n: s.id for s in plan.stages for n in s.nodes}
        for e in problem.graph.edges:
            if e.src in where and e.dst in where:
                assert where[e.src] <= where[e.dst], f"edge {e.src}->{e.dst} goes backwards: not convex"
    gpus = [s.gpu for s in plan.stages]
    assert len(set(gpus)) == len(gpus), "a Seq-pipe has one stage per GPU"


def assert_best_objective(problem: Problem, plan: Plan, best: float) -> None:
    """``seq`` found the best objective (``best``, from brute force) and returns that plan; the
    fastest of its best candidates in simulation, where it is another plan, is noted beside it
    (``simulated_alternative``, compile's row seq-sim): no simulated candidate that fits is faster."""
    assert plan.info["best_objective_ms"] == pytest.approx(best, rel=1e-9)
    assert evaluate(problem, plan).objective_ms == pytest.approx(best, rel=1e-9)
    alt = plan.info.get("simulated_alternative")
    cands = (alt or plan.info)["simulated_candidates"]
    assert any(c["objective_ms"] == pytest.approx(best, rel=1e-6) for c in cands)
    fastest = alt["simulated_period_ms"] if alt else plan.info["simulated_period_ms"]
    assert fastest == pytest.approx(min(c["simulated_period_ms"] for c in cands if c["simulated_memory_fits"]),
                                    rel=1e-6)


STRATEGIES = {"seq": partition_seq, "uniform": partition_uniform, "params": partition_params}


@pytest.mark.parametrize("model", ["t5-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("gpus", [2, 4])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_tiny_models_give_valid_contiguous_plans(model, gpus, strategy):
    problem = tiny_problem(model, gpus)
    # (3 s: seq's searches cannot finish on T5's upsets and would spend the default 20 s)
    plan = run_strategy(strategy, problem, **({"time_limit": 3} if strategy == "seq" else {}))
    assert_valid_seq_plan(problem, plan)
    assert plan.strategy == strategy
    assert plan.info["objective_ms"] == pytest.approx(evaluate(problem, plan).objective_ms)


@pytest.mark.parametrize("model", ["t5-tiny", "gpt2-tiny"])
def test_seq_beats_the_baselines(model):
    problem = tiny_problem(model, 4)
    best = evaluate(problem, partition_seq(problem, time_limit=3)).objective_ms
    for fn in (partition_uniform, partition_params):
        assert best <= evaluate(problem, fn(problem)).objective_ms + 1e-9


def test_uniform_uses_equal_layers():
    problem = tiny_problem("t5-tiny", 4)
    keys = layer_keys(problem.graph)
    layers = list(dict.fromkeys(k for k in keys if k is not None))
    assert len(layers) == 4                      # 2 encoder + 2 decoder T5Blocks
    plan = partition_uniform(problem)
    assert plan.info["layers_per_stage"] == [1, 1, 1, 1]
    ids = [n.id for n in problem.graph.op_nodes()]
    for s, layer in zip(plan.stages, layers):    # each stage begins with its layer's first node...
        first = min(ids.index(n) for n in s.nodes)
        assert first == 0 or keys[first] == layer
    # ...and holds no node of another layer
    for s in plan.stages:
        assert len({keys[ids.index(n)] for n in s.nodes} - {None}) == 1


def test_params_balances_parameter_bytes():
    problem = tiny_problem("gpt2-tiny", 2)
    plan = partition_params(problem)
    per = plan.info["param_bytes_per_stage"]
    assert len(per) == 2 and sum(per) == sum(problem.profile.params[p].bytes for p in
                                            {p for n in problem.graph.op_nodes() for p in n.params})

@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_balanced_cuts_minimise_the_heaviest_part(seed, parts):
    rng = random.Random(seed)
    w = [rng.choice([0, 0, 1, 5, 8, 13]) for _ in range(9)]
    starts = _balanced_cuts(w, parts)
    assert starts[0] == 0 and len(starts) == parts and starts == sorted(set(starts))
    heaviest = lambda st: max(sum(w[a:b]) for a, b in zip(st, st[1:] + [len(w)]))   # noqa: E731
    best = min(heaviest([0, *c]) for c in itertools.combinations(range(1, len(w)), parts - 1))
    assert heaviest(starts) == best


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gpus", [2, 3, 4])
def test_seq_equals_brute_force(seed, gpus):
    problem = synthetic_problem(10, gpus, seed=seed)
    plan = partition_seq(problem)
    assert_valid_seq_plan(problem, plan)
    assert_best_objective(problem, plan, brute_force_seq(problem))


@pytest.mark.parametrize("seed", [0, 3])
def test_seq_equals_brute_force_when_communication_dominates(seed):
    # 0.5 GB/s: sending a 12 MB activation takes 24 ms, longer than most nodes compute
    problem = synthetic_problem(9, 3, seed=seed, value_bytes=4_000_000, bandwidth=0.5e9)
    plan = partition_seq(problem)
    cost = evaluate(problem, plan)
    assert any(s.comm_fwd_ms > 0 for s in cost.stages) or len(plan.stages) == 1
    assert_best_objective(problem, plan, brute_force_seq(problem))


@pytest.mark.parametrize("seed", range(6))
def test_seq_handles_values_read_by_many_stages(seed):
    # A value read by every later stage is sent once per GPU: the DP brackets that with its two
    # send models and keeps the better plan, which on these graphs is the optimum.
    problem = synthetic_problem(9, 3, seed=seed, bandwidth=0.3e9, fanout=True)
    plan = partition_seq(problem)
    assert_valid_seq_plan(problem, plan)
    assert plan.info["send_model"] in ("once", "fanout")
    assert_best_objective(problem, plan, brute_force_seq(problem))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "pipedream", "2bw"])
def test_seq_equals_brute_force_under_memory_pressure(schedule):
    # Enough memory for a few nodes per GPU only: the split is memory-bound.
    loose = synthetic_problem(10, 4, seed=5, schedule=schedule)
    need = max(g.memory_bytes for g in evaluate(loose, partition_seq(loose)).gpus)
    problem = synthetic_problem(10, 4, seed=5, schedule=schedule, gpu_memory=int(need * 1.1))
    bf = brute_force_seq(problem)
    plan = partition_seq(problem)
    assert_valid_seq_plan(problem, plan)
    assert_best_objective(problem, plan, bf)


def test_seq_dp_objective_matches_evaluate_on_single_reader_values():
    problem = synthetic_problem(12, 4, seed=7)
    plan = partition_seq(problem)
    assert plan.info["dp_objective_ms"] == pytest.approx(evaluate(problem, plan).objective_ms, rel=1e-9)


def test_seq_respects_a_fixed_stage_count():
    problem = synthetic_problem(10, 4, seed=1)
    for S in (1, 2, 3):
        plan = partition_seq(problem, stages=S)
        assert len(plan.stages) == S
        assert_valid_seq_plan(problem, plan)


def test_op_sequence_counts_values_between_op_nodes_only():
    problem = synthetic_problem(6, 2)
    seq = op_sequence(problem)
    assert seq.n == 6 and seq.loss_pos == 5
    assert all(p < c for p, cs, _b, _f in seq.values for c in cs)
    assert seq.input_bytes[0] == 4_000_000 and seq.input_bytes[1:].sum() == 0


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_too_little_memory_is_infeasible(strategy):
    problem = tiny_problem("gpt2-tiny", 2, gpu_memory="1MB")
    with pytest.raises(Infeasible) as err:
        STRATEGIES[strategy](problem)
    assert re.search(r"\d (?:[kMGT]?B)\b", err.value.reason) and ("fit" in err.value.reason or "need" in err.value.reason)
