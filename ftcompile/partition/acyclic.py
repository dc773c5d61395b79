"""Multilevel acyclic graph partitioning for pipelines.

After Moreira, Popp & Schulz, "Graph partitioning with acyclicity constraints"
(SEA 2017) and "Evolutionary multi-level acyclic graph partitioning" (GECCO
2018), with FTPipe's pipeline objective instead of edge cut:

1. **Coarsen.** Repeatedly contract a heavy-edge matching (heaviest values in
   bytes first) of the op-node DAG. An edge ``(u, v)`` is contracted only when
   no other path leads from ``u`` to ``v`` — otherwise the merged node would sit
   on a cycle. Contracting several such edges at once can still close a cycle
   through two merged pairs, so each level's quotient is checked and the pairs
   on a strongly connected component are split again.
2. **Initial partition.** The coarsest DAG, in topological order, is cut into
   ``P`` consecutive blocks by a greedy fill: a block takes nodes until its
   compute would pass a cap ``T`` or its memory would pass the GPU's; the
   smallest ``T`` for which ``P`` blocks suffice is found by bisection.
3. **Uncoarsen and refine.** Level by level, the partition is projected to the
   finer graph and improved by moving single (coarse) nodes to the previous or
   next block. Blocks keep a topological order: a node moves to block ``j``
   only if all its predecessors are in blocks ``<= j`` and all its successors
   in blocks ``>= j``, so every edge still goes forward and the quotient stays
   acyclic. A move is kept when it lowers, in this order, memory overflow, the
   largest stage period (FTPipe Eq. 1) and the sum of squared periods (which
   rewards balancing and cutting communication).

Block ``b`` becomes the stage on GPU ``b``: one stage per GPU, in topological
order, like Seq-pipe but not necessarily contiguous in node order. During
refinement a block's pipeline depth is taken as ``P - 1 - b``, an upper bound of
its real depth (all edges go forward), so memory is judged conservatively;
the final plan is priced by :func:`ftcompile.plan.evaluate`.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import networkx as nx

from ..plan import Plan, Problem, Stage, evaluate, shared_gradient_copies
from ..units import format_bytes
from .base import Infeasible

__all__ = ["partition_acyclic"]


# --------------------------------------------------------------------------- static data

@dataclass
class _Data:
    """Per-op-node costs, indexed 0..n-1 in the graph's topological order."""

    ids: list[int]
    work: list[float]             # forward + backward
    rec: list[float]              # recomputation
    act: list[float]              # activation bytes kept for backward
    ginp: list[int]               # bytes read directly from graph inputs (per edge, as evaluate counts)
    params: list[list[int]]       # parameter indices read
    ptotal: list[int]             # weights + grads + optimizer state per parameter
    pbytes: list[int]             # weights alone (extra versions)
    pred: list[set[int]]
    succ: list[set[int]]
    edge_bytes: dict[tuple[int, int], int]
    # values made by op nodes and read by op nodes: producer, bytes, floating, consumers
    vprod: list[int]
    vbytes: list[int]
    vfloat: list[bool]
    vcons: list[list[int]]
    made: list[list[int]]         # node -> values it makes
    reads: list[list[int]]        # node -> values it reads (each once)
    margin: int = 0               # bytes kept free beyond the estimate (raised when evaluate disagrees)
    pupd: list = None             # per parameter: its optimizer step's share U / M
    ptied: dict = None            # tied parameters (read by several nodes): their gradient sum per extra holder
    pgrad: dict = None            # tied parameters: gradient bytes (one buffer per other holder waits)


