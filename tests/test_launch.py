"""Launching runs: replicas from the rank count, torchrun across "hosts", mpirun, and run options.

Real processes: ``ftcompile run`` (torch's elastic agent), two ``torchrun`` launchers meeting at a
c10d rendezvous on 127.0.0.1 as two hosts would, and ``mpirun`` over the MPI transport. A
gpt2-tiny package planned for 2 GPUs runs on 4 ranks as 2 replicas x 2 stages; its weights are
compared with the original model trained by a plain PyTorch loop on the doubled batch
(``test_runtime.plain_training``: gradient accumulation over R x M micro-batches).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ftcompile.runtime import checkpoint as ckpt
from ftcompile.runtime import load_package
from ftcompile.runtime.engine import TrainConfig
from ftcompile.runtime.launch import free_port

from test_faults import LIMIT, log_records
from test_runtime import compiled, plain_training, run_cli

PY = sys.executable
CFG = TrainConfig(schedule="1f1b", micro_batches=2, steps=3, optimizer="momentum", lr=0.05, seed=3)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return compiled(tmp_path_factory.mktemp("launch") / "seq", "gpt2-tiny", "seq", 2)


def options(pkg: Path, out: Path, cfg: TrainConfig = CFG, *extra: str) -> list[str]:
    """The training options every launcher passes on (no --nproc)."""
    return [str(pkg), "--schedule", cfg.schedule, "--micro-batches", str(cfg.micro_batches), "--steps",
            str(cfg.steps), "--optimizer", cfg.optimizer, "--lr", repr(cfg.lr), "--seed", str(cfg.seed),
            "--checkpoint-dir", str(out / "ckpt"), "--log-dir", str(out / "log"), "--progress", "off",
            "--timeout", "120", *extra]


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r


def refused(r: subprocess.CompletedProcess, *says: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    for s in says:
        assert s in r.stderr, (s, r.stderr)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-2)


def assert_doubled_batch(out: Path, pkg: Path, cfg: TrainConfig = CFG) -> dict[str, torch.Tensor]:
    """The checkpoint in ``out`` holds the model trained on R=2 x M micro-batches per step."""
    got = ckpt.load_weights(ckpt.latest(out / "ckpt"))
    want = plain_training(pkg, replace(cfg, micro_batches=2 * cfg.micro_batches), cfg.steps)
    assert set(want) <= set(got)
    for n, t in want.items():
        assert rel(got[n], t) < 2e-5, (n, rel(got[n], t))
    return got


def shards(out: Path) -> list[str]:
    return sorted(p.name for p in ckpt.latest(out / "ckpt").folder.glob("*.safetensors"))


# --------------------------------------------------------------------------- ftcompile run --nproc G

def test_more_ranks_than_planned_gpus_train_replicas_and_checkpoint_each_stage_once(pkg, tmp_path):
    r = ok(run_cli(*options(pkg, tmp_path), "--nproc", "4", timeout=LIMIT))
    assert "4 ranks: 2 replicas of a 2-rank pipeline, pipeline-major" in r.stderr, r.stderr
    assert_doubled_batch(tmp_path, pkg)
    # once per stage: replica 0's two ranks write, replica 1's ranks only compare their copies
    assert shards(tmp_path) == ["shard-00001-model-00001-of-00001.safetensors",
                                "shard-00002-model-00001-of-00001.safetensors"]
    meta = json.loads((ckpt.latest(tmp_path / "ckpt").folder / "meta.json").read_text())
    assert meta["replicas"] == 2 and meta["world_size"] == 4
    recs = log_records(tmp_path / "log" / "train.jsonl")
    assert [x["step"] for x in recs] == [0, 1, 2] and all(x["replicas"] == 2 for x in recs)
    assert all(len(x["ranks"]) == 4 for x in recs)


@pytest.mark.parametrize("extra,says", [
    (["--nproc", "3"], "3 ranks make no whole number of pipelines"),
    (["--nproc", "4", "--replicas", "3"], "--replicas 3 does not divide 4 ranks"),
    (["--nproc", "4", "--replicas", "1"], "ranks beyond 2 per pipeline would hold no stage"),
    (["--nproc", "4", "--replicas", "0"], "--replicas must be at least 1"),
])
def test_rank_counts_that_make_no_pipelines_are_refused_before_any_rank_starts(pkg, tmp_path, extra, says):
    refused(run_cli(*options(pkg, tmp_path), *extra), says)
    assert not (tmp_path / "log").exists() and not (tmp_path / "ckpt").exists()


def test_a_checkpoint_of_two_replicas_resumes_into_one_and_into_two(pkg, tmp_path):
    """Save at R=2, resume at R=1 (2 x M micro-batches per step: the same global batch) and at R=2:
    both go on as the uninterrupted R=2 run, loss for loss and weight for weight."""
    cfg = replace(CFG, steps=4)
    whole = tmp_path / "whole"
    ok(run_cli(*options(pkg, whole, cfg), "--nproc", "4", "--checkpoint-every", "2", timeout=LIMIT))
    want_losses = {x["step"]: x["loss"] for x in log_records(whole / "log" / "train.jsonl")}
    want = ckpt.load_weights(ckpt.latest(whole / "ckpt"))
    part = tmp_path / "part"
    ok(run_cli(*options(pkg, part, replace(cfg, steps=2)), "--nproc", "4", timeout=LIMIT))
    for replicas in (1, 2):
        out = tmp_path / f"r{replicas}"
        shutil.copytree(part / "ckpt", out / "ckpt")
        a = options(pkg, out, cfg)
        del a[a.index("--micro-batches"):a.index("--micro-batches") + 2]   # the checkpoint's global batch
        r = ok(run_cli(*a, "--nproc", str(2 * replicas), "--resume", timeout=LIMIT))
        if replicas == 1:
            assert "2 -> 1 replicas: 4 micro-batches per replica keep the checkpoint's 4 micro-batches per step" \
                in r.stderr, r.stderr
        got_losses = {x["step"]: x["loss"] for x in log_records(out / "log" / "train.jsonl")}
        assert sorted(got_losses) == [2, 3], got_losses
        for step, loss in got_losses.items():
            assert abs(loss - want_losses[step]) < 1e-5 * abs(want_losses[step]), (replicas, step, loss)
        got = ckpt.load_weights(ckpt.latest(out / "ckpt"))
        assert set(got) == set(want)
        for n in want:
            assert rel(got[n], want[n]) < 2e-5, (replicas, n, rel(got[n], want[n]))


# --------------------------------------------------------------------------- across hosts

def torchrun_hosts(pkg: Path, out: Path, *, nodes: int = 2, per_node: int = 2) -> list[list[str]]:
    """The command of each host: ``torchrun --nnodes 2 --nproc-per-node 2`` at one c10d rendezvous."""
    port = free_port()
    return [[PY, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ftc-test",
             "-m", "ftcompile.runtime", *options(pkg, out)] for _ in range(nodes)]


def test_two_torchrun_launchers_at_one_rendezvous_train_two_replicas(pkg, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    hosts = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for cmd in torchrun_hosts(pkg, tmp_path)]
    outs = []
    try:
        for h in hosts:
            outs.append(h.communicate(timeout=LIMIT))
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
    for h, (o, e) in zip(hosts, outs):
        assert h.returncode == 0, o + e
        assert "Traceback" not in e, e
    assert_doubled_batch(tmp_path, pkg)
    assert len(shards(tmp_path)) == 2
    assert all(x["world_size"] == 4 and x["replicas"] == 2 for x in log_records(tmp_path / "log" / "train.jsonl"))


def _mpi_missing() -> str | None:
    if shutil.which("mpirun") is None:
        return "needs Open MPI's mpirun (Debian: openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "needs mpi4py (pip install mpi4py)"
    return None


def mpirun_command(pkg: Path, out: Path, np: int = 4) -> list[str]:
    cmd = ["mpirun", "-np", str(np), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")      # Open MPI refuses root without it
    return cmd + [PY, "-m", "ftcompile.runtime", *options(pkg, out), "--transport", "mpi"]


@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
def test_mpirun_four_ranks_train_two_replicas_over_mpi(pkg, tmp_path):
    r = subprocess.run(mpirun_command(pkg, tmp_path), capture_output=True, text=True, timeout=LIMIT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    ok(r)
    assert_doubled_batch(tmp_path, pkg)
    assert len(shards(tmp_path)) == 2


# --------------------------------------------------------------------------- run options

def test_a_nan_loss_stops_the_run_naming_step_and_stage(pkg, tmp_path):
    r = run_cli(*options(pkg, tmp_path, replace(CFG, optimizer="sgd", lr=1e36, steps=4)), "--nproc", "2")
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1, r.stderr
    assert "the loss is nan at step 1" in r.stderr and "computed by stage 1" in r.stderr, r.stderr
    assert "--on-nonfinite skip" in r.stderr
    assert ckpt.latest(tmp_path / "ckpt") is None


def test_on_nonfinite_skip_skips_every_update_of_a_nan_step(pkg, tmp_path):
    """lr 1e36: step 0 trains (finite loss) and ruins the weights; steps 1-3 have NaN losses and are
    skipped on every stage, so the final weights are those of one plain SGD step."""
    from test_checkpoint import plain_training as plain_sgd

    cfg = replace(CFG, optimizer="sgd", lr=1e36, steps=4)
    ok(run_cli(*options(pkg, tmp_path, cfg), "--nproc", "2", "--on-nonfinite", "skip"))
    recs = log_records(tmp_path / "log" / "train.jsonl")
    assert [x["step"] for x in recs] == [0, 1, 2, 3]
    assert not recs[0].get("skipped") and recs[0]["loss"] is not None
    assert all(x.get("skipped") and x["loss"] is None and x["loss_not_finite"] == "nan" for x in recs[1:]), recs
    got = ckpt.load_weights(ckpt.latest(tmp_path / "ckpt"))
    want = plain_sgd(pkg, [cfg.lr], momentum=0.0, seed=cfg.seed, M=cfg.micro_batches)
    for n, t in want.items():
        assert rel(got[n], t) < 2e-5, (n, rel(got[n], t))


def test_measure_memory_logs_each_ranks_measured_peak(pkg, tmp_path):
    ok(run_cli(*options(pkg, tmp_path), "--nproc", "2", "--measure-memory"))
    recs = log_records(tmp_path / "log" / "train.jsonl")
    package = load_package(pkg)
    held = {}     # bytes of the weights each rank holds, and the momentum buffer of each trainable one
    for s in package.manifest.stages:
        mod = package.build_stage(s.id, "cpu")
        held[str(s.gpu)] = held.get(str(s.gpu), 0) + sum(
            t.numel() * t.element_size() * (2 if t.requires_grad else 1) for t in mod.parameters())
    for x in recs[1:]:    # from step 1 on, the momentum buffers exist
        assert x["memory_measured"].startswith("tensors"), x
        for r, info in x["ranks"].items():
            # the rank's own tensor count: at least its weights and momenta, far below the process's RSS
            assert held[r] <= info["memory_bytes"] < 50 * held[r], (r, info["memory_bytes"], held[r])


def test_advance_runs_avgpipe_as_plain_training(pkg, tmp_path):
    """avgpipe with 2 micro-batches forwarded in advance is still a flush schedule: the weights are
    those of plain gradient accumulation; --advance elsewhere is pointless and warned about."""
    cfg = replace(CFG, schedule="avgpipe", micro_batches=4)
    ok(run_cli(*options(pkg, tmp_path, cfg), "--nproc", "2", "--advance", "2"))
    got = ckpt.load_weights(ckpt.latest(tmp_path / "ckpt"))
    for n, t in plain_training(pkg, cfg, cfg.steps).items():
        assert rel(got[n], t) < 2e-5, n
    r = run_cli(*options(pkg, tmp_path / "b", replace(cfg, steps=1, schedule="1f1b")), "--nproc", "2",
                "--advance", "1")
    assert "warning: --advance does nothing under --schedule 1f1b" in ok(r).stderr
    refused(run_cli(*options(pkg, tmp_path / "c", cfg), "--advance=-1"), "--advance must be 0 or more")
