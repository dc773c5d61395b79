"""Held-out evaluation of a checkpoint (:mod:`ftcompile.runtime.evaluation`).

The reference is the original Hugging Face model (rebuilt from the zoo, not the package's stage
modules) with the checkpoint's weights loaded by ``load_state_dict``, in eval mode, called on the
same micro-batches: its mean loss must be what the package's evaluation reports.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ftcompile.runtime import load_package
from ftcompile.runtime import checkpoint as ckpt
from ftcompile.runtime.data import DataError, split_micro_batches, text_batches
from ftcompile.runtime.evaluation import EvaluationError, evaluate, evaluate_checkpoint

from test_runtime import call_of, compiled


@pytest.fixture(scope="module")
def seq2(tmp_path_factory):
    return compiled(tmp_path_factory.mktemp("eval") / "seq", "gpt2-tiny", "seq", 2)


def _perturbed_checkpoint(pkg, root, step: int = 7) -> dict[str, torch.Tensor]:
    """Every stage's weights moved by seeded noise, saved as the checkpoint of ``step`` (one rank, as a run saves
    it); returns the weights by canonical name."""
    g = torch.Generator().manual_seed(11)
    state, weights = {}, {}
    for spec in pkg.manifest.stages:
        mod = pkg.build_stage(spec.id)
        ws = {}
        for n, t in mod.state_dict().items():
            if n not in weights:
                weights[n] = t + 0.05 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
            ws[n] = weights[n]
        state[spec.id] = {"weights": ws, "optimizer": {}}
    m = pkg.manifest
    ckpt.save(root, step, state, meta={"run_id": "test", "package": m.generator.get("graph_hash"), "config": {}})
    return weights


def _plain_loss(pkg, weights: dict[str, torch.Tensor], batches, M: int) -> float:
    from ftcompile.models import ModelOptions, build_model

    m = pkg.manifest
    model = build_model(m.model["name"], ModelOptions(**{k: v for k, v in m.model["options"].items()
                                                          if k in ("batch_size", "seq_len")})).model.eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)   # tied to wte
    assert torch.equal(model.lm_head.weight, weights["transformer.wte.weight"])
    losses = []
    with torch.no_grad():
        for b in batches:
            for mb in split_micro_batches(b, m, M):
                args, kwargs = call_of(m, mb)
                losses.append(float(model(*args, **kwargs)[0]))
    return sum(losses) / len(losses)


def test_checkpoint_loss_on_held_out_text_is_the_plain_models(seq2, tmp_path):
    pkg = load_package(seq2)
    M = 3
    batches = list(itertools.islice(text_batches(pkg.manifest, micro_batches=M, seed=5), 2))
    weights = _perturbed_checkpoint(pkg, tmp_path / "ck")
    got = evaluate_checkpoint(pkg, tmp_path / "ck", batches, micro_batches=M)          # the folder's latest
    want = _plain_loss(pkg, weights, batches, M)
    assert got.step == 7 and got.micro_batches == 2 * M and got.samples == 2 * M * pkg.manifest.micro_batch_size
    assert abs(got.loss - want) < 1e-5 * max(1.0, abs(want)), (got.loss, want)
    # a step folder names the same checkpoint; the package's own weights give another loss (dropout off: stable)
    again = evaluate_checkpoint(pkg, tmp_path / "ck" / "step-00000007", batches, micro_batches=M)
    assert again.loss == got.loss
    own = evaluate(pkg, batches, micro_batches=M)
    assert abs(own.loss - got.loss) > 1e-3


def test_checkpoint_of_another_model_or_no_data_is_refused(seq2, tmp_path):
    pkg = load_package(seq2)
    M = 2
    batches = list(itertools.islice(text_batches(pkg.manifest, micro_batches=M, seed=0), 1))
    _perturbed_checkpoint(pkg, tmp_path / "ck")
    weights = ckpt.load_weights(ckpt.latest(tmp_path / "ck"))
    weights.pop("transformer.h.0.attn.c_attn.weight")
    with pytest.raises(EvaluationError, match="lacks transformer.h.0.attn.c_attn.weight"):
        evaluate(pkg, batches, micro_batches=M, weights=weights)
    with pytest.raises(EvaluationError, match="no batch"):
        evaluate(pkg, [], micro_batches=M)
    with pytest.raises(EvaluationError, match="neither a checkpoint folder"):
        evaluate_checkpoint(pkg, tmp_path, batches, micro_batches=M)
    bad = {k: v.clone() for k, v in batches[0].items()}
    bad["input_ids"][-1, -1] = 1000                # gpt2-tiny's vocabulary is 1000 tokens
    with pytest.raises(DataError, match=r"held-out batch 1, micro-batch 1: input 'input_ids' \(args\[0\]\) holds "
                                        r"1000 at position \[1, 31\], but it indexes the embedding"):
        evaluate(pkg, [batches[0], bad], micro_batches=M)


def test_evaluate_command_prints_the_plain_models_loss(seq2, tmp_path):
    """`ftcompile evaluate PACKAGE CHECKPOINT --data text --batches 2`: the same batches as
    `ftcompile run --data text` draws (seed 0), the loss the plain model gives; bad input refused."""
    import json
    import subprocess
    import sys

    pkg = load_package(seq2)
    M = pkg.manifest.micro_batches
    weights = _perturbed_checkpoint(pkg, tmp_path / "ck")
    batches = list(itertools.islice(text_batches(pkg.manifest, micro_batches=M, seed=0), 2))
    want = _plain_loss(pkg, weights, batches, M)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "ftcompile", "evaluate", *map(str, args)], capture_output=True,
                              text=True)

    r = cli(seq2, tmp_path / "ck", "--data", "text", "--batches", 2, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["step"] == 7 and out["micro_batches"] == 2 * M
    assert abs(out["loss"] - want) < 1e-5 * max(1.0, abs(want)), (out, want)
    r = cli(seq2, tmp_path / "ck", "--data", "text", "--batches", 2)
    assert r.returncode == 0 and f"{out['loss']:.6f}" in r.stdout, r.stdout + r.stderr
    for args, says in (((seq2, tmp_path), "neither a checkpoint folder"),
                       ((tmp_path / "nope", tmp_path / "ck"), "no package folder"),
                       ((seq2, tmp_path / "ck", "--batches", "0"), "--batches")):
        r = cli(*args)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
