"""Training data for a generated package: synthetic, a real offline text corpus, or the user's own.

A package runs micro-batches of exactly the traced shapes: every graph input
has the shape it had when the model was traced, whose dim 0 is the traced
batch size ``b`` (:attr:`Manifest.micro_batch_size`). A training step runs
``micro_batches`` micro-batches, so a step's data is one :data:`Batch`: a dict
from graph input value name (:attr:`GraphInput.value`) to a tensor of the
traced shape with dim 0 multiplied by ``micro_batches``.
:func:`split_micro_batches` cuts it into the micro-batches the stages run.

Every source is an endless (or, for a user's dataset, possibly finite)
iterator of batches, deterministic given ``seed``: each process of a job
builds the same iterator and draws the same batches, with no communication.

* :func:`synthetic_batches`: random inputs of the right shapes, dtypes and
  value ranges (for throughput runs and smoke tests).
* :func:`text_batches`: language-model fine-tuning on the source of Python's
  standard library (present on every machine, so a real corpus without a
  download), byte-level tokens.
* :func:`load_dataset`: chooses one from a command-line spec, including a
  user function ``path/to/file.py:function`` whose batches are checked
  against the manifest.

Problems with the data are :class:`DataError` messages saying what is wrong
and what to do. The module imports only torch, numpy and the standard
library, never the compiler.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .manifest import GraphInput, Manifest, torch_dtype
from .userfile import UserFileError, import_user_file

__all__ = ["Batch", "DataError", "SAMPLE_INDEX", "corpus_bytes", "load_dataset", "split_micro_batches",
           "synthetic_batches", "text_batches"]

Batch = dict[str, torch.Tensor]
"""One training step's data: graph input value name -> tensor of shape ``[micro_batches * b, ...]``."""

SAMPLE_INDEX = "__index__"
"""The optional key of a batch holding each row's dataset index (int64, shape ``[micro_batches * b]``):
what names a sample across epochs (``text`` data gives its windows' indices; a user's data may give
its own). AutoCache (:mod:`ftcompile.runtime.cache`) keys cached activations by it. A dunder name,
so that no model argument can take it."""

# Input names (kwargs keys, or the traced names of positional arguments) that
# text_batches knows how to fill, by role.
_TOKEN_ROLES = ("input_ids", "labels", "decoder_input_ids")
_MASK_ROLES = ("attention_mask", "decoder_attention_mask")
# Directories below a corpus root that hold installed packages or bytecode,
# not the standard library's own source.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_DATA_HELP = ("use `--data synthetic`, `--data text` (language models), or your own data with "
              "`--data path/to/file.py:function`")


class DataError(ValueError):
    """The data does not fit the package, or cannot be read; the message says what is wrong and what to do."""


# --------------------------------------------------------------------------- helpers

def _torch_dtype(gi: GraphInput) -> torch.dtype:
    """The torch dtype of a graph input; manifests spell it ``"int64"`` (``"torch.int64"`` is accepted)."""
    dt = torch_dtype(gi.dtype)
    if dt is None:
        raise DataError(f"graph input {gi.value!r} ({gi.path}) has dtype {gi.dtype!r}, which is not a torch "
                        "dtype; the manifest is damaged: regenerate the package with `ftcompile compile`")
    return dt


def _tensor_inputs(manifest: Manifest) -> list[GraphInput]:
    """The graph inputs data must provide: tensors (constants the trace specialised are skipped)."""
    return [gi for gi in manifest.inputs if gi.shape is not None]


def _check_micro_batches(micro_batches: Any) -> int:
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise DataError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    return micro_batches


def _step_shape(gi: GraphInput, manifest: Manifest, micro_batches: int) -> tuple[int, ...]:
    """The shape of ``gi`` in a whole step's batch: the traced shape with dim 0 times ``micro_batches``."""
    b = manifest.micro_batch_size
    shape = tuple(gi.shape or ())
    # Micro-batches are cut along dim 0, so an input without the batch there
    # (a scalar, a table shared by all samples) cannot be batched.
    if not shape or shape[0] != b:
        raise DataError(f"graph input {gi.value!r} ({gi.path}) has traced shape {list(shape)}, whose dim 0 is not "
                        f"the traced batch size {b}: micro-batches are cut along dim 0, so every tensor input "
                        "must be batched there; change the model so the batch is the first dimension")
    return (b * micro_batches,) + shape[1:]


