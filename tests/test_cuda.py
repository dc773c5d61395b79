"""On a real GPU: measured profiles time what the GPU does, packages train on CUDA as on the CPU,
and each rank's CUDA allocator stays within the plan's figure for its GPU.

Every test here needs one CUDA GPU (``pytest -m cuda``); two ranks of a two-GPU plan share it when
the machine has one (each process has its own caching allocator, so each rank's peak is its own),
and their tensors cross through pinned host buffers over gloo, the path a run takes when NCCL is
not used. ``tests/test_transport.py`` has the two-GPU NCCL test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftcompile.cluster import load_cluster
from ftcompile.hardware import load_hardware
from ftcompile.models import ModelOptions, build_model
from ftcompile.plan import Problem, evaluate, ordered
from ftcompile.profile import graph_input_values, host_params, measured_profile
from ftcompile.trace import trace

from test_codegen import interleaved_plan, package_for_plan, traced

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REPO = Path(__file__).resolve().parents[1]


def _run(pkg: Path, log: Path, *args: str, timeout: int = 600) -> list[dict]:
    """``ftcompile run`` as a user types it; the step records of its log."""
    cmd = [sys.executable, "-m", "ftcompile", "run", str(pkg), "--log-dir", str(log), "--progress", "off", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (log / "train.jsonl").read_text().splitlines()
            if line.strip() and '"step"' in line]


def test_measured_profile_on_cuda_swaps_and_times_what_the_gpu_does():
    """Host swapping keeps one node's tensors on the GPU at a time: the profiler's device peak stays
    below the model's weights alone (gpt2-medium: 1.4 GB of weights, its largest node, the tied
    lm_head with its gradient and logits, about 0.7 GB), which the whole model on the device could
    not. Node times are synchronised with the GPU: no node runs faster than the fastest GPU made
    could run its FLOPs (2 PFLOP/s, whatever the dtype)."""
    built = build_model("gpt2-medium", ModelOptions(batch_size=2, seq_len=256))
    graph = trace(built.model, built.args, built.kwargs, source={"model": built.name})
    params = host_params(graph, built.model)
    prof = measured_profile(graph, params, graph_input_values(graph, built.args, built.kwargs),
                            device="cuda", warmup=1, repeats=3)
    weights = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in params.values()}.values())
    assert 0 < prof.info["peak_device_bytes"] < weights, (prof.info["peak_device_bytes"], weights)
    timed = [prof.nodes[n.id] for n in graph.op_nodes() if n.id in prof.nodes]
    assert all(c.forward_ms >= 0 and c.backward_ms >= 0 for c in timed)
    big = max(timed, key=lambda c: c.flops_forward)
    assert big.flops_forward > 5e10, big          # the lm_head product: 2 * 2*256 * 1024 * 50257
    assert big.forward_ms >= big.flops_forward / 2e15 * 1e3, big
    assert big.backward_ms >= big.flops_backward / 2e15 * 1e3, big


def test_package_trains_on_cuda_as_on_the_cpu(tmp_path):
    """The same package, data and seed: two ranks on CUDA (tensors staged through pinned host
    buffers) give the CPU run's losses, step by step."""
    built, graph, _ = traced("gpt2-tiny")
    pkg = package_for_plan(tmp_path / "pkg", "gpt2-tiny", interleaved_plan(graph, stages=4, gpus=2))
    common = ["--nproc", "2", "--steps", "4", "--schedule", "1f1b", "--micro-batches", "4", "--no-dropout",
              "--optimizer", "adam", "--lr", "1e-3"]
    cpu = _run(pkg, tmp_path / "cpu", *common, "--device", "cpu")
    gpu = _run(pkg, tmp_path / "gpu", *common, "--device", "cuda", "--transport", "gloo")
    assert len(cpu) == len(gpu) == 4
    for a, b in zip(cpu, gpu):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["loss"], b["loss"])


