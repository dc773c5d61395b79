"""Compile's choice by simulation, checked against independent loops on DAGs with parallel branches.

The objective (FTPipe Eq. 1, the largest GPU load) does not see the waits a schedule's
dependencies impose; compile chooses the plan with the best *simulated* throughput and
reports both figures for every plan. These tests check that choice with a loop of their
own over the plans, and check the chosen plan's simulated period against brute force over
every convex split (``tests/dags.py``), simulated one by one.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dags import branchy_problem, convex_splits
from ftcompile.compile import AUTO_STRATEGIES, compile_plan
from ftcompile.plan import Plan, Stage, evaluate
from ftcompile.simulate import simulate

STRATEGIES = ",".join(AUTO_STRATEGIES)


@pytest.mark.parametrize("seed,gpus,tied", [(0, 2, False), (1, 3, False), (0, 3, True), (2, 2, True)])
def test_compile_chooses_the_best_simulated_plan_and_reports_both_figures(seed, gpus, tied):
    problem = branchy_problem(seed, gpus=gpus, tied=tied)
    result = compile_plan(problem, STRATEGIES, jobs=1, time_limit=5)
    feasible = [r for r in result.results if r.feasible]
    assert feasible
    # every plan in the table carries both figures
    for r in feasible:
        row = r.row()
        assert row["objective_ms"] is not None and row["simulated_period_ms"] is not None
        assert row["objective_ms"] == pytest.approx(evaluate(problem, r.plan).objective_ms, rel=1e-6)
    # an independent loop: simulate every plan afresh (at the in-flight scale its row was priced at,
    # tuned where a GPU holds several stages: tests/test_inflight.py), keep the highest throughput
    # (ties: lower objective), unless a plan with less stale weights (async: scale x depth / M
    # updates, the depth counted here on the stage DAG) is within 1 % of it: the least stale of those
    scored = []
    for r in feasible:
        sim = simulate(replace(problem, in_flight_scale=r.in_flight_scale), r.plan)
        assert sim.period_ms == pytest.approx(r.row()["simulated_period_ms"], rel=1e-6)
        stale = r.in_flight_scale * stage_dag_depth(problem, r.plan) / problem.micro_batches
        scored.append((-sim.throughput_samples_per_s, evaluate(problem, r.plan).objective_ms, r.name, stale))
    best = min(scored)
    near = [s for s in scored if -s[0] > -best[0] * 0.99]
    least = min(near, key=lambda s: (s[3], s[0], s[1]))
    want = least if least[3] < best[3] - 1e-9 else best
    chosen = next(s for s in scored if s[2] == result.chosen)
    assert chosen[:2] == pytest.approx(want[:2], rel=1e-9)
    assert (result.info.get("chosen_why") is not None) == (want is not best)


def stage_dag_depth(problem, plan) -> int:
    """The longest chain of stages (edges) along the graph's edges."""
    import networkx as nx

    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    g = nx.DiGraph()
    g.add_nodes_from(s.id for s in plan.stages)
    g.add_edges_from((stage_of[e.src], stage_of[e.dst]) for e in problem.graph.edges
                     if e.src in stage_of and e.dst in stage_of and stage_of[e.src] != stage_of[e.dst])
    return nx.dag_longest_path_length(g)


def brute_force_simulated(problem):
    """(best objective, its simulated period, best simulated period) over every convex split that fits."""
    best_obj, best_obj_sim, best_sim = float("inf"), None, float("inf")
    for stages in convex_splits(problem):
        plan = Plan("bf", problem.num_gpus, [Stage(k, k, s) for k, s in enumerate(stages)])
        cost = evaluate(problem, plan)
        if not cost.feasible:
            continue
        period = simulate(problem, plan).period_ms
        if cost.objective_ms < best_obj - 1e-12 or (abs(cost.objective_ms - best_obj) <= 1e-12 and period < best_obj_sim):
            best_obj, best_obj_sim = cost.objective_ms, period
        best_sim = min(best_sim, period)
    return best_obj, best_obj_sim, best_sim


@pytest.mark.parametrize("seed,gpus,blocks", [(0, 2, 2), (1, 2, 2), (2, 2, 2), (0, 3, 1), (3, 3, 1)])
def test_chosen_plan_simulates_within_3_percent_of_its_objective_where_a_convex_split_does(seed, gpus, blocks):
    """Without tied weights, where brute force finds the optimal convex split simulating within
    3% of its objective, compile's chosen plan does too, and simulates no slower than the
    fastest convex split in simulation."""
    problem = branchy_problem(seed, gpus=gpus, blocks=blocks)
    best_obj, best_obj_sim, best_sim = brute_force_simulated(problem)
    if best_obj_sim > 1.03 * best_obj:
        pytest.skip("no optimal convex split simulates within 3% of its objective on this DAG")
    result = compile_plan(problem, STRATEGIES, jobs=1, time_limit=5)
    chosen = result.best()
    assert chosen.sim["period_ms"] <= 1.03 * chosen.cost.objective_ms
    # no slower than the fastest convex split, or within 1 % of it with less stale weights
    assert chosen.sim["period_ms"] <= best_sim * (1 + 1e-9) or (
        chosen.sim["period_ms"] < best_sim / 0.99 and result.info.get("chosen_why"))


