"""The manifest of a generated package: what the runtime needs to know, and nothing else.

It lives in the package's ``plan.json`` under the key ``"package"`` (the rest of
that file is the compiler's report of how the plan was chosen). Values are named
as in the traced graph; ``name`` is the Python identifier generated code uses.

A value that crosses stages is a :class:`ValueSpec`: a tensor (shape, dtype,
whether a gradient flows back through it) or a literal (a size or flag, which
the consumer's code holds as a constant, so it is never sent). Every stage is a
:class:`StageSpec` naming its module file, class, weights, GPU, the values it
reads in ``forward`` argument order and the values it returns in order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

PACKAGE_FORMAT = "ftcompile.package"
# 2: stage forwards take update_buffers= and write buffers (StageSpec.mutates_buffers);
#    packages of version 1 silently dropped buffer updates and read aliased inputs wrongly.
PACKAGE_VERSION = 2

#: Dtypes that carry gradients (complex too: DeepSeek-V2's rotary embedding crosses stages as complex64).
FLOATING = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "complex32")


def torch_dtype(name: str):
    """The torch dtype a manifest names (``"int64"``; ``"torch.int64"`` is accepted), or None if none is."""
    import torch

    dt = getattr(torch, str(name or "").removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def input_path(keypath) -> str:
    """A pytree key path into ``(args, kwargs)`` as an input's path: ``args[0]``, ``kwargs['input_ids']``."""
    from torch.utils._pytree import keystr

    s = keystr(keypath)  # e.g. "[0][1]" or "[1]['input_ids']"
    if s.startswith("[0]"):
        return "args" + s[3:]
    if s.startswith("[1]"):
        return "kwargs" + s[3:]
    return s


def call_leaves(args: tuple = (), kwargs: dict | None = None) -> list[tuple[str, Any]]:
    """Every leaf of a call's ``(args, kwargs)`` with its input path, in flattening order."""
    from torch.utils._pytree import tree_flatten_with_path

    leaves, _ = tree_flatten_with_path((tuple(args), dict(kwargs or {})))
    return [(input_path(kp), leaf) for kp, leaf in leaves]


class ManifestError(ValueError):
    """The package manifest is missing, of another version, or inconsistent."""


def stage_order(manifest: "Manifest") -> list[int]:
    """Stage ids in an order where every stage comes after the stages it reads from."""
    deps = {s.id: {manifest.values[v].producer for v in s.inputs
                   if manifest.values[v].producer is not None} for s in manifest.stages}
    done: list[int] = []
    ready = sorted(s for s, d in deps.items() if not d)
    remaining = {s: set(d) for s, d in deps.items() if d}
    while ready:
        s = ready.pop(0)
        done.append(s)
        for t in sorted(remaining):
            remaining[t].discard(s)
            if not remaining[t]:
                del remaining[t]
                ready.append(t)
        ready.sort()
    if remaining:
        raise ManifestError(f"the stages form a cycle through {sorted(remaining)}; the manifest is damaged: "
                            "regenerate the package with `ftcompile compile`")
    return done


@dataclass(frozen=True)
class ValueSpec:
    """A value that crosses a stage boundary, enters as a graph input, or leaves as a graph output."""

    value: str                      # name in the traced graph
    name: str                       # identifier in generated code
    shape: tuple[int, ...] | None   # None: a literal
    dtype: str | None
    literal: Any = None
    requires_grad: bool = False     # a gradient flows back through it (floating, depends on weights)
    producer: int | None = None     # stage id; None for a graph input
    consumers: tuple[int, ...] = () # stage ids that read it

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def is_floating(self) -> bool:
        return self.dtype in FLOATING

    @property
    def takes_gradient(self) -> bool:
        """Whether a stage reading this value from another makes it a leaf that collects a gradient
        to send back: a floating (complex included) tensor computed from the weights."""
        return self.is_tensor and self.is_floating and self.requires_grad and self.producer is not None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape or ():
            n *= s
        return n

    def to_json(self) -> dict:
        d: dict[str, Any] = {"value": self.value, "name": self.name, "producer": self.producer,
                             "consumers": list(self.consumers)}
        if self.shape is not None:
            d.update(shape=list(self.shape), dtype=self.dtype, requires_grad=self.requires_grad)
        else:
            d["literal"] = self.literal
        return d

    @staticmethod
    def from_json(d: dict) -> "ValueSpec":
        shape = tuple(int(s) for s in d["shape"]) if "shape" in d else None
        return ValueSpec(value=d["value"], name=d["name"], shape=shape, dtype=d.get("dtype"),
                         literal=d.get("literal"), requires_grad=bool(d.get("requires_grad", False)),
                         producer=d.get("producer"), consumers=tuple(int(c) for c in d.get("consumers", ())))


