"""Let the partitioners compete and keep the best plan (FTPipe §4 "GPU assignment").

:func:`compile_plan` runs every requested strategy on one :class:`~ftcompile.plan.Problem`
(in parallel processes where there is more than one core), prices each plan with
:func:`~ftcompile.plan.evaluate`, simulates it, and chooses the feasible plan with
the highest simulated throughput. :func:`plan_document` turns the outcome into the
``plan.json`` artifact, and :func:`write_report` writes the readable report and
pictures beside it.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field

from .partition import STRATEGIES, Infeasible, run_strategy
from .runtime.atomic import atomic_path
from .plan import PLAN_FORMAT, PLAN_VERSION, Plan, PlanCost, PlanError, Problem, evaluate, lower_bound, save_json

#: Strategies ``auto`` runs. ``exact`` joins when the graph is small enough to solve.
AUTO_STRATEGIES = ("mixed", "seq", "acyclic", "metis", "uniform", "params")
#: Up to this many op nodes ``auto`` runs ``exact`` too (the tiny zoo models have 100 to 400; it
#: solves them in well under a second). Larger graphs would be coarsened into 60 blocks, whose
#: optimum is far from the heuristics' plans and whose bound holds only for whole blocks.
EXACT_AUTO_MAX_NODES = 1000


class CompileError(ValueError):
    """No strategy found a plan that fits; the message says what would."""


@dataclass
class StrategyResult:
    name: str
    feasible: bool
    reason: str | None = None
    plan: Plan | None = None
    cost: PlanCost | None = None
    sim: dict | None = None          # SimResult.to_json()
    seconds: float = 0.0

    def row(self) -> dict:
        """The strategy's line in plan.json and the report."""
        c = self.cost
        return {
            "name": self.name, "feasible": self.feasible, "reason": self.reason,
            "objective_ms": round(c.objective_ms, 6) if c else None,
            "throughput": round(self.sim["throughput_samples_per_s"], 6) if self.sim else None,
            "bubble_fraction": round(self.sim["bubble_fraction"], 6) if self.sim else None,
            "efficiency": round(c.efficiency, 6) if c else None,
            "speedup": round(c.speedup, 4) if c else None,
            "stages": len(self.plan.stages) if self.plan else None,
            "max_gpu_memory_bytes": c.max_memory_bytes if c else None,
            "seconds": round(self.seconds, 3),
            **({"info": self.plan.info} if self.plan and self.plan.info else {}),
        }


@dataclass
class CompileResult:
    problem: Problem
    results: list[StrategyResult]
    chosen: str | None
    lower_bound_ms: float
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def best(self) -> StrategyResult:
        return next(r for r in self.results if r.name == self.chosen)


