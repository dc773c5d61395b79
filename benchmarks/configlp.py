"""The configuration LP's lower bound (ftcompile.partition.configlp) on placement-graph cases.

    python benchmarks/configlp.py --graph-file gnmt_training.json --gpus 6 --memory 0 --high 118.697

For each case it prints the bound (ms), the time it took, and, with ``--high`` (a plan's
objective, e.g. the table's mixed column), how far that plan is above it. The graphs are built as
``benchmarks/partition.py --graph-file ... --graph-weights 1 --graph-optimizer sgd
--graph-no-values`` builds them (free links; weights, gradients and plain SGD as memory).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graph-file", required=True, metavar="FILE.json")
    ap.add_argument("--gpus", type=int, default=6)
    ap.add_argument("--memory", type=float, default=0.0,
                    help="memory per GPU as a share of total/P (0: unlimited; default 0)")
    ap.add_argument("--high", type=float, metavar="MS",
                    help="a plan's objective: the bisection's top, and the ratio printed (default: the total)")
    args = ap.parse_args(argv)
    if args.gpus < 1 or args.memory < 0 or (args.high is not None and not args.high > 0):
        ap.error("--gpus must be at least 1, --memory at least 0 and --high above 0")
    from placement_graphs import GraphFileError, load_problem, with_share

    from ftcompile.partition.configlp import configuration_bound

    try:
        problem = with_share(load_problem(args.graph_file, args.gpus, weights=1, optimizer="sgd", values=False),
                             args.memory or None)
    except (GraphFileError, ValueError) as exc:
        ap.error(str(exc))
    high = args.high or sum(c.forward_ms + c.backward_ms + c.recompute_ms for c in problem.profile.nodes.values())
    t = time.perf_counter()
    bound = configuration_bound(problem, 0.0, high)
    line = f"{os.path.basename(args.graph_file)} P={args.gpus} memory={args.memory or 'unlimited'}: bound {bound:.3f} ms"
    if args.high:
        line += f", plan {args.high:.3f} = {args.high / bound:.4f} x the bound"
    print(f"{line} ({time.perf_counter() - t:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
