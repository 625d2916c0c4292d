"""A timm-style registry: ``create(name, **kwargs)`` builds a plain ``nn.Module``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register(name: str) -> Callable:
    """Decorator adding a model factory to the registry under ``name``."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _MODELS:
            raise ValueError(f"model {name!r} is already registered")
        _MODELS[name] = fn
        return fn

    return wrap


def create(name: str, **kwargs) -> nn.Module:
    """Build the registered model ``name`` with ``kwargs`` (e.g. ``create("fmnist_cnn", num_classes=10)``)."""
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; available: {sorted(_MODELS)}")
    return _MODELS[name](**kwargs)


def list_models() -> list[str]:
    return sorted(_MODELS)
