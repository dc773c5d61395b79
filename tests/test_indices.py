"""Token ids and labels are checked on the host against the tables they index (ftcompile.indices).

The reference is the eager model itself: every range the compiler finds must be one the model
enforces (a value at the range's limit, at a position the range covers, makes the model fail),
must cover only positions the model reads (the same value outside the range's window, where the
window is narrower than the input, leaves the model working), and must let the loss's ignore
index through. A check that refused data the model accepts would be worse than none.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ftcompile.indices import index_ranges
from ftcompile.models import ModelOptions, build_model
from ftcompile.runtime.data import DataError, check_index_ranges
from ftcompile.trace import trace

ARCHS = Path(__file__).parent / "archs" / "hf_models.py"
MODELS = ["gpt2-tiny", "bert-tiny", "t5-tiny", f"{ARCHS}:llama", f"{ARCHS}:bart", f"{ARCHS}:albert"]


def _traced(name: str):
    built = build_model(name, ModelOptions())
    return built, trace(built.model, built.args, built.kwargs,
                        source={"model": built.name, "options": dataclasses.asdict(built.options)})


def _with(built, path: str, tensor):
    """The model's example call with the input at ``path`` replaced by ``tensor``."""
    args, kwargs = list(built.args), dict(built.kwargs)
    m = re.fullmatch(r"""kwargs\[(['"])(.+)\1\]""", path)
    if m:
        kwargs[m.group(2)] = tensor
    else:
        args[int(re.fullmatch(r"args\[(\d+)\]", path).group(1))] = tensor
    return args, kwargs


def _fails(built, path: str, tensor) -> bool:
    args, kwargs = _with(built, path, tensor)
    try:
        with torch.no_grad():
            built.model(*args, **kwargs)
    except (IndexError, RuntimeError) as exc:
        assert re.search(r"out of range|out of bounds", str(exc)), exc
        return True
    return False


def _example(built, path: str) -> torch.Tensor:
    args, kwargs = _with(built, path, None)
    m = re.fullmatch(r"""kwargs\[(['"])(.+)\1\]""", path)
    return (built.kwargs[m.group(2)] if m else built.args[int(path[5:-1])]).clone()


def _check_against_the_model(built, graph) -> dict:
    paths = {i["value"]: i["path"] for i in graph.inputs}
    found = index_ranges(graph)
    for value, ranges in found.items():
        path = paths[value]
        example = _example(built, path)
        for r in ranges:
            covered = tuple(slice(a, b) for a, b in r.window)
            x = example[covered]
            # the example the model was traced with is valid data
            assert bool((((x >= 0) & (x < r.limit)) | (x == (r.ignore if r.ignore is not None else -1))).all())
            first = tuple(a for a, _ in r.window)
            bad = example.clone()
            bad[first] = r.limit
            assert _fails(built, path, bad), (value, r)          # the model enforces the range
            bad[first] = -1 if r.ignore != -1 else -2
            assert _fails(built, path, bad), (value, r)
            if r.ignore is not None:
                ok = example.clone()
                ok[tuple(b - 1 for _, b in r.window)] = r.ignore      # the last position read: ignored
                assert not _fails(built, path, ok), (value, r)
            # positions no range of this input covers: the model does not read them there
            unread = torch.ones_like(example, dtype=torch.bool)
            for other in ranges:
                unread[tuple(slice(a, b) for a, b in other.window)] = False
            if bool(unread.any()):
                outside = example.clone()
                outside[unread] = r.limit + 7
                assert not _fails(built, path, outside), (value, r)
    return found


@pytest.mark.parametrize("name", MODELS)
def test_every_range_found_is_one_the_model_enforces(name):
    built, graph = _traced(name)
    found = _check_against_the_model(built, graph)
    ids = found.get("input_ids", [])
    assert any("embedding" in r.reads for r in ids), found        # every one of these embeds token ids
    if "labels" in built.kwargs:
        assert any(r.ignore == -100 for r in found.get("labels", [])), found
    if name in ("gpt2-tiny", f"{ARCHS}:llama"):     # the causal-LM loss shifts the labels: column 0 is unread
        seq = built.kwargs["labels"].shape[1]
        assert [r.window[1] for r in found["labels"]] == [(1, seq)]


