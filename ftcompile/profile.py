"""Per-node costs of an OpGraph (FTPipe §4 "Profiling", §4.3).

Two sources stand behind one artifact, :class:`Profile`:

* :func:`analytic_profile` runs every node once on the ``meta`` device under a
  dispatch mode that counts the FLOPs and bytes of each ATen kernel, forward and
  backward, and prices them on a :class:`~ftcompile.hardware.HardwareSpec` with a
  roofline (``max(flops / peak, bytes / bandwidth) + launch overhead``). It needs
  no weights and gives the same numbers on any machine.
* :func:`measured_profile` runs every node for real on a device, timing forward
  and backward (CUDA events on GPU, ``perf_counter`` on CPU; warm-up, repeats,
  median). Weights and activations live in host memory and are moved to the
  device node by node (host swapping), so a model larger than the device still
  profiles.

Both record, per node, the bytes of activations kept for backward (from
autograd's saved-tensor hooks), the memory of the parameters it is first to use
(weights, gradients, optimizer state for the chosen optimizer) and the bytes it
sends to each consumer. A value one node makes and a later node saves (the input
of a GELU, of a matmul) is kept where it is saved: the saver lists it in
:attr:`NodeCost.saved_inputs`, and the first saver in graph order counts its
bytes in :attr:`NodeCost.activation_bytes`, so that a stage boundary between
producer and saver leaves the bytes with the saver's stage.
:func:`held_activation_bytes` gives what a set of nodes (a stage) keeps, each
saved value once, for any cut.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .execute import import_custom_ops, run_instrs
from .hardware import HardwareSpec
from .ir import Node, OpGraph, TensorMeta, atomic_write_text, iter_refs

PROFILE_VERSION = 6     # 2: gradients from the real dataflow, fused attention, no leftovers in measured runs;
#                         3: a saved input's bytes are the saver's (first in graph order), saved inputs listed;
#                         4: CPU profiles price attention and dropout as a CPU runs them (math path, float mask);
#                         5: measured profiles count FLOPs; on a GPU they time the kernels alone (stream held)
#                         6: optimizer state in the parameter's dtype (Adam's moments of a bfloat16 weight: half)
PROFILE_FORMAT = "ftcompile.profile"
OPTIMIZERS = ("sgd", "momentum", "adam", "adafactor")


class ProfileError(ValueError):
    """A profile cannot be made or read; the message says why and what to do."""


# --------------------------------------------------------------------------- artifact

@dataclass
class NodeCost:
    """Costs of one node for one micro-batch."""

    forward_ms: float = 0.0
    backward_ms: float = 0.0
    recompute_ms: float = 0.0
    flops_forward: float = 0.0
    flops_backward: float = 0.0
    bytes_forward: float = 0.0          # memory traffic of the forward kernels
    bytes_backward: float = 0.0
    # Kept from forward to backward: the tensors the node makes and saves, plus the inputs it
    # is the first (in graph order) to save. Additive over nodes; exact for a stage that holds
    # every saver of each saved value (see held_activation_bytes for any stage).
    activation_bytes: int = 0
    saved_inputs: dict[str, int] = field(default_factory=dict)   # input value (made by an op) -> bytes, saved
    first_saved_bytes: int = 0          # the part of activation_bytes that is saved inputs
    param_bytes: int = 0                # parameters this node is first to use
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    output_bytes: dict[int, int] = field(default_factory=dict)   # consumer node id -> bytes sent

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    def to_json(self) -> dict:
        d = asdict(self)
        d["output_bytes"] = {str(k): v for k, v in self.output_bytes.items()}
        return d

    @staticmethod
    def from_json(d: dict) -> "NodeCost":
        d = dict(d)
        d["output_bytes"] = {int(k): int(v) for k, v in d.get("output_bytes", {}).items()}
        return NodeCost(**d)


@dataclass
class ParamCost:
    """Memory one parameter (or buffer) needs on every GPU that hosts a user of it."""

    bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.bytes + self.grad_bytes + self.optimizer_bytes


@dataclass
class Profile:
    """Costs of every node of one graph, for one hardware, dtype, batch size and optimizer."""

    graph_hash: str
    method: str                      # "analytic" | "measured"
    hardware: dict                   # the HardwareSpec (analytic) or the device description (measured)
    dtype: str
    batch_size: int | None
    optimizer: str
    nodes: dict[int, NodeCost]
    params: dict[str, ParamCost]
    info: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return profile_key(self.graph_hash, self.hardware.get("name", "?"), self.dtype, self.batch_size,
                           self.optimizer, self.method)

    def totals(self) -> dict:
        ns = self.nodes.values()
        return {
            "forward_ms": sum(c.forward_ms for c in ns),
            "backward_ms": sum(c.backward_ms for c in ns),
            "recompute_ms": sum(c.recompute_ms for c in ns),
            "flops_forward": sum(c.flops_forward for c in ns),
            "flops_backward": sum(c.flops_backward for c in ns),
            "activation_bytes": sum(c.activation_bytes for c in ns),
            "param_bytes": sum(p.bytes for p in self.params.values()),
            "grad_bytes": sum(p.grad_bytes for p in self.params.values()),
            "optimizer_bytes": sum(p.optimizer_bytes for p in self.params.values()),
        }

    def training_bytes(self) -> int:
        """Weights, gradients and optimizer state of every parameter plus one micro-batch's
        activations of every op node: the whole model's training memory on one device, the
        "total" of the "total / P" memory limits the partition benchmarks and tests state."""
        return sum(c.total for c in self.params.values()) + sum(c.activation_bytes for c in self.nodes.values())

    def summary(self, graph: OpGraph | None = None, top: int = 5) -> dict:
        heavy = sorted(self.nodes.items(), key=lambda kv: -kv[1].compute_ms)[:top]
        return {
            "method": self.method, "hardware": self.hardware.get("name"), "dtype": self.dtype,
            "batch_size": self.batch_size, "optimizer": self.optimizer, "key": self.key,
            **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.totals().items()},
            "heaviest": [{"node": nid, "name": graph.node(nid).name if graph else None,
                          "op": graph.node(nid).op if graph else None,
                          "forward_ms": round(c.forward_ms, 4), "backward_ms": round(c.backward_ms, 4)}
                         for nid, c in heavy],
        }

    def to_json(self) -> dict:
        return {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "graph_hash": self.graph_hash,
            "method": self.method, "hardware": self.hardware, "dtype": self.dtype,
            "batch_size": self.batch_size, "optimizer": self.optimizer, "info": self.info,
            "params": {k: asdict(v) for k, v in self.params.items()},
            "nodes": {str(k): v.to_json() for k, v in self.nodes.items()},
        }

    @staticmethod
    def from_json(d: dict) -> "Profile":
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ProfileError("not an ftcompile profile file; make one with `ftcompile profile MODEL -o profile.json`")
        if d.get("version") != PROFILE_VERSION:
            raise ProfileError(f"profile has version {d.get('version')!r}, this ftcompile reads {PROFILE_VERSION}; "
                               "re-run `ftcompile profile`")
        try:
            return Profile(
                graph_hash=d["graph_hash"], method=d["method"], hardware=d["hardware"], dtype=d["dtype"],
                batch_size=d.get("batch_size"), optimizer=d["optimizer"], info=d.get("info", {}),
                params={k: ParamCost(**v) for k, v in d["params"].items()},
                nodes={int(k): NodeCost.from_json(v) for k, v in d["nodes"].items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"profile file is corrupt ({type(exc).__name__}: {exc}); re-run `ftcompile profile`") from None

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, json.dumps(self.to_json(), separators=(",", ":")))

    @staticmethod
    def load(path: str | os.PathLike) -> "Profile":
        try:
            with open(path, encoding="utf-8") as f:
                return Profile.from_json(json.load(f))
        except FileNotFoundError:
            raise ProfileError(f"no such profile file: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"{path} is not valid JSON ({exc}); re-run `ftcompile profile`") from None

    def check_graph(self, graph: OpGraph) -> None:
        """Refuse a profile made for another graph."""
        if self.graph_hash != graph.content_hash():
            raise ProfileError(f"profile was made for graph {self.graph_hash}, not {graph.content_hash()}; "
                               "re-run `ftcompile profile` on this graph")


def held_activation_bytes(profile: "Profile", nodes: Iterable[int]) -> int:
    """The bytes ``nodes`` (a stage) keep from forward to backward for one micro-batch, when
    they do not recompute: what each node makes and saves, and each input value some node
    of the set saves, once, wherever its producer sits.

    This is the sum of the nodes' ``activation_bytes`` when every saver of each saved
    value is in the set (or none is); it differs where a cut separates the savers of a
    value, or separates it from the saver its bytes were counted with.
    """
    own = 0
    saved: dict[str, int] = {}
    for n in nodes:
        c = profile.nodes[n]
        own += c.activation_bytes - c.first_saved_bytes
        saved.update(c.saved_inputs)
    return own + sum(saved.values())


def profile_key(graph_hash: str, hardware: str, dtype: str, batch_size: int | None, optimizer: str,
                method: str) -> str:
    """File-name-safe key under which a profile is cached."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in hardware)
    return f"{graph_hash}-{method}-{safe}-{dtype}-b{batch_size}-{optimizer}"


