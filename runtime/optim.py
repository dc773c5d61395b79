"""Optimizers, learning-rate schedules, gradient clipping and weight prediction for pipeline stages.

Every stage gets its own optimizer over its own trainable parameters; built
from the same :class:`OptimConfig` they follow the same schedule, so a stage-wise step equals the whole-model step whenever the
optimizer is element-wise (SGD, momentum, Adam, AdamW) and gradients of shared
parameters are summed first. Adafactor (``transformers``) factors per tensor,
which is also stage-local.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adafactor")
LR_SCHEDULES = ("constant", "linear", "cosine")

#: The per-parameter state each optimizer keeps (torch's and transformers' keys): what a
#: checkpoint stores for it, and what an optimizer resumed from it can take over.
STATE_KEYS = {"sgd": (), "momentum": ("momentum_buffer",), "adam": ("step", "exp_avg", "exp_avg_sq"),
              "adamw": ("step", "exp_avg", "exp_avg_sq"),
              "adafactor": ("step", "exp_avg", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "RMS")}
#: Optimizers that predict weights from their state (FTPipe §4.2): see :func:`predict`.
PREDICTS = ("momentum", "adam", "adamw")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9          # momentum only
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    steps: int = 1                 # updates in the whole run, for linear and cosine decay


def build(params: list[torch.nn.Parameter], cfg: OptimConfig):
    """``(optimizer, lr_scheduler)`` for ``params`` from ``cfg``.

    An empty parameter list (a stage without trainable weights) gets a no-op
    optimizer. The scheduler steps once per update: warm-up over
    ``cfg.warmup_steps`` then ``constant``, ``linear`` decay to 0 at
    ``cfg.steps`` or ``cosine``.
    """
    name = cfg.optimizer.lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"unknown lr schedule {cfg.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")
    if not params:
        return _NoOp(cfg.lr), None
    # Fused kernels update every tensor in place in one pass: no temporaries the size of the
    # weights (the foreach kernels make one), which the memory model counts on, and faster.
    fused = {"fused": True} if _fusable(params) else {}
    if name == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused)
    elif name == "momentum":
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **fused)
    elif name == "adam":
        opt = torch.optim.Adam(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay,
                               **fused)
    elif name == "adamw":
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, **fused)
    elif name == "adafactor":
        try:
            from transformers.optimization import Adafactor
        except ImportError as e:   # pragma: no cover - transformers is a dependency
            raise ValueError(f"adafactor needs transformers: {e}") from e
        opt = Adafactor(params, lr=cfg.lr, scale_parameter=False, relative_step=False, warmup_init=False,
                        weight_decay=cfg.weight_decay)
    else:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    return opt, scheduler(opt, cfg)


def step(opt) -> None:
    """``opt.step()``, also where some parameters get their first gradient after the others.

    torch's fused SGD with momentum starts its buffers only when none of a group's exists yet, and
    fails on a parameter with a gradient but no buffer beside others that have one (a shared tensor
    whose summed gradient lags a step, ``engine.lags_shared``). The non-fused SGD starts such a
    buffer as the gradient itself; a zero buffer gives the same (``momentum * 0 + gradient``,
    without dampening, the only SGD :func:`build` makes).
    """
    if isinstance(opt, torch.optim.SGD) and opt.defaults.get("fused"):
        for group in opt.param_groups:
            if not group["momentum"] or group["dampening"]:
                continue
            live = [p for p in group["params"] if p.grad is not None]
            if any(opt.state[p].get("momentum_buffer") is not None for p in live):
                for p in live:
                    if opt.state[p].get("momentum_buffer") is None:
                        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    opt.step()


def _fusable(params: list[torch.nn.Parameter]) -> bool:
    """torch's fused optimizers take floating tensors on one CPU or CUDA device."""
    devices = {p.device.type for p in params}
    return len(devices) == 1 and devices <= {"cpu", "cuda"} and all(p.is_floating_point() for p in params)


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the base learning rate at update ``step`` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    frac = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        return max(0.0, 1.0 - frac)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")


def scheduler(opt, cfg):
    if cfg.lr_schedule == "constant" and not cfg.warmup_steps:
        return None
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps))


