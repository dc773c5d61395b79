"""METIS partitioning repaired into an acyclic Mixed-pipe plan.

METIS (via ``pymetis``) splits the *undirected* op-node graph into ``P`` parts
of balanced compute with few bytes cut. It knows nothing of direction, so a
part may both feed and be fed by another part; such parts cannot be pipeline
stages. The repair walks the op nodes in topological order and puts each node
into a stage of its part; a node joins an existing stage ``S`` of its part only
if no stage it reads from is reachable from ``S`` (which would close a cycle
``S -> ... -> T -> S``), otherwise it opens a new stage. Nodes are visited in
topological order, so only the edges from already placed predecessors matter
and the stage graph stays acyclic by construction. Every stage runs on the GPU
of its part, so a GPU may host several stages (Mixed-pipe).

Under tight memory METIS's balanced sums are not a GPU's memory (shared weights
count once, activations once per micro-batch in flight), so plans that overflow
are repaired: whole stages first, then single nodes to neighbouring stages on
GPUs with room.
"""

from __future__ import annotations

from ..plan import Plan, PlanCost, Problem, Stage, evaluate, join_unpaced_stages
from .base import Infeasible
from .refine import Refiner

__all__ = ["partition_metis", "acyclic_stages"]

#: METIS adds integer weights in 32 bits; byte counts are scaled to at most this.
_MAX_EDGE_WEIGHT = 1_000_000


def _metis_parts(problem: Problem, ids: list[int], nparts: int, seed: int, with_memory: bool) -> list[int]:
    """METIS parts of the undirected op graph; ``with_memory`` balances compute and memory together.

    pymetis hands METIS one balance constraint whatever the length of ``vweights``
    (pymetis 2025.2: an interleaved list of 2n weights partitions exactly as its first n
    entries do), so METIS's own multi-constraint balance is out of reach. With
    ``with_memory`` each node therefore weighs its share of the total compute plus its
    share of the total memory, one number METIS can balance.
    """
    try:
        import pymetis
    except ImportError:
        raise Infeasible("pymetis is not installed: pip install pymetis") from None
    g, prof = problem.graph, problem.profile
    idx = {nid: i for i, nid in enumerate(ids)}
    n = len(ids)
    adj: list[dict[int, int]] = [dict() for _ in range(n)]
    for e in g.edges:
        a, b = idx.get(e.src), idx.get(e.dst)
        if a is None or b is None or a == b:
            continue
        adj[a][b] = adj[a].get(b, 0) + e.bytes
        adj[b][a] = adj[b].get(a, 0) + e.bytes
    top = max((w for row in adj for w in row.values()), default=1) or 1
    xadj, adjncy, eweights = [0], [], []
    for row in adj:
        for b, w in sorted(row.items()):
            adjncy.append(b)
            eweights.append(max(1, round(w * _MAX_EDGE_WEIGHT / top)))
        xadj.append(len(adjncy))
    # Microseconds of forward + backward (+ recomputation), as METIS wants integers.
    costs = [prof.nodes[nid] for nid in ids]
    vweights = [max(1, round(1e3 * (c.forward_ms + c.backward_ms + c.recompute_ms))) for c in costs]
    if with_memory:
        # Weights, grads and optimizer state of the parameters a node is first to use, plus its
        # activations, as a share of the total, added to the node's share of the compute.
        mem = [c.param_bytes + c.grad_bytes + c.optimizer_bytes + c.activation_bytes for c in costs]
        work, total_mem = max(1, sum(vweights)), max(1, sum(mem))
        vweights = [max(1, round(_MAX_EDGE_WEIGHT * (w / work + m / total_mem))) for w, m in zip(vweights, mem)]
    _, parts = pymetis.part_graph(nparts, adjacency=pymetis.CSRAdjacency(xadj, adjncy), vweights=vweights,
                                  eweights=eweights, options=pymetis.Options(seed=seed))
    return list(parts)


