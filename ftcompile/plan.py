"""Pipeline plans and the objective every partitioner is judged by (FTPipe §3.3, §4, Eq. 1).

A :class:`Plan` puts every op node of an OpGraph into exactly one stage and
every stage on one GPU; several stages may share a GPU (Mixed-pipe). The stages
form a DAG (values flow between them); a stage's *depth* is its distance, in
stages, from the end of the pipeline, which fixes how many micro-batches it
holds in flight under asynchronous and 1F1B schedules.

:func:`evaluate` prices a plan:

* stage period (Eq. 1): ``T = C + max(0, Tcomm_fwd - C) + max(0, Tcomm_bwd - C)``
  with ``C`` the stage's forward + backward (+ recomputation where the stage
  recomputes) + its share ``U / M`` of the optimizer update that closes every step;
* GPU load: the sum of the periods of the stages it hosts; the plan's objective
  is the largest GPU load;
* memory per GPU: everything the runtime holds (see :class:`GpuCost`): the
  weights, gradients and optimizer state of every stage (a stage holds its own
  copy of a tensor it shares with another stage), the extra weight versions its
  schedule keeps, the activations of its micro-batches in flight, the receive
  buffers flow control allows, outputs waiting to be sent, the data of the steps
  in flight, the largest transient of one task (a recomputation rebuilding a
  stage's activations, the activation gradients of a backward, weight-prediction
  copies, the optimizer's temporaries), and the hardware's reserve for the CUDA
  context, workspaces and allocator fragmentation.

What a schedule makes a stage hold (micro-batches in flight, weight versions,
whether it recomputes) comes from the runtime's own task programs
(:mod:`ftcompile.runtime.schedules`), so the cost model, the simulator and the
runtime share one definition.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Iterable

import networkx as nx
import numpy as np

from .cluster import ClusterSpec
from .hardware import HardwareSpec, load_hardware
from .ir import OpGraph, atomic_write_text
from .profile import Profile, held_activation_bytes
from .runtime.allreduce import BUCKET_BYTES as ALLREDUCE_BUCKET_BYTES
from .runtime.pacing import lead_part, pacer, parts
from .runtime.schedules import (SCHEDULES, StageProgram, exchanges_norms, flow_control, flow_window, shared_lag,
                                stage_program, stage_programs)
from .units import format_bytes

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
    # Simulations already run of this plan (and of the alternative a strategy notes), keyed by
    # the problem's run settings and simulation_key, so that a strategy's choice, compile's row
    # and the report's timeline share one replay (hundreds of stages take a minute). Never
    # written to JSON; for the graph and costs the plan was made for (ftcompile.simulate.simulation_of).
    simulations: dict = field(default_factory=dict, compare=False, repr=False)

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
    # Run settings that change what a plan costs (``ftcompile run`` takes them as the plan's):
    clip_grad_norm: float | None = None     # clip the global gradient norm to this (all stages exchange norms)
    on_nonfinite: str = "stop"              # "skip": every update waits for all stages' finite check
    tied_lag: bool = True                   # False: tied tensors never lag (less memory, a wait per update)
    weight_prediction: bool = False     # async: forwards on predicted weights (a copy per forward)
    # Replicas of this pipeline (data x pipeline parallelism): every update first averages each
    # stage's gradients over a ring of ``replicas`` GPUs whose slowest link, per pipeline GPU, is
    # ``ring_bandwidth[gpu]`` (see ftcompile.replicas).
    replicas: int = 1
    ring_bandwidth: tuple[float, ...] | None = None
    advance: int = 0                    # avgpipe: micro-batches forwarded in advance of 1F1B's warm-up
    # async, pipedream, 2bw: every stage runs in_flight_scale * depth + 1 forwards before its first
    # backward (runtime.schedules.StageProgram.in_flight_scale; chosen by ftcompile.inflight)
    in_flight_scale: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.micro_batches < 1:
            raise PlanError(f"micro-batches must be at least 1, got {self.micro_batches}")
        if self.replicas < 1:
            raise PlanError(f"replicas must be at least 1, got {self.replicas}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise PlanError(f"on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if isinstance(self.in_flight_scale, bool) or not isinstance(self.in_flight_scale, int) or self.in_flight_scale < 1:
            raise PlanError(f"the in-flight scale must be a whole number of at least 1, got {self.in_flight_scale!r}")

    def allreduce_ms(self, gpu: int, nbytes: int) -> float:
        """Averaging ``nbytes`` of gradients over the replicas of pipeline GPU ``gpu``."""
        if self.replicas < 2:
            return 0.0
        from .replicas import allreduce_ms

        bw = self.ring_bandwidth[gpu] if self.ring_bandwidth else self.cluster.inter_node_bandwidth
        return allreduce_ms(nbytes, self.replicas, bw)

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    @functools.cached_property
    def lower_bound_ms(self) -> float:
        """:func:`lower_bound`, computed once per problem: evaluate() asks for it thousands of
        times. The value travels with the problem when it is pickled to worker processes."""
        return _lower_bound(self)

    @functools.cached_property
    def hardware(self) -> HardwareSpec | None:
        """The cluster's hardware spec (reserve, memory bandwidth for the update), or None if unknown."""
        try:
            return load_hardware(self.cluster.hardware)
        except Exception:  # noqa: BLE001 - a measured profile's cluster may name no spec
            return None

    @property
    def memory_reserve(self) -> int:
        """Bytes kept free on every GPU for the CUDA context, workspaces and fragmentation."""
        return self.hardware.memory_reserve_bytes if self.hardware is not None else 0

    def program(self, depth: int, group: int = 0) -> StageProgram:
        """The runtime's program of a stage at ``depth`` (one step's worth; its figures are per step)."""
        return stage_program(self.schedule, -1, depth=depth, micro_batches=self.micro_batches, steps=1,
                             recompute=self.recompute, group=group, advance=self.advance,
                             in_flight_scale=self.in_flight_scale)

    def programs(self, depths: dict[int, int], steps: int = 1) -> dict[int, StageProgram]:
        """Every stage's runtime program (stage id -> depth), 2gw groups included."""
        return stage_programs(self.schedule, depths, micro_batches=self.micro_batches, steps=steps,
                              recompute=self.recompute, advance=self.advance,
                              in_flight_scale=self.in_flight_scale)

    @functools.cached_property
    def shared_lag(self) -> int:
        """Steps by which shared (tied) tensors apply their summed gradient late under this
        schedule (:func:`~ftcompile.runtime.schedules.shared_lag`; none where :attr:`exchanges_norms`).
        Computed once: the simulator asks at every update it considers."""
        return shared_lag(self.schedule, self.exchanges_norms, self.tied_lag)

    @property
    def exchanges_norms(self) -> bool:
        """Whether every update first waits for a value of all stages: the global gradient norm
        (clipping) or whether every stage's gradients are finite (``on_nonfinite="skip"``). The
        runtime asks the same (:func:`~ftcompile.runtime.schedules.exchanges_norms`)."""
        return exchanges_norms(self.clip_grad_norm, self.on_nonfinite)

    def recomputes(self, is_last: bool) -> bool:
        """Whether a stage recomputes its forward in backward: at the end of the pipeline
        (``is_last``: depth 0) or inside it (see :attr:`StageProgram.recompute`).

        The one statement of which stages recompute that the bounds and the partitioners read.
        Under 2gw a stage's program also depends on its group
        (:func:`~ftcompile.runtime.schedules.groups_2gw`; a stage at depth 0 is in the second,
        which does not recompute there): a stage counts as recomputing only where it does in
        every group, so what is charged for it is never more than the runtime runs. The group
        is ignored by the other schedules."""
        depth = 0 if is_last else 1
        return all(self.program(depth, g).recompute for g in (0, 1))

    @functools.cached_property
    def feeds_loss(self) -> frozenset[int]:
        """The op nodes with a path to the loss node, the loss included; empty without a loss node.

        Only these must be in the last stage to skip recomputation there. Any other node can be
        in a sink stage of its own (a side output; anything after the loss), and a sink stage is
        at depth 0, where the end of the pipeline skips recomputation (:meth:`recomputes`)."""
        ops = {n.id for n in self.graph.op_nodes()}
        loss = next((n.id for n in self.graph.op_nodes() if n.is_loss), None)
        if loss is None:
            return frozenset()
        seen, todo = {loss}, [loss]
        while todo:
            for e in self.graph.in_edges(todo.pop()):
                if e.src not in seen:
                    seen.add(e.src)
                    todo.append(e.src)
        return frozenset(seen & ops)

    @functools.cached_property
    def grad_values(self) -> frozenset[str]:
        """Values a gradient flows back through (floating, depending on a trainable parameter): the
        runtime sends gradients, and takes them as bounding its producer, for these only.

        From the nodes' instructions, as code generation decides it; a graph without instructions
        (a hand-built or imported graph) is judged by node: every floating output of a node that
        reads a trainable parameter or such a value."""
        if any(n.instrs for n in self.graph.op_nodes()):
            from .codegen import requires_grad_values

            return frozenset(requires_grad_values(self.graph))
        trainable = {p.name for p in self.graph.params.values() if p.trainable}
        out: set[str] = set()
        for node in self.graph.nodes:        # topological order
            if node.kind != "op":
                continue
            if any(p in trainable for p in node.params) or any(e.value in out for e in self.graph.in_edges(node.id)):
                out.update(v for v, meta in node.outputs.items() if meta.tensor is not None and meta.tensor.is_floating)
        return frozenset(out)

    @functools.cached_property
    def node_working_sets(self) -> dict[int, tuple[int, int]]:
        """:func:`working_sets` of each op node alone, computed once per problem: exact's memory
        rows read every node's at each MIP they build."""
        return {n.id: working_sets(self, [n.id]) for n in self.graph.op_nodes()}

    def update_ms(self, param_names) -> float:
        """The optimizer step over these parameters (:func:`update_time_ms`)."""
        return update_time_ms(self, param_names)


