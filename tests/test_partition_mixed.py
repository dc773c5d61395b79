"""Mixed-pipe partitioning (FTPipe §4.1) and the coarsening it is built on."""

from __future__ import annotations

import os

import networkx as nx
import re

import pytest
import torch

from ftcompile.cluster import PRESETS
from ftcompile.hardware import load_hardware
from ftcompile.partition.base import Infeasible
from ftcompile.partition.coarsen import Quotient, coarsen, coarsen_blocks, grow_around_centers, is_acyclic_partition
from ftcompile.partition.mixed import partition_mixed
from ftcompile.partition.refine import Refiner
from ftcompile.plan import Plan, Problem, Stage, check_plan, evaluate, stage_graph
from ftcompile.profile import analytic_profile
from ftcompile.trace import trace

TINY = ("t5-tiny", "gpt2-tiny", "bert-tiny")


def _hf_tiny(name: str):
    """A tiny HF model and its inputs, built directly (used when the model zoo is not there)."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "t5-tiny":
        cfg = tf.T5Config(d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, vocab_size=1000, use_cache=False,
                          decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        cfg._attn_implementation = "eager"
        model = tf.T5ForConditionalGeneration(cfg)
        kw = dict(input_ids=torch.randint(2, 1000, (2, 32)), attention_mask=torch.ones(2, 32, dtype=torch.long),
                  labels=torch.randint(2, 1000, (2, 8)), use_cache=False)
    elif name == "gpt2-tiny":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=64, use_cache=False)
        cfg._attn_implementation = "eager"
        model = tf.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 1000, (2, 32))
        kw = dict(input_ids=ids, labels=ids, use_cache=False)
    else:
        cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=1000, max_position_embeddings=64)
        cfg._attn_implementation = "eager"
        model = tf.BertForSequenceClassification(cfg)
        kw = dict(input_ids=torch.randint(0, 1000, (2, 32)), attention_mask=torch.ones(2, 32, dtype=torch.long),
                  labels=torch.zeros(2, dtype=torch.long))
    return model, (), kw


def _graph(name: str):
    try:
        from ftcompile.models import ModelOptions, build_model
        built = build_model(name, ModelOptions())
        model, args, kwargs = built.model, built.args, built.kwargs
    except Exception:       # the zoo is not importable (yet): same-shaped models straight from HF
        model, args, kwargs = _hf_tiny(name)
    return trace(model, args, kwargs, source={"model": name})


_CACHE: dict = {}


def _problem(name: str, gpus: int, memory=None) -> Problem:
    if name not in _CACHE:
        g = _graph(name)
        _CACHE[name] = (g, analytic_profile(g, load_hardware("rtx2080ti"), optimizer="adam"))
    g, prof = _CACHE[name]
    cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=gpus, gpu_memory=memory)
    return Problem(g, prof, cluster, schedule="async", micro_batches=4)


# --------------------------------------------------------------------------- coarsening

@pytest.mark.parametrize("name", TINY)
def test_coarsening_keeps_quotient_acyclic_and_partitions_op_nodes(name):
    pr = _problem(name, 2)
    ops = {n.id for n in pr.graph.op_nodes()}
    q = coarsen(pr.graph, pr.profile)
    for qq in [q] + [grow_around_centers(q, L, seed=s) for L in (2, 4, 7) for s in (0, 1)]:
        groups = qq.groups()
        flat = [n for grp in groups for n in grp]
        assert sorted(flat) == sorted(ops)                      # every op node in exactly one block
        assert is_acyclic_partition(pr.graph, groups)
        assert nx.is_directed_acyclic_graph(qq.to_networkx())
        # The maintained positions are a topological order of the quotient.
        for a, succ in qq.succ.items():
            for b in succ:
                assert qq.pos[a] < qq.pos[b]
    grown = grow_around_centers(q, 4)
    assert len(grown.members) < len(q.members)
    assert len(q.members) < len(ops)                            # coarsening did contract something


def test_quotient_refuses_a_contraction_that_makes_a_cycle():
    pr = _problem("gpt2-tiny", 2)
    q = Quotient(pr.graph, pr.profile)
    # Merging the two ends of a path a -> m -> c while leaving m out would make a cycle.
    for a in q.blocks():
        for m in q.succ[a]:
            for c in q.succ[m]:
                before = {b: list(v) for b, v in q.members.items()}
                assert not q.can_merge((a, c))
                assert q.merge((a, c)) is None
                assert {b: list(v) for b, v in q.members.items()} == before
                assert q.merge((a, m)) is not None or q.can_merge((a, m)) is False
                return
    pytest.fail("no path of length 2 found")


def test_coarsen_blocks_for_other_partitioners():
    pr = _problem("bert-tiny", 2)
    res = coarsen_blocks(pr.graph, pr.profile, 6, seed=1)
    assert nx.is_directed_acyclic_graph(res.quotient)
    assert sorted(n for g in res.groups for n in g) == sorted(n.id for n in pr.graph.op_nodes())
    assert res.quotient.number_of_nodes() == len(res.groups)


def test_scope_merging_groups_module_instances():
    pr = _problem("t5-tiny", 2)
    q = coarsen(pr.graph, pr.profile, cap_ms=float("inf"))
    # With no cap, each repeated module instance ends up inside one block.
    block_of = {n: b for b, ms in q.members.items() for n in ms}
    for inst in ("encoder.block.0.layer.1", "decoder.block.1.layer.0"):
        blocks = {block_of[n.id] for n in pr.graph.op_nodes() if any(p == inst for p, _ in n.scopes)}
        assert len(blocks) == 1, inst


# --------------------------------------------------------------------------- plans

@pytest.mark.parametrize("gpus", (2, 3, 4))
@pytest.mark.parametrize("name", TINY)
def test_mixed_plans_are_valid_and_feasible(name, gpus):
    pr = _problem(name, gpus)
    plan = partition_mixed(pr, seeds=(0, 1))
    check_plan(pr.graph, plan)       # every op node in exactly one stage, acyclic stage graph
    assert plan.num_gpus == gpus
    assert all(0 <= s.gpu < gpus for s in plan.stages)
    seen = [n for s in plan.stages for n in s.nodes]
    assert len(seen) == len(set(seen)) == sum(1 for _ in pr.graph.op_nodes())
    assert nx.is_directed_acyclic_graph(stage_graph(pr.graph, plan))
    cost = evaluate(pr, plan)
    assert cost.feasible, cost.reason
    assert all(g.memory_bytes <= pr.cluster.gpu_memory for g in cost.gpus)
    assert cost.objective_ms >= cost.lower_bound_ms * (1 - 1e-9)


def test_refinement_never_loses_to_the_unrefined_plans():
    # Mixed-pipe's own candidates, refined or not. The convex split it also considers is left out
    # on both sides: seq's search gets the time refinement leaves, so with refinement it has less
    # time than without, which is not what this compares.
    pr = _problem("t5-tiny", 3)
    raw = evaluate(pr, partition_mixed(pr, refine=False, with_convex=False)).objective_ms
    ref = evaluate(pr, partition_mixed(pr, refine=True, with_convex=False)).objective_ms
    assert ref <= raw + 1e-9


def test_tight_memory_is_infeasible_with_a_reason():
    pr = _problem("t5-tiny", 2, memory=10_000)
    with pytest.raises(Infeasible) as info:
        partition_mixed(pr)
    assert re.search(r"\d (?:[kMGT]?B)\b", info.value.reason) and "mixed" in info.value.reason


def test_refiner_memory_matches_evaluate():
    pr = _problem("t5-tiny", 3)
    plan = partition_mixed(pr, refine=False)
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    r = Refiner(pr, stage_of, {s.id: s.gpu for s in plan.stages})
    cost = evaluate(pr, plan)
    for g in cost.gpus:
        assert r.gpu_memory(g.gpu) == g.memory_bytes
    loads = r.gpu_loads()
    for g in cost.gpus:      # compute only: periods equal compute when communication hides
        assert loads[g.gpu] == pytest.approx(g.compute_ms)


def test_non_adjacent_stages_may_share_a_gpu_for_t5():
    pr = _problem("t5-tiny", 2)
    # Hand-made Mixed-pipe plan: GPU 0 runs the encoder's first half and the decoder's first half.
    ops = [n for n in pr.graph.op_nodes()]
    enc = [n.id for n in ops if n.scopes and any(p.startswith("encoder") for p, _ in n.scopes)]
    rest = [n.id for n in ops if n.id not in set(enc)]
    e1, e2 = enc[:len(enc) // 2], enc[len(enc) // 2:]
    d1, d2 = rest[:len(rest) // 2], rest[len(rest) // 2:]
    plan = Plan("hand", 2, [Stage(0, 0, e1), Stage(1, 1, e2), Stage(2, 0, d1), Stage(3, 1, d2)])
    check_plan(pr.graph, plan)
    assert nx.is_directed_acyclic_graph(stage_graph(pr.graph, plan))
    # And the partitioner produces such plans when asked for more blocks than GPUs (on 4 GPUs
    # T5-tiny's best Mixed-pipe plan folds blocks of the decoder onto encoder GPUs).
    pr = _problem("t5-tiny", 4)
    # (the best by objective: simulation may then prefer a plan without folding)
    plan = partition_mixed(pr, l_factors=(2, 3), seeds=(0, 1), simulate_top=0)
    check_plan(pr.graph, plan)
    ev = evaluate(pr, plan)
    assert ev.feasible
    # (Under the memory model of issue 11, with the optimizer step in every stage's period, T5-tiny's
    # best plan by objective on 4 GPUs no longer folds; what folding needs is that the stage graph
    # stays acyclic when stages share a GPU, checked on the hand-made plan above.)
    assert nx.is_directed_acyclic_graph(stage_graph(pr.graph, plan))


# --------------------------------------------------------------------------- full size (meta)

@pytest.mark.slow
def test_t5_3b_mixed_fits_and_is_no_worse_than_seq(tmp_path):
    import transformers as tf

    from ftcompile.ir import OpGraph
    from ftcompile.profile import Profile

    cache = os.environ.get("FTC_TEST_CACHE")
    gpath = os.path.join(cache, "t5-3b.graph.json") if cache else None
    if gpath and os.path.exists(gpath):
        g, prof = OpGraph.load(gpath), Profile.load(os.path.join(cache, "t5-3b.profile.json"))
    else:
        with torch.device("meta"):
            cfg = tf.T5Config(d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128, vocab_size=32128,
                              use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
            cfg._attn_implementation = "eager"
            model = tf.T5ForConditionalGeneration(cfg)
            kw = dict(input_ids=torch.zeros(4, 512, dtype=torch.long),
                      attention_mask=torch.ones(4, 512, dtype=torch.long),
                      labels=torch.zeros(4, 4, dtype=torch.long), use_cache=False)
        g = trace(model, (), kw, source={"model": "t5-3b"})
        prof = analytic_profile(g, load_hardware("rtx2080ti"), optimizer="adam")
    pr = Problem(g, prof, PRESETS["paper-8x2080ti"], schedule="async", micro_batches=4)
    plan = partition_mixed(pr)
    cost = evaluate(pr, plan)
    assert cost.feasible and all(g.memory_bytes <= g.memory_limit for g in cost.gpus)
    # Mixed-pipe's candidates include Seq-pipes: never worse than the best contiguous split. (It
    # was 0.94 of the bound when the tied embedding's gradient copies, 131 MB each, went uncounted:
    # every GPU holding one of its three readers receives the other two before its update. Counted,
    # on 8 x 11 GB the best plans found are Seq-pipes at about 0.53 of the bound.)
    # Mixed-pipe keeps its plan by *simulated* period (choice among candidates, then refinement by
    # simulation, which may trade a little objective for a shorter period: here 649.98 -> 650.86
    # ms of objective for 1179.78 -> 1179.50 ms simulated), so that is what it must not lose.
    from ftcompile.partition.seq import partition_seq
    from ftcompile.simulate import simulate

    seq_plan = partition_seq(pr)
    assert simulate(pr, plan).period_ms <= simulate(pr, seq_plan).period_ms * (1 + 1e-9)
    assert cost.objective_ms <= evaluate(pr, seq_plan).objective_ms * 1.01
