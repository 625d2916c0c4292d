"""The decision rule's corners, each worked out by hand: the gaps the ``decision`` mutation chunk found
(docs/testing.md). Every label's reason, every argument check at its edge, the family adjustments' ordering by
p-value, the power search's edges, and the windows of ``tail_change``.

Closed forms used below (no ``scipy.stats``):

- Student-t quantiles: 1 degree of freedom (Cauchy) ``t_{q,1} = tan(pi (q - 1/2))``, so ``t_{0.975,1} = 12.706205``
  and ``t_{0.9875,1} = 25.451695``; 2 degrees of freedom ``t_{q,2} = (2q - 1) / sqrt(2 q (1 - q))``.
- Student-t tails: ``sf_1(t) = 1/2 - atan(t) / pi``; ``sf_2(t) = 1/2 - t / (2 sqrt(t^2 + 2))``; the two-sided
  p-value is ``2 sf``.
- Three differences ``[x - s, x, x + s]`` have mean ``x`` and SD ``s`` (standard error ``s / sqrt 3``); two, ``[x -
  1, x + 1]``, have SD ``sqrt 2`` and standard error ``sqrt 2 / sqrt 2 = 1``, so their half-width is the quantile.

Power is checked against the noncentral t integrated by hand (``_power_by_integration`` of
``test_decision.py``, and :func:`_power_narrow` below for 10,000 seeds, where the chi-square density is too narrow
for an integral over ``[0, inf)``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from lightning_fedhet.experiments.decision import (
    censoring_check,
    decide,
    decide_paired,
    decide_within,
    drift_check,
    family_intervals,
    grid_place,
    power,
    seeds_for_power,
    tail_change,
)
from tests.experiments.test_decision import H95, H975, _power_by_integration

T1_975 = math.tan(math.pi * 0.475)  # 12.706205
T1_9875 = math.tan(math.pi * 0.4875)  # 25.451695


def t2(q: float) -> float:
    """``t_{q,2}`` in closed form."""
    return (2 * q - 1) / math.sqrt(2 * q * (1 - q))


def seeds(values):
    return dict(enumerate(values))


def zeros(n):
    return seeds([0.0] * n)


def is_nan3(interval) -> bool:
    return len(interval) == 3 and all(math.isnan(x) for x in interval)


@pytest.fixture
def no_warnings():
    """numpy's "Mean of empty slice" and "Degrees of freedom <= 0" reach a user's console: none is expected."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _t_quantile(q: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(q, df))


def _first_n_by_integration(sd: float, effect: float, level: float) -> int:
    """The first ``n >= 2`` whose power (integrated by hand) reaches 0.8, by a plain upward scan."""
    for n in range(2, 200):
        if _power_by_integration(sd, effect, n, _t_quantile(0.5 + level / 2, n - 1)) >= 0.8:
            return n
    raise AssertionError("no n below 200")


def _power_narrow(sd: float, effect: float, n: int) -> float:
    """The noncentral t's tail at the 95 % critical value for large ``n``: the chi-square density with ``nu = n - 1``
    lives within ``nu +- 12 sqrt(2 nu)`` (12 standard deviations), which is the range integrated."""
    from scipy import integrate

    nu, delta, critical = n - 1, effect * math.sqrt(n) / sd, _t_quantile(0.975, n - 1)

    def integrand(v: float) -> float:
        log_pdf = (nu / 2 - 1) * math.log(v) - v / 2 - (nu / 2) * math.log(2) - math.lgamma(nu / 2)
        return 0.5 * (1 + math.erf((delta - critical * math.sqrt(v / nu)) / math.sqrt(2))) * math.exp(log_pdf)

    width = 12 * math.sqrt(2 * nu)
    value, _ = integrate.quad(integrand, max(0.0, nu - width), nu + width, limit=400, epsabs=1e-12, epsrel=1e-12)
    return value


