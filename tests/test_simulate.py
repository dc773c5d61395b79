"""The pipeline simulator against the known formulas, on hand-built graphs with exact costs.

Every node multiplies its input by a weight of its own (of zero bytes), so gradients flow back
through every value, as in a real model; hardware "cpu" keeps no memory reserve.
"""

from __future__ import annotations

import pytest

from ftcompile.cluster import ClusterSpec
from ftcompile.ir import Edge, Instr, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta
from ftcompile.plan import Plan, Problem, Stage, evaluate
from ftcompile.profile import NodeCost, ParamCost, Profile
from ftcompile.simulate import simulate

FREE = 1e30          # bytes/s: communication takes no time


def make_graph(n: int, edges: list[tuple[int, int]] | None = None, *, numel: int = 1,
               dtype: str = "float32", weights: bool = True) -> OpGraph:
    """Op nodes 0..n-1 (node i makes value v{i} from its inputs and, with ``weights``, a weight w{i});
    a chain unless ``edges`` says otherwise."""
    edges = [(i, i + 1) for i in range(n - 1)] if edges is None else edges
    meta = ValueMeta(tensor=TensorMeta((numel,), dtype))
    ins_of = {i: [a for a, b in edges if b == i] for i in range(n)}
    nodes = []
    for i in range(n):
        args = [{"ref": f"v{a}"} for a in ins_of[i]] + ([{"param": f"w{i}"}] if weights else [])
        nodes.append(Node(id=i, name=f"n{i}", kind="op", instrs=[Instr(f"v{i}", "aten.mul.Tensor", args, out=meta)],
                          outputs={f"v{i}": meta}, params=[f"w{i}"] if weights else [], is_loss=(i == n - 1)))
    params = {f"w{i}": ParamInfo(f"w{i}", "parameter", TensorMeta((0,), "float32"), users=[i])
              for i in range(n)} if weights else {}
    return OpGraph(nodes=nodes, edges=[Edge(a, b, f"v{a}", meta) for a, b in edges], params=params)


def make_profile(costs: list[tuple[float, float, float]], activation_bytes: int = 100) -> Profile:
    """``costs[i] = (forward, backward, recompute)`` ms of node i."""
    nodes = {i: NodeCost(forward_ms=f, backward_ms=b, recompute_ms=r, activation_bytes=activation_bytes)
             for i, (f, b, r) in enumerate(costs)}
    return Profile(graph_hash="test", method="analytic", hardware={}, dtype="float32", batch_size=2,
                   optimizer="sgd", nodes=nodes, params={f"w{i}": ParamCost(0, 0, 0) for i in range(len(costs))})


def make_cluster(gpus: int, bandwidth: float = FREE) -> ClusterSpec:
    return ClusterSpec(name="test", nodes=1, gpus_per_node=gpus, gpu_memory=10**12,
                       intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
                       local_copy_bandwidth=FREE, hardware="cpu")


def one_per_gpu(n: int) -> Plan:
    return Plan("hand", n, [Stage(i, i, [i]) for i in range(n)])


def problem(graph, costs, gpus, schedule, M, bandwidth=FREE, recompute=None):
    return Problem(graph, make_profile(costs), make_cluster(gpus, bandwidth), schedule=schedule,
                   micro_batches=M, recompute=recompute)


@pytest.mark.parametrize("P,M", [(4, 8), (4, 4), (3, 1), (8, 16)])
def test_gpipe_bubble_fraction(P, M):
    pb = problem(make_graph(P), [(1.0, 1.0, 0.0)] * P, P, "gpipe", M)
    res = simulate(pb, one_per_gpu(P))
    assert res.bubble_fraction == pytest.approx((P - 1) / (M + P - 1), abs=1e-6)
    assert res.minibatch_ms == pytest.approx((M + P - 1) * 2.0, abs=1e-6)
    assert res.throughput_samples_per_s == pytest.approx(M * 2 / ((M + P - 1) * 2.0) * 1e3)


@pytest.mark.parametrize("P,M", [(4, 8), (4, 2), (5, 5)])
def test_in_flight_1f1b_vs_gpipe(P, M):
    costs = [(1.0, 2.0, 0.0)] * P
    r1 = simulate(problem(make_graph(P), costs, P, "1f1b", M), one_per_gpu(P))
    rg = simulate(problem(make_graph(P), costs, P, "gpipe", M), one_per_gpu(P))
    assert r1.stage_peak_in_flight == {i: min(M, P - i) for i in range(P)}
    assert rg.stage_peak_in_flight == {i: M for i in range(P)}
    # 100 activation bytes per micro-batch and stage: what is held follows in-flight counts, and the
    # peak adds the buffers and transients on top.
    assert [b["held"] for b in r1.gpu_peak_breakdown] == [100 * min(M, P - i) for i in range(P)]
    assert [b["held"] for b in rg.gpu_peak_breakdown] == [100 * M] * P
    assert all(p >= 100 * min(M, P - i) for i, p in enumerate(r1.gpu_peak_memory))


