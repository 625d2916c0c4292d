"""The library's input checks: one place that turns user arguments into validated numbers, arrays and tensors.

Every check raises ``ValueError`` whose message names the parameter and the allowed values (an interval written
``[low, high]`` / ``(low, high)``, a set of choices, or the expected length), so a bad configuration fails when an
object is built or set up, never in the middle of a run. The same wording is used everywhere:

- ``"<name> must lie in [0, 1], got 1.5"`` (a value outside its interval; for vectors the first offending entry);
- ``"<name> must be finite, got ..."``;
- ``"<name> has 2 entries but num_clients is 3; give a scalar or exactly one value per client"``;
- ``"<name> must be an integer >= 1, got 2.5"``;
- ``"<name> must be one of ('a', 'b'), got 'c'"``;
- ``"<name> must be True or False, got 1"``;
- ``"<name> must sum to 1, got sum 1.1"``.

There are two families: numpy (:func:`as_float_array`, :func:`check_range`, :func:`as_prob_array`,
:func:`per_client`, :func:`as_numpy_mask`), used by the availability processes and the system models, and torch
(:func:`check_vector`, :func:`check_mask`, :func:`check_distribution`, :func:`check_weights`), used by the server
rules, which keep their per-client state as ``float64`` CPU tensors. Scalars go through :func:`check_real`,
:func:`check_int`, :func:`check_seed`, :func:`check_bool` and :func:`check_choice`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "MAX_EXACT_INT",
    "range_text",
    "check_real",
    "check_int",
    "check_round",
    "check_seed",
    "check_bool",
    "check_choice",
    "check_device",
    "check_length",
    "as_float_array",
    "check_range",
    "as_prob_array",
    "as_int_array",
    "per_client",
    "as_numpy_mask",
    "check_vector",
    "check_mask",
    "check_distribution",
    "check_weights",
]


#: the largest integer :func:`as_int_array` accepts (every int up to it is exact in float64)
MAX_EXACT_INT = 2**53


def range_text(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    """The interval as text, e.g. ``range_text(0, 1, low_open=True) == "(0, 1]"``."""
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _outside(arr: np.ndarray, low: float, high: float, low_open: bool, high_open: bool) -> np.ndarray:
    bad_low = arr <= low if low_open else arr < low
    bad_high = arr >= high if high_open else arr > high
    return bad_low | bad_high


def _real_scalar(value: Any) -> Any:
    """A real number (not a bool, not complex) as a Python or numpy scalar: numbers, numpy scalars, 0-d arrays and
    one-element tensors; ``None`` for anything else."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.dtype.is_complex:
            return None
        return value.item()
    if isinstance(value, np.ndarray):  # only 0-d: Python's int() and float() refuse 1-D numpy arrays
        if value.ndim != 0 or value.dtype.kind not in "iuf":
            return None
        return value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    return value


def _numpy(value: Any) -> Any:
    """A tensor as a numpy array (detached, on the CPU); anything else unchanged."""
    if isinstance(value, Tensor):
        return value.detach().cpu().numpy()
    return value


