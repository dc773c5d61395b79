"""What ftcompile promises, measured on a real GPU: profile, step time and memory.

Run on a CUDA machine (one GPU is enough)::

    python benchmarks/cuda.py --model gpt2-medium --batch-size 4 --seq-len 512 --out /tmp/cuda-bench

Everything goes through the CLI as a user types it:

1. **Profile.** ``ftcompile profile --method measured --device cuda`` (host swapping) against
   ``--method analytic --hardware h100-80gb``: total forward and backward time of a micro-batch,
   and the profiler's own device peak.
2. **Time.** A one-GPU plan compiled on the measured profile (``--gpus 1``), trained with
   ``ftcompile run --device cuda``: the simulator's step time (``simulation.minibatch_ms``) against
   the median measured step after two warm-up steps, per schedule.
3. **Memory.** A two-GPU plan per schedule (``--gpus 2 --replicas 1``), its two ranks sharing the one
   GPU (each process has its own CUDA allocator, so each peak is that rank's own; tensors cross
   through pinned host buffers over gloo): each rank's allocator peak and reserved peak
   (``train.jsonl``), and the whole process on the GPU as ``nvidia-smi`` sees it (CUDA context
   included, sampled every 0.2 s), against the plan's figure for that GPU (``cost.gpus[g]``:
   counted bytes, then with the preset's reserve).

4. **AvgPipe.** A plan over ``--avgpipe-gpus`` GPUs trained as N = 1 and N = 2 parallel pipelines on the
   same GPUs (N processes per GPU): measured samples/s against ``ftcompile simulate --parallel-pipelines N``,
   and the sum of the ranks' allocator peaks and of the processes' footprints against the simulator's
   memory for N pipelines (each process's reserve counted).

``--device cpu`` runs the same steps on the CPU (no profile comparison) to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

SCHEDULES = ["1f1b", "async", "gpipe", "pipedream", "2bw", "2gw"]


def ftc(*args: str, timeout: int = 900) -> str:
    cmd = [sys.executable, "-m", "ftcompile", "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


class GpuSampler:
    """The largest used memory of each of our processes on the GPU, from nvidia-smi, every 0.2 s."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.strip().splitlines():
                try:
                    pid, mib = (int(x) for x in line.split(","))
                except ValueError:
                    continue
                self.peak[pid] = max(self.peak.get(pid, 0), mib * 2**20)
            self._stop.wait(0.2)


def profile_part(a, out: Path, model_args: list[str]) -> Path | None:
    if a.device != "cuda":
        return None
    measured, analytic = out / "prof_cuda.json", out / "prof_analytic.json"
    t0 = time.perf_counter()
    ftc("profile", a.model, *model_args, "--method", "measured", "--device", "cuda", "-o", str(measured),
        "--no-cache")
    seconds = time.perf_counter() - t0
    ftc("profile", a.model, *model_args, "--method", "analytic", "--hardware", a.hardware, "-o", str(analytic),
        "--no-cache")
    m, n = json.loads(measured.read_text()), json.loads(analytic.read_text())

    def tot(p, key):
        return sum(c.get(key, 0.0) for c in p["nodes"].values())

    print(f"\n## Profile: {a.model} {' '.join(model_args)}")
    print(f"measured on {m['hardware'].get('name')} with host swapping in {seconds:.1f} s "
          f"(device peak {m['info'].get('peak_device_bytes', 0) / 1e9:.2f} GB)")
    for key in ("forward_ms", "backward_ms"):
        print(f"  {key:12s} measured {tot(m, key):9.2f} ms   analytic ({a.hardware}) {tot(n, key):9.2f} ms   "
              f"measured/analytic {tot(m, key) / max(tot(n, key), 1e-9):.2f}")
    return measured