def _build_data(problem: Problem) -> _Data:
    g, prof = problem.graph, problem.profile
    ids = [n.id for n in g.op_nodes()]
    idx = {nid: i for i, nid in enumerate(ids)}
    pnames: dict[str, int] = {}
    ptotal: list[int] = []
    pbytes: list[int] = []
    work, rec, act, ginp, params = [], [], [], [], []
    for nid in ids:
        c = prof.nodes[nid]
        work.append(c.forward_ms + c.backward_ms)
        rec.append(c.recompute_ms)
        act.append(c.activation_bytes)
        ginp.append(sum(e.bytes for e in g.in_edges(nid) if g.node(e.src).kind == "input"))
        ps = []
        for p in g.node(nid).params:
            if p not in pnames:
                pnames[p] = len(ptotal)
                ptotal.append(prof.params[p].total)
                pbytes.append(prof.params[p].bytes)
            ps.append(pnames[p])
        params.append(sorted(set(ps)))
    n = len(ids)
    pred: list[set[int]] = [set() for _ in range(n)]
    succ: list[set[int]] = [set() for _ in range(n)]
    edge_bytes: dict[tuple[int, int], int] = {}
    vindex: dict[str, int] = {}
    vprod, vbytes, vfloat, vcons = [], [], [], []
    made: list[list[int]] = [[] for _ in range(n)]
    reads: list[set[int]] = [set() for _ in range(n)]
    for e in g.edges:
        a, b = idx.get(e.src), idx.get(e.dst)
        if a is None or b is None:
            continue
        pred[b].add(a)
        succ[a].add(b)
        edge_bytes[a, b] = edge_bytes.get((a, b), 0) + e.bytes
        v = vindex.get(e.value)
        if v is None:
            v = vindex[e.value] = len(vprod)
            vprod.append(a)
            vbytes.append(e.bytes)
            vfloat.append(e.meta.tensor is not None and e.meta.tensor.is_floating)
            vcons.append([])
            made[a].append(v)
        if v not in reads[b]:
            reads[b].add(v)
            vcons[v].append(b)
    from ..plan import _shared_sum_ms

    M = problem.micro_batches
    pupd = [problem.update_ms([nm]) / M for nm in pnames]
    nreaders: dict[int, int] = {}
    for ps in params:
        for q in ps:
            nreaders[q] = nreaders.get(q, 0) + 1
    names = list(pnames)
    ptied = {q: _shared_sum_ms(problem, [names[q]], {names[q]: 2}) / M for q, c in nreaders.items()
             if c > 1 and prof.params[names[q]].grad_bytes}
    # the other holders' gradients each holder's GPU receives (plan.shared_gradient_receive)
    pgrad = {q: prof.params[names[q]].grad_bytes for q in ptied}
    return _Data(ids, work, rec, act, ginp, params, ptotal, pbytes, pred, succ, edge_bytes,
                 vprod, vbytes, vfloat, vcons, made, [sorted(r) for r in reads], pupd=pupd, ptied=ptied,
                 pgrad=pgrad)


# --------------------------------------------------------------------------- incremental costs

class _Chain:
    """Memory of block ``b`` of a chain of ``P`` blocks (block b on GPU b, depth ``P - 1 - b``), as
    the refinement and the greedy fill estimate it from the runtime's programs
    (:class:`~ftcompile.partition.base.MemoryModel`): parameters with their weight versions,
    the micro-batches in flight, receive buffers at the widest window a producer can give, the
    activations a recomputation rebuilds, and the reserve. Working sets, send buffers and data
    are left out, so this is an estimate: :func:`partition_acyclic` checks every plan with
    :func:`~ftcompile.plan.evaluate` and, when none fits, runs again keeping free what the
    estimate missed (``_Data.margin``)."""

    def __init__(self, problem: Problem, data: "_Data", P: int):
        from .base import MemoryModel

        mm = MemoryModel.of(problem)
        self.k = [mm.in_flight_max(P - 1 - b) for b in range(P)]
        self.extra = [mm.extra_versions_max(P - 1 - b) for b in range(P)]
        self.window = [mm.window_max(P - 1 - b, P - 1) for b in range(P)]
        self.recomp = [problem.recomputes(b == P - 1) for b in range(P)]
        self.limit = mm.limit - mm.reserve - data.margin

    def memory(self, b: int, pm, recv, act, ginp):
        if self.recomp[b]:
            return pm + self.k[b] * (recv + ginp) + self.window[b] * recv + act
        return pm + self.k[b] * act + self.window[b] * recv


