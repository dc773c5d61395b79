"""Code generation: a plan becomes a self-contained Python package (FTPipe §5 "Implementation").

:func:`generate` turns an OpGraph and the chosen plan into

* one module per stage (``stage_3.py``): an ``nn.Module`` whose ``forward`` is
  the straight-line code of the stage's graph nodes, variables named after
  module scopes, parameters and buffers under their original dotted names;
* a :class:`~ftcompile.runtime.manifest.Manifest` (stored in ``plan.json``)
  naming each stage's GPU, inputs and outputs, the values that cross stages,
  the loss stage and the tensors shared by several stages;
* each stage's weights, as a safetensors file, or as init recipes for a model
  traced on ``meta``.

:func:`write_package` puts them in a folder with an ``__init__.py``, a README
and a ``SHA256SUMS`` that the runtime's loader checks. The package imports only
``torch`` and :mod:`ftcompile.runtime`.

Random operators (dropout) get a *key*: their position among the graph's random
operators, in the order the original model calls them. Generated code draws
their masks from ``(seed, key)`` (see :mod:`ftcompile.runtime.ops`), so a stage
that recomputes, or runs in another order or process, draws the same masks.
"""

from __future__ import annotations

import keyword
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from . import __version__
from .execute import TORCH_NAMESPACES
from .indices import index_ranges
from .ir import OpGraph, ValueMeta, atomic_write_text, iter_params, iter_refs
from .plan import Plan, stage_depths, stage_graph
from .runtime.atomic import atomic_path
from .runtime.manifest import PACKAGE_VERSION, GraphInput, Manifest, ParamSpec, StageSpec, ValueSpec, call_leaves
from .runtime.ops import OTHER_RANDOM_KEYS
from .runtime.package import CHECKSUMS, PackageError, read_checksums, sha256_file
from .weights import WeightSource


# Names generated code uses itself; values never take them.
_RESERVED = {"self", "seed", "device", "torch", "aten", "rt", "F", "operator", "math", "builtins",
             "importlib"} | set(dir(__builtins__) if isinstance(__builtins__, dict) else dir(__import__("builtins")))

# Random operators the eager model reaches through F.dropout & co.; their keys follow the call order.
_DROPOUT_OPS = {
    "aten.dropout.default": "dropout",
    "aten.native_dropout.default": "native_dropout",
    "aten.feature_dropout.default": "feature_dropout",
    "torch.nn.functional.dropout": "functional_dropout",
}
_SEEDED_DROPOUT_OPS = {"aten.alpha_dropout.default", "aten.feature_alpha_dropout.default",
                       "torch.nn.functional.alpha_dropout", "torch.nn.functional.feature_alpha_dropout",
                       "torch.nn.functional.dropout1d", "torch.nn.functional.dropout2d",
                       "torch.nn.functional.dropout3d"}
_ATTENTION_OPS = {"aten.scaled_dot_product_attention.default": 4,
                  "torch._C._nn.scaled_dot_product_attention": 4,
                  "torch.nn.functional.scaled_dot_product_attention": 4}
_ATTENTION_DROPOUT = "dropout_p"        # the keyword of the dropout probability, when not positional

_INFIX = {"operator.add": "+", "operator.sub": "-", "operator.mul": "*", "operator.truediv": "/",
          "operator.floordiv": "//", "operator.mod": "%", "operator.pow": "**", "operator.matmul": "@"}


class CodegenError(ValueError):
    """The plan cannot be turned into a package; the message says why and what to do."""


# --------------------------------------------------------------------------- analysis

@dataclass
class _Stage:
    id: int
    gpu: int
    depth: int
    nodes: list[int]                        # in graph order
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    literals: dict[str, Any] = field(default_factory=dict)   # literal values from other stages
    params: list[str] = field(default_factory=list)


def _random_kind(target: str, ins_args: list, ins_kwargs: dict) -> str | None:
    """``dropout``-like (keyed in eager call order), ``other`` (keyed apart), or None (deterministic)."""
    if target in _DROPOUT_OPS or target in _SEEDED_DROPOUT_OPS:
        return "dropout"
    if target in _ATTENTION_OPS:
        pos = _ATTENTION_OPS[target]
        p = ins_args[pos] if len(ins_args) > pos else ins_kwargs.get(_ATTENTION_DROPOUT, 0.0)
        return "dropout" if isinstance(p, (int, float)) and p > 0 else None
    parts = target.split(".")
    if len(parts) == 3 and parts[0] == "aten":
        try:
            op = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
        except AttributeError:
            return None
        if torch.Tag.nondeterministic_seeded in op.tags:
            if parts[1] in _RNN_OPS:
                return "other" if _rnn_drops(op, ins_args, ins_kwargs) else None
            return "other"
    if target in ("torch.rand", "torch.randn", "torch.randint", "torch.rand_like", "torch.randn_like",
                  "torch.bernoulli", "torch.randperm", "torch.normal", "torch.multinomial"):
        return "other"
    return None


# Recurrent operators are tagged random because of their dropout between layers, which
# draws only when training with dropout > 0 and more than one layer.
_RNN_OPS = {"lstm", "gru", "rnn_tanh", "rnn_relu"}


def _rnn_drops(op, args: list, kwargs: dict) -> bool:
    values = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            values[a.name] = args[i]
        elif a.name in kwargs:
            values[a.name] = kwargs[a.name]
    p, train, layers = values.get("dropout", 0.0), values.get("train", True), values.get("num_layers", 1)
    if not isinstance(p, (int, float)) or not isinstance(layers, int):
        return True     # not a literal: assume it may draw
    return bool(p > 0 and train is not False and layers > 1)