class Indexing(nn.Module):
    """Each input reaches its table another way."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))
        self.emb = nn.Embedding(12, 4)
        self.head = nn.Linear(4, 6)

    def forward(self, pick, where, strided, shifted, masked, target):
        a = torch.index_select(self.table, 0, pick).sum()                  # pick < 10
        b = torch.gather(self.table, 1, where).sum()                      # where < 4 (along dim 1)
        c = self.emb(strided[:, ::2]).sum()                               # every other position only
        d = self.emb(shifted + 1).sum()                                   # values changed on the way
        logits = self.head(self.emb(pick[:2]).unsqueeze(0).expand(3, 2, 4)).reshape(6, 6)
        m = masked.masked_fill(masked > 100, -100)                        # junk masked out by the model
        loss = nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits, m)
        return loss + a + b + c + d


def _indexing():
    args = (torch.tensor([1, 2, 9]), torch.tensor([[0, 3]] * 10), torch.tensor([[1, 2, 3, 4]]),
            torch.tensor([[0, 10]]), torch.tensor([1, 2, 3, 4, 5, 0]), torch.tensor([0, 1, 2, 3, 4, 5]))
    built = type("Built", (), {"model": Indexing(), "args": args, "kwargs": {}})()
    return built, trace(built.model, args, {})


def test_only_paths_that_keep_the_values_are_checked():
    built, graph = _indexing()
    names = {i["value"]: i["path"] for i in graph.inputs}
    found = _check_against_the_model(built, graph)
    by_path = {names[v]: r for v, r in found.items()}
    assert sorted(r.limit for r in by_path["args[0]"]) == [10, 12]       # index_select's rows; the embedding's
    assert [r.limit for r in by_path["args[1]"]] == [4]
    assert [(r.limit, r.ignore) for r in by_path["args[5]"]] == [(6, -100)]
    # a strided slice, arithmetic and masked_fill: which values arrive is not known, so none is checked
    assert not {"args[2]", "args[3]", "args[4]"} & set(by_path)


class Moved(nn.Module):
    """Paths a reviewer found refusing good data: a square transpose then a slice (positions move
    between dimensions of one size), casts that change values, integer counts as a float target."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, square, narrowed, small, counts, wide):
        a = self.emb(square.t()[1:]).sum()                         # reads square[:, 1:], not square[1:]
        b = self.emb(narrowed.to(torch.uint8).long()).sum()          # 259 -> 3: valid
        c = self.emb(small.long()).sum()                             # uint8 input, widened: followed
        logits = self.head(self.emb(wide[:, 0]))
        d = nn.functional.cross_entropy(logits, counts.float())      # probabilities, not class indices
        return a + b + c + d


def test_transposes_value_changing_casts_and_float_targets_are_not_checked():
    args = (torch.tensor([[1, 2, 3, 4]] * 4), torch.tensor([[259, 3]]), torch.tensor([[5, 3]], dtype=torch.uint8),
            torch.tensor([[5, 3, 1], [0, 2, 7]]), torch.tensor([[1, 2], [3, 4]]))
    built = type("Built", (), {"model": Moved(), "args": args, "kwargs": {}})()
    graph = trace(built.model, args, {})
    names = {i["value"]: i["path"] for i in graph.inputs}
    found = {names[v]: r for v, r in _check_against_the_model(built, graph).items()}
    assert set(found) == {"args[2]", "args[4]"}, found         # the widened uint8 and the plain ids only
    assert [r.limit for r in found["args[2]"]] == [10]
    # the host check compares in int64: a limit above uint8's range does not wrap
    from ftcompile.runtime.manifest import GraphInput, IndexRange, Manifest

    gi = GraphInput("small", "args[2]", (1, 2), "uint8", index_ranges=(IndexRange(300, None, ((0, 1), (0, 2)), "t"),))
    m = Manifest(name="t", model={}, micro_batch_size=1, dtype="float32", num_gpus=1, schedule="gpipe",
                 micro_batches=1, recompute=False, optimizer="adam", stages=[], values={}, params={}, inputs=[gi],
                 outputs=[], loss=None, loss_stage=None)
    check_index_ranges([{"small": torch.tensor([[250, 3]], dtype=torch.uint8)}], m, "step 0")


