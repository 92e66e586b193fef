"""Plain-torch models of the zoo: ``mlp`` and ``cnn``.

They return logits and are trained with ``torch.nn.functional.cross_entropy`` against int64
class labels, unlike the Hugging Face models that compute their own loss. Module paths are
meant to be read in plans: ``layers.0``, ``head``, ``blocks.1.conv1``.

Every family module of the zoo (this one and ``hf.py``) offers the same five names, which
``partita.examples.build`` calls: ``SIZES``, ``default_seq_len``, ``build_model``,
``batch_maker`` and ``loss_fn``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from partita.examples import data

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``num_layers`` hidden Linear+GELU layers of width ``hidden``, then a Linear ``head``."""

    def __init__(self, in_features: int, hidden: int, num_layers: int, num_classes: int):
        super().__init__()
        widths = [in_features] + [hidden] * num_layers
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, classes)
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class ResidualBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, plus a 1x1 conv+BN shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Sequential()  # identity: no parameters, no node in the graph
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, H, W) -> (B, C_out, H/s, W/s)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCNN(nn.Module):
    """A small ResNet: conv stem, stages of residual blocks (each stage after the first halves
    the resolution and uses the next width), global average pool, Linear ``head``."""

    def __init__(self, in_channels: int, widths: tuple[int, ...], blocks_per_stage: int, num_classes: int):
        super().__init__()
        self.stem_conv = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(widths[0])
        blocks, channels = [], widths[0]
        for stage_index, width in enumerate(widths):
            for block_index in range(blocks_per_stage):
                stride = 2 if stage_index > 0 and block_index == 0 else 1
                blocks.append(ResidualBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, classes)
        x = F.relu(self.stem_bn(self.stem_conv(x)))
        x = self.blocks(x)
        x = x.mean(dim=(2, 3))  # global average pool: (B, C)
        return self.head(x)


# ---------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MLPSize:
    """Shape of one ``mlp`` size."""

    in_features: int
    hidden: int
    num_layers: int
    num_classes: int


@dataclass(frozen=True)
class CNNSize:
    """Shape of one ``cnn`` size; inputs are ``(3, image_size, image_size)``."""

    image_size: int
    widths: tuple[int, ...]
    blocks_per_stage: int
    num_classes: int


SIZES: dict[str, dict[str, MLPSize | CNNSize]] = {
    "mlp": {
        "tiny": MLPSize(in_features=32, hidden=64, num_layers=4, num_classes=10),  # 15k params
        "small": MLPSize(in_features=256, hidden=1024, num_layers=6, num_classes=100),  # 5.6M
        # ~1.0B params: too big to train on a CPU; for planning on meta or on a GPU.
        "large": MLPSize(in_features=1024, hidden=8192, num_layers=16, num_classes=1000),
    },
    "cnn": {
        "tiny": CNNSize(image_size=16, widths=(16, 32), blocks_per_stage=1, num_classes=10),
        "small": CNNSize(image_size=32, widths=(64, 128, 256), blocks_per_stage=2, num_classes=10),
    },
}


def default_seq_len(family: str, size: str) -> int | None:
    """Plain models take no sequences: always None (a given ``seq_len`` is ignored)."""
    return None


def build_model(family: str, size: str, seq_len: int | None) -> nn.Module:
    """A freshly initialised model of one size (on the current default device)."""
    spec = SIZES[family][size]
    if isinstance(spec, MLPSize):
        return MLP(spec.in_features, spec.hidden, spec.num_layers, spec.num_classes)
    return ResNetCNN(3, spec.widths, spec.blocks_per_stage, spec.num_classes)


def batch_maker(family: str, size: str, seq_len: int | None, seed: int) -> Callable[[int, int], tuple]:
    """``(batch_size, step) -> ((x,), {}, labels)`` on the CPU: prototype-plus-noise classes."""
    spec = SIZES[family][size]
    if isinstance(spec, MLPSize):
        input_shape: tuple[int, ...] = (spec.in_features,)
    else:
        input_shape = (3, spec.image_size, spec.image_size)

    def make(batch_size: int, step: int) -> tuple:
        x, labels = data.classification_batch(seed, step, batch_size, spec.num_classes, input_shape)
        return (x,), {}, labels

    return make


def loss_fn(family: str) -> Callable:
    """Both plain families are classifiers over logits."""
    return F.cross_entropy
