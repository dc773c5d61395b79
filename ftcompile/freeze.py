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
    """The instruction as an eval-mode module runs it: dropout ops keep their place in the order of
    random calls (an eval-mode module still calls ``F.dropout(training=False)``) but do nothing;
    attention gets ``dropout_p = 0`` (what eval-mode attention passes, not a random call at all)."""
    from .codegen import _ATTENTION_DROPOUT, _ATTENTION_OPS

    if ins.target in _ATTENTION_OPS:
        pos, args, kwargs = _ATTENTION_OPS[ins.target], list(ins.args), dict(ins.kwargs)
        if len(args) > pos:
            args[pos] = 0.0
        elif _ATTENTION_DROPOUT in kwargs:
            kwargs[_ATTENTION_DROPOUT] = 0.0
        return replace(ins, args=args, kwargs=kwargs)
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


# --------------------------------------------------------------------------- AutoCache: where it cuts

@dataclass(frozen=True)
class CacheCut:
    """Whether the output of a frozen region can be cached per sample (AutoCache), and as what.

    ``values`` are the tensors leaving the region for the nodes after it, ``shared`` those among
    them that depend on no model input (position tables, causal masks: one copy serves every
    sample). ``reason`` says why the region cannot be cached (None: it can).
    """

    layers: int
    values: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    reason: str | None = None


def _micro_batch_size(graph: OpGraph) -> int:
    """The traced batch size, as code generation reads it."""
    b = (graph.source.get("options") or {}).get("batch_size")
    if b is None:
        for inp in graph.inputs:
            if inp.get("node") is not None:
                meta = graph.node(inp["node"]).outputs.get(inp["value"])
                if meta is not None and meta.tensor is not None and meta.tensor.shape:
                    return int(meta.tensor.shape[0])
        return 1
    return int(b)


def cache_cut(graph: OpGraph, region: FrozenRegion) -> CacheCut:
    """Can the output of ``region`` be cached per sample and be exactly what recomputing gives?

    Only if the region computes a fixed function of each sample: it reads no parameter that keeps
    training (a tied embedding: :attr:`FrozenRegion.kept`), updates no buffer in forward (running
    statistics), draws no random number (its dropout is off; other random operators are not),
    and every value leaving it that depends on the inputs is batched along dim 0, so that row
    ``i`` is sample ``i``'s. (Whether a row depends on the other rows of its micro-batch is
    measured when the run starts: :func:`ftcompile.runtime.cache_measure.measure`.)
    """
    from .codegen import _random_kind, random_keys
    from .runtime.ops import OTHER_RANDOM_KEYS

    n = region.layers
    if not region.nodes:
        return CacheCut(n, reason="nothing is frozen")
    if region.kept:
        p = sorted(region.kept)[0]
        return CacheCut(n, reason=f"the frozen layers read {p}, which keeps training (it is also read after them, "
                                  "e.g. a tied embedding), so their output changes at every step")
    writes = sorted(buf for buf, (nid, _) in graph.buffer_writes().items() if nid in region.nodes)
    if writes:
        return CacheCut(n, reason=f"the frozen layers update buffer {writes[0]} in forward (running statistics), "
                                  "so their output depends on the micro-batches seen before")
    keys = random_keys(graph)
    for node in graph.nodes:
        if node.id in region.nodes:
            for ins in node.instrs:
                if keys.get(ins.name, -1) >= OTHER_RANDOM_KEYS and _random_kind(ins.target, ins.args, ins.kwargs):
                    return CacheCut(n, reason=f"the frozen layers draw random numbers ({ins.target} in "
                                              f"{node.scope or node.name}), so their output is not a function of "
                                              "the sample")
    # values that depend on a model input (node granularity: a node reading one makes all its outputs so)
    dependent: set[str] = set()
    for node in graph.nodes:
        if node.kind == "input" or any(e.value in dependent for e in graph.in_edges(node.id)):
            dependent.update(node.outputs)
    b = _micro_batch_size(graph)
    ops = {node.id for node in graph.op_nodes()}
    values, shared = [], []
    for v in region.boundary:
        meta = graph.node(graph.producer(v)).outputs[v]
        if meta.tensor is None or not any(e.dst in ops and e.dst not in region.nodes
                                          for e in graph.out_edges(graph.producer(v)) if e.value == v):
            continue        # a constant the readers' code holds, or a model output no later node reads
        if v not in dependent:
            shared.append(v)
        elif not meta.tensor.shape or meta.tensor.shape[0] != b:
            return CacheCut(n, reason=f"{v} {list(meta.tensor.shape)} leaves the frozen layers and depends on the "
                                      f"inputs but is not batched along dim 0 (micro-batch size {b}), so it cannot be "
                                      "split into samples")
        values.append(v)
    if not values:
        return CacheCut(n, reason="no tensor leaves the frozen layers for the layers after them")
    return CacheCut(n, tuple(values), tuple(shared))


