"""Shared input checks and key constants for the availability processes and the system models.

Every check raises ``ValueError`` with a message that names the parameter and its allowed range, so a
bad configuration fails when the object is built (or, for per-client lengths, at ``setup``), never in
the middle of a run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Static (not per-round) draws live under ``generator(seed, stream, STATIC_KEY, sub_key)``. Round draws
# use ``generator(seed, stream, round)``; numpy's SeedSequence pads short entropy with zeros, so a
# ``sub_key >= 1`` keeps the two families apart for every round below 2**32 - 1.
STATIC_KEY = 2**32 - 1
KEY_LABEL_CORRELATED = 1
KEY_TWO_GROUP = 2
KEY_CAFED_CLASSES = 3
KEY_CYCLIC_OFFSET = 4
KEY_LATENCY_GROUPS = 5
KEY_CAFED_LAMBDA = 6


def _range_text(low: float, high: float, low_open: bool, high_open: bool) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def as_float_array(value: Any, name: str) -> np.ndarray:
    """``value`` (scalar, sequence, numpy array or CPU tensor) as a finite float64 array of ndim <= 1."""
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(f"{name} must be a number or a per-client sequence of numbers, got {value!r}")
    try:
        arr = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be a number or a per-client sequence of numbers, got {value!r}") from err
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a 1-D per-client array, got shape {tuple(arr.shape)}")
    if arr.ndim == 1 and arr.size == 0:
        raise ValueError(f"{name} must not be an empty sequence")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return arr


def check_range(
    arr: np.ndarray,
    name: str,
    low: float = 0.0,
    high: float = 1.0,
    low_open: bool = False,
    high_open: bool = False,
) -> np.ndarray:
    """Raise unless every entry of ``arr`` lies in the interval ``low..high`` (bounds open or closed)."""
    bad_low = arr <= low if low_open else arr < low
    bad_high = arr >= high if high_open else arr > high
    bad = bad_low | bad_high
    if np.any(bad):
        first = float(np.asarray(arr).reshape(-1)[np.flatnonzero(np.asarray(bad).reshape(-1))[0]])
        rng = _range_text(low, high, low_open, high_open)
        raise ValueError(f"{name} must lie in {rng}, got {first!r}")
    return arr


def as_prob_array(
    value: Any,
    name: str,
    low: float = 0.0,
    high: float = 1.0,
    low_open: bool = False,
    high_open: bool = False,
) -> np.ndarray:
    """``value`` as a float64 array (scalar or 1-D) with every entry in the given interval."""
    return check_range(as_float_array(value, name), name, low, high, low_open, high_open)


def per_client(arr: np.ndarray, num_clients: int, name: str) -> np.ndarray:
    """Broadcast a scalar to ``[num_clients]``; a 1-D array must already have that length."""
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(num_clients, float(arr))
    if arr.shape[0] != num_clients:
        raise ValueError(f"{name} has {arr.shape[0]} entries but num_clients is {num_clients}; give a scalar or "
                         f"exactly one value per client")
    return arr.copy()


def as_int(value: Any, name: str, low: int = 1) -> int:
    """``value`` as a Python int ``>= low`` (floats with an integral value are accepted; bools are not)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    try:
        as_float = float(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}") from err
    if not np.isfinite(as_float) or int(as_float) != as_float or int(as_float) < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(as_float)


def as_numpy_mask(mask: Any, num_clients: int, name: str) -> np.ndarray:
    """A bool mask of length ``num_clients`` from a torch/numpy/list input."""
    if hasattr(mask, "detach"):
        mask = mask.detach().cpu().numpy()
    arr = np.asarray(mask)
    if arr.shape != (num_clients,):
        raise ValueError(f"{name} must have shape ({num_clients},), got {tuple(arr.shape)}")
    return arr.astype(bool, copy=False)