# --------------------------------------------------------------------------- memory of parameters

def optimizer_state_bytes(meta: TensorMeta, optimizer: str) -> int:
    """Bytes of optimizer state for one parameter, as the runtime's optimizers hold it: torch's
    momentum buffer and Adam's two moments are in the parameter's dtype (``zeros_like``, so half
    for a bfloat16 parameter); transformers' Adafactor keeps its in float32 (it computes half
    parameters in float32)."""
    if optimizer not in OPTIMIZERS:
        raise ProfileError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    n = meta.numel
    if optimizer == "sgd":
        return 0
    if optimizer == "momentum":
        return meta.bytes
    if optimizer == "adam":
        return 2 * meta.bytes
    # Adafactor (no first moment, as in its default): a factored second moment for
    # matrices (one row and one column vector per trailing 2-D slice), a full one otherwise.
    if len(meta.shape) >= 2:
        lead = math.prod(meta.shape[:-2])
        return 4 * lead * (meta.shape[-2] + meta.shape[-1])
    return 4 * n


def param_costs(graph: OpGraph, optimizer: str) -> dict[str, ParamCost]:
    out = {}
    for name, p in graph.params.items():
        trainable = p.trainable
        out[name] = ParamCost(
            bytes=p.bytes,
            grad_bytes=p.bytes if trainable else 0,
            optimizer_bytes=optimizer_state_bytes(p.meta, optimizer) if trainable else 0,
        )
    return out


def _first_users(graph: OpGraph) -> dict[int, list[str]]:
    owned: dict[int, list[str]] = {}
    for name, p in graph.params.items():
        if p.users:
            owned.setdefault(min(p.users), []).append(name)
    return owned


