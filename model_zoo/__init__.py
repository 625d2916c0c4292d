"""Model zoo: plain ``nn.Module``s, built by name with :func:`create` (timm style).

Registered names (``list_models()``): ``mnist_cnn``/``fmnist_cnn``, ``logistic_regression``, the papers' small
models (``fedau_cnn_cifar10``, ``fedau_cnn_svhn``, ``fedau_cnn_cifar100``, ``fedau_cnn_cinic10``, ``lenet5_fmnist``,
``fedast_cnn_cifar10``, ``fedast_mlp_mnist``), the Fed-CIS early-exit ResNet-18s (``ee_resnet18``,
``ee_resnet18_cifar10`` exits after blocks 3/9/17, ``ee_resnet18_cifar100`` 9/13/17, ``ee_resnet18_fmnist``
1-channel 3/9/17) and ``timm_early_exit`` (exits on a timm backbone).
"""

from .early_exit import RESNET18_NUM_BLOCKS, EarlyExitNet, ExitHead, early_exit_resnet18
from .registry import create, list_models, register
from .small import LogisticRegression, MnistCNN
from .small_cnns import MLP, AcarCNN, FedAUCNN, LeNet5
from .timm_exits import early_exit_timm

__all__ = [
    "create",
    "list_models",
    "register",
    "MnistCNN",
    "LogisticRegression",
    "FedAUCNN",
    "LeNet5",
    "AcarCNN",
    "MLP",
    "EarlyExitNet",
    "ExitHead",
    "early_exit_resnet18",
    "early_exit_timm",
    "RESNET18_NUM_BLOCKS",
]
