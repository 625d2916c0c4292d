"""Model zoo: plain ``nn.Module``s, built by name with :func:`create` (timm style)."""

from .registry import create, list_models, register
from .small import LogisticRegression, MnistCNN

__all__ = ["create", "list_models", "register", "MnistCNN", "LogisticRegression"]