def split_frozen(graph: OpGraph, plan, regions: Sequence[FrozenRegion]):
    """``plan`` with every stage that mixes frozen levels and active nodes split, on the same GPU.

    ``regions`` are nested frozen regions (fewer layers first). Each part of a stage keeps the
    nodes of one level: inside the first region, inside the next but not the first, ..., outside
    all. Regions are prefixes of the graph's order, so the parts of a stage only feed the later
    parts, and the stage graph stays acyclic. AutoCache skips whole stages (a frozen stage whose
    output is cached does not run for that micro-batch); splitting changes no value computed
    (the same operators, on the same GPU) and no gradient (nothing flows back into a frozen
    region). The stages are renumbered in topological order.
    """
    from .plan import Plan, Stage, ordered

    regions = sorted((r for r in regions if r.nodes), key=lambda r: r.layers)
    if not regions:
        return plan

    def level(nid: int) -> int:
        return next((i for i, r in enumerate(regions) if nid in r.nodes), len(regions))

    stages = []
    for s in plan.stages:
        parts: dict[int, list[int]] = {}
        for nid in s.nodes:
            parts.setdefault(level(nid), []).append(nid)
        for key in sorted(parts):
            stages.append(Stage(len(stages), s.gpu, sorted(parts[key])))
    if len(stages) == len(plan.stages):
        return plan
    info = dict(plan.info)
    info["frozen_split"] = [r.layers for r in regions]
    # (a part that exchanges nothing with the rest joins only a stage of its own level)
    return ordered(Plan(plan.strategy, plan.num_gpus, stages, info), graph,
                   {n: level(n) for s in stages for n in s.nodes})


def stage_levels(plan, regions: Sequence[FrozenRegion]) -> dict[int, int]:
    """Frozen stage id -> the fewest frozen layers whose region holds all its nodes (active stages left out)."""
    out = {}
    for s in plan.stages:
        for r in sorted((r for r in regions if r.nodes), key=lambda r: r.layers):
            if set(s.nodes) <= r.nodes:
                out[s.id] = r.layers
                break
    return out


# --------------------------------------------------------------------------- AutoPipe + AutoDP

@dataclass
class PhasePlan:
    """The layout of one training phase and why it was chosen."""

    frozen: int                     # layers frozen
    pipeline_gpus: int              # P
    replicas: int                   # R
    micro_batches: int              # M per replica
    samples_per_s: float            # simulated, all replicas together
    step_ms: float
    strategy: str | None
    tried: list[dict]               # every (P, R, M, b) priced: feasible, throughput, reason
    graph: OpGraph | None = None    # the frozen graph (traced at micro-batch size b)
    doc: dict | None = None         # its plan document (plan.json)
    cache: dict | None = None       # AutoCache: frozen stage levels and the values cached (see plan_phase)
    micro_batch_size: int | None = None     # b: R x M x b samples per step, fixed over the run

    def row(self) -> dict:
        out = {"frozen_layers": self.frozen, "P": self.pipeline_gpus, "R": self.replicas, "M": self.micro_batches,
               "b": self.micro_batch_size,
               "predicted_samples_per_s": round(self.samples_per_s, 6), "predicted_step_ms": round(self.step_ms, 6),
               "strategy": self.strategy, "tried": self.tried}
        if self.cache is not None:
            out["cache"] = {k: v for k, v in self.cache.items() if k != "stages"}
        return out