# --------------------------------------------------------------------------- running one node

def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return id(t)


class _KernelCounter(TorchDispatchMode):
    """Records, for every ATen kernel dispatched, its FLOPs and the bytes it reads and writes."""

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.kernels: list[tuple[float, float, bool]] = []   # (flops, bytes, is_view)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = 0.0
        counter = self.registry.get(func._overloadpacket)
        if counter is not None:
            try:
                flops = float(counter(*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a counter that cannot read these shapes counts nothing
                flops = 0.0
            if func in _FUSED_ATTENTION and _causal(func, args, kwargs):
                # fused kernels skip the blocks a causal mask hides; torch's counter counts them all
                q, k = (args[1], args[2]) if func is _EFFICIENT_BWD else (args[0], args[1])
                flops *= causal_fraction(q.shape[-2], k.shape[-2])
        is_view = bool(getattr(func, "is_view", False))
        nbytes = 0.0
        if not is_view:
            gathered = _gather_bytes(func, args, kwargs, out)
            if gathered is not None:
                nbytes = gathered
            else:
                for t in tree_flatten((args, kwargs, out))[0]:
                    if isinstance(t, torch.Tensor):
                        nbytes += t.numel() * t.element_size()
        self.kernels.append((flops, nbytes, is_view))
        return out


# ---- fused attention: what scaled_dot_product_attention costs on a GPU
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
_EFFICIENT_BWD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
_FUSED_ATTENTION = {_EFFICIENT, _EFFICIENT_BWD}
_SDPA_TARGET = "aten.scaled_dot_product_attention.default"


def _causal(func, args: tuple, kwargs: dict) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    pos = 11 if func is _EFFICIENT_BWD else 6   # fwd: (q, k, v, bias, lse, p, is_causal); bwd: ... mask, is_causal
    return len(args) > pos and bool(args[pos])


def causal_fraction(sq: int, sk: int) -> float:
    """Share of a causal (top-left aligned, as ``is_causal=True``) attention matrix a fused kernel computes."""
    if sq <= 0 or sk <= 0:
        return 1.0
    kept = sum(min(i + 1, sk) for i in range(sq))
    return kept / (sq * sk)


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    """``scaled_dot_product_attention`` as the memory-efficient kernel runs it (analytic profiles).

    On ``meta`` (and on the CPU's math path) SDPA decomposes into two matrix products
    around a softmax and keeps the ``s x s`` probabilities for backward; the fused
    kernels users run on GPUs (memory-efficient, flash) keep only the output and one
    log-sum-exp per row, recompute the probabilities in backward (2.5x the forward
    FLOPs), and draw dropout from a seed instead of storing a mask. A boolean mask is
    turned into an additive bias, as torch does before calling the kernel.
    """
    q, k, v = query, key, value
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, attn_mask, dropout_p, is_causal,
                                                                   scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        bias = bias.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    need_lse = q.requires_grad or k.requires_grad or v.requires_grad
    return _EFFICIENT(q, k, v, bias, need_lse, float(dropout_p), bool(is_causal), scale=scale)[0]


def runs_gpu_kernels(hardware_name: str) -> bool:
    """Whether hardware named ``hardware_name`` runs the GPU's kernels (fused attention, ``native_dropout``).

    A CPU does not: there ``scaled_dot_product_attention`` with dropout runs torch's math path,
    which keeps the ``s x s`` probabilities and the dropout mask for backward, and
    ``aten.dropout`` keeps a float mask (``native_dropout`` is fused on CUDA only). A plan for
    CPU workers priced with the GPU's figures would promise less memory than they hold.
    Hardware presets and measured profiles name CPUs ``cpu`` / ``cpu-<N>cores``.
    """
    return not str(hardware_name).startswith("cpu")


def _as_run_on(instrs: list, gpu: bool) -> list:
    """The instructions as the target runs them: the GPU's kernels (see :func:`_as_gpu_kernels` and
    :func:`fused_attention`), or as written for a CPU (on ``meta`` they run as a CPU runs them)."""
    return _as_fused_attention(_as_gpu_kernels(instrs)) if gpu else list(instrs)


def _as_fused_attention(instrs: list) -> list:
    """SDPA instructions as the fused kernel (see :func:`fused_attention`); for profiles made on ``meta``."""
    out = []
    for ins in instrs:
        if ins.target == _SDPA_TARGET:
            ins = replace(ins, target="ftcompile.profile.fused_attention")
        out.append(ins)
    return out


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _gather_bytes(func, args: tuple, kwargs: dict, out: Any) -> float | None:
    """Memory traffic of a row lookup (``embedding``, ``index_select``), else None.

    A lookup reads only the rows it gathers, not the whole table: the indices, the
    gathered rows (as many bytes as the output) and the output written. Charging the
    table would price GPT-2's 50k-token embedding as if every token read all of it.
    Its backward (``embedding_dense_backward``) does write a dense, table-sized
    gradient once, which the generic count (inputs + output) already gets right.
    """
    packet = getattr(func, "_overloadpacket", None)
    if packet is torch.ops.aten.embedding:
        index = args[1] if len(args) > 1 else kwargs.get("indices")
    elif packet is torch.ops.aten.index_select:
        index = args[2] if len(args) > 2 else kwargs.get("index")
    else:
        return None
    return float(_nbytes(index) + 2 * _nbytes(out))


def _as_gpu_kernels(instrs: list) -> list:
    """The instructions as both profilers run them: as a GPU runs them.

    ``aten.dropout`` is composite: off CUDA (and so on ``meta``) it runs as four
    kernels (``empty_like``, ``bernoulli_``, ``div_``, ``mul``) and keeps a float
    mask for backward; on CUDA it is the one fused ``native_dropout`` kernel with a
    boolean mask. Graphs hold either form (those torch functionalized hold
    ``native_dropout``), so running both as the fused kernel keeps their times and
    activation memory equal, and the memory figures the same for every method.
    """
    out = []
    for ins in instrs:
        if (ins.target == "aten.dropout.default" and not ins.unpack and len(ins.args) == 3 and not ins.kwargs
                and isinstance(ins.args[1], (int, float)) and 0 < ins.args[1] < 1 and ins.args[2] is True):
            ins = replace(ins, name=f"{ins.name}__fused", target="aten.native_dropout.default", out=None,
                          unpack={0: ins.name}, unpack_meta={0: ins.out} if ins.out is not None else {})
        out.append(ins)
    return out


@dataclass
class _NodeRun:
    """What running one node once taught us."""

    fwd_kernels: list
    bwd_kernels: list
    saved_internal_bytes: int
    saved_inputs: frozenset        # positions (in the node's input list) of inputs saved for backward
    outputs: dict                  # value name -> tensor


def gradient_values(graph: OpGraph) -> set[str]:
    """Values a gradient flows back through in training: they require grad and lead to the loss.

    Found from the real dataflow, by running the graph once on ``meta`` with autograd
    (trainable parameters require grad, inputs do not): an operator autograd does not
    differentiate (``empty_like``, ``argmax``, ``detach``, a no-grad region's
    stop-gradient) passes no requirement on; and a value that only feeds other outputs
    than the loss gets no gradient. Profiles make exactly these inputs require grad,
    so a node is costed with the backward it really runs.
    """
    from .ir import decode_literal

    params = {n: _make_leaf(p.meta, "meta", p.trainable) for n, p in graph.params.items()}
    env: dict[str, Any] = {}
    for inp in graph.inputs:
        if inp.get("node") is not None:
            env[inp["value"]] = _make_leaf(graph.node(inp["node"]).outputs[inp["value"]].tensor, "meta", False)
    requires: set[str] = set()
    instrs = [ins for n in graph.nodes for ins in n.instrs]
    with torch.enable_grad():
        for ins in _as_fused_attention(_as_gpu_kernels(instrs)):
            try:
                run_instrs([ins], env, params, "meta")
            except Exception:  # noqa: BLE001 - an operator meta cannot run: assume it passes gradients on
                for v, meta in ins.produced().items():
                    if meta is not None and meta.tensor is not None:
                        env[v] = _make_leaf(meta.tensor, "meta", meta.tensor.is_floating and any(
                            r in requires for r in iter_refs(ins.args, ins.kwargs)))
            for v in ins.produced():
                t = env.get(v)
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    requires.add(v)
    del env
    reach = {graph.loss} if graph.loss else set()
    for ins in reversed(instrs):
        if any(v in reach for v in ins.produced()):
            reach.update(r for r in iter_refs(ins.args, ins.kwargs) if r in requires)
    return requires & reach if graph.loss else requires


def _make_leaf(meta: TensorMeta, device, requires_grad: bool) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype)
    t = torch.empty(meta.shape, dtype=dtype, device=device)
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _run_node_once(node: Node, inputs: dict[str, Any], params: Mapping[str, torch.Tensor], device,
                   count: bool, grad_seed: Callable[[torch.Tensor], torch.Tensor],
                   instrs: list | None = None, grads: set[str] | None = None) -> _NodeRun:
    """Run ``node`` forward then backward, counting kernels (optionally) and saved tensors.

    The backward starts from the outputs that get a gradient in training (``grads``,
    see :func:`gradient_values`; all differentiable outputs when None).
    """
    input_keys = {_storage_key(t): i for i, t in enumerate(inputs.values()) if isinstance(t, torch.Tensor)}
    param_keys = {_storage_key(params[p]) for p in node.params if isinstance(params.get(p), torch.Tensor)}
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    fwd = _KernelCounter() if count else None
    env: dict[str, Any] = dict(inputs)
    instrs = _as_gpu_kernels(node.instrs) if instrs is None else instrs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if fwd is not None:
            with fwd:
                run_instrs(instrs, env, params, device)
        else:
            run_instrs(instrs, env, params, device)
    outputs = {v: env[v] for v in node.outputs if v in env}

    saved_inputs = set()
    internal = 0
    seen: set[int] = set()
    for t in saved:
        k = _storage_key(t)
        if k in seen or k in param_keys:
            continue
        seen.add(k)
        if k in input_keys:
            saved_inputs.add(input_keys[k])
        else:
            # the memory kept is the storage's: an expanded (stride-0) view of a small
            # tensor keeps only that tensor, however many elements the view has
            internal += _storage_bytes(t)

    bwd = _KernelCounter() if count else None
    diff_out = [t for v, t in outputs.items() if isinstance(t, torch.Tensor) and t.requires_grad
                and (grads is None or v in grads)]
    wrt = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt += [params[p] for p in node.params if isinstance(params.get(p), torch.Tensor) and params[p].requires_grad]
    if diff_out and wrt:
        seeds = [grad_seed(t) for t in diff_out]
        if bwd is not None:
            with bwd:
                torch.autograd.grad(diff_out, wrt, seeds, allow_unused=True)
        else:
            torch.autograd.grad(diff_out, wrt, seeds, allow_unused=True)
    return _NodeRun(fwd.kernels if fwd else [], bwd.kernels if bwd else [], internal,
                    frozenset(saved_inputs), outputs)


def _node_inputs(graph: OpGraph, node: Node) -> list[tuple[str, Any]]:
    """The node's inputs as (value name, metadata), in first-read order."""
    seen: dict[str, Any] = {}
    metas = {e.value: e.meta for e in graph.in_edges(node.id)}
    for ins in node.instrs:
        for r in iter_refs(ins.args, ins.kwargs):
            if r in metas and r not in seen:
                seen[r] = metas[r]
    return list(seen.items())


def _signature(graph: OpGraph, node: Node, grads: set[str] = frozenset()) -> str:
    """A key equal for nodes that compute the same thing on the same shapes (repeated layers)."""
    rename: dict[str, str] = {}

    def canon(tree):
        if isinstance(tree, list):
            return [canon(t) for t in tree]
        if isinstance(tree, dict):
            if len(tree) == 1 and "ref" in tree:
                return {"ref": rename.setdefault(tree["ref"], f"v{len(rename)}")}
            if len(tree) == 1 and "param" in tree:
                p = graph.params[tree["param"]]
                return {"param": [list(p.meta.shape), p.meta.dtype, p.trainable]}
            return {k: canon(v) for k, v in tree.items()}
        return tree

    metas = {e.value: e.meta.to_json() for e in graph.in_edges(node.id)}
    body = []
    for ins in node.instrs:
        args, kwargs = canon(ins.args), canon(ins.kwargs)
        body.append([ins.target, args, kwargs])
        for v in [ins.name, *ins.unpack.values()]:
            rename.setdefault(v, f"v{len(rename)}")
    ins_meta = {rename[k]: [m, k in grads] for k, m in metas.items() if k in rename}
    outs = sorted([rename[v], v in grads] for v in node.outputs if v in rename)
    return json.dumps([body, ins_meta, outs], sort_keys=True, default=str)


def _roofline_ms(kernels: Iterable[tuple[float, float, bool]], hw: HardwareSpec, dtype: str) -> float:
    peak = hw.flops_per_s(dtype) * hw.matmul_efficiency
    bw = hw.memory_bandwidth * hw.memory_efficiency
    total = 0.0
    for flops, nbytes, is_view in kernels:
        if is_view:
            continue
        total += max(flops / peak, nbytes / bw) + hw.kernel_overhead_s
    return total * 1e3


def graph_dtype(graph: OpGraph) -> str:
    """The dtype holding most parameter bytes: what the graph computes in."""
    counts: dict[str, int] = {}
    for p in graph.params.values():
        if p.meta.is_floating:
            counts[p.meta.dtype] = counts.get(p.meta.dtype, 0) + p.bytes
    return max(counts, key=counts.get) if counts else "float32"


def _fill_memory(graph: OpGraph, costs: dict[int, NodeCost], saved_by: dict[int, set[str]],
                 optimizer: str) -> dict[str, ParamCost]:
    """Parameter memory, sent bytes, and the saved inputs of each node (``saved_by``: node id ->
    names of the inputs it saves): bytes with the first saver in graph order, listed with every
    saver. Graph inputs saved by a node stay with their input node: a plan counts the batches
    of graph inputs a GPU holds as such, and a saved input is a view of them."""
    pcosts = param_costs(graph, optimizer)
    for nid, names in _first_users(graph).items():
        c = costs[nid]
        c.param_bytes = sum(pcosts[n].bytes for n in names)
        c.grad_bytes = sum(pcosts[n].grad_bytes for n in names)
        c.optimizer_bytes = sum(pcosts[n].optimizer_bytes for n in names)
    counted: set[str] = set()
    for node in graph.nodes:                      # graph order is topological
        c = costs.setdefault(node.id, NodeCost())
        for v in sorted(saved_by.get(node.id, ())):
            src = graph.node(graph.producer(v))
            meta = src.outputs[v]
            if src.kind == "input":
                if v not in counted:
                    costs.setdefault(src.id, NodeCost()).activation_bytes += meta.bytes
                    counted.add(v)
                continue
            c.saved_inputs[v] = meta.bytes
            if v not in counted:
                counted.add(v)
                c.activation_bytes += meta.bytes
                c.first_saved_bytes += meta.bytes
        per_dst: dict[int, int] = {}
        for e in graph.out_edges(node.id):
            per_dst[e.dst] = per_dst.get(e.dst, 0) + e.bytes
        c.output_bytes = per_dst
    return pcosts


# --------------------------------------------------------------------------- analytic

def analytic_profile(graph: OpGraph, hardware: HardwareSpec, *, optimizer: str = "adam",
                     dtype: str | None = None, progress: Callable[[int, int], None] | None = None) -> Profile:
    """Costs from FLOP and byte counts of every kernel, priced on ``hardware`` (no weights needed)."""
    dtype = dtype or graph_dtype(graph)
    if optimizer not in OPTIMIZERS:
        raise ProfileError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    import_custom_ops(graph)        # a graph read from a file: register the operators it calls
    meta_params = {name: _make_leaf(p.meta, "meta", p.trainable) for name, p in graph.params.items()}
    cache: dict[str, tuple[NodeCost, frozenset, int]] = {}
    costs: dict[int, NodeCost] = {}
    saved_by: dict[int, set[str]] = {}
    op_nodes = [n for n in graph.nodes if n.kind == "op"]
    t0 = time.perf_counter()
    grads = gradient_values(graph)
    gpu = runs_gpu_kernels(hardware.name)      # price the kernels the target really runs
    for i, node in enumerate(op_nodes):
        ins = _node_inputs(graph, node)
        sig = _signature(graph, node, grads)
        hit = cache.get(sig)
        if hit is None:
            inputs = {name: (_make_leaf(m.tensor, "meta", name in grads) if m.tensor is not None
                             else _literal_value(m.literal)) for name, m in ins}
            try:
                run = _run_node_once(node, inputs, meta_params, "meta", True, torch.ones_like,
                                     _as_run_on(node.instrs, gpu), grads)
            except Exception as exc:  # noqa: BLE001
                raise ProfileError(f"cannot cost node {node.id} ({node.name}, {node.op}) on meta: "
                                   f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
            fwd_ms = _roofline_ms(run.fwd_kernels, hardware, dtype)
            cost = NodeCost(
                forward_ms=fwd_ms, recompute_ms=fwd_ms,
                backward_ms=_roofline_ms(run.bwd_kernels, hardware, dtype),
                flops_forward=sum(k[0] for k in run.fwd_kernels),
                flops_backward=sum(k[0] for k in run.bwd_kernels),
                bytes_forward=sum(k[1] for k in run.fwd_kernels),
                bytes_backward=sum(k[1] for k in run.bwd_kernels),
            )
            hit = (cost, run.saved_inputs, run.saved_internal_bytes)
            cache[sig] = hit
        cost, saved_pos, internal = hit
        costs[node.id] = NodeCost(**{**asdict(cost), "activation_bytes": internal, "output_bytes": {},
                                     "saved_inputs": {}})
        saved_by[node.id] = {ins[pos][0] for pos in saved_pos}
        if progress:
            progress(i + 1, len(op_nodes))
    pcosts = _fill_memory(graph, costs, saved_by, optimizer)
    return Profile(graph_hash=graph.content_hash(), method="analytic", hardware=hardware.to_json(),
                   dtype=dtype, batch_size=graph.source.get("options", {}).get("batch_size"),
                   optimizer=optimizer, nodes=costs, params=pcosts,
                   info={"seconds": round(time.perf_counter() - t0, 3), "distinct_nodes": len(cache)})


def _literal_value(lit: Any) -> Any:
    from .ir import decode_literal

    return decode_literal(lit)


# --------------------------------------------------------------------------- measured

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    """Times a callable: its kernels' GPU time on a GPU (CUDA events), perf_counter elsewhere.

    On a GPU the stream is held (a spin kernel, ``torch.cuda._sleep``) while the host
    dispatches ``fn``'s kernels, so that the events bracket the kernels alone, run back to
    back as in a stage's stream. Without the hold, a node's time would include the host's
    dispatch of the profiler's own interpreter and one ``autograd.grad`` call per node,
    during which the GPU idles: on gpt2-medium the predicted step was 2.3 times the measured
    one (H200, benchmarks/README.md). The hold lasts twice the host time of the previous call with the
    same ``key`` (at least 1 ms); a call the hold did not cover is counted in ``uncovered``.
    """

    def __init__(self, device: torch.device, hold: bool = True) -> None:
        self.device = device
        self.hold = hold and device.type == "cuda" and hasattr(torch.cuda, "_sleep")
        self._cycles_per_ms: float | None = None
        self._host_ms: dict[str, float] = {}
        self.uncovered = 0

    def _calibrate(self) -> float:
        if self._cycles_per_ms is None:
            cycles = 20_000_000
            torch.cuda._sleep(cycles)            # first launch: loads the kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self._cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    def __call__(self, fn: Callable[[], Any], key: str = "") -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.hold:
                hold_ms = min(1000.0, max(1.0, 2.0 * self._host_ms.get(key, 5.0)))
                torch.cuda._sleep(int(hold_ms * self._calibrate()))
            start.record()
            t = time.perf_counter()
            fn()
            self._host_ms[key] = (time.perf_counter() - t) * 1e3
            if self.hold and start.query():       # the hold ended before the host had dispatched fn
                self.uncovered += 1
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3


def graph_input_values(graph: OpGraph, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Match a call's (args, kwargs) to the graph's input values by their paths."""
    from .runtime.manifest import call_leaves

    by_path = dict(call_leaves(args, kwargs))
    out = {}
    for inp in graph.inputs:
        if inp.get("node") is None:
            continue
        if inp["path"] not in by_path:
            raise ProfileError(f"the inputs given lack {inp['path']}, which the graph was traced with")
        out[inp["value"]] = by_path[inp["path"]]
    return out


def host_params(graph: OpGraph, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors for every graph parameter, buffer and constant, kept in host memory."""
    state: dict[str, torch.Tensor] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        state[name] = t
    for name, t in model.named_buffers(remove_duplicate=False):
        state[name] = t
    out = {}
    for name, p in graph.params.items():
        t = state.get(name)
        if t is None:
            t = next((state[a] for a in p.aliases if a in state), None)
        if t is None and p.value is not None:
            t = torch.tensor(p.value, dtype=getattr(torch, p.meta.dtype)).reshape(p.meta.shape)
        if t is None:
            raise ProfileError(f"the model has no tensor for graph parameter {name!r}")
        if t.is_meta:
            raise ProfileError("measured profiling needs real weights, but the model was built on the meta "
                               "device; build it with --device cpu (weights stay in host memory and move to "
                               "the GPU node by node), or use --method analytic")
        out[name] = t.detach().cpu()
    return out


def measured_profile(graph: OpGraph, params: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor], *,
                     device: str | torch.device = "cpu", optimizer: str = "adam", warmup: int = 1,
                     repeats: int = 5, progress: Callable[[int, int], None] | None = None) -> Profile:
    """Time every node on ``device`` with host swapping.

    ``params`` and ``inputs`` are host (CPU) tensors: parameters by canonical graph
    name, inputs by graph input value name (see :func:`host_params` and
    :func:`graph_input_values`). Only one node's inputs and parameters are on the
    device at a time; its outputs return to host memory and are freed after their
    last consumer has run. On the CPU the nodes run with one intra-op thread
    (``torch.set_num_threads(1)``, restored afterwards) so that times are stable.
    """
    device = torch.device(device)
    if optimizer not in OPTIMIZERS:
        raise ProfileError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError("device cuda asked for, but torch sees no CUDA device; use --device cpu")
    if repeats < 1 or warmup < 0:
        raise ProfileError("repeats must be at least 1 and warmup at least 0")
    import_custom_ops(graph)
    missing = [p for n in graph.op_nodes() for p in n.params if p not in params]
    if missing:
        raise ProfileError(f"no tensor given for graph parameter(s) {sorted(set(missing))[:5]}; "
                           "take them from the model with host_params(graph, model)")
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in [*params.values(), *inputs.values()]):
        raise ProfileError("measured profiling needs real weights and inputs, but got tensors on the meta "
                           "device; build the model with --device cpu, or use --method analytic")
    # On the CPU, time with one intra-op thread: a parallel kernel waits for its slowest
    # thread, so on a shared machine a descheduled worker stalls even tiny ops, and the
    # profiler would fight other processes for the cores. Restored on the way out.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _measured_profile(graph, params, inputs, device, optimizer, warmup, repeats, progress)
    finally:
        if device.type == "cpu":
            torch.set_num_threads(threads)


def _measured_profile(graph: OpGraph, params: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor],
                      device: torch.device, optimizer: str, warmup: int, repeats: int,
                      progress: Callable[[int, int], None] | None) -> Profile:
    timer = _Timer(device)
    pin = device.type == "cuda"
    host: dict[str, Any] = {}
    for v, t in inputs.items():
        host[v] = t.detach().cpu().pin_memory() if pin else t.detach().cpu()
    hparams = {k: (v.pin_memory() if pin and not v.is_pinned() else v) for k, v in params.items()}
    last_use: dict[str, int] = {}
    for e in graph.edges:
        last_use[e.value] = max(last_use.get(e.value, -1), e.dst)

    costs: dict[int, NodeCost] = {}
    saved_by: dict[int, set[str]] = {}
    op_nodes = [n for n in graph.nodes if n.kind == "op"]
    grads = gradient_values(graph)
    peak_device = 0
    t0 = time.perf_counter()
    for i, node in enumerate(op_nodes):
        names = [name for name, _m in _node_inputs(graph, node)]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        cost, saved_pos, outputs = _measure_node(node, names, host, hparams, graph, grads, device, timer,
                                                 warmup, repeats)
        costs[node.id] = cost
        saved_by[node.id] = {names[pos] for pos in saved_pos}
        if device.type == "cuda":
            peak_device = max(peak_device, torch.cuda.max_memory_allocated(device))
        # Swap out: outputs back to host (they are host tensors already); free what no later node reads.
        host.update(outputs)
        del outputs
        for n in names:
            if last_use.get(n, -1) <= node.id:
                host.pop(n, None)
        if progress:
            progress(i + 1, len(op_nodes))
    pcosts = _fill_memory(graph, costs, saved_by, optimizer)
    dev_name = measured_hardware_name(device)
    return Profile(graph_hash=graph.content_hash(), method="measured",
                   hardware={"name": dev_name, "device": str(device)}, dtype=graph_dtype(graph),
                   batch_size=graph.source.get("options", {}).get("batch_size"), optimizer=optimizer,
                   nodes=costs, params=pcosts,
                   info={"seconds": round(time.perf_counter() - t0, 3), "warmup": warmup, "repeats": repeats,
                         "peak_device_bytes": peak_device, "torch": torch.__version__,
                         **({"timing": "gpu kernels (stream held while the host dispatches)",
                             "uncovered_timings": timer.uncovered} if timer.hold else
                            # a torch without cuda._sleep: the events also bracket the host's dispatch
                            {"timing": "events around the host's dispatch (no torch.cuda._sleep to hold the "
                                       "stream): pessimistic where the host is slower than the kernels"}
                            if device.type == "cuda" else {})})