def random_keys(graph: OpGraph) -> dict[str, int]:
    """Instruction name -> key of every random instruction, in graph order.

    Dropout-like operators are numbered 0, 1, ... in the order the original model
    calls them (the graph's order), which is what
    :func:`ftcompile.runtime.ops.keyed_random_mode` counts on the eager side.
    """
    keys: dict[str, int] = {}
    n_drop = n_other = 0
    for node in graph.nodes:
        for ins in node.instrs:
            kind = _random_kind(ins.target, ins.args, ins.kwargs)
            if kind == "dropout":
                keys[ins.name] = n_drop
                n_drop += 1
            elif kind == "other":
                keys[ins.name] = OTHER_RANDOM_KEYS + n_other
                n_other += 1
    return keys


def requires_grad_values(graph: OpGraph) -> set[str]:
    """Floating values that depend on a trainable parameter: a gradient flows back through them."""
    trainable = {p.name for p in graph.params.values() if p.trainable}
    out: set[str] = set()
    stop = {"aten.detach.default", "aten.lift_fresh_copy.default", "method:detach"}
    for node in graph.nodes:
        for ins in node.instrs:
            if ins.target in stop:
                continue
            if any(r in out for r in iter_refs(ins.args, ins.kwargs)) or \
                    any(p in trainable for p in iter_params(ins.args, ins.kwargs)):
                for v, meta in ins.produced().items():
                    if meta is not None and meta.tensor is not None and meta.tensor.is_floating:
                        out.add(v)
    return out


def _sanitize(text: str) -> str:
    s = re.sub(r"\W", "_", text)
    s = re.sub(r"_+", "_", s).strip("_") or "v"
    if s[0].isdigit():
        s = "v" + s
    if keyword.iskeyword(s) or s in _RESERVED:
        s += "_"
    return s


def _op_short(target: str) -> str:
    if target.startswith("method:"):
        return target[len("method:"):]
    parts = target.split(".")
    if len(parts) == 3 and parts[0] in ("aten", "prims"):
        return parts[1].lstrip("_")
    return parts[-1].lstrip("_")


def value_names(graph: OpGraph) -> dict[str, str]:
    """A readable, unique Python identifier for every value, derived from its module scope.

    ``transformer.h.0.attn.c_attn`` + ``addmm`` gives ``h0_attn_c_attn_addmm``: numbered
    children join their container, and a root module path that every scope shares
    (``transformer``) is dropped.
    """
    from collections import Counter

    scopes = [ins.scope for n in graph.nodes for ins in n.instrs if ins.scope]
    firsts = Counter(s.split(".")[0] for s in scopes)
    # the backbone every layer lives in (GPT-2's "transformer", BERT's "bert") says nothing
    root, count = firsts.most_common(1)[0] if firsts else (None, 0)
    if count < 0.9 * len(scopes) or len({s for s in scopes if s.split(".")[0] == root}) < 2:
        root = None

    def prefix(scope: str) -> str:
        parts = scope.split(".") if scope else []
        if root and parts and parts[0] == root:
            parts = parts[1:]
        merged: list[str] = []
        for p in parts:
            if p.isdigit() and merged:
                merged[-1] += p
            else:
                merged.append(p)
        return "_".join(merged)

    used: set[str] = set()
    names: dict[str, str] = {}

    def claim(value: str, base: str) -> None:
        base = _sanitize(base)
        name, i = base, 1
        while name in used:
            name = f"{base}_{i}"
            i += 1
        used.add(name)
        names[value] = name

    for inp in graph.inputs:
        if inp.get("node") is not None:
            claim(inp["value"], inp["value"])
    for node in graph.nodes:
        for ins in node.instrs:
            pre = prefix(ins.scope)
            base = f"{pre}_{_op_short(ins.target)}" if pre else _op_short(ins.target)
            if ins.unpack:
                for idx, v in sorted(ins.unpack.items()):
                    claim(v, base if idx == 0 else f"{base}_{idx}")
                claim(ins.name, f"{base}_out")
            else:
                claim(ins.name, base)
    return names


def _param_expr(name: str) -> str:
    """``self.transformer.h[0].attn.c_attn.weight`` for ``transformer.h.0.attn.c_attn.weight``."""
    out = "self"
    for part in name.split("."):
        if part.isdigit():
            out += f"[{part}]"
        elif part.isidentifier() and not keyword.iskeyword(part):
            out += f".{part}"
        else:
            out = f"getattr({out}, {part!r})"
    return out