class _State:
    """Costs of an assignment of op nodes to ``P`` blocks (block b on GPU b, depth P-1-b).

    Mirrors :func:`ftcompile.plan.evaluate` for a chain of blocks, and updates
    in time proportional to the values a move touches.
    """

    def __init__(self, problem: Problem, data: _Data, block: list[int], P: int):
        self.d, self.P, self.block = data, P, list(block)
        cl = problem.cluster
        self.bw = [[cl.bandwidth(a, b) if a != b else 1.0 for b in range(P)] for a in range(P)]
        self.chain = _Chain(problem, data, P)
        self.limit = self.chain.limit
        self.extra = self.chain.extra
        self.recomp = self.chain.recomp
        z = lambda: [0.0] * P  # noqa: E731
        self.work, self.rec, self.act, self.ginp = z(), z(), z(), z()
        self.send, self.recvf, self.recvb, self.pmem = z(), z(), z(), z()
        self.upd = z()
        self.holders: dict[int, int] = {}           # tied parameter -> blocks holding it
        self.lag = problem.shared_lag
        self.count = [0] * P
        self.eps = 1e-2 * sum(data.work) / max(1, len(data.work))
        self.pref: list[dict[int, int]] = [dict() for _ in range(P)]
        self.vcnt: list[dict[int, int]] = [dict() for _ in data.vprod]
        for i, b in enumerate(self.block):
            self._add_node(i, b)
        for v in range(len(data.vprod)):
            for c in data.vcons[v]:
                cnt = self.vcnt[v]
                cnt[self.block[c]] = cnt.get(self.block[c], 0) + 1
            self._value(v, +1)

    # per-node and per-value contributions
    def _add_node(self, i: int, b: int, sign: int = 1) -> None:
        d = self.d
        self.work[b] += sign * d.work[i]
        self.rec[b] += sign * d.rec[i]
        self.act[b] += sign * d.act[i]
        self.ginp[b] += sign * d.ginp[i]
        self.count[b] += sign
        ref = self.pref[b]
        for p in d.params[i]:
            r = ref.get(p, 0) + sign
            if r == 0:
                del ref[p]
                self.pmem[b] -= d.ptotal[p] + d.pbytes[p] * self.extra[b]
                self.upd[b] -= d.pupd[p]
                if p in d.ptied:
                    self.holders[p] -= 1
            else:
                ref[p] = r
                if r == 1 and sign > 0:
                    self.pmem[b] += d.ptotal[p] + d.pbytes[p] * self.extra[b]
                    self.upd[b] += d.pupd[p]
                    if p in d.ptied:
                        self.holders[p] = self.holders.get(p, 0) + 1

    def _value(self, v: int, sign: int) -> None:
        d = self.d
        p = self.block[d.vprod[v]]
        nbytes = d.vbytes[v]
        for b, c in self.vcnt[v].items():
            if b == p or c <= 0:
                continue
            ms = nbytes / self.bw[p][b] * 1e3
            self.send[p] += sign * ms
            self.recvb[b] += sign * nbytes
            if d.vfloat[v]:
                self.recvf[b] += sign * ms

    def move(self, nodes: list[int], dst: int) -> int:
        """Move ``nodes`` (all in one block) to block ``dst``; return the block they left."""
        d = self.d
        src = self.block[nodes[0]]
        touched = {v for i in nodes for v in d.made[i]}
        touched.update(v for i in nodes for v in d.reads[i])
        for v in touched:
            self._value(v, -1)
        for i in nodes:
            self._add_node(i, src, -1)
            self._add_node(i, dst, +1)
            self.block[i] = dst
            for v in d.reads[i]:
                cnt = self.vcnt[v]
                cnt[src] -= 1
                if cnt[src] == 0:
                    del cnt[src]
                cnt[dst] = cnt.get(dst, 0) + 1
        for v in touched:
            self._value(v, +1)
        return src

    # costs
    def period(self, b: int) -> float:
        c = self.work[b] + self.upd[b] + (self.rec[b] if self.recomp[b] else 0.0)
        if self.d.ptied:
            ref = self.pref[b]
            c += sum(cq * (self.holders[q] - 1) for q, cq in self.d.ptied.items() if q in ref)
        return c + max(0.0, self.send[b] - c) + max(0.0, self.recvf[b] - c)

    def memory(self, b: int) -> float:
        m = self.chain.memory(b, self.pmem[b], self.recvb[b], self.act[b], self.ginp[b])
        if self.d.pgrad:
            ref = self.pref[b]
            m += sum(gb * shared_gradient_copies(self.holders[q] - 1, 1, self.lag)
                     for q, gb in self.d.pgrad.items() if q in ref)
        return m

    def score(self) -> tuple[float, float, float]:
        """(memory overflow, largest period, sum of squared periods), to minimise in this order.

        Each node adds a token ``eps`` to its block's period in the last term, so that
        moving a node of no cost (a view, a reshape) towards the lighter block still
        counts as progress: otherwise such nodes pin the costly ones behind them.
        """
        per = [self.period(b) for b in range(self.P)]
        over = sum(max(0.0, self.memory(b) - self.limit) for b in range(self.P))
        eps = self.eps
        return over, max(per), sum((p + eps * c) ** 2 for p, c in zip(per, self.count))


