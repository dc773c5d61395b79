"""Cluster specs: how many GPUs, how much memory each, how fast they talk.

A cluster is ``nodes`` machines of ``gpus_per_node`` GPUs. Bandwidth between two
GPUs depends on where they are: the same GPU (two stages of a Mixed-pipe plan
exchanging a value: a device-local copy), the same machine (PCIe or NVLink), or
different machines (the network).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace

from .hardware import PRESETS as HARDWARE_PRESETS


class ClusterError(ValueError):
    """A bad cluster spec, size or bandwidth string."""


_UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(text: str | int | float) -> int:
    """Bytes from ``11GB`` (10^9), ``11GiB`` (2^30), ``512MB`` or a plain number."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ClusterError(f"size must be positive, got {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ClusterError(f"cannot read size {text!r}: write it like 11GB, 11GiB or 512MB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise ClusterError(f"size must be positive, got {text!r}")
    return int(value)


def parse_bandwidth(text: str | int | float) -> float:
    """Bytes per second from ``12GB/s``, ``100Gbit/s`` or a plain number."""
    if isinstance(text, (int, float)):
        if text <= 0:
            raise ClusterError(f"bandwidth must be positive, got {text}")
        return float(text)
    s = str(text).strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(bit|b|B|iB)?(/s|ps)?", s)
    if not m:
        raise ClusterError(f"cannot read bandwidth {text!r}: write it like 12GB/s or 100Gbit/s")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    if m.group(3) in ("bit", "b"):
        value /= 8
    if value <= 0:
        raise ClusterError(f"bandwidth must be positive, got {text!r}")
    return value


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs that a plan is made for."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu_memory: int                  # bytes usable per GPU
    intra_node_bandwidth: float      # bytes/s between GPUs of one machine
    inter_node_bandwidth: float      # bytes/s between machines
    local_copy_bandwidth: float      # bytes/s for a value passed between two stages on one GPU
    hardware: str = "rtx2080ti"      # hardware preset (or spec file) the analytic costs use
    # A view of some GPUs of this cluster (one pipeline among replicas): the physical GPU of each
    # GPU of the view, which decides the links between them. None: all GPUs, in order.
    gpu_ids: tuple[int, ...] | None = None

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_ids) if self.gpu_ids is not None else self.nodes * self.gpus_per_node

    @property
    def physical_gpus(self) -> int:
        """GPUs of the whole cluster (a view covers some of them)."""
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return (self.gpu_ids[gpu] if self.gpu_ids is not None else gpu) // self.gpus_per_node

    def view(self, gpu_ids) -> "ClusterSpec":
        """These physical GPUs, in this order, as a cluster of their own (their links as they are)."""
        ids = tuple(int(g) for g in gpu_ids)
        if any(not 0 <= g < self.physical_gpus for g in ids) or len(set(ids)) != len(ids):
            raise ClusterError(f"GPUs {list(ids)} are not distinct GPUs of the {self.physical_gpus}-GPU cluster "
                               f"{self.name}")
        return replace(self, gpu_ids=ids)

    def physical_bandwidth(self, a: int, b: int) -> float:
        """The link between two physical GPUs of the whole cluster."""
        if a == b:
            return self.local_copy_bandwidth
        if a // self.gpus_per_node == b // self.gpus_per_node:
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth

    def bandwidth(self, src_gpu: int, dst_gpu: int) -> float:
        if src_gpu == dst_gpu:
            return self.local_copy_bandwidth
        if self.node_of(src_gpu) == self.node_of(dst_gpu):
            return self.intra_node_bandwidth
        return self.inter_node_bandwidth

    def with_overrides(self, *, gpus: int | None = None, gpu_memory=None, bandwidth=None,
                       hardware: str | None = None) -> "ClusterSpec":
        """The same cluster with command-line overrides applied (``--gpus 8 --gpu-memory 11GB``)."""
        c = self
        if gpus is not None:
            if gpus < 1:
                raise ClusterError(f"--gpus must be at least 1, got {gpus}")
            per = min(c.gpus_per_node, gpus) if gpus % min(c.gpus_per_node, gpus) == 0 else gpus
            c = replace(c, nodes=gpus // per, gpus_per_node=per, gpu_ids=None)
        if gpu_memory is not None:
            c = replace(c, gpu_memory=parse_size(gpu_memory))
        if bandwidth is not None:
            bw = parse_bandwidth(bandwidth)
            c = replace(c, intra_node_bandwidth=bw, inter_node_bandwidth=min(bw, c.inter_node_bandwidth))
        if hardware is not None:
            c = replace(c, hardware=hardware)
        return c

    def to_json(self) -> dict:
        d = asdict(self)
        if self.gpu_ids is None:
            del d["gpu_ids"]
        else:
            d["gpu_ids"] = list(self.gpu_ids)
        return d

    @staticmethod
    def from_json(d: dict) -> "ClusterSpec":
        known = set(ClusterSpec.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ClusterError(f"cluster spec has unknown field(s) {unknown}; known: {sorted(known)}")
        try:
            spec = ClusterSpec(
                name=str(d.get("name", "custom")), nodes=int(d["nodes"]), gpus_per_node=int(d["gpus_per_node"]),
                gpu_memory=parse_size(d["gpu_memory"]),
                intra_node_bandwidth=parse_bandwidth(d["intra_node_bandwidth"]),
                inter_node_bandwidth=parse_bandwidth(d.get("inter_node_bandwidth", d["intra_node_bandwidth"])),
                local_copy_bandwidth=parse_bandwidth(d.get("local_copy_bandwidth", 200e9)),
                hardware=str(d.get("hardware", "rtx2080ti")),
                gpu_ids=tuple(int(g) for g in d["gpu_ids"]) if d.get("gpu_ids") is not None else None,
            )
        except KeyError as exc:
            raise ClusterError(f"cluster spec lacks field {exc.args[0]!r}") from None
        if spec.nodes < 1 or spec.gpus_per_node < 1:
            raise ClusterError("cluster spec needs nodes >= 1 and gpus_per_node >= 1")
        return spec


GiB = 1024**3

PRESETS: dict[str, ClusterSpec] = {
    # The FTPipe paper's server: 8 commodity GPUs on PCIe 3.0.
    "paper-8x2080ti": ClusterSpec("paper-8x2080ti", 1, 8, 11 * 10**9, 12e9, 12e9, 300e9, "rtx2080ti"),
    "4xv100-32gb": ClusterSpec("4xv100-32gb", 1, 4, 32 * 10**9, 150e9, 12.5e9, 450e9, "v100-32gb"),
    "8xv100-32gb": ClusterSpec("8xv100-32gb", 1, 8, 32 * 10**9, 150e9, 12.5e9, 450e9, "v100-32gb"),
    "8xa100-80gb": ClusterSpec("8xa100-80gb", 1, 8, 80 * 10**9, 300e9, 25e9, 1000e9, "a100-80gb"),
    "8xh100-80gb": ClusterSpec("8xh100-80gb", 1, 8, 80 * 10**9, 450e9, 50e9, 1500e9, "h100-80gb"),
    "2x8xh100-80gb": ClusterSpec("2x8xh100-80gb", 2, 8, 80 * 10**9, 450e9, 50e9, 1500e9, "h100-80gb"),
    "2xcpu": ClusterSpec("2xcpu", 1, 2, 8 * 10**9, 5e9, 1e9, 10e9, "cpu"),
}


def load_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name, or a spec from a JSON file with ClusterSpec's fields."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        try:
            with open(name_or_path, encoding="utf-8") as f:
                return ClusterSpec.from_json(json.load(f))
        except (OSError, json.JSONDecodeError) as exc:
            raise ClusterError(f"cannot read cluster spec {name_or_path}: {exc}") from None
    raise ClusterError(f"unknown cluster {name_or_path!r}: use one of {', '.join(PRESETS)} or a JSON spec file")


def default_cluster_for(hardware: str) -> ClusterSpec:
    """A single-machine cluster of 8 GPUs of a hardware preset."""
    hw = HARDWARE_PRESETS.get(hardware)
    for c in PRESETS.values():
        if c.hardware == hardware:
            return c
    if hw is None:
        return PRESETS["paper-8x2080ti"]
    return ClusterSpec(f"8x{hardware}", 1, 8, hw.memory_bytes, hw.link_bandwidth, hw.link_bandwidth / 4,
                       hw.memory_bandwidth / 2, hardware)
