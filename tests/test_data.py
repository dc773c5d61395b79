"""Training data (ftcompile.runtime.data): synthetic, stdlib text, user datasets, micro-batch splitting."""

from __future__ import annotations

import textwrap
from dataclasses import asdict

import pytest
import torch

from ftcompile.runtime import load_package
from ftcompile.runtime.data import (SAMPLE_INDEX, DataError, corpus_bytes, load_dataset, split_micro_batches, synthetic_batches,
                                    text_batches)

MODELS = ["gpt2-tiny", "t5-tiny", "bert-tiny", "vit-tiny"]
M = 3   # micro-batches per step in these tests


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    """name -> Manifest of a package compiled in-process, as `ftcompile compile NAME --strategy seq` does."""
    from ftcompile.cluster import load_cluster
    from ftcompile.codegen import compile_package
    from ftcompile.compile import compile_plan, plan_document
    from ftcompile.hardware import load_hardware
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.plan import Problem
    from ftcompile.profile import analytic_profile
    from ftcompile.trace import trace

    out = {}
    for name in MODELS:
        built = build_model(name, ModelOptions())
        graph = trace(built.model, built.args, built.kwargs,
                      source={"model": built.name, "options": asdict(built.options)})
        prof = analytic_profile(graph, load_hardware("cpu"), optimizer="adam")
        # (3 s a search: these tests read the package's inputs, not the plan's quality)
        result = compile_plan(Problem(graph, prof, load_cluster("2xcpu"), micro_batches=4), "seq", jobs=1,
                              time_limit=3)
        assert result.chosen is not None
        doc = plan_document(result, model=graph.source)
        path = tmp_path_factory.mktemp(name)
        compile_package(built=built, graph=graph, doc=doc, out_dir=str(path))   # with the inputs' value ranges
        out[name] = load_package(path).manifest
    return out


def by_arg(manifest):
    """argument name ('input_ids', 'labels', positional: traced name) -> GraphInput, tensor inputs only."""
    out = {}
    for gi in manifest.inputs:
        if gi.shape is not None:
            out[gi.path.split("'")[1] if gi.path.startswith("kwargs") else gi.value] = gi
    return out


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- synthetic

@pytest.mark.parametrize("name", MODELS)
def test_synthetic_shapes_dtypes_ranges(manifests, name):
    m = manifests[name]
    b = m.micro_batch_size
    it = synthetic_batches(m, micro_batches=M, seed=0)
    first, second = next(it), next(it)
    tensors = [gi for gi in m.inputs if gi.shape is not None]
    assert any(gi.shape is None for gi in m.inputs) == (name in ("gpt2-tiny", "t5-tiny"))   # use_cache
    assert set(first) == {gi.value for gi in tensors}
    for gi in tensors:
        t = first[gi.value]
        assert tuple(t.shape) == (M * b,) + tuple(gi.shape[1:])
        assert str(t.dtype) == "torch." + gi.dtype.removeprefix("torch.")
        if t.dtype.is_floating_point:
            assert t.std() > 0.5                    # ~ randn, not constant
        else:
            lo, hi = (gi.low, gi.high) if gi.low is not None else (0, 1)
            assert lo <= int(t.min()) and int(t.max()) <= hi
    assert not same(first, second)                  # the stream moves on


@pytest.mark.parametrize("name", MODELS)
def test_synthetic_is_deterministic_per_seed(manifests, name):
    m = manifests[name]
    a = synthetic_batches(m, micro_batches=M, seed=7)
    b = synthetic_batches(m, micro_batches=M, seed=7)
    c = synthetic_batches(m, micro_batches=M, seed=8)
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        assert same(x, y)
        assert not same(x, z)


def test_synthetic_attention_mask_keeps_its_constant_range(manifests):
    m = manifests["t5-tiny"]
    batch = next(synthetic_batches(m, micro_batches=M))
    assert torch.all(batch[by_arg(m)["attention_mask"].value] == 1)


def test_synthetic_rejects_bad_micro_batches(manifests):
    with pytest.raises(DataError, match="micro_batches"):
        synthetic_batches(manifests["gpt2-tiny"], micro_batches=0)


# --------------------------------------------------------------------------- text

def test_corpus_is_stdlib_source_and_cached():
    corpus = corpus_bytes()
    assert len(corpus) > 1_000_000
    assert b"# ---- os.py ----\n" in corpus and b"def makedirs(" in corpus
    assert b"# ---- site-packages/" not in corpus     # installed packages are not the stdlib
    assert corpus_bytes() is corpus                 # read once per process


