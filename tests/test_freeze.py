"""Elastic freeze training (PipeTransformer): Eq. 1, frozen regions and their prices, phases.

The equivalence tests run ``ftcompile run --freeze`` with a manual schedule on 4 real ranks over
gloo (a 4-GPU pipeline, then 2 replicas of a 2-GPU one as layers freeze) and compare the final
checkpoint with plain single-process PyTorch: the original model, whose embeddings and first
layers the test freezes by hand (``requires_grad_(False)``, ``eval()``) at the same steps, trained
with gradient accumulation on the same samples and dropout masks.
"""

from __future__ import annotations

import json
import math
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
    assert s.at == [(20, 1, 2), (40, 2, None)] and s.strategy == "seq" and s.layers == ["BertLayer"]
    for bad, msg in [("alpha=2,every=3", "between 0 and 1"), ("alpha=1/3", "needs both"),
                     ("at=4:2+2:3", "must not decrease|distinct"), ("at=3:2+5:1", "must not decrease"),
                     ("at=2-1", "STEP:LAYERS"), ("speed=fast", "unknown key"),
                     ("at=2:1,alpha=1/3,every=2", "either")]:
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


# --------------------------------------------------------------------------- equivalence

def _package(out: Path, name: str, gpus: int) -> Path:
    built, graph, prof = traced(name)
    cluster = load_cluster("2xcpu").with_overrides(gpus=gpus)
    result = compile_plan(Problem(graph, prof, cluster, schedule="1f1b", micro_batches=4), "seq", jobs=1)
    assert result.best().plan.num_gpus == gpus
    return _write(out, name, plan_document(result, model=graph.source))


def freeze_reference(package: Path, schedule: dict[int, list[str]], steps: int, *, M: int, lr: float,
                     seed: int = 0, norms_of: list[str] = (), norms: dict | None = None) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the original model, freezing the named submodules at the given steps
    (``norms[step][layer]``: each of ``norms_of``'s gradient norms before each update)."""
    from ftcompile.codegen import rebuild_model
    from ftcompile.runtime import optim
    from ftcompile.runtime.data import load_dataset, split_micro_batches
    from ftcompile.runtime.engine import micro_batch_seed
    from ftcompile.runtime.ops import keyed_random_mode

    m = load_package(package).manifest
    model = rebuild_model(m.model | {"model": m.model["name"]}).model
    model.train(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, _ = optim.build(params, optim.OptimConfig("momentum", lr, 0.9, (0.9, 0.999), 1e-8, 0.0, "constant", 0,
                                                   steps))
    batches = load_dataset("synthetic", m, micro_batches=M, seed=seed)
    for j in range(steps):
        for path in schedule.get(j, []):
            mod = model.get_submodule(path)
            mod.requires_grad_(False)
            mod.eval()
        for i, mb in enumerate(split_micro_batches(next(batches), m, M)):
            args, kwargs = call_of(m, mb)
            with keyed_random_mode(micro_batch_seed(seed, j * M + i)):
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


def test_freeze_run_refuses_what_it_cannot_do_before_any_rank_starts(bert4, tmp_path):
    for extra, msg in [(["--nproc", "2", "--freeze", "alpha=1/3,every=2"], "multiple of 4"),
                       (["--schedule", "async", "--freeze", "alpha=1/3,every=2"], "gpipe, 1f1b"),
                       (["--freeze", "alpha=1/3"], "needs both"),
                       (["--freeze", "at=2:3"], "has 2 layers")]:
        r = run_cli(str(bert4), "--steps", "4", "--log-dir", str(tmp_path / "log"), *extra, timeout=300)
        assert r.returncode == 2 and msg in r.stderr, (extra, r.stderr[-2000:])
        assert "Traceback" not in r.stderr
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
