"""Let the partitioners compete and keep the best plan (FTPipe §4 "GPU assignment").

:func:`compile_plan` runs every requested strategy on one :class:`~ftcompile.plan.Problem`
(in parallel processes where there is more than one core), prices each plan with
:func:`~ftcompile.plan.evaluate`, simulates it, and chooses the feasible plan with
the highest simulated throughput, unless one with staler weights is less than
:data:`~ftcompile.inflight.GAIN` faster (:func:`choose`). :func:`plan_document` turns the outcome into the
``plan.json`` artifact, and :func:`write_report` writes the readable report and
pictures beside it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import dataclass, field, replace

from .partition import STRATEGIES, Infeasible, run_strategy
from .partition.base import memory_floor, memory_floor_reason
from .runtime.atomic import atomic_path
from .plan import (PLAN_FORMAT, PLAN_VERSION, Plan, PlanCost, PlanError, Problem, Stage, evaluate, lower_bound, ordered,
                   save_json)

#: Strategies ``auto`` runs. ``exact`` joins when the graph is small enough to solve.
AUTO_STRATEGIES = ("mixed", "seq", "acyclic", "metis", "uniform", "params")
#: Up to this many op nodes ``auto`` runs ``exact`` too, in its strong form: every op node may go
#: to any GPU (no coarsening), so its bound holds for every plan. Larger graphs would have to be
#: coarsened into blocks, whose bound holds only for plans that keep the blocks whole.
EXACT_AUTO_MAX_NODES = 1000
#: Seconds a searching strategy (seq's convex search, exact's MIP) may spend by default
#: (``--time-limit``). They stop with the best plan found and the bound proven so far.
DEFAULT_TIME_LIMIT = 20.0
#: A cluster with more GPUs than the graph has op nodes is searched on at most this many GPUs.
DEGENERATE_SEARCH_GPUS = 32


def strategy_options(name: str, *, max_stages: int | None = None, time_limit: float | None = None) -> dict:
    """The keyword options compile passes to strategy ``name``."""
    opts: dict = {}
    if max_stages is not None:
        opts["max_stages"] = int(max_stages)
    t = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    if name in ("seq", "exact"):
        opts["time_limit"] = t
    elif name in ("mixed", "mixed-sim"):
        opts["time_budget_s"] = t            # refinement, its seq search and its MIP share it
    return opts


class CompileError(ValueError):
    """No strategy found a plan that fits; the message says what would."""


@dataclass
class StrategyResult:
    name: str
    feasible: bool
    reason: str | None = None
    plan: Plan | None = None
    cost: PlanCost | None = None
    sim: dict | None = None          # SimResult.to_json()
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)     # plan_figures(): speed-ups, staleness
    bound: dict | None = None        # the best proven bound covering this plan: {"ms", "covers"}
    proven_infeasible: bool = False  # no plan: the strategy proved none of its space fits
    in_flight_scale: int | None = None   # what the plan was priced with (ftcompile.inflight)
    in_flight: dict | None = None        # the scales tried for it, where compile tuned it

    def row(self) -> dict:
        """The strategy's line in plan.json and the report."""
        c = self.cost
        period = self.sim["period_ms"] if self.sim else None
        b = self.bound
        return {
            "name": self.name, "feasible": self.feasible, "reason": self.reason,
            "objective_ms": round(c.objective_ms, 6) if c else None,
            "simulated_period_ms": round(period, 6) if period is not None else None,
            "throughput": round(self.sim["throughput_samples_per_s"], 6) if self.sim else None,
            "bubble_fraction": round(self.sim["bubble_fraction"], 6) if self.sim else None,
            # False: no periodic state showed, and the period is the mean over the steps measured
            "simulated_steady": self.sim["steady"] if self.sim else None,
            **({"simulated_steps": [self.sim["warmup_steps"], self.sim["warmup_steps"] + self.sim["cyclicity"]]}
               if self.sim and not self.sim["steady"] else {}),
            "efficiency": round(c.efficiency, 6) if c else None,
            "bound_ms": round(b["ms"], 6) if c and b else None,
            "bound_covers": b["covers"] if c and b else None,
            # how far the plan's objective is from the best bound proven for its space
            "gap": round((c.objective_ms - b["ms"]) / c.objective_ms, 6) if c and b and c.objective_ms > 0 else None,
            "speedup": round(c.speedup, 4) if c else None,
            "speedup_no_recompute": self.figures.get("speedup_no_recompute"),
            "stages": len(self.plan.stages) if self.plan else None,
            "max_depth": self.figures.get("max_depth"),
            "staleness_updates": self.figures.get("staleness_updates"),
            "max_gpu_memory_bytes": c.max_memory_bytes if c else None,
            "seconds": round(self.seconds, 3),
            "in_flight_scale": self.in_flight_scale,
            **({"in_flight_tuning": self.in_flight} if self.in_flight else {}),
            **({"proven_infeasible": True} if self.proven_infeasible else {}),
            **({"info": self.plan.info} if self.plan and self.plan.info else {}),
        }


@dataclass
class CompileResult:
    problem: Problem
    results: list[StrategyResult]
    chosen: str | None
    lower_bound_ms: float
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def best(self) -> StrategyResult:
        return next(r for r in self.results if r.name == self.chosen)

    def failure_reasons(self, most: int | None = None) -> str:
        """Why the strategies found no plan, one reason once: "mixed, seq: reason; exact: other".
        ``most``: only the first ``most`` distinct reasons."""
        by: dict[str, list[str]] = {}
        for r in self.results:
            if not r.feasible:
                by.setdefault(r.reason or "no reason given", []).append(r.name)
        items = list(by.items())[:most] if most else list(by.items())
        return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in items)


def plan_figures(problem: Problem, plan: Plan, cost: PlanCost) -> dict:
    """What a user compares a plan with, beside its objective (issue 11, item 4).

    * ``speedup_no_recompute``: one device running the model without recomputation
      takes the forward + backward of every node per micro-batch; the pipeline takes
      its objective (the period per micro-batch). Their ratio is the speed-up a user
      would measure against plain single-device training.
    * ``speedup`` (in :class:`~ftcompile.plan.PlanCost`): FTPipe's expected speed-up,
      the plan's own work (recomputation included) over its period; it counts
      recomputation as useful work, so it is the higher of the two.
    * ``max_depth`` and ``staleness_updates``: how many optimizer updates old the
      weights are that the deepest stage's gradients meet (:func:`staleness_updates`).
    """
    from .partition.base import staleness_updates
    from .plan import stage_depths, stage_graph

    prof = problem.profile
    plain = sum(prof.nodes[n.id].forward_ms + prof.nodes[n.id].backward_ms for n in problem.graph.op_nodes())
    depth = stage_depths(stage_graph(problem.graph, plan))
    d = max(depth.values(), default=0)
    return {
        "speedup_no_recompute": round(plain / cost.objective_ms, 4) if cost.objective_ms > 0 else None,
        "max_depth": d,
        "staleness_updates": round(staleness_updates(problem.schedule, d, problem.micro_batches,
                                                     problem.in_flight_scale), 3),
    }


