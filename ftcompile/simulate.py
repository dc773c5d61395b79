"""Discrete-event simulation of a pipeline plan under a training schedule.

:func:`evaluate` prices a plan with closed formulas (FTPipe Eq. 1); this module
*runs* the plan on an idealised cluster to check those formulas and to draw the
timeline (:mod:`ftcompile.timeline`).

Model
-----
* Every stage runs, per micro-batch ``k``, a forward task ``F(k)``, a
  recomputation ``R(k)`` where the schedule recomputes (same rule as
  :func:`evaluate`) and a backward ``B(k)``, with the durations of the stage's
  :class:`~ftcompile.plan.StageCost`.
* Each stage follows a fixed per-stage *program* (the order of its tasks), as
  pipeline runtimes do; the programs are what distinguish the schedules (see
  :func:`stage_program`).
* A GPU runs one compute task at a time. When several stages share a GPU
  (Mixed-pipe), the GPU picks, among the stages whose next task is ready, by the
  schedule's priority: backward (and recomputation) before forward, then the
  oldest micro-batch, then the stage nearer the end of the pipeline. GPipe
  prefers the oldest micro-batch first.
* Dataflow: ``F(k)`` waits for the values of micro-batch ``k`` from *every*
  producing stage; ``B(k)`` waits for the gradients from every consumer stage it
  sends a floating value to (and, by program order, for its own ``F``/``R``).
  Graph inputs are available at once.
* Transfers: after ``F(k)`` a stage sends, once per destination GPU, the values
  the stages there read (deduplicated like :func:`evaluate`); after ``B(k)`` a
  stage sends the gradients of the floating values it read back to each
  producer. A transfer takes ``bytes / cluster.bandwidth(src, dst)``; each
  ordered GPU pair ``(src, dst)`` (including a GPU with itself, priced at the
  local-copy bandwidth as :func:`evaluate` does) is one FIFO link, separate from
  the compute engines, so communication overlaps computation.
* Memory per GPU: the static part (weights, weight versions, gradients,
  optimizer state) from :func:`evaluate`'s :class:`~ftcompile.plan.GpuCost`,
  plus activations live over time: ``F(k)`` allocates the stage's activations
  (its inputs only if it recomputes), ``R(k)`` allocates the full activations
  again, and ``B(k)`` frees both when it ends.

Measurement: the run has some warm-up mini-batches (one for the flushing
schedules, enough to fill the deepest pipeline otherwise) followed by ``steps``
measured ones. Mini-batch ``s`` ends when the last backward of its
micro-batches ends; the measured window runs from the end of the last warm-up
mini-batch to the end of the last one, so for the flushing schedules it is
exactly flush-to-flush, and the time per mini-batch is the window over ``steps``.

Without flushes, mini-batches need not end evenly: where several stages share a
GPU, completions come in bursts, and a window of a few mini-batch ends can hold
much more or much less than ``steps`` mini-batches' worth of work. There the
window covers at least twice as many micro-batches as the pipeline is deep, and
the time per micro-batch is measured by the work done in it: the window times
the work of one micro-batch (every stage's F, R and B) over the compute the GPUs
did inside the window. Stages that nothing holds back (no gradient returns to
them and their inputs come from such stages only) may run ahead of the
pipeline and are left out of both. In a periodic steady state both measures
agree.
"""

from __future__ import annotations

import heapq
from collections import deque
import math
from dataclasses import asdict, dataclass, field, replace

import networkx as nx

from .plan import Plan, PlanError, Problem, evaluate, stage_depths, stage_graph

FLUSHING = ("gpipe", "1f1b")


class SimulationError(RuntimeError):
    """The simulation cannot proceed (a deadlock: tasks remain but none can start)."""


@dataclass
class Event:
    """One box of the timeline: a compute task (``F``/``R``/``B``) or a transfer (``send``)."""

    gpu: int                   # the GPU that computes, or the sender of a transfer
    stage: int                 # the stage computing, or the stage whose output/gradient is sent
    kind: str                  # "F" | "R" | "B" | "send"
    micro_batch: int           # global index: mini-batch * M + index within the mini-batch
    start: float               # ms
    end: float                 # ms
    dst_gpu: int | None = None     # transfers only
    dst_stage: int | None = None   # transfers: the stage the gradient goes to (backward) or None
    nbytes: int = 0


