"""Trace-driven availability: replay a recorded ``[T, N]`` on/off mask."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from lightning_fedhet.participation.base import Participation


def _load(path: str) -> np.ndarray:
    ext = os.path.splitext(path)[1].lower()
    if not os.path.isfile(path):
        raise ValueError(f"mask: no such file {path!r}")
    if ext == ".npy":
        return np.load(path, allow_pickle=False)
    if ext == ".npz":
        with np.load(path, allow_pickle=False) as archive:
            keys = list(archive.keys())
            if "mask" in keys:
                return archive["mask"]
            if len(keys) == 1:
                return archive[keys[0]]
            raise ValueError(f"mask: {path!r} holds arrays {keys}; name the trace 'mask' or store only one array")
    if ext == ".csv":
        return np.loadtxt(path, delimiter=",", ndmin=2)
    raise ValueError(f"mask: unsupported file type {ext!r} for {path!r}; use .npy, .npz or .csv")


class Trace(Participation):
    """Availability replayed from a recorded mask: client ``i`` is on in round ``t`` iff ``mask[t mod T, i]``.

    Rounds beyond the trace length ``T`` wrap around (the trace is treated as one period of a cyclic process),
    so a run may be longer than the recording. :attr:`p` is the empirical on-frequency of each client over the
    ``T`` recorded rounds, which is then also its exact long-run frequency.

    Args:
        mask: a ``[T, N]`` array of 0/1 or bools (rows are rounds, columns clients), or a path to a ``.npy``,
            ``.npz`` (array named ``mask`` or a single array) or ``.csv`` file (comma-separated 0/1, one row per
            round). ``N`` must equal ``num_clients`` at :meth:`setup`.
    """

    def __init__(self, mask: Any) -> None:
        super().__init__()
        self.source = mask if isinstance(mask, (str, os.PathLike)) else None
        raw = _load(os.fspath(mask)) if self.source is not None else mask
        if hasattr(raw, "detach"):
            raw = raw.detach().cpu().numpy()
        try:
            arr = np.asarray(raw)
        except (TypeError, ValueError) as err:
            raise ValueError(f"mask must be a [T, N] array of 0/1 values, got {type(mask).__name__}") from err
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ValueError(f"mask must have shape [T, N] with T >= 1 rounds and N >= 1 clients, got "
                             f"{tuple(arr.shape)}")
        if arr.dtype != bool:
            if not np.issubdtype(arr.dtype, np.number) or not np.all((arr == 0) | (arr == 1)):
                raise ValueError("mask must hold only 0/1 (or boolean) values")
            arr = arr == 1
        self.mask = np.ascontiguousarray(arr, dtype=bool)

    @property
    def num_rounds(self) -> int:
        """Length ``T`` of the recorded trace (rounds ``>= T`` wrap around)."""
        return self.mask.shape[0]

    def setup(self, num_clients: int, seed: int = 0) -> None:
        super().setup(num_clients, seed)
        if self.mask.shape[1] != self.num_clients:
            raise ValueError(f"mask has {self.mask.shape[1]} clients (shape {tuple(self.mask.shape)}) but "
                             f"num_clients is {self.num_clients}")

    def _sample(self, round: int) -> np.ndarray:
        return self.mask[round % self.mask.shape[0]].copy()

    def _stationary(self) -> np.ndarray:
        return self.mask.mean(axis=0, dtype=np.float64)

    def __repr__(self) -> str:
        src = repr(os.fspath(self.source)) if self.source is not None else "<array>"
        return f"Trace(mask={src}, shape={tuple(self.mask.shape)})"
