"""Elastic freeze training (PipeTransformer): Eq. 1, frozen regions and their prices, phases.

The equivalence tests run ``ftcompile run --freeze`` with a manual schedule on 4 real ranks over
gloo (a 4-GPU pipeline, then 2 replicas of a 2-GPU one as layers freeze) and compare the final
checkpoint with plain single-process PyTorch: the original model, whose embeddings and first
layers the test freezes by hand (``requires_grad_(False)``, ``eval()``) at the same steps, trained
with gradient accumulation on the same samples and dropout masks.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

from ftcompile.cluster import load_cluster
from ftcompile.compile import compile_plan, plan_document
from ftcompile.freeze import FreezeError, find_layers, freeze_graph, frozen_region, plan_phase
from ftcompile.freeze_run import parse_freeze
from ftcompile.hardware import load_hardware
from ftcompile.plan import Problem
from ftcompile.profile import analytic_profile
from ftcompile.runtime import load_package
from ftcompile.runtime.freeze import frozen_layers

from test_codegen import traced
from test_runtime import _write, call_of, final_weights, run_cli


# --------------------------------------------------------------------------- Eq. 1

def _eq1_brute(frozen: int, norms: list[float], alpha: float) -> int:
    """Eq. 1 written out from the paper, for comparison: min(bound, argmin layer + 1)."""
    L = frozen + len(norms)
    bound = int(frozen + alpha * (L - frozen) + 1e-9)
    argmin = frozen + norms.index(min(norms))
    return max(frozen, min(bound, argmin + 1))


def test_eq1_bounds_by_alpha_and_stops_at_the_smallest_norm():
    # 12 layers, alpha 1/3: at most 4 freeze; the smallest norm is at layer 1 -> 2 freeze
    assert frozen_layers(0, [5, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 1 / 3) == 2
    # smallest norm deep in the model: the alpha bound wins (4 of 12)
    assert frozen_layers(0, [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4], 1 / 3) == 4
    # 4 frozen, 8 active: bound 4 + 8/3 -> 6
    assert frozen_layers(4, [8, 7, 6, 5, 4, 3, 2, 1], 1 / 3) == 6
    # 3 active, alpha 1/3: exactly one more (not 0.999... floored to 0)
    assert frozen_layers(9, [3, 2, 1], 1 / 3) == 10
    # the first active layer has the smallest norm: it freezes alone
    assert frozen_layers(2, [0.1, 5, 5, 5, 5, 5], 1 / 2) == 3
    # too few active layers for the bound to move: nothing freezes
    assert frozen_layers(10, [1.0, 2.0], 1 / 3) == 10
    # ties: the first layer of the smallest norm
    assert frozen_layers(0, [2, 1, 1, 1, 1, 1], 0.9) == 2
    assert frozen_layers(3, [], 1 / 3) == 3


def test_eq1_matches_the_papers_formula_on_random_norms():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        L = int(torch.randint(1, 30, (1,), generator=g))
        frozen = int(torch.randint(0, L, (1,), generator=g))
        alpha = float(torch.rand(1, generator=g) * 0.98 + 0.01)
        norms = torch.rand(L - frozen, generator=g).tolist()
        assert frozen_layers(frozen, norms, alpha) == _eq1_brute(frozen, norms, alpha), (frozen, norms, alpha)


def test_eq1_geometric_schedule_with_equal_norms_deepest_smallest():
    # norms growing smaller towards the output: the bound alone drives it, L_T = L_{T-1} + floor(a (L - L_{T-1}))
    L, got, f = 24, [], 0
    for _ in range(8):
        f = frozen_layers(f, [float(L - i) for i in range(f, L)], 1 / 3)
        got.append(f)
    assert got == [8, 13, 16, 18, 20, 21, 22, 22]


def test_eq1_refuses_bad_input():
    with pytest.raises(FreezeError, match="between 0 and 1"):
        frozen_layers(0, [1.0], 1.0)
    with pytest.raises(FreezeError, match="finite"):
        frozen_layers(0, [math.nan], 0.3)


# --------------------------------------------------------------------------- options

def test_freeze_option_parses_both_forms_and_refuses_nonsense():
    s = parse_freeze("alpha=1/3,every=50")
    assert abs(s.alpha - 1 / 3) < 1e-12 and s.every == 50 and not s.manual
    s = parse_freeze("at=20:1@2x2+40:2,strategy=seq,layers=BertLayer")
    assert s.at == [(20, 1, 2, 2, None), (40, 2, None, None, None)] and s.strategy == "seq" and s.layers == ["BertLayer"]
    assert parse_freeze("at=20:1@2x2/8").at[0].micro_batches == 8 and parse_freeze("at=5:1/3").at == [(5, 1, None, None, 3)]
    assert parse_freeze("at=5:1,micro_batches=fixed").micro_batches == "fixed"
    s = parse_freeze("alpha=1/3,every=5,cache=on,cache_mb=0.5,spill_mb=0")
    assert (s.cache, s.cache_mb, s.spill_mb) == ("on", 0.5, 0.0)
    assert parse_freeze("alpha=1/3,every=5").cache == "auto"
    for bad, msg in [("alpha=2,every=3", "between 0 and 1"), ("alpha=1/3", "needs both"),
                     ("alpha=1/3,every=2,cache=maybe", "cache=maybe"), ("alpha=1/3,every=2,cache_mb=-1", "megabytes"),
                     ("at=4:2+2:3", "must not decrease|distinct"), ("at=3:2+5:1", "must not decrease"),
                     ("at=2-1", "STEP:LAYERS"), ("speed=fast", "unknown key"),
                     ("at=2:1,alpha=1/3,every=2", "either"), ("at=2:1/0", "positive number of micro-batches"),
                     ("at=2:1@0x4", "not PxR"), ("at=2:1,micro_batches=many", "micro_batches=many")]:
        with pytest.raises(FreezeError, match=msg):
            parse_freeze(bad)


# --------------------------------------------------------------------------- layers and regions

def test_layers_are_the_repeated_blocks_in_call_order():
    _, g, _ = traced("bert-tiny")
    assert find_layers(g) == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert find_layers(g, ["BertLayer"]) == find_layers(g, ["bert.encoder.layer"])
    _, g, _ = traced("vit-tiny")
    assert find_layers(g) == ["vit.layers.0", "vit.layers.1"] or len(find_layers(g)) == 2
    with pytest.raises(FreezeError, match="no module"):
        find_layers(g, ["NoSuchBlock"])


def test_frozen_region_takes_embeddings_and_leading_layers_but_keeps_tied_weights():
    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    r = frozen_region(g, layers, 1)
    assert "bert.embeddings.word_embeddings.weight" in r.params
    assert any(p.startswith("bert.encoder.layer.0.") for p in r.params)
    assert not any(p.startswith("bert.encoder.layer.1.") or p.startswith("qa_outputs") for p in r.params)
    # GPT-2 ties its token embedding to the LM head, read after the region: it keeps training
    _, g2, _ = traced("gpt2-tiny")
    r2 = frozen_region(g2, find_layers(g2), 1)
    assert "transformer.wte.weight" in r2.kept and "transformer.wte.weight" not in r2.params
    assert "transformer.wpe.weight" in r2.params


def test_frozen_nodes_are_priced_forward_only_holding_only_weights():
    _, g, prof = traced("bert-tiny")
    layers = find_layers(g)
    hw = load_hardware("cpu")
    r = frozen_region(g, layers, 1)
    fg = freeze_graph(g, r)
    fp = analytic_profile(fg, hw, optimizer="adam")
    # frozen-region nodes: no backward, no saved activations (but the region's outputs, which the
    # first active layer saves for its weights' gradients)
    for nid in r.nodes:
        assert fp.nodes[nid].backward_ms == 0.0, g.node(nid).name
        if not set(g.node(nid).outputs) & set(r.boundary):
            assert fp.nodes[nid].activation_bytes == 0, g.node(nid).name
    # frozen parameters: weights only (no gradient, no optimizer state); the others unchanged
    for name, pc in fp.params.items():
        if name in r.params:
            assert pc.grad_bytes == 0 and pc.optimizer_bytes == 0 and pc.total == g.params[name].bytes
        else:
            assert pc.total == prof.params[name].total
    # the active part is priced as before: the first active node's costs are unchanged
    later = [n.id for n in g.op_nodes() if n.id not in r.nodes and n.params]
    assert fp.nodes[later[-1]].backward_ms == pytest.approx(prof.nodes[later[-1]].backward_ms)
    # dropout in the region is switched off, keyed as before (the eager model counts it too)
    drops = [i for n in fg.nodes if n.id in r.nodes for i in n.instrs if "dropout" in i.target]
    assert drops and all((i.args[2] if len(i.args) > 2 else i.kwargs.get("train")) is False for i in drops)


def test_autopipe_plans_fewer_gpus_per_pipeline_as_layers_freeze():
    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=4)
    p0 = plan_phase(g, layers, 0, cluster, global_micro_batches=4, schedule="1f1b", strategies="seq")
    p2 = plan_phase(g, layers, 2, cluster, global_micro_batches=4, schedule="1f1b", strategies="seq")
    assert p2.samples_per_s > p0.samples_per_s
    assert p0.pipeline_gpus * p0.replicas == 4 == p2.pipeline_gpus * p2.replicas
    assert p2.micro_batches * p2.replicas == 4
    # every halving that fits is priced, and the best is kept
    thr = {t["P"]: t["samples_per_s"] for t in p2.tried if t["feasible"]}
    assert sorted(thr) == [1, 2, 4] and p2.samples_per_s == pytest.approx(max(thr.values()), rel=1e-6)
    forced = plan_phase(g, layers, 1, cluster, global_micro_batches=4, schedule="1f1b", strategies="seq",
                        pipeline_gpus=2)
    assert (forced.pipeline_gpus, forced.replicas, forced.micro_batches) == (2, 2, 2)



def test_phase_plans_are_priced_for_the_runs_settings_and_record_them():
    """A freeze run's phases are planned for its recomputation, clipping and skipping (so the phase
    packages' ranks train as priced, not with the defaults a phase package would record otherwise)."""
    from ftcompile.compile import problem_from_doc
    from ftcompile.plan import Plan, evaluate

    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=4)
    ph = plan_phase(g, layers, 1, cluster, global_micro_batches=4, schedule="1f1b", strategies="seq",
                    pipeline_gpus=2, recompute=True, clip_grad_norm=0.5, on_nonfinite="skip")
    doc = ph.doc
    assert (doc["recompute"], doc["clip_grad_norm"], doc["on_nonfinite"]) == (True, 0.5, "skip")
    prof = analytic_profile(ph.graph, load_hardware(cluster.hardware), optimizer="adam")
    plan = Plan.from_json(doc["plan"])
    as_recorded = evaluate(problem_from_doc(doc, ph.graph, prof), plan)
    assert [gpu["memory_bytes"] for gpu in doc["gpus"]] == [gpu.memory_bytes for gpu in as_recorded.gpus]
    assert doc["cost"]["objective_ms"] == pytest.approx(as_recorded.objective_ms, rel=1e-12)
    # recomputation runs the active stages' forward again in backward: a larger load than without it
    without = evaluate(problem_from_doc(doc, ph.graph, prof, recompute=False), plan)
    assert doc["cost"]["objective_ms"] > without.objective_ms