@pytest.mark.parametrize("seed", [0, 1])
def test_tied_weights_wait_only_where_the_schedule_does_not_lag_them(seed):
    """With a tied tensor read at both ends of the DAG, each holder's update waits for the
    other's gradient of the step unless the schedule lags the tensor (async does; with clipping
    nothing lags, as every update waits for the global norm anyway). Clipped, even the fastest
    convex split in brute force simulates well above its objective (the wait Eq. 1 does not
    count); lagged, the optimal split simulates within 3% of it, and compile's choice no slower
    than the fastest split."""
    problem = branchy_problem(seed, gpus=2, tied=True)
    assert problem.shared_lag == 1
    clipped = replace(problem, clip_grad_norm=1.0)
    c_obj, _c_obj_sim, c_sim = brute_force_simulated(clipped)
    assert c_sim > 1.03 * c_obj
    best_obj, best_obj_sim, best_sim = brute_force_simulated(problem)
    assert best_obj_sim <= 1.03 * best_obj
    result = compile_plan(problem, STRATEGIES, jobs=1, time_limit=5)
    assert result.best().sim["period_ms"] <= best_sim * (1 + 1e-9)


def test_seq_returns_the_convex_optimum_and_compile_adds_its_faster_split_as_seq_sim():
    """On this DAG under 1f1b the optimal convex split is not the fastest in simulation. seq
    returns the optimum (what its bound proves), and compile prices the faster split it found as
    the row ``seq-sim`` and chooses it: brute force over every convex split gives both figures."""
    problem = branchy_problem(4, blocks=2, gpus=3, schedule="1f1b")
    best_obj, best_obj_sim, best_sim = brute_force_simulated(problem)
    assert best_sim < best_obj_sim * (1 - 1e-3)         # the case this test is about
    result = compile_plan(problem, "seq", jobs=1, time_limit=5)
    rows = {r.name: r for r in result.results}
    seq, alt = rows["seq"], rows["seq-sim"]
    assert seq.cost.objective_ms == pytest.approx(best_obj, rel=1e-9)
    assert seq.plan.info["optimal"] and seq.plan.info["simulated_alternative"]["row"] == "seq-sim"
    assert "stages" not in seq.plan.info["simulated_alternative"]      # the plan itself is the row's
    assert alt.sim["period_ms"] < seq.sim["period_ms"] and alt.cost.objective_ms > seq.cost.objective_ms
    assert alt.sim["period_ms"] >= best_sim * (1 - 1e-9)                # a convex split, as brute force sees
    assert len({s.gpu for s in alt.plan.stages}) == len(alt.plan.stages)
    assert alt.bound == seq.bound                                       # seq's bound covers its own splits
    assert result.chosen == "seq-sim"
    assert result.best().plan.info["alternative_of"] == "seq"


def test_mixed_sim_is_a_strategy_with_the_same_stage_cap_as_mixed():
    """``mixed-sim`` alone returns Mixed-pipe's fastest plan in simulation, under the cap 2bw puts on
    the pipeline's depth (M + 1 stages), as ``mixed`` does."""
    from ftcompile.partition.base import run_strategy

    problem = branchy_problem(0, gpus=6, schedule="2bw", micro_batches=6)
    fast = run_strategy("mixed-sim", problem, time_budget_s=2)
    low = run_strategy("mixed", problem, time_budget_s=2)
    assert len(fast.stages) <= 7 and len(low.stages) <= 7
    assert fast.info["simulated_period_ms"] == pytest.approx(simulate(problem, fast).period_ms, rel=1e-6)
    # within one search, the alternative mixed notes is faster than the plan it returns
    alt = low.info.get("simulated_alternative")
    if alt:
        assert alt["simulated_period_ms"] < simulate(problem, low).period_ms


