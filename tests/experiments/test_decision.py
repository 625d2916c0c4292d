"""The decision rule (``lightning_fedhet.experiments.decision``) against intervals worked out by hand and power from
an independent noncentral-t computation.

Hand arithmetic used below. With 3 seeds the t quantile has a closed form (2 degrees of freedom):
``t_{q, 2} = (2q - 1) / sqrt(2 q (1 - q))``, so ``t_{0.975, 2} = 0.95 / sqrt(0.04875) = 4.302653`` and
``t_{0.9875, 2} = 0.975 / sqrt(0.0246875) = 6.205347``. Differences ``[x - 1, x, x + 1]`` have mean ``x`` and
standard deviation 1, so the 95 % half-width is ``4.302653 / sqrt(3) = 2.484138`` and the 97.5 % (Bonferroni, two
claims) half-width is ``6.205347 / sqrt(3) = 3.582659``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_fedhet.experiments.decision import (
    LABELS,
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

H95 = 0.95 / math.sqrt(0.04875) / math.sqrt(3)  # 2.484138
H975 = 0.975 / math.sqrt(0.0246875) / math.sqrt(3)  # 3.582659


def seeds(values):
    return dict(enumerate(values))


def zeros(n):
    return seeds([0.0] * n)


@pytest.mark.parametrize(("diffs", "gain", "label", "lo", "hi"), [
    ([3, 4, 5], 1.0, "reproduced", 4 - H95, 4 + H95),          # [1.516, 6.484]: above 0
    ([3, 4, 5], 50.0, "reproduced", 4 - H95, 4 + H95),         # above 0 even though the paper's effect is larger
    ([-5, -4, -3], 1.0, "opposite sign", -4 - H95, -4 + H95),  # [-6.484, -1.516]: below 0
    ([1, 2, 3], 5.0, "not reproduced", 2 - H95, 2 + H95),      # [-0.484, 4.484]: holds 0, below g = 5
    ([1, 2, 3], 4.0, "inconclusive", 2 - H95, 2 + H95),        # holds 0 and g = 4
    ([1, 2, 3], None, "inconclusive", 2 - H95, 2 + H95),       # direction only: holds 0
])
def test_labels_from_hand_computed_intervals(diffs, gain, label, lo, hi):
    d = decide_paired(seeds(diffs), zeros(3), gain, planned=3)
    assert d.label == label
    assert d.lo == pytest.approx(lo, abs=1e-5) and d.hi == pytest.approx(hi, abs=1e-5)
    assert d.mean == pytest.approx(sum(diffs) / 3) and d.n == 3
    assert d.final


def test_pending_before_the_planned_seeds_whatever_the_interval():
    d = decide_paired(seeds([3, 4, 5]), zeros(3), 1.0, planned=5)  # resolved, but 3 of 5 seeds
    assert d.label == "pending" and not d.final
    assert d.text() == "pending (3/5 seeds)"
    assert decide_paired({}, {}, 1.0, planned=5).label == "pending"
    assert decide_paired(seeds([1.0]), zeros(1), 1.0, planned=1).label == "pending"  # one seed: no interval


def test_seeds_only_both_methods_ran_are_paired():
    a, b = {0: 3.0, 1: 4.0, 2: 5.0, 7: 100.0}, {0: 0.0, 1: 0.0, 2: 0.0, 9: -100.0}
    d = decide_paired(a, b, 1.0, planned=3)
    assert d.n == 3 and d.mean == pytest.approx(4.0)


def test_convergence_and_grid_edge_withhold_a_verdict_but_pending_comes_first():
    assert decide(1.0, 2.0, 0.5, 10, 10, converged=False).label == "not converged"
    assert decide(1.0, 2.0, 0.5, 10, 10, lr_interior=False).label == "lr at grid edge"
    assert decide(1.0, 2.0, 0.5, 3, 10, converged=False).label == "pending"


def test_boundaries_are_strict():
    # lo == 0 is not "above 0"; hi == g is not "below g"
    assert decide(0.0, 2.0, 3.0, 5, 5).label == "not reproduced"
    assert decide(0.0, 3.0, 3.0, 5, 5).label == "inconclusive"
    assert decide(-2.0, 0.0, 3.0, 5, 5).label == "not reproduced"
    assert decide(1e-12, 2.0, 3.0, 5, 5).label == "reproduced"
    assert decide(-2.0, -1e-12, 3.0, 5, 5).label == "opposite sign"


def test_inconclusive_says_the_seeds_for_80_percent_power():
    # diffs [1, 2, 3]: sd 1; g = 4 -> an independent search below gives the same n
    d = decide_paired(seeds([1, 2, 3]), zeros(3), 4.0, planned=3)
    assert d.seeds_for_80 == seeds_for_power(1.0, 4.0)
    assert d.text() == f"inconclusive ({d.seeds_for_80} seeds for 80 % power)"


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="gain"):
        decide(0.0, 1.0, 0.0, 3, 3)
    with pytest.raises(ValueError, match="planned"):
        decide(0.0, 1.0, 1.0, 3, 0)
    with pytest.raises(ValueError, match="effect"):
        seeds_for_power(1.0, -1.0)
    with pytest.raises(ValueError, match="level"):
        power(1.0, 1.0, 5, level=1.5)
    with pytest.raises(ValueError, match="method"):
        family_intervals({"a": [1, 2, 3]}, method="sidak")
    assert set(LABELS) >= {"reproduced", "opposite sign", "not reproduced", "inconclusive", "pending"}


# ------------------------------------------------------------------------------------------------ family intervals
def test_bonferroni_widens_every_claim_to_level_one_minus_alpha_over_m():
    out = family_intervals({"A": [3, 4, 5], "B": [1, 2, 3]}, method="bonferroni")
    assert out["A"] == pytest.approx((4.0, 4 - H975, 4 + H975), abs=1e-5)
    assert out["B"] == pytest.approx((2.0, 2 - H975, 2 + H975), abs=1e-5)
    raw = family_intervals({"A": [3, 4, 5], "B": [1, 2, 3]}, method="none")
    assert raw["B"] == pytest.approx((2.0, 2 - H95, 2 + H95), abs=1e-5)


def test_holm_steps_down_while_claims_exclude_zero():
    # A (t = 4 sqrt 3 = 6.93) before B (t = 2 sqrt 3 = 3.46). A at alpha/2: [0.417, 7.583] excludes 0, so B at
    # alpha/1: the raw [-0.484, 4.484].
    out = family_intervals({"B": [1, 2, 3], "A": [3, 4, 5]}, method="holm")
    assert out["A"] == pytest.approx((4.0, 4 - H975, 4 + H975), abs=1e-5)
    assert out["B"] == pytest.approx((2.0, 2 - H95, 2 + H95), abs=1e-5)
    assert list(out) == ["B", "A"]  # the caller's order


def test_holm_stops_at_the_first_claim_that_holds_zero():
    # A [1, 2, 3] (t 3.46) first at alpha/2: [-1.583, 5.583] holds 0, so B [0, 1, 2] (t 1.73) keeps alpha/2 too
    out = family_intervals({"A": [1, 2, 3], "B": [0, 1, 2]}, method="holm")
    assert out["A"] == pytest.approx((2.0, 2 - H975, 2 + H975), abs=1e-5)
    assert out["B"] == pytest.approx((1.0, 1 - H975, 1 + H975), abs=1e-5)


def test_an_adjusted_interval_decides_when_given():
    # raw [1.516, 6.484] is "reproduced" for g = 5; with a fourfold family
    # (alpha/4, q = 0.99375: t = 0.9875 / sqrt(2 * 0.99375 * 0.00625) = 8.860, half 5.115) [-1.1, 9.1] holds 0 and 5
    t4 = 0.9875 / math.sqrt(2 * 0.99375 * 0.00625)
    out = family_intervals({"A": [3, 4, 5], "B": [0, 0, 0.1], "C": [0, 0.1, 0], "D": [0.1, 0, 0]},
                           method="bonferroni")
    assert out["A"][1] == pytest.approx(4 - t4 / math.sqrt(3), abs=1e-4)
    d = decide_paired(seeds([3, 4, 5]), zeros(3), 5.0, planned=3, interval=out["A"][1:])
    assert d.label == "inconclusive" and d.mean == pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------------------- power
def _power_by_integration(sd: float, effect: float, n: int, critical: float) -> float:
    """P(T > c) for T = (Z + delta) / sqrt(V / nu), V ~ chi2(nu), delta = effect sqrt(n) / sd: the noncentral t's
    definition, integrated over V with the chi-square density and the normal CDF written out (no scipy.stats)."""
    from scipy import integrate

    nu, delta = n - 1, effect * math.sqrt(n) / sd

    def chi2_pdf(v: float) -> float:
        return math.exp((nu / 2 - 1) * math.log(v) - v / 2 - (nu / 2) * math.log(2) - math.lgamma(nu / 2))

    def integrand(v: float) -> float:
        z = delta - critical * math.sqrt(v / nu)
        return 0.5 * (1 + math.erf(z / math.sqrt(2))) * chi2_pdf(v)

    value, _ = integrate.quad(integrand, 0, math.inf, limit=200)
    return value


@pytest.mark.parametrize(("sd", "effect", "n"), [(1.0, 1.0, 10), (2.0, 0.5, 30), (0.92, 0.75, 14), (1.0, 4.0, 3)])
def test_power_equals_the_noncentral_t_integrated_by_hand(sd, effect, n):
    from scipy import stats

    critical = 0.95 / math.sqrt(0.04875) if n == 3 else float(stats.t.ppf(0.975, n - 1))
    assert power(sd, effect, n) == pytest.approx(_power_by_integration(sd, effect, n, critical), abs=1e-6)


def test_power_by_simulation():
    """200,000 simulated 10-seed experiments with true gain 1 and SD 1: the share whose 95 % interval lies above 0
    is the power (binomial standard error 0.0009; tolerance 4 of them)."""
    from scipy import stats

    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, size=(200_000, 10))
    t = x.mean(1) / (x.std(1, ddof=1) / math.sqrt(10))
    share = float((t > stats.t.ppf(0.975, 9)).mean())
    assert power(1.0, 1.0, 10) == pytest.approx(share, abs=0.0036)


@pytest.mark.parametrize(("sd", "effect"), [(1.0, 1.0), (0.92, 0.75), (2.022, 0.8), (0.373, 0.31)])
def test_seeds_for_power_is_the_first_n_reaching_80_percent(sd, effect):
    from scipy import stats

    n = seeds_for_power(sd, effect)
    assert n is not None and n >= 2
    assert _power_by_integration(sd, effect, n, float(stats.t.ppf(0.975, n - 1))) >= 0.8 - 1e-9
    if n > 2:
        assert _power_by_integration(sd, effect, n - 1, float(stats.t.ppf(0.975, n - 2))) < 0.8


def test_seeds_for_power_beyond_reach_and_without_noise():
    assert seeds_for_power(100.0, 0.001, max_seeds=1000) is None
    assert seeds_for_power(0.0, 1.0) == 2
    assert seeds_for_power(math.nan, 1.0) is None


def test_equivalence_claims_within_a_margin():
    # v2's UPGA-PL U2, -4.7 [-9.0, -0.4] pp against a 1 pp margin: neither inside nor wholly outside
    assert decide_within(-9.0, -0.4, 1.0, 10, 10).label == "inconclusive"
    assert decide_within(-0.9, 0.9, 1.0, 10, 10).label == "reproduced"
    assert decide_within(-1.0, 0.5, 1.0, 10, 10).label == "inconclusive"  # the margin is open
    assert decide_within(-9.0, -1.1, 1.0, 10, 10).label == "not reproduced"
    assert decide_within(1.1, 3.0, 1.0, 10, 10).label == "not reproduced"
    assert decide_within(-0.5, 0.5, 1.0, 9, 10).label == "pending"
    assert decide_within(-0.5, 0.5, 1.0, 10, 10, converged=False).label == "not converged"
    with pytest.raises(ValueError, match="margin"):
        decide_within(-0.5, 0.5, 0.0, 10, 10)


def test_an_equivalence_interval_that_excludes_0_says_the_sign_is_resolved():
    # UPGA-PL v4's U2: -3.4 [-6.5, -0.2] pp against a 1 pp margin crosses -1 (inconclusive) but lies below 0: the
    # page must report the resolved sign. [0.2, 1.5] likewise above 0; [-1.5, 0.5] holds 0: nothing to add.
    below = decide_within(-6.5, -0.2, 1.0, 20, 20, mean=-3.4)
    assert below.label == "inconclusive" and below.text() == "inconclusive (a gap below 0 is resolved)"
    assert below.reason == ("the interval crosses the margin but lies below 0: a gap is resolved, its size against "
                            "the margin is not")
    assert decide_within(0.2, 1.5, 1.0, 20, 20).text() == "inconclusive (a gap above 0 is resolved)"
    held = decide_within(-1.5, 0.5, 1.0, 20, 20)
    assert held.text() == "inconclusive" and held.reason.endswith("equivalence neither shown nor excluded")
    assert decide_within(-0.0, 1.5, 1.0, 20, 20).text() == "inconclusive"  # touching 0 is not excluding it


def test_tail_change_compares_the_last_tenth_with_the_tenth_before():
    # rounds 10, 20, ..., 100 (T = 100, tail 0.2): last window (90, 100] holds round 100, the one before (80, 90]
    # holds round 90. values = round / 100 -> 1.0 - 0.9 = 0.1
    rounds = list(range(10, 101, 10))
    assert tail_change(rounds, [r / 100 for r in rounds]) == pytest.approx(0.1)
    # tail 0.4: (80, 100] -> rounds 90, 100 (mean 0.95); (60, 80] -> rounds 70, 80 (mean 0.75)
    assert tail_change(rounds, [r / 100 for r in rounds], tail=0.4) == pytest.approx(0.2)
    assert tail_change(rounds, [0.5] * 10) == 0.0
    assert math.isnan(tail_change([100], [0.5]))
    with pytest.raises(ValueError, match="tail"):
        tail_change(rounds, rounds, tail=1.0)


def _runs_with_tail_changes(changes):
    # rounds 10, ..., 100: each run flat at 0 up to round 90 and at `change` at round 100, so its tail_change (tail
    # 0.2: round 100 minus round 90) is `change`
    rounds = list(range(10, 101, 10))
    return rounds, [[0.0] * 9 + [c] for c in changes]


def test_drift_check_states_from_the_interval_of_the_runs_tail_changes():
    # changes 1, 2, 3: mean 2, SD 1, 95 % half-width H95 = 2.484 -> [-0.484, 4.484]
    rounds, runs = _runs_with_tail_changes([1.0, 2.0, 3.0])
    d = drift_check(rounds, runs, bound=0.5)
    assert (d.mean, d.lo, d.hi, d.n, d.bound) == pytest.approx((2.0, 2.0 - H95, 2.0 + H95, 3, 0.5))
    assert d.state == "drift not resolved" and not d.blocks_verdict  # straddles 0.5: the seeds cannot tell
    # the point estimate equals the seed-mean curve's tail change (what a check on the mean curve alone reads)
    assert d.mean == pytest.approx(tail_change(rounds, np.mean(runs, axis=0)))
    assert drift_check(rounds, runs, bound=5.0).state == "converged"  # [-0.48, 4.48] inside [-5, 5]
    # 10, 11, 12: [8.516, 13.484], all above 1 -> resolved drift; and its mirror below -1
    assert drift_check(*_runs_with_tail_changes([10.0, 11.0, 12.0]), bound=1.0).state == "not converged"
    down = drift_check(*_runs_with_tail_changes([-10.0, -11.0, -12.0]), bound=1.0)
    assert down.state == "not converged" and down.blocks_verdict
    # 1.0 = 1.0 = 1.0 (SD 0): the interval is [1, 1], on the bound: within it (inclusive), not beyond it (strict)
    assert drift_check(*_runs_with_tail_changes([1.0, 1.0, 1.0]), bound=1.0).state == "converged"
    assert drift_check(*_runs_with_tail_changes([1.5, 1.5, 1.5]), bound=1.0).state == "not converged"
    # a 99 % interval is wider: 1, 2, 3 at bound 2.4 -> 95 % [-0.48, 4.48] straddles; 10, 11, 12 at 99 %:
    # t_{0.995,2} = 0.99 / sqrt(0.00995) = 9.925, half-width 5.730 -> [5.27, 16.73], still beyond 1
    wide = drift_check(*_runs_with_tail_changes([10.0, 11.0, 12.0]), bound=1.0, level=0.99)
    assert wide.lo == pytest.approx(11.0 - 0.99 / math.sqrt(0.00995) / math.sqrt(3))


def test_drift_check_edges_of_the_bound_the_tail_and_the_seed_count():
    # [-1, -1] on the lower bound: within [-1, 1] (inclusive), not beyond it (strict)
    low = drift_check(*_runs_with_tail_changes([-1.0, -1.0, -1.0]), bound=1.0)
    assert low.state == "converged" and low.bound == 1.0
    # two seeds are enough for an interval: 1, 3 -> mean 2, SD sqrt(2), t_{0.975,1} = 12.706 -> [-10.71, 14.71]
    two = drift_check(*_runs_with_tail_changes([1.0, 3.0]), bound=1.0)
    assert (two.n, two.lo, two.hi) == pytest.approx((2, 2.0 - 12.7062047, 2.0 + 12.7062047))
    # the tail is passed on: rounds 10..100 rising by 1 a round -> tail 0.2: 10 (round 100 - round 90); tail 0.4:
    # mean(90, 100) - mean(70, 80) = 20, for every run alike (SD 0)
    rounds = list(range(10, 101, 10))
    rising = [[float(r) for r in rounds]] * 3
    assert drift_check(rounds, rising, bound=1.0).mean == pytest.approx(10.0)
    assert drift_check(rounds, rising, bound=1.0, tail=0.4).mean == pytest.approx(20.0)


def test_drift_check_with_too_few_seeds_or_bad_input():
    one = drift_check(*_runs_with_tail_changes([0.375]), bound=1.0)  # a fraction: its decimals are kept
    assert (one.mean, one.n, one.state, one.bound) == (0.375, 1, "drift not resolved", 1.0)
    assert math.isnan(one.lo) and math.isnan(one.hi)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "mean of empty slice" on the way
        none = drift_check(list(range(10, 101, 10)), [], bound=1.0)
    assert none.n == 0 and math.isnan(none.mean) and none.state == "drift not resolved"
    with pytest.raises(ValueError, match="bound"):
        drift_check(*_runs_with_tail_changes([1.0, 2.0]), bound=0.0)
    message = r"^every run needs evaluations in both tail windows \(a tail_change was NaN\)$"
    with pytest.raises(ValueError, match=message):
        drift_check([100], [[0.5], [0.6]], bound=1.0)


def test_grid_place():
    grid = [0.01, 0.0316, 0.1, 0.316]
    assert grid_place(0.1, grid) == "interior"
    assert grid_place(0.316, grid) == "upper edge"
    assert grid_place(0.01, list(reversed(grid))) == "lower edge"
    with pytest.raises(ValueError, match="not in the grid"):
        grid_place(0.2, grid)
