"""Which rank runs which stage of which replica (data x pipeline parallelism).

A job of W ranks trains R replicas of a pipeline; each replica's W / R ranks host the plan's
GPUs (GPU ``g`` of ``G`` on pipeline rank ``g * (W / R) // G``, as without replicas). A rank
is (replica, pipeline rank), numbered either pipeline-major (a replica's ranks consecutive:
``rank = r * W / R + p``; on a multi-host launch, a pipeline stays on one host when its ranks
fit there) or replica-major (one pipeline rank's replicas consecutive: ``rank = p * R + r``;
the all-reduces stay on one host). The layout is an argument of the engine, so a job can be
rebuilt with another R between training phases.
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifest import Manifest

ORDERS = ("pipeline-major", "replica-major")


class LayoutError(ValueError):
    """The ranks cannot be laid out as asked; the message says what would work."""


def rank_of_gpu(gpu: int, gpus: int, ranks: int) -> int:
    """The pipeline rank of planned GPU ``gpu`` of ``gpus`` on a pipeline of ``ranks`` ranks: GPUs
    in order, shared out evenly (fewer ranks than GPUs put neighbouring GPUs' stages on one rank)."""
    return min(gpu * ranks // max(gpus, 1), ranks - 1)


@dataclass(frozen=True)
class RankLayout:
    world_size: int
    replicas: int
    rank: int
    order: str = "pipeline-major"

    def __post_init__(self):
        if self.replicas < 1 or self.world_size % self.replicas:
            options = [r for r in range(1, self.world_size + 1) if self.world_size % r == 0]
            raise LayoutError(f"{self.replicas} replicas do not divide {self.world_size} ranks; choose --replicas "
                              f"among {options}")
        if self.order not in ORDERS:
            raise LayoutError(f"unknown rank order {self.order!r}; choose {' or '.join(ORDERS)}")
        if not 0 <= self.rank < self.world_size:
            raise LayoutError(f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def pipeline_ranks(self) -> int:
        return self.world_size // self.replicas

    def global_rank(self, replica: int, p: int) -> int:
        if self.order == "pipeline-major":
            return replica * self.pipeline_ranks + p
        return p * self.replicas + replica

    @property
    def replica(self) -> int:
        if self.order == "pipeline-major":
            return self.rank // self.pipeline_ranks
        return self.rank % self.replicas

    def pipeline_rank(self, manifest: Manifest, stage: int) -> int:
        return rank_of_gpu(manifest.stage(stage).gpu, manifest.num_gpus, self.pipeline_ranks)

    def stage_ranks(self, manifest: Manifest, replica: int | None = None) -> dict[int, int]:
        """Stage id -> the rank running it in ``replica`` (default: this rank's)."""
        r = self.replica if replica is None else replica
        return {s.id: self.global_rank(r, self.pipeline_rank(manifest, s.id)) for s in manifest.stages}

    def stage_groups(self, manifest: Manifest) -> dict[int, list[int]]:
        """Stage id -> the ranks running it, one per replica (its all-reduce group)."""
        return {s.id: [self.global_rank(r, self.pipeline_rank(manifest, s.id)) for r in range(self.replicas)]
                for s in manifest.stages}
