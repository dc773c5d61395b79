"""What generated stage modules call besides ``torch``: keyed randomness, tensor declarations.

Random operators (dropout above all) draw from a generator seeded by the pair
``(seed, key)``: ``seed`` names the micro-batch (the runtime derives it from the
run's seed and the micro-batch index) and ``key`` names the operator (its
position among the graph's random operators, fixed at code generation). A
mask is therefore a pure function of *which* micro-batch and *which* operator,
never of the order in which stages happen to run, so

* a stage that recomputes its forward in backward draws the same masks as the
  forward did (FTPipe §4.2.1 keeps "the seed of the random number generator"
  at the checkpoint; here the seed is the micro-batch's name);
* a Mixed-pipe plan that runs stages in another order than the original model,
  or on other processes, draws the same masks as the original model does under
  :func:`keyed_random_mode` (which ``ftcompile verify`` uses).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, key: int) -> int:
    """A 63-bit generator seed from ``(seed, key)``: splitmix64 of both, so nearby pairs differ widely."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + (int(key) + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def generator(seed: int, key: int, device: torch.device | str) -> torch.Generator:
    """A fresh generator on ``device`` seeded by ``(seed, key)``."""
    g = torch.Generator(device=device)
    g.manual_seed(mix_seed(seed, key))
    return g


def _noise(x: torch.Tensor, keep: float, seed: int, key: int) -> torch.Tensor:
    # Same recipe as ATen's CPU dropout (bernoulli_ then divide), with our generator.
    return torch.empty_like(x).bernoulli_(keep, generator=generator(seed, key, x.device))


def dropout(x: torch.Tensor, p: float, train: bool, seed: int, key: int) -> torch.Tensor:
    """``aten.dropout`` with a keyed mask: ``x * mask / (1 - p)``, identity when not training."""
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * torch.zeros_like(x)
    return x * _noise(x, 1.0 - p, seed, key).div_(1.0 - p)


