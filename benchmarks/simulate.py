"""How long the simulator takes to replay a plan of many stages, and what it found.

Mixed-pipe's and exact's plans under tight memory hold 100 to 250 stages on 6 GPUs; each
strategy simulates its candidates (``simulated_choice``) and refines by simulation, so the
simulator's speed sets how far past ``--time-limit`` a strategy runs. For each case this
script builds a plan (Mixed-pipe with ``--time-limit`` seconds, or the stages saved by an
earlier run with ``--save-plans``, so that two versions of the code replay the same plan),
replays it ``--repeat`` times with :func:`ftcompile.simulate.simulate` and prints:

* stages, steps simulated, tasks (stages x steps x (2M + 1): every F, B and U of every stage;
  the tasks of steps begun but not completed are not counted), periodic or not;
* the simulated period per micro-batch and the plan's objective;
* the fastest replay's seconds and microseconds per task.

    python benchmarks/simulate.py --model gpt2-tiny --model bert-tiny    # 6 GPUs, unlimited memory
    cd dnn-partitioning/throughput-inputs/OperatorGraphs && python .../benchmarks/simulate.py \\
        --graph-file bert_L-12_training.json --graph-file resnet50_training.json --gpus 6 --memory 1.1 \\
        --save-plans /tmp/plans.json        # then --plans /tmp/plans.json on another checkout

Graph files are the device-placement format of :mod:`placement_graphs` (weights 1, SGD, no value
bytes, as in ``partition.py``'s held-out runs); ``--model`` takes a zoo model's operator graph
with the analytic profile of an RTX 2080 Ti, as ``partition.py --suite`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def problems(args):
    """(label, Problem) per case."""
    if args.graph_file:
        from placement_graphs import load_problem, with_share

        for path in args.graph_file:
            pb = load_problem(path, args.gpus, weights=1, optimizer="sgd", values=False)
            yield f"{os.path.basename(path)} P={args.gpus} mem={args.memory or 'unlimited'}", \
                with_share(pb, args.memory)
    for model in args.model or ():
        from partition import suite_problems

        for label, pb in suite_problems(gpus=(args.gpus,), memory=(args.memory,), models=[f"{model}-op"]):
            yield label, pb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graph-file", action="append", help="a device-placement graph (repeatable)")
    ap.add_argument("--model", action="append", help="a zoo model, its operator graph (repeatable)")
    ap.add_argument("--gpus", type=int, default=6)
    ap.add_argument("--memory", type=float, default=0.0, help="per-GPU memory, x total / GPUs (0: unlimited)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="Mixed-pipe's budget per plan, seconds")
    ap.add_argument("--repeat", type=int, default=1, help="replays per plan (the fastest is printed)")
    ap.add_argument("--plans", help="replay the stages saved here by --save-plans instead of searching")
    ap.add_argument("--save-plans", help="save each plan's stages here (JSON)")
    args = ap.parse_args(argv)
    if not args.graph_file and not args.model:
        args.model = ["gpt2-tiny"]
    if args.gpus < 1 or args.repeat < 1 or args.time_limit <= 0 or args.memory < 0:
        ap.error("--gpus, --repeat and --time-limit must be positive, --memory at least 0")
    args.memory = args.memory or None
    if args.save_plans and not os.path.isdir(os.path.dirname(os.path.abspath(args.save_plans))):
        ap.error(f"--save-plans {args.save_plans}: its folder does not exist")

    from ftcompile.partition.base import Infeasible
    from ftcompile.partition.mixed import partition_mixed
    from ftcompile.plan import Plan, PlanError, check_plan, evaluate
    from ftcompile.simulate import simulate

    saved = {}
    if args.plans:
        try:
            with open(args.plans) as f:
                saved = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            ap.error(f"--plans {args.plans}: cannot read it ({exc})")
        if not isinstance(saved, dict):
            ap.error(f"--plans {args.plans}: expected a JSON object of plans by case, as --save-plans writes")
    out = {}
    print(f"{'case':44} {'stages':>6} {'steps':>5} {'tasks':>8} {'periodic':>8} {'period':>10} "
          f"{'objective':>10} {'seconds':>8} {'us/task':>7}")
    for label, pb in problems(args):
        if label in saved:
            try:
                plan = Plan.from_json(saved[label])
                check_plan(pb.graph, plan)
            except (KeyError, TypeError, ValueError, PlanError) as exc:
                ap.error(f"--plans {args.plans}: the plan of {label!r} is not a plan of this graph ({exc})")
        elif args.plans:
            print(f"{label}: not in {args.plans}; skipped")
            continue
        else:
            try:
                plan = partition_mixed(pb, time_budget_s=args.time_limit)
            except Infeasible as exc:
                print(f"{label}: no Mixed-pipe plan ({exc})")
                continue
        out[label] = plan.to_json()
        best = None
        for _ in range(args.repeat):
            t = time.perf_counter()
            sim = simulate(pb, plan)
            took = time.perf_counter() - t
            best = took if best is None else min(best, took)
        # every stage runs M forwards and M backwards per step and one update
        tasks = len(plan.stages) * sim.steps * (2 * pb.micro_batches + 1)
        print(f"{label:44} {len(plan.stages):6d} {sim.steps:5d} {tasks:8d} {str(sim.steady):>8} "
              f"{sim.period_ms:10.3f} {evaluate(pb, plan).objective_ms:10.3f} {best:8.2f} {1e6 * best / tasks:7.1f}",
              flush=True)
    if args.save_plans:
        # whole or not at all: written beside, then moved over the name
        tmp = f"{args.save_plans}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, args.save_plans)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
