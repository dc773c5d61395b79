"""Weights shared by several stages (ALBERT's one layer reused by every layer, GPT-2's tied embedding).

Every holder of a shared tensor sums all holders' gradients and takes the same step; these tests
place several holders on one rank, and run with fewer ranks than the plan has GPUs, under every
schedule. The reference is either plain single-process training of the original model
(synchronous schedules) or the single-process reference of the schedule's weight versions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ftcompile.cluster import load_cluster
from ftcompile.codegen import example_input_ranges, generate, write_package
from ftcompile.plan import Problem, evaluate, ordered
from ftcompile.runtime import load_package
from ftcompile.runtime.data import load_dataset
from ftcompile.runtime.engine import RankEngine, TrainConfig, stage_ranks
from ftcompile.runtime.reference import reference_train
from ftcompile.weights import weight_source

from test_codegen import interleaved_plan
from test_runtime import cli_args, final_weights, plain_training, rel_error, run_cli

ALBERT = str(Path(__file__).parent / "userfiles" / "albert_tiny.py") + ":build"


def _traced(name: str):
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.hardware import load_hardware
    from ftcompile.profile import analytic_profile
    from ftcompile.trace import trace

    built = build_model(name, ModelOptions())
    graph = trace(built.model, built.args, built.kwargs,
                  source={"model": built.name, "options": dataclasses.asdict(built.options)})
    return built, graph, analytic_profile(graph, load_hardware("cpu"))


@pytest.fixture(scope="module")
def albert_package(tmp_path_factory):
    """ALBERT in 6 stages on 3 GPUs (stage i on GPU i mod 3): the shared layer has holders on every
    GPU, two per GPU."""
    built, graph, prof = _traced(ALBERT)
    plan = ordered(interleaved_plan(graph, stages=6, gpus=3), graph)
    cost = evaluate(Problem(graph, prof, load_cluster("2xcpu").with_overrides(gpus=3)), plan)
    doc = {"format": "ftcompile.plan", "version": 1, "model": graph.source, "graph_hash": graph.content_hash(),
           "schedule": "1f1b", "micro_batches": 4, "recompute": None, "chosen": "by-hand",
           "plan": plan.to_json(), "profile": {"optimizer": "adam"},
           "stages": [{"id": c.id, "forward_ms": c.forward_ms, "backward_ms": c.backward_ms} for c in cost.stages]}
    out = tmp_path_factory.mktemp("albert") / "pkg"
    write_package(generate(graph, doc, weight_source(built.model, graph), input_ranges=example_input_ranges(built)),
                  doc, out)
    return out


def _assert_close(got: dict[int, dict[str, torch.Tensor]], want: dict[str, torch.Tensor]) -> None:
    """Every stage's copy of every expected tensor matches, relative to the tensor's own scale with a
    floor: attention key biases start at zero and get gradients that are zero in exact arithmetic,
    so their values are rounding noise on both sides."""
    seen = set()
    for sid, w in got.items():
        for n, t in w.items():
            if n in want:
                seen.add(n)
                err = float((t - want[n]).abs().max()) / max(float(want[n].abs().max()), 1e-2)
                assert err < 2e-5, f"stage {sid}: {n} differs by {err:.2e}"
    assert seen == set(want), sorted(set(want) - seen)[:5]


def _holders_per_rank(m, world: int) -> dict[str, dict[int, int]]:
    ranks = stage_ranks(m, world)
    out = {}
    for name, holders in m.shared_params().items():
        per: dict[int, int] = {}
        for h in holders:
            per[ranks[h]] = per.get(ranks[h], 0) + 1
        out[name] = per
    return out


def test_albert_plan_puts_several_holders_on_each_rank(albert_package):
    m = load_package(albert_package).manifest
    layer = [n for n in m.shared_params() if "albert_layers.0.attention.query.weight" in n]
    assert layer, sorted(m.shared_params())[:5]
    assert _holders_per_rank(m, 3)[layer[0]] == {0: 2, 1: 2, 2: 2} or \
        max(_holders_per_rank(m, 3)[layer[0]].values()) >= 2


@pytest.mark.parametrize("schedule", ["1f1b", "async", "2bw", "pipedream", "gpipe", "2gw"])
def test_one_rank_holding_every_stage_matches_reference(albert_package, schedule):
    """--nproc 1 for a 3-GPU plan: all six holders of the shared layer on one rank."""
    pkg = load_package(albert_package)
    cfg = TrainConfig(schedule=schedule, micro_batches=4 if schedule not in ("2bw", "2gw") else 6, steps=3,
                      optimizer="adam", lr=1e-3, seed=3)
    engine = RankEngine(pkg, cfg)
    recs = engine.run(load_dataset("synthetic", pkg.manifest, micro_batches=cfg.micro_batches, seed=cfg.seed),
                      cfg.steps, on_step=lambda r: None)
    ref = reference_train(pkg, load_dataset("synthetic", pkg.manifest, micro_batches=cfg.micro_batches,
                                            seed=cfg.seed), cfg, cfg.steps)
    assert [r["loss"] for r in recs] == pytest.approx(ref.losses, rel=1e-6)
    shared = pkg.manifest.shared_params()
    for sid, w in ref.weights.items():
        live = dict(engine.modules[sid].named_parameters())
        for n, t in w.items():
            assert rel_error(live[n].detach(), t) < 1e-6, (sid, n)
    # the copies of every shared tensor are identical, bit for bit
    for name, holders in shared.items():
        copies = [dict(engine.modules[h].named_parameters())[name].detach() for h in holders]
        assert all(torch.equal(copies[0], c) for c in copies[1:]), name


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3, 2])
def test_albert_trains_like_the_model_on_several_ranks(albert_package, tmp_path, nproc):
    """Real ranks over gloo; 1f1b equals plain training of the original ALBERT with gradient accumulation."""
    # SGD with momentum: attention key biases get (exactly) zero gradients, which Adam would turn
    # into steps of rounding noise on either side.
    cfg = TrainConfig(schedule="1f1b", micro_batches=4, steps=3, optimizer="momentum", lr=0.05, seed=1)
    r = run_cli(*cli_args(cfg, albert_package, tmp_path, nproc=nproc))
    assert r.returncode == 0, r.stderr
    want = plain_training(albert_package, cfg, cfg.steps)
    got = final_weights(tmp_path / "ckpt")
    _assert_close(got, want)
    for name, holders in load_package(albert_package).manifest.shared_params().items():
        copies = [got[h][name] for h in holders]
        assert all(torch.equal(copies[0], c) for c in copies[1:]), name


@pytest.mark.slow
def test_albert_async_on_three_ranks_matches_reference(albert_package, tmp_path):
    from test_runtime import losses

    cfg = TrainConfig(schedule="async", micro_batches=4, steps=3, optimizer="momentum", lr=0.05, seed=2)
    r = run_cli(*cli_args(cfg, albert_package, tmp_path, nproc=3))
    assert r.returncode == 0, r.stderr
    pkg = load_package(albert_package)
    ref = reference_train(pkg, load_dataset("synthetic", pkg.manifest, micro_batches=4, seed=cfg.seed), cfg,
                          cfg.steps)
    _assert_close(final_weights(tmp_path / "ckpt"),
                  {n: t for w in ref.weights.values() for n, t in w.items()})
    assert losses(tmp_path / "log") == pytest.approx(ref.losses, rel=1e-5)