def _better(new: tuple, old: tuple) -> bool:
    for a, b in zip(new, old):
        tol = 1e-12 * max(1.0, abs(b))
        if a < b - tol:
            return True
        if a > b + tol:
            return False
    return False


# --------------------------------------------------------------------------- coarsening

@dataclass
class _Level:
    """A coarse DAG: ``members[x]`` are the op nodes (indices) coarse node ``x`` stands for."""

    members: list[list[int]]
    pred: list[set[int]]
    succ: list[set[int]]
    weight: list[float]
    mem: list[float]
    ebytes: dict[tuple[int, int], int] = field(default_factory=dict)


def _topo_index(level: _Level) -> list[int]:
    """Position of each coarse node in a topological order (ties: smallest member first)."""
    n = len(level.members)
    indeg = [len(p) for p in level.pred]
    first = [min(m) for m in level.members]
    ready = [(first[x], x) for x in range(n) if indeg[x] == 0]
    heapq.heapify(ready)
    pos = [0] * n
    k = 0
    while ready:
        _, x = heapq.heappop(ready)
        pos[x] = k
        k += 1
        for y in level.succ[x]:
            indeg[y] -= 1
            if indeg[y] == 0:
                heapq.heappush(ready, (first[y], y))
    if k != n:
        raise AssertionError("coarse graph has a cycle")
    return pos


def _other_path(level: _Level, pos: list[int], u: int, v: int, budget: int) -> bool:
    """Whether a path ``u -> ... -> v`` other than the edge exists (True when unsure)."""
    target = pos[v]
    stack = [w for w in level.succ[u] if w != v and pos[w] < target]
    seen = set(stack)
    while stack:
        x = stack.pop()
        budget -= 1
        if budget < 0:
            return True
        for y in level.succ[x]:
            if y == v:
                return True
            if y not in seen and pos[y] < target:
                seen.add(y)
                stack.append(y)
    return False


def _contract(level: _Level, parent: list[int], nc: int) -> _Level:
    """The quotient of ``level`` under ``parent`` (node -> coarse node ``0..nc-1``)."""
    members: list[list[int]] = [[] for _ in range(nc)]
    weight = [0.0] * nc
    mem = [0.0] * nc
    for x, p in enumerate(parent):
        members[p].extend(level.members[x])
        weight[p] += level.weight[x]
        mem[p] += level.mem[x]
    pred: list[set[int]] = [set() for _ in range(nc)]
    succ: list[set[int]] = [set() for _ in range(nc)]
    ebytes: dict[tuple[int, int], int] = {}
    for (a, b), w in level.ebytes.items():
        pa, pb = parent[a], parent[b]
        if pa != pb:
            succ[pa].add(pb)
            pred[pb].add(pa)
            ebytes[pa, pb] = ebytes.get((pa, pb), 0) + w
    return _Level(members, pred, succ, weight, mem, ebytes)