def time_part(a, out: Path, model_args: list[str], profile: Path | None) -> None:
    print(f"\n## Step time: {a.model}, one GPU, plan from the {'measured' if profile else 'analytic'} profile")
    print(f"{'schedule':10s} {'predicted ms':>13s} {'measured ms':>12s} {'measured/predicted':>19s}")
    for schedule in a.time_schedules.split(","):
        pkg = out / f"p1_{schedule}"
        prof = ["--profile", str(profile)] if profile else []
        ftc("compile", a.model, *model_args, "--cluster", a.cluster, "--gpus", "1", "--replicas", "1",
            "--schedule", schedule, "--micro-batches", str(a.micro_batches), "--strategy", "uniform",
            *prof, "-o", str(pkg))
        doc = json.loads((pkg / "plan.json").read_text())
        predicted = doc["simulation"]["minibatch_ms"]
        log = out / f"log1_{schedule}"
        ftc("run", str(pkg), "--device", a.device, "--steps", str(a.steps), "--no-dropout",
            "--log-dir", str(log), "--progress", "off")
        recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines() if '"step"' in x]
        measured = statistics.median(r["seconds"] for r in recs[2:]) * 1e3
        print(f"{schedule:10s} {predicted:13.2f} {measured:12.2f} {measured / predicted:19.2f}")


def memory_part(a, out: Path, model_args: list[str], profile: Path | None) -> None:
    print(f"\n## Memory: {a.model}, two-GPU plan (cluster {a.cluster}), both ranks on this machine's GPU")
    print(f"{'schedule':10s} {'gpu':>3s} {'allocated':>10s} {'reserved':>10s} {'process':>10s} "
          f"{'counted':>10s} {'+reserve':>10s} {'alloc/counted':>13s} {'process/plan':>12s}")
    for schedule in a.memory_schedules.split(","):
        pkg = out / f"p2_{schedule}"
        prof = ["--profile", str(profile)] if profile else []
        ftc("compile", a.model, *model_args, "--cluster", a.cluster, "--gpus", "2", "--replicas", "1",
            "--schedule", schedule, "--micro-batches", str(a.micro_batches), "--strategy", "seq",
            "--time-limit", "20", *prof, "-o", str(pkg))
        doc = json.loads((pkg / "plan.json").read_text())
        log = out / f"log2_{schedule}"
        with GpuSampler() as sampler:
            ftc("run", str(pkg), "--device", a.device, "--nproc", "2", "--transport", "gloo",
                "--steps", str(a.steps), "--log-dir", str(log), "--progress", "off")
        recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines() if '"step"' in x]
        processes = sorted(sampler.peak.values(), reverse=True)
        for g in range(2):
            gpu = doc["cost"]["gpus"][g]
            alloc = max(r["ranks"][str(g)]["memory_bytes"] for r in recs)
            reserved = max(r["ranks"][str(g)].get("memory_reserved_bytes", 0) for r in recs)
            counted = gpu["memory_bytes"] - gpu["reserve_bytes"]
            # nvidia-smi names processes by pid, not rank: the larger process against the larger plan
            plans = sorted((x["memory_bytes"] for x in doc["cost"]["gpus"]), reverse=True)
            proc = processes[g] if g < len(processes) else 0
            print(f"{schedule:10s} {g:3d} {alloc / 1e9:10.2f} {reserved / 1e9:10.2f} {proc / 1e9:10.2f} "
                  f"{counted / 1e9:10.2f} {gpu['memory_bytes'] / 1e9:10.2f} {alloc / counted:13.2f} "
                  f"{(proc / plans[g]) if proc else float('nan'):12.2f}")


