"""AvgPipe: convergence of parallel pipelines on CPU, and AvgPipe against other schedules in simulation.

``convergence``: compile gpt2-tiny for 2 GPUs and train it with ``ftcompile run --nproc 2 --schedule
avgpipe`` on the text corpus, once with one pipeline (N = 1, which is 1F1B: both stages on two
ranks) and once with two parallel pipelines (N = 2: each pipeline's two stages on one rank,
elastic averaging across the two ranks), for the same number of samples. Prints the loss
against samples seen (mean over windows of samples) and writes ``avgpipe_convergence.png``.

``simulate``: BERT-large and a GNMT-like model (8 + 8 LSTM layers of 1024, the shape of GNMT-8)
on 8 GPUs of a memory limit, compiled with Seq-pipe for 1F1B; the same plan simulated under
gpipe, 1f1b, pipedream and 2bw at the given M, and AvgPipe at the (M, N, advance) that
:func:`ftcompile.avgpipe.tune` chooses within the memory limit. Prints samples/s and the
fullest GPU's memory of each, and AvgPipe's speed-up over each.

``adapt``: advance forward propagation adapted while training (``--advance adapt[:LIMIT]``, Algorithm 1) on
gpt2-tiny compiled for 2 GPUs, 2 processes: first each fixed advance in {0, 1, 2, M/2, M} (median step time
after the first step, each rank's peak tensor bytes), then the adaptive run without a limit and with one
between the fixed runs' peaks at advance 1 and 2; prints every step's advance, time, peaks and decision.

    python benchmarks/avgpipe.py convergence --steps 150
    python benchmarks/avgpipe.py adapt --micro-batches 8 --steps 12
    python benchmarks/avgpipe.py simulate --models bert-large,gnmt --gpu-memory 16GB
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path


def sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


# --------------------------------------------------------------------------- convergence

def _curve(log: Path) -> list[tuple[int, float]]:
    out = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            samples = (rec["step"] + 1) * rec["micro_batches"] * rec.get("parallel_pipelines", 1)
            out.append((samples, rec["loss"]))
    return out


def _windows(curve, width: int) -> dict[int, float]:
    """Mean loss over consecutive windows of ``width`` micro-batches' worth of samples (keyed by window end)."""
    sums: dict[int, list[float]] = {}
    for s, loss in curve:
        end = ((s - 1) // width + 1) * width
        sums.setdefault(end, []).append(loss)
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}


def convergence(args) -> None:
    py = str(Path(sys.executable).parent / "ftcompile")
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pkg"
        sh(py, "compile", "gpt2-tiny", "--cluster", "2xcpu", "--gpus", "2", "--schedule", "1f1b", "--strategy",
           "seq", "--micro-batches", str(args.micro_batches), "-o", str(pkg), "--quiet")
        curves = {}
        for n in (1, 2):
            log = Path(tmp) / f"log{n}"
            steps = args.steps // n            # the same samples: N pipelines see N batches per step
            sh(py, "run", str(pkg), "--nproc", "2", "--schedule", "avgpipe", "--parallel-pipelines", str(n),
               "--advance", "1", "--steps", str(steps), "--data", "text", "--optimizer", "adam", "--lr",
               str(args.lr), "--seed", "0", "--log-dir", str(log), "--progress", "off", "--no-dropout")
            curves[n] = _curve(log / "train.jsonl")
    width = args.micro_batches * 2 * 10          # 10 steps of N = 2
    w = {n: _windows(c, width) for n, c in curves.items()}
    mbs = 2      # gpt2-tiny's zoo micro-batch: 2 sequences of 32 tokens
    print(f"gpt2-tiny on the text corpus, Adam lr {args.lr}, M = {args.micro_batches} per pipeline, 2 processes; "
          f"mean loss per window of {width * mbs} sequences")
    print(f"{'sequences':>10} {'N=1 (1F1B)':>12} {'N=2 (AvgPipe)':>14}")
    for k in sorted(set(w[1]) & set(w[2])):
        print(f"{k * mbs:>10} {w[1][k]:>12.4f} {w[2][k]:>14.4f}")
    last = max(set(w[1]) & set(w[2]))
    print(f"final window: N=1 {w[1][last]:.4f}, N=2 {w[2][last]:.4f} ({(w[2][last] - w[1][last]) / w[1][last]:+.1%})")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for n, label in ((1, "N = 1 (1F1B)"), (2, "N = 2 (AvgPipe, alpha = 1/2)")):
            ax.plot([k * mbs for k in w[n]], list(w[n].values()), label=label)
        ax.set_xlabel("sequences seen")
        ax.set_ylabel("training loss (window mean)")
        ax.legend()
        fig.tight_layout()
        out = Path(__file__).with_name("avgpipe_convergence.png")
        fig.savefig(out, dpi=100)
        print(f"wrote {out}")
    except ImportError:
        pass


