"""Run OpGraph instructions on real or meta tensors.

The profiler runs each node alone (FTPipe's host swapping: a node's inputs and
parameters are brought to the device, it runs, its outputs go back to host
memory), and ``ftcompile verify`` runs whole stages; both read instructions
through :func:`run_instrs`.
"""

from __future__ import annotations

import functools
import importlib
import operator
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import torch

from .ir import Instr, decode_literal


#: ``torch.ops`` namespaces of PyTorch's own operators, there in every process that imports torch.
TORCH_NAMESPACES = ("aten", "prims", "quantized", "_c10d_functional")
#: First parts of target names that are Python paths, never operator namespaces.
_PYTHON_ROOTS = ("operator", "torch", "math", "builtins", "ftcompile")


def custom_op(name: str) -> torch._ops.OpOverload | None:
    """The operator that a target name ``ns.op.overload`` names in a namespace outside PyTorch's own
    (registered with ``torch.library``: ``transformers.grouped_mm_fallback.default``, which
    transformers' mixture-of-experts layers call, or ``torchvision.nms.default``), or None when
    no such operator is registered in this process (then the name may be a Python path)."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] in TORCH_NAMESPACES or parts[0] in _PYTHON_ROOTS or name.startswith("method:"):
        return None
    try:
        op = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return None
    return op if isinstance(op, torch._ops.OpOverload) else None


def registering_module(op: torch._ops.OpOverload) -> str | None:
    """The module whose import registers the custom operator ``op`` in a fresh process: where a
    ``torch.library.custom_op`` was defined, else its namespace's package where that imports (a C++
    extension's operators, ``torchvision::nms``, register when it is imported); None when neither."""
    import importlib.machinery

    # torch.library.custom_op's registry: there is no public lookup of an operator's definition.
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(op._schema.name)
    module = getattr(getattr(opdef, "_init_fn", None), "__module__", None) or op.namespace
    # Importable by name from the Python path, not only present in this process: a user's model
    # file is imported under a made-up name (runtime.userfile) that no other process can import.
    try:
        found = importlib.machinery.PathFinder.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    return module if found else None


def import_custom_ops(graph) -> None:
    """Register the custom operators ``graph`` calls in this process (a graph read from a file, in a
    process that did not build the model), importing the modules the tracer recorded for them."""
    for target, module in (graph.source.get("custom_ops") or {}).items():
        if module and custom_op(target) is None:
            importlib.import_module(module)


@functools.lru_cache(maxsize=None)
def resolve_target(name: str) -> Callable:
    """The callable behind an instruction target name (``aten.linear.default``, ``operator.getitem``)."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] in TORCH_NAMESPACES:
        ns, op, overload = parts
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    op = custom_op(name)
    if op is not None:
        return op
    if parts[0] == "operator":
        return getattr(operator, parts[1])
    if name.startswith("method:"):
        method = name[len("method:"):]
        return lambda self, *a, **k: getattr(self, method)(*a, **k)
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        return obj
    raise ValueError(f"cannot resolve operator {name!r}")


def decode_args(tree: Any, env: Mapping[str, Any], params: Mapping[str, Any], device: Any = None) -> Any:
    """Turn an encoded argument tree into call arguments, reading values from ``env`` and ``params``."""
    if isinstance(tree, list):
        return [decode_args(t, env, params, device) for t in tree]
    if isinstance(tree, dict):
        if len(tree) == 1:
            if "ref" in tree:
                return env[tree["ref"]]
            if "param" in tree:
                return params[tree["param"]]
            if "dict" in tree:
                return {k: decode_args(v, env, params, device) for k, v in tree["dict"].items()}
        return decode_literal(tree, device)
    return tree


def run_instr(ins: Instr, env: MutableMapping[str, Any], params: Mapping[str, Any], device: Any = None) -> None:
    """Execute one instruction, storing what it produces in ``env``."""
    fn = resolve_target(ins.target)
    args = decode_args(ins.args, env, params, device)
    kwargs = {k: decode_args(v, env, params, device) for k, v in ins.kwargs.items()}
    out = fn(*args, **kwargs)
    if ins.unpack:
        for idx, name in ins.unpack.items():
            env[name] = out[idx]
    else:
        env[ins.name] = out


def run_instrs(instrs: Sequence[Instr], env: MutableMapping[str, Any], params: Mapping[str, Any],
               device: Any = None) -> MutableMapping[str, Any]:
    """Execute instructions in order; ``env`` holds the inputs on entry and every value made on exit."""
    for ins in instrs:
        run_instr(ins, env, params, device)
    return env
