"""Hardware specs: what the analytic cost model needs to know about a device.

Presets hold public datasheet figures (dense, no sparsity). The analytic model
multiplies peaks by ``efficiency`` because no real kernel mix reaches them.
A user spec is a JSON file with the same fields (see ``HardwareSpec``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

GB = 1e9
TFLOPS = 1e12


class HardwareError(ValueError):
    """An unknown preset or a bad spec file."""


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or CPU) as the cost model sees it.

    ``peak_flops`` maps a dtype name to dense peak FLOP/s for matrix work;
    elementwise work is bound by ``memory_bandwidth`` (bytes/s).
    ``link_bandwidth`` is the device-to-device bandwidth (bytes/s) used for
    activations between stages; ``host_bandwidth`` the host link used for
    swapping. ``kernel_overhead_s`` is the fixed cost of launching one operator.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int
    link_bandwidth: float
    host_bandwidth: float
    kernel_overhead_s: float = 5e-6
    matmul_efficiency: float = 0.6
    memory_efficiency: float = 0.7
    # Device memory a training process uses outside its tensors: the CUDA context and kernel
    # images, cuBLAS/cuDNN workspaces, NCCL buffers, the caching allocator's fragmentation.
    # Plans keep it free on every GPU.
    memory_reserve_bytes: int = 0
    description: str = ""
    extra: dict = field(default_factory=dict)

    def flops_per_s(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``, falling back to float32's when the dtype is not listed."""
        return self.peak_flops.get(dtype, self.peak_flops.get("float32", min(self.peak_flops.values())))

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "HardwareSpec":
        """A spec from its JSON form, every field checked; errors name the field and the fix."""
        fix = "fix the hardware spec file (fields: see ftcompile.hardware.HardwareSpec, or copy a preset's)"
        if not isinstance(d, dict):
            raise HardwareError(f"a hardware spec must be a JSON object of fields, got a {type(d).__name__}; {fix}")
        required = ("name", "peak_flops", "memory_bandwidth", "memory_bytes", "link_bandwidth", "host_bandwidth")
        missing = [k for k in required if k not in d]
        if missing:
            raise HardwareError(f"hardware spec lacks field(s) {missing}; required: {list(required)}")
        known = set(HardwareSpec.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise HardwareError(f"hardware spec has unknown field(s) {unknown}; known fields: {sorted(known)}")

        def number(key: str, value: Any, *, what: str = "a positive number", low_ok: bool = False,
                   high: float | None = None) -> float:
            # bool is an int to Python, but `true` for a bandwidth is a mistake, not 1.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise HardwareError(f"hardware spec field {key} must be {what}, got {value!r} "
                                    f"({type(value).__name__}); write it as a JSON number")
            v = float(value)
            if not math.isfinite(v) or v < 0.0 or (v == 0.0 and not low_ok) or (high is not None and v > high):
                raise HardwareError(f"hardware spec field {key} must be {what}, got {value!r}")
            return v

        if not isinstance(d["name"], str) or not d["name"].strip():
            raise HardwareError(f"hardware spec field name must be a non-empty string, got {d['name']!r}")
        peaks = d["peak_flops"]
        if not isinstance(peaks, dict) or not peaks:
            raise HardwareError("hardware spec field peak_flops must be a non-empty object mapping dtype names to "
                                f"FLOP/s, e.g. {{\"float32\": 15.7e12}}; got {peaks!r}")
        peak_flops = {str(k): number(f"peak_flops[{k!r}]", v, what="a positive FLOP/s figure")
                      for k, v in peaks.items()}
        fields = {"name": d["name"], "peak_flops": peak_flops}
        for k in ("memory_bandwidth", "link_bandwidth", "host_bandwidth"):
            fields[k] = number(k, d[k], what="a positive number of bytes per second")
        mem = number("memory_bytes", d["memory_bytes"], what="a positive whole number of bytes")
        if mem != int(mem):
            raise HardwareError(f"hardware spec field memory_bytes must be a whole number of bytes, "
                                f"got {d['memory_bytes']!r}")
        fields["memory_bytes"] = int(mem)
        if "memory_reserve_bytes" in d:
            reserve = number("memory_reserve_bytes", d["memory_reserve_bytes"], what="a whole number of bytes >= 0",
                             low_ok=True)
            if reserve != int(reserve) or reserve >= fields["memory_bytes"]:
                raise HardwareError(f"hardware spec field memory_reserve_bytes must be a whole number of bytes "
                                    f"below memory_bytes, got {d['memory_reserve_bytes']!r}")
            fields["memory_reserve_bytes"] = int(reserve)
        if "kernel_overhead_s" in d:
            fields["kernel_overhead_s"] = number("kernel_overhead_s", d["kernel_overhead_s"],
                                                 what="a number of seconds >= 0", low_ok=True)
        for k in ("matmul_efficiency", "memory_efficiency"):
            if k in d:
                fields[k] = number(k, d[k], what="a fraction in (0, 1] (share of the peak reached)", high=1.0)
        if "description" in d:
            if not isinstance(d["description"], str):
                raise HardwareError(f"hardware spec field description must be a string, got {d['description']!r}")
            fields["description"] = d["description"]
        if "extra" in d:
            if not isinstance(d["extra"], dict):
                raise HardwareError(f"hardware spec field extra must be an object, got {d['extra']!r}")
            fields["extra"] = dict(d["extra"])
        return HardwareSpec(**fields)