def update_time_ms(problem: Problem, param_names) -> float:
    """Time of one optimizer step over ``param_names``: memory-bound, it reads the weights, gradients
    and optimizer state and writes weights and state back, plus a kernel launch per tensor and
    state tensor. Priced on the cluster's hardware at its memory efficiency."""
    hw = problem.hardware
    prof = problem.profile
    traffic = 0.0
    tensors = 0
    for n in param_names:
        c = prof.params.get(n)
        if c is None or not c.grad_bytes:
            continue
        traffic += 2 * c.bytes + c.grad_bytes + 2 * c.optimizer_bytes
        tensors += 1 + (2 if c.optimizer_bytes else 0)
    if hw is None or not traffic:
        return 0.0
    return (traffic / (hw.memory_bandwidth * hw.memory_efficiency) + tensors * hw.kernel_overhead_s) * 1e3


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
    update_ms: float = 0.0          # the optimizer step closing every step (once per M micro-batches)
    recomputes: bool = False
    weight_versions: int = 0        # extra weight copies the schedule keeps
    param_bytes: int = 0            # weights and buffers the stage holds (its own copy)
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    trainable_bytes: int = 0        # the weights among param_bytes that train (what a version copies)
    transient_bytes: int = 0        # the most one task adds while it runs (see evaluate)
    group: int = 0                  # 2gw group
    grads_back_bytes: int = 0       # gradients of its outputs its readers send back, per micro-batch
    allreduce_ms: float = 0.0       # averaging its gradients over the replicas, once per step


