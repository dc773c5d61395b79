"""Optimal convex splits of a DAG into pipeline stages, by dynamic programming over its ideals.

A *Seq-pipe* puts one stage on each of ``S <= P`` GPUs, and values flow from
earlier stages to later ones only. In DAG terms its stages are *convex*: they
are the differences of a chain of ideals (downward-closed node sets, PipeDream;
Tarnawski et al., "Efficient algorithms for device placement of DNN graph
operators", NeurIPS 2020)::

    {} = I_0  <  I_1  <  ...  <  I_S = V,    stage k = I_{k+1} - I_k on GPU k

This is more than contiguous ranges of one topological order: attention's
Q/K/V branches or a classifier head hanging off the trunk interleave in any
fixed order, and a range of one order cannot keep a branch together while
cutting the trunk just after it.

:func:`convex_split` finds the best such split by a dynamic programme over the
*upsets* of the DAG (complements of ideals), built from the sink end: a state
is the set ``U`` of nodes the later stages cover and the number ``k`` of those
stages; the next stage ``X`` (so that ``X + U`` is again an upset) then has
``k`` stages after it, which fixes the micro-batches it keeps in flight. Each
stage is priced as :func:`ftcompile.plan.evaluate` prices it (FTPipe Eq. 1
period, memory through :class:`~ftcompile.partition.base.MemoryModel`) except
for two things the DP cannot see from ``U`` alone:

* how many later stages read a value (evaluate sends it once per stage that
  reads it); the DP sends it once, a lower bound, exact for values with one
  reading stage;
* the stage's true depth (its longest path to a sink of the stage graph): the
  DP charges memory for depth ``k``, the most it can be. It is exact when every
  stage feeds the next (the usual case: the trunk runs through every stage);
* the buffers and transients that depend on the stages' neighbours (flow-control
  windows, send buffers, working sets): memory is checked with
  :meth:`~ftcompile.partition.base.MemoryModel.stage_lower`, a proven lower bound of
  what evaluate charges, so no split that fits is pruned; every split the DP returns
  is then checked by evaluate, which refuses those that do not fit;
* the gradient sums of tied tensors (a lower bound again: left out).

So a second value, a *bound*, is carried through the same states: it charges
memory at the least depth a stage can have (0 if it feeds no later stage, else
1) and lets a stage that feeds nothing skip recomputation where the schedule
allows. It is a proven lower bound on the objective of every convex split (of
the units the DP places); the plan's gap to it is reported. When the two meet,
the plan is optimal among convex splits.

The number of upsets grows with the DAG's width. Side nodes that hang off the
graph (a source read by one node, a dead-end read by nobody) multiply it; with
``attach=True`` such nodes are first attached to their only neighbour, and the
result is then optimal among convex splits that keep them attached (the
returned ``space`` says so). Searches that outgrow ``max_states`` or
``time_limit`` stop and return None.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..plan import Plan, Problem, Stage
from .base import MemoryModel

_INF = float("inf")


# --------------------------------------------------------------------------- units

@dataclass
class Units:
    """Op nodes grouped into units (single nodes, or side nodes attached to a neighbour).

    Units are indexed in a topological order; ``succ``/``pred``/``anc`` are bit
    sets of unit indices (``anc`` includes the unit itself). Values are those
    crossing between units: producer unit, reading units, bytes, floating.
    """

    members: list[list[int]]
    comp: list[float]                # forward + backward
    rec: list[float]                 # recomputation
    act: list[int]                   # activations kept for backward, one micro-batch
    ginp: list[int]                  # bytes of edges from graph inputs (per edge, as evaluate counts)
    params: list[tuple[int, ...]]    # parameter indices read
    ptotal: list[int]                # weights + gradients + optimizer state, per parameter index
    pbytes: list[int]                # weights alone
    succ: list[int]
    pred: list[int]
    anc: list[int]
    vprod: list[int]
    vreaders: list[list[int]]
    vbytes: list[int]
    vfloat: list[bool]
    made: list[list[int]]            # unit -> values it produces that other units read
    reads: list[list[int]]           # unit -> values of other units it reads
    loss: int | None
    attached: int = 0                # op nodes attached to a neighbour (0: units are single nodes)
    # The same costs without the attached side nodes (the bound's relaxation deletes them);
    # the very same lists when nothing is attached.
    kcomp: list[float] = None
    krec: list[float] = None
    kact: list[int] = None
    kginp: list[int] = None
    kparams: list[tuple[int, ...]] = None
    pnames: list[str] = None         # parameter names, per index
    kreaders: list[list[int]] = None  # per value: units holding a reader that is not a side node
                                      # ([] when a side node makes it: the bound ignores it)
    cache: dict = field(default_factory=dict, repr=False)    # the upsets, once listed

    @property
    def has_side(self) -> bool:
        return self.kcomp is not self.comp

    @property
    def n(self) -> int:
        return len(self.members)


def build_units(problem: Problem, groups: list[list[int]] | None = None, side: set[int] | None = None) -> Units:
    """Units of ``problem``'s op nodes: ``groups`` (lists of op node ids whose quotient is a DAG)
    or one unit per op node. ``side``: op nodes attached to a neighbour, whose costs the bound
    leaves out (see :func:`convex_split`); every value they make or read stays inside their unit."""
    from .seq import op_sequence

    seq = op_sequence(problem)
    pos = {nid: i for i, nid in enumerate(seq.ids)}
    if groups is None:
        groups = [[nid] for nid in seq.ids]
    unit_of = np.empty(seq.n, dtype=np.int64)
    for u, g in enumerate(groups):
        for nid in g:
            unit_of[pos[nid]] = u
    n = len(groups)
    comp = [0.0] * n
    rec = [0.0] * n
    act = [0] * n
    ginp = [0] * n
    params: list[set[int]] = [set() for _ in range(n)]
    side = side or set()
    kcomp, krec, kact, kginp = [0.0] * n, [0.0] * n, [0] * n, [0] * n
    kparams: list[set[int]] = [set() for _ in range(n)]
    for i in range(seq.n):
        u = int(unit_of[i])
        comp[u] += float(seq.compute_ms[i])
        rec[u] += float(seq.recompute_ms[i])
        act[u] += int(seq.activation_bytes[i])
        ginp[u] += int(seq.input_bytes[i])
        params[u].update(seq.node_params[i])
        if seq.ids[i] not in side:
            kcomp[u] += float(seq.compute_ms[i])
            krec[u] += float(seq.recompute_ms[i])
            kact[u] += int(seq.activation_bytes[i])
            kginp[u] += int(seq.input_bytes[i])
            kparams[u].update(seq.node_params[i])
    succ = [0] * n
    pred = [0] * n
    vprod, vreaders, vbytes, vfloat = [], [], [], []
    made: list[list[int]] = [[] for _ in range(n)]
    reads: list[list[int]] = [[] for _ in range(n)]
    kreaders: list[list[int]] = []
    for p, cs, nbytes, fl in seq.values:
        pu = int(unit_of[p])
        rs = sorted({int(unit_of[c]) for c in cs} - {pu})
        if not rs:
            continue
        kreaders.append(sorted({int(unit_of[c]) for c in cs if seq.ids[c] not in side} - {pu})
                        if seq.ids[p] not in side else [])
        v = len(vprod)
        vprod.append(pu)
        vreaders.append(rs)
        vbytes.append(int(nbytes))
        vfloat.append(bool(fl))
        made[pu].append(v)
        for r in rs:
            reads[r].append(v)
            succ[pu] |= 1 << r
            pred[r] |= 1 << pu
    order = _topo_order(succ, pred)
    if order is None:
        raise ValueError("the groups do not form a DAG")
    anc = [0] * n
    for u in order:
        a = 1 << u
        p = pred[u]
        while p:
            low = p & -p
            a |= anc[low.bit_length() - 1]
            p ^= low
        anc[u] = a
    loss = int(unit_of[seq.loss_pos]) if seq.loss_pos is not None else None
    attached = seq.n - n
    uparams = [tuple(sorted(p)) for p in params]
    units = Units([list(g) for g in groups], comp, rec, act, ginp, uparams,
                  [int(x) for x in seq.param_total], [int(x) for x in seq.param_bytes], succ, pred, anc,
                  vprod, vreaders, vbytes, vfloat, made, reads, loss, attached)
    units.pnames = list(seq.param_names)
    if side:
        units.kcomp, units.krec, units.kact, units.kginp = kcomp, krec, kact, kginp
        units.kparams = [tuple(sorted(p)) for p in kparams]
        units.kreaders = kreaders
    else:
        units.kcomp, units.krec, units.kact, units.kginp, units.kparams = comp, rec, act, ginp, uparams
        units.kreaders = vreaders
    return units


def _topo_order(succ: list[int], pred: list[int]) -> list[int] | None:
    n = len(succ)
    indeg = [bin(p).count("1") for p in pred]
    ready = [u for u in range(n) if indeg[u] == 0]
    out = []
    while ready:
        u = ready.pop()
        out.append(u)
        s = succ[u]
        while s:
            low = s & -s
            v = low.bit_length() - 1
            s ^= low
            indeg[v] -= 1
            if indeg[v] == 0:
                ready.append(v)
    return out if len(out) == n else None


def attach_side_nodes(problem: Problem, max_share: float = 0.02) -> tuple[list[list[int]], set[int]]:
    """Groups of op nodes in which light side nodes join the node they hang off.

    Side nodes multiply the number of upsets without shaping the split: each may sit
    in any of many stages (an attention mask computed from the input, a label clamp, a
    BatchNorm counter nobody reads, a view between two matmuls). Repeatedly, a group
    without predecessors and with one successor joins that successor, a group without
    successors and with one predecessor joins that predecessor, a group of free nodes
    (no compute, parameters or activations: views) joins its only predecessor (or
    only successor), and a group with no neighbour joins the group after it in the
    order, as long as the joining group is light: at most ``max_share`` of the graph's
    compute (forward, backward, recomputation) and a thousandth of its parameter and
    activation memory. So the trunk's first and last operators, which read weights,
    stay free. Joining a group's only predecessor or only successor keeps the quotient
    a DAG. Returns the groups (a partition of the op nodes) and the attached nodes.
    """
    graph, prof = problem.graph, problem.profile
    ops = [n.id for n in graph.op_nodes()]
    pos = {nid: i for i, nid in enumerate(ops)}
    n = len(ops)
    work = [prof.nodes[nid].forward_ms + prof.nodes[nid].backward_ms + prof.nodes[nid].recompute_ms for nid in ops]
    pmem = [sum(prof.params[q].total for q in dict.fromkeys(graph.node(nid).params)) for nid in ops]
    amem = [prof.nodes[nid].activation_bytes for nid in ops]
    cap_w = max_share * (sum(work) or 1.0)
    cap_p = 1e-3 * sum(c.total for c in prof.params.values())
    cap_a = 1e-3 * sum(amem)
    succ: list[set[int]] = [set() for _ in range(n)]
    pred: list[set[int]] = [set() for _ in range(n)]
    for e in graph.edges:
        a, b = pos.get(e.src), pos.get(e.dst)
        if a is not None and b is not None and a != b:
            succ[a].add(b)
            pred[b].add(a)
    members = {i: [i] for i in range(n)}
    gw = {i: work[i] for i in range(n)}
    gp = {i: pmem[i] for i in range(n)}
    ga = {i: amem[i] for i in range(n)}
    parent = list(range(n))

    def light(a: int) -> bool:
        return gw[a] <= cap_w and gp[a] <= cap_p and ga[a] <= cap_a

    def join(a: int, b: int) -> None:            # group a joins group b
        members[b].extend(members.pop(a))
        gw[b] += gw.pop(a)
        gp[b] += gp.pop(a)
        ga[b] += ga.pop(a)
        for x in succ[a]:
            pred[x].discard(a)
            if x != b:
                pred[x].add(b)
                succ[b].add(x)
        for x in pred[a]:
            succ[x].discard(a)
            if x != b:
                succ[x].add(b)
                pred[b].add(x)
        succ[b].discard(a)
        pred[b].discard(a)
        succ[a], pred[a] = set(), set()
        parent[a] = b

    def free(a: int) -> bool:
        return gw[a] <= 1e-6 * cap_w / max(max_share, 1e-12) and gp[a] == 0 and ga[a] == 0

    changed = True
    while changed:
        changed = False
        for a in sorted(members):
            if a not in members or not light(a):
                continue
            if not pred[a] and len(succ[a]) == 1:
                join(a, next(iter(succ[a])))
                changed = True
            elif not succ[a] and len(pred[a]) == 1:
                join(a, next(iter(pred[a])))
                changed = True
            elif free(a) and len(pred[a]) == 1:
                # a view or reshape: a boundary right after it is one right before it
                join(a, next(iter(pred[a])))
                changed = True
            elif free(a) and len(succ[a]) == 1:
                join(a, next(iter(succ[a])))
                changed = True
    alone = sorted(a for a in members if not succ[a] and not pred[a] and light(a))
    if len(members) > len(alone):
        rest = sorted(b for b in members if b not in alone)
        for a in alone:
            later = [b for b in rest if b > a]
            join(a, later[0] if later else rest[-1])
    side = {ops[i] for i in range(n) if parent[i] != i}
    groups = sorted((sorted(ops[i] for i in members[g]) for g in members), key=lambda g: pos[g[0]])
    return groups, side


# --------------------------------------------------------------------------- the DP

@dataclass
class ConvexResult:
    """What :func:`convex_split` found: the plan's stages and the DP's figures."""

    stages: list[list[int]]          # op node ids per stage, first stage first ([]: none below the cap)
    dp_objective_ms: float           # the plan's value in the DP (sends once, depth = stages after it)
    bound_ms: float                  # proven lower bound over every convex split of the units
    states: int
    transitions: int
    seconds: float
    units: int
    attached: int                    # op nodes attached to a neighbour (the space keeps them there)
    method: str = "window"
    complete: bool = True            # False: stopped early (states or time); bound_ms is then 0
    info: dict = field(default_factory=dict)


class _Abort(Exception):
    pass


def all_upsets(units: Units, cap: int) -> tuple[list[int], np.ndarray] | None:
    """Every upset of the units' DAG with its *kept work* (see :func:`convex_split`), or None
    above ``cap`` upsets.

    Breadth-first from the empty set; each upset keeps the bit set of units that may
    join it (all their successors inside), updated from the unit that joined, and its
    sums, from the upset it was reached from.
    """
    n, succ, pred = units.n, units.succ, units.pred
    kc, kr = units.kcomp, units.krec
    # Each subset of an antichain spans an upset of its own, so an antichain of more than
    # log2(cap) units settles it at once. A greedy one does here: T5-tiny's op graph has one of
    # 24 units, and listing 200,000 upsets to find out took 0.6 s, once per seq run.
    if (1 << len(greedy_antichain(units))) > cap:
        return None
    avail0 = 0
    for u in range(n):
        if succ[u] == 0:
            avail0 |= 1 << u
    seen = {0: avail0}
    sums = [(0.0, 0.0)]
    frontier = [(0, 0.0, 0.0)]
    while frontier:
        nxt = []
        for Ubits, c0, r0 in frontier:
            av = seen[Ubits]
            a = av
            while a:
                low = a & -a
                u = low.bit_length() - 1
                a ^= low
                W = Ubits | low
                if W in seen:
                    continue
                nav = av ^ low
                p = pred[u]
                while p:
                    lp = p & -p
                    w = lp.bit_length() - 1
                    p ^= lp
                    if (succ[w] & ~W) == 0:
                        nav |= lp
                seen[W] = nav
                c, r = c0 + kc[u], r0 + kr[u]
                sums.append((c, r))
                nxt.append((W, c, r))
                if len(seen) > cap:
                    return None
        frontier = nxt
    return list(seen), np.array(sums).reshape(-1, 2)


def greedy_antichain(units: Units) -> list[int]:
    """An antichain of the units' DAG (units no path joins), taken greedily in topological
    order: its size is a lower bound on the widest one's."""
    chosen, anc_of_chosen, out = 0, 0, []
    for u in range(units.n):
        # u is comparable to a chosen unit iff one is among its ancestors or it is among theirs
        if not (units.anc[u] & chosen) and not (anc_of_chosen >> u) & 1:
            chosen |= 1 << u
            anc_of_chosen |= units.anc[u]
            out.append(u)
    return out


