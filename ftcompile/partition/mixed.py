"""Mixed-pipe partitioning (FTPipe §4.1): blocks anywhere in the graph may share a GPU.

:func:`partition_mixed` runs, for several stage counts ``L`` and centre seeds:

1. coarsening (:mod:`.coarsen`): clean-up merges, coarsening by module type,
   then growth around ``L`` centres into ``L`` blocks under the memory limit;
2. load balancing: Longest-Processing-Time-first — blocks by descending compute
   go to the least-loaded GPU whose memory still has room;
3. stages per GPU: blocks on one GPU are merged while that creates no cycle in
   the stage graph (adjacent ones first), so a GPU may keep several
   non-adjacent stages (one encoder and one decoder stage per GPU for T5);
4. refinement (:mod:`.refine`): the plan is un-coarsened to op nodes and single
   nodes move to a neighbouring stage on another GPU when that lowers the larger
   of the two GPU loads, within memory and keeping the stage graph acyclic; when
   no candidate fits, the closest ones first have single nodes moved off their
   over-full GPUs.

Every candidate is priced with :func:`ftcompile.plan.evaluate`; the feasible
plan with the lowest objective wins.
"""

from __future__ import annotations

import time

from ..plan import Plan, Problem, Stage, evaluate, join_unpaced_stages
from ..units import format_bytes
from .base import Infeasible, MemoryModel, simulated_choice, with_alternative
from .coarsen import Quotient, coarsen, grow_around_centers, split_contiguous
from .refine import Refiner, refine_stages, sink_depths

#: Shares of Mixed-pipe's time budget (fractions of it, where each step ends): refinement by
#: objective, seq's convex search, the mixed-space MIP, then refinement by simulation to the end.
#: seq and the MIP get at least MIN_SHARE each, refinement by simulation at least SIM_SHARE.
#: (The MIP's 35 % found what the refinement misses on encoder-decoder graphs: T5-small's layer graph
#: on 6 GPUs, 14.69 ms against 16.44 with 25 % at a 10 s budget. Since the MIP's symmetry rows and
#: sink-stage variables were mended it beats the refinement on the operator graphs of BERT and
#: ResNet-50 under tight memory, so it gets 55 %: BERT-3 on 6 GPUs at 1.2 x total / P, 27.83 ms
#: against 28.53 with 35 %, measured with the MIP's symmetry rows then weighted by compute.)
REFINE_UNTIL, SEQ_UNTIL, MIP_UNTIL, MIN_SHARE, SIM_SHARE = 0.15, 0.3, 0.85, 0.15, 0.15
#: Refined plans over memory (the closest to fitting) that single-node moves try to relieve when none fits.
RELIEVE_TOP = 3


# --------------------------------------------------------------------------- step 2: LPT

def _block_inputs(problem: Problem, nodes: list[int]) -> int:
    """Bytes of the distinct values a block reads from outside itself (graph inputs included)."""
    graph = problem.graph
    inside = set(nodes)
    seen: dict[str, int] = {}
    for n in nodes:
        for e in graph.in_edges(n):
            if e.src not in inside:
                seen[e.value] = e.bytes
    return sum(seen.values())


