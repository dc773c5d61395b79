"""Dataflow execution of one rank's pipeline stages.

A rank (one process per GPU) hosts every stage its :class:`RunPlan` assigns
to it and runs their :mod:`~ftcompile.runtime.schedules` programs:

* **Dataflow.** A stage's next task runs as soon as what it needs has arrived:
  ``F(k)`` every input value of micro-batch ``k`` (from any stage, not only a
  neighbour), ``B(k)`` the gradient of each of its floating outputs from every
  rank that consumes it, ``U(j)`` the gradients of shared parameters from the
  other holders (and every stage's gradient norm when clipping). Among ready
  tasks the rank picks by :func:`~ftcompile.runtime.schedules.priority`.
* **Messages.** Outputs go straight to every consuming rank, once per rank
  (local consumers read them in place). A consuming rank sums its stages'
  input gradients and sends one gradient back. Sends are non-blocking; one
  receiver thread per peer rank receives into buffers allocated from the
  manifest shapes, so communication overlaps computation. See
  :mod:`~ftcompile.runtime.transport` for the tags.
* **Weights.** Each task uses the weight version its schedule's tables name;
  the engine stashes a copy of the current weights at an update only when a
  later task still needs them, and frees it after the last use.
* **Shared parameters** (``manifest["shared_parameters"]``): every holder sums
  the holders' gradients in stage order, so all copies take the same step.
* **Failures.** A peer that dies is reported at once (its connection closes);
  nothing arriving for ``timeout_s`` raises :class:`PipelineHang` naming the
  stages and what they wait for.

The plan (stage -> rank), the transport and the configuration are values
given to :class:`RankEngine`, so a job can build a new engine on a new plan.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import optim as _optim
from .schedules import StageSchedule, Task, pipeline_schedules, priority
from .transport import header_tag, payload_tag

KIND_ACT, KIND_GRAD, KIND_SHARED, KIND_NORM, KIND_FIN = 0, 1, 2, 3, 9
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8]


class PipelineError(RuntimeError):
    """A pipeline run failed; the message names the rank and stage."""


class PipelineHang(PipelineError):
    """Nothing arrived for longer than the timeout."""


# --------------------------------------------------------------------------- package access

def open_package(path, *, verify_checksums: bool = True):
    """The contract's ``ftcompile.runtime.package.load_package``; a minimal reader while it is absent."""
    try:
        from .package import load_package
    except ImportError:
        return MiniPackage(path)
    return load_package(path, verify_checksums=verify_checksums)


class MiniPackage:
    """Just what the engine uses of the contract's ``Package`` (``manifest``, ``build_stage``), no checks."""

    def __init__(self, path):
        self.path = Path(path)
        self.manifest = json.loads((self.path / "manifest.json").read_text())

    def build_stage(self, stage_id: int, device="cpu", dtype=None) -> torch.nn.Module:
        from safetensors.torch import load_file
        spec = next(s for s in self.manifest["stages"] if int(s["id"]) == stage_id)
        file = self.path / f"{spec['module']}.py"
        mod_spec = importlib.util.spec_from_file_location(f"_ftc_pkg_{abs(hash(str(self.path)))}_{spec['module']}", file)
        py = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(py)
        module = getattr(py, spec["class"])()
        module.load_state_dict(load_file(str(self.path / spec["weights"])), strict=True)
        return module.to(device)


# --------------------------------------------------------------------------- plan and config

@dataclass
class RunPlan:
    """Where every stage runs and how: the value an engine is built from.

    ``stage_rank`` maps stage id -> rank (defaults to the manifest's ``gpu``).
    """

    stage_rank: dict[int, int]
    schedule: str = "gpipe"
    micro_batches: int = 4
    recompute: bool | None = None

    @classmethod
    def from_manifest(cls, manifest: dict, *, schedule: str | None = None, micro_batches: int | None = None,
                      recompute: bool | None = None) -> "RunPlan":
        return cls({int(s["id"]): int(s["gpu"]) for s in manifest["stages"]},
                   schedule or manifest.get("schedule", "gpipe"),
                   int(micro_batches or manifest.get("micro_batches", 4)), recompute)

    @property
    def num_ranks(self) -> int:
        return max(self.stage_rank.values()) + 1