def native_dropout(x: torch.Tensor, p: float, train: bool | None, seed: int, key: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` (what functionalized graphs hold): ``(output, boolean mask)``."""
    if train is False or p == 0.0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    if p == 1.0:
        return x * torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    noise = _noise(x, 1.0 - p, seed, key)
    return x * noise.div(1.0 - p), noise.bool()


def feature_dropout(x: torch.Tensor, p: float, train: bool, seed: int, key: int) -> torch.Tensor:
    """``aten.feature_dropout`` (``F.dropout1d/2d/3d``): one keyed draw per (sample, channel)."""
    if not train or p == 0.0:
        return x
    if p == 1.0:
        return x * torch.zeros_like(x)
    shape = list(x.shape[:2]) + [1] * (x.dim() - 2)
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(
        1.0 - p, generator=generator(seed, key, x.device))
    return x * noise.div_(1.0 - p)


def seeded_call(fn: Callable, seed: int, key: int, *args: Any, **kwargs: Any) -> Any:
    """Call a random operator that takes no generator under a global RNG forked and seeded by ``(seed, key)``."""
    devices = [d.index or 0 for d in _devices(args, kwargs) if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(mix_seed(seed, key))
        return fn(*args, **kwargs)


def _devices(args, kwargs) -> set:
    out = set()
    stack = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            out.add(a.device)
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
    return out


def copy_into(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)`` out of place: ``src`` in ``dst``'s dtype and device, broadcast to its shape.

    The tracer's twin of ``aten.copy_`` (``ftcompile.functionalize.out_of_place``): ``aten.copy``
    computes the same but has no derivative, so gradients would not reach ``src``. Here they do,
    and none reaches ``dst``, whose values are overwritten."""
    # non_blocking is not passed on: the clone reads the copy at once, and a device-to-host copy
    # that had not finished would be read half done.
    return src.to(device=dst.device, dtype=dst.dtype).expand_as(dst).clone()


def zeros_strided(size, stride, **kwargs) -> torch.Tensor:
    """``torch.empty_strided`` filled with zeros: the tracer's twin of ``aten.empty_strided``
    (``ftcompile.trace._ZEROED_TARGETS``), so that a recomputed stage sends the bits it sent the
    first time where a model reads memory it never wrote."""
    return torch.empty_strided(size, stride, **kwargs).zero_()


def new_zeros_strided(self: torch.Tensor, size, stride, **kwargs) -> torch.Tensor:
    """``self.new_empty_strided`` filled with zeros (see :func:`zeros_strided`)."""
    return self.new_empty_strided(size, stride, **kwargs).zero_()


def index(x: Any, *idx: Any) -> Any:
    """``x[idx]`` with a tuple index; the string ``"..."`` stands for ``Ellipsis`` (torch.fx graphs)."""
    return x[tuple(Ellipsis if (isinstance(i, str) and i == "...") else i for i in idx)]


# --------------------------------------------------------------------------- the eager side

_DROPOUTS = {F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d}
_SDPA = F.scaled_dot_product_attention

#: Keys of random operators other than dropout (``torch.rand`` in forward, ViT-MAE's masking
#: noise, LSTM dropout between layers) start here, apart from the dropout sequence 0, 1, ...
OTHER_RANDOM_KEYS = 1 << 20

# What an eager model calls to draw random numbers besides dropout; each call gets the
# next "other" key, as the traced graph's random operators do in call order.
_OTHER_RANDOM = {
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.bernoulli, torch.normal, torch.multinomial, torch.randperm, torch.poisson,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.bernoulli,
    torch.Tensor.exponential_, torch.Tensor.random_, torch.Tensor.geometric_, torch.Tensor.cauchy_,
    torch.Tensor.log_normal_, torch.Tensor.multinomial,
}
_RNNS = {getattr(torch._VF, n) for n in ("lstm", "gru", "rnn_tanh", "rnn_relu") if hasattr(torch._VF, n)}


def _rnn_draws(args: tuple) -> bool:
    """Whether a ``_VF.lstm/gru/rnn_*`` call draws dropout masks (training, dropout > 0, several layers)."""
    # (input, hx, params, has_biases, num_layers, dropout, train, ...) or, for packed
    # sequences, (data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, ...)
    packed = len(args) > 3 and isinstance(args[3], (list, tuple)) and not isinstance(args[2], (list, tuple))
    off = 5 if packed else 4
    try:
        layers, p, train = args[off], args[off + 1], args[off + 2]
    except IndexError:
        return False
    return bool(train) and float(p) > 0 and int(layers) > 1


class _KeyedRandomMode(torch.overrides.TorchFunctionMode):
    """Gives the n-th random call of an eager model key n, as generated code does."""

    def __init__(self, seed: int, enabled: bool):
        super().__init__()
        self.seed, self.enabled, self.calls = seed, enabled, 0
        self.other_calls = 0
        self.depth = 0
        self.lock = threading.Lock()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth == 0 and func in _DROPOUTS:
            key = self._next()
            x = args[0] if args else kwargs["input"]
            p = _arg(args, kwargs, 1, "p", 0.5)
            training = _arg(args, kwargs, 2, "training", True)
            if not self.enabled:
                return x
            if func is F.dropout:
                return dropout(x, p, training, self.seed, key)
            if func in (F.dropout1d, F.dropout2d, F.dropout3d):
                # As torch does: unbatched input to dropout1d/3d gets a batch dimension first
                # (dropout2d treats a 3-D input as batched 1-D).
                if (func is F.dropout1d and x.dim() == 2) or (func is F.dropout3d and x.dim() == 4):
                    return feature_dropout(x.unsqueeze(0), p, training, self.seed, key).squeeze(0)
                return feature_dropout(x, p, training, self.seed, key)
            return self._call(seeded_call, func, self.seed, key, *args, **kwargs)
        if (self.depth == 0 and func is _SDPA
                and float(_arg(args, kwargs, 4, "dropout_p", 0.0)) > 0.0):
            key = self._next()
            if not self.enabled:
                if len(args) > 4:
                    args = (*args[:4], 0.0, *args[5:])
                else:
                    kwargs = {**kwargs, "dropout_p": 0.0}
                return self._call(func, *args, **kwargs)
            return self._call(seeded_call, func, self.seed, key, *args, **kwargs)
        if self.depth == 0 and (func in _OTHER_RANDOM or (func in _RNNS and _rnn_draws(args))):
            # Not dropout: drawn whatever ``enabled`` says (it is part of what the model computes).
            with self.lock:
                key = OTHER_RANDOM_KEYS + self.other_calls
                self.other_calls += 1
            return self._call(seeded_call, func, self.seed, key, *args, **kwargs)
        if inspect.isfunction(func) and getattr(func, "__module__", "") == "torch.nn.functional":
            # A composite (F.multi_head_attention_forward) calls dropout and attention
            # through torch.nn.functional's globals while this mode is paused: route
            # those to the keyed versions too, in call order, as the traced graph has them.
            with self._functional_patched():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def _functional_patched(self):
        saved = {}
        for fn in (*_DROPOUTS, _SDPA):
            name = fn.__name__
            if getattr(F, name, None) is fn:
                saved[name] = fn
                setattr(F, name, functools.partial(self._reenter, fn))
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(F, name, fn)

    def _reenter(self, fn, *args, **kwargs):
        return self.__torch_function__(fn, (), args, kwargs)

    def _next(self) -> int:
        with self.lock:
            self.calls += 1
            return self.calls - 1

    def _call(self, fn, *args, **kwargs):
        self.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            self.depth -= 1


def _arg(args, kwargs, pos: int, name: str, default):
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


@contextlib.contextmanager
def keyed_random_mode(seed: int, *, enabled: bool = True) -> Iterator[_KeyedRandomMode]:
    """Run an eager model with the keyed masks generated code uses for micro-batch ``seed``.

    The n-th dropout (or attention-dropout) call gets key n, which is the key code
    generation gives the n-th random operator of the traced graph. ``enabled=False``
    turns every such call into the identity (no dropout). The mode's ``calls``
    counts the random calls seen, to check against the graph's count.

    Other random draws (``torch.rand`` & co., in-place ``uniform_`` & co., LSTM/GRU
    dropout between layers) get keys ``OTHER_RANDOM_KEYS + n`` in call order, as their
    operators in the graph do, whatever ``enabled`` says; ``other_calls`` counts them.
    """
    mode = _KeyedRandomMode(seed, enabled)
    with mode:
        yield mode


# --------------------------------------------------------------------------- stage module support

class Container(torch.nn.Module):
    """A bare module holding parameters under their original dotted path; ``[i]`` reads child ``"i"``."""

    def __getitem__(self, index: int | str) -> torch.nn.Module:
        return self._modules[str(index)]


def declare(module: torch.nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, *,
            kind: str = "parameter", requires_grad: bool = True) -> None:
    """Create an uninitialised parameter or buffer at dotted path ``name`` under ``module``.

    The tensor lives on the ``meta`` device until the package loader gives it
    values (from the stage's weights file, or from its init recipe), so that
    building a stage module never allocates memory for weights.
    """
    *path, leaf = name.split(".")
    owner = module
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = Container()
            owner.add_module(part, child)
        owner = child
    empty = torch.empty(shape, dtype=dtype, device="meta")
    if kind == "parameter":
        owner.register_parameter(leaf, torch.nn.Parameter(empty, requires_grad=requires_grad))
    else:
        owner.register_buffer(leaf, empty, persistent=True)


def update_buffer(owner: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Make ``value`` the new content of buffer ``name`` of ``owner`` (BatchNorm running statistics).

    The buffer is rebound to the new tensor, not overwritten: the operator that
    computed the new statistics may have saved the old ones for its backward, and
    autograd refuses tensors changed in place since. Detached, and in the buffer's
    dtype: a buffer's history is not trained. Generated code calls this only when
    ``forward(..., update_buffers=True)``, the default; the runtime passes False when
    it recomputes a forward, so each micro-batch updates a buffer once.
    """
    old = owner._buffers[name]
    owner._buffers[name] = value.detach().to(dtype=old.dtype)


class StageModule(torch.nn.Module):
    """Base class of generated stages: a straight-line ``forward`` over named stage inputs.

    Class attributes set by the generated subclass:

    ``STAGE``   the stage id;
    ``INPUTS``  names of ``forward``'s tensor arguments, in order (values from other stages
                or graph inputs);
    ``OUTPUTS`` names of the returned values, in order;
    ``RANDOM``  how many random operators the stage runs (0: the ``seed`` argument is unused);
    ``BUFFER_UPDATES`` the buffers ``forward`` updates (empty: ``update_buffers`` is unused).

    ``forward(*inputs, seed=0, update_buffers=True)``: ``seed`` names the micro-batch
    (dropout masks are drawn from it), ``update_buffers=False`` computes the same
    outputs without writing any buffer (a recomputation in backward).
    """

    STAGE: int = -1
    INPUTS: tuple[str, ...] = ()
    OUTPUTS: tuple[str, ...] = ()
    RANDOM: int = 0
    BUFFER_UPDATES: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        # Follows the module across .to(device): where code that creates tensors
        # (arange, zeros) puts them, even in a stage with no inputs or weights.
        self.register_buffer("_anchor", torch.empty(0), persistent=False)

    def __getitem__(self, index: int | str) -> torch.nn.Module:
        return self._modules[str(index)]

    def extra_repr(self) -> str:
        return f"stage={self.STAGE}, inputs={list(self.INPUTS)}, outputs={list(self.OUTPUTS)}"
