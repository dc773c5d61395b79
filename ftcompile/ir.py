"""OpGraph: the operator graph every later step of the compiler reads.

A graph is a DAG of *nodes* in topological order. A node is a basic block
(FTPipe §4 "Tracing execution"): at operator granularity one ATen operator, at
layer granularity a whole module call (``--basic-blocks T5Block``) holding the
sequence of operators inside it. Each node keeps the straight-line
*instructions* it runs, so that the graph can be executed node by node (for
profiling) and turned back into code (for the generated stage modules) without
the original model object.

Values are named. An edge says that value ``value`` produced by node ``src`` is
read by node ``dst``; the value's metadata travels on the edge (shape, dtype and
bytes for tensors, the literal for non-tensor values). Parameters, buffers and
lifted constants are not nodes: a node lists the ones it reads, and the graph
records each tensor once with every name it is known by (tied weights).

Arguments of an instruction are JSON-able trees in which a value is written
``{"ref": name}``, a parameter/buffer/constant ``{"param": name}`` and the few
non-JSON literals (dtypes, devices, layouts, memory formats, non-finite floats)
as tagged objects; see :func:`encode_literal`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from .runtime.atomic import atomic_write_text  # noqa: F401  (re-exported: the compiler's writers use it)

#: Version of the on-disk format; bump on any incompatible change.
OPGRAPH_VERSION = 2     # 2: buffer writes (Instr.writes), explicit stop-gradients and autocast casts
OPGRAPH_FORMAT = "ftcompile.opgraph"


class GraphError(ValueError):
    """A graph file or graph structure is invalid; the message says what and how to fix it."""


# --------------------------------------------------------------------------- metadata

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    """Static description of a tensor value: what crosses a stage boundary."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_floating(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}

    @staticmethod
    def from_json(d: dict) -> "TensorMeta":
        return TensorMeta(tuple(int(s) for s in d["shape"]), str(d["dtype"]))


@dataclass(frozen=True)
class ValueMeta:
    """A value flowing in the graph: a tensor, or a non-tensor literal (int, list, None...)."""

    tensor: TensorMeta | None = None
    literal: Any = None  # encoded with encode_literal when tensor is None

    @property
    def is_tensor(self) -> bool:
        return self.tensor is not None

    @property
    def bytes(self) -> int:
        return self.tensor.bytes if self.tensor is not None else 0

    def to_json(self) -> dict:
        if self.tensor is not None:
            return {"kind": "tensor", **self.tensor.to_json()}
        return {"kind": "literal", "value": self.literal}

    @staticmethod
    def from_json(d: dict) -> "ValueMeta":
        if d["kind"] == "tensor":
            return ValueMeta(tensor=TensorMeta.from_json(d))
        return ValueMeta(literal=d.get("value"))


@dataclass
class ParamInfo:
    """A parameter, buffer or lifted constant, recorded once however many names it has."""

    name: str                       # canonical name (the first the model lists)
    kind: str                       # "parameter" | "buffer" | "constant"
    meta: TensorMeta
    aliases: list[str] = field(default_factory=list)   # other names of the same tensor (tied weights)
    users: list[int] = field(default_factory=list)     # node ids that read it
    requires_grad: bool = True
    persistent: bool = True         # buffers: saved in state_dict
    value: Any = None               # constants only: the (small) tensor's values as nested lists

    @property
    def bytes(self) -> int:
        return self.meta.bytes

    @property
    def numel(self) -> int:
        return self.meta.numel

    @property
    def trainable(self) -> bool:
        return self.kind == "parameter" and self.requires_grad

    def to_json(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, **self.meta.to_json(),
            "aliases": self.aliases, "users": self.users,
            "requires_grad": self.requires_grad, "persistent": self.persistent,
            **({"value": self.value} if self.value is not None else {}),
        }

    @staticmethod
    def from_json(d: dict) -> "ParamInfo":
        return ParamInfo(
            name=d["name"], kind=d["kind"], meta=TensorMeta.from_json(d),
            aliases=list(d.get("aliases", [])), users=[int(u) for u in d.get("users", [])],
            requires_grad=bool(d.get("requires_grad", True)), persistent=bool(d.get("persistent", True)),
            value=d.get("value"),
        )


# --------------------------------------------------------------------------- instructions and nodes

