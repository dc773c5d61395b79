"""Single-process reference training of a package: its stages run one after another.

:func:`reference_train` replays exactly the weight-version semantics of a
schedule (:func:`~ftcompile.runtime.schedules.pipeline_schedules`): for every
micro-batch, each stage's forward uses the weights its ``version_f`` table
names and its backward (recomputing when the stage recomputes) the
``version_b`` weights, gradients accumulate per mini-batch, shared parameters
sum their holders' gradients, and every stage updates after each mini-batch.
For ``gpipe``/``1f1b`` every version is the current one, which is plain
training with gradient accumulation. The distributed engine must produce the
same weights and losses (up to float summation order); tests compare them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import optim as _optim
from .engine import TrainConfig, is_grad_value, micro_batch_seed, split_micro, value_tables
from .schedules import pipeline_schedules


@dataclass
class ReferenceResult:
    losses: dict[int, list[float]] = field(default_factory=dict)
    state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def step_losses(self) -> dict[int, float]:
        return {j: sum(v) / len(v) for j, v in sorted(self.losses.items())}


def _call(module, params, inputs, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        out = torch.func.functional_call(module, params, tuple(inputs), strict=False)
    return out if isinstance(out, tuple) else (out,)


def reference_train(pkg, batches, *, schedule: str = "gpipe", micro_batches: int = 4, config: TrainConfig,
                    recompute: bool | None = None) -> ReferenceResult:
    """Train ``config.steps`` mini-batches of ``batches`` in one process with ``schedule``'s weight versions."""
    m = pkg.manifest
    M, mbs = micro_batches, int(m["micro_batch_size"])
    loss_value, loss_stage = m["loss"]["value"], int(m["loss"]["stage"])
    producer, consumers, vspec, literal, _ = value_tables(m)
    in_shape = {g["value"]: g.get("shape") for g in m.get("graph_inputs", [])}
    specs = {int(s["id"]): s for s in sorted(m["stages"], key=lambda s: int(s["id"]))}
    scheds = pipeline_schedules(schedule, m["stages"], M, config.steps, loss_stage=loss_stage, recompute=recompute)
    shared = {p: sorted(int(x) for x in h) for p, h in m.get("shared_parameters", {}).items() if len(h) > 1}
    mods, train, opts, history = {}, {}, {}, {}
    for s, spec in specs.items():
        mod = pkg.build_stage(s, device="cpu")
        mod.train()
        names = set(spec.get("trainable", spec.get("params", [])))
        train[s] = {n: p for n, p in mod.named_parameters() if n in names}
        for n, p in mod.named_parameters():
            p.requires_grad_(n in names)
        opts[s] = _optim.build(list(train[s].values()), config)
        mods[s] = mod
        history[s] = {0: {n: p.detach().clone() for n, p in train[s].items()}}
    res = ReferenceResult()
    it = iter(batches)
    for j in range(config.steps):
        batch = next(it)
        for i in range(M):
            k = j * M + i
            acts: dict[str, torch.Tensor] = {}
            kept: dict[int, tuple] = {}
            for s, spec in specs.items():
                ins = []
                for inp in spec["inputs"]:
                    v = inp["value"]
                    if inp.get("from") == "input":
                        ins.append(split_micro(batch[v], in_shape.get(v), i, mbs))
                    elif v in literal:
                        ins.append(literal[v])
                    else:
                        ins.append(acts[v])
                sch = scheds[s]
                pf = {n: t.detach().requires_grad_(not sch.recompute) for n, t in history[s][sch.version_f[k]].items()}
                gins = [x.detach().requires_grad_(True) if _floating_input(inp, x, vspec, literal) else x
                        for inp, x in zip(spec["inputs"], ins)]
                seed = micro_batch_seed(config.seed, s, k)
                with torch.set_grad_enabled(not sch.recompute):
                    outs = _call(mods[s], pf, gins, seed)
                kept[s] = (ins, gins, outs, pf)
                for o, y in zip(spec["outputs"], outs):
                    if "literal" in o:
                        continue
                    acts[o["value"]] = y.detach()
                    if o["value"] == loss_value:
                        res.losses.setdefault(j, []).append(float(y.detach()))
            grads: dict[str, torch.Tensor] = {}
            for s in sorted(specs, reverse=True):
                spec, sch = specs[s], scheds[s]
                ins, gins, outs, pf = kept[s]
                if sch.recompute:
                    pf = {n: t.detach().requires_grad_(True) for n, t in history[s][sch.version_b[k]].items()}
                    gins = [x.detach().requires_grad_(True) if _floating_input(inp, x, vspec, literal) else x
                            for inp, x in zip(spec["inputs"], ins)]
                    outs = _call(mods[s], pf, gins, micro_batch_seed(config.seed, s, k))
                ys, gs = [], []
                for o, y in zip(spec["outputs"], outs):
                    if "literal" in o or not torch.is_tensor(y) or not y.requires_grad:
                        continue
                    if o["value"] == loss_value:
                        ys.append(y)
                        gs.append(torch.full_like(y, 1.0 / M))
                    elif is_grad_value(o) and o["value"] in grads:
                        ys.append(y)
                        gs.append(grads[o["value"]].reshape(y.shape))
                if ys:
                    torch.autograd.backward(ys, gs)
                for n, t in pf.items():
                    if t.grad is not None:
                        p = train[s][n]
                        p.grad = t.grad.clone() if p.grad is None else p.grad + t.grad
                for inp, x in zip(spec["inputs"], gins):
                    if _floating_input(inp, x, vspec, literal):
                        g = x.grad if x.grad is not None else torch.zeros_like(x)
                        v = inp["value"]
                        grads[v] = g if v not in grads else grads[v] + g
        # the update closing mini-batch j
        for p, holders in shared.items():
            total = None
            for h in holders:
                g = train[h][p].grad
                g = torch.zeros_like(train[h][p]) if g is None else g
                total = g.clone() if total is None else total + g
            for h in holders:
                train[h][p].grad = total.clone()
        if config.clip_grad_norm:
            sq = 0.0
            for s in specs:
                for n, p in train[s].items():
                    if p.grad is not None and (n not in shared or shared[n][0] == s):
                        sq += float(p.grad.double().pow(2).sum())
            for s in specs:
                _optim.clip_to(train[s].values(), math.sqrt(sq), config.clip_grad_norm)
        for s in specs:
            opt, sch = opts[s]
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sch is not None:
                sch.step()
            history[s][j + 1] = {n: p.detach().clone() for n, p in train[s].items()}
    res.state = {s: {n: t.detach().clone() for n, t in mods[s].state_dict().items()} for s in specs}
    return res


def _floating_input(inp: dict, x, vspec: dict, literal: dict) -> bool:
    v = inp["value"]
    return (inp.get("from") != "input" and v not in literal and torch.is_tensor(x)
            and x.is_floating_point() and is_grad_value(vspec[v]))
