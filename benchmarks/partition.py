"""Partitioner benchmark: every strategy on the FTPipe paper's models (issue: partitioners that compete).

For each case: build the model on meta, trace it (operator granularity), profile it
analytically, run every strategy, and print one table per case: objective (stage
period per micro-batch), efficiency against the lower bound, expected speed-up
(FTPipe's figure of merit: total work / period), simulated throughput, memory and
run time. Strategies run one after another (``--jobs 1``, the default), so each
one's time is its own; ``ftcompile compile`` runs them in parallel on the cores.

Cases: the paper's T5-3B, GPT2-xl and BERT-large on its server (8 x RTX 2080 Ti,
11 GB, 12 GB/s), T5-11B (one example per micro-batch) on 4 x 32 GB V100, and two graphs of more than 5,000 op
nodes for the partitioners' run time: ``gpt2-5k`` (GPT-2 XL widths, 120 layers)
and ``t5-5k`` (T5-3B widths, 48 + 48 layers), on 8 x 32 GB V100 (their weights do
not fit the paper's server).

    python benchmarks/partition.py                      # the four paper cases
    python benchmarks/partition.py --case t5-3b --json out.json
    python benchmarks/partition.py --case gpt2-5k --case t5-5k
    python benchmarks/partition.py --all                # paper cases and the 5k graphs
    python benchmarks/partition.py --suite              # the balance-under-memory suite (below)

Per case, one table: objective (largest GPU load per micro-batch, FTPipe Eq. 1),
simulated period, the best bound proven for the plan's space and the gap to it,
both speed-ups (over one device without recomputation; FTPipe's, counting
recomputation), stages and staleness, memory, run time, and what each strategy
proved (seq: optimal over convex splits; exact: its MIP bound and what it covers).

Targets (printed PASS/FAIL, exit status 1 if any fails): T5-3B Mixed-pipe at least
94% of the lower bound (7.5 of 8); the whole t5-3b compile (build, trace, profile,
every strategy and its simulation) under 90 s; each heuristic partitioner under
20 s on a graph of 5,000 op nodes or more.

``--suite``: zoo models with parallel branches at layer and operator granularity
(BERT, GPT-2, T5, ViT, SkipNet, EncDec) on 3 and 6 GPUs with free links (balance and
memory only), with unlimited memory and with 1.2 x and 1.1 x (weights, gradients,
optimizer state and one micro-batch of activations) / P. It reports, per case,
whether seq proved its plan optimal among convex splits, Mixed-pipe against the
bound, and the chosen plan's simulated period against its objective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ftcompile.cluster import PRESETS
from ftcompile.compile import compile_plan
from ftcompile.hardware import load_hardware
from ftcompile.ir import atomic_write_text
from ftcompile.models import ModelOptions, build_model
from ftcompile.plan import Problem
from ftcompile.profile import analytic_profile
from ftcompile.trace import trace

# Optimizers as in the paper's Appendix A: Adafactor for T5, Adam(W) for GPT-2 and BERT.
# The optimizer decides the state memory: T5-11B with Adam needs 181 GB for weights,
# gradients and optimizer state alone, more than 4 x 32 GB; with Adafactor it fits.
CASES = {
    "t5-3b": dict(model="t5-3b", options=dict(batch_size=4, encoder_len=512, decoder_len=4),
                  cluster="paper-8x2080ti", hardware="rtx2080ti", optimizer="adafactor"),
    "gpt2-xl": dict(model="gpt2-xl", options=dict(batch_size=1, seq_len=1024),
                    cluster="paper-8x2080ti", hardware="rtx2080ti"),
    "bert-large": dict(model="bert-large", options=dict(batch_size=1, seq_len=384),
                       cluster="paper-8x2080ti", hardware="rtx2080ti"),
    # T5-11B keeps about 20 GB of activations per 512-token example (128 heads, d_ff 65,536):
    # a micro-batch of 4 (79 GB) cannot fit 4 x 32 GB next to 90.5 GB of weights, gradients
    # and Adafactor state under any plan, so one example per micro-batch (paper §5.8).
    "t5-11b": dict(model="t5-11b", options=dict(batch_size=1, encoder_len=512, decoder_len=4),
                   cluster="4xv100-32gb", hardware="v100-32gb", optimizer="adafactor"),
    # Deeper versions of zoo models, for graphs of more than 5,000 op nodes.
    "gpt2-5k": dict(model="gpt2-xl", config=dict(n_layer=120), options=dict(batch_size=1, seq_len=1024),
                    cluster="8xv100-32gb", hardware="v100-32gb"),
    "t5-5k": dict(model="t5-3b", config=dict(num_layers=48), options=dict(batch_size=4, encoder_len=512, decoder_len=4),
                  cluster="8xv100-32gb", hardware="v100-32gb", optimizer="adafactor"),
}
PAPER_CASES = ("t5-3b", "gpt2-xl", "bert-large", "t5-11b")
HEURISTICS = ("mixed", "seq", "acyclic", "metis", "uniform", "params")
LARGE_GRAPH = 5000


def build(case: dict):
    """The case's model on meta: a zoo entry, or a zoo entry with config fields changed."""
    options = ModelOptions(device="meta", **case["options"])
    if "config" not in case:
        return build_model(case["model"], options)
    from ftcompile.models import get_entry
    from ftcompile.models.hf import FAMILIES, build_hf

    entry = get_entry(case["model"])
    family = next(f for f in FAMILIES if f.family == entry.family)
    size = next(s for s in family.sizes if s.name == entry.name)
    size = dataclasses.replace(size, config={**size.config, **case["config"]})
    return build_hf(dataclasses.replace(family, sizes=(size,)), entry, options)