# --------------------------------------------------------------------------- Algorithm 1 while training

def _records(log: Path) -> list[dict]:
    return [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines() if '"step"' in x]


def adapt(args) -> None:
    import statistics

    py = str(Path(sys.executable).parent / "ftcompile")
    M = args.micro_batches
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "pkg"
        # the tests' 2-stage package (Seq-pipe over 2 CPU "GPUs"; `ftcompile compile` keeps gpt2-tiny on one)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from test_runtime import compiled

        compiled(pkg, "gpt2-tiny", "seq", 2)

        def run(name: str, advance: str) -> list[dict]:
            log = Path(tmp) / name
            sh(py, "run", str(pkg), "--nproc", "2", "--schedule", "avgpipe", "--advance", advance, "--micro-batches",
               str(M), "--steps", str(args.steps), "--measure-memory", "--log-dir", str(log), "--progress", "off")
            return _records(log)

        print(f"gpt2-tiny, 2 stages on 2 processes (gloo, CPU), M = {M}, {args.steps} steps each; peak = the "
              "tensor bytes a rank held at once in a step (runtime.memory)")
        print(f"{'fixed advance':>14} {'median step s':>14} {'peak rank 0':>12} {'peak rank 1':>12}")
        peaks = {}
        for k in sorted({0, 1, 2, M // 2, M}):
            recs = run(f"k{k}", str(k))[1:]
            peaks[k] = {r: max(x["ranks"][r]["memory_bytes"] for x in recs) for r in ("0", "1")}
            print(f"{k:>14} {statistics.median(x['seconds'] for x in recs):>14.4f} {peaks[k]['0']:>12} "
                  f"{peaks[k]['1']:>12}")
        limit = (max(peaks[1].values()) + max(peaks[2].values())) // 2
        for spec in ("adapt", f"adapt:{limit}"):
            print(f"\n--advance {spec}")
            print(f"{'step':>4} {'advance':>7} {'step s':>8} {'peak rank 0':>12} {'peak rank 1':>12}  decision")
            for x in run(spec.replace(":", "_"), spec):
                t = x.get("advance_tuning")
                what = f"{t['action']} -> {t['next_advance']}: {t['reason']}" if t else "(settled)"
                print(f"{x['step']:>4} {x['advance']:>7} {x['seconds']:>8.4f} {x['ranks']['0']['memory_bytes']:>12} "
                      f"{x['ranks']['1']['memory_bytes']:>12}  {what}")


# --------------------------------------------------------------------------- simulation

def gnmt_like(batch: int = 8, seq: int = 32, vocab: int = 32000, hidden: int = 1024, layers: int = 8):
    """A GNMT-8-shaped model: embedding, 8 stacked LSTM layers of ``hidden`` as encoder, 8 as decoder
    (each its own ``nn.LSTM`` so a plan can cut between them), attention of the decoder over the encoder,
    a vocabulary projection and cross-entropy."""
    import torch
    from torch import nn

    class GNMT(nn.Module):
        def __init__(self):
            super().__init__()
            self.src = nn.Embedding(vocab, hidden)
            self.tgt = nn.Embedding(vocab, hidden)
            self.enc = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers))
            self.dec = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers))
            self.att = nn.MultiheadAttention(hidden, 1, batch_first=True)
            self.out = nn.Linear(hidden, vocab)

        def forward(self, src, tgt, labels):
            h = self.src(src)
            for i, l in enumerate(self.enc):
                y, _ = l(h)
                h = y + h if i >= 2 else y
            d = self.tgt(tgt)
            for i, l in enumerate(self.dec):
                y, _ = l(d)
                d = y + d if i >= 2 else y
                if i == 0:
                    a, _ = self.att(d, h, h, need_weights=False)
                    d = d + a
            logits = self.out(d)
            return (nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1)),)

    g = torch.Generator().manual_seed(0)
    ids = lambda: torch.randint(0, vocab, (batch, seq), generator=g)  # noqa: E731
    return GNMT(), (ids(), ids(), ids())