def test_the_runtime_check_names_the_input_the_value_and_the_table():
    """check_index_ranges on a real package's manifest: values outside the window pass, a bad one
    inside is named with its position, the loss's ignore index passes."""
    from ftcompile.runtime.manifest import GraphInput, IndexRange, Manifest

    r = IndexRange(100, -100, ((0, 2), (1, 8)), "the loss's 100 classes")
    gi = GraphInput("labels", "kwargs['labels']", (2, 8), "int64", index_ranges=(r,))
    m = Manifest(name="t", model={}, micro_batch_size=2, dtype="float32", num_gpus=1, schedule="gpipe",
                 micro_batches=1, recompute=False, optimizer="adam", stages=[], values={}, params={}, inputs=[gi],
                 outputs=[], loss=None, loss_stage=None)
    good = torch.randint(0, 100, (2, 8))
    good[:, 0] = 12345                     # not read
    good[1, 3] = -100
    check_index_ranges([{"labels": good}], m, "step 4")
    bad = good.clone()
    bad[1, 5] = 100
    with pytest.raises(DataError, match=re.escape("step 4, micro-batch 1: input 'labels' (kwargs['labels']) holds "
                                                  "100 at position [1, 5], but it indexes the loss's 100 classes: "
                                                  "its values there must be 0..99, or -100 (ignored)")):
        check_index_ranges([{"labels": good}, {"labels": bad}], m, "step 4")
    check_index_ranges([{"labels": bad}], m, "step 4", inputs=["input_ids"])      # another rank's input


def test_synthetic_labels_with_an_ignore_index_stay_in_the_table(tmp_path):
    """Token-classification labels span -100 .. 4 in the example (-100 on the padding). The default
    synthetic data draws from that span but within the loss's window only from 0 .. 4: a uniform
    draw over the span was mostly out of range, and `ftcompile run` refused its own data. The
    reference is the eager model, which must accept every drawn micro-batch."""
    from ftcompile.cli import main
    from ftcompile.runtime import load_package
    from ftcompile.runtime.data import split_micro_batches, synthetic_batches
    from test_runtime import run_cli

    spec = f"{ARCHS}:bert_token_classification"
    out = tmp_path / "pkg"
    assert main(["compile", spec, "--gpus", "2", "--strategy", "seq", "--schedule", "1f1b", "--jobs", "1", "-q",
                 "-o", str(out)]) == 0
    m = load_package(out).manifest
    labels = next(gi for gi in m.inputs if gi.path == "kwargs['labels']")
    assert (labels.low, labels.high) == (-100, 4) and labels.index_ranges[0].ignore == -100
    built = build_model(spec, ModelOptions())
    batches = synthetic_batches(m, micro_batches=2, seed=0)
    seen = set()
    for step in range(3):
        micro = split_micro_batches(next(batches), m, 2)
        check_index_ranges(micro, m, f"step {step}")
        for mb in micro:
            by_path = {gi.path: mb[gi.value] for gi in m.inputs if gi.value in mb}
            args, kwargs = _with(built, "kwargs['labels']", by_path["kwargs['labels']"])
            kwargs["attention_mask"] = by_path["kwargs['attention_mask']"]
            args[0] = by_path["args[0]"]
            with torch.no_grad():
                assert torch.isfinite(built.model(*args, **kwargs).loss)       # no "out of bounds"
            seen |= set(by_path["kwargs['labels']"].unique().tolist())
    assert seen == {0, 1, 2, 3, 4}
    r = run_cli(str(out), "--nproc", "2", "--steps", "2", "--log-dir", str(tmp_path / "logs"))
    assert r.returncode == 0, r.stderr[-2000:]