@dataclass
class TrainConfig:
    steps: int = 10
    optimizer: str = "sgd"
    lr: float = 1e-2
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: str = "constant"     # constant | linear | cosine (with warmup_steps)
    warmup_steps: int = 0
    clip_grad_norm: float | None = None
    weight_prediction: bool = False   # async only: forward on predicted weights (FTPipe §4.2)
    seed: int = 0
    timeout_s: float = 60.0


@dataclass
class StageStats:
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    update_s: float = 0.0
    tasks: int = 0


@dataclass
class RunResult:
    rank: int
    losses: dict[int, list[float]] = field(default_factory=dict)   # mini-batch -> micro-batch losses
    stats: dict[int, StageStats] = field(default_factory=dict)
    wait_s: float = 0.0
    wall_s: float = 0.0
    step_end_s: dict[int, float] = field(default_factory=dict)

    def step_losses(self) -> dict[int, float]:
        return {j: sum(v) / len(v) for j, v in sorted(self.losses.items())}


def micro_batch_seed(seed: int, stage: int, k: int) -> int:
    """RNG seed of stage ``stage``'s forward on micro-batch ``k`` (recomputation replays it)."""
    return (seed * 1_000_003 + k * 1009 + stage) % (2 ** 62)


def value_tables(manifest: dict):
    """Producer stage, consumer stages, specs and literals of every value crossing stages."""
    producer: dict[str, int] = {}
    consumers: dict[str, list[int]] = defaultdict(list)
    spec: dict[str, dict] = {}
    literal: dict[str, object] = {}
    for st in manifest["stages"]:
        for o in st["outputs"]:
            producer[o["value"]] = int(st["id"])
            spec[o["value"]] = o
            if "literal" in o:
                literal[o["value"]] = o["literal"]
        for i in st["inputs"]:
            if i.get("from") != "input":
                consumers[i["value"]].append(int(st["id"]))
    names = sorted(spec)
    return producer, dict(consumers), spec, literal, {v: n for n, v in enumerate(names)}


def is_grad_value(spec: dict) -> bool:
    return "literal" not in spec and bool(spec.get("requires_grad")) and str(spec.get("dtype", "")).startswith(
        ("float", "bfloat"))


def split_micro(value: torch.Tensor, shape: list[int] | None, i: int, mbs: int) -> torch.Tensor:
    """Micro-batch ``i`` of a mini-batch tensor (batch dimension 0); tensors already of the manifest shape pass."""
    if not torch.is_tensor(value) or shape is None or list(value.shape) == list(shape):
        return value
    return value[i * mbs:(i + 1) * mbs]


# --------------------------------------------------------------------------- mailbox

class Mailbox:
    """Messages that arrived (from peers or from this rank's own stages), guarded by a condition."""

    def __init__(self):
        self.cond = threading.Condition()
        self.data: dict[tuple, object] = {}
        self.errors: list[str] = []
        self.arrivals = 0

    def put(self, key: tuple, value) -> None:
        with self.cond:
            self.data[key] = value
            self.arrivals += 1
            self.cond.notify_all()

    def fail(self, msg: str) -> None:
        with self.cond:
            self.errors.append(msg)
            self.cond.notify_all()


# --------------------------------------------------------------------------- stage state

@dataclass
class _Stage:
    id: int
    spec: dict
    module: torch.nn.Module
    sched: StageSchedule
    depth: int
    trainable: dict[str, torch.nn.Parameter]
    optimizer: object
    lr_scheduler: object
    pc: int = 0
    version: int = 0
    stash: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    last_use: dict[int, int] = field(default_factory=dict)
    saved: dict[int, tuple] = field(default_factory=dict)
    update_phase: int = 0
    stats: StageStats = field(default_factory=StageStats)

    def next_task(self) -> Task | None:
        return self.sched.program[self.pc] if self.pc < len(self.sched.program) else None