def test_async_throughput_is_max_stage_period():
    # Stages 0..2 recompute (F + R + B = 1 + 1 + 2); the last does not (F + B = 1 + 3): all periods 4.
    P = 4
    costs = [(1.0, 2.0, 1.0)] * (P - 1) + [(1.0, 3.0, 1.0)]
    for M in (1, 4, 8):
        pb = problem(make_graph(P), costs, P, "async", M)
        res = simulate(pb, one_per_gpu(P), steps=3)
        assert res.period_ms == pytest.approx(4.0, abs=1e-6)
        assert res.period_ms == pytest.approx(evaluate(pb, one_per_gpu(P)).objective_ms, abs=1e-6)
        assert res.throughput_samples_per_s == pytest.approx(2 / 4.0 * 1e3)
        assert res.bubble_fraction == pytest.approx(0.0, abs=1e-6)
        # FTPipe §4.3: every stage but the last recomputes.
        assert {e.stage for e in res.events if e.kind == "R"} == set(range(P - 1))


def test_async_unbalanced_bottleneck():
    costs = [(1.0, 1.0, 0.0), (2.0, 3.0, 0.0), (1.0, 1.0, 0.0)]
    pb = problem(make_graph(3), costs, 3, "pipedream", 4)
    res = simulate(pb, one_per_gpu(3), steps=3)
    assert res.period_ms == pytest.approx(5.0, abs=1e-6)
    assert res.gpu_utilisation[1] == pytest.approx(1.0, abs=1e-6)


def test_mixed_pipe_serialises_stages_on_one_gpu():
    # Stages 0 and 2 share GPU 0 (3 + 3 ms per micro-batch), stages 1 and 3 share GPU 1 (1.5 + 1.5).
    costs = [(1.0, 2.0, 0.0), (0.5, 1.0, 0.0), (1.0, 2.0, 0.0), (0.5, 1.0, 0.0)]
    plan = Plan("hand", 2, [Stage(0, 0, [0]), Stage(1, 1, [1]), Stage(2, 0, [2]), Stage(3, 1, [3])])
    pb = problem(make_graph(4), costs, 2, "pipedream", 4)
    res = simulate(pb, plan, steps=3)
    assert res.period_ms == pytest.approx(6.0, abs=1e-6)
    assert res.period_ms == pytest.approx(evaluate(pb, plan).objective_ms, abs=1e-6)
    assert res.gpu_utilisation[0] == pytest.approx(1.0, abs=1e-6)
    # Never two compute tasks at once on one GPU.
    for g in (0, 1):
        boxes = sorted((e.start, e.end) for e in res.events if e.gpu == g and e.kind != "send")
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(boxes, boxes[1:]))


def test_dataflow_waits_for_every_producer():
    # 0 -> {1, 2} -> 3; stage 2 is slow, so stage 3 waits for it, and stage 0's backward waits for both.
    graph = make_graph(4, edges=[(0, 1), (0, 2), (1, 3), (2, 3)])
    costs = [(1.0, 1.0, 0.0), (1.0, 1.0, 0.0), (5.0, 4.0, 0.0), (1.0, 1.0, 0.0)]
    pb = problem(graph, costs, 4, "gpipe", 1)
    res = simulate(pb, one_per_gpu(4), steps=1)
    ev = {(e.stage, e.kind, e.micro_batch): e for e in res.events if e.kind != "send"}
    assert ev[(3, "F", 0)].start == pytest.approx(ev[(2, "F", 0)].end)
    assert ev[(3, "F", 0)].start > ev[(1, "F", 0)].end
    assert ev[(0, "B", 0)].start == pytest.approx(max(ev[(1, "B", 0)].end, ev[(2, "B", 0)].end))
    assert ev[(0, "B", 0)].start == pytest.approx(ev[(2, "B", 0)].end)


def test_slow_communication_lowers_throughput_as_eq1():
    # One int64 value per micro-batch (no gradient): forward transfer 4 ms > compute 2 ms.
    graph = make_graph(2, numel=1000, dtype="int64")           # 8000 bytes
    costs = [(1.0, 1.0, 0.0), (1.0, 1.0, 0.0)]
    fast = simulate(problem(graph, costs, 2, "pipedream", 4), one_per_gpu(2), steps=3)
    pb = problem(graph, costs, 2, "pipedream", 4, bandwidth=8000 / 4e-3)
    slow = simulate(pb, one_per_gpu(2), steps=3)
    assert fast.period_ms == pytest.approx(2.0, abs=1e-6)
    assert slow.period_ms == pytest.approx(4.0, abs=1e-6)
    assert slow.period_ms == pytest.approx(evaluate(pb, one_per_gpu(2)).objective_ms, abs=1e-6)
    sends = [e for e in slow.events if e.kind == "send"]
    assert sends and all(e.gpu == 0 and e.dst_gpu == 1 and e.end - e.start == pytest.approx(4.0) for e in sends)