def _brute_force_layouts(name: str, frozen: int, G: int, S: int, schedule: str = "1f1b",
                         staleness: dict | None = None, cluster=None) -> dict[tuple[int, int], float]:
    """Every (P, M) with P halving from G, R = G / P, M dividing S / R in [P, 6P] (PipeTransformer's range):
    the model traced at b = S / (R M), frozen, priced analytically, partitioned by seq, simulated.
    ``staleness`` (given): each (P, M)'s updates of staleness under async, counted here: the in-flight
    scale x the longest chain of stages along the graph's edges / M."""
    import networkx as nx

    from ftcompile.replicas import ReplicaLayout, replicated_problem
    from ftcompile.simulate import simulate

    cluster = cluster or load_cluster("2xcpu").with_overrides(gpus=G)
    hw = load_hardware(cluster.hardware)
    layers = find_layers(traced(name)[1])
    out = {}
    P = G
    while P >= 1:
        R = G // P
        per = S // R
        for M in [m for m in range(P, 6 * P + 1) if per % m == 0]:
            g = traced(name, batch_size=per // M)[1]
            fg = freeze_graph(g, frozen_region(g, layers, frozen))
            pb = replicated_problem(Problem(fg, analytic_profile(fg, hw, optimizer="adam"), cluster, schedule=schedule,
                                            micro_batches=M), cluster, ReplicaLayout(P, R))
            result = compile_plan(pb, "seq", jobs=1)
            plan = result.best().plan
            out[(P, M)] = simulate(result.problem, plan).throughput_samples_per_s
            if staleness is not None:
                stage_of = {n: st.id for st in plan.stages for n in st.nodes}
                sg = nx.DiGraph()
                sg.add_nodes_from(st.id for st in plan.stages)
                sg.add_edges_from((stage_of[e.src], stage_of[e.dst]) for e in fg.edges
                                  if e.src in stage_of and e.dst in stage_of and stage_of[e.src] != stage_of[e.dst])
                assert schedule == "async"
                staleness[(P, M)] = result.problem.in_flight_scale * nx.dag_longest_path_length(sg) / M
        P //= 2
    return out


def test_autopipe_repicks_micro_batches_per_pipeline_length_as_brute_force_does():
    """plan_phase's (P, M) is the best simulated layout over every P halving and every M in P..6P dividing
    a replica's samples (each M at its own micro-batch size b = S / (R M)), and a deeper pipeline wants
    more micro-batches than a shorter one (its bubble)."""
    G, S, frozen = 4, 24, 1
    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=G)
    ph = plan_phase(g, layers, frozen, cluster, samples_per_step=S, schedule="1f1b", strategies="seq", split=False,
                    graph_at=lambda b: traced("bert-tiny", batch_size=b)[1])
    brute = _brute_force_layouts("bert-tiny", frozen, G, S)
    want = max(brute, key=brute.get)
    assert (ph.pipeline_gpus, ph.micro_batches) == want
    assert ph.samples_per_s == pytest.approx(brute[want], rel=1e-9)
    assert ph.replicas * ph.micro_batches * ph.micro_batch_size == S
    assert ph.graph.source["freeze"]["base_graph_hash"] == g.content_hash()     # one model whatever its b
    # every candidate was priced, with its b
    assert {(t["P"], t["M"]) for t in ph.tried} == set(brute)
    assert all(t["b"] * t["M"] * t["R"] == S for t in ph.tried)
    best_m = {P: max((m for (p, m) in brute if p == P), key=lambda m: brute[(P, m)]) for P in (4, 2, 1)}
    assert best_m[4] > best_m[1] and best_m[4] != best_m[2], best_m
    # fixed M (per replica) and no re-tracing (M follows the traced b) are both honoured
    fixed = plan_phase(g, layers, frozen, cluster, samples_per_step=S, schedule="1f1b", strategies="seq", split=False,
                       graph_at=lambda b: traced("bert-tiny", batch_size=b)[1], micro_batches=6, pipeline_gpus=2)
    assert (fixed.micro_batches, fixed.micro_batch_size) == (6, 2)
    keep = plan_phase(g, layers, frozen, cluster, samples_per_step=S, schedule="1f1b", strategies="seq", split=False)
    assert keep.micro_batch_size == 2 and all(t["b"] == 2 for t in keep.tried if "b" in t)


def test_autopipe_under_async_keeps_a_less_stale_layout_within_one_per_cent():
    """Under async a deeper pipeline (and fewer micro-batches) stales the weights more: plan_phase
    keeps the fastest (P, M) unless a less stale one is within 1 % of it, as compile does. The
    reference is brute force over every (P, M), the rule applied here by hand. Two hosts of two
    GPUs linked at 1.25 GB/s: 2 GPUs x 2 replicas (0.5 updates stale) is the fastest, and 4 replicas
    of one GPU (no staleness) within 1 % of it."""
    from dataclasses import replace

    G, S, frozen = 4, 8, 1
    _, g, _ = traced("bert-tiny")
    cluster = replace(load_cluster("2xcpu").with_overrides(gpus=G), inter_node_bandwidth=1.25e9)
    ph = plan_phase(g, find_layers(g), frozen, cluster, samples_per_step=S, schedule="async", strategies="seq",
                    split=False, graph_at=lambda b: traced("bert-tiny", batch_size=b)[1])
    stale: dict = {}
    brute = _brute_force_layouts("bert-tiny", frozen, G, S, schedule="async", staleness=stale, cluster=cluster)
    assert {(t["P"], t["M"]) for t in ph.tried} == set(brute)
    assert len(set(stale.values())) > 2, stale      # the staleness differs between layouts
    fastest = max(brute.values())
    near = [k for k in brute if brute[k] > 0.99 * fastest]
    want = min(near, key=lambda k: (stale[k], -brute[k]))
    assert brute[want] < fastest, brute             # the rule, not the throughput, decides here
    assert (ph.pipeline_gpus, ph.micro_batches) == want
    assert ph.samples_per_s == pytest.approx(brute[want], rel=1e-9)
    rows = {(t["P"], t["M"]): t for t in ph.tried}
    assert all(rows[k]["staleness_updates"] == pytest.approx(stale[k], rel=1e-9) for k in brute)


