"""AvgPipe's elastic averaging (Chen et al., PPoPP 2023, §3.2): N parallel pipelines and a reference model.

N parallel pipelines of the same package train side by side, each on its own batch (its share
of the step's global batch, as replicas do), each with its own optimizer (any: SGD, Adam,
Adafactor). Unlike replicas they never average gradients: each takes its own local step and is
then pulled toward the reference model, the average of the N parallel models.

The update of parallel model ``i`` at step ``j`` (``v_i`` the weights after its local optimizer
step, ``w_i(j)`` after the pull, ``ref(j) = mean_i w_i(j)``)::

    w_i(j) = v_i(j) + alpha * (ref(j-1) - w_i(j-1))          alpha = 1/N by default

That is the issue's ``w_i <- (1 - alpha) w_i + alpha w_ref`` with the displacement from the
reference measured one step late, at the weights the reference was averaged from. Two reasons
for that choice over pulling the current weights toward a one-step-old reference:

* **The reference stays the exact average.** Summing the update over ``i`` gives
  ``mean w(j) = mean w(j-1) + mean (v_i - w_i(j-1))``: the average moves by the mean local
  update (what the paper's reference process applies) and the elastic terms cancel. Pulling
  ``(1 - alpha) v_i + alpha ref(j-1)`` instead drags every model back by ``alpha`` times its own
  step: at N = 1, alpha = 1 it would not train at all, at N = 2 it halves the learning rate.
* **It is off the critical path.** ``ref(j-1) - w_i(j-1)`` needs only step ``j-1``'s weights: a
  background thread per stage copies them when the step is taken and all-reduces the copy over
  the stage's N ranks while the pipeline runs step ``j``'s forwards and backwards; the pull at
  ``U(j)`` waits only when a whole step of compute did not cover one all-reduce.

With N = 1 the displacement is always zero: AvgPipe is 1F1B with advance forward propagation,
bit for bit (no communication at all). The reference model is never materialised during
training; :meth:`ElasticAveraging.reference` computes it (one extra all-reduce) for checkpoints,
which save it, and every parallel model resumes from it (a resumed run is a run whose N models
start equal, as a fresh one does).

Memory: per parallel model and stage, one weight-sized buffer (the pending displacement) and one
all-reduce bucket in flight, in place of the paper's reference model per GPU.
"""

from __future__ import annotations

import queue
import threading

import torch

from .allreduce import buckets


class AvgPipeError(ValueError):
    """AvgPipe cannot run with these settings; the message says which to change."""


def default_alpha(parallel: int) -> float:
    """The paper's ``alpha = 1/N`` (§3.2, after Crossbow)."""
    return 1.0 / parallel


def check(parallel: int, alpha: float | None) -> float:
    """The elastic coefficient to use for ``parallel`` pipelines; refuses nonsense."""
    if parallel < 1:
        raise AvgPipeError(f"--parallel-pipelines must be at least 1, got {parallel}")
    a = default_alpha(parallel) if alpha is None else float(alpha)
    if not 0.0 <= a <= 1.0:
        raise AvgPipeError(f"--elastic-alpha must lie in [0, 1] (0: independent models, 1: reset to the "
                           f"reference every step), got {a}")
    return a


def _mean_in_place(flat: torch.Tensor, parallel: int, allreduce) -> None:
    """``flat`` <- the mean of every member's ``flat``. With three or more members the sum runs in
    float64: a stage's copy of a tied weight is averaged in another group (another bucket layout,
    so possibly another summation order) than the other holders' copies, and must come out the
    same bits. Two members sum ``a + b = b + a`` exactly."""
    if parallel < 3 or flat.dtype == torch.float64:
        allreduce(flat)
        flat.div_(parallel)
        return
    wide = flat.double()
    allreduce(wide)
    flat.copy_(wide.div_(parallel))


