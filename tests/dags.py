"""Small training DAGs with parallel branches, and brute-force references for the partitioners.

The graphs are built by hand (no tracing): a trunk of attention-like blocks (the
hidden state fans out to Q, K and V, which meet again in the scores and the mix,
then a residual add), a mask computed from the input and read by every block (a
source with many readers), a classifier head hanging off the middle of the trunk
and joining the loss, and an LM head at the end. Costs, parameter sizes,
activations and value sizes are random per seed.

The references enumerate plans directly and price each with
:func:`ftcompile.plan.evaluate`; they share no code with the partitioners.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from ftcompile.cluster import ClusterSpec
from ftcompile.ir import Edge, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta
from ftcompile.plan import Plan, Problem, Stage, evaluate
from ftcompile.profile import NodeCost, ParamCost, Profile


def branchy_problem(seed: int = 0, *, blocks: int = 2, heads: bool = True, mask: bool = True, gpus: int = 3,
                    schedule: str = "async", bandwidth: float = 1e30, value_bytes: int = 1_000_000,
                    micro_batches: int = 4, tied: bool = False, side: bool = False) -> Problem:
    """A branchy DAG (see the module docstring) on ``gpus`` GPUs with unlimited memory.

    ``bandwidth=1e30`` makes communication free (balance and memory decide); a finite
    one prices every value's transfer. ``side`` adds what traced graphs are full of: a
    label clamp made from the input and read by the loss only, a counter nobody reads,
    and a view (no compute) after every Q.
    """
    rng = random.Random(seed)
    nodes: list[Node] = []
    edges: list[Edge] = []
    params: dict[str, ParamInfo] = {}
    pcost: dict[str, ParamCost] = {}
    costs: dict[int, NodeCost] = {}

    def f32(nbytes: int) -> ValueMeta:
        return ValueMeta(TensorMeta((max(1, nbytes // 4),), "float32"))

    def param(name: str, scale: int) -> str:
        nb = rng.choice([1, 2, 3]) * scale
        params[name] = ParamInfo(name, "parameter", TensorMeta((nb // 4,), "float32"))
        pcost[name] = ParamCost(nb, nb, 2 * nb)
        return name

    def op(name: str, reads: list[str], *, weight: str | None = None, work: float | None = None,
           loss: bool = False, size: int | None = None, floating: bool = True, act: int | None = None) -> str:
        nid = len(nodes)
        out = f"v{nid}"
        meta = f32(size if size is not None else rng.choice([1, 2, 3]) * value_bytes) if floating else \
            ValueMeta(TensorMeta((max(1, (size or value_bytes) // 8),), "int64"))
        if loss:
            meta = ValueMeta(TensorMeta((), "float32"))
        nodes.append(Node(nid, name, "op", scope=name.split("/")[0], params=[weight] if weight else [],
                          outputs={out: meta}, is_loss=loss))
        for r in reads:
            src = int(r[1:])
            edges.append(Edge(src, nid, r, nodes[src].outputs[r]))
        fwd = work if work is not None else rng.uniform(0.5, 6.0)
        costs[nid] = NodeCost(forward_ms=fwd, backward_ms=2 * fwd, recompute_ms=fwd,
                              activation_bytes=rng.choice([1, 2, 4]) * 1_000_000 if act is None else act)
        return out

    x = "v0"
    nodes.append(Node(0, "x", "input", outputs={x: ValueMeta(TensorMeta((value_bytes // 8,), "int64"))}))
    h = op("embed", [x], weight=param("embed.weight", 4_000_000))
    m = op("mask", [x], work=0.05, size=value_bytes // 4, floating=False) if mask else None
    cls_from = None
    for b in range(blocks):
        q = op(f"b{b}/q", [h], weight=param(f"b{b}.q", 1_000_000))
        if side:
            q = op(f"b{b}/view", [q], work=0.0, act=0)
        k = op(f"b{b}/k", [h], weight=param(f"b{b}.k", 1_000_000))
        v = op(f"b{b}/v", [h], weight=param(f"b{b}.v", 1_000_000))
        s = op(f"b{b}/scores", [q, k] + ([m] if m else []))
        o = op(f"b{b}/mix", [s, v], weight=param(f"b{b}.o", 1_000_000))
        h = op(f"b{b}/add", [o, h], work=0.1)
        if b == (blocks - 1) // 2:
            cls_from = h
    terms = []
    if side:
        op("counter", [], work=0.01, act=0, floating=False, size=8)
        terms.append(op("clamp", [x], work=0.02, act=0, floating=False, size=value_bytes // 8))
    if heads:
        p = op("cls/pool", [cls_from], work=0.3)
        terms.append(op("cls/out", [p], weight=param("cls.weight", 500_000)))
    lm_weight = "embed.weight" if tied else param("lm.weight", 4_000_000)
    terms.append(op("lm", [h], weight=lm_weight))
    op("loss", terms, work=0.2, loss=True)
    out_id = len(nodes)
    loss_value = f"v{out_id - 1}"
    nodes.append(Node(out_id, "out", "output"))
    edges.append(Edge(out_id - 1, out_id, loss_value, nodes[out_id - 1].outputs[loss_value]))
    g = OpGraph(nodes=nodes, edges=edges, params=params, loss=loss_value)
    prof = Profile(graph_hash=g.content_hash(), method="analytic", hardware={"name": "synthetic"},
                   dtype="float32", batch_size=1, optimizer="adam", nodes=costs, params=pcost)
    cluster = ClusterSpec("test", 1, gpus, 10**15, bandwidth, bandwidth, bandwidth)
    return Problem(g, prof, cluster, schedule=schedule, micro_batches=micro_batches)


def with_memory(problem: Problem, nbytes: int) -> Problem:
    return replace(problem, cluster=replace(problem.cluster, gpu_memory=int(nbytes)))


def total_over_gpus(problem: Problem) -> float:
    """Weights, gradients, optimizer state and one micro-batch's activations of the whole
    model, over the number of GPUs (the "total / P" tight-memory tests are stated in)."""
    return problem.profile.training_bytes() / problem.num_gpus


# --------------------------------------------------------------------------- references

def downsets(problem: Problem) -> list[frozenset[int]]:
    """Every ideal (predecessor-closed set) of the op nodes, by brute force over the DAG."""
    ops = [n.id for n in problem.graph.op_nodes()]
    preds = {n: {e.src for e in problem.graph.in_edges(n) if e.src in set(ops)} for n in ops}
    out = {frozenset()}
    frontier = [frozenset()]
    while frontier:
        nxt = []
        for ideal in frontier:
            for n in ops:
                if n not in ideal and preds[n] <= ideal:
                    j = ideal | {n}
                    if j not in out:
                        out.add(j)
                        nxt.append(j)
        frontier = nxt
    return sorted(out, key=len)


def convex_splits(problem: Problem, max_stages: int | None = None):
    """Every chain of ideals {} < I_1 < ... < I_S = all op nodes with S <= P, as stage lists."""
    ideals = downsets(problem)
    full = ideals[-1]
    P = min(problem.num_gpus, max_stages or problem.num_gpus)

    def chains(prev: frozenset, depth: int):
        if prev == full:
            yield []
            return
        if depth == P:
            return
        for nxt in ideals:
            if len(nxt) > len(prev) and prev < nxt:
                for rest in chains(nxt, depth + 1):
                    yield [sorted(nxt - prev)] + rest

    yield from chains(frozenset(), 0)


def best_convex(problem: Problem, max_stages: int | None = None) -> tuple[float, list[list[int]] | None]:
    """The lowest evaluate() objective of any convex split that fits (inf, None if none does)."""
    best, arg = float("inf"), None
    for stages in convex_splits(problem, max_stages):
        plan = Plan("bf", problem.num_gpus, [Stage(k, k, s) for k, s in enumerate(stages)])
        cost = evaluate(problem, plan)
        if cost.feasible and cost.objective_ms < best:
            best, arg = cost.objective_ms, stages
    return best, arg


def mixed_plans(problem: Problem):
    """Every plan at all: every set partition of the op nodes into stages whose stage graph is
    acyclic, and every placement of the stages on GPUs (stage 0 on GPU 0: the GPUs are
    interchangeable). Tiny graphs only: a 9-node graph on 2 GPUs has about 17,000."""
    ops = [n.id for n in problem.graph.op_nodes()]
    op_set = set(ops)
    arcs = [(e.src, e.dst) for e in problem.graph.edges if e.src in op_set and e.dst in op_set]

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for i in range(len(part)):
                yield part[:i] + [[first] + part[i]] + part[i + 1:]
            yield [[first]] + part

    def acyclic(part) -> bool:
        where = {n: i for i, s in enumerate(part) for n in s}
        succ: dict[int, set[int]] = {i: set() for i in range(len(part))}
        for a, b in arcs:
            if where[a] != where[b]:
                succ[where[a]].add(where[b])
        state: dict[int, int] = {}

        def cyclic(u: int) -> bool:          # depth-first search for a back edge
            state[u] = 1
            for w in succ[u]:
                if state.get(w) == 1 or (w not in state and cyclic(w)):
                    return True
            state[u] = 2
            return False

        return not any(u not in state and cyclic(u) for u in succ)

    P = problem.num_gpus
    for part in partitions(ops):
        if not acyclic(part):
            continue
        for gpus in itertools.product(range(P), repeat=len(part)):
            if gpus[0] == 0:
                yield Plan("all", P, [Stage(i, g, sorted(ns)) for i, (g, ns) in enumerate(zip(gpus, part))])


def best_mixed(problem: Problem) -> float:
    """The lowest evaluate() objective of any plan at all that fits (:func:`mixed_plans`)."""
    best = float("inf")
    for plan in mixed_plans(problem):
        cost = evaluate(problem, plan)
        if cost.feasible:
            best = min(best, cost.objective_ms)
    return best