@dataclass(frozen=True)
class ParamSpec:
    """A parameter, buffer or constant as one stage holds it (tied tensors: one copy per stage)."""

    name: str                       # canonical name, the key in the stage's state_dict
    kind: str                       # parameter | buffer | constant
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    aliases: tuple[str, ...] = ()   # the other names the original model knows it by
    holders: tuple[int, ...] = ()   # every stage holding a copy (more than one: shared)
    init: list | None = None        # recipe when the package stores no weights (see runtime.init)
    persistent: bool = True         # buffers: in the original model's state_dict (False: rotary tables...)

    @property
    def shared(self) -> bool:
        return len(self.holders) > 1

    def to_json(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "shape": list(self.shape), "dtype": self.dtype,
             "trainable": self.trainable, "aliases": list(self.aliases), "holders": list(self.holders)}
        if self.init is not None:
            d["init"] = self.init
        if not self.persistent:
            d["persistent"] = False
        return d

    @staticmethod
    def from_json(d: dict) -> "ParamSpec":
        return ParamSpec(name=d["name"], kind=d["kind"], shape=tuple(int(s) for s in d["shape"]),
                         dtype=d["dtype"], trainable=bool(d["trainable"]), aliases=tuple(d.get("aliases", ())),
                         holders=tuple(int(h) for h in d.get("holders", ())), init=d.get("init"),
                         persistent=bool(d.get("persistent", True)))


@dataclass(frozen=True)
class StageSpec:
    """One generated stage module."""

    id: int
    gpu: int
    depth: int                      # distance in stages to the end of the pipeline
    module: str                     # file stem: stage_3 -> stage_3.py
    cls: str                        # class name in that file
    weights: str | None             # weights file relative to the package, None: created from recipes
    inputs: tuple[str, ...]         # values forward reads, in argument order
    outputs: tuple[str, ...]        # values forward returns, in order
    params: tuple[str, ...]         # canonical names of the tensors it holds
    nodes: tuple[int, ...] = ()     # graph node ids it computes
    computes_loss: bool = False
    random_ops: int = 0
    # forward updates buffers (BatchNorm running statistics); a recomputation must call it
    # with update_buffers=False so that each micro-batch updates them once
    mutates_buffers: bool = False
    forward_ms: float | None = None # the profile's estimate, for comparing with measured times
    backward_ms: float | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "gpu": self.gpu, "depth": self.depth, "module": self.module, "class": self.cls,
                "weights": self.weights, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "params": list(self.params), "nodes": list(self.nodes), "computes_loss": self.computes_loss,
                "random_ops": self.random_ops, "mutates_buffers": self.mutates_buffers,
                "forward_ms": self.forward_ms, "backward_ms": self.backward_ms}

    @staticmethod
    def from_json(d: dict) -> "StageSpec":
        return StageSpec(id=int(d["id"]), gpu=int(d["gpu"]), depth=int(d["depth"]), module=d["module"],
                         cls=d["class"], weights=d.get("weights"), inputs=tuple(d["inputs"]),
                         outputs=tuple(d["outputs"]), params=tuple(d["params"]),
                         nodes=tuple(int(n) for n in d.get("nodes", ())),
                         computes_loss=bool(d.get("computes_loss", False)), random_ops=int(d.get("random_ops", 0)),
                         mutates_buffers=bool(d.get("mutates_buffers", False)),
                         forward_ms=d.get("forward_ms"), backward_ms=d.get("backward_ms"))


