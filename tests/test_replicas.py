"""Replicated pipelines: R replicas of a P-stage pipeline train as one process on R x the batch.

Real ranks over gloo (and MPI when present) run R = 2 replicas of a 2-stage gpt2-tiny pipeline;
under gpipe and 1f1b their weights must equal plain single-process training of the original
model on the doubled batch (gradient accumulation over R x M micro-batches), and under the
asynchronous schedules the schedule's single-process reference with every micro-batch's
gradient averaged over the replicas. Copies of tied weights stay identical across stages and
replicas, bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ftcompile.runtime import load_package
from ftcompile.runtime.engine import TrainConfig
from ftcompile.runtime.layout import LayoutError, RankLayout

from ranks import RankRun, run_ranks, to_numpy, to_torch
from test_runtime import compiled, plain_training


def _train(r: RankRun) -> tuple:
    losses = []
    r.engine.run(r.data, r.cfg.steps, on_step=lambda rec: losses.append(rec["loss"]) if r.logs else None)
    r.engine.finish()
    return r.rank, r.layout.replica, to_numpy(r.engine.state()), losses if r.logs else None


def run_replicas(pkg: Path, cfg: TrainConfig, replicas: int, world: int, order: str = "pipeline-major"):
    """Per rank: (rank, replica, weights by stage, losses on the log rank)."""
    res = run_ranks(_train, pkg, cfg, world=world, replicas=replicas, order=order, timeout=600)
    return [(rank, rep, to_torch(ws), losses) for rank, rep, ws, losses in res]


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-2)


@pytest.fixture(scope="module")
def seq2(tmp_path_factory):
    return compiled(tmp_path_factory.mktemp("rep") / "seq", "gpt2-tiny", "seq", 2)


def test_layout_places_replicas_both_ways():
    from ftcompile.runtime.manifest import Manifest  # noqa: F401 - the layout reads only stage GPUs

    pm = [RankLayout(4, 2, r, "pipeline-major") for r in range(4)]
    rm = [RankLayout(4, 2, r, "replica-major") for r in range(4)]
    assert [x.replica for x in pm] == [0, 0, 1, 1] and [x.replica for x in rm] == [0, 1, 0, 1]
    with pytest.raises(LayoutError, match="choose --replicas"):
        RankLayout(4, 3, 0)


@pytest.mark.parametrize("schedule,order", [("1f1b", "pipeline-major"),
                                            pytest.param("gpipe", "replica-major", marks=pytest.mark.slow)])
def test_two_replicas_of_two_stages_equal_one_process_on_the_doubled_batch(seq2, schedule, order):
    cfg = TrainConfig(schedule=schedule, micro_batches=2, steps=3, optimizer="momentum", lr=0.05, seed=4)
    res = run_replicas(seq2, cfg, replicas=2, world=4, order=order)
    want = plain_training(seq2, replace(cfg, micro_batches=4), cfg.steps)
    tied = {}
    for rank, replica, weights, _ in res:
        for sid, w in weights.items():
            for n, t in w.items():
                if n in want:
                    assert _close(t, want[n]) < 2e-5, (rank, sid, n, _close(t, want[n]))
                tied.setdefault(n, []).append(t)
    for n, copies in tied.items():      # every copy, on every stage and replica, bit for bit
        assert all(torch.equal(copies[0], c) for c in copies[1:]), n
    losses = [x[3] for x in res if x[3] is not None]
    assert len(losses) == 1 and len(losses[0]) == cfg.steps


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["async", "pipedream", "2bw", "2gw"])
def test_asynchronous_replicas_match_the_reference_with_averaged_gradients(seq2, schedule):
    """Asynchronous schedules with replicas: every update averages the replicas' gradients of the
    same micro-batches (the schedule's weight versions unchanged), as the single-process reference
    of the schedule does on the R x M micro-batches."""
    from ftcompile.runtime.data import load_dataset
    from ftcompile.runtime.reference import reference_train

    cfg = TrainConfig(schedule=schedule, micro_batches=2, steps=3, optimizer="momentum", lr=0.05, seed=5)
    res = run_replicas(seq2, cfg, replicas=2, world=4)
    pkg = load_package(seq2)
    ref = reference_train(pkg, load_dataset("synthetic", pkg.manifest, micro_batches=4, seed=cfg.seed), cfg,
                          cfg.steps, replicas=2)
    want = {n: t for w in ref.weights.values() for n, t in w.items()}
    for rank, replica, weights, _ in res:
        for sid, w in weights.items():
            for n, t in w.items():
                if n in want:
                    assert _close(t, want[n]) < 2e-5, (rank, sid, n)


# --------------------------------------------------------------------------- compile: the (P, R) table

@pytest.fixture(scope="module")
def replicated_out(tmp_path_factory):
    from ftcompile.cli import main

    out = tmp_path_factory.mktemp("pr") / "o"
    assert main(["compile", "gpt2-tiny", "--cluster", "2xcpu", "--gpus", "4", "--strategy", "uniform,seq", "-q", "-o", str(out),
                 "--cache-dir", str(out.parent / "c")]) == 0
    return out


def test_compile_plans_every_pipeline_length_and_keeps_the_fastest(replicated_out):
    import json

    doc = json.loads((replicated_out / "plan.json").read_text())
    rep = doc["replicas"]
    rows = rep["options"]
    assert {(o["pipeline_gpus"], o["replicas"]) for o in rows} == {(4, 1), (2, 2), (1, 4)}
    # on 2 hosts x 2 GPUs, a 2-GPU pipeline can sit inside a host or across: both orders are planned
    assert {o["order"] for o in rows if o["replicas"] == 2} == {"pipeline-major", "replica-major"}
    feasible = [o for o in rows if o["feasible"]]
    best = max(feasible, key=lambda o: o["throughput"])
    chosen = rows[rep["chosen"]]
    assert chosen["throughput"] == best["throughput"]
    # what was chosen is what was written: the plan's GPUs, the package's layout
    assert doc["layout"]["replicas"] == chosen["replicas"] == doc["package"]["replicas"]
    assert doc["plan"]["num_gpus"] == chosen["pipeline_gpus"] == doc["package"]["num_gpus"]
    assert doc["package"]["rank_order"] == chosen["order"]
    assert abs(doc["simulation"]["throughput_samples_per_s"] - chosen["throughput"]) < 1e-3
    # cross-host bytes, counted independently: 2 hosts of 2 GPUs (GPUs 0,1 | 2,3)
    stages = {s["id"]: s["gpu"] for s in doc["plan"]["stages"]}
    for o in rows:
        if o["feasible"] and o["replicas"] == 2 and o["pipeline_gpus"] == 2:
            # pipeline-major: replica r on GPUs 2r, 2r+1 (one host): no pipeline traffic across hosts,
            # and each ring (GPU p of both replicas) crosses hosts on both links
            if o["order"] == "pipeline-major":
                assert o["pipeline_cross_host_bytes_per_step"] == 0
                assert o["allreduce_cross_host_bytes_per_step"] == o["allreduce_bytes_per_step"] > 0
            else:   # replica-major: a pipeline spans both hosts, its ring stays on one
                assert o["allreduce_cross_host_bytes_per_step"] == 0
                assert o["pipeline_cross_host_bytes_per_step"] == o["pipeline_bytes_per_step"]
    assert len(set(stages.values())) == chosen["pipeline_gpus"]
    report = (replicated_out / "report.md").read_text()
    assert "## replicas" in report and "(chosen)" in report.split("## replicas")[1]


def test_simulate_reads_the_replicated_plan_back(replicated_out, capsys):
    import json

    from ftcompile.cli import main

    doc = json.loads((replicated_out / "plan.json").read_text())
    capsys.readouterr()
    assert main(["simulate", str(replicated_out), "--json", "-o", str(replicated_out / "t.png")]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["replicas"] == (doc["layout"]["replicas"] if doc.get("layout") else 1)
    assert abs(sim["throughput_samples_per_s"] - doc["simulation"]["throughput_samples_per_s"]) < 1e-3


def test_replicas_that_do_not_divide_the_gpus_are_refused_before_tracing(tmp_path, capsys):
    from ftcompile.cli import main

    rc = main(["compile", "gpt2-tiny", "--gpus", "4", "--replicas", "3", "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "--replicas 3 does not divide" in err and "1, 2, 4" in err
    assert not (tmp_path / "o").exists()


def test_ring_all_reduce_time_is_the_ring_formula():
    from ftcompile.replicas import allreduce_ms

    # a ring of R: each member sends 2 (R - 1) chunks of n / R bytes
    for R, n, bw in [(2, 4e6, 1e9), (4, 1e8, 25e9), (8, 3.3e9, 300e9)]:
        assert allreduce_ms(n, R, bw) == pytest.approx(2 * (R - 1) * (n / R) / bw * 1e3)
    assert allreduce_ms(1e9, 1, 1e9) == 0.0
