"""Protocol v2's records under the v3 rule (scripts/studies/_v3.py): the labels, the Holm intervals beside them and
the wording of a registered "not testable here", against intervals worked out by hand.

With 3 seeds the t quantile has a closed form (2 degrees of freedom): ``t_{q, 2} = (2q - 1) / sqrt(2 q (1 - q))``,
so ``t_{0.975, 2} = 0.95 / sqrt(0.04875) = 4.302653`` and ``t_{0.9875, 2} = 0.975 / sqrt(0.0246875) = 6.205347``.
Differences ``[x - 1, x, x + 1]`` have standard deviation 1, so the 95 % half-width is ``4.302653 / sqrt(3) =
2.484138`` and the 97.5 % one (Holm's first step in a family of two) ``6.205347 / sqrt(3) = 3.582659``.
"""

import dataclasses
import math

import pytest
from studies import _v3

from lightning_fedhet.experiments import Summary, decide

H95 = 0.95 / math.sqrt(0.04875) / math.sqrt(3)  # 2.484138
H975 = 0.975 / math.sqrt(0.0246875) / math.sqrt(3)  # 3.582659


def diffs(*values):
    """``(a, b)`` per seed with ``a - b`` = ``values``."""
    return dict(enumerate(values)), dict.fromkeys(range(len(values)), 0.0)


def test_holm_widens_the_first_claim_and_leaves_the_last_at_95_percent():
    # A = [3, 4, 5] (t = 4 sqrt 3 = 6.93) comes first: level 97.5 %, [4 - 3.583, 4 + 3.583] = [0.417, 7.583] excludes
    # 0, so B = [1, 2, 3] (t = 3.46) gets 95 %: [-0.484, 4.484], its raw interval
    out = _v3.relabel({"A": (*diffs(3, 4, 5), 1.0), "B": (*diffs(1, 2, 3), 5.0)}, planned=3)
    a, b = out["A"], out["B"]
    assert a.family == b.family == 2
    assert (a.raw.lo, a.raw.hi) == pytest.approx((4 - H95, 4 + H95), abs=1e-5)
    assert (a.adjusted.lo, a.adjusted.hi) == pytest.approx((4 - H975, 4 + H975), abs=1e-5)
    assert (b.adjusted.lo, b.adjusted.hi) == pytest.approx((2 - H95, 2 + H95), abs=1e-5)
    assert a.raw.label == a.adjusted.label == "reproduced"
    assert b.raw.label == b.adjusted.label == "not reproduced"  # 4.484 < 5: the paper's effect is excluded


def test_a_label_the_holm_interval_would_change_is_shown_beside_the_raw_one():
    # A = [1.6, 2.6, 3.6]: raw [0.116, 5.084] above 0; first in Holm's order (C = [-1, 0, 1] has p = 1) at 97.5 %:
    # [-0.983, 6.183] holds 0 and lies below g = 10, and C takes the same level: [-3.583, 3.583]
    out = _v3.relabel({"A": (*diffs(1.6, 2.6, 3.6), 10.0), "C": (*diffs(-1, 0, 1), None)}, planned=3)
    assert out["A"].raw.label == "reproduced" and out["A"].adjusted.label == "not reproduced"
    assert out["A"].adjusted.hi == pytest.approx(2.6 + H975, abs=1e-5)
    assert (out["C"].adjusted.lo, out["C"].adjusted.hi) == pytest.approx((-H975, H975), abs=1e-5)
    assert out["C"].raw.label == "inconclusive"  # direction only: an interval holding 0
    # the Holm interval is formatted against the paper's effect (fmt_ci adds decimals where an end would print it)
    holm, v3, on_holm = _v3.cells(out["A"], lambda m, lo, hi, against: f"{m:.1f} [{lo:.1f}, {hi:.1f}] vs {against}")
    assert (holm, v3, on_holm) == ("2.6 [-1.0, 6.2] vs (10.0,)", "**reproduced**", "not reproduced")
    assert out["C"].raw.against == ()  # a direction-only claim is read against 0 alone


def test_the_index_text_marks_the_label_and_is_a_valid_summary_verdict():
    out = _v3.relabel({"A": (*diffs(3, 4, 5), 1.0), "P": (*diffs(3, 4, 5), 1.0)}, planned=3)
    assert out["A"].index_text() == "reproduced (v2 records, v3 rule)"
    pending = _v3.relabel({"P": (*diffs(3, 4, 5), 1.0)}, planned=20)["P"]
    assert pending.index_text() == "pending (3/20 seeds) (v2 records, v3 rule)"
    Summary("claim", "+1", "ours", pending.index_text())  # Summary checks the text before " ("


def test_a_stopped_protocols_pending_claim_says_why_and_a_final_one_is_untouched():
    """A v2 protocol stopped short of its seeds never completes: its pending labels (raw and Holm) carry the reason;
    a claim already decided keeps its label."""
    pending = dataclasses.replace(_v3.relabel({"P": (*diffs(3, 4, 5), 1.0)}, planned=20)["P"], stopped="stopped: why")
    assert pending.index_text() == "pending (3/20 seeds; stopped: why) (v2 records, v3 rule)"
    assert _v3.cells(pending, lambda m, lo, hi, **kw: f"{m:.0f}")[1:] == ("**pending (3/20 seeds; stopped: why)**",
                                                                   "pending (3/20 seeds; stopped: why)")
    Summary("claim", "+1", "ours", pending.index_text())
    final = dataclasses.replace(_v3.relabel({"A": (*diffs(3, 4, 5), 1.0)}, planned=3)["A"], stopped="stopped: why")
    assert final.index_text() == "reproduced (v2 records, v3 rule)"


def test_a_registered_not_testable_never_stands_for_an_incomplete_cell_or_a_settled_interval():
    registered = "not testable here (needs 41 seeds)"
    assert _v3.registered(registered, decide(-3.0, -1.0, 1.5, 3, 20)) == (
        "pending (3/20 seeds; registered power analysis: needs 41 seeds)")
    assert _v3.registered(registered, decide(0.5, 2.1, 0.3, 10, 10)) == (
        "not testable here (registered v2 rule, needs 41 seeds; the interval excludes 0: see the v3 label)")
    assert _v3.registered(registered, decide(-3.6, -1.0, 0.5, 10, 10)).endswith("excludes 0: see the v3 label)")
    assert _v3.registered(registered, decide(-0.5, 0.4, 0.5, 10, 10)) == (
        "not testable here (registered v2 rule, needs 41 seeds; the interval excludes the paper's effect: see the "
        "v3 label)")
    # holding both 0 and the paper's effect, the registered text stands; other labels are left as registered
    assert _v3.registered(registered, decide(-0.5, 0.6, 0.5, 10, 10)) == registered
    assert _v3.registered("not reproduced", decide(-3.6, -1.0, 0.5, 10, 10)) == "not reproduced"

