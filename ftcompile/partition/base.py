"""The partitioner interface and the helpers partitioners share.

Every strategy is ``partition(problem, **options) -> Plan``. Options every strategy
takes (through :func:`run_strategy`):

* ``max_stages`` -- at most this many pipeline stages in all (FTPipe §5.3 found 16
  stages best for T5-3B under asynchronous training: more stages, more staleness).

:class:`MemoryModel` is the one place where partitioners estimate memory: exact
figures of :func:`ftcompile.plan.evaluate` for known stages, and proven upper and lower
bounds for a stage priced before the rest of its stage graph exists.
"""

from __future__ import annotations

import importlib
import inspect
import math
import time
from typing import Callable

import numpy as np

from ..profile import held_activation_bytes
from ..plan import (ALLREDUCE_BUCKET_BYTES, Plan, Problem, Stage, _stage_params, ordered, plan_windows,
                    receive_windows, shared_gradient_receive, shared_update_transient,
                    stage_depths, stage_graph, working_sets)

#: strategy name -> "module:function" (imported on first use, so a missing optional
#: dependency such as pymetis only disables its own strategy).
STRATEGIES: dict[str, str] = {
    "seq": "ftcompile.partition.seq:partition_seq",
    "uniform": "ftcompile.partition.seq:partition_uniform",
    "params": "ftcompile.partition.seq:partition_params",
    "mixed": "ftcompile.partition.mixed:partition_mixed",
    "mixed-sim": "ftcompile.partition.mixed:partition_mixed_simulated",
    "acyclic": "ftcompile.partition.acyclic:partition_acyclic",
    "metis": "ftcompile.partition.metis:partition_metis",
    "exact": "ftcompile.partition.exact:partition_exact",
}


class Infeasible(Exception):
    """A strategy cannot produce a plan; ``reason`` says why (memory, size, missing library).
    ``proven``: the strategy proved that no plan of its space fits (rather than finding none)."""

    def __init__(self, reason: str, proven: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.proven = proven


def get_strategy(name: str) -> Callable[..., Plan]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} or auto")
    module, func = STRATEGIES[name].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise Infeasible(f"strategy {name} needs a library that is not installed: {exc}") from None
    return getattr(mod, func)