@dataclass
class GpuCost:
    """What a GPU holds at its peak, by kind (bytes), and its load."""

    gpu: int
    stages: list[int]
    load_ms: float
    compute_ms: float
    comm_ms: float
    param_bytes: int                # weights and buffers, per stage holding them
    weight_version_bytes: int       # extra versions the schedule keeps
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int           # held activations + buffers + the largest transient
    memory_bytes: int               # everything, reserve included
    memory_limit: int
    held_bytes: int = 0             # activations of the micro-batches in flight
    receive_bytes: int = 0          # values waiting for their reader (flow-control windows)
    send_bytes: int = 0             # outputs waiting to be sent
    data_bytes: int = 0             # the graph inputs of the steps in flight
    transient_bytes: int = 0        # the largest task transient of its stages
    reserve_bytes: int = 0          # CUDA context, workspaces, fragmentation

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

    @property
    def overflow_bytes(self) -> int:
        """Bytes by which the GPUs together exceed their memory limits (0 when every GPU fits)."""
        return sum(max(0, g.memory_bytes - g.memory_limit) for g in self.gpus)

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


def ordered(plan: Plan, graph: OpGraph, kinds: dict[int, object] | None = None) -> Plan:
    """The plan as it runs: every lone stage joined to another on its GPU (:func:`join_unpaced_stages`,
    which reads ``kinds``), and the stages renumbered in topological order of the stage graph
    (ties: first node)."""
    plan = join_unpaced_stages(plan, graph, kinds)
    sg = stage_graph(graph, plan)
    by_id = {s.id: s for s in plan.stages}
    first = {s.id: min(s.nodes) for s in plan.stages}
    order = list(nx.lexicographical_topological_sort(sg, key=lambda s: first[s]))
    stages = [Stage(i, by_id[s].gpu, sorted(by_id[s].nodes)) for i, s in enumerate(order)]
    # The same simulations dict: keyed by the exact stages, an entry holds for whichever plan matches.
    return Plan(plan.strategy, plan.num_gpus, stages, dict(plan.info), plan.simulations)


