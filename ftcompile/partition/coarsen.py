"""Graph coarsening for the partitioners (FTPipe §4.1.1, "Step 1: Coarsening").

Coarsening contracts op nodes into *blocks* (sets of op nodes) so that the
partitioners place a few hundred or a few dozen units instead of thousands of
operators. Every contraction keeps the *quotient graph* (blocks as vertices,
values flowing between blocks as edges) acyclic: a topological order of the
blocks is maintained dynamically (Pearce–Kelly style), and a set of blocks is
merged only if it is *convex* — no path leaves the set and comes back.

The steps, in the order :func:`coarsen` runs them (coarsening by type runs
before the two clean-up steps, unlike the paper's listing, so that a view merged
into its lightest neighbour cannot glue two module instances together):

1. inputs and outputs are not op nodes and never enter a block;
2. zero-weight nodes (views, integer and mask ops: compute ≈ 0) join their
   lightest neighbour;
3. nodes whose output communication is above a percentile (99th) join their
   neighbours, so a huge tensor never crosses a stage boundary;
4. *coarsening by type*: all nodes inside one instance of a module (a
   ``T5LayerFF``, a ``GPT2Block``...) become one block, choosing for each node
   the outermost module instance whose compute is at most ``cap_ms``;
5. :func:`grow_around_centers` (run by the caller for each target ``L``):
   ``L`` centre blocks absorb their neighbours, lightest centre first, under a
   memory limit, until only (about) ``L`` blocks remain.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import networkx as nx

from ..ir import OpGraph
from ..profile import Profile


def node_work(profile: Profile, node_id: int) -> float:
    """Compute of one node per micro-batch as a recomputing stage runs it (fwd + bwd + recompute)."""
    c = profile.nodes[node_id]
    return c.forward_ms + c.backward_ms + c.recompute_ms


class Quotient:
    """A mutable quotient DAG of an OpGraph's op nodes.

    ``members[b]`` lists the op nodes of block ``b``; ``succ[b]``/``pred[b]`` map
    neighbouring blocks to the bytes flowing along that edge (per micro-batch);
    ``pos[b]`` is a topological position (unique, not contiguous) that every
    merge keeps valid. Block ids are the id of one member; merged-away ids vanish.
    """

    def __init__(self, graph: OpGraph, profile: Profile):
        self.graph = graph
        self.profile = profile
        ops = [n.id for n in graph.op_nodes()]
        opset = set(ops)
        self.members: dict[int, list[int]] = {n: [n] for n in ops}
        self.work: dict[int, float] = {n: node_work(profile, n) for n in ops}
        self.params: dict[int, set[str]] = {n: set(graph.node(n).params) for n in ops}
        self.act: dict[int, int] = {n: profile.nodes[n].activation_bytes for n in ops}
        self.pos: dict[int, int] = {n: i for i, n in enumerate(ops)}   # graph.nodes is topological
        self.succ: dict[int, dict[int, int]] = {n: {} for n in ops}
        self.pred: dict[int, dict[int, int]] = {n: {} for n in ops}
        for e in graph.edges:
            if e.src in opset and e.dst in opset and e.src != e.dst:
                self.succ[e.src][e.dst] = self.succ[e.src].get(e.dst, 0) + e.bytes
                self.pred[e.dst][e.src] = self.pred[e.dst].get(e.src, 0) + e.bytes

    # ----------------------------------------------------------------- queries
    def blocks(self) -> list[int]:
        """Block ids in topological order."""
        return sorted(self.members, key=self.pos.__getitem__)

    def neighbours(self, b: int) -> set[int]:
        return set(self.succ[b]) | set(self.pred[b])

    def param_memory(self, params: Iterable[str]) -> int:
        return sum(self.profile.params[p].total for p in params)

    def memory(self, b: int) -> int:
        """Weights, gradients and optimizer state of the block plus one micro-batch's activations."""
        return self.param_memory(self.params[b]) + self.act[b]

    def _affected(self, group: set[int]) -> tuple[list[int], list[int]] | None:
        """Blocks between the group's extremes that must move when it merges; None if not convex.

        Returns ``(fwd, bwd)``: the blocks strictly inside the group's position
        window reachable from the group, and those reaching it. A block in both
        lies on a path that leaves the group and re-enters it.
        """
        lo = min(self.pos[b] for b in group)
        hi = max(self.pos[b] for b in group)
        fwd: set[int] = set()
        stack = [s for b in group for s in self.succ[b] if s not in group and self.pos[s] < hi]
        while stack:
            x = stack.pop()
            if x in fwd:
                continue
            fwd.add(x)
            for s in self.succ[x]:
                if s in group:
                    return None
                if s not in fwd and self.pos[s] < hi:
                    stack.append(s)
        bwd: set[int] = set()
        stack = [p for b in group for p in self.pred[b] if p not in group and self.pos[p] > lo]
        while stack:
            x = stack.pop()
            if x in bwd:
                continue
            bwd.add(x)
            for p in self.pred[x]:
                if p not in bwd and p not in group and self.pos[p] > lo:
                    stack.append(p)
        return sorted(fwd, key=self.pos.__getitem__), sorted(bwd, key=self.pos.__getitem__)

    def can_merge(self, group: Iterable[int]) -> bool:
        """Whether contracting ``group`` into one block keeps the quotient acyclic."""
        g = set(group)
        return len(g) <= 1 or self._affected(g) is not None

    # ----------------------------------------------------------------- updates
    def merge(self, group: Iterable[int]) -> int | None:
        """Contract ``group`` into one block and return its id; None (and no change) if that makes a cycle."""
        g = set(group)
        if len(g) <= 1:
            return next(iter(g), None)
        aff = self._affected(g)
        if aff is None:
            return None
        fwd, bwd = aff
        # Reuse the positions of everything that moves: blocks reaching the group go first,
        # then the merged block, then the blocks it reaches (each set keeps its order).
        pool = sorted([self.pos[b] for b in g] + [self.pos[b] for b in fwd] + [self.pos[b] for b in bwd])
        keep = min(g, key=self.pos.__getitem__)
        seq = bwd + [keep] + fwd
        # Drop the surplus positions from the middle so that bwd only moves earlier, fwd only later.
        slots = pool[:len(bwd) + 1] + pool[len(pool) - len(fwd):]
        for b, p in zip(seq, slots):
            self.pos[b] = p
        for b in g:
            if b == keep:
                continue
            self.members[keep].extend(self.members.pop(b))
            self.work[keep] += self.work.pop(b)
            self.params[keep] |= self.params.pop(b)
            self.act[keep] += self.act.pop(b)
            del self.pos[b]
            for s, w in self.succ.pop(b).items():
                del self.pred[s][b]
                if s not in g:
                    self.succ[keep][s] = self.succ[keep].get(s, 0) + w
                    self.pred[s][keep] = self.pred[s].get(keep, 0) + w
            for p, w in self.pred.pop(b).items():
                del self.succ[p][b]
                if p not in g:
                    self.pred[keep][p] = self.pred[keep].get(p, 0) + w
                    self.succ[p][keep] = self.succ[p].get(keep, 0) + w
        for x in list(self.succ[keep]):
            if x in g:
                del self.succ[keep][x]
                self.pred[x].pop(keep, None)
        for x in list(self.pred[keep]):
            if x in g:
                del self.pred[keep][x]
                self.succ[x].pop(keep, None)
        return keep

    # ----------------------------------------------------------------- export
    def groups(self) -> list[list[int]]:
        """The blocks' op nodes, blocks in topological order, nodes sorted."""
        return [sorted(self.members[b]) for b in self.blocks()]

    def to_networkx(self) -> nx.DiGraph:
        """The quotient DAG; vertices are block ids with ``work``, ``nodes``; edges carry ``bytes``."""
        q = nx.DiGraph()
        for b in self.blocks():
            q.add_node(b, work=self.work[b], nodes=sorted(self.members[b]))
        for b, ss in self.succ.items():
            for s, w in ss.items():
                q.add_edge(b, s, bytes=w)
        return q

    def copy(self) -> "Quotient":
        q = object.__new__(Quotient)
        q.graph, q.profile = self.graph, self.profile
        q.members = {b: list(m) for b, m in self.members.items()}
        q.work = dict(self.work)
        q.params = {b: set(p) for b, p in self.params.items()}
        q.act = dict(self.act)
        q.pos = dict(self.pos)
        q.succ = {b: dict(s) for b, s in self.succ.items()}
        q.pred = {b: dict(p) for b, p in self.pred.items()}
        return q