def _stages(graph: OpGraph, plan: Plan) -> list[_Stage]:
    position = {n.id: i for i, n in enumerate(graph.nodes)}
    sg = stage_graph(graph, plan)
    depths = stage_depths(sg)
    stages = [_Stage(s.id, s.gpu, depths.get(s.id, 0), sorted(s.nodes, key=position.__getitem__))
              for s in plan.stages]
    where = plan.stage_of()
    outputs_node = next((n.id for n in graph.nodes if n.kind == "output"), None)
    by_id = {s.id: s for s in stages}
    for st in stages:
        mine = set(st.nodes)
        seen_in: set[str] = set()
        outs: list[str] = []
        params: list[str] = []
        for nid in st.nodes:
            node = graph.node(nid)
            for p in node.params:
                if p not in params:
                    params.append(p)
            for e in graph.in_edges(nid):
                if e.src in mine or e.value in seen_in:
                    continue
                seen_in.add(e.value)
                if not e.meta.is_tensor:
                    st.literals[e.value] = e.meta.literal
                else:
                    st.inputs.append(e.value)
            for v in node.outputs:
                leaves = [e for e in graph.out_edges(nid) if e.value == v]
                if any(e.dst == outputs_node or where.get(e.dst, st.id) != st.id for e in leaves):
                    if node.outputs[v].is_tensor or any(e.dst != outputs_node for e in leaves):
                        outs.append(v)
        st.outputs = outs
        st.params = params
    # graph inputs first (in call order), then values from other stages in production order
    input_order = {inp["value"]: i for i, inp in enumerate(graph.inputs)}
    for st in stages:
        st.inputs.sort(key=lambda v: (0, input_order[v], 0) if v in input_order
                       else (1, position[graph.producer(v)], v))
    del by_id
    return stages


# --------------------------------------------------------------------------- emission

_VIEW_METHODS = {"view", "view_as", "reshape", "transpose", "permute", "expand", "expand_as", "narrow", "select",
                 "squeeze", "unsqueeze", "t", "unflatten", "flatten", "unbind", "split", "chunk", "as_strided",
                 "detach", "__getitem__", "contiguous"}


def _writes_and_views(ins) -> tuple[list[str], dict[str, str]]:
    """Values ``ins`` writes in place, and its results that alias an argument (result -> argument)."""
    args, kwargs, t = ins.args, ins.kwargs, ins.target

    def ref(a) -> str | None:
        return a["ref"] if isinstance(a, dict) and len(a) == 1 and "ref" in a else None

    written: list[str] = []
    views: dict[str, str] = {}
    first = ref(args[0]) if args else None
    parts = t.split(".")
    if len(parts) == 3 and parts[0] == "aten":
        try:
            op = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
        except AttributeError:
            return written, views
        schema = op._schema
        for i, a in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and ref(value):
                written.append(ref(value))
        aliases = {str(sorted(a.alias_info.before_set)): ref(args[i] if i < len(args) else kwargs.get(a.name))
                   for i, a in enumerate(schema.arguments) if a.alias_info is not None}
        for k, r in enumerate(schema.returns):
            if r.alias_info is not None:
                src = aliases.get(str(sorted(r.alias_info.before_set)))
                if src:
                    for v in (ins.unpack.values() if ins.unpack else [ins.name]):
                        views[v] = src
    elif t.startswith("method:"):
        name = t[len("method:"):]
        if name.endswith("_") and not name.startswith("__") and first:
            written.append(first)
        elif name in _VIEW_METHODS and first:
            for v in (ins.unpack.values() if ins.unpack else [ins.name]):
                views[v] = first
    elif t.startswith("operator.i") and first:
        written.append(first)
    elif t in ("operator.getitem", "ftcompile.trace_fx.index") and first:
        views[ins.name] = first
    return written, views

def check_custom_ops(graph: OpGraph) -> None:
    """Refuse a graph calling a custom operator that generated stages could not call: no module on
    the Python path registers it (``graph.source["custom_ops"]``, recorded by the tracer), or
    importing the module recorded for it does not register it in a fresh process (an operator a
    submodule registers when something else imports it). ``compile`` asks before planning."""
    found = graph.source.get("custom_ops") or {}
    for target, module in found.items():
        _check_importable(target, module)
    if found:
        _check_registered_fresh(found)


def _check_importable(target: str, module: str | None) -> None:
    """Refuse a custom operator that no importable module registers (see :func:`check_custom_ops`)."""
    if not module:
        ns, op, _ = target.split(".")
        raise CodegenError(f"the model calls the custom operator {ns}::{op}, which no importable module "
                           "registers (it was defined in the model's own file or at run time), so the "
                           "generated stages, each run in a fresh process, could not call it: define it with "
                           "torch.library in a module on the Python path and import that module in the "
                           "model's file")


#: What a rank does with a custom operator: import its module in a fresh interpreter, then look it up.
_FRESH_CHECK = """
import importlib, json, sys
import torch
missing = {}
for target, module in json.loads(sys.argv[1]).items():
    ns, op, overload = target.split(".")
    try:
        importlib.import_module(module)
        getattr(getattr(getattr(torch.ops, ns), op), overload)
    except Exception as exc:
        missing[target] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
print(json.dumps(missing))
"""


def _check_registered_fresh(found: dict[str, str]) -> None:
    """Import each operator's module in a new interpreter, as a rank would, and look the operator up."""
    import json
    import subprocess
    import sys

    try:
        r = subprocess.run([sys.executable, "-c", _FRESH_CHECK, json.dumps(found)], capture_output=True, text=True,
                           timeout=300)
        missing = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        missing = None
    if missing is None:
        return      # the check itself could not run here: the ranks will say what is missing
    for target, why in missing.items():
        ns, op, _ = target.split(".")
        raise CodegenError(f"the model calls the custom operator {ns}::{op}; the generated stages import "
                           f"{found[target]} for it, but in a fresh process that import does not register it "
                           f"({why}), so the ranks could not call it: make {found[target]} (or a module it "
                           "imports) define the operator when imported")


