"""A single-process reference of every schedule's weight-version semantics.

:func:`reference_train` trains a package one micro-batch at a time, with no
pipelining, keeping every weight version: micro-batch ``k``'s forward through
stage ``s`` uses version ``forward_version(k)`` of that stage, its backward
recomputes the stage from the same inputs with version
``backward_version(k)``, and step ``j``'s update turns version ``j`` into
``j + 1`` with the gradients of the step's micro-batches. The version tables
come from :func:`~ftcompile.runtime.engine.programs`, the ones the
multi-process engine runs, so the engine must end with the weights this gives
(up to floating-point summation order).

Shared (tied) tensors sum their holders' gradients in stage order; under the
schedules that lag them (:func:`~ftcompile.runtime.schedules.shared_lag`)
step ``j`` applies step ``j - 1``'s sum, as the engine does.

With weight prediction (FTPipe §4.2), a forward whose backward will use a
later version runs on weights predicted that many updates ahead from version
``forward_version(k)`` and the optimizer state that came with it: the
prediction is made when the version is created, since the optimizer state
moves on with every later update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.func import functional_call

from . import optim as _optim
from .engine import TrainConfig, accepts_update_buffers, grad_order, lags_shared, micro_batch_seed, programs, sum_parts
from .package import Package


@dataclass
class ReferenceResult:
    losses: list[float]                               # per step: mean micro-batch loss
    weights: dict[int, dict[str, torch.Tensor]]       # per stage: final trainable weights


def reference_train(package: Package, batches: Iterator[dict], cfg: TrainConfig, steps: int, *,
                    device: str | torch.device = "cpu", replicas: int = 1) -> ReferenceResult:
    """Train ``steps`` steps of ``cfg.schedule`` in one process; see the module docstring.

    With ``replicas``, every batch holds ``replicas * M`` micro-batches (the step's global batch);
    micro-batch ``k`` of the schedule is the replicas' ``k``-th micro-batches together, run with the
    same weight versions, and the step's gradient is averaged over the replicas (what replicated
    pipelines compute, in any schedule).
    """
    from .data import split_micro_batches

    m, M = package.manifest, cfg.micro_batches
    device = torch.device(device)
    progs = programs(m, cfg, steps)
    order = m.order
    modules = {s.id: package.build_stage(s.id, device).train(cfg.dropout) for s in m.stages}
    ocfg = cfg.optim_config()
    live = {s: {n: p for n, p in mod.named_parameters() if p.requires_grad} for s, mod in modules.items()}
    opts = {s: _optim.build(list(live[s].values()), ocfg) for s in modules}
    history = {s: {0: {n: p.detach().clone() for n, p in live[s].items()}} for s in modules}
    # (version, delay) -> predicted weights, made while the optimizer state is that version's.
    predicted: dict[int, dict[tuple[int, int], dict[str, torch.Tensor]]] = {s: {} for s in modules}

    def make_predictions(s: int, v: int) -> None:
        if not cfg.weight_prediction:
            return
        for k in range(M * steps):
            fv, d = progs[s].forward_version(k), progs[s].staleness(k)
            if fv > v:
                break               # versions grow with k
            if fv == v and d > 0 and (v, d) not in predicted[s]:
                predicted[s][(v, d)] = _optim.predict(opts[s][0], live[s], history[s][v], d)

    def forward_weights(s: int, k: int) -> dict[str, torch.Tensor]:
        v, d = progs[s].forward_version(k), progs[s].staleness(k)
        return predicted[s][(v, d)] if cfg.weight_prediction and d > 0 else history[s][v]

    for s in modules:
        make_predictions(s, 0)
    shared = m.shared_params()
    lag = lags_shared(cfg)
    pending: dict[str, torch.Tensor] = {}
    inputs_of = {i.value for i in m.inputs if i.shape is not None}
    losses = []
    for j in range(steps):
        acc: dict[int, dict[str, torch.Tensor]] = {s: {} for s in modules}
        step_losses = []
        R = replicas
        global_batch = split_micro_batches(next(batches), m, R * M)
        for i, r in ((i, r) for i in range(M) for r in range(R)):
            mb = global_batch[r * M + i]
            k = j * M + i
            seed = micro_batch_seed(cfg.seed, j, r * M + i)
            values = {n: t.to(device) for n, t in mb.items()}
            saved = {}
            for s in order:
                spec = m.stage(s)
                args = [values[v] if (v in inputs_of or m.values[v].is_tensor) else m.values[v].literal
                        for v in spec.inputs]
                saved[s] = args
                w = forward_weights(s, k)
                with torch.no_grad():
                    outs = functional_call(modules[s], w, tuple(args), {"seed": seed}, strict=False)
                for v, o in zip(spec.outputs, outs):
                    values[v] = o
                    if v == m.loss:
                        step_losses.append(float(o))
            grads: dict[str, dict[int, torch.Tensor]] = {}
            for s in reversed(order):
                spec = m.stage(s)
                w = {n: t.clone().requires_grad_(True) for n, t in history[s][progs[s].backward_version(k)].items()}
                args = []
                for v, x in zip(spec.inputs, saved[s]):
                    if isinstance(x, torch.Tensor):
                        x = x.detach()
                        vs = m.values.get(v)
                        if vs is not None and vs.takes_gradient:
                            x.requires_grad_(True)
                    args.append(x)
                # The backward recomputes the forward: running statistics were updated by the
                # forward already.
                kw = {"seed": seed, **({"update_buffers": False} if accepts_update_buffers(modules[s]) else {})}
                with torch.enable_grad():
                    outs = functional_call(modules[s], w, tuple(args), kw, strict=False)
                roots, gs = [], []
                for v, o in zip(spec.outputs, outs):
                    if not (isinstance(o, torch.Tensor) and o.requires_grad):
                        continue
                    if v == m.loss:
                        roots.append(o)
                        gs.append(torch.full_like(o, 1.0 / M))
                    elif v in grads:
                        g = None
                        for c in grad_order(m, v):          # the engine's order
                            if c in grads[v]:
                                g = grads[v][c] if g is None else g + grads[v][c]
                        roots.append(o)
                        gs.append(g)
                if roots:
                    torch.autograd.backward(roots, gs)
                for n, t in w.items():
                    if t.grad is not None:
                        acc[s][n] = t.grad if n not in acc[s] else acc[s][n] + t.grad
                for v, x in zip(spec.inputs, args):
                    vs = m.values.get(v)
                    if vs is not None and vs.requires_grad and vs.producer is not None and vs.is_tensor:
                        g = x.grad if isinstance(x, torch.Tensor) and x.grad is not None else torch.zeros_like(x)
                        grads.setdefault(v, {})[s] = g
        losses.append(sum(step_losses) / len(step_losses) if step_losses else float("nan"))
        # Step j: version j -> j + 1 on every stage.
        for s in modules:
            for n, p in live[s].items():
                g = acc[s].get(n)
                p.grad = g / R if g is not None and R > 1 else g
        for name, holders in shared.items():
            total = sum_parts([live[h][name].grad if live[h][name].grad is not None
                               else torch.zeros_like(live[h][name]) for h in sorted(holders)])
            if lag:        # step j applies step j - 1's sum (none at the first step)
                total, pending[name] = pending.get(name), total
            for h in holders:
                live[h][name].grad = total.clone() if total is not None else None
        if cfg.clip_grad_norm:
            sq = 0.0
            for s in sorted(modules):
                for n, p in live[s].items():
                    if p.grad is None or (n in shared and min(shared[n]) != s):
                        continue
                    sq += float(p.grad.detach().double().pow(2).sum())
            total_norm = math.sqrt(sq)
            for s in modules:
                _optim.clip_to(live[s].values(), total_norm, cfg.clip_grad_norm)
        for s in modules:
            opt, sched = opts[s]
            _optim.step(opt)
            if sched is not None:
                sched.step()
            for p in live[s].values():
                p.grad = None
            history[s][j + 1] = {n: p.detach().clone() for n, p in live[s].items()}
            make_predictions(s, j + 1)
            # Keep only the versions a later micro-batch still uses (versions grow with k).
            later = (j + 1) * M
            oldest = min(progs[s].forward_version(later), progs[s].backward_version(later)) \
                if later < M * steps else j + 1
            for v in [v for v in history[s] if v < oldest]:
                del history[s][v]
            for key in [key for key in predicted[s] if key[0] < oldest]:
                del predicted[s][key]
    return ReferenceResult(losses, {s: {n: p.detach().clone() for n, p in live[s].items()} for s in modules})
