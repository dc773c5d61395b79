"""Schedules: the one definition of task orders, weight versions and what a stage holds.

The closed-form versions are checked against the orders themselves (counting updates), the
memory figures against an independent replay of each order, and program generation against
the step count (a million steps cost no more memory than one).
"""

from __future__ import annotations

import tracemalloc

import pytest

from ftcompile.runtime.schedules import (
    SCHEDULES, ScheduleError, StageProgram, Task, check_program, flow_control, groups_2gw, needs_version,
    stage_program, stage_programs,
)


def _programs():
    for sched in SCHEDULES:
        for depth in range(6):
            for M in range(1, 6):
                for steps in (1, 2, 5):
                    for group in (0, 1):
                        for rc in (False, True):
                            for scale in (1, 2, 3):
                                try:
                                    yield stage_program(sched, 0, depth=depth, micro_batches=M, steps=steps,
                                                        group=group, recompute=rc, in_flight_scale=scale)
                                except ScheduleError:
                                    pass


def test_closed_form_versions_agree_with_the_orders():
    n = 0
    for p in _programs():
        check_program(p)                         # counts the updates before every task
        tasks = list(p.tasks())
        ks = sorted(t.index for t in tasks if t.kind == "F")
        assert ks == list(range(p.num_micro_batches)) == sorted(t.index for t in tasks if t.kind == "B")
        assert [t.index for t in tasks if t.kind == "U"] == list(range(p.steps))
        pos = {t: i for i, t in enumerate(tasks)}
        assert all(pos[Task("F", k)] < pos[Task("B", k)] for k in ks)
        n += 1
    assert n > 500


