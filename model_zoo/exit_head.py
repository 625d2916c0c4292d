"""The exit classifier shared by every early-exit network (:mod:`.early_exit`, :mod:`.timm_exits`)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["ExitHead"]


class ExitHead(nn.Module):
    """Exit classifier: global average pool over the spatial/token dims, then ``Linear(in_features, num_classes)``.

    Input: a block output; ``[B, C, *spatial]`` for ``fmt="NCHW"`` (any number of trailing spatial dims, e.g.
    ``[B, C, H, W]``), ``[B, *spatial, C]`` for ``fmt="NHWC"``, or ``[B, C]`` (no pooling). A tuple/list input is
    reduced to its element ``index`` first (0 for split residual blocks and for timm taps that return tuples).
    Output: logits ``[B, num_classes]``.
    """

    def __init__(self, in_features: int, num_classes: int, fmt: str = "NCHW", index: int = 0) -> None:
        super().__init__()
        if fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"fmt must be 'NCHW' or 'NHWC', got {fmt!r}")
        self.fmt = fmt
        self.index = index
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor | Sequence[Tensor]) -> Tensor:
        if isinstance(x, (tuple, list)):
            x = x[self.index]
        if x.dim() > 2:
            x = x.flatten(2).mean(-1) if self.fmt == "NCHW" else x.flatten(1, -2).mean(1)
        return self.fc(x)
