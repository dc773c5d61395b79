"""Partitioner benchmark: every strategy on the FTPipe paper's models (issue: partitioners that compete).

For each case: build the model on meta, trace it (operator granularity), profile it
analytically, run every strategy, and print one table per case: objective (stage
period per micro-batch), efficiency against the lower bound, expected speed-up
(FTPipe's figure of merit: total work / period), simulated throughput, memory and
run time. Also times the whole compile of t5-3b (trace + profile + all
partitioners + simulation), and each heuristic on the largest graph.

    python benchmarks/partition.py            # all cases
    python benchmarks/partition.py --case t5-3b --json out.json

Targets (printed PASS/FAIL): T5-3B Mixed-pipe efficiency >= 94% (7.5 of 8); the whole
t5-3b compile under 90 s; each heuristic partitioner under 20 s.
"""

from __future__ import annotations

import argparse
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

CASES = {
    "t5-3b": dict(model="t5-3b", options=dict(batch_size=4, encoder_len=512, decoder_len=4),
                  cluster="paper-8x2080ti", hardware="rtx2080ti"),
    "gpt2-xl": dict(model="gpt2-xl", options=dict(batch_size=1, seq_len=1024),
                    cluster="paper-8x2080ti", hardware="rtx2080ti"),
    "bert-large": dict(model="bert-large", options=dict(batch_size=1, seq_len=384),
                       cluster="paper-8x2080ti", hardware="rtx2080ti"),
    "t5-11b": dict(model="t5-11b", options=dict(batch_size=4, encoder_len=512, decoder_len=4),
                   cluster="4xv100-32gb", hardware="v100-32gb"),
}
HEURISTICS = ("mixed", "seq", "acyclic", "metis", "uniform", "params")


def run_case(name: str, schedule: str, micro_batches: int) -> dict:
    case = CASES[name]
    t0 = time.perf_counter()
    built = build_model(case["model"], ModelOptions(device="meta", **case["options"]))
    graph = trace(built.model, built.args, built.kwargs,
                  source={"model": case["model"], "options": case["options"]})
    t_trace = time.perf_counter() - t0
    prof = analytic_profile(graph, load_hardware(case["hardware"]))
    t_prof = time.perf_counter() - t0 - t_trace
    problem = Problem(graph, prof, PRESETS[case["cluster"]], schedule=schedule, micro_batches=micro_batches)
    result = compile_plan(problem, "auto")
    total = time.perf_counter() - t0
    rows = [r.row() for r in result.results]
    return {"case": name, "nodes": len(graph.nodes), "cluster": case["cluster"], "schedule": schedule,
            "lower_bound_ms": result.lower_bound_ms, "chosen": result.chosen, "strategies": rows,
            "seconds": {"trace": round(t_trace, 2), "profile": round(t_prof, 2),
                        "partition_and_simulate": round(result.seconds, 2), "total": round(total, 2)}}


def print_case(r: dict) -> list[tuple[str, bool]]:
    print(f"\n== {r['case']}: {r['nodes']} nodes, {r['cluster']}, {r['schedule']}; lower bound "
          f"{r['lower_bound_ms']:.2f} ms; chosen {r['chosen']}; times {r['seconds']}")
    print(f"{'strategy':10}{'feasible':>9}{'obj ms':>10}{'eff':>8}{'speedup':>9}{'thr/s':>9}{'mem GB':>8}{'time s':>8}  note")
    checks = []
    for s in r["strategies"]:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        mem = None if s["max_gpu_memory_bytes"] is None else s["max_gpu_memory_bytes"] / 1e9
        print(f"{s['name']:10}{str(s['feasible']):>9}{f(s['objective_ms'], '.2f'):>10}{f(s['efficiency'], '.1%'):>8}"
              f"{f(s['speedup'], '.2f'):>9}{f(s['throughput'], '.2f'):>9}{f(mem, '.2f'):>8}{s['seconds']:>8.1f}  "
              f"{(s['reason'] or '')[:60]}")
        if s["name"] in HEURISTICS:
            checks.append((f"{r['case']} {s['name']} under 20 s", s["seconds"] < 20))
    if r["case"] == "t5-3b":
        mixed = next(s for s in r["strategies"] if s["name"] == "mixed")
        checks.append(("t5-3b mixed efficiency >= 94%", bool(mixed["efficiency"] and mixed["efficiency"] >= 0.94)))
        checks.append(("t5-3b whole compile under 90 s", r["seconds"]["total"] < 90))
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases")
    ap.add_argument("--schedule", default="async")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    results, checks = [], []
    for name in args.case or list(CASES):
        r = run_case(name, args.schedule, args.micro_batches)
        results.append(r)
        checks += print_case(r)
        sys.stdout.flush()
    print("\ntargets:")
    for label, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}")
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
