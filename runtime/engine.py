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
* **Weight versions.** Each forward and backward uses the version its program
  names. The live parameters are the newest version; an older one is a stash
  copied at the update that would overwrite it, kept only while a task still
  needs it. A forward whose activations are kept across an update runs on a
  copy, so the update never changes what its backward reads.
* **Shared parameters.** Every holder sums all holders' gradients in stage
  order and takes the same step, so the copies stay identical.
* **Failures.** A lost peer is reported at once; nothing arriving for
  ``timeout_s`` raises :class:`PipelineHang` naming the stage, the value and
  the rank it waits for.

The stage-to-rank map, the transport and the configuration are arguments, so a
job can build a new engine for a new plan (fewer ranks, frozen stages).
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.func import functional_call

from . import optim as _optim
from .manifest import Manifest, torch_dtype
from .ops import mix_seed
from .package import Package
from .schedules import StageProgram, Task, groups_2gw, stage_program

ACT, GRAD, SHARED, NORM, STATS, FIN = 1, 2, 3, 4, 5, 9


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
    recompute: bool = False           # gpipe, 1f1b, 2bw, 2gw: recompute in backward
    weight_prediction: bool = False   # async: forward on weights predicted to the backward's version
    seed: int = 0
    dropout: bool = True              # train mode: dropout active (keyed per micro-batch, so recomputation agrees)
    timeout_s: float = 300.0
    total_steps: int | None = None    # for LR schedules across checkpoints; default ``steps``

    def optim_config(self) -> _optim.OptimConfig:
        """The optimizer and LR schedule every stage builds."""
        return _optim.OptimConfig(self.optimizer, self.lr, self.momentum, self.betas, self.eps, self.weight_decay,
                                  self.lr_schedule, self.warmup_steps, self.total_steps or self.steps)


