"""Dataflow execution of one rank's pipeline stages.

A rank (one process, one GPU) hosts every stage its GPU was given and runs
their :mod:`~ftcompile.runtime.schedules` programs:

* **Dataflow.** A stage's next task runs as soon as what it needs is there:
  ``F(k)`` every input of micro-batch ``k``, from whichever stage makes it;
  ``B(k)`` the gradient of each output from every stage that reads it;
  ``U(j)`` the other holders' gradients of shared (tied) parameters and, when
  clipping, every stage's gradient norm. Among its stages the rank runs any
  ready task, backwards first, so a Mixed-pipe GPU with several non-adjacent
  stages never waits on one while another could run.
* **Messages.** An output goes straight to every rank that reads it, once per
  rank (stages on the same rank read it in place); input gradients go back to
  their producer. Sends are non-blocking and one receiver thread per peer
  receives into buffers shaped from the manifest, so communication overlaps
  computation.
* **Flow control.** A stage runs ``F(k)`` only when every stage reading its
  outputs has taken micro-batch ``k - W`` (``W``: the edge's window, by default
  the micro-batches the producer itself keeps in flight). Where gradients come
  back from the reader, its schedule already keeps it that close; elsewhere
  (values that carry no gradient, like masks made from the input) readers send
  credits, so no stage can run ahead and fill another's memory. What waits in a
  receive buffer is therefore at most ``W`` micro-batches per value, which the
  plan's memory model counts (:func:`flow_windows`).
* **Weight versions.** Each forward and backward uses the version its program
  names. The live parameters are the newest version; an older one is a stash
  copied at the update that would overwrite it, kept only while a task still
  needs it (:func:`~ftcompile.runtime.schedules.needs_version`). A forward whose
  activations are kept across an update runs on a copy, so the update never
  changes what its backward reads.
* **Shared parameters.** Every holder sums all holders' gradients in stage
  order and takes the same step, so the copies stay identical.
* **Failures.** A lost peer is reported at once; nothing arriving for
  ``timeout_s`` raises :class:`PipelineHang` naming the stage, the value and
  the rank it waits for. A loss that is not finite stops the run naming the
  step and the stage, or skips the step's update on every stage
  (``nonfinite="skip"``).

The stage-to-rank map, the transport and the configuration are arguments, so a
job can build a new engine for a new plan (fewer ranks, frozen stages). Memory
is O(pipeline depth x micro-batches): programs are generated lazily and a step
leaves nothing behind once every rank has reported it.
"""

from __future__ import annotations

import contextlib
import math
import pickle
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call

from . import optim as _optim
from .layout import RankLayout, rank_of_gpu
from .manifest import Manifest, torch_dtype
from .memory import MemoryMeter, optimizer_tensors
from .ops import mix_seed
from .package import Package
from .pacing import pace, pacers, stage_priority
from .schedules import (StageProgram, Task, exchanges_norms, flow_control, flow_window, needs_version, shared_lag,
                        stage_programs)

ACT, GRAD, SHARED, NORM, STATS, CREDIT, FIN = 1, 2, 3, 4, 5, 6, 9
NONFINITE = ("stop", "skip")


class PipelineError(RuntimeError):
    """A pipeline run failed; the message names the rank and stage."""


class PipelineHang(PipelineError):
    """Nothing arrived for longer than the timeout."""


@dataclass
class TrainConfig:
    """How to train: schedule, optimizer, clipping; the same on every rank."""

    schedule: str = "1f1b"
    micro_batches: int = 4
    steps: int = 10
    optimizer: str = "adam"           # sgd, momentum, adam, adamw, adafactor
    lr: float = 1e-3
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_schedule: str = "constant"     # constant, linear, cosine
    warmup_steps: int = 0
    clip_grad_norm: float | None = None
    tied_lag: bool = True             # schedules without a flush: tied tensors apply the last step's sum
    recompute: bool = False           # gpipe, 1f1b, 2bw, 2gw: recompute in backward
    weight_prediction: bool = False   # async: forward on weights predicted to the backward's version
    seed: int = 0
    dropout: bool = True              # train mode: dropout active (keyed per micro-batch, so recomputation agrees)
    timeout_s: float = 300.0
    total_steps: int | None = None    # for LR schedules across checkpoints; default ``steps``
    nonfinite: str = "stop"           # a loss that is not finite: stop the run, or skip the step's update
    advance: int = 0                  # avgpipe: micro-batches forwarded in advance of 1F1B's warm-up
    in_flight_scale: int = 1          # async, pipedream, 2bw: scale * depth + 1 warm-up forwards per stage
    measure_memory: bool = False      # count every tensor the rank holds (CPU); see runtime.memory

    def optim_config(self) -> _optim.OptimConfig:
        """The optimizer and LR schedule every stage builds."""
        return _optim.OptimConfig(self.optimizer, self.lr, self.momentum, self.betas, self.eps, self.weight_decay,
                                  self.lr_schedule, self.warmup_steps, self.total_steps or self.steps)


def stage_ranks(manifest: Manifest, world_size: int) -> dict[int, int]:
    """Stage id -> rank of one pipeline on ``world_size`` ranks (:func:`.layout.rank_of_gpu`: several GPUs'
    stages share a rank when there are fewer ranks than planned GPUs)."""
    return {s.id: rank_of_gpu(s.gpu, manifest.num_gpus, world_size) for s in manifest.stages}


def programs(manifest: Manifest, cfg: TrainConfig, steps: int) -> dict[int, StageProgram]:
    """Every stage's program for ``steps`` steps under ``cfg``."""
    return stage_programs(cfg.schedule, {s.id: s.depth for s in manifest.stages}, micro_batches=cfg.micro_batches,
                          steps=steps, recompute=cfg.recompute, advance=cfg.advance,
                          in_flight_scale=cfg.in_flight_scale)


def flow_windows(manifest: Manifest, progs: dict[int, StageProgram],
                 windows: dict[tuple[int, int], int] | None = None) -> dict[tuple[int, int], tuple[int, bool]]:
    """The flow control of every edge of ``manifest`` carrying tensors: ``windows`` where given, else
    :func:`~ftcompile.runtime.schedules.flow_window` (the compiler prices the same windows)."""
    returns: dict[tuple[int, int], bool] = {}
    for v in manifest.values.values():
        if v.producer is None or not v.is_tensor:
            continue
        for c in v.consumers:
            if c != v.producer:
                key = (v.producer, c)
                returns[key] = returns.get(key, False) or (v.requires_grad and v.is_floating)
    depth = {s.id: s.depth for s in manifest.stages}
    w = {(p, c): flow_window(progs[p], depth[c]) for p, c in returns}
    w.update({e: x for e, x in (windows or {}).items() if e in w})
    return flow_control(returns, {s: p.in_flight for s, p in progs.items()}, w)


#: The optimizer-state key under which a checkpoint keeps a lagging shared tensor's pending sum.
LAGGED_GRAD = "lagged_grad"


def lags_shared(cfg: TrainConfig) -> bool:
    """Whether shared tensors apply their summed gradient one step late under ``cfg``
    (:func:`~ftcompile.runtime.schedules.shared_lag`); the engine and the reference both ask here."""
    return bool(shared_lag(cfg.schedule, exchanges_norms(cfg.clip_grad_norm, cfg.nonfinite), cfg.tied_lag))


def sum_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """Holders' gradient parts of a shared tensor summed in the order given (stage order): every
    holder, and the reference, add the same tensors the same way, so the copies stay bit-equal."""
    if len(parts) == 1:
        return parts[0].clone()
    total = parts[0] + parts[1]
    for g in parts[2:]:
        total.add_(g)
    return total


