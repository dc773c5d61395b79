"""Plain PyTorch nets as user models (``file.py:function``): BatchNorm, in-place ops, recurrent layers.

Each function returns ``(model, args)`` or ``(model, args, kwargs)``; the model returns the
training loss first. Sizes are tiny so that tests run on a CPU in seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- ResNet (BatchNorm)

class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)), inplace=True)


class ResNet(nn.Module):
    """A ResNet-18-shaped net at toy width: stem, four stages of two basic blocks, classifier."""

    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        chans = [width, width * 2, width * 4, width * 8]
        layers, c = [], width
        for i, ch in enumerate(chans):
            layers.append(nn.Sequential(BasicBlock(c, ch, 1 if i == 0 else 2), BasicBlock(ch, ch)))
            c = ch
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x, target):
        h = self.layers(self.stem(x))
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
        return F.cross_entropy(logits, target), logits


def resnet():
    model = ResNet().train()
    return model, (torch.randn(4, 3, 16, 16, generator=_gen(1)), torch.randint(0, 10, (4,), generator=_gen(2)))


# --------------------------------------------------------------------------- MobileNetV2 (in-place ops)

class ConvBNReLU(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        self.use_res = stride == 1 and c_in == c_out
        layers = [ConvBNReLU(c_in, hidden, 1)] if expand != 1 else []
        layers += [ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2's structure (inverted residuals, ReLU6 in place) at toy width; in-place dropout head."""

    def __init__(self, classes: int = 10):
        super().__init__()
        setting = [(1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 2, 2)]
        layers = [ConvBNReLU(3, 8, stride=2)]
        c = 8
        for t, ch, n, s in setting:
            for i in range(n):
                layers.append(InvertedResidual(c, ch, s if i == 0 else 1, t))
                c = ch
        layers.append(ConvBNReLU(c, 32, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(32, classes))

    def forward(self, x, target):
        h = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        logits = self.classifier(h)
        return F.cross_entropy(logits, target), logits


def mobilenet_v2():
    model = MobileNetV2().train()
    return model, (torch.randn(4, 3, 32, 32, generator=_gen(3)), torch.randint(0, 10, (4,), generator=_gen(4)))


# --------------------------------------------------------------------------- recurrent

class Recurrent(nn.Module):
    """Token classifier: embedding, a 2-layer LSTM, a GRU, mean-pooled linear head (no dropout)."""

    def __init__(self, vocab: int = 50, d: int = 16, classes: int = 5, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True, dropout=dropout)
        self.gru = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, ids, target):
        h, _ = self.lstm(self.embed(ids))
        h, _ = self.gru(h)
        logits = self.head(h.mean(1))
        return F.cross_entropy(logits, target), logits


def lstm_gru():
    model = Recurrent().train()
    return model, (torch.randint(0, 50, (4, 12), generator=_gen(5)), torch.randint(0, 5, (4,), generator=_gen(6)))


def lstm_dropout():
    """The same with dropout between the LSTM's layers: a random operator keyed apart from dropout."""
    model = Recurrent(dropout=0.25).train()
    return model, (torch.randint(0, 50, (4, 12), generator=_gen(5)), torch.randint(0, 5, (4,), generator=_gen(6)))


# --------------------------------------------------------------------------- noise drawn in forward

class RandomMasking(nn.Module):
    """MAE-style: per example, noise from ``torch.rand`` ranks the patches and a random half is kept
    (ViTMAE draws its masking noise the same way inside forward)."""

    def __init__(self, patches: int = 8, d: int = 16, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)
        self.keep = patches // 2

    def forward(self, x, target):
        h = self.embed(x)
        noise = torch.rand(h.shape[0], h.shape[1], device=h.device)
        keep = torch.argsort(noise, dim=1)[:, :self.keep]
        h = torch.gather(h, 1, keep.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        logits = self.head(torch.tanh(self.mix(h)).mean(1))
        return F.cross_entropy(logits, target), logits


def random_masking():
    model = RandomMasking().train()
    return model, (torch.randn(4, 8, 16, generator=_gen(8)), torch.randint(0, 5, (4,), generator=_gen(9)))


# --------------------------------------------------------------------------- copy_ into a new tensor

class SliceCopy(nn.Module):
    """Fills slices of a fresh tensor with copy_ (DeepSeek-V3's attention builds its keys so): the
    gradient must reach both sources, through a dtype cast and a broadcast."""

    def __init__(self, d: int = 8, classes: int = 5):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, 1), nn.Linear(2 * d, classes)

    def forward(self, x, target):
        h = x.new_empty(x.shape[0], x.shape[1], 2 * x.shape[2])
        h[..., : x.shape[2]].copy_(self.a(x).double())             # cast back to h's dtype
        h[..., x.shape[2]:].copy_(self.b(x))                       # broadcast from width 1
        logits = self.head(torch.relu(h)).mean(1)
        return F.cross_entropy(logits, target), logits


def slice_copy():
    model = SliceCopy().train()
    return model, (torch.randn(4, 6, 8, generator=_gen(10)), torch.randint(0, 5, (4,), generator=_gen(11)))


# --------------------------------------------------------------------------- refused

class MaskedMean(nn.Module):
    """Selects the positive activations with a boolean mask: an output shape that depends on data."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return h[h > 0].mean()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = MaskedMean()

    def forward(self, x):
        return self.pool(x)


def masked():
    return Net(), (torch.randn(4, 8, generator=_gen(7)),)