def test_verify_on_cuda(tmp_path):
    from test_codegen import assert_verified
    built, graph, _ = traced("gpt2-tiny")
    pkg = package_for_plan(tmp_path / "pkg", "gpt2-tiny", interleaved_plan(graph, stages=3, gpus=3))
    assert_verified(pkg, device="cuda")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """gpt2-small (8 x 256 tokens per micro-batch) in 4 stages on 2 GPUs, stages 0 and 2 on GPU 0: the
    weights, optimizer state and activations are hundreds of MB, well above cuBLAS's workspaces."""
    built, graph, prof = traced("gpt2-small", batch_size=8, seq_len=256)
    plan = ordered(interleaved_plan(graph, stages=4, gpus=2), graph)
    path = package_for_plan(tmp_path_factory.mktemp("cuda-mem") / "pkg", "gpt2-small", plan,
                            batch_size=8, seq_len=256)
    return path, graph, prof, plan


@pytest.mark.parametrize("schedule", ["1f1b", "async", "gpipe", "pipedream", "2bw", "2gw"])
def test_cuda_allocator_peak_within_the_plan(small, schedule, tmp_path):
    """Each rank's CUDA allocator peak (every tensor, cuBLAS workspaces included) stays within what the
    plan gives its GPU (an H100-80GB plan, its reserve included), and the memory it reserves from the
    driver too; the model is not wildly pessimistic about what it counts itself."""
    path, graph, prof, plan = small
    M = 6 if schedule in ("2bw", "2gw") else 4
    recompute = schedule in ("gpipe", "2bw")
    problem = Problem(graph, prof, load_cluster("8xh100-80gb").with_overrides(gpus=2), schedule=schedule,
                      micro_batches=M, recompute=recompute)
    cost = evaluate(problem, plan)
    recs = _run(path, tmp_path / "log", "--nproc", "2", "--steps", "4", "--schedule", schedule,
                "--micro-batches", str(M), "--device", "cuda", "--transport", "gloo",
                *(["--recompute"] if recompute else []))
    for g in range(2):
        allocated = max(r["ranks"][str(g)]["memory_bytes"] for r in recs)
        reserved = max(r["ranks"][str(g)].get("memory_reserved_bytes", 0) for r in recs)
        planned = cost.gpus[g].memory_bytes
        counted = planned - cost.gpus[g].reserve_bytes
        print(f"CUDA {schedule} GPU {g}: allocated {allocated:,} reserved {reserved:,} "
              f"planned {counted:,} + reserve {cost.gpus[g].reserve_bytes:,} "
              f"(allocated/counted {allocated / counted:.2f})", flush=True)
        assert 0 < allocated <= planned and reserved <= planned, (g, allocated, reserved, cost.gpus[g])
        assert allocated > 0.3 * counted, (g, allocated, counted)


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_avgpipe_two_parallel_pipelines_train_on_cuda_as_on_the_cpu(transport, tmp_path):
    """AvgPipe, N = 2 pipelines of a two-GPU plan on the machine's GPUs (stage s of both pipelines on
    one GPU), one micro-batch forwarded in advance: the CUDA run gives the CPU run's losses, step by
    step, and each rank's allocator peak is reported. Under NCCL the groups whose ranks share a GPU
    (the averaging groups; every group on a one-GPU machine) go through host memory over gloo."""
    built, graph, _ = traced("gpt2-tiny")
    pkg = package_for_plan(tmp_path / "pkg", "gpt2-tiny", interleaved_plan(graph, stages=2, gpus=2))
    common = ["--nproc", "4", "--steps", "4", "--schedule", "avgpipe", "--parallel-pipelines", "2",
              "--advance", "1", "--micro-batches", "4", "--no-dropout", "--optimizer", "adam", "--lr", "1e-3"]
    cpu = _run(pkg, tmp_path / "cpu", *common, "--device", "cpu")
    gpu = _run(pkg, tmp_path / "gpu", *common, "--device", "cuda", "--transport", transport)
    assert len(cpu) == len(gpu) == 4
    for a, b in zip(cpu, gpu):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (a["loss"], b["loss"])
    assert all(r["ranks"][str(k)]["memory_bytes"] > 0 for r in gpu for k in range(4))