# ---------------------------------------------------------------------------------------------------------- decide
def test_every_label_says_its_reason_and_carries_its_numbers():
    """Each branch of ``decide`` with its whole reason; gain ``None`` never gets a power figure."""
    cases = [
        (dict(lo=0.5, hi=2.0, gain=1.0), "reproduced", "the interval lies above 0"),
        (dict(lo=-2.0, hi=-0.5, gain=1.0), "opposite sign", "the interval lies below 0"),
        (dict(lo=-0.5, hi=0.5, gain=1.0), "not reproduced", "the interval holds 0 and excludes the paper's effect"),
        (dict(lo=-0.5, hi=1.5, gain=1.0), "inconclusive", "the interval holds 0 and the paper's effect"),
        (dict(lo=-0.5, hi=1.5, gain=None), "inconclusive", "the interval holds 0"),
    ]
    for kw, label, reason in cases:
        d = decide(kw["lo"], kw["hi"], kw["gain"], 4, 4, mean=0.25)
        assert (d.label, d.reason) == (label, reason)
        assert (d.mean, d.lo, d.hi, d.n, d.planned, d.gain) == (0.25, kw["lo"], kw["hi"], 4, 4, kw["gain"])
        assert d.seeds_for_80 is None  # no sd given: no power figure
    d = decide(1.0, 2.0, 1.0, 3, 5)
    assert (d.label, d.reason) == ("pending", "3 of 5 planned seeds")
    d = decide(1.0, 2.0, 1.0, 5, 5, converged=False)
    assert (d.label, d.reason) == ("not converged", "the cell failed the protocol's convergence check")
    d = decide(1.0, 2.0, 1.0, 5, 5, lr_interior=False)
    assert (d.label, d.reason) == ("lr at grid edge", "a learning rate was picked at its grid's edge")
    assert d.text() == "lr at grid edge" and not d.final
    assert decide(-0.5, 1.5, None, 4, 4, sd=1.0).seeds_for_80 is None  # direction only: no effect to power
    assert decide(-0.5, 1.5, None, 4, 4).text() == "inconclusive"


def test_an_interval_missing_either_end_is_pending():
    """One NaN end is as good as none: ``lo = nan`` or ``hi = nan`` with all the seeds is still pending."""
    assert decide(math.nan, 1.0, 1.0, 5, 5).label == "pending"
    assert decide(1.0, math.nan, 1.0, 5, 5).label == "pending"
    assert decide_within(math.nan, 0.5, 1.0, 5, 5).label == "pending"
    assert decide_within(-0.5, math.nan, 1.0, 5, 5).label == "pending"


def test_the_power_figure_at_the_deciding_level():
    """sd 1, gain 1 at 95 %: power(9 seeds) = 0.748 < 0.8 <= power(10) = 0.803 (integrated by hand), so 10 seeds;
    sd 2, gain 1 at 80 %: the scan by integration; 2 seeds (the fewest) count."""
    n95 = _first_n_by_integration(1.0, 1.0, 0.95)
    assert n95 == 10
    assert decide(-0.5, 1.5, 1.0, 4, 4, sd=1.0).seeds_for_80 == 10
    n80 = _first_n_by_integration(2.0, 1.0, 0.8)
    assert decide(-0.5, 1.5, 1.0, 4, 4, sd=2.0, level=0.8).seeds_for_80 == n80 != _first_n_by_integration(
        2.0, 1.0, 0.95)
    assert decide(1.0, 1.0, 1.0, 2, 2, sd=0.0).seeds_for_80 == 2  # two seeds, no noise


def test_out_of_reach_reads_more_than_ten_thousand():
    """sd 100, gain 0.001: noncentrality at 10,000 seeds is ``0.001 * 100 / 100 = 0.001``, power about 0.025."""
    d = decide(-1.0, 1.0, 0.001, 3, 3, sd=100.0)
    assert d.seeds_for_80 is None
    assert d.text() == "inconclusive (> 10,000 seeds for 80 % power)"


# --------------------------------------------------------------------------------------------------- decide_paired
def test_the_paired_differences_and_their_sd():
    """a = [5, 7, 9], b = [1, 1, 1]: differences [4, 6, 8] (mean 6, SD 2); the 95 % half-width is ``2 * H95 =
    4.968276``: [1.031724, 10.968276], reproduced. At 80 %: ``t_{0.9,2} = 0.8 / sqrt(0.18) = 1.885618``, half-width
    ``1.885618 * 2 / sqrt 3 = 2.177324``; the power figure at that level (sd 2, gain 1)."""
    a, b = seeds([5.0, 7.0, 9.0]), seeds([1.0, 1.0, 1.0])
    d = decide_paired(a, b, 1.0, planned=3)
    assert d.label == "reproduced" and d.mean == pytest.approx(6.0)
    assert (d.lo, d.hi) == pytest.approx((6 - 2 * H95, 6 + 2 * H95), abs=1e-6)
    assert d.seeds_for_80 == _first_n_by_integration(2.0, 1.0, 0.95)
    d = decide_paired(a, b, 1.0, planned=3, level=0.8)
    half = 0.8 / math.sqrt(0.18) * 2 / math.sqrt(3)
    assert (d.lo, d.hi) == pytest.approx((6 - half, 6 + half), abs=1e-6)
    assert d.seeds_for_80 == _first_n_by_integration(2.0, 1.0, 0.8)


