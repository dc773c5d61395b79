"""AutoCache (PipeTransformer §3.4): the frozen prefix's output per sample, shared by every rank.

A freeze phase's package keeps its frozen layers in stages of their own (the compiler splits a
stage that mixes frozen and active nodes, ``ftcompile.freeze.split_frozen``), each tagged with a
*level*: the fewest frozen layers whose region holds it (the manifest's
``model.freeze.cache.stages``). The values leaving the stages of level ``L`` or below are the
*boundary* ``B_L``. A phase freezing ``n`` layers has stages of level ``n`` and, when the
previous phase froze ``c`` layers and cached ``B_c``, of level ``c``.

For each micro-batch every rank decides alike (:meth:`AutoCache.plan_step`):

* **hit** (level ``n``): every sample's ``B_n`` is cached: no frozen stage runs; the stages
  reading ``B_n`` read it from the cache;
* **advance** (level ``c``): every sample's ``B_c`` is cached: the stages of level ``c`` do not
  run, those of level ``n`` (the newly frozen layers) run on the cached ``B_c`` and their outputs
  are cached as ``B_n``: nothing runs through a frozen layer twice;
* **miss**: the frozen stages run from the input, and the samples' ``B_n`` is cached.

*Which rank writes what.* Every rank draws the same global batch (all replicas' micro-batches)
and keeps the same index of cached samples, updated by the same rule in step order: a sample
not yet cached is *admitted* at its first occurrence in a step, if it fits the byte budget, and
counts as cached from the next step on. The decision for a micro-batch is therefore the same on
every rank without a message; the one writer of a sample's value is the rank running the stage
that produces it in the replica whose micro-batch admitted it; a reader of a sample admitted by
another replica in an earlier step waits (the engine's readiness check, never blocking the rank)
until the writer's file exists. Files are written to a temporary name and renamed, so a reader
sees a whole entry or none.

*Where.* Entries are files: in host memory (a folder on ``/dev/shm``, a RAM file system every
process of the host shares) while the run's ``memory_budget`` lasts, then spilled to the run's
own folder on disk (``disk_budget``, None: no limit); beyond both, samples are not cached. The
byte count is part of the deterministic index, so every rank knows each entry's tier. The
controller (``ftcompile run --freeze``) makes both folders for one run, named by a token of its
own, and removes them at the end.

*Exactness.* A cached activation is used only if it is the one for that exact sample, computed
by this run: an entry's header carries the run's token, the value, the sample's dataset index
(:data:`~ftcompile.runtime.data.SAMPLE_INDEX`), its shape and dtype and a BLAKE2b digest of the
sample's every input; a reader checks all of them against the sample in hand and stops the run
with :class:`CacheError` on any difference (a data source that changes a sample between epochs,
or an index naming two samples). The folder's ``meta.json`` records the base graph, the micro-batch
size and every value's shape, dtype and the frozen layers it was first cached at; a phase whose
package disagrees is refused before training. Entries are per sample, so a phase that runs another
micro-batch size (``ftcompile run --freeze`` re-picks ``M`` and so ``b`` as the pipeline changes)
reads the entries earlier phases made, once :func:`resize` has dropped the shared values sized by
the batch and the profiler has checked that the frozen layers give each sample the same bits at
both sizes (:func:`ftcompile.runtime.cache_measure.compare_sizes`; where they do not, the
controller drops the entries and logs why). Frozen stages compute a deterministic function of
each sample (dropout off, no running statistics, no random draws: ``ftcompile.freeze.cache_cut``),
and the profiler (:func:`ftcompile.runtime.cache_measure.measure`) checks at run time that a
sample's frozen output does not depend on its micro-batch's other samples or its row, bit for bit;
so a hit gives the bits a recomputation gives.

*When.* The profiler times the frozen forward of a micro-batch and reading its cached
boundary, on the run's device; the controller uses the cache only where reading is faster
(``cache=auto``) and logs the numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .atomic import atomic_write_text
from .data import SAMPLE_INDEX
from .manifest import Manifest, torch_dtype

FORMAT = "ftcompile.autocache"
VERSION = 1
MAGIC = b"FTCACHE1"
#: Bytes counted per entry beside its tensor (its header), so that budgets are exact and alike on every rank.
ENTRY_OVERHEAD = 512
TIERS = ("memory", "disk")


class CacheError(ValueError):
    """The activation cache cannot be used as asked; the message says what is wrong and what to do."""


# --------------------------------------------------------------------------- configuration

@dataclass
class CacheConfig:
    """What one phase's ranks are told (``--autocache FILE``, written by the controller)."""

    token: str                      # the run's cache: every entry and meta.json carry it
    disk: str                       # the disk tier; holds meta.json
    memory: str | None              # the host-memory tier (a RAM file system), None: none
    memory_budget: int              # bytes, every rank's entries together
    disk_budget: int | None         # bytes; None: no limit
    layers: int                     # frozen layers of this phase (n)
    cached_from: int = 0            # the previous phase's (c), whose cached boundary is advanced
    use: list[int] = field(default_factory=list)   # levels micro-batches may read (n and/or c)
    write: bool = False             # cache B_n of samples missing it
    index_in: str | None = None     # the index the previous phase left
    index_out: str | None = None    # where this phase's index goes

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "CacheConfig":
        return CacheConfig(**{k: d[k] for k in CacheConfig.__dataclass_fields__ if k in d})

    @staticmethod
    def load(path: str | os.PathLike) -> "CacheConfig":
        try:
            return CacheConfig.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise CacheError(f"--autocache {path}: cannot be read ({exc}); it is written by `ftcompile run "
                             "--freeze`, which gives it to each phase's ranks") from None

    def tier_dir(self, tier: str) -> Path | None:
        if tier == "memory":
            return Path(self.memory) / "v" if self.memory else None
        return Path(self.disk) / "v"