class _Emitter:
    """Turns one stage's instructions into lines of Python."""

    def __init__(self, graph: OpGraph, stage: _Stage, names: dict[str, str], keys: dict[str, int]):
        self.graph, self.stage, self.names, self.keys = graph, stage, names, keys
        self.imports: set[str] = set()
        self.uses_device = False
        self.uses_operator = False
        self.uses_functional = False
        self.uses_math = False
        self.buffer_updates: list[str] = []

    # ----------------------------------------------------------------- expressions
    def expr(self, tree: Any) -> str:
        if isinstance(tree, list):
            return "[" + ", ".join(self.expr(t) for t in tree) + "]"
        if isinstance(tree, dict):
            if len(tree) == 1:
                if "ref" in tree:
                    v = tree["ref"]
                    if v in self.stage.literals:
                        return self.literal(self.stage.literals[v])
                    return self.names[v]
                if "param" in tree:
                    return _param_expr(tree["param"])
                if "dict" in tree:
                    return "{" + ", ".join(f"{k!r}: {self.expr(v)}" for k, v in tree["dict"].items()) + "}"
            return self.literal(tree)
        return self.literal(tree)

    def literal(self, x: Any) -> str:
        if isinstance(x, dict):
            if "dtype" in x:
                return f"torch.{x['dtype']}"
            if "device" in x:
                self.uses_device = True
                return "device"
            if "layout" in x:
                return f"torch.{x['layout']}"
            if "memory_format" in x:
                return f"torch.{x['memory_format']}"
            if "float" in x:
                return f"float({x['float']!r})"
            if "slice" in x:
                return "slice(" + ", ".join(self.literal(v) for v in x["slice"]) + ")"
            if "dict" in x:
                return "{" + ", ".join(f"{k!r}: {self.literal(v)}" for k, v in x["dict"].items()) + "}"
            raise CodegenError(f"cannot write literal {x!r} as Python")
        if isinstance(x, list):
            return "[" + ", ".join(self.literal(v) for v in x) + "]"
        if isinstance(x, float):
            return repr(x)
        return repr(x)

    def callee(self, target: str) -> str:
        if target.startswith("method:"):
            raise AssertionError("methods are written by call()")
        parts = target.split(".")
        if len(parts) == 3 and parts[0] == "aten":
            return target
        if len(parts) == 3 and parts[0] in TORCH_NAMESPACES:      # aten returned above
            return f"torch.ops.{target}"
        if parts[0] == "operator":
            self.uses_operator = True
            return target
        if target.startswith("torch.nn.functional."):
            self.uses_functional = True
            return "F." + target[len("torch.nn.functional."):]
        if target == "ftcompile.trace_fx.index":
            return "rt.index"
        if target.startswith("ftcompile.runtime.ops.") and len(parts) == 4:
            return "rt." + parts[3]         # the runtime's own twins (index, copy_into)
        if parts[0] == "torch":
            return target
        if parts[0] == "math":
            self.uses_math = True
            return target
        if parts[0] == "builtins":
            return parts[1]
        if parts[0] == "ftcompile":
            raise CodegenError(f"operator {target} belongs to the compiler, which generated code must not "
                               "import; this is a bug in ftcompile's tracer")
        custom = self.graph.source.get("custom_ops") or {}
        if target in custom:
            # A torch.library operator: called through torch.ops, registered by importing its module
            # (compile checked before planning that a fresh process registers it so).
            _check_importable(target, custom[target])
            self.imports.add(custom[target])
            return f"torch.ops.{target}"
        module = ".".join(parts[:-1])
        self.imports.add(module)
        return target

    def call(self, ins) -> str:
        args = list(ins.args)
        kwargs = dict(ins.kwargs)
        t = ins.target
        key = self.keys.get(ins.name)
        rendered_kw = [f"{k}={self.expr(v)}" for k, v in kwargs.items()]
        if key is not None:
            return self._random_call(ins, key)
        if t == "operator.getitem" and len(args) == 2 and not kwargs:
            return f"{self.expr(args[0])}[{self.expr(args[1])}]"
        if t in _INFIX and len(args) == 2 and not kwargs:
            return f"{self.expr(args[0])} {_INFIX[t]} {self.expr(args[1])}"
        if t == "operator.neg" and len(args) == 1:
            return f"-{self.expr(args[0])}"
        if t.startswith("method:"):
            obj, rest = args[0], args[1:]
            inner = ", ".join([self.expr(a) for a in rest] + rendered_kw)
            return f"{self.expr(obj)}.{t[len('method:'):]}({inner})"
        inner = ", ".join([self.expr(a) for a in args] + rendered_kw)
        return f"{self.callee(t)}({inner})"

    def _random_call(self, ins, key: int) -> str:
        t, args, kwargs = ins.target, list(ins.args), dict(ins.kwargs)
        if t in ("aten.dropout.default", "aten.native_dropout.default", "aten.feature_dropout.default"):
            x = self.expr(args[0] if args else kwargs["input"])
            p = self.expr(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
            train = args[2] if len(args) > 2 else kwargs.get("train", True)
            train_s = "self.training" if train in (True, None) else self.expr(train)
            fn = _DROPOUT_OPS[t]
            return f"rt.{fn}({x}, {p}, {train_s}, seed, {key})"
        if t == "torch.nn.functional.dropout":
            x = self.expr(args[0] if args else kwargs["input"])
            p = self.expr(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
            train = args[2] if len(args) > 2 else kwargs.get("training", True)
            train_s = "self.training" if train is True else self.expr(train)
            return f"rt.dropout({x}, {p}, {train_s}, seed, {key})"
        if t in _ATTENTION_OPS:
            pos = _ATTENTION_OPS[t]
            # Dropout only in training, as the model's own attention does.
            if len(args) > pos:
                args[pos] = {"__code__": f"{self.literal(args[pos])} if self.training else 0.0"}
            else:
                kwargs[_ATTENTION_DROPOUT] = {"__code__": f"{self.literal(kwargs[_ATTENTION_DROPOUT])} "
                                                          "if self.training else 0.0"}

        def code(a):
            return a["__code__"] if isinstance(a, dict) and "__code__" in a else self.expr(a)

        parts = [code(a) for a in args] + [f"{k}={code(v)}" for k, v in kwargs.items()]
        if t.startswith("method:"):
            return f"rt.seeded_call(type({parts[0]}).{t[len('method:'):]}, seed, {key}, {', '.join(parts)})"
        return f"rt.seeded_call({self.callee(t)}, seed, {key}, {', '.join(parts)})"

    # ----------------------------------------------------------------- in-place safety
    def inputs_mutated(self, instrs) -> list[str]:
        """Stage inputs that an instruction writes in place, directly or through a view.

        Traced graphs are functional (torch.export functionalizes, the torch.fx
        path rewrites in-place calls), but a graph built by other means may not
        be; a stage must never write into a tensor another stage still reads.
        """
        root: dict[str, str] = {v: v for v in self.stage.inputs}
        hit: list[str] = []
        for _nid, ins in instrs:
            written, view_of = _writes_and_views(ins)
            for v in written:
                r = root.get(v)
                if r is not None and r not in hit:
                    hit.append(r)
            for out, src in view_of.items():
                if src in root:
                    root[out] = root[src]
        return hit

    # ----------------------------------------------------------------- the forward body
    def body(self) -> list[str]:
        graph, st, names = self.graph, self.stage, self.names
        instrs = [(nid, ins) for nid in st.nodes for ins in graph.node(nid).instrs]
        keep = set(st.outputs)
        # last position at which each value is read, to free it right after (a stage that
        # runs without autograd, as under the async schedule, then holds little at once)
        last: dict[str, int] = {v: -1 for v in st.inputs}
        for i, (_nid, ins) in enumerate(instrs):
            for v in ins.produced():
                last.setdefault(v, i)
            for r in iter_refs(ins.args, ins.kwargs):
                if r in last or r in names:
                    last[r] = i
        dead_after: dict[int, list[str]] = {}
        for v, i in last.items():
            if v not in keep and v not in st.literals:
                dead_after.setdefault(i, []).append(v)

        lines: list[str] = []
        for v in self.inputs_mutated(instrs):
            # Another stage on this process may hold the very same tensor: mutate a copy.
            lines.append(f"{names[v]} = {names[v]}.clone()  # written in place below")
        if -1 in dead_after:   # inputs nothing reads (should not happen)
            lines.append("del " + ", ".join(names[v] for v in sorted(dead_after[-1])))
        scope = None
        current_node = None
        for i, (nid, ins) in enumerate(instrs):
            node = graph.node(nid)
            if nid != current_node and len(node.instrs) > 1:
                lines.append(f"# node {nid}: {node.scope or '<model>'} ({node.scope_class or 'block'})")
                scope = node.scope
            elif ins.scope != scope and len(node.instrs) == 1:
                cls = node.scope_class
                lines.append(f"# {ins.scope or '<model>'}" + (f" ({cls})" if cls else ""))
                scope = ins.scope
            current_node = nid
            rhs = self.call(ins)
            if ins.unpack:
                tmp = names[ins.name]
                lines.append(f"{tmp} = {rhs}")
                for idx, v in sorted(ins.unpack.items()):
                    lines.append(f"{names[v]} = {tmp}[{idx}]")
                lines.append(f"del {tmp}")
            else:
                lines.append(f"{names[ins.name]} = {rhs}")
            for v, buf in sorted(ins.writes.items()):
                # the buffer's new content (running statistics); a recomputation passes False
                lines.append("if update_buffers:")
                owner, _, leaf = buf.rpartition(".")
                lines.append(f"    rt.update_buffer({_param_expr(owner) if owner else 'self'}, {leaf!r}, {names[v]})")
                self.buffer_updates.append(buf)
            dead = [names[v] for v in dead_after.get(i, []) if v in names]
            if dead:
                lines.append("del " + ", ".join(sorted(dead)))
        if self.uses_device:
            lines.insert(0, "device = self._anchor.device")
        return lines


# --------------------------------------------------------------------------- the package

@dataclass
class GeneratedPackage:
    """Everything :func:`write_package` writes: sources by file name, weights by stage, the manifest."""

    manifest: Manifest
    sources: dict[str, str]                         # relative path -> text
    weights: dict[int, dict[str, torch.Tensor]]     # stage id -> canonical name -> tensor


def _jinja():
    from importlib.resources import files

    import jinja2

    folder = files("ftcompile.codegen_templates")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(folder)), trim_blocks=True,
                              lstrip_blocks=True, keep_trailing_newline=True,
                              undefined=jinja2.StrictUndefined)


