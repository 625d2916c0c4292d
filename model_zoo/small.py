"""The papers' small models, as plain ``nn.Module``s."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .registry import register


class MnistCNN(nn.Module):
    """Two 3x3 conv layers + two linear layers for 28x28 grey images (the FedStale code's ``MnistCNN``).

    conv(1->32, 3, pad 1)-ReLU-maxpool2 -> conv(32->64, 3, pad 1)-ReLU-maxpool2 -> FC(64*7*7->128)-ReLU
    -> FC(128->num_classes). Input ``[B, in_channels, 28, 28]``, output logits ``[B, num_classes]``.

    Args:
        num_classes: output classes.
        in_channels: input channels.
        width: channels of the first conv (the second has ``2*width``); 32 as in the FedStale code.
        hidden: width of the hidden linear layer.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * 7 * 7, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class LogisticRegression(nn.Module):
    """Multinomial logistic regression ``x -> W x + b`` on flattened inputs (synthetic LEAF, MNIST in ch.2).

    Input ``[B, ...]`` with ``prod(...) == in_features``; output logits ``[B, num_classes]``.
    The ridge penalty of the thesis belongs in the optimizer's ``weight_decay``.
    """

    def __init__(self, in_features: int = 60, num_classes: int = 10) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(torch.flatten(x, 1))


@register("fmnist_cnn")
@register("mnist_cnn")
def mnist_cnn(num_classes: int = 10, in_channels: int = 1, **kwargs) -> MnistCNN:
    return MnistCNN(num_classes=num_classes, in_channels=in_channels, **kwargs)


@register("logistic_regression")
def logistic_regression(in_features: int = 60, num_classes: int = 10) -> LogisticRegression:
    return LogisticRegression(in_features=in_features, num_classes=num_classes)
