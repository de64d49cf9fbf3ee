"""ResNet-50 (no torchvision dependency).

Source: He et al., "Deep Residual Learning for Image Recognition" (2015), in
the torchvision ``resnet50`` formulation (ResNet v1.5: the stride of a
downsampling Bottleneck sits on the 3x3 conv).  The model appears in the
GPipe / PipeDream / torchgpipe benchmarks and in PyTorch's model-parallel
tutorial (which splits torchvision's ResNet-50 over two devices).

Structure: stem ``conv1`` (7x7/2) -> ``bn1`` -> ``relu`` -> ``maxpool`` (3x3/2),
``layer1..layer4`` = ``nn.Sequential`` of Bottleneck blocks (expansion 4,
[3, 4, 6, 3] blocks, base widths w, 2w, 4w, 8w), ``avgpool`` (adaptive 1x1),
``fc``.  With width 64 / 1000 classes the parameter count is exactly
torchvision's 25,557,032.

Config keys: width (64 for the real net), num_classes, image_size, norm
("batch" = BatchNorm2d as in the paper; "group" = GroupNorm(min(32, C)
groups), same parameter count, no batch statistics -- useful when microbatch
results must match the full batch exactly), seed.

Note: with BatchNorm in training mode, microbatched forward passes are *not*
equivalent to a full-batch pass (per-microbatch statistics).

Sizes:

* ``tiny``: width 8, 10 classes, 32x32 images (376,722 params).
* ``imagenet``: width 64, 1000 classes, 224x224 (25,557,032 params).

Data: ``make_batch`` = random normal images (B, 3, H, W) + random labels (B,).
``train_batches`` = learnable synthetic data: each class has a fixed random
mean colour (per channel) and spatial pattern; images are that plus noise.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(32, channels), channels)
    raise ValueError(f"resnet50: unknown norm {kind!r} (use 'batch' or 'group')")


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None, norm: str = "batch"
    ):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = _norm(norm, planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = _norm(norm, planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = _norm(norm, planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:  # module attribute: static under fx
            identity = self.downsample(x)
        out = out + identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000, norm: str = "batch"):
        super().__init__()
        self.norm = norm
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = _norm(norm, width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                _norm(self.norm, planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample, self.norm)]
        self.inplanes = planes * Bottleneck.expansion
        for _ in range(1, blocks):
            layers.append(Bottleneck(self.inplanes, planes, norm=self.norm))
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


SIZES: dict[str, dict] = {
    "tiny": dict(width=8, num_classes=10, image_size=32),
    "imagenet": dict(width=64, num_classes=1000, image_size=224),
}


def build_model(width: int = 64, num_classes: int = 1000, norm: str = "batch", **_ignored) -> nn.Module:
    return ResNet((3, 4, 6, 3), width=width, num_classes=num_classes, norm=norm)


def make_batch(
    batch_size: int, num_classes: int = 1000, image_size: int = 224, **_ignored
) -> tuple[tuple, torch.Tensor]:
    x = torch.randn(batch_size, 3, image_size, image_size)
    y = torch.randint(0, num_classes, (batch_size,))
    return (x,), y


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def train_batches(
    batch_size: int, num_classes: int = 1000, image_size: int = 224, seed: int = 0, noise: float = 1.0, **_ignored
) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Infinite deterministic stream of class-conditional synthetic images."""
    g = torch.Generator().manual_seed(int(seed))
    colours = torch.randn(num_classes, 3, 1, 1, generator=g)
    patterns = torch.randn(num_classes, 1, 8, 8, generator=g)
    while True:
        y = torch.randint(0, num_classes, (batch_size,), generator=g)
        pat = F.interpolate(patterns[y], size=(image_size, image_size), mode="nearest")
        x = colours[y] + 0.5 * pat + noise * torch.randn(batch_size, 3, image_size, image_size, generator=g)
        yield (x,), y