def test_float_values_send_gradients_back_on_the_other_link():
    # Float value: its gradient returns on link 1 -> 0, beside link 0 -> 1 (8 ms each way). With
    # depth + 1 = 2 micro-batches in flight on stage 0, the period is the round trip over 2:
    # (F0 + 8 + F1 + B1 + 8 + B0) / 2 = 10 ms, above Eq. 1 (2 + 6 = 8 per stage), which ignores that latency.
    graph = make_graph(2, numel=2000)                           # 8000 bytes of float32
    costs = [(1.0, 1.0, 0.0), (1.0, 1.0, 0.0)]
    pb = problem(graph, costs, 2, "pipedream", 4, bandwidth=8000 / 8e-3)
    res = simulate(pb, one_per_gpu(2), steps=3)
    assert res.period_ms == pytest.approx(10.0, abs=1e-6)
    assert evaluate(pb, one_per_gpu(2)).objective_ms == pytest.approx(8.0)
    assert {(e.gpu, e.dst_gpu) for e in res.events if e.kind == "send"} == {(0, 1), (1, 0)}


def test_2gw_fills_g1_flush_bubbles():
    # WPipe layout: GPU i hosts G0 stage i and G1 stage i + 2 (Fig. 4a).
    costs = [(1.0, 1.0, 0.0)] * 4
    plan = Plan("hand", 2, [Stage(0, 0, [0]), Stage(1, 1, [1]), Stage(2, 0, [2]), Stage(3, 1, [3])])
    flush = simulate(problem(make_graph(4), costs, 2, "1f1b", 4), plan, steps=3)
    wpipe = simulate(problem(make_graph(4), costs, 2, "2gw", 4), plan, steps=3)
    assert wpipe.bubble_fraction < flush.bubble_fraction / 2
    assert wpipe.period_ms < flush.period_ms
    assert wpipe.period_ms >= wpipe.max_load_ms - 1e-9
    # G0 stages run the next step's forwards before this step's backwards (2 M in flight); G1 stages
    # 1F1B's min(M, depth + 1).
    assert wpipe.stage_peak_in_flight == {0: 8, 1: 8, 2: 2, 3: 1}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "pipedream", "2bw", "2gw"])
def test_every_schedule_runs_every_task_once(schedule):
    P, M = 4, 4
    costs = [(1.0, 2.0, 0.5)] * P
    res = simulate(problem(make_graph(P), costs, P, schedule, M, recompute=True), one_per_gpu(P), steps=2)
    shown = 4 * M            # the events kept for the picture: the first four steps
    for s in range(P):
        for kind in ("F", "B"):
            ks = sorted(e.micro_batch for e in res.events if e.stage == s and e.kind == kind)
            assert ks == list(range(shown))
        assert sorted(e.micro_batch for e in res.events if e.stage == s and e.kind == "U") in ([], [0, 1, 2, 3])
        # Within a stage, F(k) < R(k) < B(k).
        ev = {(e.kind, e.micro_batch): e for e in res.events if e.stage == s and e.kind not in ("send", "U")}
        for k in range(shown):
            assert ev[("F", k)].end <= ev[("B", k)].start + 1e-9
            if ("R", k) in ev:
                assert ev[("F", k)].end <= ev[("R", k)].start <= ev[("B", k)].start + 1e-9
    assert 0.0 <= res.bubble_fraction < 1.0
    assert res.steady and res.period_ms >= res.max_load_ms - 1e-9
    assert res.to_json()["schedule"] == schedule


def test_pictures_are_written(tmp_path):
    from ftcompile.timeline import draw_timeline

    P = 8
    res = simulate(problem(make_graph(P), [(1.0, 2.0, 1.0)] * P, P, "async", 16, bandwidth=4e5), one_per_gpu(P),
                   steps=1)
    out = draw_timeline(res, tmp_path / "timeline.png")
    assert [p.suffix for p in out] == [".png", ".svg"]
    assert all(p.exists() and p.stat().st_size > 1000 for p in out)


@pytest.mark.parametrize("seed", range(8))
def test_mixed_pipe_period_is_steady_and_never_below_a_gpu_load(seed):
    """Stages scattered over GPUs finish micro-batches in bursts; the measured period must still
    be the steady state: never below the busiest GPU's compute per micro-batch (no GPU works
    faster than its load), and the same whether 1 or 40 mini-batches are measured."""
    import random

    rng = random.Random(seed)
    n, P = 12, 3
    costs = [(f, 2 * f, f) for f in (rng.uniform(0.5, 3.0) for _ in range(n))]
    gpus = [rng.randrange(P) for _ in range(n)]
    plan = Plan("scattered", P, [Stage(i, gpus[i], [i]) for i in range(n)])
    pb = problem(make_graph(n), costs, P, "async", 4)
    load = [0.0] * P
    for i, (f, b, r) in enumerate(costs):
        load[gpus[i]] += f + b + (r if i < n - 1 else 0.0)      # the last stage does not recompute
    short, long = simulate(pb, plan, steps=1), simulate(pb, plan, steps=40)
    assert short.period_ms >= max(load) * (1 - 1e-9)
    assert short.period_ms == pytest.approx(long.period_ms, rel=0.02)
    assert short.throughput_samples_per_s == pytest.approx(2 * 1e3 / short.period_ms)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "pipedream", "2bw", "2gw"])