def test_simulated_choice_stops_simulating_at_its_time_limit_once_a_plan_fits():
    from ftcompile.partition.base import simulated_choice

    problem = branchy_problem(1, gpus=3)
    finals = []
    for split in convex_splits(problem):
        plan = Plan("t", 3, [Stage(i, i, sorted(ns)) for i, ns in enumerate(split)])
        cost = evaluate(problem, plan)
        if cost.feasible:
            finals.append((cost.objective_ms, plan))
        if len(finals) == 6:
            break
    finals.sort(key=lambda f: (f[0], len(f[1].stages)))
    # No time: the lowest objective alone is simulated (it fits), the rest are counted as skipped.
    lowest, fastest = simulated_choice(problem, [(o, Plan(p.strategy, 3, p.stages)) for o, p in finals], 6,
                                       time_limit=0.0)
    assert lowest is fastest and lowest.info["simulated_skipped"] == 5
    assert len(lowest.info["simulated_candidates"]) == 1
    assert lowest.info["simulated_period_ms"] == pytest.approx(simulate(problem, lowest).period_ms)
    # Time enough: all six simulated, and the fastest is the loop's own fastest.
    lowest, fastest = simulated_choice(problem, finals, 6, time_limit=600.0)
    assert "simulated_skipped" not in fastest.info
    assert len(fastest.info["simulated_candidates"]) == len({tuple(map(tuple, (s.nodes for s in p.stages)))
                                                             for _, p in finals})
    periods = {id(p): simulate(problem, p).period_ms for _, p in finals}
    assert periods[id(fastest)] == pytest.approx(min(periods.values()))


@pytest.mark.parametrize("strategies,jobs", [("seq", 1), ("seq,uniform", 2)])
def test_compile_simulates_each_plan_once_and_its_rows_match_a_fresh_simulation(strategies, jobs, monkeypatch,
                                                                                   tmp_path):
    """seq's choice among its candidates, compile's row (and the ``seq-sim`` row of the
    alternative it notes) and the report's timeline share one replay per plan: no plan is
    simulated twice in this process, and every row's figures equal a fresh simulation of its
    plan (so what was reused is what a replay of that plan gives). With jobs=2 the strategies
    run in worker processes: their simulations cross with the plans, and the parent simulates
    nothing again."""
    import ftcompile.simulate as simulate_module
    from ftcompile.compile import plan_document, write_report
    from ftcompile.plan import run_settings_key, simulation_key

    problem = branchy_problem(4, blocks=2, gpus=3, schedule="1f1b")    # seq notes seq-sim here
    calls: list[tuple] = []
    real = simulate_module.simulate

    def counting(pb, plan, **kw):
        calls.append(simulation_key(plan))
        return real(pb, plan, **kw)

    monkeypatch.setattr(simulate_module, "simulate", counting)
    result = compile_plan(problem, strategies, jobs=jobs, time_limit=5)
    write_report(str(tmp_path / "out"), plan_document(result), result)
    assert (tmp_path / "out" / "timeline.png").exists()
    assert len(calls) == len(set(calls)), "a plan was simulated twice"
    rows = {r.name: r for r in result.results if r.feasible}
    assert "seq-sim" in rows
    if jobs == 2:
        assert calls == []          # every row's replay came back from the workers
    else:
        assert calls
    monkeypatch.setattr(simulate_module, "simulate", real)
    for r in rows.values():
        assert (run_settings_key(problem), simulation_key(r.plan)) in r.plan.simulations
        fresh = simulate(problem, r.plan)
        assert r.sim["period_ms"] == pytest.approx(fresh.period_ms, rel=1e-12)
        assert r.sim["gpu_peak_memory"] == fresh.gpu_peak_memory
        assert "simulations" not in r.plan.to_json()
    json.dumps(plan_document(result))       # (plan.json never carries the replays)