def _arg_name(gi: GraphInput) -> str:
    """The name the model's call knows an input by: the kwargs key, else (positional) its traced name."""
    m = re.fullmatch(r"""kwargs\[(['"])(.+)\1\]""", gi.path)
    return m.group(2) if m else gi.value


def _describe(manifest: Manifest) -> str:
    """The model's tensor inputs as ``name [shape] dtype``, for messages."""
    return ", ".join(f"{_arg_name(gi)} {list(gi.shape or ())} {gi.dtype}" for gi in _tensor_inputs(manifest)) \
        or "no tensor inputs"


def _model_name(manifest: Manifest) -> str:
    return str((manifest.model or {}).get("name") or manifest.name)


# --------------------------------------------------------------------------- synthetic

def synthetic_batches(manifest: Manifest, *, micro_batches: int, seed: int = 0) -> Iterator[Batch]:
    """Endless random batches of the traced shapes, dtypes and value ranges.

    Parameters
    ----------
    manifest : Manifest
        The package manifest: its tensor graph inputs and traced batch size ``b``.
    micro_batches : int
        Micro-batches per step: every tensor's dim 0 is ``micro_batches * b``.
    seed : int, optional (default=0)
        Seeds the one random generator the iterator draws from, so every process
        given the same seed draws the same batches.

    Yields
    ------
    batch : Batch
        Graph input value name -> tensor of the traced shape with dim 0 multiplied
        by ``micro_batches``, on the CPU. Floating inputs are standard normal
        (a floating input whose example was constant, ``low == high``, keeps that
        value: it is a mask or a scale, not data). Integer and bool inputs are
        uniform on the integers in ``[low, high]`` of the traced example (token
        ids, labels and positions stay valid), or in ``[0, 1]`` where the
        manifest records no range; where they reach a table (an embedding, a
        loss's classes: ``GraphInput.index_ranges``) they are drawn from the part
        of that range the table holds. Constant inputs (shape ``None``) are skipped.

    Raises
    ------
    DataError
        If ``micro_batches`` is not a positive integer, or an input's dim 0 is
        not the traced batch size.

    Examples
    --------
    >>> batches = synthetic_batches(package.manifest, micro_batches=4, seed=0)  # doctest: +SKIP
    >>> next(batches)["input_ids"].shape                                        # doctest: +SKIP
    torch.Size([8, 32])
    """
    micro_batches = _check_micro_batches(micro_batches)
    # Work out every input's recipe before the first batch, so a bad manifest fails at once.
    recipes = [(gi.value, _step_shape(gi, manifest, micro_batches), _torch_dtype(gi), gi.low, gi.high,
                gi.index_ranges) for gi in _tensor_inputs(manifest)]
    return _synthetic(recipes, seed, manifest.micro_batch_size)


def _synthetic(recipes: list, seed: int, b: int) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(int(seed))
    while True:
        batch: Batch = {}
        for value, shape, dtype, low, high, ranges in recipes:
            if dtype.is_floating_point or dtype.is_complex:
                if low is not None and high is not None and low == high:
                    batch[value] = torch.full(shape, low, dtype=dtype)
                else:
                    # Half types are drawn in float32: the same numbers whatever the dtype.
                    draw = dtype if dtype.itemsize >= 4 or dtype.is_complex else torch.float32
                    batch[value] = torch.randn(shape, generator=g, dtype=draw).to(dtype)
            else:
                lo, hi = 0, 1
                if low is not None and high is not None:
                    lo, hi = math.ceil(min(low, high)), math.floor(max(low, high))
                    if lo > hi:   # no integer in a fractional range: fall back rather than fail
                        lo, hi = 0, 1
                if dtype == torch.bool:
                    lo, hi = max(lo, 0), min(hi, 1)
                    batch[value] = torch.randint(lo, hi + 1, shape, generator=g).to(torch.bool)
                else:
                    batch[value] = torch.randint(lo, hi + 1, shape, generator=g, dtype=dtype)
                    if ranges:
                        _within_tables(batch[value], ranges, lo, hi, b, g)
        yield batch


