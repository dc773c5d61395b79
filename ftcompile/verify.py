"""``ftcompile verify``: does a generated package compute what the original model computes?

The package's stages run one after another on one device
(:class:`~ftcompile.runtime.local.LocalPipeline`: every stage boundary cut from
autograd as in a real pipeline, each stage's own backward), and the original
model, rebuilt by name with the same weights, runs the same inputs. Both draw
the same dropout masks: generated code keys each mask by (micro-batch seed,
operator), and the eager model runs under
:func:`~ftcompile.runtime.ops.keyed_random_mode`, which gives its n-th dropout
call the n-th key (other random draws, ``torch.rand`` in forward, are keyed in
their own sequence). Compared: every model output, the loss, every parameter's
gradient (a tied tensor's copies summed), every buffer after the forward
(BatchNorm's running statistics), and every stage's recomputed forward against its
first forward, run as the runtime recomputes (autograd on, buffers not updated).
Inputs that were one tensor in the example call are given distinct values first,
so that a package reading one for the other cannot pass.

The error of a tensor is ``max |package - model| / max |model|``; for a gradient the
denominator is at least a thousandth of the model's largest gradient, so a gradient
that is zero in exact arithmetic (rounding noise on both sides) is not judged relative
to its own noise.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


class VerifyError(ValueError):
    """The package cannot be verified at all (no weights, model cannot be rebuilt...)."""


@dataclass
class Difference:
    kind: str           # output | loss | gradient | buffer | recompute
    name: str
    error: float        # max |a - b| / max |b|
    max_abs: float
    shape: list[int]
    ok: bool

    def row(self) -> list[str]:
        return [self.kind, self.name, f"{self.error:.2e}", f"{self.max_abs:.2e}",
                "x".join(map(str, self.shape)) or "scalar", "ok" if self.ok else "FAIL"]


@dataclass
class VerifyReport:
    package: str
    model: str
    device: str
    dtype: str
    tolerance: float
    dropout: bool
    stages: int
    compared: dict[str, int] = field(default_factory=dict)
    worst: list[Difference] = field(default_factory=list)
    failures: list[Difference] = field(default_factory=list)
    random_calls: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _error(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> tuple[float, float]:
    # complex values compare as their real and imaginary parts (.double() would drop the imaginary)
    a, b = (torch.view_as_real(x.detach().resolve_conj()) if x.is_complex() else x.detach() for x in (a, b))
    a, b = a.double().cpu(), b.double().cpu()
    if a.shape != b.shape:
        return math.inf, math.inf
    if a.numel() == 0:
        return 0.0, 0.0
    diff = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), floor)
    if not math.isfinite(diff):
        same_nan = bool(torch.equal(torch.isnan(a), torch.isnan(b))) and bool(
            torch.equal(a[~torch.isnan(a)], b[~torch.isnan(b)]))
        return (0.0, 0.0) if same_nan else (math.inf, math.inf)
    return (diff / scale if scale > 0 else diff), diff


def distinct_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
    """The call with every input that shares memory with an earlier one given other values.

    An example call such as ``model(input_ids=ids, labels=ids)`` cannot tell a package
    that reads ``labels`` where the model reads ``input_ids`` from a correct one. Each
    later input of such a group becomes a copy with its elements rotated by one: the
    same values (valid token ids stay valid), in other places. Returns the new call
    and the paths changed.
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from .runtime.manifest import call_leaves

    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    paths = [p for p, _ in call_leaves(args, kwargs)]
    seen: set = set()
    changed: list[str] = []
    out = list(leaves)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = t.untyped_storage()._cdata
        if key in seen:
            out[i] = t.flatten().roll(1).reshape(t.shape).clone() if t.numel() else t.clone()
            changed.append(paths[i])
        else:
            seen.add(key)
    if not changed:
        return args, kwargs, []
    new_args, new_kwargs = tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs), changed