@dataclass(frozen=True)
class IndexRange:
    """What the values of one input may be where they reach one indexing operator (an embedding's
    rows, a loss's classes: found by ``ftcompile.indices``, checked on the host by
    ``runtime.data.check_index_ranges``).

    ``limit``: values must lie in ``0 .. limit - 1``, or equal ``ignore`` (a loss's
    ``ignore_index``); ``window``: per dimension of the traced input, the ``[start, stop)`` of the
    positions that reach it (the rest are not read there); ``reads``: what is indexed, in words.
    """

    limit: int
    ignore: int | None
    window: tuple[tuple[int, int], ...]
    reads: str

    def to_json(self) -> dict:
        return {"limit": self.limit, "ignore": self.ignore, "window": [list(w) for w in self.window],
                "reads": self.reads}

    @staticmethod
    def from_json(d: dict) -> "IndexRange":
        return IndexRange(int(d["limit"]), None if d.get("ignore") is None else int(d["ignore"]),
                          tuple((int(a), int(b)) for a, b in d["window"]), str(d.get("reads", "")))


@dataclass(frozen=True)
class GraphInput:
    """A model input: where it sits in the original call and which stages read it."""

    value: str
    path: str                       # args[0], kwargs['labels']
    shape: tuple[int, ...] | None   # None: a constant the trace specialised (e.g. use_cache=False)
    dtype: str | None
    consumers: tuple[int, ...] = ()
    constant: Any = None
    # Smallest and largest value of the example input: synthetic data draws integer
    # inputs (token ids, labels, positions) from this range so they stay valid.
    low: float | None = None
    high: float | None = None
    #: Where its values index a table: the ranges they must lie in (token ids, class labels).
    index_ranges: tuple[IndexRange, ...] = ()

    def to_json(self) -> dict:
        d: dict[str, Any] = {"value": self.value, "path": self.path, "consumers": list(self.consumers)}
        if self.shape is not None:
            d.update(shape=list(self.shape), dtype=self.dtype)
            if self.low is not None:
                d.update(low=self.low, high=self.high)
            if self.index_ranges:
                d["index_ranges"] = [r.to_json() for r in self.index_ranges]
        else:
            d["constant"] = self.constant
        return d

    @staticmethod
    def from_json(d: dict) -> "GraphInput":
        return GraphInput(value=d["value"], path=d["path"],
                          shape=tuple(int(s) for s in d["shape"]) if "shape" in d else None,
                          dtype=d.get("dtype"), consumers=tuple(int(c) for c in d.get("consumers", ())),
                          constant=d.get("constant"), low=d.get("low"), high=d.get("high"),
                          index_ranges=tuple(IndexRange.from_json(r) for r in d.get("index_ranges", ())))