def _coarsen_once(level: _Level, cap_w: float, cap_m: float, rng: random.Random | None) -> _Level | None:
    """One round of acyclicity-preserving heavy-edge matching; None when nothing contracts."""
    n = len(level.members)
    pos = _topo_index(level)
    edges = list(level.ebytes.items())
    if rng is not None:
        edges.sort(key=lambda kv: -kv[1] * rng.uniform(0.7, 1.3))
    else:
        edges.sort(key=lambda kv: (-kv[1], pos[kv[0][0]]))
    mate = list(range(n))
    matched = [False] * n
    for (u, v), _ in edges:
        if matched[u] or matched[v]:
            continue
        if level.weight[u] + level.weight[v] > cap_w or level.mem[u] + level.mem[v] > cap_m:
            continue
        if len(level.succ[u]) > 1 and len(level.pred[v]) > 1 and _other_path(level, pos, u, v, 256):
            continue
        matched[u] = matched[v] = True
        mate[u], mate[v] = v, u
    pairs = [(u, mate[u]) for u in range(n) if mate[u] > u]
    if not pairs:
        return None
    while True:
        parent = [-1] * n
        nc = 0
        for u in range(n):
            if parent[u] < 0:
                parent[u] = nc
                if mate[u] != u:
                    parent[mate[u]] = nc
                nc += 1
        coarse = _contract(level, parent, nc)
        q = nx.DiGraph()
        q.add_nodes_from(range(nc))
        q.add_edges_from(coarse.ebytes)
        bad = [c for c in nx.strongly_connected_components(q) if len(c) > 1]
        if not bad:
            return coarse if nc < n else None
        # Two matched pairs close a cycle: split every pair on one.
        inbad = set().union(*bad)
        for u in range(n):   # a pair's two nodes share a parent, so both are reset
            if parent[u] in inbad:
                mate[u] = u


def _hierarchy(data: _Data, problem: Problem, P: int, rng: random.Random | None) -> list[_Level]:
    """Levels from the op graph (index 0) to the coarsest DAG; ``rng`` perturbs the matching."""
    n = len(data.ids)
    node_mem = [float(sum(data.ptotal[p] for p in data.params[i]) + data.act[i]) for i in range(n)]
    base = _Level([[i] for i in range(n)], [set(p) for p in data.pred], [set(s) for s in data.succ],
                  [data.work[i] + data.rec[i] for i in range(n)], node_mem, dict(data.edge_bytes))
    total = sum(base.weight)
    # Coarse nodes stay small enough for the initial partition to balance P blocks and fit memory.
    cap_w = max(total / (4 * P), max(base.weight, default=0.0))
    cap_m = max(problem.cluster.gpu_memory / 4, max(node_mem, default=0.0))
    levels = [base]
    stop = max(8 * P, 32)
    while len(levels[-1].members) > stop:
        nxt = _coarsen_once(levels[-1], cap_w, cap_m, rng)
        if nxt is None or len(nxt.members) > 0.95 * len(levels[-1].members):
            if nxt is not None:
                levels.append(nxt)
            break
        levels.append(nxt)
    return levels


# --------------------------------------------------------------------------- initial partition