class _StageAverager:
    """One stage's background thread: all-reduce a snapshot, leave ``alpha * (mean - snapshot)``."""

    def __init__(self, stage: int, parallel: int, alpha: float, allreduce, notify):
        self.stage, self.parallel, self.alpha = stage, parallel, alpha
        self._allreduce, self._notify = allreduce, notify
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: dict[int, object] = {}        # step -> displacement list, or the error
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"avgpipe-{stage}")
        self._thread.start()

    def submit(self, key, tensors: list[torch.Tensor], kind: str, done=None) -> None:
        self._jobs.put((key, tensors, kind, done))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            key, tensors, kind, done = job
            try:
                out = self._pull(tensors) if kind == "pull" else self._mean(tensors)
            except BaseException as exc:  # noqa: BLE001 - handed to the engine, which names the stage
                out = exc
            if done is not None:
                done(out)
                continue
            with self._lock:
                self.results[key] = out
            self._notify()

    def _pull(self, snapshot: list[torch.Tensor]) -> list[torch.Tensor]:
        # Bucket by bucket: the snapshot becomes the displacement in place, so the thread holds one
        # weight-sized buffer plus one bucket.
        for idx in buckets(snapshot):
            parts = [snapshot[i] for i in idx]
            flat = torch.cat([p.reshape(-1) for p in parts])
            _mean_in_place(flat, self.parallel, self._allreduce)
            off = 0
            for p in parts:
                n = p.numel()
                p.neg_().add_(flat[off:off + n].view_as(p)).mul_(self.alpha)
                off += n
        return snapshot

    def _mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for idx in buckets(tensors):
            parts = [tensors[i] for i in idx]
            flat = torch.cat([p.detach().reshape(-1) for p in parts])
            _mean_in_place(flat, self.parallel, self._allreduce)
            off = 0
            for p in parts:
                n = p.numel()
                out.append(flat[off:off + n].view_as(p).clone())
                off += n
        return out

    def take(self, step: int):
        with self._lock:
            return self.results.pop(step, None)

    def has(self, step: int) -> bool:
        with self._lock:
            return step in self.results

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=10)


class ElasticAveraging:
    """The ``averaging`` object of :class:`~ftcompile.runtime.engine.RankEngine` for AvgPipe.

    The engine runs N parallel pipelines as N replicas (:class:`~ftcompile.runtime.layout.RankLayout`
    with ``replicas=N``) and, given this object, skips its gradient averaging and calls
    :meth:`attach` with each local stage's all-reduce over its N copies, :meth:`ready` before
    ``U(j)`` and :meth:`after_step` right after each stage's optimizer step.
    """

    def __init__(self, parallel: int, alpha: float | None = None):
        self.parallel = parallel
        self.alpha = check(parallel, alpha)
        self._stages: dict[int, _StageAverager] = {}
        self._pending: dict[int, int] = {}          # stage -> the step whose displacement U(step + 1) applies
        self._poke = None

    # ---- engine hooks
    def attach(self, engine, allreduce: dict[int, object]) -> None:
        """Called by the engine once its local stages exist: ``allreduce[stage](flat)`` sums over the stage's N
        ranks (one per parallel pipeline)."""
        if engine.replicas != self.parallel:
            raise AvgPipeError(f"{self.parallel} parallel pipelines need a layout of {self.parallel} replicas, "
                               f"the engine has {engine.replicas}")
        self._poke = engine.poke
        if self.parallel < 2:
            return
        for sid in sorted(engine.modules):
            self._stages[sid] = _StageAverager(sid, self.parallel, self.alpha, allreduce[sid], self._notify)

    def _notify(self) -> None:
        if self._poke is not None:
            self._poke()

    def ready(self, stage: int, step: int) -> str | None:
        prev = self._pending.get(stage)
        if prev is None or stage not in self._stages or self._stages[stage].has(prev):
            return None
        return (f"the reference model of step {prev} (the average of stage {stage} over the {self.parallel} "
                "parallel pipelines, on its background all-reduce)")

    @torch.no_grad()
    def after_step(self, stage: int, step: int, params: dict[str, torch.Tensor]) -> None:
        avg = self._stages.get(stage)
        if avg is None:
            return
        tensors = list(params.values())
        prev = self._pending.pop(stage, None)
        if prev is not None:
            disp = avg.take(prev)
            if isinstance(disp, BaseException):
                raise AvgPipeError(f"averaging stage {stage} over the parallel pipelines at step {prev} failed: "
                                   f"{disp}")
            for p, d in zip(tensors, disp):
                p.add_(d)
        avg.submit(step, [p.detach().clone() for p in tensors], "pull")
        self._pending[stage] = step

    # ---- the reference model
    @torch.no_grad()
    def reference(self, state: dict[int, dict]) -> dict[int, dict]:
        """The reference model in the layout of :meth:`RankEngine.state`: every floating tensor of each local
        stage's weights and optimizer state averaged over the N parallel pipelines (a collective: every rank
        calls it at the same point). Every pipeline gets the same bits, so a checkpoint keeps one copy."""
        if not self._stages:
            return state
        out = {}
        for sid, st in state.items():
            avg = self._stages[sid]
            keys, tensors = [], []
            for n, t in st["weights"].items():
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    keys.append(("weights", n, None))
                    tensors.append(t)
            for n, d in st.get("optimizer", {}).items():
                for k, t in d.items():
                    if isinstance(t, torch.Tensor) and t.is_floating_point():
                        keys.append(("optimizer", n, k))
                        tensors.append(t)
            box: queue.SimpleQueue = queue.SimpleQueue()
            # Through the stage's own thread: its all-reduces stay in one order on every member.
            avg.submit(None, tensors, "mean", box.put)
            means = box.get()
            if isinstance(means, BaseException):
                raise AvgPipeError(f"averaging stage {sid}'s reference model failed: {means}")
            new = {"weights": dict(st["weights"]),
                   "optimizer": {n: dict(d) for n, d in st.get("optimizer", {}).items()}}
            for (part, n, k), m in zip(keys, means):
                if part == "weights":
                    new["weights"][n] = m
                else:
                    new["optimizer"][n][k] = m
            out[sid] = new
        return out

    def close(self) -> None:
        for avg in self._stages.values():
            avg.close()
        self._stages.clear()


