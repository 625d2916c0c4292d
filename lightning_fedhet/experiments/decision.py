"""The one decision rule for a claim "method A beats method B by ``g > 0``", from paired differences over seeds.

Every study (the repository's and a user's) labels its claims with :func:`decide`. From the paired interval
``[lo, hi]`` of the mean of ``a - b`` (Student-t over the seeds both ran, at the deciding level):

============== ============================ ==================================================================
label          when                         what it says
============== ============================ ==================================================================
pending        fewer seeds than planned     never a final label (an interim interval may be shown beside it)
not converged  the cell failed its check    the regime is not settled: no verdict on its numbers
lr at edge     the learning-rate pick sits  the tuning is not settled: no verdict on its numbers
               on its grid's edge
reproduced     ``lo > 0``                   the sign is resolved in the paper's direction
opposite sign  ``hi < 0``                   the sign is resolved against the paper
not reproduced ``lo <= 0 <= hi`` and        the paper's effect is excluded, no effect is not
               ``hi < g``
inconclusive   ``lo <= 0 <= hi`` and        neither 0 nor the paper's effect is excluded; the label gives the
               ``hi >= g``                  seeds that 80 % power to resolve ``g`` needs (noncentral t)
============== ============================ ==================================================================

A resolved sign is therefore always reported: an interval that excludes 0 is never "inconclusive". Where a claim
has no number (``g=None``: "A beats B", direction only) an interval holding 0 is "inconclusive".

Several claims on one page form a *family*; :func:`family_intervals` widens their intervals for it (Bonferroni, or
Holm's step-down), and the protocol says whether the raw or the adjusted interval decides (``decide``'s ``lo, hi``).

Power (:func:`power`, :func:`seeds_for_power`): the paired test that puts the two-sided ``1 - alpha`` interval above 0
rejects when ``T = mean / (sd / sqrt(n)) > t_{1 - alpha/2, n-1}``; if the true gain is ``g``, ``T`` follows a
noncentral t with ``n - 1`` degrees of freedom and noncentrality ``g sqrt(n) / sd``. (The older rule "the
half-width is below ``g``", :func:`~lightning_fedhet.experiments.stats.seeds_needed`, gives about 50 % power.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_fedhet.experiments.stats import mean_ci

#: the labels :func:`decide` gives, final verdicts first
LABELS = ("reproduced", "opposite sign", "not reproduced", "inconclusive", "pending", "not converged",
          "lr at grid edge")
#: the labels that are verdicts on the claim (the others say why there is none yet)
FINAL = LABELS[:4]
ADJUSTMENTS = ("none", "bonferroni", "holm")


def _t_interval(diffs: np.ndarray, level: float) -> tuple[float, float, float]:
    """The mean and Student-t interval of ``diffs`` (:func:`~lightning_fedhet.experiments.stats.mean_ci`)."""
    return mean_ci(diffs, level)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")


def power(sd: float, effect: float, n: int, level: float = 0.95) -> float:
    """Probability that the paired ``level`` interval over ``n`` seeds lies above 0 when the true mean difference
    is ``effect`` and the per-seed differences have standard deviation ``sd`` (noncentral t, see the module).

    >>> round(power(1.0, 1.0, 10), 3)
    0.803
    """
    from scipy import stats

    _check_level(level)
    if n < 2:
        raise ValueError(f"n must be >= 2 seeds, got {n}")
    if not sd > 0:
        raise ValueError(f"sd must be > 0, got {sd}")
    critical = stats.t.ppf(0.5 + level / 2, n - 1)
    return float(stats.nct.sf(critical, n - 1, effect * math.sqrt(n) / sd))


def seeds_for_power(sd: float, effect: float, target: float = 0.8, level: float = 0.95,
                    max_seeds: int = 10_000) -> int | None:
    """The fewest seeds ``n >= 2`` whose paired test resolves a true gain ``effect > 0`` with probability at least
    ``target`` (:func:`power`); ``None`` when more than ``max_seeds`` would be needed or ``sd`` is not finite.
    ``sd == 0`` needs 2 seeds (no noise)."""
    if not effect > 0:
        raise ValueError(f"effect must be > 0, got {effect}")
    if not 0 < target < 1:
        raise ValueError(f"target (power) must be in (0, 1), got {target}")
    if not math.isfinite(sd) or sd < 0:
        return None
    if sd == 0:
        return 2
    if power(sd, effect, max_seeds, level) < target:
        return None
    lo, hi = 2, max_seeds  # power grows with n: bisect for the first n that reaches the target
    while lo < hi:
        mid = (lo + hi) // 2
        if power(sd, effect, mid, level) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class Decision:
    """A claim's label and what it rests on (differences in the metric's units, e.g. fractions of accuracy).

    ``mean, lo, hi``: the deciding interval (raw or family-adjusted); ``n``: paired seeds; ``planned``: the
    protocol's seeds; ``gain``: the paper's effect ``g`` (``None``: direction only); ``seeds_for_80``: seeds for
    80 % power to resolve ``g`` from this cell's paired SD (``None`` when unknown or out of reach); ``reason``: one
    sentence.
    """

    label: str
    mean: float
    lo: float
    hi: float
    n: int
    planned: int
    gain: float | None
    seeds_for_80: int | None
    reason: str

    @property
    def final(self) -> bool:
        """Whether the label is a verdict on the claim (not pending, not converged, not at a grid edge)."""
        return self.label in FINAL

    @property
    def against(self) -> tuple[float, ...]:
        """What the interval is read against besides 0: the paper's effect, where the claim states one (pass it
        as :func:`~lightning_fedhet.experiments.fmt_ci`'s ``against``)."""
        return () if self.gain is None else (self.gain,)

    def text(self) -> str:
        """The label as a page shows it, with the seeds 80 % power needs where the interval is inconclusive."""
        if self.label == "inconclusive" and self.gain is not None:
            need = "> 10,000" if self.seeds_for_80 is None else str(self.seeds_for_80)
            return f"inconclusive ({need} seeds for 80 % power)"
        if self.label == "inconclusive" and (self.hi < 0 or self.lo > 0):
            # an equivalence claim's interval may exclude 0 and still cross the margin: the sign is resolved and a
            # page must say so (a resolved sign is never hidden behind "inconclusive")
            return f"inconclusive (a gap {'below' if self.hi < 0 else 'above'} 0 is resolved)"
        if self.label == "pending":
            return f"pending ({self.n}/{self.planned} seeds)"
        return self.label