@dataclass(frozen=True)
class CachePlan:
    """What a package's manifest says about its frozen stages (see the module docstring)."""

    layers: int                             # n
    levels: dict[int, int]                  # frozen stage -> its level
    boundary: dict[int, tuple[str, ...]]    # level -> the values leaving the stages of that level or below
    shared: frozenset[str]                  # values that depend on no input: one entry for all samples
    shapes: dict[str, tuple[int, ...]]      # per sample (shared: whole)
    dtypes: dict[str, str]
    producer: dict[str, int]
    inputs: tuple[str, ...]                 # every tensor input, in the manifest's order (the digest)
    micro_batch_size: int

    def entry_bytes(self, v: str) -> int:
        return math.prod(self.shapes[v]) * torch.empty((), dtype=torch_dtype(self.dtypes[v])).element_size() \
            + ENTRY_OVERHEAD


def cache_plan(manifest: Manifest) -> CachePlan | None:
    """The :class:`CachePlan` of a freeze phase's package, or None when it has no cacheable frozen stage."""
    freeze = (manifest.model or {}).get("freeze") or {}
    meta = freeze.get("cache") or {}
    if meta.get("refused") or not meta.get("stages"):
        return None
    levels = {int(s): int(lv) for s, lv in meta["stages"].items()}
    known = {s.id for s in manifest.stages}
    if not set(levels) <= known:
        raise CacheError(f"the manifest's freeze.cache names stages {sorted(set(levels) - known)} it does not have; "
                         "the package is damaged: let `ftcompile run --freeze` regenerate it")
    b = manifest.micro_batch_size
    boundary: dict[int, tuple[str, ...]] = {}
    for L in sorted(set(levels.values())):
        below = {s for s, lv in levels.items() if lv <= L}
        boundary[L] = tuple(sorted(v for v, spec in manifest.values.items()
                                   if spec.is_tensor and spec.producer in below
                                   and any(c not in below for c in spec.consumers)))
    shared = frozenset(meta.get("shared", ())) | frozenset(meta.get("previous_shared", ()))
    shapes, dtypes, producer = {}, {}, {}
    for vs in boundary.values():
        for v in vs:
            spec = manifest.values[v]
            if v in shared:
                shapes[v] = tuple(spec.shape)
            elif not spec.shape or spec.shape[0] != b:
                raise CacheError(f"{v} {list(spec.shape or ())} leaves the frozen stages but is not batched "
                                 f"(micro-batch size {b}); the package is damaged: let `ftcompile run --freeze` "
                                 "regenerate it")
            else:
                shapes[v] = tuple(spec.shape[1:])
            dtypes[v] = spec.dtype
            producer[v] = spec.producer
    n = int(freeze.get("layers", 0))
    for L, key in ((n, "values"), (int(meta.get("cached_from") or 0), "previous_values")):
        if L in boundary and key in meta and set(boundary[L]) != set(meta[key]):
            raise CacheError(f"the frozen stages of {L} layers send {sorted(boundary[L])} on, the compiler cached "
                             f"{sorted(meta[key])}; the package is damaged: let `ftcompile run --freeze` regenerate it")
    if max(levels.values()) != n:
        raise CacheError(f"the manifest's frozen stages reach {max(levels.values())} layers, its phase freezes {n}; "
                         "the package is damaged: let `ftcompile run --freeze` regenerate it")
    inputs = tuple(gi.value for gi in manifest.inputs if gi.shape is not None)
    return CachePlan(n, levels, boundary, shared, shapes, dtypes, producer, inputs, b)