def test_one_seed_and_no_seed(no_warnings):
    """One paired seed: mean 2.5 - 0.5 = 2, no interval, no SD, pending (1/3). No common seed: n 0, all NaN."""
    d = decide_paired({0: 2.5}, {0: 0.5}, 1.0, planned=3)
    assert (d.label, d.n, d.mean, d.seeds_for_80) == ("pending", 1, 2.0, None)
    assert math.isnan(d.lo) and math.isnan(d.hi)
    assert d.text() == "pending (1/3 seeds)"
    d = decide_paired({0: 1.0}, {1: 1.0}, 1.0, planned=3)
    assert (d.label, d.n, d.gain, d.planned, d.reason) == ("pending", 0, 1.0, 3, "0 of 3 planned seeds")
    assert math.isnan(d.mean) and math.isnan(d.lo) and math.isnan(d.hi)
    assert d.text() == "pending (0/3 seeds)"


def test_two_seeds_that_agree_need_two_seeds():
    """Differences [1, 1]: SD 0, so the interval is [1, 1] (reproduced) and 2 seeds give any power."""
    d = decide_paired({0: 1.5, 1: 2.5}, {0: 0.5, 1: 1.5}, 1.0, planned=2)
    assert (d.label, d.lo, d.hi, d.seeds_for_80) == ("reproduced", 1.0, 1.0, 2)


def test_two_seeds_use_one_degree_of_freedom():
    """Differences [9, 11]: mean 10, SE 1, half-width ``t_{0.975,1} = 12.706205``: [-2.706205, 22.706205]."""
    d = decide_paired({0: 9.0, 1: 11.0}, zeros(2), 20.0, planned=2)
    assert (d.lo, d.hi) == pytest.approx((10 - T1_975, 10 + T1_975), abs=1e-6)
    assert d.label == "inconclusive"


def test_paired_decisions_pass_the_checks_on():
    a, b = seeds([3.0, 4.0, 5.0]), zeros(3)
    assert decide_paired(a, b, 1.0, planned=3, converged=False).label == "not converged"
    assert decide_paired(a, b, 1.0, planned=3, lr_interior=False).label == "lr at grid edge"


# --------------------------------------------------------------------------------------------------- decide_within
def test_equivalence_labels_their_reasons_and_edges():
    """Margin 1: (-0.2, 0.4) inside; an end exactly on a margin is not inside (open) and not outside (strict)."""
    d = decide_within(-0.2, 0.4, 1.0, 5, 5, mean=0.1)
    assert (d.label, d.mean, d.lo, d.hi, d.n, d.planned, d.gain, d.seeds_for_80, d.reason) == (
        "reproduced", 0.1, -0.2, 0.4, 5, 5, None, None, "the interval lies inside the margin")
    assert decide_within(-3.0, -1.5, 1.0, 5, 5).reason == "the interval lies outside the margin"
    assert decide_within(-3.0, 0.5, 1.0, 5, 5).reason == ("the interval crosses the margin: equivalence neither "
                                                          "shown nor excluded")
    assert decide_within(-0.5, 1.0, 1.0, 5, 5).label == "inconclusive"   # hi == margin
    assert decide_within(-3.0, -1.0, 1.0, 5, 5).label == "inconclusive"  # hi == -margin
    assert decide_within(1.0, 3.0, 1.0, 5, 5).label == "inconclusive"    # lo == margin
    d = decide_within(-0.5, 0.5, 1.0, 4, 5)
    assert (d.label, d.reason) == ("pending", "4 of 5 planned seeds")
    d = decide_within(-0.5, 0.5, 1.0, 5, 5, converged=False)
    assert d.reason == "the cell failed the protocol's convergence check"
    d = decide_within(-0.5, 0.5, 1.0, 5, 5, lr_interior=False)
    assert (d.label, d.reason) == ("lr at grid edge", "a learning rate was picked at its grid's edge")


