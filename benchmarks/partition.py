"""Partitioner benchmark: every strategy on the FTPipe paper's models (issue: partitioners that compete).

For each case: build the model on meta, trace it (operator granularity), profile it
analytically, run every strategy, and print one table per case: objective (stage
period per micro-batch), efficiency against the lower bound, expected speed-up
(FTPipe's figure of merit: total work / period), simulated throughput, memory and
run time. Strategies run one after another (``--jobs 1``, the default), so each
one's time is its own; ``ftcompile compile`` runs them in parallel on the cores.

Cases: the paper's T5-3B, GPT2-xl and BERT-large on its server (8 x RTX 2080 Ti,
11 GB, 12 GB/s), T5-11B (one example per micro-batch) on 4 x 32 GB V100, and two graphs of more than 5,000 op
nodes for the partitioners' run time: ``gpt2-5k`` (GPT-2 XL widths, 120 layers)
and ``t5-5k`` (T5-3B widths, 48 + 48 layers), on 8 x 32 GB V100 (their weights do
not fit the paper's server).

    python benchmarks/partition.py                      # the four paper cases
    python benchmarks/partition.py --case t5-3b --json out.json
    python benchmarks/partition.py --case gpt2-5k --case t5-5k
    python benchmarks/partition.py --all                # paper cases and the 5k graphs
    python benchmarks/partition.py --suite              # the balance-under-memory suite (below)

Per case, one table: objective (largest GPU load per micro-batch, FTPipe Eq. 1),
simulated period, the best bound proven for the plan's space and the gap to it,
both speed-ups (over one device without recomputation; FTPipe's, counting
recomputation), stages and staleness, memory, run time, and what each strategy
proved (seq: optimal over convex splits; exact: its MIP bound and what it covers).

Targets (printed PASS/FAIL, exit status 1 if any fails): T5-3B Mixed-pipe at least
94% of the lower bound (7.5 of 8); the whole t5-3b compile (build, trace, profile,
every strategy and its simulation) under 90 s; each heuristic partitioner under
20 s on a graph of 5,000 op nodes or more.

``--suite``: zoo models with parallel branches at layer and operator granularity
(BERT, GPT-2, T5, ViT, SkipNet, EncDec) on 3 and 6 GPUs with free links (balance and
memory only), with unlimited memory and with the hardware's per-GPU reserve plus 1.2 x and 1.1 x
(weights, gradients, optimizer state and one micro-batch of activations) / P. It reports, per case,
whether seq proved its plan optimal among convex splits, Mixed-pipe against the
bound, and the chosen plan's simulated period against its objective.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from ftcompile.cluster import PRESETS
from ftcompile.compile import DEFAULT_TIME_LIMIT, compile_plan, every_plan_bound, tighten_bounds
from ftcompile.hardware import load_hardware
from ftcompile.ir import atomic_write_text
from ftcompile.models import ModelOptions, build_model
from ftcompile.plan import Problem
from ftcompile.profile import analytic_profile
from ftcompile.trace import trace

# Optimizers as in the paper's Appendix A: Adafactor for T5, Adam(W) for GPT-2 and BERT.
# The optimizer decides the state memory: T5-11B with Adam needs 181 GB for weights,
# gradients and optimizer state alone, more than 4 x 32 GB; with Adafactor it fits.
CASES = {
    "t5-3b": dict(model="t5-3b", options=dict(batch_size=4, encoder_len=512, decoder_len=4),
                  cluster="paper-8x2080ti", hardware="rtx2080ti", optimizer="adafactor"),
    "gpt2-xl": dict(model="gpt2-xl", options=dict(batch_size=1, seq_len=1024),
                    cluster="paper-8x2080ti", hardware="rtx2080ti"),
    "bert-large": dict(model="bert-large", options=dict(batch_size=1, seq_len=384),
                       cluster="paper-8x2080ti", hardware="rtx2080ti"),
    # T5-11B keeps about 20 GB of activations per 512-token example (128 heads, d_ff 65,536):
    # a micro-batch of 4 (79 GB) cannot fit 4 x 32 GB next to 90.5 GB of weights, gradients
    # and Adafactor state under any plan, so one example per micro-batch (paper §5.8).
    "t5-11b": dict(model="t5-11b", options=dict(batch_size=1, encoder_len=512, decoder_len=4),
                   cluster="4xv100-32gb", hardware="v100-32gb", optimizer="adafactor"),
    # Deeper versions of zoo models, for graphs of more than 5,000 op nodes.
    "gpt2-5k": dict(model="gpt2-xl", config=dict(n_layer=120), options=dict(batch_size=1, seq_len=1024),
                    cluster="8xv100-32gb", hardware="v100-32gb"),
    "t5-5k": dict(model="t5-3b", config=dict(num_layers=48), options=dict(batch_size=4, encoder_len=512, decoder_len=4),
                  cluster="8xv100-32gb", hardware="v100-32gb", optimizer="adafactor"),
}
PAPER_CASES = ("t5-3b", "gpt2-xl", "bert-large", "t5-11b")
HEURISTICS = ("mixed", "seq", "acyclic", "metis", "uniform", "params")
LARGE_GRAPH = 5000


def build(case: dict):
    """The case's model on meta: a zoo entry, or a zoo entry with config fields changed."""
    options = ModelOptions(device="meta", **case["options"])
    if "config" not in case:
        return build_model(case["model"], options)
    from ftcompile.models import get_entry
    from ftcompile.models.hf import FAMILIES, build_hf

    entry = get_entry(case["model"])
    family = next(f for f in FAMILIES if f.family == entry.family)
    size = next(s for s in family.sizes if s.name == entry.name)
    size = dataclasses.replace(size, config={**size.config, **case["config"]})
    return build_hf(dataclasses.replace(family, sizes=(size,)), entry, options)