# --------------------------------------------------------------------------- entries

def value_folder(value: str) -> str:
    """The folder of a value's entries in a tier: its name made safe, and a hash of it (names may collide)."""
    return "".join(ch if ch.isalnum() or ch in "_-." else "_" for ch in value) + "-" + \
        hashlib.blake2b(value.encode(), digest_size=4).hexdigest()


def entry_path(tier_dir: Path, value: str, sample: int | None) -> Path:
    """Where the entry of ``value`` for ``sample`` (None: a shared value) lies in a tier."""
    if sample is None:
        return tier_dir / value_folder(value) / "shared.bin"
    return tier_dir / value_folder(value) / f"{sample % 256:02x}" / f"{sample}.bin"


def sample_digests(micro_batch: dict, inputs: Sequence[str]) -> list[str]:
    """A BLAKE2b digest of each row's every input (names, dtypes, shapes and bytes): what a sample is."""
    b = next(iter(micro_batch[v] for v in inputs)).shape[0] if inputs else 0
    out = []
    for row in range(b):
        h = hashlib.blake2b(digest_size=16)
        for v in inputs:
            t = micro_batch[v][row:row + 1].detach().to("cpu").contiguous()
            h.update(f"{v}:{t.dtype}:{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest())
    return out


def encode_entry(token: str, value: str, sample: int | None, digest: str | None, layers: int,
                 t: torch.Tensor) -> bytes:
    """An entry's bytes: magic, header length, a JSON header saying whose it is, the tensor's bytes."""
    t = t.detach().to("cpu").contiguous()
    header = json.dumps({"token": token, "value": value, "sample": sample, "digest": digest, "layers": layers,
                         "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + t.reshape(-1).view(torch.uint8).numpy().tobytes()


def decode_entry(data: bytes, *, token: str, value: str, sample: int | None, digest: str | None,
                 shape: tuple[int, ...], dtype: str, where: str) -> torch.Tensor:
    """The tensor of an entry, once every field of its header is the one expected (else :class:`CacheError`)."""
    if data[:len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
        raise CacheError(f"{where} is not an AutoCache entry; the cache folder was altered: run again (the cache "
                         "is rebuilt), or give --freeze ...,cache=off")
    (n,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    try:
        head = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    except ValueError:
        head = {}
    want = {"token": token, "value": value, "sample": sample, "dtype": dtype, "shape": list(shape)}
    for key, w in want.items():
        if head.get(key) != w:
            raise CacheError(f"stale AutoCache entry {where}: its {key} is {head.get(key)!r}, this run needs {w!r} "
                             "(an entry of another run, value or sample); the cache folder was altered: run again, "
                             "or give --freeze ...,cache=off")
    if digest is not None and head.get("digest") != digest:
        raise CacheError(f"sample {sample}: its inputs differ from those its cached {value} was computed from "
                         f"({where}): the data changes a sample between epochs (random augmentation?) or gives "
                         f"one {SAMPLE_INDEX!r} to two samples. AutoCache needs each index to name one fixed "
                         "sample; give --freeze ...,cache=off for such data")
    dt = torch_dtype(dtype)
    payload = data[len(MAGIC) + 4 + n:]
    size = math.prod(shape) * torch.empty((), dtype=dt).element_size()
    if len(payload) != size:
        raise CacheError(f"AutoCache entry {where} holds {len(payload)} bytes for {size}; the cache folder was "
                         "altered: run again, or give --freeze ...,cache=off")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dt).reshape(shape)


def write_entry(path: Path, data: bytes) -> None:
    """Write an entry through a temporary name and a rename (no fsync: a crash ends the run, not the cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def find_entry(cfg: CacheConfig, value: str, sample: int | None) -> Path | None:
    """The entry's file in whichever tier holds it, or None."""
    for tier in TIERS:
        d = cfg.tier_dir(tier)
        if d is not None:
            p = entry_path(d, value, sample)
            if p.exists():
                return p
    return None


# --------------------------------------------------------------------------- the index

@dataclass
class CacheIndex:
    """Which samples hold every value of ``values`` (a level's boundary), and the bytes each value takes."""

    layers: int = 0
    values: tuple[str, ...] = ()
    known: set[int] = field(default_factory=set)
    shared: set[str] = field(default_factory=set)
    bytes: dict[str, list[int]] = field(default_factory=dict)      # value -> [memory, disk]

    def save(self, path: str | os.PathLike) -> None:
        import numpy as np

        doc = {"format": FORMAT + ".index", "version": VERSION, "layers": self.layers, "values": list(self.values),
               "shared": sorted(self.shared), "bytes": self.bytes, "count": len(self.known)}
        ids = np.array(sorted(self.known), dtype=np.int64)
        Path(path).with_suffix(".ids.npy").parent.mkdir(parents=True, exist_ok=True)
        from .atomic import atomic_path

        with atomic_path(Path(path).with_suffix(".ids.npy")) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, ids, allow_pickle=False)
        atomic_write_text(path, json.dumps(doc))

    @staticmethod
    def load(path: str | os.PathLike) -> "CacheIndex":
        import numpy as np

        try:
            doc = json.loads(Path(path).read_text())
            ids = np.load(Path(path).with_suffix(".ids.npy"), allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise CacheError(f"AutoCache index {path} cannot be read ({exc}); run again, or give --freeze "
                             "...,cache=off") from None
        if doc.get("format") != FORMAT + ".index" or doc.get("version") != VERSION or len(ids) != doc.get("count"):
            raise CacheError(f"{path} is not an AutoCache index of this version; run again, or give --freeze "
                             "...,cache=off")
        return CacheIndex(int(doc["layers"]), tuple(doc["values"]), set(int(x) for x in ids.tolist()),
                          set(doc["shared"]), {k: [int(a), int(b)] for k, (a, b) in doc["bytes"].items()})


# --------------------------------------------------------------------------- meta.json

def _meta_path(cfg: CacheConfig) -> Path:
    return Path(cfg.disk) / "meta.json"


def create(cfg: CacheConfig, manifest: Manifest) -> None:
    """Start a run's cache (the controller): its folders and ``meta.json``, for the model of ``manifest``."""
    Path(cfg.disk).mkdir(parents=True, exist_ok=True)
    if cfg.memory:
        Path(cfg.memory).mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "version": VERSION, "token": cfg.token, "model": (manifest.model or {}).get("name"),
           "base_graph_hash": manifest.generator.get("base_graph_hash") or manifest.generator.get("graph_hash"),
           "micro_batch_size": manifest.micro_batch_size, "values": {}}
    atomic_write_text(_meta_path(cfg), json.dumps(doc, indent=1))


def _read_meta(cfg: CacheConfig) -> dict:
    try:
        doc = json.loads(_meta_path(cfg).read_text())
    except (OSError, ValueError) as exc:
        raise CacheError(f"AutoCache folder {cfg.disk} has no readable meta.json ({exc}); it is made by `ftcompile "
                         "run --freeze` for one run") from None
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CacheError(f"{_meta_path(cfg)} is not an AutoCache of this version ({doc.get('format')} "
                         f"{doc.get('version')}); it cannot be read")
    return doc


def check(cfg: CacheConfig, manifest: Manifest, plan: CachePlan, *, register: bool = False) -> None:
    """Refuse a cache folder that is not this run's, or whose values are not this package's.

    The folder's ``meta.json`` must carry the run's token, the package's base graph and
    micro-batch size, and every boundary value it records with the package's shape and dtype,
    cached at no more frozen layers than this phase's. ``register`` (the controller, before a
    phase starts) records this phase's boundary values.
    """
    doc = _read_meta(cfg)
    base = manifest.generator.get("base_graph_hash") or manifest.generator.get("graph_hash")
    what = f"AutoCache folder {cfg.disk}"
    if doc.get("token") != cfg.token:
        raise CacheError(f"stale cache: {what} belongs to another run (token {doc.get('token')}, this run's is "
                         f"{cfg.token}); a cache is never shared between runs: give the run its own, or "
                         "--freeze ...,cache=off")
    if doc.get("base_graph_hash") != base:
        raise CacheError(f"stale cache: {what} holds activations of model {doc.get('model')} (graph "
                         f"{doc.get('base_graph_hash')}), not of this package's (graph {base})")
    if doc.get("micro_batch_size") != manifest.micro_batch_size and any(
            v in plan.shared and v in doc.get("values", {}) for vs in plan.boundary.values() for v in vs):
        raise CacheError(f"stale cache: {what} was made for micro-batches of {doc.get('micro_batch_size')}, this "
                         f"package runs {manifest.micro_batch_size}; its values shared by every sample may be sized "
                         "by the batch: carry it over with ftcompile.runtime.cache.resize (`ftcompile run --freeze` "
                         "does), or give --freeze ...,cache=off")
    values = doc.setdefault("values", {})
    for vs in plan.boundary.values():
        for v in vs:
            want = {"kind": "shared" if v in plan.shared else "sample", "shape": list(plan.shapes[v]),
                    "dtype": plan.dtypes[v]}
            got = values.get(v)
            if got is None:
                if register:
                    values[v] = {**want, "layers": plan.layers}
                continue
            if {k: got.get(k) for k in want} != want:
                raise CacheError(f"stale cache: {what} holds {v} as {got.get('kind')} {got.get('dtype')} "
                                 f"{got.get('shape')}, this phase's package makes {want['kind']} {want['dtype']} "
                                 f"{want['shape']}: another package's")
            if int(got.get("layers", 0)) > plan.layers:
                raise CacheError(f"stale cache: {what} cached {v} at {got['layers']} frozen layers, this phase freezes "
                                 f"only {plan.layers}: the activations of a later phase")
    if register:
        atomic_write_text(_meta_path(cfg), json.dumps(doc, indent=1))


def resize(cfg: CacheConfig, manifest: Manifest, index: CacheIndex, index_path: str | os.PathLike) -> list[str]:
    """Carry a run's cache over to a package of another micro-batch size (the controller, between phases).

    Per-sample entries hold one sample's tensor, whatever the micro-batch size that computed it, and
    stay (whether they are the bits the new size computes is the profiler's question:
    :func:`ftcompile.runtime.cache_measure.compare_sizes`). A value shared by every sample (no
    input feeds it) may be sized by the batch (a mask built for ``b`` rows): one whose shape differs
    in ``manifest`` is dropped from both tiers, ``index`` (saved back to ``index_path``) and
    ``meta.json``, to be cached again at the new size. ``meta.json`` then records the new size.
    Returns the shared values dropped.
    """
    plan = cache_plan(manifest)
    doc = _read_meta(cfg)
    values = doc.setdefault("values", {})
    dropped = []
    for v, rec in sorted(values.items()):
        if rec.get("kind") != "shared" or plan is None or v not in plan.shapes:
            continue
        if list(rec.get("shape") or ()) == list(plan.shapes[v]) and rec.get("dtype") == plan.dtypes[v]:
            continue
        for tier in TIERS:
            d = cfg.tier_dir(tier)
            if d is not None:
                with contextlib.suppress(FileNotFoundError):
                    entry_path(d, v, None).unlink()
        del values[v]
        index.shared.discard(v)
        if v in index.bytes:
            index.bytes[v] = [0, 0]
        dropped.append(v)
    doc["micro_batch_size"] = manifest.micro_batch_size
    index.save(index_path)
    atomic_write_text(_meta_path(cfg), json.dumps(doc, indent=1))
    return dropped


# --------------------------------------------------------------------------- the engine's hook

@dataclass
class _Step:
    ids: list[list[int]]                    # every global micro-batch's sample indices
    levels: list[int]                       # every global micro-batch's level (0: miss)
    writes: dict[int, dict[int, dict[str, str]]]     # micro-batch -> row -> value -> tier
    shared_writes: dict[int, dict[str, str]]          # micro-batch -> shared value -> tier
    local: list[dict]                       # this replica's micro-batches (CPU), for digests
    digests: dict[int, list[str]] = field(default_factory=dict)


class AutoCache:
    """The engine's ``cache`` hook for one rank of one phase (see the module docstring).

    The engine calls :meth:`bind` once, :meth:`plan_step` with every step's global batch (in
    step order), and for a forward ``F`` of micro-batch ``i`` of step ``j``: :meth:`skips` (the
    stage does not run), :meth:`cached_inputs` (inputs read from the cache), :meth:`ready` and
    :meth:`read` for them, and :meth:`store` with the stage's outputs; :meth:`record` gives a
    step's counts for the step log.
    """

    def __init__(self, cfg: CacheConfig, plan: CachePlan, index: CacheIndex | None = None):
        self.cfg, self.plan = cfg, plan
        n, c = plan.layers, cfg.cached_from
        self.n = n
        self.c = c if (c and c in plan.boundary and c != n) else 0
        self.B = {L: plan.boundary.get(L, ()) for L in {n, self.c} if L}
        index = index or CacheIndex()
        self.known_n: set[int] = set()
        self.known_c: set[int] = set()
        if index.values:
            if tuple(index.values) == self.B[n]:
                self.known_n = set(index.known)
            elif self.c and tuple(index.values) == self.B[self.c]:
                self.known_c = set(index.known)
            else:
                raise CacheError(f"stale cache: the index {cfg.index_in} lists {list(index.values)} ({index.layers} "
                                 f"frozen layers), this phase reads {list(self.B[n])}"
                                 + (f" or {list(self.B[self.c])}" if self.c else "") + "; run again, or give "
                                 "--freeze ...,cache=off")
        self.shared_known = set(index.shared)
        self.bytes = {v: list(index.bytes.get(v, [0, 0])) for v in set().union(*self.B.values())} if self.B else {}
        self.use_n = n in cfg.use
        self.use_c = bool(self.c) and self.c in cfg.use
        self.write = bool(cfg.write) and self.use_n
        self.steps: dict[int, _Step] = {}
        self.counts: dict[int, dict] = {}
        self.ready_memo: set[tuple] = set()
        self.shared_tensors: dict[str, torch.Tensor] = {}
        self.local: set[int] = set()
        self.replica, self.replicas, self.M = 0, 1, 1
        self.device = torch.device("cpu")
        self._inputs_from: dict[tuple[int, int], frozenset[str]] = {}

    # ------------------------------------------------------------------ set-up
    def bind(self, manifest: Manifest, stages: Sequence[int], *, replica: int, replicas: int, micro_batches: int,
             device) -> None:
        """Tie the cache to a rank: its stages, its replica among ``replicas``, ``M`` micro-batches each."""
        self.m = manifest
        self.local = set(stages)
        self.replica, self.replicas, self.M = replica, replicas, micro_batches
        self.device = torch.device(device)
        # one rank per replica counts the replica's micro-batches: the one running its first frozen stage
        self.counter = min(self.plan.levels) in self.local
        for sid in self.local:
            for L in (self.c, self.n):
                if not L:
                    continue
                below = {s for s, lv in self.plan.levels.items() if lv <= L}
                self._inputs_from[(sid, L)] = frozenset(
                    v for v in manifest.stage(sid).inputs if manifest.values[v].producer in below)

    @property
    def memory_used(self) -> int:
        return sum(b[0] for b in self.bytes.values())

    @property
    def disk_used(self) -> int:
        return sum(b[1] for b in self.bytes.values())

    # ------------------------------------------------------------------ deciding, alike on every rank
    def _holds(self, level: int, ids: list[int]) -> bool:
        known = self.known_n if level == self.n else self.known_c
        vs = self.B[level]
        return all(v in self.shared_known for v in vs if v in self.plan.shared) and \
            (all(s in known for s in ids) if any(v not in self.plan.shared for v in vs) else True)

    def _tier(self, v: str, size: int) -> str:
        if self.cfg.memory and self.memory_used + size <= self.cfg.memory_budget:
            self.bytes[v][0] += size
            return "memory"
        self.bytes[v][1] += size
        return "disk"

    def _fits(self, size: int) -> bool:
        room = (self.cfg.memory_budget if self.cfg.memory else 0) - self.memory_used
        if self.cfg.disk_budget is None:
            return True
        return size <= max(room, 0) + self.cfg.disk_budget - self.disk_used

    def plan_step(self, step: int, micro_batches: list[dict]) -> None:
        """Decide every micro-batch of ``step`` (the global batch: every replica's, in order) and who writes what."""
        if step in self.steps:
            return
        R, M = self.replicas, self.M
        if len(micro_batches) != R * M:
            raise CacheError(f"step {step}: {len(micro_batches)} micro-batches, expected {R} x {M}")
        ids = []
        for g, mb in enumerate(micro_batches):
            if SAMPLE_INDEX not in mb:
                raise CacheError(f"step {step}: the data gives no {SAMPLE_INDEX!r} (each sample's dataset index), "
                                 "which AutoCache keys activations by; give data that does (text data, or a "
                                 f"dataset function yielding {SAMPLE_INDEX!r}), or --freeze ...,cache=off")
            ids.append([int(x) for x in mb[SAMPLE_INDEX].tolist()])
        n, c = self.n, self.c
        levels: list[int] = []
        writes: dict[int, dict[int, dict[str, str]]] = {}
        shared_writes: dict[int, dict[str, str]] = {}
        admitted: list[int] = []
        seen: set[int] = set()
        sample_values = [v for v in self.B[n] if v not in self.plan.shared]
        old = set(self.B[c]) if c else set()
        # shared values the previous level reads but this one does not: only after a change of micro-batch
        # size dropped them (resize); a miss computes them again, and advancing needs them
        prev_shared = [v for v in (self.B[c] if c and self.use_c else ()) if v in self.plan.shared
                       and v not in self.B[n]]
        # In micro-batch order, so that a shared value a miss writes (after a change of micro-batch size
        # dropped it) is known to the step's later micro-batches: they hit or advance, reading its file once
        # written (the engine's readiness check waits for it), instead of the whole step missing.
        for g, sids in enumerate(ids):
            if self.use_n and self._holds(n, sids):
                L = n
            elif self.use_c and self._holds(c, sids):
                L = c
            else:
                L = 0
            levels.append(L)
            if not self.write or L == n:
                continue
            for v in [*self.B[n], *(prev_shared if L == 0 else ())]:
                if v in self.plan.shared and v not in self.shared_known:
                    size = self.plan.entry_bytes(v)
                    if self._fits(size):
                        shared_writes.setdefault(g, {})[v] = self._tier(v, size)
                        self.shared_known.add(v)        # (readers of this step wait for its file)
            for row, s in enumerate(sids):
                if s in self.known_n or s in seen:
                    continue
                seen.add(s)
                need = [v for v in sample_values if not (v in old and s in self.known_c)]
                size = sum(self.plan.entry_bytes(v) for v in need)
                if not need or not self._fits(size):
                    continue
                writes.setdefault(g, {})[row] = {v: self._tier(v, self.plan.entry_bytes(v)) for v in need}
                admitted.append(s)
        self.known_n.update(admitted)   # cached from the next step on
        local = micro_batches[self.replica * M:(self.replica + 1) * M]
        self.steps[step] = _Step(ids, levels, writes, shared_writes, local)
        if self.counter:
            mine = levels[self.replica * M:(self.replica + 1) * M]
            cnt = self.counts.setdefault(step, _zero())
            cnt["hits"] += sum(1 for L in mine if L == n)
            cnt["advanced"] += sum(1 for L in mine if L and L != n)
            cnt["misses"] += sum(1 for L in mine if not L)
            cnt["samples_admitted"] += sum(len(writes.get(self.replica * M + i, {})) for i in range(M))

    def level(self, step: int, i: int) -> int:
        return self.steps[step].levels[self.replica * self.M + i]

    def skips(self, sid: int, step: int, i: int) -> bool:
        """Whether frozen stage ``sid`` does not run micro-batch ``i`` of ``step`` (its output is cached)."""
        lv = self.plan.levels.get(sid)
        if lv is None:
            return False
        L = self.level(step, i)
        return bool(L) and lv <= L

    def cached_inputs(self, sid: int, step: int, i: int) -> frozenset[str]:
        """The inputs of stage ``sid`` (which runs) that micro-batch ``i`` of ``step`` reads from the cache."""
        L = self.level(step, i)
        if not L or self.skips(sid, step, i):
            return frozenset()
        return self._inputs_from.get((sid, L), frozenset())

    # ------------------------------------------------------------------ reading
    def _samples(self, v: str, step: int, i: int) -> list[int | None]:
        return [None] if v in self.plan.shared else self.steps[step].ids[self.replica * self.M + i]

    def ready(self, v: str, step: int, i: int) -> str | None:
        """None once every entry micro-batch ``i`` of ``step`` reads for ``v`` exists, else what it waits for."""
        key = (v, step, i)
        if key in self.ready_memo:
            return None
        if v in self.plan.shared and v in self.shared_tensors:
            self.ready_memo.add(key)
            return None
        for s in self._samples(v, step, i):
            if find_entry(self.cfg, v, s) is None:
                who = "every sample" if s is None else f"sample {s}"
                return f"the cached {v} of {who} (micro-batch {i} of step {step}), which another rank writes"
        self.ready_memo.add(key)
        return None

    def read(self, v: str, step: int, i: int) -> torch.Tensor:
        """Micro-batch ``i`` of ``step``'s ``v`` from the cache, checked entry by entry, on the rank's device."""
        t0 = time.perf_counter()
        cnt = self.counts.setdefault(step, _zero())
        if v in self.plan.shared:
            t = self.shared_tensors.get(v)
            if t is None:
                path = find_entry(self.cfg, v, None)
                data = path.read_bytes()
                cnt["bytes_read"] += len(data)
                t = decode_entry(data, token=self.cfg.token, value=v, sample=None, digest=None,
                                 shape=self.plan.shapes[v], dtype=self.plan.dtypes[v], where=str(path))
                t = self.shared_tensors[v] = t.to(self.device)
            cnt["read_s"] += time.perf_counter() - t0
            return t
        st = self.steps[step]
        digests = self._digests(step, i)
        ids = st.ids[self.replica * self.M + i]
        out = torch.empty((len(ids), *self.plan.shapes[v]), dtype=torch_dtype(self.plan.dtypes[v]))
        for row, s in enumerate(ids):
            path = find_entry(self.cfg, v, s)
            if path is None:
                raise CacheError(f"the cached {v} of sample {s} vanished from {self.cfg.disk}; the cache folder was "
                                 "altered while the run read it")
            data = path.read_bytes()
            cnt["bytes_read"] += len(data)
            out[row] = decode_entry(data, token=self.cfg.token, value=v, sample=s, digest=digests[row],
                                    shape=self.plan.shapes[v], dtype=self.plan.dtypes[v], where=str(path))
        out = out.to(self.device)
        cnt["read_s"] += time.perf_counter() - t0
        return out

    def _digests(self, step: int, i: int) -> list[str]:
        st = self.steps[step]
        if i not in st.digests:
            st.digests[i] = sample_digests(st.local[i], self.plan.inputs)
        return st.digests[i]

    # ------------------------------------------------------------------ writing
    def store(self, sid: int, step: int, i: int, outputs: Sequence[str], values: Sequence) -> None:
        """Cache the values of ``sid``'s outputs that micro-batch ``i`` of ``step`` was admitted for."""
        if not self.write:
            return
        st = self.steps[step]
        g = self.replica * self.M + i
        rows, shared = st.writes.get(g, {}), st.shared_writes.get(g, {})
        if not rows and not shared:
            return
        t0 = time.perf_counter()
        cnt = self.counts.setdefault(step, _zero())
        for v, t in zip(outputs, values):
            if (v not in self.B[self.n] and v not in shared) or self.plan.producer.get(v) != sid or \
                    not isinstance(t, torch.Tensor):
                continue
            if v in shared:
                data = encode_entry(self.cfg.token, v, None, None, self.n, t)
                write_entry(entry_path(self.cfg.tier_dir(shared[v]), v, None), data)
                cnt["entries_written"] += 1
                cnt["bytes_written"] += len(data)
                continue
            cpu = None
            for row, tiers in rows.items():
                if v not in tiers:
                    continue
                if cpu is None:
                    cpu = t.detach().to("cpu")
                s = st.ids[g][row]
                data = encode_entry(self.cfg.token, v, s, self._digests(step, i)[row], self.n, cpu[row])
                write_entry(entry_path(self.cfg.tier_dir(tiers[v]), v, s), data)
                cnt["entries_written"] += 1
                cnt["bytes_written"] += len(data)
        cnt["write_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ the log and the next phase
    def record(self, step: int) -> dict | None:
        """This rank's counts of ``step`` for the step log (summed over ranks by the engine); forgets the step."""
        self.steps.pop(step, None)
        self.ready_memo = {k for k in self.ready_memo if k[1] != step}
        cnt = self.counts.pop(step, None)
        if cnt is None:
            return None
        if self.counter:
            cnt["memory_bytes"], cnt["disk_bytes"] = self.memory_used, self.disk_used
        cnt["read_s"], cnt["write_s"] = round(cnt["read_s"], 6), round(cnt["write_s"], 6)
        return cnt

    def index(self) -> CacheIndex:
        """What this phase leaves cached: the samples holding ``B_n``, for the next phase."""
        vs = self.B[self.n]
        return CacheIndex(self.n, vs, set(self.known_n), {v for v in self.shared_known if v in vs},
                          {v: list(self.bytes.get(v, [0, 0])) for v in vs})


def _zero() -> dict:
    return {"hits": 0, "advanced": 0, "misses": 0, "samples_admitted": 0, "entries_written": 0, "bytes_written": 0,
            "bytes_read": 0, "read_s": 0.0, "write_s": 0.0}


def merge_counts(parts: Sequence[dict]) -> dict:
    """One step's counts from every rank's: sums, and the cache's size (the same on every rank that says it)."""
    out = _zero()
    for p in parts:
        for k, v in p.items():
            if k in ("memory_bytes", "disk_bytes"):
                out[k] = max(out.get(k, 0), v)
            else:
                out[k] = out.get(k, 0) + v
    out["read_s"], out["write_s"] = round(out["read_s"], 6), round(out["write_s"], 6)
    return out


def open_cache(path: str | os.PathLike, manifest: Manifest) -> AutoCache | None:
    """The rank's :class:`AutoCache` for ``--autocache PATH`` (None when the package has nothing to cache)."""
    cfg = CacheConfig.load(path)
    plan = cache_plan(manifest)
    if plan is None:
        return None
    if plan.layers != cfg.layers:
        raise CacheError(f"--autocache {path} is for a phase freezing {cfg.layers} layers, the package freezes "
                         f"{plan.layers}; it is written by `ftcompile run --freeze` for each phase")
    check(cfg, manifest, plan)
    index = CacheIndex.load(cfg.index_in) if cfg.index_in else None
    return AutoCache(cfg, plan, index)