def assign_lpt(problem: Problem, q: Quotient, *, balance_memory: bool = False) -> dict[int, int] | None:
    """GPU of each block of ``q``: Longest-Processing-Time-first under an estimate of memory.

    A GPU's memory is estimated as the weights, gradients and optimizer state of
    the parameters its blocks read (each once), the extra weight versions the
    schedule keeps for them (PipeDream: the block's depth), plus, per block, the
    micro-batches the schedule keeps in flight (``depth + 1`` for async and 1F1B,
    ``M`` for GPipe, with the depth taken in the block DAG): their inputs where the
    schedule recomputes, plus the largest block's full activations (what
    recomputation rebuilds), else their full activations. Returns None when some
    block fits no GPU.

    With ``balance_memory`` the blocks are sorted by the larger of their shares
    of total compute and total memory, and each goes to the GPU that minimises
    the larger of its compute and memory shares afterwards: memory-heavy,
    compute-light blocks (T5's decoder) are then spread before the GPUs fill up.
    """
    blocks = q.blocks()
    succ = {b: set(q.succ[b]) for b in blocks}
    depth = sink_depths(succ, blocks)
    P = problem.num_gpus
    limit = problem.cluster.gpu_memory
    # Micro-batches in flight per block (its depth in the block DAG), each keeping the block's
    # inputs where the schedule recomputes, else its full activations.
    recomputes = problem.recomputes(False)
    mm = MemoryModel.of(problem)
    held = {b: mm.in_flight(depth[b])
            * (_block_inputs(problem, q.members[b]) if recomputes else q.act[b]) for b in blocks}
    load = [0.0] * P
    params: list[set[str]] = [set() for _ in range(P)]
    act = [0] * P
    peak = [0] * P
    where: dict[int, int] = {}
    # Extra weight versions the schedule keeps (PipeDream: depth, 2BW: one...), per GPU and
    # parameter the most any of its blocks needs, as evaluate counts them.
    wbytes = {prm: c.bytes for prm, c in problem.profile.params.items()}
    xv = {b: mm.extra_versions(depth[b]) for b in blocks}
    versions: list[dict[str, int]] = [{} for _ in range(P)]
    vbytes = [0] * P

    def versions_after(g: int, b: int) -> int:
        if not xv[b]:
            return vbytes[g]
        cur = versions[g]
        return vbytes[g] + sum(wbytes[prm] * (xv[b] - cur.get(prm, 0)) for prm in q.params[b]
                               if cur.get(prm, 0) < xv[b])

    total_work = sum(q.work[b] for b in blocks) or 1.0
    bmem = {b: q.param_memory(q.params[b]) + held[b] + xv[b] * sum(wbytes[prm] for prm in q.params[b])
            for b in blocks}
    total_mem = sum(bmem.values()) or 1
    if balance_memory:
        order = sorted(blocks, key=lambda b: (-max(q.work[b] / total_work, bmem[b] / total_mem), q.pos[b]))
    else:
        order = sorted(blocks, key=lambda b: (-q.work[b], q.pos[b]))
    for b in order:
        best = None
        best_key = None
        for g in sorted(range(P), key=lambda g: (load[g], g)):
            mem = (q.param_memory(params[g] | q.params[b]) + versions_after(g, b) + act[g] + held[b]
                   + (max(peak[g], q.act[b]) if recomputes else 0))
            if mem > limit:
                continue
            if not balance_memory:
                best = g
                break
            key = (max((load[g] + q.work[b]) / total_work, mem / (total_mem + P * max(peak))), g)
            if best_key is None or key < best_key:
                best, best_key = g, key
        if best is None:
            return None
        where[b] = best
        load[best] += q.work[b]
        params[best] |= q.params[b]
        vbytes[best] = versions_after(best, b)
        for prm in q.params[b]:
            versions[best][prm] = max(versions[best].get(prm, 0), xv[b])
        act[best] += held[b]
        peak[best] = max(peak[best], q.act[b])
    return where


# --------------------------------------------------------------------------- step 3: stages per GPU

def stages_per_gpu(q: Quotient, where: dict[int, int]) -> list[tuple[int, list[int]]]:
    """Merge blocks sharing a GPU while the quotient stays acyclic; returns (gpu, nodes) per stage.

    Adjacent pairs are tried first (merging connected components, as FTPipe
    does), then any pair on the same GPU, earliest blocks first.
    """
    q = q.copy()
    gpu = dict(where)
    changed = True
    while changed:
        changed = False
        for adjacent_only in (True, False):
            for b in q.blocks():
                if b not in q.members:
                    continue
                if adjacent_only:
                    cands = [n for n in q.neighbours(b) if gpu[n] == gpu[b]]
                else:
                    cands = [n for n in q.members if n != b and gpu[n] == gpu[b]]
                for n in sorted(cands, key=q.pos.__getitem__):
                    if n not in q.members or b not in q.members:
                        continue
                    g = gpu[b]
                    keep = q.merge((b, n))
                    if keep is not None:
                        gpu[keep] = g
                        changed = True
                        break
            if changed:
                break
    return [(gpu[b], sorted(q.members[b])) for b in q.blocks()]


# --------------------------------------------------------------------------- driver

def _plan(problem: Problem, stages: list[tuple[int, list[int]]], info: dict) -> Plan:
    # (lone stages joined as they will run, so that each candidate is priced as it runs)
    return join_unpaced_stages(Plan("mixed", problem.num_gpus, [Stage(i, g, nodes) for i, (g, nodes) in enumerate(stages)],
                                 info), problem.graph)