def test_equivalence_seed_counts_at_their_edges():
    assert decide_within(-0.5, 0.5, 1.0, 0, 1).label == "pending"  # n = 0 and planned = 1 are allowed
    assert decide_within(-0.5, 0.5, 1.0, 1, 1).label == "reproduced"
    with pytest.raises(ValueError, match=r"^n must be >= 0 and planned >= 1, got n=-1, planned=1$"):
        decide_within(-0.5, 0.5, 1.0, -1, 1)
    with pytest.raises(ValueError, match=r"^n must be >= 0 and planned >= 1, got n=0, planned=0$"):
        decide_within(-0.5, 0.5, 1.0, 0, 0)


# --------------------------------------------------------------------------------------------------- power, search
def test_power_refuses_each_argument_at_its_edge():
    with pytest.raises(ValueError, match=r"^sd must be > 0, got 0.0$"):
        power(0.0, 1.0, 5)
    with pytest.raises(ValueError, match=r"^n must be >= 2 seeds, got 1$"):
        power(1.0, 1.0, 1)
    for level in (0.0, 1.0):
        with pytest.raises(ValueError, match=rf"^level must be in \(0, 1\), got {level}$"):
            power(1.0, 1.0, 5, level=level)


def test_seeds_for_power_refuses_each_argument_at_its_edge():
    with pytest.raises(ValueError, match=r"^effect must be > 0, got 0.0$"):
        seeds_for_power(1.0, 0.0)
    for target in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=rf"^target \(power\) must be in \(0, 1\), got {target}$"):
            seeds_for_power(1.0, 1.0, target=target)


def test_seeds_for_power_exact_counts():
    """sd 1, gain 1: 10 seeds (an int); gain 100: already 2 seeds (power at n = 2 is ``P((Z + 141.4) / |Z'| >
    12.7)``, about 1); at level 0.8 (sd 2, gain 1) the scan by integration."""
    n = seeds_for_power(1.0, 1.0)
    assert n == 10 and type(n) is int
    assert seeds_for_power(1.0, 100.0) == 2
    assert _power_by_integration(1.0, 100.0, 2, T1_975) >= 0.8
    assert seeds_for_power(2.0, 1.0, level=0.8) == _first_n_by_integration(2.0, 1.0, 0.8)


def test_seeds_for_power_checks_its_reach_at_the_asked_level():
    """Ten seeds at most, sd 1, gain 1: at 95 % power(10) = 0.803 reaches 0.8, at 99 % (critical ``t_{0.995,9}``)
    it is about 0.50: out of reach."""
    assert _power_by_integration(1.0, 1.0, 10, _t_quantile(0.995, 9)) < 0.8
    assert seeds_for_power(1.0, 1.0, level=0.99, max_seeds=10) is None
    assert seeds_for_power(1.0, 1.0, level=0.95, max_seeds=10) == 10


def test_the_default_reach_is_ten_thousand_seeds():
    """Gain/SD ratio 0.0280178: power(10,000) = 0.79998 < 0.8 <= power(10,001) = 0.80002 (integrated by hand), so
    the first n is 10,001, beyond the default ``max_seeds`` (what ``Decision.text`` prints as "> 10,000")."""
    r = 0.0280178
    assert _power_narrow(1.0, r, 10_000) < 0.8 <= _power_narrow(1.0, r, 10_001)
    assert seeds_for_power(1.0, r) is None
    assert seeds_for_power(1.0, r, max_seeds=10_001) == 10_001