def verify_package(path: str, *, device: str = "cpu", tolerance: float | None = None, dropout: bool = True,
                   recompute: bool = True, checksums: bool = True, seed: int = 0,
                   progress: Callable[[str], None] | None = None, top: int = 8) -> VerifyReport:
    """Compare the package in ``path`` with its original model; see the module docstring.

    ``dropout=False`` turns dropout off on both sides; ``checksums=False`` skips
    the SHA256SUMS check, so that a deliberately edited package can be compared
    numerically.
    """
    from torch.utils._pytree import tree_flatten, tree_map

    from .codegen import rebuild_model
    from .runtime.local import LocalPipeline
    from .runtime.ops import keyed_random_mode
    from .runtime.package import load_package

    note = progress or (lambda _s: None)
    t0 = time.perf_counter()
    note("load package")
    pkg = load_package(path, verify=checksums)
    m = pkg.manifest
    if m.weights != "stored":
        raise VerifyError(f"{path} stores no weights (its model was traced on 'meta'), so there is nothing to "
                          "compare the original model with; compile the model with --device cpu to verify it")
    tol = tolerance if tolerance is not None else TOLERANCES.get(m.dtype, 1e-5)
    report = VerifyReport(package=str(path), model=str(m.model.get("name")), device=str(device), dtype=m.dtype,
                          tolerance=tol, dropout=dropout, stages=len(m.stages))

    note("rebuild the model")
    source = {"model": m.model.get("name"), "options": dict(m.model.get("options") or {})}
    try:
        built = rebuild_model(source, device="cpu")
    except Exception as exc:  # noqa: BLE001 - a model that no longer builds cannot be verified
        raise VerifyError(f"cannot rebuild {source['model']} to compare with: {exc}") from None
    model = built.model.to(device)
    model.train()
    args, kwargs = built.make_inputs(str(device))
    args, kwargs, changed = distinct_inputs(args, kwargs)
    if changed:
        report.notes.append(f"inputs {', '.join(changed)} were the same tensor as another input in the example "
                            "call; they were given other values here, so that reading one input for another "
                            "shows")
    inputs = pkg.inputs_from_call(args, kwargs)
    # the model gets its own copies: a model that writes an input in place must not change the package's
    model_args, model_kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))

    note("run the model")
    model.zero_grad(set_to_none=True)
    with keyed_random_mode(seed, enabled=dropout) as mode:
        out = model(*model_args, **model_kwargs)
    leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
    other_ops = m.random_ops - m.dropout_ops
    report.random_calls = {"model": mode.calls, "package": m.dropout_ops,
                           "model_other": mode.other_calls, "package_other": other_ops}
    if dropout and mode.calls != m.dropout_ops:
        report.notes.append(f"the model made {mode.calls} dropout calls but the package has {m.dropout_ops} "
                            "dropout operators, so masks cannot match; compare with --no-dropout")
    if mode.other_calls != other_ops:
        report.notes.append(f"the model drew random numbers {mode.other_calls} time(s) besides dropout "
                            f"(torch.rand, uniform_...) but the package has {other_ops} such operator(s), so "
                            "their values cannot match: draw that noise outside the model and pass it as an input "
                            "(ViTMAE: forward(pixel_values, noise=...))")
    if len(leaves) != len(m.outputs):
        raise VerifyError(f"the model returns {len(leaves)} tensors but the package {len(m.outputs)}; the model "
                          "changed since it was compiled: re-run `ftcompile compile`")
    ref_loss = leaves[m.outputs.index(m.loss)] if m.loss in m.outputs else None
    if ref_loss is not None:
        ref_loss.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}

    note("run the package")
    pipe = LocalPipeline.build(pkg, device)
    pipe.train(dropout)
    values, runs = pipe.forward(inputs, seed=seed, grad=True)
    if m.loss is not None:
        pipe.backward(runs)
    grads = pipe.parameter_grads()

    diffs: list[Difference] = []

    # A gradient that is zero in exact arithmetic (an attention key bias: softmax ignores a
    # shift) comes out as rounding noise of either side; relative to itself that noise is
    # anything. Such tensors are measured against a thousandth of the largest gradient.
    grad_floor = 1e-3 * max((float(g.detach().abs().max()) for g in ref_grads.values()
                             if isinstance(g, torch.Tensor) and g.numel()), default=0.0)

    def compare(kind: str, name: str, a, b) -> None:
        if a is None and b is None:
            return
        if a is None or b is None:
            diffs.append(Difference(kind, name, math.inf, math.inf, [], False))
            return
        err, mx = _error(a, b, grad_floor if kind == "gradient" else 0.0)
        diffs.append(Difference(kind, name, err, mx, list(b.shape), err <= tol))

    for v, ref in zip(m.outputs, leaves):
        got = values.get(v)
        compare("loss" if v == m.loss else "output", m.values[v].name if v in m.values else v,
                got if isinstance(got, torch.Tensor) else None, ref)
    for name, spec in m.params.items():
        if not spec.trainable:
            continue
        ref = next((ref_grads[n] for n in (name, *spec.aliases) if ref_grads.get(n) is not None), None)
        compare("gradient", name, grads.get(name), ref)

    # Buffers after one forward: running statistics the model updated must be updated alike.
    model_buffers = dict(model.named_buffers(remove_duplicate=False))
    held = pipe.buffers()
    for name, spec in m.params.items():
        if spec.kind != "buffer":
            continue
        ref = next((model_buffers[n] for n in (name, *spec.aliases) if n in model_buffers), None)
        for h in spec.holders:
            label = name if len(spec.holders) == 1 else f"{name} (stage {h})"
            compare("buffer", label, held.get(h, {}).get(name), ref)

    if recompute:
        note("recompute every stage")
        # as the runtime recomputes in backward: with autograd on, without updating buffers
        before = {sid: {n: b.clone() for n, b in bufs.items()} for sid, bufs in held.items()}
        for run in runs:
            again = pipe.recompute(run, seed=seed)
            for v, first, second in zip(run.spec.outputs, run.outputs, again):
                if isinstance(first, torch.Tensor):
                    err, mx = _error(second, first)
                    diffs.append(Difference("recompute", f"stage {run.spec.id}: {m.values[v].name}", err, mx,
                                            list(first.shape), mx == 0.0 or err <= tol * 1e-3))
        for sid, bufs in pipe.buffers().items():
            for n, b in bufs.items():
                err, mx = _error(b, before[sid][n])
                if mx != 0.0:
                    diffs.append(Difference("recompute", f"stage {sid}: buffer {n} changed by recomputation",
                                            err, mx, list(b.shape), False))

    for d in diffs:
        report.compared[d.kind] = report.compared.get(d.kind, 0) + 1
    report.failures = [d for d in diffs if not d.ok]
    report.worst = sorted(diffs, key=lambda d: -d.error)[:top]
    report.seconds = round(time.perf_counter() - t0, 3)
    return report
