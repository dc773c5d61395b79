"""Replicated pipelines: R copies of a P-GPU pipeline on G = R x P GPUs (data x pipeline parallelism).

A :class:`ReplicaLayout` says which physical GPU runs pipeline GPU ``g`` of replica
``r``, in one of two orders:

* ``pipeline-major``: a pipeline's GPUs are consecutive (``r * P + g``), so a pipeline
  sits inside one host when P divides the host's GPU count, and the gradient
  all-reduce of each pipeline GPU runs between hosts;
* ``replica-major``: the replicas of one pipeline GPU are consecutive (``g * R + r``),
  so each all-reduce stays inside a host while the pipeline's activations cross hosts.

Every replica trains its pipeline on its own micro-batches of the step's global batch;
at each update the gradients of every stage are averaged across the replicas (a ring
all-reduce per pipeline GPU, :func:`allreduce_ms`) before the optimizer step, so all
replicas keep the same weights. The compiler plans one pipeline on the view of the
cluster that replica 0's GPUs give (:meth:`ReplicaLayout.pipeline_view`) and prices
the all-reduce on the ring of each pipeline GPU (:meth:`ReplicaLayout.ring_bandwidth`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import ClusterError, ClusterSpec

ORDERS = ("pipeline-major", "replica-major")


@dataclass(frozen=True)
class ReplicaLayout:
    """Where R replicas of a P-GPU pipeline run on a cluster of R x P GPUs."""

    pipeline_gpus: int
    replicas: int
    order: str = "pipeline-major"

    def __post_init__(self):
        if self.pipeline_gpus < 1 or self.replicas < 1:
            raise ClusterError(f"need at least one GPU per pipeline and one replica, got P={self.pipeline_gpus}, "
                               f"R={self.replicas}")
        if self.order not in ORDERS:
            raise ClusterError(f"unknown replica order {self.order!r}; choose {' or '.join(ORDERS)}")

    @property
    def gpus(self) -> int:
        return self.pipeline_gpus * self.replicas

    def physical(self, replica: int, gpu: int) -> int:
        """The physical GPU of pipeline GPU ``gpu`` in ``replica``."""
        if self.order == "pipeline-major":
            return replica * self.pipeline_gpus + gpu
        return gpu * self.replicas + replica

    def pipeline_view(self, cluster: ClusterSpec) -> ClusterSpec:
        """Replica 0's GPUs as a cluster of P GPUs (the links between them as they are)."""
        return cluster.view([self.physical(0, g) for g in range(self.pipeline_gpus)])

    def ring(self, gpu: int) -> list[int]:
        """The physical GPUs whose gradients pipeline GPU ``gpu`` averages with (one per replica)."""
        return [self.physical(r, gpu) for r in range(self.replicas)]

    def ring_bandwidth(self, cluster: ClusterSpec, gpu: int) -> float:
        """The slowest link of pipeline GPU ``gpu``'s all-reduce ring (what paces a ring all-reduce)."""
        ring = self.ring(gpu)
        if len(ring) < 2:
            return float("inf")
        return min(cluster.physical_bandwidth(a, b) for a, b in zip(ring, ring[1:] + ring[:1]))

    def ring_bandwidths(self, cluster: ClusterSpec) -> tuple[float, ...]:
        return tuple(self.ring_bandwidth(cluster, g) for g in range(self.pipeline_gpus))

    def to_json(self) -> dict:
        return {"pipeline_gpus": self.pipeline_gpus, "replicas": self.replicas, "order": self.order}

    @staticmethod
    def from_json(d: dict) -> "ReplicaLayout":
        return ReplicaLayout(int(d["pipeline_gpus"]), int(d["replicas"]), str(d.get("order", "pipeline-major")))