@dataclass
class Manifest:
    """Everything the runtime reads about a package."""

    name: str
    model: dict                     # name and options the model was built with
    micro_batch_size: int           # the traced batch: every stage runs micro-batches of this size
    dtype: str
    num_gpus: int
    schedule: str                   # the schedule the plan was optimised for
    micro_batches: int
    recompute: bool | None
    optimizer: str
    stages: list[StageSpec]
    values: dict[str, ValueSpec]    # every value crossing a boundary, plus graph inputs and outputs
    params: dict[str, ParamSpec]
    inputs: list[GraphInput]
    outputs: list[str]              # the model's flattened outputs, as value names
    loss: str | None
    loss_stage: int | None
    random_ops: int = 0             # random operators in the graph (dropout...), each keyed
    dropout_ops: int = 0            # of which reached through F.dropout & co. (keys 0..n-1, eager call order)
    weights: str = "stored"         # stored: one safetensors file per stage; init: recipes
    imports: list[str] = field(default_factory=list)   # modules generated code imports besides torch
    generator: dict = field(default_factory=dict)      # ftcompile version, graph hash, strategy
    #: The planned data x pipeline layout: ``replicas`` copies of the pipeline over ``num_gpus x replicas``
    #: GPUs, ranks numbered ``pipeline-major`` (replica r holds ranks r*P..r*P+P-1) or ``replica-major``.
    replicas: int = 1
    rank_order: str = "pipeline-major"
    #: Run settings the plan was priced with besides schedule, micro-batches, recomputation and
    #: optimizer: ``ftcompile run`` takes all of them as its defaults, so it runs as planned.
    weight_prediction: bool = False
    clip_grad_norm: float | None = None
    on_nonfinite: str = "stop"
    tied_lag: bool = True
    in_flight_scale: int = 1        # async, pipedream, 2bw: scale * depth + 1 warm-up forwards per stage

    # ----------------------------------------------------------------- queries
    @functools.cached_property
    def order(self) -> list[int]:
        """Stage ids, every stage after the stages it reads from (:func:`stage_order`)."""
        return stage_order(self)

    def stage(self, stage_id: int) -> StageSpec:
        for s in self.stages:
            if s.id == stage_id:
                return s
        raise ManifestError(f"the package has no stage {stage_id}; its stages are "
                            f"{', '.join(str(s.id) for s in self.stages)}")

    def stages_on(self, gpu: int) -> list[StageSpec]:
        return [s for s in self.stages if s.gpu == gpu]

    def shared_params(self) -> dict[str, tuple[int, ...]]:
        """Tensors held by more than one stage (tied weights): name -> holder stage ids."""
        return {n: p.holders for n, p in self.params.items() if p.shared}

    def edges(self) -> list[tuple[int, int, str]]:
        """``(producer stage, consumer stage, value)`` for every tensor sent between stages."""
        out = []
        for v in self.values.values():
            if v.producer is not None and v.is_tensor:
                out.extend((v.producer, c, v.value) for c in v.consumers)
        return out

    # ----------------------------------------------------------------- files
    def to_json(self) -> dict:
        return {
            "format": PACKAGE_FORMAT, "version": PACKAGE_VERSION, "name": self.name, "model": self.model,
            "micro_batch_size": self.micro_batch_size, "dtype": self.dtype, "num_gpus": self.num_gpus,
            "schedule": self.schedule, "micro_batches": self.micro_batches, "recompute": self.recompute,
            "optimizer": self.optimizer, "weights": self.weights, "random_ops": self.random_ops,
            "dropout_ops": self.dropout_ops,
            "loss": self.loss, "loss_stage": self.loss_stage, "outputs": self.outputs,
            "inputs": [i.to_json() for i in self.inputs],
            "stages": [s.to_json() for s in self.stages],
            "values": [v.to_json() for v in self.values.values()],
            "params": [p.to_json() for p in self.params.values()],
            "imports": self.imports, "generator": self.generator,
            "replicas": self.replicas, "rank_order": self.rank_order,
            "weight_prediction": self.weight_prediction, "clip_grad_norm": self.clip_grad_norm,
            "on_nonfinite": self.on_nonfinite, "tied_lag": self.tied_lag, "in_flight_scale": self.in_flight_scale,
        }

    @staticmethod
    def from_json(d: Any, *, where: str = "plan.json") -> "Manifest":
        if not isinstance(d, dict) or d.get("format") != PACKAGE_FORMAT:
            raise ManifestError(f"{where} holds no package manifest (no 'package' section of format "
                                f"{PACKAGE_FORMAT!r}); generate the package with `ftcompile compile ... -o DIR`")
        if d.get("version") != PACKAGE_VERSION:
            raise ManifestError(f"{where}: package format version {d.get('version')!r}, but this runtime reads "
                                f"version {PACKAGE_VERSION}; regenerate the package with this ftcompile")
        try:
            m = Manifest(
                name=d["name"], model=dict(d.get("model") or {}), micro_batch_size=int(d["micro_batch_size"]),
                dtype=d["dtype"], num_gpus=int(d["num_gpus"]), schedule=d["schedule"],
                micro_batches=int(d["micro_batches"]), recompute=d.get("recompute"),
                optimizer=d.get("optimizer", "adam"),
                stages=[StageSpec.from_json(s) for s in d["stages"]],
                values={v["value"]: ValueSpec.from_json(v) for v in d["values"]},
                params={p["name"]: ParamSpec.from_json(p) for p in d["params"]},
                inputs=[GraphInput.from_json(i) for i in d["inputs"]], outputs=list(d["outputs"]),
                loss=d.get("loss"), loss_stage=d.get("loss_stage"), random_ops=int(d.get("random_ops", 0)),
                dropout_ops=int(d.get("dropout_ops", 0)), weights=d.get("weights", "stored"), imports=list(d.get("imports", [])),
                generator=dict(d.get("generator", {})), replicas=int(d.get("replicas", 1)),
                rank_order=str(d.get("rank_order", "pipeline-major")),
                weight_prediction=bool(d.get("weight_prediction", False)),
                clip_grad_norm=None if d.get("clip_grad_norm") is None else float(d["clip_grad_norm"]),
                on_nonfinite=str(d.get("on_nonfinite") or "stop"), tied_lag=bool(d.get("tied_lag", True)),
                in_flight_scale=d.get("in_flight_scale", 1),
            )
            m.check(where)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # A value of the wrong type (a list where a name belongs) fails in the check too.
            raise ManifestError(f"{where}: the package manifest is corrupt ({type(exc).__name__}: {exc}); "
                                "regenerate the package with `ftcompile compile`") from None
        return m

    def check(self, where: str = "plan.json") -> None:
        """Internal consistency: every value read is made somewhere, every tensor a stage holds is listed."""
        ids = [s.id for s in self.stages]
        if len(set(ids)) != len(ids):
            raise ManifestError(f"{where}: stage ids repeat: {ids}")
        if self.on_nonfinite not in ("stop", "skip") or (self.clip_grad_norm is not None and
                                                         not self.clip_grad_norm > 0):
            raise ManifestError(f"{where}: the planned run settings are corrupt (on_nonfinite "
                                f"{self.on_nonfinite!r}, clip_grad_norm {self.clip_grad_norm!r})")
        if isinstance(self.in_flight_scale, bool) or not isinstance(self.in_flight_scale, int) or \
                self.in_flight_scale < 1:
            raise ManifestError(f"{where}: the planned in-flight scale {self.in_flight_scale!r} is not a whole "
                                "number of at least 1; regenerate the package with `ftcompile compile`")
        graph_inputs = {i.value for i in self.inputs}
        for what, spec in [*self.values.items(), *self.params.items()]:
            if getattr(spec, "shape", None) is not None and torch_dtype(spec.dtype) is None:
                raise ManifestError(f"{where}: {what!r} has dtype {spec.dtype!r}, which torch does not know")
        for s in self.stages:
            if not 0 <= s.gpu < self.num_gpus:
                raise ManifestError(f"{where}: stage {s.id} is on GPU {s.gpu}, but the plan has "
                                    f"{self.num_gpus} GPUs")
            for v in s.inputs:
                spec = self.values.get(v)
                if spec is None:
                    raise ManifestError(f"{where}: stage {s.id} reads {v!r}, which no stage or input provides")
                if spec.producer is None and v not in graph_inputs:
                    raise ManifestError(f"{where}: stage {s.id} reads {v!r}, which has no producer")
                if spec.producer is not None and spec.producer not in ids:
                    raise ManifestError(f"{where}: value {v!r} comes from stage {spec.producer}, which does not exist")
            for v in s.outputs:
                if v not in self.values or self.values[v].producer != s.id:
                    raise ManifestError(f"{where}: stage {s.id} returns {v!r}, but the manifest says "
                                        f"another stage makes it")
            for p in s.params:
                if p not in self.params:
                    raise ManifestError(f"{where}: stage {s.id} holds {p!r}, which the manifest does not describe")
                if s.id not in self.params[p].holders:
                    raise ManifestError(f"{where}: stage {s.id} holds {p!r}, but its holders are "
                                        f"{list(self.params[p].holders)}")
            for v in s.inputs:
                spec = self.values[v]
                if spec.producer is not None and spec.is_tensor and s.id not in spec.consumers:
                    raise ManifestError(f"{where}: stage {s.id} reads {v!r}, but its consumers are "
                                        f"{list(spec.consumers)}")
        if self.loss is not None and self.values.get(self.loss, None) is None:
            raise ManifestError(f"{where}: the loss value {self.loss!r} is not described")
        try:
            stage_order(self)
        except ManifestError as exc:
            raise ManifestError(f"{where}: {exc}") from None