def partition_mixed(problem: Problem, *, l_factors=(1, 2, 3), max_l: int | None = None, seeds=(0, 1, 2),
                    refine: bool = True, cap_ms: float | None = None, refine_top: int = 2,
                    simulate_top: int = 6,
                    time_budget_s: float = 10.0, max_stages: int | None = None,
                    with_convex: bool = True, exact_max_nodes: int = 1000, sim_refine: bool = True,
                    prefer: str = "objective") -> Plan:
    """Mixed-pipe partitioning of ``problem`` (FTPipe §4.1); see the module docstring.

    ``l_factors`` gives the candidate numbers of coarse blocks ``L = f * P`` (at
    most ``max_l``); ``seeds`` the centre choices tried for each ``L`` (each with
    and without per-region centres, plus one equal-compute contiguous split).
    Each candidate is assigned by LPT twice (by compute, and by the larger of the
    compute and memory shares). The ``refine_top`` best unrefined candidates of
    each ``L`` and its contiguous one are refined, then further candidates, best
    first, while the run is within its share of ``time_budget_s`` (the best one is
    always refined). Every coarsening step keeps blocks that fit one GPU alone. When no
    refined candidate fits, the :data:`RELIEVE_TOP` closest to fitting have single nodes moved
    off their over-full GPUs (:meth:`Refiner.relieve`) and are refined again. With
    ``with_convex`` the best convex split (:func:`~ftcompile.partition.seq.partition_seq`,
    a Seq-pipe being a Mixed-pipe too) joins the candidates, so a plan is found
    whenever a Seq-pipe fits; on graphs of at most ``exact_max_nodes`` op nodes, so
    does the best plan the mixed-space MIP (:func:`~ftcompile.partition.exact.partition_exact`)
    finds, started from the best plan found before it (refused, at no cost, when its model would
    pass 100,000 variables: transfers on many GPUs), and its plans a few per cent above that in
    fewer stages (its ``relaxed_out``), which are simulated whatever their rank.

    Two plans come out of the candidates. The **lowest objective** (among plans within
    :data:`~ftcompile.partition.base.OBJECTIVE_TIE` of it, the fastest in simulation) is what
    ``prefer="objective"`` (the default, strategy ``mixed``) returns: the plan the objective
    and the bounds speak of. The **fastest in simulation**: the ``simulate_top`` best plans by
    objective are simulated, since stages sharing a GPU wait on one another in ways Eq. 1 does
    not see, and the fastest, with ``sim_refine`` improved by single-node moves that lower its
    simulated period at the in-flight scale it was ranked at
    (:func:`~ftcompile.partition.simrefine.refine_simulated`), is returned
    with ``prefer="simulated"`` (strategy ``mixed-sim``) and otherwise noted as
    ``info["simulated_alternative"]`` when it is another plan that simulates faster
    (:func:`~ftcompile.compile.compile_plan` makes it a row of its own).
    ``time_budget_s`` is the whole search's, in shares (:data:`REFINE_UNTIL` and the
    others): refinement by objective up to 15% of it, seq's search to 30%, the MIP to 85%,
    refinement by simulation the rest; seq and the MIP get at least 15% each and the last
    step 15%, so none of them gets only what an earlier one left. Simulating the best few
    before that refinement may take up to ``time_budget_s`` again (the returned plan is always
    simulated; :func:`~ftcompile.partition.base.simulated_choice`). ``max_stages``: no plan with more
    stages. Raises :class:`Infeasible` when no candidate fits in GPU memory.
    """
    if prefer not in ("objective", "simulated"):
        raise ValueError(f"prefer must be 'objective' or 'simulated', got {prefer!r}")
    t0 = time.perf_counter()
    # Fixed shares, so that seq's convex search and the MIP never get only the scraps that
    # refinement (which refines further candidates while it has time) leaves over.
    refine_until = time_budget_s * (REFINE_UNTIL if with_convex else 1.0 - SIM_SHARE)
    P = problem.num_gpus
    limit = problem.cluster.gpu_memory
    base = coarsen(problem.graph, problem.profile, cap_ms=cap_ms, memory_limit=limit)
    n_blocks = len(base.members)
    ls = sorted({min(max(1, int(f * P)), n_blocks) for f in l_factors})
    if max_l is not None:
        ls = [l for l in ls if l <= max_l] or [min(max_l, n_blocks)]
    if max_stages is not None:
        ls = sorted({min(L, max_stages) for L in ls})
    regions = _regions(problem, base)
    best: tuple[float, Plan] | None = None
    finals: list[tuple[float, Plan]] = []
    # the MIP's plans a little above its best in fewer stages: simulated whatever their rank
    relaxed: list[tuple[float, Plan]] = []
    worst_reason = None
    must: list[tuple] = []
    extra: list[tuple] = []
    seen: set = set()
    for L in ls:
        cands = []
        # A block may take its fair share of the cluster's memory (and at least the largest
        # coarse block), so that LPT can still pack L of them onto P GPUs.
        block_limit = max(int(limit * min(1.0, 0.85 * P / L)), max(base.memory(b) for b in base.members))
        variants = [(sd, r) for sd in seeds for r in ((False, True) if regions else (False,))]
        variants.append(("contiguous", False))
        for seed, by_region in variants:
            if seed == "contiguous":
                # Equal-compute runs of the topological order: the Seq-pipe-like start, which
                # suits chain-shaped models (GPT-2, BERT) whose blocks LPT can hardly pack.
                q = split_contiguous(base, L, memory_limit=block_limit)
            else:
                q = grow_around_centers(base, L, block_limit, seed=seed, regions=regions if by_region else None)
            for balance_memory in (False, True):
                where = assign_lpt(problem, q, balance_memory=balance_memory)
                if where is None:
                    worst_reason = worst_reason or f"L={L}: a block fits no GPU's remaining memory"
                    where = _assign_any(problem, q)
                stages = stages_per_gpu(q, where)
                key = tuple(sorted((g, tuple(ns)) for g, ns in stages))
                if key in seen:
                    continue
                seen.add(key)
                plan = _plan(problem, stages, {"L": L, "seed": seed, "refined": False, "blocks": len(q.members),
                                               "balance_memory": balance_memory, "by_region": by_region})
                cost = evaluate(problem, plan)
                cands.append((cost.objective_ms if cost.feasible else float("inf"), cost.max_memory_bytes,
                              str(seed), stages, plan, cost))
        cands.sort(key=lambda c: (c[0], c[1]))
        for obj, mem, seed, stages, plan, cost in cands:
            if not cost.feasible:
                worst_reason = cost.reason
            elif best is None or obj < best[0]:
                best = (obj, plan)
            if cost.feasible:
                finals.append((obj, plan))
        picked = cands[:refine_top] + [c for c in cands[refine_top:] if c[2] == "contiguous"]
        must += picked
        extra += [c for c in cands if not any(c is m for m in picked)]
    misses: list[tuple[int, int, list]] = []          # refined plans over memory: (overflow, i, stages)
    if refine:
        must.sort(key=lambda c: (c[0], c[1]))
        extra.sort(key=lambda c: (c[0], c[1]))
        for i, (obj, mem, seed, stages, plan, cost) in enumerate(must + extra):
            left = refine_until - (time.perf_counter() - t0)
            if i > 0 and left <= 0:
                break
            rstages = refine_stages(problem, stages, max_seconds=max(left, 1.0))
            rplan = _plan(problem, rstages, {**plan.info, "refined": True})
            rcost = evaluate(problem, rplan)
            if rcost.feasible:
                finals.append((rcost.objective_ms, rplan))
            if rcost.feasible and (best is None or rcost.objective_ms < best[0]):
                best = (rcost.objective_ms, rplan)
            elif not rcost.feasible:
                worst_reason = worst_reason or rcost.reason
                misses.append((rcost.overflow_bytes, i, rstages))
    if best is None and misses:
        # Nothing fits yet: single-node moves off the over-full GPUs of the plans closest to
        # fitting (coarse blocks and LPT's memory estimate can miss a fit by a few nodes).
        for _, i, stages in sorted(misses)[:RELIEVE_TOP]:
            r = Refiner.of_stages(problem, stages)
            if not r.relieve(max_seconds=max(1.0, 0.1 * time_budget_s)):
                continue
            rstages = refine_stages(problem, r.stages(), max_seconds=1.0)
            rplan = _plan(problem, rstages, {"refined": True, "relieved": True})
            rcost = evaluate(problem, rplan)
            if rcost.feasible:
                finals.append((rcost.objective_ms, rplan))
                if best is None or rcost.objective_ms < best[0]:
                    best = (rcost.objective_ms, rplan)
    if with_convex:
        from .seq import partition_seq

        def consider(found: Plan, source: str, into: list | None = None) -> None:
            """Another partitioner's plan joins the candidates (re-made with Mixed-pipe's info)."""
            nonlocal best
            plan = _plan(problem, [(st.gpu, st.nodes) for st in found.stages], {"source": source, "refined": False})
            plan.simulations.update(found.simulations)      # (seq's replays: not run again)
            cost = evaluate(problem, plan)
            if cost.feasible:
                (finals if into is None else into).append((cost.objective_ms, plan))
                if best is None or cost.objective_ms < best[0]:
                    best = (cost.objective_ms, plan)

        sp = None
        try:
            left = max(1.0, time_budget_s * SEQ_UNTIL - (time.perf_counter() - t0), time_budget_s * MIN_SHARE)
            sp = partition_seq(problem, max_stages=max_stages, time_limit=left)
            consider(sp, "convex split (seq)")
            alt = sp.info.get("simulated_alternative")
            if alt and "stages" in alt:         # seq's fastest split in simulation is a candidate too
                consider(Plan("seq", P, [Stage(i, g, ns) for i, (g, ns) in enumerate(alt["stages"])],
                              simulations=sp.simulations),
                         "convex split (seq, fastest in simulation)")
        except Infeasible as exc:
            worst_reason = worst_reason or exc.reason
        if sum(1 for _ in problem.graph.op_nodes()) <= exact_max_nodes and P > 1:
            try:
                from .exact import partition_exact

                left = max(1.0, time_budget_s * MIP_UNTIL - (time.perf_counter() - t0), time_budget_s * MIN_SHARE)
                # Started from the best plan found so far (refined candidates or the convex split),
                # the MIP spends its time below it rather than rediscovering it.
                warm = best[1] if best is not None else sp
                few: list[tuple[Plan, str]] = []
                mp = partition_exact(problem, time_limit=left, max_stages=max_stages,
                                     simulate_top=0, warm_plan=warm, max_variables=100_000, relaxed_out=few)
                for p, source in few:
                    consider(p, f"mixed-space MIP ({source})", relaxed)
                consider(mp, "mixed-space MIP")
            except Infeasible as exc:
                worst_reason = worst_reason or exc.reason
    if max_stages is not None:
        finals = [f for f in finals if len(f[1].stages) <= max_stages]
        best = min(finals, key=lambda f: f[0]) if finals else None
    if best is None:
        need = sum(c.total for c in problem.profile.params.values())
        raise Infeasible(f"no Mixed-pipe (mixed) plan fits in memory for L in {ls} ({worst_reason}); weights, gradients "
                         f"and optimizer state alone need {format_bytes(need)} against "
                         f"{P} x {format_bytes(limit)}"
                         + (f" (at most {max_stages} stages)" if max_stages is not None else ""))
    # The plan returned is the lowest objective found (near-ties decided by simulation), what the
    # objective and any bound speak of. The fastest in simulation, refined by simulated period,
    # goes with it as info["simulated_alternative"] (compile makes it the row "mixed-sim"), or is
    # returned itself with prefer="simulated".
    # Simulating the best few may take as long as the search did (its fastest plan in simulation,
    # often one of few stages, is compile's best row in many cases), no longer.
    lowest, fastest = simulated_choice(problem, finals, simulate_top, time_limit=time_budget_s, extra=relaxed)
    plan = lowest
    if simulate_top:
        if sim_refine:
            from .simrefine import refine_simulated

            left = max(time_budget_s - (time.perf_counter() - t0), time_budget_s * SIM_SHARE)
            fastest = refine_simulated(problem, fastest, left)
        plan = fastest if prefer == "simulated" else with_alternative(lowest, fastest)
    plan.info["best_objective_ms"] = best[0]
    plan.info["seconds"] = round(time.perf_counter() - t0, 3)
    return plan