class _Filler:
    """Greedy fill of units (lists of op nodes) taken in a topological order into consecutive blocks.

    A block takes units while its compute (forward + backward + recomputation;
    the last block does not recompute) stays within a cap ``T`` and, optionally,
    its memory within the GPU's; the last block takes the rest. For additive
    costs this greedy is optimal for a given ``T``, so bisection on ``T`` finds
    the best contiguous split of the order (communication aside).
    """

    def __init__(self, problem: Problem, data: _Data, P: int):
        self.problem, self.d, self.P = problem, data, P
        self.chain = _Chain(problem, data, P)
        self.extra = self.chain.extra
        self.recomp = self.chain.recomp

    def _units(self, units: list[list[int]]) -> list[tuple]:
        """Per unit: work, recomputation, activations, graph-input bytes, params, values read, members."""
        d = self.d
        out = []
        for ms in units:
            inside = set(ms)
            out.append((sum(d.work[i] for i in ms), sum(d.rec[i] for i in ms), sum(d.act[i] for i in ms),
                        sum(d.ginp[i] for i in ms), sorted({p for i in ms for p in d.params[i]}),
                        sorted({v for i in ms for v in d.reads[i] if d.vprod[v] not in inside}), ms))
        return out

    def fill(self, units: list[tuple], T: float, respect_memory: bool) -> list[int] | None:
        """Blocks of units (from :meth:`_units`) for cap ``T``; None when they do not fit."""
        d, P, limit = self.d, self.P, self.chain.limit
        vprod, vbytes, ptotal, pbytes = d.vprod, d.vbytes, d.ptotal, d.pbytes
        blocks = [0] * len(units)
        b = 0
        work = rec = act = ginp = recv = pm = 0.0
        here: set[int] = set()          # op nodes in this block
        pset: set[int] = set()
        vals: set[int] = set()          # values this block reads from earlier blocks
        extra = self.extra[0]

        memory = self.chain.memory

        for u, (w, r, a, gi, ps, reads, ms) in enumerate(units):
            if here and b < P - 1:
                over = work + rec + w + r > T
                if not over and respect_memory:
                    dp = sum(ptotal[p] + pbytes[p] * extra for p in ps if p not in pset)
                    # the order is topological: what the unit reads from outside comes from before it
                    dv = sum(vbytes[v] for v in reads if v not in vals and vprod[v] not in here)
                    over = memory(b, pm + dp, recv + dv, act + a, ginp + gi) > limit
                if over:
                    b += 1
                    extra = self.extra[b]
                    work = rec = act = ginp = recv = pm = 0.0
                    here, pset, vals = set(), set(), set()
            blocks[u] = b
            work += w
            rec += r
            act += a
            ginp += gi
            for p in ps:
                if p not in pset:
                    pset.add(p)
                    pm += ptotal[p] + pbytes[p] * extra
            for v in reads:
                if v not in vals and vprod[v] not in here:
                    vals.add(v)
                    recv += vbytes[v]
            here.update(ms)
        if work + (rec if self.recomp[b] else 0.0) > T:
            return None
        if respect_memory and memory(b, pm, recv, act, ginp) > limit:
            return None
        return blocks

    def best(self, units: list[list[int]]) -> list[int]:
        """The fill with the smallest cap that fits ``P`` blocks (memory first, then compute only)."""
        packed = self._units(units)
        sizes = [w + r for w, r, *_ in packed]
        total = sum(sizes)
        for respect_memory in (True, False):
            hi = total * (1 + 1e-9) + 1e-9
            best = self.fill(packed, hi, respect_memory)
            if best is None:
                continue
            # the last block does not recompute, so the optimum may lie a little under total / P
            lo = max(total / self.P, max(sizes, default=0.0)) * 0.5
            while hi - lo > 1e-6 * hi:
                mid = (lo + hi) / 2
                got = self.fill(packed, mid, respect_memory)
                if got is None:
                    lo = mid
                else:
                    hi, best = mid, got
            return best
        raise AssertionError("the compute-only fill always succeeds with an unbounded cap")


def _initial(level: _Level, data: _Data, problem: Problem, P: int) -> list[int]:
    """Blocks of the coarse nodes: the best greedy fill of their topological order."""
    pos = _topo_index(level)
    order = sorted(range(len(pos)), key=pos.__getitem__)
    got = _Filler(problem, data, P).best([level.members[x] for x in order])
    blocks = [0] * len(order)
    for x, b in zip(order, got):
        blocks[x] = b
    return blocks


# --------------------------------------------------------------------------- refinement

