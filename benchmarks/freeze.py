"""Predicted speed-up of elastic freeze training (PipeTransformer) with the simulator and analytic costs.

For each model: trace it at the micro-batch size, then for every phase of an alpha = 1/3 freeze
schedule plan and simulate four systems, each adding one mechanism, against the no-freeze
pipeline x DDP baseline on the same cluster:

* **baseline**: no freezing; the best (P, R) layout our compiler finds with our partitioners
  (also shown: the paper's baseline layout, one 8-GPU GPipe pipeline, P=8 R=1);
* **freeze only**: the baseline's plan kept, frozen layers priced as what they are (forward
  only, weights only: no backward, gradient, optimizer state or all-reduce);
* **+AutoPipe**: the frozen graph re-partitioned, P halved from the running phase's while it fits
  and gains, R kept (freed GPUs idle), and M re-picked for each P (below);
* **+AutoDP**: as +AutoPipe, with R = G / P replicas on the freed GPUs;
* **+AutoCache**: as +AutoDP (the same plan: the runtime plans a phase for misses and splits the
  frozen layers into stages of their own), simulated with the prefix frozen before the phase read
  from the host cache instead of recomputed (its boundary activations over the host link, charged
  to the stages that would compute them), the newly frozen layers run to advance the cache, and
  the phase's new boundary written to it; where reading is slower than recomputing, the runtime's
  rule does not use the cache and the phase runs as +AutoDP.

Re-picking M (``--micro-batches auto``, the default) is the runtime controller's: at each
transition :func:`ftcompile.freeze.plan_phase` is given the step's samples (``SETTINGS``: 400
images for ViT, 64 sequences for BERT; fixed over the run), the running phase's ``(M, b)``, and
the model built on ``meta`` and traced at each micro-batch size ``b`` it prices (:class:`Traces`,
each size traced once); it prices every ``M`` among ``P .. 6P`` (PipeTransformer §3.2.3; at most
6 per P, fewer with ``--max-m``) with ``b = samples / (R M)``. The no-freeze start is a package
compiled at the traced size (as a run starts); the same layout with M re-picked and nothing
frozen is printed too, with the speed-ups against it. ``--micro-batches fixed`` keeps the
traced size (M = samples per replica / b0). In both, each phase is planned from the one running
(P halves from the running P, as the controller does; the figures before M was re-picked
halved from the start layout's P at every phase, which could lengthen the pipeline again).

Assumptions (printed with the figures): training is split into ``--intervals`` equal parts (in
samples) with a freeze check between parts; the gradient norms are taken to fall towards the
output, so Eq. 1's alpha bound decides (the fastest freezing alpha allows); each phase is one
pass over the data (so every micro-batch of a phase is an advance: the previous phase's cached
output read, the newly frozen layers run, their output written; the first frozen phase only
writes); transitions (re-planning, restart, checkpoint load) are not counted here (the
CPU end-to-end run measures them).

    python benchmarks/freeze.py                       # ViT-B/16 and BERT-large on 8 x V100
    python benchmarks/freeze.py --models vit-base --intervals 10 --strategy seq
    python benchmarks/freeze.py --micro-batches fixed # micro-batches of the traced size throughout
    python benchmarks/freeze.py --cpu-run             # plus the 4-process CPU end-to-end runs
    python benchmarks/freeze.py --models "" --cpu-cache 8   # AutoCache off and on, CPU, 8-sample dataset
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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


class Traces:
    """The model built on ``meta`` and traced at each micro-batch size ``b`` a plan prices (each once),
    as the runtime's controller re-traces its package's model (``ftcompile.freeze_run._Traces``)."""

    def __init__(self, name: str, extra: dict):
        self.name, self.extra, self.by_size, self.seconds = name, extra, {}, 0.0

    def graph(self, b: int):
        from ftcompile.models import ModelOptions, build_model
        from ftcompile.trace import trace

        if b not in self.by_size:
            t0 = time.perf_counter()
            built = build_model(self.name, ModelOptions(batch_size=b, device="meta", **self.extra))
            self.by_size[b] = trace(built.model, built.args, built.kwargs,
                                    source={"model": built.name, "options": asdict(built.options)})
            self.seconds += time.perf_counter() - t0
        return self.by_size[b]


def cap_micro_batches(limit: int | None) -> None:
    """Price at most ``limit`` micro-batch counts per pipeline length (spread over P..6P, its ends kept;
    the running phase's M and the M keeping its b still added) instead of the planner's default
    (``ftcompile.freeze.MICRO_BATCH_CANDIDATES``): a time cap for this script, the runtime unchanged."""
    import functools

    import ftcompile.freeze as fz

    if limit is None:
        return
    if limit < 2:
        raise SystemExit(f"--max-m {limit}: give at least 2 (the ends of the range P..6P)")
    # plan_phase looks the function up in its module at each call
    fz.micro_batch_candidates = functools.partial(fz.micro_batch_candidates, limit=limit)


@dataclass
class Study:
    """What every system's phases are planned from: one model, traced at ``b0``, on one cluster, with its
    freeze schedule; ``micro`` says how a transition picks the micro-batches (``"auto"``: M re-picked with
    the step's ``batch`` samples fixed, the model traced at each b; ``"fixed"``: micro-batches of ``b0``)."""

    micro: str
    batch: int
    b0: int
    traces: Traces
    graph: Any
    cluster: Any
    hw: Any
    layers: list
    sched: list[int]
    common: dict
    profiles: dict = field(default_factory=dict)    # frozen layers -> (frozen graph, its analytic profile)

    @property
    def fixed(self) -> dict:
        """plan_phase's arguments for micro-batches of ``b0``: a package as compiled."""
        return dict(global_micro_batches=self.batch // self.b0, **self.common)

    def start(self, **kw):
        """The no-freeze phase of a package compiled at ``b0`` (the runtime's first phase)."""
        from ftcompile.freeze import plan_phase

        return plan_phase(self.graph, self.layers, 0, self.cluster, **self.fixed, **kw)

    def replan(self, n: int, current: tuple[int, int], **kw):
        """One transition's plan, as the controller makes it (``fixed``: M follows b0)."""
        from ftcompile.freeze import plan_phase

        if self.micro == "fixed":
            return plan_phase(self.graph, self.layers, n, self.cluster, **self.fixed, **kw)
        return plan_phase(self.graph, self.layers, n, self.cluster, samples_per_step=self.batch,
                          graph_at=self.traces.graph, current=current, **self.common, **kw)

    def layout(self, ph) -> tuple:
        """A phase's (P, R, M, b)."""
        return (ph.pipeline_gpus, ph.replicas, ph.micro_batches, ph.micro_batch_size or self.b0)


def study_of(name: str, cluster_name: str, alpha: float, intervals: int, strategy: str, micro: str) -> Study:
    """``name`` traced at its start micro-batch size on ``cluster_name``, its schedule of frozen layers
    (:func:`schedule_of`), and the graph and analytic profile of each frozen depth the schedule reaches."""
    from ftcompile.cluster import load_cluster
    from ftcompile.freeze import find_layers
    from ftcompile.hardware import load_hardware

    batch, b0, extra = SETTINGS[name]
    traces = Traces(name, extra)
    graph = traces.graph(b0)
    cluster = load_cluster(cluster_name)
    hw = load_hardware(cluster.hardware)
    layers = find_layers(graph)
    return Study(micro, batch, b0, traces, graph, cluster, hw, layers, schedule_of(len(layers), alpha, intervals),
                 dict(schedule="gpipe", optimizer="adam", strategies=strategy, hardware=hw))


def frozen_profiles(st: Study) -> dict:
    """Frozen layers -> (the graph with that prefix frozen, its analytic profile), for each depth of the schedule."""
    from ftcompile.freeze import freeze_graph, frozen_region
    from ftcompile.profile import analytic_profile

    out = {}
    for n in set(st.sched):
        fg = freeze_graph(st.graph, frozen_region(st.graph, st.layers, n))
        out[n] = (fg, analytic_profile(fg, st.hw, optimizer="adam"))
    return out


def autocache(st: Study, dp, n: int, prev: int) -> tuple[float, bool]:
    """The +AutoDP plan ``dp``, one pass over the data with the cache: read what the previous phase cached,
    run the newly frozen layers, write their output (at the plan's micro-batch size). Its samples/s, and
    whether the cache is used (else +AutoDP's)."""
    from ftcompile.freeze import cached_profile, frozen_region
    from ftcompile.plan import Plan, Problem
    from ftcompile.profile import analytic_profile
    from ftcompile.replicas import ReplicaLayout, replicated_problem

    fg = dp.graph
    prof = analytic_profile(fg, st.hw, optimizer="adam")
    region = frozen_region(fg, st.layers, n)
    before = frozen_region(fg, st.layers, prev) if prev else None
    cprof, used = cached_profile(fg, prof, region, before, host_bandwidth=st.hw.host_bandwidth, write=True)
    if not (used and (dp.cache or {}).get("stages")):
        return dp.samples_per_s, False
    cpb = replicated_problem(Problem(fg, cprof, st.cluster, schedule="gpipe", micro_batches=dp.micro_batches),
                             st.cluster, ReplicaLayout(dp.pipeline_gpus, dp.replicas))
    cached = simulate_fixed(cpb, Plan.from_json(dp.doc["plan"]))
    return (cached, True) if cached > 0 else (dp.samples_per_s, False)


def frozen_phase(st: Study, base, n: int, prev: int, run_ap: tuple, run_dp: tuple) -> dict:
    """The row of a phase with ``n`` layers frozen (``prev`` before it), from the no-freeze layout ``base``:
    each system's samples/s, +AutoPipe planned from its running layout ``run_ap`` (R kept), +AutoDP and
    +AutoCache from ``run_dp``."""
    from ftcompile.plan import Plan, Problem
    from ftcompile.replicas import ReplicaLayout, replicated_problem

    fg, prof = st.profiles[n]
    pb = replicated_problem(Problem(fg, prof, st.cluster, schedule="gpipe", micro_batches=base.micro_batches),
                            st.cluster, ReplicaLayout(base.pipeline_gpus, base.replicas))
    only = simulate_fixed(pb, Plan.from_json(base.doc["plan"]))
    ap = st.replan(n, run_ap[2:], replicas=base.replicas, start_pipeline=run_ap[0])
    dp = st.replan(n, run_dp[2:], start_pipeline=run_dp[0], cached_from=prev)
    cached, used = autocache(st, dp, n, prev)
    return {"frozen": n, "cached_prefix": prev if used and prev else 0, "freeze_only": only,
            "autopipe": ap.samples_per_s, "autopipe_PRMb": st.layout(ap),
            "autodp": dp.samples_per_s, "autodp_PRMb": st.layout(dp),
            "autocache": cached, "cache_used": used}


def breakdown(st: Study, base) -> dict:
    """Throughput per interval of each system, starting from the no-freeze layout ``base``; each
    system's next phase is planned from its running one (P to halve from, and ``current=(M, b)``)."""
    per: dict[str, list[float]] = {k: [] for k in ("freeze_only", "autopipe", "autodp", "autocache")}
    rows, memo = [], {}
    start = st.layout(base)
    run_ap, run_dp = start, start       # the running phase of +AutoPipe and of +AutoDP/+AutoCache
    for i, n in enumerate(st.sched):
        prev = st.sched[i - 1] if i else 0
        if n == 0:          # before the first freeze every system runs the baseline
            row = {"frozen": 0, "cached_prefix": 0, "freeze_only": base.samples_per_s,
                   "autopipe": base.samples_per_s, "autopipe_PRMb": start,
                   "autodp": base.samples_per_s, "autodp_PRMb": start,
                   "autocache": base.samples_per_s, "cache_used": False}
        else:
            key = (prev, n, run_ap, run_dp)
            if key not in memo:
                memo[key] = frozen_phase(st, base, n, prev, run_ap, run_dp)
            row = memo[key]
            run_ap, run_dp = row["autopipe_PRMb"], row["autodp_PRMb"]
        row = {**row, "interval": i}
        rows.append(row)
        for k in per:
            per[k].append(row[k])
    # equal samples per interval: time ~ sum of 1 / throughput
    base_t = len(st.sched) / base.samples_per_s
    return {"layout": {"P": base.pipeline_gpus, "R": base.replicas, "M": base.micro_batches, "b": st.b0,
                       "samples_per_s": base.samples_per_s},
            "phases": rows, **{f"speedup_{k}": base_t / sum(1.0 / x for x in v) for k, v in per.items()}}


def predict(name: str, cluster_name: str, alpha: float, intervals: int, strategy: str,
            micro: str = "auto") -> dict:
    """The breakdown for ``name`` on ``cluster_name``: ``micro="auto"`` re-picks M at every transition as
    the runtime's controller does (samples per step fixed, the model traced at each b); ``"fixed"``
    keeps the traced micro-batch size (M = samples per replica / b0)."""
    t0 = time.perf_counter()
    st = study_of(name, cluster_name, alpha, intervals, strategy, micro)
    G = st.cluster.physical_gpus
    # the no-freeze start: a package compiled at b0 (the runtime's first phase), best layout or the paper's
    best = st.start()
    paper = st.start(pipeline_gpus=G)
    tuned = {}
    if micro == "auto":     # the same layouts with M (and b) re-picked too: what tuning M alone gives
        tuned = {"best_layout": st.replan(0, (best.micro_batches, st.b0)),
                 "paper_layout": st.replan(0, (paper.micro_batches, st.b0), pipeline_gpus=G)}
    st.profiles = frozen_profiles(st)
    out = {"model": name, "cluster": cluster_name, "layers": len(st.layers), "alpha": alpha, "schedule": st.sched,
           "batch": st.batch, "micro_batch": st.b0, "micro_batches": micro,
           "best_layout": breakdown(st, best), "paper_layout": breakdown(st, paper)}
    for key, ph in tuned.items():
        out[key]["tuned_start"] = {"P": ph.pipeline_gpus, "R": ph.replicas, "M": ph.micro_batches,
                                   "b": ph.micro_batch_size, "samples_per_s": ph.samples_per_s}
    out["trace_sizes"] = sorted(st.traces.by_size)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def report(r: dict) -> str:
    how = ("M re-picked at every transition (P..6P, samples per step fixed, model traced at each b)"
           if r["micro_batches"] == "auto" else f"micro-batches of {r['micro_batch']} kept (M fixed per replica)")
    lines = [f"{r['model']} on {r['cluster']}: {r['layers']} layers, alpha={r['alpha']:.3g}, frozen per interval "
             f"{r['schedule']}, global batch {r['batch']} (start: {r['micro_batch']} per micro-batch), gpipe, adam; "
             f"{how}"]
    for key, label in (("best_layout", "best no-freeze layout"), ("paper_layout", "the paper's baseline layout")):
        b = r[key]
        lay = b["layout"]
        lines.append(f"  from {label}: P={lay['P']} R={lay['R']} M={lay['M']} b={lay['b']}, "
                     f"{lay['samples_per_s']:.1f} samples/s (simulated)")
        t = b.get("tuned_start")
        if t:
            lines.append(f"    (the same layout, no freezing, M re-picked: P={t['P']} R={t['R']} M={t['M']} b={t['b']}, "
                         f"{t['samples_per_s']:.1f} samples/s, {t['samples_per_s'] / lay['samples_per_s']:.2f}x)")
        lines.append("    interval frozen (cached) | freeze only | +AutoPipe (P R M b)      | +AutoDP (P R M b)        "
                     "| +AutoCache   [samples/s]")
        for p in b["phases"]:
            ap, dp = p["autopipe_PRMb"], p["autodp_PRMb"]
            lines.append(f"    {p['interval']:8d} {p['frozen']:6d} ({p['cached_prefix']:2d}) | {p['freeze_only']:11.1f} | "
                         f"{p['autopipe']:9.1f} ({ap[0]} {ap[1]} {ap[2]:2d} {ap[3]:3d}) | "
                         f"{p['autodp']:9.1f} ({dp[0]} {dp[1]} {dp[2]:2d} {dp[3]:3d}) | {p['autocache']:9.1f}")
        lines.append("    speed-up over the run: " + ", ".join(
            f"{k} {b[f'speedup_{k}']:.2f}x" for k in ("freeze_only", "autopipe", "autodp", "autocache")))
        if t:
            f = lay["samples_per_s"] / t["samples_per_s"]
            lines.append("    against the M-re-picked no-freeze baseline: " + ", ".join(
                f"{k} {b[f'speedup_{k}'] * f:.2f}x" for k in ("freeze_only", "autopipe", "autodp", "autocache")))
    if r["model"] in PAPER:
        lines.append(f"  paper (PipeTransformer, 8 GPUs, alpha=1/3, measured): {PAPER[r['model']]:.2f}x")
    lines.append(f"  ({r['seconds']} s; traced at b = {r['trace_sizes']})")
    return "\n".join(lines)


# A finite dataset of fixed samples (drawn once from the package's synthetic recipe), visited in a fresh
# order every epoch, every row named by its index: what AutoCache needs to reuse activations. Its size is
# the environment variable EPOCHS_DATA_SAMPLES of the process loading it (the file's docstring says why).
EPOCHS_DATA = ROOT / "examples" / "epochs_data.py"


def cpu_run(model: str, pretrained: str, work: Path, steps: int, every: int, cache: str = "off",
            samples: int | None = None) -> tuple[str, list[dict]]:
    """Compile ``model`` from a 6-layer local checkpoint for 4 CPU workers and freeze-train it on 4 ranks
    (on synthetic data, or with ``samples`` on a dataset of that many samples, AutoCache ``cache``)."""
    import subprocess

    pkg = work / f"{Path(pretrained).name}-pkg"
    py = [sys.executable, "-m", "ftcompile"]
    if not pkg.exists():
        subprocess.run(py + ["compile", model, "--pretrained", pretrained, "--cluster", "2xcpu", "--gpus", "4",
                             "--schedule", "1f1b", "--strategy", "seq", "--replicas", "1", "--optimizer", "momentum",
                             "-o", str(pkg), "-q"],
                       check=True, stdout=subprocess.DEVNULL)
    data, env = [], None
    if samples:     # its size reaches every rank through their environment
        data, env = ["--data", f"{EPOCHS_DATA}:epochs"], {**os.environ, "EPOCHS_DATA_SAMPLES": str(samples)}
    log = work / f"{Path(pretrained).name}-run-{cache}"
    r = subprocess.run(py + ["run", str(pkg), "--nproc", "4", "--steps", str(steps), "--optimizer", "momentum",
                             "--lr", "0.01", "--schedule", "1f1b", "--log-dir", str(log), "--overwrite-checkpoints",
                             *data, "--freeze", f"alpha=1/3,every={every},strategy=seq,cache={cache}"],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    lines = [json.loads(x) for x in (log / "freeze.jsonl").read_text().splitlines()]
    what = f"dataset of {samples} samples" if samples else "synthetic data"
    out = [f"{model} (6 layers, {pretrained}): {steps} steps, Eq. 1 every {every} steps, 4 ranks over gloo, {what}, "
           f"cache={cache}"]
    for x in lines:
        if "phase" in x and not x.get("decision"):
            line = (f"  phase {x['phase']}: steps {x['steps'][0]}-{x['steps'][1] - 1}, {x['frozen_layers']} frozen, "
                    f"P={x['P']} R={x['R']} M={x['M']}: {x['samples_per_s']} samples/s measured (training "
                    f"steps), transition/start-up {x['transition_s']:.1f} s")
            c = x.get("cache")
            if c:
                m, n = c.get("measured") or {}, c.get("counts") or {}
                line += (f"\n    AutoCache: {'reads ' + '+'.join(map(str, c.get('reads_levels') or [])) if c.get('used') else 'off'}"
                         f" ({c.get('why')}); {n.get('hits', 0)} hits, {n.get('advanced', 0)} advanced, "
                         f"{n.get('misses', 0)} misses; {n.get('bytes_read', 0) / 1e6:.2f} MB read in "
                         f"{n.get('read_s', 0):.3f} s, {n.get('bytes_written', 0) / 1e6:.2f} MB written in "
                         f"{n.get('write_s', 0):.3f} s (all ranks); measured per micro-batch: frozen forward "
                         f"{m.get('forward_ms', 0):.2f} ms, read {m.get('read_ms', 0):.2f} ms")
            out.append(line)
    for x in lines:
        if x.get("decision"):
            out.append(f"  step {x['step']}: {x['frozen_before']} -> {x['frozen_after']} frozen ({x['rule']})")
    recs = [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines()]
    return "\n".join(out), [x for x in recs if "step" in x]


def loss_agreement(off: list[float], on: list[float]) -> str:
    """How the two runs' losses compare step by step: identical, or where and by how much they differ
    (a phase may pick another micro-batch size with the cache on: the phase lines above say which)."""
    if len(off) != len(on):
        return f"different step counts ({len(off)} off, {len(on)} on)"
    differ = [i for i, (a, b) in enumerate(zip(off, on)) if a != b]
    if not differ:
        return f"identical at all {len(off)} steps"
    rel = max(abs(off[i] - on[i]) / max(abs(off[i]), 1e-30) for i in differ)
    return (f"identical at {len(off) - len(differ)} of {len(off)} steps; steps {differ[0]}-{differ[-1]} differ "
            f"by at most {rel:.1e} relative")


def frozen_forward_seconds(recs: list[dict], first: int, end: int) -> float:
    """Seconds the ranks spent in forward (every stage) over steps [first, end) of ``train.jsonl``."""
    return sum(st["forward_s"] for x in recs if first <= x["step"] < end for st in x["stages"].values())


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
    p.add_argument("--micro-batches", choices=("auto", "fixed"), default="auto",
                   help="auto: re-pick M (and b) at every transition as the runtime's controller does; fixed: keep "
                        "the traced micro-batch size (the earlier figures)")
    p.add_argument("--max-m", type=int, default=None, metavar="N",
                   help="price at most N micro-batch counts per pipeline length (default: the planner's, "
                        "6 spread over P..6P)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--cpu-run", action="store_true", help="also run the 4-process CPU end-to-end freeze runs")
    p.add_argument("--cpu-cache", type=int, default=0, metavar="N",
                   help="also run them on a dataset of N samples with AutoCache off and on (N = 8: an epoch a step)")
    p.add_argument("--work", default=None, help="folder for the CPU runs (default: a temporary one)")
    args = p.parse_args()
    cap_micro_batches(args.max_m)
    for name in [m for m in args.models.split(",") if m]:
        r = predict(name, args.cluster, args.alpha, args.intervals, args.strategy, args.micro_batches)
        print(json.dumps(r) if args.json else report(r), flush=True)
    if args.cpu_run or args.cpu_cache:
        import tempfile

        work = Path(args.work or tempfile.mkdtemp(prefix="ftcompile-freeze-"))
        work.mkdir(parents=True, exist_ok=True)
        for model, ckpt in make_checkpoints(work).items():
            if args.cpu_run:
                print(cpu_run(model, ckpt, work, steps=10, every=2)[0], flush=True)
            if args.cpu_cache:
                # the same run on a dataset of 8 samples per step's global batch, so every step is an
                # epoch: a phase's first step misses (or advances the cache), its later steps hit
                runs = {c: cpu_run(model, ckpt, work, steps=16, every=4, cache=c, samples=args.cpu_cache)
                        for c in ("off", "on")}
                for c, (text, _) in runs.items():
                    print(text, flush=True)
                loss = {c: [x["loss"] for x in recs] for c, (_, recs) in runs.items()}
                print(f"  losses with and without the cache: {loss_agreement(loss['off'], loss['on'])}")
                for first, end in ((4, 8), (8, 12), (12, 16)):
                    fw = {c: frozen_forward_seconds(recs, first, end) for c, (_, recs) in runs.items()}
                    print(f"  steps {first}-{end - 1}: forward seconds of every stage, all ranks: off "
                          f"{fw['off']:.3f} s, on {fw['on']:.3f} s", flush=True)


if __name__ == "__main__":
    main()
