"""Elastic freeze training (PipeTransformer): which layers freeze, and the graph and plan of a phase.

Fine-tuning a Transformer, the layers near the input converge first. PipeTransformer (ICML 2021)
freezes a growing prefix of the model's layers while training and spends what that saves:

* **The freeze algorithm** (:func:`frozen_layers`, the paper's Eq. 1). At each check ``T`` the
  frozen prefix grows to ``min(L_f + alpha (L - L_f), argmin_l ||g_l||)`` layers: at most an
  ``alpha`` fraction of the active layers, and no further than the active layer whose gradient
  norm is the smallest (the one that converged most).
* **Frozen layers** (:func:`freeze_graph`). The *layers* are the model's repeated blocks
  (:func:`find_layers`: basic-block classes or module-path prefixes, in call order). Freezing
  ``n`` layers freezes the *frozen region*: every node that runs before the first node of layer
  ``n`` (the embeddings and layers ``0 .. n-1``); its parameters stop requiring gradients unless
  a node after the region also reads them (a tied embedding stays trainable), and its dropout is
  switched off (so a frozen prefix computes a deterministic function, and a cached activation is
  exact). Everything downstream follows from ``requires_grad``: the graph's gradient values
  (:func:`ftcompile.profile.gradient_values`), so a node fed only by frozen parameters and
  inputs is priced forward-only with no saved activations, no gradient and no optimizer state
  by the analytic profile, and its generated stage runs without autograd.
* **AutoPipe and AutoDP** (:func:`replan`): at a freeze event the frozen graph is re-profiled and
  re-partitioned by our own partitioners for every pipeline length ``P`` halving from the
  current one, ``R = G / P`` replicas each, and the micro-batch count re-picked for each ``P``;
  the simulated throughput decides, and ``P`` shrinks only while the plan fits and gains.

The controller that runs phases (saving at a step boundary, generating the next phase's package,
restarting the ranks with the new layout and loading by parameter name) is
:mod:`ftcompile.freeze_run`; the runtime side (gradient norms per layer, the activation cache) is
:mod:`ftcompile.runtime.freeze`, which never imports this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Sequence

from .ir import OpGraph
from .runtime.freeze import FreezeError, frozen_layers as _rt_frozen_layers

#: Dropout-like instructions whose ``train`` argument (position 2) switches them off.
_DROPOUT_TRAIN_ARG = {"aten.dropout.default": ("train", 2), "aten.native_dropout.default": ("train", 2),
                      "aten.feature_dropout.default": ("train", 2),
                      "aten.alpha_dropout.default": ("train", 2),
                      "aten.feature_alpha_dropout.default": ("train", 2),
                      "torch.nn.functional.dropout": ("training", 2),
                      "torch.nn.functional.dropout1d": ("training", 2),
                      "torch.nn.functional.dropout2d": ("training", 2),
                      "torch.nn.functional.dropout3d": ("training", 2),
                      "torch.nn.functional.alpha_dropout": ("training", 2),
                      "torch.nn.functional.feature_alpha_dropout": ("training", 2)}


# --------------------------------------------------------------------------- Eq. 1

#: Eq. 1 lives on the runtime side, so the ranks and the controller share one definition.
frozen_layers = _rt_frozen_layers


def parse_alpha(text: str) -> float:
    """``"1/3"`` or ``"0.33"`` -> a float in (0, 1)."""
    try:
        a = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise FreezeError(f"alpha={text!r} is not a number; give a fraction such as 1/3 or 0.25") from None
    if not 0 < a < 1:
        raise FreezeError(f"alpha={text} must lie strictly between 0 and 1 (the paper uses 1/3)")
    return a


# --------------------------------------------------------------------------- layers

def find_layers(graph: OpGraph, blocks: Sequence[str] | None = None) -> list[str]:
    """The module paths of the model's layers, in the order the model calls them.

    ``blocks`` names the layers: module class names (``BertLayer``, matched against every
    scope's class, qualified or not) or module-path prefixes (``encoder.layer``: each numbered
    child ``encoder.layer.N`` is a layer). By default the graph's basic blocks when it was traced
    with ``--basic-blocks``, else the module class with the most numbered instances
    (``...layer.0``, ``...layer.1``).
    """
    order: dict[str, str] = {}                 # path -> class, first-call order
    for node in graph.nodes:
        for path, cls in node.scopes:
            order.setdefault(path, cls)
    if not blocks:
        blocks = list(graph.basic_blocks)
    if blocks:
        found = []
        for path, cls in order.items():
            short = cls.rsplit(".", 1)[-1]
            for b in blocks:
                if short == b or cls == b or re.fullmatch(re.escape(b.rstrip(".")) + r"\.\d+", path):
                    found.append(path)
                    break
        # a block nested in another block (a layer's sub-layer) is not a layer of its own
        found = [p for p in found if not any(p != q and p.startswith(q + ".") for q in found)]
        if not found:
            raise FreezeError(f"no module of {graph.source.get('model', 'the model')} matches "
                              f"{', '.join(blocks)}; name the repeated block class (e.g. BertLayer) or its "
                              "module path prefix (e.g. encoder.layer)")
        return found
    by_class: dict[str, list[str]] = {}
    for path, cls in order.items():
        if re.search(r"\.\d+$", path):
            by_class.setdefault(cls, []).append(path)
    if not by_class:
        raise FreezeError(f"{graph.source.get('model', 'the model')} has no numbered repeated modules; "
                          "name its layers with --layers (block classes or module path prefixes)")
    best = max(by_class.values(), key=lambda ps: (len(ps), -min(p.count(".") for p in ps)))
    return best


def _in_layer(node_scopes: list, prefix: str) -> bool:
    return any(p == prefix or p.startswith(prefix + ".") for p, _ in node_scopes)


@dataclass(frozen=True)
class FrozenRegion:
    """What freezing ``layers`` leading layers freezes in a graph."""

    layers: int
    nodes: frozenset[int]           # node ids of the frozen region
    params: frozenset[str]          # canonical names of the parameters that stop training
    kept: frozenset[str]            # parameters read in the region that keep training (read after it too)
    boundary: tuple[str, ...]       # values leaving the region (what AutoCache stores)


def frozen_region(graph: OpGraph, layer_paths: Sequence[str], n: int) -> FrozenRegion:
    """The nodes before the first node of layer ``n`` (graph order), and the parameters only they read."""
    L = len(layer_paths)
    if not 0 <= n <= L:
        raise FreezeError(f"cannot freeze {n} of {L} layers; give a count between 0 and {L}")
    if n == 0:
        return FrozenRegion(0, frozenset(), frozenset(), frozenset(), ())
    ops = [node for node in graph.nodes if node.kind == "op"]
    if n < L:
        first = next((node.id for node in ops if _in_layer(node.scopes, layer_paths[n])), None)
        if first is None:
            raise FreezeError(f"layer {layer_paths[n]} runs no operator in the graph")
    else:       # every layer: the region ends after the last node of the last layer
        last = [i for i, node in enumerate(ops) if _in_layer(node.scopes, layer_paths[-1])]
        first = ops[last[-1] + 1].id if last and last[-1] + 1 < len(ops) else None
        if first is None:
            raise FreezeError(f"freezing all {L} layers leaves nothing after them to train")
    ids = [node.id for node in graph.nodes]
    pos = {nid: i for i, nid in enumerate(ids)}
    region = {node.id for node in graph.nodes if node.kind == "op" and pos[node.id] < pos[first]}
    read_in = {p for node in graph.nodes if node.id in region for p in node.params}
    read_after = {p for node in graph.nodes if node.id not in region for p in node.params}
    params = {p for p in read_in - read_after if graph.params[p].kind == "parameter"}
    kept = {p for p in read_in & read_after if graph.params[p].kind == "parameter"}
    boundary = sorted({e.value for e in graph.edges if e.src in region and e.dst not in region})
    return FrozenRegion(n, frozenset(region), frozenset(params), frozenset(kept), tuple(boundary))


def freeze_graph(graph: OpGraph, region: FrozenRegion) -> OpGraph:
    """A copy of ``graph`` whose frozen region trains no parameter and drops nothing out.

    The copy's ``source["freeze"]`` records the frozen layers and the original graph's hash
    (``base_graph_hash``), under which checkpoints of every phase of one run are one model's.
    """
    g = OpGraph.from_json(graph.to_json())
    for name in region.params:
        g.params[name].requires_grad = False
    for node in g.nodes:
        if node.id not in region.nodes:
            continue
        node.instrs = [_no_dropout(ins) for ins in node.instrs]
    base = graph.source.get("freeze", {}).get("base_graph_hash") or graph.content_hash()
    g.source = {**graph.source, "freeze": {"layers": region.layers, "base_graph_hash": base,
                                           "frozen_params": sorted(region.params)}}
    g._index()
    return g


def _no_dropout(ins):
    spec = _DROPOUT_TRAIN_ARG.get(ins.target)
    if spec is None:
        return ins
    kw, pos = spec
    args, kwargs = list(ins.args), dict(ins.kwargs)
    if len(args) > pos:
        args[pos] = False
    else:
        kwargs[kw] = False
    return replace(ins, args=args, kwargs=kwargs)