def join_unpaced_stages(plan: Plan, graph: OpGraph, kinds: dict[int, object] | None = None) -> Plan:
    """``plan`` with every part of its stage graph that no edge links to the loss's stage tied to
    it: one of the part's stages joins a stage of the loss's part on its GPU.

    Such a part is paced by nothing: its sources wait for no producer's values and its sinks for
    no reader's window. A lone stage (a BatchNorm's step counter, dead code) is one; so is dead
    code spread over two GPUs (traced Llama on 4 GPUs: ``arange`` on GPU 0 feeding three unused
    ``unsqueeze`` on GPU 2). Under async it runs through its steps ahead of the rest, as far as
    the run goes, and every step it begins is a step of graph inputs its GPU holds beside those
    the other stages are still on (ResNet's counters on 4 GPUs: 101 steps, 20.0 MB simulated
    against evaluate's 2.6 MB; Llama's dead code: 69 x evaluate's data on GPU 0). Joined, the
    part runs at the pace of the stage it joined, which flow control passes on to the rest.

    A sink of the part joins first where it can: its host then gains only edges in, so no stage
    of the loss's part gets deeper. The host is the GPU's stage of the loss's part nearest the
    end of the pipeline (lowest depth; then lowest id): at depth 0, as a lone stage is, it does
    not recompute either and holds one micro-batch in flight. The stage graph stays acyclic (the
    joined stage's edges all lead within its part, which no edge links to its host's). A part
    none of whose GPUs runs a stage of the loss's part stays as it is, and so does a plan of one
    stage. Without a loss node, the part with the most op nodes leads.

    ``kinds`` (op node -> label), where given, keeps stages of different labels apart: a stage
    joins only a host whose first node has its own first node's label (freeze's stages of one
    frozen level each, which AutoCache skips whole: :func:`~ftcompile.freeze.split_frozen`).

    The parts, the lead part and the choice among hosts (:func:`~ftcompile.runtime.pacing.pacer`)
    are the runtime's, which paces what a plan still holds (:mod:`ftcompile.runtime.pacing`): a
    part no GPU of which the lead part shares, a freeze part with no host of its level, a
    hand-written plan's, stages folded onto fewer ranks. Here links are every value a part
    exchanges (a size or flag too, which the runtime never sends), so the joined plan's stage
    graph, literal edges and all, stays acyclic.
    """
    if len(plan.stages) < 2:
        return plan
    # (one pass over the edges first: every plan priced goes through here, and few have a part)
    where = plan.stage_of()
    groups = parts((s.id for s in plan.stages), ((where.get(e.src), where.get(e.dst)) for e in graph.edges))
    if len(groups) == 1:
        return plan
    loss = next((where[n.id] for n in graph.op_nodes() if n.is_loss and n.id in where), None)
    lead = lead_part(groups, loss, {st.id: len(st.nodes) for st in plan.stages})
    sg = stage_graph(graph, plan)
    depth = stage_depths(sg)
    nodes = {st.id: list(st.nodes) for st in plan.stages}
    gpu = {st.id: st.gpu for st in plan.stages}
    kind = {st.id: None if kinds is None else kinds.get(min(st.nodes)) for st in plan.stages}
    joined = False
    for i, part in enumerate(groups):
        if i == lead:
            continue
        for x in sorted(part, key=lambda x: (sg.out_degree(x) > 0, depth[x], x)):
            host = pacer((h for h in groups[lead] if gpu[h] == gpu[x] and kind[h] == kind[x]), depth)
            if host is not None:
                nodes[host] += nodes.pop(x)
                joined = True
                break
    if not joined:
        return plan
    stages = [Stage(i, gpu[x], sorted(nodes[x])) for i, x in enumerate(sorted(nodes))]
    return Plan(plan.strategy, plan.num_gpus, stages, dict(plan.info), plan.simulations)


def simulation_key(plan: Plan) -> tuple:
    """What a simulation of ``plan`` depends on in the plan itself: the GPU count and every
    stage's id, GPU and nodes (the ids set the engine's stage order)."""
    return (plan.num_gpus, tuple((s.id, s.gpu, tuple(sorted(s.nodes))) for s in plan.stages))


def run_settings_key(problem: Problem) -> tuple:
    """What a simulation depends on in ``problem`` besides its graph and costs: the cluster (GPUs,
    memory, links) and every run setting. By value, not identity: a problem copied into a worker
    process keys its replays as the original does. Every field of :class:`Problem` but the graph
    and its costs, so a setting added there is in the key without a change here."""
    return tuple(repr(getattr(problem, f.name)) for f in fields(problem) if f.name not in ("graph", "profile"))


# --------------------------------------------------------------------------- costs

def plan_windows(problem: Problem, sg: nx.DiGraph, depth: dict[int, int], progs: dict[int, StageProgram],
                 windows: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], tuple[int, bool]]:
    """The flow control of a plan: per stage edge ``(p, c)``, ``(W, credits)`` as the runtime enforces it
    (:func:`ftcompile.runtime.schedules.flow_control`).

    Unless ``windows`` says otherwise, each edge gets
    :func:`~ftcompile.runtime.schedules.flow_window`, which the runtime computes the same way
    from the stages' depths; :func:`ftcompile.simulate.simulate` replays the plan under these
    windows and reports the occupancy it saw.
    """
    graph, grad_values = problem.graph, problem.grad_values
    edges: dict[tuple[int, int], bool] = {}
    for p, c, data in sg.edges(data=True):
        if any(graph.node(graph.producer(v)).outputs[v].tensor is not None for v in data["values"]):
            edges[(p, c)] = any(v in grad_values for v in data["values"])
    structural = {(p, c): flow_window(progs[p], depth[c]) for p, c in edges}
    if windows:
        structural.update({e: w for e, w in windows.items() if e in structural})
    return flow_control(edges, {s: prog.in_flight for s, prog in progs.items()}, structural)