PRESETS: dict[str, HardwareSpec] = {
    "rtx2080ti": HardwareSpec(
        name="rtx2080ti",
        # GeForce Turing: fp16 tensor cores with fp32 accumulate run at half rate (26.9 TF).
        peak_flops={"float32": 13.4 * TFLOPS, "float16": 26.9 * TFLOPS, "bfloat16": 13.4 * TFLOPS},
        memory_bandwidth=616 * GB, memory_bytes=11 * 1024**3,
        link_bandwidth=12 * GB, host_bandwidth=12 * GB, kernel_overhead_s=6e-6,
        # ~300 MB CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers, ~5% allocator fragmentation
        memory_reserve_bytes=int(0.8 * GB),
        description="NVIDIA GeForce RTX 2080 Ti, 11 GB, PCIe 3.0 x16 (the FTPipe paper's server)"),
    "v100-32gb": HardwareSpec(
        name="v100-32gb",
        peak_flops={"float32": 15.7 * TFLOPS, "float16": 125 * TFLOPS, "bfloat16": 15.7 * TFLOPS},
        memory_bandwidth=900 * GB, memory_bytes=32 * 1024**3,
        link_bandwidth=150 * GB, host_bandwidth=12 * GB, kernel_overhead_s=5e-6,
        memory_reserve_bytes=int(1.5 * GB),
        description="NVIDIA V100 SXM2 32 GB, NVLink 2"),
    "a100-80gb": HardwareSpec(
        name="a100-80gb",
        # float32 matmuls use TF32 tensor cores by default in most frameworks' training setups.
        peak_flops={"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS, "float16": 312 * TFLOPS,
                    "bfloat16": 312 * TFLOPS},
        memory_bandwidth=2039 * GB, memory_bytes=80 * 1024**3,
        link_bandwidth=300 * GB, host_bandwidth=25 * GB, kernel_overhead_s=4e-6,
        memory_reserve_bytes=int(2.5 * GB),
        description="NVIDIA A100 SXM4 80 GB, NVLink 3"),
    "h100-80gb": HardwareSpec(
        name="h100-80gb",
        peak_flops={"float32": 67 * TFLOPS, "tf32": 494 * TFLOPS, "float16": 989 * TFLOPS,
                    "bfloat16": 989 * TFLOPS, "float8_e4m3fn": 1979 * TFLOPS},
        memory_bandwidth=3350 * GB, memory_bytes=80 * 1024**3,
        link_bandwidth=450 * GB, host_bandwidth=55 * GB, kernel_overhead_s=4e-6,
        memory_reserve_bytes=int(2.5 * GB),
        description="NVIDIA H100 SXM5 80 GB, NVLink 4"),
    "cpu": HardwareSpec(
        name="cpu",
        peak_flops={"float32": 100e9, "float16": 25e9, "bfloat16": 50e9, "float64": 50e9},
        memory_bandwidth=20 * GB, memory_bytes=16 * 1024**3,
        link_bandwidth=5 * GB, host_bandwidth=20 * GB, kernel_overhead_s=5e-6,
        matmul_efficiency=0.5, memory_efficiency=0.5,
        description="a small multi-core x86 server CPU (for tests and CPU runs)"),
}


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A preset by name, or a spec from a JSON file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        try:
            with open(name_or_path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise HardwareError(f"cannot read hardware spec {name_or_path}: {exc}") from None
        return HardwareSpec.from_json(data)
    raise HardwareError(f"unknown hardware {name_or_path!r}: use one of {', '.join(PRESETS)} "
                        "or a JSON spec file with the fields of ftcompile.hardware.HardwareSpec")
