"""The availability-process protocol shared by every process: purity in (seed, round), copies, setup."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.participation import Bernoulli, Cyclic, Full, LabelCorrelated, Markov, Trace, UniformSample
from tests.participation.processes import N, draw


def _processes():
    hist = np.random.default_rng(0).integers(1, 20, size=(N, 10))
    return [
        (lambda: Bernoulli(np.linspace(0.1, 0.9, N)), {}),
        (lambda: Markov(p=0.4, lam=0.7), {}),
        (lambda: Markov(p=0.4, lam=0.7, block=7), {}),
        (lambda: Markov(p=LabelCorrelated(floor=0.05), max_on=0.05), {"label_hist": hist}),
        (lambda: Cyclic(100, 0.3), {}),
        (lambda: Trace(np.random.default_rng(1).random((77, N)) < 0.5), {}),
        (lambda: Full(), {}),
        (lambda: UniformSample(5), {}),
    ]


@pytest.mark.parametrize("index", range(8))
def test_same_seed_same_masks_in_any_order(index):
    make, kw = _processes()[index]
    in_order = make()
    in_order.setup(N, 11, **kw)
    reference = draw(in_order, range(601))
    jumped = make()
    jumped.setup(N, 11, **kw)
    first = jumped.sample(500).numpy()
    np.testing.assert_array_equal(first, reference[500])
    np.testing.assert_array_equal(draw(jumped, range(601)), reference)
    shuffled = make()
    shuffled.setup(N, 11, **kw)
    order = np.random.default_rng(2).permutation(601)
    out = np.empty_like(reference)
    for t in order:
        out[t] = shuffled.sample(int(t)).numpy()
    np.testing.assert_array_equal(out, reference)
    other = make()
    other.setup(N, 12, **kw)
    if not isinstance(other, (Full, Trace)):
        assert not np.array_equal(draw(other, range(601)), reference)


def test_sample_returns_independent_copies():
    proc = Markov(p=0.5, lam=0.5)
    proc.setup(10, seed=0)
    a = proc.sample(3)
    expected = a.clone()
    a[:] = ~a
    np.testing.assert_array_equal(proc.sample(3).numpy(), expected.numpy())


def test_sample_before_setup_or_negative_round():
    with pytest.raises(RuntimeError, match="setup"):
        Markov(p=0.5, lam=0.5).sample(0)
    proc = Cyclic(10, 0.5)
    proc.setup(3)
    with pytest.raises(ValueError, match="round must be >= 0"):
        proc.sample(-1)