def resolve_strategies(names: list[str] | tuple[str, ...] | str, problem: Problem) -> list[str]:
    """Expand ``auto`` and check names."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        if n == "auto":
            out.extend(AUTO_STRATEGIES)
            if sum(1 for _ in problem.graph.op_nodes()) <= EXACT_AUTO_MAX_NODES:
                out.append("exact")
        elif n in STRATEGIES:
            out.append(n)
        else:
            raise CompileError(f"unknown strategy {n!r}; choose from auto, {', '.join(STRATEGIES)}")
    return list(dict.fromkeys(out))


def search_problem(problem: Problem, max_stages: int | None = None) -> tuple[Problem, int]:
    """The problem the strategies search on, and its number of GPUs.

    More GPUs than op nodes never help (every stage holds a node). Such a cluster is searched
    on at most min(op nodes, :data:`DEGENERATE_SEARCH_GPUS`) of its GPUs (hundreds of stages
    would take the search and the simulation hours, and pile up staleness); plans are priced
    and simulated on the whole cluster. Any other problem is searched as it is.
    """
    ops = sum(1 for _ in problem.graph.op_nodes())
    if problem.num_gpus > ops > 0:
        from dataclasses import replace

        searched = min(ops, max(max_stages or 0, DEGENERATE_SEARCH_GPUS))
        return replace(problem, cluster=problem.cluster.with_overrides(gpus=searched)), searched
    return problem, problem.num_gpus


def _run_one(name: str, problem: Problem, simulate_plan: bool, options: dict | None = None,
             search: Problem | None = None, tune: bool = False, tune_seconds: float | None = None) -> StrategyResult:
    """Run strategy ``name`` on ``search`` (default: ``problem``; a smaller cluster when the
    real one has more GPUs than the graph has op nodes), then price and simulate its plan on
    ``problem`` (``tune``: at the in-flight scale :func:`~ftcompile.inflight.tune_in_flight` chooses,
    within the strategy's time limit)."""
    t0 = time.perf_counter()
    try:
        with quiet_native_stdout():
            plan = run_strategy(name, search or problem, **(options or {}))
        # (replays on a smaller search cluster are keyed by it: none is read for this problem)
        return _priced(name, problem, Plan(plan.strategy, problem.num_gpus, plan.stages, plan.info,
                                           plan.simulations),
                       simulate_plan, t0, tune, tune_seconds)
    except Infeasible as exc:
        return StrategyResult(name, False, exc.reason, seconds=time.perf_counter() - t0,
                              proven_infeasible=exc.proven)
    except (PlanError, ValueError) as exc:
        return StrategyResult(name, False, f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - one broken strategy must not sink the others
        tb = traceback.format_exc(limit=3).strip().splitlines()[-1]
        return StrategyResult(name, False, f"internal error in {name}: {exc} ({tb})",
                              seconds=time.perf_counter() - t0)


def _priced(name: str, problem: Problem, plan: Plan, simulate_plan: bool, t0: float,
            tune: bool = False, tune_seconds: float | None = None) -> StrategyResult:
    """``plan`` priced (and simulated) on ``problem``: a feasible result, or why it does not fit.

    ``tune`` (with ``simulate_plan``): at the in-flight scale chosen for the plan by simulation
    (:func:`~ftcompile.inflight.tune_in_flight`, for at most ``tune_seconds``) instead of the
    problem's, which it starts from."""
    tuning = None
    if tune and simulate_plan:
        from .inflight import tune_in_flight

        tuning = tune_in_flight(problem, plan, time_limit=tune_seconds)
        if tuning.tries:
            problem = replace(problem, in_flight_scale=tuning.chosen)
    r = _priced_at(name, problem, plan, simulate_plan, t0)
    r.in_flight_scale = problem.in_flight_scale
    r.in_flight = tuning.to_json() if tuning is not None and tuning.tries else None
    return r


def _priced_at(name: str, problem: Problem, plan: Plan, simulate_plan: bool, t0: float) -> StrategyResult:
    cost = evaluate(problem, plan)
    if not cost.feasible:
        return StrategyResult(name, False, f"plan does not fit: {cost.reason}", plan, cost,
                              seconds=time.perf_counter() - t0)
    sim = None
    if simulate_plan:
        from .simulate import simulation_of

        sim = simulation_of(problem, plan).to_json(events=False)
        if not sim["memory_feasible"]:
            worst = max(range(plan.num_gpus), key=lambda g: sim["gpu_peak_memory"][g] - sim["gpu_memory_limit"])
            from .units import format_bytes

            return StrategyResult(name, False, f"the simulated run does not fit: GPU {worst} peaks at "
                                  f"{format_bytes(sim['gpu_peak_memory'][worst])} of "
                                  f"{format_bytes(sim['gpu_memory_limit'])}", plan, cost, sim,
                                  time.perf_counter() - t0)
    return StrategyResult(name, True, None, plan, cost, sim, time.perf_counter() - t0,
                          figures=plan_figures(problem, plan, cost))


#: Suffix of the row a strategy's fastest plan in simulation gets (:func:`simulated_alternatives`).
SIMULATED_SUFFIX = "-sim"


def simulated_alternatives(problem: Problem, results: list[StrategyResult], simulate_plans: bool,
                           tune: bool = False, tune_seconds: float | None = None) -> list[StrategyResult]:
    """``results`` with, after each strategy that noted one, a row ``<name>-sim`` for its
    ``info["simulated_alternative"]``: the plan among its candidates that simulates fastest,
    where that is not the plan it returned (its lowest objective, which its bound speaks of).

    So both figures are shown: what each search achieves on its objective, and the fastest plan
    it found once the waits the objective leaves out are simulated; the choice among all rows is
    by simulated throughput. The alternative's node lists leave the strategy's ``info`` (a
    summary stays), so plan.json keeps each plan once.
    """
    out = []
    ran = {r.name for r in results}
    for r in results:
        out.append(r)
        # (a plan whose simulated run did not fit still carries its alternative, which may)
        alt = (r.plan.info or {}).get("simulated_alternative") if r.plan is not None else None
        if not alt or "stages" not in alt:
            continue
        stages = alt.pop("stages")
        name = r.name + SIMULATED_SUFFIX
        if not simulate_plans or name in ran:        # (``mixed-sim`` asked for and run itself)
            continue
        t0 = time.perf_counter()
        try:
            plan = Plan(r.plan.strategy, problem.num_gpus,
                        [Stage(i, g, list(ns)) for i, (g, ns) in enumerate(stages)],
                        {"alternative_of": r.name, **alt}, r.plan.simulations)
            alt_r = _priced(name, problem, ordered(plan, problem.graph), True, t0, tune, tune_seconds)
        except (PlanError, ValueError) as exc:      # one row lost, never the compile
            alt["row_error"] = f"{type(exc).__name__}: {exc}"
            continue
        if alt_r.feasible:
            alt["row"] = name
            out.append(alt_r)
    return out


def fresher_within_gain(rows: list, throughput, stale, tie=lambda r: 0.0):
    """``(kept, fastest)`` among ``rows`` (non-empty): the rule every choice between plans follows.

    ``fastest`` has the highest ``throughput(row)`` (ties: the lowest ``tie(row)``). ``kept`` is
    ``fastest`` unless rows whose weights are fewer ``stale(row)`` updates old come within
    :data:`~ftcompile.inflight.GAIN` of its throughput: then the least stale of those, the fastest
    of them, the lowest ``tie``. More staleness must buy that much throughput, as more
    micro-batches in flight must (:func:`~ftcompile.inflight.tune_in_flight`). Used by
    :func:`choose` (the strategies' rows of one pipeline), :func:`~ftcompile.replicas.choice`
    (the (P, R) layouts) and :func:`~ftcompile.freeze.plan_phase` (a freeze phase's (P, R, M)).
    """
    from .inflight import GAIN

    fastest = min(rows, key=lambda r: (-throughput(r), tie(r)))
    # (periods: a row is within GAIN when the fastest's period is less than GAIN shorter)
    near = [r for r in rows if throughput(fastest) * (1 - GAIN) < throughput(r)] or [fastest]
    kept = min(near, key=lambda r: (stale(r), -throughput(r), tie(r)))
    return (kept if stale(kept) < stale(fastest) else fastest), fastest


def fresher_why(kept: str, fastest: str, kept_throughput: float, fastest_throughput: float,
                kept_stale: float, fastest_stale: float) -> str:
    """Why :func:`fresher_within_gain` kept ``kept`` over the faster ``fastest`` (names as the user reads them)."""
    from .inflight import GAIN

    return (f"{kept}: {1 - kept_throughput / fastest_throughput:.2%} less simulated throughput than {fastest}, "
            f"with weights {kept_stale:.3g} updates stale against {fastest_stale:.3g}; more staleness must buy "
            f"at least {GAIN:.0%} (as a larger in-flight scale must)")


def choose(results: list[StrategyResult], simulate_plans: bool = True) -> tuple[str | None, str | None]:
    """The row compile keeps among ``results``, and why, where it is not the fastest.

    The fastest feasible row in simulation (ties: the lower objective), unless a row whose weights
    are less stale (:func:`~ftcompile.partition.base.staleness_updates`: ``async`` and
    ``pipedream``) simulates within :data:`~ftcompile.inflight.GAIN` of it: among those, the least
    stale, then the fastest (:func:`fresher_within_gain`). Held-out InceptionV3 on 6 GPUs at
    1.2 x: exact's 121-stage plan at 6 x depth + 1 in flight, 164.901 ms (168 updates stale, 1.038
    of its objective), against a 14-stage plan at 166.165 ms (3.25 updates, 1.000), 0.8 %
    slower. Schedules with a flush (0) and 2bw (1) stale every plan alike: the fastest wins.
    Without simulation, the lowest objective. ``(None, None)`` when no row is feasible.
    """
    feasible = [r for r in results if r.feasible]
    if not feasible:
        return None, None
    if not simulate_plans:
        return min(feasible, key=lambda r: r.cost.objective_ms).name, None

    def throughput(r: StrategyResult) -> float:
        return r.sim["throughput_samples_per_s"] if r.sim else 0.0

    def stale(r: StrategyResult) -> float:
        return r.figures.get("staleness_updates") or 0.0

    kept, fastest = fresher_within_gain(feasible, throughput, stale, tie=lambda r: r.cost.objective_ms)
    if kept is fastest:
        return fastest.name, None
    return kept.name, fresher_why(kept.name, fastest.name, throughput(kept), throughput(fastest),
                                  stale(kept), stale(fastest))


def compile_plan(problem: Problem, strategies: list[str] | str = "auto", *, jobs: int | None = None,
                 simulate_plans: bool = True, progress=None, max_stages: int | None = None,
                 time_limit: float | None = None, tune_in_flight: bool = True) -> CompileResult:
    """Run the strategies, price and simulate each plan, and choose the best feasible one.

    The best is the feasible plan with the highest simulated throughput, unless one with less
    stale weights is within :data:`~ftcompile.inflight.GAIN` of it (:func:`choose`; the lowest
    objective when ``simulate_plans`` is off); ties go to the lower objective.
    ``tune_in_flight``: a plan whose GPUs hold several stages is priced at the in-flight scale
    chosen for it by simulation (:mod:`ftcompile.inflight`, for at most ``time_limit`` seconds
    a plan), from ``problem.in_flight_scale`` up; the result's problem takes the chosen plan's.
    ``max_stages``: every strategy makes at most that many stages. ``time_limit``:
    seconds each searching strategy may spend (default :data:`DEFAULT_TIME_LIMIT`).
    Every result carries the best bound proven for its space (:func:`attach_bounds`).
    """
    names = resolve_strategies(strategies, problem)
    if max_stages is not None and int(max_stages) < 1:
        raise CompileError(f"--max-stages must be at least 1, got {max_stages}")
    if time_limit is not None and not time_limit >= 0:
        raise CompileError(f"--time-limit must be a number of seconds >= 0, got {time_limit}")
    t0 = time.perf_counter()
    bound = lower_bound(problem)     # before the workers start: the problem carries it to them
    jobs = jobs if jobs is not None else min(len(names), os.cpu_count() or 1)
    options = {n: strategy_options(n, max_stages=max_stages, time_limit=time_limit) for n in names}
    # tuning a plan's in-flight scale replays it at each scale tried: at most a search's time
    tune_seconds = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    search, searched = search_problem(problem, max_stages)
    results: dict[str, StrategyResult] = {}
    # Some op node's own weights, state and activations exceed a GPU: no strategy can fit, proven,
    # so none is run (a search would spend its whole time limit finding nothing).
    floor_reason = memory_floor_reason(problem)
    if floor_reason is not None:
        for n in names:
            results[n] = StrategyResult(n, False, floor_reason, proven_infeasible=True)
            if progress:
                progress(results[n])
    elif jobs > 1 and len(names) > 1:
        ctx = multiprocessing.get_context("fork")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futs = {pool.submit(_run_one, n, problem, simulate_plans, options[n], search, tune_in_flight,
                                tune_seconds): n for n in names}
            for fut in cf.as_completed(futs):
                r = fut.result()
                results[r.name] = r
                if progress:
                    progress(r)
    else:
        for n in names:
            r = _run_one(n, problem, simulate_plans, options[n], search, tune_in_flight, tune_seconds)
            results[n] = r
            if progress:
                progress(r)
    ordered_results = simulated_alternatives(problem, [results[n] for n in names], simulate_plans, tune_in_flight,
                                             tune_seconds)
    attach_bounds(problem, ordered_results, bound)
    chosen, why = choose(ordered_results, simulate_plans)
    info = {"max_stages": max_stages, "searched_gpus": searched, "proven_no_fit": floor_reason,
            "time_limit_s": options[names[0]].get("time_limit", DEFAULT_TIME_LIMIT) if names else None,
            **({"chosen_why": why} if why else {})}
    if chosen is not None:
        scale = next(r for r in ordered_results if r.name == chosen).in_flight_scale
        if scale is not None and scale != problem.in_flight_scale:
            problem = replace(problem, in_flight_scale=scale)
    return CompileResult(problem, ordered_results, chosen, bound, time.perf_counter() - t0, info=info)


#: Strategies whose plans are convex splits with one stage per GPU (Seq-pipes): a bound proven
#: over convex splits covers them.
CONVEX_STRATEGIES = ("seq", "uniform", "params", "acyclic")


def every_plan_bound(results: list[StrategyResult], lower: float, configuration: float | None = None) -> dict:
    """The best bound proven over every plan: :func:`~ftcompile.plan.lower_bound` (``lower``),
    ``exact``'s MIP bound when its space is every plan (no coarsening), and the configuration LP's
    (``configuration``, :func:`tighten_bounds`): ``{"ms", "covers"}``."""
    every = {"ms": lower, "covers": "every plan (total work / GPUs, last-stage knapsack)"}
    for r in results:
        info = (r.plan.info if r.plan else None) or {}
        if r.name == "exact" and info.get("bound_space") == "every plan" and info.get("mip_bound_ms", 0) > every["ms"]:
            every = {"ms": float(info["mip_bound_ms"]), "covers": "every plan (exact's MIP)"}
    if configuration is not None and configuration > every["ms"]:
        every = {"ms": float(configuration), "covers": "every plan (configuration LP)"}
    return every


def attach_bounds(problem: Problem, results: list[StrategyResult], lower: float,
                  configuration: float | None = None) -> None:
    """Give every result the best proven lower bound that covers its plan.

    Every plan: :func:`every_plan_bound`. Seq-pipe plans (convex splits): also ``seq``'s bound
    over convex splits, when its search finished, and exact's when it searched convex splits
    only. A bound proven only for part of a space (a coarsened MIP, side nodes kept attached) is
    not used for the others.
    """
    every = every_plan_bound(results, lower, configuration)
    convex = every
    for r in results:
        info = (r.plan.info if r.plan else None) or {}
        if r.name == "seq" and info.get("bound_ms") is not None and \
                info.get("bound_covers") == "every convex split" and info["bound_ms"] > convex["ms"]:
            convex = {"ms": float(info["bound_ms"]), "covers": "convex splits (seq's search)"}
        if r.name == "exact" and info.get("bound_space") == "every convex split with one stage per GPU" and \
                info.get("mip_bound_ms", 0) > convex["ms"]:
            convex = {"ms": float(info["mip_bound_ms"]), "covers": "convex splits (exact's MIP)"}
    for r in results:
        if r.cost is not None:
            # a strategy's -sim row is one of its own candidates: the same space
            base = r.name[:-len(SIMULATED_SUFFIX)] if r.name.endswith(SIMULATED_SUFFIX) else r.name
            r.bound = dict(convex if base in CONVEX_STRATEGIES else every)


#: :func:`tighten_bounds` seeks the configuration LP's bound only where the best plan is more than
#: this share above the best bound already proven: below, it could close little, and on graphs of
#: many small nodes its column generation tails off near the optimum without deciding a load.
CONFIGURATION_GAP = 1e-3
#: It first asks whether the bound rises by this share of the gap at least, for at most
#: CONFIGURATION_FIRST_S seconds: a load well below the LP's threshold is decided in a few rounds
#: (Farley's bound), one near it may take thousands (operator graphs). Only where it does is the
#: gap bisected, so graphs of many small nodes (the zoo's traced models, where the searches'
#: bounds are already close) cost those seconds, not the whole time.
CONFIGURATION_FIRST_SHARE = 0.1
CONFIGURATION_FIRST_S = 2.0
#: Nor is it sought on graphs of more op nodes than this: their nodes are small, the searches'
#: bounds close, and one round of the LP's column generation outlasts the first probe's time
#: (a chain of 20,000 nodes: 4.1 s for a probe given 2 s).
CONFIGURATION_MAX_NODES = 2000


def tighten_bounds(result: CompileResult, seconds: float) -> dict | None:
    """Raise the every-plan bound of ``result``'s rows with the configuration LP's
    (:func:`~ftcompile.partition.configlp.configuration_bound`), searched for at most ``seconds``
    between the best bound proven and the lowest objective of any plan that fits.

    Where the searches leave a gap, whole nodes are often why (a few large layers that no split
    balances): exact's MIP bound stays at total/P there, and the configuration LP, which keeps each
    GPU's nodes whole, proves how far any plan must be from it. Returns what was done (also
    ``result.info["configuration_bound"]``), or None when not run: no plan, no time, a gap of at
    most :data:`CONFIGURATION_GAP`, or more than :data:`CONFIGURATION_MAX_NODES` op nodes.
    """
    from .partition.configlp import ConfigurationLP, configuration_bound

    objectives = [r.cost.objective_ms for r in result.results if r.feasible and r.cost is not None]
    if seconds <= 0 or not objectives or sum(1 for _ in result.problem.graph.op_nodes()) > CONFIGURATION_MAX_NODES:
        return None
    high = min(objectives)
    every = every_plan_bound(result.results, result.lower_bound_ms,
                             (result.info.get("configuration_bound") or {}).get("ms"))["ms"]
    if high <= 0 or (high - every) / high <= CONFIGURATION_GAP:
        return None
    t0 = time.perf_counter()
    lp = ConfigurationLP(result.problem)
    first = every + CONFIGURATION_FIRST_SHARE * (high - every)
    ms = every
    if lp.exceeds(first, t0 + min(CONFIGURATION_FIRST_S, seconds)):
        # Half the time at most for one load, so that one at the edge (slow to decide) leaves
        # time for loads below it.
        left = seconds - (time.perf_counter() - t0)
        ms = configuration_bound(result.problem, first, high, time_limit=left, probe_limit=left / 2, lp=lp)
    # (unrounded: rounding may lift a bound above what was proven, or an unraised one above the old)
    done = {"ms": ms, "from_ms": every, "plan_ms": high, "raised": ms > every,
            "seconds": round(time.perf_counter() - t0, 3), "loads_probed": lp.stats["probes"],
            "columns": len(lp.columns)}
    result.info["configuration_bound"] = done
    if ms > every:
        attach_bounds(result.problem, result.results, result.lower_bound_ms, configuration=ms)
    return done


@contextlib.contextmanager
def quiet_native_stdout():
    """Discard what native libraries write to file descriptor 1 (HiGHS's copyright banner, once
    per solver; METIS's notes), for the duration; Python's own stdout is untouched.

    ``compile --json`` must print one JSON document and nothing else on stdout, these libraries
    write to the descriptor directly, below any Python-level redirection, and what they write
    says nothing a user acts on (errors come back as return codes), so ``-q`` stays quiet.
    """
    try:
        sys.stdout.flush()
        saved = os.dup(1)
        sink = os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError):          # no real descriptor 1 (embedded, captured)
        yield
        return
    try:
        os.dup2(sink, 1)
        os.close(sink)
        yield
    finally:
        try:
            sys.stdout.flush()
        except ValueError:
            pass
        os.dup2(saved, 1)
        os.close(saved)


def minimum_requirements(problem: Problem, max_gpus: int = 64, *, precision: float = 0.02,
                         time_limit: float | None = None) -> str:
    """What would make the model fit: the smallest per-GPU memory and the fewest GPUs.

    Both are found with the Seq-pipe DP, which is exact among contiguous plans under
    a memory limit (another strategy may fit with less). Memory: the Seq-pipe plan on
    the same GPUs with the limit lifted uses some most-loaded GPU memory ``need``; the
    smallest limit at which the DP still finds a plan is bisected between what the
    weights alone need per GPU and ``need``, to ``precision``, and rounded up. GPUs:
    the fewest GPUs of the given memory on which the DP finds a plan, searched from
    the count the weights alone need (doubling, then bisection), up to ``max_gpus``.
    Where a probe below the advised figure found no plan without proving that none fits (the
    DP's memory check is a relaxation of evaluate's, a large graph has too many upsets to list,
    the time limit), the advice says so: less may fit. One GPU fewer than advised is then tried
    with the whole Seq-pipe (its MIP, with lazy memory cuts), which finds a plan there or proves
    that none fits. ``time_limit``: seconds per probe (Seq-pipe's default when None).
    """
    from dataclasses import replace

    from .units import format_bytes

    P = problem.num_gpus
    limit = problem.cluster.gpu_memory
    static = sum(p.total for p in problem.profile.params.values())
    parts = [f"weights, gradients and optimizer state take {format_bytes(static)} in all"]
    floor, floor_node = memory_floor(problem)
    if floor > limit:
        # No number of GPUs helps: one operator's own needs exceed a GPU (memory_floor).
        parts.append(f"op node {problem.graph.node(floor_node).name!r} alone needs at least "
                     f"{format_bytes(floor)} on its GPU, more than the {format_bytes(limit)} a GPU has, so no "
                     f"plan fits on any number of GPUs: raise --gpu-memory above {format_bytes(floor)}, or lower "
                     "--batch-size (the micro-batch)")
        limit_floor = floor
    else:
        limit_floor = 0

    def with_memory(m: int) -> Problem:
        return replace(problem, cluster=replace(problem.cluster, gpu_memory=int(m)))

    # (GPUs, memory per GPU) of the probes that found no plan without proving that none fits
    unsure: set[tuple[int, int]] = set()

    def seq_fits(pb: Problem) -> bool:
        # as compile judges a plan: priced, and its simulated run within the limit. The DP alone
        # (no MIP): a bisection probes many limits at which nothing fits, and the MIP would spend
        # its whole time limit on each.
        r = _run_one("seq", pb, True, {"mip": False, **({} if time_limit is None else {"time_limit": time_limit})})
        if not r.feasible and not r.proven_infeasible and r.cost is None:
            unsure.add((pb.num_gpus, pb.cluster.gpu_memory))
        return r.feasible

    def unproven(below: list, what) -> str:
        """Says where a probe below the advised figure (``below``: the figures of those probes)
        found no plan without proving that none fits (the DP's time limit, side nodes attached)."""
        return (f" (not proven the least: at {what(max(below))} the search found no plan but did not prove "
                "that none fits)" if below else "")

    if not limit_floor and seq_fits(problem):
        # The strategies asked for failed, but the cluster is big enough.
        parts.append(f"a Seq-pipe plan fits these {P} GPUs of {format_bytes(limit)}: use --strategy seq "
                     "(or auto)")
        return "; ".join(parts)
    relaxed = with_memory(10**18)
    try:
        need = evaluate(relaxed, run_strategy("seq", relaxed, mip=False)).max_memory_bytes
    except (Infeasible, PlanError, ValueError):
        need = None
    if need is not None:
        reserve = problem.memory_reserve                # kept free on every GPU (hardware preset)
        # lo does not fit (else we would not be here); neither does anything below the floor
        lo, hi = max(limit, reserve + static // P, limit_floor), need
        while hi - lo > precision * (hi - reserve):     # (precision on what the plan itself uses)
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if seq_fits(with_memory(mid)) else (mid, hi)
        parts.append(f"on {P} GPUs a Seq-pipe plan fits in {format_bytes(hi)} per GPU (have "
                     f"{format_bytes(limit)}, of which {format_bytes(reserve)} stay free as the hardware's "
                     f"reserve): use --gpu-memory {format_bytes(hi + max(0.005 * (hi - reserve), 10_000))} or more"
                     + unproven([m for p, m in unsure if p == P and m < hi], lambda m: f"{format_bytes(m)} per GPU"))

    if limit_floor:
        return "; ".join(parts)         # more GPUs of this memory cannot help (the floor is per node)

    def fits(p: int) -> bool:
        return seq_fits(replace(problem, cluster=problem.cluster.with_overrides(gpus=p)))

    usable = limit - problem.memory_reserve
    if usable <= 0:
        parts.append(f"no number of GPUs of {format_bytes(limit)} fits: each keeps "
                     f"{format_bytes(problem.memory_reserve)} free for the CUDA context, workspaces and "
                     "fragmentation (the hardware's reserve); raise --gpu-memory first, then --gpus")
        return "; ".join(parts)
    lo = max(P, -(-static // usable) - 1)               # lo GPUs do not fit
    hi = min(lo + 1, max_gpus)
    while hi < max_gpus and not fits(hi):
        lo, hi = hi, min(hi * 2, max_gpus)
    if hi > lo and (hi < max_gpus or fits(hi)):
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        # Where the DP proved nothing one GPU fewer (its memory check is a relaxation of evaluate's,
        # too many upsets to list on a large graph, its time limit), the whole Seq-pipe, MIP
        # included (lazy memory cuts), finds a plan there or proves that none fits.
        while hi > P and (hi - 1, limit) in unsure:
            fewer = replace(problem, cluster=problem.cluster.with_overrides(gpus=hi - 1))
            r = _run_one("seq", fewer, True, {} if time_limit is None else {"time_limit": time_limit})
            if not r.feasible and not r.proven_infeasible:
                break
            unsure.discard((hi - 1, limit))
            if not r.feasible:
                break
            hi -= 1
        parts.append(f"with {format_bytes(limit)} per GPU a Seq-pipe plan fits on {hi} GPUs (--gpus {hi})"
                     + unproven([p for p, m in unsure if m == limit and p < hi], lambda p: f"{p} GPUs"))
    elif any(m == limit and p > P for p, m in unsure):
        parts.append(f"the search found no Seq-pipe plan on up to {max_gpus} GPUs of {format_bytes(limit)}, "
                     "without proving that none fits (try --strategy seq or exact with a longer --time-limit)")
    else:
        parts.append(f"it does not fit on up to {max_gpus} GPUs of {format_bytes(limit)} (--gpus): some single "
                     "operator needs more memory than one GPU has")
    return "; ".join(parts)


# --------------------------------------------------------------------------- plan.json

def _stage_rows(problem: Problem, plan: Plan, cost: PlanCost) -> list[dict]:
    from .plan import stage_graph, total_param_memory

    graph = problem.graph
    sg = stage_graph(graph, plan)
    gpu_of = {s.id: s.gpu for s in plan.stages}
    rows = []
    by_id = {c.id: c for c in cost.stages}
    param_bytes = {s.id: total_param_memory(problem, s.nodes) for s in plan.stages}
    for s in plan.stages:
        c = by_id[s.id]

        def values(edges, other_key):
            out = []
            for other, data in edges:
                for v, b in data["values"].items():
                    meta = graph.node(graph.producer(v)).outputs[v]
                    out.append({"value": v, other_key: other, "gpu": gpu_of[other], "bytes": b,
                                **({"shape": list(meta.tensor.shape), "dtype": meta.tensor.dtype}
                                   if meta.tensor is not None else {"literal": meta.literal})})
            return out

        rows.append({
            "id": s.id, "gpu": s.gpu, "depth": c.depth, "nodes": s.nodes,
            "forward_ms": c.forward_ms, "backward_ms": c.backward_ms, "recompute_ms": c.recompute_ms,
            "compute_ms": c.forward_ms + c.backward_ms + c.recompute_ms, "period_ms": c.period_ms,
            "comm_fwd_ms": c.comm_fwd_ms, "comm_bwd_ms": c.comm_bwd_ms,
            # Memory of the stage alone: the weights, gradients and optimizer state of the parameters
            # it reads, plus the activations it keeps for its micro-batches in flight. (A GPU's
            # total in "gpus" counts a parameter shared by its stages once, and weight versions.)
            "activation_bytes": c.activation_bytes, "activation_memory_bytes": c.memory_bytes,
            "param_memory_bytes": param_bytes[s.id],
            "memory_bytes": c.memory_bytes + param_bytes[s.id],
            "inputs": values(((u, sg.edges[u, s.id]) for u in sg.predecessors(s.id)), "from_stage"),
            "outputs": values(((t, sg.edges[s.id, t]) for t in sg.successors(s.id)), "to_stage"),
            "graph_inputs": sorted({e.value for n in s.nodes for e in graph.in_edges(n)
                                    if graph.node(e.src).kind == "input"}),
            "computes_loss": any(graph.node(n).is_loss for n in s.nodes),
        })
    return rows


def plan_document(result: CompileResult, *, model: dict | None = None) -> dict:
    """The ``plan.json`` artifact."""
    p = result.problem
    doc = {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "model": model or p.graph.source,
        "graph_hash": p.graph.content_hash(),
        "profile": {"method": p.profile.method, "hardware": p.profile.hardware.get("name"),
                    "dtype": p.profile.dtype, "optimizer": p.profile.optimizer, "key": p.profile.key},
        "cluster": p.cluster.to_json(),
        "schedule": p.schedule, "micro_batches": p.micro_batches, "recompute": p.recompute,
        "weight_prediction": p.weight_prediction, "clip_grad_norm": p.clip_grad_norm, "on_nonfinite": p.on_nonfinite,
        "tied_lag": p.tied_lag, "in_flight_scale": p.in_flight_scale,
        "lower_bound": {"objective_ms": result.lower_bound_ms,
                        "note": "total compute / GPUs, less the most recomputation the last stage can skip "
                                "within its period and one GPU's memory; no plan that fits can beat it"},
        "strategies": [r.row() for r in result.results],
        "chosen": result.chosen,
        **({"chosen_why": result.info["chosen_why"]} if result.info.get("chosen_why") else {}),
        "limits": {"max_stages": result.info.get("max_stages"), "time_limit_s": result.info.get("time_limit_s")},
        **({"configuration_bound": result.info["configuration_bound"]} if "configuration_bound" in result.info else {}),
        "compile_seconds": round(result.seconds, 3),
    }
    if p.replicas > 1 or p.cluster.gpu_ids is not None:
        doc["layout"] = {"replicas": p.replicas, "pipeline_gpus": p.num_gpus,
                         "gpu_ids": list(p.cluster.gpu_ids) if p.cluster.gpu_ids is not None else None,
                         "ring_bandwidth": list(p.ring_bandwidth) if p.ring_bandwidth else None}
    if result.chosen is not None:
        best = result.best()
        doc["plan"] = best.plan.to_json()
        doc["cost"] = {k: v for k, v in best.cost.to_json().items() if k != "stages"}
        doc["simulation"] = best.sim
        doc["stages"] = _stage_rows(p, best.plan, best.cost)
        doc["node_names"] = {str(n.id): n.name for n in p.graph.op_nodes()}
        doc["gpus"] = [{"gpu": g.gpu, "stages": g.stages, "load_ms": g.load_ms, "compute_ms": g.compute_ms,
                        "comm_ms": g.comm_ms, "memory_bytes": g.memory_bytes, "memory_limit": g.memory_limit,
                        "param_bytes": g.param_bytes, "activation_bytes": g.activation_bytes,
                        "utilisation": g.load_ms / best.cost.objective_ms if best.cost.objective_ms else 0.0}
                       for g in best.cost.gpus]
    return doc


# --------------------------------------------------------------------------- report

def replicas_section(options, chosen: int | None, whole_cluster) -> dict:
    """plan.json's ``replicas``: every (P, R) layout considered, the chosen one and why."""
    from .inflight import GAIN
    from .replicas import SEARCHED_LAYOUTS, SEARCHING_STRATEGIES, why

    c = options[chosen] if chosen is not None else None
    screened = ""
    if any(o.planned in ("screened", "bounded") for o in options):
        screened = (f"; with more layouts than are planned in full, they were planned shortest pipeline first "
                    f"without the searching strategies ({', '.join(SEARCHING_STRATEGIES)}; 'screened'), a layout whose "
                    f"throughput bound (the busiest GPU's least work per step, or its all-reduce lane) is below "
                    f"the best found before (x (1 - {GAIN:.0%})^2 where staleness grows with depth) was not "
                    f"planned ('bounded'); a layout they found no plan for, the {SEARCHED_LAYOUTS} best "
                    f"layout(s) and the one kept were then planned with every strategy asked for, the first "
                    f"where its bound reaches the best found")
    return {"cluster": whole_cluster.to_json(), "gpus": whole_cluster.physical_gpus,
            "options": [o.row() for o in options], "chosen": chosen,
            "replicas": c.layout.replicas if c else None, "pipeline_gpus": c.layout.pipeline_gpus if c else None,
            "order": c.layout.order if c else None, "why": why(options, chosen),
            "note": "throughput: samples/s of all replicas together in the simulated steady state (R x M "
                    "micro-batches per step, gradient all-reduce over a ring of R priced on the slowest link "
                    "of the ring); staleness: how many updates old the weights are that the deepest stage's "
                    "gradients meet; the fastest layout is kept unless a less stale one is within "
                    f"{GAIN:.0%} of it; options whose pipeline cannot hold the model's weights, gradients and "
                    "optimizer state are refused without partitioning" + screened}


def problem_from_doc(doc: dict, graph, prof, *, schedule: str | None = None, micro_batches: int | None = None,
                     recompute: bool | None = None, weight_prediction: bool | None = None,
                     clip_grad_norm: float | None = None, on_nonfinite: str | None = None,
                     tied_lag: bool | None = None, in_flight_scale: int | None = None) -> Problem:
    """The Problem a plan document was made for (its pipeline's GPUs, replicas and rings, and the
    run settings it was priced with); a setting given here replaces the document's."""
    from .cluster import ClusterSpec

    lay = doc.get("layout") or {}
    ring = lay.get("ring_bandwidth")
    return Problem(graph, prof, ClusterSpec.from_json(doc["cluster"]), schedule=schedule or doc["schedule"],
                   micro_batches=micro_batches or doc["micro_batches"],
                   recompute=doc.get("recompute") if recompute is None else recompute,
                   weight_prediction=bool(doc.get("weight_prediction") if weight_prediction is None
                                          else weight_prediction),
                   clip_grad_norm=doc.get("clip_grad_norm") if clip_grad_norm is None else clip_grad_norm,
                   on_nonfinite=on_nonfinite or doc.get("on_nonfinite") or "stop",
                   tied_lag=bool(doc.get("tied_lag", True) if tied_lag is None else tied_lag),
                   in_flight_scale=doc.get("in_flight_scale", 1) if in_flight_scale is None else in_flight_scale,
                   replicas=int(lay.get("replicas") or 1), ring_bandwidth=tuple(ring) if ring else None)


def _replicas_lines(rep: dict) -> list[str]:
    lines = ["", f"## replicas: pipeline length x replicas on {rep['gpus']} GPUs", "",
             "| pipeline GPUs | replicas | rank order | fits | strategy | samples/s (all replicas) | "
             "staleness (updates) | step ms | all-reduce ms | moved per step: pipeline / all-reduce (across hosts) | "
             "max GPU mem | time s | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, o in enumerate(rep["options"]):
        mark = " (chosen)" if i == rep.get("chosen") else ""
        f = o["feasible"]
        lines.append(
            f"| {o['pipeline_gpus']}{mark} | {o['replicas']} | {o['order']} | {'yes' if f else 'no'} | "
            f"{o['strategy'] or '-'} | {o['throughput']:.3f} | {_fmt_stale(o.get('staleness_updates'))} | "
            f"{o['step_ms']:.3f} | {o['allreduce_ms']:.3f} | "
            f"{_fmt_bytes(o['pipeline_bytes_per_step'])} ({_fmt_bytes(o['pipeline_cross_host_bytes_per_step'])}) / "
            f"{_fmt_bytes(o['allreduce_bytes_per_step'])} ({_fmt_bytes(o['allreduce_cross_host_bytes_per_step'])}) | "
            f"{_fmt_bytes(o['max_gpu_memory_bytes'])} | {o['seconds']:.1f} | {_planned_note(o)} |" if f else
            f"| {o['pipeline_gpus']} | {o['replicas']} | {o['order']} | "
            f"{'-' if o.get('planned') == 'bounded' else 'no'} | - | - | - | - | - | - | - | "
            f"{o['seconds']:.1f} | {o['reason']} |")
    lines += ["", f"Chosen: {rep['why']}.", "", f"*{rep['note']}*"]
    return lines


def _fmt_stale(updates: float | None) -> str:
    return "-" if updates is None else f"{updates:.3g}"


def _planned_note(o: dict) -> str:
    """What a feasible layout's row was planned with, when not every strategy asked for."""
    if o.get("planned") == "screened":
        return f"screened with {', '.join(o.get('strategies_run') or [])} only"
    return ""


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def _settings_text(doc: dict) -> str:
    """The run settings recorded in ``doc`` that change a plan's price, where they differ, as they take
    effect (``reprice.Settings``), from the run's fixed defaults (which ``ftcompile run`` takes from
    the plan instead: ``options.planned_settings``)."""
    from .reprice import LABELS, Settings, changes

    schedule, m = doc["schedule"], doc["micro_batches"]
    clip, skip = doc.get("clip_grad_norm"), doc.get("on_nonfinite") or "stop"
    planned = Settings.of(schedule, m, doc.get("recompute"), doc["profile"].get("optimizer") or "adam",
                          doc.get("weight_prediction"), clip, skip, doc.get("tied_lag", True),
                          in_flight_scale=int(doc.get("in_flight_scale") or 1))
    out = []
    for name, _, value in changes(Settings.of(schedule, m, False, "adam", False, None, "stop"), planned):
        if name == "exchanges_norms":
            out += ([f"clip-grad-norm {clip:g}"] if clip else []) + (["on-nonfinite skip"] if skip == "skip" else [])
        elif name == "optimizer":
            out.append(f"optimizer {value}")
        elif name == "in_flight_scale":
            out.append(f"in-flight scale {value} (x depth + 1 forwards before the first backward)")
        else:
            out.append(f"{LABELS.get(name, name)} {'on' if value else 'off'}")
    return ", ".join(out)


def report_text(doc: dict) -> str:
    """A plain-text (Markdown) report of a plan document."""
    lines = []
    m = doc.get("model") or {}
    c = doc["cluster"]
    lines.append(f"# ftcompile plan: {m.get('model', '?')}")
    lines.append("")
    limits = doc.get("limits") or {}
    lay = doc.get("layout") or {}
    if lay.get("replicas", 1) > 1 or lay.get("gpu_ids"):
        lines.append(f"one pipeline of {P_of(c)} GPUs (GPUs {gpu_ranges(lay.get('gpu_ids') or range(P_of(c)))} of "
                     f"the cluster; replica 0), {lay.get('replicas', 1)} replica(s); the tables below are per "
                     f"pipeline")
    lines.append(f"cluster {c['name']}: {c['nodes']} x {c['gpus_per_node']} GPUs, "
                 f"{c['gpu_memory'] / 1e9:.1f} GB each, {c['intra_node_bandwidth'] / 1e9:.1f} GB/s; "
                 f"schedule {doc['schedule']}, {doc['micro_batches']} micro-batches; "
                 f"costs {doc['profile']['method']} on {doc['profile']['hardware']}"
                 + (f"; at most {limits['max_stages']} stages" if limits.get("max_stages") else ""))
    settings = _settings_text(doc)
    if settings:
        lines.append(f"priced for the run's settings: {settings}")
    for note in doc.get("notes") or ():
        lines.append(f"note: {note}")
    lines.append(f"lower bound: {doc['lower_bound']['objective_ms']:.3f} ms per micro-batch (every plan)")
    cb = doc.get("configuration_bound")
    if cb:
        lines.append("configuration LP (whole nodes per GPU): " + (
            f"no plan is below {cb['ms']:.3f} ms per micro-batch" if cb["raised"] else
            f"did not raise the bound above {cb['from_ms']:.3f} ms") + f" ({cb['seconds']:.1f} s)")
    lines.append("")
    lines.append("| strategy | feasible | objective ms | simulated ms | bound ms | gap | speed-up | "
                 "speed-up (FTPipe) | stages | staleness | max GPU mem | time s | note |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def fmt(v, f):
        return f.format(v) if v is not None else "-"

    P = P_of(c)
    for r in doc["strategies"]:
        mark = " (chosen)" if r["name"] == doc.get("chosen") else ""
        stale = (f"{r['staleness_updates']:.2g} upd. (depth {r['max_depth']})"
                 if r.get("staleness_updates") is not None else "-")
        note = r["reason"] or _row_note(r)
        lines.append(
            f"| {r['name']}{mark} | {'yes' if r['feasible'] else 'no'} | {fmt(r['objective_ms'], '{:.3f}')} | "
            f"{fmt(r.get('simulated_period_ms'), '{:.3f}')} | {fmt(r.get('bound_ms'), '{:.3f}')} | "
            f"{fmt(r.get('gap'), '{:.1%}')} | {fmt(r.get('speedup_no_recompute'), '{:.2f}')} | "
            f"{fmt(r['speedup'], '{:.2f}')} | {fmt(r['stages'], '{}')} | {stale} | "
            f"{_fmt_bytes(r['max_gpu_memory_bytes'])} | {r['seconds']:.1f} | {note} |")
    lines.append("")
    lines.append(f"*objective*: the largest GPU load per micro-batch (FTPipe Eq. 1); *simulated*: the period "
                 f"per micro-batch the discrete-event simulation measures under {doc['schedule']}; *bound*: the "
                 f"best lower bound proven for the plan's space (see `bound_covers` in plan.json) and *gap* the "
                 f"objective's distance from it; *speed-up*: one device running the model without recomputation "
                 f"(forward + backward of every node) over the objective, of {P}; *speed-up (FTPipe)*: the plan's "
                 f"own work, recomputation included, over the objective; *staleness*: how many optimizer updates "
                 f"old the weights are that the deepest stage's gradients meet."
                 + (" *in flight*: a plan whose GPUs hold several stages runs K x depth + 1 forwards per stage "
                    "before its first backward, K chosen by simulation (`in_flight_tuning` in plan.json), so the "
                    "round trip of a micro-batch through the stages on shared GPUs stays covered."
                    if any((r.get("in_flight_tuning") or {}).get("chosen", 1) > 1 for r in doc["strategies"]) else "")
                 + (" *NAME-sim*: among that strategy's plans, the one that simulates fastest (each strategy "
                    "returns its lowest objective, which its bound speaks of; the choice is by simulated "
                    "throughput)." if any(r["name"].endswith(SIMULATED_SUFFIX) for r in doc["strategies"]) else ""))
    if doc.get("gpus"):
        best = next((r for r in doc["strategies"] if r["name"] == doc.get("chosen")), None)
        lines.append("")
        lines.append(f"## chosen: {doc['chosen']}")
        lines.append("")
        if doc.get("chosen_why"):
            lines.append(f"Not the fastest row: {doc['chosen_why']}.")
            lines.append("")
        if best and best.get("staleness_updates"):
            lines.append(f"Under {doc['schedule']}, the first stage's gradients are about "
                         f"{best['staleness_updates']:.1f} updates old ({best['max_depth']} stages deep"
                         + (f" x in-flight scale {best['in_flight_scale']}" if (best.get("in_flight_scale") or 1) > 1
                            else "") +
                         f", {doc['micro_batches']} micro-batches per update); `--max-stages` bounds that.")
            lines.append("")
        lines.append("| GPU | stages | load ms | compute ms | comm ms | utilisation | memory | of limit |")
        lines.append("|---|---|---|---|---|---|---|---|")
        idle = [g for g in doc["gpus"] if not g["stages"]]
        for g in doc["gpus"]:
            if g["stages"] or len(idle) <= IDLE_GPU_ROWS:
                lines.append(f"| {g['gpu']} | {','.join(map(str, g['stages']))} | {g['load_ms']:.3f} | "
                             f"{g['compute_ms']:.3f} | {g['comm_ms']:.3f} | {g['utilisation']:.1%} | "
                             f"{_fmt_bytes(g['memory_bytes'])} | {g['memory_bytes'] / g['memory_limit']:.0%} |")
        if len(idle) > IDLE_GPU_ROWS:     # one row for the GPUs without a stage (plan.json lists each)
            worst = max(idle, key=lambda g: g["memory_bytes"])
            lines.append(f"| {gpu_ranges(g['gpu'] for g in idle)} ({len(idle)} GPUs) | - | 0.000 | 0.000 | 0.000 | "
                         f"0.0% | {_fmt_bytes(worst['memory_bytes'])} | "
                         f"{worst['memory_bytes'] / worst['memory_limit']:.0%} |")
        lines.append("")
        lines.append("| stage | GPU | depth | nodes | period ms | memory | sends | receives |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for s in doc["stages"]:
            lines.append(f"| {s['id']} | {s['gpu']} | {s['depth']} | {len(s['nodes'])} | {s['period_ms']:.3f} | "
                         f"{_fmt_bytes(s.get('memory_bytes'))} | "
                         f"{_fmt_bytes(sum(v['bytes'] for v in s['outputs']))} | "
                         f"{_fmt_bytes(sum(v['bytes'] for v in s['inputs']))} |")
    else:
        lines.append("")
        lines.append(f"no strategy found a plan that fits: {doc.get('requirements', '')}")
    if doc.get("replicas"):
        lines += _replicas_lines(doc["replicas"])
    return "\n".join(lines) + "\n"


#: The report lists GPUs without a stage one per row up to this many; more share one row.
IDLE_GPU_ROWS = 16


def gpu_ranges(gpus) -> str:
    """GPU numbers as ascending runs: ``0-3, 6, 8-9``."""
    ids = sorted(int(g) for g in gpus)
    runs: list[list[int]] = []
    for g in ids:
        if runs and g == runs[-1][1] + 1:
            runs[-1][1] = g
        else:
            runs.append([g, g])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def P_of(cluster_json: dict) -> int:
    """GPUs of a cluster document (a view counts its own)."""
    c = cluster_json
    return len(c["gpu_ids"]) if c.get("gpu_ids") else c["nodes"] * c["gpus_per_node"]


def _row_note(r: dict) -> str:
    """What a strategy proved about its own space (seq, exact), in a few words, and the in-flight
    scale its plan was priced at where compile tuned it above 1."""
    note = _proof_note(r)
    if r.get("simulated_steps"):
        a, b = r["simulated_steps"]
        note += ("; " if note else "") + f"simulated: no periodic state, the mean of steps {a} to {b - 1}"
    tuned = r.get("in_flight_tuning") or {}
    if tuned.get("chosen", 1) > 1:
        first = tuned["tries"][0]
        note += ("; " if note else "") + (f"{tuned['chosen']} x depth + 1 in flight (at {first['scale']}: "
                                          f"{first['period_ms']:.3f} ms simulated)")
    return note


def _proof_note(r: dict) -> str:
    info = r.get("info") or {}
    if "alternative_of" in info:
        return f"the fastest of {info['alternative_of']}'s plans in simulation"
    if r["name"] == "exact" and "mip_bound_ms" in info:
        state = "proven optimal" if info.get("optimal") else f"MIP bound {info['mip_bound_ms']:.3f} ms"
        return f"{state} over {info.get('bound_space', 'its space')}"
    if r["name"] == "seq" and "search" in info:
        if info.get("optimal"):
            return "proven optimal over convex splits"
        if info.get("bound_ms") is not None:
            return f"within {info.get('gap', 0):.1%} of the best convex split (search {info['search']})"
        return f"convex search {info['search']}"
    return ""


#: Pictures draw at most this many GPU boxes (or timeline rows); larger clusters are grouped.
MAX_PICTURE_GPUS = 64


def gpu_boxes(gpus: list[dict], most: int = MAX_PICTURE_GPUS) -> list[dict]:
    """The boxes to draw for a plan's ``gpus`` rows: one per GPU, or, for more than ``most``
    GPUs, the idle ones as one box and the others in consecutive groups (memory: the most of
    the group; utilisation: the mean), so a picture of 10,000 GPUs stays ``most`` boxes."""
    busy = [g for g in gpus if g["stages"]]
    idle = [g for g in gpus if not g["stages"]]
    boxes = [{"label": f"GPU {g['gpu']}", **g} for g in gpus]
    if len(gpus) <= most:
        return boxes
    slots = most - (1 if idle else 0)
    per = -(-len(busy) // max(1, slots))
    boxes = []
    for i in range(0, len(busy), per):
        grp = busy[i:i + per]
        label = f"GPU {grp[0]['gpu']}" if len(grp) == 1 else f"GPUs {grp[0]['gpu']}-{grp[-1]['gpu']}"
        boxes.append({"label": label, "memory_bytes": max(g["memory_bytes"] for g in grp),
                      "memory_limit": grp[0]["memory_limit"],
                      "utilisation": sum(g["utilisation"] for g in grp) / len(grp), "stages": True})
    if idle:
        boxes.append({"label": f"{len(idle)} idle GPUs", "memory_bytes": max(g["memory_bytes"] for g in idle),
                      "memory_limit": idle[0]["memory_limit"], "utilisation": 0.0, "stages": []})
    return boxes


def draw_gpu_boxes(docs: list[tuple[str, dict]], path: str) -> None:
    """FTPipe Fig. 8: one box per GPU, width = memory used, fill = utilisation; one row per plan.

    More than :data:`MAX_PICTURE_GPUS` GPUs are grouped (:func:`gpu_boxes`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = [(label, d) for label, d in docs if d.get("gpus")]
    fig, axes = plt.subplots(len(rows) or 1, 1, figsize=(12, 1.6 * max(len(rows), 1) + 0.6), squeeze=False)
    for ax, (label, d) in zip(axes[:, 0], rows):
        boxes = gpu_boxes(d["gpus"])
        # Widths are relative to the fullest GPU so that small models stay visible; labels give
        # the absolute figures and the share of the GPU's memory.
        widest = max(max(g["memory_bytes"] for g in boxes), 1)
        small = len(boxes) > 16
        x = 0.0
        for g in boxes:
            w = max(g["memory_bytes"] / widest, 0.03)
            ax.add_patch(Rectangle((x, 0), w, 1, fill=False, lw=1.2, ec="black"))
            ax.add_patch(Rectangle((x, 0), w, min(g["utilisation"], 1.0), color="tab:blue", alpha=0.6))
            text = (f"{g['label']}\n{_fmt_bytes(g['memory_bytes'])} "
                    f"({g['memory_bytes'] / g['memory_limit']:.0%})\n{g['utilisation']:.0%} busy")
            ax.text(x + w / 2, 1.05, text, ha="center", va="bottom", fontsize=4 if small else 7,
                    rotation=90 if small else 0)
            x += w + 0.15
        ax.set_xlim(0, max(x, 1))
        ax.set_ylim(0, 1.9 if not small else 3.2)
        ax.set_yticks([])
        ax.set_xticks([])
        eff = d.get("cost", {}).get("efficiency")
        grouped = f"; {len(d['gpus'])} GPUs in {len(boxes)} boxes" if len(boxes) < len(d["gpus"]) else ""
        ax.set_title(f"{label}: {d.get('chosen')} ({'' if eff is None else f'{eff:.1%} of lower bound'}); "
                     f"width = memory used, fill = utilisation{grouped}", fontsize=9, loc="left")
        for s in ax.spines.values():
            s.set_visible(False)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def write_report(out_dir: str, doc: dict, result: CompileResult | None = None) -> dict[str, str]:
    """Write plan.json, report.md, gpus.png and (when a plan was chosen) the timeline pictures."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"plan": os.path.join(out_dir, "plan.json"), "report": os.path.join(out_dir, "report.md")}
    save_json(paths["plan"], doc)
    from .ir import atomic_write_text

    atomic_write_text(paths["report"], report_text(doc))
    if doc.get("gpus"):
        paths["gpus"] = os.path.join(out_dir, "gpus.png")
        draw_gpu_boxes([(str((doc.get("model") or {}).get("model", "plan")), doc)], paths["gpus"])
        if result is not None and result.chosen is not None:
            from .simulate import simulation_of
            from .timeline import draw_timeline

            best = result.best()
            sim = simulation_of(result.problem, best.plan)     # (the row's own replay, with its events)
            base = os.path.join(out_dir, "timeline")
            draw_timeline(sim, base + ".png")
            paths["timeline"] = base + ".png"
    return paths