def test_micro_batch_candidates_follow_the_papers_range():
    from ftcompile.freeze import micro_batch_candidates

    assert micro_batch_candidates(4, 24) == [4, 6, 8, 12, 24]
    assert micro_batch_candidates(2, 12, keep=[1, 5]) == [1, 2, 3, 4, 6, 12]     # 5 does not divide: left out
    assert micro_batch_candidates(4, 2) == [2]                 # no divisor in 4..24: the nearest
    many = micro_batch_candidates(8, 2 * 3 * 4 * 5 * 7)        # 840: 13 divisors in 8..48
    assert len(many) == 6 and many[0] == 8 and many[-1] == 42 and all(840 % m == 0 and 8 <= m <= 48 for m in many)


def test_impossible_micro_batch_settings_are_refused_clearly():
    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=4)
    at = dict(schedule="1f1b", strategies="seq", graph_at=lambda b: traced("bert-tiny", batch_size=b)[1])
    with pytest.raises(FreezeError, match="do not split among 4 replicas"):
        plan_phase(g, layers, 1, cluster, samples_per_step=6, pipeline_gpus=1, **at)
    with pytest.raises(FreezeError, match="do not split into 5 micro-batches"):
        plan_phase(g, layers, 1, cluster, samples_per_step=8, pipeline_gpus=2, micro_batches=5, **at)
    with pytest.raises(FreezeError, match="exactly one of"):
        plan_phase(g, layers, 1, cluster, schedule="1f1b")
    with pytest.raises(FreezeError, match="only run micro-batches of 2"):      # no re-tracing: b stays 2
        plan_phase(g, layers, 1, cluster, samples_per_step=8, pipeline_gpus=2, micro_batches=4, schedule="1f1b",
                   strategies="seq")
    other = traced("llama-tiny")[1]
    with pytest.raises(FreezeError, match="is not the graph traced at 2"):
        plan_phase(g, layers, 1, cluster, samples_per_step=8, pipeline_gpus=2, micro_batches=4, schedule="1f1b",
                   strategies="seq", graph_at=lambda b: other)


def test_a_micro_batch_size_the_model_refuses_is_skipped_with_its_reason():
    """A model that cannot trace at some batch size (it asserts on its batch, say) loses those
    candidates, not the transition: the search prices the others and says why it skipped."""
    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=2)

    def graph_at(b):
        if b != 4:
            raise RuntimeError(f"this model needs batches of 2 or 4, not {b}\nsecond line")
        return traced("bert-tiny", batch_size=b)[1]

    ph = plan_phase(g, layers, 1, cluster, samples_per_step=8, pipeline_gpus=2, schedule="1f1b", strategies="seq",
                    graph_at=graph_at)
    assert ph.micro_batch_size in (2, 4)
    skipped = [r for r in ph.tried if not r.get("feasible") and "does not trace" in r.get("reason", "")]
    assert skipped and all("not " + str(r["b"]) in r["reason"] and "second line" not in r["reason"] for r in skipped)
    with pytest.raises(FreezeError, match="does not trace at micro-batch size 1"):
        plan_phase(g, layers, 1, cluster, samples_per_step=8, pipeline_gpus=2, micro_batches=8, schedule="1f1b",
                   strategies="seq", graph_at=graph_at)


# --------------------------------------------------------------------------- equivalence

def _package(out: Path, name: str, gpus: int) -> Path:
    built, graph, prof = traced(name)
    cluster = load_cluster("2xcpu").with_overrides(gpus=gpus)
    result = compile_plan(Problem(graph, prof, cluster, schedule="1f1b", micro_batches=4), "seq", jobs=1)
    assert result.best().plan.num_gpus == gpus
    return _write(out, name, plan_document(result, model=graph.source))