def _measure_node(node: Node, names: list[str], host: dict, hparams: Mapping[str, torch.Tensor], graph: OpGraph,
                  grads: set[str], device: torch.device, timer: "_Timer", warmup: int, repeats: int
                  ) -> tuple[NodeCost, frozenset, dict[str, Any]]:
    """Time one node on ``device`` (host swapping) and return its cost and its outputs, in host memory.

    Everything the node put on the device (inputs, parameters, intermediate values,
    autograd's saved tensors, gradients) is released before this returns, and each
    timed repeat starts after the previous one's tensors are gone, so that only one
    node's tensors, from one run, are on the device at a time.
    """

    def stage_in():
        # Swap in: this node's inputs and parameters, fresh leaves each time; an input
        # requires grad when training sends a gradient back through it.
        ins = {}
        for n in names:
            v = host[n]
            if isinstance(v, torch.Tensor):
                v = v.to(device, non_blocking=True).detach()
                if n in grads and v.is_floating_point():
                    v.requires_grad_(True)
            ins[n] = v
        ps = {}
        for p in node.params:
            t = hparams[p].to(device, non_blocking=True).detach()
            if graph.params[p].trainable and t.is_floating_point():
                t.requires_grad_(True)
            ps[p] = t
        return ins, ps

    ins, ps = stage_in()
    _sync(device)
    gpu = device.type != "cpu"
    instrs = _as_gpu_kernels(node.instrs) if gpu else list(node.instrs)
    try:
        # counted (untimed) run: the FLOPs and bytes of the kernels this device really runs
        run = _run_node_once(node, ins, ps, device, True, torch.randn_like, instrs, grads)
    except Exception as exc:  # noqa: BLE001
        raise ProfileError(f"node {node.id} ({node.name}, {node.op}) failed on {device}: "
                           f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
    outputs = {v: (t.detach().to("cpu") if isinstance(t, torch.Tensor) else t) for v, t in run.outputs.items()}
    saved_internal, saved_pos = run.saved_internal_bytes, run.saved_inputs
    fwd_kernels, bwd_kernels = run.fwd_kernels, run.bwd_kernels
    del run             # its outputs hold the autograd graph and every tensor it saved
    if gpu and any(ins.target == _SDPA_TARGET for ins in node.instrs):
        # Plans for GPUs price the fused attention kernel (a GPU's math fallback, as for
        # dropout in float32 attention on some, keeps the s x s matrix): what the node keeps
        # is counted as the analytic profile counts it, on meta. A CPU keeps what it measured.
        saved_internal, saved_pos = _saved_as_fused(node, names, graph, grads)
    fwd_times, bwd_times = [], []
    for r in range(warmup + repeats):
        env = dict(ins)
        f_ms = timer(lambda: run_instrs(instrs, env, ps, device), "forward")
        outs = [env[v] for v in node.outputs if v in grads and isinstance(env.get(v), torch.Tensor)
                and env[v].requires_grad]
        wrt = [t for t in list(ins.values()) + list(ps.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
        b_ms = 0.0
        if outs and wrt:
            seeds = [torch.randn_like(t) for t in outs]
            b_ms = timer(lambda: torch.autograd.grad(outs, wrt, seeds, allow_unused=True), "backward")
            del seeds
        # this run's values, saved tensors and gradients go before the next run allocates
        del env, outs, wrt
        if r >= warmup:
            fwd_times.append(f_ms)
            bwd_times.append(b_ms)
    del ins, ps
    f = statistics.median(fwd_times)
    cost = NodeCost(forward_ms=f, recompute_ms=f, backward_ms=statistics.median(bwd_times),
                    flops_forward=sum(k[0] for k in fwd_kernels), flops_backward=sum(k[0] for k in bwd_kernels),
                    bytes_forward=sum(k[1] for k in fwd_kernels), bytes_backward=sum(k[1] for k in bwd_kernels),
                    activation_bytes=saved_internal)
    return cost, saved_pos, outputs


def _saved_as_fused(node: Node, names: list[str], graph: OpGraph, grads: set[str]) -> tuple[int, frozenset]:
    """Activation memory of ``node`` with its attention as the fused kernel (a run on ``meta``)."""
    metas = dict(_node_inputs(graph, node))
    inputs = {n: (_make_leaf(metas[n].tensor, "meta", n in grads) if metas[n].tensor is not None
                  else _literal_value(metas[n].literal)) for n in names}
    params = {p: _make_leaf(graph.params[p].meta, "meta", graph.params[p].trainable) for p in node.params}
    run = _run_node_once(node, inputs, params, "meta", False, torch.ones_like,
                         _as_fused_attention(_as_gpu_kernels(node.instrs)), grads)
    return run.saved_internal_bytes, run.saved_inputs


def measured_hardware_name(device: str | torch.device) -> str:
    """The name a measured profile records for ``device`` (part of its cache key)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ProfileError("device cuda asked for, but torch sees no CUDA device; use --device cpu")
        return torch.cuda.get_device_name(device)
    return f"cpu-{os.cpu_count()}cores"


# --------------------------------------------------------------------------- cache

def check_cache_dir(path_dir: str | os.PathLike) -> None:
    """Refuse a cache directory that is an existing regular file (it may not exist yet)."""
    d = os.fspath(path_dir)
    if os.path.exists(d) and not os.path.isdir(d):
        raise ProfileError(f"--cache-dir {d} is a file; give a directory (profiles are cached as files in it), "
                           "or --no-cache")


def cached(path_dir: str | os.PathLike, key: str) -> Profile | None:
    """The profile saved under ``key`` in ``path_dir``, or None."""
    check_cache_dir(path_dir)
    p = os.path.join(os.fspath(path_dir), key + ".json")
    if os.path.exists(p):
        try:
            return Profile.load(p)
        except ProfileError:
            return None
    return None


def store(path_dir: str | os.PathLike, profile: Profile) -> str:
    check_cache_dir(path_dir)
    p = os.path.join(os.fspath(path_dir), profile.key + ".json")
    profile.save(p)
    return p


__all__ = [
    "NodeCost", "ParamCost", "Profile", "ProfileError", "OPTIMIZERS", "analytic_profile", "measured_profile",
    "graph_input_values", "host_params", "optimizer_state_bytes", "param_costs", "profile_key", "cached", "store",
    "graph_dtype", "measured_hardware_name", "check_cache_dir", "held_activation_bytes",
]
