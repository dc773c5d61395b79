"""Small synthetic networks that exercise graph shapes the real models lack or hide.

* ``mlp``: a plain chain, the simplest pipeline.
* ``skipnet``: long skip connections (U-Net style: layer i feeds layer N-1-i) and an
  input embedding reused, transposed, as the output projection, so that partitions
  must pass activations across several stages and share one weight.
* ``encdec``: a two-stack encoder-decoder whose encoder output feeds every decoder layer.

Each ``forward`` returns ``(loss, output)`` so that the loss is the first output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .base import BuiltModel, ModelOptions, ZooEntry, ZooError
from .common import assemble, input_generator, refuse_attention, resolve_options, seeded


# --------------------------------------------------------------------------- mlp


class MLPBlock(nn.Module):
    """Linear followed by GELU."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.linear(x))


class MLP(nn.Module):
    """A chain of :class:`MLPBlock` and a classifier trained with cross-entropy."""

    def __init__(self, d_in: int = 32, d_hidden: int = 128, depth: int = 4, classes: int = 10):
        super().__init__()
        widths = [d_in] + [d_hidden] * depth
        self.blocks = nn.ModuleList(MLPBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(d_hidden, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits, target), logits


# --------------------------------------------------------------------------- skipnet


class SkipBlock(nn.Module):
    """Pre-norm residual feed-forward block."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SkipNet(nn.Module):
    """Token model with long skips and a tied output projection.

    The output of block ``i`` (for ``i < depth // 2``) is added to the input of block
    ``depth - 1 - i``; logits are ``h @ embed.weight.T``.
    """

    def __init__(self, vocab: int = 1000, d: int = 64, depth: int = 6):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        # nn.Embedding's N(0, 1) init would give logits of variance d through the tied
        # projection; d**-0.5 keeps them near unit scale (initial loss ~ log(vocab)).
        nn.init.normal_(self.embed.weight, std=d**-0.5)
        self.blocks = nn.ModuleList(SkipBlock(d) for _ in range(depth))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        depth = len(self.blocks)
        h = self.embed(ids)
        skips = []
        for i, block in enumerate(self.blocks):
            if i >= depth - depth // 2:
                h = h + skips[depth - 1 - i]
            h = block(h)
            if i < depth // 2:
                skips.append(h)
        logits = self.norm(h) @ self.embed.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()), logits


# --------------------------------------------------------------------------- encdec


class EncDec(nn.Module):
    """A small Transformer encoder-decoder over token ids (batch first).

    Source and target share the token embedding; positions are learned. The decoder
    is causally masked and reads the encoder output in every layer.
    """

    def __init__(self, vocab: int = 1000, d: int = 64, heads: int = 4, d_ff: int = 128,
                 layers: int = 2, max_len: int = 512, dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        kw = dict(d_model=d, nhead=heads, dim_feedforward=d_ff, dropout=dropout, batch_first=True)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(**kw) for _ in range(layers))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(**kw) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory = self._embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        t = tgt.shape[1]
        # Boolean mask (True = blocked) works for every parameter dtype.
        causal = torch.ones(t, t, dtype=torch.bool, device=tgt.device).triu(1)
        h = self._embed(tgt)
        for layer in self.decoder:
            h = layer(h, memory, tgt_mask=causal)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


# --------------------------------------------------------------------------- zoo


@dataclass(frozen=True)
class SyntheticSpec:
    """A synthetic zoo entry: how to construct the net and its example inputs."""

    entry: ZooEntry
    lengths: tuple[str, ...]
    basic_blocks: tuple[str, ...]
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[ModelOptions], tuple[tuple, dict]]  # float32 CPU inputs


def _mlp_inputs(o: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(o.seed)
    x = torch.randn(o.batch_size, 32, generator=gen)
    return (x, torch.randint(0, 10, (o.batch_size,), generator=gen)), {}


def _skipnet_inputs(o: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(o.seed)
    ids = torch.randint(0, 1000, (o.batch_size, o.seq_len), generator=gen)
    return (ids, torch.randint(0, 1000, (o.batch_size, o.seq_len), generator=gen)), {}


def _encdec_inputs(o: ModelOptions) -> tuple[tuple, dict]:
    gen = input_generator(o.seed)
    src = torch.randint(0, 1000, (o.batch_size, o.encoder_len), generator=gen)
    labels = torch.randint(0, 1000, (o.batch_size, o.decoder_len), generator=gen)
    # Teacher forcing: the decoder reads the labels shifted right behind a start id 0.
    tgt = torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)
    return (src, tgt, labels), {}


SPECS: tuple[SyntheticSpec, ...] = (
    SyntheticSpec(
        entry=ZooEntry("mlp", "synthetic",
                       "MLP: 4 Linear+GELU blocks (32->128->...->128) and a 10-way classifier, "
                       "cross-entropy; inputs (x[batch, 32], target[batch])",
                       55_050, ModelOptions(batch_size=8)),
        lengths=(),
        basic_blocks=("MLPBlock",),
        make_model=MLP,
        make_inputs=_mlp_inputs,
    ),
    SyntheticSpec(
        entry=ZooEntry("skipnet", "synthetic",
                       "SkipNet: 6 residual blocks (d=64) with long skips (block i feeds block "
                       "5-i), embedding reused transposed as output projection, vocab 1000",
                       263_424, ModelOptions(batch_size=4, seq_len=32)),
        lengths=("seq_len",),
        basic_blocks=("SkipBlock",),
        make_model=SkipNet,
        make_inputs=_skipnet_inputs,
    ),
    SyntheticSpec(
        entry=ZooEntry("encdec", "synthetic",
                       "EncDec: 2 nn.TransformerEncoderLayer + 2 nn.TransformerDecoderLayer "
                       "(d=64, 4 heads, ff 128), vocab 1000; lengths via encoder_len/decoder_len",
                       329_192, ModelOptions(batch_size=4, encoder_len=32, decoder_len=16)),
        lengths=("encoder_len", "decoder_len"),
        basic_blocks=("TransformerEncoderLayer", "TransformerDecoderLayer"),
        make_model=EncDec,
        make_inputs=_encdec_inputs,
    ),
)

_LENGTH_NOTES = {
    "mlp": "its inputs are flat feature vectors",
    "encdec": "an encoder-decoder; use encoder_len and decoder_len",
}
_MAX_POSITIONS = 512  # EncDec's learned position table


def build_synthetic(spec: SyntheticSpec, options: ModelOptions) -> BuiltModel:
    """Build a synthetic net; see :func:`ftcompile.models.build_model`."""
    entry = spec.entry
    if options.pretrained is not None:
        raise ZooError(f"{entry.name} is synthetic: pretrained checkpoints apply to HuggingFace models only")
    refuse_attention(entry.name, options, "it is a synthetic net without attention layers")
    resolved = resolve_options(entry.name, options, entry.default_options, spec.lengths,
                               entry.approx_parameters, _LENGTH_NOTES.get(entry.name, ""))
    for field in ("encoder_len", "decoder_len"):
        value = getattr(resolved, field)
        if value is not None and value > _MAX_POSITIONS:
            raise ZooError(f"{entry.name}: {field}={value} exceeds the model's maximum of {_MAX_POSITIONS}")
    with seeded(resolved.seed, resolved.device), torch.device(resolved.device):
        model = spec.make_model()
    return assemble(entry.name, model, resolved, spec.basic_blocks,
                    lambda: spec.make_inputs(resolved))


def synthetic_entries() -> list[tuple[ZooEntry, Callable[[ModelOptions], BuiltModel]]]:
    """Zoo entries of the synthetic nets, each with its builder."""
    return [(s.entry, lambda opts, s=s: build_synthetic(s, opts)) for s in SPECS]