def _shape_str(spec: ValueSpec) -> str:
    if spec.shape is None:
        return f"literal {spec.literal!r}"
    return f"{spec.dtype}[{', '.join(str(s) for s in spec.shape)}]"


def _scope_span(graph: OpGraph, nodes: list[int]) -> str:
    scopes = [graph.node(n).scope for n in nodes if graph.node(n).scope]
    if not scopes:
        return "the model's top level"
    first, last = scopes[0], scopes[-1]
    return first if first == last else f"{first} .. {last}"


def generate(graph: OpGraph, doc: dict, weights: WeightSource, *, name: str | None = None,
             input_ranges: dict[str, tuple[float, float]] | None = None) -> GeneratedPackage:
    """Generate the package for the plan in ``doc`` (a ``plan.json`` document from ``ftcompile compile``).

    ``weights`` gives the tensors' values (real tensors) or init recipes (a model
    traced on ``meta``). ``input_ranges`` (input path -> smallest and largest example
    value) tells the runtime's synthetic data which token ids and labels are valid.
    Raises :class:`CodegenError` when the plan does not fit the
    graph or a value cannot cross a stage boundary.
    """
    if not doc.get("plan"):
        raise CodegenError("plan.json holds no plan (no strategy found one that fits); nothing to generate")
    if doc.get("graph_hash") and doc["graph_hash"] != graph.content_hash():
        raise CodegenError("the graph is not the one the plan was made for (graph hash differs); "
                           "re-run `ftcompile compile`")
    plan = Plan.from_json(doc["plan"])
    stages = _stages(graph, plan)
    names = value_names(graph)
    keys = random_keys(graph)
    grads = requires_grad_values(graph)
    env = _jinja()
    options = (graph.source.get("options") or {})
    model_name = graph.source.get("model") or "model"
    pkg_name = name or _sanitize(str(model_name).replace("-", "_").split("/")[-1].split(":")[0])
    costs = {int(s["id"]): s for s in doc.get("stages", [])}

    # ---- values crossing stages, graph inputs and outputs
    stage_of_value: dict[str, int] = {}
    for st in stages:
        for v in st.outputs:
            stage_of_value[v] = st.id
    consumers: dict[str, list[int]] = {}
    for st in stages:
        for v in [*st.inputs, *st.literals]:
            consumers.setdefault(v, []).append(st.id)
    values: dict[str, ValueSpec] = {}

    def meta_of(v: str) -> ValueMeta:
        return graph.node(graph.producer(v)).outputs[v]

    input_values = {i["value"] for i in graph.inputs if i.get("node") is not None}
    for v in sorted(set(stage_of_value) | set(consumers) | set(graph.outputs),
                    key=lambda x: (graph.producer(x) if x in graph._producer else -1, x)):
        if v not in graph._producer:
            continue
        m = meta_of(v)
        if m.tensor is None and v in stage_of_value and any(c != stage_of_value[v] for c in consumers.get(v, [])) \
                and m.literal is None:
            raise CodegenError(f"value {v} crosses from stage {stage_of_value[v]} to another stage but is "
                               "neither a tensor nor a known constant; trace with --basic-blocks so that "
                               "its producer and consumers stay together")
        values[v] = ValueSpec(
            value=v, name=names.get(v, _sanitize(v)),
            shape=tuple(m.tensor.shape) if m.tensor is not None else None,
            dtype=m.tensor.dtype if m.tensor is not None else None,
            literal=None if m.tensor is not None else m.literal,
            requires_grad=v in grads, producer=None if v in input_values else stage_of_value.get(v),
            consumers=tuple(sorted(consumers.get(v, []))))

    # ---- parameters: which stages hold each
    holders: dict[str, list[int]] = {}
    for st in stages:
        for p in st.params:
            holders.setdefault(p, []).append(st.id)
    params: dict[str, ParamSpec] = {}
    for pname, hs in holders.items():
        info = graph.params[pname]
        params[pname] = ParamSpec(
            name=pname, kind=info.kind, shape=tuple(info.meta.shape), dtype=info.meta.dtype,
            trainable=info.trainable, aliases=tuple(info.aliases), holders=tuple(hs),
            init=None if weights.stored else weights.recipe(info),
            persistent=info.persistent or info.kind != "buffer")

    # ---- buffers forward updates: one stage must own each, or copies would drift apart
    for buf, (nid, _v) in graph.buffer_writes().items():
        if len(holders.get(buf, [])) > 1:
            writer = plan.stage_of().get(nid)
            others = [h for h in holders[buf] if h != writer]
            raise CodegenError(
                f"buffer {buf} is updated in forward by stage {writer} ({graph.node(nid).scope or 'the model'}) but "
                f"also read by stage{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}, whose copy would "
                "never see the update; keep its module whole with --basic-blocks "
                f"{graph.node(nid).scope_class or 'CLASS'} so that one stage holds it")

    # ---- stage sources
    sources: dict[str, str] = {}
    specs: list[StageSpec] = []
    stage_weights: dict[int, dict[str, torch.Tensor]] = {}
    imports: set[str] = set()
    template = env.get_template("stage.py.j2")
    loss_stage = None
    for st in stages:
        em = _Emitter(graph, st, names, keys)
        body = em.body()
        imports |= em.imports
        module = f"stage_{st.id}"
        cls = f"Stage{st.id}"
        n_random = sum(1 for nid in st.nodes for ins in graph.node(nid).instrs if ins.name in keys)
        computes_loss = graph.loss is not None and graph.loss in st.outputs
        if computes_loss:
            loss_stage = st.id
        cost = costs.get(st.id, {})
        decls = []
        for p in st.params:
            info = graph.params[p]
            dtype = f"torch.{info.meta.dtype}"
            shape = tuple(info.meta.shape)
            if info.kind == "parameter":
                extra = "" if info.requires_grad else ", requires_grad=False"
                decls.append(f"rt.declare(self, {p!r}, {shape!r}, {dtype}{extra})")
            else:
                decls.append(f"rt.declare(self, {p!r}, {shape!r}, {dtype}, kind={info.kind!r})")
            if info.aliases:
                decls[-1] += f"  # tied: also {', '.join(info.aliases)}"
            if len(holders[p]) > 1:
                others = [h for h in holders[p] if h != st.id]
                decls[-1] += f"  # shared with stage{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"

        def rows(vs: Iterable[str], inbound: bool) -> list[str]:
            out = []
            for v in vs:
                spec = values[v]
                if inbound:
                    where = (f"from stage {spec.producer}" if spec.producer is not None
                             else f"model input {next(i['path'] for i in graph.inputs if i['value'] == v)}")
                else:
                    to = [c for c in spec.consumers if c != st.id]
                    where = ", ".join(filter(None, [
                        f"to stage{'s' if len(to) > 1 else ''} {', '.join(map(str, to))}" if to else "",
                        "the loss" if v == graph.loss else ("a model output" if v in graph.outputs else "")]))
                grad = "  (gradient flows back)" if spec.requires_grad and not inbound else ""
                out.append(f"{spec.name:<32} {_shape_str(spec):<24} {where}{grad}")
            return out

        numel = sum(graph.params[p].numel for p in st.params if graph.params[p].kind == "parameter")
        text = template.render(
            version=__version__, model=model_name, stage=st, num_stages=len(stages), cls=cls,
            span=_scope_span(graph, st.nodes), n_nodes=len(st.nodes),
            forward_ms=cost.get("forward_ms"), backward_ms=cost.get("backward_ms"),
            profile=doc.get("profile", {}), strategy=doc.get("chosen"),
            inputs_doc=rows(st.inputs, True), outputs_doc=rows(st.outputs, False),
            literal_doc=[f"{names.get(v, v)} = {lit!r} (a constant from stage {stage_of_value.get(v, '?')})"
                         for v, lit in st.literals.items()],
            n_params=sum(1 for p in st.params if graph.params[p].kind == "parameter"), numel=numel,
            imports=sorted(em.imports), uses_operator=em.uses_operator, uses_functional=em.uses_functional,
            uses_math=em.uses_math,
            inputs=[names[v] for v in st.inputs], outputs=[names[v] for v in st.outputs],
            input_values_repr=repr(tuple(st.inputs)), output_values_repr=repr(tuple(st.outputs)), random=n_random,
            buffer_updates_repr=repr(tuple(em.buffer_updates)), declarations=decls, body=body)
        sources[f"{module}.py"] = text
        specs.append(StageSpec(
            id=st.id, gpu=st.gpu, depth=st.depth, module=module, cls=cls,
            weights=f"weights/{module}.safetensors" if weights.stored else None,
            inputs=tuple(st.inputs), outputs=tuple(st.outputs), params=tuple(st.params), nodes=tuple(st.nodes),
            computes_loss=computes_loss, random_ops=n_random, mutates_buffers=bool(em.buffer_updates),
            forward_ms=cost.get("forward_ms"), backward_ms=cost.get("backward_ms")))
        if weights.stored:
            stage_weights[st.id] = {p: weights.value(graph.params[p]) for p in st.params}

    indexed = index_ranges(graph)
    inputs = []
    for inp in graph.inputs:
        if inp.get("node") is None:
            inputs.append(GraphInput(value=inp["value"], path=inp["path"], shape=None, dtype=None,
                                     constant=inp.get("constant")))
            continue
        m = graph.node(inp["node"]).outputs[inp["value"]]
        lo, hi = (input_ranges or {}).get(inp["path"], (None, None))
        inputs.append(GraphInput(value=inp["value"], path=inp["path"],
                                 shape=tuple(m.tensor.shape) if m.tensor else None,
                                 dtype=m.tensor.dtype if m.tensor else None,
                                 consumers=tuple(sorted(consumers.get(inp["value"], []))), low=lo, high=hi,
                                 index_ranges=tuple(indexed.get(inp["value"], ()))))
    batch = options.get("batch_size")
    if batch is None:
        first = next((i for i in inputs if i.shape), None)
        batch = first.shape[0] if first and first.shape else 1
    manifest = Manifest(
        name=pkg_name, model={"name": model_name, "options": options, "granularity": graph.granularity,
                              "basic_blocks": list(graph.basic_blocks)},
        micro_batch_size=int(batch), dtype=_package_dtype(graph, options), num_gpus=plan.num_gpus,
        schedule=doc.get("schedule", "async"), micro_batches=int(doc.get("micro_batches", 4)),
        recompute=doc.get("recompute"), optimizer=(doc.get("profile") or {}).get("optimizer", "adam"),
        weight_prediction=bool(doc.get("weight_prediction")), clip_grad_norm=doc.get("clip_grad_norm"),
        on_nonfinite=doc.get("on_nonfinite") or "stop", tied_lag=bool(doc.get("tied_lag", True)),
        in_flight_scale=doc.get("in_flight_scale", 1),
        stages=specs, values=values, params=params, inputs=inputs, outputs=list(graph.outputs),
        loss=graph.loss, loss_stage=loss_stage, random_ops=len(keys),
        dropout_ops=sum(1 for k in keys.values() if k < OTHER_RANDOM_KEYS),
        weights="stored" if weights.stored else "init", imports=sorted(imports),
        generator={"ftcompile": __version__, "graph_hash": graph.content_hash(), "strategy": doc.get("chosen"),
                   "schedule": doc.get("schedule")},
        replicas=int((doc.get("layout") or {}).get("replicas") or 1),
        rank_order=str((doc.get("replicas") or {}).get("order") or "pipeline-major"))
    manifest.check()
    sources["__init__.py"] = env.get_template("__init__.py.j2").render(
        version=__version__, manifest=manifest, model=model_name, strategy=doc.get("chosen"),
        package_version=PACKAGE_VERSION)
    sources["README.md"] = env.get_template("README.md.j2").render(
        version=__version__, manifest=manifest, model=model_name, doc=doc, values=values,
        stage_rows=[(s, costs.get(s.id, {})) for s in specs], options=options)
    return GeneratedPackage(manifest, sources, stage_weights)