def flow_windows_of(problem: Problem, plan: Plan, windows: dict[tuple[int, int], int] | None = None
                    ) -> dict[tuple[int, int], int]:
    """The flow-control window of every stage edge of ``plan`` (see :func:`plan_windows`): what the
    package's manifest tells the runtime to enforce."""
    sg = stage_graph(problem.graph, plan)
    depth = stage_depths(sg)
    return {e: w for e, (w, _) in plan_windows(problem, sg, depth, problem.programs(depth), windows).items()}


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
    # Interior stages recompute (async, or --recompute); the end of the pipeline may skip it.
    recompute_all = problem.recomputes(False)
    end_skips = recompute_all and not problem.recomputes(True)
    ops = list(graph.op_nodes())
    P = problem.num_gpus
    base = np.array([prof.nodes[n.id].forward_ms + prof.nodes[n.id].backward_ms for n in ops], dtype=float)
    rec = np.array([prof.nodes[n.id].recompute_ms for n in ops], dtype=float) if recompute_all \
        else np.zeros(len(ops))
    # Every trainable tensor is updated once per step, by at least one stage.
    work = float(base.sum() + rec.sum()) + problem.update_ms(graph.params) / problem.micro_batches
    if not ops or not (rec > 0).any() or not end_skips:
        return work / P
    loss = next((i for i, n in enumerate(ops) if n.is_loss), None)
    if loss is not None and not _all_related_to(problem, ops[loss].id):
        # A node neither feeding the loss nor fed by it can end up in a sink stage of its own,
        # which also skips recomputation: only the budget of P stages holds then.
        loss = None
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


def _all_related_to(problem: Problem, loss: int) -> bool:
    """Every op node is an ancestor of the loss node ``loss`` (:attr:`Problem.feeds_loss`) or a
    descendant of it."""
    graph = problem.graph
    ops = {n.id for n in graph.op_nodes()}
    seen, todo = set(problem.feeds_loss), [loss]
    while todo:
        for e in graph.out_edges(todo.pop()):
            if e.dst in ops and e.dst not in seen:
                seen.add(e.dst)
                todo.append(e.dst)
    return seen >= ops


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


def _shared_sum_ms(problem: Problem, names: list[str], holders: dict[str, int]) -> float:
    """Summing the other holders' gradients of shared tensors before the update (one read of each
    part and a read and write of the sum per add)."""
    hw = problem.hardware
    traffic = sum(3 * problem.profile.params[n].grad_bytes * (holders[n] - 1) for n in names if holders[n] > 1)
    if hw is None or not traffic:
        return 0.0
    return traffic / (hw.memory_bandwidth * hw.memory_efficiency) * 1e3


def receive_windows(sg, flow: dict, gpu_of: dict[int, int]) -> dict[tuple[str, int], tuple[int, int]]:
    """Values waiting for a reader, per (value, GPU of the reader): ``(window, bytes)``, the window the
    widest flow-control window among that GPU's readers of it, once per GPU as the runtime keeps
    one copy."""
    waiting: dict[tuple[str, int], tuple[int, int]] = {}
    for p, c, data in sg.edges(data=True):
        w = flow[(p, c)][0] if (p, c) in flow else 1
        for v, b in data["values"].items():
            key = (v, gpu_of[c])
            waiting[key] = (max(waiting.get(key, (0, 0))[0], w), b)
    return waiting


def shared_update_transient(prof, names: Iterable[str], holders: dict[str, int]) -> int:
    """Bytes U(j) adds for the shared (tied) tensors among ``names`` held by several stages: per
    tensor the holders' sum and a zero gradient standing in for a missing own one (the runtime's
    ``_sum_shared``; the other holders' parts are theirs, or wait in :func:`shared_gradient_receive`)."""
    return sum(2 * prof.params[n].grad_bytes for n in names if holders.get(n, 0) > 1 and prof.params[n].grad_bytes)


def lags_tied_tensors(problem: Problem) -> bool:
    """Whether the tied-weight lag can cost ``problem``'s plans memory: the schedule lags shared
    tensors (:attr:`Problem.shared_lag`) and some trained tensor is read by two or more op nodes,
    so that a plan may give it two holders (:func:`shared_gradient_copies`)."""
    if not problem.shared_lag:
        return False
    readers: dict[str, int] = {}
    for node in problem.graph.op_nodes():
        for prm in set(node.params):
            if problem.profile.params[prm].grad_bytes:
                readers[prm] = readers.get(prm, 0) + 1
                if readers[prm] > 1:
                    return True
    return False