# ------------------------------------------------------------------------------------------------ family intervals
def test_holm_orders_by_the_paired_t_p_value_not_by_name():
    """"b" [3, 4, 5]: t = 4 sqrt 3 = 6.928203, p = 2 sf_2 = 1 - 6.928203 / sqrt 50 = 0.020204. "a" [9, 11]: t = 10 /
    1 = 10, p = 2 sf_1 = 1 - 2 atan(10) / pi = 0.063451. So "b" first at alpha/2: [0.417, 7.583] excludes 0, and "a"
    at alpha: 10 +- t_{0.975,1} = [-2.706, 22.706]. (Ordering by t / n, by t x SE^2, by name, or with n degrees of
    freedom puts "a" first, whose alpha/2 interval 10 +- 25.45 holds 0 and keeps "b" at alpha/2 too.)"""
    claims = {"a": [9.0, 11.0], "b": [3.0, 4.0, 5.0]}
    for out in (family_intervals(claims, method="holm"), family_intervals(claims)):  # holm is the default
        assert out["b"] == pytest.approx((4.0, 4 - H975, 4 + H975), abs=1e-6)
        assert out["a"] == pytest.approx((10.0, 10 - T1_975, 10 + T1_975), abs=1e-6)


def test_holm_ranks_a_two_seed_claim_by_its_p_value():
    """"T" [99, 101]: t = 100, p = 1 - 2 atan(100) / pi = 0.006366; "C" [1, 2, 3]: t = 2 sqrt 3, p = 1 - 3.464102 /
    sqrt 14 = 0.074180. "T" first at alpha/2: 100 +- 25.451695 excludes 0, so "C" at alpha: 2 +- H95."""
    out = family_intervals({"C": [1.0, 2.0, 3.0], "T": [99.0, 101.0]}, method="holm")
    assert out["T"] == pytest.approx((100.0, 100 - T1_9875, 100 + T1_9875), abs=1e-6)
    assert out["C"] == pytest.approx((2.0, 2 - H95, 2 + H95), abs=1e-6)


def test_holm_with_claims_of_zero_spread():
    """Constant differences have SD 0: p = 0 when their mean is not 0 (they go first), 1 when it is (last).

    "K" [0.5] x 3 (p 0) first at alpha/2: [0.5, 0.5] excludes 0, so "C" [1, 2, 3] at alpha: 2 +- H95.
    "A" [9, 10, 11] (t = 10 sqrt 3, p = 1 - 17.320508 / sqrt 302 = 0.003314), "B" [3, 4, 5] (p 0.020204), "Z" [0] x 3
    (p 1): A at alpha/3 (``t_{1 - 0.05/6, 2} = 7.648826``, half-width 4.416051) excludes 0, B at alpha/2 excludes
    0 (lo 0.417), Z at alpha is [0, 0]."""
    out = family_intervals({"C": [1.0, 2.0, 3.0], "K": [0.5, 0.5, 0.5]}, method="holm")
    assert out["K"] == pytest.approx((0.5, 0.5, 0.5))
    assert out["C"] == pytest.approx((2.0, 2 - H95, 2 + H95), abs=1e-6)
    out = family_intervals({"Z": [0.0, 0.0, 0.0], "A": [9.0, 10.0, 11.0], "B": [3.0, 4.0, 5.0]}, method="holm")
    half3 = t2(1 - 0.05 / 6) / math.sqrt(3)
    assert out["A"] == pytest.approx((10.0, 10 - half3, 10 + half3), abs=1e-6)
    assert out["B"] == pytest.approx((4.0, 4 - H975, 4 + H975), abs=1e-6)
    assert out["Z"] == (0.0, 0.0, 0.0)


def test_holm_stops_at_an_interval_that_touches_zero():
    """"Z" [0, 0, 0] and "N" [-1, 0, 1] both have p = 1 (kept in the caller's order). Z's interval [0, 0] holds 0
    (``lo <= 0 <= hi`` with both ends 0), so Holm stops there and N keeps alpha/2: 0 +- H975 (not alpha's H95)."""
    out = family_intervals({"Z": [0.0, 0.0, 0.0], "N": [-1.0, 0.0, 1.0]}, method="holm")
    assert out["N"] == pytest.approx((0.0, -H975, H975), abs=1e-6)


@pytest.mark.parametrize("method", ["none", "bonferroni", "holm"])
def test_no_claims_and_a_claim_without_seeds(method, no_warnings):
    """An empty family gives ``{}``; a claim with no difference gives three NaNs, silently, and counts in ``m``."""
    assert family_intervals({}, method=method) == {}
    out = family_intervals({"E": [], "A": [3.0, 4.0, 5.0]}, method=method)
    assert is_nan3(out["E"])
    half = H95 if method == "none" else H975
    assert out["A"] == pytest.approx((4.0, 4 - half, 4 + half), abs=1e-6)


