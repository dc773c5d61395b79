"""How the attention implementation changes the plans: eager against fused SDPA.

transformers runs ``scaled_dot_product_attention`` (SDPA) by default; on a GPU its fused
kernels (flash, memory-efficient) keep no ``s x s`` attention matrix for backward and
recompute it instead. The eager implementation materialises the matrix, its softmax
and its dropout mask, and keeps them. For each case the model is built on ``meta``
both ways (``--attention eager|sdpa``), traced, profiled analytically (SDPA priced as
the memory-efficient kernel: its FLOPs, causal blocks skipped, only the output and one
log-sum-exp per row kept), and partitioned by Mixed-pipe and Seq-pipe for the paper's
server (8 x RTX 2080 Ti, 11 GB, 12 GB/s, async, Adam, 4 micro-batches).

    python benchmarks/attention.py                     # gpt2-xl and bert-large
    python benchmarks/attention.py --case gpt2-xl --json out.json

Printed per case and attention: op nodes; forward and backward time of one
micro-batch on one GPU (analytic, summed over nodes); activation memory kept for
backward; the attention operators' share of it; and for each strategy the stage
period (objective), the expected speed-up (work over period, of 8), simulated
throughput and the largest per-GPU memory.
"""

from __future__ import annotations

import argparse
import json
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
    "gpt2-xl": dict(model="gpt2-xl", options=dict(batch_size=1, seq_len=1024)),
    "bert-large": dict(model="bert-large", options=dict(batch_size=1, seq_len=384)),
}
# what eager attention runs between the projections: scores, softmax, dropout, weighted sum
_EAGER_ATTENTION_OPS = {"aten.matmul.default", "aten.softmax.int", "aten._softmax.default", "aten.dropout.default",
                        "aten.native_dropout.default", "aten.where.self", "aten.div.Tensor", "aten.baddbmm.default",
                        "aten.bmm.default"}


def _attention_nodes(graph) -> list[int]:
    out = []
    for n in graph.op_nodes():
        scope = n.scope.rsplit(".", 1)[-1] if n.scope else ""
        if n.op == "aten.scaled_dot_product_attention.default":
            out.append(n.id)
        elif n.op in _EAGER_ATTENTION_OPS and ("attn" in n.scope or "attention" in n.scope) and "dense" not in scope:
            out.append(n.id)
    return out


def run(case: str, attention: str, strategies: list[str]) -> dict:
    spec = CASES[case]
    t0 = time.perf_counter()
    built = build_model(spec["model"], ModelOptions(device="meta", attention=attention, **spec["options"]))
    graph = trace(built.model, built.args, built.kwargs,
                  source={"model": spec["model"], "options": {**spec["options"], "attention": attention}})
    prof = analytic_profile(graph, load_hardware("rtx2080ti"), optimizer="adam")
    totals = prof.totals()
    att = _attention_nodes(graph)
    problem = Problem(graph, prof, PRESETS["paper-8x2080ti"], schedule="async", micro_batches=4)
    rows = {}
    for s in strategies:
        res = compile_plan(problem, [s], jobs=1)
        rows[s] = res.results[0].row()
    return {
        "case": case, "attention": attention, "op_nodes": sum(1 for _ in graph.op_nodes()),
        "forward_ms": totals["forward_ms"], "backward_ms": totals["backward_ms"],
        "activation_gb": totals["activation_bytes"] / 1e9,
        "attention_activation_gb": sum(prof.nodes[i].activation_bytes for i in att) / 1e9,
        "flops_forward": totals["flops_forward"], "flops_backward": totals["flops_backward"],
        "strategies": rows, "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    ap.add_argument("--strategies", default="mixed,seq")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args()
    strategies = args.strategies.split(",")
    out = []
    for case in args.case or list(CASES):
        for attention in ("eager", "sdpa"):
            r = run(case, attention, strategies)
            out.append(r)
            print(f"\n== {case}, {attention}: {r['op_nodes']} op nodes; one micro-batch on one GPU: forward "
                  f"{r['forward_ms']:.1f} ms, backward {r['backward_ms']:.1f} ms, activations kept "
                  f"{r['activation_gb']:.2f} GB (attention {r['attention_activation_gb']:.2f} GB); "
                  f"{r['seconds']} s")
            print(f"{'strategy':10}{'obj ms':>10}{'speedup':>9}{'thr/s':>9}{'mem GB':>8}{'stages':>8}")
            for s, row in r["strategies"].items():
                if not row["feasible"]:
                    print(f"{s:10}  infeasible: {row['reason']}")
                    continue
                print(f"{s:10}{row['objective_ms']:>10.2f}{row['speedup']:>9.2f}{row['throughput']:>9.2f}"
                      f"{row['max_gpu_memory_bytes'] / 1e9:>8.2f}{row['stages']:>8}")
    if args.json:
        atomic_write_text(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