def shared_gradient_copies(remote: int, local: int, lag: int) -> int:
    """Gradients of one shared tensor a GPU keeps besides its stages' own: one per holder on
    another GPU (its part, waiting for this GPU's holders' update); where the schedule lags the
    tensor (:attr:`Problem.shared_lag`), two per holder, remote or local. A holder's part of step
    ``j`` lives until every holder's ``U(j+1)`` has used it, and it sends its part of step ``j+1``
    only once every part of step ``j`` is in (``engine._try_update``), so two of its steps at
    most are alive: its part of ``j`` may still wait for a slower holder's ``U(j+1)``."""
    return (1 + lag) * remote + 2 * lag * local


def shared_gradient_receive(graph: OpGraph, prof, stages: Iterable[tuple[int, Iterable[int]]],
                            lag: int = 0) -> dict[int, int]:
    """Per GPU: bytes of shared (tied) tensors' gradients that wait there (:func:`shared_gradient_copies`).

    ``stages`` are ``(gpu, nodes)`` pairs. At the start of its U(j) each holder sends its gradient
    once to every other GPU holding the tensor (the runtime's ``_begin_update``: one message per
    rank, read by every holder there); it waits there until that GPU's holders reach their own
    U(j) (lagging: U(j+1)), through their remaining backwards and the other stages' tasks, so it
    adds to whatever the GPU runs meanwhile. Holders on the same GPU hand over the gradient
    itself (no copy).
    """
    gpus_of: dict[str, list[int]] = {}
    for gpu, nodes in stages:
        for prm in {p for n in nodes for p in graph.node(n).params}:
            if prof.params[prm].grad_bytes:
                gpus_of.setdefault(prm, []).append(gpu)
    out: dict[int, int] = {}
    for prm, gs in gpus_of.items():
        if len(gs) < 2:
            continue
        for g in set(gs):
            remote = sum(1 for h in gs if h != g)
            n = shared_gradient_copies(remote, len(gs) - remote, lag)
            if n:
                out[g] = out.get(g, 0) + n * prof.params[prm].grad_bytes
    return out


def _stage_params(problem: Problem, nodes: Iterable[int]) -> tuple[int, int, int, int, list[str]]:
    """``(weights and buffers, gradients, optimizer state, trainable weights, names)`` a stage holds."""
    prof = problem.profile
    names = sorted({p for n in nodes for p in problem.graph.node(n).params})
    pb = gb = ob = tb = 0
    for n in names:
        c = prof.params[n]
        pb += c.bytes
        gb += c.grad_bytes
        ob += c.optimizer_bytes
        if c.grad_bytes:
            tb += c.bytes
    return pb, gb, ob, tb, names


def working_sets(problem: Problem, nodes: Iterable[int]) -> tuple[int, int]:
    """``(forward, backward)``: the most bytes a stage's forward and backward hold at once beyond
    what the stage keeps between them.

    Forward: the values alive at each node (made and not yet read for the last time; the
    generated code frees each value after its last use), plus the node's own working memory.
    Backward: the gradients alive at each node, walking the nodes in reverse: a value's
    gradient exists from the backward of its last reader in the stage (or from the start, for
    an output another stage sends it back for) until its producer's backward (or the end, for
    an input whose gradient is sent back). A node's own working memory is unknown inside
    the node; its activations stand for it (exact enough for single operators, an estimate
    for whole blocks).
    """
    graph, prof, grads = problem.graph, problem.profile, problem.grad_values
    nodes = sorted(nodes)                         # graph order is topological
    inside = set(nodes)
    size: dict[str, int] = {}
    last_read: dict[str, int] = {}
    first_read: dict[str, int] = {}
    leaves: set[str] = set()
    for i, n in enumerate(nodes):
        for e in graph.in_edges(n):
            size[e.value] = e.bytes
            last_read[e.value] = i
            first_read.setdefault(e.value, i)
        for e in graph.out_edges(n):
            size[e.value] = e.bytes
            if e.dst not in inside:
                leaves.add(e.value)
    made = {v: i for i, n in enumerate(nodes) for v in graph.node(n).outputs}
    own = [prof.nodes[n].activation_bytes for n in nodes]
    # forward
    fwd = 0
    for i in range(len(nodes)):
        live = sum(b for v, b in size.items()
                   if made.get(v, -1) <= i and (last_read.get(v, -1) >= i or (v in leaves and made.get(v, -1) >= 0)))
        fwd = max(fwd, live + own[i])
    # backward
    bwd = 0
    for i in range(len(nodes) - 1, -1, -1):
        live = 0
        for v, b in size.items():
            if v not in grads:
                continue
            born = len(nodes) if v in leaves else last_read.get(v, -1)      # first seen walking back
            dies = made.get(v, -1)                                           # -1: a stage input, sent back
            if born >= i >= dies or (dies == -1 and born >= i):
                live += b
        bwd = max(bwd, live + own[i])
    return fwd, bwd