@dataclass
class Instr:
    """One operator call: ``outputs = target(*args, **kwargs)``.

    ``target`` names the callable: ``aten.linear.default`` (an OpOverload under
    ``torch.ops``), or a dotted Python path such as ``operator.getitem``.
    ``out`` is the metadata of the result. For an operator returning a tuple,
    ``unpack`` maps tuple positions to the names of the values taken from it
    (the ``getitem`` nodes of the torch.fx graph are folded in here); ``name``
    then names the tuple itself, which never leaves the instruction.
    """

    name: str
    target: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)
    out: ValueMeta | None = None
    unpack: dict[int, str] = field(default_factory=dict)
    unpack_meta: dict[int, ValueMeta] = field(default_factory=dict)
    scope: str = ""           # module path, "" for the root module
    # Buffer updates: value this instruction makes -> canonical name of the buffer that
    # takes it as its new content after forward (BatchNorm's running statistics). Running
    # the instruction never writes; generated code copies the value when asked to.
    writes: dict[str, str] = field(default_factory=dict)

    def produced(self) -> dict[str, ValueMeta | None]:
        """Names of the values this instruction makes visible, with their metadata."""
        if self.unpack:
            return {n: self.unpack_meta.get(i) for i, n in self.unpack.items()}
        return {self.name: self.out}

    def to_json(self) -> dict:
        d = {"name": self.name, "target": self.target, "args": self.args, "kwargs": self.kwargs,
             "out": self.out.to_json() if self.out is not None else None, "scope": self.scope}
        if self.unpack:
            d["unpack"] = {str(i): n for i, n in self.unpack.items()}
            d["unpack_meta"] = {str(i): m.to_json() for i, m in self.unpack_meta.items()}
        if self.writes:
            d["writes"] = dict(self.writes)
        return d

    @staticmethod
    def from_json(d: dict) -> "Instr":
        return Instr(
            name=d["name"], target=d["target"], args=d.get("args", []), kwargs=d.get("kwargs", {}),
            out=ValueMeta.from_json(d["out"]) if d.get("out") else None,
            unpack={int(i): n for i, n in d.get("unpack", {}).items()},
            unpack_meta={int(i): ValueMeta.from_json(m) for i, m in d.get("unpack_meta", {}).items()},
            scope=d.get("scope", ""), writes={str(k): str(v) for k, v in d.get("writes", {}).items()},
        )


NODE_KINDS = ("input", "op", "output")


@dataclass
class Node:
    """A basic block: the unit the partitioner places.

    ``kind`` is ``input`` (a user input of the model), ``op`` (computation) or
    ``output`` (the model's outputs, a sink). ``scope`` is the innermost module
    path and ``scope_class`` its class name; ``scopes`` keeps the whole module
    stack as ``[path, qualified class]`` pairs, outermost first.
    """

    id: int
    name: str
    kind: str
    instrs: list[Instr] = field(default_factory=list)
    scope: str = ""
    scope_class: str = ""
    scopes: list[list[str]] = field(default_factory=list)
    params: list[str] = field(default_factory=list)     # canonical names of params/buffers/constants read
    outputs: dict[str, ValueMeta] = field(default_factory=dict)  # values visible to other nodes
    is_loss: bool = False

    @property
    def op(self) -> str:
        """The operator (op granularity) or ``block:Class`` (layer granularity)."""
        if self.kind != "op":
            return self.kind
        if len(self.instrs) == 1:
            return self.instrs[0].target
        return f"block:{self.scope_class}"

    @property
    def output_bytes(self) -> int:
        return sum(v.bytes for v in self.outputs.values())

    def to_json(self) -> dict:
        return {
            "id": self.id, "name": self.name, "kind": self.kind, "op": self.op,
            "scope": self.scope, "scope_class": self.scope_class, "scopes": self.scopes,
            "params": self.params, "is_loss": self.is_loss,
            "outputs": {n: m.to_json() for n, m in self.outputs.items()},
            "instrs": [i.to_json() for i in self.instrs],
        }

    @staticmethod
    def from_json(d: dict) -> "Node":
        return Node(
            id=int(d["id"]), name=d["name"], kind=d["kind"],
            instrs=[Instr.from_json(i) for i in d.get("instrs", [])],
            scope=d.get("scope", ""), scope_class=d.get("scope_class", ""),
            scopes=[list(s) for s in d.get("scopes", [])], params=list(d.get("params", [])),
            outputs={n: ValueMeta.from_json(m) for n, m in d.get("outputs", {}).items()},
            is_loss=bool(d.get("is_loss", False)),
        )


