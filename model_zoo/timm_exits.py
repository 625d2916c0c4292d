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

import numbers
from collections.abc import Sequence

from torch import Tensor, nn

from .early_exit import EarlyExitNet, ExitHead
from .registry import register

__all__ = ["early_exit_timm"]


class _AllStages(nn.Module):
    """Wraps a non-sequential timm feature extractor: ``x [B, C, H, W] -> list`` of stage features."""

    def __init__(self, features: nn.Module) -> None:
        super().__init__()
        self.features = features

    def forward(self, x: Tensor) -> list[Tensor]:
        out = self.features(x)
        return list(out.values()) if isinstance(out, dict) else list(out)


def _fmt(backbone: nn.Module) -> str:
    fmt = getattr(backbone, "output_fmt", "NCHW")
    fmt = getattr(fmt, "value", fmt)
    return fmt if fmt in ("NCHW", "NHWC") else "NCHW"


def early_exit_timm(
    name: str,
    exits: Sequence[int] | None = None,
    num_classes: int = 10,
    pretrained: bool = False,
    in_chans: int = 3,
    **timm_kwargs,
) -> EarlyExitNet:
    """An :class:`EarlyExitNet` with one exit per requested timm feature stage.

    Args:
        name: a timm model name (``timm.list_models()``), e.g. ``"resnet18"``, ``"test_resnet"``.
        exits: timm feature-stage indices (``out_indices``: 0 = first tap, usually the stem at stride 2), strictly
            increasing and ``>= 0``; ``None`` = timm's default taps for ``features_only``. The deepest listed stage
            is the final exit (there is no extra full-network exit: list the last stage to get one).
        num_classes: classes of every exit head.
        pretrained: load timm's pretrained weights (needs network access or a local cache).
        in_chans: input channels.
        **timm_kwargs: passed to ``timm.create_model`` (e.g. ``drop_rate``).

    Returns:
        ``EarlyExitNet``; input ``[B, in_chans, H, W]``, output ``len(exits)`` tensors ``[B, num_classes]``.
    """
    import timm

    if exits is not None:
        ex = tuple(exits)
        if (
            not ex
            or any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ex)
            or any(i < 0 for i in ex)
            or any(a >= b for a, b in zip(ex, ex[1:]))
        ):
            raise ValueError(f"exits must be strictly increasing timm feature-stage indices >= 0, got {ex}")
        timm_kwargs["out_indices"] = tuple(int(i) for i in ex)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    try:
        backbone = timm.create_model(name, features_only=True, pretrained=pretrained, in_chans=in_chans, **timm_kwargs)
    except (IndexError, AssertionError) as err:
        if exits is None:
            raise
        full = timm.create_model(name, features_only=True, pretrained=False, in_chans=in_chans)
        n = len(full.feature_info.info)
        raise ValueError(
            f"exits must be timm feature-stage indices in [0, {n - 1}] for {name!r}, got {tuple(exits)}"
        ) from err

    info = backbone.feature_info
    channels = info.channels()
    fmt = _fmt(backbone)
    return_layers = getattr(backbone, "return_layers", None)
    if isinstance(backbone, nn.ModuleDict) and isinstance(return_layers, dict) and len(return_layers) == len(channels):
        names = list(backbone.keys())
        blocks = [backbone[n] for n in names]
        exit_blocks = sorted(names.index(n) + 1 for n in return_layers)
        heads = [ExitHead(c, num_classes, fmt=fmt) for c in channels]
    else:
        blocks = [_AllStages(backbone)]
        exit_blocks = [1] * len(channels)
        heads = [ExitHead(c, num_classes, fmt=fmt, index=k) for k, c in enumerate(channels)]
    net = EarlyExitNet(blocks, exit_blocks, heads)
    net.timm_name = name
    net.timm_out_indices = tuple(info.out_indices)
    return net


@register("timm_early_exit")
def timm_early_exit(
    backbone: str = "resnet18", exits: Sequence[int] | None = (1, 2, 4), num_classes: int = 10, **kwargs
) -> EarlyExitNet:
    """Registry entry for :func:`early_exit_timm` (``create("timm_early_exit", backbone="resnet18", exits=...)``)."""
    return early_exit_timm(backbone, exits=exits, num_classes=num_classes, **kwargs)