def run_case(name: str, schedule: str, micro_batches: int, jobs: int, time_limit: float | None = None) -> dict:
    case = CASES[name]
    t0 = time.perf_counter()
    built = build(case)
    t_build = time.perf_counter() - t0
    source = {"model": case["model"], "options": case["options"], **({"config": case["config"]} if "config" in case else {})}
    graph = trace(built.model, built.args, built.kwargs, source=source)
    t_trace = time.perf_counter() - t0 - t_build
    prof = analytic_profile(graph, load_hardware(case["hardware"]), optimizer=case.get("optimizer", "adam"))
    t_prof = time.perf_counter() - t0 - t_build - t_trace
    problem = Problem(graph, prof, PRESETS[case["cluster"]], schedule=schedule, micro_batches=micro_batches)
    result = compile_plan(problem, "auto", jobs=jobs, time_limit=time_limit)
    tighten_bounds(result, DEFAULT_TIME_LIMIT if time_limit is None else time_limit)
    total = time.perf_counter() - t0
    rows = [r.row() for r in result.results]
    return {"case": name, "nodes": len(graph.nodes), "op_nodes": sum(1 for _ in graph.op_nodes()),
            "cluster": case["cluster"], "optimizer": case.get("optimizer", "adam"), "schedule": schedule, "jobs": jobs,
            "lower_bound_ms": result.lower_bound_ms, "chosen": result.chosen, "strategies": rows,
            "seconds": {"build": round(t_build, 2), "trace": round(t_trace, 2), "profile": round(t_prof, 2),
                        "partition_and_simulate": round(result.seconds, 2), "total": round(total, 2)}}


def note(s: dict) -> str:
    """Why a strategy failed, or what seq and exact proved."""
    from ftcompile.compile import _row_note

    return s["reason"] or _row_note(s)


