"""Early-exit networks (EENs): a backbone cut into blocks, with classifier heads ("exits") after some blocks.

Used by Fed-CIS (thesis ch. 5, ResNet-18 with early exits; the authors' code's ``ResNetEE``): a node holds the
prefix of the network up to its largest exit ``E_i`` (:meth:`EarlyExitNet.truncate`) and trains one exit per round.

Conventions used throughout:

* Exits are numbered **1-based, shallow first**: exit ``e`` sits after block ``exit_blocks[e-1]``.
* ``forward(x)`` returns a ``list`` of logits, one ``[B, num_classes]`` tensor per exit; the last one is the
  full network's output. ``forward(x, upto=e)`` runs only the blocks needed by exits ``1..e``.
* A block's output is passed unchanged to the next block and to the heads placed after it. It is normally a
  tensor; it may be a tuple (the first element is the feature map the head pools), which lets a residual block be
  split into two list entries that carry the shortcut input along (see :func:`early_exit_resnet18`).
* FLOPs are counted as **multiply-accumulates (MACs) of Conv and Linear layers only**, for one sample (batch 1),
  bias additions, normalisation, activations, pooling and residual additions excluded (by this count the full
  thesis-layout ResNet-18 on 32x32 is 1.763 GMAC).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._timm_backbone import timm_exit_parts
from .exit_head import ExitHead
from .registry import register

__all__ = ["EarlyExitNet", "ExitHead", "early_exit_resnet18", "RESNET18_NUM_BLOCKS"]

RESNET18_NUM_BLOCKS = 17


class EarlyExitNet(nn.Module):
    """A sequence of blocks with exit heads after some of them.

    Args:
        blocks: the backbone as an ordered list of modules; block ``k`` (1-based) consumes block ``k-1``'s output.
        exit_blocks: for each exit (shallow first), the 1-based index of the block after which its head sits.
            Non-decreasing, in ``[1, len(blocks)]``, and the last exit must follow the last block (blocks past the
            last exit would be dead weight).
        heads: one module per exit mapping the block output to logits ``[B, num_classes]``.

    Shapes: ``forward(x)`` with ``x`` ``[B, C_in, H, W]`` (for the ResNet/timm builders) returns ``num_exits``
    tensors ``[B, num_classes]``.

    Parameter sharing: :meth:`truncate` returns a new ``EarlyExitNet`` whose blocks and heads are **the same module
    objects** (not copies), so training the sub-model updates the full model's tensors, and its ``state_dict()``
    keys are exactly the full model's keys of that prefix (``blocks.{k}.*``, ``heads.{k}.*``).
    """

    def __init__(self, blocks: Sequence[nn.Module], exit_blocks: Sequence[int], heads: Sequence[nn.Module]) -> None:
        super().__init__()
        exit_blocks = tuple(int(b) for b in exit_blocks)
        if len(blocks) == 0:
            raise ValueError("blocks must not be empty")
        if len(exit_blocks) == 0 or len(exit_blocks) != len(heads):
            raise ValueError(
                f"exit_blocks and heads must be non-empty and of equal length, got {len(exit_blocks)} and {len(heads)}"
            )
        if any(b < 1 or b > len(blocks) for b in exit_blocks) or list(exit_blocks) != sorted(exit_blocks):
            raise ValueError(
                f"exit_blocks must be non-decreasing block indices in [1, {len(blocks)}], got {exit_blocks}"
            )
        if exit_blocks[-1] != len(blocks):
            raise ValueError(
                f"the last exit must follow the last block: exit_blocks[-1] must be {len(blocks)}, "
                f"got {exit_blocks[-1]}"
            )
        self.blocks = nn.ModuleList(blocks)
        self.heads = nn.ModuleList(heads)
        self.exit_blocks: tuple[int, ...] = exit_blocks

    # ------------------------------------------------------------------ structure
    @property
    def num_exits(self) -> int:
        """Number of exits ``E`` (the last one is the deepest)."""
        return len(self.heads)

    def _check_exit(self, e: int, name: str = "e") -> int:
        if isinstance(e, bool) or not isinstance(e, numbers.Integral) or not 1 <= e <= self.num_exits:
            raise ValueError(f"{name} must be an exit index in [1, {self.num_exits}] (1-based), got {e!r}")
        return int(e)

    def truncate(self, e: int) -> EarlyExitNet:
        """The prefix sub-model with exits ``1..e`` (1-based) that a node with largest exit ``e`` holds.

        Shares (does not copy) the blocks ``1..exit_blocks[e-1]`` and heads ``1..e`` with this network; deeper
        blocks and heads are not part of it. ``truncate(num_exits)`` holds every module of ``self``.
        """
        e = self._check_exit(e)
        return self._make_truncated(e)

    def _make_truncated(self, e: int) -> EarlyExitNet:
        last = self.exit_blocks[e - 1]
        return EarlyExitNet(list(self.blocks[:last]), self.exit_blocks[:e], list(self.heads[:e]))

    # ------------------------------------------------------------------ compute
    def forward(self, x: Tensor, upto: int | None = None) -> list[Tensor]:
        """Exit logits, shallow first.

        Args:
            x: input batch, e.g. ``[B, C_in, H, W]``.
            upto: compute only exits ``1..upto`` (1-based) and only the blocks they need; ``None`` = all exits.

        Returns:
            list of ``upto`` (or ``num_exits``) tensors ``[B, num_classes]``.
        """
        n = self.num_exits if upto is None else self._check_exit(upto, "upto")
        last = self.exit_blocks[n - 1]
        outs: list[Tensor] = []
        for k, block in enumerate(self.blocks[:last], start=1):
            x = block(x)
            while len(outs) < n and self.exit_blocks[len(outs)] == k:
                outs.append(self.heads[len(outs)](x))
        return outs

    # ------------------------------------------------------------------ cost
    def _units(self) -> list[list[nn.Module]]:
        """Modules exit ``e`` depends on, per exit: ``[blocks[:exit_blocks[e-1]], head e]`` as module lists."""
        return [list(self.blocks[: self.exit_blocks[e]]) + [self.heads[e]] for e in range(self.num_exits)]

    def exit_params(self) -> list[int]:
        """Per exit ``e`` (shallow first): the number of parameters exit ``e``'s logits depend on.

        That is the blocks up to exit ``e`` plus head ``e`` (not the heads of shallower exits; the size of what a
        node stores is ``sum(p.numel() for p in net.truncate(e).parameters())``). Shared tensors count once.
        """
        counts = []
        for mods in self._units():
            seen: dict[int, int] = {}
            for m in mods:
                for p in m.parameters():
                    seen[id(p)] = p.numel()
            counts.append(sum(seen.values()))
        return counts

    @torch.no_grad()
    def exit_flops(self, input_shape: Sequence[int]) -> list[int]:
        """Per exit ``e``: multiply-accumulates (MACs) to compute exit ``e``'s logits for **one** sample.

        Counts ``nn.Conv1d/2d/3d`` (``out.numel() * in_channels/groups * prod(kernel)``) and ``nn.Linear``
        (``out.numel() * in_features``) run by the blocks up to exit ``e`` and by head ``e``; everything else is
        free (see module docstring). Measured with forward hooks on one zero input ``[1, *input_shape]`` in eval
        mode (each module's training flag is restored).

        Args:
            input_shape: per-sample input shape without batch dim, e.g. ``(3, 32, 32)``.
        """
        shape = tuple(int(s) for s in input_shape)
        if len(shape) == 0 or any(s < 1 for s in shape):
            raise ValueError(f"input_shape must be a per-sample shape like (3, 32, 32), got {tuple(input_shape)}")
        macs: dict[int, int] = {}

        def hook(mod: nn.Module, inp, out) -> None:
            if isinstance(mod, nn.Linear):
                n = out.numel() * mod.in_features
            else:
                n = out.numel() * (mod.in_channels // mod.groups) * math.prod(mod.kernel_size)
            macs[id(mod)] = macs.get(id(mod), 0) + n

        counted = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
        handles = [m.register_forward_hook(hook) for m in self.modules() if isinstance(m, counted)]
        modes = [(m, m.training) for m in self.modules()]
        try:
            self.eval()
            ref = next(self.parameters(), None)
            x = torch.zeros(
                1,
                *shape,
                device=ref.device if ref is not None else None,
                dtype=ref.dtype if ref is not None and ref.is_floating_point() else None,
            )
            self(x)
        finally:
            for h in handles:
                h.remove()
            for m, mode in modes:
                m.training = mode
        out = []
        for mods in self._units():
            ids = {id(m) for mod in mods for m in mod.modules()}
            out.append(sum(v for k, v in macs.items() if k in ids))
        return out

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_timm(
        cls,
        name: str,
        exits: Sequence[int] | None = None,
        num_classes: int = 10,
        pretrained: bool = False,
        in_chans: int = 3,
        **timm_kwargs,
    ) -> EarlyExitNet:
        """Exits on a timm backbone, one per requested feature stage (see :mod:`lightning_fedhet.model_zoo.timm_exits`
        for how the backbone is cut into blocks).

        Args:
            name: a timm model name (``timm.list_models()``), e.g. ``"resnet18"``, ``"test_resnet"``.
            exits: timm feature-stage indices (``out_indices``: 0 = first tap, usually the stem at stride 2),
                strictly increasing and ``>= 0``; ``None`` = timm's default taps for ``features_only``. The deepest
                listed stage is the final exit (there is no extra full-network exit: list the last stage to get one).
            num_classes: classes of every exit head.
            pretrained: load timm's pretrained weights (needs network access or a local cache).
            in_chans: input channels.
            **timm_kwargs: passed to ``timm.create_model`` (e.g. ``drop_rate``).

        Returns:
            ``EarlyExitNet``; input ``[B, in_chans, H, W]``, output ``len(exits)`` tensors ``[B, num_classes]``; its
            ``timm_name`` and ``timm_out_indices`` record the backbone and the stages.
        """
        parts = timm_exit_parts(
            name, exits=exits, num_classes=num_classes, pretrained=pretrained, in_chans=in_chans, **timm_kwargs
        )
        net = cls(parts.blocks, parts.exit_blocks, parts.heads)
        net.timm_name = name
        net.timm_out_indices = parts.out_indices
        return net

    def extra_repr(self) -> str:
        return f"num_exits={self.num_exits}, exit_blocks={self.exit_blocks}"


# ---------------------------------------------------------------------- ResNet-18 (thesis / Fed-CIS layout)
def _norm(kind: str, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(2, channels)


class _Stem(nn.Module):
    """CIFAR stem (block 1): ``Conv3x3(in->w, s1, p1, no bias) + norm + ReLU``; ``[B, in, H, W] -> [B, w, H, W]``."""

    def __init__(self, in_channels: int, width: int, norm: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        self.norm = _norm(norm, width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.norm(self.conv(x)))


class _BasicLower(nn.Module):
    """First half ("L") of a BasicBlock: ``conv1 3x3 (stride s) + norm + ReLU``.

    ``x [B, c_in, H, W] -> (h [B, c_out, H/s, W/s], x)``: the block input rides along for the shortcut.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = _norm(norm, c_out)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.act(self.norm1(self.conv1(x))), x


class _BasicUpper(nn.Module):
    """Second half ("U") of a BasicBlock: ``ReLU(norm2(conv2 3x3 (h)) + shortcut(x))``.

    ``(h [B, c_out, H', W'], x [B, c_in, H, W]) -> [B, c_out, H', W']``; the shortcut is the identity, or
    ``Conv1x1(stride s, no bias) + norm`` when the shape changes.
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.norm2 = _norm(norm, c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )
        self.act = nn.ReLU(inplace=True)

    def forward(self, hx: tuple[Tensor, Tensor]) -> Tensor:
        h, x = hx
        return self.act(self.norm2(self.conv2(h)) + self.shortcut(x))


_STRIDES = {"thesis": (1, 1, 2, 2), "standard": (1, 2, 2, 2)}


def early_exit_resnet18(
    num_classes: int = 10,
    exits: Sequence[int] = (3, 9),
    in_channels: int = 3,
    base_width: int = 64,
    stride_layout: str = "thesis",
    norm: str = "batch",
) -> EarlyExitNet:
    """ResNet-18 with early exits in the Fed-CIS layout (thesis ch. 5; released code ``ResNetEE``).

    The backbone is a flat list of **17 blocks**:

    * block 1: CIFAR stem ``Conv3x3(in_channels -> w, s1, p1, no bias) + norm + ReLU`` (no max-pool);
    * blocks 2..17: the 8 BasicBlocks of a standard ResNet-18 (2 per stage, widths ``w, 2w, 4w, 8w``), each split
      into two entries, ``L`` = conv1 3x3 + norm + ReLU (even blocks) and ``U`` = conv2 3x3 + norm + shortcut
      (1x1 conv + norm when the shape changes) + ReLU (odd blocks).

    So block 3 ends BasicBlock 1, block 9 ends stage 2, block 13 ends stage 3 and block 17 is the full network.
    The thesis counts the stem as "residual block 1", so its "exits after the 2nd and 5th residual blocks" (CIFAR10)
    are blocks (3, 9) and "5th and 7th" (CIFAR100) are blocks (9, 13). An exit after an ``L`` entry (even index) is
    allowed and pools the conv1 output. Every exit head is ``global avg-pool -> Linear(C_stage, num_classes)``.

    Args:
        num_classes: classes of every exit.
        exits: block indices (1-based, strictly increasing, in ``[1, 17]``) after which **early** exits sit; the
            final exit after block 17 is always added (listing 17 last is accepted and means the same).
        in_channels: input channels (1 for Fashion-MNIST).
        base_width: width ``w`` of the stem and stage 1 (64 = ResNet-18).
        stride_layout: ``"thesis"`` = stage strides (1, 1, 2, 2) as in the released code (stage 2 keeps the input
            resolution; 1.763 GMAC on 32x32) or ``"standard"`` = (1, 2, 2, 2) (CIFAR ResNet-18, 0.555 GMAC).
        norm: ``"batch"`` (BatchNorm2d, as in the thesis) or ``"group"`` (GroupNorm with 2 groups, as in
            FedAST's ResNet-18; no running statistics to aggregate).

    Returns:
        an :class:`EarlyExitNet` with ``len(exits) + 1`` exits; input ``[B, in_channels, H, W]`` (H, W >= 1, e.g.
        32x32 CIFAR or 28x28 Fashion-MNIST), output ``len(exits) + 1`` tensors ``[B, num_classes]``.
    """
    if stride_layout not in _STRIDES:
        raise ValueError(f"stride_layout must be one of {sorted(_STRIDES)}, got {stride_layout!r}")
    if norm not in ("batch", "group"):
        raise ValueError(f"norm must be 'batch' or 'group', got {norm!r}")
    for pname, val in (("num_classes", num_classes), ("in_channels", in_channels), ("base_width", base_width)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{pname} must be a positive int, got {val!r}")
    if norm == "group" and base_width % 2:
        raise ValueError(f"base_width must be even with norm='group' (GroupNorm(2, C)), got {base_width}")
    exits_t = tuple(exits)
    nb = RESNET18_NUM_BLOCKS
    if (
        any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in exits_t)
        or any(b < 1 or b > nb for b in exits_t)
        or any(a >= b for a, b in zip(exits_t, exits_t[1:]))
    ):
        raise ValueError(
            f"exits must be strictly increasing block indices in [1, {nb}] (the final exit after block {nb} is "
            f"always added), got {exits_t}"
        )
    exits_t = tuple(int(b) for b in exits_t)
    exit_blocks = exits_t if exits_t and exits_t[-1] == nb else exits_t + (nb,)

    widths = [base_width * 2**s for s in range(4)]
    blocks: list[nn.Module] = [_Stem(in_channels, widths[0], norm)]
    channels = [widths[0]]  # feature channels after each block
    c_in = widths[0]
    for c_out, stride in zip(widths, _STRIDES[stride_layout]):
        for b in range(2):
            s = stride if b == 0 else 1
            blocks += [_BasicLower(c_in, c_out, s, norm), _BasicUpper(c_in, c_out, s, norm)]
            channels += [c_out, c_out]
            c_in = c_out
    heads = [ExitHead(channels[b - 1], num_classes) for b in exit_blocks]
    return EarlyExitNet(blocks, exit_blocks, heads)


@register("ee_resnet18")
def ee_resnet18(num_classes: int = 10, exits: Sequence[int] = (3, 9), **kwargs) -> EarlyExitNet:
    """Generic early-exit ResNet-18 (:func:`early_exit_resnet18`), CIFAR10 exits by default."""
    return early_exit_resnet18(num_classes=num_classes, exits=exits, **kwargs)


@register("ee_resnet18_cifar10")
def ee_resnet18_cifar10(num_classes: int = 10, exits: Sequence[int] = (3, 9), **kwargs) -> EarlyExitNet:
    """Thesis CIFAR10 model: exits after blocks 3, 9 and 17."""
    return early_exit_resnet18(num_classes=num_classes, exits=exits, **kwargs)


@register("ee_resnet18_cifar100")
def ee_resnet18_cifar100(num_classes: int = 100, exits: Sequence[int] = (9, 13), **kwargs) -> EarlyExitNet:
    """Thesis CIFAR100 model: exits after blocks 9, 13 and 17."""
    return early_exit_resnet18(num_classes=num_classes, exits=exits, **kwargs)


@register("ee_resnet18_fmnist")
def ee_resnet18_fmnist(
    num_classes: int = 10, exits: Sequence[int] = (3, 9), in_channels: int = 1, **kwargs
) -> EarlyExitNet:
    """Grey-scale (Fashion-MNIST, 28x28) variant of the CIFAR10 model: ``in_channels=1``, exits 3, 9, 17."""
    return early_exit_resnet18(num_classes=num_classes, exits=exits, in_channels=in_channels, **kwargs)
