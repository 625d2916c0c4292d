"""FedVARP (FedStale paper Eq. 7; FedAU paper's code): hand-computed rounds, empty rounds, resume.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import pytest
import torch
from rule_rounds import F64, check_resume, close, make_ctx, run_round, setup

from lightning_fedhet.algorithms import ClientInfo, FedVARP


def test_fedvarp_hand_computed_participating():
    # N=3, alpha=1/3, participating: w += (1/3) sum_j y_j + (1/|R|) sum_R (delta_i - y_i); then y_i <- delta_i
    algo = setup(FedVARP(), 3, [0.0, 0.0])
    # round 0: y = 0. fresh = (1/2)([3,0] + [0,3]) = [1.5, 1.5] -> w1 = [1.5, 1.5]; y0=[3,0], y1=[0,3]
    close(run_round(algo, 0, 3, {0: [3, 0], 1: [0, 3]}), [1.5, 1.5])
    assert algo.last_weights == pytest.approx({0: 0.5, 1: 0.5})
    # round 1: stale = (1/3)([3,0]+[0,3]+0) = [1,1]; fresh = ([6,0] - y1=[0,3]) / 1 = [6,-3]
    # step = [7,-2] -> w2 = [8.5, -0.5]; y1 <- [6,0]
    close(run_round(algo, 1, 3, {1: [6, 0]}), [8.5, -0.5])
    # round 2: stale = (1/3)([3,0]+[6,0]+0) = [3,0]; fresh = (1/2)(([0,3]-[3,0]) + ([3,3]-0)) = (1/2)[0,6] = [0,3]
    # step = [3,3] -> w3 = [11.5, 2.5]
    close(run_round(algo, 2, 3, {0: [0, 3], 2: [3, 3]}), [11.5, 2.5])
    assert algo.memory_bytes == 3 * 2 * 4


def test_fedvarp_empty_round():
    for empty, expected in (("skip", [1.5, 1.5]), ("stale", [2.5, 2.5])):
        algo = setup(FedVARP(empty_round=empty), 3, [0.0, 0.0])
        close(run_round(algo, 0, 3, {0: [3, 0], 1: [0, 3]}), [1.5, 1.5])
        # nobody arrives: "skip" keeps w; "stale" adds (1/3)(y0+y1+y2) = (1/3)[3,3] = [1,1]
        close(run_round(algo, 1, 3, {}), expected)
        assert algo.last_weights == {}


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: FedVARP(), id="fedvarp"),
        pytest.param(lambda: FedVARP(weighting="known_p", memory_dtype=torch.bfloat16), id="fedvarp_known"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedVARP(weighting="samples"), "weighting"),
        (lambda: FedVARP(memory_dtype=torch.int32), "memory_dtype"),
        (lambda: FedVARP(empty_round="never"), "empty_round"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    with pytest.raises(ValueError, match="participation_probs"):
        setup(FedVARP(weighting="known_p"), 3, [0.0]).open_round(0, make_ctx(0, 3, [0], p=[0.5, 1.5, 1.0]))
    # the same client twice in a round, and a wrong shape
    varp = setup(FedVARP(), 2, [0.0, 0.0])
    varp.open_round(0, None)
    varp.add(0, torch.zeros(2, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="already added"):
        varp.add(0, torch.zeros(2, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="shape"):
        varp.add(1, torch.zeros(3, dtype=F64), ClientInfo(1, 1))
