"""Flat-vector view of a module's state, the representation the server and the rules work on."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class FlatModel:
    """Reads and writes a module's parameters and floating-point buffers as one vector ``[d]``.

    Parameters come first (in ``named_parameters`` order), then floating buffers such as BatchNorm
    running statistics. Integer buffers (``num_batches_tracked``, counters a ``training_step`` keeps) are read
    and written separately as an int64 vector ``[m]`` (:meth:`get_ints` / :meth:`set_ints`), so they stay exact.

    Writing always copies, so the vector and the module never share storage.
    """

    def __init__(self, module: nn.Module) -> None:
        self.tensors: list[Tensor] = [p for p in module.parameters()]
        self.tensors += [b for b in module.buffers() if torch.is_floating_point(b)]
        self.numels = [t.numel() for t in self.tensors]
        self.dim = sum(self.numels)
        self.num_parameters = sum(p.numel() for p in module.parameters())
        self.int_names = [n for n, b in module.named_buffers() if not torch.is_floating_point(b)]
        self.int_tensors = [b for b in module.buffers() if not torch.is_floating_point(b)]
        self.int_numels = [t.numel() for t in self.int_tensors]

    def get(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """A new flat copy of the module's current state, shape ``[d]``."""
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1).to(dtype) for t in self.tensors])

    def set(self, vector: Tensor) -> None:
        """Copy ``vector`` (shape ``[d]``) into the module, in place."""
        if vector.numel() != self.dim:
            raise ValueError(f"vector has {vector.numel()} entries, the model has {self.dim}")
        with torch.no_grad():
            for t, chunk in zip(self.tensors, torch.split(vector, self.numels)):
                t.copy_(chunk.view_as(t))

    def get_ints(self) -> Tensor:
        """The integer buffers as one int64 vector ``[m]`` (empty when there are none)."""
        if not self.int_tensors:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([t.detach().reshape(-1).to(torch.int64).cpu() for t in self.int_tensors])

    def set_ints(self, vector: Tensor) -> None:
        """Copy an int64 vector ``[m]`` into the integer buffers."""
        with torch.no_grad():
            for t, chunk in zip(self.int_tensors, torch.split(vector, self.int_numels)):
                t.copy_(chunk.view_as(t).to(t))


def all_finite(vector: Tensor) -> bool:
    """Whether every entry of ``vector`` (any shape) is finite: no NaN, no ±inf. :func:`rows_finite` of one row.

    Example::

        >>> all_finite(torch.tensor([1.0, -2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    return bool(rows_finite(vector.reshape(1, -1))[0])


def rows_finite(matrix: Tensor) -> Tensor:
    """Whether each row of ``matrix`` ``[C, d]`` is entirely finite: bool ``[C]``.

    Exact: ``amax`` and ``amin`` propagate NaN, and a row's extremes are finite exactly when every entry is. On a CPU
    this is several times faster than ``torch.isfinite(matrix).all(dim=1)``, which materialises a boolean matrix and
    reduces it slowly, and than ``torch.aminmax(matrix, dim=1)``, whose row reduction is not vectorised (measured on
    a 2-core CPU: 1.3 ms against 11.6 ms for ten rows of 421,642 floats). One host sync when its result is read.
    """
    if matrix.dim() != 2:
        raise ValueError(f"rows_finite needs a [C, d] matrix, got shape {tuple(matrix.shape)}")
    if matrix.shape[1] == 0 or not (matrix.is_floating_point() or matrix.is_complex()):
        return torch.ones(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    if matrix.is_complex():
        return rows_finite(torch.view_as_real(matrix).reshape(matrix.shape[0], -1))
    return torch.isfinite(matrix.amax(dim=1)) & torch.isfinite(matrix.amin(dim=1))