def run_case(name: str, schedule: str, micro_batches: int, jobs: int, time_limit: float | None = None) -> dict:
    case = CASES[name]
    t0 = time.perf_counter()
    built = build(case)
    t_build = time.perf_counter() - t0
    source = {"model": case["model"], "options": case["options"], **({"config": case["config"]} if "config" in case else {})}
    graph = trace(built.model, built.args, built.kwargs, source=source)
    t_trace = time.perf_counter() - t0 - t_build
    prof = analytic_profile(graph, load_hardware(case["hardware"]), optimizer=case.get("optimizer", "adam"))
    t_prof = time.perf_counter() - t0 - t_build - t_trace
    problem = Problem(graph, prof, PRESETS[case["cluster"]], schedule=schedule, micro_batches=micro_batches)
    result = compile_plan(problem, "auto", jobs=jobs, time_limit=time_limit)
    total = time.perf_counter() - t0
    rows = [r.row() for r in result.results]
    return {"case": name, "nodes": len(graph.nodes), "op_nodes": sum(1 for _ in graph.op_nodes()),
            "cluster": case["cluster"], "optimizer": case.get("optimizer", "adam"), "schedule": schedule, "jobs": jobs,
            "lower_bound_ms": result.lower_bound_ms, "chosen": result.chosen, "strategies": rows,
            "seconds": {"build": round(t_build, 2), "trace": round(t_trace, 2), "profile": round(t_prof, 2),
                        "partition_and_simulate": round(result.seconds, 2), "total": round(total, 2)}}


def note(s: dict) -> str:
    """Why a strategy failed, or what seq and exact proved."""
    from ftcompile.compile import _row_note

    return s["reason"] or _row_note(s)


def print_case(r: dict) -> list[tuple[str, bool]]:
    print(f"\n== {r['case']}: {r['op_nodes']} op nodes, {r['cluster']}, {r['schedule']}, {r['optimizer']}; lower bound "
          f"{r['lower_bound_ms']:.3f} ms; chosen {r['chosen']}; times {r['seconds']}")
    print(f"{'strategy':10}{'obj ms':>10}{'sim ms':>10}{'bound ms':>10}{'gap':>7}{'speedup':>8}{'FTPipe':>7}"
          f"{'stages':>7}{'stale':>6}{'mem GB':>8}{'time s':>8}  note")
    checks = []
    for s in r["strategies"]:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        mem = None if s["max_gpu_memory_bytes"] is None else s["max_gpu_memory_bytes"] / 1e9
        print(f"{s['name']:10}{f(s['objective_ms'], '.3f'):>10}{f(s.get('simulated_period_ms'), '.3f'):>10}"
              f"{f(s.get('bound_ms'), '.3f'):>10}{f(s.get('gap'), '.1%'):>7}{f(s.get('speedup_no_recompute'), '.2f'):>8}"
              f"{f(s['speedup'], '.2f'):>7}{f(s['stages'], 'd'):>7}{f(s.get('staleness_updates'), '.2g'):>6}"
              f"{f(mem, '.2f'):>8}{s['seconds']:>8.1f}  {note(s)[:90]}")
        if s["name"] in HEURISTICS and r["op_nodes"] >= LARGE_GRAPH:
            checks.append((f"{r['case']} ({r['op_nodes']} op nodes) {s['name']} under 20 s: {s['seconds']:.1f} s",
                           s["seconds"] < 20))
    if r["case"] == "t5-3b":
        mixed = next(s for s in r["strategies"] if s["name"] == "mixed")
        checks.append((f"t5-3b mixed efficiency >= 94%: {mixed['efficiency'] or 0:.1%} "
                       f"(speed-up {mixed['speedup'] or 0:.2f} of 8)",
                       bool(mixed["efficiency"] and mixed["efficiency"] >= 0.94)))
        checks.append((f"t5-3b whole compile under 90 s: {r['seconds']['total']:.1f} s", r["seconds"]["total"] < 90))
    return checks