@dataclass(frozen=True)
class Edge:
    """Value ``value`` made by node ``src`` and read by node ``dst``."""

    src: int
    dst: int
    value: str
    meta: ValueMeta

    @property
    def bytes(self) -> int:
        return self.meta.bytes

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "value": self.value, "meta": self.meta.to_json()}

    @staticmethod
    def from_json(d: dict) -> "Edge":
        return Edge(int(d["src"]), int(d["dst"]), d["value"], ValueMeta.from_json(d["meta"]))


# --------------------------------------------------------------------------- the graph

@dataclass
class OpGraph:
    """The traced model: nodes in topological order, edges, parameters, and where it came from.

    ``inputs`` lists the user inputs in call order as ``[node id, value name,
    path]`` where path says where the value sits in the call (``args[0]``,
    ``kwargs['input_ids']``). ``outputs`` lists the model's flattened outputs as
    value names; ``loss`` names the loss value (``None`` if the model returns
    none). ``source`` records the model name and options and the tracer used.
    """

    nodes: list[Node]
    edges: list[Edge]
    params: dict[str, ParamInfo]
    inputs: list[dict] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    loss: str | None = None
    granularity: str = "op"
    basic_blocks: list[str] = field(default_factory=list)
    source: dict = field(default_factory=dict)

    # ----------------------------------------------------------------- queries
    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        self._by_id = {n.id: n for n in self.nodes}
        self._in: dict[int, list[Edge]] = {n.id: [] for n in self.nodes}
        self._out: dict[int, list[Edge]] = {n.id: [] for n in self.nodes}
        for e in self.edges:
            if e.src in self._out:
                self._out[e.src].append(e)
            if e.dst in self._in:
                self._in[e.dst].append(e)
        self._producer = {name: n.id for n in self.nodes for name in n.outputs}

    def node(self, node_id: int) -> Node:
        return self._by_id[node_id]

    def in_edges(self, node_id: int) -> list[Edge]:
        return self._in[node_id]

    def out_edges(self, node_id: int) -> list[Edge]:
        return self._out[node_id]

    def producer(self, value: str) -> int:
        """Id of the node that makes ``value``."""
        return self._producer[value]

    def predecessors(self, node_id: int) -> list[int]:
        return sorted({e.src for e in self._in[node_id]})

    def successors(self, node_id: int) -> list[int]:
        return sorted({e.dst for e in self._out[node_id]})

    def op_nodes(self) -> Iterator[Node]:
        return (n for n in self.nodes if n.kind == "op")

    def unique_params(self, kinds: Iterable[str] = ("parameter",)) -> list[ParamInfo]:
        kinds = tuple(kinds)
        return [p for p in self.params.values() if p.kind in kinds]

    def buffer_writes(self) -> dict[str, tuple[int, str]]:
        """Buffers forward updates (running statistics): name -> (node id, value written)."""
        return {buf: (n.id, v) for n in self.nodes for ins in n.instrs for v, buf in ins.writes.items()}

    @property
    def num_parameters(self) -> int:
        """Trainable-parameter count; a tied tensor counts once."""
        return sum(p.numel for p in self.params.values() if p.kind == "parameter")

    @property
    def parameter_bytes(self) -> int:
        return sum(p.bytes for p in self.params.values() if p.kind == "parameter")

    @property
    def activation_bytes(self) -> int:
        """Bytes of all tensor values computed in one forward pass (outputs of op nodes)."""
        return sum(n.output_bytes for n in self.nodes if n.kind == "op")

    def to_networkx(self):
        """A ``networkx.MultiDiGraph`` view: node attributes are the Nodes, edge data the Edges."""
        import networkx as nx

        g = nx.MultiDiGraph()
        for n in self.nodes:
            g.add_node(n.id, node=n)
        for e in self.edges:
            g.add_edge(e.src, e.dst, key=e.value, edge=e, bytes=e.bytes)
        return g

    def summary(self) -> dict:
        """The figures ``ftcompile trace --json`` prints."""
        return {
            "model": self.source.get("model"),
            "granularity": self.granularity,
            "nodes": len(self.nodes),
            "op_nodes": sum(1 for _ in self.op_nodes()),
            "edges": len(self.edges),
            "parameters": self.num_parameters,
            "parameter_bytes": self.parameter_bytes,
            "buffers": sum(1 for p in self.params.values() if p.kind != "parameter"),
            "tied_parameters": sum(1 for p in self.params.values() if p.aliases),
            "buffer_writes": len(self.buffer_writes()),
            "activation_bytes": self.activation_bytes,
            "inputs": [i["path"] for i in self.inputs],
            "loss": self.loss,
            "hash": self.content_hash(),
        }

    # ----------------------------------------------------------------- checking
    def validate(self) -> None:
        """Check that this is a well-formed DAG in topological order; raise GraphError if not."""
        seen_ids: set[int] = set()
        position: dict[int, int] = {}
        for i, n in enumerate(self.nodes):
            if n.kind not in NODE_KINDS:
                raise GraphError(f"node {n.id} ({n.name}) has unknown kind {n.kind!r}")
            if n.id in seen_ids:
                raise GraphError(f"node id {n.id} appears twice")
            seen_ids.add(n.id)
            position[n.id] = i
        producers: dict[str, int] = {}
        for n in self.nodes:
            for v in n.outputs:
                if v in producers:
                    raise GraphError(f"value {v!r} is produced by nodes {producers[v]} and {n.id}")
                producers[v] = n.id
        for e in self.edges:
            if e.src not in position or e.dst not in position:
                raise GraphError(f"edge {e.src}->{e.dst} ({e.value}) names a missing node")
            if position[e.src] >= position[e.dst]:
                raise GraphError(
                    f"edge {e.src}->{e.dst} ({e.value}) goes backwards: the nodes are not in "
                    "topological order or the graph has a cycle")
            if producers.get(e.value) != e.src:
                raise GraphError(f"edge {e.src}->{e.dst} carries {e.value!r}, which node {e.src} does not produce")
        for n in self.nodes:
            for p in n.params:
                if p not in self.params:
                    raise GraphError(f"node {n.id} ({n.name}) reads unknown parameter {p!r}")
            # every value an instruction reads must come from inside the node or over an edge
            local: set[str] = set()
            incoming = {e.value for e in self._in[n.id]}
            for ins in n.instrs:
                for ref in iter_refs(ins.args, ins.kwargs):
                    if ref not in local and ref not in incoming:
                        raise GraphError(f"node {n.id} ({n.name}) reads {ref!r} but no edge brings it")
                local.add(ins.name)
                local.update(ins.unpack.values())
                for v, buf in ins.writes.items():
                    if v not in ins.produced():
                        raise GraphError(f"node {n.id} ({n.name}) writes {v!r} into {buf!r}, but its instruction "
                                         f"{ins.name} does not make {v!r}")
                    info = self.params.get(buf)
                    if info is None or info.kind != "buffer" or buf not in n.params:
                        raise GraphError(f"node {n.id} ({n.name}) writes {buf!r}, which is not a buffer it holds")
        if self.loss is not None and self.loss not in producers:
            raise GraphError(f"loss value {self.loss!r} is not produced by any node")

    # ----------------------------------------------------------------- files
    def to_json(self) -> dict:
        return {
            "format": OPGRAPH_FORMAT,
            "version": OPGRAPH_VERSION,
            "granularity": self.granularity,
            "basic_blocks": self.basic_blocks,
            "source": self.source,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "loss": self.loss,
            "params": [p.to_json() for p in self.params.values()],
            "nodes": [n.to_json() for n in self.nodes],
            "edges": [e.to_json() for e in self.edges],
        }

    @staticmethod
    def from_json(d: dict) -> "OpGraph":
        if not isinstance(d, dict) or d.get("format") != OPGRAPH_FORMAT:
            raise GraphError("not an ftcompile OpGraph file (missing 'format': 'ftcompile.opgraph'); "
                             "create one with `ftcompile trace MODEL -o graph.json`")
        if d.get("version") != OPGRAPH_VERSION:
            raise GraphError(f"OpGraph file has version {d.get('version')!r} but this ftcompile reads "
                             f"version {OPGRAPH_VERSION}; re-run `ftcompile trace` to regenerate it")
        try:
            g = OpGraph(
                nodes=[Node.from_json(n) for n in d["nodes"]],
                edges=[Edge.from_json(e) for e in d["edges"]],
                params={p["name"]: ParamInfo.from_json(p) for p in d["params"]},
                inputs=list(d.get("inputs", [])), outputs=list(d.get("outputs", [])),
                loss=d.get("loss"), granularity=d.get("granularity", "op"),
                basic_blocks=list(d.get("basic_blocks", [])), source=dict(d.get("source", {})),
            )
            g.validate()
        except GraphError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # Malformed content (a list where an object belongs, a number for a shape...)
            # surfaces as whichever error the first bad access raises, in reading or validating.
            raise GraphError(f"OpGraph file is corrupt ({type(exc).__name__}: {exc}); "
                             "re-run `ftcompile trace` to regenerate it") from None
        return g

    def save(self, path: str | os.PathLike) -> None:
        """Write the graph as JSON, atomically (a crash never leaves half a file)."""
        atomic_write_text(path, json.dumps(self.to_json(), separators=(",", ":")))

    @staticmethod
    def load(path: str | os.PathLike) -> "OpGraph":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise GraphError(f"no such OpGraph file: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise GraphError(f"{path} is not valid JSON ({exc}); the file is corrupt or not an "
                             "OpGraph: re-run `ftcompile trace` to regenerate it") from None
        return OpGraph.from_json(data)

    def content_hash(self) -> str:
        """A stable hash of what costs depend on: nodes, edges and parameters (not the source info)."""
        d = self.to_json()
        d.pop("source", None)
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------- helpers

