"""Early exits on any timm backbone, built with timm's public ``features_only`` API.

``EarlyExitNet.from_timm(name, exits=...)`` (same as :func:`early_exit_timm`) creates
``timm.create_model(name, features_only=True, out_indices=exits, pretrained=..., in_chans=...)`` and puts one
:class:`~lightning_fedhet.model_zoo.early_exit.ExitHead` (global avg-pool + linear) on each requested feature stage.

Two cases, depending on the feature wrapper timm returns for the model:

* **Sequential wrappers** (``FeatureListNet``, used by ResNets, ConvNeXts, EfficientNets, ... — an
  ``nn.ModuleDict`` of the model's top-level modules with a ``return_layers`` map, already cut after the last
  requested stage): its modules become the :class:`EarlyExitNet` blocks, one per module, and exit ``k`` sits after
  the module that produces stage ``exits[k-1]``. ``forward(x, upto=e)`` and ``truncate(e)`` then run and hold only
  the modules up to stage ``exits[e-1]``, exactly like the ResNet-18 builder.
* **Other wrappers** (``FeatureGetterNet`` for ViTs and other ``forward_intermediates`` models,
  ``FeatureHookNet``): the network cannot be stopped early from outside. The whole wrapper is one block that returns
  all requested stages (timm prunes it after the last requested stage); head ``k`` reads stage ``k``.
  ``truncate(e)`` still returns a model with exits ``1..e`` only (same parameters, shared), but it holds and
  computes the whole feature extractor, and ``exit_flops``/``exit_params`` charge the whole extractor to every exit.
"""

from __future__ import annotations

from collections.abc import Sequence

from .early_exit import EarlyExitNet
from .registry import register

__all__ = ["early_exit_timm"]


def early_exit_timm(
    name: str,
    exits: Sequence[int] | None = None,
    num_classes: int = 10,
    pretrained: bool = False,
    in_chans: int = 3,
    **timm_kwargs,
) -> EarlyExitNet:
    """An :class:`EarlyExitNet` with one exit per requested timm feature stage: :meth:`EarlyExitNet.from_timm`."""
    return EarlyExitNet.from_timm(
        name, exits=exits, num_classes=num_classes, pretrained=pretrained, in_chans=in_chans, **timm_kwargs
    )


@register("timm_early_exit")
def timm_early_exit(
    backbone: str = "resnet18", exits: Sequence[int] | None = (1, 2, 4), num_classes: int = 10, **kwargs
) -> EarlyExitNet:
    """Registry entry for :func:`early_exit_timm` (``create("timm_early_exit", backbone="resnet18", exits=...)``)."""
    return early_exit_timm(backbone, exits=exits, num_classes=num_classes, **kwargs)