# --------------------------------------------------------------------------- options

def _count(flag: str, text, low: int):
    """``text`` as an int >= ``low``, ``"auto"``, or None when not given."""
    if text is None or text == "auto":
        return text
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise AvgPipeError(f"{flag} takes a whole number or 'auto', got {text!r}") from None
    if n < low:
        raise AvgPipeError(f"{flag} must be {'0 or more' if low == 0 else f'at least {low}'} (or 'auto'), got {n}")
    return n


def check_options(args) -> list[str]:
    """Refuse AvgPipe options that make no sense (:class:`AvgPipeError`); warnings for pointless ones."""
    n = _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    _count("--advance", getattr(args, "advance", None), 0)
    alpha = getattr(args, "elastic_alpha", None)
    if alpha is not None:
        check(n if isinstance(n, int) else 2, alpha)
    given = [f for f, v in (("--parallel-pipelines", n), ("--elastic-alpha", alpha)) if v is not None]
    if given and args.schedule not in (None, "avgpipe"):
        raise AvgPipeError(f"{', '.join(given)} belong to --schedule avgpipe, not {args.schedule}; add "
                           "--schedule avgpipe or drop them")
    if getattr(args, "advance", None) not in (None, 0, "0") and args.schedule not in (None, "avgpipe"):
        return [f"--advance does nothing under --schedule {args.schedule}: it is for --schedule avgpipe"]
    return []


def resolved(args) -> tuple[int, int, float | None]:
    """``(parallel pipelines, advance, alpha)`` of a rank's options; 'auto' must have been resolved by the
    launcher (``ftcompile run``), which can consult the compiler."""
    n = _count("--parallel-pipelines", getattr(args, "parallel_pipelines", None), 1)
    k = _count("--advance", getattr(args, "advance", None), 0)
    if n == "auto" or k == "auto":
        raise AvgPipeError("--parallel-pipelines auto and --advance auto are chosen by `ftcompile run` from the "
                           "package's plan; started directly, give numbers")
    return (n or 1), (k or 0), getattr(args, "elastic_alpha", None)


def as_replicas(args, schedule: str | None) -> None:
    """Under ``avgpipe`` the parallel pipelines are the run's replicas: set ``args.replicas`` to N (refusing a
    ``--replicas`` that says otherwise)."""
    if schedule != "avgpipe":
        return
    n = resolved(args)[0]
    given = getattr(args, "replicas", None)
    if given is not None and given != n:
        raise AvgPipeError(f"--replicas {given} with --schedule avgpipe: its parallel pipelines are the replicas; "
                           f"give --parallel-pipelines {given} instead (now {n})")
    args.replicas = n
