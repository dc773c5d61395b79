"""Every stage of a package in one process, run one after another on one device.

This is the pipeline without the pipelining: each stage's inputs are cut from
the autograd graph of the stage that made them (as when they arrive over a
wire), each stage runs its own backward with the gradients of its outputs, and
the gradients of its inputs go back to their producers. ``ftcompile verify``
compares it with the original model; on a single GPU it trains the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from .manifest import Manifest, StageSpec
from .engine import accepts_update_buffers
from .package import Package


@dataclass
class StageRun:
    """A stage's forward on one micro-batch, kept for its backward."""

    spec: StageSpec
    inputs: list[torch.Tensor | object]      # as given to forward (boundary tensors are fresh leaves)
    outputs: tuple


@dataclass
class LocalPipeline:
    """The stages of ``package`` built on ``device``; see the module docstring."""

    package: Package
    device: torch.device
    modules: dict[int, torch.nn.Module] = field(default_factory=dict)

    @property
    def order(self) -> list[int]:
        """Stage ids, every stage after those it reads from (checked when the manifest loaded)."""
        return self.package.manifest.order

    @classmethod
    def build(cls, package: Package, device: str | torch.device = "cpu", *,
              dtype: torch.dtype | None = None) -> "LocalPipeline":
        device = torch.device(device)
        modules = {s.id: package.build_stage(s.id, device, dtype=dtype) for s in package.manifest.stages}
        return cls(package, device, modules)

    @property
    def manifest(self) -> Manifest:
        return self.package.manifest

    def train(self, mode: bool = True) -> "LocalPipeline":
        for m in self.modules.values():
            m.train(mode)
        return self

    def zero_grad(self) -> None:
        for m in self.modules.values():
            m.zero_grad(set_to_none=True)

    def forward(self, inputs: Mapping[str, torch.Tensor], *, seed: int = 0, grad: bool = True,
                update_buffers: bool = True) -> tuple[dict[str, object], list[StageRun]]:
        """Run every stage once; returns every value made (by name) and the runs for :meth:`backward`.

        ``update_buffers=False`` leaves every buffer (BatchNorm running statistics) as it is.
        """
        m = self.manifest
        values: dict[str, object] = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v)
                                     for k, v in inputs.items()}
        runs: list[StageRun] = []
        for sid in self.order:
            spec = m.stage(sid)
            args = []
            for v in spec.inputs:
                x = values[v]
                if isinstance(x, torch.Tensor):
                    x = x.detach()
                    if grad and m.values[v].requires_grad and m.values[v].is_floating:
                        x.requires_grad_(True)
                args.append(x)
            with torch.set_grad_enabled(grad):
                outs = self.call(sid, args, seed=seed, update_buffers=update_buffers)
            for v, out in zip(spec.outputs, outs):
                values[v] = out
            runs.append(StageRun(spec, args, tuple(outs)))
        return values, runs

    def call(self, stage_id: int, args: list, *, seed: int, update_buffers: bool = True) -> tuple:
        """One stage's forward on ``args``; ``update_buffers=False`` as a recomputation calls it."""
        module = self.modules[stage_id]
        if not update_buffers and accepts_update_buffers(module):
            return module(*args, seed=seed, update_buffers=False)
        return module(*args, seed=seed)

    def recompute(self, run: StageRun, *, seed: int) -> tuple:
        """Run a stage's forward again on the inputs of ``run``, as the runtime does in backward.

        With autograd on (the runtime recomputes to differentiate, and some kernels, such
        as the CPU LSTM, differ in the last bits under ``no_grad``) and without updating
        buffers (the forward already did).
        """
        args = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                for x in run.inputs]
        with torch.enable_grad():
            return self.call(run.spec.id, args, seed=seed, update_buffers=False)

    def buffers(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each stage's buffers (running statistics...) by canonical name."""
        return {sid: {n: b for n, b in m.named_buffers() if n != "_anchor"} for sid, m in self.modules.items()}

    def backward(self, runs: list[StageRun], loss: str | None = None, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Back-propagate from ``loss`` (default: the model's) stage by stage; returns input-value gradients."""
        m = self.manifest
        loss = loss or m.loss
        grads: dict[str, torch.Tensor] = {}
        for run in reversed(runs):
            outs, gs = [], []
            for v, out in zip(run.spec.outputs, run.outputs):
                if not (isinstance(out, torch.Tensor) and out.requires_grad):
                    continue
                if v == loss:
                    outs.append(out)
                    gs.append(torch.full_like(out, scale))
                elif v in grads:
                    outs.append(out)
                    gs.append(grads[v])
            if outs:
                torch.autograd.backward(outs, gs)
            for v, x in zip(run.spec.inputs, run.inputs):
                if isinstance(x, torch.Tensor) and x.requires_grad and x.grad is not None:
                    grads[v] = grads[v] + x.grad if v in grads else x.grad
        return grads

    def parameter_grads(self) -> dict[str, torch.Tensor | None]:
        """Each trainable tensor's gradient by canonical name; a shared tensor's copies summed."""
        out: dict[str, torch.Tensor | None] = {}
        for sid, module in self.modules.items():
            for name, p in module.named_parameters():
                g = p.grad
                if name in out and out[name] is not None and g is not None:
                    out[name] = out[name] + g
                elif name not in out or out[name] is None:
                    out[name] = g
        return out

    def sum_shared_grads(self) -> None:
        """Give every copy of a shared tensor the sum of all copies' gradients (they then take the same step)."""
        for name, holders in self.manifest.shared_params().items():
            params = [dict(self.modules[h].named_parameters()).get(name) for h in holders]
            params = [p for p in params if p is not None]
            total = None
            for p in params:
                if p.grad is not None:
                    total = p.grad.clone() if total is None else total + p.grad
            for p in params:
                if total is not None:
                    p.grad = total.clone()
