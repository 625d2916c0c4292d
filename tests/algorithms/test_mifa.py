"""MIFA (FedAU paper's code): hand-computed rounds, empty rounds, resume.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import pytest

from lightning_fedhet.algorithms import MIFA
from tests.algorithms.rule_rounds import check_resume, close, run_round, setup


def test_mifa_hand_computed_and_empty_round():
    # MIFA: y_i <- delta_i for arrivals first, then w += (1/N) sum_j y_j
    for empty, expected_last in (("stale", [7.0, 1.0]), ("skip", [4.0, 1.0])):
        algo = setup(MIFA(empty_round=empty), 3, [0.0, 0.0])
        # round 0: y0=[3,0], y1=[0,3] -> (1/3)[3,3] = [1,1] -> w1 = [1,1]
        close(run_round(algo, 0, 3, {0: [3, 0], 1: [0, 3]}), [1.0, 1.0])
        assert algo.last_weights == pytest.approx({0: 1 / 3, 1: 1 / 3})
        # round 1: y1=[6,0] -> (1/3)([3,0]+[6,0]+0) = [3,0] -> w2 = [4,1]
        close(run_round(algo, 1, 3, {1: [6, 0]}), [4.0, 1.0])
        # round 2: nobody arrives. default "stale" (FedAU code) still applies [3,0] -> [7,1]; "skip" keeps [4,1]
        close(run_round(algo, 2, 3, {}), expected_last)


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: MIFA(), id="mifa"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: MIFA(empty_round="never"), "empty_round"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()