def gpu_graph_input_bytes(graph: OpGraph, plan: Plan) -> dict[int, int]:
    """Bytes per micro-batch of the graph inputs each GPU's stages read, by GPU.

    Each input value counts once per GPU however many nodes and stages there read it: the
    runtime moves a step's batch of each input its rank reads to the device once
    (``runtime/engine.py``, ``_local_inputs``). :func:`evaluate` keeps
    ``(ceil(in flight / M) + 1) * M`` micro-batches of it, and the simulator the steps it has
    begun and not finished; both take the bytes from here.
    """
    values: dict[int, dict[str, int]] = {}
    for s in plan.stages:
        for n in s.nodes:
            for e in graph.in_edges(n):
                if graph.node(e.src).kind == "input":
                    values.setdefault(s.gpu, {})[e.value] = int(e.bytes)
    return {g: sum(vs.values()) for g, vs in values.items()}


def evaluate(problem: Problem, plan: Plan, *, windows: dict[tuple[int, int], int] | None = None) -> PlanCost:
    """Price ``plan``: stage periods (Eq. 1), GPU loads, memory per GPU, feasibility.

    ``windows`` are flow-control windows per stage edge (see :func:`plan_windows`); by default
    the structural ones. Every memory term is an upper bound of what the runtime holds under
    those windows, except the backward's activation gradients, which are estimated as the
    gradients of the stage's inputs and outputs plus its largest node's activations.
    """
    graph, prof, cluster = problem.graph, problem.profile, problem.cluster
    check_plan(graph, plan)
    sg = stage_graph(graph, plan)
    depth = stage_depths(sg)
    progs = problem.programs(depth)
    flow = plan_windows(problem, sg, depth, progs, windows)
    gpu_of = {s.id: s.gpu for s in plan.stages}
    grad_values = problem.grad_values
    M = problem.micro_batches
    shared_holders: dict[str, int] = {}
    for s in plan.stages:
        for prm in {p for n in s.nodes for p in graph.node(n).params}:
            shared_holders[prm] = shared_holders.get(prm, 0) + 1

    stage_costs: list[StageCost] = []
    for s in plan.stages:
        nodes = s.nodes
        prog = progs[s.id]
        fwd = sum(prof.nodes[n].forward_ms for n in nodes)
        bwd = sum(prof.nodes[n].backward_ms for n in nodes)
        rec = sum(prof.nodes[n].recompute_ms for n in nodes) if prog.recompute else 0.0
        pb, gb, ob, tb, names = _stage_params(problem, nodes)
        upd = problem.update_ms(names) + _shared_sum_ms(problem, names, shared_holders)
        compute = fwd + bwd + rec + upd / M
        # Forward: each value goes once to each GPU that reads it. Backward: the gradient of
        # each value received that carries one comes back over the same link.
        send_ms = recv_ms = 0.0
        send_b = recv_b = 0
        in_grad_b = 0
        sent: set[tuple[str, int]] = set()
        for t in sg.successors(s.id):
            for v, b in sg.edges[s.id, t]["values"].items():
                key = (v, gpu_of[t])
                if key in sent:
                    continue
                sent.add(key)
                send_b += b
                send_ms += b / cluster.bandwidth(s.gpu, gpu_of[t]) * 1e3
        # Gradients coming back: the readers' parts of each value join one running sum as they
        # arrive (the runtime sums them in a fixed order, nearest the end of the pipeline first,
        # which is how they come), and the sums wait here for this stage's backward of their
        # micro-batch: as many micro-batches as the stage holds in flight at most (a stage
        # slower than its readers sees them all arrive before it gets to them).
        grads_back = sum({v: b for t in sg.successors(s.id) for v, b in sg.edges[s.id, t]["values"].items()
                          if v in grad_values}.values())
        got: set[str] = set()
        for u in sg.predecessors(s.id):
            for v, b in sg.edges[u, s.id]["values"].items():
                if v in got:
                    continue
                got.add(v)
                recv_b += b
                if v in grad_values:
                    in_grad_b += b
                    recv_ms += b / cluster.bandwidth(gpu_of[u], s.gpu) * 1e3
        # The gradient all-reduce across replicas, once per step, overlaps the compute of the
        # step's other work like the transfers do.
        ar = problem.allreduce_ms(s.gpu, gb)
        period = compute + max(0.0, send_ms - compute) + max(0.0, recv_ms - compute) + max(0.0, ar / M - compute)
        act_full = held_activation_bytes(prof, nodes)     # each saved value once, with its savers
        graph_inputs = sum(e.bytes for n in nodes for e in graph.in_edges(n)
                           if graph.node(e.src).kind == "input")
        act_in = recv_b + graph_inputs
        k = prog.in_flight
        held = k * (act_in if prog.recompute else act_full)
        # The most one task adds while it runs (a GPU runs one task at a time):
        # backward: its activation gradients (see working_sets) and, recomputing, the rebuilt
        # activations together with the values alive while the recomputation runs;
        ws_fwd, ws_bwd = working_sets(problem, nodes)
        t_bwd = (act_full + max(ws_fwd, ws_bwd)) if prog.recompute else ws_bwd
        if prog.extra_weight_versions:
            t_bwd += tb     # a backward on a stashed version fills that copy's gradients first
        # forward: the values alive while it runs, and weights predicted ahead (a copy) when the
        # backward will use later ones;
        t_fwd = ws_fwd + (tb if (problem.weight_prediction and problem.schedule == "async" and prog.recompute)
                          else 0)
        # update: shared tensors' sums (the runtime's fused optimizers update in place; Adafactor's
        # factored statistics are small).
        t_upd = shared_update_transient(prof, names, shared_holders)
        if problem.replicas > 1:
            t_upd += min(gb, ALLREDUCE_BUCKET_BYTES)      # the all-reduce's flat bucket
        stage_costs.append(StageCost(
            id=s.id, gpu=s.gpu, depth=depth[s.id], forward_ms=fwd, backward_ms=bwd, recompute_ms=rec,
            comm_fwd_ms=send_ms, comm_bwd_ms=recv_ms, period_ms=period, send_bytes=send_b, recv_bytes=recv_b,
            activation_bytes=act_full, input_bytes=act_in, in_flight=k, memory_bytes=held, update_ms=upd,
            recomputes=prog.recompute, weight_versions=prog.extra_weight_versions, param_bytes=pb, grad_bytes=gb,
            optimizer_bytes=ob, trainable_bytes=tb, transient_bytes=max(t_bwd, t_fwd, t_upd), group=prog.group,
            grads_back_bytes=grads_back, allreduce_ms=ar))

    by_gpu: dict[int, list[StageCost]] = {}
    for sc in stage_costs:
        by_gpu.setdefault(sc.gpu, []).append(sc)
    waiting = receive_windows(sg, flow, gpu_of)
    receive = [0] * plan.num_gpus
    for (v, g), (w, b) in waiting.items():
        receive[g] += w * b
    for sc in stage_costs:
        receive[sc.gpu] += sc.in_flight * sc.grads_back_bytes
    for g, b in shared_gradient_receive(graph, prof, [(s.gpu, s.nodes) for s in plan.stages],
                                        problem.shared_lag).items():
        receive[g] += b
    send = [0] * plan.num_gpus
    where = plan.stage_of()
    for (v, g_dst) in {(v, gpu_of[c]) for p, c, data in sg.edges(data=True) for v in data["values"]}:
        p = where[graph.producer(v)]
        g_src = gpu_of[p]
        if g_src != g_dst and (v, g_src) not in waiting:
            send[g_src] += graph.node(graph.producer(v)).outputs[v].bytes
    # Graph inputs: each step's batch of the inputs a GPU's stages read, for the steps in flight.
    inputs_of = gpu_graph_input_bytes(graph, plan)
    gpu_costs: list[GpuCost] = []
    reserve = problem.memory_reserve
    for g in range(plan.num_gpus):
        scs = by_gpu.get(g, [])
        pb = sum(sc.param_bytes for sc in scs)
        gb = sum(sc.grad_bytes for sc in scs)
        ob = sum(sc.optimizer_bytes for sc in scs)
        wv = sum(sc.weight_versions * sc.trainable_bytes for sc in scs)
        held = sum(sc.memory_bytes for sc in scs)
        ahead = max((sc.in_flight for sc in scs), default=0)
        data = (math.ceil(ahead / M) + 1) * M * inputs_of.get(g, 0) if scs else 0
        transient = max((sc.transient_bytes for sc in scs), default=0)
        act = held + receive[g] + send[g] + data + transient
        gpu_costs.append(GpuCost(
            gpu=g, stages=[sc.id for sc in scs], load_ms=sum(sc.period_ms for sc in scs),
            compute_ms=sum(sc.forward_ms + sc.backward_ms + sc.recompute_ms + sc.update_ms / M for sc in scs),
            comm_ms=sum(sc.comm_fwd_ms + sc.comm_bwd_ms for sc in scs),
            param_bytes=pb, weight_version_bytes=wv, grad_bytes=gb, optimizer_bytes=ob,
            activation_bytes=act, memory_bytes=pb + wv + gb + ob + act + (reserve if scs else 0),
            memory_limit=cluster.gpu_memory, held_bytes=held, receive_bytes=receive[g], send_bytes=send[g],
            data_bytes=data, transient_bytes=transient, reserve_bytes=reserve if scs else 0))

    objective = max((g.load_ms for g in gpu_costs), default=0.0)
    work = sum(sc.forward_ms + sc.backward_ms + sc.recompute_ms + sc.update_ms / M for sc in stage_costs)
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