def print_case(r: dict) -> list[tuple[str, bool]]:
    print(f"\n== {r['case']}: {r['op_nodes']} op nodes, {r['cluster']}, {r['schedule']}, {r['optimizer']}; lower bound "
          f"{r['lower_bound_ms']:.3f} ms; chosen {r['chosen']}; times {r['seconds']}")
    print(f"{'strategy':10}{'obj ms':>10}{'sim ms':>10}{'bound ms':>10}{'gap':>7}{'speedup':>8}{'FTPipe':>7}"
          f"{'stages':>7}{'stale':>6}{'mem GB':>8}{'time s':>8}  note")
    checks = []
    for s in r["strategies"]:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        mem = None if s["max_gpu_memory_bytes"] is None else s["max_gpu_memory_bytes"] / 1e9
        print(f"{s['name']:10}{f(s['objective_ms'], '.3f'):>10}{f(s.get('simulated_period_ms'), '.3f'):>10}"
              f"{f(s.get('bound_ms'), '.3f'):>10}{f(s.get('gap'), '.1%'):>7}{f(s.get('speedup_no_recompute'), '.2f'):>8}"
              f"{f(s['speedup'], '.2f'):>7}{f(s['stages'], 'd'):>7}{f(s.get('staleness_updates'), '.2g'):>6}"
              f"{f(mem, '.2f'):>8}{s['seconds']:>8.1f}  {note(s)[:90]}")
        if s["name"] in HEURISTICS and r["op_nodes"] >= LARGE_GRAPH:
            checks.append((f"{r['case']} ({r['op_nodes']} op nodes) {s['name']} under 20 s: {s['seconds']:.1f} s",
                           s["seconds"] < 20))
    if r["case"] == "t5-3b":
        mixed = next(s for s in r["strategies"] if s["name"] == "mixed")
        checks.append((f"t5-3b mixed efficiency >= 94%: {mixed['efficiency'] or 0:.1%} "
                       f"(speed-up {mixed['speedup'] or 0:.2f} of 8)",
                       bool(mixed["efficiency"] and mixed["efficiency"] >= 0.94)))
        checks.append((f"t5-3b whole compile under 90 s: {r['seconds']['total']:.1f} s", r["seconds"]["total"] < 90))
    return checks


# --------------------------------------------------------------------------- the suite

#: (model, basic blocks or None for operator granularity, options)
SUITE_GRAPHS = [
    ("bert-large", "auto", {}), ("gpt2-small", "auto", {}), ("t5-small", "auto", {}), ("vit-base", "auto", {}),
    ("bert-tiny", None, {}), ("gpt2-tiny", None, {}), ("skipnet", None, {}), ("encdec", None, {}),
]


def suite_problems(gpus=(3, 6), memory=(None, 1.2, 1.1), models=None):
    """(label, Problem) for every suite graph (or those of ``models``, "name-layer"/"name-op"),
    GPU count and memory share; free links."""
    from dataclasses import replace

    for model, blocks, opts in SUITE_GRAPHS:
        if models and f"{model}{'-layer' if blocks else '-op'}" not in models and model not in models:
            continue
        built = build_model(model, ModelOptions(device="meta" if blocks else "cpu", **opts))
        graph = trace(built.model, built.args, built.kwargs, source={"model": model},
                      basic_blocks=built.basic_blocks if blocks == "auto" else ())
        prof = analytic_profile(graph, load_hardware("rtx2080ti"), optimizer="adam")
        total = prof.training_bytes()
        for P in gpus:
            for share in memory:
                cluster = PRESETS["paper-8x2080ti"].with_overrides(gpus=P, bandwidth="1000000GB/s")
                if share is not None:
                    # The hardware's reserve (CUDA context, workspaces) is per GPU, not shared out.
                    reserve = load_hardware(cluster.hardware).memory_reserve_bytes
                    cluster = replace(cluster, gpu_memory=reserve + int(share * total / P))
                label = f"{model}{'-layer' if blocks else '-op'} P={P} mem={share or 'unlimited'}"
                yield label, Problem(graph, prof, cluster, schedule="async", micro_batches=4)


def file_problems(paths, gpus=(3, 6), memory=(None, 1.2, 1.1), weights: float = 0.0, optimizer: str = "adam",
                  values: bool = True):
    """(label, Problem) for every placement-graph file (:mod:`placement_graphs`: the public BERT,
    ResNet-50, InceptionV3 and GNMT graphs of Tarnawski et al.), GPU count and memory share of
    total / P; free links."""
    import os

    from placement_graphs import load_problem, with_share

    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        for P in gpus:
            base = load_problem(path, P, weights=weights, optimizer=optimizer, values=values)
            for share in memory:
                yield f"{name} P={P} mem={share or 'unlimited'}", with_share(base, share)