def test_corpus_from_a_folder(tmp_path):
    (tmp_path / "b.py").write_text("print('b')\n")
    (tmp_path / "a.py").write_text("print('a')")
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "c.py").write_text("skipped")
    assert corpus_bytes(str(tmp_path)) == b"# ---- a.py ----\nprint('a')\n# ---- b.py ----\nprint('b')\n"
    with pytest.raises(DataError, match="does not exist"):
        corpus_bytes(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no readable"):
        corpus_bytes(str(tmp_path / "empty"))


def test_text_causal_lm_windows_are_stdlib_bytes(manifests):
    m = manifests["gpt2-tiny"]
    ids, labels = by_arg(m)["input_ids"], by_arg(m)["labels"]
    corpus = corpus_bytes()
    batch = next(text_batches(m, micro_batches=M, seed=0))
    assert set(batch) == {ids.value, labels.value, SAMPLE_INDEX}
    x, y = batch[ids.value], batch[labels.value]
    seq = ids.shape[1]
    for row, i in zip(x, batch[SAMPLE_INDEX].tolist()):            # the index names the window
        assert bytes(row.tolist()) == corpus[i * seq:(i + 1) * seq]
    assert x.shape == (M * m.micro_batch_size, ids.shape[1]) and x.dtype == torch.int64
    assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()    # the model shifts labels itself
    assert int(x.max()) < 256 <= ids.high + 1                     # bytes, within gpt2-tiny's vocabulary of 1000
    for row in x:
        window = bytes(row.tolist())
        assert window in corpus
    # and it reads as source text
    assert any(kw in bytes(x.flatten().tolist()).decode("utf-8", "replace") for kw in ("def ", "import ", "self", " = "))


def test_text_seq2seq_labels_follow_the_encoder_window(manifests):
    m = manifests["t5-tiny"]
    args = by_arg(m)
    ids, labels, mask = args["input_ids"], args["labels"], args["attention_mask"]
    enc, dec = ids.shape[1], labels.shape[1]
    assert enc != dec
    corpus = corpus_bytes()
    batch = next(text_batches(m, micro_batches=M, seed=0))
    assert set(batch) == {ids.value, labels.value, mask.value, SAMPLE_INDEX}
    assert batch[ids.value].shape == (M * m.micro_batch_size, enc)
    assert batch[labels.value].shape == (M * m.micro_batch_size, dec)
    assert torch.all(batch[mask.value] == 1) and batch[mask.value].dtype == torch.int64
    for src, tgt in zip(batch[ids.value], batch[labels.value]):
        assert bytes(src.tolist()) + bytes(tgt.tolist()) in corpus   # labels are the next bytes


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_text_is_deterministic_and_seeds_change_the_order(manifests, name):
    m = manifests[name]
    a, b = text_batches(m, micro_batches=M, seed=1), text_batches(m, micro_batches=M, seed=1)
    c = text_batches(m, micro_batches=M, seed=2)
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        assert same(x, y)
        assert not same(x, z)


def test_text_cycles_epochs_over_a_small_corpus(manifests, tmp_path):
    m = manifests["gpt2-tiny"]
    seq = by_arg(m)["input_ids"].shape[1]
    rows = M * m.micro_batch_size
    (tmp_path / "a.py").write_bytes(bytes(range(32, 127)))   # 3 windows only
    corpus = corpus_bytes(str(tmp_path))
    n = len(corpus) // seq
    assert n < rows                                  # every batch spans epochs
    ids = by_arg(m)["input_ids"].value
    seen = [bytes(r.tolist()) for _, batch in zip(range(4), text_batches(m, micro_batches=M, root=str(tmp_path)))
            for r in batch[ids]]
    windows = [corpus[i * seq:(i + 1) * seq] for i in range(n)]
    for e in range(len(seen) // n):                  # each epoch: every window exactly once
        assert sorted(seen[e * n:(e + 1) * n]) == sorted(windows)
    # a window keeps its index in every epoch (what AutoCache keys activations by)
    for _, batch in zip(range(4), text_batches(m, micro_batches=M, root=str(tmp_path))):
        for r, i in zip(batch[ids], batch[SAMPLE_INDEX].tolist()):
            assert bytes(r.tolist()) == windows[i]


def test_text_maps_bytes_into_a_small_vocabulary(manifests):
    from dataclasses import replace

    m = manifests["gpt2-tiny"]
    small = replace(m, inputs=[replace(gi, high=99.0) if gi.value == by_arg(m)["input_ids"].value else gi
                               for gi in m.inputs])
    plain = next(text_batches(m, micro_batches=M))
    mapped = next(text_batches(small, micro_batches=M))
    ids = by_arg(m)["input_ids"].value
    assert int(mapped[ids].max()) < 100
    assert torch.equal(mapped[ids], plain[ids] % 100)


@pytest.mark.parametrize("name", ["bert-tiny", "vit-tiny"])
def test_text_on_a_model_that_is_not_a_language_model(manifests, name):
    with pytest.raises(DataError) as e:
        text_batches(manifests[name], micro_batches=M)
    msg = str(e.value)
    assert "language models" in msg and "--data synthetic" in msg and name in msg
    assert ("start_positions" in msg) if name == "bert-tiny" else ("pixel_values" in msg)


# --------------------------------------------------------------------------- load_dataset

def test_load_dataset_builtin_specs(manifests, tmp_path):
    m = manifests["gpt2-tiny"]
    assert same(next(load_dataset("synthetic", m, micro_batches=M, seed=3)),
                next(synthetic_batches(m, micro_batches=M, seed=3)))
    assert same(next(load_dataset("text", m, micro_batches=M, seed=3)),
                next(text_batches(m, micro_batches=M, seed=3)))
    (tmp_path / "mod.py").write_text("x = 1\n" * 200)
    batch = next(load_dataset(f"text:{tmp_path}", m, micro_batches=M))
    assert bytes(batch["input_ids"][0].tolist()) in corpus_bytes(str(tmp_path))
    for bad in ("imagenet", "data.csv:load", "file.py:not-a-name", "text:"):
        with pytest.raises(DataError, match="synthetic|text:DIR"):
            load_dataset(bad, m, micro_batches=M)


USER_DATA = '''
import torch

def by_argument_names(manifest, micro_batches, seed):
    n = micro_batches * manifest.micro_batch_size
    g = torch.Generator().manual_seed(seed)
    for step in range(2):
        ids = torch.randint(0, 100, (n, 32), generator=g)
        yield {"input_ids": ids, "labels": ids.clone(), "use_cache": False}

def by_paths(manifest, micro_batches):          # no seed: it is left out of the call
    n = micro_batches * manifest.micro_batch_size
    return [{"args[0]": torch.zeros(n, 32, dtype=torch.int64), "kwargs['labels']": [[1] * 32] * n}]

def wrong_shape(manifest, micro_batches, seed):
    n = micro_batches * manifest.micro_batch_size
    yield {"input_ids": torch.zeros(n, 32, dtype=torch.int64), "labels": torch.zeros(n, 16, dtype=torch.int64)}

def wrong_dtype(**kw):
    n = kw["micro_batches"] * kw["manifest"].micro_batch_size
    yield {"input_ids": torch.zeros(n, 32, dtype=torch.int32), "labels": torch.zeros(n, 32, dtype=torch.int64)}

def missing_and_unknown(manifest, micro_batches, seed):
    n = micro_batches * manifest.micro_batch_size
    yield {"input_ids": torch.zeros(n, 32, dtype=torch.int64), "lables": torch.zeros(n, 32, dtype=torch.int64)}

def not_iterable(manifest, micro_batches, seed):
    return 42

def with_index(manifest, micro_batches, seed):
    n = micro_batches * manifest.micro_batch_size
    yield {"input_ids": torch.zeros(n, 32, dtype=torch.int64), "labels": torch.zeros(n, 32, dtype=torch.int64),
           "__index__": list(range(100, 100 + n))}

def bad_index(manifest, micro_batches, seed):
    n = micro_batches * manifest.micro_batch_size
    yield {"input_ids": torch.zeros(n, 32, dtype=torch.int64), "labels": torch.zeros(n, 32, dtype=torch.int64),
           "__index__": torch.zeros(n + 1)}
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_data.py"
    path.write_text(textwrap.dedent(USER_DATA))
    return path


def test_user_dataset_keyed_by_argument_names(manifests, user_file):
    m = manifests["gpt2-tiny"]
    args = by_arg(m)
    batches = list(load_dataset(f"{user_file}:by_argument_names", m, micro_batches=M, seed=5))
    assert len(batches) == 2
    for batch in batches:
        assert set(batch) == {args["input_ids"].value, args["labels"].value}
        assert batch[args["input_ids"].value].shape == (M * m.micro_batch_size, 32)
    again = list(load_dataset(f"{user_file}:by_argument_names", m, micro_batches=M, seed=5))
    assert all(same(x, y) for x, y in zip(batches, again))
    (batch,) = load_dataset(f"{user_file}:by_paths", m, micro_batches=M)
    assert batch[args["labels"].value].dtype == torch.int64 and torch.all(batch[args["labels"].value] == 1)
    micro = split_micro_batches(batch, m, M)
    assert len(micro) == M


def test_user_dataset_may_name_its_samples(manifests, user_file):
    m = manifests["gpt2-tiny"]
    (batch,) = load_dataset(f"{user_file}:with_index", m, micro_batches=M)
    n = M * m.micro_batch_size
    assert batch[SAMPLE_INDEX].dtype == torch.int64 and batch[SAMPLE_INDEX].tolist() == list(range(100, 100 + n))
    micro = split_micro_batches(batch, m, M)          # each micro-batch keeps its rows' indices
    assert [mb[SAMPLE_INDEX].tolist() for mb in micro] == [list(range(100 + i * m.micro_batch_size,
                                                                      100 + (i + 1) * m.micro_batch_size))
                                                           for i in range(M)]
    with pytest.raises(DataError, match=rf"'__index__' must hold one integer dataset index per sample, shape \[{n}\]"):
        next(load_dataset(f"{user_file}:bad_index", m, micro_batches=M))


def test_user_dataset_with_a_wrong_shape_names_the_input(manifests, user_file):
    m = manifests["gpt2-tiny"]
    batches = load_dataset(f"{user_file}:wrong_shape", m, micro_batches=M)
    with pytest.raises(DataError) as e:
        next(batches)
    msg = str(e.value)
    assert "'labels'" in msg and f"[{M * m.micro_batch_size}, 16]" in msg and f"[{M * m.micro_batch_size}, 32]" in msg


def test_user_dataset_errors(manifests, user_file):
    m = manifests["gpt2-tiny"]
    with pytest.raises(DataError, match=r"dtype torch.int32, expected torch.int64"):
        next(load_dataset(f"{user_file}:wrong_dtype", m, micro_batches=M))
    with pytest.raises(DataError, match=r"'lables' is not an input"):
        next(load_dataset(f"{user_file}:missing_and_unknown", m, micro_batches=M))
    with pytest.raises(DataError, match="not an iterable"):
        load_dataset(f"{user_file}:not_iterable", m, micro_batches=M)
    with pytest.raises(DataError, match="no function 'nope'.*by_argument_names"):
        load_dataset(f"{user_file}:nope", m, micro_batches=M)
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(f"{user_file.parent / 'other.py'}:f", m, micro_batches=M)
    broken = user_file.parent / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(DataError, match=r"dataset file: importing .*broken.py.* failed: SyntaxError"):
        load_dataset(f"{broken}:f", m, micro_batches=M)


# --------------------------------------------------------------------------- split_micro_batches

@pytest.mark.parametrize("name", MODELS)
def test_split_micro_batches(manifests, name):
    m = manifests[name]
    b = m.micro_batch_size
    batch = next(synthetic_batches(m, micro_batches=M))
    micro = split_micro_batches(batch, m, M)
    assert len(micro) == M
    for i, mb in enumerate(micro):
        assert mb.keys() == batch.keys()
        for gi in m.inputs:
            if gi.shape is not None:
                assert tuple(mb[gi.value].shape) == tuple(gi.shape)
                assert torch.equal(mb[gi.value], batch[gi.value][i * b:(i + 1) * b])


def test_split_micro_batches_mismatch(manifests):
    m = manifests["gpt2-tiny"]
    batch = next(synthetic_batches(m, micro_batches=M))
    with pytest.raises(DataError, match=rf"'input_ids'.*shape \[{M * m.micro_batch_size}, 32\], expected "
                                        rf"\[{(M + 1) * m.micro_batch_size}, 32\]"):
        split_micro_batches(batch, m, M + 1)
    del batch["labels"]
    with pytest.raises(DataError, match="missing input.*labels"):
        split_micro_batches(batch, m, M)


def test_data_module_imports_no_compiler():
    import subprocess
    import sys

    code = ("import sys, ftcompile.runtime.data; "
            "bad = [m for m in sys.modules if m.startswith(('ftcompile.', 'transformers')) "
            "and not m.startswith('ftcompile.runtime')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