def pipeline_lengths(gpus: int, start: int, divisible: int) -> list[int]:
    """AutoPipe's candidates: ``start``, ``start / 2``, ... while ``P`` divides the GPUs and the
    ``R = G / P`` replicas divide ``divisible`` (the step's samples, or its micro-batches where the
    micro-batch size cannot change)."""
    out, P = [], start
    while P >= 1:
        R = gpus // P
        if gpus % P == 0 and divisible % R == 0:
            out.append(P)
        if P % 2:
            break
        P //= 2
    return out


#: PipeTransformer §3.2.3 enumerates M from K to 6K for a K-GPU pipeline.
MICRO_BATCH_RANGE = (1, 6)
#: At most this many micro-batch counts are priced per pipeline length (spread over the range).
MICRO_BATCH_CANDIDATES = 6


def micro_batch_candidates(pipeline_gpus: int, per_replica: int, keep: Sequence[int] = (),
                           limit: int = MICRO_BATCH_CANDIDATES) -> list[int]:
    """The micro-batch counts ``M`` AutoPipe prices for a ``pipeline_gpus``-GPU pipeline whose replica
    trains ``per_replica`` samples a step.

    Every ``M`` dividing ``per_replica`` (micro-batches of ``b = per_replica / M`` samples) with
    ``P <= M <= 6 P`` (PipeTransformer §3.2.3); where none divides, the nearest divisor on each
    side. More than ``limit`` are thinned to ``limit`` spread evenly over the range (its ends kept).
    ``keep`` (the running phase's ``M``, and the ``M`` that keeps its ``b``) are added where they
    divide ``per_replica``. Sorted ascending.
    """
    if per_replica < 1 or pipeline_gpus < 1:
        raise FreezeError(f"cannot split {per_replica} samples among micro-batches of a {pipeline_gpus}-GPU pipeline")
    divisors = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
    lo, hi = MICRO_BATCH_RANGE[0] * pipeline_gpus, MICRO_BATCH_RANGE[1] * pipeline_gpus
    inside = [m for m in divisors if lo <= m <= hi]
    if not inside:
        inside = [max((m for m in divisors if m < lo), default=None), min((m for m in divisors if m > hi), default=None)]
        inside = [m for m in inside if m is not None]
    if len(inside) > limit:
        n = len(inside)
        inside = sorted({inside[round(i * (n - 1) / (limit - 1))] for i in range(limit)})
    return sorted(set(inside) | {m for m in keep if m and per_replica % m == 0})


def same_structure(a: OpGraph, b: OpGraph) -> str | None:
    """None when graphs ``a`` and ``b`` (one model traced at two batch sizes) have the same nodes,
    instructions, module scopes, parameters and edges (shapes aside); else the first difference."""
    def node_sig(n):
        return (n.id, n.name, n.kind, [list(s) for s in n.scopes], [(i.name, i.target) for i in n.instrs],
                sorted(n.params), sorted(n.outputs), n.is_loss)

    if len(a.nodes) != len(b.nodes):
        return f"{len(a.nodes)} against {len(b.nodes)} nodes"
    for x, y in zip(a.nodes, b.nodes):
        if node_sig(x) != node_sig(y):
            return f"node {x.id} is {x.name} ({x.scope or 'top'}) in one and {y.name} ({y.scope or 'top'}) in the other"
    ea = sorted((e.src, e.dst, e.value) for e in a.edges)
    eb = sorted((e.src, e.dst, e.value) for e in b.edges)
    if ea != eb:
        return "their edges differ"
    def param_sig(p):       # a lifted constant may be sized by the batch; weights and buffers may not
        return (p.kind, p.requires_grad, sorted(p.aliases),
                None if p.kind == "constant" else [list(p.meta.shape or ()), p.meta.dtype])

    pa = {k: param_sig(p) for k, p in a.params.items()}
    pb = {k: param_sig(p) for k, p in b.params.items()}
    if pa != pb:
        diff = sorted(set(pa) ^ set(pb)) or sorted(k for k in pa if pa[k] != pb[k])
        return f"parameter {diff[0]} differs"
    return None


