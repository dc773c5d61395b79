"""Pictures of a simulated pipeline (:func:`ftcompile.simulate.simulate`).

One row per GPU: compute boxes (forward, recomputation, backward) fill the
upper part of the row, labelled with the micro-batch where they are wide enough;
transfers the GPU sends run as a thin strip along the bottom of its row, since
they overlap computation. Idle time stays white. Dashed lines mark the measured
window.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from .runtime.atomic import atomic_path  # noqa: E402
from .simulate import SimResult  # noqa: E402

COLORS = {"F": "#4c72b0", "R": "#dd8452", "B": "#55a868", "U": "#c44e52", "send": "#8c8c8c",
          "allreduce": "#8172b3"}
#: At most this many GPU rows are drawn; with more GPUs, the busiest are shown and the title says so.
MAX_ROWS = 48
NAMES = {"F": "forward", "R": "recompute", "B": "backward", "U": "update", "send": "send",
         "allreduce": "all-reduce across replicas"}


def draw_timeline(result: SimResult, path: str | os.PathLike, *, max_time_ms: float | None = None) -> list[Path]:
    """Draw ``result``'s events to ``<path>.png`` and ``<path>.svg``; return both paths.

    A ``.png``/``.svg`` suffix on ``path`` is dropped first. ``max_time_ms``
    crops the picture (default: the whole run).
    """
    base = Path(path)
    if base.suffix.lower() in (".png", ".svg"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)
    end = max_time_ms or result.makespan_ms or 1.0
    gpus = sorted({e.gpu for e in result.events}) or list(range(min(result.num_gpus, MAX_ROWS)))
    shown_note = ""
    if len(gpus) > MAX_ROWS:
        # Too many rows to read (and matplotlib slows to a crawl): the busiest GPUs, in order.
        busy: dict[int, float] = {}
        for e in result.events:
            if e.kind != "send":
                busy[e.gpu] = busy.get(e.gpu, 0.0) + (e.end - e.start)
        keep = set(sorted(gpus, key=lambda g: -busy.get(g, 0.0))[:MAX_ROWS])
        shown_note = f"; the {MAX_ROWS} busiest of {len(gpus)} GPUs"
        gpus = sorted(keep)
    row = {g: i for i, g in enumerate(gpus)}
    fig, ax = plt.subplots(figsize=(min(40.0, 8.0 + 0.04 * len(result.events) ** 0.5 * 12), 0.9 + 0.7 * len(gpus)))
    compute: dict[str, list] = {k: [] for k in COLORS}
    for e in result.events:
        if e.start >= end or e.gpu not in row:
            continue
        compute[e.kind].append(e)
    for kind, evs in compute.items():
        bars: dict[int, list] = {}
        for e in evs:
            bars.setdefault(row[e.gpu], []).append((e.start, e.end - e.start))
            # Labels only where they fit, so 8 GPUs x 16 micro-batches stays readable.
            if kind not in ("send", "allreduce") and (e.end - e.start) / end > 0.012:
                ax.text((e.start + e.end) / 2, row[e.gpu] - 0.05, f"{e.micro_batch}", ha="center",
                        va="center", fontsize=6, color="white")
        y0, h = {"send": (0.33, 0.12), "allreduce": (-0.47, 0.07)}.get(kind, (-0.4, 0.7))   # y grows downwards
        for r, xs in bars.items():
            ax.broken_barh(xs, (r + y0, h), facecolors=COLORS[kind],
                           edgecolors="none" if kind in ("send", "allreduce") else "white", linewidth=0.4)
    w0, w1 = result.window
    for x in (w0, w1):
        if x <= end:
            ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlim(0, end)
    ax.set_ylim(len(gpus) - 0.5, -0.5)
    ax.set_yticks(range(len(gpus)))
    ax.set_yticklabels([f"GPU {g}" for g in gpus])
    ax.set_xlabel("time (ms)")
    ax.set_title(f"{result.schedule} ({result.strategy}), M={result.micro_batches}: "
                 f"{result.throughput_samples_per_s:.1f} samples/s, {result.period_ms:.3f} ms/micro-batch, "
                 f"bubble {100 * result.bubble_fraction:.1f}%  (dashed: measured window){shown_note}", fontsize=9)
    handles = [Patch(color=c, label=NAMES[k]) for k, c in COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="black", label="idle"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.25 / len(gpus)),
              ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    out = [base.with_suffix(".png"), base.with_suffix(".svg")]
    try:
        with atomic_path(out[0]) as tmp:
            fig.savefig(tmp, dpi=130, format="png")
        with atomic_path(out[1]) as tmp:
            fig.savefig(tmp, format="svg")
    finally:
        plt.close(fig)
    return out