def stage_ranks(manifest: Manifest, world_size: int) -> dict[int, int]:
    """Stage id -> rank: GPU ``g`` of ``G`` runs on rank ``g * world_size // G`` (several GPUs' stages
    share a rank when there are fewer ranks than planned GPUs)."""
    G = max(manifest.num_gpus, 1)
    return {s.id: min(s.gpu * world_size // G, world_size - 1) for s in manifest.stages}


def programs(manifest: Manifest, cfg: TrainConfig, steps: int) -> dict[int, StageProgram]:
    """Every stage's program for ``steps`` steps under ``cfg``."""
    depths = {s.id: s.depth for s in manifest.stages}
    groups = groups_2gw(depths)
    deepest = max(depths.values(), default=0)
    return {s.id: stage_program(cfg.schedule, s.id, depth=s.depth, micro_batches=cfg.micro_batches,
                                steps=steps, last=s.computes_loss or s.depth == 0, recompute=cfg.recompute,
                                group=groups[s.id], pipeline_depth=deepest)
            for s in manifest.stages}


def accepts_update_buffers(module: torch.nn.Module) -> bool:
    """Whether a stage's forward takes ``update_buffers=`` (stages that write running statistics)."""
    import inspect

    try:
        return "update_buffers" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _call(module: torch.nn.Module, weights: dict, live: dict, args: tuple, seed: int, *, recompute: bool = False):
    # A recomputation repeats a forward that already ran: it must not update running
    # statistics (BatchNorm) a second time.
    kwargs = {"seed": seed}
    if recompute and getattr(module, "_ftc_updates_buffers", False):
        kwargs["update_buffers"] = False
    # The live weights are the module's own: call it directly, skipping functional_call's
    # re-parametrisation, which costs more than a small stage's compute.
    if weights is live:
        return module(*args, **kwargs)
    return functional_call(module, weights, args, kwargs, strict=False)


def micro_batch_seed(seed: int, k: int) -> int:
    """The dropout seed of global micro-batch ``k``: the same in forward and recomputation, on any rank."""
    return mix_seed(seed, k)


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
    pos: int = 0
    version: int = 0
    stash: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    uses_left: dict[int, int] = field(default_factory=dict)
    saved: dict[int, tuple] = field(default_factory=dict)
    update_phase: int = 0             # U(j): 0 not begun, 1 shared grads sent, 2 norm sent
    times: StageTimes = field(default_factory=StageTimes)

    @property
    def next(self) -> Task | None:
        return self.program.tasks[self.pos] if self.pos < len(self.program.tasks) else None


class RankEngine:
    """Runs the stages of ``package`` that ``ranks`` puts on ``rank``; see the module docstring."""

    def __init__(self, package: Package, cfg: TrainConfig, *, rank: int = 0, world_size: int = 1,
                 transport=None, device: str | torch.device = "cpu", ranks: dict[int, int] | None = None,
                 dtype: torch.dtype | None = None):
        self.package, self.m, self.cfg = package, package.manifest, cfg
        self.rank, self.world_size, self.transport = rank, world_size, transport
        self.device = torch.device(device)
        self.ranks = ranks if ranks is not None else stage_ranks(self.m, world_size)
        if world_size > 1 and transport is None:
            raise PipelineError("several ranks need a transport")
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
        self._graph_inputs = {i.value for i in self.m.inputs if i.shape is not None}
        self._local_consumers = {v: [c for c in cs if self.ranks[c] == rank] for v, cs in self._consumers.items()}
        self._remote_ranks = {v: sorted({self.ranks[c] for c in cs} - {rank}) for v, cs in self._consumers.items()}
        # Looked up on every scheduling pass: computed once.
        self._spec = {s.id: s for s in self.m.stages}
        self._shared = self.m.shared_params()
        self._local_holders = {n: tuple(h for h in sorted(hs) if self.ranks[h] == rank)
                               for n, hs in self._shared.items()}
        self.step_offset = 0
        self._parked: dict[int, list[tuple]] = {}     # messages of segments this rank has not begun
        self._refs: dict[tuple, int] = {}
        # The rank of the loss stage writes the log: every rank sends it its step records.
        self.log_rank = self.ranks[self.m.loss_stage] if self.m.loss_stage is not None else 0
        self._build_optimizers()

    # ------------------------------------------------------------------ setup
    def _build_optimizers(self) -> None:
        ocfg = self.cfg.optim_config()
        self._opt = {}
        for sid, mod in self.modules.items():
            params = {n: p for n, p in mod.named_parameters() if p.requires_grad}
            opt, sched = _optim.build(list(params.values()), ocfg)
            self._opt[sid] = (params, opt, sched)

    def _needs_grad(self, v: str) -> bool:
        spec = self.m.values[v]
        return spec.is_tensor and spec.is_floating and spec.requires_grad and spec.producer is not None

    # ------------------------------------------------------------------ messages
    def _put(self, key: tuple, value) -> None:
        with self.cv:
            self.inbox[key] = value
            self.arrivals += 1
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
            self.inbox[key] = value
            self.arrivals += 1
            self.cv.notify_all()

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
            return torch.empty(spec.shape, dtype=torch_dtype(spec.dtype), device=self.device)
        if kind == SHARED:
            p = self.m.params[self.param_names[a]]
            return torch.empty(p.shape, dtype=torch_dtype(p.dtype), device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _receiver(self, src: int) -> None:
        try:
            while True:
                kind, a, k, stage, nbytes, segment, *_ = self.transport.recv_header(src)
                if kind == FIN:
                    return
                buf = self._buffer(kind, a, nbytes)
                buf = self.transport.recv_payload(src, buf)
                if kind == ACT:
                    self._deliver(segment, ("A", self.value_names[a], k), buf)
                elif kind == GRAD:
                    self._deliver(segment, ("G", self.value_names[a], k, stage), buf)
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

    def _used(self, st: _Stage, version: int) -> None:
        st.uses_left[version] -= 1
        if st.uses_left[version] == 0:
            del st.uses_left[version]
            st.stash.pop(version, None)

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

    def _missing(self, st: _Stage, task: Task, data) -> list[str]:
        spec = self._spec[st.id]
        miss = []
        if task.kind == "F":
            for v in spec.inputs:
                if v in self._graph_inputs or not self.m.values[v].is_tensor:
                    continue
                if ("A", v, task.index) not in self.inbox:
                    p = self.m.values[v].producer
                    miss.append(f"{v} of micro-batch {task.index} from stage {p} (rank {self.ranks[p]})")
        elif task.kind == "B":
            for v in spec.outputs:
                if v == self.m.loss or not self._needs_grad(v):
                    continue
                for c in self._consumers[v]:
                    if ("G", v, task.index, c) not in self.inbox:
                        miss.append(f"gradient of {v} of micro-batch {task.index} from stage {c} "
                                    f"(rank {self.ranks[c]})")
        else:
            j = task.index
            mine = set(st.params) if st.update_phase < 2 else set()
            for name, holders in self._shared.items():
                if name in mine:
                    for h in holders:
                        if h != st.id and ("S", name, j, h, st.id) not in self.inbox:
                            miss.append(f"shared gradient of {name} for step {j} from stage {h} "
                                        f"(rank {self.ranks[h]})")
            if self.cfg.clip_grad_norm and st.update_phase >= 2:
                for s in self.m.stages:
                    if ("N", j, s.id) not in self.inbox:
                        miss.append(f"gradient norm of step {j} from stage {s.id} (rank {self.ranks[s.id]})")
        return miss

    # ------------------------------------------------------------------ tasks
    def _forward(self, st: _Stage, k: int, data) -> None:
        spec = self._spec[st.id]
        prog = st.program
        version = prog.forward_version[k]
        inputs = [self._input(st, v, k, data) for v in spec.inputs]
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
        seed = micro_batch_seed(self.cfg.seed, self.step_offset * self.cfg.micro_batches + k)
        t0 = time.perf_counter()
        if prog.recompute:
            weights = self._predicted(st, k, self._weights(st, version, across_update=False))
            with torch.no_grad():
                outs = _call(st.module, weights, st.params, tuple(inputs), seed)
            st.saved[k] = (inputs, None, None)
        else:
            across = k in st.program.spans_update
            weights = self._weights(st, version, across_update=across)
            args = [self._leaf(v, x) for v, x in zip(spec.inputs, inputs)]
            with torch.enable_grad():
                outs = _call(st.module, weights, st.params, tuple(args), seed)
            st.saved[k] = (args, outs, weights)
        st.times.forward_s += time.perf_counter() - t0
        st.times.forwards += 1
        self._used(st, version)
        for v, out in zip(spec.outputs, outs):
            if v == self.m.loss:
                self._losses[k] = float(out.detach())
            if not isinstance(out, torch.Tensor):
                continue
            if self._local_consumers.get(v):
                self._put(("A", v, k), out.detach())
            for r in self._remote_ranks.get(v, []):
                self._send(r, [ACT, self.value_index[v], k, st.id, 0], out.detach())

    def _leaf(self, v: str, x):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if self._needs_grad(v):
                x.requires_grad_(True)
        return x

    def _backward(self, st: _Stage, k: int, data) -> None:
        spec = self._spec[st.id]
        prog = st.program
        version = prog.backward_version[k]
        args, outs, weights = st.saved.pop(k)
        seed = micro_batch_seed(self.cfg.seed, self.step_offset * self.cfg.micro_batches + k)
        t0 = time.perf_counter()
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
                if not (isinstance(out, torch.Tensor) and out.requires_grad):
                    if v != self.m.loss and self._needs_grad(v):
                        for c in self._consumers[v]:
                            self.inbox.pop(("G", v, k, c), None)
                    continue
                if v == self.m.loss:
                    roots.append(out)
                    grads.append(torch.full_like(out, 1.0 / self.cfg.micro_batches))
                elif self._needs_grad(v):
                    g = None
                    for c in sorted(self._consumers[v]):
                        part = self.inbox.pop(("G", v, k, c))
                        g = part if g is None else g + part
                    if g is not None:
                        roots.append(out)
                        grads.append(g)
        if roots:
            torch.autograd.backward(roots, grads)
        if weights is not st.params:
            for n, t in weights.items():
                if t.grad is not None:
                    p = st.params[n]
                    p.grad = t.grad if p.grad is None else p.grad + t.grad
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
        st.times.backward_s += time.perf_counter() - t0
        st.times.backwards += 1
        self._used(st, version)

    def _begin_update(self, st: _Stage, j: int) -> None:
        """Phase 1 of U(j): send this stage's gradients of shared parameters to the other holders.

        Each other holder on this rank gets the tensor itself (keyed by its own id); each other
        rank gets one message, which its receiver hands to every holder there. Nobody writes
        into a gradient once it is sent: holders sum into a tensor of their own.
        """
        for name, holders in self._shared.items():
            if name not in st.params:
                continue
            p = st.params[name]
            g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
            for h in self._local_holders[name]:
                if h != st.id:
                    self._put(("S", name, j, st.id, h), g)
            for r in sorted({self.ranks[h] for h in holders} - {self.rank}):
                self._send(r, [SHARED, self.param_index[name], j, st.id, 0], g)
        st.update_phase = 1

    def _sum_shared(self, st: _Stage, j: int) -> None:
        """Every holder sums all holders' gradients in stage order, so the copies take the same step."""
        parts: dict[str, list[torch.Tensor]] = {}
        with self.cv:
            for name, holders in self._shared.items():
                if name not in st.params:
                    continue
                p = st.params[name]
                own = p.grad if p.grad is not None else torch.zeros_like(p)
                parts[name] = [own if h == st.id else self.inbox.pop(("S", name, j, h, st.id))
                               for h in sorted(holders)]
        # Outside the lock: the receiver threads keep delivering meanwhile.
        for name, gs in parts.items():
            total = gs[0] + gs[1]
            for g in gs[2:]:
                total.add_(g)
            st.params[name].grad = total

    def _norm_part(self, st: _Stage) -> float:
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
        part = self._norm_part(st)
        blob = torch.frombuffer(bytearray(pickle.dumps(part)), dtype=torch.uint8)
        self._put(("N", j, st.id), part)
        for r in sorted({self.ranks[s.id] for s in self.m.stages} - {self.rank}):
            self._send(r, [NORM, 0, j, st.id, blob.numel()], blob)
        st.update_phase = 2

    def _try_update(self, st: _Stage, j: int, data) -> bool:
        """Advance U(j) as far as what has arrived allows; True once the step is taken."""
        if st.update_phase == 0:
            self._begin_update(st, j)
        with self.cv:
            if self._missing(st, st.next, data):
                return False
        if st.update_phase == 1:
            self._sum_shared(st, j)
            if self.cfg.clip_grad_norm:
                self._send_norm(st, j)
                with self.cv:
                    if self._missing(st, st.next, data):
                        return False
        self._update(st, j)
        return True

    def _update(self, st: _Stage, j: int) -> None:
        t0 = time.perf_counter()
        params, opt, sched = self._opt[st.id]
        if self.cfg.clip_grad_norm:
            total = math.sqrt(sum(self.inbox[("N", j, s.id)] for s in sorted(self.m.stages, key=lambda s: s.id)))
            _optim.clip_to(params.values(), total, self.cfg.clip_grad_norm)
            self._norms[j] = total
        if st.uses_left.get(st.version, 0) > 0 and st.version not in st.stash:
            st.stash[st.version] = self._copy(st)
        opt.step()
        if sched is not None:
            sched.step()
        for p in params.values():
            p.grad = None
        st.version += 1
        st.update_phase = 0
        st.times.update_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ the loop
    def run(self, batches: Iterator[dict], steps: int, *, on_step: Callable[[dict], None] | None = None,
            step_offset: int = 0) -> list[dict]:
        """Train ``steps`` steps on ``batches`` (mini-batches of ``M`` micro-batches, every rank the same
        iterator). Returns, per step, this rank's record (loss when it holds the loss stage, times)."""
        cfg, M = self.cfg, self.cfg.micro_batches
        with self.cv:
            self.step_offset = step_offset
            # Gradient norms stay in the inbox until the segment ends (every local update reads
            # them); those of the last segment would answer for this one's steps.
            for key in [key for key in self.inbox if key[0] == "N"]:
                del self.inbox[key]
            for key, value in self._parked.pop(step_offset, []):
                self.inbox[key] = value
                self.arrivals += 1
        progs = programs(self.m, cfg, steps)
        from .data import split_micro_batches

        self.stages = {}
        for sid, mod in self.modules.items():
            prog = progs[sid]
            self.stages[sid] = _Stage(sid, mod, prog, self._opt[sid][0], uses_left=dict(prog.version_uses))
        self._losses: dict[int, float] = {}
        self._norms: dict[int, float] = {}
        self._merged_next = 0
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
                cache[fetched[0]] = [{n: t.to(self.device) for n, t in mb.items()}
                                     for mb in split_micro_batches(batch, self.m, M)]
                fetched[0] += 1
            return cache[j][k % M]

        records: list[dict] = []
        done_steps: dict[int, set] = defaultdict(set)
        t_start = time.perf_counter()
        t_step = t_start
        wait_s = 0.0
        order = sorted(self.stages.values(), key=lambda s: (s.program.group, s.id))
        if self.world_size > 1 and not self._threads:
            self.start()
        last_progress = time.monotonic()
        while any(st.next is not None for st in order):
            ran = False
            seen = self.arrivals
            # Backwards first: they free memory and unblock upstream stages.
            for kinds in (("B", "U"), ("F",)):
                for st in order:
                    task = st.next
                    if task is None or task.kind not in kinds:
                        continue
                    if task.kind == "U":
                        if not self._try_update(st, task.index, data):
                            continue
                        st.pos += 1
                        done_steps[task.index].add(st.id)
                        if len(done_steps[task.index]) == len(self.stages):
                            now = time.perf_counter()
                            rec = self._record(task.index, now - t_step, wait_s)
                            t_step, wait_s = now, 0.0
                            records.append(rec)
                            cache.pop(task.index, None)
                            self._publish(task.index, rec)
                        ran = True
                        break
                    with self.cv:
                        missing = self._missing(st, task, data)
                    if missing:
                        continue
                    (self._forward if task.kind == "F" else self._backward)(st, task.index, data)
                    st.pos += 1
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
        if self.rank == self.log_rank:
            self._put(("R", j, self.rank), rec)
        else:
            blob = torch.frombuffer(bytearray(pickle.dumps(rec)), dtype=torch.uint8)
            self._send(self.log_rank, [STATS, 0, j, -1, blob.numel()], blob)

    def _emit(self, on_step: Callable[[dict], None]) -> None:
        """Call ``on_step`` with each step whose records have come in from every rank, in step order."""
        ranks = sorted(set(self.ranks.values()))
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
                continue
            with self.cv:
                miss = self._missing(st, task, data)
            lines.append(f"  stage {st.id} waits in {task}: " + ("; ".join(miss[:3]) or "nothing (a bug)"))
        return "\n".join(lines)

    def _record(self, j: int, seconds: float, wait_s: float) -> dict:
        M = self.cfg.micro_batches
        losses = [self._losses.pop(k) for k in range(j * M, (j + 1) * M) if k in self._losses]
        rec = {"step": self.step_offset + j, "rank": self.rank, "seconds": seconds,
               "samples_per_s": M * self.m.micro_batch_size / seconds if seconds > 0 else None,
               "wait_s": wait_s, "stages": {str(s.id): s.times.take() for s in self.stages.values()},
               "lr": None, "memory_bytes": memory_bytes(self.device),
               # Messages posted but not yet taken by the peer: bounded unless a peer falls behind.
               "sends_in_flight": len(self.pending_sends)}
        if losses:
            rec["loss"] = sum(losses) / len(losses)
        if j in self._norms:
            rec["grad_norm"] = self._norms.pop(j)
        opts = [o for _, o, _ in self._opt.values() if getattr(o, "param_groups", None)]
        if opts:
            rec["lr"] = opts[0].param_groups[0]["lr"]
        return rec

    # ------------------------------------------------------------------ state
    def state(self) -> dict[int, dict]:
        """Per local stage: its weights (canonical names) and optimizer state, for checkpoints."""
        out = {}
        for sid, (params, opt, sched) in self._opt.items():
            mod = self.modules[sid]
            out[sid] = {"weights": {n: t.detach() for n, t in mod.state_dict().items()},
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict() if sched is not None else None}
        return out

    def load_state(self, state: dict[int, dict]) -> None:
        for sid, (params, opt, sched) in self._opt.items():
            s = state[sid]
            try:
                self.modules[sid].load_state_dict(s["weights"])
            except RuntimeError as exc:
                first = str(exc).splitlines()[1:2] or [str(exc)]
                raise PipelineError(f"rank {self.rank}: the checkpoint's shard of stage {sid} does not fit it "
                                    f"({first[0].strip()}); resume with the package it was trained with") from None
            if s.get("optimizer"):
                opt.load_state_dict(s["optimizer"])
            if sched is not None and s.get("scheduler"):
                sched.load_state_dict(s["scheduler"])


def merge_records(parts: list[dict]) -> dict:
    """One log line for a step from every rank's record: the loss, the slowest rank's time, all stages."""
    seconds = max(p["seconds"] for p in parts)
    out = {"step": parts[0]["step"], "seconds": seconds, "samples_per_s": None, "loss": None, "lr": None,
           "stages": {}, "ranks": {}, "stage_ranks": {}}
    for p in parts:
        if p.get("loss") is not None:
            out["loss"] = p["loss"]
        if p.get("grad_norm") is not None:
            out["grad_norm"] = p["grad_norm"]
        if p.get("lr") is not None:
            out["lr"] = p["lr"]
        if p.get("samples_per_s") and seconds > 0:
            out["samples_per_s"] = p["samples_per_s"] * p["seconds"] / seconds
        out["stages"].update(p["stages"])
        out["stage_ranks"].update({sid: str(p["rank"]) for sid in p["stages"]})
        out["ranks"][str(p["rank"])] = {"seconds": p["seconds"], "wait_s": p["wait_s"],
                                        "memory_bytes": p["memory_bytes"],
                                        "sends_in_flight": p.get("sends_in_flight", 0)}
    return out


def memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA's allocator peak on a GPU, the resident set size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # noqa: BLE001 - not on every OS
        return 0