def partition_mixed_simulated(problem: Problem, *, max_stages: int | None = None, **options) -> Plan:
    """Mixed-pipe's fastest plan in simulation (strategy ``mixed-sim``): :func:`partition_mixed`
    with ``prefer="simulated"``. (``max_stages`` is named so that
    :func:`~ftcompile.partition.base.run_strategy` sees it and caps 2bw's and 2gw's stages.)"""
    return partition_mixed(problem, prefer="simulated", max_stages=max_stages, **options)


def _assign_any(problem: Problem, q: Quotient) -> dict[int, int]:
    """Least-loaded assignment ignoring memory, so that evaluate can report what was needed."""
    load = [0.0] * problem.num_gpus
    where = {}
    for b in sorted(q.blocks(), key=lambda b: -q.work[b]):
        g = min(range(len(load)), key=lambda g: load[g])
        where[b] = g
        load[g] += q.work[b]
    return where


def _regions(problem: Problem, q: Quotient) -> dict[int, str] | None:
    """Block -> top-level module holding its first node, if the model has two or more such modules."""
    graph = problem.graph
    out = {}
    for b, members in q.members.items():
        scopes = graph.node(min(members)).scopes
        out[b] = next((path for path, _ in scopes if path), "")
    return out if len(set(out.values())) > 1 else None
