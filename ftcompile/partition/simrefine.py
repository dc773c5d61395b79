"""Simulation-guided refinement: local search on a plan's *simulated* period.

Every partitioner minimises FTPipe's Eq. 1 objective, the largest GPU load per
micro-batch. The simulator (:func:`ftcompile.simulate.simulate`) replays the
schedule's dependencies and shows what Eq. 1 leaves out: the waits between stages
sharing a GPU, an optimizer step that stalls its neighbours, the wait for a tied
tensor's other gradient. Where those waits set the period, a plan with a slightly
worse objective can run faster; :func:`refine_simulated` searches for it directly.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

import networkx as nx

from ..plan import Plan, Problem, Stage, evaluate, ordered, simulation_key


def simulated_score(problem: Problem, plan: Plan) -> tuple[float, float] | None:
    """``(simulated period, objective)`` per micro-batch of ``plan``, or None if it does not fit
    (by :func:`~ftcompile.plan.evaluate` or in the simulated run's memory replay)."""
    from ..simulate import simulation_of

    # simulate() evaluates the plan again itself; evaluating first costs about a sixth of a
    # simulation and keeps plans that cannot fit from being simulated at all.
    cost = evaluate(problem, plan)
    if not cost.feasible:
        return None
    sim = simulation_of(problem, plan)
    if not getattr(sim, "memory_feasible", True):
        return None
    return sim.period_ms, cost.objective_ms


def refine_simulated(problem: Problem, plan: Plan, time_limit: float, *, seed: int = 0) -> Plan:
    """``plan`` improved by single-node moves that lower its simulated period.

    A move takes one op node from its stage to a stage that holds one of its producers or
    consumers (on any GPU), leaving no stage empty and the stage graph acyclic. It is
    accepted when the plan still fits and ``(simulated period, objective)`` decreases
    lexicographically (so among plans of equal period the lower objective wins). Moves are
    tried in an order shuffled by ``seed``; after each accepted move the candidates are
    listed again. The search stops when a whole list brings no improvement or before a
    simulation that would end past ``time_limit`` seconds (at the longest one took so far),
    and returns the best plan found (``plan`` itself when none is better), its stages
    renumbered in topological order. Deterministic for a given seed except where the time
    limit cuts it short.

    A stage count is never raised (a move that leaves a stage lone, exchanging no value with
    another, joins it to another stage on its GPU: :func:`~ftcompile.plan.join_unpaced_stages`)
    and an accepted plan always fits, so the result is a
    valid plan of the same kind: stages that are convex (one per GPU) may become stages
    that share a GPU only if ``plan`` already had them. ``info["simulated_refinement"]``
    says what happened: the period and objective before and after, moves accepted,
    simulations run, and the in-flight scale they were simulated at.

    That scale is the one :func:`~ftcompile.partition.base.simulated_choice` ranked ``plan`` by
    (:func:`~ftcompile.partition.base.ranked_scale`): the problem's, or its probe's where the
    choice ranked it by its period there. A move is then judged by the period the plan was
    chosen for, and the result's ``simulated_probe`` is its own (``simulated_period_ms`` stays
    the problem's scale's, from one more replay, kept back from ``time_limit`` like a move's).
    A move that scale refuses or deadlocks (2bw: ``M`` must cover ``scale x depth``) is not
    taken; a start it cannot run is refined at the problem's scale; a result that does not
    run at the problem's scale is dropped for ``plan``.
    """
    from ..simulate import SimulationError, kept_simulation, simulation_of
    from .base import ranked_scale

    t0 = time.perf_counter()
    graph = problem.graph

    def score_of(pb: Problem, candidate: Plan) -> tuple[float, float] | None:
        # (a scale above the problem's refuses what it cannot run: 2bw's M below scale x depth,
        # a deadlock; such a plan is not taken, as _probed_fastest does not rank it)
        try:
            return simulated_score(pb, candidate)
        except (ValueError, SimulationError):
            return None

    # Judged at the scale the plan was chosen at. Refined at the problem's scale, the probe's
    # choice was undone: BERT-6's held-out operator graph on 6 GPUs at 1.1 x, one move from
    # 48.245 to 47.935 ms at scale 1, and compile's tuned period of the result 43.974 against
    # the probed plan's 43.816 (1.000 of its objective).
    scale = ranked_scale(problem, plan)
    judged = problem if scale == problem.in_flight_scale else replace(problem, in_flight_scale=scale)
    # Every plan is scored as it will run, stages numbered by ordered() (the ids set the
    # engine's stage order), and keeps its simulation: compile's row reuses the winner's.
    # (ordered() shares the plan's simulations dict: ``plan`` keeps the one run here.)
    first = ordered(plan, graph)
    start = score_of(judged, first)
    if start is None and judged is not problem:
        judged, scale = problem, problem.in_flight_scale
        start = score_of(judged, first)
    if start is None or time_limit <= 0 or len(plan.stages) < 2:
        return plan
    # A move's plan has the stages of this one, so its simulation takes about as long as this
    # one's did: none is started that would not end in time (BERT-6's operator graph under tight
    # memory: 17 s each for 159 stages, against 1.5 s left). The replay's own seconds, also where
    # it was kept from before (simulated_choice's: BERT-12's 255 stages, a move of 30 s began
    # with 5 s left when its cached start counted as no time). At the probe's scale, the result's
    # replay at the problem's scale is kept back too: the start's, where simulated_choice kept
    # it, says how long; else the judged scale's, which runs more micro-batches in flight.
    sim_s = simulation_of(judged, first).seconds
    kept = None if judged is problem else kept_simulation(problem, first)
    final_s = 0.0 if judged is problem else (kept.seconds if kept is not None else sim_s)
    neighbours: dict[int, set[int]] = {}
    for e in graph.edges:
        neighbours.setdefault(e.src, set()).add(e.dst)
        neighbours.setdefault(e.dst, set()).add(e.src)
    stages = [(s.gpu, set(s.nodes)) for s in plan.stages]
    best, best_plan, moves, sims = start, None, 0, 0
    scored: dict[tuple, tuple | None] = {}
    rng = random.Random(seed)
    improved = True
    while improved and time.perf_counter() - t0 < time_limit:
        improved = False
        where = {n: i for i, (_g, ns) in enumerate(stages) for n in ns}
        cands = sorted({(n, where[m]) for n in where for m in neighbours.get(n, ())
                        if m in where and where[m] != where[n]})
        rng.shuffle(cands)
        for n, t in cands:
            if time.perf_counter() - t0 + sim_s + final_s >= time_limit:
                break
            s = where[n]
            if len(stages[s][1]) == 1:
                continue
            trial = [(g, set(ns)) for g, ns in stages]
            trial[s][1].discard(n)
            trial[t][1].add(n)
            try:
                candidate = ordered(_as_plan(plan, trial), graph)
            except nx.NetworkXUnfeasible:       # (the move made the stage graph cyclic)
                continue
            key = simulation_key(candidate)
            if key in scored:           # (two moves from two plans can make the same plan)
                continue
            t_sim = time.perf_counter()
            score = scored[key] = score_of(judged, candidate)
            sim_s = max(sim_s, time.perf_counter() - t_sim)
            sims += 1
            if score is not None and score < best:
                best, best_plan, stages, improved = score, candidate, trial, True
                moves += 1
                break
    report = {"from_period_ms": round(start[0], 6), "from_objective_ms": round(start[1], 6),
              "period_ms": round(best[0], 6), "objective_ms": round(best[1], 6),
              "moves": moves, "simulations": sims, "in_flight_scale": scale,
              "seconds": round(time.perf_counter() - t0, 3)}
    if moves == 0:
        plan.info["simulated_refinement"] = report
        return plan
    out = best_plan
    out.info["simulated_refinement"] = report
    out.info.pop("simulated_probe", None)       # (copied from ``plan``: not this plan's)
    if judged is problem:
        out.info["simulated_period_ms"] = round(best[0], 6)
        out.info["simulated_memory_fits"] = True
    else:
        # the figures the choice keeps, for this plan: its period at the problem's scale (one
        # more replay, shorter than the probe's) and the probe it was refined by
        at = score_of(problem, out)
        if at is None:          # (it fits at the larger scale, so this should not happen: kept safe)
            report["dropped"] = f"the refined plan does not run at in-flight scale {problem.in_flight_scale}"
            plan.info["simulated_refinement"] = report
            return plan
        out.info["simulated_period_ms"] = round(at[0], 6)
        out.info["simulated_memory_fits"] = True
        out.info["simulated_probe"] = {"scale": scale, "fits": True, "period_ms": round(best[0], 6)}
    return out


def _as_plan(plan: Plan, stages: list[tuple[int, set[int]]]) -> Plan:
    return Plan(plan.strategy, plan.num_gpus, [Stage(i, g, sorted(ns)) for i, (g, ns) in enumerate(stages)],
                dict(plan.info))
