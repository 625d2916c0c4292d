"""A timm feature extractor cut into the blocks and exit heads of an early-exit network.

The cutting rules are documented in :mod:`lightning_fedhet.model_zoo.timm_exits`; the network itself is assembled by
:meth:`~lightning_fedhet.model_zoo.early_exit.EarlyExitNet.from_timm`. This module sits below both (it needs only
:class:`~lightning_fedhet.model_zoo.exit_head.ExitHead`), so ``early_exit`` and ``timm_exits`` do not import each
other in a circle.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import NamedTuple

from torch import Tensor, nn

from .exit_head import ExitHead


class TimmExitParts(NamedTuple):
    """What :class:`~lightning_fedhet.model_zoo.early_exit.EarlyExitNet` is built from."""

    blocks: list[nn.Module]
    exit_blocks: list[int]
    heads: list[ExitHead]
    out_indices: tuple[int, ...]


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


def timm_exit_parts(
    name: str,
    exits: Sequence[int] | None = None,
    num_classes: int = 10,
    pretrained: bool = False,
    in_chans: int = 3,
    **timm_kwargs,
) -> TimmExitParts:
    """Blocks, exit positions and heads for ``EarlyExitNet.from_timm`` (same arguments; validated here)."""
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
    return TimmExitParts(blocks, exit_blocks, heads, tuple(info.out_indices))