@dataclass
class SimResult:
    """What the simulation measured. Times in ms, memory in bytes; lists are indexed by GPU."""

    schedule: str
    strategy: str
    num_gpus: int
    micro_batches: int
    micro_batch_size: int
    steps: int                          # measured mini-batches
    warmup_steps: int                   # mini-batches simulated before the measured window
    tail_steps: int                     # and after it (no-flush schedules: keeps the drain out)
    throughput_samples_per_s: float
    minibatch_ms: float                 # time per mini-batch in the measured window
    period_ms: float                    # minibatch_ms / micro_batches, comparable to evaluate's objective
    objective_ms: float                 # evaluate()'s objective (Eq. 1) for the same problem and plan
    bubble_fraction: float              # idle / total time of the GPUs that host stages, in the window
    window: tuple[float, float]
    makespan_ms: float
    gpu_busy_ms: list[float]            # compute time inside the window
    gpu_utilisation: list[float]
    gpu_peak_memory: list[int]          # static (weights etc.) + peak live activations, whole run
    gpu_memory_limit: int
    stage_peak_in_flight: dict[int, int]    # most micro-batches between F start and B end
    events: list[Event] = field(default_factory=list)

    def to_json(self) -> dict:
        d = asdict(self)
        d["window"] = list(self.window)
        d["stage_peak_in_flight"] = {str(k): v for k, v in self.stage_peak_in_flight.items()}
        return d


# --------------------------------------------------------------------------- programs

def stage_program(schedule: str, depth: int, micro_batches: int, total_steps: int, *,
                  recompute: bool, group0: bool = False, group0_depth: int = 0) -> list[tuple[str, int]]:
    """The order in which one stage runs its tasks, as ``(kind, micro-batch)`` pairs.

    ``depth`` is the stage's distance, in stages, from the end of the pipeline.
    A backward unit is ``R(k), B(k)`` when the stage recomputes, else ``B(k)``.

    * ``gpipe``: per mini-batch all forwards, then all backwards (oldest first).
    * ``1f1b`` (PipeDream-flush): per mini-batch ``min(depth + 1, M)`` forwards,
      then one backward / one forward until the forwards run out, then the
      remaining backwards. Nothing of mini-batch ``s + 1`` precedes the last
      backward of ``s``: the flush.
    * ``async`` (FTPipe), ``pipedream``, ``2bw``: the same 1F1B steady state over
      the whole run without flushes (``depth + 1`` warm-up forwards). They differ
      in recomputation (decided by the caller) and in weight versions (memory,
      from :func:`evaluate`), not in order.
    * ``2gw`` (WPipe): G1 stages run 1F1B with a flush per mini-batch (one weight
      version, data-parallel semantics). G0 stages never flush: G0's forward of
      mini-batch ``s + 1`` is moved in front of its backward of ``s`` (Fig. 4b),
      which makes ``F(k + M)`` and ``B(k)`` a "V" that is pipelined 1F1B-style
      over the G0 stages, so a G0 stage runs ``M + group0_depth`` forwards
      (``group0_depth``: its depth within G0) before its first backward and
      then alternates (two weight versions). Where a GPU hosts a G0 and a G1
      stage, G0's work fills G1's flush bubbles (Fig. 5). This is our reading of
      the figures; it holds ``group0_depth`` more micro-batches than WPipe's
      ``M`` on G0 stages, and with greedy task choice a few percent of bubble
      can remain at flush boundaries on deep pipelines.
    """
    M = micro_batches
    total = M * total_steps

    def back(k: int) -> list[tuple[str, int]]:
        return [("R", k), ("B", k)] if recompute else [("B", k)]

    def one_f_one_b(ks: list[int], warm: int) -> list[tuple[str, int]]:
        warm = min(warm, len(ks))
        out = [("F", k) for k in ks[:warm]]
        for i, k in enumerate(ks):
            out += back(k)
            if warm + i < len(ks):
                out.append(("F", ks[warm + i]))
        return out

    prog: list[tuple[str, int]] = []
    if schedule == "gpipe":
        for s in range(total_steps):
            ks = list(range(s * M, (s + 1) * M))
            prog += [("F", k) for k in ks]
            for k in ks:
                prog += back(k)
    elif schedule == "1f1b" or (schedule == "2gw" and not group0):
        for s in range(total_steps):
            prog += one_f_one_b(list(range(s * M, (s + 1) * M)), depth + 1)
    elif schedule in ("async", "pipedream", "2bw"):
        prog = one_f_one_b(list(range(total)), depth + 1)
    elif schedule == "2gw":
        prog = one_f_one_b(list(range(total)), M + group0_depth)
    else:
        raise PlanError(f"unknown schedule {schedule!r}")
    return prog