def test_none_gives_the_raw_interval_of_every_claim():
    """"none" with two claims: A [3, 4, 5] raw 4 +- H95 (Holm would give it alpha/2: H975)."""
    out = family_intervals({"A": [3.0, 4.0, 5.0], "B": [1.0, 2.0, 3.0]}, method="none")
    assert out["A"] == pytest.approx((4.0, 4 - H95, 4 + H95), abs=1e-6)


# ------------------------------------------------------------------------------------------- tail change, grid place
def test_tail_change_windows_by_hand(no_warnings):
    """Rounds 1..100, tail 0.2: last window (90, 100], the one before (80, 90]. Values 1 at rounds 91-93, else 0:
    3/10 - 0/10 = 0.3. A window with no evaluation gives NaN without a warning; so does no evaluation at all."""
    rounds = list(range(1, 101))
    values = [1.0 if 91 <= r <= 93 else 0.0 for r in rounds]
    assert tail_change(rounds, values) == pytest.approx(0.3)
    assert math.isnan(tail_change([10, 100], [0.5, 0.6]))  # (80, 90] holds no round
    assert math.isnan(tail_change([], []))


def test_tail_change_refuses_bad_input():
    with pytest.raises(ValueError, match=r"^tail must be in \(0, 1\), got 0.0$"):
        tail_change([1, 2], [1, 2], tail=0.0)
    with pytest.raises(ValueError, match=r"^rounds and values must be 1-D of one length, got \(3,\) and \(2,\)$"):
        tail_change([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match=r"got \(1, 2\) and \(1, 2\)$"):
        tail_change([[1, 2]], [[1, 2]])


def test_grid_place_of_three_values_and_its_error():
    assert grid_place(0.1, [0.01, 0.1, 1.0]) == "interior"
    with pytest.raises(ValueError, match=r"^grid must hold at least 3 values to have an interior, got \[0.1, 1.0\]$"):
        grid_place(0.1, [0.1, 1.0])


# ----------------------------------------------------------------------------------------- float32 inputs, equality
F32 = [2.0**24, 1.0, 1.0]  # 2^24 + 2 = 16,777,218 is exact in float64: mean 5,592,406; float32 gives 5,592,405.5


def test_float32_metrics_are_averaged_in_float64():
    """float32 rounds ``2^24 + 1`` down to ``2^24`` (24-bit significand), so a float32 mean of [2^24, 1, 1] is
    5,592,405.5 where the float64 mean is exactly 16,777,218 / 3 = 5,592,406: differences, claims and curves handed
    over as float32 (numpy or torch metrics) are averaged in float64."""
    a = {k: np.float32(x) for k, x in enumerate(F32)}
    b = {k: np.float32(0.0) for k in range(3)}
    assert decide_paired(a, b, None, planned=3).mean == 5_592_406.0
    assert family_intervals({"A": np.array(F32, dtype=np.float32)}, method="none")["A"][0] == 5_592_406.0
    # rounds 1..30, tail 0.2: last window (27, 30] holds the three values, the one before (24, 27] zeros
    values = np.array([0.0] * 27 + F32, dtype=np.float32)
    assert tail_change(list(range(1, 31)), values) == 5_592_406.0


def test_tail_change_edges_are_those_of_the_float_tail():
    """tail 0.8 is stored as 0.8000000000000000444, so with rounds 1..10 the earlier window starts at ``10 (1 -
    tail) = 1.9999999999999996`` and holds round 2 (up to mid = 6); a float32 comparison would round the start to
    2.0 and drop it. Value 1 at round 2 only: last window (6, 10] mean 0, before (2 - 4e-16, 6] mean 1/5: -0.2,
    whether the rounds come as ints or as float32."""
    assert 10 * (1 - 0.8) < 2
    values = [1.0 if r == 2 else 0.0 for r in range(1, 11)]
    assert tail_change(list(range(1, 11)), values, tail=0.8) == pytest.approx(-0.2)
    assert tail_change(np.arange(1, 11, dtype=np.float32), values, tail=0.8) == pytest.approx(-0.2)


def test_a_change_equal_to_the_bound_in_exact_arithmetic_equals_the_bound():
    """Three seeds on 2,000 test images, evaluated at rounds 18 and 20 (tail 0.2: windows (16, 18] and (18, 20]).
    One seed gains 30 images, so the seed-mean moves by 30 / 2000 / 3 = 1/200 = 0.5 pp exactly; averaged in
    floats the difference is 0.004999999999999893, below a 0.5 pp bound by noise. The change compares equal to
    the bound's literal, so a rule "0.5 pp or more fails" and one "at most 0.5 pp passes" both see the tie."""
    runs = [[1380 / 2000, 1410 / 2000], [1380 / 2000, 1380 / 2000], [1400 / 2000, 1400 / 2000]]
    curve = np.mean(runs, axis=0)
    assert float(curve[1] - curve[0]) < 0.005  # the noise this guards against
    change = tail_change([18, 20], curve)
    assert change == 0.005 and abs(change) >= 0.005 and abs(change) <= 0.005
    assert tail_change([18, 20], 1 - curve) == -0.005
    # drift_check's mean is the same number (a mean of differences is the difference of means), tie kept: runs
    # moving by +4, -9 and +35 images (30 in all) have per-run changes whose float mean is 0.005000000000000001
    runs = [[1380 / 2000, 1384 / 2000], [1390 / 2000, 1381 / 2000], [1400 / 2000, 1435 / 2000]]
    assert float(np.mean([r[1] - r[0] for r in runs])) != 0.005  # the noise this guards against
    assert drift_check([18, 20], runs, 0.005).mean == 0.005 == tail_change([18, 20], np.mean(runs, axis=0))
    # what rounding keeps: a change 1e-10 off the bound is not a tie
    assert tail_change([18, 20], [0.5, 0.5 + 0.005 - 1e-10]) < 0.005


def test_a_power_exactly_at_the_target_is_enough():
    """"With probability at least ``target``": a target equal to the power of 10 seeds is met by 10 seeds, whether
    10 is found by the search or is the reach itself."""
    target = power(1.0, 1.0, 10)
    assert seeds_for_power(1.0, 1.0, target=target) == 10
    assert seeds_for_power(1.0, 1.0, target=target, max_seeds=10) == 10


@pytest.mark.parametrize(("method_c", "baseline_c", "lo", "hi", "effect", "passes"), [
    (0, 0, -0.6, -0.4, 0.43, True),    # nothing censored: nothing to bound
    (3, 0, -0.6, -0.4, 0.43, True),    # below 0, the method censored: each such gain is an upper bound, consistent
    (0, 1, -0.6, -0.4, 0.43, False),   # below 0, a baseline censored: a lower bound, against the interval's side
    (0, 1, 0.05, 0.3, 0.43, False),    # below the effect (not reproduced) with a baseline censored: fails too
    (0, 1, 0.5, 0.7, 0.43, True),      # above the effect and 0: a lower bound only strengthens it
    (1, 0, 0.5, 0.7, 0.43, False),     # above 0, the method censored: an upper bound, against the interval's side
    (1, 0, 0.1, 0.3, 0.43, False),     # above 0 though below the effect: reproduced, so the same holds
    (1, 1, -0.2, 0.6, 0.43, True),     # holds 0 and the effect: asserts nothing
    (0, 1, -0.3, -0.1, None, False),   # direction only: "below" means below 0
    (0, 1, -0.1, 0.3, None, True),     # direction only, holding 0
    (0, 1, -0.1, 0.43, 0.43, True),    # hi at the effect: the effect is inside (decide's not reproduced is hi < g)
    (1, 0, 0.0, 0.3, 0.43, True),      # lo at 0: 0 is inside (decide's reproduced is lo > 0)
    (1, 1, math.nan, math.nan, 0.43, True),  # no interval yet (fewer than 2 seeds): asserts nothing
])
def test_censoring_passes_when_no_bound_points_against_the_interval(method_c, baseline_c, lo, hi, effect, passes):
    """The convergence check of a first-passage metric, case by case (a censored run of the claim's method makes
    its pair's gain an upper bound, one of the baseline a lower bound)."""
    assert censoring_check(method_c, baseline_c, lo, hi, effect) is passes


def test_censoring_check_refuses_a_negative_count():
    with pytest.raises(ValueError, match="baseline_censored=-1"):
        censoring_check(0, -1, 0.1, 0.2, None)
