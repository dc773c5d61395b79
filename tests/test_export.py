"""`ftcompile export`: a trained checkpoint back into the user's model.

The reference is independent of the runtime: the original HuggingFace model trained in a plain
PyTorch loop (test_runtime.plain_training), and transformers' own from_pretrained reading the
exported folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch

from test_runtime import TOL, cfg_for, cli_args, plain_training, rel_error, run_cli

ARCHS = Path(__file__).parent / "archs" / "hf_models.py"


def _ftcompile(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftcompile", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT-2 (tied embedding and head) saved as a HuggingFace folder, compiled from it for 2
    GPUs, trained 3 steps of 1f1b on 2 ranks with a checkpoint."""
    import transformers as T

    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    T.GPT2LMHeadModel(cfg).save_pretrained(root / "hf")
    pkg = root / "pkg"
    c = _ftcompile("compile", "gpt2-tiny", "--pretrained", str(root / "hf"), "--gpus", "2", "--strategy", "seq",
                   "--schedule", "1f1b", "--replicas", "1", "--jobs", "1", "-q", "-o", str(pkg))
    assert c.returncode == 0, c.stderr[-2000:]
    run = cfg_for("1f1b")
    r = run_cli(*cli_args(run, pkg, root), "--checkpoint-dir", str(root / "ckpt"))
    assert r.returncode == 0, r.stderr[-2000:]
    return root, pkg, run


def test_exported_weights_load_with_from_pretrained_as_plain_training_left_them(trained, tmp_path):
    import transformers as T

    root, pkg, run = trained
    out = tmp_path / "finetuned"
    e = _ftcompile("export", str(pkg), str(root / "ckpt"), "-o", str(out))
    assert e.returncode == 0, e.stderr[-2000:]
    assert "step 3" in e.stderr and "tied name" in e.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    model, info = T.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()     # tied again
    want = plain_training(pkg, run, run.steps)
    got = dict(model.named_parameters())
    for n, t in want.items():
        assert rel_error(got[n].detach(), t) < TOL, n
    # what was there before training differs: the export is the trained model, not the start
    start = T.AutoModelForCausalLM.from_pretrained(root / "hf")
    assert rel_error(start.transformer.h[0].mlp.c_fc.weight.detach(), want["transformer.h.0.mlp.c_fc.weight"]) > 1e-4
    mask = os.umask(0)
    os.umask(mask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask     # as the umask allows


def test_export_never_overwrites_and_refuses_another_packages_checkpoint(trained, tmp_path):
    root, pkg, _ = trained
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    e = _ftcompile("export", str(pkg), str(root / "ckpt"), "-o", str(out))
    assert e.returncode == 2 and "exists" in e.stderr and "Traceback" not in e.stderr
    assert (out / "mine.txt").read_text() == "keep"
    other = tmp_path / "other"
    c = _ftcompile("compile", "bert-tiny", "--gpus", "2", "--strategy", "seq", "--schedule", "1f1b", "--jobs", "1",
                   "-q", "-o", str(other))
    assert c.returncode == 0, c.stderr[-2000:]
    e = _ftcompile("export", str(other), str(root / "ckpt"), "-o", str(tmp_path / "x"))
    assert e.returncode == 2 and "another package" in e.stderr, e.stderr
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".tmp-export-*"))


@pytest.mark.parametrize("name", ["bert-tiny", "t5-tiny", f"{ARCHS}:llama"])
def test_export_writes_the_models_state_dict_names(name, tmp_path):
    """What export writes is the model's own state_dict, tied names once: not the non-persistent
    buffers (BERT's position ids, Llama's rotary table) nor T5's lifted constant, which a package
    holds too. The reference is the eager model's state_dict()."""
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.runtime import load_package
    from ftcompile.runtime.export import exported
    from test_runtime import by_hand

    m = load_package(by_hand(tmp_path / "pkg", name, stages=2, gpus=2)).manifest
    names = exported(m)
    want = set(build_model(name, ModelOptions()).model.state_dict())
    assert set(names) | {a for n in names for a in m.params[n].aliases} == want
    assert len(names) == len(set(names))