def _within_tables(t: torch.Tensor, ranges, lo: int, hi: int, b: int, g: torch.Generator) -> None:
    """Redraw, in place, the values of ``t`` (a step's batch of micro-batches of ``b`` rows) where
    they reach a table (:attr:`GraphInput.index_ranges`), so that they index it: the example's
    range can be wider than the table (labels of -100, the ignore index, and 0..4 span -100..4; a
    uniform draw there would be mostly out of range). A window whose example values were all
    ignored (nothing of the example in the table) keeps the ignore index."""
    # Smallest table last: its draw then lies in every larger one whose window overlaps it.
    for r in sorted(ranges, key=lambda r: -r.limit):
        if len(r.window) != t.dim():
            continue
        a, z = max(lo, 0), min(hi, r.limit - 1)
        if (a, z) == (lo, hi):
            continue          # the whole draw lies in the table
        (r0, r1), rest = r.window[0], tuple(slice(x, y) for x, y in r.window[1:])
        for i in range(t.shape[0] // b):
            part = t[(slice(i * b + r0, i * b + r1),) + rest]
            if a <= z:
                part.copy_(torch.randint(a, z + 1, part.shape, generator=g, dtype=t.dtype))
            elif r.ignore is not None and lo <= r.ignore <= hi:
                part.fill_(r.ignore)
            else:
                part.copy_(torch.randint(0, r.limit, part.shape, generator=g, dtype=t.dtype))


# --------------------------------------------------------------------------- text

def corpus_bytes(root: str | None = None) -> bytes:
    """The text corpus: the ``*.py`` files under ``root``, concatenated.

    Parameters
    ----------
    root : str or None, optional (default=None)
        A folder, searched recursively (folders named ``site-packages``,
        ``dist-packages`` and ``__pycache__`` below it are skipped: installed
        packages are not the corpus), or a single file. ``None``: the Python
        standard library, ``sysconfig.get_paths()["stdlib"]``.

    Returns
    -------
    corpus : bytes
        The files in sorted order of their paths relative to ``root``, each
        preceded by the line ``# ---- <relative path> ----`` and ending in a
        newline. Files that are not valid UTF-8 are left out (the standard
        library's tests hold a few deliberately broken ones). The result is
        cached per process and root, so every call after the first is free.

    Raises
    ------
    DataError
        If ``root`` does not exist or holds no readable ``*.py`` file.

    Notes
    -----
    The corpus is the same on every process of a job only if every machine
    has the same Python (or the same files under ``root``).
    """
    root = sysconfig.get_paths()["stdlib"] if root is None else os.path.expanduser(str(root))
    return _corpus(os.path.realpath(root))


@functools.lru_cache(maxsize=4)
def _corpus(root: str) -> bytes:
    if os.path.isfile(root):
        files = [(os.path.basename(root), root)]
    elif os.path.isdir(root):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
            for n in names:
                if n.endswith(".py"):
                    p = os.path.join(d, n)
                    files.append((os.path.relpath(p, root).replace(os.sep, "/"), p))
    else:
        raise DataError(f"text corpus {root} does not exist: give a folder of *.py files (`--data text:DIR`), "
                        "or `--data text` for the Python standard library")
    parts = []
    for rel, path in sorted(files):
        try:
            with open(path, "rb") as f:
                data = f.read()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data:
            continue
        parts.append(f"# ---- {rel} ----\n".encode())
        parts.append(data if data.endswith(b"\n") else data + b"\n")
    if not parts:
        raise DataError(f"text corpus {root} holds no readable UTF-8 *.py file: give a folder of Python "
                        "source (`--data text:DIR`), or `--data text` for the Python standard library")
    return b"".join(parts)


def data_fingerprint(spec: str) -> str | None:
    """A digest of what the data spec reads, where ftcompile can tell: the text corpus's bytes
    (``text``, ``text:DIR``), a user data file's source (not what its function may read besides);
    None for synthetic data, or where the source cannot be read (loading it says why). Checkpoints
    record it, so that a resumed run whose data changed under the same spec is told."""
    import hashlib

    spec = str(spec).strip()
    try:
        if spec == "text" or spec.startswith("text:"):
            root = spec[len("text:"):] if spec.startswith("text:") else None
            if root == "":
                return None           # refused by load_dataset: no corpus to hash
            data = corpus_bytes(root)
        elif is_user_data(spec):
            data = Path(os.path.expanduser(spec.rpartition(":")[0])).read_bytes()
        else:
            return None
    except (DataError, OSError):
        return None
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def text_batches(manifest: Manifest, *, micro_batches: int, seed: int = 0,
                 root: str | None = None) -> Iterator[Batch]:
    """Endless language-model batches cut from a real corpus, byte-level tokens.

    The corpus (:func:`corpus_bytes`: by default the Python standard library's
    source) is cut into consecutive non-overlapping windows of a fixed length;
    each epoch visits every window once, in an order shuffled from ``seed``;
    epochs follow each other without end, each in a new order. A batch takes
    the next ``micro_batches * b`` windows. Each byte is one token: ids
    ``0..255``.

    Inputs are filled by role, found from their names in the model's call
    (``kwargs['labels']`` -> ``labels``, positional ones by traced name):

    * causal LM (``input_ids``, ``labels`` of the same shape ``[b, seq_len]``,
      e.g. gpt2-*): windows of ``seq_len`` bytes, ``labels`` equal to
      ``input_ids`` (the model shifts labels itself, as Hugging Face models do);
    * sequence-to-sequence (``labels`` of another length than ``input_ids``, a
      ``decoder_input_ids`` input, or a model built with a ``decoder_len``;
      e.g. t5-*): windows of ``encoder_len + decoder_len`` bytes, ``input_ids``
      the first ``encoder_len``, ``labels`` the next ``decoder_len``, and
      ``decoder_input_ids`` (if the model takes it) the labels shifted right
      with ``0`` as start token;
    * ``attention_mask`` and ``decoder_attention_mask`` inputs are all ones.

    Parameters
    ----------
    manifest : Manifest
        The package manifest.
    micro_batches : int
        Micro-batches per step: every tensor's dim 0 is ``micro_batches * b``.
    seed : int, optional (default=0)
        Seeds the epoch orders; every process given the same seed draws the same
        batches.
    root : str or None, optional (default=None)
        The corpus folder or file (see :func:`corpus_bytes`); ``None``: the
        Python standard library.

    Yields
    ------
    batch : Batch
        Graph input value name -> tensor in the input's dtype, on the CPU; and
        :data:`SAMPLE_INDEX` -> each row's window index (the same window in
        every epoch).

    Raises
    ------
    DataError
        If the model is not a language model with ``input_ids`` and ``labels``
        (the message lists its inputs), takes an input this function cannot
        fill, or the corpus is missing or shorter than one batch's window.

    Notes
    -----
    Token ids must be below the model's vocabulary size. The vocabulary is at
    least ``high + 1`` of ``input_ids`` (the largest id in the traced example);
    where that bound is below 256, byte ``x`` becomes token ``x % (high + 1)``,
    so ids stay valid at the price of merging some bytes. Where the manifest
    records no range, the vocabulary is assumed to hold all 256 bytes.
    """
    micro_batches = _check_micro_batches(micro_batches)
    by_name: dict[str, GraphInput] = {}
    for gi in _tensor_inputs(manifest):
        by_name[_arg_name(gi)] = gi
    other = sorted(set(by_name) - set(_TOKEN_ROLES) - set(_MASK_ROLES))
    lacking = [n for n in ("input_ids", "labels") if n not in by_name]
    if lacking or other:
        why = "; ".join(([f"it takes no {' and no '.join(lacking)}"] if lacking else [])
                        + ([f"text data cannot fill {', '.join(other)}"] if other else []))
        raise DataError(f"text data is for language models (gpt2-*, t5-*: token input_ids and labels), but model "
                        f"{_model_name(manifest)!r} is not one: {why}. Its inputs: {_describe(manifest)}. "
                        f"Use `--data synthetic`, or your own data with `--data path/to/file.py:function`")
    for name in _TOKEN_ROLES:
        gi = by_name.get(name)
        if gi is not None and (len(gi.shape or ()) != 2 or _torch_dtype(gi).is_floating_point
                               or _torch_dtype(gi) == torch.bool):
            raise DataError(f"text data fills {name} with token ids of shape [batch, length], but model "
                            f"{_model_name(manifest)!r} takes {name} {list(gi.shape or ())} {gi.dtype}. "
                            f"Use `--data synthetic`, or your own data with `--data path/to/file.py:function`")
    ids, labels = by_name["input_ids"], by_name["labels"]
    enc_len, dec_len = ids.shape[1], labels.shape[1]
    options = (manifest.model or {}).get("options") or {}
    seq2seq = ("decoder_input_ids" in by_name or "decoder_attention_mask" in by_name or enc_len != dec_len
               or options.get("decoder_len") is not None)
    window = enc_len + dec_len if seq2seq else enc_len
    shapes = {name: _step_shape(gi, manifest, micro_batches) for name, gi in by_name.items()}
    if "decoder_input_ids" in by_name and tuple(by_name["decoder_input_ids"].shape or ())[1:] != (dec_len,):
        raise DataError(f"decoder_input_ids {list(by_name['decoder_input_ids'].shape)} must have the length of "
                        f"labels {list(labels.shape)}: it is labels shifted right. Use `--data synthetic`, or your "
                        "own data with `--data path/to/file.py:function`")
    for name in _MASK_ROLES:
        want = ids if name == "attention_mask" else labels
        if name in by_name and tuple(by_name[name].shape or ())[1:] != tuple(want.shape)[1:]:
            raise DataError(f"{name} {list(by_name[name].shape or ())} does not match "
                            f"{_arg_name(want)} {list(want.shape)}; text data cannot fill it. Use `--data "
                            "synthetic`, or your own data with `--data path/to/file.py:function`")
    vocab = 256 if ids.high is None else int(ids.high) + 1

    corpus = np.frombuffer(corpus_bytes(root), dtype=np.uint8)
    rows = micro_batches * manifest.micro_batch_size
    n_windows = len(corpus) // window
    if n_windows < 1:
        raise DataError(f"the text corpus holds {len(corpus)} bytes, fewer than one window of {window} tokens: "
                        "give a larger corpus with `--data text:DIR`")
    windows = corpus[:n_windows * window].reshape(n_windows, window)
    # Byte -> token id; the identity unless the vocabulary is smaller than a byte.
    table = torch.arange(256, dtype=torch.int64) % vocab
    plan = dict(by_name=by_name, shapes=shapes, enc_len=enc_len, seq2seq=seq2seq)
    return _text(windows, table, rows, int(seed), plan)


def _text(windows: np.ndarray, table: torch.Tensor, rows: int, seed: int, plan: dict) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(seed)
    n = len(windows)
    order = np.empty(0, dtype=np.int64)
    by_name, shapes, enc_len, seq2seq = plan["by_name"], plan["shapes"], plan["enc_len"], plan["seq2seq"]
    while True:
        while len(order) < rows:   # a new epoch: every window once, in a fresh order
            order = np.concatenate([order, torch.randperm(n, generator=g).numpy()])
        take, order = order[:rows], order[rows:]
        tokens = table[torch.from_numpy(windows[take].astype(np.int64))]
        if seq2seq:
            source, target = tokens[:, :enc_len], tokens[:, enc_len:]
        else:
            source = target = tokens
        filled = {"input_ids": source, "labels": target}
        if "decoder_input_ids" in by_name:
            # Teacher forcing: the decoder reads the targets shifted right, 0 (T5's pad) as start token.
            filled["decoder_input_ids"] = torch.cat([torch.zeros_like(target[:, :1]), target[:, :-1]], dim=1)
        batch: Batch = {SAMPLE_INDEX: torch.from_numpy(take.astype(np.int64))}     # a window names a sample
        for name, gi in by_name.items():
            dtype = _torch_dtype(gi)
            if name in _MASK_ROLES:
                batch[gi.value] = torch.ones(shapes[name], dtype=dtype)
            else:
                # clone: input_ids and labels of a causal LM must not share memory (a stage may write in place)
                batch[gi.value] = filled[name].to(dtype).clone()
        yield batch


# --------------------------------------------------------------------------- user data and checks

def _aliases(manifest: Manifest) -> tuple[dict[str, GraphInput], dict[str, GraphInput]]:
    """Every key a batch may use for an input -> the input; and the same for constants.

    Keys: the value name, the path (``args[0]``, ``kwargs['labels']``, also with
    double quotes) and the argument name. A key naming two inputs is dropped.
    """
    tensors: dict[str, GraphInput] = {}
    constants: dict[str, GraphInput] = {}
    ambiguous: set[str] = set()
    for gi in manifest.inputs:
        table = tensors if gi.shape is not None else constants
        keys = {gi.value, gi.path, gi.path.replace("'", '"'), _arg_name(gi)}
        for k in keys:
            other = tensors.get(k) or constants.get(k)
            if other is not None and other is not gi:
                ambiguous.add(k)
            table[k] = gi
    for k in ambiguous:
        tensors.pop(k, None)
        constants.pop(k, None)
    # The value name is always unambiguous: graph values have unique names.
    for gi in manifest.inputs:
        (tensors if gi.shape is not None else constants)[gi.value] = gi
    return tensors, constants


def _as_tensor(x: Any, gi: GraphInput, dtype: torch.dtype, where: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    try:   # plain Python numbers and lists carry no dtype of their own: take the input's
        return torch.as_tensor(x, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise DataError(f"{where}: input {_arg_name(gi)!r} is a {type(x).__name__}, not a tensor ({exc}); give a "
                        f"torch.Tensor of shape {list(gi.shape or ())} x micro-batches and dtype {dtype}") from None


def _sample_index(x: Any, manifest: Manifest, micro_batches: int, where: str) -> torch.Tensor:
    """The batch's sample indices, checked: integers, one per row."""
    rows = micro_batches * manifest.micro_batch_size
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or tuple(t.shape) != (rows,):
        raise DataError(f"{where}: {SAMPLE_INDEX!r} must hold one integer dataset index per sample, shape [{rows}] "
                        f"({micro_batches} micro-batches x {manifest.micro_batch_size}); got {t.dtype} "
                        f"{list(t.shape)}")
    return t.to(torch.int64)


def _normalize(batch: Any, manifest: Manifest, micro_batches: int, where: str) -> Batch:
    """Key ``batch`` by value names and check every input's presence, shape and dtype."""
    if not isinstance(batch, Mapping):
        raise DataError(f"{where} is a {type(batch).__name__}, not a dict of input name -> tensor; the model's "
                        f"inputs: {_describe(manifest)}")
    tensors, constants = _aliases(manifest)
    out: Batch = {}
    for key, x in batch.items():
        if key == SAMPLE_INDEX:
            out[key] = _sample_index(x, manifest, micro_batches, where)
            continue
        gi = tensors.get(key)
        if gi is None:
            c = constants.get(key)
            if c is not None:
                # The trace specialised this argument to a constant baked into the code.
                if not isinstance(x, (torch.Tensor, np.ndarray)) and (x is c.constant or x == c.constant):
                    continue
                raise DataError(f"{where}: input {key!r} is {x!r}, but the package was traced with {key}="
                                f"{c.constant!r}, which its code holds as a constant; leave it out of the batch, "
                                "or recompile with the value you need")
            raise DataError(f"{where}: key {key!r} is not an input of model {_model_name(manifest)!r}; its inputs "
                            f"are {_describe(manifest)} (keys may be value names, argument names or paths "
                            "such as args[0], kwargs['labels'])")
        if gi.value in out:
            raise DataError(f"{where}: input {_arg_name(gi)!r} is given twice (as {key!r} and another name); give "
                            "each input once")
        dtype = _torch_dtype(gi)
        t = _as_tensor(x, gi, dtype, where)
        want = _step_shape(gi, manifest, micro_batches)
        if tuple(t.shape) != want:
            raise DataError(f"{where}: input {_arg_name(gi)!r} ({gi.path}) has shape {list(t.shape)}, expected "
                            f"{list(want)}: the traced shape {list(gi.shape)} with dim 0 = {micro_batches} "
                            f"micro-batches x {manifest.micro_batch_size} (every micro-batch must have exactly "
                            "the traced shape; recompile with other --batch-size/--seq-len to change it)")
        if t.dtype != dtype:
            raise DataError(f"{where}: input {_arg_name(gi)!r} ({gi.path}) has dtype {t.dtype}, expected {dtype}; "
                            f"convert it with .to({dtype})")
        out[gi.value] = t
    missing = [gi for gi in _tensor_inputs(manifest) if gi.value not in out]
    if missing:
        raise DataError(f"{where}: missing input(s) "
                        f"{', '.join(f'{_arg_name(gi)} {list(_step_shape(gi, manifest, micro_batches))} {gi.dtype}' for gi in missing)}"
                        f"; every batch must hold every tensor input of model {_model_name(manifest)!r}")
    return out


def check_index_ranges(micro_batches: list[Batch], manifest: Manifest, where: str,
                       inputs: Iterable[str] | None = None) -> None:
    """Raise :class:`DataError` if a token id or label of ``micro_batches`` (each of the traced
    shapes) is outside the table its input indexes (:attr:`GraphInput.index_ranges`): checked on
    the host before the values reach the operator, which on a GPU would fail with a device-side
    assert at some later synchronisation. ``inputs``: check only these (a rank's own)."""
    wanted = None if inputs is None else set(inputs)
    for gi in manifest.inputs:
        if not gi.index_ranges or (wanted is not None and gi.value not in wanted):
            continue
        for i, mb in enumerate(micro_batches):
            t = mb.get(gi.value)
            if not isinstance(t, torch.Tensor) or t.is_floating_point():
                continue
            for r in gi.index_ranges:
                if len(r.window) != t.dim():
                    continue
                # int64: a limit or ignore index outside a narrow dtype's range must not wrap
                x = t[tuple(slice(a, b) for a, b in r.window)].to(torch.int64)
                bad = (x < 0) | (x >= r.limit)
                if r.ignore is not None:
                    bad &= x != r.ignore
                if not bool(bad.any()):
                    continue
                at = [int(c) + a for c, (a, _) in zip(bad.nonzero()[0].tolist(), r.window)]
                value = int(t[tuple(at)])
                allowed = f"0..{r.limit - 1}" + (f", or {r.ignore} (ignored)" if r.ignore is not None else "")
                more = int(bad.sum()) - 1
                raise DataError(f"{where}, micro-batch {i}: input {_arg_name(gi)!r} ({gi.path}) holds {value} at "
                                f"position {at}{f' (and {more} more)' if more else ''}, but it indexes {r.reads}: its "
                                f"values there must be {allowed}; check the data (--data): a tokenizer or label "
                                "set larger than the model's?")


def split_micro_batches(batch: Batch, manifest: Manifest, micro_batches: int) -> list[Batch]:
    """Cut one step's batch into ``micro_batches`` micro-batches of the traced shapes.

    Parameters
    ----------
    batch : Batch
        Input -> tensor with dim 0 = ``micro_batches * b``. Keys are value names
        (argument names and paths are accepted too, as in :func:`load_dataset`).
    manifest : Manifest
        The package manifest.
    micro_batches : int
        How many micro-batches to cut.

    Returns
    -------
    micro : list of Batch
        ``micro_batches`` dicts keyed by value name; micro-batch ``i`` holds rows
        ``i*b`` to ``(i+1)*b - 1`` of each tensor (views, no copy).

    Raises
    ------
    DataError
        If an input is missing or unknown, or a tensor's shape or dtype does not
        match; the message names the input, the expected and the actual shape.
    """
    micro_batches = _check_micro_batches(micro_batches)
    checked = _normalize(batch, manifest, micro_batches, "batch")
    b = manifest.micro_batch_size
    pieces = {v: t.split(b, dim=0) for v, t in checked.items()}
    return [{v: p[i] for v, p in pieces.items()} for i in range(micro_batches)]


def _load_user_function(path: str, name: str):
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise DataError(f"dataset file {path} does not exist; `--data FILE.py:FUNCTION` names a Python file and "
                        "a function in it")
    try:
        module = import_user_file(Path(path), "ftcompile_user_data")
    except UserFileError as exc:
        raise DataError(f"dataset file: {exc}") from exc.__cause__
    fn = getattr(module, name, None)
    if not callable(fn):
        names = sorted(k for k, v in vars(module).items()
                       if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_"))
        raise DataError(f"dataset file {path} has no function {name!r}; its functions: "
                        f"{', '.join(names) or 'none'}")
    return fn


def _call_user_function(fn, spec: str, manifest: Manifest, micro_batches: int, seed: int):
    given = {"manifest": manifest, "micro_batches": micro_batches, "seed": seed}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        # A function that does not need the seed (say) need not declare it.
        given = {k: v for k, v in given.items() if k in params}
        required = [k for k, p in params.items() if p.default is p.empty and k not in given
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            raise DataError(f"dataset function {spec} requires argument(s) {', '.join(required)}, but it is called "
                            "as function(manifest=..., micro_batches=..., seed=...); give the others defaults")
    try:
        return fn(**given)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"dataset function {spec} failed: {type(exc).__name__}: {exc}") from exc


def _checked(batches: Iterable, manifest: Manifest, micro_batches: int, spec: str) -> Iterator[Batch]:
    for i, batch in enumerate(batches):
        yield _normalize(batch, manifest, micro_batches, f"{spec}: batch {i}")


def is_user_data(spec: str) -> bool:
    """Whether a data spec names a user's ``FILE.py:FUNCTION`` (not a built-in source)."""
    path, sep, name = str(spec).strip().rpartition(":")
    return bool(sep) and path.endswith(".py") and name.isidentifier()


def load_dataset(spec: str, manifest: Manifest, *, micro_batches: int, seed: int = 0) -> Iterator[Batch]:
    """The batches named by a command-line data spec.

    Parameters
    ----------
    spec : str
        One of

        * ``"synthetic"``: :func:`synthetic_batches`;
        * ``"text"``: :func:`text_batches` on the Python standard library;
        * ``"text:DIR"``: :func:`text_batches` on the ``*.py`` files under ``DIR``
          (or the single file ``DIR``);
        * ``"path/to/file.py:function"``: the user's data. The file is imported
          as a module (its folder is not added to ``sys.path``) and the function
          called as ``function(manifest=manifest, micro_batches=micro_batches,
          seed=seed)`` (arguments it does not declare are left out). It returns
          an iterable of batches, each a dict from input to tensor (numpy arrays
          and nested lists are accepted) keyed by graph input value name, by the
          model's argument name (``"input_ids"``, ``"labels"``) or by path
          (``"args[0]"``, ``"kwargs['labels']"``). Constants the trace
          specialised may be left out, or given with their traced value. A
          batch may also hold :data:`SAMPLE_INDEX` (``"__index__"``): each
          row's dataset index, int64 of shape ``[micro_batches * b]``, which
          AutoCache needs to reuse activations across epochs.
    manifest : Manifest
        The package manifest.
    micro_batches : int
        Micro-batches per step: every tensor's dim 0 is ``micro_batches * b``.
    seed : int, optional (default=0)
        Passed on to the source; the same seed gives the same batches on every
        process.

    Returns
    -------
    batches : iterator of Batch
        Keyed by value name. A user's batches are checked as they are drawn.

    Raises
    ------
    DataError
        If the spec is of none of these forms, the file or function is missing,
        the chosen source does not fit the model, or (when drawn) a user's batch
        misses an input or has one of another shape or dtype; the message names
        the input, the expected and the actual shape.
    """
    micro_batches = _check_micro_batches(micro_batches)
    spec = str(spec).strip()
    if spec == "synthetic":
        return synthetic_batches(manifest, micro_batches=micro_batches, seed=seed)
    if spec == "text":
        return text_batches(manifest, micro_batches=micro_batches, seed=seed)
    if spec.startswith("text:"):
        root = spec[len("text:"):]
        if not root:
            raise DataError("`--data text:` names no corpus folder: give `--data text:DIR`, or `--data text` for the "
                            "Python standard library")
        return text_batches(manifest, micro_batches=micro_batches, seed=seed, root=root)
    path, _, name = spec.rpartition(":")
    if not is_user_data(spec):
        raise DataError(f"unknown data {spec!r}: {_DATA_HELP} (a file and a function, FILE.py:FUNCTION)")
    fn = _load_user_function(path, name)
    batches = _call_user_function(fn, spec, manifest, micro_batches, seed)
    if isinstance(batches, Mapping) or not isinstance(batches, Iterable):
        raise DataError(f"dataset function {spec} returned a {type(batches).__name__}, not an iterable of batches; "
                        "return (or yield) dicts of input name -> tensor")
    return _checked(batches, manifest, micro_batches, spec)
