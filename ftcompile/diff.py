"""Compare two plans (``ftcompile diff A B``): what moved, and what it changed.

Both sides are plan documents (``plan.json``, or an output directory holding one).
Nodes are matched by id, which is meaningful only when both plans were made for
the same graph (same ``graph_hash``); otherwise only the summaries are compared.
"""

from __future__ import annotations

from collections import Counter


#: ``diff_text`` lists GPUs without a stage in either plan one per line up to this many.
IDLE_GPU_LINES = 16


def _placement(doc: dict) -> dict[int, tuple[int, int]]:
    out = {}
    for s in (doc.get("plan") or {}).get("stages", []):
        for n in s["nodes"]:
            out[int(n)] = (int(s["id"]), int(s["gpu"]))
    return out


def _summary(doc: dict) -> dict:
    cost = doc.get("cost") or {}
    sim = doc.get("simulation") or {}
    return {
        "chosen": doc.get("chosen"), "schedule": doc.get("schedule"),
        "stages": len((doc.get("plan") or {}).get("stages", [])),
        "objective_ms": cost.get("objective_ms"), "efficiency": cost.get("efficiency"),
        "speedup": cost.get("speedup"), "throughput": sim.get("throughput_samples_per_s"),
        "max_memory_bytes": cost.get("max_memory_bytes"),
    }


def diff_plans(a: dict, b: dict, *, max_moves: int = 50) -> dict:
    """A structured difference between plan documents ``a`` and ``b``."""
    sa, sb = _summary(a), _summary(b)
    delta = {}
    for k in ("objective_ms", "efficiency", "speedup", "throughput", "max_memory_bytes", "stages"):
        if sa.get(k) is not None and sb.get(k) is not None:
            delta[k] = sb[k] - sa[k]
    same_graph = a.get("graph_hash") == b.get("graph_hash")
    out = {"a": sa, "b": sb, "delta": delta, "same_graph": same_graph}
    ga = {g["gpu"]: g for g in a.get("gpus", [])}
    gb = {g["gpu"]: g for g in b.get("gpus", [])}
    out["gpus"] = [{
        "gpu": g,
        "load_ms": [ga.get(g, {}).get("load_ms"), gb.get(g, {}).get("load_ms")],
        "memory_bytes": [ga.get(g, {}).get("memory_bytes"), gb.get(g, {}).get("memory_bytes")],
        "utilisation": [ga.get(g, {}).get("utilisation"), gb.get(g, {}).get("utilisation")],
        "stages": [len(ga.get(g, {}).get("stages", [])), len(gb.get(g, {}).get("stages", []))],
    } for g in sorted(set(ga) | set(gb))]
    if not same_graph:
        out["note"] = ("the plans were made for different graphs (model, options or granularity differ); "
                       "node moves are not compared")
        return out
    pa, pb = _placement(a), _placement(b)
    names = {**(a.get("node_names") or {}), **(b.get("node_names") or {})}
    moved_gpu = [(n, pa[n], pb[n]) for n in sorted(pa) if n in pb and pa[n][1] != pb[n][1]]
    matrix = Counter((x[1], y[1]) for _n, x, y in moved_gpu)
    out["nodes"] = len(pa)
    out["moved_between_gpus"] = len(moved_gpu)
    out["moves"] = [{"from_gpu": f, "to_gpu": t, "nodes": c} for (f, t), c in sorted(matrix.items())]
    out["moved_nodes"] = [{"node": n, "name": names.get(str(n)), "from": {"stage": x[0], "gpu": x[1]},
                           "to": {"stage": y[0], "gpu": y[1]}} for n, x, y in moved_gpu[:max_moves]]
    return out


def diff_text(d: dict, label_a: str = "A", label_b: str = "B") -> str:
    """The difference as a readable text table."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"{'':16}{label_a:>18}{label_b:>18}{'delta':>14}"]
    rows = [("strategy", "chosen", "s"), ("stages", "stages", "d"), ("objective ms", "objective_ms", ".3f"),
            ("efficiency", "efficiency", ".1%"), ("speed-up", "speedup", ".2f"),
            ("throughput /s", "throughput", ".2f"), ("max GPU mem GB", "max_memory_bytes", ".2f")]
    for label, key, spec in rows:
        va, vb = d["a"].get(key), d["b"].get(key)
        dv = d["delta"].get(key)
        if key == "max_memory_bytes":
            va, vb, dv = (None if v is None else v / 1e9 for v in (va, vb, dv))
        if spec == "s":
            lines.append(f"{label:16}{str(va):>18}{str(vb):>18}")
        else:
            lines.append(f"{label:16}{f(va, spec):>18}{f(vb, spec):>18}{f(dv, '+' + spec if spec != 'd' else '+d'):>14}")
    lines.append("")
    lines.append(f"{'GPU':>4}{'load ms ' + label_a:>16}{'load ms ' + label_b:>16}"
                 f"{'mem GB ' + label_a:>14}{'mem GB ' + label_b:>14}{'stages':>10}")
    # GPUs without a stage on either side are listed in one line when there are many (10,000 GPUs).
    empty = [g["gpu"] for g in d["gpus"] if not any(g["stages"])]
    fold = len(empty) > IDLE_GPU_LINES
    for g in d["gpus"]:
        if fold and not any(g["stages"]):
            continue
        la, lb = g["load_ms"]
        ma, mb = g["memory_bytes"]
        lines.append(f"{g['gpu']:>4}{f(la, '.3f'):>16}{f(lb, '.3f'):>16}"
                     f"{f(None if ma is None else ma / 1e9, '.2f'):>14}{f(None if mb is None else mb / 1e9, '.2f'):>14}"
                     f"{str(g['stages'][0]) + '/' + str(g['stages'][1]):>10}")
    if fold:
        from .compile import gpu_ranges

        lines.append(f"     {len(empty)} GPUs without a stage in either plan: {gpu_ranges(empty)}")
    lines.append("")
    if "note" in d:
        lines.append(d["note"])
    else:
        lines.append(f"{d['moved_between_gpus']} of {d['nodes']} nodes run on another GPU in {label_b}")
        for m in d["moves"]:
            lines.append(f"  GPU {m['from_gpu']} -> GPU {m['to_gpu']}: {m['nodes']} nodes")
        if d["moved_nodes"]:
            shown = ", ".join(f"{m['name'] or m['node']} ({m['from']['gpu']}->{m['to']['gpu']})"
                              for m in d["moved_nodes"][:12])
            lines.append(f"  e.g. {shown}")
    return "\n".join(lines) + "\n"