def grad_order(manifest: Manifest, v: str) -> list[int]:
    """The readers of ``v`` in the order their gradient parts are summed: nearest the end of the
    pipeline first (they come back first), then by id. The reference sums in the same order."""
    depth = {s.id: s.depth for s in manifest.stages}
    return sorted(manifest.values[v].consumers, key=lambda c: (depth[c], c))


class GradSum:
    """The gradient of one value for one micro-batch, summed from its readers' parts in
    :func:`grad_order`: a part that comes in order joins the sum at once; one that comes early
    waits for those before it, so the sum is the same whatever the arrival order."""

    __slots__ = ("n", "next", "total", "early")

    def __init__(self, n: int):
        self.n, self.next, self.total, self.early = n, 0, None, {}

    def put(self, i: int, g: torch.Tensor) -> None:
        if i != self.next:
            self.early[i] = g
            return
        while True:
            # the parts are this engine's own (received buffers, local gradients): sum in place
            self.total = g if self.total is None else self.total.add_(g)
            self.next += 1
            if self.next not in self.early:
                return
            g = self.early.pop(self.next)

    def has(self, i: int) -> bool:
        return i < self.next or i in self.early

    @property
    def complete(self) -> bool:
        return self.next == self.n


def accepts_update_buffers(module: torch.nn.Module) -> bool:
    """Whether a stage's forward takes ``update_buffers=`` (stages that write running statistics)."""
    import inspect

    try:
        return "update_buffers" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


#: Words of the errors PyTorch's kernels raise when a value indexes past a table: an embedding's
#: "index out of range in self", cross-entropy's "Target 7000 is out of bounds", a CUDA kernel's
#: device-side assert. Under ``_call`` they come from the data, not from ftcompile. (Python's own
#: "list index out of range" is not among them: that is a bug, reported as one.) A CUDA assert
#: usually surfaces at a later synchronisation instead, so that entry is best effort: the host
#: check of each step's inputs (data.check_index_ranges) comes first.
_OUT_OF_RANGE = ("index out of range in self", "is out of bounds", "device-side assert")


