"""Aggregation over lossy links (thesis ch. 4): UPGA-PL, DMA-PL, UDMA-PL.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import DMAPL, UDMAPL, UPGAPL, ClientInfo, RoundContext
from tests.algorithms.rule_rounds import F64, check_resume, close, make_ctx, run_round, setup

# alpha = [1,1,2]/4 = [0.25, 0.25, 0.5]; success s = 1-q = [1, 0.5, 0.8]; c = alpha/s = [0.25, 0.5, 0.625]
# (the thesis's setting: every client selected, no deadline, so P(aggregated) = 1 - q, passed as p)
ALPHA = torch.tensor([1.0, 1.0, 2.0])
S_PROBS = [1.0, 0.5, 0.8]
LOSSY_ROUNDS = [{0: [4, 0], 2: [0, 8]}, {1: [2, 2]}, {}]


def test_upgapl_hand_computed():
    algo = setup(UPGAPL(), 3, [2.0, 2.0], ALPHA)
    # round 0: w + 0.25[4,0] + 0.625[0,8] = [2,2] + [1,5] = [3,7]
    close(run_round(algo, 0, 3, LOSSY_ROUNDS[0], p=S_PROBS), [3.0, 7.0])
    assert algo.last_weights == pytest.approx({0: 0.25, 2: 0.625})
    # round 1: + 0.5[2,2] = [4,8]
    close(run_round(algo, 1, 3, LOSSY_ROUNDS[1], p=S_PROBS), [4.0, 8.0])
    # round 2: nobody -> unchanged
    close(run_round(algo, 2, 3, LOSSY_ROUNDS[2], p=S_PROBS), [4.0, 8.0])


def test_dmapl_hand_computed():
    algo = setup(DMAPL(), 3, [2.0, 2.0], ALPHA)
    # round 0: models [6,2], [2,10]; weights 0.25/0.75 = 1/3, 0.5/0.75 = 2/3 -> [2+4/3, 2/3+20/3] = [10/3, 22/3]
    close(run_round(algo, 0, 3, LOSSY_ROUNDS[0], s=S_PROBS), [10 / 3, 22 / 3])
    assert algo.last_weights == pytest.approx({0: 1 / 3, 2: 2 / 3})
    # round 1: only client 1 -> its model w + [2,2] = [16/3, 28/3]
    close(run_round(algo, 1, 3, LOSSY_ROUNDS[1], s=S_PROBS), [16 / 3, 28 / 3])
    # round 2: nobody -> keep
    close(run_round(algo, 2, 3, LOSSY_ROUNDS[2], s=S_PROBS), [16 / 3, 28 / 3])


def test_udmapl_hand_computed():
    for empty, last in (("zero", [0.0, 0.0]), ("keep", [2.375, 4.375])):
        algo = setup(UDMAPL(empty_round=empty), 3, [2.0, 2.0], ALPHA)
        # round 0: 0.25 [6,2] + 0.625 [2,10] = [1.5+1.25, 0.5+6.25] = [2.75, 6.75]  (no renormalisation)
        close(run_round(algo, 0, 3, LOSSY_ROUNDS[0], p=S_PROBS), [2.75, 6.75])
        # round 1: model of client 1 = [2.75,6.75] + [2,2] = [4.75, 8.75]; times c1 = 0.5 -> [2.375, 4.375]
        close(run_round(algo, 1, 3, LOSSY_ROUNDS[1], p=S_PROBS), [2.375, 4.375])
        # round 2: nobody -> Eq. 4.4 literally gives the zero model (warned), or keep w
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            close(run_round(algo, 2, 3, LOSSY_ROUNDS[2], p=S_PROBS), last)
        assert len(caught) == (1 if empty == "zero" else 0)


def test_upgapl_estimated_q():
    algo = setup(UPGAPL(q="estimate"), 2, [0.0])
    # round 0: no history -> s_hat = (0+1)/(0+1) = 1 -> weights alpha = 1/2; selected {0,1}, only 0 arrives
    close(run_round(algo, 0, 2, {0: [2.0]}, selected=[0, 1]), [1.0])
    # now s_hat = [(1+1)/(1+1), (0+1)/(1+1)] = [1, 0.5]
    close(algo.loss_estimates(), [0.0, 0.5])
    # round 1: client 1 arrives with weight 0.5/0.5 = 1 -> [1] + 1*[3] = [4]
    close(run_round(algo, 1, 2, {1: [3.0]}, selected=[1]), [4.0])
    assert algo.last_weights == pytest.approx({1: 1.0})
    close(algo.loss_estimates(), [0.0, 1 - 2 / 3])


def _lossy_setup():
    # two reliable clients (q=0.1) pushing +, two unreliable (q=0.5) pushing -; uniform alpha
    s = torch.tensor([0.9, 0.9, 0.5, 0.5], dtype=F64)
    deltas = torch.tensor([[1.0, 2.0], [1.0, 0.0], [-1.0, -2.0], [-1.0, 0.0]], dtype=F64)
    return s, deltas


def _one_draw(algo, w0, deltas, s, pattern):
    algo.params = w0.clone()
    algo.open_round(0, RoundContext(0, 4, *(torch.ones(4, dtype=torch.bool),) * 3, participation_probs=s))
    for c in np.flatnonzero(pattern).tolist():
        algo.add(c, deltas[c], ClientInfo(1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return algo.close_round() - w0


def test_upgapl_unbiased_and_dmapl_biased_towards_reliable_clients():
    s, deltas = _lossy_setup()
    w0 = torch.tensor([0.5, -1.0], dtype=F64)
    lossless = deltas.mean(0)  # FedAvg without losses: sum_i alpha_i delta_i = [0, 0]
    # exact expectation over all 2^4 loss patterns
    # UDMA-PL is unbiased with the literal Eq. 4.4 (the zero model when nobody arrives), not with the default "keep"
    rules = {UPGAPL: UPGAPL, DMAPL: DMAPL, UDMAPL: lambda: UDMAPL(empty_round="zero")}
    exact = {cls: torch.zeros(2, dtype=F64) for cls in rules}
    for pattern in itertools.product([0, 1], repeat=4):
        prob = math.prod(float(s[i]) if b else 1 - float(s[i]) for i, b in enumerate(pattern))
        for cls in exact:
            algo = setup(rules[cls](), 4, w0.tolist())
            exact[cls] += prob * _one_draw(algo, w0, deltas, s, pattern)
    torch.testing.assert_close(exact[UPGAPL], lossless, atol=1e-12, rtol=0)
    torch.testing.assert_close(exact[UDMAPL], lossless, atol=1e-12, rtol=0)  # unbiased too (zero model if empty)
    bias = exact[DMAPL] - lossless
    towards_reliable = deltas[:2].mean(0) - deltas[2:].mean(0)  # [2, 1]
    assert torch.dot(bias, towards_reliable) > 0.5
    assert bias[0] > 0.2  # first coordinate: reliable clients push +1, unreliable -1
    # Monte Carlo over 4000 channel draws. Variance of one UPGA-PL draw, per coordinate:
    # sum_i alpha_i^2 (1-s_i)/s_i delta_i^2 = 0.0625 (0.111*(1+1) + 1*(1+1)) = 0.139 (coord 0) and
    # 0.0625 (0.111*4 + 1*4) = 0.278 (coord 1); std of the mean <= sqrt(0.278/4000) = 0.0083. Tolerance 0.06 (> 7 std).
    rng = np.random.default_rng(11)
    algo = setup(UPGAPL(), 4, w0.tolist())
    draws = rng.random((4000, 4)) < s.numpy()
    mc = torch.stack([_one_draw(algo, w0, deltas, s, row) for row in draws]).mean(0)
    torch.testing.assert_close(mc, lossless, atol=0.06, rtol=0)
    dma = setup(DMAPL(), 4, w0.tolist())
    mc_dma = torch.stack([_one_draw(dma, w0, deltas, s, row) for row in draws[:1000]]).mean(0)
    assert mc_dma[0] > 0.2


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: UPGAPL(), id="upgapl"),
        pytest.param(lambda: UPGAPL(q="estimate"), id="upgapl_est"),
        pytest.param(lambda: DMAPL(), id="dmapl"),
        pytest.param(lambda: UDMAPL(q=[0.1, 0.2, 0.3, 0.4, 0.5], empty_round="keep"), id="udmapl"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: UPGAPL(q=[0.1, 1.0]), "q"),
        (lambda: UPGAPL(q=[-0.1, 0.5]), "q"),
        (lambda: UPGAPL(q="oracle"), "q"),
        (lambda: UDMAPL(empty_round="nan"), "empty_round"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    # q = 1 (a client whose update is never aggregated): the rule runs on and warns once that its data is never seen
    algo = setup(UPGAPL(), 3, [0.0])
    with pytest.warns(RuntimeWarning, match=r"ids 1\): they are never aggregated"):
        algo.open_round(0, make_ctx(0, 3, [0], p=[0.5, 0.0, 1.0]))
    algo.add(0, torch.tensor([1.0], dtype=F64), ClientInfo(1, 1))
    close(algo.close_round(), [1 / 3 / 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same clients again: no second warning
        algo.open_round(1, make_ctx(1, 3, [], p=[0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="participation_probs"):
        setup(UDMAPL(), 3, [0.0]).open_round(0, make_ctx(0, 3, [0]))
    with pytest.raises(ValueError, match="num_clients"):
        setup(UPGAPL(q=[0.1, 0.2]), 3, [0.0])


def test_udmapl_keeps_the_model_by_default_when_nobody_arrives():
    # Slip caught: a default that wipes out training (the literal Eq. 4.4 zero model) when a round is empty.
    algo = setup(UDMAPL(q=[0.5, 0.5]), 2, [2.0, -1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(run_round(algo, 0, 2, {}), [2.0, -1.0])
    assert UDMAPL().hparams()["empty_round"] == "keep"


# ------------------------------------------------------------------------ against the upgapl chunk's survivors
def test_fixed_q_weights_each_arrival_by_alpha_over_one_minus_q():
    # Eq. 4.5 with fixed q = [0.5, 0, 0.2], alpha = [0.25, 0.25, 0.5]: c = alpha / (1 - q) = [0.5, 0.25, 0.625].
    # UPGA-PL: clients 0 ([4, 0]) and 2 ([0, 8]) arrive: w = 0.5 [4, 0] + 0.625 [0, 8] = [2, 5].
    # UDMA-PL (Eq. 4.4): sum c_i (w_t + delta_i) from w_t = [1, 1]: 0.5 [5, 1] + 0.625 [1, 9] = [3.125, 6.125].
    # Slips caught: 1 + q or 2 - q for the success probability.
    q = [0.5, 0.0, 0.2]
    upga = setup(UPGAPL(q=q), 3, [0.0, 0.0], ALPHA)
    close(run_round(upga, 0, 3, {0: [4, 0], 2: [0, 8]}), [2.0, 5.0])
    assert upga.last_weights == pytest.approx({0: 0.5, 2: 0.625})
    udma = setup(UDMAPL(q=q), 3, [1.0, 1.0], ALPHA)
    close(run_round(udma, 0, 3, {0: [4, 0], 2: [0, 8]}), [3.125, 6.125])


def test_options_are_reported():
    assert UPGAPL(q=[0.5, 0.0], server_lr=0.5).hparams() == {"q": [0.5, 0.0], "server_lr": 0.5}
    assert UPGAPL().hparams() == {"q": "known", "server_lr": 1.0}
    assert UDMAPL(q="estimate").hparams() == {"q": "estimate", "empty_round": "keep"}
    assert DMAPL().hparams() == {}
    assert UPGAPL().loss_estimates() is None
    algo = UPGAPL()
    algo.setup(2, torch.zeros(1, dtype=F64), None, torch.tensor([3, 0]))
    assert algo.client_sizes.tolist() == [3, 0]


def test_round_protocol_errors_name_what_is_missing():
    # Slips caught: the messages emptied or changed, the checks of `q="known"` and `q="estimate"` swapped.
    known = setup(UPGAPL(), 2, [0.0])
    with pytest.raises(ValueError, match=r"^UPGAPL\(q='known'\) needs RoundContext\.participation_probs$"):
        known.open_round(0, None)
    estimate = setup(UPGAPL(q="estimate"), 2, [0.0])
    with pytest.raises(ValueError, match=r"^q='estimate' needs RoundContext\.selected to count transmission "
                                         r"attempts$"):
        estimate.open_round(0, None)
    with pytest.raises(ValueError, match=r"^state has no success estimator but q='estimate'$"):
        estimate.load_state_dict(known.state_dict())
    dma = setup(DMAPL(), 2, [0.0])
    run_round(dma, 0, 2, {})
    assert dma.last_weights == {}  # an empty round applies no weights


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: UPGAPL(server_lr=0.0), r"^server_lr must lie in \(0, inf\), got 0.0$"),
        (lambda: UPGAPL(server_lr=float("inf")), r"^server_lr must be finite, got inf$"),
        (lambda: UDMAPL(empty_round="none"), r"^empty_round must be one of"),
        (lambda: UPGAPL(q=[0.5, 1.0]), r"^q \(loss probabilities\)"),
    ],
)
def test_bad_arguments_name_the_parameter(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_the_literal_empty_round_warns_once_with_the_way_out():
    udma = setup(UDMAPL(q=[0.0, 0.0], empty_round="zero"), 2, [3.0])
    with pytest.warns(RuntimeWarning, match=r"^UDMAPL: no update arrived this round; Eq\. 4\.4 returns the zero model "
                                            r"\(pass empty_round='keep' to keep w_t instead\)$"):
        close(run_round(udma, 0, 2, {}), [0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        close(run_round(udma, 1, 2, {}), [0.0])  # once per rule


def test_success_estimator_counts_are_integers():
    # The counts are documented (and checkpointed) as int64; the estimate (arrivals + 1) / (attempts + 1) as float64.
    algo = setup(UPGAPL(q="estimate"), 2, [0.0])
    run_round(algo, 0, 2, {0: [1.0]}, selected=[0, 1])
    est = algo.estimator
    assert (est.attempts.dtype, est.arrivals.dtype) == (torch.int64, torch.int64)
    assert est.attempts.tolist() == [1, 1] and est.arrivals.tolist() == [1, 0]
    torch.testing.assert_close(algo.loss_estimates(), torch.tensor([0.0, 0.5], dtype=F64))