def untied_problem(problem: Problem, plan) -> Problem:
    """``problem`` with every tensor that several of ``plan``'s stages read given one copy per
    holding stage: the same plan then simulates without the tied-weight exchange and its wait
    (each holder's update waits for every other holder's gradient of the step). Memory and
    update costs stay as they were (each holder keeps and updates its own copy either way).
    Used only to attribute a gap between the simulated period and the objective."""
    import copy

    graph = copy.deepcopy(problem.graph)
    prof = copy.deepcopy(problem.profile)
    stage_of = {n: st.id for st in plan.stages for n in st.nodes}
    holders: dict[str, set[int]] = {}
    for n in graph.op_nodes():
        for prm in n.params:
            holders.setdefault(prm, set()).add(stage_of[n.id])
    for n in graph.nodes:
        names = []
        for prm in n.params:
            if len(holders.get(prm, ())) > 1 and stage_of.get(n.id) != min(holders[prm]):
                prm2 = f"{prm}#stage{stage_of[n.id]}"
                graph.params.setdefault(prm2, graph.params[prm])
                prof.params.setdefault(prm2, prof.params[prm])
                prm = prm2
            names.append(prm)
        n.params = names
    graph._index()
    return dataclasses.replace(problem, graph=graph, profile=prof)


def tied_across_stages(problem: Problem, plan) -> bool:
    stage_of = {n: st.id for st in plan.stages for n in st.nodes}
    holders: dict[str, set[int]] = {}
    for n in problem.graph.op_nodes():
        for prm in n.params:
            holders.setdefault(prm, set()).add(stage_of[n.id])
    return any(len(h) > 1 for h in holders.values())


#: Goals of issue 12 on the suite.
MIXED_OVER_BOUND, MIXED_OVER_OPTIMUM, SIM_OVER_OBJECTIVE = 1.02, 1.01, 1.03
REL = 1e-9


