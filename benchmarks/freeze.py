"""Predicted speed-up of elastic freeze training (PipeTransformer) with the simulator and analytic costs.

For each model: trace it at the micro-batch size, then for every phase of an alpha = 1/3 freeze
schedule plan and simulate four systems, each adding one mechanism, against the no-freeze
pipeline x DDP baseline on the same cluster:

* **baseline**: no freezing; the best (P, R) layout our compiler finds with our partitioners
  (also shown: the paper's baseline layout, one 8-GPU GPipe pipeline, P=8 R=1);
* **freeze only**: the baseline's plan kept, frozen layers priced as what they are (forward
  only, weights only: no backward, gradient, optimizer state or all-reduce);
* **+AutoPipe**: the frozen graph re-partitioned, P halved while it fits and gains, R kept
  (freed GPUs idle);
* **+AutoDP**: as +AutoPipe, with R = G / P replicas on the freed GPUs;
* **+AutoCache**: as +AutoDP, the prefix frozen before the phase read from a host cache (its
  boundary activations over the host link) instead of recomputed, where reading is faster.

Assumptions (printed with the figures): training is split into ``--intervals`` equal parts (in
samples) with a freeze check between parts; the gradient norms are taken to fall towards the
output, so Eq. 1's alpha bound decides (the fastest freezing alpha allows); each phase is one
pass over the data (so the cache is advanced through the newly frozen layers once per phase and
read afterwards); transitions (re-planning, restart, checkpoint load) are not counted here (the
CPU end-to-end run measures them); the global batch is fixed (``--batch``), split into
micro-batches of the traced size.

    python benchmarks/freeze.py                       # ViT-B/16 and BERT-large on 8 x V100
    python benchmarks/freeze.py --models vit-base --intervals 10 --strategy seq
    python benchmarks/freeze.py --cpu-run             # plus the 4-process CPU end-to-end runs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PAPER = {"vit-base": 2.83, "bert-large": 2.10}
# model -> (global batch, micro-batch size, extra model options)
SETTINGS = {"vit-base": (400, 50, {}), "bert-large": (64, 8, {"seq_len": 384})}


def schedule_of(L: int, alpha: float, intervals: int) -> list[int]:
    """Frozen layers in each interval: Eq. 1 with the alpha bound deciding (norms smallest deepest)."""
    from ftcompile.runtime.freeze import frozen_layers

    out, f = [0], 0
    for _ in range(intervals - 1):
        f = frozen_layers(f, [float(L - i) for i in range(f, L)], alpha)
        out.append(f)
    return out


def simulate_fixed(problem, plan) -> float:
    from ftcompile.plan import evaluate
    from ftcompile.simulate import simulate

    cost = evaluate(problem, plan)
    if not cost.feasible:
        return 0.0
    return simulate(problem, plan).throughput_samples_per_s


def predict(name: str, cluster_name: str, alpha: float, intervals: int, strategy: str) -> dict:
    from ftcompile.cluster import load_cluster
    from ftcompile.freeze import cached_profile, find_layers, freeze_graph, frozen_region, plan_phase
    from ftcompile.hardware import load_hardware
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.plan import Plan, Problem
    from ftcompile.profile import analytic_profile
    from ftcompile.replicas import ReplicaLayout, replicated_problem
    from ftcompile.trace import trace

    batch, micro, extra = SETTINGS[name]
    t0 = time.perf_counter()
    built = build_model(name, ModelOptions(batch_size=micro, device="meta", **extra))
    graph = trace(built.model, built.args, built.kwargs, source={"model": built.name,
                                                                 "options": asdict(built.options)})
    cluster = load_cluster(cluster_name)
    hw = load_hardware(cluster.hardware)
    G, Mg = cluster.physical_gpus, batch // micro
    layers = find_layers(graph)
    L = len(layers)
    sched = schedule_of(L, alpha, intervals)
    common = dict(global_micro_batches=Mg, schedule="gpipe", optimizer="adam", strategies=strategy, hardware=hw)
    base = plan_phase(graph, layers, 0, cluster, **common)
    paper_base = plan_phase(graph, layers, 0, cluster, pipeline_gpus=G, **common)
    rows, prev_region = [], None
    cache: dict[int, dict] = {}
    for n in sorted(set(sched)):
        region = frozen_region(graph, layers, n)
        fg = freeze_graph(graph, region)
        prof = analytic_profile(fg, hw, optimizer="adam")
        # freeze only: the baseline's plan on the frozen costs
        pb = replicated_problem(Problem(fg, prof, cluster, schedule="gpipe", micro_batches=base.micro_batches),
                                cluster, ReplicaLayout(base.pipeline_gpus, base.replicas))
        plan = Plan.from_json(base.doc["plan"])
        only = simulate_fixed(pb, plan)
        autopipe = plan_phase(graph, layers, n, cluster, replicas=base.replicas,
                              start_pipeline=base.pipeline_gpus, **common)
        autodp = plan_phase(graph, layers, n, cluster, start_pipeline=base.pipeline_gpus, **common)
        cached, used = autodp.samples_per_s, False
        if prev_region is not None and prev_region.layers > 0:
            def with_cache(g, _prev=prev_region, _reg=region):
                p = analytic_profile(g, hw, optimizer="adam")
                return cached_profile(g, p, _reg, _prev, host_bandwidth=hw.host_bandwidth)[0]

            cp = analytic_profile(fg, hw, optimizer="adam")
            used = cached_profile(fg, cp, region, prev_region, host_bandwidth=hw.host_bandwidth)[1]
            if used:
                cached = plan_phase(graph, layers, n, cluster, start_pipeline=base.pipeline_gpus,
                                    profile_fn=with_cache, **common).samples_per_s
        # a phase's later passes read the whole current prefix: the steady state of the cache
        cache[n] = {"frozen": n, "freeze_only": only, "autopipe": autopipe.samples_per_s,
                    "autopipe_P": autopipe.pipeline_gpus, "autodp": autodp.samples_per_s,
                    "autodp_PR": (autodp.pipeline_gpus, autodp.replicas), "autocache": cached, "cache_used": used}
        rows.append(cache[n])
        prev_region = region
    # time per interval: equal samples S; time = S / throughput
    def total(key: str) -> float:
        return sum(1.0 / cache[n][key] for n in sched)

    base_t = intervals / base.samples_per_s
    paper_t = intervals / paper_base.samples_per_s
    out = {"model": name, "cluster": cluster_name, "layers": L, "alpha": alpha, "schedule": sched,
           "batch": batch, "micro_batch": micro,
           "baseline": {"P": base.pipeline_gpus, "R": base.replicas, "M": base.micro_batches,
                        "samples_per_s": base.samples_per_s},
           "paper_baseline": {"P": paper_base.pipeline_gpus, "R": paper_base.replicas,
                              "samples_per_s": paper_base.samples_per_s},
           "phases": rows, "seconds": round(time.perf_counter() - t0, 1)}
    for key in ("freeze_only", "autopipe", "autodp", "autocache"):
        out[f"speedup_{key}"] = base_t / total(key)
        out[f"speedup_{key}_vs_paper_baseline"] = paper_t / total(key)
    return out


def report(r: dict) -> str:
    lines = [f"{r['model']} on {r['cluster']}: {r['layers']} layers, alpha={r['alpha']:.3g}, frozen per interval "
             f"{r['schedule']}, batch {r['batch']} ({r['micro_batch']} per micro-batch)",
             f"  baseline (best no-freeze layout): P={r['baseline']['P']} R={r['baseline']['R']} "
             f"{r['baseline']['samples_per_s']:.1f} samples/s; paper's layout P={r['paper_baseline']['P']} "
             f"R={r['paper_baseline']['R']} {r['paper_baseline']['samples_per_s']:.1f} samples/s",
             "  frozen | freeze only | +AutoPipe (P) | +AutoDP (P x R) | +AutoCache"]
    for p in r["phases"]:
        lines.append(f"  {p['frozen']:6d} | {p['freeze_only']:11.1f} | {p['autopipe']:9.1f} ({p['autopipe_P']}) | "
                     f"{p['autodp']:9.1f} ({p['autodp_PR'][0]}x{p['autodp_PR'][1]}) | {p['autocache']:9.1f}"
                     f"{'' if p['cache_used'] else ' (no cache)'}")
    lines.append("  speed-up over the whole run vs best baseline: " + ", ".join(
        f"{k} {r[f'speedup_{k}']:.2f}x" for k in ("freeze_only", "autopipe", "autodp", "autocache")))
    lines.append("  speed-up vs the paper's baseline layout:    " + ", ".join(
        f"{k} {r[f'speedup_{k}_vs_paper_baseline']:.2f}x" for k in ("freeze_only", "autopipe", "autodp",
                                                                      "autocache")))
    if r["model"] in PAPER:
        lines.append(f"  paper (PipeTransformer, 8 GPUs, alpha=1/3): {PAPER[r['model']]:.2f}x")
    return "\n".join(lines)


def cpu_run(model: str, pretrained: str, work: Path, steps: int, every: int) -> str:
    """Compile ``model`` from a 6-layer local checkpoint for 4 CPU workers and freeze-train it on 4 ranks."""
    import subprocess

    pkg = work / f"{Path(pretrained).name}-pkg"
    py = [sys.executable, "-m", "ftcompile"]
    subprocess.run(py + ["compile", model, "--pretrained", pretrained, "--cluster", "2xcpu", "--gpus", "4",
                         "--schedule", "1f1b", "--strategy", "seq", "--optimizer", "momentum", "-o", str(pkg), "-q"],
                   check=True)
    log = work / f"{Path(pretrained).name}-run"
    r = subprocess.run(py + ["run", str(pkg), "--nproc", "4", "--steps", str(steps), "--optimizer", "momentum",
                             "--lr", "0.01", "--schedule", "1f1b", "--log-dir", str(log), "--overwrite-checkpoints",
                             "--freeze", f"alpha=1/3,every={every},strategy=seq"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    lines = [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines()]
    out = [f"{model} (6 layers, {pretrained}): {steps} steps, Eq. 1 every {every} steps, 4 ranks over gloo"]
    for x in lines:
        if "phase" in x and not x.get("decision"):
            out.append(f"  phase {x['phase']}: steps {x['steps'][0]}-{x['steps'][1] - 1}, {x['frozen_layers']} frozen, "
                       f"P={x['P']} R={x['R']} M={x['M']}: {x['samples_per_s']} samples/s measured (training "
                       f"steps), transition/start-up {x['transition_s']:.1f} s")
    for x in lines:
        if x.get("decision"):
            out.append(f"  step {x['step']}: {x['frozen_before']} -> {x['frozen_after']} frozen ({x['rule']})")
    return "\n".join(out)


def make_checkpoints(work: Path) -> dict[str, str]:
    """6-layer BERT and ViT checkpoints with random weights (from configs; nothing downloaded)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    b = T.BertConfig(num_hidden_layers=6, hidden_size=128, num_attention_heads=2, intermediate_size=512)
    T.BertForQuestionAnswering(b).save_pretrained(work / "bert6")
    v = T.ViTConfig(num_hidden_layers=6, hidden_size=192, num_attention_heads=3, intermediate_size=768,
                    image_size=32, patch_size=8, num_labels=1000, problem_type="single_label_classification")
    T.ViTForImageClassification(v).save_pretrained(work / "vit6")
    return {"bert-tiny": str(work / "bert6"), "vit-tiny": str(work / "vit6")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="vit-base,bert-large")
    p.add_argument("--cluster", default="8xv100-32gb")
    p.add_argument("--alpha", type=float, default=1 / 3)
    p.add_argument("--intervals", type=int, default=10)
    p.add_argument("--strategy", default="seq")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cpu-run", action="store_true", help="also run the 4-process CPU end-to-end freeze runs")
    p.add_argument("--work", default=None, help="folder for the CPU runs (default: a temporary one)")
    args = p.parse_args()
    for name in [m for m in args.models.split(",") if m]:
        r = predict(name, args.cluster, args.alpha, args.intervals, args.strategy)
        print(json.dumps(r) if args.json else report(r), flush=True)
    if args.cpu_run:
        import tempfile

        work = Path(args.work or tempfile.mkdtemp(prefix="ftcompile-freeze-"))
        work.mkdir(parents=True, exist_ok=True)
        for model, ckpt in make_checkpoints(work).items():
            print(cpu_run(model, ckpt, work, steps=10, every=2), flush=True)


if __name__ == "__main__":
    main()
