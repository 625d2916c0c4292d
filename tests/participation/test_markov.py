"""Two-state Markov availability: the three parameterisations, frequencies, correlations, caching, checks."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.participation import Markov
from tests.participation.processes import N, T, assert_frequencies, draw, lag1_autocorrelation


@pytest.mark.parametrize("lam", [0.8, -0.4])
def test_markov_frequency_and_autocorrelation(lam):
    p = np.linspace(0.3, 0.7, N) if lam < 0 else np.linspace(0.05, 0.95, N)
    proc = Markov(p=p, lam=lam)
    proc.setup(N, seed=1)
    np.testing.assert_allclose(proc.p.numpy(), p)
    np.testing.assert_allclose(proc.lam.numpy(), lam)
    np.testing.assert_allclose(proc.p_on.numpy(), p * (1 - lam))
    np.testing.assert_allclose(proc.p_off.numpy(), (1 - p) * (1 - lam))
    masks = draw(proc, range(T))
    assert_frequencies(masks, p, inflation=(1 + lam) / (1 - lam))
    rho = lag1_autocorrelation(masks)
    assert abs(rho.mean() - lam) < 0.01
    assert np.all(np.abs(rho - lam) < 0.05)


def test_markov_transition_form():
    p_on = np.linspace(0.01, 0.3, N)
    p_off = np.linspace(0.2, 0.05, N)
    proc = Markov(p_on=p_on, p_off=p_off)
    proc.setup(N, seed=2)
    pi = p_on / (p_on + p_off)
    lam = 1 - p_on - p_off
    np.testing.assert_allclose(proc.p.numpy(), pi)
    np.testing.assert_allclose(proc.lam.numpy(), lam)
    masks = draw(proc, range(T))
    assert_frequencies(masks, pi, inflation=(1 + lam) / (1 - lam))
    assert abs(lag1_autocorrelation(masks).mean() - lam.mean()) < 0.01


def test_markov_fedau_rule_unit():
    a, b = Markov.fedau_transitions(0.02, 0.05)
    assert b == 1.0
    assert a == pytest.approx(0.05 / 2.45) and a == pytest.approx(0.0204081632653, abs=1e-12)
    a, b = Markov.fedau_transitions([0.5, 0.1, 1.0, 0.0], 0.05)
    np.testing.assert_allclose(a, [0.05, 0.05, 0.05, 0.0])
    np.testing.assert_allclose(b, [0.05, 0.45, 0.0, 1.0])
    # the rescaling happens exactly below p = 1/21
    _, b = Markov.fedau_transitions([1 / 21 + 1e-9, 1 / 21 - 1e-9], 0.05)
    assert b[0] < 1.0 and b[1] == 1.0
    proc = Markov(p=[0.02, 0.5], max_on=0.05)
    proc.setup(2, seed=0)
    np.testing.assert_allclose(proc.p_on.numpy(), [0.05 / 2.45, 0.05])
    np.testing.assert_allclose(proc.p_off.numpy(), [1.0, 0.05])
    np.testing.assert_allclose(proc.p.numpy(), [0.02, 0.5])


def test_markov_fedau_rule_frequency():
    p = np.linspace(0.02, 0.6, N)
    proc = Markov(p=p, max_on=0.05)
    proc.setup(N, seed=4)
    lam = proc.lam.numpy()
    masks = draw(proc, range(T))
    assert_frequencies(masks, p, inflation=(1 + lam) / (1 - lam))
    # floor clients (p = 0.02) have b = 1: every active stint lasts exactly one round
    on = masks[:, 0]
    assert on.sum() > 0 and not np.any(on[1:] & on[:-1])


def test_markov_caching_is_linear_in_order_and_bounded_on_revisit(monkeypatch):
    proc = Markov(p=0.3, lam=0.5, block=16)
    proc.setup(N, seed=0)
    calls = []
    original = proc.round_uniforms
    monkeypatch.setattr(proc, "round_uniforms", lambda t: calls.append(t) or original(t))
    draw(proc, range(200))
    assert calls == list(range(200))  # one step per round in order
    calls.clear()
    proc.sample(37)  # revisit: start from the checkpoint at round 32
    assert calls == [33, 34, 35, 36, 37]
    calls.clear()
    proc.sample(38)  # continue from the last drawn state
    assert calls == [38]


@pytest.mark.parametrize("make, match", [
    (lambda: Markov(p=0.5, lam=1.0), r"lam must lie in \(-1, 1\)"),
    (lambda: Markov(p=0.5, lam=-1.0), r"lam must lie in \(-1, 1\)"),
    (lambda: Markov(p=0.2, lam=-0.5), r"infeasible pair p=0.2, lam=-0.5.*lam must lie in \[-0.25, 1\)"),
    (lambda: Markov(p=[0.5, 0.9], lam=-0.5), r"infeasible pair p=0.9, lam=-0.5"),
    (lambda: Markov(p=1.2, lam=0.5), r"p must lie in \[0, 1\]"),
    (lambda: Markov(p_on=0.0, p_off=0.0), r"inconsistent pair p_on=0, p_off=0.*\(0, 2\)"),
    (lambda: Markov(p_on=1.0, p_off=1.0), r"inconsistent pair p_on=1, p_off=1"),
    (lambda: Markov(p_on=1.2, p_off=0.1), r"p_on must lie in \[0, 1\]"),
    (lambda: Markov(p_on=0.2, p_off=-0.1), r"p_off must lie in \[0, 1\]"),
    (lambda: Markov(p=0.5), r"exactly one of \(p=, lam=\), \(p_on=, p_off=\) or \(p=, max_on=\)"),
    (lambda: Markov(p=0.5, lam=0.1, p_on=0.1), r"exactly one of"),
    (lambda: Markov(p=0.5, max_on=0.0), r"max_on must lie in \(0, 1\]"),
    (lambda: Markov(p=0.5, lam=0.5, block=0), r"block must be an integer >= 1"),
    (lambda: Markov(p=[0.1, 0.2], lam=[0.1, 0.2, 0.3]).setup(2), r"lam has 3 entries but num_clients is 2"),
])
def test_bad_inputs_raise_value_error_naming_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()