# --------------------------------------------------------------------------- simulation

def _micro_batch_size(problem: Problem) -> int:
    bs = problem.profile.batch_size or problem.graph.source.get("options", {}).get("batch_size")
    return int(bs) if bs else 1


def simulate(problem: Problem, plan: Plan, *, micro_batches: int | None = None, steps: int = 2) -> SimResult:
    """Simulate ``plan`` under ``problem.schedule`` and measure its steady state.

    ``micro_batches`` overrides ``problem.micro_batches`` (M); ``steps`` is the
    number of measured mini-batches (after the warm-up ones, see the module
    docstring). Raises :class:`SimulationError` on a deadlock, which the
    schedules here should never produce on an acyclic stage graph.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if micro_batches is not None:
        problem = replace(problem, micro_batches=micro_batches)
    M = problem.micro_batches
    graph, cluster = problem.graph, problem.cluster
    cost = evaluate(problem, plan)
    sg = stage_graph(graph, plan)
    depth = stage_depths(sg)
    # Same grouping and "last stage" rule as evaluate(), so both price the same pipeline.
    topo = list(nx.topological_sort(sg))
    group0 = {s: i < (len(topo) + 1) // 2 for i, s in enumerate(topo)}
    sc_of = {sc.id: sc for sc in cost.stages}
    gpu_of = {s.id: s.gpu for s in plan.stages}
    where = plan.stage_of()
    loss_stage = where.get(next((n.id for n in graph.nodes if n.is_loss), -1))
    recomputes = {s: problem.recomputes(depth[s] == 0 and (loss_stage is None or loss_stage == s))
                  for s in gpu_of}

    max_depth = max(depth.values(), default=0)
    if problem.schedule in FLUSHING:
        warm_steps, tail_steps = 1, 0
    else:
        # Without flushes the pipeline fills and drains over `ahead` micro-batches at each end;
        # keep both transients out of the measured window.
        ahead = max_depth + 1 if problem.schedule != "2gw" else M + max_depth + 1
        warm_steps = tail_steps = math.ceil(ahead / M) + 1
        steps = max(steps, math.ceil(2 * ahead / M))
    total_steps = warm_steps + steps + tail_steps

    g0_base = min((depth[s] for s in gpu_of if group0[s]), default=0)
    programs = {s: stage_program(problem.schedule, depth[s], M, total_steps, recompute=recomputes[s],
                                 group0=group0[s], group0_depth=depth[s] - g0_base) for s in gpu_of}

    def floating(v: str) -> bool:
        t = graph.node(graph.producer(v)).outputs[v].tensor
        return t is not None and t.is_floating

    # Forward messages: per (producer stage, destination GPU), the distinct values the stages there read.
    fwd_msgs: dict[int, dict[int, list]] = {s: {} for s in gpu_of}       # u -> g -> [bytes, [t...]]
    grad_msgs: dict[int, list[tuple[int, int]]] = {s: [] for s in gpu_of}  # t -> [(u, bytes)]
    for u in gpu_of:
        per_gpu: dict[int, dict[str, int]] = {}
        for t in sg.successors(u):
            vals = sg.edges[u, t]["values"]
            per_gpu.setdefault(gpu_of[t], {}).update(vals)
            fwd_msgs[u].setdefault(gpu_of[t], [0, []])[1].append(t)
            fb = [b for v, b in vals.items() if floating(v)]
            if fb:
                grad_msgs[t].append((u, sum(fb)))
        for g, vals in per_gpu.items():
            fwd_msgs[u][g][0] = sum(vals.values())
    producers = {t: list(sg.predecessors(t)) for t in gpu_of}
    grad_from = {u: [t for t in gpu_of if any(p == u for p, _ in grad_msgs[t])] for u in gpu_of}

    dur = {s: {"F": sc_of[s].forward_ms, "R": sc_of[s].recompute_ms, "B": sc_of[s].backward_ms} for s in gpu_of}
    held = {s: sc_of[s].input_bytes if recomputes[s] else sc_of[s].activation_bytes for s in gpu_of}
    kind_rank = {"B": 0, "R": 0, "F": 1}
    if problem.schedule == "gpipe":
        def prio(s: int, kind: str, k: int):
            return (k, kind_rank[kind], depth[s], s)
    else:
        def prio(s: int, kind: str, k: int):
            return (kind_rank[kind], k, depth[s], s)

    stages_on: dict[int, list[int]] = {}
    for s in sorted(gpu_of):
        stages_on.setdefault(gpu_of[s], []).append(s)

    head = {s: 0 for s in gpu_of}
    fwd_in: set[tuple[int, int, int]] = set()      # (producer u, consumer t, k) arrived
    grad_in: set[tuple[int, int, int]] = set()     # (consumer t, producer u, k) arrived
    gpu_free = {g: True for g in stages_on}
    links: dict[tuple[int, int], deque] = {}       # (src, dst) -> FIFO of pending messages
    link_free: dict[tuple[int, int], bool] = {}
    # Only GPUs and links whose state changed since they were last looked at can start
    # something; the others are skipped (same choices, in the same order, as a full scan).
    dirty_gpus: set[int] = set(stages_on)
    dirty_links: set[tuple[int, int]] = set()
    events: list[Event] = []
    mem: dict[int, list[tuple[float, int, int]]] = {g: [] for g in range(plan.num_gpus)}  # (t, order, delta)
    live: dict[int, int] = {s: 0 for s in gpu_of}
    peak_live = {s: 0 for s in gpu_of}
    heap: list = []
    seq = 0

    def push(t: float, what: tuple) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, seq, what))
        seq += 1

    def ready(s: int) -> bool:
        kind, k = programs[s][head[s]]
        if kind == "F":
            return all((u, s, k) in fwd_in for u in producers[s])
        if kind == "B":
            return all((t, s, k) in grad_in for t in grad_from[s])
        return True

    def send(now: float, src_stage: int, dst_gpu: int, nbytes: int, k: int, deliver: tuple,
             dst_stage: int | None) -> None:
        key = (gpu_of[src_stage], dst_gpu)
        t = nbytes / cluster.bandwidth(*key) * 1e3 if nbytes else 0.0
        if t <= 0:
            deliver_now(deliver)
            return
        links.setdefault(key, deque()).append((t, src_stage, k, deliver, dst_stage, nbytes))
        link_free.setdefault(key, True)
        dirty_links.add(key)

    def deliver_now(deliver: tuple) -> None:
        if deliver[0] == "fwd":
            _, u, ts, k = deliver
            for t in ts:
                fwd_in.add((u, t, k))
                dirty_gpus.add(gpu_of[t])
        else:
            _, t, u, k = deliver
            grad_in.add((t, u, k))
            dirty_gpus.add(gpu_of[u])

    now = 0.0
    remaining = sum(len(p) for p in programs.values())
    while True:
        # Start whatever can start at `now`: transfers first (they only need a free link).
        for key, q in links.items():
            if key not in dirty_links:
                continue
            if q and link_free[key]:
                t, src_stage, k, deliver, dst_stage, nbytes = q.popleft()
                link_free[key] = False
                events.append(Event(key[0], src_stage, "send", k, now, now + t, key[1], dst_stage, nbytes))
                push(now + t, ("link", key, deliver))
        dirty_links.clear()
        for g, stages in stages_on.items():
            if g not in dirty_gpus or not gpu_free[g]:
                continue
            cands = [s for s in stages if head[s] < len(programs[s]) and ready(s)]
            if not cands:
                continue
            s = min(cands, key=lambda s: prio(s, *programs[s][head[s]]))
            kind, k = programs[s][head[s]]
            end = now + dur[s][kind]
            gpu_free[g] = False
            events.append(Event(g, s, kind, k, now, end))
            if kind == "F":
                mem[g].append((now, 1, held[s]))
                live[s] += 1
                peak_live[s] = max(peak_live[s], live[s])
            elif kind == "R":
                mem[g].append((now, 1, sc_of[s].activation_bytes))
            push(end, ("task", s, kind, k))
        dirty_gpus.clear()
        if not heap:
            break
        now = heap[0][0]
        while heap and heap[0][0] == now:
            _, _, what = heapq.heappop(heap)
            if what[0] == "link":
                link_free[what[1]] = True
                dirty_links.add(what[1])
                deliver_now(what[2])
                continue
            _, s, kind, k = what
            gpu_free[gpu_of[s]] = True
            dirty_gpus.add(gpu_of[s])
            head[s] += 1
            remaining -= 1
            if kind == "F":
                for g, (nbytes, ts) in fwd_msgs[s].items():
                    send(now, s, g, nbytes, k, ("fwd", s, ts, k), None)
            elif kind == "B":
                freed = held[s] + (sc_of[s].activation_bytes if recomputes[s] else 0)
                mem[gpu_of[s]].append((now, 0, -freed))
                live[s] -= 1
                for u, nbytes in grad_msgs[s]:
                    send(now, s, gpu_of[u], nbytes, k, ("grad", s, u, k), u)
    if remaining:
        stuck = {s: programs[s][head[s]] for s in gpu_of if head[s] < len(programs[s])}
        raise SimulationError(f"deadlock at {now:.3f} ms: {remaining} tasks left; next per stage: {stuck}")

    # ---- measurement
    step_end = [0.0] * total_steps
    for e in events:
        if e.kind == "B":
            s_idx = e.micro_batch // M
            step_end[s_idx] = max(step_end[s_idx], e.end)
    w0, w1 = step_end[warm_steps - 1], step_end[warm_steps + steps - 1]
    window = w1 - w0
    # Without flushes the period is work-based (see the module docstring): robust to bursts of
    # mini-batch ends. Stages that nothing holds back (no gradient comes back to them, and their
    # inputs come from such stages or the graph's inputs) may run ahead of the pipeline, so their
    # work does not count.
    free: set[int] = set()
    if problem.schedule not in FLUSHING:
        for st in topo:
            if not grad_from[st] and all(u in free for u in producers[st]):
                free.add(st)
    busy = [0.0] * plan.num_gpus
    done = 0.0          # compute of paced stages inside the window
    for e in events:
        if e.kind != "send":
            inside = max(0.0, min(e.end, w1) - max(e.start, w0))
            busy[e.gpu] += inside
            if e.stage not in free:
                done += inside
    used = sorted(stages_on)
    idle = sum(window - busy[g] for g in used)
    minibatch_ms = window / steps
    if problem.schedule not in FLUSHING and window > 0:
        work_mb = sum(dur[st]["F"] + dur[st]["R"] + dur[st]["B"] for st in gpu_of if st not in free)
        if done > 0 and work_mb > 0:
            minibatch_ms = M * work_mb * window / done
    mbs = _micro_batch_size(problem)
    peak_mem = []
    for g in range(plan.num_gpus):
        gc = cost.gpus[g]
        static = gc.param_bytes + gc.weight_version_bytes + gc.grad_bytes + gc.optimizer_bytes
        cur = top = 0
        for _, _, delta in sorted(mem[g]):      # frees (order 0) before allocations at equal times
            cur += delta
            top = max(top, cur)
        peak_mem.append(static + top)
    return SimResult(
        schedule=problem.schedule, strategy=plan.strategy, num_gpus=plan.num_gpus, micro_batches=M,
        micro_batch_size=mbs, steps=steps, warmup_steps=warm_steps, tail_steps=tail_steps,
        throughput_samples_per_s=(M * mbs / (minibatch_ms / 1e3)) if minibatch_ms > 0 else float("inf"),
        minibatch_ms=minibatch_ms, period_ms=minibatch_ms / M, objective_ms=cost.objective_ms,
        bubble_fraction=idle / (len(used) * window) if window > 0 and used else 0.0,
        window=(w0, w1), makespan_ms=max((e.end for e in events), default=0.0),
        gpu_busy_ms=busy, gpu_utilisation=[b / window if window > 0 else 0.0 for b in busy],
        gpu_peak_memory=peak_mem, gpu_memory_limit=cluster.gpu_memory,
        stage_peak_in_flight=dict(sorted(peak_live.items())), events=events)