def allreduce_ms(nbytes: float, replicas: int, bandwidth: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``replicas`` members whose slowest link carries
    ``bandwidth`` bytes/s: each member sends and receives ``2 (R - 1) / R`` of the data."""
    if replicas < 2 or not nbytes:
        return 0.0
    return 2 * (replicas - 1) / replicas * nbytes / bandwidth * 1e3


def layouts(cluster: ClusterSpec, replicas: int | None = None) -> list[ReplicaLayout]:
    """The layouts to consider for the whole cluster: every pipeline length P dividing its GPU count
    (or the one ``replicas`` forces), each order that places GPUs differently on it."""
    G = cluster.physical_gpus
    if replicas is not None:
        if replicas < 1 or G % replicas:
            raise ClusterError(f"--replicas {replicas} does not divide the cluster's {G} GPUs; choose one of "
                               f"{', '.join(str(r) for r in range(1, G + 1) if G % r == 0)}")
        counts = [replicas]
    else:
        counts = [r for r in range(1, G + 1) if G % r == 0]
    out = []
    for R in counts:
        P = G // R
        seen = set()
        for order in ORDERS:
            lay = ReplicaLayout(P, R, order)
            # two orders that give the same links are one option
            key = ("trivial",) if R == 1 or P == 1 else _links_key(cluster, lay)
            if key in seen:
                continue
            seen.add(key)
            out.append(lay)
    return out


def _links_key(cluster: ClusterSpec, lay: ReplicaLayout) -> tuple:
    """What decides the links a layout uses, in O(G): equal keys, equal links.

    The hosts of replica 0's GPUs (for a whole cluster), the slowest link of every
    all-reduce ring, and which of the pipeline's GPUs share a host (the host labels
    renumbered in order of first use; nothing when a host's links are as fast as the
    network's), which decides every link between two GPUs of the pipeline without
    listing the P x P of them.
    """
    first = [lay.physical(0, x) for x in range(lay.pipeline_gpus)]
    hosts = [g // cluster.gpus_per_node for g in first]
    if cluster.intra_node_bandwidth == cluster.inter_node_bandwidth:
        sharing = None
    else:
        names: dict[int, int] = {}
        sharing = tuple(names.setdefault(h, len(names)) for h in hosts)
    return (tuple(hosts) if cluster.gpu_ids is None else None, lay.ring_bandwidths(cluster), sharing)


def traffic(problem, plan, layout: ReplicaLayout, cluster: ClusterSpec, cost=None) -> dict:
    """Bytes moved per step (every replica's M micro-batches) on the whole cluster, and how many of
    them cross hosts: activations and their gradients between pipeline GPUs, and each ring
    all-reduce (a ring of R carries ``2 (R - 1) / R`` of the gradients on each of its R links).
    ``cost``: the plan's :func:`~ftcompile.plan.evaluate`, when the caller has it."""
    from .plan import evaluate, stage_graph

    def host(physical: int) -> int:
        return physical // cluster.gpus_per_node

    gpu_of = {s.id: s.gpu for s in plan.stages}
    grads = problem.grad_values
    out = dict.fromkeys(("pipeline_bytes", "pipeline_cross_host_bytes", "allreduce_bytes",
                         "allreduce_cross_host_bytes"), 0)
    for a, b, data in stage_graph(problem.graph, plan).edges(data=True):
        ga, gb = gpu_of[a], gpu_of[b]
        if ga == gb:
            continue
        per_mb = sum(n * (2 if v in grads else 1) for v, n in data["values"].items())
        for r in range(layout.replicas):
            moved = per_mb * problem.micro_batches
            out["pipeline_bytes"] += moved
            if host(layout.physical(r, ga)) != host(layout.physical(r, gb)):
                out["pipeline_cross_host_bytes"] += moved
    if layout.replicas > 1:
        cost = cost or evaluate(problem, plan)
        for g in range(layout.pipeline_gpus):
            n = sum(sc.grad_bytes for sc in cost.stages if sc.gpu == g)
            ring = layout.ring(g)
            per_link = 2 * (layout.replicas - 1) / layout.replicas * n
            for x, y in zip(ring, ring[1:] + ring[:1]):
                out["allreduce_bytes"] += per_link
                if host(x) != host(y):
                    out["allreduce_cross_host_bytes"] += per_link
    return {k: int(v) for k, v in out.items()}


# --------------------------------------------------------------------------- planning

#: Strategies that search until their time limit (``--time-limit``): planning a layout with them
#: takes about that long, whatever the cluster.
SEARCHING_STRATEGIES = ("mixed", "mixed-sim", "seq", "exact")
#: Auto replicas plans up to this many layouts with every strategy (a host of 8 GPUs has 4, two
#: hosts of 8 have 8). More layouts (every divisor of a large GPU count) are screened
#: (:func:`compile_replicated`) ...
MAX_FULL_LAYOUTS = 8
#: ... and then this many of the best are planned with the searching strategies too.
SEARCHED_LAYOUTS = 1


def screens(layouts_: list[ReplicaLayout], replicas: int | None) -> bool:
    """Whether :func:`compile_replicated` screens these layouts rather than planning each in full."""
    return replicas is None and len(layouts_) > MAX_FULL_LAYOUTS


@dataclass
class ReplicaOption:
    """One way to use the cluster: a layout, the best plan for its pipeline, and what it gives."""

    layout: ReplicaLayout
    feasible: bool
    reason: str | None = None
    result: object | None = None          # CompileResult of the pipeline
    throughput: float = 0.0               # samples/s of all replicas together (simulated)
    staleness: float = 0.0                # staleness_updates of the pipeline's chosen plan
    step_ms: float = 0.0                  # one step (R x M micro-batches) in the steady state
    allreduce_ms: float = 0.0             # the slowest pipeline GPU's all-reduces per step
    traffic: dict = field(default_factory=dict)    # traffic(): bytes per step, all replicas, and across hosts
    seconds: float = 0.0
    problem: object | None = None         # the pipeline's Problem
    # How the layout was planned: "all" (every strategy asked for), "screened" (those that do not
    # search, see SEARCHING_STRATEGIES), "bounded" (not planned: its throughput bound is below a
    # layout planned before) or "refused" (its pipeline cannot hold the model's static memory).
    planned: str = "all"
    bound: float | None = None            # throughput_bound() of the layout, where it was computed

    def row(self) -> dict:
        best = self.result.best() if self.feasible and self.result is not None else None
        return {"pipeline_gpus": self.layout.pipeline_gpus, "replicas": self.layout.replicas,
                "order": self.layout.order, "feasible": self.feasible, "reason": self.reason,
                "strategy": best.name if best else None,
                "throughput": round(self.throughput, 6) if self.feasible else None,
                "staleness_updates": self.staleness if self.feasible else None,
                "step_ms": round(self.step_ms, 6) if self.feasible else None,
                "allreduce_ms": round(self.allreduce_ms, 6) if self.feasible else None,
                **{f"{k}_per_step": v for k, v in self.traffic.items()},
                "max_gpu_memory_bytes": best.cost.max_memory_bytes if best else None,
                "planned": self.planned,
                "strategies_run": [r.name for r in self.result.results] if self.result is not None else [],
                "throughput_bound": round(self.bound, 6) if self.bound is not None else None,
                "seconds": round(self.seconds, 3)}


def replicated_problem(base, cluster: ClusterSpec, layout: ReplicaLayout):
    """``base`` (a Problem for the whole cluster) turned into the problem of one pipeline of ``layout``."""
    from dataclasses import replace

    return replace(base, cluster=layout.pipeline_view(cluster), replicas=layout.replicas,
                   ring_bandwidth=layout.ring_bandwidths(cluster))


def throughput_bound(problem, max_stages: int | None = None) -> float:
    """A proven upper bound on the throughput (samples/s of all replicas) that the simulation
    (:func:`ftcompile.simulate.simulate`) measures for any plan :func:`~ftcompile.compile.compile_plan`
    can return for ``problem`` (one pipeline of a layout, :func:`replicated_problem`).

    The simulated time of a step is never below a GPU's work per step, M micro-batches, which is
    at least M times the larger of

    * the lower bound of the objective (:func:`~ftcompile.plan.lower_bound`) over the GPUs the
      strategies search on (:func:`~ftcompile.compile.search_problem`: a plan never uses more),
    * the forward and backward of the heaviest op node (some GPU runs it);

    nor below the all-reduce lane of the GPU holding the most gradients (its all-reduces run
    one at a time, once per step): at best the trainable gradients spread evenly over those GPUs,
    each ring on the fastest ring link. Throughput is replicas x M x the micro-batch size per step.
    """
    from .compile import search_problem
    from .plan import lower_bound
    from .simulate import micro_batch_size

    search, used = search_problem(problem, max_stages)
    prof, M = problem.profile, problem.micro_batches
    ops = list(problem.graph.op_nodes())
    heaviest = max((prof.nodes[n.id].forward_ms + prof.nodes[n.id].backward_ms for n in ops), default=0.0)
    step = M * max(lower_bound(search), heaviest)
    if problem.replicas > 1:
        grads = sum(prof.params[p].grad_bytes for p in {p for n in ops for p in n.params})
        bw = max(problem.ring_bandwidth) if problem.ring_bandwidth else problem.cluster.inter_node_bandwidth
        step = max(step, allreduce_ms(grads / max(1, used), problem.replicas, bw))
    if step <= 0:
        return float("inf")
    return problem.replicas * M * micro_batch_size(problem) / (step / 1e3)


def _static_refusal(base, cluster: ClusterSpec, lay: ReplicaLayout, pb) -> str | None:
    """Why a layout's pipeline cannot hold the model's weights, gradients and optimizer state, or None."""
    static = sum(p.total for p in base.profile.params.values())
    room = lay.pipeline_gpus * max(0, cluster.gpu_memory - pb.memory_reserve)
    if static > room:
        from .units import format_bytes

        return (f"weights, gradients and optimizer state ({format_bytes(static)}) exceed {lay.pipeline_gpus} "
                f"GPU(s) of {format_bytes(cluster.gpu_memory)} less the {format_bytes(pb.memory_reserve)} reserve "
                "each")
    return None


def _plan_layout(pb, lay: ReplicaLayout, cluster: ClusterSpec, strategies, *, jobs, strategy_progress,
                 compile_options) -> ReplicaOption:
    """Plan one layout's pipeline with ``strategies`` and measure it over all replicas."""
    import time

    from .compile import compile_plan

    t0 = time.perf_counter()
    # One GPU has one plan (everything on it): no strategy can do better than another.
    names = "uniform" if lay.pipeline_gpus == 1 else strategies
    result = compile_plan(pb, names, jobs=jobs, progress=strategy_progress, **compile_options)
    opt = ReplicaOption(lay, result.chosen is not None, result=result, problem=pb)
    if result.chosen is None:
        opt.reason = "no strategy found a pipeline plan that fits: " + result.failure_reasons(most=3)
    else:
        best = result.best()
        sim = best.sim or {}
        opt.throughput = sim.get("throughput_samples_per_s", 0.0)
        opt.staleness = best.figures.get("staleness_updates") or 0.0
        opt.step_ms = sim.get("minibatch_ms", 0.0)
        opt.allreduce_ms = max((sum(sc.allreduce_ms for sc in best.cost.stages if sc.gpu == g)
                                for g in best.plan.gpus()), default=0.0)
        opt.traffic = traffic(pb, best.plan, lay, cluster, best.cost)
    opt.seconds = time.perf_counter() - t0
    return opt


def compile_replicated(base, strategies="auto", *, replicas: int | None = None, jobs: int | None = None,
                       progress=None, strategy_progress=None, **compile_options) -> tuple[list[ReplicaOption], int | None]:
    """Plan every layout of ``base.cluster`` (every pipeline length dividing its GPU count, or the one
    ``replicas`` forces, in each order that places GPUs differently) and choose the highest
    simulated throughput over all replicas, unless a layout with less stale weights comes within
    :data:`~ftcompile.inflight.GAIN` of it (:func:`choice`). Returns the options and the index of
    the chosen one.

    A layout whose pipeline cannot hold the model's weights, gradients and optimizer state is
    refused without partitioning.

    With more than :data:`MAX_FULL_LAYOUTS` layouts (``replicas`` not forced: a GPU count with
    many divisors, 50 layouts for 10,000 GPUs), planning each with every strategy would take the
    searching strategies' time limit that many times over. Then (:func:`screens`,
    :func:`_compile_screened`) the layouts are planned shortest pipeline first with the
    strategies that do not search (:data:`SEARCHING_STRATEGIES`), a layout whose
    :func:`throughput_bound` is below the best throughput found so far (x (1 - GAIN)^2 under a
    schedule whose staleness grows with depth, see :func:`_compile_screened`) is not planned, and
    the layouts those strategies found no plan for (where their bound reaches the best found), the
    :data:`SEARCHED_LAYOUTS` best layouts and the one :func:`choice` keeps are then planned with
    every strategy asked for. Each option's ``planned`` says which of these it got.
    """
    cluster = base.cluster
    lays = layouts(cluster, replicas)
    if screens(lays, replicas):
        options = _compile_screened(base, lays, strategies, jobs=jobs, progress=progress,
                                    strategy_progress=strategy_progress, compile_options=compile_options)
    else:
        options = []
        for lay in lays:
            pb = replicated_problem(base, cluster, lay)
            why_not = _static_refusal(base, cluster, lay, pb)
            if why_not:
                opt = ReplicaOption(lay, False, why_not, problem=pb, planned="refused")
            else:
                opt = _plan_layout(pb, lay, cluster, strategies, jobs=jobs, strategy_progress=strategy_progress,
                                   compile_options=compile_options)
            options.append(opt)
            if progress:
                progress(opt)
    return options, choice(options)[0]


def choice(options: list[ReplicaOption]) -> tuple[int | None, int | None]:
    """``(kept, fastest)``: indices of the layout compile keeps and of the fastest feasible one (ties:
    fewer replicas), by the rule that chooses between a pipeline's plans
    (:func:`~ftcompile.compile.fresher_within_gain`): the fastest unless a layout whose chosen plan
    has less stale weights is within :data:`~ftcompile.inflight.GAIN` of it. Pipelines of different
    lengths stale differently under ``async`` and ``pipedream`` (a stage's depth / M updates).
    ``(None, None)`` when no layout is feasible."""
    from .compile import fresher_within_gain

    feasible = [i for i, o in enumerate(options) if o.feasible]
    if not feasible:
        return None, None
    return fresher_within_gain(feasible, lambda i: options[i].throughput, lambda i: options[i].staleness,
                               tie=lambda i: options[i].layout.replicas)


def _stales_by_depth(schedule: str) -> bool:
    """Whether a longer pipeline's plans may be staler under ``schedule`` (``async``, ``pipedream``)."""
    from .partition.base import staleness_updates

    return staleness_updates(schedule, 2, 1) != staleness_updates(schedule, 1, 1)


def _compile_screened(base, lays: list[ReplicaLayout], strategies, *, jobs, progress, strategy_progress,
                      compile_options) -> list[ReplicaOption]:
    """:func:`compile_replicated` over more layouts than it plans in full; options in ``lays``' order.

    Shortest pipelines first: they are the cheapest to plan (one GPU has one plan) and, with many
    replicas, usually the fastest, so the bound rules out most long pipelines unplanned. A bound
    equal to the best so far is still planned, as a tie goes to fewer replicas. Under a schedule
    whose staleness grows with depth, :func:`choice` may keep a layout up to
    :data:`~ftcompile.inflight.GAIN` slower than the fastest for its fresher weights, and planning
    the best layout again with every strategy may leave it up to GAIN slower than its screened
    plan (:func:`~ftcompile.compile.choose` keeps a fresher row that close): so a bound is ruled
    out only below the best so far x (1 - GAIN)^2. The layouts :func:`choice` finds fastest and
    keeps are always planned with every strategy (unless throughput alone decides and a screened
    plan reaches its bound): the best by throughput, then, while the choice's fastest or kept is a
    layout only screened, that one, and the choice is made again. A screened layout that is
    neither keeps its screened plan, even where planning it in full could make it the fastest:
    that is what screening trades for time. Before that, a layout the strategies that do not search
    found no plan for is planned with every strategy unless its bound is below the best so far:
    under tight memory the searching ones may fit what they cannot.
    """
    from .compile import resolve_strategies

    cluster = base.cluster
    names = resolve_strategies(strategies, base)
    fast = [n for n in names if n not in SEARCHING_STRATEGIES] or names
    max_stages = compile_options.get("max_stages")
    from .inflight import GAIN

    reach = (1 - GAIN) ** 2 if _stales_by_depth(base.schedule) else 1.0    # of the best throughput so far
    margin = (f" less {1 - reach:.2%} (a less stale layout within {GAIN:.0%} of the fastest is kept, and "
              f"planning the best in full may keep a row up to {GAIN:.0%} slower)" if reach < 1 else "")
    options: dict[int, ReplicaOption] = {}
    best: ReplicaOption | None = None
    for i in sorted(range(len(lays)), key=lambda i: (lays[i].pipeline_gpus, ORDERS.index(lays[i].order))):
        lay = lays[i]
        pb = replicated_problem(base, cluster, lay)
        why_not = _static_refusal(base, cluster, lay, pb)
        if why_not:
            opt = ReplicaOption(lay, False, why_not, problem=pb, planned="refused")
        else:
            bound = throughput_bound(pb, max_stages)
            if best is not None and bound * (1 + 1e-9) < best.throughput * reach:
                opt = ReplicaOption(lay, False, f"not planned: no plan of it can exceed {bound:.2f} samples/s "
                                    f"(throughput bound), below the {best.throughput:.2f} of "
                                    f"{best.layout.pipeline_gpus} GPU(s) x {best.layout.replicas}" + margin,
                                    problem=pb, planned="bounded", bound=bound)
            else:
                opt = _plan_layout(pb, lay, cluster, fast, jobs=jobs, strategy_progress=strategy_progress,
                                   compile_options=compile_options)
                opt.bound = bound
                opt.planned = "all" if lay.pipeline_gpus == 1 or len(fast) == len(names) else "screened"
        options[i] = opt
        if opt.feasible and (best is None or (opt.throughput, -lay.replicas) > (best.throughput, -best.layout.replicas)):
            best = opt
        if progress:
            progress(opt)

    def search(i: int) -> None:
        o = options[i]
        opt = _plan_layout(o.problem, o.layout, cluster, names, jobs=jobs, strategy_progress=strategy_progress,
                           compile_options=compile_options)
        opt.bound, opt.seconds = o.bound, opt.seconds + o.seconds
        options[i] = opt
        if progress:
            progress(opt)

    return _plan_in_full(options, reach, margin, search)


def _plan_in_full(options: dict[int, ReplicaOption], reach: float, margin: str, search) -> list[ReplicaOption]:
    """:func:`_compile_screened`'s second part: which screened layouts ``search(i)`` plans again
    with every strategy (it replaces ``options[i]``). Returns the options in layout order."""
    # A layout no fast strategy found a plan for may still fit with a searching one (tight
    # memory: GPT-2 tiny on 24 GPUs of 4.6 MB, where only Mixed-pipe fits a 2-GPU pipeline, 5.6 %
    # faster than the best 3-GPU one): each whose bound reaches the best so far is planned in
    # full, highest bound first.
    unfit = sorted((i for i, o in options.items() if o.planned == "screened" and not o.feasible),
                   key=lambda i: (-options[i].bound, options[i].layout.pipeline_gpus))
    for i in unfit:
        top = max((o.throughput for o in options.values() if o.feasible), default=0.0)
        if options[i].bound * (1 + 1e-9) >= top * reach:
            search(i)
        else:
            options[i].reason += (f"; not planned with the searching strategies: no plan of it can exceed "
                                  f"{options[i].bound:.2f} samples/s (throughput bound), below the {top:.2f} "
                                  f"of the best layout found" + margin)

    def settled(o: ReplicaOption) -> bool:
        # Planned with every strategy, or, where only throughput decides, already at its bound.
        return o.planned != "screened" or (reach == 1 and not o.bound * (1 + 1e-9) > o.throughput)

    ranked = sorted((i for i, o in options.items() if o.feasible),
                    key=lambda i: (-options[i].throughput, options[i].layout.replicas))
    for i in ranked[:SEARCHED_LAYOUTS]:
        if not settled(options[i]):
            search(i)
    # The fastest sets the window the choice keeps a less stale layout in, and planning a layout
    # in full can leave it up to GAIN slower (the rule within it): so both the fastest and the
    # kept are planned in full, until neither changes. Each round settles one more layout: it ends.
    while True:
        listed = [options[i] for i in range(len(options))]
        kept, fastest = choice(listed)
        todo = [i for i in (fastest, kept) if i is not None and not settled(listed[i])]
        if not todo:
            return listed
        search(todo[0])


def why(options: list[ReplicaOption], chosen: int | None) -> str:
    """One sentence on the choice: what the two orders put on the slow links, and what won."""
    if chosen is None:
        return "no layout fits"
    from .compile import fresher_why

    c = options[chosen]
    same = [o for o in options if o.feasible and o.layout.replicas == c.layout.replicas and o is not c]
    fastest = options[choice(options)[1]]
    if fastest is c:
        parts = [f"{c.layout.replicas} replica(s) of a {c.layout.pipeline_gpus}-GPU pipeline, {c.layout.order}, "
                 f"gives the highest simulated throughput ({c.throughput:.2f} samples/s)"]
    else:
        def name(o: ReplicaOption) -> str:
            gpus = o.layout.pipeline_gpus
            return f"{gpus} GPU{'s' if gpus > 1 else ''} x {o.layout.replicas} ({o.layout.order})"

        parts = [f"{c.layout.replicas} replica(s) of a {c.layout.pipeline_gpus}-GPU pipeline, {c.layout.order}, "
                 f"gives {c.throughput:.2f} samples/s, and "
                 + fresher_why(name(c), name(fastest), c.throughput, fastest.throughput, c.staleness,
                               fastest.staleness)]
    def across(o: ReplicaOption) -> str:
        t = o.traffic
        return (f"{(t['pipeline_cross_host_bytes'] + t['allreduce_cross_host_bytes']) / 1e9:.3f} GB per step "
                f"across hosts ({t['pipeline_cross_host_bytes'] / 1e9:.3f} GB of pipeline traffic of "
                f"{t['pipeline_bytes'] / 1e9:.3f}, {t['allreduce_cross_host_bytes'] / 1e9:.3f} GB of all-reduce "
                f"of {t['allreduce_bytes'] / 1e9:.3f})")

    feasible = [o for o in options if o.feasible]
    longest = max(o.layout.pipeline_gpus for o in feasible)
    most = max(o.layout.replicas for o in feasible)
    middle = [o for o in feasible if o.layout.pipeline_gpus not in (longest, c.layout.pipeline_gpus)
              and o.layout.replicas != most]
    if c.layout.replicas == most and len(feasible) > 1 and fastest is c:
        what = ("each replica holds the whole model on one GPU: no pipeline bubble and no activation traffic"
                if c.layout.pipeline_gpus == 1 else "the shortest pipeline that fits, with the fewest bubbles")
        note = (f"it is the most replicas that fit ({what}), and its all-reduce ({c.allreduce_ms:.1f} ms per step) "
                f"costs less than longer pipelines lose")
        if middle:
            m = max(middle, key=lambda o: o.throughput)
            note += (f"; the best intermediate layout ({m.layout.pipeline_gpus} GPUs x {m.layout.replicas}) gives "
                     f"{m.throughput:.2f}")
        parts.append(note)
    elif c.layout.pipeline_gpus == longest and len(feasible) > 1:
        shorter = [o for o in feasible if o.layout.pipeline_gpus < longest]
        if shorter:
            m = max(shorter, key=lambda o: o.throughput)
            parts.append(f"it is the longest pipeline: the best layout with more replicas ({m.layout.pipeline_gpus} "
                         f"GPUs x {m.layout.replicas}) gives {m.throughput:.2f}, its all-reduce taking "
                         f"{m.allreduce_ms:.1f} ms per step")
    if same:
        parts.append(f"{c.layout.order} moves {across(c)}")
        for o in same:
            parts.append(f"{o.layout.order} would move {across(o)} and gives {o.throughput:.2f} samples/s")
    return "; ".join(parts)