class _OtherGraph(FreezeError):
    """The model traces to another graph at this micro-batch size."""


@dataclass
class _AtSize:
    """A phase's frozen graph at one micro-batch size, priced, with its AutoCache cut."""

    b: int
    graph: OpGraph                  # frozen
    profile: object
    levels: list                    # FrozenRegion levels to split stages at (AutoCache)
    cache: dict | None


def _prepare(graph: OpGraph, layer_paths, frozen: int, *, base_hash: str, cached_from: int, split: bool,
             profile_fn, hardware, cluster, optimizer: str) -> _AtSize:
    region = frozen_region(graph, layer_paths, frozen)
    fg = freeze_graph(graph, region)
    fg.source["freeze"]["base_graph_hash"] = base_hash     # one model over every phase, whatever its b
    cut = cache_cut(graph, region) if frozen else None
    levels: list[FrozenRegion] = []
    cache: dict | None = None
    if cut is not None:
        cache = {"layers": frozen, "cached_from": 0, "values": list(cut.values), "shared": list(cut.shared),
                 "refused": cut.reason}
        if cut.reason is None and split:
            levels = [region]
            if 0 < cached_from < frozen:
                prev = frozen_region(graph, layer_paths, cached_from)
                pcut = cache_cut(graph, prev)
                if pcut.reason is None:
                    levels.insert(0, prev)
                    cache.update(cached_from=cached_from, previous_values=list(pcut.values),
                                 previous_shared=list(pcut.shared))
    if profile_fn is None:
        from .hardware import load_hardware
        from .profile import analytic_profile

        hw = hardware or load_hardware(cluster.hardware)
        prof = analytic_profile(fg, hw, optimizer=optimizer)
    else:
        prof = profile_fn(fg)
    return _AtSize(_micro_batch_size(graph), fg, prof, levels, cache)