def iter_refs(*trees: Any) -> Iterator[str]:
    """Yield the value names referenced (``{"ref": name}``) anywhere in encoded argument trees."""
    stack = list(trees)
    while stack:
        t = stack.pop()
        if isinstance(t, dict):
            if "ref" in t and len(t) == 1:
                yield t["ref"]
            else:
                stack.extend(t.values())
        elif isinstance(t, (list, tuple)):
            stack.extend(t)


def iter_params(*trees: Any) -> Iterator[str]:
    """Yield the parameter names referenced (``{"param": name}``) in encoded argument trees."""
    stack = list(trees)
    while stack:
        t = stack.pop()
        if isinstance(t, dict):
            if "param" in t and len(t) == 1:
                yield t["param"]
            else:
                stack.extend(t.values())
        elif isinstance(t, (list, tuple)):
            stack.extend(t)


def encode_literal(x: Any) -> Any:
    """Encode a non-tensor Python value into JSON; inverse of :func:`decode_literal`.

    Tuples become lists (ATen accepts lists wherever it takes int[] and similar),
    and dtypes, devices, layouts, memory formats and non-finite floats become
    tagged objects.
    """
    import torch

    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        return {"float": repr(x)}
    if isinstance(x, (list, tuple)):
        return [encode_literal(v) for v in x]
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.layout):
        return {"layout": str(x).removeprefix("torch.")}
    if isinstance(x, torch.memory_format):
        return {"memory_format": str(x).removeprefix("torch.")}
    if isinstance(x, slice):
        return {"slice": [encode_literal(x.start), encode_literal(x.stop), encode_literal(x.step)]}
    if isinstance(x, dict):
        return {"dict": {str(k): encode_literal(v) for k, v in x.items()}}
    raise TypeError(f"cannot encode literal of type {type(x).__name__}: {x!r}")


def decode_literal(x: Any, device: Any = None) -> Any:
    """Decode a literal written by :func:`encode_literal`.

    ``device``, when given, replaces every encoded device, so that a graph traced
    on ``meta`` or ``cpu`` runs on another device.
    """
    import torch

    if isinstance(x, list):
        return [decode_literal(v, device) for v in x]
    if isinstance(x, dict):
        if "float" in x:
            return float(x["float"])
        if "dtype" in x:
            return getattr(torch, x["dtype"])
        if "device" in x:
            return torch.device(device) if device is not None else torch.device(x["device"])
        if "layout" in x:
            return getattr(torch, x["layout"])
        if "memory_format" in x:
            return getattr(torch, x["memory_format"])
        if "slice" in x:
            return slice(*(decode_literal(v, device) for v in x["slice"]))
        if "dict" in x:
            return {k: decode_literal(v, device) for k, v in x["dict"].items()}
        raise ValueError(f"cannot decode {x!r}")
    return x
