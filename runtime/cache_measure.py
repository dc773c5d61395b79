"""AutoCache's profiler and rule: is reading a micro-batch's cached activations faster than recomputing them?

PipeTransformer §3.4: "the cache can be slower than running the real forward propagation,
especially if frozen layers are few and activations are large", so a phase reads the cache only
where a profiler says it pays. :func:`measure` times, on the run's device, one micro-batch's
frozen forward (and, for an advance, the newly frozen layers' alone) against reading its cached
activations exactly as the ranks read them (:mod:`ftcompile.runtime.cache`), and checks that the
cache would be exact; :func:`decide` turns the figures into what the phase reads and writes. The
controller (``ftcompile run --freeze``) calls them before each frozen phase and logs both.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from .cache import (CacheConfig, CacheError, CacheIndex, cache_plan, decode_entry, encode_entry, entry_path,
                    find_entry, sample_digests, write_entry)
from .manifest import stage_order, torch_dtype


def run_frozen(package, modules: dict, stages: Sequence[int], values: dict) -> dict:
    """Run ``stages`` (frozen, in dependency order) on ``values`` (graph inputs and earlier outputs, on
    the modules' device); returns ``values`` with their outputs added."""
    m = package.manifest
    values = dict(values)
    want = set(stages)
    for sid in stage_order(m):
        if sid not in want:
            continue
        spec = m.stage(sid)
        args = [values[v] if v in values else m.values[v].literal for v in spec.inputs]
        with torch.no_grad():
            outs = modules[sid](*args, seed=0)
        values.update(zip(spec.outputs, outs))
    return values


def _timed(fn, device, min_s: float = 0.2, reps: int = 20) -> float:
    """Seconds of ``fn()``: the fastest of runs after a warm-up, repeated until ``min_s`` seconds or ``reps``
    runs (the least disturbed by other processes, as :mod:`timeit` takes it)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fn()
    sync()
    times, start = [], time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < min_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(package, cfg: CacheConfig, micro_batch: dict, device="cpu") -> dict:
    """AutoCache's profiler: on ``device``, the frozen forward of one micro-batch against reading its cache.

    Returns milliseconds per micro-batch: ``forward_ms`` (every frozen stage, from the inputs),
    ``advance_ms`` (only the newly frozen layers, from the cached boundary of ``cfg.cached_from``
    layers), ``read_ms`` and ``read_previous_ms`` (the boundary of ``n`` and of ``c`` layers, read
    as the ranks read it: every entry, its header and the sample's digest checked, stacked and
    moved to ``device``, from the tier new entries go to), and ``exact``: whether each sample's
    frozen output is the same bits when its micro-batch is reversed (if not, with ``reason``,
    caching would not be exact and must not be used). On the CPU both are timed on one thread.
    """
    # On the CPU, one intra-op thread (as ftcompile's measured profile times): a parallel kernel waits for
    # its slowest thread, so on a shared machine a descheduled worker stalls even tiny ops. Restored after.
    device = torch.device(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _measure(package, cfg, micro_batch, device)
    finally:
        torch.set_num_threads(threads)


def _measure(package, cfg: CacheConfig, micro_batch: dict, device: torch.device) -> dict:
    import shutil
    import tempfile

    m = package.manifest
    plan = cache_plan(m)
    if plan is None:
        raise CacheError("the package has no cacheable frozen stages")
    frozen = sorted(plan.levels)
    modules = {s: package.build_stage(s, device).train(True) for s in frozen}
    inputs = {gi.value: micro_batch[gi.value].to(device) for gi in m.inputs if gi.shape is not None}
    n = plan.layers
    c = cfg.cached_from if cfg.cached_from in plan.boundary and cfg.cached_from != n else 0
    out: dict = {"layers": n, "cached_from": c, "micro_batch_size": plan.micro_batch_size}
    full = run_frozen(package, modules, frozen, inputs)
    out["forward_ms"] = 1e3 * _timed(lambda: run_frozen(package, modules, frozen, inputs), device)
    if c:
        newly = [s for s in frozen if plan.levels[s] > c]
        at_c = {**inputs, **{v: full[v] for v in plan.boundary[c]}}
        out["advance_ms"] = 1e3 * _timed(lambda: run_frozen(package, modules, newly, at_c), device)
    # exactness: a sample's output must not depend on the other rows of its micro-batch, nor on its row
    out["exact"], out["reason"] = True, None
    b = plan.micro_batch_size
    if b > 1:
        rev = {k: t.flip(0) for k, t in inputs.items()}
        back = run_frozen(package, modules, frozen, rev)
        for L in sorted(plan.boundary):
            for v in plan.boundary[L]:
                same = torch.equal(back[v], full[v]) if v in plan.shared else torch.equal(back[v].flip(0), full[v])
                if not same:
                    out["exact"] = False
                    out["reason"] = (f"{v} of a sample changes when its micro-batch is reversed (by up to "
                                     f"{float((back[v].flip(0) - full[v]).abs().max()) if v not in plan.shared else 'n/a'}"
                                     "): the frozen layers mix the samples of a micro-batch or depend on a sample's "
                                     "row, so a cached activation would not be the one recomputing gives")
                    break
            if not out["exact"]:
                break
    # reading: write the micro-batch's entries into a scratch folder of the tier new entries take
    per_mb = [v for v in plan.boundary[n] if v not in plan.shared]
    need = sum(plan.entry_bytes(v) * b for v in per_mb)
    used = sum(x[0] for x in CacheIndex.load(cfg.index_in).bytes.values()) if cfg.index_in else 0
    tier = "memory" if cfg.memory and cfg.memory_budget - used >= need else "disk"
    base = Path(cfg.memory if tier == "memory" else cfg.disk)
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".measure-", dir=base))
    try:
        probe = CacheConfig(cfg.token, str(scratch), None, 0, None, n)
        ids = list(range(b))
        cpu_mb = {v: micro_batch[v] for v in plan.inputs}
        digests = sample_digests(cpu_mb, plan.inputs)
        for L in sorted(plan.boundary):
            for v in plan.boundary[L]:
                t = full[v].detach().to("cpu")
                for row, s in enumerate([None] if v in plan.shared else ids):
                    data = encode_entry(cfg.token, v, s, None if s is None else digests[row], n,
                                        t if s is None else t[row])
                    write_entry(entry_path(probe.tier_dir("disk"), v, s), data)

        def read_all(vs):
            dig = sample_digests(cpu_mb, plan.inputs)
            for v in vs:
                if v in plan.shared:
                    p = find_entry(probe, v, None)
                    decode_entry(p.read_bytes(), token=cfg.token, value=v, sample=None, digest=None,
                                 shape=plan.shapes[v], dtype=plan.dtypes[v], where=str(p)).to(device)
                    continue
                buf = torch.empty((b, *plan.shapes[v]), dtype=torch_dtype(plan.dtypes[v]))
                for row, s in enumerate(ids):
                    p = find_entry(probe, v, s)
                    buf[row] = decode_entry(p.read_bytes(), token=cfg.token, value=v, sample=s, digest=dig[row],
                                            shape=plan.shapes[v], dtype=plan.dtypes[v], where=str(p))
                buf.to(device)

        # a shared value is read once per rank, not per micro-batch
        out["read_ms"] = 1e3 * _timed(lambda: read_all(per_mb), device)
        if c:
            out["read_previous_ms"] = 1e3 * _timed(lambda: read_all([v for v in plan.boundary[c]
                                                                    if v not in plan.shared]), device)
        out["tier"] = tier
        out["bytes_per_micro_batch"] = need
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def measure_apart(package_path: str | os.PathLike, cfg: CacheConfig, micro_batch: dict, device="cpu") -> dict:
    """:func:`measure`, in a process of its own on a GPU: the CUDA context and the memory its allocator
    keeps leave with it, instead of staying on the GPU the phase's first rank then trains on."""
    import subprocess
    import sys
    import tempfile

    from .package import load_package

    if torch.device(device).type != "cuda":
        return measure(load_package(package_path), cfg, micro_batch, device)
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="ftcompile-measure-") as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in micro_batch.items()}, f"{tmp}/mb.safetensors")
        Path(f"{tmp}/cfg.json").write_text(json.dumps(cfg.to_json()))
        r = subprocess.run([sys.executable, "-m", "ftcompile.runtime.cache_measure", str(package_path), f"{tmp}/cfg.json",
                            f"{tmp}/mb.safetensors", str(device)], capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise CacheError(f"measuring AutoCache on {device} failed: {last}; give --freeze ...,cache=off to train "
                         "without it")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare_sizes(previous, package, layers: int, batch: dict, device="cpu") -> tuple[bool, str]:
    """Do entries cached by ``previous`` (a package of micro-batch size ``b0``) hold the bits ``package``
    (size ``b1``) computes? ``(same, why)``.

    Both packages' frozen stages of up to ``layers`` layers run on the first ``b0`` and the first
    ``b1`` samples of ``batch`` (a step's inputs, keyed by value name), on ``device``; every value
    leaving them must be bit for bit the same for the samples both saw (a value shared by every
    sample: the same, unless its shape follows the batch, when it is cached again anyway). Kernels
    may pick another blocking, and so another rounding, at another batch size; then a cached entry
    is not what recomputing gives, and the cache must not carry over.
    """
    device = torch.device(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        outs = []
        for pkg in (previous, package):
            m = pkg.manifest
            plan = cache_plan(m)
            if plan is None or layers not in plan.boundary:
                return False, f"package {pkg.path} has no frozen stages of {layers} layers to compare"
            stages = sorted(s for s, lv in plan.levels.items() if lv <= layers)
            modules = {s: pkg.build_stage(s, device).train(True) for s in stages}
            b = m.micro_batch_size
            inputs = {gi.value: batch[gi.value][:b].to(device) for gi in m.inputs if gi.shape is not None}
            vals = run_frozen(pkg, modules, stages, inputs)
            outs.append((plan, b, {v: vals[v].detach().to("cpu") for v in plan.boundary[layers]}))
    finally:
        torch.set_num_threads(threads)
    (_, b0, v0), (plan, b1, v1) = outs
    n = min(b0, b1)
    for v in plan.boundary[layers]:
        if v not in v0:
            return False, f"{v} leaves the frozen layers at micro-batch size {b1} but not at {b0}"
        a, c = v0[v], v1[v]
        if v in plan.shared:
            if a.shape != c.shape:
                continue
        else:
            a, c = a[:n], c[:n]
        if a.shape != c.shape or a.dtype != c.dtype:
            return False, f"{v} is {a.dtype} {list(a.shape)} at size {b0}, {c.dtype} {list(c.shape)} at {b1}"
        if not torch.equal(a, c):
            diff = float((a.double() - c.double()).abs().max()) if a.is_floating_point() else "n/a"
            return False, (f"{v} of a sample differs (by up to {diff}) between micro-batches of {b0} and of {b1}: "
                           "the kernels round differently at another batch size, so entries cached at one are not "
                           "what recomputing at the other gives")
    return True, f"the frozen layers give the first {n} samples the same bits in micro-batches of {b0} and of {b1}"


def compare_sizes_apart(previous_path, package_path, layers: int, batch: dict, device="cpu") -> tuple[bool, str]:
    """:func:`compare_sizes` from package paths, in a process of its own on a GPU (as :func:`measure_apart`)."""
    import subprocess
    import sys
    import tempfile

    from .package import load_package

    if torch.device(device).type != "cuda":
        return compare_sizes(load_package(previous_path), load_package(package_path), layers, batch, device)
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="ftcompile-compare-") as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in batch.items()}, f"{tmp}/batch.safetensors")
        r = subprocess.run([sys.executable, "-m", "ftcompile.runtime.cache_measure", "--compare", str(previous_path),
                            str(package_path), str(layers), f"{tmp}/batch.safetensors", str(device)],
                           capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        return False, f"comparing the frozen layers at both micro-batch sizes on {device} failed: {last}"
    same, why = json.loads(r.stdout.strip().splitlines()[-1])
    return bool(same), str(why)


def _main(argv: Sequence[str]) -> None:
    """``python -m ftcompile.runtime.cache_measure PACKAGE CONFIG MICRO_BATCH DEVICE``: :func:`measure`, as JSON;
    ``... --compare PREVIOUS PACKAGE LAYERS BATCH DEVICE``: :func:`compare_sizes`, as JSON."""
    from safetensors.torch import load_file

    from .package import load_package

    if argv and argv[0] == "--compare":
        previous, package, layers, batch, device = argv[1:]
        print(json.dumps(list(compare_sizes(load_package(previous), load_package(package), int(layers),
                                            load_file(batch), device))))
        return
    package, config, mb, device = argv
    print(json.dumps(measure(load_package(package), CacheConfig.load(config), load_file(mb), device)))


def decide(mode: str, cfg: CacheConfig, measured: dict | None) -> tuple[list[int], bool, str]:
    """The levels a phase reads and whether it writes: ``(use, write, why)``, from ``measure``'s figures.

    ``auto`` reads the cached boundary of ``n`` frozen layers when reading a micro-batch's is faster
    than its frozen forward, and advances the previous phase's (``c`` layers) when reading it and
    running the newly frozen layers is; ``on`` reads both whatever the timing. Neither uses a
    cache that is not exact.
    """
    n, c = cfg.layers, cfg.cached_from
    if measured is None:
        return [], False, "not measured"
    if not measured.get("exact", False):
        return [], False, f"not exact: {measured.get('reason')}"
    if mode == "on":
        use = [n] + ([c] if c else [])
        return use, True, "cache=on"
    fwd = measured["forward_ms"]
    use = []
    why = []
    if measured["read_ms"] < fwd:
        use.append(n)
        why.append(f"reading {measured['read_ms']:.3f} ms < recomputing {fwd:.3f} ms per micro-batch")
    else:
        why.append(f"reading {measured['read_ms']:.3f} ms >= recomputing {fwd:.3f} ms per micro-batch")
    if c and "read_previous_ms" in measured:
        adv = measured["read_previous_ms"] + measured["advance_ms"]
        if adv < fwd:
            use.append(c)
            why.append(f"advancing (read {measured['read_previous_ms']:.3f} + newly frozen "
                       f"{measured['advance_ms']:.3f} ms) < {fwd:.3f} ms")
        else:
            why.append(f"advancing ({adv:.3f} ms) >= {fwd:.3f} ms")
    return use, n in use, "; ".join(why)


if __name__ == "__main__":
    import sys

    _main(sys.argv[1:])