def _check_counts(n: int, planned: int) -> None:
    if n < 0 or planned < 1:
        raise ValueError(f"n must be >= 0 and planned >= 1, got n={n}, planned={planned}")


def _withheld(lo: float, hi: float, n: int, planned: int, converged: bool,
              lr_interior: bool) -> tuple[str, str] | None:
    """The label and reason when a claim gets no verdict yet (pending, not converged, lr at grid edge), else
    ``None``: the same order for every kind of claim."""
    if n < planned or math.isnan(lo) or math.isnan(hi):
        return "pending", f"{n} of {planned} planned seeds"
    if not converged:
        return "not converged", "the cell failed the protocol's convergence check"
    if not lr_interior:
        return "lr at grid edge", "a learning rate was picked at its grid's edge"
    return None


def decide(lo: float, hi: float, gain: float | None, n: int, planned: int, *, mean: float = math.nan,
           sd: float = math.nan, converged: bool = True, lr_interior: bool = True, level: float = 0.95) -> Decision:
    """The label of "A beats B by ``gain``" from the paired interval ``[lo, hi]`` of ``a - b`` over ``n`` seeds.

    Args:
        lo, hi: the deciding interval (raw, or from :func:`family_intervals`).
        gain: the paper's effect ``g > 0`` in the same units, or ``None`` for a claim of direction only.
        n: seeds both methods ran; ``planned``: the seeds the protocol plans (``n < planned`` is "pending").
        mean, sd: the mean and standard deviation (ddof 1) of the per-seed differences, for the power figure.
        converged: the cell passed its protocol's convergence check (both methods).
        lr_interior: the cell's learning rates sit inside their grids (both methods).
        level: the interval's level, for the power figure.
    """
    if gain is not None and not gain > 0:
        raise ValueError(f"gain must be > 0 (the paper's effect in the claim's direction) or None, got {gain}")
    _check_counts(n, planned)
    need = None
    if gain is not None and math.isfinite(sd) and n >= 2:
        need = seeds_for_power(sd, gain, level=level)

    def out(label: str, reason: str) -> Decision:
        return Decision(label, mean, lo, hi, n, planned, gain, need, reason)

    withheld = _withheld(lo, hi, n, planned, converged, lr_interior)
    if withheld is not None:
        return out(*withheld)
    if lo > 0:
        return out("reproduced", "the interval lies above 0")
    if hi < 0:
        return out("opposite sign", "the interval lies below 0")
    if gain is not None and hi < gain:
        return out("not reproduced", "the interval holds 0 and excludes the paper's effect")
    return out("inconclusive", "the interval holds 0" + ("" if gain is None else " and the paper's effect"))