# ---------------------------------------------------------------------------------------------- scalars
def check_real(
    value: Any,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a finite Python float in the interval ``low..high`` (bools are not numbers here).

    Example::

        >>> check_real(0.5, "beta", 0.0, 1.0, low_open=True)
        0.5
        >>> check_real(0.0, "beta", 0.0, 1.0, low_open=True)
        Traceback (most recent call last):
        ...
        ValueError: beta must lie in (0, 1], got 0.0
    """
    scalar = _real_scalar(value)
    if scalar is None:
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        v = float(scalar)
    except OverflowError:  # an int beyond the float range
        v = math.inf
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if _outside(np.float64(v), low, high, low_open, high_open):
        raise ValueError(f"{name} must lie in {range_text(low, high, low_open, high_open)}, got {value!r}")
    return v


def check_int(value: Any, name: str, low: int = 1, high: int | None = None) -> int:
    """``value`` as a Python int in ``[low, high]`` (floats with an integral value are accepted; bools are not)."""
    if type(value) is int and value >= low and (high is None or value <= high):
        return value  # the common case, checked on every submitted update: no abstract-class look-ups
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    scalar = _real_scalar(value)
    if scalar is None:
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")
    if isinstance(scalar, numbers.Integral):
        as_int = int(scalar)  # exact, however large
    else:
        as_float = float(scalar)
        if not math.isfinite(as_float) or int(as_float) != as_float:
            raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")
        as_int = int(as_float)
    if as_int < low or (high is not None and as_int > high):
        raise ValueError(f"{name} must be an integer {bounds}, got {value!r}")
    return as_int


def check_round(round: Any) -> int:
    """A 0-based round index as an int (``ValueError`` for negative or non-integral values)."""
    scalar = _real_scalar(round)
    try:
        value = float(scalar)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"round must be >= 0 (an integer), got {round!r}") from err
    if not math.isfinite(value) or int(value) != value or value < 0:
        raise ValueError(f"round must be >= 0 (an integer), got {round!r}")
    return int(value)


def check_seed(seed: Any, name: str = "seed") -> int:
    """A seed as a Python int ``>= 0`` (any size: it only feeds ``numpy.random.SeedSequence``)."""
    return check_int(seed, name, 0)


def check_bool(value: Any, name: str) -> bool:
    """``value`` as a Python bool; only ``True``/``False`` (Python or numpy) are accepted, not 0/1 or strings."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_choice(value: Any, name: str, choices: Sequence[Any], alternatives: str = "") -> Any:
    """``value`` if it is one of ``choices``, else ``ValueError`` listing them (and ``alternatives``, the other
    accepted forms that the caller handles itself, e.g. ``"None"``: ``"<name> must be one of (...) or None"``).

    Use it instead of ``value not in CHOICES``: ``in`` compares with ``==``, which for a numpy array is elementwise
    (an empty or longer array raises numpy's "truth value ... is ambiguous", a one-element ``array(['a'])`` passes)
    and for a dict of choices hashes ``value`` (a list raises "unhashable type"); here only a value of a choice's
    own type is compared.
    """
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        other = f" or {alternatives}" if alternatives else ""
        raise ValueError(f"{name} must be one of {tuple(choices)}{other}, got {value!r}")
    return value


def check_device(value: Any, name: str) -> torch.device:
    """``value`` (a ``torch.device`` or a name such as ``"cpu"``, ``"cuda:0"``) as a device this machine has.

    CUDA devices are checked against ``torch.cuda.device_count()`` (which does not initialise CUDA); other
    non-CPU devices by allocating an empty tensor there.
    """
    what = f"{name} must be a torch.device or a device name such as 'cpu' or 'cuda:0', got {value!r}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (str, torch.device, int, np.integer)):
        raise ValueError(what)
    # torch keeps device indices in an int8 and wraps larger ones silently (torch.device("cuda:200") is cuda:-56)
    if isinstance(value, (int, np.integer)):
        value = f"cuda:{int(value)}" if 0 <= int(value) < 128 else ""
    if isinstance(value, str) and ":" in value:
        index = value.rsplit(":", 1)[1]
        if not (index.isdigit() and int(index) < 128):
            raise ValueError(what)
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(what) from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"{name}={value!r} but this machine has {count} CUDA device(s)")
    elif device.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=device)
        except Exception as err:  # torch raises RuntimeError or AssertionError for a backend it was built without
            raise ValueError(f"{name}={value!r} is not available on this machine") from err
    return device


# ---------------------------------------------------------------------------------------------- numpy arrays
def as_float_array(value: Any, name: str) -> np.ndarray:
    """``value`` (scalar, sequence, numpy array or CPU tensor) as a finite float64 array of ndim <= 1."""
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(f"{name} must be a number or a per-client sequence of numbers, got {value!r}")
    what = f"{name} must be a number or a per-client sequence of real numbers, got {value!r}"
    try:
        raw = np.asarray(_numpy(value))
        if np.iscomplexobj(raw):  # numpy would drop the imaginary part silently
            raise ValueError(what)
        arr = np.asarray(raw, dtype=np.float64)
    except OverflowError as err:  # an int beyond the float range
        raise ValueError(f"{name} must be finite, got {value!r}") from err
    except (TypeError, ValueError) as err:
        raise ValueError(what) from err
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
    bad = _outside(np.asarray(arr), low, high, low_open, high_open)
    if np.any(bad):
        first = float(np.asarray(arr).reshape(-1)[np.flatnonzero(np.asarray(bad).reshape(-1))[0]])
        raise ValueError(f"{name} must lie in {range_text(low, high, low_open, high_open)}, got {first!r}")
    return arr


def as_prob_array(
    value: Any,
    name: str,
    low: float = 0.0,
    high: float = 1.0,
    low_open: bool = False,
    high_open: bool = False,
) -> np.ndarray:
    """``value`` as a float64 array (scalar or 1-D) with every entry in the given interval (default ``[0, 1]``)."""
    return check_range(as_float_array(value, name), name, low, high, low_open, high_open)