def freeze_reference(package: Path, schedule: dict[int, list[str]], steps: int, *, M: int, lr: float,
                     seed: int = 0, norms_of: list[str] = (), norms: dict | None = None,
                     dropout: bool = True, data: str = "synthetic") -> dict[str, torch.Tensor]:
    """Plain PyTorch: the original model, freezing the named submodules at the given steps
    (``norms[step][layer]``: each of ``norms_of``'s gradient norms before each update);
    ``dropout=False``: the whole model in eval mode (no dropout; BERT has no batch statistics);
    ``data``: a ``--data`` spec, drawn in this process as a rank draws it."""
    from ftcompile.codegen import rebuild_model
    from ftcompile.runtime import optim
    from ftcompile.runtime.data import load_dataset, split_micro_batches
    from ftcompile.runtime.engine import micro_batch_seed
    from ftcompile.runtime.ops import keyed_random_mode

    m = load_package(package).manifest
    model = rebuild_model(m.model | {"model": m.model["name"]}).model
    model.train(dropout)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = optim.build(params, optim.OptimConfig("momentum", lr, 0.9, (0.9, 0.999), 1e-8, 0.0, "constant", 0,
                                                   steps))
    batches = load_dataset(data, m, micro_batches=M, seed=seed)
    for j in range(steps):
        for path in schedule.get(j, []):
            mod = model.get_submodule(path)
            mod.requires_grad_(False)
            mod.eval()
        for i, mb in enumerate(split_micro_batches(next(batches), m, M)):
            args, kwargs = call_of(m, mb)
            with keyed_random_mode(micro_batch_seed(seed, j, i)):
                loss = model(*args, **kwargs)[0]
            (loss / M).backward()
        if norms is not None:
            norms[j] = {path: math.sqrt(sum(float(p.grad.double().pow(2).sum())
                                            for p in model.get_submodule(path).parameters() if p.grad is not None))
                        for path in norms_of}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def bert4(tmp_path_factory):
    return _package(tmp_path_factory.mktemp("freeze") / "bert", "bert-tiny", 4)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_manual_freeze_run_equals_plain_pytorch_freezing_the_same_layers(bert4, tmp_path, schedule):
    steps, lr = 6, 0.05
    log, ck = tmp_path / "log", tmp_path / "ck"
    r = run_cli(str(bert4), "--nproc", "4", "--steps", str(steps), "--optimizer", "momentum", "--lr", str(lr),
                "--schedule", schedule, "--log-dir", str(log), "--checkpoint-dir", str(ck),
                "--freeze", "at=2:1@2x2+4:2@2x2,strategy=seq", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    layers = ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    ref_norms: dict = {}
    want = freeze_reference(bert4, {2: ["bert.embeddings", "bert.encoder.layer.0"], 4: ["bert.encoder.layer.1"]},
                            steps, M=4, lr=lr, norms_of=layers, norms=ref_norms)
    got = final_weights(ck)
    for n, t in want.items():
        err = float((got[n] - t).abs().max()) / max(float(t.abs().max()), 1e-2)
        assert err < 2e-5, (n, err)
    # every step's phase is in the step log
    recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
    phases = {rec["step"]: rec["phase"] for rec in recs if "step" in rec and "phase" in rec}
    assert [(phases[s]["frozen_layers"], phases[s]["P"], phases[s]["R"], phases[s]["M"]) for s in range(steps)] == \
        [(0, 4, 1, 4)] * 2 + [(1, 2, 2, 2)] * 2 + [(2, 2, 2, 2)] * 2
    lines = [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines()]
    decisions = [x for x in lines if x.get("decision")]
    assert [(d["step"], d["frozen_before"], d["frozen_after"]) for d in decisions] == [(2, 0, 1), (4, 1, 2)]
    assert all(set(d["grad_norms"]) == {"bert.encoder.layer.0", "bert.encoder.layer.1"} for d in decisions)
    # the norms behind each decision are the gradients' of the step before it, as plain PyTorch has them
    for d in decisions:
        for layer in layers:
            assert d["grad_norms"][layer] == pytest.approx(ref_norms[d["step"] - 1][layer], rel=1e-4, abs=1e-9)
    assert decisions[1]["grad_norms"]["bert.encoder.layer.0"] == 0.0        # frozen: no gradient at all
    assert decisions[0]["grad_norms"]["bert.encoder.layer.0"] > 0.0
    runs = [x for x in lines if "phase" in x]
    assert [x["steps"] for x in runs] == [[0, 2], [2, 4], [4, 6]]
    assert all(x["transition_s"] >= 0 and x["samples_per_s"] > 0 for x in runs)


@pytest.mark.slow
def test_freeze_run_trains_and_plans_every_phase_with_the_runs_settings(tmp_path):
    """--recompute and --clip-grad-norm on a package compiled without them: phase 0 (the package as
    compiled) is priced again for them, and the later phases are planned for them, record them and
    train with them (the checkpoint's config)."""
    from ftcompile.cli import main

    pkg, log, ck = tmp_path / "pkg", tmp_path / "log", tmp_path / "ck"
    assert main(["compile", "bert-tiny", "--gpus", "4", "--replicas", "1", "--schedule", "1f1b", "--strategy",
                 "uniform", "-q", "-o", str(pkg)]) == 0        # with graph.json and profile.json, as compile writes
    r = run_cli(str(pkg), "--nproc", "4", "--steps", "4", "--schedule", "1f1b", "--recompute",
                "--clip-grad-norm", "100", "--log-dir", str(log), "--checkpoint-dir", str(ck),
                "--freeze", "at=2:1@2x2,strategy=seq", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "this run is not the one the plan was priced for (recompute off -> on, " in r.stderr
    phase1 = load_package(next((log / "freeze").glob("phase-1-*"))).manifest
    assert (phase1.recompute, phase1.clip_grad_norm, phase1.on_nonfinite) == (True, 100.0, "stop")
    config = json.loads(next(ck.glob("step-*/meta.json")).read_text())["config"]
    assert (config["recompute"], config["clip_grad_norm"]) == (True, 100.0)
    assert "as the plan was priced" not in r.stderr      # no phase fell back to a package's own settings


@pytest.mark.slow
def test_freeze_run_changing_micro_batches_equals_plain_pytorch(bert4, tmp_path):
    """M (and so b) changes at both transitions: 4 x 2 samples on one 4-GPU pipeline, then 2 replicas of
    1 micro-batch of 4 samples, then of 2 micro-batches of 2; each step trains the same 8 samples, so the
    weights are plain PyTorch's (dropout off: its masks are keyed by micro-batch number)."""
    steps, lr = 6, 0.05
    log, ck = tmp_path / "log", tmp_path / "ck"
    r = run_cli(str(bert4), "--nproc", "4", "--steps", str(steps), "--optimizer", "momentum", "--lr", str(lr),
                "--schedule", "1f1b", "--no-dropout", "--log-dir", str(log), "--checkpoint-dir", str(ck),
                "--freeze", "at=2:1@2x2/1+4:2@2x2/2,strategy=seq", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "another batch" not in r.stderr
    want = freeze_reference(bert4, {2: ["bert.embeddings", "bert.encoder.layer.0"], 4: ["bert.encoder.layer.1"]},
                            steps, M=4, lr=lr, dropout=False)
    got = final_weights(ck)
    for n, t in want.items():
        err = float((got[n] - t).abs().max()) / max(float(t.abs().max()), 1e-2)
        assert err < 2e-5, (n, err)
    recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
    phases = {rec["step"]: rec["phase"] for rec in recs if "step" in rec and "phase" in rec}
    assert [tuple(phases[s][k] for k in ("frozen_layers", "P", "R", "M", "b")) for s in range(steps)] == \
        [(0, 4, 1, 4, 2)] * 2 + [(1, 2, 2, 1, 4)] * 2 + [(2, 2, 2, 2, 2)] * 2
    runs = [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines() if '"phase"' in x]
    assert [(x["M"], x["b"]) for x in runs if "phase" in x and "steps" in x] == [(4, 2), (1, 4), (2, 2)]


def test_freeze_run_refuses_what_it_cannot_do_before_any_rank_starts(bert4, tmp_path, capsys):
    # In this process (the command line's own entry point): each refusal comes before any rank
    # starts, and seven fresh interpreters would spend most of the test importing torch.
    from ftcompile.cli import main

    for extra, msg in [(["--nproc", "2", "--freeze", "alpha=1/3,every=2"], "multiple of 4"),
                       (["--schedule", "async", "--freeze", "alpha=1/3,every=2"], "gpipe, 1f1b"),
                       (["--freeze", "alpha=1/3"], "needs both"),
                       (["--freeze", "at=2:3"], "has 2 layers"),
                       (["--freeze", "at=2:1@2x3"], "P x R = 4"),
                       (["--freeze", "at=2:1@2x2/3"], "do not split into 3 micro-batches; give M among [1, 2, 4]"),
                       (["--freeze", "at=2:1,cache=on"], "cache=on: --data synthetic gives no '__index__'")]:
        code = main(["run", str(bert4), "--steps", "4", "--log-dir", str(tmp_path / "log"), *extra])
        err = capsys.readouterr().err
        assert code == 2 and msg in err, (extra, err[-2000:])
        assert "Traceback" not in err
    assert not (tmp_path / "log" / "train.jsonl").exists()


def test_autocache_is_priced_only_where_reading_beats_recomputing():
    from ftcompile.freeze import cached_profile

    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    hw = load_hardware("cpu")
    prev, region = frozen_region(g, layers, 1), frozen_region(g, layers, 2)
    fg = freeze_graph(g, region)
    prof = analytic_profile(fg, hw, optimizer="adam")
    fast, used = cached_profile(fg, prof, region, prev, host_bandwidth=1e15)
    assert used
    new_nodes = region.nodes - prev.nodes
    assert all(fast.nodes[n].forward_ms == prof.nodes[n].forward_ms for n in new_nodes)   # the cache advances
    assert sum(fast.nodes[n].forward_ms for n in prev.nodes) < 1e-6                      # read, not recomputed
    slow, used = cached_profile(fg, prof, region, prev, host_bandwidth=1.0)                # 1 byte/s: recompute
    assert not used and slow is prof


@pytest.mark.slow
def test_eq1_run_on_four_ranks_goes_through_transitions(tmp_path):
    """A 6-layer BERT (random weights from a config) frozen by Eq. 1 every 2 steps on 4 ranks."""
    import subprocess
    import sys

    import transformers as T

    torch.manual_seed(0)
    cfg = T.BertConfig(num_hidden_layers=6, hidden_size=64, num_attention_heads=2, intermediate_size=128)
    T.BertForQuestionAnswering(cfg).save_pretrained(tmp_path / "bert6")
    pkg = tmp_path / "pkg"
    c = subprocess.run([sys.executable, "-m", "ftcompile", "compile", "bert-tiny", "--pretrained",
                        str(tmp_path / "bert6"), "--cluster", "2xcpu", "--gpus", "4", "--schedule", "1f1b",
                        "--strategy", "seq", "--replicas", "1", "--optimizer", "momentum", "-o", str(pkg), "-q"],
                       capture_output=True, text=True, timeout=600)
    assert c.returncode == 0, c.stderr[-2000:]
    log = tmp_path / "log"
    r = run_cli(str(pkg), "--nproc", "4", "--steps", "8", "--optimizer", "momentum", "--lr", "0.01",
                "--schedule", "1f1b", "--log-dir", str(log), "--freeze", "alpha=1/3,every=2,strategy=seq",
                timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines()]
    decisions = [x for x in lines if x.get("decision")]
    changes = [d for d in decisions if d["frozen_after"] > d["frozen_before"]]
    assert len(changes) >= 2
    for d in decisions:     # each decision is Eq. 1 on the norms it logged
        norms = [d["grad_norms"][f"bert.encoder.layer.{i}"] for i in range(6)]
        assert d["frozen_after"] == frozen_layers(d["frozen_before"], norms[d["frozen_before"]:], 1 / 3)
    runs = [x for x in lines if "phase" in x and not x.get("decision")]
    assert all(x["P"] * x["R"] == 4 and x["samples_per_s"] > 0 for x in runs)
    recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
    steps = sorted(x["step"] for x in recs if "step" in x and "phase" in x)
    assert steps == list(range(8))


# --------------------------------------------------------------------------- AutoCache

NETS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return h + F.gelu(self.fc(h))


class Net(nn.Module):
    def __init__(self, mix=False, bn=False):
        super().__init__()
        self.mix = mix
        self.inp = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if bn else None
        self.blocks = nn.ModuleList(Block(32) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        h = self.inp(x)
        if self.mix:        # a sample's activation depends on the rest of its micro-batch
            h = h - h.mean(0, keepdim=True)
        if self.norm is not None:
            h = self.norm(h)
        for b in self.blocks:
            h = b(h)
        return (F.cross_entropy(self.head(h), y),)


def mixing():
    return Net(mix=True), (torch.randn(4, 16), torch.randint(0, 4, (4,)))


def batchnorm():
    return Net(bn=True), (torch.randn(4, 16), torch.randint(0, 4, (4,)))
'''

# A finite dataset of 8 fixed samples visited in a fresh order every epoch, naming each sample by its index
# (`--data EPOCHS_DATA:epochs`; 8 unless EPOCHS_DATA_SAMPLES says otherwise, and the tests leave it unset).
EPOCHS_DATA = Path(__file__).resolve().parents[1] / "examples" / "epochs_data.py"


@pytest.fixture(autouse=True)
def _epochs_of_8(monkeypatch):
    """EPOCHS_DATA's default size, 8, in this process and the ranks it starts, whatever the caller's environment."""
    monkeypatch.delenv("EPOCHS_DATA_SAMPLES", raising=False)


def _epochs(manifest, micro_batches: int, seed: int = 0):
    """EPOCHS_DATA in this process, loaded as a rank loads it."""
    from ftcompile.runtime.data import load_dataset

    return load_dataset(f"{EPOCHS_DATA}:epochs", manifest, micro_batches=micro_batches, seed=seed)


def _measured_setup(package: Path, root: Path, layers: int, cached_from: int = 0, batches=None):
    """What the AutoCache profiler measures on: the package, a fresh cache for it under ``root`` (``layers``
    frozen, ``cached_from`` cached before) and the first micro-batch of ``batches(manifest)`` (EPOCHS_DATA's
    by default)."""
    from ftcompile.runtime.cache import create
    from ftcompile.runtime.data import split_micro_batches

    pkg = load_package(package)
    cfg = _cfg(root, layers, cached_from)
    create(cfg, pkg.manifest)
    data = batches(pkg.manifest) if batches else _epochs(pkg.manifest, 1)
    return pkg, cfg, split_micro_batches(next(data), pkg.manifest, 1)[0]


def test_epochs_data_visits_its_samples_once_an_epoch_and_refuses_a_bad_size(llama_phases, monkeypatch):
    """examples/epochs_data.py: every epoch a permutation of the n samples (8, or EPOCHS_DATA_SAMPLES), a sample
    the same tensors whenever it comes back; a size that is no multiple of the micro-batch size refused."""
    from ftcompile.runtime.data import SAMPLE_INDEX, DataError

    m = load_package(llama_phases[0]).manifest
    b = m.micro_batch_size
    for n, env in ((8, None), (6 * b, str(6 * b))):
        if env:
            monkeypatch.setenv("EPOCHS_DATA_SAMPLES", env)
        rows, seen = [], {}
        for batch in itertools.islice(_epochs(m, 3), -(-4 * n // (3 * b))):  # 4 epochs, 3 micro-batches a step
            for r, i in enumerate(batch[SAMPLE_INDEX].tolist()):
                rows.append(i)
                for k, v in batch.items():
                    if k != SAMPLE_INDEX:
                        assert torch.equal(seen.setdefault((i, k), v[r]), v[r])
        assert len(rows) >= 4 * n
        assert all(sorted(rows[e * n:(e + 1) * n]) == list(range(n)) for e in range(4))
        assert rows[:n] != rows[n:2 * n]                                   # a fresh order every epoch
    monkeypatch.setenv("EPOCHS_DATA_SAMPLES", str(b + 1))
    with pytest.raises(DataError, match=f"EPOCHS_DATA_SAMPLES='{b + 1}': the dataset's size must be a positive "
                                        f"multiple of the package's micro-batch size {b}"):
        _epochs(m, 1)


def test_cache_cut_says_where_activations_can_be_cached(tmp_path):
    from ftcompile.freeze import cache_cut

    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cut = cache_cut(g, frozen_region(g, layers, 1))
    assert cut.reason is None and set(cut.values) == set(frozen_region(g, layers, 1).boundary) and not cut.shared
    # Llama: rotary tables and the causal mask leave the frozen layers but depend on no input: one copy each
    _, g, _ = traced("llama-tiny")
    cut = cache_cut(g, frozen_region(g, find_layers(g), 1))
    assert cut.reason is None and len(cut.shared) == 3 and len(cut.values) == 4
    # a tied embedding keeps training, so what the frozen layers compute from it changes every step
    _, g, _ = traced("gpt2-tiny")
    assert "transformer.wte.weight" in cache_cut(g, frozen_region(g, find_layers(g), 1)).reason
    # running statistics: the output depends on the micro-batches seen before
    (tmp_path / "nets.py").write_text(NETS)
    _, g, _ = traced(f"{tmp_path / 'nets.py'}:batchnorm")
    assert "update buffer norm." in cache_cut(g, frozen_region(g, find_layers(g), 1)).reason


def test_frozen_layers_get_stages_of_their_own_at_each_cached_depth():
    from ftcompile.freeze import split_frozen
    from ftcompile.plan import stage_graph

    _, g, _ = traced("bert-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=4)
    r1, r2 = frozen_region(g, layers, 1), frozen_region(g, layers, 2)
    for P in (4, 2):
        ph = plan_phase(g, layers, 2, cluster, global_micro_batches=4, schedule="1f1b", strategies="seq",
                        pipeline_gpus=P, cached_from=1)
        plain = plan_phase(g, layers, 2, cluster, global_micro_batches=4, schedule="1f1b", strategies="seq",
                           pipeline_gpus=P, split=False)
        from ftcompile.plan import Plan

        plan, before = Plan.from_json(ph.doc["plan"]), Plan.from_json(plain.doc["plan"])
        assert split_frozen(g, before, [r1, r2]).to_json()["stages"] == plan.to_json()["stages"]
        # the same nodes on the same GPUs; every stage of one level only; the stage graph acyclic
        where = {n: s.gpu for s in plan.stages for n in s.nodes}
        assert where == {n: s.gpu for s in before.stages for n in s.nodes}
        levels = {int(k): v for k, v in ph.cache["stages"].items()}
        for s in plan.stages:
            inside = [1 if n in r1.nodes else 2 if n in r2.nodes else 0 for n in s.nodes]
            assert len(set(inside)) == 1
            assert levels.get(s.id, 0) == inside[0]
        import networkx as nx

        assert nx.is_directed_acyclic_graph(stage_graph(ph.graph, plan))
        assert ph.cache["cached_from"] == 1 and ph.cache["values"] == list(r2.boundary)
        assert ph.samples_per_s > 0 and ph.doc["cost"]["feasible"]


@pytest.fixture(scope="module")
def llama_phases(tmp_path_factory):
    """llama-tiny's phase packages freezing 1 then 2 layers (the second split at 1 and 2), one GPU each."""
    from ftcompile.freeze import write_phase_package

    built, g, _ = traced("llama-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=2)
    out = tmp_path_factory.mktemp("llama-phases")
    p1 = plan_phase(g, layers, 1, cluster, global_micro_batches=2, schedule="1f1b", strategies="seq", pipeline_gpus=2)
    p2 = plan_phase(g, layers, 2, cluster, global_micro_batches=2, schedule="1f1b", strategies="seq", pipeline_gpus=2,
                    cached_from=1)
    return (Path(write_phase_package(p1, built, layers, out / "f1")),
            Path(write_phase_package(p2, built, layers, out / "f2")))


def _cfg(root: Path, layers: int, cached_from: int = 0, **kw):
    from ftcompile.runtime.cache import CacheConfig

    return CacheConfig("tok", str(root / "disk"), str(root / "mem"), kw.pop("memory_budget", 10 ** 9),
                       kw.pop("disk_budget", None), layers, cached_from, **kw)


def _engine_run(package, steps: int, batches, *, start: int = 0, state=None, cache=None, M: int = 2):
    """``steps`` steps of 1F1B on one process (every stage on rank 0); (losses, state)."""
    from ftcompile.runtime.engine import RankEngine, TrainConfig

    cfg = TrainConfig(schedule="1f1b", micro_batches=M, steps=10, optimizer="momentum", lr=0.05, seed=3)
    eng = RankEngine(load_package(package), cfg, cache=cache)
    if state is not None:
        eng.load_state(state)
    recs = eng.run(batches, steps, step_offset=start)
    eng.finish()
    flat = {"weights": {}, "optimizer": {}, "step": start + steps}
    for st in eng.state().values():
        flat["weights"].update(st["weights"])
        flat["optimizer"].update(st["optimizer"])
    return [r["loss"] for r in recs], flat, recs


def test_autocache_in_one_process_gives_the_same_bits_through_miss_hit_and_advance(llama_phases, tmp_path):
    """Two phases of llama-tiny (1 then 2 frozen layers) on one process, with and without AutoCache:
    the same losses and weights, bit for bit, while the cache misses, hits, and advances its entries
    through the newly frozen layer; shared values (rotary tables, causal mask) are cached once."""
    from ftcompile.runtime.cache import AutoCache, CacheIndex, cache_plan, check, create

    f1, f2 = llama_phases
    m1 = load_package(f1).manifest
    # without the cache
    data = _epochs(m1, 2)
    ref1, state, _ = _engine_run(f1, 3, data)
    ref2, ref_state, _ = _engine_run(f2, 3, data, start=3, state=state)
    # with it
    cfg1 = _cfg(tmp_path, 1, use=[1], write=True, index_out=str(tmp_path / "index-1.json"))
    create(cfg1, m1)
    plan1 = cache_plan(m1)
    check(cfg1, m1, plan1, register=True)
    c1 = AutoCache(cfg1, plan1)
    data = _epochs(m1, 2)
    got1, state, recs1 = _engine_run(f1, 3, data, cache=c1)
    c1.index().save(cfg1.index_out)
    m2 = load_package(f2).manifest
    cfg2 = _cfg(tmp_path, 2, 1, use=[2, 1], write=True, index_in=cfg1.index_out)
    plan2 = cache_plan(m2)
    check(cfg2, m2, plan2, register=True)
    c2 = AutoCache(cfg2, plan2, CacheIndex.load(cfg2.index_in))
    got2, got_state, recs2 = _engine_run(f2, 3, data, start=3, state=state, cache=c2)
    assert got1 == ref1 and got2 == ref2
    assert all(torch.equal(got_state["weights"][n], t) for n, t in ref_state["weights"].items())
    # 8 samples in micro-batches of 2, 2 micro-batches a step: every sample comes back every other step.
    # What each micro-batch should be: a hit once every sample was seen in an earlier step of its phase,
    # an advance (phase 2) once every sample was seen in phase 1, else a miss.
    from ftcompile.runtime.data import SAMPLE_INDEX

    ids = [b[SAMPLE_INDEX].tolist() for _, b in zip(range(6), _epochs(m1, 2))]
    want, seen = [], {1: set(), 2: set()}
    for j, row in enumerate(ids):
        phase = 1 if j < 3 else 2
        kinds = []
        for mb in (row[:2], row[2:]):
            if set(mb) <= seen[phase]:
                kinds.append("hit")
            elif phase == 2 and set(mb) <= seen[1]:
                kinds.append("advanced")
            else:
                kinds.append("miss")
        seen[phase] |= set(row)
        want.append((kinds.count("miss"), kinds.count("hit"), kinds.count("advanced")))
    counts = [(r["cache"]["misses"], r["cache"]["hits"], r["cache"]["advanced"]) for r in recs1 + recs2]
    assert counts == want
    assert want[0] == (2, 0, 0) and want[3] == (0, 0, 2) and sum(w[1] for w in want[3:]) > 0
    assert sum(r["cache"]["entries_written"] for r in recs1) == 8 * 1 + 3     # the hidden state + 3 shared
    assert sum(r["cache"]["entries_written"] for r in recs2) == 8              # advanced: the new hidden state
    assert set(plan1.shared) and set(plan1.shared) <= set(plan1.boundary[1])


def test_autocache_carries_over_a_change_of_micro_batch_size(llama_phases, tmp_path):
    """Phase 1 caches llama-tiny's first layer in 2 micro-batches of 2; phase 2 re-picks M = 1 micro-batch
    of 4 samples (the same 4 samples a step) and advances those entries through its newly frozen layer:
    the same bits as phase 2 without the cache, once the profiler found both sizes give every sample the
    same bits; shared values sized by the batch are dropped and cached again. (At b = 1 llama-tiny traces
    to another graph: torch.export specializes sizes of 1; such a size is refused, or skipped by the search.)"""
    from ftcompile.freeze import write_phase_package
    from ftcompile.runtime.cache import AutoCache, CacheIndex, cache_plan, check, create, resize
    from ftcompile.runtime.cache_measure import compare_sizes

    f1, _ = llama_phases
    m1 = load_package(f1).manifest
    built, g, _ = traced("llama-tiny")
    layers = find_layers(g)
    cluster = load_cluster("2xcpu").with_overrides(gpus=2)
    with pytest.raises(FreezeError, match="traced at micro-batch size 1 is not the graph traced at 2"):
        plan_phase(g, layers, 2, cluster, samples_per_step=4, schedule="1f1b", strategies="seq", pipeline_gpus=2,
                   micro_batches=4, cached_from=1, graph_at=lambda b: traced("llama-tiny", batch_size=b)[1])
    ph = plan_phase(g, layers, 2, cluster, samples_per_step=4, schedule="1f1b", strategies="seq", pipeline_gpus=2,
                    micro_batches=1, cached_from=1, graph_at=lambda b: traced("llama-tiny", batch_size=b)[1])
    assert (ph.micro_batches, ph.micro_batch_size) == (1, 4)
    ranges = {gi.path: (gi.low, gi.high) for gi in m1.inputs if gi.low is not None}
    f2 = Path(write_phase_package(ph, traced("llama-tiny", batch_size=4)[0], layers, tmp_path / "f2b4",
                                  input_ranges=ranges))
    m2 = load_package(f2).manifest
    assert m2.micro_batch_size == 4 and [(gi.low, gi.high) for gi in m2.inputs] == [(gi.low, gi.high) for gi in m1.inputs]
    ref1, state, _ = _engine_run(f1, 3, _epochs(m1, 2))
    data = _epochs(m1, 2)
    for _ in range(3):
        next(data)
    ref2, ref_state, _ = _engine_run(f2, 3, data, start=3, state=state, M=1)
    # with the cache
    root = tmp_path / "c"
    cfg1 = _cfg(root, 1, use=[1], write=True, index_out=str(root / "index-1.json"))
    create(cfg1, m1)
    plan1 = cache_plan(m1)
    check(cfg1, m1, plan1, register=True)
    c1 = AutoCache(cfg1, plan1)
    data = _epochs(m1, 2)
    got1, state, _ = _engine_run(f1, 3, data, cache=c1)
    c1.index().save(cfg1.index_out)
    batch = next(_epochs(m1, 2))
    same, why = compare_sizes(load_package(f1), load_package(f2), 1, batch)
    assert same, why
    plan2 = cache_plan(m2)
    cfg2 = _cfg(root, 2, 1, use=[2, 1], write=True, index_in=cfg1.index_out)
    with pytest.raises(Exception, match="micro-batches of 2"):       # not carried over: refused
        check(cfg2, m2, plan2)
    index = CacheIndex.load(cfg1.index_out)
    dropped = resize(cfg2, m2, index, cfg1.index_out)
    for v in dropped:
        assert tuple(plan1.shapes[v]) != tuple(plan2.shapes[v])
    check(cfg2, m2, plan2, register=True)
    c2 = AutoCache(cfg2, plan2, CacheIndex.load(cfg1.index_out))
    got2, got_state, recs2 = _engine_run(f2, 3, data, start=3, state=state, cache=c2, M=1)
    assert got1 == ref1 and got2 == ref2
    assert all(torch.equal(got_state["weights"][n], t) for n, t in ref_state["weights"].items())
    assert sum(r["cache"]["advanced"] for r in recs2) > 0, (dropped, [r["cache"] for r in recs2], plan2.shared, plan1.shared)  # entries made at b=2 read at b=4


def test_autocache_decides_alike_on_every_replica_within_its_budget(llama_phases, tmp_path):
    """Replicas decide every micro-batch alike with no message: one writer per sample, budgets in order."""
    from ftcompile.runtime.cache import ENTRY_OVERHEAD, AutoCache, cache_plan
    from ftcompile.runtime.data import SAMPLE_INDEX

    f1, _ = llama_phases
    m = load_package(f1).manifest
    plan = cache_plan(m)
    per = {v: plan.entry_bytes(v) for v in plan.boundary[1]}
    sample = sum(b for v, b in per.items() if v not in plan.shared)
    shared = sum(b for v, b in per.items() if v in plan.shared)
    assert sample == 32 * 64 * 4 + ENTRY_OVERHEAD          # one [32, 64] float32 hidden state per sample
    # room in memory for the shared values and 3 samples, on disk for 2 more
    cfg = _cfg(tmp_path, 1, use=[1], write=True, memory_budget=shared + 3 * sample, disk_budget=2 * sample)
    caches = []
    for r in range(2):
        c = AutoCache(cfg, plan)
        c.bind(m, [s.id for s in m.stages], replica=r, replicas=2, micro_batches=2, device="cpu")
        caches.append(c)
    b = m.micro_batch_size

    def step(ids):
        mbs = [{SAMPLE_INDEX: torch.tensor(ids[i * b:(i + 1) * b])} for i in range(4)]
        for c in caches:
            c.plan_step(c_step[0], mbs)
        c_step[0] += 1
        return caches[0].steps[c_step[0] - 1]

    c_step = [0]
    st = step([0, 1, 2, 3, 3, 4, 5, 6])                    # sample 3 twice in one step: written once
    assert st.levels == [0, 0, 0, 0]
    written = {st.ids[g][row]: tiers for g, rows in st.writes.items() for row, tiers in rows.items()}
    assert sorted(written) == [0, 1, 2, 3, 4]                 # 5 fit, 5 and 6 do not
    assert [next(iter(written[s].values())) for s in range(5)] == ["memory"] * 3 + ["disk"] * 2
    assert sum(1 for g, rows in st.writes.items() for row in rows if st.ids[g][row] == 3) == 1
    assert st.shared_writes == {0: {v: "memory" for v in plan.shared}}
    for c in caches[1:]:
        other = c.steps[0]
        assert (other.levels, other.writes, other.shared_writes) == (st.levels, st.writes, st.shared_writes)
    st = step([0, 1, 2, 3, 4, 5, 1, 0])
    assert st.levels == [1, 1, 0, 1] and not st.writes       # 4 with 5 is not cached; nothing more fits
    assert caches[0].memory_used == shared + 3 * sample and caches[0].disk_used == 2 * sample


def test_autocache_entries_are_exact_and_refuse_what_is_not_theirs(tmp_path):
    from ftcompile.runtime.cache import CacheError, decode_entry, encode_entry, sample_digests

    for t in (torch.randn(3, 5), torch.randn(2, 4).to(torch.bfloat16), torch.randint(0, 9, (7,))):
        data = encode_entry("tok", "h", 17, "d" * 32, 2, t)
        back = decode_entry(data, token="tok", value="h", sample=17, digest="d" * 32, shape=tuple(t.shape),
                            dtype=str(t.dtype).removeprefix("torch."), where="e")
        assert back.dtype == t.dtype and torch.equal(back, t)
    data = encode_entry("tok", "h", 17, "d" * 32, 2, torch.zeros(3))
    ok = dict(token="tok", value="h", sample=17, digest="d" * 32, shape=(3,), dtype="float32", where="e")
    for change, msg in [({"token": "other"}, "stale AutoCache entry e: its token"),
                        ({"value": "g"}, "its value"), ({"sample": 18}, "its sample"),
                        ({"shape": (4,)}, "its shape"), ({"dtype": "float64"}, "its dtype"),
                        ({"digest": "e" * 32}, "sample 17: its inputs differ")]:
        with pytest.raises(CacheError, match=msg):
            decode_entry(data, **{**ok, **change})
    with pytest.raises(CacheError, match="not an AutoCache entry"):
        decode_entry(b"junk" * 10, **ok)
    # a sample's digest covers every input's bytes, dtype and shape, row by row
    mb = {"x": torch.arange(6).reshape(2, 3), "y": torch.tensor([1.0, 2.0])}
    d = sample_digests(mb, ["x", "y"])
    assert d[0] != d[1] and d == sample_digests({k: v.clone() for k, v in mb.items()}, ["x", "y"])
    assert sample_digests({"x": mb["x"], "y": torch.tensor([1.0, 2.5])}, ["x", "y"])[0] == d[0]
    assert sample_digests({"x": mb["x"].double(), "y": mb["y"]}, ["x", "y"])[0] != d[0]


def test_a_stale_cache_is_refused(llama_phases, bert4, tmp_path):
    """The cache of another run, another package or a later phase is refused before training, as is an
    index that does not list this phase's values."""
    from dataclasses import replace

    from ftcompile.runtime.cache import AutoCache, CacheError, CacheIndex, cache_plan, check, create

    f1, f2 = llama_phases
    m1, m2 = load_package(f1).manifest, load_package(f2).manifest
    cfg = _cfg(tmp_path, 1)
    create(cfg, m1)
    check(cfg, m1, cache_plan(m1), register=True)
    with pytest.raises(CacheError, match="belongs to another run"):
        check(replace(cfg, token="someone-else"), m1, cache_plan(m1))
    bert = load_package(bert4).manifest
    other = replace(m1, generator={**m1.generator, "base_graph_hash": bert.generator["graph_hash"]})
    with pytest.raises(CacheError, match="holds activations of model llama-tiny"):
        check(cfg, other, cache_plan(m1))
    # the meta.json of a run that went further (2 layers) seen from a phase freezing 1
    check(replace(cfg, layers=2), m2, cache_plan(m2), register=True)
    plan1 = cache_plan(m1)
    late = replace(plan1, layers=0)
    with pytest.raises(CacheError, match="cached .* at 1 frozen layers, this phase freezes only 0"):
        check(cfg, m1, late)
    bad = replace(plan1, shapes={**plan1.shapes, plan1.boundary[1][0]: (7,)})
    with pytest.raises(CacheError, match="another package's"):
        check(cfg, m1, bad)
    idx = tmp_path / "index.json"
    CacheIndex(1, ("nope",), {1, 2}, set(), {}).save(idx)
    with pytest.raises(CacheError, match="stale cache: the index"):
        AutoCache(_cfg(tmp_path, 2, 1, index_in=str(idx)), cache_plan(m2), CacheIndex.load(idx))


def test_a_rank_refuses_a_stale_cache_before_training(llama_phases, tmp_path):
    """A real rank given another run's cache folder stops with one line and exit status 2."""
    import subprocess
    import sys

    from ftcompile.runtime.cache import cache_plan, check, create

    f1, _ = llama_phases
    m1 = load_package(f1).manifest
    cfg = _cfg(tmp_path, 1, use=[1], write=True)
    create(cfg, m1)
    check(cfg, m1, cache_plan(m1), register=True)
    cfg.token = "not-this-run"
    (tmp_path / "autocache.json").write_text(json.dumps(cfg.to_json()))
    r = subprocess.run([sys.executable, "-m", "ftcompile.runtime", str(f1), "--steps", "1", "--log-dir",
                        str(tmp_path / "log"), "--data", f"{EPOCHS_DATA}:epochs", "--autocache",
                        str(tmp_path / "autocache.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "stale cache" in r.stderr and "belongs to another run" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "log" / "train.jsonl").exists()


def test_autocache_profiler_measures_and_checks_exactness(llama_phases, tmp_path):
    from ftcompile.freeze import write_phase_package
    from ftcompile.runtime.cache import cache_plan
    from ftcompile.runtime.cache_measure import decide, measure

    _, f2 = llama_phases
    pkg, cfg, mb = _measured_setup(f2, tmp_path, 2, 1)
    got = measure(pkg, cfg, mb)
    assert got["exact"] and got["tier"] == "memory"
    assert got["forward_ms"] > 0 and got["advance_ms"] > 0 and got["read_ms"] > 0 and got["read_previous_ms"] > 0
    plan = cache_plan(pkg.manifest)
    assert got["bytes_per_micro_batch"] == 2 * sum(plan.entry_bytes(v) for v in plan.boundary[2]
                                                   if v not in plan.shared)
    # the process of its own a GPU measures in answers the same (here on the CPU)
    import subprocess
    import sys

    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in mb.items()}, str(tmp_path / "mb.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg.to_json()))
    r = subprocess.run([sys.executable, "-m", "ftcompile.runtime.cache_measure", str(f2), str(tmp_path / "cfg.json"),
                        str(tmp_path / "mb.safetensors"), "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    apart = json.loads(r.stdout.strip().splitlines()[-1])
    assert apart["exact"] and set(apart) == set(got)
    assert not any(p.name.startswith(".measure-") for p in (tmp_path / "mem").iterdir())     # scratch removed
    # auto reads where reading is faster, on whatever the timing, off when not exact
    fast = {"exact": True, "forward_ms": 5.0, "read_ms": 1.0, "read_previous_ms": 1.0, "advance_ms": 3.0}
    assert decide("auto", cfg, fast)[:2] == ([2, 1], True)
    assert decide("auto", cfg, {**fast, "advance_ms": 4.5})[:2] == ([2], True)
    assert decide("auto", cfg, {**fast, "read_ms": 6.0, "read_previous_ms": 9.0})[:2] == ([], False)
    assert decide("on", cfg, {**fast, "read_ms": 6.0})[:2] == ([2, 1], True)
    use, write, why = decide("on", cfg, {"exact": False, "reason": "mixes"})
    assert (use, write) == ([], False) and "not exact: mixes" in why
    # a model whose frozen layers mix the samples of a micro-batch: measured not exact
    (tmp_path / "nets.py").write_text(NETS)
    built, g, _ = traced(f"{tmp_path / 'nets.py'}:mixing")
    layers = find_layers(g)
    ph = plan_phase(g, layers, 1, load_cluster("2xcpu").with_overrides(gpus=1), global_micro_batches=1,
                    schedule="1f1b", strategies="seq")
    from ftcompile.runtime.data import synthetic_batches

    mixing, cfg, mb = _measured_setup(write_phase_package(ph, built, layers, tmp_path / "mixing"), tmp_path / "m", 1,
                                      batches=lambda m: synthetic_batches(m, micro_batches=1))
    got = measure(mixing, cfg, mb)
    assert not got["exact"] and "changes when its micro-batch is reversed" in got["reason"]


@pytest.mark.slow
def test_autocache_on_and_off_give_the_same_bits_on_four_ranks(bert4, tmp_path):
    """BERT on 4 real ranks over gloo, two freeze transitions (P 4 -> 2, R 1 -> 2): with AutoCache (in host
    memory; and with a budget of 0, every entry spilled to disk) the losses and weights are those without
    it, bit for bit, while steps miss, hit and advance the cache through the newly frozen layer."""
    runs = {}
    for name, cache in [("off", "off"), ("on", "on"), ("spill", "on,cache_mb=0")]:
        log = tmp_path / name
        r = run_cli(str(bert4), "--nproc", "4", "--steps", "6", "--optimizer", "momentum", "--lr", "0.05",
                    "--schedule", "1f1b", "--log-dir", str(log), "--checkpoint-dir", str(log / "ck"),
                    "--data", f"{EPOCHS_DATA}:epochs",
                    "--freeze", f"at=2:1@2x2+4:2@2x2,strategy=seq,cache={cache}", timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
        runs[name] = ([x for x in recs if "step" in x], final_weights(log / "ck"),
                      [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines()])
        # the run's cache is gone: nothing left in host memory or beside the log
        memory = re.findall(r"/dev/shm/ftcompile-autocache-[0-9a-f]+", r.stderr)
        assert bool(memory) == (cache != "off") and not any(Path(p).exists() for p in memory)
        assert not [p for p in (log / "freeze").glob("cache-*") if p.is_dir()]
    off_steps, off_w, _ = runs["off"]
    assert all("cache" not in x for x in off_steps)
    for name in ("on", "spill"):
        steps, w, freeze = runs[name]
        assert [x["loss"] for x in steps] == [x["loss"] for x in off_steps], name
        assert set(w) == set(off_w) and all(torch.equal(w[n], off_w[n]) for n in w), name
        # 8 samples, 8 a step: phase 1 misses then hits; phase 2 advances the cached layer-0 output
        # through layer 1, then hits
        counts = [(x["cache"]["misses"], x["cache"]["hits"], x["cache"]["advanced"]) for x in steps[2:]]
        assert counts == [(4, 0, 0), (0, 4, 0), (0, 0, 4), (0, 4, 0)], name
        assert [x["cache"]["entries_written"] > 0 for x in steps[2:]] == [True, False, True, False]
        assert all(x["cache"]["bytes_read"] > 0 for x in steps[3:])
        tier = [(x["cache"]["memory_bytes"] > 0, x["cache"]["disk_bytes"] > 0) for x in steps[2:]]
        assert set(tier) == ({(True, False)} if name == "on" else {(False, True)}), name
        phases = [x for x in freeze if "phase" in x and not x.get("decision")]
        assert [p.get("cache", {}).get("used") for p in phases] == [None, True, True]
        assert phases[2]["cache"]["reads_levels"] == [2, 1] and phases[2]["cache"]["measured"]["exact"]
        assert phases[1]["cache"]["counts"]["hits"] == 4 and phases[2]["cache"]["counts"]["advanced"] == 4


# What plain PyTorch freezes by hand at steps 2 and 4 of at=2:1...+4:2...: the modules before the first layer, then
# each layer in turn (neither model ties its embedding to its head)
HAND_FROZEN = {"vit-tiny": {2: ["vit.embeddings", "vit.layers.0"], 4: ["vit.layers.1"]},
               "llama-tiny": {2: ["model.embed_tokens", "model.layers.0"], 4: ["model.layers.1"]}}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit-tiny", "llama-tiny"])
def test_autocache_on_four_ranks_carries_over_transitions_that_change_the_micro_batch_size(name, tmp_path):
    """ViT (the class token expanded to the batch) and Llama (rotary tables and the causal mask) cache values
    shared by every sample whose shape follows the micro-batch size. On 4 real ranks over gloo, with (M, b)
    per replica (4, 2) -> (1, 4) -> (2, 2): the first frozen phase runs another size than the one the run's
    cache was made at, with nothing cached yet (what a freeze that re-picks M does at its first transition,
    as ViT's in benchmarks/freeze.py), and the second carries phase 1's entries from b = 4 back to b = 2.
    With AutoCache on the run finishes with the losses and weights of the run without it, bit for bit, and
    with plain PyTorch's weights."""
    from ftcompile.runtime.cache import cache_plan

    package = _package(tmp_path / "pkg", name, 4)
    steps, lr, data = 6, 0.05, f"{EPOCHS_DATA}:epochs"
    runs = {}
    for cache in ("off", "on"):
        log = tmp_path / cache
        r = run_cli(str(package), "--nproc", "4", "--steps", str(steps), "--optimizer", "momentum", "--lr", str(lr),
                    "--schedule", "1f1b", "--no-dropout", "--log-dir", str(log), "--checkpoint-dir", str(log / "ck"),
                    "--data", data, "--freeze", f"at=2:1@2x2/1+4:2@2x2/2,strategy=seq,cache={cache}", timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
        runs[cache] = ([x for x in recs if "step" in x], final_weights(log / "ck"),
                       [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines()])
    (off, off_w, _), (on, on_w, freeze) = runs["off"], runs["on"]
    for steps_of in (off, on):
        assert [tuple(x["phase"][k] for k in ("frozen_layers", "M", "b")) for x in steps_of] == \
            [(0, 4, 2)] * 2 + [(1, 1, 4)] * 2 + [(2, 2, 2)] * 2
    assert [x["loss"] for x in on] == [x["loss"] for x in off]
    assert set(on_w) == set(off_w) and all(torch.equal(on_w[n], off_w[n]) for n in on_w)
    want = freeze_reference(package, HAND_FROZEN[name], steps, M=4, lr=lr, dropout=False, data=data)
    assert set(want) <= set(on_w)                                 # (the checkpoint holds buffers too)
    for n, t in want.items():
        err = float((on_w[n] - t).abs().max()) / max(float(t.abs().max()), 1e-2)
        assert err < 2e-5, (n, err)
    # the path this test is for: phase 1 caches a shared value whose shape is not the one at phase 0's size
    phases = [x for x in freeze if "phase" in x and not x.get("decision")]
    plans = [cache_plan(load_package(p["package"]).manifest) for p in phases[1:]]
    shared = [v for v in plans[0].shared if any(v in vs for vs in plans[0].boundary.values())]
    assert shared and any(plans[0].shapes[v] != plans[1].shapes[v] for v in shared), (plans[0].shared, plans[0].shapes)
    # the cache was used in both frozen phases: phase 1 wrote at b = 4, phase 2 read those entries at b = 2
    assert [p.get("cache", {}).get("used") for p in phases] == [None, True, True]
    assert "resized" not in phases[1]["cache"]                     # nothing cached before phase 1
    resized = phases[2]["cache"]["resized"]
    assert resized["kept"] and (resized["from"], resized["to"]) == (4, 2), resized
    assert [sum(x["cache"][k] for x in on[2:4]) for k in ("misses", "hits")] == [2, 2]   # 2 micro-batches a step
    assert sum(x["cache"]["advanced"] for x in on[4:]) > 0         # b = 4 entries advanced at b = 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_autocache_measures_on_a_gpu_in_a_process_of_its_own(llama_phases, tmp_path):
    from ftcompile.runtime.cache_measure import measure_apart

    _, f2 = llama_phases
    _, cfg, mb = _measured_setup(f2, tmp_path, 2, 1)
    before = torch.cuda.memory_reserved(0)
    got = measure_apart(f2, cfg, mb, "cuda:0")
    assert got["exact"] and got["forward_ms"] > 0 and got["read_ms"] > 0
    assert torch.cuda.memory_reserved(0) == before          # nothing of it stays in this process