def suite_row(label: str, problem: Problem, result) -> dict:
    """The figures of one suite case (see :func:`run_suite` for what each covers)."""
    from ftcompile.compile import CONVEX_STRATEGIES
    from ftcompile.simulate import simulate

    by = {r.name: r for r in result.results}
    seq, mixed, exact = by.get("seq"), by.get("mixed"), by.get("exact")
    lb = result.lower_bound_ms
    sinfo = (seq.plan.info if seq and seq.plan else None) or {}
    einfo = (exact.plan.info if exact and exact.plan else None) or {}
    # Convex splits: the best objective any convex strategy found (seq returns its best; its
    # seq-sim row is a split that simulates faster), and seq's bound over every convex split
    # when its search proved one.
    convex = [r.cost.objective_ms for r in result.results if r.feasible and r.name in CONVEX_STRATEGIES]
    if seq and seq.feasible and sinfo.get("best_objective_ms") is not None:
        convex.append(float(sinfo["best_objective_ms"]))
    if exact and exact.feasible and einfo.get("bound_space") == "every convex split with one stage per GPU":
        convex.append(exact.cost.objective_ms)
    best_convex = min(convex, default=None)
    convex_bound = sinfo.get("bound_ms") if sinfo.get("bound_covers") == "every convex split" else None
    seq_best = float(sinfo["best_objective_ms"]) if seq and seq.feasible and "best_objective_ms" in sinfo else None
    # Every plan: total work / P (with the last-stage knapsack), exact's MIP bound when its space
    # is every plan (no coarsening), or the configuration LP's (tighten_bounds), the highest.
    every = every_plan_bound(result.results, lb, (result.info.get("configuration_bound") or {}).get("ms"))
    every_bound = every["ms"]
    exact_opt = (exact.cost.objective_ms if exact and exact.feasible and einfo.get("optimal")
                 and einfo.get("bound_space") == "every plan" else None)
    m = mixed.cost.objective_ms if mixed and mixed.feasible else None
    # Mixed-pipe's lowest objective found (the plan it returns; its fastest in simulation is the
    # row mixed-sim), and the simulated period of that plan (the bound bounds that period as well).
    m_best = (float(mixed.plan.info["best_objective_ms"]) if m is not None
              and mixed.plan.info.get("best_objective_ms") is not None else m)
    m_sim = mixed.sim["period_ms"] if m is not None and getattr(mixed, "sim", None) else None
    row = {
        "case": label, "op_nodes": sum(1 for _ in problem.graph.op_nodes()), "lower_bound_ms": lb,
        "seq_ms": seq.cost.objective_ms if seq and seq.feasible else None, "seq_best_ms": seq_best,
        "best_convex_ms": best_convex, "convex_bound_ms": convex_bound,
        "seq_search": sinfo.get("search"),
        # seq's best equals the best convex plan anyone found, and its bound proves it optimal
        # (exact's bound over every plan also bounds the convex splits, a part of that space)
        "convex_optimum_proven": bool(seq_best is not None and seq_best <= max(
            convex_bound or 0.0, every_bound if every_bound > lb else 0.0) * (1 + REL)),
        # seq proved that no convex split fits (its MIP, or its DP on every op node)
        "convex_none_proven": bool(seq and not seq.feasible and seq.proven_infeasible),
        "seq_is_best_convex": bool(seq_best is not None and best_convex is not None
                                   and seq_best <= best_convex * (1 + REL)),
        "mixed_ms": m, "every_plan_bound_ms": every_bound,
        "bound_source": ("configuration LP" if "configuration" in every["covers"] else
                         "exact's MIP" if "exact" in every["covers"] else "total/P (knapsack)"),
        "configuration_bound": result.info.get("configuration_bound"),
        "mixed_over_bound": m / every_bound if m else None,
        "mixed_best_ms": m_best, "mixed_best_over_bound": m_best / every_bound if m_best else None,
        "mixed_simulated_ms": m_sim, "mixed_simulated_over_bound": m_sim / every_bound if m_sim else None,
        "exact_ms": exact.cost.objective_ms if exact and exact.feasible else None,
        "exact_proven_optimum_ms": exact_opt,
        "mixed_over_optimum": m / exact_opt if m and exact_opt else None,
        "chosen": result.chosen, "rows": [r.row() for r in result.results],
        "exact_reason": exact.reason if exact and not exact.feasible else None,
        # some op node alone needs more than a GPU has: no plan of any strategy fits (memory_floor)
        "proven_no_fit": result.info.get("proven_no_fit"),
    }
    row["mixed_goal"] = (None if m is None else bool(row["mixed_over_bound"] <= MIXED_OVER_BOUND
                         or (row["mixed_over_optimum"] is not None and row["mixed_over_optimum"] <= MIXED_OVER_OPTIMUM)))
    row["mixed_best_goal"] = (None if m_best is None else bool(
        m_best / every_bound <= MIXED_OVER_BOUND or (exact_opt is not None and m_best / exact_opt <= MIXED_OVER_OPTIMUM)))
    if result.chosen:
        best = result.best()
        row["chosen_objective_ms"] = best.cost.objective_ms
        row["chosen_simulated_ms"] = best.sim["period_ms"]
        row["chosen_sim_over_objective"] = best.sim["period_ms"] / best.cost.objective_ms
        row["chosen_stages"] = len(best.plan.stages)
        # the in-flight scale the chosen plan was priced at, and its period at the scale tuning started from
        row["chosen_in_flight_scale"] = best.in_flight_scale
        tries = (best.in_flight or {}).get("tries") or []
        if tries and tries[0]["period_ms"] is not None:
            row["chosen_untuned_sim_over_objective"] = tries[0]["period_ms"] / best.cost.objective_ms
        if tied_across_stages(problem, best.plan):
            at = dataclasses.replace(problem, in_flight_scale=best.in_flight_scale or 1)
            row["chosen_untied_sim_over_objective"] = (simulate(untied_problem(at, best.plan), best.plan).period_ms
                                                       / best.cost.objective_ms)
    return row