def as_int_array(value: Any, name: str, low: int = 1) -> np.ndarray:
    """``value`` (int, sequence, numpy array or tensor) as an ``int64`` array of ndim <= 1 with entries in
    ``[low, MAX_EXACT_INT]``.

    Integral floats are accepted; bools, strings, complex and fractional values are not. The upper bound
    ``2**53`` keeps every entry exact through the float64 check and safe from int64 overflow.
    """
    value = _numpy(value)
    what = f"{name} must be an integer >= {low} or a per-client sequence of them, got {value!r}"
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(what)
    try:
        arr = np.asarray(value)
        if np.iscomplexobj(arr):
            raise TypeError(what)
        num = arr.astype(np.float64)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(what) from err
    if arr.dtype == bool or arr.ndim > 1 or (arr.ndim == 1 and arr.size == 0):
        raise ValueError(what)
    flat = num.reshape(-1)
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(flat) & (flat == np.round(flat)) & (flat >= low)
    if not np.all(valid):
        raise ValueError(f"{name} must be integers >= {low}, got {float(flat[~valid][0])!r}")
    if np.any(flat > MAX_EXACT_INT):
        raise ValueError(f"{name} must be integers <= 2**53, got {float(flat[flat > MAX_EXACT_INT][0])!r}")
    return num.astype(np.int64)


def check_length(got: int, num_clients: int, name: str) -> None:
    """Raise unless a per-client argument named ``name`` has ``got == num_clients`` entries."""
    if got != num_clients:
        raise _length_error(name, got, num_clients)


def _length_error(name: str, got: int, num_clients: int) -> ValueError:
    return ValueError(f"{name} has {got} entries but num_clients is {num_clients}; give a scalar or exactly one "
                      f"value per client")


def per_client(arr: Any, num_clients: int, name: str) -> np.ndarray:
    """Broadcast a scalar to ``[num_clients]``; a 1-D array must already have that length (a copy is returned)."""
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(num_clients, float(arr))
    if arr.shape[0] != num_clients:
        raise _length_error(name, arr.shape[0], num_clients)
    return arr.copy()


def as_numpy_mask(mask: Any, num_clients: int, name: str) -> np.ndarray:
    """A numpy bool mask of shape ``(num_clients,)`` from a torch/numpy/list input (non-zero = True)."""
    arr = np.asarray(_numpy(mask))
    if arr.shape != (num_clients,):
        raise ValueError(f"{name} must have shape ({num_clients},), got {tuple(arr.shape)}")
    return arr.astype(bool, copy=False)


# ---------------------------------------------------------------------------------------------- torch tensors
def check_vector(
    values: Any,
    name: str,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    num_clients: int | None = None,
) -> Tensor:
    """A finite per-client ``float64`` CPU tensor (a fresh copy) with every entry in the interval ``low..high``.

    With ``num_clients`` a scalar is broadcast to ``[num_clients]`` and a sequence must have exactly that many
    entries; without it the result has the given (non-zero) length.

    Example::

        >>> check_vector(0.5, "success_probs", 0.0, 1.0, num_clients=2)
        tensor([0.5000, 0.5000], dtype=torch.float64)
    """
    arr = as_float_array(values, name)
    check_range(arr, name, low, high, low_open, high_open)
    if num_clients is not None:
        arr = per_client(arr, num_clients, name)
    return torch.from_numpy(np.array(arr, dtype=np.float64, ndmin=1))


def check_mask(values: Any, num_clients: int, name: str) -> Tensor:
    """A per-client bool CPU tensor of ``num_clients`` entries (non-zero = True) from a tensor/array/list."""
    if isinstance(values, Tensor):
        m = values.detach().flatten().cpu()
    else:
        m = torch.as_tensor(np.asarray(values)).flatten()
    if m.numel() != num_clients:
        raise _length_error(name, m.numel(), num_clients)
    return m != 0


def check_weights(values: Any, name: str, num_clients: int | None = None, normalize: bool = True) -> Tensor:
    """Finite, non-negative weights, not all zero (``float64`` ``[N]``), normalised to sum to 1 unless told not to."""
    w = check_vector(values, name, 0.0, math.inf, num_clients=num_clients)
    if not float(w.sum()) > 0:
        raise ValueError(f"{name} must be finite, non-negative and not all zero, got all zeros")
    return w / w.sum() if normalize else w


def check_distribution(values: Any, name: str, num_clients: int | None = None, atol: float = 1e-6) -> Tensor:
    """An explicit probability vector: finite, in ``[0, 1]`` and summing to 1 within ``atol`` (``float64``).

    Example::

        >>> check_distribution([0.5, 0.6], "omega")
        Traceback (most recent call last):
        ...
        ValueError: omega must sum to 1, got sum 1.1
    """
    p = check_vector(values, name, 0.0, 1.0)
    if num_clients is not None and p.numel() != num_clients:
        raise _length_error(name, p.numel(), num_clients)
    total = float(p.sum())
    if abs(total - 1.0) > atol:
        raise ValueError(f"{name} must sum to 1, got sum {total:g}")
    return p
