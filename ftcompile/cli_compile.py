"""The ``compile``, ``simulate`` and ``diff`` commands of the ``ftcompile`` command line.

``compile`` runs the whole compiler: trace (or a graph file), profile (cached),
every partitioning strategy, simulation, and writes OUT/plan.json, OUT/report.md,
OUT/gpus.png and OUT/timeline.png, plus OUT/graph.json and OUT/profile.json so that
``simulate`` and later steps can resume from OUT without tracing again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from . import cli as base

CLUSTER_HELP = "a cluster preset (paper-8x2080ti, 4xv100-32gb, 8xa100-80gb, 8xh100-80gb, 2xcpu...) or a JSON file"


def add_parsers(sub) -> None:
    from .plan import SCHEDULES

    # ---- compile
    p = sub.add_parser(
        "compile", help="partition a model for P GPUs: all strategies compete, the best plan is kept",
        formatter_class=base._Formatter,
        description=(
            "Trace MODEL (or read a graph file), profile it, let every partitioning strategy\n"
            "propose a plan for the cluster (Mixed-pipe, Seq-pipe, acyclic, METIS, the uniform\n"
            "and parameter-balanced baselines, and an exact MIP on small graphs), price each plan\n"
            "with the stage-period objective (FTPipe Eq. 1) and per-GPU memory, simulate it under\n"
            "--schedule, and keep the feasible plan with the highest simulated throughput (one\n"
            "with less stale weights when the fastest is less than 1 % faster).\n\n"
            "Writes OUT/plan.json (the plan and the per-strategy table), OUT/report.md,\n"
            "OUT/gpus.png (one box per GPU: width = memory, fill = utilisation), OUT/timeline.png\n"
            "and .svg, and OUT/graph.json + OUT/profile.json to resume from."),
        epilog=(
            "examples:\n"
            "  ftcompile compile t5-tiny --gpus 3 -o out/t5-tiny\n"
            "  ftcompile compile t5-3b --batch-size 4 --encoder-len 512 --decoder-len 4 --gpus 8 \\\n"
            "      --gpu-memory 11GB --bandwidth 12GB/s --hardware rtx2080ti --schedule async -o out/t5-3b\n"
            "  ftcompile compile gpt2-xl --strategy mixed,seq --schedule 1f1b --micro-batches 8 -o out/gpt2"))
    base._add_common(p, top=False)
    p.add_argument("model", metavar="MODEL", help="a zoo name, a user model 'file.py:function', or an OpGraph JSON file")
    base._add_model_options(p)
    p.add_argument("--basic-blocks", metavar="CLASSES", help="trace at layer granularity (see `ftcompile trace --help`)")
    g = p.add_argument_group("cluster")
    g.add_argument("--cluster", metavar="NAME|FILE", help=CLUSTER_HELP + " (default: 8 GPUs of --hardware)")
    g.add_argument("--gpus", type=base._positive_int, metavar="P", help="number of GPUs (overrides the cluster's)")
    g.add_argument("--gpu-memory", metavar="SIZE", help="memory per GPU, e.g. 11GB or 32GiB")
    g.add_argument("--bandwidth", metavar="BW", help="GPU-to-GPU bandwidth, e.g. 12GB/s")
    g.add_argument("--hardware", metavar="NAME|FILE",
                   help=f"hardware the analytic costs are priced on (default: the cluster's, else {base.DEFAULT_HARDWARE})")
    g = p.add_argument_group("training")
    g.add_argument("--schedule", choices=SCHEDULES, default="async", help="pipeline schedule (default: async, FTPipe)")
    g.add_argument("--micro-batches", type=base._positive_int, default=4, metavar="M",
                   help="micro-batches per mini-batch (default: 4)")
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in backward (async always does, but for the last stage)")
    g.add_argument("--optimizer", choices=("sgd", "momentum", "adam", "adafactor"), default="adam",
                   help="optimizer whose state memory counts (default: adam)")
    _add_run_settings(g)
    from .avgpipe import add_arguments as _avgpipe_arguments

    _avgpipe_arguments(g)
    g = p.add_argument_group("strategies")
    g.add_argument("--strategy", default="auto", metavar="NAMES",
                   help="auto (all that apply) or a comma-separated list of: mixed, mixed-sim, seq, acyclic, "
                        "metis, uniform, params, exact (default: auto). Each returns its lowest objective; where "
                        "another of its candidates simulates faster, that plan gets a row NAME-sim of its own "
                        "(mixed-sim: Mixed-pipe's fastest plan in simulation, refined by simulated period)")
    g.add_argument("--replicas", type=_replicas_arg, default=None, metavar="R|auto",
                   help="data x pipeline: R copies of a pipeline over GPUs/R GPUs each; default auto: every R "
                        "dividing the GPUs is planned and simulated, the highest throughput is kept (a less stale "
                        "layout within 1 %% of it under async and pipedream)")
    g.add_argument("--jobs", type=base._positive_int, metavar="N", help="strategies run in parallel (default: cores)")
    g.add_argument("--max-stages", type=base._positive_int, metavar="N",
                   help="at most N pipeline stages in all: fewer stages, less staleness under async "
                        "(FTPipe found 16 best for T5-3B on 8 GPUs); default: no limit")
    g.add_argument("--time-limit", type=_seconds, metavar="SECONDS",
                   help="seconds each searching strategy may spend (seq's search over convex splits, "
                        "exact's MIP) before it returns its best plan and the bound proven so far "
                        "(default: 20)")
    g.add_argument("--bound-time", type=_seconds, metavar="SECONDS",
                   help="seconds the configuration LP may spend, after the searches, raising the bound over "
                        "every plan where the best plan is more than 0.1%% above it (whole nodes that no split "
                        "balances); 0: not run (default: as long as the searches took, at least 2 and at "
                        "most the --time-limit)")
    g.add_argument("--profile", dest="profile_file", metavar="FILE",
                   help="use this profile (from `ftcompile profile -o`) instead of an analytic one")
    g.add_argument("--cache-dir", metavar="DIR", default=base.DEFAULT_CACHE_DIR,
                   help=f"profile cache (default: {base.DEFAULT_CACHE_DIR})")
    p.add_argument("-o", "--output", metavar="OUT", required=True, help="output directory")
    p.add_argument("--json", action="store_true", help="print the strategies table and choice as JSON")
    p.set_defaults(func=cmd_compile)

    # ---- simulate
    p = sub.add_parser(
        "simulate", help="simulate a compiled plan under a schedule, with a timeline picture",
        formatter_class=base._Formatter,
        description=(
            "Discrete-event simulation of the plan in OUT (from `ftcompile compile`) under a\n"
            "schedule: throughput, bubble fraction, per-GPU busy time and peak memory, and a\n"
            "timeline picture (PNG and SVG) per GPU: forward, backward, recompute, send, idle."),
        epilog="example:\n  ftcompile simulate out/t5-tiny --schedule gpipe --micro-batches 8 -o gpipe.png")
    base._add_common(p, top=False)
    p.add_argument("plan", metavar="OUT", help="an output directory of `ftcompile compile` (with plan.json, graph.json, profile.json)")
    p.add_argument("--schedule", choices=SCHEDULES, help="schedule (default: the plan's)")
    p.add_argument("--micro-batches", type=base._positive_int, metavar="M", help="default: the plan's")
    p.add_argument("--steps", type=base._positive_int, default=2, metavar="K", help="mini-batches measured (default: 2)")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute activations in backward (default: the plan's)")
    _add_run_settings(p, default="the plan's")
    from .avgpipe import add_arguments as _avgpipe_arguments

    _avgpipe_arguments(p, auto=False)
    p.add_argument("-o", "--output", metavar="FILE.png", help="timeline picture (default: OUT/timeline-SCHEDULE.png; .svg beside it)")
    p.add_argument("--json", action="store_true", help="print the simulation figures as JSON")
    p.set_defaults(func=cmd_simulate)

    # ---- diff
    p = sub.add_parser(
        "diff", help="compare two plans: what moved, load, memory, objective",
        formatter_class=base._Formatter,
        description=(
            "Compare plans A and B (plan.json files or `ftcompile compile` output directories):\n"
            "which nodes run on another GPU, per-GPU load and memory side by side, and the\n"
            "objective, efficiency and simulated-throughput deltas."),
        epilog="example:\n  ftcompile diff out/t5-mixed out/t5-seq --picture diff.png")
    base._add_common(p, top=False)
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--json", action="store_true", help="print the difference as JSON")
    p.add_argument("--picture", metavar="FILE.png", help="also draw both plans' GPU boxes, one above the other")
    p.set_defaults(func=cmd_diff)


# --------------------------------------------------------------------------- compile

def _add_run_settings(g, default: str | None = None) -> None:
    """The settings of `ftcompile run` that change what a plan costs, so that the plan is priced
    (and later run) with them: a predicted weight copy per forward, and an update that waits for
    every stage (no tied-weight lag)."""
    g.add_argument("--weight-prediction", action=argparse.BooleanOptionalAction, default=None,
                   help="async: forwards run on predicted weights, one more weight copy per forward "
                        f"(default: {default or 'off'})")
    g.add_argument("--clip-grad-norm", type=_clip_value, default=None, metavar="X|none",
                   help="the run clips the global gradient norm: every update waits for all stages and "
                        f"tied weights do not lag (default: {default or 'none'})")
    g.add_argument("--on-nonfinite", choices=("stop", "skip"), default=None,
                   help="skip: the run skips non-finite steps, so every update waits for all stages "
                        f"(default: {default or 'stop'})")
    g.add_argument("--tied-lag", action=argparse.BooleanOptionalAction, default=None,
                   help="schedules without a flush: tied tensors apply the previous step's summed gradient, "
                        "no update waits for it, each holder's GPU keeps two steps' parts; --no-tied-lag: "
                        f"less memory, a wait per update (default: {default or 'on'})")
    g.add_argument("--in-flight-scale", type=_in_flight_value if default is None else _scale_value, default=None,
                   metavar="K|auto" if default is None else "K",
                   help="async/pipedream/2bw: every stage runs K x its depth + 1 forwards before its first backward "
                        "(1: FTPipe's and PipeDream's depth + 1), so a plan whose GPUs hold many stages keeps them "
                        "busy, at the cost of memory and, under async and pipedream, staler weights" +
                        (f" (default: {default})" if default else "; auto: for each plan where a GPU holds several "
                         "stages, the smallest scale past which simulation gains under 1%% (default auto)"))


def _scale_value(text: str) -> int:
    """``--in-flight-scale K``: a whole number of at least 1."""
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return k


def _in_flight_value(text: str) -> int | str:
    """``--in-flight-scale K|auto`` of compile."""
    return "auto" if text.strip().lower() == "auto" else _scale_value(text)


def _clip_value(text: str) -> float:
    """``--clip-grad-norm``: a finite number > 0, or ``none`` (0.0: no clipping)."""
    if text.strip().lower() in ("none", "off"):
        return 0.0
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None
    if not (v > 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, or none, got {text!r}")
    return v


def _predicts(args, ui) -> bool:
    """``--weight-prediction`` as it will take effect: only async forwards predict, and only from an
    optimizer with momentum or moments (priced otherwise, the plan would count a copy never made)."""
    from .runtime.optim import PREDICTS

    if not args.weight_prediction:
        return False
    if args.schedule != "async" or args.optimizer not in PREDICTS:
        ui.note(f"warning: --weight-prediction does nothing under --schedule {args.schedule} with --optimizer "
                f"{args.optimizer} (async, with {', '.join(p for p in PREDICTS if p != 'adamw')}); priced without it")
        return False
    return True


def _replicas_arg(text: str) -> int | None:
    """``--replicas``: ``auto`` (None: every count dividing the GPUs) or a positive integer."""
    if text == "auto":
        return None
    try:
        return base._positive_int(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'auto'") from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return v


@contextlib.contextmanager
def _native_stdout_to_stderr(active: bool):
    """With --json, what native libraries print on descriptor 1 goes to stderr (see
    :func:`ftcompile.compile.quiet_native_stdout`), so stdout holds the JSON alone."""
    if not active:
        yield
        return
    from .compile import quiet_native_stdout

    with quiet_native_stdout():
        yield


def _cluster(args: argparse.Namespace):
    from .cluster import PRESETS, default_cluster_for, load_cluster

    if args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        cluster = default_cluster_for(args.hardware) if args.hardware else PRESETS["paper-8x2080ti"]
    return cluster.with_overrides(gpus=args.gpus, gpu_memory=args.gpu_memory, bandwidth=args.bandwidth,
                                  hardware=args.hardware)


def _graph_and_built(args: argparse.Namespace, ui):
    from .ir import OpGraph

    if args.model.endswith(".json") and os.path.isfile(args.model):
        if base._given_model_options(args) or args.basic_blocks:
            raise base.UsageError("model options only apply when MODEL is a model, not a graph file")
        return OpGraph.load(args.model), None
    options = base._model_options(args)
    with ui.phases(f"trace {args.model}", base.TRACE_PHASES) as note:
        note("build")
        built = base._build(args.model, options)
        graph = base._trace_built(built, base._parse_blocks(args.basic_blocks, built.basic_blocks), note, ui=ui,
                                  args=args)
    return graph, built


def _analytic_profile(graph, hw, optimizer: str, cache_dir: str | None, ui):
    from .profile import cached, store

    key = base._profile_key_for(graph, "analytic", hw.name, optimizer)
    if cache_dir:
        prof = cached(cache_dir, key)
        if prof is not None and prof.graph_hash == graph.content_hash() and \
                json.loads(json.dumps(hw.to_json())) == prof.hardware:
            ui.note(f"reused cached profile {os.path.join(cache_dir, key + '.json')}")
            return prof
    with ui.steps("analytic profile") as progress:
        prof = base._run_profile(graph, method="analytic", hw=hw, optimizer=optimizer, progress=progress)
    if cache_dir:
        store(cache_dir, prof)
    return prof


def cmd_compile(args: argparse.Namespace) -> int:
    from .compile import CompileError, compile_plan, minimum_requirements, plan_document, write_report
    from .hardware import load_hardware
    from .plan import Problem, lags_tied_tensors
    from .profile import Profile

    ui = base._Ui(args)
    base._check_cache_dir(args)
    cluster = _cluster(args)
    from .replicas import layouts

    if args.schedule == "avgpipe":
        # AvgPipe's N parallel pipelines share the plan's GPUs in place of data-parallel replicas (the
        # runtime runs them as its replicas): a plan of one pipeline over every GPU, N tuned for it.
        if args.replicas not in (None, 1):
            raise CompileError(f"--replicas {args.replicas} with --schedule avgpipe: AvgPipe's parallel pipelines "
                               "share the GPUs in place of data-parallel replicas; drop --replicas (one pipeline over "
                               "all GPUs) and give --parallel-pipelines N or auto")
        args.replicas = 1
    lays = layouts(cluster, args.replicas)       # refuses an --replicas not dividing the GPUs, before tracing
    hw = load_hardware(args.hardware or cluster.hardware)
    t0 = time.perf_counter()
    phases: dict[str, float] = {}      # seconds per phase, for the --json summary and plan.json

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = round(now - since, 3)
        return now

    with base._stdout_for(args), _native_stdout_to_stderr(args.json):
        graph, built = _graph_and_built(args, ui)
        _check_loss(graph, args.model)
        from .codegen import CodegenError, check_custom_ops

        try:
            check_custom_ops(graph)          # before planning: the package could not call it
        except CodegenError as exc:
            raise CompileError(str(exc)) from None
        t = lap("trace", t0)
        if args.profile_file:
            prof = Profile.load(args.profile_file)
            prof.check_graph(graph)
        else:
            prof = _analytic_profile(graph, hw, args.optimizer, args.cache_dir, ui)
        from dataclasses import replace

        from .avgpipe import format_tuning, problem_advance, tune_for_compile

        from .runtime.schedules import CONTINUOUS

        if isinstance(args.in_flight_scale, int) and args.in_flight_scale > 1 and args.schedule not in CONTINUOUS:
            ui.note(f"warning: --in-flight-scale does nothing under --schedule {args.schedule} (it stretches the "
                    f"warm-up of {', '.join(CONTINUOUS)}); the plan records 1")
            args.in_flight_scale = 1
        problem = Problem(graph, prof, cluster, schedule=args.schedule, micro_batches=args.micro_batches,
                          recompute=args.recompute, advance=problem_advance(args),
                          weight_prediction=_predicts(args, ui), clip_grad_norm=args.clip_grad_norm or None,
                          on_nonfinite=args.on_nonfinite or "stop", tied_lag=args.tied_lag is not False,
                          in_flight_scale=1 if args.in_flight_scale in (None, "auto") else args.in_flight_scale)
        t = lap("profile", t)

        from .compile import resolve_strategies

        total = len(resolve_strategies(args.strategy, problem))
        warnings = _size_warnings(graph, cluster.num_gpus, args.max_stages, args.replicas, lays)
        for w in warnings:
            ui.note(f"warning: {w}")
        problem, options, chosen, least, lag_note = _partition(args, problem, ui, total * len(lays), warnings)
        t = lap("partition_and_simulate", t)
        result = _result_of(options, chosen)
        t = _tighten_bounds(args, result, ui, lap, t, phases["partition_and_simulate"])
        doc = plan_document(result, model=graph.source)
        if lag_note:
            doc["notes"] = [lag_note]
        if len(options) > 1 or options[0].layout.replicas > 1:
            from .compile import replicas_section

            doc["replicas"] = replicas_section(options, chosen, cluster)
        if args.schedule == "avgpipe" and result.chosen is not None:     # (M, N, advance), AvgPipe §5.2
            tuning = tune_for_compile(args, replace(result.problem, replicas=1, ring_bandwidth=None),
                                      result.best().plan)
            doc["avgpipe"] = tuning.to_json()
            ui.note(format_tuning(tuning))
            t = lap("avgpipe_tuning", t)
        if result.chosen is None:
            doc["requirements"] = minimum_requirements(least, time_limit=args.time_limit) + (
                " (without the tied-weight lag, which compile turns off by itself where only that fits)"
                if least is not problem else "")
            t = lap("requirements", t)
        doc["compile_seconds"] = round(time.perf_counter() - t0, 3)
        doc["phase_seconds"] = dict(phases)
        os.makedirs(args.output, exist_ok=True)
        base._save(graph, os.path.join(args.output, "graph.json"), "graph")
        base._save(prof, os.path.join(args.output, "profile.json"), "profile")
        paths = write_report(args.output, doc, result)
        t = lap("report", t)
        package = None
        if result.chosen is not None:
            package = _generate_package(args, graph, doc, built, ui)
            t = lap("codegen", t)
    if result.chosen is None:
        reasons = result.failure_reasons() or "; ".join(
            f"{o.layout.pipeline_gpus} GPUs x {o.layout.replicas} replicas: {o.reason}" for o in options)
        lag = (" Or --no-tied-lag: the tied-weight lag keeps two steps of every holder's gradient part on "
               "each holder's GPU." if args.tied_lag and lags_tied_tensors(problem) else "")
        raise CompileError(f"no strategy found a plan that fits ({reasons}). To fit: {doc['requirements']}.{lag} "
                           f"The table is in {paths['report']}")
    if result.chosen is not None:
        used = len(result.best().plan.gpus()) * result.problem.replicas
        if used < cluster.num_gpus:
            warnings.append(f"the chosen plan uses {used} of the {cluster.num_gpus} GPUs")
    summary = {"output": args.output, "chosen": result.chosen, "lower_bound_ms": result.lower_bound_ms,
               "strategies": doc["strategies"], "files": paths, "package": package, "warnings": warnings,
               "seconds": {**phases, "trace_and_profile": round(phases["trace"] + phases["profile"], 3),
                           "partition": round(result.seconds, 3),
                           "strategies": {r.name: round(r.seconds, 3) for r in result.results},
                           "total": round(time.perf_counter() - t0, 3)}}
    if args.json:
        base._emit_json(summary)
        return 0
    from .compile import report_text

    print(report_text(doc), end="")
    print(f"\nwrote {', '.join(paths.values())}")
    if package:
        print(f"package: {args.output} (verify with `ftcompile verify {args.output}`)")
    return 0


def _partition(args, problem, ui, steps: int, warnings: list[str]):
    """Every layout and strategy on ``problem``; where nothing fits with the tied-weight lag, which was
    not asked for (``args.tied_lag`` None), and something may without it, once more without it.

    Returns ``(problem, options, chosen, least, note)``: the problem planned (the unlagged one when
    that is what fits), the layouts' options and the chosen index, the problem whose minimum
    requirements a failure names (the unlagged one once compile would fall back to it), and the
    note saying the lag was turned off (also appended to ``warnings``), or None."""
    from dataclasses import replace

    from .plan import lags_tied_tensors
    from .replicas import compile_replicated

    def run(problem):
        done = []
        with ui.steps("partition", "strategy") as bar:
            def progress(r):
                done.append(r.name)
                bar(len(done), steps)
                ui.note(f"{r.name}: " + (f"{r.cost.objective_ms:.3f} ms, {r.cost.efficiency:.1%} of the lower "
                                         f"bound" if r.feasible else f"no plan ({r.reason})") + f" [{r.seconds:.1f} s]")

            def option_done(o):
                what = (f"{o.throughput:.3f} samples/s" + (" (screened)" if o.planned == "screened" else "")
                        if o.feasible else f"skipped ({o.reason})" if o.planned == "bounded"
                        else f"no plan ({o.reason})")
                ui.note(f"{o.layout.pipeline_gpus} GPUs x {o.layout.replicas} replicas ({o.layout.order}): {what}")

            return compile_replicated(problem, args.strategy, replicas=args.replicas, jobs=args.jobs,
                                      progress=option_done, strategy_progress=progress,
                                      max_stages=args.max_stages, time_limit=args.time_limit,
                                      tune_in_flight=args.in_flight_scale in (None, "auto"))

    options, chosen = run(problem)
    if chosen is not None or args.tied_lag is not None or not lags_tied_tensors(problem) or not _searched(options):
        return problem, options, chosen, problem, None
    # The lag's memory (two steps of every holder's gradient part per GPU) is what a plan cannot
    # hold: without it the run is plain async training with a wait per update.
    ui.note("no plan fits with the tied-weight lag; planning again without it (--no-tied-lag)")
    unlagged = replace(problem, tied_lag=False)
    options_nl, chosen_nl = run(unlagged)
    if chosen_nl is None:
        return problem, options, None, unlagged, None
    note = ("no plan fits with the tied-weight lag (each holder's GPU keeps two steps of every holder's "
            "gradient part), so this plan is for --no-tied-lag: tied tensors update without lag and every "
            "update waits for their summed gradient; the package records it and `ftcompile run` trains so")
    warnings.append(note)
    ui.note(f"warning: {note}")
    return unlagged, options_nl, chosen_nl, unlagged, note


def _searched(options) -> bool:
    """Whether some layout's strategies searched for a plan and did not fit: not refused for its static
    memory nor proven unable to fit by one op node's needs (:func:`memory_floor`), which no setting
    of the tied-weight lag changes."""
    return any(o.planned != "refused" and o.result is not None and not o.result.info.get("proven_no_fit")
               for o in options)


def _tighten_bounds(args, result, ui, lap, t, searched_s: float):
    """The configuration LP's bound for the chosen layout's rows (:func:`~ftcompile.compile.tighten_bounds`),
    for ``--bound-time`` seconds; by default as long as the searches took (``searched_s``), at least
    its first probe's 2 s and at most the ``--time-limit``: a bound should not cost a compile whose
    searches end in a second (gpt2-tiny, seq alone: 1 s) the 20 s it gives searches that use them."""
    from .compile import CONFIGURATION_FIRST_S, DEFAULT_TIME_LIMIT, tighten_bounds

    if result.chosen is None:
        return t
    limit = args.time_limit if args.time_limit is not None else DEFAULT_TIME_LIMIT
    seconds = args.bound_time if args.bound_time is not None else \
        min(limit, max(CONFIGURATION_FIRST_S, searched_s))
    done = tighten_bounds(result, seconds)
    if done is None:
        return t
    if done["raised"]:
        ui.note(f"bound: the configuration LP raised the bound over every plan from {done['from_ms']:.3f} to "
                f"{done['ms']:.3f} ms (best plan {done['plan_ms']:.3f}) [{done['seconds']:.1f} s]")
    else:
        ui.note(f"bound: the configuration LP did not raise the bound over every plan ({done['from_ms']:.3f} ms) "
                f"in {done['seconds']:.1f} s")
    return lap("bound", t)


def _result_of(options, chosen):
    """The CompileResult to write: the chosen layout's, or, when none fits, the longest pipeline's
    (whose table says best why nothing fits)."""
    if chosen is not None:
        return options[chosen].result
    ran = [o for o in options if o.result is not None]
    if ran:
        return min(ran, key=lambda o: o.layout.replicas).result
    from .compile import CompileResult

    return CompileResult(options[0].problem, [], None, 0.0)


def _check_loss(graph, model: str) -> None:
    """A pipeline trains on the loss: refuse a model whose first output is not a scalar loss."""
    from .compile import CompileError

    if graph.loss is None:
        outs = []
        for v in graph.outputs[:3]:
            meta = graph.node(graph.producer(v)).outputs[v] if graph.producer(v) is not None else None
            t = meta.tensor if meta is not None else None
            outs.append(f"{v} {t.dtype}{list(t.shape)}" if t is not None else v)
        outs_text = ", ".join(outs) or "nothing"
        raise CompileError(
            f"{model} returns no scalar training loss (its first outputs: {outs_text}); ftcompile compiles training "
            "pipelines, and the model's first output must be the loss as a 0-dimensional floating tensor, "
            "e.g. return `loss` or `(loss, logits)` from forward, or pass labels to a HuggingFace model")


def _size_warnings(graph, gpus: int, max_stages: int | None, replicas: int | None = 1, layouts=None) -> list[str]:
    """Warnings for a cluster larger than the graph can use or than compile plans in full
    (``replicas``: None for auto; ``layouts``: those :func:`ftcompile.replicas.layouts` gives)."""
    from .compile import DEGENERATE_SEARCH_GPUS
    from .replicas import SEARCHED_LAYOUTS, SEARCHING_STRATEGIES, screens

    ops = sum(1 for _ in graph.op_nodes())
    searched = min(ops, max(max_stages or 0, DEGENERATE_SEARCH_GPUS))
    P = gpus if replicas is None else gpus // replicas
    out = []
    if P > ops:
        per = f" per pipeline ({gpus} / {replicas} replicas)" if replicas not in (None, 1) else ""
        longer = "pipelines longer than that are" if replicas is None else "its plans are"
        out.append(f"{P} GPUs{per} but only {ops} op nodes: at most {ops} GPUs of a pipeline can hold a stage; "
                   f"{longer} searched on {searched} GPUs (trace at operator granularity, or use fewer GPUs)")
    elif max_stages is not None and gpus > max_stages:
        out.append(f"{gpus} GPUs but at most {max_stages} stages (--max-stages): a Seq-pipe uses at most "
                   f"{max_stages} of them")
    if layouts is not None and screens(layouts, replicas):
        out.append(f"{len(layouts)} layouts (pipeline GPUs x replicas) of {gpus} GPUs: planned shortest pipeline "
                   f"first without the searching strategies ({', '.join(SEARCHING_STRATEGIES)}), skipping a layout "
                   f"whose throughput bound is below the best found before it; the searching strategies then run "
                   f"on the layouts those found no plan for (where the bound reaches the best), on the "
                   f"{SEARCHED_LAYOUTS} best and on the one kept (--replicas R plans one layout with every strategy)")
    return out


def _generate_package(args, graph, doc, built, ui):
    """Code generation: writes the stage modules, manifest and weights into OUT."""
    from .codegen import compile_package

    return compile_package(built=built, graph=graph, doc=doc, out_dir=args.output)


# --------------------------------------------------------------------------- simulate

def _load_out(path: str):
    from .ir import OpGraph
    from .plan import Plan, load_plan_file
    from .profile import Profile

    doc = load_plan_file(path)
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    graph = OpGraph.load(os.path.join(folder, "graph.json"))
    prof = Profile.load(os.path.join(folder, "profile.json"))
    prof.check_graph(graph)
    if doc.get("graph_hash") != graph.content_hash():
        raise base.UsageError(f"{folder}/graph.json is not the graph plan.json was made for; re-run `ftcompile compile`")
    if not doc.get("plan"):
        raise base.UsageError(f"{folder}/plan.json holds no plan (no strategy found one that fits)")
    return doc, graph, prof, Plan.from_json(doc["plan"]), folder


def cmd_simulate(args: argparse.Namespace) -> int:
    from .compile import problem_from_doc
    from .simulate import simulate
    from .timeline import draw_timeline

    doc, graph, prof, plan, folder = _load_out(args.plan)
    schedule = args.schedule or doc["schedule"]
    from dataclasses import replace

    from .avgpipe import problem_advance, setting

    args.schedule = schedule
    problem = replace(problem_from_doc(doc, graph, prof, schedule=schedule, micro_batches=args.micro_batches,
                                       recompute=args.recompute, weight_prediction=args.weight_prediction,
                                       clip_grad_norm=args.clip_grad_norm, on_nonfinite=args.on_nonfinite,
                                       tied_lag=args.tied_lag, in_flight_scale=args.in_flight_scale),
                      advance=problem_advance(args))
    result = simulate(problem, plan, steps=args.steps)
    par = None
    if schedule == "avgpipe" and int(args.parallel_pipelines or 1) > 1:    # N pipelines share the GPUs
        par = setting(problem, plan, problem.micro_batches, int(args.parallel_pipelines), problem.advance)
    out = args.output or os.path.join(folder, f"timeline-{schedule}.png")
    draw_timeline(result, out)
    data = result.to_json(events=False)
    data["picture"] = out
    if par is not None:      # the timeline is one pipeline's; the figures below are all N's (ftcompile.avgpipe)
        data.update(parallel_pipelines=par.parallel, avgpipe_step_ms=par.step_ms,
                    avgpipe_throughput_samples_per_s=par.throughput, avgpipe_peak_memory=par.memory_bytes,
                    avgpipe_memory_feasible=par.fits,
                    avgpipe_gpu_memory=[{"gpu": g, "counted_bytes": c, "reserve_bytes": r}
                                        for g, (c, r) in enumerate(par.gpu_memory)])
    if args.json:
        base._emit_json(data)
        return 0
    print(f"{schedule}, {problem.micro_batches} micro-batches on {plan.num_gpus} GPUs ({doc['chosen']} plan):")
    print(base._kv([(k, v) for k, v in data.items() if not isinstance(v, (list, dict))]))
    print(f"wrote {out} (and .svg)")
    return 0


# --------------------------------------------------------------------------- diff

def cmd_diff(args: argparse.Namespace) -> int:
    from .compile import draw_gpu_boxes
    from .diff import diff_plans, diff_text
    from .plan import load_plan_file

    a, b = load_plan_file(args.a), load_plan_file(args.b)
    d = diff_plans(a, b)
    if args.picture:
        draw_gpu_boxes([(f"A {args.a}", a), (f"B {args.b}", b)], args.picture)
        d["picture"] = args.picture
    if args.json:
        base._emit_json(d)
        return 0
    sys.stdout.write(diff_text(d, "A", "B"))
    if args.picture:
        print(f"wrote {args.picture}")
    return 0