# --------------------------------------------------------------------------- steps

def fits_merged(q: Quotient, group, memory_limit: int | None) -> bool:
    """Whether the block made of ``group`` could still run on one GPU: its weights, gradients and
    optimizer state plus one micro-batch of its activations (:meth:`Quotient.memory`) within
    ``memory_limit`` (None: no limit). Every coarsening step checks this, so no block is ever
    too big for every GPU (a view of 0 ms but 0.25 GB merged into a 0.51 GB neighbour on
    0.73 GB GPUs would be)."""
    if memory_limit is None:
        return True
    group = list(group)
    params = set().union(*(q.params[b] for b in group))
    return q.param_memory(params) + sum(q.act[b] for b in group) <= memory_limit


def merge_zero_weight(q: Quotient, eps_ms: float = 1e-6, memory_limit: int | None = None) -> int:
    """Merge every block of (near-)zero compute into its lightest mergeable neighbour that it
    fits with (:func:`fits_merged`); returns merges done."""
    done = 0
    for b in q.blocks():
        if b not in q.members or q.work[b] > eps_ms:
            continue
        for n in sorted(q.neighbours(b), key=lambda x: (q.work[x], q.pos[x])):
            if not fits_merged(q, (b, n), memory_limit):
                continue
            if q.merge((b, n)) is not None:
                done += 1
                break
    return done