def _problem(name: str, gpus: int, memory: str, M: int):
    from dataclasses import asdict

    from ftcompile.cluster import load_cluster
    from ftcompile.hardware import load_hardware
    from ftcompile.plan import Problem
    from ftcompile.profile import analytic_profile
    from ftcompile.trace import trace

    if name == "gnmt":
        with __import__("torch").device("meta"):
            model, args_ = gnmt_like()
        graph = trace(model, tuple(a.to("meta") for a in args_), {}, source={"model": "gnmt-like"})
    else:
        from ftcompile.models import ModelOptions, build_model
        built = build_model(name, ModelOptions(device="meta"))
        graph = trace(built.model, built.args, built.kwargs, source={"model": built.name,
                                                                     "options": asdict(built.options)})
    cluster = load_cluster("8xv100-32gb").with_overrides(gpus=gpus, gpu_memory=memory)
    prof = analytic_profile(graph, load_hardware(cluster.hardware), optimizer="adam")
    return Problem(graph, prof, cluster, schedule="1f1b", micro_batches=M)


def simulate_all(args) -> None:
    from ftcompile.avgpipe import tune
    from ftcompile.compile import compile_plan
    from ftcompile.plan import evaluate
    from ftcompile.simulate import simulate

    for name in args.models.split(","):
        problem = _problem(name, args.gpus, args.gpu_memory, args.micro_batches)
        result = compile_plan(problem, "seq", jobs=1)
        if result.chosen is None:
            print(f"{name}: no 1F1B plan fits {args.gpu_memory} per GPU")
            continue
        plan = result.best().plan
        rows = {}
        for sched in ("gpipe", "1f1b", "pipedream", "2bw"):
            pb = replace(problem, schedule=sched)
            try:
                sim = simulate(pb, plan)
                mem = max(g.memory_bytes for g in evaluate(pb, plan).gpus)
                rows[sched] = (sim.throughput_samples_per_s, mem, mem <= problem.cluster.gpu_memory)
            except ValueError as exc:
                rows[sched] = (0.0, 0, f"{exc}")
        print(f"\n{name} on {args.gpus} GPUs of {args.gpu_memory}, Seq-pipe plan of {len(plan.stages)} stages, "
              f"M = {args.micro_batches} for the baselines:")
        print(f"{'schedule':>36} {'samples/s':>10} {'GiB (fullest GPU)':>18} {'fits':>5}")
        for s, (thr, mem, fits) in rows.items():
            print(f"{s:>36} {thr:>10.1f} {mem / 2**30:>18.2f} {str(fits):>5}")
        # same batch per model as the baselines (M fixed: the paper's fair setting), then M tuned too
        # (a larger M is a larger batch per model here: the micro-batch size is the profiled one)
        for what, Ms in (("same M", (args.micro_batches,)),
                         ("M tuned", sorted({args.micro_batches, 2 * args.micro_batches, 4 * args.micro_batches}))):
            t = tune(problem, plan, micro_batches=Ms, parallel=(1, 2, 3, 4))
            c = t.chosen
            if c is None:
                print(f"{'avgpipe (' + what + ')':>36}: no setting fits")
                continue
            label = f"avgpipe {what}: M={c.micro_batches} N={c.parallel} adv={c.advance}"
            print(f"{label:>36} {c.throughput:>10.1f} {c.memory_bytes / 2**30:>18.2f} {str(c.fits):>5}")
            print("    " + ", ".join(f"/ {s}: {c.throughput / thr:.2f}x" for s, (thr, _, fits) in rows.items()
                                     if thr and fits is True))
        eq = max(t.settings, key=lambda s: (s.fits, -s.predicted_step_ms / (s.parallel * s.micro_batches)))
        print(f"  the paper's equations (from M={t.profiled[0]}, N=1) would choose M={eq.micro_batches} "
              f"N={eq.parallel} adv={eq.advance}: {eq.throughput:.1f} samples/s simulated")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("convergence")
    c.add_argument("--steps", type=int, default=200, help="steps of N = 1 (N = 2 runs half as many)")
    c.add_argument("--micro-batches", type=int, default=4)
    c.add_argument("--lr", type=float, default=1e-3)
    a = sub.add_parser("adapt")
    a.add_argument("--micro-batches", type=int, default=8)
    a.add_argument("--steps", type=int, default=12)
    s = sub.add_parser("simulate")
    s.add_argument("--models", default="bert-large,gnmt")
    s.add_argument("--gpus", type=int, default=8)
    s.add_argument("--gpu-memory", default="16GB")
    s.add_argument("--micro-batches", type=int, default=8)
    args = ap.parse_args()
    {"convergence": convergence, "adapt": adapt, "simulate": simulate_all}[args.what](args)


if __name__ == "__main__":
    main()