def run_strategy(name: str, problem: Problem, **options) -> Plan:
    """Run one strategy; the plan comes back with stages in topological order.

    ``options`` go to the strategy's function; ``max_stages=None`` is dropped, and a
    plan with more stages than ``max_stages`` is refused (:class:`Infeasible`).
    """
    from ..plan import check_plan, evaluate

    if options.get("max_stages") is None:
        options.pop("max_stages", None)
    elif int(options["max_stages"]) < 1:
        raise ValueError(f"max_stages must be at least 1, got {options['max_stages']}")
    from ..runtime.schedules import ScheduleError

    fn = get_strategy(name)
    if problem.schedule in ("2bw", "2gw") and "max_stages" in inspect.signature(fn).parameters:
        # two weight versions hold only for a pipeline no deeper than M (M / s with 2bw's
        # in-flight scale s): at most that + 1 stages
        scale = problem.in_flight_scale if problem.schedule == "2bw" else 1
        options["max_stages"] = min(options.get("max_stages") or (1 << 30), problem.micro_batches // scale + 1)
    try:
        plan = fn(problem, **options)
        plan = ordered(plan, problem.graph)
        check_plan(problem.graph, plan)
        evaluate(problem, plan)            # (a schedule that cannot run the plan says so here)
    except ScheduleError as exc:
        raise Infeasible(f"{name}: {exc}") from None
    cap = options.get("max_stages")
    if cap is not None and len(plan.stages) > cap:
        raise Infeasible(f"{name} made {len(plan.stages)} stages, more than --max-stages {cap}")
    return plan


def stage_cap(problem: Problem, max_stages: int | None) -> int:
    """The most stages a plan may have: ``max_stages`` if given, else unbounded (a large number)."""
    return max(1, int(max_stages)) if max_stages is not None else 1 << 30


# --------------------------------------------------------------------------- choosing by simulation

def simulated_choice(problem: Problem, finals: list[tuple[float, Plan]], top: int,
                     tie: float | None = None, time_limit: float | None = None,
                     extra: list[tuple[float, Plan]] = ()) -> tuple[Plan, Plan]:
    """``(lowest, fastest)`` among ``finals`` (``(objective, plan)`` pairs), each of the ``top``
    distinct plans of lowest objective simulated once, and each of ``extra`` (plans a little
    above the lowest objective in fewer stages, which may run faster: exact's relaxed
    solves for fewer stages) whatever its rank.

    The objective (FTPipe Eq. 1, the largest GPU load) ignores the waits between stages that
    the schedule's dependencies impose, most of all when a GPU runs several stages; only the
    simulator (:func:`ftcompile.simulate.simulate`) sees them, and it also replays the memory
    the runtime holds. So:

    * ``lowest`` is the plan of lowest objective whose simulated run fits memory (compile would
      refuse one that does not); among those within ``tie`` (default :data:`OBJECTIVE_TIE`, rounding)
      of it, the shortest simulated period. It is what a strategy returns: its objective, bound
      and "optimal" speak of it. With none fitting, the lowest objective.
    * ``fastest`` is the simulated run that fits memory with the shortest period (ties: lower
      objective), which compile shows beside it (:func:`with_alternative`) and tunes the in-flight
      scale of. For the few fastest whose GPUs hold several stages, the period is the shorter of
      the problem's scale's and :data:`PROBE_SCALE`'s (:func:`_probed_fastest`): the order at the
      scale they will run at, not at the first.

    Every simulated plan's ``info`` gets ``simulated_period_ms`` and ``simulated_memory_fits``;
    ``fastest``'s also ``simulated_candidates``, every simulated plan's figures. ``top=0``:
    no simulation, both are the lowest objective.

    ``time_limit`` (seconds): the lowest objective is always simulated, first; the others, by
    stage count, get ``time_limit`` seconds of simulation after it: none is started that would
    not end within them at the slowest rate per stage seen so far, except while none simulated
    so far fits (a plan of hundreds of stages takes a minute to simulate: BERT-12's operator
    graph under tight memory).
    ``fastest.info["simulated_skipped"]`` then counts the candidates left out. Strategies give
    it :data:`SIMULATION_SHARE` of their own limit.
    """
    from ..simulate import simulation_of

    tie = OBJECTIVE_TIE if tie is None else tie
    finals = sorted(finals, key=lambda c: (c[0], len(c[1].stages)))
    if top <= 0:
        return finals[0][1], finals[0][1]
    picked, seen = [], set()
    for obj, plan in finals:
        key = plan_key(plan)
        if key not in seen:
            seen.add(key)
            picked.append((obj, plan))
        if len(picked) == top:
            break
    for obj, plan in extra:
        key = plan_key(plan)
        if key not in seen:
            seen.add(key)
            picked.append((obj, plan))
    scored = []
    t0 = None
    skipped = 0
    # The lowest objective first (what a strategy returns must be simulated), then the others
    # by stage count: a simulation's cost grows with the stages, so under a time limit the
    # cheap ones are not the ones left out. Their time starts after the first: a deep lowest
    # plan (94 stages of BERT-6's operator graph: 13 s) must not leave the few-stage
    # candidates, milliseconds each, unsimulated. One is started only if it should end in time
    # at the slowest rate seen (BERT-12's: a 287-stage plan took a minute, then one of 288 began).
    rate = 0.0                      # the most seconds a simulation took per stage so far
    for obj, plan in picked[:1] + sorted(picked[1:], key=lambda c: len(c[1].stages)):
        if t0 is None and scored:
            t0 = time.perf_counter()
        if time_limit is not None and scored and any(not c[0] for c in scored):
            left = time_limit - (time.perf_counter() - t0)
            if left <= 0 or rate * len(plan.stages) > left:
                skipped += 1
                continue
        # Simulated as run_strategy will number its stages (the ids set the engine's order), and
        # kept on the plan: compile's row reuses it (ordered() keeps the same simulations).
        sim = simulation_of(problem, ordered(plan, problem.graph))
        # (the replay's own seconds: one kept from before, on plan.simulations, costs nothing now
        # but says what the next plan of as many stages will cost)
        rate = max(rate, sim.seconds / max(1, len(plan.stages)))
        fits = bool(getattr(sim, "memory_feasible", True))
        plan.info["simulated_period_ms"] = round(sim.period_ms, 6)
        plan.info["simulated_memory_fits"] = fits
        scored.append((not fits, sim.period_ms, obj, plan))
    for c in scored:                # (a probe noted by an earlier choice is not this one's)
        c[3].info.pop("simulated_probe", None)
    fastest = _probed_fastest(problem, scored, time_limit, t0)
    fastest.info["simulated_candidates"] = [{"objective_ms": round(o, 6), "simulated_period_ms": round(p, 6),
                                             "simulated_memory_fits": not nf, "stages": len(pl.stages),
                                             **({"simulated_probe": pl.info["simulated_probe"]}
                                                if "simulated_probe" in pl.info else {})}
                                            for nf, p, o, pl in sorted(scored, key=lambda c: c[2])]
    if skipped:
        fastest.info["simulated_skipped"] = skipped
    fitting = [c for c in scored if not c[0]]
    if not fitting:
        return finals[0][1], fastest
    low = min(c[2] for c in fitting)
    lowest = min((c for c in fitting if c[2] <= low * (1 + tie)), key=lambda c: (c[1], c[2]))[3]
    return lowest, fastest


#: The in-flight scale at which :func:`simulated_choice` simulates again its fastest few plans
#: whose GPUs hold several stages (:func:`_probed_fastest`); how many; and how far above the
#: shortest period at the problem's scale one may be.
PROBE_SCALE, PROBE_TOP, PROBE_WITHIN = 4, 3, 0.10


def _probed_fastest(problem: Problem, scored: list[tuple], time_limit: float | None, t0: float | None) -> Plan:
    """The fastest of ``scored`` (``(not fits, period, objective, plan)``), its period taken as the
    shorter of the problem's scale's and :data:`PROBE_SCALE`'s for plans that stack stages.

    Compile tunes the in-flight scale of each row's plan (:mod:`ftcompile.inflight`), and the
    plan a strategy notes as its fastest becomes a row of its own, run at its tuned scale; the
    other candidates are never tuned. Plans of many stages per GPU wait
    on one another at the scale they are simulated at here, and how much more in flight
    recovers differs from plan to plan, so the order at the problem's scale is not the order
    once tuned (BERT-3's held-out operator graph on 6 GPUs at 1.2 x: 48 stages at 30.651 ms
    against 37 at 31.052 at scale 1; tuned, 27.840 against 27.812, the 37 within 0.1 % of
    their objective; at scale 4 already 28.192 against 28.145). So the :data:`PROBE_TOP`
    fastest that fit, stack stages and are within :data:`PROBE_WITHIN` of the shortest period
    are simulated again at :data:`PROBE_SCALE` and ranked by the shorter period where the run
    still fits. None is started once ``time_limit`` seconds have passed since ``t0``, but one
    started may end past them. Their ``info`` gets ``simulated_probe``: the scale, its period
    and whether the run fit (:func:`ranked_period` reads it; :func:`with_alternative` compares
    by it). A plan the probe cannot replay (a deadlock or a scale its schedule refuses) keeps
    its rank at the problem's scale.
    """
    from dataclasses import replace

    from ..inflight import stacks_stages
    from ..plan import evaluate
    from ..runtime.schedules import CONTINUOUS as SCHEDULES_WITHOUT_FLUSH
    from ..simulate import SimulationError, simulation_of

    def key(c):
        return (c[0], ranked_period(c[3], c[1]), c[2])

    fitting = sorted((c for c in scored if not c[0]), key=lambda c: (c[1], c[2]))
    if (problem.schedule not in SCHEDULES_WITHOUT_FLUSH or problem.in_flight_scale >= PROBE_SCALE
            or len(fitting) < 2):
        return min(scored, key=key)[3]
    shortest = fitting[0][1]
    near = [c[3] for c in fitting if c[1] <= shortest * (1 + PROBE_WITHIN) and stacks_stages(c[3])]
    probed = replace(problem, in_flight_scale=PROBE_SCALE)
    for plan in near[:PROBE_TOP]:
        if time_limit is not None and t0 is not None and time.perf_counter() - t0 > time_limit:
            break
        try:
            # (priced and replayed as run_strategy will number and join its stages)
            as_run = ordered(plan, problem.graph)
            sim = simulation_of(probed, as_run) if evaluate(probed, as_run).feasible else None
        except (ValueError, SimulationError):     # (a plan the scale cannot run: ranked at the problem's)
            continue
        fits = sim is not None and bool(getattr(sim, "memory_feasible", True))
        plan.info["simulated_probe"] = {"scale": PROBE_SCALE, "fits": fits,
                                        "period_ms": round(sim.period_ms, 6) if sim is not None else None}
    return min(scored, key=key)[3]


def ranked_period(plan: Plan, period: float | None = None) -> float | None:
    """The period :func:`simulated_choice` ranked ``plan`` by: its simulated period
    (``period``, else ``info["simulated_period_ms"]``), or its period at the probe scale where
    that choice probed it, the run fit and it is shorter (:func:`_probed_fastest`)."""
    period = plan.info.get("simulated_period_ms") if period is None else period
    probe = plan.info.get("simulated_probe")
    if period is None or not probe or not probe.get("fits") or probe.get("period_ms") is None:
        return period
    return min(period, probe["period_ms"])


def ranked_scale(problem: Problem, plan: Plan) -> int:
    """The in-flight scale of the period :func:`ranked_period` returns for ``plan``: its probe's
    where that choice ranked it by the probe, else ``problem``'s."""
    period = plan.info.get("simulated_period_ms")
    probe = plan.info.get("simulated_probe")
    if period is not None and ranked_period(plan) < period:
        return int(probe["scale"])
    return problem.in_flight_scale


#: The share of a searching strategy's time limit its simulation of the few best plans may take
#: after the search (seq and exact; Mixed-pipe allows its whole budget, see partition_mixed).
SIMULATION_SHARE = 0.25

#: Plans whose objectives differ by less than this share count as equal: simulation decides.
#: Rounding only: a strategy returns its lowest objective, so that "optimal" holds of what it returns.
OBJECTIVE_TIE = 1e-9


def plan_key(plan: Plan) -> tuple:
    """What makes two plans the same: each stage's GPU and nodes (stage ids aside)."""
    return tuple(sorted((s.gpu, tuple(sorted(s.nodes))) for s in plan.stages))


def with_alternative(plan: Plan, fastest: Plan) -> Plan:
    """``plan`` (a strategy's lowest objective) noting ``fastest`` (its fastest plan in simulation)
    as ``info["simulated_alternative"]`` when that is another plan that simulates faster.

    A strategy returns the plan its objective and bound speak of, so that "optimal" and "gap"
    describe what it returns; :func:`ftcompile.compile.compile_plan` adds the alternative as a
    row of its own (``<strategy>-sim``) and chooses among all rows by simulated throughput.
    """
    # (compared as simulated_choice ranked them: a probe at a larger scale counts)
    period = ranked_period(fastest)
    own = ranked_period(plan)
    fits = fastest.info.get("simulated_memory_fits", True)
    own_fits = plan.info.get("simulated_memory_fits", True)
    if period is None or plan_key(fastest) == plan_key(plan) or not fits or (
            own_fits and own is not None and own <= period):
        return plan
    plan.simulations.update(fastest.simulations)      # (compile's row for it reuses its simulation)
    plan.info["simulated_alternative"] = {
        "stages": [[int(s.gpu), [int(n) for n in s.nodes]] for s in fastest.stages],
        "simulated_period_ms": round(float(fastest.info["simulated_period_ms"]), 6),
        **{k: fastest.info[k] for k in ("simulated_candidates", "simulated_refinement", "simulated_skipped",
                                        "simulated_probe", "source", "plan_source")
           if k in fastest.info}}
    return plan


# --------------------------------------------------------------------------- memory

class MemoryModel:
    """Per-GPU memory as :func:`ftcompile.plan.evaluate` counts it, for partitioners.

    Two kinds of figures:

    * **exact**, for a plan whose stages are known: :meth:`gpus` (and :meth:`gpus_of` for
      stages that are not yet a :class:`~ftcompile.plan.Plan`) returns every GPU's
      ``GpuCost.memory_bytes`` of :func:`~ftcompile.plan.evaluate`, term for term: each
      stage's own parameters, gradients and optimizer state (a stage keeps its own copy of
      a shared tensor), the weight versions and micro-batches in flight of its runtime
      program, the receive buffers its flow-control windows allow (once per value and
      GPU), the gradients waiting for its backward, outputs waiting to be sent, the graph
      inputs of the steps in flight, the largest task transient of its stages
      (:func:`~ftcompile.plan.working_sets`) and the hardware reserve. The Mixed-pipe
      refiner checks its moves with it.
    * **bounds**, for a DP that prices a candidate stage before the rest of the stage graph
      exists: :meth:`stage_upper` is a proven upper bound of the GPU that holds just this
      stage at depth ``d`` in a pipeline no deeper than ``deepest`` (every window at its
      widest for a producer deeper than ``d``, both 2GW groups, transients bounded by
      :meth:`working_set_bounds`), so a split the DP accepts with it fits under
      ``evaluate``; :meth:`stage_lower` is a proven lower bound (windows of one, no send
      buffers, the transient a recomputation needs at least), so a DP that prunes with it
      keeps every split that fits and its optimum is a valid bound.

    Scalars and numpy arrays are accepted alike by the bounds (the Seq-pipe DP evaluates
    whole rows of candidate stages at once).
    """

    def __init__(self, problem: Problem):
        self.problem = problem
        self.schedule = problem.schedule
        self.micro_batches = problem.micro_batches
        self.limit = int(problem.cluster.gpu_memory)
        self.reserve = int(problem.memory_reserve)
        self._progs: dict[tuple[int, int], object] = {}
        self._ws: dict[frozenset, tuple[int, int]] = {}

    @staticmethod
    def of(problem: Problem) -> "MemoryModel":
        return MemoryModel(problem)

    # ----------------------------------------------------------- the runtime's programs
    def program(self, depth: int, group0: bool = True):
        key = (int(depth), 0 if group0 else 1)
        got = self._progs.get(key)
        if got is None:
            got = self._progs[key] = self.problem.program(key[0], key[1])
        return got

    def in_flight(self, depth: int, group0: bool = True) -> int:
        """Micro-batches a stage of ``depth`` holds (2GW: ``group0`` says which group it is in)."""
        return self.program(depth, group0).in_flight

    def extra_versions(self, depth: int, group0: bool = True) -> int:
        """Weight versions beyond the first a stage of ``depth`` keeps (PipeDream, 2BW, 2GW)."""
        return self.program(depth, group0).extra_weight_versions

    def in_flight_max(self, depth: int) -> int:
        return max(self.in_flight(depth, g) for g in (True, False))

    def extra_versions_max(self, depth: int) -> int:
        return max(self.extra_versions(depth, g) for g in (True, False))

    def window_max(self, depth: int, deepest: int) -> int:
        """The widest flow-control window a stage of ``depth`` can get from a producer in a
        pipeline no deeper than ``deepest`` (:func:`~ftcompile.runtime.schedules.flow_window`;
        1 when no producer can be deeper)."""
        from ..runtime.schedules import flow_window

        return max([flow_window(self.program(p, g), depth) for p in range(depth + 1, deepest + 1)
                    for g in (True, False)], default=1)

    def data_steps(self, in_flight: int) -> int:
        """Micro-batches of graph inputs a GPU keeps for its stages' ``in_flight`` (evaluate's data term)."""
        M = self.micro_batches
        return (math.ceil(in_flight / M) + 1) * M

    def fits(self, nbytes) -> bool:
        return nbytes <= self.limit

    # ----------------------------------------------------------- exact, for known stages
    def working_sets(self, nodes) -> tuple[int, int]:
        key = frozenset(nodes)
        got = self._ws.get(key)
        if got is None:
            got = self._ws[key] = working_sets(self.problem, key)
        return got

    def gpus(self, plan: Plan) -> list[int]:
        """Every GPU's memory under ``plan``, as :func:`~ftcompile.plan.evaluate` counts it."""
        return self.gpus_of({s.id: (s.gpu, list(s.nodes)) for s in plan.stages}, plan.num_gpus)

    def gpus_of(self, stages: dict[int, tuple[int, list[int]]], num_gpus: int) -> list[int]:
        """:meth:`gpus` for stages given as ``id -> (gpu, nodes)`` (their stage graph must be acyclic)."""
        pr = self.problem
        graph, prof, grads = pr.graph, pr.profile, pr.grad_values
        plan = Plan("memory", num_gpus, [Stage(i, g, ns) for i, (g, ns) in stages.items()])
        sg = stage_graph(graph, plan)
        depth = stage_depths(sg)
        progs = pr.programs(depth)
        flow = plan_windows(pr, sg, depth, progs)
        gpu_of = {i: g for i, (g, _ns) in stages.items()}
        holders: dict[str, int] = {}
        for _g, ns in stages.values():
            for prm in {q for n in ns for q in graph.node(n).params}:
                holders[prm] = holders.get(prm, 0) + 1
        total = [0] * num_gpus
        used = [False] * num_gpus
        transient = [0] * num_gpus
        ahead = [0] * num_gpus
        inputs: list[dict[str, int]] = [{} for _ in range(num_gpus)]
        for sid, (g, ns) in stages.items():
            prog = progs[sid]
            pb, gb, ob, tb, names = _stage_params(pr, ns)
            act_full = held_activation_bytes(prof, ns)     # as evaluate: each saved value once per stage
            recv = sum({v: b for u in sg.predecessors(sid) for v, b in sg.edges[u, sid]["values"].items()}.values())
            ginp = 0
            for n in ns:
                for e in graph.in_edges(n):
                    if graph.node(e.src).kind == "input":
                        ginp += e.bytes
                        inputs[g][e.value] = e.bytes
            back = sum({v: b for t in sg.successors(sid) for v, b in sg.edges[sid, t]["values"].items()
                        if v in grads}.values())
            k = prog.in_flight
            ws_f, ws_b = self.working_sets(ns)
            t_bwd = (act_full + max(ws_f, ws_b)) if prog.recompute else ws_b
            if prog.extra_weight_versions:
                t_bwd += tb
            t_fwd = ws_f + (tb if (pr.weight_prediction and pr.schedule == "async" and prog.recompute) else 0)
            t_upd = shared_update_transient(prof, names, holders)
            if pr.replicas > 1:
                t_upd += min(gb, ALLREDUCE_BUCKET_BYTES)
            total[g] += (pb + gb + ob + prog.extra_weight_versions * tb
                         + k * ((recv + ginp) if prog.recompute else act_full) + k * back)
            transient[g] = max(transient[g], t_bwd, t_fwd, t_upd)
            ahead[g] = max(ahead[g], k)
            used[g] = True
        # receive buffers: per value and reading GPU, the widest window among its readers there
        waiting = receive_windows(sg, flow, gpu_of)
        for (v, g), (w, b) in waiting.items():
            total[g] += w * b
        for g, b in shared_gradient_receive(graph, prof, stages.values(), pr.shared_lag).items():
            total[g] += b
        # send buffers: a value leaving its GPU that no reader on that GPU waits for
        where = plan.stage_of()
        for v, g_dst in {(v, gpu_of[c]) for _p, c, data in sg.edges(data=True) for v in data["values"]}:
            g_src = gpu_of[where[graph.producer(v)]]
            if g_src != g_dst and (v, g_src) not in waiting:
                total[g_src] += graph.node(graph.producer(v)).outputs[v].bytes
        for g in range(num_gpus):
            if used[g]:
                total[g] += (self.data_steps(ahead[g]) * sum(inputs[g].values()) + transient[g] + self.reserve)
        return total

    # ----------------------------------------------------------- bounds, for DPs
    def stage_upper(self, *, depth: int, deepest: int, params_total, trainable, recomputes, act_full,
                    recv, inputs, grads_back, send, ws_fwd, ws_bwd, shared_extra=0):
        """A proven upper bound of a GPU holding only this stage, at ``depth`` in a pipeline at most
        ``deepest`` deep, whatever the rest of the stage graph.

        ``params_total``: weights + gradients + optimizer state of the parameters it reads;
        ``trainable``: the trainable weights among them; ``act_full``: one micro-batch's
        activations; ``recv``: bytes of the values it receives (each once); ``inputs``: graph
        input bytes it reads (per edge, as evaluate counts them); ``grads_back``: bytes of the
        values it sends that carry a gradient (or more); ``send``: bytes of the values it sends
        (each once); ``ws_fwd``/``ws_bwd``: upper bounds of :func:`~ftcompile.plan.working_sets`;
        ``shared_extra``: an upper bound of what shared (tied) tensors add: the other holders'
        gradients waiting for its update and the update's sums (added whole, not under the
        transients' maximum: the gradients wait while other tasks run).
        """
        k = self.in_flight_max(depth)
        x = self.extra_versions_max(depth)
        w = self.window_max(depth, deepest)
        held = k * self._where(recomputes, recv + inputs, act_full)
        t_bwd = self._where(recomputes, act_full + self._max(ws_fwd, ws_bwd), ws_bwd) + (trainable if x else 0)
        t_fwd = ws_fwd + (trainable if self.problem.weight_prediction and self.schedule == "async" else 0)
        t_upd = min_bucket(params_total) if self.problem.replicas > 1 else 0
        return (params_total + x * trainable + held + w * recv + k * grads_back + send + shared_extra
                + self.data_steps(k) * inputs + self._max(self._max(t_bwd, t_fwd), t_upd) + self.reserve)

    def stage_lower(self, *, depth: int, params_total, trainable, recomputes, act_full, recv, inputs,
                    group0: bool | None = None):
        """A proven lower bound of a GPU holding this stage at ``depth``: what it keeps whatever its
        neighbours (every value received waits in a window of at least one; no send buffer,
        data or working set counted) and, recomputing, the activations its backward rebuilds."""
        gs = (True, False) if group0 is None else (group0,)
        k = min(self.in_flight(depth, g) for g in gs)
        x = min(self.extra_versions(depth, g) for g in gs)
        held = k * self._where(recomputes, recv + inputs, act_full)
        rebuilt = self._where(recomputes, act_full, 0)
        return params_total + x * trainable + held + recv + rebuilt + self.reserve

    def lower_bound(self, params_total, act_full, recompute_ms, recomputes: bool):
        """The least memory any stage holding these nodes needs, whatever its depth and inputs:
        its parameters, one micro-batch's activations (kept, or rebuilt by recomputation when it
        has any to redo) and the reserve. Monotone in the set of nodes."""
        if recomputes:
            return params_total + act_full + self.reserve
        return params_total + min(self.in_flight(0, g) for g in (False, True)) * act_full + self.reserve

    @staticmethod
    def _where(cond, a, b):
        if isinstance(cond, (bool, np.bool_)):
            return a if cond else b
        return np.where(cond, a, b)

    @staticmethod
    def _max(a, b):
        if np.isscalar(a) and np.isscalar(b):
            return max(a, b)
        return np.maximum(a, b)


def memory_floor(problem: Problem) -> tuple[int, int | None]:
    """``(bytes, node id)``: the most memory that the GPU running some single op node needs in
    every plan, of every strategy and space (the node whose floor is highest).

    Whatever the plan, the GPU that runs op node ``n`` holds the weights, gradients and
    optimizer state of every parameter ``n`` reads, one micro-batch of ``n``'s activations
    (kept until its backward, or rebuilt there when its stage recomputes) and the hardware
    reserve: :meth:`MemoryModel.lower_bound` of ``n`` alone, the smaller of its recomputing
    and keeping forms, which :func:`~ftcompile.plan.evaluate` never undercuts. So when the
    floor exceeds the GPU memory no plan fits at all (proven); below it nothing is proven.
    """
    mm = MemoryModel.of(problem)
    best: tuple[int, int | None] = (0, None)
    for node in problem.graph.op_nodes():
        pb, gb, ob, _tb, _names = _stage_params(problem, [node.id])
        act = held_activation_bytes(problem.profile, [node.id])
        need = min(mm.lower_bound(pb + gb + ob, act, 0.0, rc) for rc in (True, False))
        if need > best[0]:
            best = (int(need), node.id)
    return best


def memory_floor_reason(problem: Problem) -> str | None:
    """Why no plan can fit, when :func:`memory_floor` proves it (None otherwise)."""
    from ..units import format_bytes

    need, nid = memory_floor(problem)
    if nid is None or need <= problem.cluster.gpu_memory:
        return None
    node = problem.graph.node(nid)
    pb, gb, ob, _tb, _names = _stage_params(problem, [nid])      # the figures the floor counted
    static = pb + gb + ob
    return (f"no plan of any strategy fits (proven): op node {node.name!r} alone needs at least "
            f"{format_bytes(need)} on its GPU ({format_bytes(static)} of weights, gradients and optimizer "
            f"state, one micro-batch of its activations and the {format_bytes(problem.memory_reserve)} "
            f"reserve) but a GPU has {format_bytes(problem.cluster.gpu_memory)}; an operator cannot be split "
            f"across GPUs, so raise --gpu-memory to more than {format_bytes(need)}, or lower --batch-size (the "
            f"micro-batch), or pick an --optimizer with less state (sgd, adafactor)")


def min_bucket(grad_bytes):
    """The all-reduce's flat bucket: at most its size, at most the gradients (an upper bound with
    ``params_total`` standing for the gradients)."""
    if np.isscalar(grad_bytes):
        return min(grad_bytes, ALLREDUCE_BUCKET_BYTES)
    return np.minimum(grad_bytes, ALLREDUCE_BUCKET_BYTES)


def working_set_bounds(problem: Problem, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per position of ``ids`` (op nodes in a topological order): upper bounds of what
    :func:`~ftcompile.plan.working_sets` adds at that node for any stage that is a *contiguous
    range* of ``ids`` holding it, forward and backward.

    A value alive at a node of a range (made at or before it in the range, or received, and
    read at or after it, or sent out of the range, whose readers all come after the range)
    is made before that position and read at or after it in the whole order (a graph output
    counts as read at the end). So the bytes of
    all such values, plus the node's own activations, bound the range's working set there;
    a range's working set is at most the largest of these over its positions.
    """
    graph, prof, grads = problem.graph, problem.profile, problem.grad_values
    pos = {n: i for i, n in enumerate(ids)}
    N = len(ids)
    df = np.zeros(N + 1, dtype=np.int64)
    db = np.zeros(N + 1, dtype=np.int64)
    span: dict[str, list] = {}
    for e in graph.edges:
        src = pos.get(e.src, 0)          # graph inputs: alive from the start
        dst = pos.get(e.dst, N - 1)      # graph outputs: alive to the end
        lo, hi, b = span.get(e.value, (src, dst, e.bytes))
        span[e.value] = (min(lo, src), max(hi, dst), max(b, e.bytes))
    for v, (lo, hi, b) in span.items():
        df[lo] += b
        df[hi + 1] -= b
        if v in grads:
            db[lo] += b
            db[hi + 1] -= b
    own = np.array([prof.nodes[n].activation_bytes for n in ids], dtype=np.int64)
    return np.cumsum(df)[:N] + own, np.cumsum(db)[:N] + own


# --------------------------------------------------------------------------- staleness

def staleness_updates(schedule: str, depth: int, micro_batches: int, in_flight_scale: int = 1) -> float:
    """How many optimizer updates old the weights are that a stage of ``depth`` computes with.

    A stage of depth ``d`` runs its forward ``d`` micro-batches ahead of its backward
    (``s * d`` with an in-flight scale ``s``, :attr:`~ftcompile.plan.Problem.in_flight_scale`).
    Under ``async`` (FTPipe) and ``pipedream`` no flush holds the others back, so by
    the time its gradient is applied, ``d / M`` updates (``M`` micro-batches each)
    have happened since the weights its micro-batch saw: 29 stages deep at ``M = 4``
    is about 7 updates. ``gpipe`` and ``1f1b`` flush every update (0); ``2bw`` uses
    the previous version (1); ``2gw`` one version behind for its group G0 (1).
    """
    if schedule in ("async", "pipedream"):
        return in_flight_scale * depth / max(1, micro_batches)
    if schedule in ("2bw", "2gw"):
        return 1.0
    return 0.0