def acyclic_stages(problem: Problem, parts: dict[int, int]) -> list[Stage]:
    """Split parts (op node id -> GPU) into stages whose stage graph is acyclic.

    Nodes are placed in the graph's (topological) order. A node joins the stage
    of its part it exchanges most bytes with among those it may join without a
    cycle; a stage ``S`` may take node ``v`` unless some stage ``T != S`` holding
    a predecessor of ``v`` is reachable from ``S``. Reachability is kept as
    ancestor bitsets and pushed to descendants when a new stage edge appears.
    """
    g = problem.graph
    stage_of: dict[int, int] = {}
    nodes: list[list[int]] = []
    gpu: list[int] = []
    anc: list[int] = []                  # bitset of stages that reach stage s (not s itself)
    succ: list[set[int]] = []
    by_part: dict[int, list[int]] = {}

    def add_edge(t: int, s: int) -> None:
        if s in succ[t]:
            return
        succ[t].add(s)
        gained = anc[t] | (1 << t)
        stack = [s]
        while stack:                      # push new ancestors down to every descendant
            x = stack.pop()
            if gained & ~anc[x]:
                anc[x] |= gained
                stack.extend(succ[x])

    for node in g.op_nodes():
        v, part = node.id, parts[node.id]
        feed: dict[int, int] = {}         # stage -> bytes it sends to v
        for e in g.in_edges(v):
            t = stage_of.get(e.src)
            if t is not None:
                feed[t] = feed.get(t, 0) + e.bytes
        best = None
        for s in by_part.get(part, []):
            if any(t != s and anc[t] >> s & 1 for t in feed):
                continue                  # s reaches a stage v reads from: v in s closes a cycle
            key = (feed.get(s, 0), s)
            if best is None or key > best[0]:
                best = (key, s)
        if best is None:
            s = len(nodes)
            nodes.append([])
            gpu.append(part)
            anc.append(0)
            succ.append(set())
            by_part.setdefault(part, []).append(s)
        else:
            s = best[1]
        nodes[s].append(v)
        stage_of[v] = s
        for t in feed:
            if t != s:
                add_edge(t, s)
    return [Stage(i, gpu[i], ns) for i, ns in enumerate(nodes)]


def repair_memory(problem: Problem, plan: Plan, max_moves: int = 200) -> tuple[Plan, int]:
    """Move whole stages off GPUs over their memory limit onto GPUs with room.

    METIS balances the sum of its vertex weights, but a GPU's memory is not such a
    sum: a parameter read by several nodes counts once, and activations count once
    per micro-batch in flight, which depends on the stage's depth. So a part that
    METIS calls balanced may overflow. Moving a whole stage to another GPU keeps
    the stage graph (and its acyclicity) as it is; each move takes the stage whose
    departure most reduces the overflow to the GPU where it fits best, and is kept
    only when the total overflow drops. Returns the plan and the moves made.
    """
    cost = evaluate(problem, plan)
    moves = 0
    while not cost.feasible and moves < max_moves:
        cur = cost.overflow_bytes
        best = None
        over = [g.gpu for g in cost.gpus if g.memory_bytes > g.memory_limit]
        for st in [st for st in plan.stages if st.gpu in over]:
            for g in range(plan.num_gpus):
                if g == st.gpu:
                    continue
                trial = Plan(plan.strategy, plan.num_gpus,
                             [Stage(x.id, g if x.id == st.id else x.gpu, x.nodes) for x in plan.stages], plan.info)
                c = evaluate(problem, trial)
                key = (c.overflow_bytes, c.objective_ms)
                if key[0] < cur and (best is None or key < best[0]):
                    best = (key, trial, c)
        if best is None:
            break
        _, plan, cost = best
        moves += 1
    return plan, moves