class RankEngine:
    """Runs the stages of one rank. ``pkg``: a loaded package (contract API); ``transport``: see transport.py."""

    def __init__(self, pkg, plan: RunPlan, config: TrainConfig, transport, *, device="cpu",
                 modules: dict[int, torch.nn.Module] | None = None, on_step=None):
        self.pkg, self.plan, self.cfg, self.tp = pkg, plan, config, transport
        self.manifest = pkg.manifest
        self.rank = transport.rank
        self.device = torch.device(device)
        self.on_step = on_step
        m = self.manifest
        self.M = plan.micro_batches
        self.mbs = int(m["micro_batch_size"])
        self.loss_value = m["loss"]["value"]
        self.loss_stage = int(m["loss"]["stage"])
        self.producer, self.consumers, self.vspec, self.literal, self.vidx = value_tables(m)
        self.vnames = sorted(self.vidx, key=self.vidx.get)
        self.input_shape = {g["value"]: g.get("shape") for g in m.get("graph_inputs", [])}
        self.all_specs = {int(s["id"]): s for s in m["stages"]}
        self.shared = {p: sorted(int(x) for x in h) for p, h in m.get("shared_parameters", {}).items() if len(h) > 1}
        self.shared_names = sorted(self.shared)
        self.num_stages = len(self.all_specs)
        self.scheds = pipeline_schedules(plan.schedule, m["stages"], self.M, config.steps,
                                         loss_stage=self.loss_stage, recompute=plan.recompute)
        mine = sorted(s for s, r in plan.stage_rank.items() if r == self.rank)
        self.stages: dict[int, _Stage] = {}
        for sid in mine:
            spec = self.all_specs[sid]
            mod = modules[sid] if modules and sid in modules else pkg.build_stage(sid, device=self.device)
            mod.train()
            trainable_names = set(spec.get("trainable", spec.get("params", [])))
            named = dict(mod.named_parameters())
            trainable = {n: p for n, p in named.items() if n in trainable_names}
            for n, p in named.items():
                p.requires_grad_(n in trainable_names)
            opt, sch = _optim.build(list(trainable.values()), config)
            st = _Stage(sid, spec, mod, self.scheds[sid], int(spec["depth"]), trainable, opt, sch)
            for pos, t in enumerate(st.sched.program):
                if t.kind == "F":
                    st.last_use[st.sched.version_f[t.index]] = pos
                elif t.kind == "B":
                    st.last_use[st.sched.version_b[t.index]] = pos
            self.stages[sid] = st
        # peers: every other rank hosting stages (messages flow in both directions)
        self.peers = sorted({r for r in plan.stage_rank.values() if r != self.rank})
        self.box = Mailbox()
        self.send_seq: dict[int, int] = defaultdict(int)
        self.pending_sends: list = []
        self.grad_parts: dict[tuple, dict[int, torch.Tensor]] = {}
        self.batches: dict[int, dict] = {}
        self.result = RunResult(self.rank, stats={s: st.stats for s, st in self.stages.items()})
        self._threads: list[threading.Thread] = []
        self._t0 = time.perf_counter()

    # ----------------------------------------------------------------- messaging
    def _num_items(self) -> int:
        return max(len(self.vnames), len(self.shared_names) * self.num_stages, self.num_stages, 1)

    def _send(self, dst: int, kind: int, index: int, item: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().contiguous()
        code = _DTYPES.index(tensor.dtype)
        header = torch.tensor([kind, index, item, tensor.numel(), code], dtype=torch.int64)
        seq = self.send_seq[dst]
        self.send_seq[dst] += 1
        h1 = self.tp.isend(header.to(self.tp.device), dst, header_tag(seq))
        if kind == KIND_FIN:      # the header says it all
            self.pending_sends.append((h1, None, header, tensor))
            return
        h2 = self.tp.isend(tensor.to(self.tp.device), dst, payload_tag(kind, index, item, self._num_items()))
        self.pending_sends.append((h1, h2, header, tensor))
        if len(self.pending_sends) > 64:
            self._drain_sends(32)

    def _drain_sends(self, keep: int = 0) -> None:
        while len(self.pending_sends) > keep:
            h1, h2, _, _ = self.pending_sends.pop(0)
            h1.wait()
            if h2 is not None:
                h2.wait()

    def _alloc(self, kind: int, item: int, numel: int, code: int) -> torch.Tensor:
        dtype = _DTYPES[code]
        if kind in (KIND_ACT, KIND_GRAD):
            shape = self.vspec[self.vnames[item]].get("shape")
            if shape is not None and math.prod(shape) == numel:
                return torch.empty(shape, dtype=dtype, device=self.tp.device)
        return torch.empty(numel, dtype=dtype, device=self.tp.device)

    def _receiver(self, src: int) -> None:
        seq = 0
        stages = sorted(s for s, r in self.plan.stage_rank.items() if r == src)
        try:
            while True:
                header = torch.empty(5, dtype=torch.int64, device=self.tp.device)
                self.tp.recv(header, src, header_tag(seq))
                seq += 1
                kind, index, item, numel, code = (int(x) for x in header.cpu())
                if kind == KIND_FIN:
                    return
                buf = self._alloc(kind, item, numel, code)
                self.tp.recv(buf, src, payload_tag(kind, index, item, self._num_items()))
                buf = buf.to(self.device)
                if kind == KIND_ACT:
                    self.box.put(("act", index, self.vnames[item]), buf)
                elif kind == KIND_GRAD:
                    self.box.put(("grad", index, self.vnames[item], src), buf)
                elif kind == KIND_SHARED:
                    p, s = divmod(item, self.num_stages)
                    self.box.put(("shared", index, self.shared_names[p], s), buf)
                elif kind == KIND_NORM:
                    self.box.put(("norm", index, item), buf)
        except Exception as e:  # the peer died or the link broke
            self.box.fail(f"rank {self.rank}: lost rank {src} (stages {stages}): {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}")

    def _deliver_act(self, k: int, value: str, tensor: torch.Tensor) -> None:
        ranks = sorted({self.plan.stage_rank[c] for c in self.consumers.get(value, [])})
        for r in ranks:
            if r == self.rank:
                self.box.put(("act", k, value), tensor.detach())
            else:
                self._send(r, KIND_ACT, k, self.vidx[value], tensor)

    def _add_input_grad(self, k: int, value: str, stage: int, grad: torch.Tensor) -> None:
        """Collect one local consumer's gradient; when all local consumers gave theirs, send the sum."""
        local = sorted(c for c in self.consumers[value] if self.plan.stage_rank[c] == self.rank)
        parts = self.grad_parts.setdefault((k, value), {})
        parts[stage] = grad
        if len(parts) < len(local):
            return
        del self.grad_parts[(k, value)]
        total = parts[local[0]].clone()
        for c in local[1:]:
            total += parts[c]
        dst = self.plan.stage_rank[self.producer[value]]
        if dst == self.rank:
            self.box.put(("grad", k, value, self.rank), total)
        else:
            self._send(dst, KIND_GRAD, k, self.vidx[value], total)

    # ----------------------------------------------------------------- readiness
    def _data(self, k: int, batches) -> dict:
        j = k // self.M
        while j >= self._pulled:
            try:
                self.batches[self._pulled] = next(batches)
            except StopIteration:
                raise PipelineError(f"rank {self.rank}: the dataset ran out at mini-batch {self._pulled}") from None
            self._pulled += 1
        return self.batches[j]

    def _grad_sources(self, value: str) -> list[int]:
        return sorted({self.plan.stage_rank[c] for c in self.consumers.get(value, [])})

    def _missing(self, st: _Stage) -> list[str]:
        """What the stage's next task still waits for (empty: ready)."""
        t = st.next_task()
        data = self.box.data
        miss = []
        if t.kind == "F":
            for i in st.spec["inputs"]:
                v = i["value"]
                if i.get("from") == "input" or v in self.literal:
                    continue
                if ("act", t.index, v) not in data:
                    p = self.producer[v]
                    miss.append(f"value {v!r} of micro-batch {t.index} from stage {p} on rank {self.plan.stage_rank[p]}")
        elif t.kind == "B":
            for o in st.spec["outputs"]:
                v = o["value"]
                if not is_grad_value(o) or v not in self.consumers:
                    continue
                for r in self._grad_sources(v):
                    if ("grad", t.index, v, r) not in data:
                        miss.append(f"gradient of {v!r} for micro-batch {t.index} from rank {r}")
        else:
            j = t.index
            if st.update_phase == 1:
                for p in self._shared_of(st):
                    for h in self.shared[p]:
                        if h != st.id and ("shared", j, p, h) not in data:
                            miss.append(f"shared gradient {p!r} of step {j} from stage {h} on rank "
                                        f"{self.plan.stage_rank[h]}")
            elif st.update_phase == 2:
                for s in range(self.num_stages):
                    if ("norm", j, s) not in data:
                        miss.append(f"gradient norm of step {j} from stage {s} on rank {self.plan.stage_rank[s]}")
        return miss

    def _shared_of(self, st: _Stage) -> list[str]:
        return [p for p in self.shared_names if st.id in self.shared[p] and p in st.trainable]

    # ----------------------------------------------------------------- tasks
    def _params_for(self, st: _Stage, version: int, *, grad: bool) -> dict[str, torch.Tensor] | None:
        """None: the module's own parameters (current version); else a stashed copy."""
        if version == st.version:
            return None
        if version not in st.stash:
            raise PipelineError(f"rank {self.rank} stage {st.id}: weight version {version} is not available "
                                f"(current {st.version}); the schedule's version table is inconsistent")
        src = st.stash[version]
        return {n: t.detach().requires_grad_(grad) for n, t in src.items()}

    def _call(self, st: _Stage, params, inputs: list, k: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(micro_batch_seed(self.cfg.seed, st.id, k))
            if params is None:
                out = st.module(*inputs)
            else:
                out = torch.func.functional_call(st.module, params, tuple(inputs), strict=False)
        return out if isinstance(out, tuple) else (out,)

    def _inputs(self, st: _Stage, k: int, batches) -> list:
        vals = []
        for i in st.spec["inputs"]:
            v = i["value"]
            if i.get("from") == "input":
                x = split_micro(self._data(k, batches)[v], self.input_shape.get(v), k % self.M, self.mbs)
                vals.append(x.to(self.device) if torch.is_tensor(x) else x)
            elif v in self.literal:
                vals.append(self.literal[v])
            else:
                vals.append(self.box.data[("act", k, v)])
        return vals

    def _forward(self, st: _Stage, k: int, batches) -> None:
        t0 = time.perf_counter()
        inputs = self._inputs(st, k, batches)
        vf = st.sched.version_f[k]
        if st.sched.recompute:
            params = self._params_for(st, vf, grad=False)
            if self.cfg.weight_prediction and self.plan.schedule == "async":
                delay = st.sched.version_b[k] - vf
                if delay > 0:
                    base = params if params is not None else {n: p.detach() for n, p in st.trainable.items()}
                    params = _optim.predict(st.optimizer, st.trainable, base, delay)
            with torch.no_grad():
                outs = self._call(st, params, inputs, k)
            st.saved[k] = (inputs, None, None)
        else:
            params = self._params_for(st, vf, grad=True)
            ginputs = [x.detach().requires_grad_(True) if torch.is_tensor(x) and x.is_floating_point()
                       and self._needs_grad(st, n) else x for n, x in enumerate(inputs)]
            with torch.enable_grad():
                outs = self._call(st, params, ginputs, k)
            st.saved[k] = (ginputs, outs, params)
        for o, y in zip(st.spec["outputs"], outs):
            if "literal" in o:
                continue
            if o["value"] == self.loss_value:
                self.result.losses.setdefault(k // self.M, []).append(float(y.detach()))
            self._deliver_act(k, o["value"], y)
        st.stats.forward_s += time.perf_counter() - t0
        self._consumed_inputs(st, k)

    def _needs_grad(self, st: _Stage, n: int) -> bool:
        i = st.spec["inputs"][n]
        return i.get("from") != "input" and i["value"] not in self.literal and is_grad_value(self.vspec[i["value"]])

    def _consumed_inputs(self, st: _Stage, k: int) -> None:
        # A received activation leaves the mailbox once every local consumer has run F(k);
        # stages that need it later (recomputation) hold their own reference in `saved`.
        for i in st.spec["inputs"]:
            v = i["value"]
            if i.get("from") == "input" or v in self.literal:
                continue
            key = ("act", k, v)
            n = self.act_uses.get(key)
            if n is None:
                n = sum(1 for c in self.consumers[v] if self.plan.stage_rank[c] == self.rank)
            if n <= 1:
                self.act_uses.pop(key, None)
                with self.box.cond:
                    self.box.data.pop(key, None)
            else:
                self.act_uses[key] = n - 1

    def _backward(self, st: _Stage, k: int) -> None:
        t0 = time.perf_counter()
        inputs, outs, params = st.saved.pop(k)
        if outs is None:   # recompute with the backward's weight version
            params = self._params_for(st, st.sched.version_b[k], grad=True)
            inputs = [x.detach().requires_grad_(True) if torch.is_tensor(x) and x.is_floating_point()
                      and self._needs_grad(st, n) else x for n, x in enumerate(inputs)]
            with torch.enable_grad():
                outs = self._call(st, params, inputs, k)
            st.stats.recompute_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        ys, gs = [], []
        for o, y in zip(st.spec["outputs"], outs):
            v = o["value"]
            if "literal" in o or not torch.is_tensor(y) or not y.requires_grad:
                continue
            if v == self.loss_value:
                ys.append(y)
                gs.append(torch.full_like(y, 1.0 / self.M))
            elif is_grad_value(o) and v in self.consumers:
                g = None
                for r in self._grad_sources(v):
                    part = self.box.data.pop(("grad", k, v, r))
                    g = part.clone() if g is None else g + part
                ys.append(y)
                gs.append(g.reshape(y.shape).to(y.dtype))
        if ys:
            torch.autograd.backward(ys, gs)
        if params is not None:
            for n, t in params.items():
                if t.grad is not None and n in st.trainable:
                    p = st.trainable[n]
                    p.grad = t.grad.clone() if p.grad is None else p.grad + t.grad
        for n, (i, x) in enumerate(zip(st.spec["inputs"], inputs)):
            if self._needs_grad(st, n):
                g = x.grad if x.grad is not None else torch.zeros_like(x)
                self._add_input_grad(k, i["value"], st.id, g.detach())
        st.stats.backward_s += time.perf_counter() - t1

    def _update(self, st: _Stage, j: int) -> bool:
        """Runs the update's phases; returns True when the step is taken."""
        t0 = time.perf_counter()
        shared = self._shared_of(st)
        if st.update_phase == 0:
            for p in shared:
                g = st.trainable[p].grad
                g = torch.zeros_like(st.trainable[p]) if g is None else g
                sent_to = set()
                for h in self.shared[p]:
                    if h == st.id:
                        continue
                    r = self.plan.stage_rank[h]
                    if r == self.rank:
                        self.box.put(("shared", j, p, st.id), g.detach().clone())
                    elif r not in sent_to:
                        sent_to.add(r)
                        self._send(r, KIND_SHARED, j, self.shared_names.index(p) * self.num_stages + st.id, g)
            st.update_phase = 1
            if self._missing(st):
                st.stats.update_s += time.perf_counter() - t0
                return False
        if st.update_phase == 1:
            for p in shared:
                total = None
                for h in self.shared[p]:
                    g = st.trainable[p].grad if h == st.id else self.box.data[("shared", j, p, h)]
                    g = torch.zeros_like(st.trainable[p]) if g is None else g
                    total = g.detach().clone() if total is None else total + g.reshape(total.shape)
                st.trainable[p].grad = total
            if self.cfg.clip_grad_norm:
                sq = torch.zeros((), dtype=torch.float64)
                for n, p in st.trainable.items():
                    if p.grad is not None and (n not in self.shared or self.shared[n][0] == st.id):
                        sq += p.grad.detach().double().pow(2).sum().cpu()
                for r in sorted(set(self.plan.stage_rank.values())):
                    if r == self.rank:
                        self.box.put(("norm", j, st.id), sq.reshape(1))
                    else:
                        self._send(r, KIND_NORM, j, st.id, sq.reshape(1))
                st.update_phase = 2
                if self._missing(st):
                    st.stats.update_s += time.perf_counter() - t0
                    return False
            else:
                st.update_phase = 3
        if st.update_phase == 2:
            total = sum(float(self.box.data[("norm", j, s)]) for s in range(self.num_stages))
            norm = math.sqrt(total)
            _optim.clip_to(st.trainable.values(), norm, self.cfg.clip_grad_norm)
            st.update_phase = 3
        # phase 3: stash the current weights if a later task still needs them, then step
        if st.last_use.get(st.version, -1) > st.pc:
            st.stash[st.version] = {n: p.detach().clone() for n, p in st.trainable.items()}
        st.optimizer.step()
        st.optimizer.zero_grad(set_to_none=True)
        if st.lr_scheduler is not None:
            st.lr_scheduler.step()
        st.version += 1
        for v in [v for v in st.stash if st.last_use.get(v, -1) <= st.pc]:
            del st.stash[v]
        st.update_phase = 0
        st.stats.update_s += time.perf_counter() - t0
        return True

    def _end_step(self, j: int) -> None:
        """Drop step ``j``'s bookkeeping once every local stage took its update."""
        with self.box.cond:
            for key in [key for key in self.box.data if key[0] in ("shared", "norm") and key[1] == j]:
                del self.box.data[key]
        self.batches.pop(j, None)

    # ----------------------------------------------------------------- main loop
    def run(self, batches) -> RunResult:
        """Train ``config.steps`` mini-batches from ``batches`` (an iterator of dicts value -> mini-batch tensor)."""
        batches = iter(batches)
        self._pulled = 0
        self.act_uses: dict[tuple, int] = {}
        for src in self.peers:
            th = threading.Thread(target=self._receiver, args=(src,), daemon=True, name=f"recv-{src}")
            th.start()
            self._threads.append(th)
        updates_left: dict[int, int] = defaultdict(lambda: len(self.stages))
        t_start = time.perf_counter()
        last_progress = time.perf_counter()
        try:
            while any(st.next_task() is not None for st in self.stages.values()):
                with self.box.cond:
                    if self.box.errors:
                        raise PipelineError(self.box.errors[0])
                    ready = [st for st in self.stages.values() if st.next_task() is not None and not self._missing(st)]
                    if not ready:
                        seen = self.box.arrivals
                        t_wait = time.perf_counter()
                        self.box.cond.wait(timeout=0.5)
                        self.result.wait_s += time.perf_counter() - t_wait
                        if self.box.arrivals == seen and time.perf_counter() - last_progress > self.cfg.timeout_s:
                            waits = "; ".join(f"stage {st.id} {st.next_task().kind}({st.next_task().index}) waits "
                                              f"for {', '.join(self._missing(st))}"
                                              for st in self.stages.values() if st.next_task() is not None)
                            raise PipelineHang(f"rank {self.rank}: nothing arrived for {self.cfg.timeout_s:.0f} s: "
                                               f"{waits}")
                        continue
                st = min(ready, key=lambda s: priority(self.plan.schedule, s.next_task(), s.depth, s.id))
                t = st.next_task()
                last_progress = time.perf_counter()
                if t.kind == "F":
                    self._forward(st, t.index, batches)
                elif t.kind == "B":
                    self._backward(st, t.index)
                else:
                    if not self._update(st, t.index):
                        continue
                    updates_left[t.index] -= 1
                    if updates_left[t.index] == 0:
                        self._end_step(t.index)
                        self.result.step_end_s[t.index] = time.perf_counter() - t_start
                        if self.on_step is not None:
                            self.on_step(self, t.index)
                st.pc += 1
                st.stats.tasks += 1
            self._drain_sends()
        finally:
            pass
        self.result.wall_s = time.perf_counter() - t_start
        return self.result

    def finish(self) -> None:
        """Tell every peer this rank is done and join the receiver threads."""
        for r in self.peers:
            self._send(r, KIND_FIN, 0, 0, torch.zeros(1))
        self._drain_sends()
        for th in self._threads:
            th.join(timeout=self.cfg.timeout_s)

    def state_dicts(self) -> dict[int, dict[str, torch.Tensor]]:
        return {s: {n: p.detach().clone() for n, p in st.module.state_dict().items()} for s, st in self.stages.items()}