def _call(module: torch.nn.Module, weights: dict, live: dict, args: tuple, seed: int, *, recompute: bool = False):
    # A recomputation repeats a forward that already ran: it must not update running
    # statistics (BatchNorm) a second time.
    kwargs = {"seed": seed}
    if recompute and getattr(module, "_ftc_updates_buffers", False):
        kwargs["update_buffers"] = False
    try:
        # The live weights are the module's own: call it directly, skipping functional_call's
        # re-parametrisation, which costs more than a small stage's compute.
        if weights is live:
            return module(*args, **kwargs)
        return functional_call(module, weights, args, kwargs, strict=False)
    except (IndexError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not any(w in str(exc) for w in _OUT_OF_RANGE):
            raise
        from .data import DataError

        raise DataError(f"stage {getattr(module, 'STAGE', '?')}: {type(exc).__name__}: {text}: a value of the "
                        "data (a token id, a label, a position) is outside what the model takes: token ids must "
                        "be below its vocabulary size, class labels below its number of classes (or the ignore "
                        "index, -100); check the data (--data)") from exc


def micro_batch_seed(seed: int, step: int, index: int) -> int:
    """The dropout seed of micro-batch ``index`` of the run's step ``step`` (numbered across the
    replicas' global batch): the same in forward and recomputation, on any rank. Keyed by the step
    first so that a run whose micro-batches per step change (a resume with another ``M``, a freeze
    phase with other replicas) never draws a mask it drew at another step."""
    return mix_seed(mix_seed(seed, step), index)


@dataclass
class StageTimes:
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    update_s: float = 0.0
    forwards: int = 0
    backwards: int = 0

    def take(self) -> dict:
        d = {"forward_s": self.forward_s, "backward_s": self.backward_s, "recompute_s": self.recompute_s,
             "update_s": self.update_s, "forwards": self.forwards, "backwards": self.backwards}
        self.__init__()
        return d


@dataclass
class _Stage:
    id: int
    module: torch.nn.Module
    program: StageProgram
    params: dict[str, torch.nn.Parameter]
    tasks: Iterator[Task]
    next: Task | None = None
    version: int = 0                  # the live weights' version
    stash: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    saved: dict[int, tuple] = field(default_factory=dict)
    next_forward: int = 0             # the micro-batch of the next F (= micro-batches taken so far)
    pending: deque = field(default_factory=deque)    # micro-batches whose F ran and whose B has not
    update_phase: int = 0             # U(j): 0 not begun, 1 averaging over replicas, 2 shared sent, 3 norm sent
    bad_loss: set = field(default_factory=set)       # steps with a loss that is not finite
    times: StageTimes = field(default_factory=StageTimes)
    # Where the live weights keep their data: the updates (and AvgPipe's pull) write it in place,
    # so an output viewing it is copied before it is handed on. Stashed and predicted copies are
    # never written, and buffers are rebound, not overwritten (ops.update_buffer).
    live: frozenset = field(init=False)

    def __post_init__(self) -> None:
        self.live = frozenset(p.untyped_storage().data_ptr() for p in self.params.values() if p.numel())

    def advance(self) -> None:
        self.next = next(self.tasks, None)

    def oldest_pending(self) -> int | None:
        return self.pending[0] if self.pending else None

    def forward_left(self) -> int | None:
        return self.next_forward if self.next_forward < self.program.num_micro_batches else None


class RankEngine:
    """Runs the stages of ``package`` that ``ranks`` puts on ``rank``; see the module docstring."""

    def __init__(self, package: Package, cfg: TrainConfig, *, rank: int = 0, world_size: int = 1,
                 transport=None, device: str | torch.device = "cpu", ranks: dict[int, int] | None = None,
                 dtype: torch.dtype | None = None, windows: dict[tuple[int, int], int] | None = None,
                 layout: RankLayout | None = None, averaging=None, grad_hook=None, cache=None):
        if cfg.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {', '.join(NONFINITE)}, got {cfg.nonfinite!r}")
        self.package, self.m, self.cfg = package, package.manifest, cfg
        self.rank, self.world_size, self.transport = rank, world_size, transport
        self.device = torch.device(device)
        self.layout = layout
        if layout is not None:
            ranks = layout.stage_ranks(self.m)
        self.ranks = ranks if ranks is not None else stage_ranks(self.m, world_size)
        self.replicas = layout.replicas if layout is not None else 1
        self.replica = layout.replica if layout is not None else 0
        if world_size > 1 and transport is None:
            raise PipelineError("several ranks need a transport")
        self.windows = windows
        # Elastic averaging (AvgPipe) or any other rule applied after each stage's optimizer step:
        # ``averaging.ready(stage, step)`` names what U(step) still waits for (None: nothing),
        # ``averaging.after_step(stage, step, params)`` runs right after the step.
        self.averaging = averaging
        # Freeze training: ``grad_hook(stage, step, params)`` sees the gradients each step takes;
        # ``cache`` (AutoCache, runtime/cache.py) skips frozen stages whose output it holds.
        self.grad_hook = grad_hook
        self.cache = cache
        self.meter = MemoryMeter() if cfg.measure_memory else None
        self.value_names = sorted(self.m.values)
        self.value_index = {v: i for i, v in enumerate(self.value_names)}
        self.param_names = sorted(self.m.params)
        self.param_index = {p: i for i, p in enumerate(self.param_names)}
        self.modules = {}
        for s in self.m.stages:
            if self.ranks[s.id] == rank:
                mod = package.build_stage(s.id, self.device, dtype=dtype)
                mod.train(cfg.dropout)
                mod._ftc_updates_buffers = accepts_update_buffers(mod)
                self.modules[s.id] = mod
        self.stages: dict[int, _Stage] = {}
        self.cv = threading.Condition()
        self.inbox: dict[tuple, object] = {}
        self.failure: str | None = None
        self.arrivals = 0
        self.pending_sends: list = []
        self._threads: list[threading.Thread] = []
        self._consumers = {v: list(spec.consumers) for v, spec in self.m.values.items()}
        # Gradient parts of a value are summed in one order everywhere (the reference too): readers
        # nearest the end of the pipeline first, which is the order they usually arrive in, so
        # each part joins the running sum on arrival and only one sum per micro-batch waits.
        self._grad_rank = {v: {c: i for i, c in enumerate(grad_order(self.m, v))} for v in self.m.values}
        self._graph_inputs = {i.value for i in self.m.inputs if i.shape is not None}
        # graph inputs this rank's stages read: the only data it moves to its device
        self._local_inputs = {v for s in self.m.stages if self.ranks[s.id] == rank for v in s.inputs
                              if v in self._graph_inputs}
        self._local_consumers = {v: [c for c in cs if self.ranks[c] == rank] for v, cs in self._consumers.items()}
        self._remote_ranks = {v: sorted({self.ranks[c] for c in cs} - {rank}) for v, cs in self._consumers.items()}
        # Looked up on every scheduling pass: computed once.
        self._spec = {s.id: s for s in self.m.stages}
        self._shared = self.m.shared_params()
        self._local_holders = {n: tuple(h for h in sorted(hs) if self.ranks[h] == rank)
                               for n, hs in self._shared.items()}
        # Shared tensors lag by a step (schedules without a flush): U(j) applies step j-1's sum.
        # ``_carry[stage][name]``: a summed gradient not applied yet (the last step of the previous
        # segment, or a checkpoint's), taken by the segment's first update.
        self._lag = lags_shared(cfg)
        self._carry: dict[int, dict[str, torch.Tensor]] = {}
        self._collecting: set[int] = set()            # stages waiting for the last step's parts
        self._last_step = -1
        self.step_offset = 0
        self._parked: dict[int, list[tuple]] = {}     # messages of segments this rank has not begun
        self._refs: dict[tuple, int] = {}
        self._credit: dict[int, int] = {}             # remote reader stage -> micro-batches it has taken
        # The rank of the loss stage writes the log: every rank sends it its step records. With
        # replicas, replica 0's does, and the other replicas' loss ranks send it their losses.
        loss_rank = self.ranks[self.m.loss_stage] if self.m.loss_stage is not None else min(self.ranks.values())
        self.log_rank = layout.stage_ranks(self.m, 0)[self.m.loss_stage] if layout is not None and \
            self.m.loss_stage is not None else loss_rank
        # Ranks whose step records the log rank merges: every rank of every replica.
        self._record_ranks = sorted({r for rep in range(self.replicas)
                                     for r in (layout.stage_ranks(self.m, rep).values() if layout is not None
                                               else self.ranks.values())})
        # A local stage no tensor links to the loss's stage runs its forwards at the pace of a local
        # stage of the pipeline (runtime/pacing.py); without one it would draw every step's data ahead.
        self._pacer = {s: p for s, p in pacers(self.ranks, [(a, b) for a, b, _ in self.m.edges()],
                                              {s.id: s.depth for s in self.m.stages}, self.m.loss_stage,
                                              {s.id: len(s.nodes) for s in self.m.stages}).items()
                       if self.ranks[s] == rank}
        self._groups: dict[int, object] = {}
        self._averaged: dict[tuple[int, int], BaseException | None] = {}
        fns = {}
        if self.replicas > 1:
            if transport is None:
                raise PipelineError("replicas need a transport")
            from .allreduce import ReplicaGroup

            # every rank creates every stage's group, in stage order (collective on some transports)
            fns = transport.replica_groups(layout.stage_groups(self.m))
            if averaging is None:      # with an averaging rule (AvgPipe) replicas keep their own gradients
                for sid in sorted(self.modules):
                    self._groups[sid] = ReplicaGroup(sid, self.replicas, fns[sid], self._averaged_cb)
        if averaging is not None and hasattr(averaging, "attach"):
            averaging.attach(self, fns)
        if cache is not None:
            cache.bind(self.m, sorted(self.modules), replica=self.replica, replicas=self.replicas,
                       micro_batches=cfg.micro_batches, device=self.device)
        self._build_optimizers()

    # ------------------------------------------------------------------ setup
    def _build_optimizers(self) -> None:
        ocfg = self.cfg.optim_config()
        self._opt = {}
        for sid, mod in self.modules.items():
            params = {n: p for n, p in mod.named_parameters() if p.requires_grad}
            opt, sched = _optim.build(list(params.values()), ocfg)
            self._opt[sid] = (params, opt, sched)

    def _root_handle(self, v: str, out):
        """What a stage keeps of output ``v`` for its backward. The plan counts what autograd saves, not
        the stage's outputs, so neither is kept alive here:
        * an output the backward does not start from (neither the loss nor a value some reader sends a
          gradient for: a language model's logits beside its loss): nothing;
        * an output a reader sends a gradient for: its place in the autograd graph
          (``GradientEdge``), not its tensor, whose memory goes once sent and read;
        * the loss, a scalar: itself."""
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return None
        if v == self.m.loss:
            return out
        if self._needs_grad(v) and (self._local_consumers.get(v) or self._remote_ranks.get(v)):
            return get_gradient_edge(out)
        return None

    def _needs_grad(self, v: str) -> bool:
        return self.m.values[v].takes_gradient

    def _flow(self, progs: dict[int, StageProgram]) -> None:
        """The flow-control windows of this segment (see :func:`flow_windows`)."""
        edges = flow_windows(self.m, progs, self.windows)
        # producer stage here -> [(reader, W, credits)]
        self._readers: dict[int, list[tuple[int, int, bool]]] = {}
        # reader stage here -> remote producer ranks to send credits to
        self._credit_to: dict[int, list[tuple[int, int]]] = {}
        for (p, c), (w, credits) in edges.items():
            if self.ranks[p] == self.rank:
                self._readers.setdefault(p, []).append((c, w, credits))
            if self.ranks[c] == self.rank and credits and self.ranks[p] != self.rank:
                self._credit_to.setdefault(c, []).append((p, self.ranks[p]))
        self._credit = {}

    # ------------------------------------------------------------------ messages
    def _put(self, key: tuple, value) -> None:
        with self.cv:
            self._take(key, value)
            self.cv.notify_all()

    def _send(self, dst: int, header: list[int], payload: torch.Tensor | None) -> None:
        # Indices are local to a run() segment; the segment's first step tells segments apart.
        self.pending_sends.extend(self.transport.isend(dst, header + [self.step_offset], payload))

    def _deliver(self, segment: int, key: tuple, value) -> None:
        """A message from a peer: into the inbox, or parked until this rank starts its segment."""
        with self.cv:
            if segment != self.step_offset:
                self._parked.setdefault(segment, []).append((key, value))
                return
            self._take(key, value)
            self.cv.notify_all()

    def _take(self, key: tuple, value) -> None:
        # (under the lock) credits only ever grow: keep the largest
        if key[0] == "C":
            self._credit[key[1]] = max(self._credit.get(key[1], 0), value)
        elif key[0] == "G":
            _, v, k, c = key
            acc = self.inbox.get(("G", v, k))
            if acc is None:
                acc = self.inbox[("G", v, k)] = GradSum(len(self._grad_rank[v]))
            acc.put(self._grad_rank[v][c], value)
        else:
            self.inbox[key] = value
        self.arrivals += 1

    def _reap_sends(self, wait: bool = False) -> None:
        keep = []
        for h in self.pending_sends:
            if wait:
                self.transport.wait(h)
            elif not self.transport.done(h):
                keep.append(h)
        self.pending_sends = keep

    def _buffer(self, kind: int, a: int, nbytes: int) -> torch.Tensor:
        if kind in (ACT, GRAD):
            spec = self.m.values[self.value_names[a]]
            buf = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
        elif kind == SHARED:
            p = self.m.params[self.param_names[a]]
            buf = torch.empty(p.shape, dtype=torch_dtype(p.dtype), device=self.device)
        else:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self.meter is not None:
            self.meter.track(buf)
        return buf

    def _receiver(self, src: int) -> None:
        try:
            while True:
                kind, a, k, stage, nbytes, segment, *_ = self.transport.recv_header(src)
                if kind == FIN:
                    return
                if kind == CREDIT:
                    self._deliver(segment, ("C", a), k)
                    continue
                buf = self._buffer(kind, a, nbytes)
                buf = self.transport.recv_payload(src, buf)
                if kind == ACT:
                    self._deliver(segment, ("A", self.value_names[a], k), buf)
                elif kind == GRAD:
                    self._deliver(segment, ("G", self.value_names[a], k, stage), buf)     # joins the sum
                elif kind == SHARED:
                    # One message per rank: every holder here reads it (keyed by the receiving
                    # stage, so that holders sharing a rank never take each other's copy).
                    name = self.param_names[a]
                    for h in self._local_holders.get(name, ()):
                        if h != stage:
                            self._deliver(segment, ("S", name, k, stage, h), buf)
                elif kind == NORM:
                    self._deliver(segment, ("N", k, stage), pickle.loads(buf.numpy().tobytes()))
                elif kind == STATS:
                    self._deliver(segment, ("R", k, src), pickle.loads(buf.numpy().tobytes()))
        except Exception as exc:  # noqa: BLE001 - any transport failure means the peer is gone
            stages = sorted(s for s, r in self.ranks.items() if r == src)
            with self.cv:
                if self.failure is None:
                    self.failure = (f"rank {self.rank}: lost rank {src} (stages {stages}): {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}")
                self.cv.notify_all()

    def start(self) -> None:
        for src in range(self.world_size):
            if src != self.rank:
                t = threading.Thread(target=self._receiver, args=(src,), daemon=True, name=f"recv-{src}")
                t.start()
                self._threads.append(t)

    def finish(self) -> None:
        """Tell every peer this rank sends nothing more, and wait until every peer has said the same."""
        for g in self._groups.values():
            g.close()
        if self.averaging is not None and hasattr(self.averaging, "close"):
            self.averaging.close()
        if self.world_size == 1:
            return
        for dst in range(self.world_size):
            if dst != self.rank:
                self._send(dst, [FIN, 0, 0, 0, 0], None)
        self._reap_sends(wait=True)
        deadline = time.monotonic() + self.cfg.timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise PipelineHang(f"rank {self.rank}: {t.name.replace('recv-', 'rank ')} did not finish within "
                                   f"{self.cfg.timeout_s:.0f} s")
        if self.failure:
            raise PipelineError(self.failure)

    # ------------------------------------------------------------------ weights
    def _copy(self, st: _Stage) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone().requires_grad_(True) for n, p in st.params.items()}

    def _weights(self, st: _Stage, version: int, *, across_update: bool) -> dict[str, torch.Tensor]:
        if version == st.version:
            if not across_update:
                return st.params
            if version not in st.stash:
                st.stash[version] = self._copy(st)
            return st.stash[version]
        if version in st.stash:
            return st.stash[version]
        raise PipelineError(f"rank {self.rank}: stage {st.id} needs weight version {version} but holds "
                            f"{st.version} and stashes {sorted(st.stash)} (a schedule bug)")

    def _prune(self, st: _Stage) -> None:
        """Drop the weight versions no later task of the stage uses."""
        if st.stash:
            nf, old = st.forward_left(), st.oldest_pending()
            for v in [v for v in st.stash if not needs_version(st.program, v, nf, old)]:
                del st.stash[v]

    def _predicted(self, st: _Stage, k: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        delay = st.program.staleness(k)
        if not (self.cfg.weight_prediction and delay > 0):
            return base
        params, opt, _ = self._opt[st.id]
        return _optim.predict(opt, params, {n: base[n] for n in params}, delay)

    # ------------------------------------------------------------------ readiness
    def _input(self, st: _Stage, v: str, k: int, data: Callable[[int], dict]):
        spec = self.m.values.get(v)
        if v in self._graph_inputs:
            return data(k)[v]
        if spec is not None and not spec.is_tensor:
            return spec.literal
        return self.inbox.get(("A", v, k))

    def _taken(self, reader: int) -> int:
        """Micro-batches ``reader`` has taken its inputs for (its next forward's index)."""
        st = self.stages.get(reader)
        if st is not None:
            return st.next_forward
        return self._credit.get(reader, 0)

    def _missing(self, st: _Stage, task: Task, data) -> list[str]:
        spec = self._spec[st.id]
        miss = []
        if task.kind == "F":
            if st.id in self._pace:     # before AutoCache's look, which draws the step's data
                p, ahead = self._pace[st.id]
                host = self.stages[p]
                if host.forward_left() is not None and host.next_forward <= task.index - ahead:
                    return [f"stage {p} to run the forward of micro-batch {task.index - ahead} (no tensor links "
                            f"stage {st.id} to the loss's stage: it keeps stage {p}'s pace)"]
            skipped, cached, (j, i) = self._cached(st, task.index, data)
            if skipped:
                return miss
            for v in spec.inputs:
                if v in self._graph_inputs or not self.m.values[v].is_tensor:
                    continue
                if v in cached:
                    why = self.cache.ready(v, j, i)
                    if why:
                        miss.append(why)
                    continue
                if ("A", v, task.index) not in self.inbox:
                    p = self.m.values[v].producer
                    miss.append(f"{v} of micro-batch {task.index} from stage {p} (rank {self.ranks[p]})")
            for c, w, credits in self._readers.get(st.id, ()):
                if (credits or c in self.stages) and self._taken(c) <= task.index - w:
                    miss.append(f"stage {c} (rank {self.ranks[c]}) to take micro-batch {task.index - w} "
                                f"(flow control: at most {w} waiting)")
        elif task.kind == "B":
            for v in spec.outputs:
                if v == self.m.loss or not self._needs_grad(v):
                    continue
                acc = self.inbox.get(("G", v, task.index))
                for c in self._consumers[v]:
                    if acc is None or not acc.has(self._grad_rank[v][c]):
                        miss.append(f"gradient of {v} of micro-batch {task.index} from stage {c} "
                                    f"(rank {self.ranks[c]})")
        else:
            j = task.index
            if st.update_phase == 1:
                return [f"the average of its gradients of step {j} over its {self.replicas} replicas"]
            if st.update_phase < 3:
                miss += self._missing_shared(st, j - 1 if self._lag else j)
            if self.averaging is not None:
                wait = self.averaging.ready(st.id, self.step_offset + j)
                if wait:
                    miss.append(wait)
            if self._exchanges_norms and st.update_phase >= 3:
                for s in self.m.stages:
                    if ("N", j, s.id) not in self.inbox:
                        miss.append(f"gradient norm of step {j} from stage {s.id} (rank {self.ranks[s.id]})")
        return miss

    def _missing_shared(self, st: _Stage, j: int) -> list[str]:
        """The other holders' gradients of step ``j`` of the shared tensors ``st`` holds, not in yet."""
        miss = []
        if j < 0:
            return miss
        for name, holders in self._shared.items():
            if name in st.params:
                for h in holders:
                    if h != st.id and ("S", name, j, h, st.id) not in self.inbox:
                        miss.append(f"shared gradient of {name} for step {j} from stage {h} "
                                    f"(rank {self.ranks[h]})")
        return miss

    @property
    def _exchanges_norms(self) -> bool:
        # Clipping needs the global norm; skipping non-finite steps needs every stage to agree.
        return exchanges_norms(self.cfg.clip_grad_norm, self.cfg.nonfinite)

    # ------------------------------------------------------------------ tasks
    def _cached(self, st: _Stage, k: int, data) -> tuple[bool, frozenset, tuple[int, int]]:
        """AutoCache's view of ``F(k)``: whether the stage is skipped, the inputs it reads from the cache,
        and (step, micro-batch) of ``k``."""
        if self.cache is None:
            return False, frozenset(), (0, 0)
        data(k)             # the cache decides a step's micro-batches when the step's batch is drawn
        j, i = divmod(k, self.cfg.micro_batches)
        j += self.step_offset
        if self.cache.skips(st.id, j, i):
            return True, frozenset(), (j, i)
        return False, self.cache.cached_inputs(st.id, j, i), (j, i)

    def _forward(self, st: _Stage, k: int, data) -> None:
        spec = self._spec[st.id]
        prog = st.program
        version = prog.forward_version(k)
        skipped, cached, (j, i) = self._cached(st, k, data)
        if skipped:     # AutoCache holds this frozen stage's output for every sample of the micro-batch
            st.next_forward = k + 1
            st.pending.append(k)
            for p, r in self._credit_to.get(st.id, ()):
                self._send(r, [CREDIT, st.id, k + 1, p, 0], None)
            st.saved[k] = ((), (), st.params)
            return
        inputs = [self.cache.read(v, j, i) if v in cached else self._input(st, v, k, data) for v in spec.inputs]
        with self.cv:
            for v in spec.inputs:
                key = ("A", v, k)
                if key in self.inbox:
                    # Every stage of this rank that reads the value takes it once; the last frees it.
                    left = self._refs.get(key, len(self._local_consumers.get(v, ())) or 1) - 1
                    if left <= 0:
                        self.inbox.pop(key, None)
                        self._refs.pop(key, None)
                    else:
                        self._refs[key] = left
        st.next_forward = k + 1
        st.pending.append(k)
        for p, r in self._credit_to.get(st.id, ()):
            self._send(r, [CREDIT, st.id, k + 1, p, 0], None)
        seed = self._seed(k)
        t0 = time.perf_counter()
        if prog.recompute:
            weights = self._predicted(st, k, self._weights(st, version, across_update=False))
            with torch.no_grad():
                outs = _call(st.module, weights, st.params, tuple(inputs), seed)
            st.saved[k] = (inputs, None, None)
        else:
            weights = self._weights(st, version, across_update=prog.spans_update(k))
            args = [self._leaf(v, x) for v, x in zip(spec.inputs, inputs)]
            with torch.enable_grad():
                outs = _call(st.module, weights, st.params, tuple(args), seed)
            st.saved[k] = (args, tuple(self._root_handle(v, out) for v, out in zip(spec.outputs, outs)), weights)
        st.times.forward_s += time.perf_counter() - t0
        st.times.forwards += 1
        if self.cache is not None:      # before sending: a reader that sees it sent finds it written
            self.cache.store(st.id, j, i, spec.outputs, outs)
        for v, out in zip(spec.outputs, outs):
            if v == self.m.loss:
                self._loss(st, k, out)
            if not isinstance(out, torch.Tensor):
                continue
            out = out.detach()
            if out.untyped_storage().data_ptr() in st.live:
                # A view of a weight the stage updates in place (Gemma's norm `weight.float()` is
                # aten.to, which returns a float32 weight itself): a send may still be reading it,
                # and a reader on this rank would take it after U(j), when the stage updates
                # before the reader runs (async). Send the values of this forward.
                out = out.clone()
            if self._local_consumers.get(v):
                self._put(("A", v, k), out)
            for r in self._remote_ranks.get(v, []):
                self._send(r, [ACT, self.value_index[v], k, st.id, 0], out)

    def _loss(self, st: _Stage, k: int, out: torch.Tensor) -> None:
        value = float(out.detach())
        self._losses[k] = value
        if math.isfinite(value):
            return
        M = self.cfg.micro_batches
        step = self.step_offset + k // M
        if self.cfg.nonfinite == "skip":
            st.bad_loss.add(k // M)
            return
        raise PipelineError(f"rank {self.rank}: the loss is {value} at step {step} (micro-batch {k % M} of {M}), "
                            f"computed by stage {st.id}; lower --lr, clip gradients (--clip-grad-norm X), or "
                            "skip such steps with --on-nonfinite skip")

    def _seed(self, k: int) -> int:
        """Micro-batch ``k`` of this segment, numbered across the replicas' global batch."""
        M = self.cfg.micro_batches
        j, i = divmod(k, M)
        return micro_batch_seed(self.cfg.seed, self.step_offset + j, self.replica * M + i)

    def _leaf(self, v: str, x):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if self._needs_grad(v):
                x.requires_grad_(True)
        return x

    def _backward(self, st: _Stage, k: int, data) -> None:
        spec = self._spec[st.id]
        prog = st.program
        version = prog.backward_version(k)
        args, outs, weights = st.saved.pop(k)
        seed = self._seed(k)
        t0 = time.perf_counter()
        if outs is None and not (self._opt[st.id][0] or any(self._needs_grad(v) for v in spec.outputs)):
            # Nothing to differentiate (a frozen stage in freeze training, or a side branch no loss
            # reads): skip the recomputation; inputs that need a gradient get zeros below.
            outs, weights = (), st.params
        if outs is None:
            weights = self._weights(st, version, across_update=False)
            args = [self._leaf(v, x) for v, x in zip(spec.inputs, args)]
            with torch.enable_grad():
                outs = _call(st.module, weights, st.params, tuple(args), seed, recompute=True)
            t1 = time.perf_counter()
            st.times.recompute_s += t1 - t0
            t0 = t1
        roots, grads = [], []
        with self.cv:
            for v, out in zip(spec.outputs, outs):
                if not (isinstance(out, GradientEdge) or (isinstance(out, torch.Tensor) and out.requires_grad)):
                    if v != self.m.loss and self._needs_grad(v):
                        self.inbox.pop(("G", v, k), None)
                    continue
                if v == self.m.loss:
                    roots.append(out)
                    grads.append(torch.full_like(out, 1.0 / self.cfg.micro_batches))
                elif self._needs_grad(v):
                    acc = self.inbox.pop(("G", v, k), None)
                    if acc is not None:
                        roots.append(out)
                        grads.append(acc.total)
        del outs
        if roots:
            torch.autograd.backward(roots, grads)
        del roots, grads
        if weights is not st.params:
            # The backward ran on a stashed version: its gradients join the live weights' (in place).
            for n, t in weights.items():
                if t.grad is not None:
                    p = st.params[n]
                    if p.grad is None:
                        p.grad = t.grad
                    else:
                        p.grad.add_(t.grad)
                    t.grad = None
        for v, x in zip(spec.inputs, args):
            if not self._needs_grad(v):
                continue
            g = x.grad if isinstance(x, torch.Tensor) and x.grad is not None else torch.zeros(
                self.m.values[v].shape, dtype=torch_dtype(self.m.values[v].dtype), device=self.device)
            producer = self.m.values[v].producer
            if self.ranks[producer] == self.rank:
                self._put(("G", v, k, st.id), g)
            else:
                self._send(self.ranks[producer], [GRAD, self.value_index[v], k, st.id, 0], g)
        st.pending.remove(k)
        st.times.backward_s += time.perf_counter() - t0
        st.times.backwards += 1

    def _begin_update(self, st: _Stage, j: int) -> None:
        """Phase 1 of U(j): send this stage's gradients of shared parameters to the other holders.

        Every holder on this rank, this stage included, gets the tensor itself (keyed by its own
        id; :meth:`_take_sums` sums every part from the inbox); each other rank gets one message,
        which its receiver hands to every holder there. Nobody writes
        into a gradient once it is sent: holders sum into a tensor of their own.
        """
        for name, holders in self._shared.items():
            if name not in st.params:
                continue
            p = st.params[name]
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
            for h in self._local_holders[name]:      # itself too: every part is summed from the inbox
                self._put(("S", name, j, st.id, h), g)
            for r in sorted({self.ranks[h] for h in holders} - {self.rank}):
                self._send(r, [SHARED, self.param_index[name], j, st.id, 0], g)
        st.update_phase = 2

    def _sum_shared(self, st: _Stage, j: int) -> None:
        """Every holder sums all holders' gradients in stage order, so the copies take the same step.

        Lagging, U(j) takes step ``j - 1``'s sum (at the segment's first update, the carried one,
        or none: the optimizer then leaves the tensor alone this step). Not lagging, a carried sum
        (a checkpoint of a lagging run resumed by a schedule that does not lag) joins the first
        update's gradient, so no step's gradient is lost.
        """
        carry = self._carry.pop(st.id, {}) if j == 0 else {}
        step = j - 1 if self._lag else j
        got = self._take_sums(st, step) if step >= 0 else {}
        for name in self._shared:
            if name in st.params:
                st.params[name].grad = got.get(name, carry.pop(name, None) if self._lag else None)
        for name, g in carry.items():
            p = st.params.get(name)
            if p is not None:
                p.grad = g if p.grad is None else p.grad + g

    def _take_sums(self, st: _Stage, j: int) -> dict[str, torch.Tensor]:
        """Step ``j``'s summed gradient of each shared tensor ``st`` holds, its parts taken from the inbox."""
        parts: dict[str, list[torch.Tensor]] = {}
        with self.cv:
            for name, holders in self._shared.items():
                if name in st.params:
                    parts[name] = [self.inbox.pop(("S", name, j, h, st.id)) for h in sorted(holders)]
        # Outside the lock: the receiver threads keep delivering meanwhile.
        return {name: sum_parts(gs) for name, gs in parts.items()}

    def _collect(self, st: _Stage) -> bool:
        """At the end of a lagging segment: sum the last step's parts into the carry, once they are in."""
        with self.cv:
            if self._missing_shared(st, self._last_step):
                return False
        self._carry[st.id] = self._take_sums(st, self._last_step)
        self._collecting.discard(st.id)
        return True

    def _norm_part(self, st: _Stage, j: int) -> float:
        if j in st.bad_loss:
            return math.nan      # every stage then skips step j
        shared = self._shared
        sq = 0.0
        for name, p in st.params.items():
            if p.grad is None:
                continue
            if name in shared and min(shared[name]) != st.id:
                continue   # a shared tensor's summed gradient counts once, at its first holder
            sq += float(p.grad.detach().double().pow(2).sum())
        return sq

    def _send_norm(self, st: _Stage, j: int) -> None:
        part = self._norm_part(st, j)
        blob = torch.frombuffer(bytearray(pickle.dumps(part)), dtype=torch.uint8)
        self._put(("N", j, st.id), part)
        for r in sorted({self.ranks[s.id] for s in self.m.stages} - {self.rank}):
            self._send(r, [NORM, 0, j, st.id, blob.numel()], blob)
        st.update_phase = 3

    def _try_update(self, st: _Stage, j: int, data) -> bool:
        """Advance U(j) as far as what has arrived allows; True once the step is taken.

        Phases: (1) average the stage's gradients over its replicas, on the stage's all-reduce
        thread; (2) send the gradients of shared tensors to their other holders and sum theirs
        (after the average, so every copy sums the same averaged parts); (3) with clipping or
        non-finite skipping, exchange the gradient norm; then step.
        """
        if st.update_phase == 0:
            st.update_phase = 1
            if self._groups:
                grads = []
                for p in self._opt[st.id][0].values():
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
                self._groups[st.id].submit(j, grads)
        if st.update_phase == 1:
            if self._groups:
                with self.cv:
                    if (st.id, j) not in self._averaged:
                        return False
                    err = self._averaged.pop((st.id, j))
                if err is not None:
                    raise PipelineError(f"rank {self.rank}: averaging stage {st.id}'s gradients of step "
                                        f"{self.step_offset + j} over its replicas failed: {err}")
            if self._lag:
                st.update_phase = 2          # its part is sent below, once step j - 1's parts are in
            else:
                self._begin_update(st, j)
        with self.cv:
            if self._missing(st, st.next, data):
                return False
        if st.update_phase == 2:
            if self._lag:
                # Sent only now: a holder's part of step j cannot leave before every part of step
                # j - 1 is in, so no holder runs more than a step ahead of the slowest and at most
                # two steps' parts of each holder wait anywhere (plan.shared_gradient_copies).
                self._begin_update(st, j)
            self._sum_shared(st, j)
            if self._exchanges_norms:
                self._send_norm(st, j)
                with self.cv:
                    if self._missing(st, st.next, data):
                        return False
        self._update(st, j)
        return True

    def poke(self) -> None:
        """Wake the scheduling loop: something it waits for (not a message) is ready."""
        with self.cv:
            self.arrivals += 1
            self.cv.notify_all()

    def _averaged_cb(self, group, step: int, err) -> None:
        with self.cv:
            self._averaged[(group.stage, step)] = err
            self.arrivals += 1
            self.cv.notify_all()

    def _update(self, st: _Stage, j: int) -> None:
        t0 = time.perf_counter()
        params, opt, sched = self._opt[st.id]
        skip = False
        if self._exchanges_norms:
            total = math.sqrt(sum(self.inbox[("N", j, s.id)] for s in sorted(self.m.stages, key=lambda s: s.id)))
            if not math.isfinite(total):
                if self.cfg.nonfinite != "skip":
                    raise PipelineError(f"rank {self.rank}: the gradient norm is {total} at step "
                                        f"{self.step_offset + j} (stage {st.id}); lower --lr or skip such steps "
                                        "with --on-nonfinite skip")
                skip = True
                self._skipped.add(j)
            elif self.cfg.clip_grad_norm:
                _optim.clip_to(params.values(), total, self.cfg.clip_grad_norm)
                self._norms[j] = total
        if needs_version(st.program, st.version, st.forward_left(), st.oldest_pending()) \
                and st.version not in st.stash:
            st.stash[st.version] = self._copy(st)
        if self.grad_hook is not None:
            self.grad_hook(st.id, self.step_offset + j, params)
        if not skip:
            _optim.step(opt)
        if self.averaging is not None:
            self.averaging.after_step(st.id, self.step_offset + j, params)
        if sched is not None:
            sched.step()
        for p in params.values():
            p.grad = None
        st.bad_loss.discard(j)
        st.version += 1
        st.update_phase = 0
        st.times.update_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ the loop
    def run(self, batches: Iterator[dict], steps: int, *, on_step: Callable[[dict], None] | None = None,
            step_offset: int = 0, keep_records: bool = True) -> list[dict]:
        """Train ``steps`` steps on ``batches`` (mini-batches of ``M`` micro-batches, every rank the same
        iterator). Returns, per step, this rank's record (loss when it holds the loss stage, times), or
        nothing with ``keep_records=False`` (long runs: records go to ``on_step`` only)."""
        with self.cv:
            self.step_offset = step_offset
            # Gradient norms of the last segment would answer for this one's steps.
            for key in [key for key in self.inbox if key[0] == "N"]:
                del self.inbox[key]
        progs = programs(self.m, self.cfg, steps)
        self._flow(progs)
        with self.cv:
            for key, value in self._parked.pop(step_offset, []):
                self._take(key, value)
        self.stages = {}
        for sid, mod in self.modules.items():
            prog = progs[sid]
            st = _Stage(sid, mod, prog, self._opt[sid][0], prog.tasks())
            st.advance()
            self.stages[sid] = st
        self._pace = pace(self._pacer, progs)
        self._last_step = steps - 1
        self._collecting = {sid for sid in self.stages if self._lag and steps > 0
                            and any(n in self._opt[sid][0] for n in self._shared)}
        self._losses: dict[int, float] = {}
        self._norms: dict[int, float] = {}
        self._skipped: set[int] = set()
        self._merged_next = 0
        if self.meter is not None:
            for mod in self.modules.values():
                self.meter.track_all(mod.parameters())
                self.meter.track_all(mod.buffers())
                self.meter.track_all(p.grad for p in mod.parameters() if p.grad is not None)
            for _, opt, _ in self._opt.values():
                self.meter.track_all(optimizer_tensors(opt))
            with self.cv:
                self.meter.track_all(v for v in self.inbox.values() if isinstance(v, torch.Tensor))
        with (self.meter.tracking() if self.meter is not None else contextlib.nullcontext()):
            return self._loop(batches, steps, on_step, keep_records)

    def _loop(self, batches: Iterator[dict], steps: int, on_step, keep_records: bool) -> list[dict]:
        cfg, M = self.cfg, self.cfg.micro_batches
        from .data import check_index_ranges, split_micro_batches

        cache: dict[int, list[dict]] = {}
        fetched = [0]

        def data(k: int) -> dict:
            j = k // M
            while fetched[0] <= j:
                try:
                    batch = next(batches)
                except StopIteration:
                    raise PipelineError(f"the data ran out after {fetched[0]} steps of the {steps} asked for") \
                        from None
                # Every replica draws the step's global batch and takes its own M micro-batches.
                R, r = self.replicas, self.replica
                mbs = split_micro_batches(batch, self.m, R * M)
                if self.cache is not None:
                    self.cache.plan_step(self.step_offset + fetched[0], mbs)
                mbs = mbs[r * M:(r + 1) * M]
                # On the host, before a bad token id becomes a device-side assert on a GPU.
                check_index_ranges(mbs, self.m, f"step {self.step_offset + fetched[0]}"
                                   + (f", replica {r} (the batch's micro-batches {r * M}..{r * M + M - 1})"
                                      if R > 1 else ""), self._local_inputs)
                cache[fetched[0]] = [{n: t.to(self.device) for n, t in mb.items() if n in self._local_inputs}
                                     for mb in mbs]
                fetched[0] += 1
            return cache[j][k % M]

        records: list[dict] = []
        done_steps: dict[int, int] = {}
        t_start = time.perf_counter()
        t_step = t_start
        wait_s = 0.0
        order = sorted(self.stages.values(), key=lambda s: stage_priority(s.id, s.program.group, self._pace))
        if self.world_size > 1 and not self._threads:
            self.start()
        last_progress = time.monotonic()
        while any(st.next is not None or st.id in self._collecting for st in order):
            ran = False
            seen = self.arrivals
            for st in order:
                if st.next is None and st.id in self._collecting and self._collect(st):
                    ran = True
            # Backwards first: they free memory and unblock upstream stages.
            for kinds in (("B", "U"), ("F",)):
                for st in order:
                    task = st.next
                    if task is None or task.kind not in kinds:
                        continue
                    if task.kind == "U":
                        if self.meter is not None:
                            self.meter.label = f"stage {st.id} {task}"
                        if not self._try_update(st, task.index, data):
                            continue
                        st.advance()
                        self._prune(st)
                        j = task.index
                        done_steps[j] = done_steps.get(j, 0) + 1
                        if done_steps[j] == len(self.stages):
                            del done_steps[j]
                            now = time.perf_counter()
                            rec = self._record(j, now - t_step, wait_s)
                            t_step, wait_s = now, 0.0
                            if keep_records:
                                records.append(rec)
                            cache.pop(j, None)
                            self._publish(j, rec)
                        ran = True
                        break
                    with self.cv:
                        missing = self._missing(st, task, data)
                    if missing:
                        continue
                    if self.meter is not None:
                        self.meter.label = f"stage {st.id} {task}"
                    (self._forward if task.kind == "F" else self._backward)(st, task.index, data)
                    st.advance()
                    self._prune(st)
                    ran = True
                    break
                if ran:
                    break
            if self.pending_sends:
                self._reap_sends()
            if on_step and self.rank == self.log_rank:
                self._emit(on_step)
            if ran:
                last_progress = time.monotonic()
                continue
            t0 = time.perf_counter()
            with self.cv:
                if self.failure:
                    raise PipelineError(self.failure)
                if self.arrivals == seen:
                    self.cv.wait(timeout=0.05 if self.pending_sends else 1.0)
                if self.failure:
                    raise PipelineError(self.failure)
            wait_s += time.perf_counter() - t0
            if time.monotonic() - last_progress > cfg.timeout_s:
                raise PipelineHang(self._hang_message(data))
            if self.arrivals != seen:
                last_progress = time.monotonic()
        if self.rank == self.log_rank:
            deadline = time.monotonic() + cfg.timeout_s
            while self._merged_next < steps:
                if on_step:
                    self._emit(on_step)
                else:
                    with self.cv:
                        for r in range(self.world_size):
                            self.inbox.pop(("R", self._merged_next, r), None)
                    self._merged_next += 1
                    continue
                with self.cv:
                    if self.failure:
                        raise PipelineError(self.failure)
                    if self._merged_next < steps:
                        self.cv.wait(timeout=0.2)
                if time.monotonic() > deadline:
                    raise PipelineHang(f"rank {self.rank}: the step records of step {self._merged_next} did "
                                       f"not arrive from every rank within {cfg.timeout_s:.0f} s")
        self._reap_sends(wait=True)
        return records

    def _publish(self, j: int, rec: dict) -> None:
        with self.cv:
            # Every local stage has taken step j: its gradient norms are spent.
            for s in self.m.stages:
                self.inbox.pop(("N", j, s.id), None)
        if self.rank == self.log_rank:
            self._put(("R", j, self.rank), rec)
        else:
            blob = torch.frombuffer(bytearray(pickle.dumps(rec)), dtype=torch.uint8)
            self._send(self.log_rank, [STATS, 0, j, -1, blob.numel()], blob)

    def _emit(self, on_step: Callable[[dict], None]) -> None:
        """Call ``on_step`` with each step whose records have come in from every rank, in step order."""
        ranks = self._record_ranks
        while True:
            j = self._merged_next
            with self.cv:
                if not all(("R", j, r) in self.inbox for r in ranks):
                    return
                parts = [self.inbox.pop(("R", j, r)) for r in ranks]
            self._merged_next += 1
            on_step(merge_records(parts))

    def _hang_message(self, data) -> str:
        lines = [f"rank {self.rank}: nothing arrived for {self.cfg.timeout_s:.0f} s"]
        for st in self.stages.values():
            task = st.next
            if task is None:
                if st.id in self._collecting:
                    with self.cv:
                        miss = self._missing_shared(st, self._last_step)
                    lines.append(f"  stage {st.id} waits at the end of the segment: " + "; ".join(miss[:3]))
                continue
            with self.cv:
                miss = self._missing(st, task, data)
            lines.append(f"  stage {st.id} waits in {task}: " + ("; ".join(miss[:3]) or "nothing (a bug)"))
        return "\n".join(lines)

    def _record(self, j: int, seconds: float, wait_s: float) -> dict:
        M = self.cfg.micro_batches
        losses = [self._losses.pop(k) for k in range(j * M, (j + 1) * M) if k in self._losses]
        rec = {"step": self.step_offset + j, "rank": self.rank, "replica": self.replica, "seconds": seconds,
               "samples_per_s": M * self.m.micro_batch_size / seconds if seconds > 0 else None,
               "wait_s": wait_s, "stages": {str(s.id): s.times.take() for s in self.stages.values()},
               "lr": None, **self._memory(),
               # Messages posted but not yet taken by the peer: bounded unless a peer falls behind.
               "sends_in_flight": len(self.pending_sends)}
        if self.meter is not None:
            rec["memory_measured"] = "tensors"
            rec["memory_peak_during"] = self.meter.peak_label
        if losses:
            rec["loss"] = sum(losses) / len(losses)
        if j in self._norms:
            rec["grad_norm"] = self._norms.pop(j)
        if j in self._skipped:
            self._skipped.discard(j)
            rec["skipped"] = True
        if self.cache is not None:
            counts = self.cache.record(self.step_offset + j)
            if counts:
                rec["cache"] = counts
        opts = [o for _, o, _ in self._opt.values() if getattr(o, "param_groups", None)]
        if opts:
            rec["lr"] = opts[0].param_groups[0]["lr"]
        return rec

    def _memory(self) -> dict:
        """Peak bytes since the last step: the rank's own tensor count when measuring, CUDA's allocator
        on a GPU (and what it reserved from the driver: allocations plus its cache), else the process's
        peak resident set."""
        if self.meter is not None:
            return {"memory_bytes": self.meter.take_peak()}
        if self.device.type == "cuda":
            reserved = int(torch.cuda.max_memory_reserved(self.device))
            return {"memory_bytes": memory_bytes(self.device), "memory_reserved_bytes": reserved}
        return {"memory_bytes": memory_bytes(self.device)}

    # ------------------------------------------------------------------ state
    def state(self) -> dict[int, dict]:
        """Per local stage: ``{"weights": {name: tensor}, "optimizer": {name: {key: value}}}``.

        Everything is keyed by canonical parameter name (weights include persistent buffers;
        optimizer state is per trainable parameter, see :func:`~ftcompile.runtime.optim.named_state`),
        so :mod:`~ftcompile.runtime.checkpoint` can write a tensor several stages or replicas hold
        once, and load it into any other layout. The learning-rate schedule is a function of the
        step and is not part of it.
        """
        out = {}
        for sid, (params, opt, sched) in self._opt.items():
            mod = self.modules[sid]
            out[sid] = {"weights": {n: t.detach() for n, t in mod.state_dict().items()},
                        "optimizer": _optim.named_state(opt, params)}
            for name, g in self._carry.get(sid, {}).items():     # a lagging shared tensor's pending sum
                out[sid]["optimizer"].setdefault(name, {})[LAGGED_GRAD] = g.detach()
        return out

    def load_state(self, state: dict) -> None:
        """Take weights and optimizer state by name (``checkpoint.load``): ``{"weights", "optimizer", "step"}``.

        Each local stage copies the tensors it holds; the optimizers take the per-parameter state
        their kind keeps, with the hyperparameters of this run's configuration (the command line's
        lr, not the checkpoint's); the learning-rate schedule moves to ``state["step"]`` updates.
        """
        weights, opt_state = state.get("weights", {}), state.get("optimizer") or {}
        for sid, (params, opt, sched) in self._opt.items():
            mod = self.modules[sid]
            own = mod.state_dict()
            missing = [n for n in own if n not in weights]
            if missing:
                raise PipelineError(f"rank {self.rank}: the checkpoint lacks {missing[0]} (and {len(missing) - 1} "
                                    f"more) of stage {sid}; resume with a package of the model it was trained with")
            try:
                mod.load_state_dict({n: weights[n] for n in own})
            except RuntimeError as exc:
                first = str(exc).splitlines()[1:2] or [str(exc)]
                raise PipelineError(f"rank {self.rank}: the checkpoint's tensors do not fit stage {sid} "
                                    f"({first[0].strip()}); resume with a package of the model it was trained "
                                    "with") from None
            _optim.load_named_state(opt, params, opt_state, self.cfg.optimizer)
            _optim.set_position(opt, sched, self.cfg.optim_config(), int(state.get("step", 0)))
            carry = {n: opt_state[n][LAGGED_GRAD].to(device=p.device, dtype=p.dtype).clone()
                     for n, p in params.items() if LAGGED_GRAD in opt_state.get(n, {})}
            if carry:
                self._carry[sid] = carry
            else:
                self._carry.pop(sid, None)


def merge_records(parts: list[dict]) -> dict:
    """One log line for a step from every rank's record: the loss, the slowest rank's time, all stages."""
    seconds = max(p["seconds"] for p in parts)
    out = {"step": parts[0]["step"], "seconds": seconds, "samples_per_s": None, "loss": None, "lr": None,
           "stages": {}, "ranks": {}, "stage_ranks": {}}
    # one loss per replica, each the mean over its micro-batches: the step's loss is their mean
    losses = [p["loss"] for p in parts if p.get("loss") is not None]
    if losses:
        out["loss"] = sum(losses) / len(losses)
    replicas = {p.get("replica", 0) for p in parts}
    if len(replicas) > 1:
        out["replicas"] = len(replicas)
    if any(p.get("cache") for p in parts):       # AutoCache: every rank's reads and writes, every replica's
        from .cache import merge_counts

        out["cache"] = merge_counts([p["cache"] for p in parts if p.get("cache")])
    for p in parts:
        if p.get("replica", 0) != 0:
            out["ranks"][str(p["rank"])] = {"seconds": p["seconds"], "wait_s": p["wait_s"],
                                            "memory_bytes": p["memory_bytes"], "replica": p["replica"],
                                            "sends_in_flight": p.get("sends_in_flight", 0), **_reserved(p)}
            continue
        if p.get("grad_norm") is not None:
            out["grad_norm"] = p["grad_norm"]
        if p.get("skipped"):
            out["skipped"] = True
        if p.get("lr") is not None:
            out["lr"] = p["lr"]
        if p.get("samples_per_s") and seconds > 0:
            out["samples_per_s"] = p["samples_per_s"] * p["seconds"] / seconds * len(replicas)
        out["stages"].update(p["stages"])
        out["stage_ranks"].update({sid: str(p["rank"]) for sid in p["stages"]})
        out["ranks"][str(p["rank"])] = {"seconds": p["seconds"], "wait_s": p["wait_s"],
                                        "memory_bytes": p["memory_bytes"],
                                        "sends_in_flight": p.get("sends_in_flight", 0), **_reserved(p)}
    return out


def _reserved(part: dict) -> dict:
    return {"memory_reserved_bytes": part["memory_reserved_bytes"]} if "memory_reserved_bytes" in part else {}


def memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA's allocator peak since the last call on a GPU, the resident set
    size on the CPU."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    try:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # noqa: BLE001 - not on every OS
        return 0