def run_suite(time_limit: float, jobs: int, models=None, gpus=(3, 6), memory=(None, 1.2, 1.1),
              problems=None) -> list[dict]:
    """Run ``compile_plan(auto)`` on every suite case and print one line each.

    Columns: *seq best* the best objective seq's convex search found (the split it returns);
    *cvx bound* the bound seq proved over every convex split (stages = chains of
    ideals, one per GPU) and *cvx opt* whether seq's best meets it ("opt"), else the gap,
    "none" when seq proved that no convex split fits, and "!" when another convex strategy
    found a better split than seq; *mixed* Mixed-pipe's
    objective (the lowest it found; its fastest plan in simulation is the row mixed-sim, which
    *chosen* may name), *m best* the lowest objective it found, *m sim* its plan's simulated period; *bound* the best bound over every plan (total work / P with the last-stage
    knapsack, exact's MIP bound when higher: "M", or the configuration LP's, sought for up to the
    time limit after the searches, ftcompile.compile.tighten_bounds: "C"); *exact* exact's objective in the mixed
    space ("*" proven optimal); *chosen* compile's choice (best simulated throughput; a less stale row within 1 %, compile.choose), its
    objective (Eq. 1), simulated period, their ratio, *K* the in-flight scale it runs at (K x depth
    + 1 micro-batches in flight per stage, chosen by simulation where a GPU holds several stages;
    ftcompile.inflight) and *K=1* its ratio at scale 1 where K was tuned, and the ratio the same
    plan simulates at with its tied tensors untied (no tied-weight exchange), when its stages
    share one. *chosen*
    "no fit!": no plan of any strategy fits, proven (an op node alone needs more than a GPU has);
    "none": no strategy found a plan, nothing proven.
    """
    rows = []
    print(f"{'case':34}{'ops':>5}{'seq best':>10}{'cvx bound':>10}{'cvx opt':>8}{'mixed':>9}{'m best':>9}"
          f"{'m sim':>9}{'bound':>9}"
          f"{'m/bnd':>7}{'exact':>10}{'m/opt':>7}{'chosen':>10}{'ch obj':>9}{'ch sim':>9}{'sim/obj':>8}"
          f"{'K':>3}{'K=1':>7}{'untied':>7}{'time s':>7}")
    for label, problem in (problems if problems is not None else suite_problems(gpus, memory, models)):
        t0 = time.perf_counter()
        result = compile_plan(problem, "auto", jobs=jobs, time_limit=time_limit)
        tighten_bounds(result, DEFAULT_TIME_LIMIT if time_limit is None else time_limit)
        secs = time.perf_counter() - t0
        row = suite_row(label, problem, result)
        row["seconds"] = round(secs, 1)
        rows.append(row)
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        if row["convex_optimum_proven"]:
            proof = "opt"
        elif row["convex_none_proven"]:
            proof = "none"
        elif row["seq_best_ms"] is not None and row["convex_bound_ms"]:
            proof = f"{1 - row['convex_bound_ms'] / row['seq_best_ms']:.1%}"
        else:
            proof = "-"
        if row["seq_best_ms"] is not None and not row["seq_is_best_convex"]:
            proof += "!"
        exact = f(row["exact_ms"], ".3f") + ("*" if row["exact_proven_optimum_ms"] else "")
        chosen = str(row["chosen"]) if row["chosen"] else ("no fit!" if row["proven_no_fit"] else "none")
        bound = f(row["every_plan_bound_ms"], ".3f") + {"exact's MIP": "M", "configuration LP": "C"}.get(row["bound_source"], "")
        print(f"{label:34}{row['op_nodes']:>5}{f(row['seq_best_ms'], '.3f'):>10}{f(row['convex_bound_ms'], '.3f'):>10}"
              f"{proof:>8}{f(row['mixed_ms'], '.3f'):>9}{f(row['mixed_best_ms'], '.3f'):>9}"
              f"{f(row['mixed_simulated_ms'], '.3f'):>9}{bound:>9}{f(row['mixed_over_bound'], '.3f'):>7}"
              f"{exact:>10}{f(row['mixed_over_optimum'], '.3f'):>7}{chosen:>10}"
              f"{f(row.get('chosen_objective_ms'), '.3f'):>9}{f(row.get('chosen_simulated_ms'), '.3f'):>9}"
              f"{f(row.get('chosen_sim_over_objective'), '.3f'):>8}{f(row.get('chosen_in_flight_scale'), 'd'):>3}"
              f"{f(row.get('chosen_untuned_sim_over_objective'), '.3f'):>7}"
              f"{f(row.get('chosen_untied_sim_over_objective'), '.3f'):>7}{secs:>7.1f}", flush=True)
    return rows


