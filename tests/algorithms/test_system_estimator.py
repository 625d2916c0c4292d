"""The FedACS family's EMA estimator (``estimator="ema"``) against two rounds computed by hand.

Rate b = 0.5; per client the estimate is v/u with v <- (1-b) v + b x and u <- (1-b) u + b on the rounds the client
is observed. Three clients:

round 1: drawn [T, F, T], arrived [T, F, F], norms [2, nan, 0], available [T, F, T]
round 2: drawn [T, T, F], arrived [F, T, F], norms [4, 1, nan], available [F, T, T]
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_fedhet.algorithms._system_estimator import SystemEstimator

T, F = True, False
NAN = math.nan


def _round(est, drawn, arrived, norms, available):
    est.update(torch.tensor(drawn), torch.tensor(arrived),
               None if available is None else torch.tensor(available),
               None if norms is None else torch.tensor(norms, dtype=torch.float64))


def _two_rounds() -> SystemEstimator:
    est = SystemEstimator(rate=0.5)
    est.setup(3)
    _round(est, [T, F, T], [T, F, F], [2.0, NAN, 0.0], [T, F, T])
    _round(est, [T, T, F], [F, T, F], [4.0, 1.0, NAN], [F, T, T])
    return est


def test_before_any_round_every_estimate_is_its_prior():
    est = SystemEstimator()
    est.setup(2)
    assert est.rate == 0.1
    assert est.success().tolist() == [1.0, 1.0]
    assert est.availability().tolist() == [1.0, 1.0]
    assert est.norms().tolist() == [1.0, 1.0]


def test_one_round_by_hand():
    est = SystemEstimator(rate=0.5)
    est.setup(3)
    _round(est, [T, F, T], [T, F, F], [2.0, NAN, 0.0], [T, F, T])
    assert est.success().tolist() == [1.0, 1.0, 0.0]  # client 1 never drawn: prior 1
    # only client 0 ran steps (norm 0 and nan are not observations); the others get the mean of the known, 2
    assert est.norms().tolist() == [2.0, 2.0, 2.0]
    assert est.availability().tolist() == [1.0, 0.0, 1.0]


def test_two_rounds_by_hand():
    est = _two_rounds()
    # s: client 0 v = .5*.5 + 0 = .25, u = .5*.5 + .5 = .75; client 1 first seen in round 2; client 2 not drawn again
    assert est.success().tolist() == pytest.approx([1 / 3, 1.0, 0.0], abs=1e-15)
    # a: client 0 v = .5*1 + .5*4 = 2.5, u = .75 -> 10/3; client 1 -> 1; client 2 never seen: mean(10/3, 1) = 13/6
    assert est.norms().tolist() == pytest.approx([10 / 3, 1.0, 13 / 6], abs=1e-15)
    # pi (every client every round): client 0 .25/.75, client 1 .5/.75, client 2 .75/.75
    assert est.availability().tolist() == pytest.approx([1 / 3, 2 / 3, 1.0], abs=1e-15)


def test_a_round_without_norms_or_availability_moves_only_success():
    est = _two_rounds()
    before = est.state_dict()
    _round(est, [F, F, T], [F, F, T], None, None)
    after = est.state_dict()
    for key in ("a_v", "a_u", "pi_v", "pi_u"):
        assert torch.equal(after[key], before[key]), key
    assert est.success().tolist() == pytest.approx([1 / 3, 1.0, 0.5 / 0.75], abs=1e-15)


def test_state_dict_round_trip_gives_the_same_estimates_and_is_a_copy():
    est = _two_rounds()
    other = SystemEstimator(rate=0.9)
    other.load_state_dict(est.state_dict())
    assert other.rate == 0.5 and other.num_clients == 3
    for name in ("success", "norms", "availability"):
        assert torch.equal(getattr(other, name)(), getattr(est, name)()), name
    _round(other, [T, T, T], [T, T, T], [1.0, 1.0, 1.0], [T, T, T])
    assert est.success().tolist() == pytest.approx([1 / 3, 1.0, 0.0], abs=1e-15)  # est did not move


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.0001, math.nan])
def test_a_rate_outside_0_1_is_refused_naming_the_parameter(rate):
    with pytest.raises(ValueError, match=r"^ema \(the estimator's rate\) must "):  # lie in (0, 1] / be finite
        SystemEstimator(rate=rate)


def test_rate_one_keeps_the_last_observation_only():
    est = SystemEstimator(rate=1.0)
    est.setup(1)
    _round(est, [T], [T], [3.0], [T])
    _round(est, [T], [F], [5.0], [F])
    assert (est.success().item(), est.norms().item(), est.availability().item()) == (0.0, 5.0, 0.0)
