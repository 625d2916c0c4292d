"""Cyclic availability (FedAU's ``cyclic-100``): block lengths, phases, frequencies, checks."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.participation import Cyclic
from tests.participation.processes import N, T, draw


def test_cyclic_block_lengths_exact():
    p = np.array([0.0, 0.004, 0.005, 0.015, 0.02, 0.025, 0.035, 0.1, 0.527, 0.5, 0.994, 0.995, 1.0])
    proc = Cyclic(100, p)
    proc.setup(len(p), seed=5)
    expected_active = np.array([max(1, round(100 * x)) for x in p])
    expected_inactive = np.maximum(1, 100 - expected_active)
    np.testing.assert_array_equal(proc.active, expected_active)
    np.testing.assert_array_equal(proc.inactive, expected_inactive)
    masks = draw(proc, range(3 * 101))
    for i in range(len(p)):
        x = masks[:, i].astype(np.int8)
        starts = np.flatnonzero(np.diff(x) == 1) + 1
        ends = np.flatnonzero(np.diff(x) == -1) + 1
        ends = ends[ends > starts[0]]
        runs = ends[: len(starts) - 1] - starts[: len(ends)][: len(starts) - 1]
        assert len(runs) >= 1 and np.all(runs == expected_active[i]), (p[i], runs)
    np.testing.assert_allclose(proc.p.numpy(), expected_active / (expected_active + expected_inactive))


def test_cyclic_frequency_and_stationary_marginal():
    p = np.linspace(0.01, 0.9, N)
    proc = Cyclic(100, p)
    proc.setup(N, seed=6)
    masks = draw(proc, range(T))
    cycle = proc.active + proc.inactive
    # a deterministic cycle: the time average is off by at most one partial block
    assert np.all(np.abs(masks.mean(axis=0) - proc.p.numpy()) <= cycle / T)
    # uniform phases: any single round is Bernoulli(p) across clients
    many = Cyclic(100, 0.3)
    many.setup(4000, seed=6)
    for t in (0, 57, 1234):
        rate = many.sample(t).double().mean().item()
        assert abs(rate - 0.3) < 3 * np.sqrt(0.3 * 0.7 / 4000)


def test_cyclic_inactive_offset_first_active_round_is_fedau_codes():
    # FedAU's code (cyclic-100): every client starts inactive with rounds_to_switch ~ randint(0, inactive - 1), so
    # its first active round is uniform on {0, ..., inactive - 1}. p = 0.3: active = 30, inactive = 70 -> first
    # active round uniform on {0..69}: mean 34.5, sd sqrt((70^2 - 1)/12) = 20.2, so the mean of 20,000 clients has
    # standard error 0.143 and 0.6 is > 4 standard errors; min 0 and max 69 are hit with probability 1 - 2e-124.
    n = 20_000
    proc = Cyclic(100, 0.3, offset="inactive")
    proc.setup(n, seed=0)
    assert np.all(proc.active == 30) and np.all(proc.inactive == 70)
    masks = draw(proc, range(101))
    assert masks.any(axis=0).all()
    first_on = np.argmax(masks, axis=0)
    assert first_on.min() == 0 and first_on.max() == 69
    assert abs(first_on.mean() - 34.5) < 0.6
    # before its first active round a client is off, then it stays on for exactly one active block
    rounds = np.arange(101)[:, None]
    assert not np.any(masks & (rounds < first_on))
    assert np.all(masks == ((rounds >= first_on) & (rounds < first_on + 30)) | (rounds >= first_on + 100))


@pytest.mark.parametrize("make, match", [
    (lambda: Cyclic(0, 0.5), r"period must be an integer in \[1, 1000000000\]"),
    (lambda: Cyclic(2.5, 0.5), r"period must be an integer in \[1, 1000000000\]"),
    (lambda: Cyclic(10, 1.1), r"p must lie in \[0, 1\]"),
    (lambda: Cyclic(10, 0.5, offset="random"), r"offset must be"),
])
def test_bad_inputs_raise_value_error_naming_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("p", [0.3, 0.7, 0.05])
def test_inactive_offset_marginal_is_the_share_of_starting_positions_on_in_that_round(p):
    # Slip caught: a server dividing by the stationary p under offset="inactive", whose early rounds are not
    # stationary (every client starts off: round 0 is on only for the first-active draw u = 0).
    # Independent transcription of FedAU's code: the first active round u is uniform on {0, ..., inactive - 1}; then
    # on for `active` rounds, off for `inactive`, and so on. Enumerate u and count, round by round.
    period = 10
    proc = Cyclic(period, p, offset="inactive")
    proc.setup(3, seed=0)
    active, inactive = int(proc.active[0]), int(proc.inactive[0])
    cycle = active + inactive
    for t in range(3 * cycle):
        on = [(t - u) >= 0 and (t - u) % cycle < active for u in range(inactive)]
        expected = sum(on) / inactive
        np.testing.assert_allclose(proc.marginal_probs(t).numpy(), expected, err_msg=f"round {t}")
    # the marginal really is what the draws do: over many seeds, the share of clients on in round t
    many = Cyclic(period, p, offset="inactive")
    many.setup(4000, seed=3)
    for t in (0, 1, active, cycle - 1):
        share = float(many.sample(t).double().mean())
        marginal = float(many.marginal_probs(t)[0])
        # binomial standard deviation over 4000 clients <= 0.008: 5 sd
        assert abs(share - marginal) < 0.04, (t, share, marginal)
    # and averaged over a cycle it is the stationary p
    mean = np.mean([float(proc.marginal_probs(t)[0]) for t in range(cycle, 2 * cycle)])
    assert mean == pytest.approx(float(proc.p[0]))


def test_uniform_offset_marginal_is_the_stationary_probability():
    proc = Cyclic(10, [0.2, 0.5])
    proc.setup(2, seed=0)
    for t in (0, 3, 17):
        np.testing.assert_array_equal(proc.marginal_probs(t).numpy(), proc.p.numpy())