def all_upsets_of(units: Units, cap: int):
    """:func:`all_upsets`, kept on ``units`` (listing them is the expensive part)."""
    if ("upsets", cap) not in units.cache:
        units.cache[("upsets", cap)] = all_upsets(units, cap)
    return units.cache[("upsets", cap)]


def convex_split(problem: Problem, *, units: Units | None = None, max_stages: int | None = None,
                 stages: int | None = None, upper_bound_ms: float | None = None, max_upsets: int = 200_000,
                 max_transitions: int = 5_000_000, time_limit: float = 30.0) -> ConvexResult | None:
    """The best convex split of ``problem``'s units (see the module docstring), and a bound.

    ``upper_bound_ms``: a cap; only splits that can stay within it are explored,
    which keeps the search small (give the objective of a known plan). With a cap, a
    result without stages means no split of the units stays within it (``bound_ms``
    is then the cap). Without a cap and without any split that fits, None.

    Two values are carried through the same states (module docstring): the plan's
    (memory at depth "stages after it", values sent once, with every unit's cost)
    and the bound's, a relaxation of every convex split of the *whole graph*: memory
    at the least depth, stage period ``max(C, S, R)`` (Eq. 1 is at least that), and
    the attached side nodes of ``units`` deleted (their costs left out; a convex
    split restricted to the other nodes is a convex split of what is left, and costs
    no more).

    Two ways to list the candidate stages after a set ``U`` of later stages:
    ``window`` enumerates every upset once (up to ``max_upsets``) and keeps, for each
    ``U``, the supersets whose work lies in the window a split within the cap
    allows; ``dfs`` grows stages unit by unit from ``U``. The search stops
    (``complete=False``, no bound) after ``max_transitions`` candidate stages or
    ``time_limit`` seconds. ``stages``: exactly this many stages.
    """
    t0 = time.perf_counter()
    U = units if units is not None else build_units(problem)
    n = U.n
    if n == 0:
        return None
    K = min(problem.num_gpus, n, max_stages or problem.num_gpus)
    if stages is not None:
        if not 1 <= stages <= min(problem.num_gpus, n):
            return None
        K = stages
    mm = MemoryModel.of(problem)
    limit = mm.limit
    cl = problem.cluster
    pairs = [(a, b) for a in range(K) for b in range(K) if a != b]
    bw = max((cl.bandwidth(a, b) for a, b in pairs), default=1.0)
    homogeneous = len({cl.bandwidth(a, b) for a, b in pairs}) <= 1
    # (heterogeneous links: the fastest, so that communication is never over-priced in the bound)
    ms_per_byte = 1e3 / bw
    rec_mid = problem.recomputes(False)
    rec_last = problem.recomputes(True)
    loss = U.loss
    T_ub = upper_bound_ms * (1 + 1e-9) if upper_bound_ms is not None else _INF
    side = U.has_side
    # "work": what a stage that is not the last runs (with recomputation where the schedule has
    # it); the kept work (side nodes left out) is at most the work, so it bounds both values.
    total_comp, total_kcomp = sum(U.comp), sum(U.kcomp)
    total_kwork = total_kcomp + (sum(U.krec) if rec_mid else 0.0)
    tol = 1e-9 * max(sum(U.comp) + sum(U.rec), 1e-300)
    from ..runtime.schedules import ScheduleError

    while K > 1:                         # 2bw/2gw: no pipeline deeper than M
        try:
            mm.in_flight(K - 1)
            break
        except ScheduleError:
            if stages is not None:
                return None
            K -= 1

    comp, rec, act, ginp, uparams = U.comp, U.rec, U.act, U.ginp, U.params
    kcomp, krec, kact, kginp, kparams = U.kcomp, U.krec, U.kact, U.kginp, U.kparams
    ptotal, pbytes = U.ptotal, U.pbytes
    # each parameter's optimizer step, its share U / M of every micro-batch (tied tensors' gradient
    # sums left out: the DP's price is then at most evaluate's, and its bound stays valid)
    pupd = [problem.update_ms([nm]) / problem.micro_batches for nm in U.pnames] if U.pnames else [0.0] * len(ptotal)
    succ, pred = U.succ, U.pred
    vprod, vbytes, vfloat, readers_of = U.vprod, U.vbytes, U.vfloat, U.vreaders
    made, reads = U.made, U.reads
    kreaders = U.kreaders
    kread_sets = [set(k) for k in kreaders]
    multi_made = [[v for v in made[u] if len(readers_of[v]) >= 2] for u in range(n)]
    has_multi = 0
    for u in range(n):
        if multi_made[u]:
            has_multi |= 1 << u
    full = (1 << n) - 1

    val: dict[int, list[float]] = {0: [0.0] + [_INF] * K}
    bnd: dict[int, list[float]] = {0: [0.0] + [_INF] * K}
    back: dict[tuple[int, int], int] = {}
    val2: dict[int, list[float]] = {0: [0.0] + [_INF] * K}   # the same with values sent "fanout"
    back2: dict[tuple[int, int], int] = {}
    ucomp: dict[int, float] = {0: 0.0}      # compute of the covered set (plan)
    ukc: dict[int, float] = {0: 0.0}        # kept compute and kept work of the covered set (bound)
    ukw: dict[int, float] = {0: 0.0}
    uwork: dict[int, float] = {0: 0.0}
    buckets: dict[int, list[int]] = {0: [0]}
    counters = [0]
    deadline = t0 + time_limit

    def relax(Ubits: int, ks: list[int], X: int, m: tuple) -> None:
        """Stage X (metrics m, see :func:`metrics`) in front of U: values for U + X."""
        counters[0] += 1
        (c, r, a, gi, ptot, pwb, recv, recvf, snd, feeds, kc, kr, ka, kg, kpt, kpw, krv, krvf, ksnd, kfeeds,
         upd, kupd) = m
        new = Ubits | X
        has_loss = loss is not None and (X >> loss) & 1
        loss_placed = rec_mid and loss is not None and ((new >> loss) & 1)
        # What is left runs on the stages still to come, each within T_ub; once the loss is
        # placed none of them is the last, so they all recompute where the schedule does.
        rem = (total_comp + sum_rec - uwork[Ubits] - c - r) if loss_placed else (total_comp - ucomp[Ubits] - c)
        rem_k = (total_kwork - ukw[Ubits] - kc - kr) if loss_placed else (total_kcomp - ukc[Ubits] - kc)
        send_ms = snd * ms_per_byte
        recv_ms = recvf * ms_per_byte
        # the bound: least depth (0 if the stage feeds no later one), kept costs, max(C, S, R)
        d_lb = 1 if kfeeds else 0
        rc_lb = rec_last if (d_lb == 0 and (loss is None or has_loss)) else rec_mid
        per_lb = max(kc + kupd + (kr if rc_lb else 0.0), ksnd * ms_per_byte, krvf * ms_per_byte)
        fits_lb = mm.stage_lower(depth=d_lb, params_total=kpt, trainable=kpw, recomputes=rc_lb, act_full=ka,
                                 recv=krv, inputs=kg) <= limit
        vals, bnds, vals2 = val[Ubits], bnd[Ubits], val2[Ubits]
        nv = val.get(new)
        # "fanout": a value read by several units of U is sent to up to that many stages
        multi = []
        xm = X & has_multi
        while xm:
            low = xm & -xm
            xm ^= low
            for v in multi_made[low.bit_length() - 1]:
                nu = sum(1 for w in readers_of[v] if (Ubits >> w) & 1)
                if nu >= 2:
                    multi.append((vbytes[v], nu))
        for k in ks:
            left = K - k - 1
            if new != full and left <= 0:
                continue
            ok_v = new == full or rem - tol <= left * T_ub
            ok_b = new == full or rem_k - tol <= left * T_ub
            cand = cand_b = cand2 = _INF
            if ok_v:
                # the plan's price: depth k; the last stage (k == 0) may skip recomputation
                rc = rec_last if (k == 0 and (loss is None or has_loss)) else rec_mid
                C = c + upd + (r if rc else 0.0)
                per = C + max(0.0, send_ms - C) + max(0.0, recv_ms - C)
                mem = mm.stage_lower(depth=k, params_total=ptot, trainable=pwb, recomputes=rc, act_full=a,
                                     recv=recv, inputs=gi)
                if mem <= limit:
                    cand = max(vals[k], per)
                    if multi and k >= 2:
                        s2 = send_ms + sum(b * (min(nu, k) - 1) for b, nu in multi) * ms_per_byte
                        per = C + max(0.0, s2 - C) + max(0.0, recv_ms - C)
                    cand2 = max(vals2[k], per)
            if ok_b and fits_lb:
                cand_b = max(bnds[k], per_lb)
            if cand > T_ub and cand_b > T_ub and cand2 > T_ub:
                continue
            if nv is None:
                nv = val[new] = [_INF] * (K + 1)
                val2[new] = [_INF] * (K + 1)
                bnd[new] = [_INF] * (K + 1)
                ucomp[new] = ucomp[Ubits] + c
                uwork[new] = uwork[Ubits] + c + r
                ukc[new] = ukc[Ubits] + kc
                ukw[new] = ukw[Ubits] + kc + (kr if rec_mid else 0.0)
                buckets.setdefault(new.bit_count(), []).append(new)
            if cand < nv[k + 1]:
                nv[k + 1] = cand
                back[new, k + 1] = Ubits
            nv2 = val2[new]
            if cand2 < nv2[k + 1]:
                nv2[k + 1] = cand2
                back2[new, k + 1] = Ubits
            nb = bnd[new]
            if cand_b < nb[k + 1]:
                nb[k + 1] = cand_b

    sum_rec = sum(U.rec)

    def param_sums(ps: set[int]) -> tuple[int, int, float]:
        return sum(ptotal[q] for q in ps), sum(pbytes[q] for q in ps), sum(pupd[q] for q in ps)

    def metrics(Ubits: int, X: int) -> tuple:
        """Compute, memory and traffic of stage X in front of the covered set U, from scratch."""
        c = r = kc = kr = 0.0
        a = gi = ka = kg = recv = recvf = snd = krv = krvf = ksnd = 0
        feeds = kfeeds = 0
        params: set[int] = set()
        kps: set[int] = set()
        seen_in: set[int] = set()
        kseen: set[int] = set()
        x = X
        while x:
            low = x & -x
            u = low.bit_length() - 1
            x ^= low
            c += comp[u]
            r += rec[u]
            a += act[u]
            gi += ginp[u]
            params.update(uparams[u])
            if side:
                kc += kcomp[u]
                kr += krec[u]
                ka += kact[u]
                kg += kginp[u]
                kps.update(kparams[u])
            for v in reads[u]:
                if v not in seen_in and not (X >> vprod[v]) & 1:
                    seen_in.add(v)
                    recv += vbytes[v]
                    if vfloat[v]:
                        recvf += vbytes[v]
                if side and v not in kseen and u in kread_sets[v] and not (X >> vprod[v]) & 1:
                    kseen.add(v)
                    krv += vbytes[v]
                    if vfloat[v]:
                        krvf += vbytes[v]
            for v in made[u]:
                for w in readers_of[v]:
                    if (Ubits >> w) & 1:
                        snd += vbytes[v]
                        feeds = 1
                        break
                if side:
                    for w in kreaders[v]:
                        if (Ubits >> w) & 1:
                            ksnd += vbytes[v]
                            kfeeds = 1
                            break
        ptot, pwb, upd = param_sums(params)
        if not side:
            return (c, r, a, gi, ptot, pwb, recv, recvf, snd, feeds, c, r, a, gi, ptot, pwb,
                    recv, recvf, snd, feeds, upd, upd)
        kpt, kpw, kupd = param_sums(kps)
        return (c, r, a, gi, ptot, pwb, recv, recvf, snd, feeds, kc, kr, ka, kg, kpt, kpw, krv, krvf, ksnd, kfeeds,
                upd, kupd)

    def live_ks(Ubits: int) -> list[int]:
        vals, bnds, vals2 = val[Ubits], bnd[Ubits], val2[Ubits]
        return [k for k in range(K) if vals[k] <= T_ub or bnds[k] <= T_ub or vals2[k] <= T_ub]

    # ---- candidate stages: the window over all upsets sorted by kept work. Once U holds the
    # loss, every further stage recomputes (where the schedule does): its kept work is at most
    # T_ub, and the kept work left after it must fit in the stages still to come.
    listed = all_upsets_of(U, max_upsets) if max_upsets > 0 else None
    if listed is not None:
        ups, sums = listed
        works = sums[:, 0] + sums[:, 1] if rec_mid else sums[:, 0]
        order = np.argsort(works, kind="stable")
        s_ups = [ups[i] for i in order]
        s_work = works[order]
    used = {"window": 0, "dfs": 0}

    def expand(Ubits: int) -> None:
        ks = live_ks(Ubits)
        if not ks:
            return
        if listed is None or Ubits == 0 or T_ub == _INF or (loss is not None and not (Ubits >> loss) & 1):
            used["dfs"] += 1
            return _expand_dfs(Ubits, ks)
        wu = ukw[Ubits]
        most_left = K - ks[0] - 1
        lo = max(wu, total_kwork - most_left * T_ub)
        hi = wu + T_ub
        if (lo - wu) < 0.9 * T_ub:
            used["dfs"] += 1               # the window prunes little: growing stages is cheaper
            return _expand_dfs(Ubits, ks)
        i0 = int(np.searchsorted(s_work, lo - tol, side="left"))
        i1 = int(np.searchsorted(s_work, hi + tol, side="right"))
        used["window"] += 1
        for i in range(i0, i1):
            W = s_ups[i]
            if W & Ubits == Ubits and W != Ubits:
                X = W ^ Ubits
                relax(Ubits, ks, X, metrics(Ubits, X))
        if counters[0] > max_transitions:
            raise _Abort("transitions")
        if time.perf_counter() > deadline:
            raise _Abort("time")

    # ---- candidate stages: grown unit by unit
    def _expand_dfs(Ubits: int, ks: list[int]) -> None:
        first = Ubits == 0
        prune_rec = rec_mid and not first      # the new stage recomputes unless it may be the last
        rc_any = (rec_mid, rec_last) if first else (rec_mid,)
        loss_in = loss is not None and (Ubits >> loss) & 1
        rest = (total_kwork - ukw[Ubits] + tol) if (rec_mid and loss_in) else (total_kcomp - ukc[Ubits] + tol)
        wkey = 1 if (rec_mid and loss_in) else 0
        most_left = K - ks[0] - 1
        sends_to_u: dict[int, bool] = {}
        ksends_to_u: dict[int, bool] = {}
        cands0 = [u for u in range(n) if not (Ubits >> u) & 1 and (succ[u] & ~Ubits) == 0]
        # st: c r a gi ptot pwb recv recvf snd feeds | kc kr ka kg kpt kpw krecv krecvf ksnd kfeeds
        st = [0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0]   # + upd kupd
        pref: dict[int, int] = {}
        kpref: dict[int, int] = {}
        rcount: dict[int, int] = {}
        krcount: dict[int, int] = {}

        def sends(v: int) -> bool:
            got = sends_to_u.get(v)
            if got is None:
                got = sends_to_u[v] = any((Ubits >> w) & 1 for w in readers_of[v])
            return got

        def ksends(v: int) -> bool:
            got = ksends_to_u.get(v)
            if got is None:
                got = ksends_to_u[v] = any((Ubits >> w) & 1 for w in kreaders[v])
            return got

        def grow(cands: list[int], X: int) -> None:
            for i, u in enumerate(cands):
                nkc = st[10] + kcomp[u]
                nkr = st[11] + krec[u]
                if nkc + (nkr if prune_rec else 0.0) > T_ub:
                    continue
                saved = st[:]
                st[0] += comp[u]
                st[1] += rec[u]
                st[2] += act[u]
                st[3] += ginp[u]
                st[10] = nkc
                st[11] = nkr
                st[12] += kact[u]
                st[13] += kginp[u]
                for q in uparams[u]:
                    cq = pref.get(q, 0)
                    if cq == 0:
                        st[4] += ptotal[q]
                        st[5] += pbytes[q]
                        st[20] += pupd[q]
                    pref[q] = cq + 1
                for q in kparams[u]:
                    cq = kpref.get(q, 0)
                    if cq == 0:
                        st[14] += ptotal[q]
                        st[15] += pbytes[q]
                        st[21] += pupd[q]
                    kpref[q] = cq + 1
                for v in reads[u]:                      # read from outside: producers come later
                    cv = rcount.get(v, 0)
                    if cv == 0:
                        st[6] += vbytes[v]
                        if vfloat[v]:
                            st[7] += vbytes[v]
                    rcount[v] = cv + 1
                    if side and u in kread_sets[v]:
                        cv = krcount.get(v, 0)
                        if cv == 0:
                            st[16] += vbytes[v]
                            if vfloat[v]:
                                st[17] += vbytes[v]
                        krcount[v] = cv + 1
                for v in made[u]:
                    if rcount.get(v, 0) > 0:            # read inside: no longer received
                        st[6] -= vbytes[v]
                        if vfloat[v]:
                            st[7] -= vbytes[v]
                    if sends(v):                        # read by a later stage: sent (once)
                        st[8] += vbytes[v]
                        st[9] = 1
                    if side:
                        if krcount.get(v, 0) > 0:
                            st[16] -= vbytes[v]
                            if vfloat[v]:
                                st[17] -= vbytes[v]
                        if ksends(v):
                            st[18] += vbytes[v]
                            st[19] = 1
                if any(mm.lower_bound(st[14], st[12], st[11], rc) <= limit for rc in rc_any):
                    Xn = X | (1 << u)
                    done = nkc + (nkr if wkey else 0.0)
                    if rest - done <= most_left * T_ub or Ubits | Xn == full:
                        relax(Ubits, ks, Xn, tuple(st) if side else tuple(st[:16]) + tuple(st[6:10]) + (st[20], st[20]))
                        if counters[0] > max_transitions:
                            raise _Abort("transitions")
                    covered = Ubits | Xn
                    p = pred[u]
                    newc = []
                    while p:
                        low = p & -p
                        w = low.bit_length() - 1
                        p ^= low
                        if (succ[w] & ~covered) == 0:
                            newc.append(w)
                    grow(cands[i + 1:] + newc, Xn)
                st[:] = saved
                for q in uparams[u]:
                    cq = pref[q] - 1
                    if cq:
                        pref[q] = cq
                    else:
                        del pref[q]
                for q in kparams[u]:
                    cq = kpref[q] - 1
                    if cq:
                        kpref[q] = cq
                    else:
                        del kpref[q]
                for v in reads[u]:
                    cv = rcount[v] - 1
                    if cv:
                        rcount[v] = cv
                    else:
                        del rcount[v]
                    if side and u in kread_sets[v]:
                        cv = krcount[v] - 1
                        if cv:
                            krcount[v] = cv
                        else:
                            del krcount[v]
            if time.perf_counter() > deadline:
                raise _Abort("time")

        grow(cands0, 0)

    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 4 * n + 1000))
    complete, why = True, None
    try:
        for size in range(n + 1):
            for Ubits in buckets.pop(size, []):
                if Ubits != full:
                    expand(Ubits)
    except _Abort as exc:
        complete, why = False, str(exc)
    finally:
        sys.setrecursionlimit(old_limit)
    method = "+".join(k for k, v in used.items() if v) or "none"
    common = dict(states=len(val), transitions=counters[0], seconds=time.perf_counter() - t0, units=n,
                  attached=U.attached, method=method)
    if not complete:
        return ConvexResult([], _INF, 0.0, complete=False, info={"stopped": why, "homogeneous": homogeneous},
                            **common)
    vals = val.get(full)
    bound = (min(bnd[full][1:]) if stages is None else bnd[full][K]) if full in bnd else T_ub
    bound = min(bound, T_ub)
    if vals is None or min(vals[1:]) == _INF:
        # No split of the units stays within the cap (or, without one, none fits).
        if T_ub == _INF and bound == _INF:
            return None
        return ConvexResult([], _INF, bound, info={"homogeneous": homogeneous}, **common)
    best_k = min(range(1, K + 1), key=lambda k: (vals[k], k)) if stages is None else K
    if vals[best_k] == _INF:
        return ConvexResult([], _INF, bound, info={"homogeneous": homogeneous}, **common)

    def unwind(table: dict, backs: dict) -> list[list[int]] | None:
        vs = table.get(full)
        if vs is None:
            return None
        k = min(range(1, K + 1), key=lambda k: (vs[k], k)) if stages is None else K
        if vs[k] == _INF:
            return None
        chain, cur = [], full
        while cur:
            prev = backs[cur, k]
            chain.append(cur & ~prev)
            cur, k = prev, k - 1
        # Walking back from the full set meets the stages the DP added last first: the
        # pipeline's first stage comes first.
        out = []
        for X in chain:
            ids = []
            x = X
            while x:
                low = x & -x
                ids.extend(U.members[low.bit_length() - 1])
                x ^= low
            out.append(sorted(ids))
        return out

    out = unwind(val, back)
    fan = unwind(val2, back2)
    info = {"homogeneous": homogeneous, "alternatives": [fan] if fan and fan != out else []}
    return ConvexResult(out, vals[best_k], min(bound, vals[best_k]), info=info, **common)


