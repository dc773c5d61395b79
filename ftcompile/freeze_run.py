"""``ftcompile run PKG --freeze ...``: the controller of elastic freeze training.

The runtime cannot plan (it never imports the compiler), so a freeze run is a sequence of
*phases*, each an ordinary ``ftcompile run`` of one package on ``P x R`` ranks, and this
controller, on the compiler side, stands between them:

1. the phase trains up to the next freeze check and checkpoints at that step boundary (weights
   and optimizer state by parameter name), its ranks measuring every layer's gradient norm on
   the check's last step (:class:`ftcompile.runtime.freeze.GradNorms`);
2. the controller adds the ranks' norms up and applies Eq. 1 (or the manual schedule), and logs
   the decision with the norms behind it in ``freeze.jsonl`` beside ``train.jsonl``;
3. when more layers freeze, it re-plans (:func:`ftcompile.freeze.plan_phase`: the frozen graph
   re-profiled and re-partitioned, ``P`` halved while it fits and gains, ``R = G / P``
   replicas, and the micro-batch count ``M`` re-picked for each ``P`` among ``P .. 6P``
   (PipeTransformer §3.2.3), the model re-traced at each micro-batch size ``b`` it needs) and
   writes the next phase's package at the chosen ``b``;
4. the next phase's ranks start with the new layout and resume from the checkpoint by name:
   no step is lost or repeated, and the data stream continues where it was. What a step trains
   is fixed over the run: ``S = R0 x M0 x b0`` samples (phase 0's), drawn as one global batch and
   split into ``R x M`` micro-batches of ``b = S / (R M)``; the step's gradient is the mean over
   its samples whatever the split (each micro-batch's mean loss weighted ``1 / M``, replicas
   averaged), so re-picking ``M`` changes only float rounding for models without batch coupling
   (batch norm couples a micro-batch's samples). Dropout masks are keyed by the step and the
   micro-batch's place in the step's global batch (:func:`ftcompile.runtime.engine.micro_batch_seed`),
   so a run whose ``M`` or ``b`` changes draws other masks than one whose does not (a different
   random stream, the same distribution), and never reuses a mask of another step.

Each transition's cost (planning, plus the launch's start-up and checkpoint load: its wall time
less its training time) is measured and logged, and counts in the run's samples/s.

AutoCache (``cache=auto|on|off``, :mod:`ftcompile.runtime.cache`): the controller makes the run's
cache (a folder in host memory, ``/dev/shm``, up to ``cache_mb``, and one under the run's log
folder for the spill, up to ``spill_mb``), measures before each frozen phase whether reading a
micro-batch's cached activations beats recomputing its frozen forward, tells the phase's ranks
what to read and write, logs the decision with its figures and the phase's hits, misses and bytes,
drops what the next phase no longer reads, and removes the cache when the run ends.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import NamedTuple
from fractions import Fraction
from pathlib import Path

from .freeze import FreezeError, find_layers, frozen_layers, parse_alpha, plan_phase, write_phase_package
from .runtime.atomic import atomic_write_text
from .units import format_bytes


@dataclass
class FreezeSpec:
    """What ``--freeze`` asked for: Eq. 1 (``alpha``, ``every``) or a manual schedule (``at``)."""

    alpha: float | None = None
    every: int | None = None
    at: list = field(default_factory=list)     # Manual transitions, by step
    layers: list[str] = field(default_factory=list)
    strategy: str = "auto"
    cluster: str | None = None
    cache: str = "auto"             # AutoCache: auto (where measured faster), on, off
    cache_mb: float | None = None   # host-memory budget; None: half the free space of /dev/shm
    spill_mb: float | None = None   # disk spill budget; None: half the free space under the log folder
    micro_batches: str = "auto"     # auto (searched per P), fixed (phase 0's M), keep-size (phase 0's b)

    @property
    def manual(self) -> bool:
        return bool(self.at)


USAGE = ("give --freeze alpha=1/3,every=K (Eq. 1 every K steps) or --freeze at=STEP:LAYERS[@PxR][/M]+... "
         "(freeze LAYERS layers at STEP, optionally on P-GPU pipelines x R replicas of M micro-batches each), "
         "with optional layers=CLASS+CLASS (block classes or module path prefixes), strategy=NAME, cluster=NAME, "
         "micro_batches=auto|fixed|keep-size (M searched per pipeline length, kept, or sized to keep the "
         "micro-batch size), cache=auto|on|off (AutoCache), cache_mb=N (its host memory), spill_mb=N (its disk "
         "spill)")


class Manual(NamedTuple):
    """One transition of a manual schedule: ``at=STEP:LAYERS[@PxR][/M]``."""

    step: int
    layers: int
    pipeline_gpus: int | None = None
    replicas: int | None = None
    micro_batches: int | None = None


def parse_freeze(text: str) -> FreezeSpec:
    """``alpha=1/3,every=50`` or ``at=20:1@2x2/4+40:2`` (plus ``layers=``, ``strategy=``, ``cluster=``,
    ``micro_batches=``, ``cache=``, ``cache_mb=``, ``spill_mb=``)."""
    spec = FreezeSpec()
    for part in [p for p in text.split(",") if p.strip()]:
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise FreezeError(f"--freeze {text!r}: {part!r} is not KEY=VALUE; {USAGE}")
        if key == "alpha":
            spec.alpha = parse_alpha(value)
        elif key == "every":
            if not value.isdigit() or int(value) < 1:
                raise FreezeError(f"--freeze every={value}: give a positive number of steps")
            spec.every = int(value)
        elif key == "at":
            for item in value.split("+"):
                item, slash, mb = item.partition("/")
                what, _, layout = item.partition("@")
                step, colon, n = what.partition(":")
                if not (colon and step.strip().isdigit() and n.strip().isdigit()):
                    raise FreezeError(f"--freeze at={value}: {item!r} is not STEP:LAYERS[@PxR][/M]; {USAGE}")
                P = R = M = None
                if layout:
                    p, x, r = layout.partition("x")
                    if not (x and p.isdigit() and r.isdigit() and int(p) > 0 and int(r) > 0):
                        raise FreezeError(f"--freeze at={value}: layout {layout!r} is not PxR (e.g. 2x2)")
                    P, R = int(p), int(r)
                if slash:
                    if not (mb.strip().isdigit() and int(mb) > 0):
                        raise FreezeError(f"--freeze at={value}: /{mb} is not a positive number of micro-batches "
                                          "per replica (e.g. 20:1@2x2/8)")
                    M = int(mb)
                spec.at.append(Manual(int(step), int(n), P, R, M))
            spec.at.sort()
            steps = [t.step for t in spec.at]
            counts = [t.layers for t in spec.at]
            if len(set(steps)) != len(steps) or counts != sorted(counts) or min(steps) < 1:
                raise FreezeError(f"--freeze at={value}: steps must be distinct and at least 1, and frozen layer "
                                  "counts must not decrease (a frozen layer stays frozen)")
        elif key == "layers":
            spec.layers = [x for x in value.split("+") if x]
        elif key == "strategy":
            spec.strategy = value
        elif key == "cluster":
            spec.cluster = value
        elif key == "cache":
            if value not in ("auto", "on", "off"):
                raise FreezeError(f"--freeze cache={value}: give auto (cache where reading beats recomputing), on "
                                  "or off")
            spec.cache = value
        elif key == "micro_batches":
            if value not in ("auto", "fixed", "keep-size"):
                raise FreezeError(f"--freeze micro_batches={value}: give auto (M searched among P..6P for each "
                                  "pipeline length P), fixed (phase 0's M per replica) or keep-size (phase 0's "
                                  "micro-batch size)")
            spec.micro_batches = value
        elif key in ("cache_mb", "spill_mb"):
            try:
                mb = float(value)
            except ValueError:
                mb = -1.0
            if not (mb >= 0 and math.isfinite(mb)):
                raise FreezeError(f"--freeze {key}={value}: give a number of megabytes >= 0")
            setattr(spec, key, mb)
        else:
            raise FreezeError(f"--freeze: unknown key {key!r}; {USAGE}")
    if spec.manual and (spec.alpha is not None or spec.every is not None):
        raise FreezeError(f"--freeze: give either at= (a manual schedule) or alpha= and every=, not both; {USAGE}")
    if not spec.manual and (spec.alpha is None or spec.every is None):
        raise FreezeError(f"--freeze {text!r}: Eq. 1 needs both alpha= and every=; {USAGE}")
    return spec


def _trace_package_model(m, batch_size: int | None = None):
    """The package's model rebuilt and traced as it was compiled (its graph hash must match), or at
    another micro-batch size ``batch_size`` (the same model: weights, layers and options but the batch)."""
    from .codegen import rebuild_model
    from .trace import trace

    source = m.model | {"model": m.model["name"]}
    if batch_size is not None:
        source = source | {"options": {**(m.model.get("options") or {}), "batch_size": batch_size}}
    built = rebuild_model(source)
    graph = trace(built.model, built.args, built.kwargs, basic_blocks=tuple(m.model.get("basic_blocks") or ()),
                  source={"model": built.name, "options": asdict(built.options)})
    if batch_size is not None:
        return built, graph
    want = m.generator.get("graph_hash")
    if want and graph.content_hash() != want:
        raise FreezeError(f"the package's model {m.model['name']} traces to graph {graph.content_hash()}, the "
                          f"package was compiled from {want}; recompile the package with this ftcompile before "
                          "freeze training it")
    return built, graph


class _Traces:
    """The package's model traced at each micro-batch size a phase needs (each traced once)."""

    def __init__(self, m0, built, graph):
        from .models.user import is_user_spec

        self.m0 = m0
        self.by_size = {m0.micro_batch_size: (built, graph)}
        name = str((m0.model or {}).get("name") or "")
        self.why_not = None
        if is_user_spec(name):
            self.why_not = (f"the user model {name} is traced at the batch its function returns, so the "
                            "controller cannot re-trace it at another micro-batch size")
        self.resizable = self.why_not is None

    def _get(self, b: int):
        if b not in self.by_size:
            if not self.resizable:
                raise FreezeError(f"micro-batches of {b} samples: {self.why_not}; give --freeze "
                                  "...,micro_batches=keep-size")
            try:
                self.by_size[b] = _trace_package_model(self.m0, batch_size=b)
            except FreezeError:
                raise
            except Exception as exc:        # a model that cannot be built or traced at this size
                raise FreezeError(f"the model {self.m0.model.get('name')} could not be re-traced at micro-batch "
                                  f"size {b} ({type(exc).__name__}: {exc}); give --freeze ...,micro_batches=keep-size "
                                  "to keep the size it was compiled at") from None
        return self.by_size[b]

    def graph(self, b: int):
        return self._get(b)[1]

    def built(self, b: int):
        return self._get(b)[0]