def merge_heavy_edges(q: Quotient, percentile: float = 99.0, memory_limit: int | None = None) -> int:
    """Merge the endpoints of edges whose bytes lie above ``percentile`` of all edge sizes (when
    the result fits one GPU, :func:`fits_merged`)."""
    sizes = sorted(w for ss in q.succ.values() for w in ss.values())
    if len(sizes) < 2:
        return 0
    cut = sizes[min(len(sizes) - 1, int(len(sizes) * percentile / 100.0))]
    done = 0
    heavy = sorted(((w, a, b) for a, ss in q.succ.items() for b, w in ss.items() if w > cut), reverse=True)
    rep = {}        # merged-away id -> surviving id

    def find(x):
        while x in rep:
            x = rep[x]
        return x

    for _, a, b in heavy:
        a, b = find(a), find(b)
        if a == b or not fits_merged(q, (a, b), memory_limit):
            continue
        keep = q.merge((a, b))
        if keep is not None:
            done += 1
            for x in (a, b):
                if x != keep:
                    rep[x] = keep
    return done


def merge_by_scope(q: Quotient, cap_ms: float, min_repeats: int = 2, memory_limit: int | None = None) -> int:
    """Coarsening by type: contract module instances whose compute is at most ``cap_ms``.

    For each op node, the outermost scope in its module stack whose class occurs
    at least ``min_repeats`` times (a repeated module such as a Transformer
    block) and whose instance's total compute is at most ``cap_ms`` names its
    group. Instances are merged outermost first; a group that would create a
    cycle is tried again one level deeper.
    """
    graph = q.graph
    owner = {n: b for b, ms in q.members.items() for n in ms}
    inst_work: dict[str, float] = {}
    inst_class: dict[str, str] = {}
    for n in graph.op_nodes():
        w = node_work(q.profile, n.id)
        for path, cls in n.scopes:
            if path == "":
                continue
            inst_work[path] = inst_work.get(path, 0.0) + w
            inst_class[path] = cls
    class_count: dict[str, int] = {}
    for path, cls in inst_class.items():
        class_count[cls] = class_count.get(cls, 0) + 1

    def eligible(path: str) -> bool:
        return class_count[inst_class[path]] >= min_repeats and inst_work[path] <= cap_ms

    # Candidate scope chain per node, outermost first (only eligible ones).
    chains = {n.id: [p for p, _ in n.scopes if p and eligible(p)] for n in graph.op_nodes()}
    level = {n: 0 for n in chains}
    done = 0
    for _ in range(8):         # deeper retries for groups that were not convex
        groups: dict[str, set[int]] = {}
        for n, ch in chains.items():
            if level[n] < len(ch):
                groups.setdefault(ch[level[n]], set()).add(n)
        if not groups:
            break
        retry = False
        for path in sorted(groups, key=lambda p: min(q.pos[owner[n]] for n in groups[p] if owner[n] in q.pos)):
            blocks = {owner[n] for n in groups[path]}
            keep = q.merge(blocks) if fits_merged(q, blocks, memory_limit) else None
            if keep is None:
                for n in groups[path]:
                    level[n] += 1
                retry = True
                continue
            done += 1
            for n in q.members[keep]:
                owner[n] = keep
                level[n] = len(chains[n])   # settled
        if not retry:
            break
    return done