def plan_from_stages(strategy: str, problem: Problem, stages: list[list[int]], info: dict) -> Plan:
    """Stage ``k`` (a list of op node ids) on GPU ``k``."""
    return Plan(strategy, problem.num_gpus, [Stage(k, k, list(s)) for k, s in enumerate(stages)], info)


def is_convex_split(problem: Problem, stages: list[list[int]]) -> bool:
    """Whether ``stages`` (in order) form a chain of ideals: every edge goes forward or stays."""
    where = {n: k for k, s in enumerate(stages) for n in s}
    for e in problem.graph.edges:
        a, b = where.get(e.src), where.get(e.dst)
        if a is not None and b is not None and a > b:
            return False
    return True


def upset_count(units: Units, cap: int) -> int | None:
    """The number of upsets of the units' DAG, or None above ``cap`` (it can be exponential)."""
    seen = {0}
    frontier = [0]
    n = units.n
    while frontier:
        nxt = []
        for Ubits in frontier:
            for u in range(n):
                if not (Ubits >> u) & 1 and (units.succ[u] & ~Ubits) == 0:
                    W = Ubits | (1 << u)
                    if W not in seen:
                        seen.add(W)
                        nxt.append(W)
                        if len(seen) > cap:
                            return None
        frontier = nxt
    return len(seen)


__all__ = ["Units", "build_units", "attach_side_nodes", "convex_split", "ConvexResult", "plan_from_stages",
           "is_convex_split", "upset_count"]