def decide_within(lo: float, hi: float, margin: float, n: int, planned: int, *, mean: float = math.nan,
                  converged: bool = True, lr_interior: bool = True) -> Decision:
    """The label of an equivalence claim "A is within ``margin`` of B" (e.g. "nearly attains the lossless
    baseline") from the paired interval ``[lo, hi]`` of ``a - b``: **reproduced** when the interval lies inside
    ``(-margin, margin)``; **not reproduced** when it lies wholly outside (``hi < -margin`` or ``lo > margin``: the
    gap is resolved and larger than the margin); **inconclusive** otherwise (equivalence neither shown nor
    excluded); pending, not converged and lr at grid edge as :func:`decide`."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    _check_counts(n, planned)

    def out(label: str, reason: str) -> Decision:
        return Decision(label, mean, lo, hi, n, planned, None, None, reason)

    withheld = _withheld(lo, hi, n, planned, converged, lr_interior)
    if withheld is not None:
        return out(*withheld)
    if -margin < lo and hi < margin:
        return out("reproduced", "the interval lies inside the margin")
    if hi < -margin or lo > margin:
        return out("not reproduced", "the interval lies outside the margin")
    if hi < 0 or lo > 0:
        return out("inconclusive", f"the interval crosses the margin but lies {'below' if hi < 0 else 'above'} 0: "
                                   "a gap is resolved, its size against the margin is not")
    return out("inconclusive", "the interval crosses the margin: equivalence neither shown nor excluded")


def decide_paired(a: Mapping[int, float], b: Mapping[int, float], gain: float | None, planned: int, *,
                  level: float = 0.95, interval: tuple[float, float] | None = None, converged: bool = True,
                  lr_interior: bool = True) -> Decision:
    """:func:`decide` on the paired differences ``a[s] - b[s]`` over the seeds both have. ``interval`` replaces
    the raw ``level`` interval by a family-adjusted one (:func:`family_intervals`)."""
    seeds = sorted(set(a) & set(b))
    diffs = np.array([a[s] - b[s] for s in seeds], dtype=np.float64)
    if diffs.size == 0:
        return decide(math.nan, math.nan, gain, 0, planned, converged=converged, lr_interior=lr_interior)
    mean, lo, hi = _t_interval(diffs, level)
    if interval is not None:
        lo, hi = interval
    sd = float(diffs.std(ddof=1)) if diffs.size > 1 else math.nan
    return decide(lo, hi, gain, diffs.size, planned, mean=mean, sd=sd, converged=converged,
                  lr_interior=lr_interior, level=level)


def family_intervals(diffs: Mapping[str, Sequence[float]], level: float = 0.95,
                     method: str = "holm") -> dict[str, tuple[float, float, float]]:
    """Intervals ``{claim: (mean, lo, hi)}`` adjusted for a family of ``m`` claims (each a list of per-seed
    differences).

    - ``"bonferroni"``: every claim at level ``1 - alpha/m`` (``alpha = 1 - level``): simultaneous coverage.
    - ``"holm"``: claims ordered by their two-sided paired-t p-value (smallest first); the ``i``-th (0-based) at
      level ``1 - alpha/(m - i)`` while every earlier one excluded 0; from the first that holds 0 on, every later
      claim takes that claim's level. An interval excludes 0 exactly when Holm's step-down rejects "no difference".
    - ``"none"``: the raw intervals.

    A claim with fewer than two differences gets ``(mean, nan, nan)`` and counts in ``m``.
    """
    from scipy import stats

    _check_level(level)
    if method not in ADJUSTMENTS:
        raise ValueError(f"method must be one of {ADJUSTMENTS}, got {method!r}")
    arrays = {k: np.asarray(v, dtype=np.float64) for k, v in diffs.items()}
    m, alpha = len(arrays), 1 - level
    if method == "none" or m == 0:
        return {k: _t_interval(v, level) if v.size else (math.nan,) * 3 for k, v in arrays.items()}
    if method == "bonferroni":
        return {k: _t_interval(v, 1 - alpha / m) if v.size else (math.nan,) * 3 for k, v in arrays.items()}

    def p_value(v: np.ndarray) -> float:
        if v.size < 2:
            return math.nan
        sd = v.std(ddof=1)
        if sd == 0:
            return 0.0 if v.mean() != 0 else 1.0
        return float(2 * stats.t.sf(abs(v.mean()) / (sd / math.sqrt(v.size)), v.size - 1))

    pvals = {k: p_value(v) for k, v in arrays.items()}
    order = sorted(arrays, key=lambda k: (math.isnan(pvals[k]), pvals[k]))  # untestable claims last
    out: dict[str, tuple[float, float, float]] = {}
    step_alpha, stopped = alpha / m, False
    for i, k in enumerate(order):
        if not stopped:
            step_alpha = alpha / (m - i)
        v = arrays[k]
        out[k] = _t_interval(v, 1 - step_alpha) if v.size else (math.nan,) * 3
        lo, hi = out[k][1], out[k][2]
        if not stopped and (math.isnan(lo) or lo <= 0 <= hi):
            stopped = True
    return {k: out[k] for k in arrays}


# ----------------------------------------------------------------------------------------- convergence, grid place
#: decimals :func:`tail_change` keeps: far below any test set's resolution (1e-4 at 10,000 images), far above the
#: float noise of averaging (about 1e-16), so a change equal to a bound in exact arithmetic compares equal to it
TIE_DECIMALS = 12


def tail_change(rounds: Sequence[float], values: Sequence[float], tail: float = 0.2) -> float:
    """How much a metric still moves at the end of a run: the mean of ``values`` over the last ``tail / 2`` of the
    rounds minus their mean over the ``tail / 2`` before (rounds ``(T (1 - tail/2), T]`` and ``(T (1 - tail),
    T (1 - tail/2)]``, ``T`` the last round). Apply it to a cell's curve averaged over seeds; a protocol states the
    bound below which ``abs(tail_change)`` counts as converged. NaN when a window holds no evaluation.

    The change is rounded to :data:`TIE_DECIMALS` decimals. Accuracies on a finite test set are multiples of one
    over its size, so a seed-mean curve can move by exactly a bound (Fed-CIS v5's C6: 1/200 on 2,000 images over
    10 seeds), and averaging in floating point then lands 1e-16 on either side of it at random. Rounded, such a
    change equals the bound's literal and the protocol's own rule decides the tie ("0.5 pp or more")."""
    if not 0 < tail < 1:
        raise ValueError(f"tail must be in (0, 1), got {tail}")
    r = np.asarray(rounds, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if r.shape != v.shape or r.ndim != 1:
        raise ValueError(f"rounds and values must be 1-D of one length, got {r.shape} and {v.shape}")
    if r.size == 0:
        return math.nan
    end = float(r.max())
    mid, start = end * (1 - tail / 2), end * (1 - tail)
    last, before = v[r > mid], v[(r > start) & (r <= mid)]
    if last.size == 0 or before.size == 0:
        return math.nan
    return round(float(last.mean() - before.mean()), TIE_DECIMALS)


#: the states of :func:`drift_check`, in the order it tests them
DRIFT_STATES = ("not converged", "converged", "drift not resolved")


@dataclass(frozen=True)
class Drift:
    """A cell's convergence check with its own uncertainty (:func:`drift_check`).

    ``mean``: the mean over seeds of each run's :func:`tail_change` (equal to the tail change of the seed-mean curve
    when the runs share their evaluation rounds); ``lo, hi``: its Student-t interval; ``n``: the seeds; ``bound``:
    the protocol's bound; ``state``: one of :data:`DRIFT_STATES`."""

    mean: float
    lo: float
    hi: float
    n: int
    bound: float
    state: str

    @property
    def blocks_verdict(self) -> bool:
        """Only a resolved drift beyond the bound withholds a verdict (the state "not converged")."""
        return self.state == "not converged"


