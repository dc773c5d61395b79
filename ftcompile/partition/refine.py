"""Single-node refinement of a plan whose stages may share GPUs (FTPipe §4.1, step 4).

:class:`Refiner` holds a plan at op level (each node's stage, each stage's GPU) with what it
needs to price a move cheaply: GPU loads in ms and GPU memory in bytes by
:class:`~ftcompile.partition.base.MemoryModel`, the rule :func:`~ftcompile.plan.evaluate`
applies. Two searches use it:

* :meth:`Refiner.run` moves single nodes to a neighbouring stage on another GPU while that
  lowers the larger of the two GPU loads, within memory and keeping the stage graph acyclic
  (Mixed-pipe's refinement, :func:`refine_stages`);
* :meth:`Refiner.relieve` moves single nodes off GPUs over memory (Mixed-pipe's closest misses,
  METIS's memory-balanced retry, exact's assignments a little over memory).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..plan import Problem, _shared_sum_ms
from .base import MemoryModel

EPS_MS = 1e-9


def sink_depths(succ: dict[int, set[int]], order: list[int]) -> dict[int, int]:
    """Each node's longest path to a sink, in edges (0 for a sink); ``order`` is topological."""
    depth: dict[int, int] = {}
    for b in reversed(order):
        depth[b] = 1 + max((depth[s] for s in succ[b]), default=-1)
    return depth



