"""The Bayesian estimates of CA-Fed's Markov availability (thesis §2.4.2): pi_hat and lambda_hat."""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import MarkovAvailabilityEstimator
from tests.algorithms.selection_rounds import F64, markov_chain


def test_markov_estimator_converges():
    # 4 classes of the thesis (pi in {0.9, 0.1} x lambda in {0.9, 0}). After R = 20000 rounds the standard error of
    # pi_hat is sqrt(pi(1-pi)/R * (1+lam)/(1-lam)) <= 0.0093 and of lam_hat <= ~0.007 (P(1->1) from ~2000 visits of
    # state 1 for pi = 0.1): a 0.04 tolerance is > 4 standard errors.
    pi, lam = [0.9, 0.9, 0.1, 0.1], [0.9, 0.0, 0.9, 0.0]
    est = MarkovAvailabilityEstimator()
    est.setup(4)
    for row in markov_chain(pi, lam, 20000, seed=0):
        est.update(torch.from_numpy(row))
    assert torch.allclose(est.pi_hat(), torch.tensor(pi, dtype=F64), atol=0.04)
    assert torch.allclose(est.lam_hat(), torch.tensor(lam, dtype=F64), atol=0.04)
    # far from the prior's starting point (1/2, 0) for every client that should move
    assert (est.pi_hat() - 0.5).abs().min() > 0.3 and est.lam_hat()[[0, 2]].min() > 0.8


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: MarkovAvailabilityEstimator(pi_prior=(0.0, 1.0)), "pi_prior"),
        (lambda: MarkovAvailabilityEstimator(transition_prior=0.0), "transition_prior"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()