# --------------------------------------------------------------------------- writing

def _previous_files(out: Path) -> set[str]:
    try:
        return set(read_checksums(out))
    except PackageError:        # no earlier package there, or a damaged one: remove nothing
        return set()


def write_package(pkg: GeneratedPackage, doc: dict, out_dir: str | os.PathLike) -> list[str]:
    """Write the package into ``out_dir`` (beside the compiler's plan.json); returns the files written.

    Every file is written to a temporary name and renamed into place, ``SHA256SUMS``
    last: a package interrupted half-way fails its checksums instead of loading.
    Files of an earlier package in ``out_dir`` that the new one lacks are removed;
    nothing else in the folder is touched.
    """
    from safetensors.torch import save_file

    from .plan import save_json

    out = Path(out_dir)
    (out / "weights").mkdir(parents=True, exist_ok=True)
    previous = _previous_files(out)
    written: list[str] = []
    doc = dict(doc)
    doc["package"] = pkg.manifest.to_json()
    save_json(out / "plan.json", doc)
    written.append("plan.json")
    for rel, text in pkg.sources.items():
        atomic_write_text(out / rel, text)
        written.append(rel)
    for sid, tensors in pkg.weights.items():
        rel = f"weights/stage_{sid}.safetensors"
        with atomic_path(out / rel) as tmp:
            save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, tmp,
                      metadata={"format": "pt", "stage": str(sid), "package": pkg.manifest.name})
        written.append(rel)
    for stale in previous - set(written):
        if re.fullmatch(r"stage_\d+\.py|weights/stage_\d+\.safetensors", stale):
            try:
                os.unlink(out / stale)
            except FileNotFoundError:
                pass
    listed = [w for w in written if w != "README.md"]
    sums = "".join(f"{sha256_file(out / rel)}  {rel}\n" for rel in sorted(listed))
    atomic_write_text(out / CHECKSUMS, sums)
    written.append(CHECKSUMS)
    return written


