"""A model calling a custom operator defined in this very file with ``torch.library.custom_op``.

Imported as a user file (``custom_op_model.py:build``), the module has no importable name, so
a generated stage cannot import what registers the operator: compile must say so, clearly.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.library.custom_op("ftctest::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.b(scaled_tanh(self.a(x), 2.0)).pow(2).mean()


def build():
    return Net().train(), (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),)
