"""Work no value links to the loss is paced by the pipeline in the runtime too.

A part of the stage graph that no tensor links to the loss's stage (a statistic of the batch the
model returns beside its loss, dead code) waits for no producer and no reader: left alone, the
rank running it takes its forwards as fast as it can, drawing the data of every step it reaches
and holding it until the rest of the rank has caught up. The compiler joins such a part to the
pipeline (:func:`ftcompile.plan.join_unpaced_stages`), but packages of hand-written plans, packages
made before that, and ranks folding several GPUs' stages still hold one. The engine paces each such
stage by a stage of the loss's part on its rank (:mod:`ftcompile.runtime.pacing`).

Checked on real ranks (spawned processes over gloo) and on one folded rank, against the formula of
how far ahead a paced pipeline draws (unpaced: every step's batch before the first update), and
against the same model with the part joined by the compiler: the same losses.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from ftcompile.codegen import generate, write_package
from ftcompile.cluster import load_cluster
from ftcompile.hardware import load_hardware
from ftcompile.plan import Plan, Problem, Stage, evaluate, ordered
from ftcompile.profile import analytic_profile
from ftcompile.runtime import load_package
from ftcompile.runtime.engine import RankEngine, TrainConfig, programs
from ftcompile.trace import trace
from ftcompile.weights import weight_source

from ranks import run_ranks

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class WithStatistic(nn.Module):
    """A regression trunk, and beside the loss a statistic of the batch nobody trains on."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x, y):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        loss = F.mse_loss(self.c(h), y)
        scale = x.abs().amax(dim=0) + 1.0      # reads the input; no value of it reaches the loss
        return loss, scale


def build():
    torch.manual_seed(0)
    return WithStatistic(), (torch.randn(4, 16), torch.randn(4, 4))
