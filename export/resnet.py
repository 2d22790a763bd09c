"""ResNet-50 (v1.5: stride on the 3x3 convolution), defined here, state_dict-compatible with
torchvision's ``resnet50``.

torchvision does not import beside this project's torch build, so the architecture lives
here with torchvision's module names (conv1, bn1, layer1.0.conv1, ..., layerN.0.downsample.0/1,
fc), and a torchvision state_dict loads with ``strict=True``.

Without weights the network is initialised with a fixed seed (torchvision's scheme) and its
BatchNorm running statistics are then re-estimated on real photos. Untouched, a random
50-layer network's eval-mode activations drift layer by layer and its logits barely depend
on the input, which would make every accuracy comparison downstream meaningless; with
recalibrated statistics each layer sees normalised activations and the logits differ from
image to image. The class names of such a network mean nothing: ``provenance`` says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from python_backends.files import sha256_file

LAYERS = (3, 4, 6, 3)
NUM_CLASSES = 1000
DEFAULT_SEED = 0


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, layers: tuple[int, ...] = LAYERS):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        # torchvision's initialisation; the Linear layer keeps PyTorch's default.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def random_init_provenance(seed: int) -> str:
    return f"random-init(seed={seed})+bn-recalibrated"


def load_weights(model: ResNet50, path: Path) -> None:
    """Load a torchvision-style state_dict (.pth) with strict=True."""
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]  # a training checkpoint wrapping the state_dict
    model.load_state_dict(state, strict=True)


@torch.no_grad()
def recalibrate_batchnorm(model: nn.Module, batches: Iterable[torch.Tensor]) -> int:
    """Re-estimate every BatchNorm's running mean and variance on ``batches``.

    Train mode with ``momentum=None`` makes the running statistics a plain cumulative average
    over the batches seen; the model is left in eval mode with the momenta restored. Returns
    the number of images seen.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    seen = 0
    try:
        for batch in batches:
            model(batch)
            seen += int(batch.shape[0])
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        model.eval()
    if seen == 0:
        raise ValueError("no calibration images")
    return seen


def build(
    weights: Path | None = None, seed: int = DEFAULT_SEED, calibration: Iterable[torch.Tensor] | None = None
) -> tuple[ResNet50, dict]:
    """The eval-mode model and its metadata (``provenance``: real weights or random init).

    ``calibration``: batches of preprocessed images [n, 3, 224, 224], required without weights.
    """
    if weights is not None:
        model = ResNet50()
        load_weights(model, Path(weights))
        model.eval()
        return model, {
            "provenance": "pretrained",
            "weights_file": Path(weights).name,
            "weights_sha256": sha256_file(Path(weights)),
        }
    if calibration is None:
        raise ValueError("random initialisation needs calibration batches to re-estimate BatchNorm statistics")
    torch.manual_seed(seed)
    model = ResNet50()
    seen = recalibrate_batchnorm(model, calibration)
    return model, {
        "provenance": random_init_provenance(seed),
        "seed": seed,
        "torch": torch.__version__,
        "bn_calibration_images": seen,
    }