def drift_check(rounds: Sequence[float], runs: Sequence[Sequence[float]], bound: float, tail: float = 0.2,
                level: float = 0.95) -> Drift:
    """Whether a cell still moves at the end of its runs, judged with the noise of its own seeds.

    Each run's :func:`tail_change` (``runs``: one metric series per seed, all at ``rounds``) is a paired difference
    of the same run's last two windows; their mean and ``level`` Student-t interval ``[lo, hi]`` give the state:

    - ``"not converged"`` when the interval lies entirely beyond the bound (``lo > bound`` or ``hi < -bound``): a
      drift larger than the bound is resolved;
    - ``"converged"`` when it lies within ``[-bound, bound]``: any drift is smaller than the bound;
    - ``"drift not resolved"`` otherwise, and with fewer than 2 seeds: the seeds cannot tell.

    A check on the seed-mean curve alone (``abs(tail_change(...)) <= bound``) reads noise as drift once the runs
    fluctuate by more than the bound: its own sampling error is ``t * SD / sqrt(n)`` of the per-run tail changes.
    ``mean`` equals that curve's :func:`tail_change` (a mean of differences is the difference of means), rounded
    as it is.
    """
    if not bound > 0:
        raise ValueError(f"bound must be > 0, got {bound}")
    changes = np.array([tail_change(rounds, run, tail) for run in runs])
    if changes.size and np.isnan(changes).any():
        raise ValueError("every run needs evaluations in both tail windows (a tail_change was NaN)")
    if changes.size < 2:
        mean = float(changes[0]) if changes.size else math.nan  # one run: its own tail_change, rounded already
        return Drift(mean, math.nan, math.nan, int(changes.size), bound, "drift not resolved")
    mean, lo, hi = _t_interval(changes, level)
    mean = round(mean, TIE_DECIMALS)  # the seed-mean curve's tail_change, tie and all
    state = ("not converged" if lo > bound or hi < -bound else
             "converged" if -bound <= lo and hi <= bound else "drift not resolved")
    return Drift(mean, lo, hi, int(changes.size), bound, state)