def clip_to(params: Iterable[torch.nn.Parameter], total_norm: float, max_norm: float) -> None:
    """Scale gradients as ``torch.nn.utils.clip_grad_norm_`` does, given the global norm."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def predict(opt, trainable: dict[str, torch.nn.Parameter], base: dict[str, torch.Tensor],
            delay: int) -> dict[str, torch.Tensor]:
    """Weights predicted ``delay`` updates ahead from the optimizer state (FTPipe §4.2, after SpecTrain).

    SGD with momentum: ``w - lr * delay * m``; Adam/AdamW: ``w - lr * delay *
    m_hat / (sqrt(v_hat) + eps)``. Without state yet (first steps) or for other
    optimizers, ``base`` unchanged.
    """
    out = {}
    group = opt.param_groups[0] if getattr(opt, "param_groups", None) else {}
    lr = group.get("lr", 0.0)
    for n, w in base.items():
        p = trainable.get(n)
        state = opt.state.get(p, {}) if p is not None else {}
        w = w.detach()
        if "momentum_buffer" in state and state["momentum_buffer"] is not None:
            out[n] = w - lr * delay * state["momentum_buffer"]
        elif "exp_avg" in state:
            b1, b2 = group.get("betas", (0.9, 0.999))
            step = float(state.get("step", 1))
            m_hat = state["exp_avg"] / (1 - b1 ** step)
            v_hat = state["exp_avg_sq"] / (1 - b2 ** step)
            out[n] = w - lr * delay * m_hat / (v_hat.sqrt() + group.get("eps", 1e-8))
        else:
            out[n] = w
    return out


class _NoOp:
    """Optimizer of a stage with nothing to train."""

    def __init__(self, lr: float):
        self.param_groups = [{"lr": lr, "params": []}]
        self.state = {}

    def step(self):
        pass

    def zero_grad(self, set_to_none: bool = True):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


# --------------------------------------------------------------------------- state by parameter name

def named_state(opt, params: dict[str, torch.nn.Parameter]) -> dict[str, dict]:
    """``opt``'s per-parameter state keyed by parameter name (not torch's integer index).

    ``params`` maps names to the parameters ``opt`` updates. A checkpoint keyed this way loads into
    another stage layout, another plan or another number of replicas: whoever holds a parameter
    takes its state. Values are tensors, or Python numbers for optimizers that keep some (Adafactor's
    ``step``); ``None`` entries (no momentum yet) are left out.
    """
    names = {id(p): n for n, p in params.items()}
    out: dict[str, dict] = {}
    for p, state in getattr(opt, "state", {}).items():
        n = names.get(id(p))
        if n is not None and state:
            out[n] = {k: v for k, v in state.items() if v is not None}
    return out


def load_named_state(opt, params: dict[str, torch.nn.Parameter], state: dict[str, dict], optimizer: str) -> None:
    """Give ``opt`` (an ``optimizer``) the per-parameter state ``state`` (from :func:`named_state`).

    Only the keys ``optimizer`` keeps (:data:`STATE_KEYS`) are taken, so a change allowed by
    :func:`resume_change` (momentum to SGD: the buffers are dropped) loads cleanly. The
    hyperparameters (lr, betas, weight decay) stay those ``opt`` was built with: the command line's,
    not the checkpoint's. Parameters without saved state start afresh, as on a first step.
    """
    if not params or not hasattr(opt, "load_state_dict") or isinstance(opt, _NoOp):
        return
    keep = STATE_KEYS.get(optimizer, ())
    index: dict[int, int] = {}
    for group in opt.param_groups:
        for p in group["params"]:
            index[id(p)] = len(index)
    sd = opt.state_dict()
    by_index = {}
    for n, p in params.items():
        # A copy per optimizer: torch keeps the tensors it is given, and two local holders of a
        # tied weight must not step one shared momentum buffer twice.
        s = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.get(n, {}).items() if k in keep}
        if s and id(p) in index:
            by_index[index[id(p)]] = s
    # torch casts each value to its parameter's dtype and device (a step counter stays where
    # the optimizer keeps it); param_groups are the current ones, so no hyperparameter changes.
    opt.load_state_dict({"state": by_index, "param_groups": sd["param_groups"]})


def resume_change(old: str, new: str) -> str | None:
    """Why an ``new`` optimizer cannot continue from ``old``'s checkpointed state, or None if it can.

    Allowed: the same optimizer; Adam and AdamW (the same moments); SGD to momentum (the buffer
    starts at zero, as on a first step); momentum to SGD (the buffers are dropped).
    """
    if old == new or {old, new} == {"adam", "adamw"} or {old, new} == {"sgd", "momentum"}:
        return None
    kept = ", ".join(STATE_KEYS.get(old, ())) or "no state"
    return (f"the checkpoint was trained with --optimizer {old}, whose state ({kept}) means nothing to {new}")


def set_position(opt, sched, cfg: OptimConfig, updates: int) -> None:
    """Put the learning-rate schedule after ``updates`` updates, with ``cfg``'s base lr.

    The schedule is a function of the update count (:func:`lr_factor`), so a resumed run takes
    the lr the command line gives (not the checkpoint's) at the position the checkpoint reached.
    """
    groups = getattr(opt, "param_groups", None) or []
    factor = lr_factor(updates, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.steps) \
        if sched is not None else 1.0
    for g in groups:
        g["lr"] = cfg.lr * factor
        if "initial_lr" in g:
            g["initial_lr"] = cfg.lr
    if sched is not None:
        sched.base_lrs = [cfg.lr for _ in groups]
        sched.last_epoch = updates
        sched._last_lr = [g["lr"] for g in groups]