def _refine(level: _Level, state: _State, max_passes: int = 30) -> int:
    """Greedy moves of coarse nodes to the neighbouring blocks; returns the number of moves.

    Passes alternate between topological and reverse topological order: a node can
    follow its successors to the next block (or its predecessors to the previous one)
    in the same pass.
    """
    moves = 0
    score = state.score()
    blk = state.block
    pos = _topo_index(level)
    order = sorted(range(len(pos)), key=pos.__getitem__)
    for k in range(max_passes):
        improved = False
        for x in (reversed(order) if k % 2 else order):
            ms = level.members[x]
            b = blk[ms[0]]
            if state.count[b] == len(ms):
                continue                      # never empty a block
            for t in (b - 1, b + 1):
                if not 0 <= t < state.P:
                    continue
                if t < b and any(blk[level.members[y][0]] > t for y in level.pred[x]):
                    continue
                if t > b and any(blk[level.members[y][0]] < t for y in level.succ[x]):
                    continue
                state.move(ms, t)
                new = state.score()
                if _better(new, score):
                    score = new
                    moves += 1
                    improved = True
                    break
                state.move(ms, b)
        if not improved:
            break
    return moves


def refine_convex(problem: Problem, stages: list[list[int]]) -> list[list[int]]:
    """Single-node moves between neighbouring stages of a convex split (stage k on GPU k).

    The refinement of :func:`partition_acyclic` at operator level, started from
    ``stages``: a node moves to the previous or next stage when every edge still goes
    forward and (memory overflow, largest period, sum of squared periods) drops.
    Returns the stages in the same order (none emptied).
    """
    data = _build_data(problem)
    P = len(stages)
    idx = {nid: i for i, nid in enumerate(data.ids)}
    block = [0] * len(data.ids)
    for b, nodes in enumerate(stages):
        for nid in nodes:
            block[idx[nid]] = b
    n = len(data.ids)
    level = _Level([[i] for i in range(n)], [set(p) for p in data.pred], [set(q) for q in data.succ],
                   [data.work[i] + data.rec[i] for i in range(n)], [0.0] * n, dict(data.edge_bytes))
    state = _State(problem, data, block, P)
    _refine(level, state)
    out: list[list[int]] = [[] for _ in range(P)]
    for i, b in enumerate(state.block):
        out[b].append(data.ids[i])
    return [sorted(s) for s in out]


# --------------------------------------------------------------------------- driver

def _plan(data: _Data, block: list[int], P: int, info: dict, num_gpus: int | None = None) -> Plan:
    nodes: dict[int, list[int]] = {}
    for i, b in enumerate(block):
        nodes.setdefault(b, []).append(data.ids[i])
    stages = [Stage(b, b, nodes[b]) for b in sorted(nodes)]
    return Plan("acyclic", num_gpus or P, stages, info)


def _run_seed(problem: Problem, data: _Data, P: int, seed: int, rebalance: int = 3) -> tuple[Plan, list[Plan]]:
    """One multilevel run: the initial partition and the refined candidates, best last.

    After the V-cycle, up to ``rebalance`` rounds re-split the refined order (blocks
    in turn, nodes in graph order inside a block — a topological order) with the
    exact greedy fill, then refine single nodes again. This shifts every block
    boundary at once, which single-node moves between two blocks cannot do.
    """
    rng = random.Random(seed) if seed else None
    levels = _hierarchy(data, problem, P, rng)
    top = levels[-1]
    coarse_block = _initial(top, data, problem, P)
    block = [0] * len(data.ids)
    for x, ms in enumerate(top.members):
        for i in ms:
            block[i] = coarse_block[x]
    info = {"seed": seed, "levels": len(levels), "coarsest_nodes": len(top.members)}
    initial = _plan(data, block, P, dict(info), problem.num_gpus)
    state = _State(problem, data, block, P)
    moves = sum(_refine(level, state) for level in reversed(levels))
    candidates = [_plan(data, state.block, P, dict(info, moves=moves, rebalanced=0), problem.num_gpus)]
    score = state.score()
    filler = _Filler(problem, data, P)
    for r in range(rebalance):
        order = sorted(range(len(data.ids)), key=lambda i: (state.block[i], i))
        got = filler.best([[i] for i in order])
        block = [0] * len(order)
        for i, b in zip(order, got):
            block[i] = b
        trial = _State(problem, data, block, P)
        moves += _refine(levels[0], trial)
        if not _better(trial.score(), score):
            break
        state, score = trial, trial.score()
        candidates.append(_plan(data, state.block, P, dict(info, moves=moves, rebalanced=r + 1), problem.num_gpus))
    return initial, candidates