def grid_place(pick: float, grid: Sequence[float]) -> str:
    """Where a tuned value sits in its grid: ``"interior"``, ``"lower edge"`` or ``"upper edge"`` (a pick at an
    edge means the grid must be extended before the cell gets a verdict)."""
    values = sorted(float(g) for g in grid)
    if len(values) < 3:
        raise ValueError(f"grid must hold at least 3 values to have an interior, got {list(grid)}")
    close = [g for g in values if math.isclose(g, pick, rel_tol=1e-9)]
    if not close:
        raise ValueError(f"pick {pick} is not in the grid {values}")
    return "lower edge" if close[0] == values[0] else "upper edge" if close[0] == values[-1] else "interior"


def censoring_check(method_censored: int, baseline_censored: int, lo: float, hi: float,
                    effect: float | None) -> bool:
    """The convergence check of a first-passage metric (rounds or time to a target), per claim: ``True`` passes.

    Such a metric needs no plateau, only runs that reach the target. A run that never does counts at the horizon,
    which makes its pair's gain a bound: an upper bound when the claim's method's run is censored, a lower bound
    when the baseline's is (both: a gain of either sign). The check fails when a bound points against what the
    paired interval ``[lo, hi]`` asserts: below the paper's ``effect`` (0 when ``None``, a direction-only claim)
    with a baseline run censored, or above 0 with a run of the method censored. An interval holding both 0 and the
    effect asserts nothing, so it passes, and so does an undefined one (NaN ends, as :func:`mean_ci` gives for fewer
    than 2 seeds). ``method_censored`` and ``baseline_censored`` count censored runs over the paired seeds (a pair
    with both censored counts on both sides)."""
    if method_censored < 0 or baseline_censored < 0:
        raise ValueError(f"censored counts must be >= 0, got method_censored={method_censored}, "
                         f"baseline_censored={baseline_censored}")
    bar = 0.0 if effect is None else effect  # a NaN end compares False on both sides: nothing asserted
    return not ((hi < bar and baseline_censored > 0) or (lo > 0 and method_censored > 0))