def plan_phase(graph: OpGraph, layer_paths: Sequence[str], frozen: int, cluster, *,
               global_micro_batches: int | None = None, samples_per_step: int | None = None,
               schedule: str, optimizer: str = "adam", start_pipeline: int | None = None,
               pipeline_gpus: int | None = None, strategies="auto", jobs: int | None = 1, hardware=None,
               recompute=None, profile_fn=None, replicas: int | None = None, cached_from: int = 0,
               split: bool = True, graph_at=None, micro_batches: int | None = None,
               current: tuple[int, int] | None = None, clip_grad_norm: float | None = None,
               on_nonfinite: str = "stop") -> PhasePlan:
    """AutoPipe and AutoDP: the best ``(P, R = G / P, M)`` for ``frozen`` frozen layers.

    What a step trains is fixed over a run: ``samples_per_step`` samples (``S``; or
    ``global_micro_batches`` micro-batches of ``graph``'s traced size ``b0``). A layout of ``R``
    replicas gives each ``S / R`` samples, in ``M`` micro-batches of ``b = S / (R M)``.

    For each pipeline length from ``start_pipeline`` (default: all the cluster's GPUs), halving,
    and for each micro-batch count ``M`` among :func:`micro_batch_candidates` (``P <= M <= 6 P``,
    PipeTransformer §3.2.3, plus the running phase's ``current = (M, b)`` and the ``M`` keeping its
    ``b``), the model's graph at ``b`` (``graph_at(b)``, checked to be ``graph``'s structure;
    cached per ``b``) is frozen (:func:`freeze_graph`), profiled (``profile_fn(graph)``, default:
    analytic on ``hardware`` or the cluster's), partitioned by our strategies and simulated, the
    all-reduce of the trainable weights included; the best simulated samples/s wins (ties: the
    first priced), unless a layout with less stale weights is within :data:`~ftcompile.inflight.GAIN`
    of it (:func:`~ftcompile.compile.fresher_within_gain`: ``async``, ``pipedream``). ``P`` shrinks
    while some ``M`` fits. Without ``graph_at`` only ``b = b0`` is possible (``M = S / (R b0)``).
    ``micro_batches`` forces ``M``; ``pipeline_gpus`` forces ``P`` (a manual schedule);
    ``replicas`` keeps ``R`` fixed (AutoPipe without AutoDP: the GPUs a shorter pipeline frees
    stay idle). Every priced ``(P, R, M, b)`` is in ``PhasePlan.tried``. ``recompute``,
    ``clip_grad_norm`` and ``on_nonfinite`` are the run's settings: each plan is priced for them
    as ``compile`` prices them and the phase's plan records them.

    AutoCache: where the frozen region's output can be cached (:func:`cache_cut`) and ``split``,
    each plan's stages that mix frozen and active nodes are split on their GPU
    (:func:`split_frozen`) at ``frozen`` layers and at ``cached_from`` (the previous phase's
    frozen layers, whose cached outputs the newly frozen layers advance), and the split plan is
    priced and simulated in place of the partitioner's. Plans are made for recomputing the frozen
    forward: a phase starts with samples the cache does not hold, and whether reading beats
    recomputing is measured when it runs. ``PhasePlan.cache`` records the levels of the frozen
    stages and the values cached, or why the region cannot be cached.
    """
    G = cluster.physical_gpus
    b0 = _micro_batch_size(graph)
    if (samples_per_step is None) == (global_micro_batches is None):
        raise FreezeError("plan_phase needs exactly one of samples_per_step and global_micro_batches")
    S = samples_per_step if samples_per_step is not None else global_micro_batches * b0
    if S < 1:
        raise FreezeError(f"a step of {S} samples trains nothing; give a positive batch")
    if micro_batches is not None and micro_batches < 1:
        raise FreezeError(f"micro_batches={micro_batches}: give a positive number of micro-batches per replica")
    base_hash = graph.source.get("freeze", {}).get("base_graph_hash") or graph.content_hash()
    sized: dict[int, _AtSize] = {}

    refused: dict[int, str] = {}

    def at(b: int) -> _AtSize:
        if b in refused:
            raise _OtherGraph(refused[b])
        if b not in sized:
            g = graph
            if b != b0:
                try:
                    g = graph_at(b)
                except Exception as e:  # noqa: BLE001  a model may refuse a batch size: skip it, keep the others
                    refused[b] = (f"the model does not trace at micro-batch size {b} "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
                    raise _OtherGraph(refused[b]) from None
                diff = same_structure(graph, g)
                if diff is not None:
                    # torch.export specializes sizes of 1 (and a model may branch on its batch): another graph
                    # would not carry node ids, cached values or layers across phases
                    raise _OtherGraph(f"the model traced at micro-batch size {b} is not the graph traced at {b0} "
                                      f"({diff}), so its layers and cached activations cannot be carried across")
            sized[b] = _prepare(g, layer_paths, frozen, base_hash=base_hash, cached_from=cached_from, split=split,
                                profile_fn=profile_fn, hardware=hardware, cluster=cluster, optimizer=optimizer)
        return sized[b]

    def counts(P: int, R: int) -> tuple[list[int], str | None]:
        """The micro-batch counts priced for ``P x R``, or why there are none."""
        if S % R:
            return [], f"{S} samples per step do not split among {R} replicas"
        per = S // R
        if micro_batches is not None:
            if per % micro_batches:
                return [], f"{per} samples per replica do not split into {micro_batches} micro-batches"
            if graph_at is None and per // micro_batches != b0:
                return [], (f"{micro_batches} micro-batches of {per} samples are {per // micro_batches} samples "
                            f"each, and the model can only run micro-batches of {b0}")
            return [micro_batches], None
        if graph_at is None:
            if per % b0:
                return [], f"{per} samples per replica do not split into micro-batches of {b0}"
            return [per // b0], None
        keep = []
        if current is not None:
            cm, cb = current
            keep = [cm] + ([per // cb] if cb and per % cb == 0 else [])
        return micro_batch_candidates(P, per, keep), None

    candidates = _pipeline_candidates(G, S, counts, pipeline_gpus=pipeline_gpus, replicas=replicas,
                                      start_pipeline=start_pipeline, forced_m=micro_batches is not None)
    tried: list[dict] = []
    fitting: list[tuple[float, float, object]] = []     # (samples/s, staleness, make) of each that fits
    for P in candidates:
        R = G // P if replicas is None else replicas
        if P * R > G:
            continue
        ms, why = counts(P, R)
        if not ms:
            tried.append({"P": P, "R": R, "feasible": False, "reason": why})
            continue
        fits = False
        for M in ms:
            b = S // (R * M)
            try:
                sz = at(b)
            except _OtherGraph as exc:
                if micro_batches is not None:
                    raise FreezeError(f"{exc}; give another micro-batch count, or keep the micro-batch size "
                                      "(--freeze ...,micro_batches=keep-size)") from None
                tried.append({"P": P, "R": R, "M": M, "b": b, "feasible": False, "reason": str(exc)})
                continue
            row, thr, make = _price_layout(sz, cluster, P, R, M, b, schedule=schedule, recompute=recompute,
                                           strategies=strategies, jobs=jobs, clip_grad_norm=clip_grad_norm,
                                           on_nonfinite=on_nonfinite)
            tried.append(row)
            if make is not None:
                fits = True
                fitting.append((thr, row["staleness_updates"], make))
        if not fits:
            break       # a shorter pipeline holds more per GPU: it will not fit either
    if not fitting:
        raise FreezeError(f"no pipeline of {candidates} GPUs fits the model with {frozen} frozen layers: "
                          + "; ".join(r.get("reason", "") for r in tried))
    # The rule compile's choices follow: the fastest (ties: the first priced, the longer pipeline),
    # unless one with less stale weights is within inflight.GAIN of it (async, pipedream).
    from .compile import fresher_within_gain

    kept, _ = fresher_within_gain(list(range(len(fitting))), lambda i: fitting[i][0], lambda i: fitting[i][1],
                                  tie=lambda i: i)
    return fitting[kept][2](frozen, tried)


def _pipeline_candidates(G: int, S: int, counts, *, pipeline_gpus: int | None, replicas: int | None,
                         start_pipeline: int | None, forced_m: bool) -> list[int]:
    """The pipeline lengths :func:`plan_phase` tries: the forced one (refused with the reason when
    ``counts(P, R)`` has no micro-batch count for it), or ``start_pipeline`` halving (every halving
    with ``replicas`` fixed, else those whose ``R = G / P`` divides the GPUs and the step)."""
    if pipeline_gpus is not None:
        if replicas is not None:
            R = replicas
        else:
            R = G // pipeline_gpus if pipeline_gpus >= 1 and G % pipeline_gpus == 0 else 0
        ms, why = ([], f"{pipeline_gpus} does not divide the {G} GPUs")
        if R and pipeline_gpus * R <= G:
            ms, why = counts(pipeline_gpus, R)
        if not ms:
            raise FreezeError(f"a {pipeline_gpus}-GPU pipeline on {G} GPUs cannot train the step's {S} samples: "
                              + why
                              + f"; choose P among {pipeline_lengths(G, G, S)}"
                              + (" and a micro-batch count dividing the samples per replica" if forced_m else ""))
        return [pipeline_gpus]
    if replicas is None:
        return pipeline_lengths(G, start_pipeline or G, S)
    P, out = start_pipeline or G // replicas, []
    while P >= 1:
        out.append(P)
        if P % 2:
            break
        P //= 2
    return out


def _price_layout(sz: _AtSize, cluster, P: int, R: int, M: int, b: int, *, schedule: str, recompute, strategies,
                  jobs, clip_grad_norm: float | None = None, on_nonfinite: str = "stop"):
    """Partition and simulate ``sz``'s frozen graph as ``P x R`` with ``M`` micro-batches of ``b``.

    Returns the ``tried`` row, the simulated samples/s and, when a plan fits,
    ``make(frozen, tried) -> PhasePlan`` (the plan document is written only for a layout that wins)."""
    from .compile import compile_plan, plan_document
    from .plan import Problem
    from .replicas import ReplicaLayout, replicated_problem

    base = Problem(sz.graph, sz.profile, cluster, schedule=schedule, micro_batches=M, recompute=recompute,
                   clip_grad_norm=clip_grad_norm or None, on_nonfinite=on_nonfinite)
    pb = replicated_problem(base, cluster, ReplicaLayout(P, R))
    result = compile_plan(pb, strategies, jobs=jobs)
    row = {"P": P, "R": R, "M": M, "b": b, "feasible": result.chosen is not None}
    if result.chosen is None:
        row["reason"] = "; ".join(f"{r.name}: {r.reason}" for r in result.results[:3])
        return row, 0.0, None
    chosen = result.best()
    split_note = _split_chosen(pb, chosen, sz.levels) if sz.levels else None
    sim = chosen.sim or {}
    thr = float(sim.get("throughput_samples_per_s", 0.0))
    row.update(samples_per_s=round(thr, 6), strategy=chosen.name,
               staleness_updates=chosen.figures.get("staleness_updates") or 0.0)
    if split_note:
        row["cache_split"] = split_note

    def make(frozen: int, tried: list[dict]) -> PhasePlan:
        phase_cache = None
        if sz.cache is not None:
            phase_cache = dict(sz.cache)
            if sz.levels and split_note is None:
                phase_cache["stages"] = {str(k): v for k, v in sorted(stage_levels(chosen.plan, sz.levels).items())}
            elif sz.levels:
                phase_cache["refused"] = f"its plan split at the frozen layers {split_note}"
        return PhasePlan(frozen, P, R, M, thr, float(sim.get("minibatch_ms", 0.0)), chosen.name, tried, sz.graph,
                         plan_document(result, model=sz.graph.source), phase_cache, b)

    return row, thr, make


def _split_chosen(problem, chosen, levels: Sequence[FrozenRegion]) -> str | None:
    """Replace ``chosen``'s plan by :func:`split_frozen`'s, priced and simulated; or say why not."""
    from .compile import plan_figures
    from .plan import evaluate
    from .simulate import simulate
    from .units import format_bytes

    sp = split_frozen(problem.graph, chosen.plan, levels)
    if sp is chosen.plan:
        return None
    cost = evaluate(problem, sp)
    if not cost.feasible:
        return f"does not fit: {cost.reason}"
    sim = simulate(problem, sp).to_json()
    sim.pop("events", None)
    if not sim["memory_feasible"]:
        g = max(range(sp.num_gpus), key=lambda i: sim["gpu_peak_memory"][i] - sim["gpu_memory_limit"])
        return f"does not fit: GPU {g} peaks at {format_bytes(sim['gpu_peak_memory'][g])} in simulation"
    chosen.plan, chosen.cost, chosen.sim = sp, cost, sim
    chosen.figures = plan_figures(problem, sp, cost)
    return None


def write_phase_package(phase: PhasePlan, built, layer_paths: Sequence[str], out_dir, *,
                        rank_order: str = "pipeline-major", input_ranges: dict | None = None) -> str:
    """Generate the package of ``phase`` into ``out_dir``: its stages, and in its manifest the layout
    ``(P, R)``, the frozen layers and the base graph's hash (so the run's checkpoints load into it).

    ``built`` is the model built at the phase's micro-batch size. ``input_ranges`` (input path ->
    smallest and largest value; default: ``built``'s example inputs') should be the first phase's,
    so that data drawn from the ranges (synthetic, text) is the same samples in every phase."""
    from .codegen import example_input_ranges, generate, write_package
    from .weights import weight_source

    g = phase.graph
    ranges = input_ranges if input_ranges is not None else example_input_ranges(built)
    pkg = generate(g, phase.doc, weight_source(built.model, g), input_ranges=ranges)
    m = pkg.manifest
    m.replicas, m.rank_order = phase.replicas, rank_order
    m.generator["base_graph_hash"] = g.source["freeze"]["base_graph_hash"]
    m.model["freeze"] = {"layers": phase.frozen, "of": len(layer_paths), "paths": list(layer_paths)}
    if phase.cache is not None:
        m.model["freeze"]["cache"] = phase.cache
    write_package(pkg, phase.doc, out_dir)
    return str(out_dir)


# --------------------------------------------------------------------------- AutoCache (pricing)

def cached_profile(graph: OpGraph, prof, region: FrozenRegion, previous: FrozenRegion | None, *,
                   host_bandwidth: float, write: bool = False):
    """AutoCache's price of one pass over the data: ``prof`` (of the frozen graph) as the runtime runs it.

    The nodes of ``previous`` (the prefix frozen before this phase, whose output is cached per
    sample) are skipped: reading their cached boundary costs its bytes per micro-batch over the host
    link (``host_bandwidth`` bytes/s), charged to the nodes that produce it. The newly frozen nodes
    (in ``region``, not in ``previous``) keep their forward: they advance the cache. ``write``: the
    pass also caches ``region``'s boundary (its bytes over the host link, charged to its producers),
    as a phase's first pass does. The read replaces the recomputation only where it is faster (the
    runtime's rule, :func:`ftcompile.runtime.cache_measure.decide`); returns ``(profile, cached)``, with
    ``cached`` False and ``prof`` unchanged where it is not.
    """
    from dataclasses import replace as dc_replace

    def host_ms(values) -> float:
        return sum(graph.node(graph.producer(v)).outputs[v].bytes for v in values) / host_bandwidth * 1e3

    nodes = dict(prof.nodes)
    if previous is not None and previous.nodes:
        read_ms = host_ms(previous.boundary)
        forward_ms = sum(prof.nodes[n].forward_ms for n in previous.nodes if n in prof.nodes)
        if read_ms >= forward_ms:
            return prof, False
        producers = {graph.producer(v) for v in previous.boundary}
        share = read_ms / max(len(producers), 1)
        for n in previous.nodes:
            if n in nodes:
                t = share if n in producers else 0.0
                nodes[n] = dc_replace(nodes[n], forward_ms=t, recompute_ms=t, flops_forward=0.0, bytes_forward=0.0)
    elif not write or host_ms(region.boundary) >= sum(prof.nodes[n].forward_ms for n in region.nodes
                                                      if n in prof.nodes):
        return prof, False      # nothing cached to read, and the cache would not pay: not used
    if write:
        producers = {graph.producer(v) for v in region.boundary}
        share = host_ms(region.boundary) / max(len(producers), 1)
        for n in producers:
            if n in nodes:
                nodes[n] = dc_replace(nodes[n], forward_ms=nodes[n].forward_ms + share)
    return dc_replace(prof, nodes=nodes), True