'''

STEPS, M = 12, 2


def _packages(out: Path, spec: str) -> dict[str, Path]:
    """The trunk in two stages on GPUs 0 and 1, and three ways to place the statistic:

    - ``lone``: a stage of its own on GPU 0;
    - ``split``: two stages of its own, its first on GPU 1 (beside the loss's stage, which runs one
      forward before each backward where the first runs two under async) and its second on GPU 0;
    - ``joined``: ``split`` as the compiler plans it (:func:`ordered` ties the part to the pipeline).
    """
    from ftcompile.models import ModelOptions, build_model

    built = build_model(spec, ModelOptions())
    graph = trace(built.model, built.args, built.kwargs,
                  source={"model": built.name, "options": dataclasses.asdict(built.options)})
    ops = [n.id for n in graph.op_nodes()]
    loss = next(n.id for n in graph.op_nodes() if n.is_loss)
    # the op nodes with a path to the loss (found here by a plain walk, not by the compiler)
    feeds = {loss}
    for e in reversed(graph.edges):
        if e.dst in feeds and e.src in ops:
            feeds.add(e.src)
    trunk = [n for n in ops if n in feeds]
    side = [n for n in ops if n not in feeds]
    assert len(side) >= 2 and trunk
    half = len(trunk) // 2
    split = Plan("by hand", 2, [Stage(0, 0, trunk[:half]), Stage(1, 1, side[:1]), Stage(2, 1, trunk[half:]),
                                Stage(3, 0, side[1:])])
    plans = {"lone": Plan("by hand", 2, [Stage(0, 0, trunk[:half]), Stage(1, 1, trunk[half:]), Stage(2, 0, side)]),
             "split": split, "joined": ordered(split, graph)}
    assert len(plans["joined"].stages) == 3
    prof = analytic_profile(graph, load_hardware("cpu"))
    out_paths = {}
    for name, plan in plans.items():
        cost = evaluate(Problem(graph, prof, load_cluster("2xcpu").with_overrides(gpus=2)), plan)
        doc = {"format": "ftcompile.plan", "version": 1, "model": graph.source, "graph_hash": graph.content_hash(),
               "schedule": "async", "micro_batches": M, "recompute": None, "chosen": "by hand",
               "plan": plan.to_json(), "profile": {"optimizer": "sgd"},
               "stages": [{"id": c.id, "forward_ms": c.forward_ms, "backward_ms": c.backward_ms} for c in cost.stages]}
        write_package(generate(graph, doc, weight_source(built.model, graph)), doc, out / name)
        out_paths[name] = out / name
    return out_paths


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pacing")
    model = tmp / "model.py"
    model.write_text(MODEL)
    return _packages(tmp, f"{model}:build")


class _Drawn:
    """The batches an engine draws, with how far each is ahead of the rank's oldest unfinished step."""

    def __init__(self, batches, engine: RankEngine):
        self.batches, self.engine, self.ahead = batches, engine, []

    def __iter__(self):
        for j, batch in enumerate(self.batches):
            # the live weights' version of a stage is the number of its updates run
            self.ahead.append(j - min(st.version for st in self.engine.stages.values()))
            yield batch


def _train(run, steps: int) -> dict:
    drawn, losses = _Drawn(run.data, run.engine), []
    run.engine.run(iter(drawn), steps, on_step=lambda rec: losses.append(rec["loss"]) if run.logs else None)
    run.engine.finish()
    return {"ahead": drawn.ahead, "losses": losses}


def _bound(pkg: Path, cfg: TrainConfig) -> int:
    """How many steps ahead of its oldest unfinished step a paced rank may draw: the forwards a
    stage runs before its first backward, in steps, plus the step it is on."""
    progs = programs(load_package(pkg).manifest, cfg, STEPS)
    return math.ceil(max(p.in_flight for p in progs.values()) / cfg.micro_batches) + 1


def _cfg(schedule: str, clip: float | None = None) -> TrainConfig:
    return TrainConfig(schedule=schedule, micro_batches=M, steps=STEPS, optimizer="sgd", lr=0.05, timeout_s=60,
                       clip_grad_norm=clip)


def test_a_lone_stage_draws_no_data_ahead_of_the_pipeline(packages):
    """Unpaced, the statistic's stage on rank 0 drew all 12 steps' batches before the first update."""
    cfg = _cfg("async")
    got = run_ranks(_train, packages["lone"], cfg, world=2, replicas=1, args=(STEPS,))
    for r in got:
        assert max(r["ahead"]) <= _bound(packages["lone"], cfg), r["ahead"]
    assert len(got[1]["losses"]) == STEPS


def test_a_part_paced_on_two_ranks_trains_as_joined_and_waits_for_no_update(packages):
    """The statistic's first stage runs two forwards before each backward, the loss's stage beside
    it one; with clipping every update waits for every stage's gradient norm. Paced forward for
    forward, the statistic would wait for the loss's stage's next step, which waits for the
    statistic's norm: a hang. It may run the forward its program needs ahead of its pacer."""
    cfg = _cfg("async", clip=1.0)
    got = run_ranks(_train, packages["split"], cfg, world=2, replicas=1, args=(STEPS,))
    ref = run_ranks(_train, packages["joined"], cfg, world=2, replicas=1, args=(STEPS,))
    for r in got:
        assert max(r["ahead"]) <= _bound(packages["split"], cfg), r["ahead"]
    assert len(got[1]["losses"]) == STEPS and got[1]["losses"] == ref[1]["losses"]


def _folded(pkg: Path, cfg: TrainConfig) -> dict:
    """Every stage on one rank, in this process."""
    from ftcompile.runtime.data import load_dataset

    engine = RankEngine(load_package(pkg), cfg)
    drawn = _Drawn(iter(load_dataset("synthetic", engine.m, micro_batches=M, seed=cfg.seed)), engine)
    records = engine.run(iter(drawn), STEPS)
    return {"ahead": drawn.ahead, "losses": [r["loss"] for r in records]}


@pytest.mark.parametrize("schedule", ["async", "1f1b", "pipedream"])
def test_stages_of_two_gpus_folded_onto_one_rank_are_paced_by_the_loss_stage(packages, schedule):
    """One rank runs every stage: the statistic's stages are paced by the loss's stage there, the
    first of them two forwards to its one (async, pipedream), with clipping. Forward for forward
    that hung (async, pipedream); it trains as the joined plan does, drawing no further ahead."""
    cfg = _cfg(schedule, clip=1.0)
    for name in ("lone", "split"):
        got, ref = _folded(packages[name], cfg), _folded(packages["joined"], cfg)
        assert max(got["ahead"]) <= _bound(packages[name], cfg), (name, got["ahead"])
        assert got["losses"] == ref["losses"] and len(got["losses"]) == STEPS


@pytest.mark.parametrize("alpha", [None, "default"], ids=["replicas", "avgpipe"])
def test_a_lone_stage_is_paced_in_each_of_two_pipelines_and_trains_as_joined(packages, alpha):
    """Two copies of the pipeline on four ranks: plain replicas (gradients averaged per stage) and
    AvgPipe's parallel pipelines (weights pulled toward their mean each step). No clipping: the
    global norm's exchange at each update would hold the statistic back by itself. Each
    copy paces its own statistic by the trunk's stage on its rank: every rank stays within the
    bound (unpaced: 10 steps ahead), and the losses are those of the plan the compiler joins."""
    cfg = _cfg("async")
    got = run_ranks(_train, packages["lone"], cfg, world=4, replicas=2, alpha=alpha, args=(STEPS,))
    ref = run_ranks(_train, packages["joined"], cfg, world=4, replicas=2, alpha=alpha, args=(STEPS,))
    for r in got:
        assert max(r["ahead"]) <= _bound(packages["lone"], cfg), r["ahead"]
    logged = [r["losses"] for r in got if r["losses"]]
    assert len(logged) >= 1 and all(len(x) == STEPS for x in logged)
    assert logged == [r["losses"] for r in ref if r["losses"]]