def test_weight_versions_of_every_schedule():
    M, K = 4, 3
    for sched in ("gpipe", "1f1b"):
        p = stage_program(sched, 0, depth=2, micro_batches=M, steps=K)
        assert all(p.forward_version(k) == p.backward_version(k) == k // M for k in range(M * K))
        assert [t.kind for t in p.tasks()].count("U") == K
    # async: the last stage is never stale and never recomputes; once the pipeline is full a
    # stage of depth d with M = 1 takes d updates between a forward and its backward, which
    # recomputes with the newest weights (PipeDream's staleness, without stashing).
    last = stage_program("async", 1, depth=0, micro_batches=1, steps=6)
    assert not last.recompute and all(last.staleness(k) == 0 for k in range(6))
    mid = stage_program("async", 0, depth=2, micro_batches=1, steps=6)
    assert mid.recompute
    assert [mid.staleness(k) for k in range(6)] == [0, 1, 2, 2, 2, 2]
    assert [mid.forward_version(k) for k in range(6)] == [0, 0, 0, 1, 2, 3]
    # pipedream stashes: backward uses the forward's version
    pd = stage_program("pipedream", 0, depth=2, micro_batches=1, steps=6)
    assert not pd.recompute and all(pd.forward_version(k) == pd.backward_version(k) for k in range(6))
    assert pd.forward_version(5) == 3
    # 2bw: one step of delay everywhere
    bw = stage_program("2bw", 0, depth=2, micro_batches=M, steps=K)
    assert [bw.forward_version(k) for k in range(0, M * K, M)] == [0, 0, 1]
    # 2gw: G0 one step late (its next step's forwards precede this step's backwards), G1 never
    g0 = stage_program("2gw", 0, depth=3, micro_batches=M, steps=K, group=0)
    g1 = stage_program("2gw", 1, depth=1, micro_batches=M, steps=K, group=1)
    assert [g0.forward_version(k) for k in range(0, M * K, M)] == [0, 0, 1]
    assert [g1.forward_version(k) for k in range(0, M * K, M)] == [0, 1, 2]
    pos = {t: i for i, t in enumerate(g0.tasks())}
    assert pos[Task("F", M)] < pos[Task("B", 0)]
    assert groups_2gw({0: 3, 1: 2, 2: 1, 3: 0}) == {0: 0, 1: 0, 2: 1, 3: 1}


def _replay_in_flight(p: StageProgram) -> int:
    live = peak = 0
    for t in p.tasks():
        live += {"F": 1, "B": -1, "U": 0}[t.kind]
        peak = max(peak, live)
    return peak


def _replay_versions_held(p: StageProgram) -> int:
    """Extra weight copies, counted from the versions the remaining tasks use (an independent
    brute force over the whole order: a version is held from the update that replaces it until
    the last task that uses it; a forward kept across an update holds a copy until its backward)."""
    tasks = list(p.tasks())
    last_use: dict[int, int] = {}
    for i, t in enumerate(tasks):
        if t.kind == "F":
            last_use[p.forward_version(t.index)] = i
        elif t.kind == "B":
            last_use[p.backward_version(t.index)] = i
    live, peak = 0, 0
    copies: dict[int, tuple[int, int]] = {}      # micro-batch -> (version, index of its B)
    b_at = {t.index: i for i, t in enumerate(tasks) if t.kind == "B"}
    for i, t in enumerate(tasks):
        if t.kind == "U":
            live += 1
        elif t.kind == "F" and not p.recompute and p.spans_update(t.index) and p.forward_version(t.index) == live:
            copies[t.index] = (live, b_at[t.index])
        held = {v for v, last in last_use.items() if v < live and last > i}
        held |= {v for v, end in copies.values() if end > i and v != live}
        # a copy whose version is still live at this point also costs a copy
        held_copies = {v for v, end in copies.values() if end > i and v == live}
        peak = max(peak, len(held) + len(held_copies))
    return peak


@pytest.mark.parametrize("sched", SCHEDULES)
def test_memory_figures_are_what_the_orders_hold(sched):
    for depth in range(5):
        for M in (1, 2, 4, 6):
            for rc in (False, True):
                for group in (0, 1):
                    for scale in (1, 3):
                        try:
                            p = stage_program(sched, 0, depth=depth, micro_batches=M, recompute=rc, group=group,
                                              steps=(2 * scale * depth + 2) // M + 6, in_flight_scale=scale)
                        except ScheduleError:
                            continue
                        assert p.in_flight == _replay_in_flight(p), (depth, M, rc, group, scale)
                        assert p.extra_weight_versions == _replay_versions_held(p), (depth, M, rc, group, scale)


def test_in_flight_of_the_classic_schedules():
    for depth in range(4):
        assert stage_program("1f1b", 0, depth=depth, micro_batches=8, steps=2).in_flight == depth + 1
        assert stage_program("gpipe", 0, depth=depth, micro_batches=8, steps=2).in_flight == 8
        assert stage_program("async", 0, depth=depth, micro_batches=2, steps=3).in_flight == depth + 1
    # pipedream with an update per micro-batch stashes depth versions (WPipe Table 1: N - i), and
    # here the newest forward also runs on a copy, since the update must not change the tensors its
    # autograd graph saved: d + 1 copies beside the live weights
    assert [stage_program("pipedream", 0, depth=d, micro_batches=1, steps=12).extra_weight_versions
            for d in range(4)] == [0, 2, 3, 4]
    # 2bw: one shadow version; keeping activations also costs the copy the newest forwards run on
    assert stage_program("2bw", 0, depth=3, micro_batches=4, steps=4, recompute=True).extra_weight_versions == 1
    assert stage_program("2bw", 0, depth=3, micro_batches=4, steps=4).extra_weight_versions == 2


def test_the_in_flight_scale_stretches_the_warm_up_of_the_continuous_schedules_only():
    """``s * depth + 1`` forwards before the first backward, counted from the order itself; the
    staleness grows with it; the flush schedules and the last stage are untouched."""
    for sched in ("async", "pipedream", "2bw"):
        for depth in range(4):
            for s in (1, 2, 3):
                M = 16 if sched == "2bw" else 2
                p = stage_program(sched, 0, depth=depth, micro_batches=M, steps=8, in_flight_scale=s)
                tasks = list(p.tasks())
                warm = next(i for i, t in enumerate(tasks) if t.kind == "B")
                assert warm == s * depth + 1 == p.in_flight
                assert p.adjacent == (depth == 0)
    # async: micro-batch k's forward sees the updates closed before it; with M = 2 a stage of depth
    # 3 at scale 2 runs F(9) after B(2) only: one update, where scale 1 has run B(5) and three
    assert stage_program("async", 0, depth=3, micro_batches=2, steps=8, in_flight_scale=2).forward_version(9) == 1
    assert stage_program("async", 0, depth=3, micro_batches=2, steps=8).forward_version(9) == 3
    for sched in ("gpipe", "1f1b", "2gw", "avgpipe"):
        a = stage_program(sched, 0, depth=2, micro_batches=4, steps=3, in_flight_scale=3)
        assert list(a.tasks()) == list(stage_program(sched, 0, depth=2, micro_batches=4, steps=3).tasks())
    # 2bw keeps two versions only while M covers the stretched depth
    with pytest.raises(ScheduleError, match="in-flight scale 2"):
        stage_program("2bw", 0, depth=3, micro_batches=4, steps=2, in_flight_scale=2)
    with pytest.raises(ScheduleError, match="in-flight scale"):
        stage_program("async", 0, depth=3, micro_batches=4, steps=2, in_flight_scale=0)


def test_the_last_stage_rule_is_one_rule():
    """A stage recomputes only when its backward does not directly follow its forward."""
    for sched in ("async", "1f1b", "2bw"):
        end = stage_program(sched, 0, depth=0, micro_batches=4, steps=2, recompute=True)
        assert end.adjacent and not end.recompute
        mid = stage_program(sched, 0, depth=1, micro_batches=4, steps=2, recompute=True)
        assert not mid.adjacent and mid.recompute
    # gpipe holds all M micro-batches even at the end of the pipeline: recomputation pays there
    assert stage_program("gpipe", 0, depth=0, micro_batches=4, steps=2, recompute=True).recompute
    assert not stage_program("pipedream", 0, depth=2, micro_batches=4, steps=2, recompute=True).recompute


def test_double_buffered_schedules_need_enough_micro_batches():
    with pytest.raises(ScheduleError, match="--micro-batches"):
        stage_program("2bw", 0, depth=5, micro_batches=2, steps=2)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        stage_program("zb-h1", 0, depth=1, micro_batches=2, steps=2)


def test_a_million_steps_of_program_cost_no_memory():
    tracemalloc.start()
    try:
        progs = stage_programs("async", {0: 3, 1: 2, 2: 1, 3: 0}, micro_batches=4, steps=1_000_000)
        p = progs[0]
        it = p.tasks()
        base = tracemalloc.get_traced_memory()[0]
        n = 0
        for t in it:
            n += 1
            if n == 200_000:
                break
        assert p.forward_version(3_999_999) == p.updates_before_forward(3_999_999)
        assert needs_version(p, 999_998, 3_999_999, 3_999_990)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown


def test_flow_control_needs_credits_only_where_no_gradient_bounds_the_producer():
    edges = {(0, 1): True, (0, 3): False, (1, 2): True}
    fc = flow_control(edges, {0: 4, 1: 3, 2: 2})
    assert fc[(0, 1)] == (4, False)        # gradients come back: the schedule bounds it
    assert fc[(0, 3)] == (4, True)         # a mask read three stages on: credits
    assert flow_control(edges, {0: 4, 1: 3}, {(0, 1): 2})[(0, 1)] == (2, True)   # a tighter window


def test_advance_forward_spans_1f1b_to_all_forward_all_backward():
    """AvgPipe's schedule: with nothing forwarded in advance it is 1F1B, with M (or more) it is
    all-forward-all-backward (GPipe's order), and in between it holds that many more in flight."""
    for depth in range(4):
        for M in (1, 3, 6):
            one = [str(t) for t in stage_program("1f1b", 0, depth=depth, micro_batches=M, steps=3).tasks()]
            afab = [str(t) for t in stage_program("gpipe", 0, depth=depth, micro_batches=M, steps=3).tasks()]
            assert [str(t) for t in stage_program("avgpipe", 0, depth=depth, micro_batches=M, steps=3,
                                                  advance=0).tasks()] == one
            for a in (M, M + 2):
                assert [str(t) for t in stage_program("avgpipe", 0, depth=depth, micro_batches=M, steps=3,
                                                      advance=a).tasks()] == afab
            for a in range(M + 1):
                p = stage_program("avgpipe", 0, depth=depth, micro_batches=M, steps=3, advance=a)
                check_program(p)
                assert p.in_flight == min(M, depth + a + 1)
    # per step, as a tuner chooses it
    p = stage_program("avgpipe", 0, depth=0, micro_batches=4, steps=3, advance=4, advance_fn=lambda j: j)
    tasks = [str(t) for t in p.tasks()]
    assert tasks[:9] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "U0"]
    assert tasks[9:11] == ["F4", "F5"] and tasks[18:22] == ["F8", "F9", "F10", "B8"]
