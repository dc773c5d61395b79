"""Pipeline plans and the objective every partitioner is judged by (FTPipe §3.3, §4, Eq. 1).

A :class:`Plan` puts every op node of an OpGraph into exactly one stage and
every stage on one GPU; several stages may share a GPU (Mixed-pipe). The stages
form a DAG (values flow between them); a stage's *depth* is its distance, in
stages, from the end of the pipeline, which fixes how many micro-batches it
holds in flight under asynchronous and 1F1B schedules.

:func:`evaluate` prices a plan:

* stage period (Eq. 1): ``T = C + max(0, Tcomm_fwd - C) + max(0, Tcomm_bwd - C)``
  with ``C`` the stage's forward + backward (+ recomputation where the schedule
  recomputes: every stage but the last under the async FTPipe schedule, §4.3);
* GPU load: the sum of the periods of the stages it hosts; the plan's objective
  is the largest GPU load;
* memory per GPU for the schedule and optimizer: parameters (each tensor once per
  GPU that uses it), gradients, optimizer state, the extra weight versions the
  schedule keeps (PipeDream depth+1, 2BW two, 2GW two for group G0 only, WPipe
  Table 1) and the activations of the micro-batches in flight.
"""

from __future__ import annotations

import functools

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Iterable

import networkx as nx
import numpy as np

from .cluster import ClusterSpec
from .ir import OpGraph, atomic_write_text
from .profile import Profile
from .units import format_bytes

SCHEDULES = ("gpipe", "1f1b", "async", "pipedream", "2bw", "2gw")
PLAN_VERSION = 1
PLAN_FORMAT = "ftcompile.plan"


class PlanError(ValueError):
    """A plan is malformed, or does not fit its graph."""


@dataclass
class Stage:
    """One pipeline stage: a set of op nodes placed on one GPU."""

    id: int
    gpu: int
    nodes: list[int]


@dataclass
class Plan:
    """An assignment of op nodes to stages and of stages to GPUs."""

    strategy: str
    num_gpus: int
    stages: list[Stage]
    info: dict = field(default_factory=dict)   # what the partitioner wants to say (L, seeds, bound...)

    def stage_of(self) -> dict[int, int]:
        return {n: s.id for s in self.stages for n in s.nodes}

    def gpus(self) -> list[int]:
        return sorted({s.gpu for s in self.stages})

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "num_gpus": self.num_gpus, "info": self.info,
                "stages": [asdict(s) for s in self.stages]}

    @staticmethod
    def from_json(d: dict) -> "Plan":
        return Plan(strategy=d["strategy"], num_gpus=int(d["num_gpus"]), info=d.get("info", {}),
                    stages=[Stage(int(s["id"]), int(s["gpu"]), [int(n) for n in s["nodes"]]) for s in d["stages"]])


@dataclass(frozen=True)
class Problem:
    """Everything a partitioner needs: the graph, its costs, the cluster and how it will train."""

    graph: OpGraph
    profile: Profile
    cluster: ClusterSpec
    schedule: str = "async"
    micro_batches: int = 4
    recompute: bool | None = None       # None: the schedule's default

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.micro_batches < 1:
            raise PlanError(f"micro-batches must be at least 1, got {self.micro_batches}")

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    @functools.cached_property
    def lower_bound_ms(self) -> float:
        """:func:`lower_bound`, computed once per problem: evaluate() asks for it thousands of
        times. The value travels with the problem when it is pickled to worker processes."""
        return _lower_bound(self)

    def recomputes(self, is_last: bool) -> bool:
        """Whether a stage recomputes its forward in backward under this schedule."""
        if self.schedule == "async":
            return not is_last          # FTPipe §4.3: the last stage does not recompute
        if self.recompute is not None:
            return self.recompute and not is_last
        return False


@dataclass
class StageCost:
    id: int
    gpu: int
    depth: int
    forward_ms: float
    backward_ms: float
    recompute_ms: float
    comm_fwd_ms: float
    comm_bwd_ms: float
    period_ms: float
    send_bytes: int
    recv_bytes: int
    activation_bytes: int           # full activations of one micro-batch
    input_bytes: int                # stage inputs of one micro-batch (what recomputation keeps)
    in_flight: int
    memory_bytes: int               # activations this stage holds at peak (weights counted per GPU)


@dataclass
class GpuCost:
    gpu: int
    stages: list[int]
    load_ms: float
    compute_ms: float
    comm_ms: float
    param_bytes: int
    weight_version_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    memory_bytes: int
    memory_limit: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit


@dataclass
class PlanCost:
    """What a plan costs; ``objective_ms`` is the period per micro-batch (lower is better)."""

    objective_ms: float
    lower_bound_ms: float
    work_ms: float                   # all stages' compute, as the schedule runs it
    speedup: float                   # work / objective: FTPipe's "expected speed-up"
    efficiency: float                # lower_bound / objective
    feasible: bool
    reason: str | None
    max_memory_bytes: int
    stages: list[StageCost]
    gpus: list[GpuCost]

    def to_json(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- structure

def check_plan(graph: OpGraph, plan: Plan) -> None:
    """Every op node in exactly one stage, stages on existing GPUs, and an acyclic stage graph."""
    op_ids = {n.id for n in graph.op_nodes()}
    seen: dict[int, int] = {}
    ids = set()
    for s in plan.stages:
        if s.id in ids:
            raise PlanError(f"stage id {s.id} appears twice")
        ids.add(s.id)
        if not 0 <= s.gpu < plan.num_gpus:
            raise PlanError(f"stage {s.id} is on GPU {s.gpu}, but the plan has {plan.num_gpus} GPUs")
        if not s.nodes:
            raise PlanError(f"stage {s.id} is empty")
        for n in s.nodes:
            if n not in op_ids:
                raise PlanError(f"stage {s.id} holds node {n}, which is not an op node of the graph")
            if n in seen:
                raise PlanError(f"node {n} is in stages {seen[n]} and {s.id}")
            seen[n] = s.id
    missing = op_ids - set(seen)
    if missing:
        raise PlanError(f"{len(missing)} op nodes are in no stage (e.g. {sorted(missing)[:5]})")
    sg = stage_graph(graph, plan)
    if not nx.is_directed_acyclic_graph(sg):
        cyc = nx.find_cycle(sg)
        raise PlanError(f"the stage graph has a cycle: {' -> '.join(str(e[0]) for e in cyc)}")


def stage_graph(graph: OpGraph, plan: Plan) -> nx.DiGraph:
    """Stages as a DiGraph; edge data ``values`` maps value name -> bytes crossing the edge."""
    where = plan.stage_of()
    g = nx.DiGraph()
    g.add_nodes_from(s.id for s in plan.stages)
    for e in graph.edges:
        a, b = where.get(e.src), where.get(e.dst)
        if a is None or b is None or a == b:
            continue
        data = g.get_edge_data(a, b)
        if data is None:
            g.add_edge(a, b, values={})
            data = g.get_edge_data(a, b)
        data["values"][e.value] = e.bytes
    return g


def stage_depths(sg: nx.DiGraph) -> dict[int, int]:
    """Longest distance, in stages, from each stage to a sink of the stage graph."""
    depth: dict[int, int] = {}
    for s in reversed(list(nx.topological_sort(sg))):
        succ = list(sg.successors(s))
        depth[s] = 1 + max(depth[t] for t in succ) if succ else 0
    return depth


def ordered(plan: Plan, graph: OpGraph) -> Plan:
    """The plan with stages renumbered in topological order of the stage graph (ties: GPU)."""
    sg = stage_graph(graph, plan)
    by_id = {s.id: s for s in plan.stages}
    first = {s.id: min(s.nodes) for s in plan.stages}
    order = list(nx.lexicographical_topological_sort(sg, key=lambda s: first[s]))
    stages = [Stage(i, by_id[s].gpu, sorted(by_id[s].nodes)) for i, s in enumerate(order)]
    return Plan(plan.strategy, plan.num_gpus, stages, dict(plan.info))


# --------------------------------------------------------------------------- costs

def _in_flight(schedule: str, depth: int, micro_batches: int, group0: bool) -> int:
    if schedule == "gpipe":
        return micro_batches
    if schedule in ("1f1b", "2bw"):
        return min(micro_batches, depth + 1)
    if schedule in ("async", "pipedream"):
        return depth + 1
    if schedule == "2gw":
        # WPipe §3.3: G0 keeps all M micro-batches of a period, G1 one fewer per stage of depth.
        return micro_batches if group0 else min(micro_batches, depth + 1)
    raise PlanError(f"unknown schedule {schedule!r}")


def _extra_weight_versions(schedule: str, depth: int, group0: bool) -> int:
    if schedule == "pipedream":
        return depth            # a worker of depth d stashes d+1 versions (WPipe Table 1: N - i)
    if schedule == "2bw":
        return 1
    if schedule == "2gw":
        return 1 if group0 else 0
    return 0


#: Larger graphs skip the closure rule of lower_bound (its n x n bits would pass 100 MB).
_CLOSURE_MAX_NODES = 30_000


def lower_bound(problem: Problem) -> float:
    """A proven lower bound on the objective of any plan that fits, in ms per micro-batch.

    With total work ``W`` (forward + backward, plus recomputation where stages
    recompute) spread over ``P`` GPUs, the period ``T`` is at least ``W / P``.
    Under schedules where the last stage skips recomputation (async), that stage
    saves at most ``f(T)``, so ``P T >= W - f(T)``; the smallest such ``T`` is
    found by bisection (``f`` increases with ``T``).

    ``f(T)`` is a fractional knapsack: the most recomputation a set of nodes
    whose forward + backward fits in ``T`` can carry, best recompute-to-work
    ratio first, over the nodes that *may* be in the last stage. The last stage
    holds the loss and is a sink of the stage graph, so with node ``v`` it holds
    every descendant of ``v`` and of the loss: ``v`` is eligible only if that
    closure's forward + backward fits in ``T`` (the last stage's load) and the
    closure's weights, gradients and optimizer state (each parameter charged to
    one of its users) plus one micro-batch of its activations (the last stage
    keeps them, as it does not recompute) fit in one GPU's memory. On T5 this
    keeps the encoder, whose closure is the whole decoder, out of the knapsack.
    Graphs without a loss node let every sink stage skip recomputation; there
    the knapsack's budget is ``P T`` with no closure rule. Graphs of more than
    30,000 op nodes skip the closure rule (a weaker, still valid bound).

    The value depends only on the problem, so it is kept on it
    (:attr:`Problem.lower_bound_ms`; a Problem is frozen, and its graph and
    profile are not changed once a problem holds them).
    """
    return problem.lower_bound_ms


def _lower_bound(problem: Problem) -> float:
    graph, prof = problem.graph, problem.profile
    recompute_all = problem.schedule == "async" or bool(problem.recompute)
    ops = list(graph.op_nodes())
    P = problem.num_gpus
    base = np.array([prof.nodes[n.id].forward_ms + prof.nodes[n.id].backward_ms for n in ops], dtype=float)
    rec = np.array([prof.nodes[n.id].recompute_ms for n in ops], dtype=float) if recompute_all \
        else np.zeros(len(ops))
    work = float(base.sum() + rec.sum())
    if not ops or not (rec > 0).any():
        return work / P
    loss = next((i for i, n in enumerate(ops) if n.is_loss), None)
    costs = _closure_costs(problem, ops, base, loss) \
        if loss is not None and len(ops) <= _CLOSURE_MAX_NODES else None
    if costs is not None:
        clos_base, clos_mem = costs
        with_rec = rec > 0
        clos_base, clos_mem = clos_base[with_rec], clos_mem[with_rec]
    b_items, r_items = base[rec > 0], rec[rec > 0]
    # Best recompute-to-work ratio first; items without work (pure gain) lead.
    ratio = np.where(b_items > 0, r_items / np.where(b_items > 0, b_items, 1.0), np.inf)
    order = np.argsort(-ratio, kind="stable")
    b_items, r_items = b_items[order], r_items[order]
    if costs is not None:
        clos_base, clos_mem = clos_base[order], clos_mem[order]
        # (float sums: a hair of slack, so that rounding only ever admits more nodes)
        fits_memory = clos_mem <= problem.cluster.gpu_memory * (1 + 1e-9)

    def skip(budget: float, eligible) -> float:
        b, r = (b_items, r_items) if eligible is None else (b_items[eligible], r_items[eligible])
        if not len(b):
            return 0.0
        cum_b, cum_r = np.cumsum(b), np.cumsum(r)
        # Whole items while their work fits the budget, then a fraction of the next one.
        i = int(np.searchsorted(cum_b, budget, side="right"))
        got = float(cum_r[i - 1]) if i > 0 else 0.0
        if i < len(b):
            left = budget - (float(cum_b[i - 1]) if i > 0 else 0.0)
            got += float(r[i]) * left / float(b[i])
        return got

    def saved(T: float) -> float:
        if loss is None:
            return skip(P * T, None)
        if costs is None:
            return skip(T, None)
        return skip(T, fits_memory & (clos_base <= T * (1 + 1e-9)))

    lo, hi = 0.0, work / P
    for _ in range(64):
        mid = (lo + hi) / 2
        if P * mid >= work - saved(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _closure_costs(problem: Problem, ops: list, base: np.ndarray,
                   loss: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per op node ``v``: forward + backward, and a lower bound on the memory, of ``v``, the loss
    (``ops[loss]``) and all their descendants (the least a last stage holding ``v`` holds).

    Memory: each parameter's weights, gradients and optimizer state charged to its last
    user (so a set holding that user holds the parameter), plus activations. ``ops`` must
    be in topological order (as ``graph.nodes`` is); None if an edge says otherwise.
    """
    graph, prof = problem.graph, problem.profile
    n = len(ops)
    pos = {node.id: i for i, node in enumerate(ops)}
    last_user: dict[str, int] = {}
    for i, node in enumerate(ops):
        for prm in node.params:
            last_user[prm] = i
    mem = np.array([prof.nodes[node.id].activation_bytes for node in ops], dtype=float)
    for prm, i in last_user.items():
        mem[i] += prof.params[prm].total
    # Descendant sets as bit rows (n x n bits), built in reverse topological order.
    width = (n + 7) // 8
    reach = np.zeros((n, width), dtype=np.uint8)
    for i in range(n - 1, -1, -1):
        row = reach[i]
        row[i >> 3] |= 128 >> (i & 7)
        for e in graph.out_edges(ops[i].id):
            j = pos.get(e.dst)
            if j is None or j == i:
                continue
            if j < i:
                return None
            row |= reach[j]
    reach |= reach[loss].copy()
    weights = np.stack([base, mem], axis=1)
    sums = np.empty((n, 2))
    for a in range(0, n, 1024):
        sums[a:a + 1024] = np.unpackbits(reach[a:a + 1024], axis=1, count=n).astype(np.float64) @ weights
    return sums[:, 0], sums[:, 1]


def evaluate(problem: Problem, plan: Plan) -> PlanCost:
    """Price ``plan``: stage periods (Eq. 1), GPU loads, memory per GPU, feasibility."""
    graph, prof, cluster = problem.graph, problem.profile, problem.cluster
    check_plan(graph, plan)
    sg = stage_graph(graph, plan)
    depth = stage_depths(sg)
    topo = list(nx.topological_sort(sg))
    half = {s: i < (len(topo) + 1) // 2 for i, s in enumerate(topo)}   # 2GW: first half is G0
    gpu_of = {s.id: s.gpu for s in plan.stages}
    where = plan.stage_of()
    loss_stage = where.get(next((n.id for n in graph.nodes if n.is_loss), -1))

    stage_costs: list[StageCost] = []
    for s in plan.stages:
        nodes = s.nodes
        fwd = sum(prof.nodes[n].forward_ms for n in nodes)
        bwd = sum(prof.nodes[n].backward_ms for n in nodes)
        is_last = depth[s.id] == 0 and (loss_stage is None or loss_stage == s.id)
        rec = sum(prof.nodes[n].recompute_ms for n in nodes) if problem.recomputes(is_last) else 0.0
        compute = fwd + bwd + rec
        # Forward: each value goes once to each GPU that reads it. Backward: the gradient of
        # each floating value received comes back over the same link.
        send_ms = recv_ms = 0.0
        send_b = recv_b = 0
        sent: set[tuple[str, int]] = set()
        for t in sg.successors(s.id):
            for v, b in sg.edges[s.id, t]["values"].items():
                key = (v, gpu_of[t])
                if key in sent:
                    continue
                sent.add(key)
                send_b += b
                send_ms += b / cluster.bandwidth(s.gpu, gpu_of[t]) * 1e3
        got: set[str] = set()
        for u in sg.predecessors(s.id):
            for v, b in sg.edges[u, s.id]["values"].items():
                if v in got:
                    continue
                got.add(v)
                recv_b += b
                if graph.node(graph.producer(v)).outputs[v].tensor is not None and \
                        graph.node(graph.producer(v)).outputs[v].tensor.is_floating:
                    recv_ms += b / cluster.bandwidth(gpu_of[u], s.gpu) * 1e3
        period = compute + max(0.0, send_ms - compute) + max(0.0, recv_ms - compute)
        act_full = sum(prof.nodes[n].activation_bytes for n in nodes)
        graph_inputs = sum(e.bytes for n in nodes for e in graph.in_edges(n)
                           if graph.node(e.src).kind == "input")
        act_in = recv_b + graph_inputs
        k = _in_flight(problem.schedule, depth[s.id], problem.micro_batches, half[s.id])
        if problem.recomputes(is_last):
            held = k * act_in
        else:
            held = k * act_full
        stage_costs.append(StageCost(
            id=s.id, gpu=s.gpu, depth=depth[s.id], forward_ms=fwd, backward_ms=bwd, recompute_ms=rec,
            comm_fwd_ms=send_ms, comm_bwd_ms=recv_ms, period_ms=period, send_bytes=send_b, recv_bytes=recv_b,
            activation_bytes=act_full, input_bytes=act_in, in_flight=k, memory_bytes=held))

    by_gpu: dict[int, list[StageCost]] = {}
    for sc in stage_costs:
        by_gpu.setdefault(sc.gpu, []).append(sc)
    nodes_of_stage = {s.id: s.nodes for s in plan.stages}
    gpu_costs: list[GpuCost] = []
    for g in range(plan.num_gpus):
        scs = by_gpu.get(g, [])
        params: dict[str, int] = {}     # param -> extra versions needed on this GPU
        for sc in scs:
            extra = _extra_weight_versions(problem.schedule, sc.depth, half[sc.id])
            for n in nodes_of_stage[sc.id]:
                for p in graph.node(n).params:
                    params[p] = max(params.get(p, 0), extra)
        pb = sum(prof.params[p].bytes for p in params)
        wv = sum(prof.params[p].bytes * extra for p, extra in params.items())
        gb = sum(prof.params[p].grad_bytes for p in params)
        ob = sum(prof.params[p].optimizer_bytes for p in params)
        held = sum(sc.memory_bytes for sc in scs)
        # Recomputation rebuilds one micro-batch's full activations of one stage at a time.
        transient = max((sc.activation_bytes for sc in scs if sc.recompute_ms > 0), default=0)
        act = held + transient
        gpu_costs.append(GpuCost(
            gpu=g, stages=[sc.id for sc in scs], load_ms=sum(sc.period_ms for sc in scs),
            compute_ms=sum(sc.forward_ms + sc.backward_ms + sc.recompute_ms for sc in scs),
            comm_ms=sum(sc.comm_fwd_ms + sc.comm_bwd_ms for sc in scs),
            param_bytes=pb, weight_version_bytes=wv, grad_bytes=gb, optimizer_bytes=ob,
            activation_bytes=act, memory_bytes=pb + wv + gb + ob + act, memory_limit=cluster.gpu_memory))

    objective = max((g.load_ms for g in gpu_costs), default=0.0)
    work = sum(sc.forward_ms + sc.backward_ms + sc.recompute_ms for sc in stage_costs)
    lb = lower_bound(problem)
    over = [g for g in gpu_costs if not g.fits]
    reason = None
    if over:
        worst = max(over, key=lambda g: g.memory_bytes)
        reason = (f"GPU {worst.gpu} needs {format_bytes(worst.memory_bytes)} but has "
                  f"{format_bytes(cluster.gpu_memory)}")
    return PlanCost(
        objective_ms=objective, lower_bound_ms=lb, work_ms=work,
        speedup=work / objective if objective > 0 else 0.0,
        efficiency=lb / objective if objective > 0 else 0.0,
        feasible=not over, reason=reason, max_memory_bytes=max((g.memory_bytes for g in gpu_costs), default=0),
        stages=stage_costs, gpus=gpu_costs)


def total_param_memory(problem: Problem, nodes: Iterable[int]) -> int:
    """Weights + gradients + optimizer state of the parameters a set of nodes reads (each once)."""
    names = {p for n in nodes for p in problem.graph.node(n).params}
    return sum(problem.profile.params[p].total for p in names)


# --------------------------------------------------------------------------- files

def save_json(path: str | os.PathLike, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))


def load_plan_file(path: str | os.PathLike) -> dict:
    """Read a plan.json (or an output dir holding one); refuse anything else clearly."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "plan.json")
    try:
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"no plan at {p}; make one with `ftcompile compile MODEL -o DIR`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"{p} is not valid JSON ({exc}); re-run `ftcompile compile`") from None
    if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
        raise PlanError(f"{p} is not an ftcompile plan (no 'format': '{PLAN_FORMAT}')")
    if d.get("version") != PLAN_VERSION:
        raise PlanError(f"{p} has plan version {d.get('version')!r}; this ftcompile reads {PLAN_VERSION}")
    return d