def test_simulation_of_replays_a_plan_once_per_stage_numbering():
    """simulation_of keeps one replay per plan as numbered: the same plan again is the same
    result; a copy sharing the replays under another strategy's name gets its own label; the
    same stages numbered otherwise (the ids set the engine's order) are replayed anew, as a
    fresh simulate() of that numbering gives; so is the same plan on another cluster or with
    other run settings, never read from the first problem's replay."""
    from dataclasses import replace

    from ftcompile.plan import run_settings_key, simulation_key
    from ftcompile.simulate import simulation_of

    problem = branchy_problem(0, gpus=3)
    plan = Plan("t", 3, [Stage(i, i, sorted(ns)) for i, ns in enumerate(next(iter(convex_splits(problem))))])
    first = simulation_of(problem, plan)
    assert simulation_of(problem, plan) is first
    assert list(plan.simulations) == [(run_settings_key(problem), simulation_key(plan))]
    # an equal problem (a copy, as a worker process holds) reads the same replay
    assert simulation_of(replace(problem), plan) is first
    for other_pb in (replace(problem, micro_batches=problem.micro_batches + 4),
                     replace(problem, cluster=replace(problem.cluster, gpu_memory=problem.cluster.gpu_memory // 1000)),
                     replace(problem, schedule="gpipe")):
        got = simulation_of(other_pb, plan)
        fresh = simulate(other_pb, plan)
        assert got is not first
        assert got.minibatch_ms == fresh.minibatch_ms and got.memory_feasible == fresh.memory_feasible
    assert simulation_of(replace(problem, cluster=replace(problem.cluster, gpu_memory=1)), plan).memory_feasible is False
    assert first.memory_feasible
    plan.simulations.clear()
    assert simulation_of(problem, plan).period_ms == first.period_ms
    other = simulation_of(problem, Plan("mixed", 3, plan.stages, {}, plan.simulations))
    assert other.strategy == "mixed" and other.period_ms == first.period_ms and first.strategy == "t"
    renumbered = Plan("t", 3, [Stage(2 - s.id, s.gpu, s.nodes) for s in plan.stages], {}, plan.simulations)
    again = simulation_of(problem, renumbered)
    assert again is not first and len(plan.simulations) == 2
    assert again.period_ms == simulate(problem, renumbered).period_ms
    assert "simulations" not in plan.to_json()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fastest_plans_that_stack_stages_are_ranked_at_the_probe_scale_too(seed):
    """Compile tunes the in-flight scale of a strategy's fastest plan only, so the candidates are
    ranked as they will run: the few fastest whose GPUs hold several stages are simulated again
    at the probe scale, and ranked by the shorter period. Checked by a loop of the test's own over
    plans that put stage k on GPU k mod P (several stages per GPU), each simulated afresh."""
    from ftcompile.partition.base import PROBE_SCALE, PROBE_TOP, PROBE_WITHIN, simulated_choice

    problem = branchy_problem(seed, blocks=3, gpus=2)
    four = branchy_problem(seed, blocks=3, gpus=4)          # the same DAG, split in four
    assert four.graph.content_hash() == problem.graph.content_hash()
    finals, seen = [], set()
    for split in convex_splits(four):
        if len(split) != 4:
            continue
        plan = Plan("t", 2, [Stage(i, i % 2, sorted(ns)) for i, ns in enumerate(split)])
        cost = evaluate(problem, plan)
        key = tuple(tuple(sorted(ns)) for ns in split)
        if cost.feasible and key not in seen:
            seen.add(key)
            finals.append((cost.objective_ms, plan))
        if len(finals) == 8:
            break
    assert len(finals) == 8
    _, fastest = simulated_choice(problem, finals, len(finals), time_limit=600.0)
    at = {1: {}, PROBE_SCALE: {}}
    for _, plan in finals:
        for scale in at:
            at[scale][id(plan)] = simulate(replace(problem, in_flight_scale=scale), plan).period_ms
    by_period = sorted(finals, key=lambda f: (at[1][id(f[1])], f[0]))
    shortest = at[1][id(by_period[0][1])]
    # (every plan here holds two stages on each GPU: all stack stages)
    probed = [p for _, p in by_period if at[1][id(p)] <= shortest * (1 + PROBE_WITHIN)][:PROBE_TOP]
    assert len(probed) >= 2        # (the case checks a choice, not one plan)
    for _, plan in finals:
        if any(plan is p for p in probed):
            assert plan.info["simulated_probe"]["period_ms"] == pytest.approx(at[PROBE_SCALE][id(plan)], rel=1e-6)
        else:
            assert "simulated_probe" not in plan.info

    def ranked(f):
        plan = f[1]
        period = at[1][id(plan)]
        if any(plan is p for p in probed):
            period = min(period, at[PROBE_SCALE][id(plan)])
        return (period, f[0])

    mine = next(f for f in finals if f[1] is fastest)
    assert ranked(mine) == pytest.approx(min(ranked(f) for f in finals), rel=1e-9)


def test_the_alternative_is_compared_as_it_was_ranked_with_its_probe():
    """A fastest plan chosen for its period at the probe scale (28 against the lowest plan's 30)
    is noted as the alternative although its period at the problem's scale (31) is longer; the
    same plan without that probe, or with a probe whose run did not fit, is not."""
    from ftcompile.partition.base import PROBE_SCALE, with_alternative

    problem = branchy_problem(0, gpus=2)
    ids = [n.id for n in problem.graph.op_nodes()]

    def plan(cut, period, probe=None):
        p = Plan("t", 2, [Stage(0, 0, ids[:cut]), Stage(1, 1, ids[cut:])])
        p.info.update(simulated_period_ms=period, simulated_memory_fits=True)
        if probe is not None:
            p.info["simulated_probe"] = probe
        return p

    fast = {"scale": PROBE_SCALE, "fits": True, "period_ms": 28.0}
    noted = with_alternative(plan(3, 30.0), plan(5, 31.0, fast)).info["simulated_alternative"]
    assert noted["simulated_period_ms"] == 31.0 and noted["simulated_probe"] == fast
    assert "simulated_alternative" not in with_alternative(plan(3, 30.0), plan(5, 31.0)).info
    over = dict(fast, fits=False)
    assert "simulated_alternative" not in with_alternative(plan(3, 30.0), plan(5, 31.0, over)).info