def resolve_strategies(names: list[str] | tuple[str, ...] | str, problem: Problem) -> list[str]:
    """Expand ``auto`` and check names."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        if n == "auto":
            out.extend(AUTO_STRATEGIES)
            if sum(1 for _ in problem.graph.op_nodes()) <= EXACT_AUTO_MAX_NODES:
                out.append("exact")
        elif n in STRATEGIES:
            out.append(n)
        else:
            raise CompileError(f"unknown strategy {n!r}; choose from auto, {', '.join(STRATEGIES)}")
    return list(dict.fromkeys(out))


def _run_one(name: str, problem: Problem, simulate_plan: bool) -> StrategyResult:
    t0 = time.perf_counter()
    try:
        plan = run_strategy(name, problem)
        cost = evaluate(problem, plan)
        if not cost.feasible:
            return StrategyResult(name, False, f"plan does not fit: {cost.reason}", plan, cost,
                                  seconds=time.perf_counter() - t0)
        sim = None
        if simulate_plan:
            from .simulate import simulate

            sim = simulate(problem, plan).to_json()
            sim.pop("events", None)
            if not sim["memory_feasible"]:
                worst = max(range(plan.num_gpus), key=lambda g: sim["gpu_peak_memory"][g] - sim["gpu_memory_limit"])
                return StrategyResult(name, False, f"the simulated run does not fit: GPU {worst} peaks at "
                                      f"{sim['gpu_peak_memory'][worst] / 1e9:.2f} GB of "
                                      f"{sim['gpu_memory_limit'] / 1e9:.2f} GB", plan, cost, sim,
                                      time.perf_counter() - t0)
        return StrategyResult(name, True, None, plan, cost, sim, time.perf_counter() - t0)
    except Infeasible as exc:
        return StrategyResult(name, False, exc.reason, seconds=time.perf_counter() - t0)
    except (PlanError, ValueError) as exc:
        return StrategyResult(name, False, f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - one broken strategy must not sink the others
        tb = traceback.format_exc(limit=3).strip().splitlines()[-1]
        return StrategyResult(name, False, f"internal error in {name}: {exc} ({tb})",
                              seconds=time.perf_counter() - t0)


def compile_plan(problem: Problem, strategies: list[str] | str = "auto", *, jobs: int | None = None,
                 simulate_plans: bool = True, progress=None) -> CompileResult:
    """Run the strategies, price and simulate each plan, and choose the best feasible one.

    The best is the feasible plan with the highest simulated throughput (or the
    lowest objective when ``simulate_plans`` is off); ties go to the lower objective.
    """
    names = resolve_strategies(strategies, problem)
    t0 = time.perf_counter()
    bound = lower_bound(problem)     # before the workers start: the problem carries it to them
    jobs = jobs if jobs is not None else min(len(names), os.cpu_count() or 1)
    results: dict[str, StrategyResult] = {}
    if jobs > 1 and len(names) > 1:
        ctx = multiprocessing.get_context("fork")
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futs = {pool.submit(_run_one, n, problem, simulate_plans): n for n in names}
            for fut in cf.as_completed(futs):
                r = fut.result()
                results[r.name] = r
                if progress:
                    progress(r)
    else:
        for n in names:
            r = _run_one(n, problem, simulate_plans)
            results[n] = r
            if progress:
                progress(r)
    ordered_results = [results[n] for n in names]
    feasible = [r for r in ordered_results if r.feasible]
    chosen = None
    if feasible:
        def score(r: StrategyResult):
            thr = r.sim["throughput_samples_per_s"] if r.sim else 0.0
            return (-thr, r.cost.objective_ms) if simulate_plans else (r.cost.objective_ms,)
        chosen = min(feasible, key=score).name
    return CompileResult(problem, ordered_results, chosen, bound, time.perf_counter() - t0)


def minimum_requirements(problem: Problem, max_gpus: int = 64, *, precision: float = 0.02) -> str:
    """What would make the model fit: the smallest per-GPU memory and the fewest GPUs.

    Both are found with the Seq-pipe DP, which is exact among contiguous plans under
    a memory limit (another strategy may fit with less). Memory: the Seq-pipe plan on
    the same GPUs with the limit lifted uses some most-loaded GPU memory ``need``; the
    smallest limit at which the DP still finds a plan is bisected between what the
    weights alone need per GPU and ``need``, to ``precision``, and rounded up. GPUs:
    the fewest GPUs of the given memory on which the DP finds a plan, searched from
    the count the weights alone need (doubling, then bisection), up to ``max_gpus``.
    """
    from dataclasses import replace

    from .units import format_bytes

    P = problem.num_gpus
    limit = problem.cluster.gpu_memory
    static = sum(p.total for p in problem.profile.params.values())
    parts = [f"weights, gradients and optimizer state take {format_bytes(static)} in all"]

    def with_memory(m: int) -> Problem:
        return replace(problem, cluster=replace(problem.cluster, gpu_memory=int(m)))

    def seq_fits(pb: Problem) -> bool:
        try:
            run_strategy("seq", pb)
            return True
        except (Infeasible, PlanError, ValueError):
            return False

    if seq_fits(problem):
        # The strategies asked for failed, but the cluster is big enough.
        parts.append(f"a Seq-pipe plan fits these {P} GPUs of {format_bytes(limit)}: use --strategy seq "
                     "(or auto)")
        return "; ".join(parts)
    relaxed = with_memory(10**18)
    try:
        need = evaluate(relaxed, run_strategy("seq", relaxed)).max_memory_bytes
    except (Infeasible, PlanError, ValueError):
        need = None
    if need is not None:
        lo, hi = max(limit, static // P), need          # lo does not fit (else we would not be here)
        while hi - lo > precision * hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if seq_fits(with_memory(mid)) else (mid, hi)
        parts.append(f"on {P} GPUs a Seq-pipe plan fits in {format_bytes(hi)} per GPU (have "
                     f"{format_bytes(limit)}): use --gpu-memory {format_bytes(hi * 1.005)} or more")

    def fits(p: int) -> bool:
        return seq_fits(replace(problem, cluster=problem.cluster.with_overrides(gpus=p)))

    lo = max(P, -(-static // max(limit, 1)) - 1)       # lo GPUs do not fit
    hi = min(lo + 1, max_gpus)
    while hi < max_gpus and not fits(hi):
        lo, hi = hi, min(hi * 2, max_gpus)
    if hi > lo and (hi < max_gpus or fits(hi)):
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        parts.append(f"with {format_bytes(limit)} per GPU a Seq-pipe plan fits on {hi} GPUs (--gpus {hi})")
    else:
        parts.append(f"it does not fit on up to {max_gpus} GPUs of {format_bytes(limit)}: some single "
                     "operator needs more memory than one GPU has")
    return "; ".join(parts)


# --------------------------------------------------------------------------- plan.json

def _stage_rows(problem: Problem, plan: Plan, cost: PlanCost) -> list[dict]:
    from .plan import stage_graph, total_param_memory

    graph = problem.graph
    sg = stage_graph(graph, plan)
    gpu_of = {s.id: s.gpu for s in plan.stages}
    rows = []
    by_id = {c.id: c for c in cost.stages}
    param_bytes = {s.id: total_param_memory(problem, s.nodes) for s in plan.stages}
    for s in plan.stages:
        c = by_id[s.id]

        def values(edges, other_key):
            out = []
            for other, data in edges:
                for v, b in data["values"].items():
                    meta = graph.node(graph.producer(v)).outputs[v]
                    out.append({"value": v, other_key: other, "gpu": gpu_of[other], "bytes": b,
                                **({"shape": list(meta.tensor.shape), "dtype": meta.tensor.dtype}
                                   if meta.tensor is not None else {"literal": meta.literal})})
            return out

        rows.append({
            "id": s.id, "gpu": s.gpu, "depth": c.depth, "nodes": s.nodes,
            "forward_ms": c.forward_ms, "backward_ms": c.backward_ms, "recompute_ms": c.recompute_ms,
            "compute_ms": c.forward_ms + c.backward_ms + c.recompute_ms, "period_ms": c.period_ms,
            "comm_fwd_ms": c.comm_fwd_ms, "comm_bwd_ms": c.comm_bwd_ms,
            # Memory of the stage alone: the weights, gradients and optimizer state of the parameters
            # it reads, plus the activations it keeps for its micro-batches in flight. (A GPU's
            # total in "gpus" counts a parameter shared by its stages once, and weight versions.)
            "activation_bytes": c.activation_bytes, "activation_memory_bytes": c.memory_bytes,
            "param_memory_bytes": param_bytes[s.id],
            "memory_bytes": c.memory_bytes + param_bytes[s.id],
            "inputs": values(((u, sg.edges[u, s.id]) for u in sg.predecessors(s.id)), "from_stage"),
            "outputs": values(((t, sg.edges[s.id, t]) for t in sg.successors(s.id)), "to_stage"),
            "graph_inputs": sorted({e.value for n in s.nodes for e in graph.in_edges(n)
                                    if graph.node(e.src).kind == "input"}),
            "computes_loss": any(graph.node(n).is_loss for n in s.nodes),
        })
    return rows


def plan_document(result: CompileResult, *, model: dict | None = None) -> dict:
    """The ``plan.json`` artifact."""
    p = result.problem
    doc = {
        "format": PLAN_FORMAT, "version": PLAN_VERSION,
        "model": model or p.graph.source,
        "graph_hash": p.graph.content_hash(),
        "profile": {"method": p.profile.method, "hardware": p.profile.hardware.get("name"),
                    "dtype": p.profile.dtype, "optimizer": p.profile.optimizer, "key": p.profile.key},
        "cluster": p.cluster.to_json(),
        "schedule": p.schedule, "micro_batches": p.micro_batches, "recompute": p.recompute,
        "lower_bound": {"objective_ms": result.lower_bound_ms,
                        "note": "total compute / GPUs, less the most recomputation the last stage can skip "
                                "within its period and one GPU's memory; no plan that fits can beat it"},
        "strategies": [r.row() for r in result.results],
        "chosen": result.chosen,
        "compile_seconds": round(result.seconds, 3),
    }
    if result.chosen is not None:
        best = result.best()
        doc["plan"] = best.plan.to_json()
        doc["cost"] = {k: v for k, v in best.cost.to_json().items() if k != "stages"}
        doc["simulation"] = best.sim
        doc["stages"] = _stage_rows(p, best.plan, best.cost)
        doc["node_names"] = {str(n.id): n.name for n in p.graph.op_nodes()}
        doc["gpus"] = [{"gpu": g.gpu, "stages": g.stages, "load_ms": g.load_ms, "compute_ms": g.compute_ms,
                        "comm_ms": g.comm_ms, "memory_bytes": g.memory_bytes, "memory_limit": g.memory_limit,
                        "param_bytes": g.param_bytes, "activation_bytes": g.activation_bytes,
                        "utilisation": g.load_ms / best.cost.objective_ms if best.cost.objective_ms else 0.0}
                       for g in best.cost.gpus]
    return doc


# --------------------------------------------------------------------------- report

def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def report_text(doc: dict) -> str:
    """A plain-text (Markdown) report of a plan document."""
    lines = []
    m = doc.get("model") or {}
    c = doc["cluster"]
    lines.append(f"# ftcompile plan: {m.get('model', '?')}")
    lines.append("")
    lines.append(f"cluster {c['name']}: {c['nodes']} x {c['gpus_per_node']} GPUs, "
                 f"{c['gpu_memory'] / 1e9:.1f} GB each, {c['intra_node_bandwidth'] / 1e9:.1f} GB/s; "
                 f"schedule {doc['schedule']}, {doc['micro_batches']} micro-batches; "
                 f"costs {doc['profile']['method']} on {doc['profile']['hardware']}")
    lines.append(f"lower bound: {doc['lower_bound']['objective_ms']:.3f} ms per micro-batch")
    lines.append("")
    lines.append("| strategy | feasible | objective ms | efficiency | speed-up | throughput /s | bubble | stages | max GPU mem | time s | note |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in doc["strategies"]:
        mark = " (chosen)" if r["name"] == doc.get("chosen") else ""
        fmt = lambda v, f: (f.format(v) if v is not None else "-")  # noqa: E731
        lines.append(
            f"| {r['name']}{mark} | {'yes' if r['feasible'] else 'no'} | {fmt(r['objective_ms'], '{:.3f}')} | "
            f"{fmt(r['efficiency'], '{:.1%}')} | {fmt(r['speedup'], '{:.2f}')} | {fmt(r['throughput'], '{:.2f}')} | "
            f"{fmt(r['bubble_fraction'], '{:.1%}')} | {fmt(r['stages'], '{}')} | "
            f"{_fmt_bytes(r['max_gpu_memory_bytes'])} | {r['seconds']:.1f} | {r['reason'] or ''} |")
    if doc.get("gpus"):
        lines.append("")
        lines.append(f"## chosen: {doc['chosen']}")
        lines.append("")
        lines.append("| GPU | stages | load ms | compute ms | comm ms | utilisation | memory | of limit |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for g in doc["gpus"]:
            lines.append(f"| {g['gpu']} | {','.join(map(str, g['stages']))} | {g['load_ms']:.3f} | "
                         f"{g['compute_ms']:.3f} | {g['comm_ms']:.3f} | {g['utilisation']:.1%} | "
                         f"{_fmt_bytes(g['memory_bytes'])} | {g['memory_bytes'] / g['memory_limit']:.0%} |")
        lines.append("")
        lines.append("| stage | GPU | depth | nodes | period ms | memory | sends | receives |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for s in doc["stages"]:
            lines.append(f"| {s['id']} | {s['gpu']} | {s['depth']} | {len(s['nodes'])} | {s['period_ms']:.3f} | "
                         f"{_fmt_bytes(s.get('memory_bytes'))} | "
                         f"{_fmt_bytes(sum(v['bytes'] for v in s['outputs']))} | "
                         f"{_fmt_bytes(sum(v['bytes'] for v in s['inputs']))} |")
    else:
        lines.append("")
        lines.append(f"no strategy found a plan that fits: {doc.get('requirements', '')}")
    return "\n".join(lines) + "\n"


def draw_gpu_boxes(docs: list[tuple[str, dict]], path: str) -> None:
    """FTPipe Fig. 8: one box per GPU, width = memory used, fill = utilisation; one row per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    rows = [(label, d) for label, d in docs if d.get("gpus")]
    fig, axes = plt.subplots(len(rows) or 1, 1, figsize=(12, 1.6 * max(len(rows), 1) + 0.6), squeeze=False)
    for ax, (label, d) in zip(axes[:, 0], rows):
        # Widths are relative to the fullest GPU so that small models stay visible; labels give
        # the absolute figures and the share of the GPU's memory.
        widest = max(max(g["memory_bytes"] for g in d["gpus"]), 1)
        x = 0.0
        for g in d["gpus"]:
            w = max(g["memory_bytes"] / widest, 0.03)
            ax.add_patch(Rectangle((x, 0), w, 1, fill=False, lw=1.2, ec="black"))
            ax.add_patch(Rectangle((x, 0), w, min(g["utilisation"], 1.0), color="tab:blue", alpha=0.6))
            ax.text(x + w / 2, 1.05, f"GPU {g['gpu']}\n{_fmt_bytes(g['memory_bytes'])} "
                    f"({g['memory_bytes'] / g['memory_limit']:.0%})\n{g['utilisation']:.0%} busy",
                    ha="center", va="bottom", fontsize=7)
            x += w + 0.15
        ax.set_xlim(0, max(x, 1))
        ax.set_ylim(0, 1.9)
        ax.set_yticks([])
        ax.set_xticks([])
        eff = d.get("cost", {}).get("efficiency")
        ax.set_title(f"{label}: {d.get('chosen')} ({'' if eff is None else f'{eff:.1%} of lower bound'}); "
                     "width = memory used, fill = utilisation", fontsize=9, loc="left")
        for s in ax.spines.values():
            s.set_visible(False)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def write_report(out_dir: str, doc: dict, result: CompileResult | None = None) -> dict[str, str]:
    """Write plan.json, report.md, gpus.png and (when a plan was chosen) the timeline pictures."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"plan": os.path.join(out_dir, "plan.json"), "report": os.path.join(out_dir, "report.md")}
    save_json(paths["plan"], doc)
    from .ir import atomic_write_text

    atomic_write_text(paths["report"], report_text(doc))
    if doc.get("gpus"):
        paths["gpus"] = os.path.join(out_dir, "gpus.png")
        draw_gpu_boxes([(str((doc.get("model") or {}).get("model", "plan")), doc)], paths["gpus"])
        if result is not None and result.chosen is not None:
            from .simulate import simulate
            from .timeline import draw_timeline

            best = result.best()
            sim = simulate(result.problem, best.plan)
            base = os.path.join(out_dir, "timeline")
            draw_timeline(sim, base + ".png")
            paths["timeline"] = base + ".png"
    return paths
