"""Statistics over seeds and the verdicts built on them.

A cell is summarised by its mean and a two-sided Student-t interval over seeds (:func:`mean_ci`); two methods are
compared by the differences over the seeds both ran (:func:`paired`), which removes what the seeds share (the data
order, the participation draws, the initial model). scipy (the ``[experiments]`` extra) gives the t quantiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from lightning_fedhet.experiments.records import Record

#: the verdicts of the v1/v2 protocols' registered rule (:func:`verdict_for_gain`), strongest first; studies decide
#: with :func:`lightning_fedhet.experiments.decision.decide` since v3
VERDICTS = ("reproduced", "partly reproduced", "direction only", "not reproduced", "not testable here")


def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t interval of the mean: ``(mean, low, high)``.

    One value gives ``(value, nan, nan)`` (no interval from one seed); none gives three NaNs.
    """
    from scipy import stats

    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(arr.mean())
    if arr.size == 1:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, arr.size - 1) * arr.std(ddof=1) / math.sqrt(arr.size))
    return mean, mean - half, mean + half


def by_seed(records: Iterable[Record], value: Callable[[Record], float], **match: object) -> dict[int, float]:
    """``{seed: value(record)}`` over the records whose fields equal ``match`` (e.g. ``method="FedAU"``)."""
    return {r["seed"]: float(value(r)) for r in records if all(r[k] == v for k, v in match.items())}


def paired(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> tuple[float, float, float, int]:
    """Mean and interval of ``a - b`` over the seeds both have, and that number of seeds."""
    seeds = sorted(set(a) & set(b))
    mean, lo, hi = mean_ci([a[s] - b[s] for s in seeds], level)
    return mean, lo, hi, len(seeds)


def fmt_ci(mean: float, lo: float, hi: float, scale: float = 100.0, digits: int = 1, unit: str = "",
           against: Sequence[float] = ()) -> str:
    """``"72.9 [70.1, 75.6]"`` (``scale`` 100 turns fractions into percent or percentage points).

    An interval is read against 0 (does it exclude it?) and against each value in ``against`` (a paper's effect,
    in the units of ``mean``): where ``digits`` would print an end equal to one of them although it differs (lo =
    -0.0004 printed ``-0.0``, hi = 0.497 printed ``0.5`` against an effect of 0.5), all three numbers get one
    more decimal, up to 6, until each end shows its side."""
    if math.isnan(mean):
        return "–"
    d = _decimals_to_tell((lo, hi), (0.0, *against), scale, digits)  # a NaN end equals no reference: `digits`
    m = f"{scale * mean:.{d}f}{unit}"
    return m if math.isnan(lo) else f"{m} [{scale * lo:.{d}f}, {scale * hi:.{d}f}]"


def fmt_vs_bound(value: float, bound: float, scale: float = 100.0, digits: int = 2, unit: str = "") -> str:
    """``value * scale`` signed (``"+0.48"``), with more decimals than ``digits`` where ``digits`` would print the
    magnitude of ``bound`` itself although ``value`` differs from it: a number read against a check's bound (a
    tail change "below 0.5 pp") must show which side of the bound it lies on (``+0.497`` passes, ``+0.503``
    fails; both read ``+0.50`` at two decimals). At most 6 decimals; ``"–"`` for NaN."""
    if math.isnan(value):
        return "–"
    return f"{scale * value:+.{_decimals_to_tell((value,), (bound, -bound), scale, digits)}f}{unit}"


def _decimals_to_tell(values: Sequence[float], refs: Sequence[float], scale: float, digits: int) -> int:
    """The fewest decimals from ``digits`` (at most 6) at which no value of ``values`` that differs from a value of
    ``refs`` prints as it (both times ``scale``): the digits that show on which side of each reference it lies."""
    d = digits
    while d < 6 and any(v != r and round(scale * v, d) == round(scale * r, d) for v in values for r in refs):
        d += 1
    return d


def fmt_mean_ci(values: Sequence[float], scale: float = 100.0, digits: int = 1, unit: str = "",
                level: float = 0.95) -> str:
    """:func:`fmt_ci` of :func:`mean_ci` over ``values``: a cell's ``"72.9 [70.1, 75.6]"`` in one call."""
    return fmt_ci(*mean_ci(list(values), level), scale, digits, unit)


def seeds_done(n: int, planned: int) -> str:
    """``"7/10 (incomplete)"``, or ``"10/10"`` once a cell has all its planned seeds."""
    return f"{n}/{planned}" + ("" if n >= planned else " (incomplete)")


def verdict_for_gain(lo: float, mean: float, hi: float, paper_gain: float | None = None,
                     ratio: float = 0.5) -> str:
    """The v1/v2 protocols' registered rule for "method A beats method B by about the paper's gain", kept to show
    what those protocols decided; new studies use :func:`lightning_fedhet.experiments.decision.decide`.

    - ``reproduced``: the interval lies above 0 and the mean gain is at least ``ratio`` x ``paper_gain``;
    - ``partly reproduced``: the interval lies above 0 but the gain is smaller than that;
    - ``direction only``: the mean gain is positive but the interval reaches 0;
    - ``not reproduced``: the mean gain is 0 or negative;
    - ``pending``: no paired seeds yet.
    """
    if math.isnan(mean):
        return "pending"
    if lo > 0:
        return "reproduced" if paper_gain is None or mean >= ratio * paper_gain else "partly reproduced"
    return "direction only" if mean > 0 else "not reproduced"


def direction(lo: float, mean: float, hi: float) -> str:
    """What a paired interval of ``a - b`` resolves: ``"higher"``, ``"lower"``, ``"not resolved"`` (it holds 0) or
    ``"–"`` (fewer than two paired seeds)."""
    if math.isnan(lo):
        return "–"
    if lo > 0:
        return "higher"
    if hi < 0:
        return "lower"
    return "not resolved"


def seeds_needed(sd_paired: float, effect: float, level: float = 0.95, max_seeds: int = 1000) -> int | None:
    """The fewest seeds ``n >= 2`` whose paired interval half-width ``t_{n-1} sd / sqrt(n)`` is below ``effect``
    (the v1/v2 protocols' power analysis: about 50 % power; for 80 % use
    :func:`lightning_fedhet.experiments.decision.seeds_for_power`); ``None`` if more than ``max_seeds`` are
    needed."""
    from scipy import stats

    if effect <= 0:
        raise ValueError(f"effect must be > 0, got {effect}")
    for n in range(2, max_seeds + 1):
        if stats.t.ppf(0.5 + level / 2, n - 1) * sd_paired / math.sqrt(n) < effect:
            return n
    return None
