"""The in-flight scale chosen by simulation (ftcompile.inflight) and carried by compile.

A plan whose GPUs hold several stages each needs more micro-batches in flight than
``depth + 1`` to run at its balance. The references here are fresh simulations of the
plan at each scale (``simulate``, not the replays the tuning keeps on the plan) and the
plan's objective (the most any GPU works per micro-batch), which no period can beat.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dags import branchy_problem, with_memory
from ftcompile.compile import compile_plan, plan_document
from ftcompile.inflight import GAIN, stacks_stages, tune_in_flight
from ftcompile.plan import Plan, Stage, evaluate, ordered
from ftcompile.simulate import simulate


def _round_robin(problem, stages: int) -> Plan:
    """The op nodes in graph order cut into ``stages`` chunks, chunk i on GPU i mod P: every GPU holds
    several stages, and a micro-batch's round trip crosses every GPU many times."""
    ops = [n.id for n in problem.graph.op_nodes()]
    size = -(-len(ops) // stages)
    chunks = [ops[i:i + size] for i in range(0, len(ops), size)]
    P = problem.num_gpus
    return ordered(Plan("round-robin", P, [Stage(i, i % P, c) for i, c in enumerate(chunks)]), problem.graph)


@pytest.fixture(scope="module")
def stacked():
    problem = branchy_problem(2, blocks=8, gpus=4)
    return problem, _round_robin(problem, 16)


def test_tuning_keeps_a_scale_only_for_a_simulated_gain(stacked):
    problem, plan = stacked
    assert stacks_stages(plan)
    tuning = tune_in_flight(problem, plan)
    fresh = {t.scale: simulate(replace(problem, in_flight_scale=t.scale), plan).period_ms for t in tuning.tries}
    assert [t.period_ms for t in tuning.tries] == pytest.approx([fresh[t.scale] for t in tuning.tries], rel=1e-12)
    assert tuning.tries[0].scale == 1 and tuning.chosen > 1
    objective = evaluate(problem, plan).objective_ms
    # the chosen scale simulates at least GAIN faster than every smaller one tried, never below the objective
    chosen = fresh[tuning.chosen]
    assert all(chosen <= fresh[s] * (1 - GAIN) for s in fresh if s < tuning.chosen)
    assert chosen >= objective * (1 - 1e-9)
    # and no larger scale tried gains GAIN on it
    assert all(fresh[s] > chosen * (1 - GAIN) for s in fresh if s > tuning.chosen)
    assert tuning.to_json()["chosen"] == tuning.chosen


def test_tuning_stops_where_more_in_flight_does_not_fit(stacked):
    """Memory between what the plan needs at scale 1 and at the scale tuning chose: that scale is
    refused by name, and a smaller one is kept."""
    problem, plan = stacked
    k = tune_in_flight(problem, plan).chosen
    need = {s: evaluate(replace(problem, in_flight_scale=s), plan).max_memory_bytes for s in (1, k)}
    assert need[1] < need[k]     # async keeps every micro-batch in flight's inputs for recomputation
    tight = with_memory(problem, (need[1] + need[k]) // 2)
    tuning = tune_in_flight(tight, plan)
    assert tuning.chosen < k
    assert not tuning.tries[-1].fits and tuning.tries[-1].reason
    assert all(t.fits for t in tuning.tries[:-1])


def test_no_tuning_where_the_scale_cannot_help(stacked):
    problem, plan = stacked
    # one stage per GPU: depth + 1 covers the round trip (but for the transfers): not tuned
    single = _round_robin(problem, problem.num_gpus)
    assert not stacks_stages(single) and tune_in_flight(problem, single).tries == []
    # a schedule with a flush has no warm-up to stretch
    flush = replace(problem, schedule="1f1b")
    assert tune_in_flight(flush, plan).tries == [] and tune_in_flight(flush, plan).chosen == 1
    # an explicit scale is where the search starts
    assert tune_in_flight(replace(problem, in_flight_scale=3), plan).tries[0].scale == 3


def test_compile_prices_each_stacked_plan_at_its_scale_and_records_the_chosen_one():
    problem = branchy_problem(0, blocks=4, gpus=3)
    result = compile_plan(problem, ["seq", "mixed"], jobs=1, time_limit=5)
    rows = {r.name: r for r in result.results if r.feasible}
    assert rows["seq"].in_flight_scale == 1 and rows["seq"].in_flight is None     # one stage per GPU
    mixed = rows["mixed"]
    assert stacks_stages(mixed.plan) and mixed.in_flight["tries"][0]["scale"] == 1
    # the row's figures are the plan's at its scale: a fresh simulation agrees
    at = replace(problem, in_flight_scale=mixed.in_flight_scale)
    assert mixed.sim["period_ms"] == pytest.approx(simulate(at, mixed.plan).period_ms, rel=1e-12)
    best = result.best()
    assert result.problem.in_flight_scale == best.in_flight_scale
    doc = plan_document(result, model={"name": "branchy"})
    assert doc["in_flight_scale"] == best.in_flight_scale
    assert doc["simulation"]["period_ms"] == pytest.approx(simulate(result.problem, best.plan).period_ms, rel=1e-12)
    # without tuning every row is priced at the problem's scale
    plain = compile_plan(problem, ["mixed"], jobs=1, time_limit=5, tune_in_flight=False)
    assert all(r.in_flight_scale == 1 and r.in_flight is None for r in plain.results if r.feasible)


def test_2bw_plans_stay_within_the_depth_its_scale_allows():
    """2bw keeps two weight versions only while M covers s x depth: the strategies are capped at
    M // s + 1 stages, so they search shallower plans instead of failing at the schedule."""
    from ftcompile.partition import run_strategy
    from ftcompile.runtime.schedules import ScheduleError, stage_program

    problem = replace(branchy_problem(0, blocks=4, gpus=4, schedule="2bw"), micro_batches=4, in_flight_scale=2)
    plan = run_strategy("mixed", problem, time_budget_s=3)
    assert len(plan.stages) <= 4 // 2 + 1
    assert evaluate(problem, plan).feasible
    with pytest.raises(ScheduleError, match="lower --in-flight-scale"):
        stage_program("2bw", 0, depth=3, micro_batches=4, steps=1, in_flight_scale=2)


def test_a_bad_scale_is_refused_by_name():
    from ftcompile.plan import PlanError, Problem

    problem = branchy_problem(0)
    for bad in (0, 2.5, True, "2"):
        with pytest.raises(PlanError, match="in-flight scale"):
            Problem(problem.graph, problem.profile, problem.cluster, in_flight_scale=bad)


def _fresh(plan: Plan) -> Plan:
    """``plan`` without the replays kept on it (the module's fixture collects them test by test)."""
    return Plan(plan.strategy, plan.num_gpus, plan.stages, dict(plan.info))


def test_the_time_limit_ends_the_tuning_and_the_reason_says_so(stacked):
    """Once the limit has passed no further scale is tried (the last one tried may end past it:
    see tune_in_flight), and the reason names the scales left out and the limit. Without a
    limit the same plan tries several (the tests above)."""
    from ftcompile.inflight import SCALES

    problem, plan = stacked
    tuning = tune_in_flight(problem, _fresh(plan), time_limit=0)
    assert [t.scale for t in tuning.tries] == [1] and tuning.chosen == 1
    assert tuning.why == (f"scales {', '.join(str(s) for s in SCALES if s > 1)} not tried: "
                          "the 0 s limit (--time-limit) had passed")
    assert len(tune_in_flight(problem, _fresh(plan)).tries) > 1


def test_a_scale_already_replayed_is_read_past_the_time_limit_and_the_patience(stacked):
    """A replay kept on the plan (a strategy's probe at scale 4: simulated_choice) costs nothing, so
    the tuning reads it when the time limit has passed, or after PATIENCE tries without gain, and
    keeps it where it gains: a plan ranked by its period at scale 4 is run there, not at the last
    scale the time allowed. Each period is checked against a fresh simulate() at that scale."""
    from ftcompile.inflight import PATIENCE
    from ftcompile.simulate import simulation_of

    problem, plan = stacked
    at = {s: simulate(replace(problem, in_flight_scale=s), plan).period_ms for s in (1, 2, 3, 4)}
    assert at[4] < at[1] * (1 - GAIN)          # (the case: scale 4 gains over scale 1)
    probed = _fresh(plan)
    simulation_of(replace(problem, in_flight_scale=4), probed)      # (what the probe leaves on the plan)
    tuning = tune_in_flight(problem, probed, time_limit=0)
    assert [t.scale for t in tuning.tries] == [1, 4] and tuning.chosen == 4
    assert [t.period_ms for t in tuning.tries] == pytest.approx([at[1], at[4]], rel=1e-9)
    # (the search ends at a scale that reaches the objective: none does better)
    objective = evaluate(replace(problem, in_flight_scale=4), plan).objective_ms
    left_out = "2, 3" if at[4] <= objective * (1 + 1e-9) else "2, 3, 6, 8"
    assert tuning.why.endswith(f"scales {left_out} not tried: the 0 s limit (--time-limit) had passed")
    # past the patience: with the gain asked for out of reach, scales 2 and 3 gain nothing, which
    # ended the search before scale 4; the kept replay is still read (and gains nothing either)
    tuning = tune_in_flight(problem, probed, gain=0.99)
    assert PATIENCE == 2 and [t.scale for t in tuning.tries] == [1, 2, 3, 4] and tuning.chosen == 1
