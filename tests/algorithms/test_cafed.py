"""CA-Fed (thesis ch. 2, Algorithm 3): the estimates it uses, ComputeWeights, the unnormalised aggregation, the loss
filter of eq. 2.22 fed by training losses or by the probe of Alg. 3 line 3, input checks and resume.

Expected numbers come from closed forms or from arithmetic written out in comments, never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import CAFed, ClientInfo, compute_weights, proxy_error
from tests.algorithms.selection_rounds import F64, check_resume, ctx_for, vec

NAN = float("nan")


def test_cafed_estimates_follow_the_formulas():
    # pi_hat = (#active + 1)/(t + 2); P_hat(a->a) from conditional counts with prior 1 (hand-made sequence)
    seq = [[1, 0], [1, 0], [0, 0], [1, 1], [1, 1]]
    algo = CAFed()
    algo.setup(2, torch.zeros(1, dtype=F64))
    for t, row in enumerate(seq):
        algo.select(t, torch.tensor(row, dtype=torch.bool), None)
        algo.open_round(t, ctx_for(t, 2, [i for i in range(2) if row[i]], [], []))
        algo.close_round()
    # client 0: active 4 of 5 -> (4+1)/(5+2) = 5/7; transitions 1->1, 1->0, 0->1, 1->1: P11 = (2+1)/(3+2) = 0.6,
    #   P00 = (0+1)/(1+2) = 1/3 -> lam = 0.6 + 1/3 - 1 = -1/15
    # client 1: active 2 of 5 -> 3/7; transitions 0->0, 0->0, 0->1, 1->1: P00 = (2+1)/(3+2) = 0.6, P11 = 2/3
    #   -> lam = 0.6 + 2/3 - 1 = 4/15
    assert torch.allclose(algo.pi_hat, vec(5 / 7, 3 / 7))
    assert torch.allclose(algo.lam_hat, vec(-1 / 15, 4 / 15))


def test_compute_weights_hand_made_example():
    # alpha uniform over 3 clients, pi = [0.9, 0.9, 0.1], lam = [0, 0, 0.9], gap = F - F* = [0.1, 0.1, 1.0], Gamma = 1
    alpha, pi, lam, gap = [1 / 3] * 3, [0.9, 0.9, 0.1], [0.0, 0.0, 0.9], [0.1, 0.1, 1.0]
    q = np.array(alpha) / np.array(pi)  # [0.3704, 0.3704, 3.333]: pi*q = alpha -> p = alpha, TV = 0
    # eps(q) = <gap, alpha> = 0.4
    assert proxy_error(q, alpha, gap, 1.0, pi, kappa_bar_sq=0.1) == pytest.approx(0.4)
    # kappa^2 = 0.1. Pass 1 (lam descending): client 2 first. Without it p = [0.5, 0.5, 0]:
    #   opt = 0.1, TV = (1/6 + 1/6 + 1/3)/2 = 1/3, bias = 4 * 0.1 * 1/9 * 1 = 0.0444 -> eps+ = 0.1444 < 0.4: dropped.
    #   Then client 0: p = [0, 1, 0], opt = 0.1, TV = 2/3, bias = 0.4 * 4/9 = 0.1778 -> 0.2778 > 0.1444: kept;
    #   client 1 likewise. Pass 2 (pi ascending) re-tests 0 and 1 with the same result.
    out = compute_weights(q, alpha, gap, 1.0, pi, np.abs(lam), kappa_bar_sq=0.1)
    out = compute_weights(out, alpha, gap, 1.0, pi, -np.array(pi), kappa_bar_sq=0.1)
    assert torch.allclose(out, torch.tensor([q[0], q[1], 0.0], dtype=F64))
    assert proxy_error(out, alpha, gap, 1.0, pi, kappa_bar_sq=0.1) == pytest.approx(0.1 + 0.4 / 9)
    # kappa^2 = 1: dropping client 2 gives 0.1 + 4/9 = 0.544 > 0.4 -> nobody dropped
    assert torch.equal(compute_weights(q, alpha, gap, 1.0, pi, np.abs(lam), kappa_bar_sq=1.0), torch.from_numpy(q))
    # tau larger than any possible decrease (0.4 - 0.1444 = 0.2556) -> nobody dropped
    assert torch.equal(compute_weights(q, alpha, gap, 1.0, pi, np.abs(lam), 0.1, tau=0.3), torch.from_numpy(q))
    # tau just below that decrease -> client 2 still dropped
    assert compute_weights(q, alpha, gap, 1.0, pi, np.abs(lam), 0.1, tau=0.25)[2] == 0.0
    # ties (eps == 0 when no loss gap has been seen): strict keeps everyone; the literal thesis rule (>= 0) drops
    # clients down to the last one (removing the last would make eps infinite)
    zero = [0.0, 0.0, 0.0]
    assert torch.equal(compute_weights(q, alpha, zero, 0.0, pi, np.abs(lam), 1.0), torch.from_numpy(q))
    literal = compute_weights(q, alpha, zero, 0.0, pi, np.abs(lam), 1.0, strict=False)
    assert int((literal > 0).sum()) == 1


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_compute_weights_takes_tensors_without_numpy_warnings():
    # the rule passes float64 tensors; numpy 2 warned on every np.asarray(tensor, dtype=...) (Tensor.__array__
    # has no copy keyword). Same hand example as above: client 2 is dropped.
    alpha, pi, gap = torch.full((3,), 1 / 3, dtype=F64), vec(0.9, 0.9, 0.1), vec(0.1, 0.1, 1.0)
    q = alpha / pi
    out = compute_weights(q, alpha, gap, 1.0, pi, vec(0.0, 0.0, 0.9), kappa_bar_sq=0.1)
    assert torch.allclose(out, torch.cat([q[:2], torch.zeros(1, dtype=F64)]))
    assert torch.equal(q, alpha / pi)  # the input is not modified
    assert proxy_error(out, alpha, gap, 1.0, pi, kappa_bar_sq=0.1) == pytest.approx(0.1 + 0.4 / 9)


def test_cafed_round_drops_the_expected_client_and_aggregates_unnormalised():
    # same numbers through the rule: oracle pi/lam, probe losses [1, 1, 1] at w_0 and [1.1, 1.1, 2.0] at w_1 (beta = 1)
    # round 0: gap = 0 for everyone -> eps = 0 and no strict decrease is possible: everyone available trains
    algo = CAFed(kappa_bar_sq=0.1, pi=[0.9, 0.9, 0.1], lam=[0.0, 0.0, 0.9], loss_source="probe")
    algo.setup(3, torch.zeros(2, dtype=F64))
    algo.observe_losses(0, vec(1.0, 1.0, 1.0))
    assert algo.select(0, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, True]
    algo.open_round(0, ctx_for(0, 3, [0, 1, 2], [0, 1, 2], []))
    assert torch.equal(algo.close_round(), torch.zeros(2, dtype=F64))  # nothing arrived
    # round 1: F_hat = [1.1, 1.1, 2.0], F_hat* = [1, 1, 1] -> gap = [0.1, 0.1, 1.0], Gamma = 1.0: client 2 dropped
    algo.observe_losses(1, vec(1.1, 1.1, 2.0))
    assert algo.select(1, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, False]
    algo.open_round(1, ctx_for(1, 3, [0, 1, 2], [0, 1], [0, 1]))
    algo.add(0, vec(0.9, 0.0), ClientInfo(1, 1, loss=5.0))  # probe mode: training losses are ignored
    algo.add(1, vec(0.0, 1.8), ClientInfo(1, 1))
    # q = alpha/pi = (1/3)/0.9 = 10/27, NOT renormalised: w = 10/27 * [0.9, 1.8] = [1/3, 2/3]
    assert torch.allclose(algo.close_round(), vec(1 / 3, 2 / 3))
    assert algo.last_error == pytest.approx(0.1 + 0.4 / 9)
    assert torch.allclose(algo.loss_hat, vec(1.1, 1.1, 2.0))
    # tau large => nobody dropped; kappa_bar_sq large => Unbiased (nobody dropped)
    for kwargs in (dict(kappa_bar_sq=0.1, tau=10.0), dict(kappa_bar_sq=100.0)):
        keep = CAFed(pi=[0.9, 0.9, 0.1], lam=[0.0, 0.0, 0.9], loss_source="probe", **kwargs)
        keep.setup(3, torch.zeros(2, dtype=F64))
        keep.observe_losses(0, vec(1.0, 1.0, 1.0))
        keep.select(0, torch.ones(3, dtype=torch.bool), None)
        keep.open_round(0, ctx_for(0, 3, [0, 1, 2], [0, 1, 2], []))
        keep.close_round()
        keep.observe_losses(1, vec(1.1, 1.1, 2.0))
        assert keep.select(1, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, True]
        assert torch.allclose(keep.last_q, torch.tensor([10 / 27, 10 / 27, 10 / 3], dtype=F64))


def test_cafed_probe_losses_of_round_t_set_the_weights_of_round_t():
    # Alg. 3 line 3: the losses at w_t enter F_hat before round t's weights. beta = 0.5 on the newest loss.
    # round 0 probe [2, nan, 1]: F_hat = [2, nan, 1] (client 1 not probed), F* = F_hat -> gaps 0: nobody dropped.
    # round 1 probe [1, 3, 3]: F_hat_0 = 0.5*2 + 0.5*1 = 1.5 (min 1.5), F_hat_1 = 3 (first), F_hat_2 = 0.5 + 1.5 = 2
    #   (min 1) -> gap = [0, 0, 1], Gamma = 1; pi = [0.9, 0.9, 0.1], alpha uniform, kappa^2 = 0.1:
    #   keeping everyone: p = alpha, eps = <gap, alpha> = 1/3; without client 2: p = [1/2, 1/2, 0], TV = 1/3,
    #   eps = 0 + 4 * 0.1 * 1/9 * 1 = 0.0444 < 1/3 -> dropped; without 0 or 1 as well: p one-hot, TV = 2/3,
    #   eps = 0.4 * 4/9 = 0.178 > 0.044 -> kept.
    algo = CAFed(kappa_bar_sq=0.1, beta=0.5, pi=[0.9, 0.9, 0.1], lam=[0.0, 0.0, 0.0], loss_source="probe")
    algo.setup(3, torch.zeros(1, dtype=F64))
    assert algo.wants_probe_losses()
    algo.observe_losses(0, vec(2.0, NAN, 1.0))
    assert torch.allclose(algo.loss_hat, vec(2.0, NAN, 1.0), equal_nan=True)
    assert algo.select(0, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, True]
    algo.open_round(0, ctx_for(0, 3, [0, 1, 2], [0, 1, 2], [0, 1, 2]))
    for i in range(3):
        algo.add(i, vec(0.0), ClientInfo(1, 1, loss=100.0))  # training losses do not enter the filter
    algo.close_round()
    assert torch.allclose(algo.loss_hat, vec(2.0, NAN, 1.0), equal_nan=True)
    algo.observe_losses(1, vec(1.0, 3.0, 3.0))
    assert torch.allclose(algo.loss_hat, vec(1.5, 3.0, 2.0))
    assert algo.select(1, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, False]
    assert algo.last_gamma == pytest.approx(1.0)
    assert algo.last_error == pytest.approx(0.4 / 9)


def test_cafed_probe_mode_refuses_a_round_without_probe_losses():
    algo = CAFed(loss_source="probe")
    algo.setup(2, torch.zeros(1, dtype=F64))
    everyone = torch.ones(2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match=r"observe_losses\(0, losses\) before select\(0\)"):
        algo.select(0, everyone, None)
    with pytest.raises(RuntimeError, match="observe_losses"):  # nor through open_round's availability
        algo.open_round(0, ctx_for(0, 2, [0, 1], [0, 1], []))
    algo.observe_losses(0, vec(1.0, 1.0))
    algo.select(0, everyone, None)
    algo.open_round(0, ctx_for(0, 2, [0, 1], [0, 1], []))
    algo.close_round()
    with pytest.raises(RuntimeError, match="last probe was for round 0"):  # stale probe: never Unbiased
        algo.select(1, everyone, None)
    with pytest.raises(ValueError, match="increasing round order"):
        algo.observe_losses(0, vec(1.0, 1.0))
    with pytest.raises(ValueError, match="losses has 3 entries but num_clients is 2"):
        algo.observe_losses(1, vec(1.0, 1.0, 1.0))
    algo.observe_losses(1, vec(1.0, 1.0))
    algo.select(1, everyone, None)
    # the training-loss mode needs no probe
    assert not CAFed().wants_probe_losses()


def test_cafed_training_losses_feed_the_filter():
    # loss_source="train" with beta = 0.5: first report sets F_hat, then F_hat <- 0.5 F_hat + 0.5 loss
    algo = CAFed(beta=0.5)
    algo.setup(2, torch.zeros(1, dtype=F64))
    for t, losses in enumerate([(2.0, None), (1.0, 4.0)]):
        algo.select(t, torch.ones(2, dtype=torch.bool), None)
        algo.open_round(t, ctx_for(t, 2, [0, 1], [0, 1], [0, 1]))
        for i, loss in enumerate(losses):
            if loss is not None:
                algo.add(i, vec(0.0), ClientInfo(1, 1, loss=loss))
        algo.close_round()
    # client 0: 2.0 then 0.5*2 + 0.5*1 = 1.5 (min 1.5); client 1: 4.0 (min 4.0)
    assert torch.allclose(algo.loss_hat, vec(1.5, 4.0))
    gap, gamma = algo.loss_gaps()
    assert torch.allclose(gap, vec(0.0, 0.0)) and gamma == 0.0


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: CAFed(tau=-0.1), "tau"),
        (lambda: CAFed(kappa_bar_sq=-1.0), "kappa_bar_sq"),
        (lambda: CAFed(beta=0.0), "beta"),
        (lambda: CAFed(pi=[0.5, 0.0]), "pi"),
        (lambda: CAFed(lam=[0.5, 1.5]), "lam"),
        (lambda: CAFed(loss_source="val"), "loss_source"),
        (lambda: CAFed(server_lr=0.0), "server_lr"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    with pytest.raises(ValueError, match="tau"):
        compute_weights([1.0], [1.0], [0.0], 0.0, [1.0], [0.0], 1.0, tau=-1.0)
    cafed = CAFed()
    cafed.setup(2, torch.zeros(1, dtype=F64))
    with pytest.raises(ValueError, match="availability"):
        cafed.open_round(0, None)
    with pytest.raises(ValueError, match="num_clients"):
        CAFed(pi=[0.5, 0.5, 0.5]).setup(2, torch.zeros(1, dtype=F64))


@pytest.mark.parametrize(
    "factory",
    [lambda: CAFed(kappa_bar_sq=0.5), lambda: CAFed(kappa_bar_sq=0.5, beta=0.5, loss_source="probe")],
    ids=["train", "probe"],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


def test_old_import_paths_still_work():
    import lightning_fedhet.algorithms as algorithms
    from lightning_fedhet.algorithms import cafed

    for name in ("CAFed", "AdaFed", "F3AST", "MarkovAvailabilityEstimator", "compute_weights", "proxy_error"):
        assert getattr(cafed, name) is getattr(algorithms, name), name