def _gpu_counts(text: str) -> tuple[int, ...]:
    """--suite-gpus: comma-separated GPU counts, each at least 1."""
    try:
        got = tuple(int(g) for g in text.split(","))
    except ValueError:
        got = ()
    if not got or min(got) < 1:
        raise argparse.ArgumentTypeError(f"expected GPU counts of at least 1, comma-separated (e.g. 3,6); got {text!r}")
    return got


def _memory_shares(text: str) -> tuple[float | None, ...]:
    """--suite-memory: comma-separated shares of total/P above 0, or 'free' for unlimited."""
    try:
        got = tuple(None if m == "free" else float(m) for m in text.split(","))
    except ValueError:
        got = ()
    if not got or any(m is not None and not m > 0 for m in got):
        raise argparse.ArgumentTypeError(f"expected memory shares of total/P above 0 or 'free', comma-separated "
                                         f"(e.g. free,1.2,1.1); got {text!r}")
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases (repeatable)")
    ap.add_argument("--all", action="store_true", help="the paper cases and the 5k-node graphs")
    ap.add_argument("--schedule", default="async")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1, help="strategies run in parallel (default 1: each timed alone)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--suite", action="store_true", help="the balance-under-memory suite instead of the paper cases")
    ap.add_argument("--suite-graph", action="append", help="--suite: only this graph (e.g. bert-large-layer, "
                    "skipnet; repeatable)")
    ap.add_argument("--suite-gpus", default=(3, 6), type=_gpu_counts, help="--suite: GPU counts (default 3,6)")
    ap.add_argument("--suite-memory", default=(None, 1.2, 1.1), type=_memory_shares,
                    help="--suite: memory shares of total/P, 'free' for unlimited (default free,1.2,1.1)")
    ap.add_argument("--graph-file", action="append", metavar="FILE.json",
                    help="--suite on a profiled graph in the device-placement JSON format of Tarnawski et al. "
                         "(their public BERT, ResNet-50, InceptionV3 and GNMT training graphs) instead of the zoo "
                         "(repeatable; see benchmarks/placement_graphs.py)")
    ap.add_argument("--graph-weights", type=float, default=0.0, metavar="SHARE",
                    help="--graph-file: this share of each node's size is weights (priced with gradients and "
                         "Adam state), the rest one micro-batch of activations (default 0)")
    ap.add_argument("--graph-optimizer", default="adam", choices=("sgd", "momentum", "adam"),
                    help="--graph-file: the optimizer whose state the weights carry (default adam)")
    ap.add_argument("--graph-no-values", action="store_true",
                    help="--graph-file: values between nodes take 4 bytes (no buffers count), not the file's sizes")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per searching strategy (default 20)")
    args = ap.parse_args(argv)
    if args.graph_file:
        # every file read before any case runs: a bad one is one line, not a traceback halfway
        from placement_graphs import load_problem

        for path in args.graph_file:
            try:
                load_problem(path, 1, weights=args.graph_weights, optimizer=args.graph_optimizer)
            except ValueError as exc:
                ap.error(str(exc))
    if args.suite or args.graph_file:
        gpus, memory = args.suite_gpus, args.suite_memory
        problems = (file_problems(args.graph_file, gpus, memory, args.graph_weights, args.graph_optimizer,
                                  not args.graph_no_values)
                    if args.graph_file else None)
        rows = run_suite(args.time_limit, max(args.jobs, 1), args.suite_graph, gpus, memory, problems)
        if args.json:
            atomic_write_text(args.json, json.dumps(rows, indent=1, default=str))
        return 0
    names = args.case or (list(CASES) if args.all else list(PAPER_CASES))
    results, checks = [], []
    for name in names:
        r = run_case(name, args.schedule, args.micro_batches, args.jobs, args.time_limit)
        results.append(r)
        checks += print_case(r)
        sys.stdout.flush()
    print("\ntargets:")
    for label, ok in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {label}")
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