def compile_package(*, built, graph: OpGraph, doc: dict, out_dir: str) -> dict:
    """Generate and write the package for ``doc``'s plan (the ``ftcompile compile`` hook)."""
    from .weights import weight_source

    if built is None:
        built = rebuild_model(graph.source)
    pkg = generate(graph, doc, weight_source(built.model, graph), input_ranges=example_input_ranges(built))
    files = write_package(pkg, doc, out_dir)
    return {"path": out_dir, "stages": len(pkg.manifest.stages), "weights": pkg.manifest.weights,
            "files": files}


def example_input_ranges(built) -> dict[str, tuple[float, float]]:
    """Each example input's smallest and largest value, by its path in the call (``args[0]``...)."""
    try:
        args, kwargs = built.make_inputs("cpu")
    except Exception:  # noqa: BLE001 - a user's make_inputs may not exist or fail: ranges are a nicety
        args, kwargs = built.args, built.kwargs
    out = {}
    for path, leaf in call_leaves(args, kwargs):
        if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta" or leaf.numel() == 0:
            continue
        out[path] = (float(leaf.min().item()), float(leaf.max().item()))
    return out


# Least precise first: a package of several dtypes is verified at its coarsest's tolerance.
_BY_PRECISION = ("bfloat16", "float16", "float32", "float64")


def _package_dtype(graph: OpGraph, options: dict) -> str:
    """The dtype the package is named by: ``--dtype``'s, else (a user model as its function built
    it, perhaps a bfloat16 base with float32 adapters) the least precise floating dtype among its
    parameters, float32 where it has none."""
    if options.get("dtype"):
        return str(options["dtype"])
    have = {p.meta.dtype for p in graph.params.values() if p.kind == "parameter"}
    return next((d for d in _BY_PRECISION if d in have), "float32")


def rebuild_model(source: dict, device: str | None = None):
    """The model a graph was traced from (``graph.source``: name and options), rebuilt for its weights."""
    from dataclasses import fields

    from .models import ModelOptions, build_model

    name = source.get("model")
    if not name:
        raise CodegenError("this graph file does not record which model it was traced from, so its weights "
                           "are unknown; compile the model by name (or file.py:function) instead")
    recorded = source.get("options") or {}
    known = {f.name for f in fields(ModelOptions)}
    opts = {k: v for k, v in recorded.items() if k in known}
    if device is not None:
        opts["device"] = device
    return build_model(name, ModelOptions(**opts))
