"""The shared streaming accumulator: hand-computed sums, merge of partial sums, refusal of double counting."""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms._weighted_sum import WeightedSum


def test_hand_computed_sum_weights_and_coef():
    acc = WeightedSum(torch.zeros(2, dtype=torch.float64))
    acc.add(2, torch.tensor([1.0, -2.0]), weight=0.5)  # total = (0.5, -1)
    acc.add(0, torch.tensor([4.0, 4.0], dtype=torch.float32), weight=3.0, coef=0.25)  # + (1, 1)
    assert acc.total.dtype == torch.float64
    torch.testing.assert_close(acc.total, torch.tensor([1.5, 0.0], dtype=torch.float64), atol=0, rtol=0)
    assert acc.weights == {2: 0.5, 0: 3.0}
    assert list(acc) == [2, 0] and len(acc) == 2 and 0 in acc and 1 not in acc
    assert acc.weight_sum == 3.5
    assert acc.scaled_weights(2.0) == {2: 1.0, 0: 6.0}


def test_empty_sum_and_like_is_untouched():
    like = torch.ones(3)
    acc = WeightedSum(like)
    assert len(acc) == 0 and acc.weight_sum == 0.0
    acc.add(1, torch.tensor([1.0, 1.0, 1.0]), weight=2.0)
    torch.testing.assert_close(like, torch.ones(3), atol=0, rtol=0)  # total is a new tensor
    torch.testing.assert_close(acc.total, torch.full((3,), 2.0), atol=0, rtol=0)


def test_merge_of_disjoint_partial_sums_equals_one_sum():
    gen = torch.Generator().manual_seed(0)
    deltas = {c: torch.randn(5, generator=gen, dtype=torch.float64) for c in range(6)}
    weights = {c: 0.1 * (c + 1) for c in range(6)}
    whole = WeightedSum(torch.zeros(5, dtype=torch.float64))
    left, right = WeightedSum(whole.total), WeightedSum(whole.total)
    for c in range(6):
        whole.add(c, deltas[c], weights[c])
        (left if c % 2 else right).add(c, deltas[c], weights[c])
    left.merge(right)
    torch.testing.assert_close(left.total, whole.total, atol=1e-12, rtol=0)
    assert left.weights == weights
    # sum_c 0.1 (c + 1) * delta_c, written out
    expected = sum(0.1 * (c + 1) * deltas[c] for c in range(6))
    torch.testing.assert_close(whole.total, expected, atol=1e-12, rtol=0)


def test_refuses_double_counting_and_bad_merge():
    acc = WeightedSum(torch.zeros(2))
    acc.add(0, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="client 0 already added"):
        acc.add(0, torch.ones(2), 1.0)
    other = WeightedSum(torch.zeros(2))
    other.add(0, torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="share clients"):
        acc.merge(other)
    with pytest.raises(ValueError, match="shape"):
        acc.merge(WeightedSum(torch.zeros(3)))


def test_shares_are_the_running_sum_and_table_themselves_and_repr_names_them():
    # The many-process engine combines shares in place: they must be the very tensor and dict, not copies.
    # Slips caught: shares() returning copies (an all-reduce would then not reach the sum), or swapping them.
    s = WeightedSum(torch.zeros(3))
    s.add(4, torch.tensor([1.0, 2.0, 3.0]), 0.5)
    shares = s.shares()
    assert shares.sums[0] is s.total and shares.tables[0] is s.weights
    assert repr(s) == "WeightedSum(clients=[4], dim=3)"