def coarsen(graph: OpGraph, profile: Profile, *, cap_ms: float | None = None, percentile: float = 99.0,
            by_scope: bool = True, memory_limit: int | None = None) -> Quotient:
    """Steps 1–4 of FTPipe's coarsening; returns the quotient (call :meth:`Quotient.groups` for blocks).

    ``cap_ms`` bounds the compute of a module instance merged by type (default:
    1/32 of the total work, fine enough for load balancing on 8 GPUs).
    ``memory_limit``: no step makes a block that would not fit one GPU alone.
    """
    q = Quotient(graph, profile)
    total = sum(q.work.values())
    if cap_ms is None:
        cap_ms = total / 32.0
    if by_scope:
        merge_by_scope(q, cap_ms, memory_limit=memory_limit)
    merge_zero_weight(q, memory_limit=memory_limit)
    merge_heavy_edges(q, percentile, memory_limit=memory_limit)
    return q


def grow_around_centers(q: Quotient, num_blocks: int, memory_limit: int | None = None, *, seed: int = 0,
                        regions: dict[int, str] | None = None, min_share: float = 0.05) -> Quotient:
    """Coarsening around centres: contract ``q`` (a copy) to about ``num_blocks`` blocks.

    A block's *size* is the larger of its shares of the total compute and of the
    total parameter memory. ``num_blocks`` centres are picked at equal steps of
    cumulative size along the topological order (``seed`` jitters the steps);
    with ``regions`` (block -> label, e.g. the top-level module: encoder or
    decoder) every region holding at least ``min_share`` of the compute or the
    memory gets the same number of centres, so that a compute-light but
    memory-heavy region (T5's decoder) is cut into as many pieces as a heavy one.
    Then the smallest centre repeatedly absorbs its neighbouring non-centre block
    with the most traffic to it, if the result keeps the quotient acyclic and fits
    ``memory_limit`` (see :meth:`Quotient.memory`). Blocks no centre can take are
    then merged into any neighbour they can; the result may keep more than
    ``num_blocks`` blocks when memory or acyclicity forbids more merging.
    """
    q = q.copy()
    rng = random.Random(seed)
    order = q.blocks()
    if len(order) <= num_blocks:
        return q
    total_w = sum(q.work.values()) or 1.0
    total_m = q.param_memory(set().union(*q.params.values())) or 1

    def size(b: int) -> float:
        return max(q.work[b] / total_w, q.param_memory(q.params[b]) / total_m)

    jitter = rng.uniform(0.05, 0.95) if seed else 0.5
    if regions:
        by_region: dict[str, list[int]] = {}
        for b in order:
            by_region.setdefault(regions.get(b, ""), []).append(b)
        big = [r for r, bs in by_region.items()
               if sum(q.work[b] for b in bs) / total_w >= min_share
               or q.param_memory(set().union(*(q.params[b] for b in bs))) / total_m >= min_share]
        per = max(1, num_blocks // max(1, len(big)))
        chains = [(by_region[r], per) for r in big]
    else:
        chains = [(order, num_blocks)]
    centers: list[int] = []
    for chain, k in chains:
        tot = sum(size(b) for b in chain)
        step = tot / k
        acc, target, got = 0.0, step * jitter, 0
        for b in chain:
            acc += size(b)
            if acc >= target and got < k:
                centers.append(b)
                got += 1
                target += step
    for b in sorted(order, key=lambda b: -size(b)):     # too few centres (few big blocks): biggest left
        if len(centers) >= num_blocks:
            break
        if b not in centers:
            centers.append(b)
    cset = set(centers)
    limit = memory_limit if memory_limit is not None else float("inf")
    stuck: set[int] = set()
    while True:
        live = [c for c in cset if c not in stuck]
        if not live:
            break
        c = min(live, key=lambda x: (size(x), q.pos[x]))
        cands = [n for n in q.neighbours(c) if n not in cset]
        cands.sort(key=lambda n: -(q.succ[c].get(n, 0) + q.pred[c].get(n, 0)))
        merged = False
        for n in cands:
            if q.param_memory(q.params[c] | q.params[n]) + q.act[c] + q.act[n] > limit:
                continue
            keep = q.merge((c, n))
            if keep is not None:
                if keep != c:
                    cset.discard(c)
                    cset.add(keep)
                    stuck = {s if s != c else keep for s in stuck}
                merged = True
                break
        if not merged:
            stuck.add(c)
    # Leftovers: merge into whichever neighbour takes them, lightest result first.
    changed = True
    while changed and len(q.members) > num_blocks:
        changed = False
        for b in sorted((b for b in q.members if b not in cset), key=lambda b: q.work[b]):
            if b not in q.members:
                continue
            for n in sorted(q.neighbours(b), key=lambda n: q.work[n]):
                if q.param_memory(q.params[b] | q.params[n]) + q.act[b] + q.act[n] > limit:
                    continue
                was_center = n in cset
                keep = q.merge((b, n))
                if keep is not None:
                    if was_center:
                        cset.discard(n)
                        cset.add(keep)
                    changed = True
                    break
    return q


def split_contiguous(q: Quotient, num_blocks: int, shift: float = 1.0,
                     memory_limit: int | None = None) -> Quotient:
    """Contract ``q`` (a copy) into about ``num_blocks`` runs of its topological order of about
    equal compute.

    A run of consecutive blocks in a topological order is always convex, so every
    merge succeeds. ``shift`` scales the cut points (1.0: equal compute per run). A run
    also ends before a block that would take it past ``memory_limit`` (:func:`fits_merged`),
    so there may be more runs than ``num_blocks``.
    """
    q = q.copy()
    order = q.blocks()
    total = sum(q.work[b] for b in order)
    runs: list[list[int]] = [[]]
    acc = 0.0
    for b in order:
        if runs[-1] and ((len(runs) < num_blocks and acc >= total * len(runs) / num_blocks * shift)
                         or not fits_merged(q, runs[-1] + [b], memory_limit)):
            runs.append([])
        runs[-1].append(b)
        acc += q.work[b]
    for run in runs:
        q.merge(run)
    return q


def is_acyclic_partition(graph: OpGraph, groups: Sequence[Sequence[int]]) -> bool:
    """Whether contracting ``groups`` (a partition of some op nodes) gives an acyclic graph."""
    where = {n: i for i, g in enumerate(groups) for n in g}
    d = nx.DiGraph()
    d.add_nodes_from(range(len(groups)))
    for e in graph.edges:
        a, b = where.get(e.src), where.get(e.dst)
        if a is not None and b is not None and a != b:
            d.add_edge(a, b)
    return nx.is_directed_acyclic_graph(d)


@dataclass
class Coarsening:
    """A coarsening result: blocks of op nodes in topological order and their quotient DAG."""

    groups: list[list[int]]
    quotient: nx.DiGraph = field(repr=False)


def coarsen_blocks(graph: OpGraph, profile: Profile, num_blocks: int | None = None, *,
                   memory_limit: int | None = None, cap_ms: float | None = None, seed: int = 0) -> Coarsening:
    """Convenience for other partitioners: :func:`coarsen`, then optionally grow to ``num_blocks``."""
    q = coarsen(graph, profile, cap_ms=cap_ms)
    if num_blocks is not None:
        q = grow_around_centers(q, num_blocks, memory_limit, seed=seed)
    return Coarsening(q.groups(), q.to_networkx())