# --------------------------------------------------------------------------- the suite

#: (model, basic blocks or None for operator granularity, options)
SUITE_GRAPHS = [
    ("bert-large", "auto", {}), ("gpt2-small", "auto", {}), ("t5-small", "auto", {}), ("vit-base", "auto", {}),
    ("bert-tiny", None, {}), ("gpt2-tiny", None, {}), ("skipnet", None, {}), ("encdec", None, {}),
]


def suite_problems(gpus=(3, 6), memory=(None, 1.2, 1.1)):
    """(label, Problem) for every suite graph, GPU count and memory share; free links."""
    from dataclasses import replace

    for model, blocks, opts in SUITE_GRAPHS:
        built = build_model(model, ModelOptions(device="meta" if blocks else "cpu", **opts))
        graph = trace(built.model, built.args, built.kwargs, source={"model": model},
                      basic_blocks=built.basic_blocks if blocks == "auto" else ())
        prof = analytic_profile(graph, load_hardware("rtx2080ti"), optimizer="adam")
        total = sum(c.total for c in prof.params.values()) + sum(c.activation_bytes for c in prof.nodes.values())
        for P in gpus:
            for share in memory:
                cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=P, bandwidth="1000000GB/s")
                if share is not None:
                    cluster = replace(cluster, gpu_memory=int(share * total / P))
                label = f"{model}{'-layer' if blocks else '-op'} P={P} mem={share or 'unlimited'}"
                yield label, Problem(graph, prof, cluster, schedule="async", micro_batches=4)


def run_suite(time_limit: float, jobs: int) -> list[dict]:
    rows = []
    print(f"{'case':36}{'ops':>5}{'seq':>9}{'proof':>8}{'mixed/lb':>10}{'best/lb':>9}{'chosen':>9}{'sim/obj':>9}"
          f"{'time s':>8}")
    for label, problem in suite_problems():
        t0 = time.perf_counter()
        result = compile_plan(problem, "auto", jobs=jobs, time_limit=time_limit)
        secs = time.perf_counter() - t0
        by = {r.name: r for r in result.results}
        seq = by.get("seq")
        mixed = by.get("mixed")
        lb = result.lower_bound_ms
        feas = [r for r in result.results if r.feasible]
        best = min((r.cost.objective_ms for r in feas), default=None)
        row = {"case": label, "op_nodes": sum(1 for _ in problem.graph.op_nodes()),
               "seq_ms": seq.cost.objective_ms if seq and seq.feasible else None,
               "seq_optimal": bool(seq and seq.feasible and seq.plan.info.get("optimal")),
               "seq_gap": seq.plan.info.get("gap") if seq and seq.feasible else None,
               "mixed_over_bound": mixed.cost.objective_ms / lb if mixed and mixed.feasible else None,
               "best_over_bound": best / lb if best else None, "chosen": result.chosen,
               "chosen_sim_over_objective": (result.best().sim["period_ms"] / result.best().cost.objective_ms
                                             if result.chosen else None),
               "rows": [r.row() for r in result.results], "seconds": round(secs, 1)}
        rows.append(row)
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        proof = "opt" if row["seq_optimal"] else (f"{row['seq_gap']:.1%}" if row["seq_gap"] is not None else "-")
        print(f"{label:36}{row['op_nodes']:>5}{f(row['seq_ms'], '.3f'):>9}{proof:>8}"
              f"{f(row['mixed_over_bound'], '.4f'):>10}{f(row['best_over_bound'], '.4f'):>9}{str(row['chosen']):>9}"
              f"{f(row['chosen_sim_over_objective'], '.4f'):>9}{secs:>8.1f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases (repeatable)")
    ap.add_argument("--all", action="store_true", help="the paper cases and the 5k-node graphs")
    ap.add_argument("--schedule", default="async")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1, help="strategies run in parallel (default 1: each timed alone)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--suite", action="store_true", help="the balance-under-memory suite instead of the paper cases")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per searching strategy (default 20)")
    args = ap.parse_args(argv)
    if args.suite:
        rows = run_suite(args.time_limit, max(args.jobs, 1))
        if args.json:
            atomic_write_text(args.json, json.dumps(rows, indent=1, default=str))
        return 0
    names = args.case or (list(CASES) if args.all else list(PAPER_CASES))
    results, checks = [], []
    for name in names:
        r = run_case(name, args.schedule, args.micro_batches, args.jobs, args.time_limit)
        results.append(r)
        checks += print_case(r)
        sys.stdout.flush()
    print("\ntargets:")
    for label, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}")
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
