"""Bernoulli availability: per-client long-run frequencies, independence across rounds, input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.participation import Bernoulli
from tests.participation.processes import N, T, assert_frequencies, draw, lag1_autocorrelation


def test_bernoulli_long_run_frequency_per_client():
    p = np.linspace(0.02, 0.98, N)
    proc = Bernoulli(p)
    proc.setup(N, seed=3)
    np.testing.assert_array_equal(proc.p.numpy(), p)
    assert proc.p.dtype == torch.float64
    masks = draw(proc, range(T))
    assert_frequencies(masks, p)
    assert np.all(np.abs(lag1_autocorrelation(masks)) < 4.5 / np.sqrt(T))


def test_bernoulli_scalar_and_extremes():
    proc = Bernoulli(0.0)
    proc.setup(7, seed=0)
    assert not proc.sample(11).any()
    proc = Bernoulli(1)
    proc.setup(7, seed=0)
    assert proc.sample(11).all() and proc.sample(11).dtype == torch.bool
    np.testing.assert_array_equal(proc.p.numpy(), np.ones(7))


@pytest.mark.parametrize("make, match", [
    (lambda: Bernoulli(1.5), r"p must lie in \[0, 1\]"),
    (lambda: Bernoulli(-0.1), r"p must lie in \[0, 1\]"),
    (lambda: Bernoulli([0.2, float("nan")]), r"p must be finite"),
    (lambda: Bernoulli([0.1, 0.2]).setup(3), r"p has 2 entries but num_clients is 3"),
    (lambda: Bernoulli("0.5"), r"p must be a number"),
])
def test_bad_inputs_raise_value_error_naming_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()