def avgpipe_part(a, out: Path, model_args: list[str], profile: Path | None) -> None:
    """N = 1, 2 AvgPipe pipelines of one plan on the same GPUs (N processes per GPU): measured samples/s
    and memory against the simulator's figures for N pipelines (``ftcompile simulate ... --parallel-pipelines N``,
    which counts each process's reserve). Memory per plan GPU: the allocator peaks of the N ranks that host
    it (pipeline-major ranks: rank r hosts plan GPU r mod P) against N copies of its counted bytes."""
    P = a.avgpipe_gpus
    print(f"\n## AvgPipe: {a.model}, a {P}-GPU plan, N pipelines sharing its GPUs (cluster {a.cluster})")
    print(f"(samples/s predicted for {P} GPUs of the cluster; measured with every rank on this machine's "
          f"{torch.cuda.device_count() if a.device == 'cuda' else 0} GPU(s))")
    print(f"{'N':>2s} {'predicted samples/s':>20s} {'measured samples/s':>19s} {'processes GB (sum)':>19s} "
          f"{'plan GB (sum, +reserves)':>25s}")
    rows = []
    pkg = out / "pa"
    prof = ["--profile", str(profile)] if profile else []
    ftc("compile", a.model, *model_args, "--cluster", a.cluster, "--gpus", str(P), "--replicas", "1",
        "--schedule", "avgpipe", "--parallel-pipelines", "1", "--advance", "0",
        "--micro-batches", str(a.micro_batches), "--strategy", "seq", "--time-limit", "20", *prof, "-o", str(pkg))
    doc = json.loads((pkg / "plan.json").read_text())
    for n in (1, 2):
        sim = json.loads(ftc("simulate", str(pkg), "--schedule", "avgpipe", "--parallel-pipelines", str(n),
                             "--advance", "0", "--json"))
        if n == 1:
            sps = sim["throughput_samples_per_s"]
            per_gpu = [(g["memory_bytes"] - g["reserve_bytes"], g["reserve_bytes"]) for g in doc["cost"]["gpus"]]
        else:
            sps = sim["avgpipe_throughput_samples_per_s"]
            per_gpu = [(g["counted_bytes"], g["reserve_bytes"]) for g in sim["avgpipe_gpu_memory"]]
        log = out / f"loga_{n}"
        with GpuSampler() as sampler:
            ftc("run", str(pkg), "--device", a.device, "--nproc", str(n * P), "--schedule", "avgpipe",
                "--parallel-pipelines", str(n), "--advance", "0", "--steps", str(a.steps), "--no-dropout",
                "--log-dir", str(log), "--progress", "off")
        recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines() if '"step"' in x]
        measured = statistics.median(r["samples_per_s"] for r in recs[2:])
        peak = {int(k): max(r["ranks"][k]["memory_bytes"] for r in recs) for k in recs[0]["ranks"]}
        procs = sum(sampler.peak.values())
        planned = sum(c + r for c, r in per_gpu)
        print(f"{n:2d} {sps:20.1f} {measured:19.1f} {procs / 1e9:19.2f} {planned / 1e9:25.2f}")
        for g, (counted, reserve) in enumerate(per_gpu):
            alloc = sum(b for r, b in peak.items() if r % P == g)
            rows.append(f"{n:2d} {g:3d} {alloc / 1e9:15.2f} {counted / 1e9:11.2f} {reserve / 1e9:11.2f} "
                        f"{alloc / counted if counted else float('nan'):14.2f}")
    print(f"\n{'N':>2s} {'gpu':>3s} {'allocator GB':>15s} {'counted GB':>11s} {'reserves GB':>11s} "
          f"{'alloc/counted':>14s}   (allocator: sum of the peaks of the N ranks on that plan GPU)")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cluster", default="8xh100-80gb")
    ap.add_argument("--hardware", default="h100-80gb")
    ap.add_argument("--time-schedules", default="1f1b,gpipe")
    ap.add_argument("--memory-schedules", default=",".join(SCHEDULES))
    ap.add_argument("--avgpipe-gpus", type=int, default=1, help="avgpipe part: the plan's GPUs (N x that many ranks)")
    ap.add_argument("--parts", default="profile,time,memory,avgpipe")
    ap.add_argument("--out", default="out/cuda-bench")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_args = ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len)]
    parts = a.parts.split(",")
    profile = profile_part(a, out, model_args) if "profile" in parts else None
    if "time" in parts:
        time_part(a, out, model_args, profile)
    if "memory" in parts:
        memory_part(a, out, model_args, profile)
    if "avgpipe" in parts:
        avgpipe_part(a, out, model_args, profile)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