def partition_metis(problem: Problem, *, seeds: int = 3, max_stages: int | None = None) -> Plan:
    """Partition with METIS on the undirected op graph, then repair into acyclic stages.

    Parameters
    ----------
    problem : Problem
        Graph, profile, cluster and schedule.
    seeds : int
        METIS runs with seeds ``0 .. seeds-1``, balancing compute only; where
        memory binds (some of those plans do not fit as METIS left them), as many
        runs balancing each node's share of compute plus its share of memory. A
        plan that does not fit is repaired by moving whole stages between GPUs
        (:func:`repair_memory`), then single nodes off over-full GPUs
        (:meth:`ftcompile.partition.refine.Refiner.relieve`). The best feasible
        plan wins.
    max_stages : int, optional
        Plans with more stages are dropped.

    Returns
    -------
    Plan
        A Mixed-pipe plan: every stage on the GPU of the METIS part it came from.
        ``info`` holds ``objective_ms``, ``seed``, ``memory_constraint``
        (whether METIS also balanced memory), ``metis_parts`` (non-empty METIS
        parts), ``stages`` and, for a repaired plan, ``memory_repair_moves``
        (whole stages) and ``memory_repair_node_moves`` (single nodes).

    Raises
    ------
    Infeasible
        When pymetis is missing or no run fits every GPU's memory.
    """
    ids = [n.id for n in problem.graph.op_nodes()]
    if not ids:
        raise Infeasible("the graph has no op nodes")
    P = problem.num_gpus
    best: tuple | None = None
    closest = (float("inf"), "none")       # (overflow, reason) of the run closest to fitting
    tight = False                         # some METIS partition did not fit as METIS left it
    # Compute-balanced parts first; where memory binds, also parts balanced by compute and memory
    # together (their plans are often better there, not only the ones that fit).
    for with_memory in ((False,) if P == 1 else (False, True)):
        if with_memory and best is not None and not tight:
            break
        for seed in range(max(1, seeds)):
            raw = [0] * len(ids) if P == 1 else _metis_parts(problem, ids, P, seed, with_memory)
            parts = dict(zip(ids, raw))
            # (joined as it will run: an isolated node, a counter, would be a stage nothing paces)
            plan = join_unpaced_stages(Plan("metis", P, acyclic_stages(problem, parts),
                                         {"seed": seed, "memory_constraint": with_memory,
                                          "metis_parts": len(set(raw))}), problem.graph)
            if max_stages is not None and len(plan.stages) > max_stages:
                if closest[0] == float("inf"):
                    closest = (closest[0], f"the repaired METIS parts make {len(plan.stages)} stages, "
                                           f"more than {max_stages}")
                continue
            cost = evaluate(problem, plan)
            if not cost.feasible:
                tight = True
                plan, cost = _repair(problem, plan)
                joined = join_unpaced_stages(plan, problem.graph)       # (a whole stage moved beside others)
                if joined is not plan:
                    plan, cost = joined, evaluate(problem, joined)
            if not cost.feasible:
                if cost.overflow_bytes < closest[0]:
                    closest = (cost.overflow_bytes, cost.reason)
                continue
            plan.info.update(objective_ms=cost.objective_ms, stages=len(plan.stages))
            if best is None or cost.objective_ms < best[0]:
                best = (cost.objective_ms, plan)
            if P == 1:
                break
    if best is None:
        raise Infeasible(f"no METIS partition fits memory, balancing compute or compute and memory together, "
                         f"even after moving whole stages and then single nodes to GPUs with room (METIS "
                         f"balances sums of node weights; a GPU's memory counts shared weights once and "
                         f"activations per micro-batch in flight, which depends on the stage's depth). The "
                         f"closest: {closest[1]}. Try mixed or seq, or more memory per GPU")
    return best[1]


def _repair(problem: Problem, plan: Plan) -> tuple[Plan, PlanCost]:
    """Whole-stage moves, then single-node moves (:meth:`Refiner.relieve`) while memory overflows."""
    plan, moved = repair_memory(problem, plan)
    plan.info["memory_repair_moves"] = moved
    cost = evaluate(problem, plan)
    if cost.feasible:
        return plan, cost
    r = Refiner.of_stages(problem, [(st.gpu, st.nodes) for st in plan.stages])
    node_moves = r.relieve()
    if node_moves:
        plan = Plan(plan.strategy, plan.num_gpus, [Stage(i, g, nodes) for i, (g, nodes) in enumerate(r.stages())],
                    plan.info)
        cost = evaluate(problem, plan)
    plan.info["memory_repair_node_moves"] = node_moves
    return plan, cost
