"""Runtime overhead and measured-vs-simulated throughput of `ftcompile run` on this machine.

For each model: profile it by measurement on this CPU (one thread, as each rank gets),
compile it for the 2-worker `2xcpu` cluster with that profile, and train it with
every schedule on 2 processes (gloo over loopback). Prints, per schedule:

* the simulator's predicted samples/s for the plan (same profile, same schedule, M);
* the measured samples/s (steps after the first, which includes warm-up);
* their ratio (measured / predicted);
* per micro-batch and rank, the overhead: wall time that is neither a stage's
  forward, backward, recomputation or update, nor waiting for a message
  (scheduling, bookkeeping, send/receive calls, Python).

With a GPU (`--device cuda`) the package also runs on CUDA in one process (all stages,
one rank) and each stage's measured forward and backward times are compared with the
profile's.

    python benchmarks/runtime.py                      # gpt2-tiny and bert-tiny, all schedules
    python benchmarks/runtime.py --models gpt2-tiny --schedules 1f1b,async --steps 30
    python benchmarks/runtime.py --device cuda --models gpt2-small
    python benchmarks/runtime.py --models gpt2-small --model-options="--seq-len 256" --schedules 1f1b,async \
        --strategies seq,mixed --steps 6 --keep /tmp/rt      # compute-bound: 0.1 to 1 s per stage

Each row is printed as soon as its run ends (a run of a large model takes minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SCHEDULES = ["gpipe", "1f1b", "async", "pipedream", "2bw", "2gw"]


def sh(*cmd: str, env: dict | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


def ftc(*args: str, env: dict | None = None) -> str:
    return sh(sys.executable, "-m", "ftcompile", *args, env=env)


def measure(model: str, out: Path, schedules: list[str], steps: int, micro_batches: int, nproc: int,
            device: str, strategies: list[str], model_options: list[str], show) -> list[dict]:
    prof = out / "profile.measured.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not prof.exists():       # --keep DIR reuses a profile measured before
        out.mkdir(parents=True, exist_ok=True)
        ftc("-q", "profile", model, *model_options, "--method", "measured", "--device",
            "cuda" if device == "cuda" else "cpu", "--repeats", "5", "-o", str(prof), "--no-cache", env=env)
    rows = []
    for strategy in strategies:
        pkg = out / f"pkg-{strategy}"
        if pkg.exists():        # a kept directory: compile afresh (the package is ours, made by this script)
            shutil.rmtree(pkg)
        # one pipeline over the ranks (--replicas 1): this compares a pipeline's prediction with its run
        ftc("-q", "compile", model, *model_options, "--cluster", "2xcpu", "--gpus", str(nproc), "--profile",
            str(prof), "--micro-batches", str(micro_batches), "--strategy", strategy, "--replicas", "1", "-o",
            str(pkg), "--json")
        rows += _runs(model, strategy, pkg, schedules, steps, micro_batches, nproc, device, out / strategy, show)
    return rows


def _runs(model: str, strategy: str, pkg: Path, schedules: list[str], steps: int, micro_batches: int, nproc: int, device: str,
          out: Path, show) -> list[dict]:
    rows = []
    for sched in schedules:
        sim = json.loads(ftc("-q", "simulate", str(pkg), "--schedule", sched, "--micro-batches",
                             str(micro_batches), "--steps", "4", "--json"))
        predicted = sim.get("throughput") or sim.get("throughput_samples_per_s")
        log = out / "runs" / sched
        if log.exists():        # a kept directory: a fresh log, never appended to an old run's
            shutil.rmtree(log)
        ftc("-q", "run", str(pkg), "--nproc", str(nproc), "--schedule", sched, "--steps", str(steps),
            "--micro-batches", str(micro_batches), "--log-dir", str(log), "--progress", "off", "--device", device)
        lines = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
        steady = [x for x in lines if not x.get("summary")][1:]
        seconds = sum(x["seconds"] for x in steady)
        samples = sum(x["samples_per_s"] * x["seconds"] for x in steady)
        measured = samples / seconds if seconds else float("nan")
        overhead = []
        for r in sorted(steady[0]["ranks"]):
            wall = sum(x["ranks"][r]["seconds"] for x in steady)
            wait = sum(x["ranks"][r]["wait_s"] for x in steady)
            busy = 0.0
            for x in steady:
                for sid, st in x["stages"].items():
                    if _rank_of(x, sid) == r:
                        busy += st["forward_s"] + st["backward_s"] + st["recompute_s"] + st["update_s"]
            overhead.append(max(0.0, wall - wait - busy) / (len(steady) * micro_batches) * 1e3)
        rows.append({"strategy": strategy, "model": model, "schedule": sched, "predicted_sps": predicted, "measured_sps": measured,
                     "ratio": measured / predicted if predicted else None, "overhead_ms_per_micro_batch": overhead,
                     "loss_first": lines[0].get("loss"), "loss_last": [x for x in lines if not x.get("summary")][-1]
                     .get("loss")})
        show(rows[-1])
    return rows


def _rank_of(line: dict, sid: str) -> str:
    return line.get("stage_ranks", {}).get(sid, "?")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-tiny,bert-tiny")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--strategies", default="auto",
                    help="plan each with these strategies (e.g. seq,mixed) to compare the predicted and measured "
                         "ranking")
    ap.add_argument("--model-options", default="",
                    help="model options for profile and compile, e.g. \"--seq-len 256 --batch-size 2\"")
    ap.add_argument("--keep", metavar="DIR",
                    help="work in DIR and keep it (profiles, packages, logs); a measured profile there is reused")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    print(f"{'model':<10} {'strategy':<9} {'schedule':<10} {'predicted/s':>12} {'measured/s':>11} {'ratio':>6}  "
          f"overhead ms/micro-batch per rank", flush=True)

    def show(r: dict) -> None:
        ov = ", ".join(f"{x:.2f}" for x in r["overhead_ms_per_micro_batch"])
        print(f"{r['model']:<10} {r['strategy']:<9} {r['schedule']:<10} {r['predicted_sps']:>12.2f} "
              f"{r['measured_sps']:>11.2f} {(r['ratio'] or float('nan')):>6.2f}  {ov}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for model in args.models.split(","):
            rows += measure(model, root / model, args.schedules.split(","), args.steps, args.micro_batches,
                            args.nproc, args.device, args.strategies.split(","), shlex.split(args.model_options),
                            show)
    for model in dict.fromkeys(r["model"] for r in rows):
        for sched in dict.fromkeys(r["schedule"] for r in rows):
            mine = [r for r in rows if r["model"] == model and r["schedule"] == sched]
            if len(mine) > 1:
                rank = lambda key: " > ".join(x["strategy"] for x in sorted(mine, key=lambda x: -x[key]))  # noqa: E731
                print(f"{model} {sched}: predicted {rank('predicted_sps')}; measured {rank('measured_sps')}")
    if args.json:
        from ftcompile.runtime.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
