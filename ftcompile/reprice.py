"""A package's plan priced again under the settings a run actually uses.

A plan's memory and period hold for the settings it was priced with: schedule, micro-batches,
recomputation, optimizer, weight prediction, whether every update waits for all stages
(clipping, skipping non-finite steps), and the ranks that train it: the replicas whose
gradients each stage averages (an all-reduce and its bucket), their rank order (which GPUs
form the rings), and how many ranks run one pipeline (fewer ranks than planned GPUs put
several GPUs' stages on one device). ``ftcompile run`` takes all of them from the plan unless
told otherwise (:func:`ftcompile.runtime.options.planned_settings`); when an option changes one,
the launcher prices the same plan under the run's settings before any rank starts
(:func:`reprice`), says what changed and what the plan now needs, and refuses a run on GPUs
that the plan no longer fits. It lives on the compiler side: ``ftcompile.runtime`` never imports
the cost model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .runtime.optim import PREDICTS
from .runtime.schedules import CONTINUOUS, OPTIONAL_RECOMPUTE, SYNCHRONOUS, exchanges_norms

#: Run optimizers priced as one of the profile's (AdamW keeps Adam's two moments).
PRICED_AS = {"adamw": "adam"}
#: How a setting is named in what a run prints.
LABELS = {"micro_batches": "micro-batches", "weight_prediction": "weight prediction",
          "exchanges_norms": "updates wait for all stages (clipping, --on-nonfinite skip)", "tied_lag": "tied-weight lag",
          "in_flight_scale": "in-flight scale",
          "rank_order": "rank order", "pipeline_ranks": "ranks per pipeline"}
#: The run options behind each setting.
SOURCES = {"exchanges_norms": ("clip_grad_norm", "on_nonfinite"), "replicas": ("replicas", "nproc"),
           "pipeline_ranks": ("nproc", "replicas")}


@dataclass(frozen=True)
class Settings:
    """What a plan's cost depends on among a run's options, each as it takes effect."""

    schedule: str
    micro_batches: int
    recompute: bool | None   # asked for; None where the schedule decides (async always, pipedream never)
    optimizer: str           # as priced: adamw is adam
    weight_prediction: bool  # in effect: async with an optimizer that predicts
    exchanges_norms: bool    # every update waits for all stages (clipping, skipping non-finite steps)
    tied_lag: bool | None = None   # asked for; None where the schedule flushes (nothing lags)
    replicas: int = 1              # pipelines whose gradients each stage averages
    rank_order: str | None = None  # how replicas' ranks are numbered; None with one replica
    pipeline_ranks: int | None = None   # ranks (devices) running one pipeline; None: not known here
    in_flight_scale: int | None = None  # warm-up forwards per stage downstream; None where the schedule ignores it

    @staticmethod
    def of(schedule: str, micro_batches: int, recompute, optimizer: str, weight_prediction, clip_grad_norm,
           on_nonfinite: str | None, tied_lag=True, *, replicas: int = 1, rank_order: str | None = None,
           pipeline_ranks: int | None = None, in_flight_scale: int | None = 1) -> "Settings":
        replicas = max(int(replicas or 1), 1)
        return Settings(schedule, int(micro_batches), bool(recompute) if schedule in OPTIONAL_RECOMPUTE else None,
                        PRICED_AS.get(optimizer, optimizer),
                        bool(weight_prediction) and schedule == "async" and optimizer in PREDICTS,
                        exchanges_norms(clip_grad_norm, on_nonfinite or "stop"),
                        None if schedule in SYNCHRONOUS else tied_lag is not False,
                        replicas, (rank_order or "pipeline-major") if replicas > 1 else None, pipeline_ranks,
                        int(in_flight_scale or 1) if schedule in CONTINUOUS else None)


def planned(manifest) -> Settings:
    """The settings the package's plan was priced with (one rank per planned GPU)."""
    return Settings.of(manifest.schedule, manifest.micro_batches, manifest.recompute, manifest.optimizer,
                       manifest.weight_prediction, manifest.clip_grad_norm, manifest.on_nonfinite, manifest.tied_lag,
                       replicas=manifest.replicas, rank_order=manifest.rank_order,
                       pipeline_ranks=max(manifest.num_gpus, 1), in_flight_scale=manifest.in_flight_scale)


def of_run(args, *, replicas: int = 1, rank_order: str | None = None, pipeline_ranks: int | None = None) -> Settings:
    """The settings of resolved run options (:func:`ftcompile.runtime.options.resolve`) on a job of
    ``replicas`` pipelines of ``pipeline_ranks`` ranks each (None: one rank per planned GPU)."""
    return Settings.of(args.schedule, args.micro_batches, args.recompute, args.optimizer, args.weight_prediction,
                       args.clip_grad_norm, args.on_nonfinite, getattr(args, "tied_lag", True),
                       replicas=replicas, rank_order=rank_order, pipeline_ranks=pipeline_ranks,
                       in_flight_scale=getattr(args, "in_flight_scale", 1))


def changes(plan: Settings, run: Settings) -> list[tuple[str, object, object]]:
    """``(setting, planned, run)`` for every setting that differs (recomputation only where both
    schedules let it be chosen: otherwise the schedule's change says it)."""
    out = []
    for f in dataclasses.fields(Settings):
        a, b = getattr(plan, f.name), getattr(run, f.name)
        if a != b and not (f.name in ("recompute", "tied_lag", "rank_order", "pipeline_ranks", "in_flight_scale") and None in (a, b)):
            out.append((f.name, a, b))
    return out