def _check_sizes(spec: FreezeSpec, traces: _Traces, G: int, S: int, M: int) -> None:
    """Refuse, before any rank starts, a manual layout or micro-batch count the step's ``S`` samples
    cannot take, and ``micro_batches=fixed`` where the micro-batch size cannot change."""
    b0 = traces.m0.micro_batch_size
    if spec.micro_batches == "fixed" and not traces.resizable:
        raise FreezeError(f"--freeze micro_batches=fixed keeps M={M} per replica, so the micro-batch size changes "
                          f"with the replicas; {traces.why_not}: give micro_batches=keep-size or auto")
    for t in spec.at:
        where = f"--freeze at=...{t.step}:{t.layers}"
        if t.pipeline_gpus is not None:
            P, R = t.pipeline_gpus, t.replicas
            if G % P or G // P != R:
                raise FreezeError(f"{where}@{P}x{R}: {P}-GPU pipelines on the run's {G} GPUs make "
                                  f"{G // P if not G % P else 'no whole number of'} replicas; give PxR with P x R = "
                                  f"{G} (e.g. {G // 2 if G > 1 else 1}x{2 if G > 1 else 1})")
            if S % R:
                raise FreezeError(f"{where}@{P}x{R}: a step's {S} samples (R0 x M0 x b0) do not split among {R} "
                                  f"replicas; choose a layout whose R divides {S}, or change --micro-batches")
            if t.micro_batches is not None:
                per = S // R
                if per % t.micro_batches:
                    divs = [m for m in range(1, per + 1) if per % m == 0]
                    raise FreezeError(f"{where}@{P}x{R}/{t.micro_batches}: each replica trains {per} samples a "
                                      f"step, which do not split into {t.micro_batches} micro-batches; give M among "
                                      f"{divs}")
                if not traces.resizable and per // t.micro_batches != b0:
                    raise FreezeError(f"{where}/{t.micro_batches}: micro-batches of {per // t.micro_batches} "
                                      f"samples; {traces.why_not}: give M = {per // b0 if per % b0 == 0 else '?'} "
                                      f"(micro-batches of {b0})")
            elif spec.micro_batches == "fixed" and (S // R) % M:
                raise FreezeError(f"{where}@{P}x{R}: micro_batches=fixed keeps M={M}, which does not divide the "
                                  f"{S // R} samples of each of {R} replicas; give /M or micro_batches=auto")
        elif t.micro_batches is not None and S % t.micro_batches:
            raise FreezeError(f"{where}/{t.micro_batches}: a step's {S} samples do not split into "
                              f"{t.micro_batches} micro-batches per replica on any number of replicas")


def _phase_seconds(log: Path, first: int, end: int) -> tuple[float, int]:
    """Training seconds and steps of steps [first, end) in ``train.jsonl`` (the log rank's records)."""
    total, steps = 0.0, 0
    if not log.exists():
        return 0.0, 0
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in rec and first <= int(rec["step"]) < end and rec.get("seconds"):
            total += float(rec["seconds"])
            steps += 1
    return total, steps


# --------------------------------------------------------------------------- AutoCache

SHM = Path("/dev/shm")
_SHM_PREFIX = "ftcompile-autocache-"


def _claim_memory_dir(token: str) -> tuple[Path | None, int | None]:
    """A folder of this run on the host's RAM file system (None where there is none), locked while it
    lives; folders that dead runs left there (their lock free) are removed first."""
    import fcntl

    if not SHM.is_dir() or not os.access(SHM, os.W_OK):
        return None, None
    for old in SHM.glob(_SHM_PREFIX + "*"):
        try:
            fd = os.open(old / ".owner.lock", os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue            # its run is alive
        try:
            shutil.rmtree(old, ignore_errors=True)
        finally:
            os.close(fd)
    # made under a temporary name and locked before it gets its final one, so no scan removes it
    tmp = SHM / f".{_SHM_PREFIX}{token}"
    tmp.mkdir(mode=0o700)
    fd = os.open(tmp / ".owner.lock", os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    final = SHM / f"{_SHM_PREFIX}{token}"
    os.replace(tmp, final)
    return final, fd


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _available_memory() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


class CacheRun:
    """The run's activation cache, from the controller's side (see the module docstring)."""

    def __init__(self, spec: FreezeSpec, args, manifest, work: Path, note, micro_batches: int = 1):
        import torch

        from .runtime.cache import CacheConfig, create
        from .runtime.data import SAMPLE_INDEX, DataError, load_dataset, split_micro_batches

        self.spec, self.note, self.work = spec, note, work
        self.mode = spec.cache
        self.device = str(args.device or "cpu")
        if self.device == "cuda":
            self.device = "cuda:0"
        data = args.data or "synthetic"
        try:
            batch = next(iter(load_dataset(data, manifest, micro_batches=micro_batches, seed=args.seed or 0)))
        except (DataError, StopIteration) as exc:
            raise FreezeError(f"AutoCache could not draw a batch of --data {data}: {exc}") from None
        self.usable = SAMPLE_INDEX in batch
        self.why_not = None if self.usable else (
            f"--data {data} gives no {SAMPLE_INDEX!r} (each sample's dataset index): with nothing naming a sample "
            "across epochs there is nothing to reuse (text data gives one; a dataset function can yield it)")
        if not self.usable and self.mode == "on":
            raise FreezeError(f"--freeze cache=on: {self.why_not}; give such data, or cache=auto|off")
        # a step's samples, keyed by value name: each phase profiles its first micro-batch of whatever size
        parts = split_micro_batches(batch, manifest, micro_batches)
        self.batch = {k: torch.cat([mb[k] for mb in parts]) for k in parts[0]}
        self.index_size: int | None = None     # the micro-batch size of the phase that left self.index
        self.previous_package: str | None = None
        self.token = uuid.uuid4().hex
        self.memory, self._lock = (None, None)
        self.cfg = None
        self.index: str | None = None
        self.phase_no = 0
        if not self.usable:
            return
        self.memory, self._lock = _claim_memory_dir(self.token)
        disk = work / f"cache-{self.token[:12]}"
        disk.mkdir(parents=True, exist_ok=True)
        mem_budget = 0
        if self.memory is not None:
            avail = [_free_bytes(self.memory) // 2] + [a // 2 for a in [_available_memory()] if a]
            mem_budget = int(spec.cache_mb * 2 ** 20) if spec.cache_mb is not None else min(avail)
        disk_budget = int(spec.spill_mb * 2 ** 20) if spec.spill_mb is not None else _free_bytes(disk) // 2
        self.base = CacheConfig(self.token, str(disk), str(self.memory) if self.memory else None, mem_budget,
                                disk_budget, 0)
        create(self.base, manifest)
        where = f"{self.memory} (host memory, {format_bytes(mem_budget)})" if self.memory else \
            "no host-memory file system"
        note(f"AutoCache ({self.mode}): {where}, spill to {disk} ({format_bytes(disk_budget)})")

    def prepare(self, package: str, frozen: int, phase: int) -> tuple[str | None, dict]:
        """Measure and decide what phase ``phase`` (a package freezing ``frozen`` layers) reads and writes;
        returns its ``--autocache`` file (None: no cache) and the record for ``freeze.jsonl``."""
        from dataclasses import replace

        from .runtime import load_package
        from .runtime.cache import cache_plan, check
        from .runtime.cache_measure import decide, measure_apart

        rec: dict = {"mode": self.mode}
        if not self.usable:
            rec["used"], rec["why"] = False, self.why_not
            return None, rec
        pkg = load_package(package)
        b = pkg.manifest.micro_batch_size
        micro_batch = {k: v[:b] for k, v in self.batch.items()}
        if self.index is not None and self.index_size not in (None, b):
            kept = self._resize(pkg, b)
            rec["resized"] = kept
            self.note(f"phase {phase}: AutoCache entries made at micro-batch size {self.index_size}, read at {b}: "
                      + ("kept" if kept.get("kept") else f"dropped ({kept.get('why')})"))
        if self.index is None:
            # Nothing is cached (the run's first frozen phase, or the entries were dropped): the cache starts
            # again at this package's micro-batch size. Left at the size it was made at, meta.json would
            # register this phase's values (shared ones sized by the batch) under the old size, and every
            # rank would refuse it as stale whenever the transition re-picked b.
            self._start_again(pkg.manifest)
        meta = ((pkg.manifest.model or {}).get("freeze") or {}).get("cache") or {}
        plan = cache_plan(pkg.manifest)
        if plan is None:
            rec["used"], rec["why"] = False, meta.get("refused") or "the package has no frozen stage of its own"
            self._keep(set())           # this phase neither reads nor leaves anything
            self.index = None
            return None, rec
        cfg = replace(self.base, layers=frozen, cached_from=int(meta.get("cached_from") or 0),
                      index_in=self.index, index_out=str(self.work / f"cache-index-{phase}.json"))
        check(cfg, pkg.manifest, plan, register=True)
        t0 = time.perf_counter()
        measured = measure_apart(package, cfg, micro_batch, self.device)
        use, write, why = decide(self.mode, cfg, measured)
        cfg.use, cfg.write = use, write
        rec.update(used=bool(use), reads_levels=use, writes=write, why=why, measured=measured,
                   measure_s=round(time.perf_counter() - t0, 3))
        path = self.work / f"phase-{phase}-autocache.json"
        atomic_write_text(path, json.dumps(cfg.to_json(), indent=1))
        self.cfg = cfg
        self.cfg_size, self.previous_package = b, package
        return str(path), rec

    def _resize(self, pkg, b: int) -> dict:
        """Carry the cached entries over a change of micro-batch size to ``b``, or drop them.

        Entries are per sample, so their size does not depend on ``b``; they are kept when the new
        package's frozen layers give every sample the same bits at ``b`` as the previous package's did at
        its size (:func:`ftcompile.runtime.cache_measure.compare_sizes`: kernels may round otherwise at
        another batch size), and values shared by all samples whose shape follows the batch are dropped
        (re-cached at ``b``). Returns the record for ``freeze.jsonl``."""
        from .runtime.cache import CacheIndex, resize, value_folder
        from .runtime.cache_measure import compare_sizes_apart

        index = CacheIndex.load(self.index)
        t0 = time.perf_counter()
        same, why = compare_sizes_apart(self.previous_package, str(pkg.path), index.layers, self.batch, self.device)
        out = {"from": self.index_size, "to": b, "layers": index.layers, "compare_s": round(time.perf_counter() - t0, 3)}
        if not same:
            self._keep(set())
            self.index = None
            return {**out, "kept": False, "why": why}
        dropped = resize(self.base, pkg.manifest, index, self.index)
        self._keep({value_folder(v) for v in index.values})
        return {**out, "kept": True, "dropped_shared": dropped, "why": why}

    def after(self) -> None:
        """The phase ended: keep what it left cached for the next one, drop the values nobody reads any more."""
        from .runtime.cache import CacheIndex, value_folder

        if self.cfg is None:
            return
        cfg, self.cfg = self.cfg, None
        if not (cfg.index_out and Path(cfg.index_out).exists()):
            self._keep(set())
            self.index = None
            return
        self.index = cfg.index_out
        self.index_size = self.cfg_size
        self._keep({value_folder(v) for v in CacheIndex.load(cfg.index_out).values})

    def _start_again(self, manifest) -> None:
        """The cache holds no entry: empty both tiers and write ``meta.json`` afresh for ``manifest``'s package
        (its micro-batch size, no value registered), as :func:`ftcompile.runtime.cache.create` does at the start."""
        from .runtime.cache import create

        self._keep(set())
        self.index = self.index_size = None
        create(self.base, manifest)

    def _keep(self, keep: set[str]) -> None:
        """Remove every value's entries but those of ``keep`` (folder names) from both tiers."""
        for tier in ("memory", "disk"):
            d = self.base.tier_dir(tier)
            if d is not None and d.is_dir():
                for sub in d.iterdir():
                    if sub.name not in keep:
                        shutil.rmtree(sub, ignore_errors=True)

    def close(self) -> None:
        """Remove the run's cache (it is derived data, and can be large)."""
        if getattr(self, "base", None) is not None:
            shutil.rmtree(self.base.disk, ignore_errors=True)
        if self.memory is not None:
            shutil.rmtree(self.memory, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _phase_cache(log: Path, first: int, end: int) -> dict | None:
    """AutoCache's counts over steps [first, end) of ``train.jsonl``."""
    from .runtime.cache import merge_counts

    if not log.exists():
        return None
    parts = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in rec and first <= int(rec["step"]) < end and rec.get("cache"):
            parts.append(rec["cache"])
    if not parts:
        return None
    total = merge_counts([{k: v for k, v in p.items() if k not in ("memory_bytes", "disk_bytes")} for p in parts])
    total.update({k: parts[-1][k] for k in ("memory_bytes", "disk_bytes") if k in parts[-1]})
    return total


def run_freeze(args, spec: FreezeSpec) -> int:
    """Train ``args.package`` through its freeze phases (see the module docstring); returns the exit status."""
    from .cluster import ClusterSpec, load_cluster
    from .runtime import load_package

    pkg0 = load_package(args.package)
    m0 = pkg0.manifest
    if (m0.model or {}).get("freeze"):
        raise FreezeError(f"{args.package} is a freeze phase's package; give the package of the whole model")
    P = m0.num_gpus
    G = args.nproc if args.nproc is not None else P * max(m0.replicas, 1)
    if G < P or G % P:
        raise FreezeError(f"--freeze starts from the package's {P}-GPU pipeline: give --nproc a multiple of {P} "
                          f"(e.g. {P * max(m0.replicas, 1)}: its planned replicas)")
    R0 = G // P
    first = _first_phase(args, m0)         # the run's settings as phase 0's ranks resolve them
    steps, schedule, M, optimizer = first.steps, first.schedule, first.micro_batches, first.optimizer
    if schedule not in ("gpipe", "1f1b"):
        raise FreezeError(f"--freeze trains synchronous pipelines (gpipe, 1f1b), not {schedule}: give --schedule "
                          "1f1b")
    S = R0 * M * m0.micro_batch_size       # every step's samples, all replicas together, fixed over the run
    settings = {name: getattr(first, name) for name in PRICED_SETTINGS}
    _check_phase0(pkg0, first, args, (G, R0, args.rank_order or m0.rank_order))
    doc = json.loads((pkg0.path / "plan.json").read_text())
    cluster = load_cluster(spec.cluster) if spec.cluster else ClusterSpec.from_json(doc["cluster"])
    cluster = cluster.with_overrides(gpus=G)
    built, graph = _trace_package_model(m0)
    traces = _Traces(m0, built, graph)
    _check_sizes(spec, traces, G, S, M)
    layer_paths = find_layers(graph, spec.layers or None)
    L = len(layer_paths)
    if spec.manual and max(t.layers for t in spec.at) > L:
        raise FreezeError(f"--freeze at=: the model has {L} layers ({layer_paths[0]} ... {layer_paths[-1]})")
    log_dir = Path(args.log_dir or pkg0.path / "runs" / schedule)
    ck_dir = Path(args.checkpoint_dir or log_dir / "checkpoints")
    work = log_dir / "freeze"
    work.mkdir(parents=True, exist_ok=True)

    def note(text: str) -> None:
        print(f"ftcompile run --freeze: {text}", file=sys.stderr)

    note(f"{L} layers ({layer_paths[0]} ... {layer_paths[-1]}); phase 0: P={P} R={R0} M={M} b={m0.micro_batch_size} "
         f"({S} samples per step, micro_batches={spec.micro_batches})")
    if spec.micro_batches == "auto" and not traces.resizable:
        note(f"M follows the micro-batch size {m0.micro_batch_size}: {traces.why_not}")
    cache = CacheRun(spec, args, m0, work, note, R0 * M) if spec.cache != "off" else None
    if cache is not None and not cache.usable:
        note(f"AutoCache off: {cache.why_not}")
    run = _Run(args, spec, m0, steps, schedule, M, P, R0, S, optimizer, cluster, traces, graph, layer_paths,
               log_dir, ck_dir, work, note, cache, settings)
    try:
        return _phases(run)
    finally:
        if cache is not None:
            cache.close()


@dataclass
class _Run:
    """What :func:`run_freeze` settled before the first phase."""

    args: object
    spec: FreezeSpec
    m0: object                  # the whole model's manifest
    steps: int
    schedule: str
    M: int                      # micro-batches per replica in phase 0
    P: int
    R: int
    samples: int                # S: samples per step, all replicas together
    optimizer: str
    cluster: object
    traces: "_Traces"
    graph: object               # the package's graph (phase 0's micro-batch size)
    layer_paths: list[str]
    log_dir: Path
    ck_dir: Path
    work: Path
    note: object
    cache: CacheRun | None
    # recompute, clip_grad_norm, on_nonfinite: what every phase trains with and is priced for
    settings: dict = field(default_factory=dict)


#: The run settings that change a phase plan's price under gpipe and 1f1b: recomputation, and
#: clipping or skipping, which make every update wait for all stages. Every phase is planned for
#: them and its ranks are given them, so that no phase falls back to the defaults its own package
#: would record otherwise.
PRICED_SETTINGS = ("recompute", "clip_grad_norm", "on_nonfinite")


def _first_phase(args, m0):
    """The options of phase 0 as its ranks resolve them (``options.resolve``: the option given, else
    the package's plan, else the default), without a resume: phase 0 starts the run."""
    from .runtime.options import resolve

    first = copy.copy(args)
    first.resume = False
    return resolve(first, m0).args


def _check_phase0(pkg0, first, cli, ranks) -> None:
    """Phase 0 trains the package as compiled: price it again for the run's settings (``first``,
    resolved) where they differ from its plan's (the launcher's check of a plain run,
    ``cli_package._check_planned``), and refuse a GPU run it no longer fits before anything starts.
    Later phases are planned for them."""
    from .cli import _Ui
    from .cli_package import _check_planned

    _check_planned(pkg0, first, _Ui(cli), cli=cli, ranks=ranks)


def _phases(run: _Run) -> int:
    """The phase loop of :func:`run_freeze` (see the module docstring)."""
    from .runtime.freeze import read_norms
    from .runtime.launch import spawn
    from .runtime.options import new_run_id, worker_argv

    args, spec, steps, schedule, M, P, R = run.args, run.spec, run.steps, run.schedule, run.M, run.P, run.R
    layer_paths, log_dir, ck_dir, work, m0, cache, note = (run.layer_paths, run.log_dir, run.ck_dir, run.work,
                                                           run.m0, run.cache, run.note)
    L = len(layer_paths)
    decisions: list[dict] = []
    phases: list[dict] = []

    def save_log() -> None:
        atomic_write_text(log_dir / "freeze.jsonl", "".join(json.dumps(d) + "\n" for d in decisions + phases))

    step, frozen, package, plan_s, b = 0, 0, str(args.package), 0.0, m0.micro_batch_size
    ranges = {gi.path: (gi.low, gi.high) for gi in m0.inputs if gi.low is not None and gi.high is not None}
    caching = cache is not None and cache.usable
    while step < steps:
        if spec.manual:
            end = next((t.step for t in spec.at if t.step > step), steps)
        elif math.floor(Fraction(spec.alpha).limit_denominator(10_000) * (L - frozen)) == 0:
            end = steps         # Eq. 1 can freeze no more: train to the end without checks
        else:
            end = min(step + spec.every, steps)
        end = min(end, steps)
        norms_file = work / f"norms-{end}"
        w = copy.copy(args)
        w.package, w.steps, w.micro_batches, w.schedule = package, end, M, schedule
        for name, value in run.settings.items():        # as every phase was planned
            setattr(w, name, value)
        w.log_dir, w.checkpoint_dir, w.checkpoint_every = str(log_dir), str(ck_dir), None
        w.replicas, w.rank_order = R, None      # the phase package's layout
        w.resume = step > 0
        w.overwrite_checkpoints = bool(args.overwrite_checkpoints) and step == 0
        w.reset_optimizer = False
        w.grad_norms_at, w.grad_norms_layers, w.grad_norms_file = str(end - 1), ",".join(layer_paths), str(norms_file)
        w.autocache, cache_rec = None, None
        if caching and frozen > 0:
            t1 = time.perf_counter()
            w.autocache, cache_rec = cache.prepare(package, frozen, len(phases))
            plan_s += time.perf_counter() - t1      # measuring is part of the transition
            reads = "+".join(map(str, cache_rec.get("reads_levels") or []))
            note(f"phase {len(phases)}: AutoCache " + (f"reads the output of {reads} frozen layers" if
                                                       cache_rec.get("used") else "not used")
                 + f" ({cache_rec.get('why')})")
        argv = worker_argv(w)
        if getattr(args, "quiet", False) and "--progress" in argv:
            argv[argv.index("--progress") + 1] = "off"
        t0 = time.perf_counter()
        code = spawn(argv, P * R, run_id=new_run_id(), max_restarts=0, debug=bool(getattr(args, "debug", False)))
        wall = time.perf_counter() - t0
        if code:
            return code
        train_s, n = _phase_seconds(log_dir / "train.jsonl", step, end)
        samples = n * R * M * b
        phases.append({"phase": len(phases), "steps": [step, end], "frozen_layers": frozen, "P": P, "R": R, "M": M,
                       "b": b,
                       "package": package, "train_s": round(train_s, 4), "launch_s": round(wall, 4),
                       "transition_s": round(plan_s + max(wall - train_s, 0.0), 4),
                       "samples_per_s": round(samples / train_s, 3) if train_s else None,
                       "samples_per_s_with_transition": round(samples / (wall + plan_s), 3) if wall else None})
        if cache_rec is not None:
            phases[-1]["cache"] = {**cache_rec, "counts": _phase_cache(log_dir / "train.jsonl", step, end)}
            cache.after()
        note(f"phase {len(phases) - 1}: steps {step}-{end - 1}, {frozen} frozen, P={P} R={R} M={M} b={b}: "
             f"{phases[-1]['samples_per_s']} samples/s training, transition {phases[-1]['transition_s']:.1f} s")
        step = end
        save_log()
        if step >= steps:
            break
        files = sorted(work.glob(f"norms-{end}.rank*.json"))
        norms = read_norms(files).get(end - 1)
        if norms is None:
            raise FreezeError(f"the ranks wrote no gradient norms for step {end - 1} into {work}")
        forced_m = run.M if spec.micro_batches == "fixed" else None
        if spec.manual:
            t = next(t for t in spec.at if t.step == end)
            new, forced, rule = t.layers, t.pipeline_gpus, "manual"
            forced_m = t.micro_batches or forced_m
        else:
            new = frozen_layers(frozen, norms[frozen:], spec.alpha)
            forced, rule = None, f"eq1 alpha={spec.alpha:.4g}"
        decision = {"decision": True, "step": end, "rule": rule, "frozen_before": frozen, "frozen_after": new,
                    "grad_norms": {layer_paths[i]: norms[i] for i in range(L)},
                    "active_argmin": (layer_paths[frozen + min(range(L - frozen), key=lambda i: norms[frozen + i])]
                                      if frozen < L else None)}
        plan_s = 0.0
        if new != frozen or (forced is not None and forced != P) or (spec.manual and forced_m not in (None, M)):
            t1 = time.perf_counter()
            resize = run.traces.resizable and spec.micro_batches != "keep-size"
            ph = plan_phase(run.graph, layer_paths, new, run.cluster, samples_per_step=run.samples,
                            schedule=schedule, optimizer=run.optimizer, start_pipeline=P, pipeline_gpus=forced,
                            strategies=spec.strategy, cached_from=frozen if caching else 0,
                            graph_at=run.traces.graph if resize else None, micro_batches=forced_m, current=(M, b),
                            recompute=run.settings["recompute"], clip_grad_norm=run.settings["clip_grad_norm"],
                            on_nonfinite=run.settings["on_nonfinite"])
            package = write_phase_package(ph, run.traces.built(ph.micro_batch_size), layer_paths,
                                          work / f"phase-{len(phases)}-frozen-{new}", input_ranges=ranges)
            plan_s = time.perf_counter() - t1
            P, R, M, b, frozen = ph.pipeline_gpus, ph.replicas, ph.micro_batches, ph.micro_batch_size, new
            decision["plan"] = ph.row()
            decision["plan_s"] = round(plan_s, 3)
        decisions.append(decision)
        note(f"step {end}: {decision['frozen_before']} -> {new} frozen layers ({rule}); next phase P={P} R={R} "
             f"M={M} b={b}")
        save_log()
    total_train = sum(p["train_s"] for p in phases)
    total_wall = sum(p["launch_s"] for p in phases) + sum(d.get("plan_s", 0.0) for d in decisions)
    note(f"{steps} steps in {len(phases)} phase(s): {total_train:.1f} s training, {total_wall:.1f} s with "
         f"transitions; log {log_dir / 'freeze.jsonl'}")
    return 0
