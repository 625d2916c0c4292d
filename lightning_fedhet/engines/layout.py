"""Where each client's state sits in a cohort's stacked rows.

A cohort holds its clients' states as one row each of stacked tensors ``[C, *shape]``. :class:`StateLayout` maps the
server's flat vectors (:class:`~lightning_fedhet.flat.FlatModel`'s layout) to named stacked tensors and back; a
compiled cohort pads its rows to a bucket size (:func:`padded_size`) so that one compiled graph serves many cohort
sizes, and the tree helpers pad, slice and copy the nested batches and outputs that travel with those rows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class StateLayout:
    """Where a module's state sits in the server's vectors: parameters (``named_parameters`` order) then floating
    buffers (``named_buffers`` order) in the float vector ``[d]``, integer buffers in the int64 vector ``[m]`` (the
    layout of :class:`~lightning_fedhet.flat.FlatModel`)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [(name, p) for name, p in module.named_parameters()]
        buffers = list(module.named_buffers())
        #: every buffer's name in ``named_buffers`` order (the order a cohort keeps its stacked buffers in)
        self.buffer_names = [name for name, _ in buffers]
        #: the normalisation layers (BatchNorm, InstanceNorm), by name: what the vmap checks read each round, kept so
        #: that a round does not walk the module tree again (hashing every submodule: tens of us per round)
        self.norms = normalisation_layers(module)
        self.float_buffers = [(name, b) for name, b in buffers if torch.is_floating_point(b)]
        self.int_buffers = [(name, b) for name, b in buffers if not torch.is_floating_point(b)]
        self.floats = self.params + self.float_buffers
        self.num_parameters = sum(p.numel() for _, p in self.params)

    def current(self) -> tuple[Tensor, Tensor]:
        """The module's own state: float ``[d]`` and int64 ``[m]`` vectors."""
        with torch.no_grad():
            floats = torch.cat([t.detach().reshape(-1) for _, t in self.floats])
            ints = [t.detach().reshape(-1).to(torch.int64) for _, t in self.int_buffers]
            return floats, torch.cat(ints) if ints else torch.zeros(0, dtype=torch.int64, device=floats.device)

    @staticmethod
    def split(rows: Tensor, named: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """Stacked tensors ``[C, *shape]`` (fresh storage, the module's dtypes) from flat rows ``[C, sum numel]``."""
        if not named:
            return {}
        chunks = torch.split(rows, [t.numel() for _, t in named], dim=1)
        return {
            name: chunk.reshape(rows.shape[0], *t.shape).to(device=t.device, dtype=t.dtype, copy=True)
            for (name, t), chunk in zip(named, chunks)
        }



def normalisation_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The module's normalisation layers with running statistics' machinery (BatchNorm, InstanceNorm), by name."""
    return [(name, sub) for name, sub in module.named_modules() if isinstance(sub, nn.modules.batchnorm._NormBase)]


def padded_size(size: int) -> int:
    """The bucket a compiled cohort of ``size`` clients is padded to (at most 7 rows, or 12.5 %, of padding)."""
    step = max(8, 2 ** (max(size, 1).bit_length() - 4))
    return -(-size // step) * step


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """``t`` with its leading dimension padded to ``rows`` by repeating row 0 (padding rows are never active)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t[:1].expand(rows - t.shape[0], *t.shape[1:])])


def pad_batch(batch, rows: int):
    if isinstance(batch, Tensor):
        return pad_rows(batch, rows)
    if isinstance(batch, dict):
        return {k: pad_batch(v, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(pad_batch(v, rows) for v in batch)
    return batch


def slice_tree(tree, size: int):
    if isinstance(tree, Tensor):
        return tree[:size]
    if isinstance(tree, dict):
        return {k: slice_tree(v, size) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(slice_tree(v, size) for v in tree)
    return tree


def clone_tree(tree):
    if isinstance(tree, Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(clone_tree(v) for v in tree)
    return tree