@dataclass
class Repriced:
    """The plan under the run's settings: the simulated period and every GPU's peak against its memory."""

    changed: list[tuple[str, object, object]]
    planned_period_ms: float | None      # the plan's own simulated period per micro-batch
    period_ms: float                     # under the run's settings
    gpu_peak: list[int]                  # simulated peak per GPU, reserve included
    gpu_memory: int                      # what each GPU has
    reason: str | None = None            # why the plan does not fit (evaluate's words), or None

    @property
    def fits(self) -> bool:
        return self.reason is None


def reprice(folder: str | os.PathLike, plan_settings: Settings, run: Settings, *,
            gpu_memory: int | None = None) -> Repriced | None:
    """The package's plan in ``folder`` (priced with ``plan_settings``, :func:`planned`) priced and
    simulated under ``run``, on GPUs of ``gpu_memory``
    bytes (default: the plan's cluster's); None when nothing that prices it differs from what it was
    planned with, or the package lacks its graph or profile. Raises ValueError when graph.json is
    not the graph the plan was made for."""
    from .compile import problem_from_doc
    from .ir import OpGraph
    from .plan import Plan, evaluate, load_plan_file
    from .profile import Profile, param_costs
    from .simulate import simulate
    from .units import format_bytes

    folder = os.fspath(folder)
    doc = load_plan_file(os.path.join(folder, "plan.json"))
    changed = changes(plan_settings, run)
    graph_file, profile_file = os.path.join(folder, "graph.json"), os.path.join(folder, "profile.json")
    if not changed or not doc.get("plan") or not (os.path.isfile(graph_file) and os.path.isfile(profile_file)):
        return None
    graph, prof = OpGraph.load(graph_file), Profile.load(profile_file)
    prof.check_graph(graph)
    if doc.get("graph_hash") != graph.content_hash():
        raise ValueError(f"{graph_file} is not the graph plan.json was made for")
    if run.optimizer != prof.optimizer:
        # Another optimizer keeps other state: the same weights and gradients, its own state bytes.
        state = param_costs(graph, run.optimizer)
        prof = dataclasses.replace(prof, optimizer=run.optimizer, params={
            n: dataclasses.replace(c, optimizer_bytes=state[n].optimizer_bytes) if n in state else c
            for n, c in prof.params.items()})
    problem = problem_from_doc(doc, graph, prof, schedule=run.schedule, micro_batches=run.micro_batches,
                               recompute=bool(run.recompute), weight_prediction=run.weight_prediction,
                               tied_lag=run.tied_lag is not False, on_nonfinite="stop",
                               in_flight_scale=run.in_flight_scale or 1,
                               # what prices a plan is whether updates wait for all stages, not the norm
                               clip_grad_norm=1.0 if run.exchanges_norms else 0.0)
    plan = Plan.from_json(doc["plan"])
    if any(name in ("replicas", "rank_order", "pipeline_ranks") for name, _, _ in changed):
        problem, plan = on_ranks(problem, plan, run)
    if gpu_memory is not None:
        problem = dataclasses.replace(problem, cluster=dataclasses.replace(problem.cluster, gpu_memory=gpu_memory))
    cost = evaluate(problem, plan)
    sim = simulate(problem, plan)
    reason = cost.reason if not cost.feasible else None
    if reason is None and not sim.memory_feasible:
        g = max(range(len(sim.gpu_peak_memory)), key=lambda i: sim.gpu_peak_memory[i])
        reason = f"GPU {g} peaks at {format_bytes(sim.gpu_peak_memory[g])} in the simulated run"
    return Repriced(changed, (doc.get("simulation") or {}).get("period_ms"), sim.period_ms,
                    list(sim.gpu_peak_memory), problem.cluster.gpu_memory, reason)


def on_ranks(problem, plan, run: Settings):
    """``problem`` and ``plan`` as a job of ``run.replicas`` pipelines of ``run.pipeline_ranks`` ranks
    runs them.

    Fewer ranks than planned GPUs: the stages of the GPUs one rank runs
    (:func:`ftcompile.runtime.layout.rank_of_gpu`) share its device and its memory.
    The job's GPUs are the plan's cluster's, grown where the job has more (a single machine stays
    one machine; a cluster of several gains machines of the same kind), laid out by replica order
    (:class:`ftcompile.replicas.ReplicaLayout`), which prices each stage's gradient all-reduce on
    its ring and adds its bucket to the GPU's memory.
    """
    from .plan import Plan, Stage
    from .replicas import ReplicaLayout, replicated_problem
    from .runtime.layout import rank_of_gpu

    G = plan.num_gpus
    n = min(run.pipeline_ranks or G, G)
    if n < G:
        plan = Plan(plan.strategy, n, [Stage(s.id, rank_of_gpu(s.gpu, G, n), list(s.nodes)) for s in plan.stages], plan.info)
    whole = dataclasses.replace(problem.cluster, gpu_ids=None)
    need = n * run.replicas
    if need > whole.physical_gpus:
        whole = (dataclasses.replace(whole, gpus_per_node=need) if whole.nodes == 1
                 else dataclasses.replace(whole, nodes=-(-need // whole.gpus_per_node)))
    lay = ReplicaLayout(n, run.replicas, run.rank_order or "pipeline-major")
    return replicated_problem(problem, whole, lay), plan