@dataclass
class Refiner:
    """Op-level state of a plan for cheap what-if moves (loads in ms, memory in bytes)."""

    problem: Problem
    stage_of: dict[int, int]
    gpu_of: dict[int, int]          # stage -> gpu

    def __post_init__(self):
        p = self.problem
        g = p.graph
        self.members: dict[int, set[int]] = {}
        for n, s in self.stage_of.items():
            self.members.setdefault(s, set()).add(n)
        self.base = {n: p.profile.nodes[n].forward_ms + p.profile.nodes[n].backward_ms for n in self.stage_of}
        self.rec = {n: p.profile.nodes[n].recompute_ms for n in self.stage_of}
        self.loss = next((n.id for n in g.nodes if n.is_loss and n.id in self.stage_of), None)
        self.cnt: dict[tuple[int, int], int] = {}
        for e in g.edges:
            a, b = self.stage_of.get(e.src), self.stage_of.get(e.dst)
            if a is not None and b is not None and a != b:
                self.cnt[(a, b)] = self.cnt.get((a, b), 0) + 1
        self.pcount: dict[int, dict[str, int]] = {gg: {} for gg in range(p.num_gpus)}
        for n, s in self.stage_of.items():
            pc = self.pcount[self.gpu_of[s]]
            for prm in g.node(n).params:
                pc[prm] = pc.get(prm, 0) + 1
        self.sbase = {s: sum(self.base[n] for n in m) for s, m in self.members.items()}
        self.srec = {s: sum(self.rec[n] for n in m) for s, m in self.members.items()}
        self.act = {n: p.profile.nodes[n].activation_bytes for n in self.stage_of}
        self.sact = {s: sum(self.act[n] for n in m) for s, m in self.members.items()}
        self.nin = {n: sorted({e.src for e in g.in_edges(n) if e.src in self.stage_of}) for n in self.stage_of}
        self.nout = {n: sorted({e.dst for e in g.out_edges(n) if e.dst in self.stage_of}) for n in self.stage_of}
        self._in_cache: dict[int, int] = {}
        self._pm_cache: dict[int, int] = {}
        self._mm = MemoryModel.of(p)
        self._mem: list[int] | None = None          # every GPU's memory in the current state
        self._upd: dict[int, float] = {}            # per stage: its optimizer step's share U / M
        readers: dict[str, set[int]] = {}
        for n in self.stage_of:
            for prm in g.node(n).params:
                readers.setdefault(prm, set()).add(n)
        self._tied = {prm: r for prm, r in readers.items() if len(r) > 1}   # may be held by several stages
        self._refresh_structure()

    # ------------------------------------------------------------- structure
    def _succ(self) -> dict[int, set[int]]:
        succ = {s: set() for s in self.members}
        for (a, b) in self.cnt:
            succ[a].add(b)
        return succ

    def _refresh_structure(self) -> None:
        succ = self._succ()
        order = _topo(succ)
        self.depth = sink_depths(succ, order) if order is not None else {}
        ls = self.stage_of.get(self.loss) if self.loss is not None else None
        self.last = ls if ls is not None and not succ[ls] else None

    def recomputes(self, s: int) -> bool:
        # As evaluate reads it: every stage at depth 0 (the last, and any other sink of the stage
        # graph: side outputs, a counter) is at the end of the pipeline.
        d = self.depth.get(s)
        return self.problem.recomputes(d == 0 if d is not None else s == self.last)

    def stage_load(self, s: int) -> float:
        upd = self._upd.get(s)
        if upd is None:
            graph = self.problem.graph
            names = {prm for n in self.members[s] for prm in graph.node(n).params}
            holders = {prm: len({self.stage_of[n] for n in self._tied[prm]}) for prm in names if prm in self._tied}
            upd = self.problem.update_ms(names) + _shared_sum_ms(self.problem, [q for q in names if q in holders],
                                                                 holders)
            upd = self._upd[s] = upd / self.problem.micro_batches
        return self.sbase[s] + upd + (self.srec[s] if self.recomputes(s) else 0.0)

    def gpu_loads(self) -> list[float]:
        load = [0.0] * self.problem.num_gpus
        for s in self.members:
            load[self.gpu_of[s]] += self.stage_load(s)
        return load

    # ------------------------------------------------------------- memory (mirrors plan.evaluate)
    def _stage_inputs(self, s: int) -> int:
        """Bytes a stage receives per micro-batch, counted as evaluate does (cached per stage)."""
        got = self._in_cache.get(s)
        if got is None:
            graph = self.problem.graph
            nodes = self.members[s]
            vals: dict[str, int] = {}
            from_inputs = 0
            for n in nodes:
                for e in graph.in_edges(n):
                    if e.src in self.stage_of:
                        if e.src not in nodes:
                            vals[e.value] = e.bytes
                    elif graph.node(e.src).kind == "input":
                        from_inputs += e.bytes      # evaluate counts graph inputs once per edge
            got = self._in_cache[s] = sum(vals.values()) + from_inputs
        return got

    def _param_memory(self, gpu: int) -> int:
        got = self._pm_cache.get(gpu)
        if got is None:
            params = self.problem.profile.params
            got = self._pm_cache[gpu] = sum(params[prm].total for prm in self.pcount[gpu])
        return got

    def gpu_memory(self, gpu: int) -> int:
        """Memory of ``gpu`` exactly as :func:`ftcompile.plan.evaluate` counts it
        (:meth:`MemoryModel.gpus_of` over the current stages, once per state)."""
        if self._mem is None:
            self._mem = self._mm.gpus_of({s: (self.gpu_of[s], sorted(m)) for s, m in self.members.items() if m},
                                         self.problem.num_gpus)
        return self._mem[gpu]

    # ------------------------------------------------------------- moves
    def _apply(self, n: int, t: int) -> bool:
        """Move node ``n`` to stage ``t``; returns whether the set of stage edges changed."""
        graph = self.problem.graph
        s = self.stage_of[n]
        before = set(self.cnt)
        for e in graph.in_edges(n):
            a = self.stage_of.get(e.src)
            if a is None:
                continue
            if a != s:
                self._dec((a, s))
            if a != t:
                self.cnt[(a, t)] = self.cnt.get((a, t), 0) + 1
        for e in graph.out_edges(n):
            b = self.stage_of.get(e.dst)
            if b is None:
                continue
            if b != s:
                self._dec((s, b))
            if b != t:
                self.cnt[(t, b)] = self.cnt.get((t, b), 0) + 1
        # Edges from n to itself cannot exist; edges between n and nodes of s/t were handled above
        # with a == s / b == s meaning "internal before the move".
        self.stage_of[n] = t
        self.members[s].discard(n)
        self.members[t].add(n)
        self.sbase[s] -= self.base[n]
        self.sbase[t] += self.base[n]
        self.srec[s] -= self.rec[n]
        self.srec[t] += self.rec[n]
        self.sact[s] -= self.act[n]
        self.sact[t] += self.act[n]
        self._in_cache.pop(s, None)
        self._in_cache.pop(t, None)
        if any(prm in self._tied for prm in graph.node(n).params):
            self._upd.clear()   # a tied tensor's holders may change: every stage holding it
        else:
            self._upd.pop(s, None)
            self._upd.pop(t, None)
        self._mem = None
        gs, gt = self.gpu_of[s], self.gpu_of[t]
        if gs != gt:
            self._pm_cache.pop(gs, None)
            self._pm_cache.pop(gt, None)
            for prm in graph.node(n).params:
                self.pcount[gs][prm] -= 1
                if not self.pcount[gs][prm]:
                    del self.pcount[gs][prm]
                self.pcount[gt][prm] = self.pcount[gt].get(prm, 0) + 1
        return set(self.cnt) != before

    def _dec(self, key: tuple[int, int]) -> None:
        c = self.cnt[key] - 1
        if c:
            self.cnt[key] = c
        else:
            del self.cnt[key]

    def try_move(self, n: int, t: int, limit: int) -> bool:
        """Move ``n`` to ``t`` if the stage graph stays acyclic and memory fits; else leave all as it was."""
        s = self.stage_of[n]
        if len(self.members[s]) == 1:
            return False
        structural = self._apply(n, t)
        ok = True
        after = None
        if structural:
            succ = self._succ()
            if _topo(succ) is None:
                ok = False
            else:
                old_last = self.last
                self._refresh_structure()
                if old_last is not None and self.last is None:
                    ok = False      # keep the loss stage a sink: it is the cheap, non-recomputing one
        if ok:
            gpus = range(self.problem.num_gpus) if structural else {self.gpu_of[s], self.gpu_of[t]}
            after = {g: self.gpu_memory(g) for g in gpus}
            ok = all(m <= limit for m in after.values())
        if not ok:
            self._apply(n, s)
            if structural:
                self._refresh_structure()
            if not ok and after is not None:
                # An over-full start may still move if no GPU gets fuller or crosses the limit.
                before = {g: self.gpu_memory(g) for g in after}
                ok = all(after[g] <= max(limit, before[g]) for g in after) and any(
                    after[g] < before[g] for g in after if before[g] > limit)
                if ok:
                    self._apply(n, t)
                    if structural:
                        self._refresh_structure()
        return ok

    def run(self, max_moves: int = 20000, max_seconds: float = 5.0) -> int:
        """Greedy balancing moves until none lowers a pair's larger load; returns moves made.

        A move takes one node to a neighbouring stage on another GPU when that lowers
        the larger of the two GPUs' loads (a free node may move to the lighter GPU
        without lowering it). Stops after ``max_moves`` moves or ``max_seconds``.
        """
        limit = self.problem.cluster.gpu_memory
        moves = 0
        rejected: set[tuple[int, int]] = set()
        deadline = time.perf_counter() + max_seconds
        while moves < max_moves and time.perf_counter() < deadline:
            load = self.gpu_loads()
            done = False
            for g in sorted(range(len(load)), key=lambda g: -load[g]):
                cands = self._candidates(g, load, rejected)
                # Try the best first; after each move re-check the rest against the new loads.
                for _, n, t in cands:
                    s = self.stage_of[n]
                    h = self.gpu_of[t]
                    out = self.base[n] + (self.rec[n] if self.recomputes(s) else 0.0)
                    inn = self.base[n] + (self.rec[n] if self.recomputes(t) else 0.0)
                    if not self._worth(load[g], load[h], out, inn):
                        continue
                    if self.try_move(n, t, limit):
                        new = self.gpu_loads()
                        # The estimate read s's and t's recomputation before the move; a move that
                        # changes which of them is at the end of the pipeline (depth 0: no
                        # recomputation) changes their loads beyond it. Kept only where it holds.
                        if not self._worth(load[g], load[h], load[g] - new[g], new[h] - load[h]):
                            if self._apply(n, s):
                                self._refresh_structure()
                            rejected.add((n, t))
                            continue
                        moves += 1
                        done = True
                        load = new
                        if moves >= max_moves:
                            break
                    else:
                        rejected.add((n, t))
                if done:
                    break
            if not done:
                break
        return moves

    def overflow(self, limit: int) -> int:
        """Bytes by which the GPUs together exceed ``limit`` (0 when every GPU fits)."""
        return sum(max(0, self.gpu_memory(g) - limit) for g in range(self.problem.num_gpus))

    def relieve(self, max_seconds: float = 1.0) -> int:
        """Single-node moves off GPUs over the memory limit, until every GPU fits or none helps.

        Each round prices every move of a node on an over-full GPU into a neighbouring stage on
        another GPU (the stage graph kept acyclic, the loss stage kept a sink, no stage emptied)
        and makes the one that lowers the total overflow most; ties go to the lower largest GPU
        load. A move is kept only when the overflow falls, so the search ends. Whole-stage moves
        (:func:`ftcompile.partition.metis.repair_memory`) cannot split a stage whose weights and
        in-flight activations are too much for any one GPU; single nodes can. Returns moves made.
        """
        limit = self.problem.cluster.gpu_memory
        free = 1 << 62                    # try_move's limit when only structure is checked
        deadline = time.perf_counter() + max_seconds
        moves = 0
        over = self.overflow(limit)
        while over and time.perf_counter() < deadline:
            best = None
            full = {g for g in range(self.problem.num_gpus) if self.gpu_memory(g) > limit}
            for s in sorted(s for s in self.members if self.gpu_of[s] in full):
                for n in sorted(self.members[s]):
                    if n == self.loss or len(self.members[s]) == 1:
                        continue
                    near = {self.stage_of[x] for x in self.nin[n]} | {self.stage_of[x] for x in self.nout[n]}
                    for t in sorted(t for t in near if self.gpu_of[t] != self.gpu_of[s]):
                        if time.perf_counter() >= deadline:
                            break
                        if not self.try_move(n, t, free):
                            continue
                        key = (self.overflow(limit), max(self.gpu_loads()))
                        if self._apply(n, s):              # back, unchecked: that state was valid
                            self._refresh_structure()
                        if key[0] < over and (best is None or key < best[0]):
                            best = (key, n, t)
            if best is None:
                break
            self.try_move(best[1], best[2], free)
            over = best[0][0]
            moves += 1
        return moves

    @staticmethod
    def _worth(lg: float, lh: float, out: float, inn: float) -> bool:
        if max(lg - out, lh + inn) < max(lg, lh) - EPS_MS:
            return True
        # Free nodes (views) drift towards the lighter GPU: they often hide the next real
        # operator of a stage's frontier.
        return out == inn == 0.0 and lh < lg - EPS_MS

    def _candidates(self, g: int, load: list[float], rejected: set) -> list[tuple[float, int, int]]:
        """Moves of nodes on GPU ``g`` into neighbouring stages on other GPUs, best first."""
        cands = []
        for s in [s for s in self.members if self.gpu_of[s] == g]:
            rs = self.recomputes(s)
            for n in self.members[s]:
                if n == self.loss:
                    continue
                ins = {self.stage_of[x] for x in self.nin[n]}
                outs = {self.stage_of[x] for x in self.nout[n]}
                for t in (ins | outs):
                    if t == s:
                        continue
                    # Moving n downstream while it feeds s (or upstream while s feeds it)
                    # would make s and t feed each other: skip without trying.
                    if (s in outs and (s, t) in self.cnt) or (s in ins and (t, s) in self.cnt):
                        continue
                    h = self.gpu_of[t]
                    if h == g or (n, t) in rejected:
                        continue
                    out = self.base[n] + (self.rec[n] if rs else 0.0)
                    inn = self.base[n] + (self.rec[n] if self.recomputes(t) else 0.0)
                    if self._worth(load[g], load[h], out, inn):
                        cands.append((max(load[g] - out, load[h] + inn), n, t))
        cands.sort()
        return cands

    @classmethod
    def of_stages(cls, problem: Problem, stages) -> "Refiner":
        """The state of ``stages``, ``(gpu, nodes)`` pairs (as :meth:`stages` returns them), the
        i-th numbered i."""
        stages = list(stages)
        return cls(problem, {n: i for i, (_g, nodes) in enumerate(stages) for n in nodes},
                   {i: g for i, (g, _nodes) in enumerate(stages)})

    def stages(self) -> list[tuple[int, list[int]]]:
        return [(self.gpu_of[s], sorted(m)) for s, m in self.members.items() if m]


def _topo(succ: dict[int, set[int]]) -> list[int] | None:
    indeg = {s: 0 for s in succ}
    for a in succ:
        for b in succ[a]:
            indeg[b] += 1
    ready = [s for s, d in indeg.items() if d == 0]
    order = []
    while ready:
        s = ready.pop()
        order.append(s)
        for b in succ[s]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return order if len(order) == len(succ) else None


def refine_stages(problem: Problem, stages: list[tuple[int, list[int]]], max_moves: int = 20000,
                  max_seconds: float = 5.0) -> list[tuple[int, list[int]]]:
    """Step 3 of FTPipe §4.1: op-level greedy moves between neighbouring stages on different GPUs."""
    r = Refiner.of_stages(problem, stages)
    r.run(max_moves, max_seconds)
    return r.stages()
