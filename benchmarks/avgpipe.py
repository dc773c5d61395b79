"""AvgPipe: convergence of parallel pipelines on CPU, and AvgPipe against other schedules in simulation.

``convergence``: gpt2-tiny compiled as a 2-stage pipeline and trained with ``ftcompile run --nproc 2
--schedule avgpipe`` on the text corpus cut by file into a training and a held-out part, three ways, each
for the same number of sequences: (a) N = 1 with batch B = M micro-batches per step (1F1B); (b) N = 1 with
2B per step (2M micro-batches: the same optimizer steps as (c), what plain 2-way data parallelism
computes); (c) N = 2 parallel pipelines, alpha = 1/2, each taking B per step. Every run checkpoints every
``--eval-every`` sequences; each checkpoint's model (under AvgPipe the reference model, the average of the
N parallel models: what a checkpoint saves) is evaluated on the same held-out sequences with
:func:`ftcompile.runtime.evaluation.evaluate_checkpoint`. Prints training loss per window and held-out loss
against sequences seen, for each learning rate in ``--lrs``, and writes ``avgpipe_convergence.png`` (seed 0;
``avgpipe_convergence_seedS.png`` for another) in ``--figures`` (default: the current folder; ``--figures
benchmarks`` replaces benchmarks/README.md's). ``--seed`` seeds both the initial weights (``compile --seed``)
and the training data's order (``run --seed``); ``--runs`` trains only some of (a), (b), (c); ``--alpha`` runs
(c) at each given elastic coefficient (``run --elastic-alpha``; results keyed ``n2-aA-lrL``, alpha 1/2 keeping
the key ``n2-lrL``) and reports each as a run of its own. ``--load`` of
``--save`` files of several seeds reports each seed's final held-out losses, the paired differences between
the runs (same seed: same initial weights, same data order) with their mean and spread over the seeds (with
several learning rates, also (c) against (b) each at its own best one), and writes
``avgpipe_convergence_seeds.png``.

``simulate``: BERT-large and a GNMT-like model (8 + 8 LSTM layers of 1024, the shape of GNMT-8)
on 8 GPUs of a memory limit, compiled with Seq-pipe for 1F1B; the same plan simulated under
gpipe, 1f1b, pipedream and 2bw at the given M, and AvgPipe at the (M, N, advance) that
:func:`ftcompile.avgpipe.tune` chooses within the memory limit. Prints samples/s and the
fullest GPU's memory of each, and AvgPipe's speed-up over each.

``adapt``: advance forward propagation adapted while training (``--advance adapt[:LIMIT]``, Algorithm 1) on
gpt2-tiny compiled for 2 GPUs, 2 processes: first each fixed advance in {0, 1, 2, M/2, M} (median step time
after the first step, each rank's peak tensor bytes), then the adaptive run without a limit and with one
between the fixed runs' peaks at advance 1 and 2; prints every step's advance, time, peaks and decision.

    python benchmarks/avgpipe.py convergence --sequences 12800 --lrs 1e-3,2e-3,4e-3
    python benchmarks/avgpipe.py convergence --sequences 12800 --lrs 1e-3 --seed 1 --runs n1x2,n2 --save s1.json
    python benchmarks/avgpipe.py convergence --load s0.json s1.json s2.json
    python benchmarks/avgpipe.py convergence --sequences 12800 --lrs 1e-3 --runs n2 --alpha 1,0.25 --save a.json
    python benchmarks/avgpipe.py adapt --micro-batches 8 --steps 12
    python benchmarks/avgpipe.py simulate --models bert-large,gnmt --gpu-memory 16GB
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


# --------------------------------------------------------------------------- convergence

OPT_NAMES = {"adam": "Adam", "momentum": "SGD with momentum 0.9", "sgd": "plain SGD"}

#: The three runs compared at equal samples: (key, label, parallel pipelines, micro-batches per pipeline as a
#: multiple of M, what one optimizer step of a model sees).
RUNS = (("n1", "N = 1, batch B (1F1B)", 1, 1),
        ("n1x2", "N = 1, batch 2B (= data parallel x2)", 1, 2),
        ("n2", "N = 2 AvgPipe, alpha 1/2", 2, 1))


def _n2_key(alpha: float) -> str:
    """The result key of (c) at elastic coefficient ``alpha``; 1/2, the paper's 1/N and the only one measured
    before ``--alpha`` existed, keeps the plain key so older result files read as they did."""
    return "n2" if alpha == 0.5 else f"n2-a{alpha:g}"


def _columns(runs: dict) -> list[tuple[str, str, str]]:
    """(key, label, short name) of every run present in ``runs`` (a ``res["runs"]``): (a), (b), (c), then (c)
    at other elastic coefficients by alpha (files older than ``--alpha`` have no ``"alpha"``: 1/2)."""
    present = {r["key"]: r.get("alpha", 0.5) for r in runs.values()}
    names = {"n1": "(a) n1", "n1x2": "(b) n1x2", "n2": "(c) n2"}
    out = [(k, lab, names[k]) for k, lab, _, _ in RUNS if k in present]
    for k, a in sorted(((k, a) for k, a in present.items() if k not in names), key=lambda x: x[1]):
        out.append((k, f"N = 2 AvgPipe, alpha {a:g}", f"(c) a{a:g}"))
    return out


def _alphas(text: str) -> list[float]:
    try:
        xs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        xs = []
    if not xs or any(not 0.0 <= x <= 1.0 for x in xs):
        raise argparse.ArgumentTypeError(f"--alpha takes elastic coefficients in [0, 1], comma-separated "
                                         f"(e.g. 0.5,1), got {text!r}")
    return xs


def _run_keys(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    known = [k for k, *_ in RUNS]
    bad = [k for k in keys if k not in known]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"unknown run {', '.join(bad) or '(none given)'}; choose among "
                                         f"{', '.join(known)} (a, b, c), comma-separated")
    return keys


def _split_corpus(folder: Path, every: int) -> tuple[Path, Path, dict]:
    """The text corpus (the standard library's source) cut by file: every file whose path hashes to 0 mod
    ``every`` goes to the held-out part, the rest to the training part; each written as one file."""
    import re
    import zlib

    from ftcompile.runtime.data import corpus_bytes

    text = corpus_bytes()
    heads = list(re.finditer(rb"^# ---- (.+) ----\n", text, re.M))
    parts = {"train": [], "heldout": []}
    for i, h in enumerate(heads):
        body = text[h.start():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        parts["heldout" if zlib.crc32(h.group(1)) % every == 0 else "train"].append(body)
    out = {}
    for k, v in parts.items():
        out[k] = folder / f"{k}.py"
        out[k].write_bytes(b"".join(v))
    info = {k: {"files": len(v), "bytes": sum(map(len, v))} for k, v in parts.items()}
    return out["train"], out["heldout"], info


def _train_curve(log: Path, seqs_per_step: int) -> list[tuple[int, float]]:
    """(sequences seen after the step, the step's training loss: mean over the micro-batches of every
    parallel model) from a run's train.jsonl."""
    return [((r["step"] + 1) * seqs_per_step, r["loss"]) for r in map(json.loads, log.read_text().splitlines())
            if "loss" in r and "step" in r]


def _window_means(curve, edges: list[int]) -> list[float]:
    """Mean training loss over the steps after each edge up to the next (edges[0] = 0 excluded)."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        xs = [loss for s, loss in curve if lo < s <= hi]
        out.append(sum(xs) / len(xs) if xs else float("nan"))
    return out


def _run_all(args, tmp: Path) -> dict:
    import itertools

    from ftcompile.runtime import load_package
    from ftcompile.runtime.data import text_batches
    from ftcompile.runtime.evaluation import evaluate, evaluate_checkpoint

    py = str(Path(sys.executable).parent / "ftcompile")
    M, b = args.micro_batches, 2                        # gpt2-tiny's zoo micro-batch: 2 sequences of 32 bytes
    pkg = tmp / "pkg"
    # --replicas 1: a real 2-stage pipeline (left alone, the compiler keeps gpt2-tiny whole on each GPU)
    # --seed twice: the compiled package's initial weights (the zoo's seed; 0 is its default) and, below, the
    # run's data order (and dropout masks, off here). The held-out sequences do not depend on it.
    sh(py, "compile", "gpt2-tiny", "--cluster", "2xcpu", "--gpus", "2", "--schedule", "1f1b", "--strategy", "seq",
       "--replicas", "1", "--micro-batches", str(M), "--seed", str(args.seed), "-o", str(pkg), "--quiet")
    train, heldout, split = _split_corpus(tmp, args.heldout_every)
    package = load_package(pkg)
    per = 2 * M * b                                    # sequences per step of N = 2 (and of N = 1 at 2B)
    if args.sequences % args.eval_every or args.eval_every % per:
        raise SystemExit(f"--sequences must be a multiple of --eval-every, and that of {per}")
    hb = max(1, args.heldout_sequences // (M * b))
    held = list(itertools.islice(text_batches(package.manifest, micro_batches=M, seed=12345, root=str(heldout)), hb))
    edges = list(range(0, args.sequences + 1, args.eval_every))
    res = {"seed": args.seed, "optimizer": args.optimizer, "split": split, "M": M, "b": b, "edges": edges, "heldout_sequences": hb * M * b,
           "init_heldout": evaluate(package, held, micro_batches=M).loss, "runs": {}}
    todo = [(key, label, n, mult, None) for key, label, n, mult in RUNS if key in args.runs and n == 1]
    if "n2" in args.runs:
        todo += [(_n2_key(a), RUNS[2][1] if a == 0.5 else f"N = 2 AvgPipe, alpha {a:g}", 2, 1, a) for a in args.alpha]
    for lr in args.lrs:
        for key, label, n, mult, alpha in todo:
            seqs = n * mult * M * b                    # per optimizer step
            steps, every = args.sequences // seqs, args.eval_every // seqs
            name = f"{key}-lr{lr:g}"
            log, ck = tmp / ("log-" + name), tmp / ("ck-" + name)
            t0 = time.perf_counter()
            sh(py, "run", str(pkg), "--nproc", "2", "--schedule", "avgpipe", "--parallel-pipelines", str(n),
               "--advance", "1", "--micro-batches", str(mult * M), "--steps", str(steps), "--data", f"text:{train}",
               "--optimizer", args.optimizer, "--lr", str(lr), "--seed", str(args.seed), "--log-dir", str(log),
               "--checkpoint-dir", str(ck), "--checkpoint-every", str(every), "--progress", "off", "--no-dropout",
               *(("--elastic-alpha", str(alpha)) if alpha is not None else ()))
            seconds = time.perf_counter() - t0
            curve = _train_curve(log / "train.jsonl", seqs)
            held_loss = [res["init_heldout"]] + [
                evaluate_checkpoint(package, ck / f"step-{s // seqs:08d}", held, micro_batches=M).loss
                for s in edges[1:]]
            res["runs"][name] = {"key": key, "lr": lr, "label": label, "steps": steps, "seconds": seconds,
                                 "train": _window_means(curve, edges), "heldout": held_loss}
            if alpha is not None:
                res["runs"][name]["alpha"] = alpha    # files older than --alpha have none: 1/2
            print(f"  {name}: {steps} steps in {seconds:.0f} s, held-out {held_loss[-1]:.4f}", file=sys.stderr)
            shutil.rmtree(ck)
    return res


def _report(res: dict, args) -> None:
    edges, runs = res["edges"], res["runs"]
    lrs = sorted({r["lr"] for r in runs.values()})
    sp = res["split"]
    print(f"gpt2-tiny (2 stages, 2 processes, gloo) on the text corpus split by file: training part "
          f"{sp['train']['files']} files ({sp['train']['bytes'] / 1e6:.1f} MB), held-out part {sp['heldout']['files']} "
          f"files ({sp['heldout']['bytes'] / 1e6:.1f} MB); {OPT_NAMES[res.get('optimizer', 'adam')]}, constant lr, M = {res['M']} micro-batches of "
          f"{res['b']} sequences of 32 bytes per pipeline (B = {res['M'] * res['b']} sequences), dropout off, seed "
          f"{args.seed}.")
    print("train: mean training loss of the steps in the window ending at that many sequences (N = 2: mean over the "
          "two parallel models); held-out: the checkpoint's model (N = 2: the reference model, the average of the "
          f"two) on the same {res['heldout_sequences']} held-out sequences.")
    for lr in lrs:
        print(f"\nlr {lr:g}")
        cols = [(k, lab) for k, lab, _ in _columns(runs) if f"{k}-lr{lr:g}" in runs]
        head = "".join(f" {'train ' + k:>12} {'held ' + k:>12}" for k, _ in cols)
        print(f"{'sequences':>10}{head}")
        for i, e in enumerate(edges):
            row = ""
            for k, _ in cols:
                r = runs[f"{k}-lr{lr:g}"]
                tr = r["train"][i - 1] if i else float("nan")
                row += f" {tr:>12.4f} {r['heldout'][i]:>12.4f}"
            print(f"{e:>10}{row}")
    print(f"\nat {edges[-1]} sequences, held-out loss (N = 2 against each: the difference, relative to it):")
    best, cols = {}, _columns(runs)
    for k, lab, _ in cols:
        got = {r["lr"]: r["heldout"][-1] for r in runs.values() if r["key"] == k}
        best[k] = min(got.items(), key=lambda x: x[1])
        print(f"  {lab:<40} " + ", ".join(f"lr {lr:g}: {v:.4f}" for lr, v in sorted(got.items()))
              + f"; best lr {best[k][0]:g}")
    for c, clab, _ in cols:
        if c.startswith("n2"):
            for k, lab, _ in cols:
                if not k.startswith("n2"):
                    d = best[c][1] - best[k][1]
                    print(f"  {'N = 2' if c == 'n2' else clab} (best lr) against {lab} (best lr): {d:+.4f} "
                          f"({d / best[k][1]:+.1%})")
    _plot(res, args.seed, Path(args.figures))


def _colors(runs: dict) -> dict[str, str]:
    """A line colour per run key: (a), (b), (c) as before ``--alpha``, (c) at other alphas after them."""
    more = iter(["tab:purple", "tab:orange", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"] * 4)
    fixed = {"n1": "tab:blue", "n1x2": "tab:green", "n2": "tab:red"}
    return {k: fixed.get(k) or next(more) for k, _, _ in _columns(runs)}


def _plot(res: dict, seed: int, folder: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    edges, runs = res["edges"], res["runs"]
    lrs = sorted({r["lr"] for r in runs.values()})
    cols = min(2, len(lrs))
    rows = -(-len(lrs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows + 0.5), sharey=True, squeeze=False)
    colors = _colors(runs)
    for ax in axes.flat[len(lrs):]:
        ax.set_visible(False)
    for ax, lr in zip(axes.flat, lrs):
        for k, lab, _ in _columns(runs):
            r = runs.get(f"{k}-lr{lr:g}")
            if r is None:
                continue
            ax.plot(edges[1:], r["train"], color=colors[k], ls=":", lw=1)
            ax.plot(edges, r["heldout"], color=colors[k], marker=".", lw=1.5,
                    label=lab + (" (reference model)" if k.startswith("n2") else ""))
        ax.set_title(f"{OPT_NAMES[res.get('optimizer', 'adam')]}, lr {lr:g}", fontsize=10)
        ax.set_xlabel("sequences seen")
        ax.set_ylim(top=min(3.6, max(res["init_heldout"], 1.0)))
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("loss (solid: held-out;\ndotted: training)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"gpt2-tiny on the text corpus, 2 processes, seed {seed}: held-out loss of the checkpointed "
                 "model, training loss per window", fontsize=9)
    fig.tight_layout()
    # seed 0's is named as benchmarks/README.md's (written there only with --figures benchmarks)
    out = folder / ("avgpipe_convergence.png" if seed == 0 else f"avgpipe_convergence_seed{seed}.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def _load(files: list[str], default_seed: int) -> dict[int, dict]:
    """The ``--save`` files' results by seed: files of one seed (say, more learning rates) merged into one."""
    by_seed: dict[int, dict] = {}
    first: dict[int, str] = {}
    for f in files:
        try:
            got = json.loads(Path(f).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"cannot read {f} ({e}); give files written by convergence --save")
        seed = got.setdefault("seed", default_seed)      # files saved before the seed was recorded: --seed
        got.setdefault("optimizer", "adam")              # files saved before --optimizer: Adam
        res = by_seed.get(seed)
        if res is None:
            by_seed[seed], first[seed] = got, f
        elif any(got[k] != res[k] for k in ("edges", "split", "M", "heldout_sequences", "init_heldout", "optimizer")):
            raise SystemExit(f"{f} measured another setting than {first[seed]} (same seed {seed}); report them apart")
        else:
            res["runs"].update(got["runs"])
    some = next(iter(by_seed.values()))
    for seed, res in by_seed.items():
        if any(res[k] != some[k] for k in ("edges", "split", "M", "heldout_sequences", "optimizer")):
            raise SystemExit(f"seed {seed}'s files measured another setting (sequences, checkpoints, corpus split, M, "
                             "held-out sequences or optimizer) than the others; compare seeds of one setting only")
    return dict(sorted(by_seed.items()))


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (nan for one value) of ``xs``."""
    mean = sum(xs) / len(xs)
    return mean, (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else float("nan")


def _stats(xs: list[float], sign: str = "") -> str:
    """Mean, sample standard deviation, min and max of ``xs``."""
    mean, sd = _mean_sd(xs)
    return f"mean {mean:{sign}.4f}  sd {sd:.4f}  min {min(xs):{sign}.4f}  max {max(xs):{sign}.4f}"


def _reach(edges: list[int], curve: list[float], target: float) -> float:
    """Sequences after which ``curve`` (held-out loss at ``edges``) first reaches ``target``, linear between
    checkpoints; nan where it never does."""
    for i in range(1, len(edges)):
        if curve[i] <= target:
            lo, hi = curve[i - 1], curve[i]
            return edges[i - 1] + (edges[i] - edges[i - 1]) * (lo - target) / (lo - hi)
    return float("nan")


def _report_seeds(by_seed: dict[int, dict], folder: Path) -> None:
    """Final held-out loss of every run for every seed, the paired differences between runs (same seed: same
    initial weights and data order) and their spread over seeds, per learning rate."""
    some = next(iter(by_seed.values()))
    edges = some["edges"]
    print(f"gpt2-tiny (2 stages, 2 processes, gloo) on the text corpus split by file; {OPT_NAMES[some.get('optimizer', 'adam')]}, constant lr, M = "
          f"{some['M']} micro-batches of {some['b']} sequences of 32 bytes per pipeline, dropout off. Seeds "
          f"{', '.join(map(str, by_seed))}: each seed its own initial weights and training data order; the same "
          f"{some['heldout_sequences']} held-out sequences for all. Held-out loss of each run's model after "
          f"{edges[-1]} sequences (N = 2: the reference model).")
    lrs = sorted({r["lr"] for res in by_seed.values() for r in res["runs"].values()})
    cols = _columns({n: r for res in by_seed.values() for n, r in res["runs"].items()})
    names = {k: short for k, _, short in cols}
    tags = {k: "(c)" if k == "n2" else f"(c {short[4:]})" for k, _, short in cols}       # "(c)", "(c a1)"
    pairs = [(k, base, f"{tags[k]} - {tag}") for base, tag in (("n1x2", "(b)"), ("n1", "(a)"))
             for k, _, _ in cols if k.startswith("n2")] + [("n1x2", "n1", "(b) - (a)")]
    for lr in lrs:
        print(f"\nlr {lr:g}")
        finals = {seed: {r["key"]: r["heldout"][-1] for r in res["runs"].values() if r["lr"] == lr}
                  for seed, res in by_seed.items()}
        keys = [k for k, _, _ in cols if any(k in f for f in finals.values())]
        shown = [p for p in pairs if p[0] in keys and p[1] in keys]
        w = [max(10, len(lab)) for _, _, lab in shown]
        print(f"{'seed':>6} {'init':>8}" + "".join(f" {names[k]:>9}" for k in keys)
              + "".join(f" {lab:>{n}}" for (_, _, lab), n in zip(shown, w)))
        for seed, f in finals.items():
            row = "".join(f" {f[k]:>9.4f}" if k in f else f" {'-':>9}" for k in keys)
            row += "".join(f" {f[a] - f[b]:>+{n}.4f}" if a in f and b in f else f" {'-':>{n}}"
                           for (a, b, _), n in zip(shown, w))
            print(f"{seed:>6} {by_seed[seed]['init_heldout']:>8.4f}{row}")
        reach = []                    # sequences (b) needs to reach (c)'s final loss
        for res in by_seed.values():
            c, b = res["runs"].get(f"n2-lr{lr:g}"), res["runs"].get(f"n1x2-lr{lr:g}")
            if c and b:
                reach.append(_reach(edges, b["heldout"], c["heldout"][-1]))
        if reach:
            print("  (b) reaches (c)'s final held-out loss after " + ", ".join(f"{x:.0f}" for x in reach)
                  + f" sequences (seeds in order): (c) takes {edges[-1] / max(reach):.2f}x to "
                    f"{edges[-1] / min(reach):.2f}x the samples")
        for k in keys:
            xs = [f[k] for f in finals.values() if k in f]
            print(f"  {names[k]:<9} over {len(xs)} seeds: {_stats(xs)}")
        for a, b, lab in shown:
            _paired(lab, [(f[a], f[b]) for f in finals.values() if a in f and b in f])
    # each run at its own best learning rate, as a user who tunes each would compare them: among the learning
    # rates every seed measured, the one of lowest mean final loss; only runs measured at two or more
    full: dict[str, dict[float, dict[int, float]]] = {}
    for seed, res in by_seed.items():
        for r in res["runs"].values():
            full.setdefault(r["key"], {}).setdefault(r["lr"], {})[seed] = r["heldout"][-1]
    tuned = {}                        # key -> (its best lr, {seed: final loss at it})
    for k, per in full.items():
        every_seed = {lr: v for lr, v in per.items() if len(v) == len(by_seed)}
        if len(every_seed) > 1:
            tuned[k] = min(every_seed.items(), key=lambda x: sum(x[1].values()))
    if "n1x2" in tuned and any(k.startswith("n2") for k in tuned):
        b = tuned["n1x2"]
        print(f"\neach at its best learning rate (lowest mean over the seeds, among those all {len(by_seed)} "
              "measured):")
        for k, _, _ in cols:
            if k.startswith("n2") and k in tuned:
                c = tuned[k]
                _paired(f"{tags[k]} at lr {c[0]:g} - (b) at lr {b[0]:g}", [(c[1][s], b[1][s]) for s in by_seed])
    _plot_seeds(by_seed, lrs, folder)


def _paired(label: str, pairs: list[tuple[float, float]]) -> None:
    """Prints the spread of ``a - b`` over ``pairs`` (one per seed) with its relative mean and paired t."""
    if not pairs:                     # both measured, never in one seed
        return
    xs = [a - b for a, b in pairs]
    rel = [(a - b) / b for a, b in pairs]
    mean, sd = _mean_sd(xs)
    t = mean / (sd / len(xs) ** 0.5) if len(xs) > 1 and sd > 0 else float("nan")
    print(f"  {label} over {len(xs)} seeds: {_stats(xs, '+')}  (relative: mean {sum(rel) / len(rel):+.2%}, "
          f"{sum(x > 0 for x in xs)} of {len(xs)} positive; paired t = {t:.2f}, {len(xs) - 1} dof)")


def _plot_seeds(by_seed: dict[int, dict], lrs: list[float], folder: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    some = next(iter(by_seed.values()))
    edges = some["edges"]
    every = {n: r for res in by_seed.values() for n, r in res["runs"].items()}
    colors = _colors(every)
    fig, axes = plt.subplots(len(lrs), 2, figsize=(10.4, 3.4 * len(lrs) + 0.5), squeeze=False)
    for (ax, dax), lr in zip(axes, lrs):
        for k, lab, _ in _columns(every):
            first = True
            for seed, res in by_seed.items():
                r = res["runs"].get(f"{k}-lr{lr:g}")
                if r is None:
                    continue
                ax.plot(edges[1:], r["heldout"][1:], color=colors[k], lw=1, alpha=0.7,
                        label=lab + (" (reference model)" if k.startswith("n2") else "") if first else None)
                first = False
        ax.set_title(f"held-out loss, one line per seed ({OPT_NAMES[some['optimizer']]}, lr {lr:g})", fontsize=9)
        ax.set_xlabel("sequences seen")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        for seed, res in by_seed.items():
            c, b = res["runs"].get(f"n2-lr{lr:g}"), res["runs"].get(f"n1x2-lr{lr:g}")
            if c and b:
                dax.plot(edges[1:], [x - y for x, y in zip(c["heldout"][1:], b["heldout"][1:])], marker=".",
                         lw=1, label=f"seed {seed}")
        if not dax.lines:             # a learning rate without both (b) and (c)
            dax.set_visible(False)
            continue
        dax.axhline(0, color="black", lw=0.8)
        dax.set_title("(c) N = 2 reference model minus (b) N = 1 at 2B, same seed", fontsize=9)
        dax.set_xlabel("sequences seen")
        dax.set_ylabel("held-out loss difference")
        dax.grid(alpha=0.3)
        dax.legend(fontsize=7, ncol=2)
    fig.suptitle("gpt2-tiny on the text corpus, 2 processes: seeds (initial weights and data order)", fontsize=9)
    fig.tight_layout()
    out = folder / "avgpipe_convergence_seeds.png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def convergence(args) -> None:
    if not Path(args.figures).is_dir():     # before hours of training, not after
        raise SystemExit(f"--figures {args.figures}: no such folder; create it or name another")
    if args.load:
        by_seed = _load(args.load, args.seed)
        if len(by_seed) > 1:
            _report_seeds(by_seed, Path(args.figures))
            return
        res = next(iter(by_seed.values()))
        args.seed = res["seed"]
    else:
        from ftcompile.runtime.atomic import atomic_write_text

        with tempfile.TemporaryDirectory() as tmp:
            res = _run_all(args, Path(tmp))
        if args.save:
            atomic_write_text(Path(args.save), json.dumps(res, indent=1))
    _report(res, args)


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
    c.add_argument("--sequences", type=int, default=9600, help="sequences every run sees")
    c.add_argument("--eval-every", type=int, default=800, help="sequences between checkpoints evaluated")
    c.add_argument("--micro-batches", type=int, default=4, help="M per pipeline (B = 2M sequences)")
    c.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-3, 2e-3])
    c.add_argument("--optimizer", choices=sorted(OPT_NAMES), default="adam",
                   help="every run's optimizer (momentum: SGD with momentum 0.9; default adam)")
    c.add_argument("--seed", type=int, default=0,
                   help="seeds the initial weights (compile --seed) and the training data's order (run --seed)")
    c.add_argument("--runs", type=_run_keys, default=[k for k, *_ in RUNS],
                   help="which of the runs to train, comma-separated: n1 (a: N = 1, batch B), n1x2 (b: N = 1, "
                        "batch 2B), n2 (c: N = 2 AvgPipe); default all three")
    c.add_argument("--alpha", type=_alphas, default=[0.5],
                   help="elastic coefficients to run (c) with, comma-separated (run --elastic-alpha); default 0.5 "
                        "(the paper's 1/N). Each is a run of its own, keyed n2-aA-lrL (0.5: n2-lrL)")
    c.add_argument("--heldout-every", type=int, default=20, help="one file in this many goes to the held-out part")
    c.add_argument("--heldout-sequences", type=int, default=512)
    c.add_argument("--save", help="write the measured curves to this JSON file")
    c.add_argument("--figures", default=".", metavar="DIR",
                   help="folder for the figures (default: the current one; benchmarks/README.md's are in benchmarks/, "
                        "so --figures benchmarks replaces them)")
    c.add_argument("--load", nargs="+", help="report and plot the curves of --save files instead of training")
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