@pytest.mark.parametrize("seed", range(6))
def test_period_is_never_below_a_gpu_or_link_load(schedule, seed):
    """Random DAGs, random plans (several stages per GPU), random costs and slow links: the periodic
    steady state is found, and its period is at least the busiest GPU's work per micro-batch and
    the busiest link's transfer time per micro-batch, which no schedule can beat."""
    import random

    rng = random.Random(seed * 7 + len(schedule))
    n = rng.randint(6, 14)
    edges = sorted({(i, j) for j in range(1, n) for i in rng.sample(range(j), k=min(j, rng.randint(1, 2)))})
    graph = make_graph(n, edges, numel=rng.choice([1, 500, 4000]))
    costs = [(rng.uniform(0.2, 2.0), rng.uniform(0.4, 4.0), rng.uniform(0.2, 2.0)) for _ in range(n)]
    P = rng.randint(2, 4)
    cuts = sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(P, 2 * P))))
    bounds = [0, *cuts, n]
    stages = [Stage(i, rng.randrange(P), list(range(a, b))) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    plan = Plan("random", P, stages)
    M = max(len(stages), 4) if schedule in ("2bw", "2gw") else rng.choice([1, 2, 4])
    pb = problem(graph, costs, P, schedule, M, bandwidth=rng.choice([FREE, 4e6, 1e6]), recompute=rng.random() < 0.5)
    res = simulate(pb, plan)
    assert res.steady, (res.steps, res.cyclicity)
    cost = evaluate(pb, plan)
    work = [0.0] * P
    for sc in cost.stages:
        work[sc.gpu] += sc.forward_ms + sc.backward_ms + sc.recompute_ms + sc.update_ms / M
    assert res.period_ms >= max(work) * (1 - 1e-9)
    assert res.max_load_ms == pytest.approx(max(work))
    # what the simulated run holds stays within evaluate's bound, GPU by GPU
    for g, peak in enumerate(res.gpu_peak_memory):
        assert peak <= cost.gpus[g].memory_bytes, (g, res.gpu_peak_breakdown[g], cost.gpus[g])
    # links: every transfer of the measured period, per ordered GPU pair
    from ftcompile.plan import stage_graph

    sg = stage_graph(graph, plan)
    gpu = {s.id: s.gpu for s in stages}
    link: dict[tuple[int, int], float] = {}
    for u, t, data in sg.edges(data=True):
        if gpu[u] != gpu[t]:
            nbytes = sum(data["values"].values())
            link[(gpu[u], gpu[t])] = link.get((gpu[u], gpu[t]), 0.0)
            link[(gpu[t], gpu[u])] = link.get((gpu[t], gpu[u]), 0.0)
    # one message per (producer, destination GPU) forward, one per (reader, producer) backward
    fwd: dict[tuple[int, int], dict[str, int]] = {}
    for u, t, data in sg.edges(data=True):
        if gpu[u] != gpu[t]:
            fwd.setdefault((u, gpu[t]), {}).update(data["values"])
            link[(gpu[t], gpu[u])] += sum(data["values"].values()) / pb.cluster.bandwidth(gpu[t], gpu[u]) * 1e3
    for (u, g), vals in fwd.items():
        link[(gpu[u], g)] += sum(vals.values()) / pb.cluster.bandwidth(gpu[u], g) * 1e3
    assert res.period_ms >= max(link.values(), default=0.0) * (1 - 1e-9)


def test_replicas_all_reduce_is_link_traffic_after_the_last_backward():
    """Two replicas of a 2-stage 1F1B pipeline: each stage's gradients (4 MB) are averaged over a
    2-member ring at 1 GB/s: 2 (R - 1) / R x 4 MB / 1 GB/s = 4 ms after its last backward of the
    step, before its update, on the GPU's all-reduce lane; throughput counts both replicas."""
    from dataclasses import replace

    graph = make_graph(2)
    prof = make_profile([(1.0, 2.0, 0.0)] * 2)
    prof.params.update({f"w{i}": ParamCost(4 * 10**6, 4 * 10**6, 0) for i in range(2)})
    base = Problem(graph, prof, make_cluster(2), schedule="1f1b", micro_batches=4)
    one = simulate(base, one_per_gpu(2))
    two = simulate(replace(base, replicas=2, ring_bandwidth=(1e9, 1e9)), one_per_gpu(2))
    free = simulate(replace(base, replicas=2, ring_bandwidth=(FREE, FREE)), one_per_gpu(2))
    assert free.minibatch_ms == pytest.approx(one.minibatch_ms)
    assert free.throughput_samples_per_s == pytest.approx(2 * one.throughput_samples_per_s)
    ars = [e for e in two.events if e.kind == "allreduce"]
    assert ars and all(e.end - e.start == pytest.approx(4.0) for e in ars)
    for e in ars:      # after the stage's last backward of the step, before its update
        last_b = max(x.end for x in two.events if x.kind == "B" and x.stage == e.stage and x.step == e.step)
        upd = [x for x in two.events if x.kind == "U" and x.stage == e.stage and x.micro_batch == e.micro_batch]
        assert e.start >= last_b - 1e-9 and all(u.start >= e.end - 1e-9 for u in upd)
    # stage 1 (the end of the pipeline) finishes its backwards early: its all-reduce overlaps stage 0's
    # backwards; stage 0's does not (nothing is left to overlap), so the step grows by at most 4 ms
    assert one.minibatch_ms < two.minibatch_ms <= one.minibatch_ms + 4.0 + 1e-9


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "pipedream", "2bw", "2gw", "avgpipe"])
@pytest.mark.parametrize("scale", [1, 3])
def test_fed_steps_end_where_a_stage_runs_out_of_forwards(schedule, scale):
    """The steps measured are those whose update every stage runs before its last forward,
    counted here by walking each program's task order (not its closed forms)."""
    from ftcompile.runtime.schedules import stage_programs
    from ftcompile.simulate import fed_steps

    depths = {0: 4, 1: 3, 2: 1, 3: 0}
    n, M = 12, 4 * scale          # 2bw and 2gw need M >= s x depth
    progs = stage_programs(schedule, depths, micro_batches=M, steps=n, in_flight_scale=scale)
    walked = []
    for p in progs.values():
        tasks = list(p.tasks())
        last_f = max(i for i, t in enumerate(tasks) if t.kind == "F")
        before = sum(t.kind == "U" for t in tasks[:last_f])
        walked.append(n if before >= n - 1 else before)
    assert fed_steps(progs) == min(walked)
    if schedule in ("async", "pipedream", "2bw"):     # depth 4: 4 s + 1 forwards in flight drain
        assert fed_steps(progs) == n - -(-(4 * scale + 1) // M)
    elif schedule != "2gw":
        assert fed_steps(progs) == n


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("scale", [1, 3])
def test_a_run_too_short_for_a_steady_state_measures_no_drain(seed, scale):
    """Once a stage's forwards run out, its warm-up's backwards drain faster than the steady
    state runs. A run cut short measures the steps before that: never faster than the steady
    state (12 stages scattered over 3 GPUs, async; seeds 0 and 2 at s = 1 measured 2.3 % and
    1.4 % below it, at the busiest GPU's load, when the drain counted)."""
    import random
    from dataclasses import replace

    rng = random.Random(seed)
    n, P = 12, 3
    costs = [(f, 2 * f, f) for f in (rng.uniform(0.5, 3.0) for _ in range(n))]
    gpus = [rng.randrange(P) for _ in range(n)]
    plan = Plan("scattered", P, [Stage(i, gpus[i], [i]) for i in range(n)])
    pb = replace(problem(make_graph(n), costs, P, "async", 4), in_flight_scale=scale)
    steady = simulate(pb, plan)
    assert steady.steady
    for max_steps in (8, 12, 20):
        short = simulate(pb, plan, max_steps=max_steps)
        assert short.period_ms >= steady.period_ms * (1 - 1e-9), (max_steps, short.period_ms, steady.period_ms)
        assert short.period_ms == pytest.approx(steady.period_ms, rel=0.03)


def test_busy_time_is_counted_when_no_steady_state_shows():
    # Too few steps to see a periodic state: the period is the second half's average, and each
    # GPU's busy time there is its work (the bottleneck GPU 1: 2 + 3 ms per micro-batch, busy
    # all the time), not what the few kept events of the first steps hold.
    costs = [(1.0, 1.0, 0.0), (2.0, 3.0, 0.0), (1.0, 1.0, 0.0)]
    pb = problem(make_graph(3), costs, 3, "pipedream", 4)
    res = simulate(pb, one_per_gpu(3), steps=3, max_steps=4, keep_events=1)
    assert not res.steady
    assert res.period_ms == pytest.approx(5.0, abs=1e-6)
    assert (res.warmup_steps, res.cyclicity) == (2, 2)        # steps 2 and 3 measured, the second half
    assert res.gpu_utilisation == pytest.approx([2 / 5, 1.0, 2 / 5], abs=1e-6)
    assert res.bubble_fraction == pytest.approx(1 - (2 + 5 + 2) / 15, abs=1e-6)


def test_a_period_that_repeats_every_five_steps_is_found():
    """A periodic state can repeat over any number of steps, not only 1, 2, 3, 4 or 6: this async
    plan (4 stages on 2 GPUs, M = 2) repeats every 5 steps from step 13. The run ends there with
    that period, steady, and the timeline itself (every task's start, all steps kept) shows it:
    every task of the last 10 steps starts 5 periods after the same task 5 steps before, and no
    shorter cyclicity holds. Checking only 1, 2, 3, 4 and 6 ran it to ``max_steps`` for an average."""
    edges = [(0, 1), (0, 4), (0, 5), (0, 6), (1, 2), (1, 3), (2, 3), (3, 5), (4, 6)]
    costs = [(6.0, 8.0, 0.0), (3.0, 4.0, 0.0), (5.0, 2.0, 0.0), (3.0, 1.0, 0.0), (1.0, 1.0, 0.0),
             (6.0, 9.0, 0.0), (1.0, 7.0, 0.0)]
    plan = Plan("five", 2, [Stage(0, 1, [0]), Stage(1, 1, [1]), Stage(2, 0, [2, 3, 4, 5]), Stage(3, 1, [6])])
    M = 2
    res = simulate(problem(make_graph(7, edges), costs, 2, "async", M), plan, keep_events=10**6)
    assert res.steady and res.cyclicity == 5, (res.steady, res.cyclicity, res.steps)
    assert res.steps < 100
    L = res.minibatch_ms
    assert L >= M * (14 + 7 + 8) - 1e-9                  # GPU 1's work per step: stages 0, 1 and 3
    start = {(e.stage, e.kind, e.micro_batch): e.start for e in res.events if e.kind in "FBU"}

    def repeats(c: int, last: int) -> bool:
        for (s, kind, i), t in start.items():
            step = i if kind == "U" else i // M
            if last - 2 * c < step <= last:
                before = start[(s, kind, i - (c if kind == "U" else c * M))]
                if abs(t - before - c * L) > 1e-9 * t:
                    return False
        return True

    last = res.warmup_steps + res.cyclicity - 1            # the last step measured
    assert repeats(5, last)
    assert not any(repeats(c, last) for c in range(1, 5))
    assert res.gpu_utilisation == pytest.approx([5 * M * 28 / (5 * L), 5 * M * 29 / (5 * L)])


def test_a_period_without_a_periodic_state_says_so_in_the_plan_table():
    """A row whose replay found no periodic state carries the steps its mean spans, and the
    report's note says it; a steady row carries neither."""
    from ftcompile.compile import StrategyResult, _row_note

    costs = [(1.0, 1.0, 0.0), (2.0, 3.0, 0.0), (1.0, 1.0, 0.0)]
    pb = problem(make_graph(3), costs, 3, "pipedream", 4)
    plan = one_per_gpu(3)
    short = simulate(pb, plan, steps=3, max_steps=4)
    row = StrategyResult("seq", True, None, plan, evaluate(pb, plan), short.to_json(events=False)).row()
    assert row["simulated_steady"] is False and row["simulated_steps"] == [2, 4]
    assert "no periodic state, the mean of steps 2 to 3" in _row_note(row)
    steady = StrategyResult("seq", True, None, plan, evaluate(pb, plan), simulate(pb, plan).to_json(events=False)).row()
    assert steady["simulated_steady"] is True and "simulated_steps" not in steady
    assert "periodic" not in _row_note(steady)


@pytest.mark.parametrize("schedule", ["async", "1f1b", "gpipe"])
def test_a_graph_input_read_by_many_stages_on_a_gpu_is_held_once(schedule):
    """The runtime moves a step's batch of each graph input its rank reads to the device once
    (engine ``_local_inputs``), however many of the rank's stages read it. Here the input
    (1 MB a micro-batch) is read by the embedding and the mask, in two stages of GPU 0: the
    simulated run holds whole steps of it, once each, and never more than evaluate's bound."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from dags import branchy_problem

    pb = branchy_problem(0, blocks=2, gpus=2, schedule=schedule)
    g = pb.graph
    x_bytes = {e.value: e.bytes for e in g.edges if g.node(e.src).kind == "input"}
    readers = sorted({e.dst for e in g.edges if g.node(e.src).kind == "input"})
    assert len(x_bytes) == 1 and len(readers) == 2
    ops = [n.id for n in g.nodes if n.kind == "op"]
    plan = Plan("one-node stages", 2, [Stage(i, 0 if n in readers else i % 2, [n]) for i, n in enumerate(ops)])
    M = pb.micro_batches
    res = simulate(pb, plan)
    cost = evaluate(pb, plan)
    data = res.gpu_peak_breakdown[0]["data"]
    per_step = M * next(iter(x_bytes.values()))
    assert data > 0 and data % per_step == 0
    # whole steps of the input once: at most the steps any stage there has in flight, plus one
    ahead = max(res.stage_peak_in_flight[s.id] for s in plan.stages if s.gpu == 0)
    assert data // per_step <= -(-ahead // M) + 1
    assert data <= cost.gpus[0].data_bytes
    for gpu, peak in enumerate(res.gpu_peak_memory):
        assert peak <= cost.gpus[gpu].memory_bytes, (gpu, res.gpu_peak_breakdown[gpu], cost.gpus[gpu])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async", "pipedream", "2bw"])
@pytest.mark.parametrize("seed", range(4))
def test_simulated_memory_stays_within_evaluate_on_branchy_dags(schedule, seed):
    """What a plan is promised to fit in (evaluate's per-GPU figure) bounds what its simulated run
    holds, GPU by GPU, on DAGs with what traced graphs have: an input read by several nodes (the
    embedding, the mask, a label clamp), a mask read by every block, heads off the trunk, tied
    weights, and plans of several stages per GPU cut from the topological order at random."""
    import random
    import sys
    from dataclasses import replace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from dags import branchy_problem

    rng = random.Random(seed)
    P = rng.choice([2, 3])
    pb = branchy_problem(seed, blocks=3, gpus=P, schedule=schedule, side=True, tied=seed % 2 == 1,
                         bandwidth=rng.choice([1e30, 1e9]))
    ops = [n.id for n in pb.graph.nodes if n.kind == "op"]
    lone = {n.id for n in pb.graph.nodes if n.name == "counter"}   # reads and feeds nothing
    cuts = sorted(rng.sample(range(1, len(ops)), k=rng.randint(P, 2 * P)))
    bounds = [0, *cuts, len(ops)]
    parts = [[n for n in ops[a:b] if n not in lone] for a, b in zip(bounds, bounds[1:])]
    parts = [p for p in parts if p]
    parts[0] += sorted(lone)            # (a stage of its own would run ahead without bound)
    stages = [Stage(i, rng.randrange(P) if i else 0, sorted(p)) for i, p in enumerate(parts)]
    plan = Plan("random", P, stages)
    if schedule == "2bw":
        from ftcompile.plan import stage_depths, stage_graph

        depth = max(stage_depths(stage_graph(pb.graph, plan)).values()) + 1
        pb = replace(pb, micro_batches=max(pb.micro_batches, depth))
    res = simulate(pb, plan)
    cost = evaluate(pb, plan)
    for g, peak in enumerate(res.gpu_peak_memory):
        if cost.gpus[g].stages:
            assert peak <= cost.gpus[g].memory_bytes, (g, res.gpu_peak_breakdown[g], cost.gpus[g])


@pytest.mark.parametrize("schedule", ["async", "1f1b"])
def test_a_lone_stage_is_joined_to_a_stage_on_its_gpu_and_holds_no_steps_ahead(schedule):
    """A stage that exchanges no value with another (here the counter nobody reads) is paced by
    nothing in the stage graph: left alone it would run through its steps ahead of the stages
    beside it on GPU 0, which would hold a batch of graph inputs for every step it begins, beyond
    what evaluate promised. The engine paces it by GPU 0's stage (runtime/pacing.py), and so does
    the simulation: within evaluate's data. ordered(), which every plan compile keeps goes
    through, joins it to the GPU's stage nearest the end; the plan then stays within evaluate's
    data, and the counter is still computed once per micro-batch."""
    import sys
    from pathlib import Path

    from ftcompile.plan import ordered, stage_depths, stage_graph

    sys.path.insert(0, str(Path(__file__).parent))
    from dags import branchy_problem

    pb = branchy_problem(0, blocks=2, gpus=2, schedule=schedule, side=True)
    g = pb.graph
    counter = next(n.id for n in g.nodes if n.name == "counter")
    ops = [n.id for n in g.nodes if n.kind == "op" and n.id != counter]
    half = len(ops) // 2
    lone = Plan("by hand", 2, [Stage(0, 0, ops[:half]), Stage(1, 1, ops[half:]), Stage(2, 0, [counter])])
    cost = evaluate(pb, lone)
    raw = simulate(pb, lone)
    assert raw.gpu_peak_breakdown[0]["data"] <= cost.gpus[0].data_bytes     # paced as the engine paces it
    plan = ordered(lone, g)
    assert len(plan.stages) == 2 and stage_graph(g, plan).number_of_edges() == 1
    host = next(s for s in plan.stages if counter in s.nodes)
    assert host.gpu == 0 and set(host.nodes) == set(ops[:half]) | {counter}
    assert stage_depths(stage_graph(g, plan))[host.id] == 1
    joined, cost = simulate(pb, plan), evaluate(pb, plan)
    for gpu, peak in enumerate(joined.gpu_peak_memory):
        assert joined.gpu_peak_breakdown[gpu]["data"] <= cost.gpus[gpu].data_bytes
        assert peak <= cost.gpus[gpu].memory_bytes
    # one of another kind than every stage on its GPU (freeze's frozen levels) stays lone
    assert len(ordered(lone, g, {n: n == counter for n in ops + [counter]}).stages) == 3
    # a lone stage with its GPU to itself is left alone, and a plan of one stage too
    alone = Plan("by hand", 3, [Stage(0, 0, ops[:half]), Stage(1, 1, ops[half:]), Stage(2, 2, [counter])])
    assert len(ordered(alone, g).stages) == 3
    assert len(ordered(Plan("one", 1, [Stage(0, 0, ops + [counter])]), g).stages) == 1


def test_dead_code_over_two_gpus_is_tied_to_the_pipeline_and_holds_no_steps_ahead():
    """Dead code spread over two GPUs (traced Llama on 4 GPUs: ``arange`` on GPU 0 feeding three
    unused ``unsqueeze`` on GPU 2) is a part of the stage graph no edge links to the loss's: paced
    by nothing there; left alone it would run ahead, and its GPUs would hold the inputs of every
    step it begins. The engine paces each of its stages by the pipeline's stage on its GPU, and so
    does the simulation. ordered() joins its sink to the loss's stage on that GPU; either way the
    plan stays within evaluate's data."""
    import networkx as nx

    from ftcompile.plan import ordered, stage_depths, stage_graph

    def v(n=250_000):
        return ValueMeta(TensorMeta((n,), "float32"))

    scalar = ValueMeta(TensorMeta((), "float32"))
    # x -> a -> b -> loss; x -> c -> d, whose output nobody reads
    nodes = [Node(0, "x", "input", outputs={"x": v()}), Node(1, "a", "op", outputs={"va": v()}),
             Node(2, "b", "op", outputs={"vb": v()}), Node(3, "loss", "op", outputs={"vl": scalar}, is_loss=True),
             Node(4, "c", "op", outputs={"vc": v()}), Node(5, "d", "op", outputs={"vd": v()}), Node(6, "out", "output")]
    edges = [Edge(0, 1, "x", v()), Edge(1, 2, "va", v()), Edge(2, 3, "vb", v()), Edge(0, 4, "x", v()),
             Edge(4, 5, "vc", v()), Edge(3, 6, "vl", scalar), Edge(5, 6, "vd", v())]
    g = OpGraph(nodes=nodes, edges=edges, params={}, loss="vl")
    costs = {1: (1.0, 2.0), 2: (1.0, 2.0), 3: (0.5, 0.5), 4: (0.2, 0.0), 5: (0.2, 0.0)}
    prof = Profile(graph_hash="test", method="analytic", hardware={}, dtype="float32", batch_size=2, optimizer="sgd",
                   nodes={i: NodeCost(forward_ms=f, backward_ms=b, recompute_ms=f, activation_bytes=1000)
                          for i, (f, b) in costs.items()}, params={})
    pb = Problem(g, prof, make_cluster(2), schedule="async", micro_batches=4)
    apart = Plan("by hand", 2, [Stage(0, 0, [1]), Stage(1, 1, [2, 3]), Stage(2, 0, [4]), Stage(3, 1, [5])])
    cost = evaluate(pb, apart)
    raw = simulate(pb, apart)
    for gpu in range(2):
        assert raw.gpu_peak_breakdown[gpu]["data"] <= cost.gpus[gpu].data_bytes   # paced as the engine paces it
    plan = ordered(apart, g)
    assert sorted(sorted(s.nodes) for s in plan.stages) == [[1], [2, 3, 5], [4]]
    sg = stage_graph(g, plan)
    assert nx.is_weakly_connected(sg) and stage_depths(sg)[next(s.id for s in plan.stages if 3 in s.nodes)] == 0
    joined, cost = simulate(pb, plan), evaluate(pb, plan)
    for gpu, peak in enumerate(joined.gpu_peak_memory):
        assert joined.gpu_peak_breakdown[gpu]["data"] <= cost.gpus[gpu].data_bytes
        assert peak <= cost.gpus[gpu].memory_bytes


@pytest.mark.parametrize("schedule", ["async", "pipedream", "2bw", "2gw", "1f1b", "gpipe"])
@pytest.mark.parametrize("on_nonfinite", ["stop", "skip"])
def test_a_deep_unpaced_part_paced_beside_a_shallow_pipeline_never_deadlocks(schedule, on_nonfinite):
    """Dead code in four stages alternating over two GPUs (x -> c1 -> c2 -> c3 -> c4, unused) beside
    a pipeline of two (x -> a -> b -> loss), with clipping: every update waits for every stage's
    gradient norm. Each dead stage is paced by the pipeline's stage on its GPU, the first (depth 3)
    by the loss's (depth 0). Paced forward for forward, c1 would need forwards of the next step
    before its last backward of this one while the loss's stage waits at the update for it: the
    simulation deadlocks (async, pipedream, 2bw, 2gw). With runtime/pacing.py's slack it runs, and
    every GPU stays within evaluate's data."""
    from ftcompile.simulate import SimulationError

    def v(n=1000):
        return ValueMeta(TensorMeta((n,), "float32"))

    scalar = ValueMeta(TensorMeta((), "float32"))
    nodes = [Node(0, "x", "input", outputs={"x": v()}), Node(1, "a", "op", outputs={"va": v()}),
             Node(2, "b", "op", outputs={"vb": v()}), Node(3, "loss", "op", outputs={"vl": scalar}, is_loss=True)]
    edges = [Edge(0, 1, "x", v()), Edge(1, 2, "va", v()), Edge(2, 3, "vb", v())]
    last = 0
    for i in range(4):
        nodes.append(Node(4 + i, f"c{i + 1}", "op", outputs={f"vc{i}": v()}))
        edges.append(Edge(last, 4 + i, "x" if last == 0 else f"vc{i - 1}", v()))
        last = 4 + i
    nodes.append(Node(8, "out", "output"))
    edges += [Edge(3, 8, "vl", scalar), Edge(7, 8, "vc3", v())]
    g = OpGraph(nodes=nodes, edges=edges, params={}, loss="vl")
    prof = Profile(graph_hash="test", method="analytic", hardware={}, dtype="float32", batch_size=2, optimizer="sgd",
                   nodes={i: NodeCost(forward_ms=1.0, backward_ms=2.0 if i < 4 else 0.0, recompute_ms=1.0,
                                      activation_bytes=1000) for i in range(1, 8)}, params={})
    M = 6 if schedule in ("2bw", "2gw") else 4
    pb = Problem(g, prof, make_cluster(2), schedule=schedule, micro_batches=M, clip_grad_norm=1.0,
                 on_nonfinite=on_nonfinite)
    plan = Plan("by hand", 2, [Stage(0, 0, [1]), Stage(1, 1, [4]), Stage(2, 0, [5]), Stage(3, 1, [2, 3]),
                               Stage(4, 1, [6]), Stage(5, 0, [7])])
    try:
        res = simulate(pb, plan)
    except SimulationError as exc:
        pytest.fail(f"{schedule}: {exc}")
    cost = evaluate(pb, plan)
    for gpu in range(2):
        assert res.gpu_peak_breakdown[gpu]["data"] <= cost.gpus[gpu].data_bytes
