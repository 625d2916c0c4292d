"""FixedSizeDirichlet (the FedAST paper's split): exact sizes, label mix, refilled pools, determinism, errors."""

import numpy as np
import pytest

from lightning_fedhet.data import FixedSizeDirichlet


def test_hand_counted_refill_two_classes():
    # alpha = 1e6 makes p_i = (1/2, 1/2) up to 1e-3, so n = 4 gives every client the counts (2, 2) (by hand:
    # 4 * p = (2 +- 0.004, 2 -+ 0.004); floors + largest remainder = (2, 2)). Three clients need 6 samples of
    # each class, which holds 3: the pool is emptied once and refilled once, so every sample is held by exactly
    # two clients and no client holds one twice.
    # Slip caught: refilling without moving the client's own samples back (a duplicate inside a client), sizes
    # off by one from plain rounding, or a pool that is never refilled (an IndexError / short client).
    labels = np.array([0, 0, 0, 1, 1, 1])
    parts = FixedSizeDirichlet(samples_per_client=4, alpha=1e6).split(labels, num_clients=3, seed=0)
    assert [len(p) for p in parts] == [4, 4, 4]
    for p in parts:
        assert len(np.unique(p)) == 4
        assert np.bincount(labels[p], minlength=2).tolist() == [2, 2]
    assert np.bincount(np.concatenate(parts), minlength=6).tolist() == [2] * 6


def test_counts_largest_remainder_by_hand():
    # n = 10, p = (0.34, 0.33, 0.33): 3.4, 3.3, 3.3 -> floors 3, 3, 3, the one left goes to 0.4: (4, 3, 3).
    # p = (0.25, 0.25, 0.5), n = 2: 0.5, 0.5, 1 -> floors 0, 0, 1, ties to the lower class: (1, 0, 1).
    # Slip caught: np.round (gives 3, 3, 3 = 9 samples; or banker's rounding 0, 0, 1 = 1 sample).
    assert FixedSizeDirichlet.counts(10, np.array([0.34, 0.33, 0.33])).tolist() == [4, 3, 3]
    assert FixedSizeDirichlet.counts(2, np.array([0.25, 0.25, 0.5])).tolist() == [1, 0, 1]


def test_exact_sizes_no_duplicates_and_label_spread_matches_dirichlet_variance():
    # 10 classes of 500 samples, 400 clients of 50 samples, alpha = 0.1 and 10. The share of class 0 in a client
    # is p_0 ~ Beta(alpha, 9 alpha) (a Dirichlet marginal) plus rounding: mean 1/10 and variance
    # (1/10)(9/10)/(10 alpha + 1) = 0.045 (alpha 0.1) or 0.000891 (alpha 10); rounding to 1/50 adds at most
    # (1/50)^2/4 = 1e-4. Tolerances: 5 standard errors of a 400-client variance estimate.
    # Slip caught: Dir(alpha) over clients instead of classes (the classic per-class split: sizes vary), or
    # alpha not passed through (the spread would not change with alpha).
    labels = np.repeat(np.arange(10), 500)
    for alpha, var in ((0.1, 0.045), (10.0, 0.000891)):
        parts = FixedSizeDirichlet(50, alpha).split(labels, 400, seed=3)
        assert all(len(p) == 50 and len(np.unique(p)) == 50 for p in parts)
        share = np.array([np.mean(labels[p] == 0) for p in parts])
        assert abs(share.mean() - 0.1) < 5 * np.sqrt(var / 400)
        assert abs(share.var() - var) < 5 * var * np.sqrt(2 / 399) + 1e-4
    # small alpha: most clients are dominated by one class (E[max_c p_c] > 0.7 for Dir(0.1 * 1_10))
    parts = FixedSizeDirichlet(50, 0.1).split(labels, 400, seed=3)
    assert np.mean([np.bincount(labels[p]).max() / 50 for p in parts]) > 0.6


def test_deterministic_in_its_seed():
    # Slip caught: a draw from global numpy state (a second call would differ) or a seed that is ignored.
    labels = np.repeat(np.arange(4), 30)
    a = FixedSizeDirichlet(20, 0.5).split(labels, 8, seed=7)
    b = FixedSizeDirichlet(20, 0.5).split(labels, 8, seed=7)
    c = FixedSizeDirichlet(20, 0.5).split(labels, 8, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_unsatisfiable_and_bad_arguments_raise():
    # alpha = 1e6 asks (2, 2) of every client, but class 1 has one sample: it cannot be met without a repeat.
    with pytest.raises(ValueError, match="samples_per_client=4 cannot be met"):
        FixedSizeDirichlet(4, 1e6).split(np.array([0, 0, 0, 1]), 2)
    with pytest.raises(ValueError, match="samples_per_client"):
        FixedSizeDirichlet(0, 0.1)
    with pytest.raises(ValueError, match="alpha"):
        FixedSizeDirichlet(10, 0.0)
    with pytest.raises(ValueError, match="num_clients"):
        FixedSizeDirichlet(10, 0.1).split(np.zeros(20), 0)
