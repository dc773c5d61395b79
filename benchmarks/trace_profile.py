#!/usr/bin/env python
"""Benchmark: trace and analytically profile the paper's large models on the meta device.

For each model a fresh Python process builds it on ``meta`` (no weights are
allocated), traces it at operator granularity and profiles it analytically on the
``rtx2080ti`` preset. The child reports wall times and its peak resident memory
(``VmHWM`` from /proc/self/status, read right after tracing and again after
profiling), so each model's peak is its own and includes the cost of importing
torch and transformers.

Targets: trace < 60 s and < 3 GB peak RSS; analytic profile < 10 s.

    python benchmarks/trace_profile.py                 # all four models, a table
    python benchmarks/trace_profile.py --json          # the same as JSON
    python benchmarks/trace_profile.py --models gpt2-xl,bert-large

Exit status: 0 if every row passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# name -> model options (the FTPipe paper's settings)
MODELS: dict[str, dict] = {
    "t5-3b": {"batch_size": 4, "encoder_len": 512, "decoder_len": 4},
    "gpt2-xl": {"batch_size": 1, "seq_len": 1024},
    "bert-large": {"batch_size": 1, "seq_len": 384},
    "t5-11b": {"batch_size": 4, "encoder_len": 512, "decoder_len": 4},
}
HARDWARE = "rtx2080ti"
TRACE_S = 60.0
TRACE_RSS = 3e9  # bytes (decimal GB throughout)
PROFILE_S = 10.0


def _peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def child(name: str, options: dict) -> dict:
    """Build, trace and profile one model in this process; return the figures."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    t = time.perf_counter()
    from ftcompile.hardware import load_hardware
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.profile import analytic_profile
    from ftcompile.trace import trace

    import_s = time.perf_counter() - t
    rss_imports = _peak_rss()
    t = time.perf_counter()
    built = build_model(name, ModelOptions(**options, device="meta"))
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    graph = trace(built.model, built.args, built.kwargs, source={"model": name, "options": options})
    trace_s = time.perf_counter() - t
    rss_trace = _peak_rss()
    t = time.perf_counter()
    profile = analytic_profile(graph, load_hardware(HARDWARE))
    profile_s = time.perf_counter() - t
    totals = profile.totals()
    return {
        "model": name, "options": options, "parameters": graph.num_parameters,
        "nodes": len(graph.nodes), "edges": len(graph.edges), "tracer": graph.source.get("tracer"),
        "trace_phases_s": graph.source.get("timings_s"), "functionalized": graph.source.get("functionalized"),
        "import_s": round(import_s, 2), "build_s": round(build_s, 2), "trace_s": round(trace_s, 2),
        "profile_s": round(profile_s, 2), "rss_after_imports": rss_imports, "trace_peak_rss": rss_trace,
        "peak_rss": _peak_rss(), "distinct_nodes": profile.info.get("distinct_nodes"),
        "forward_ms": round(totals["forward_ms"], 2), "backward_ms": round(totals["backward_ms"], 2),
    }


def run_one(name: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return {"model": name, "error": lines[-1] if lines else f"exit status {proc.returncode}"}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["process_s"] = round(wall, 2)
    return row


def check(row: dict) -> dict:
    if "error" in row:
        return {"trace_time": False, "trace_rss": False, "profile_time": False}
    return {"trace_time": row["trace_s"] < TRACE_S, "trace_rss": row["trace_peak_rss"] < TRACE_RSS,
            "profile_time": row["profile_s"] < PROFILE_S}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated subset of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    ap.add_argument("--timeout", type=float, default=600, help="seconds allowed per model (default: 600)")
    ap.add_argument("--child", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, MODELS[args.child])))
        return 0

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    rows = []
    for name in names:
        if not args.json:
            print(f"... {name}", file=sys.stderr, flush=True)
        row = run_one(name, args.timeout)
        row["checks"] = check(row)
        row["pass"] = all(row["checks"].values())
        rows.append(row)

    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"targets: trace < {TRACE_S:.0f} s and < {_gb(TRACE_RSS)} peak RSS; "
              f"analytic profile ({HARDWARE}) < {PROFILE_S:.0f} s\n")
        head = ("model", "options", "nodes", "build s", "trace s", "trace RSS", "profile s", "peak RSS", "result")
        table = []
        for r in rows:
            opts = " ".join(f"{k.split('_')[0]}={v}" for k, v in MODELS[r["model"]].items())
            if "error" in r:
                table.append((r["model"], opts, "-", "-", "-", "-", "-", "-", f"FAIL: {r['error']}"))
                continue
            failed = [k for k, ok in r["checks"].items() if not ok]
            table.append((r["model"], opts, f"{r['nodes']:,}", f"{r['build_s']:.1f}", f"{r['trace_s']:.1f}",
                          _gb(r["trace_peak_rss"]), f"{r['profile_s']:.1f}", _gb(r["peak_rss"]),
                          "PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"))
        widths = [max(len(str(x[i])) for x in [head, *table]) for i in range(len(head))]
        for k, line in enumerate([head, *table]):
            print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())
            if k == 0:
                print("  ".join("-" * w for w in widths))
        print("\nRSS is the process's peak resident memory (VmHWM) including torch/transformers imports "
              f"(~{_gb(min((r.get('rss_after_imports') or 0) for r in rows) if rows else 0)} after imports).")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