def partition_acyclic(problem: Problem, *, seeds: int = 3, max_stages: int | None = None) -> Plan:
    """Partition the op nodes into at most one stage per GPU with a multilevel acyclic partitioner.

    Parameters
    ----------
    problem : Problem
        Graph, profile, cluster and schedule.
    seeds : int
        Number of runs; run 0 matches heavy edges deterministically, the others
        perturb edge weights with a seeded random factor. The best plan wins.
    max_stages : int, optional
        Use at most this many GPUs (one stage each).

    Returns
    -------
    Plan
        Stages in topological order, stage ``b`` on GPU ``b``. ``info`` holds
        ``objective_ms`` and ``initial_objective_ms`` (the initial partition of
        the winning run, which refinement never worsens), ``seed``, ``levels``,
        ``coarsest_nodes`` and ``moves``.

    Raises
    ------
    Infeasible
        When no run yields a plan whose every GPU fits its memory.
    """
    P = min(problem.num_gpus, max_stages or problem.num_gpus)
    data = _build_data(problem)
    if not data.ids:
        raise Infeasible("the graph has no op nodes")
    P = min(P, len(data.ids))
    need = sum(data.ptotal)
    if need > P * problem.cluster.gpu_memory:
        raise Infeasible(f"parameters, gradients and optimizer state need {format_bytes(need)}, more than "
                         f"{P} GPUs x {format_bytes(problem.cluster.gpu_memory)}")
    from ..runtime.schedules import ScheduleError

    try:
        _Chain(problem, data, P)
    except ScheduleError as exc:
        raise Infeasible(f"the {problem.schedule} schedule cannot run {P} stages: {exc}") from None
    best: tuple | None = None
    reasons = []
    for attempt in range(3):
        best, over = _run_seeds(problem, data, P, seeds, reasons)
        if best is not None or over <= 0:
            break
        # The refinement's estimate missed ``over`` bytes somewhere: keep that much free and rerun.
        data.margin += over
    if best is None:
        raise Infeasible(f"acyclic partitioning found no plan that fits memory: {reasons[0]}")
    best[1].info["memory_margin"] = data.margin
    return best[1]


def _run_seeds(problem: Problem, data: "_Data", P: int, seeds: int, reasons: list) -> tuple[tuple | None, int]:
    """Every seed's run; the best feasible plan (or None) and the least overshoot seen."""
    best: tuple | None = None
    over = -1
    for seed in range(max(1, seeds)):
        initial, refined = _run_seed(problem, data, P, seed)
        c0 = evaluate(problem, initial)
        # Refinement judges memory by a conservative depth and may trade exactness for
        # speed: the exact objective picks among the initial partition and the refined ones.
        pick, cost = initial, c0
        for plan in refined:
            c = evaluate(problem, plan)
            if (c.feasible, -c.objective_ms) > (cost.feasible, -cost.objective_ms):
                pick, cost = plan, c
        if not cost.feasible:
            reasons.append(cost.reason)
            excess = max(g.memory_bytes - g.memory_limit for g in cost.gpus)
            over = excess if over < 0 else min(over, excess)
            continue
        pick.info.update(objective_ms=cost.objective_ms,
                         initial_objective_ms=c0.objective_ms if c0.feasible else None,
                         initial_feasible=c0.feasible, refined=pick is not initial)
        if best is None or cost.objective_ms < best[0]:
            best = (cost.objective_ms, pick)
    return best, over
