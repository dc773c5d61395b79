"""A stage output that is a view of the stage's own weight.

Gemma's RMSNorm computes `1 + weight.float()`; for a float32 weight `aten.to` returns the weight
itself, and a plan may cut between the cast and its reader. Under async the stage updates the
weight in place (U(j)) before the reader has run, so the reader saw the next step's weight: on
one rank always (wrong and repeatable), over gloo whenever the send had not left yet (runs of
one command differed). The reference is runtime.reference, the schedules' single-process
semantics, which hands each value on as it was computed.
"""

from __future__ import annotations

import textwrap

import pytest

from ftcompile.runtime import load_package
from ftcompile.runtime.data import load_dataset
from ftcompile.runtime.reference import reference_train
from test_runtime import (assert_engine_matches_reference, by_hand, cfg_for, cli_args, final_weights, losses,
                          rel_error, run_cli)

MODEL = """
import torch
from torch import nn

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(16))
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)
        self.d = nn.Linear(16, 16)

    def forward(self, x, y):
        s = self.scale.float()          # aten.to on a float32 weight: the weight itself
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        h = torch.tanh(self.c(h)) * (1.0 + s)
        return nn.functional.mse_loss(self.d(h), y)

def build():
    g = torch.Generator().manual_seed(0)
    return Scaled(), (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)), {}
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    root = tmp_path_factory.mktemp("aliased")
    (root / "scaled.py").write_text(textwrap.dedent(MODEL))
    pkg = by_hand(root / "pkg", f"{root / 'scaled.py'}:build", stages=2, gpus=2)
    m = load_package(pkg).manifest
    # the plan does cut there: stage 0 sends the cast weight to stage 1
    sent = [v for v in m.stages[0].outputs if 1 in m.values[v].consumers]
    assert "to" in sent, sent             # the value of `self.scale.float()`
    return pkg


def test_one_rank_hands_on_the_forwards_values_not_the_updated_weight(package):
    assert_engine_matches_reference(load_package(package), cfg_for("async", micro_batches=2), 4)


def test_two_ranks_train_as_the_reference_does(package, tmp_path):
    pkg = load_package(package)
    cfg = cfg_for("async", micro_batches=2, steps=4)
    r = run_cli(*cli_args(cfg, package, tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    ref = reference_train(pkg, load_dataset("synthetic", pkg.manifest, micro_batches=2, seed=cfg.seed), cfg, 4)
    assert losses(tmp_path / "log") == pytest.approx(ref.losses, rel=1e-6)
    got = final_weights(tmp_path / "ckpt")
    for w in ref.weights.values():
        for n, t in w.items():
            assert rel_error(got[n], t) < 1e-6, n
