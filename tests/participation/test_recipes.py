"""Recipes of per-client participation probabilities: LabelCorrelated, TwoGroup, CAFedClasses."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.participation import Bernoulli, CAFedClasses, LabelCorrelated, Markov, TwoGroup
from tests.participation.processes import draw


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


@pytest.mark.parametrize("make, match", [
    (lambda: LabelCorrelated(mean=0.0), r"mean must lie in \(0, 1\]"),
    (lambda: LabelCorrelated(floor=1.5), r"floor must lie in \[0, 1\]"),
    (lambda: LabelCorrelated(alpha=0.0), r"alpha must lie in \(0, inf\)"),
    (lambda: LabelCorrelated().probabilities(np.zeros((2, 3)), 0), r"label_hist: every client needs"),
    (lambda: TwoGroup(p_min=1.5), r"p_min must lie in \[0, 1\]"),
    (lambda: CAFedClasses(g=0.5), r"g must lie in \(0, 0.5\)"),
    (lambda: CAFedClasses(nu=1.0), r"nu must lie in \(-1, 1\)"),
    (lambda: CAFedClasses(composition="x"), r"composition must be"),
])
def test_bad_inputs_raise_value_error_naming_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()
