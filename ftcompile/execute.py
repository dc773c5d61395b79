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


@functools.lru_cache(maxsize=None)
def resolve_target(name: str) -> Callable:
    """The callable behind an instruction target name (``aten.linear.default``, ``operator.getitem``)."""
    parts = name.split(".")
    if len(parts) == 3 and hasattr(torch.ops, parts[0]) and parts[0] in ("aten", "prims", "quantized", "_c10d_functional"):
        ns, op, overload = parts
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
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
