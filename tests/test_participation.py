"""Availability processes: stationary frequencies, correlations, block lengths, purity and input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.participation import (
    Bernoulli,
    CAFedClasses,
    Cyclic,
    Full,
    LabelCorrelated,
    Markov,
    Trace,
    TwoGroup,
    UniformSample,
)

N = 50
T = 20_000


def draw(proc, rounds) -> np.ndarray:
    """Stack ``proc.sample(t)`` for ``t`` in ``rounds`` into a bool ``[len(rounds), N]`` array."""
    return np.stack([proc.sample(t).numpy() for t in rounds])


def assert_frequencies(masks: np.ndarray, p: np.ndarray, inflation: np.ndarray | float = 1.0) -> None:
    """Per-client frequencies within 4.5 SE (Bonferroni over 50 clients) and the pooled one within 3 SE.

    ``inflation`` is the variance factor of a time average of a correlated 0/1 sequence, ``(1+lam)/(1-lam)`` for a
    stationary two-state chain (1 for independent rounds).
    """
    rounds = masks.shape[0]
    var = p * (1 - p) / rounds * inflation
    freq = masks.mean(axis=0)
    z = (freq - p) / np.sqrt(var)
    assert np.max(np.abs(z)) < 4.5, f"max |z| = {np.max(np.abs(z)):.2f}"
    pooled_z = (freq.sum() - p.sum()) / np.sqrt(np.sum(var))
    assert abs(pooled_z) < 3.0, f"pooled z = {pooled_z:.2f}"


def lag1_autocorrelation(masks: np.ndarray) -> np.ndarray:
    x = masks.astype(np.float64)
    x = x - x.mean(axis=0)
    return (x[1:] * x[:-1]).mean(axis=0) / x.var(axis=0)


# ----------------------------------------------------------------------------- Bernoulli
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


# ----------------------------------------------------------------------------- Markov
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
    original = proc._uniforms
    monkeypatch.setattr(proc, "_uniforms", lambda t: calls.append(t) or original(t))
    draw(proc, range(200))
    assert calls == list(range(200))  # one step per round in order
    calls.clear()
    proc.sample(37)  # revisit: start from the checkpoint at round 32
    assert calls == [33, 34, 35, 36, 37]
    calls.clear()
    proc.sample(38)  # continue from the last drawn state
    assert calls == [38]


# ----------------------------------------------------------------------------- Cyclic
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


def test_cyclic_inactive_offset_starts_off():
    proc = Cyclic(100, 0.3, offset="inactive")
    proc.setup(500, seed=0)
    assert not proc.sample(0).any()
    # the first switch on is uniform over the 70 inactive rounds
    first_on = np.argmax(draw(proc, range(100)), axis=0)
    assert first_on.min() >= 1 and first_on.max() <= 70
    assert abs(first_on.mean() - 35.5) < 3 * np.sqrt((70**2 - 1) / 12 / 500)


# ----------------------------------------------------------------------------- Trace
def test_trace_replays_and_wraps(tmp_path):
    rng = np.random.default_rng(0)
    mask = rng.random((30, 8)) < 0.4
    proc = Trace(mask)
    proc.setup(8, seed=0)
    for t in (0, 5, 29, 30, 31, 95):
        np.testing.assert_array_equal(proc.sample(t).numpy(), mask[t % 30])
    np.testing.assert_allclose(proc.p.numpy(), mask.mean(axis=0))
    assert proc.num_rounds == 30
    np.save(tmp_path / "m.npy", mask)
    np.savez(tmp_path / "m.npz", mask=mask.astype(np.int8), other=np.zeros(2))
    np.savetxt(tmp_path / "m.csv", mask.astype(int), fmt="%d", delimiter=",")
    for name in ("m.npy", "m.npz", "m.csv"):
        loaded = Trace(tmp_path / name)
        loaded.setup(8)
        np.testing.assert_array_equal(draw(loaded, range(60)), np.concatenate([mask, mask]))


# ----------------------------------------------------------------------------- recipes
def test_label_correlated_formula_and_mean():
    rng = np.random.default_rng(1)
    hist = rng.integers(0, 50, size=(20, 10))
    hist[:, 0] += 1
    recipe = LabelCorrelated(mean=0.1, floor=0.02, alpha=0.1)
    q = recipe.affinity(10, seed=7)
    assert q.shape == (10,) and q.sum() == pytest.approx(1.0)
    kappa = hist / hist.sum(axis=1, keepdims=True)
    expected = np.clip(np.maximum(10 * 0.1 * kappa @ q, 0.02), 0, 1)
    np.testing.assert_allclose(recipe.probabilities(hist, seed=7), expected)
    # E[p_n] = mu over the Dirichlet draw (no floor)
    raw = LabelCorrelated(mean=0.1, floor=0.0)
    means = np.array([raw.probabilities(hist, seed=s).mean() for s in range(400)])
    assert abs(means.mean() - 0.1) < 3 * means.std() / np.sqrt(400)
    # through a process: label_hist goes to setup
    proc = Bernoulli(recipe)
    assert proc.needs_label_hist and not Bernoulli(0.5).needs_label_hist
    proc.setup(20, seed=7, label_hist=hist)
    np.testing.assert_allclose(proc.p.numpy(), expected)
    with pytest.raises(ValueError, match="label_hist"):
        Bernoulli(recipe).setup(20, seed=7)
    with pytest.raises(ValueError, match="label_hist has 20 rows but num_clients is 21"):
        Bernoulli(recipe).setup(21, seed=7, label_hist=hist)


def test_label_correlated_clips_above_one():
    hist = np.eye(100) * 10  # one-hot clients: p = 100 * 0.9 * q_c exceeds 1 for the dominant class
    with pytest.warns(UserWarning, match="clipped"):
        p = LabelCorrelated(mean=0.9, alpha=0.01).probabilities(hist, seed=0)
    assert p.max() <= 1.0


def test_two_group_recipe():
    recipe = TwoGroup(p_min=0.05)
    p, _ = recipe.resolve(24, seed=0), None
    assert np.sum(p == 0.05) == 12 and np.sum(p == 1.0) == 12
    np.testing.assert_array_equal(recipe.low_group(24, 0), p == 0.05)
    fixed = TwoGroup(p_min=0.2, shuffle=False).resolve(5, seed=0)
    np.testing.assert_array_equal(fixed, [1.0, 1.0, 1.0, 0.2, 0.2])
    proc = Bernoulli(recipe)
    proc.setup(24, seed=0)
    masks = draw(proc, range(200))
    assert masks[:, p == 1.0].all()


def test_cafed_classes_recipe():
    pi, lam = CAFedClasses(g=0.4, nu=0.9, eps=0.01).resolve(100, seed=0)
    ids = CAFedClasses().classes(100, seed=0)
    assert np.bincount(ids).tolist() == [25, 25, 25, 25]
    np.testing.assert_allclose(pi[ids <= 1], 0.9)
    np.testing.assert_allclose(pi[ids >= 2], 0.1)
    np.testing.assert_allclose(lam[(ids == 0) | (ids == 2)], 0.9)
    weak = lam[(ids == 1) | (ids == 3)]
    assert abs(weak.mean()) < 3 * 0.01 / np.sqrt(50) and 0.006 < weak.std() < 0.014
    code_ids = CAFedClasses(composition="code").classes(100, seed=0)
    assert np.bincount(code_ids, minlength=4).tolist() == [0, 50, 25, 25]
    proc = Markov(p=CAFedClasses())
    proc.setup(100, seed=0)
    np.testing.assert_allclose(proc.p.numpy(), pi)
    np.testing.assert_allclose(proc.lam.numpy(), lam)
    with pytest.raises(ValueError, match="lam"):
        Markov(p=CAFedClasses(), lam=0.5)
    with pytest.raises(ValueError, match="lam"):
        Bernoulli(CAFedClasses())


# ----------------------------------------------------------------------------- purity
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


# ----------------------------------------------------------------------------- input checks
BAD_INPUTS = [
    (lambda: Bernoulli(1.5), r"p must lie in \[0, 1\]"),
    (lambda: Bernoulli(-0.1), r"p must lie in \[0, 1\]"),
    (lambda: Bernoulli([0.2, float("nan")]), r"p must be finite"),
    (lambda: Bernoulli([0.1, 0.2]).setup(3), r"p has 2 entries but num_clients is 3"),
    (lambda: Bernoulli("0.5"), r"p must be a number"),
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
    (lambda: Cyclic(0, 0.5), r"period must be an integer >= 1"),
    (lambda: Cyclic(2.5, 0.5), r"period must be an integer >= 1"),
    (lambda: Cyclic(10, 1.1), r"p must lie in \[0, 1\]"),
    (lambda: Cyclic(10, 0.5, offset="random"), r"offset must be"),
    (lambda: Trace(np.ones((5, 3), dtype=bool)).setup(4), r"mask has 3 clients .* num_clients is 4"),
    (lambda: Trace(np.array([[0, 2]])), r"mask must hold only 0/1"),
    (lambda: Trace(np.ones(5)), r"mask must have shape \[T, N\]"),
    (lambda: Trace("/nonexistent/trace.npy"), r"mask: no such file"),
    (lambda: LabelCorrelated(mean=0.0), r"mean must lie in \(0, 1\]"),
    (lambda: LabelCorrelated(floor=1.5), r"floor must lie in \[0, 1\]"),
    (lambda: LabelCorrelated(alpha=0.0), r"alpha must lie in \(0, inf\)"),
    (lambda: LabelCorrelated().probabilities(np.zeros((2, 3)), 0), r"label_hist: every client needs"),
    (lambda: TwoGroup(p_min=1.5), r"p_min must lie in \[0, 1\]"),
    (lambda: CAFedClasses(g=0.5), r"g must lie in \(0, 0.5\)"),
    (lambda: CAFedClasses(nu=1.0), r"nu must lie in \(-1, 1\)"),
    (lambda: CAFedClasses(composition="x"), r"composition must be"),
]


@pytest.mark.parametrize("make, match", BAD_INPUTS)
def test_bad_inputs_raise_value_error_naming_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_sample_before_setup_or_negative_round():
    with pytest.raises(RuntimeError, match="setup"):
        Markov(p=0.5, lam=0.5).sample(0)
    proc = Cyclic(10, 0.5)
    proc.setup(3)
    with pytest.raises(ValueError, match="round must be >= 0"):
        proc.sample(-1)
