"""The papers' small CNNs/MLPs (FedAU/FedACS CNNs, FedAST's LeNet-5, CNN and MLP), as plain ``nn.Module``s.

Every model returns logits (the FedAU paper mentions a softmax output; use ``F.cross_entropy`` on the logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .registry import register

__all__ = ["FedAUCNN", "LeNet5", "AcarCNN", "MLP"]


class FedAUCNN(nn.Module):
    """FedAU / FedACS CNN (FedAU paper §4.4, FedACS paper Table 3).

    Trunk: ``Conv(in->32, k3, s1, p1)-ReLU-MaxPool2-Conv(32->32, k3, p1)-ReLU-MaxPool2-Flatten`` (2048 features for
    32x32 inputs), then for each hidden width ``h``: ``[Dropout(p)]-Linear(h)-ReLU``, then
    ``[Dropout(p)]-Linear(num_classes)``. Kaiming-normal (ReLU) weights and zero biases for the convs and hidden
    linears; the last linear keeps PyTorch's default init (IBM/fedau code).

    Input ``[B, in_channels, input_size, input_size]``, output logits ``[B, num_classes]``.

    Args:
        num_classes: outputs.
        in_channels: input channels.
        hidden: hidden linear widths: ``(256, 64)`` CIFAR-10, ``(128,)`` SVHN, ``(512, 256)`` CIFAR-100/CINIC-10.
        dropout: dropout probability before each linear layer (0.2 for CIFAR-100/CINIC-10, else 0).
        input_size: spatial size of the (square) input; the flatten size is ``32 * (input_size // 4) ** 2``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        hidden: Sequence[int] = (256, 64),
        dropout: float = 0.0,
        input_size: int = 32,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        layers: list[nn.Module] = []
        width = 32 * (input_size // 4) ** 2
        for h in hidden:
            if dropout:
                layers.append(nn.Dropout(dropout))
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(width, num_classes))
        self.classifier = nn.Sequential(*layers)
        last = layers[-1]
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)) and m is not last:
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class LeNet5(nn.Module):
    """LeNet-5 as in the FedAST paper (Fashion-MNIST, §4.1).

    ``Conv(in->6, k5)-ReLU-MaxPool2-Conv(6->16, k5)-ReLU-MaxPool2-Flatten(256)-Linear(120)-ReLU-Linear(84)-ReLU
    -Linear(num_classes)``, the output being logits. (The FedAST authors' code also puts a ReLU on the logits; that
    clips every negative logit to 0, so a class whose logit goes negative for all inputs stops receiving gradient
    from its own examples. It is not reproduced here.)

    Input ``[B, in_channels, 28, 28]``, output ``[B, num_classes]``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class AcarCNN(nn.Module):
    """CIFAR-10 CNN of Acar et al. (2021) used by FedAST (paper §4.1).

    ``Conv(in->64, k5)-ReLU-MaxPool2-Conv(64->64, k5)-ReLU-MaxPool2-Flatten(1600)-Linear(384)-ReLU-Linear(192)-ReLU
    -Linear(num_classes)``. Input ``[B, in_channels, 32, 32]``, output ``[B, num_classes]``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(64 * 5 * 5, 384), nn.ReLU(), nn.Linear(384, 192), nn.ReLU(), nn.Linear(192, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Fully connected ReLU network on flattened inputs (FedAST's MNIST MLP: 784-200-200-10).

    Input ``[B, ...]`` with ``prod(...) == in_features``, output ``[B, num_classes]``.
    """

    def __init__(self, in_features: int = 784, hidden: Sequence[int] = (200, 200), num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(torch.flatten(x, 1))


@register("fedau_cnn_cifar10")
def fedau_cnn_cifar10(num_classes: int = 10, in_channels: int = 3, **kwargs) -> FedAUCNN:
    """FedAU/FedACS CIFAR-10 CNN: 2048-256-64-10 head, 551,786 parameters."""
    return FedAUCNN(num_classes=num_classes, in_channels=in_channels, hidden=(256, 64), **kwargs)


@register("fedau_cnn_svhn")
def fedau_cnn_svhn(num_classes: int = 10, in_channels: int = 3, **kwargs) -> FedAUCNN:
    """FedAU SVHN CNN: 2048-128-10 head, 273,706 parameters."""
    return FedAUCNN(num_classes=num_classes, in_channels=in_channels, hidden=(128,), **kwargs)


@register("fedau_cnn_cifar100")
def fedau_cnn_cifar100(num_classes: int = 100, in_channels: int = 3, **kwargs) -> FedAUCNN:
    """FedAU CIFAR-100 CNN: dropout 0.2 before each of 2048-512-256-100, 1,216,260 parameters."""
    kwargs.setdefault("dropout", 0.2)
    return FedAUCNN(num_classes=num_classes, in_channels=in_channels, hidden=(512, 256), **kwargs)


@register("fedau_cnn_cinic10")
def fedau_cnn_cinic10(num_classes: int = 10, in_channels: int = 3, **kwargs) -> FedAUCNN:
    """FedAU/FedACS CINIC-10 CNN: as CIFAR-100 with 10 outputs, 1,193,130 parameters."""
    kwargs.setdefault("dropout", 0.2)
    return FedAUCNN(num_classes=num_classes, in_channels=in_channels, hidden=(512, 256), **kwargs)


@register("lenet5_fmnist")
def lenet5_fmnist(num_classes: int = 10, in_channels: int = 1, **kwargs) -> LeNet5:
    """FedAST Fashion-MNIST LeNet-5 (logits out), 44,426 parameters."""
    return LeNet5(num_classes=num_classes, in_channels=in_channels, **kwargs)


@register("fedast_cnn_cifar10")
def fedast_cnn_cifar10(num_classes: int = 10, in_channels: int = 3) -> AcarCNN:
    """FedAST CIFAR-10 CNN (Acar et al. 2021): 1600-384-192-10 head."""
    return AcarCNN(num_classes=num_classes, in_channels=in_channels)


@register("fedast_mlp_mnist")
def fedast_mlp_mnist(num_classes: int = 10, in_features: int = 784, **kwargs) -> MLP:
    """FedAST MNIST MLP 784-200-200-10."""
    return MLP(in_features=in_features, num_classes=num_classes, **kwargs)
