"""Choosing the in-flight scale of a plan: how many micro-batches each stage keeps in flight.

The schedules without a flush (``async``, ``pipedream``, ``2bw``) run ``depth + 1``
forwards before a stage's first backward (FTPipe, PipeDream): about enough when each
GPU holds one stage, whose round trip through the stages downstream is ``depth + 1``
periods and the transfers. A plan whose GPUs hold many stages each (Mixed-pipe, exact in mixed space)
has a longer round trip: every hop of a micro-batch waits behind the other stages on
its GPU. By Little's law the pipeline runs at its balance (the objective) only when
the micro-batches in flight cover that round trip; with ``depth + 1`` such plans
simulate 5 to 20 % above their objective (benchmarks/README.md). More in flight closes
part of that gap, rarely all of it: more in flight also queues longer on each GPU
(InceptionV3's 134-stage plan: 1.116 of its objective at ``s = 1``, 1.042 at 6, 1.036 at 8).

The in-flight scale ``s`` (:attr:`ftcompile.plan.Problem.in_flight_scale`) stretches
every stage's warm-up to ``s * depth + 1`` forwards
(:attr:`ftcompile.runtime.schedules.StageProgram.in_flight_scale`); the cost model,
the simulator and the runtime all take it from the programs. More in flight costs
memory (inputs kept for recomputation, or stashes) and, under ``async`` and
``pipedream``, staler weights (``s * depth / M`` updates at the deepest stage). So
:func:`tune_in_flight` keeps a larger ``s`` only where its simulated period is at least
:data:`GAIN` shorter than the best smaller one's and the plan still fits, and tries it
only for plans where some GPU holds more than one stage. With one stage per GPU
only the transfers are left uncovered (gpt2-tiny's Mixed-pipe plan on 2 CPU workers,
one stage each: 1.2 % faster in simulation at ``s = 2``), not worth doubling the
staleness unasked; ``--in-flight-scale K`` asks for it. The period is not monotone in ``s`` (one of
tests/dags.py's plans simulates at 92.8 ms with ``s = 1`` and 109.8 with ``s = 2``: other
micro-batches meet on a GPU), so one try without gain does not end the search; two in a
row do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from .plan import Plan, PlanError, Problem, evaluate
from .runtime.schedules import CONTINUOUS, ScheduleError

#: The scales tried, in order.
SCALES = (1, 2, 3, 4, 6, 8)
#: A larger scale must shorten the simulated period by at least this share of the best smaller one's.
GAIN = 0.01
#: Tries in a row without that gain that end the search.
PATIENCE = 2


@dataclass
class InFlightTry:
    """One scale tried: its simulated period, and whether the plan fits under it (else why not)."""

    scale: int
    period_ms: float | None
    fits: bool
    reason: str | None = None

    def to_json(self) -> dict:
        return {"scale": self.scale, "period_ms": None if self.period_ms is None else round(self.period_ms, 6),
                "fits": self.fits, **({"reason": self.reason} if self.reason else {})}


@dataclass
class InFlightTuning:
    """The scales tried for one plan, and the one chosen (the first of the plan's problem when none was tried)."""

    chosen: int
    tries: list[InFlightTry] = field(default_factory=list)
    why: str = ""

    def to_json(self) -> dict:
        return {"chosen": self.chosen, "why": self.why, "tries": [t.to_json() for t in self.tries],
                "rule": f"scales {', '.join(map(str, SCALES))} in turn; a larger one is kept where it simulates at "
                        f"least {GAIN:.0%} faster than the best smaller one and fits; the search ends where the plan "
                        f"does not fit, reaches its objective, or {PATIENCE} tries in a row gain less; only for "
                        "plans where a GPU holds several stages; a scale already replayed on the plan is read "
                        "whatever the time limit and the tries without gain"}


def stacks_stages(plan: Plan) -> bool:
    """Whether some GPU of ``plan`` holds more than one stage."""
    gpus = [s.gpu for s in plan.stages]
    return len(set(gpus)) < len(gpus)


def tune_in_flight(problem: Problem, plan: Plan, *, scales: tuple[int, ...] = SCALES,
                   gain: float = GAIN, time_limit: float | None = None) -> InFlightTuning:
    """The in-flight scale for ``plan`` on ``problem``, chosen by simulation.

    Tries ``scales`` in order from ``problem.in_flight_scale`` on: a scale becomes the best
    where the plan fits under it (the cost model's memory and the simulated peak) and its
    simulated period is at least ``gain`` shorter than the best so far. The search ends at
    the first scale that does not fit (more in flight only holds more), once the period is
    the plan's objective (the most any GPU works per micro-batch: no scale does better), or
    after :data:`PATIENCE` tries in a row without that gain. ``time_limit``: no scale is tried
    once this many seconds have passed, so the last one tried may end past them by one replay
    (half a minute for a plan of 255 stages). That is deliberate: the plans that need a larger
    scale are the ones of many stages, whose replays are the long ones, and the scale is worth
    more than the seconds (the held-out BERT-3 operator graph on 6 GPUs at 1.2 x: its 75-stage
    plan, about 7 s a replay here, simulates at 1.212 of its objective at scale 1 and at 1.097 at
    scale 3; under a 10 s limit that no replay may cross, the tuning would stop at scale 2).
    A scale whose replay is already kept on the plan (``plan.simulations``: the strategy's probe,
    :func:`~ftcompile.partition.base.simulated_choice`) costs no replay (only its pricing, about a
    sixth of one), so it is read whatever the
    time limit and the patience say: a plan chosen for its period at scale 4 is not run at 2
    because the 2 took the time (BERT-12's held-out operator graph on 6 GPUs at 1.2 x: a
    249-stage plan ranked at 427.4 ms at scale 4, tuned to 2 at 433.9 with scale 3 cut by the
    20 s limit). Schedules the scale does not touch, and plans with one stage per GPU, keep the
    problem's scale untried.
    """
    from .simulate import kept_simulation, simulation_of

    start = problem.in_flight_scale
    if problem.schedule not in CONTINUOUS:
        return InFlightTuning(start, why=f"{problem.schedule} has a flush per step: its warm-up is not stretched")
    if not stacks_stages(plan):
        return InFlightTuning(start, why="one stage per GPU: depth + 1 in flight covers the round trip "
                                         "but for the transfers")
    tries: list[InFlightTry] = []
    best: InFlightTry | None = None
    idle = 0
    cut: list[int] = []     # the scales not tried for the time limit
    patient = True          # False once PATIENCE tries in a row gained too little: only kept replays are read
    t0 = time.perf_counter()
    for s in [start] + [k for k in scales if k > start]:
        pb = replace(problem, in_flight_scale=s)
        kept = kept_simulation(pb, plan) is not None
        if not kept and not patient:
            continue
        if not kept and tries and time_limit is not None and time.perf_counter() - t0 >= time_limit:
            cut.append(s)
            continue
        try:
            cost = evaluate(pb, plan)
            if not cost.feasible:
                tries.append(InFlightTry(s, None, False, cost.reason))
                break
            sim = simulation_of(pb, plan)
        except (ScheduleError, PlanError) as exc:     # 2bw: M below the stretched depth
            tries.append(InFlightTry(s, None, False, str(exc)))
            break
        t = InFlightTry(s, sim.period_ms, sim.memory_feasible,
                        None if sim.memory_feasible else "the simulated peak exceeds a GPU's memory")
        tries.append(t)
        if not t.fits:
            break
        if best is None or t.period_ms < best.period_ms * (1 - gain):
            best, idle = t, 0
        else:
            idle += 1
        if best.period_ms <= cost.objective_ms * (1 + 1e-9):
            break
        patient = patient and idle < PATIENCE
    if best is None:
        return InFlightTuning(start, tries, why=f"the plan does not fit at scale {start}")
    first = tries[0]
    unasked = (f"scale{'s' if len(cut) > 1 else ''} {', '.join(map(str, cut))} not tried: the {time_limit:g} s "
               "limit (--time-limit) had passed" if cut else "")
    if best.scale != first.scale:
        why = (f"{best.scale} x depth + 1 in flight simulates at {best.period_ms:.4g} ms per micro-batch against "
               f"{first.period_ms:.4g} at {first.scale}" + (f"; {unasked}" if unasked else ""))
    elif len(tries) == 1 and unasked:
        why = unasked
    else:
        why = f"no larger scale tried shortens the simulated period by {gain:.0%} and fits" + \
            (f"; {unasked}" if unasked else "")
    return InFlightTuning(best.scale, tries, why)
