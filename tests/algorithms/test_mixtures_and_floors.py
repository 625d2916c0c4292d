"""Every mixture and every floor of the server rules, by hand, with unequal client weights and a mixing weight other
than 1/2: OS's ``p = (1 - mix) p_norm + mix * omega``, FedACS's and c-a-FedAvg's floor ``s_m >= min_success`` (also
after ``unavailable="drop"`` multiplies by the availability), CA-Fed's loss gap floored at 0 under an oracle
``f_star``, F3AST's EMA activity rate ``r <- (1 - beta) r + beta 1[available]``.

Each test asserts the sampling probabilities (or selection) and the weights applied in one aggregation. A weight of
1/2, or equal client weights, would hide the slips these tests are for: ``mix`` and ``1 - mix`` swapped, ``omega``
replaced by the uniform distribution or left unnormalised, a floor applied before the product it should bound.
Expected numbers come from the arithmetic in the docstrings, never from the code under test.
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_fedhet.algorithms import F3AST, OS, CAFed, CAFedAvg, ClientInfo, FedACS
from tests.algorithms.selection_rounds import F64, ctx_for, vec

ONE = ClientInfo(1, 1)
EVERYONE3 = torch.ones(3, dtype=torch.bool)


def close(got, expected):
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def weights_close(got: dict, expected: dict):
    assert set(got) == set(expected), (got, expected)
    for client, weight in expected.items():
        assert abs(got[client] - weight) < 1e-12, (client, got[client], weight)


# ============================================================================================== OS's mixture
def _os_after_round_zero(K: int, seed: int):
    """OS(K, mix=1/4) on 3 clients with client weights (3, 2, 1), after a round 0 in which clients 0 and 1 arrive
    with updates of norm 1 and 3 and client 2's upload is lost. Returns the rule, round 0's counts and ``w_1``."""
    algo = OS(K=K, mix=0.25)
    algo.setup(3, torch.zeros(2, dtype=F64), client_weights=torch.tensor([3.0, 2.0, 1.0]))
    counts = algo.select(0, EVERYONE3, np.random.default_rng(seed)).tolist()
    assert counts[0] > 0 and counts[1] > 0
    algo.open_round(0, ctx_for(0, 3, [0, 1, 2], [0, 1, 2], [0, 1]))
    algo.add(0, vec(1.0, 0.0), ONE)
    algo.add(1, vec(0.0, 3.0), ONE)
    return algo, counts, algo.close_round().clone()


def test_os_mixture_with_unequal_client_weights_by_hand():
    """OS (FedACS paper eq. (20); Chen, Horváth, Richtárik): ``p = (1 - mix) p_norm + mix * omega`` with
    ``p_norm ∝ omega_m n_m`` (``n_m`` the norm of client m's last received update, the mean known norm for a client
    never received), aggregation ``w + (1/K) sum_received c_m (omega_m / p_m) delta_m``.

    omega = (3, 2, 1) / 6 = (1/2, 1/3, 1/6), mix = 1/4, K = 44.

    Round 0: no norm known, every n_m = 1: p_norm = omega, so p = omega = (1/2, 1/3, 1/6); factors omega/p = 1, so
    each arrived update weighs c_m / 44. Clients 0 and 1 arrive with (1, 0) and (0, 3) (norms 1 and 3); client 2's
    upload is lost: w_1 = (c_0, 3 c_1) / 44.

    Round 1: n = (1, 3, 2) (client 2: the mean of the known norms, (1 + 3) / 2).
      omega n = (1/2, 1, 1/3), sum 11/6  ->  p_norm = (3/11, 6/11, 2/11)
      p = 3/4 p_norm + 1/4 omega = (9/44 + 1/8, 18/44 + 1/12, 6/44 + 1/24) = (87, 130, 47) / 264   (sum 264/264)
      factors omega/p = (132/87, 88/130, 44/47) = (44/29, 44/65, 44/47); with K = 44 an arrived update of client m
      weighs c_m / 29, c_m / 65, c_m / 47.
    The slips give other p: mix and 1 - mix swapped (1/4 p_norm + 3/4 omega = (0.4432, 0.3864, 0.1705)), the
    uniform distribution instead of omega ((0.2879, 0.4924, 0.2197)), p_norm left unnormalised (3/4 (1/2, 1, 1/3)
    + 1/4 omega, renormalised by select: (12, 20, 7) / 39), the never-received client at norm 1 instead of the mean
    ((21, 32, 7) / 60).
    """
    algo, c0, w1 = _os_after_round_zero(K=44, seed=3)
    # round 0
    assert sum(c0) == 44
    weights_close(algo.last_weights, {0: c0[0] / 44, 1: c0[1] / 44})
    close(w1, vec(c0[0] / 44, 3 * c0[1] / 44))
    # round 1: the probabilities the draws are taken from
    counts = algo.select(1, EVERYONE3, np.random.default_rng(4)).tolist()
    close(algo.last_probabilities, vec(87 / 264, 130 / 264, 47 / 264))
    assert all(c > 0 for c in counts) and sum(counts) == 44
    # the weights of one aggregation: every drawn client arrives with delta (1, 1)
    algo.open_round(1, ctx_for(1, 3, [0, 1, 2], [0, 1, 2], [0, 1, 2]))
    for m in range(3):
        algo.add(m, vec(1.0, 1.0), ONE)
    w2 = algo.close_round()
    expected = {0: counts[0] / 29, 1: counts[1] / 65, 2: counts[2] / 47}
    weights_close(algo.last_weights, expected)
    step = sum(expected.values())
    close(w2, w1 + vec(step, step))


def test_os_draws_follow_the_mixture():
    """The same round 1 with K = 10**6 draws: each count / K lies within 5 standard deviations (sqrt(p (1 - p) / K)
    <= 5e-4) of p = (87, 130, 47) / 264 = (0.3295, 0.4924, 0.1780): the draws are taken from the mixture, not from
    p_norm = (3, 6, 2) / 11 = (0.2727, 0.5455, 0.1818) or omega."""
    algo, _, _ = _os_after_round_zero(K=10**6, seed=3)
    counts = algo.select(1, EVERYONE3, np.random.default_rng(4)).to(F64)
    p = vec(87 / 264, 130 / 264, 47 / 264)
    sd = (p * (1 - p) / 10**6).sqrt()
    assert ((counts / 10**6 - p).abs() < 5 * sd).all(), (counts / 10**6, p)


# ============================================================================================== min_success floors
def test_fedacs_floors_success_at_min_success_before_and_after_the_availability():
    """FedACS (Algorithm 1, p_m ∝ omega_m / (s_m ||a_m||_1)) with min_success = 1/4: s_m is floored at 1/4 after
    ``unavailable="drop"`` has multiplied it by the availability pi_m (s_m -> pi_m s_m), so p_m stays finite.

    omega = (2, 1, 1) / 4 = (1/2, 1/4, 1/4), s = (0.1, 0.5, 1), ||a||_1 = (1, 1, 2), pi = (1, 0.4, 0.5), K = 8.
    renormalize: s -> (1/4, 1/2, 1): omega / (s a) = (2, 1/2, 1/8), sum 21/8 -> p = (16, 4, 1) / 21
                 (without the floor: (5, 1/2, 1/8) -> (40, 4, 1) / 45).
    drop:        pi s = (0.1, 0.2, 0.5) -> (1/4, 1/4, 1/2): omega / (s a) = (2, 1, 1/4), sum 13/4 -> p = (8, 4, 1) / 13
                 (floored before the product, (1/4, 1/2, 1) * pi = (1/4, 0.2, 1/2): (2, 1.25, 1/4) -> (8, 5, 1) / 14).
    FedACS aggregates anonymously, w + (1/K) sum c_m delta_m: every drawn client arrives with delta 1, so client m
    weighs c_m / 8 and w moves by 1 (all K = 8 draws arrive).
    """
    for unavailable, expected in (("renormalize", vec(16 / 21, 4 / 21, 1 / 21)), ("drop", vec(8 / 13, 4 / 13, 1 / 13))):
        algo = FedACS(K=8, min_success=0.25, unavailable=unavailable)
        algo.setup(3, torch.zeros(1, dtype=F64), client_weights=torch.tensor([2.0, 1.0, 1.0]))
        algo.observe_system(0, success_probs=[0.1, 0.5, 1.0], accumulation_norms=[1.0, 1.0, 2.0],
                            participation_probs=[1.0, 0.4, 0.5])
        counts = algo.select(0, EVERYONE3, np.random.default_rng(0)).tolist()
        close(algo.last_probabilities, expected)
        drawn = [m for m in range(3) if counts[m] > 0]
        algo.open_round(0, None)
        for m in drawn:
            algo.add(m, vec(1.0), ONE)
        close(algo.close_round(), vec(1.0))
        weights_close(algo.last_weights, {m: counts[m] / 8 for m in drawn})


def test_cafedavg_drop_floors_the_product_of_success_and_availability():
    """c-a-FedAvg (aggregation ``w + (1/K) sum c_m delta_m / s_m``) with ``unavailable="drop"``: s_m -> pi_m s_m,
    floored at min_success = 1/4 *after* the product (the test of the plain floor is in test_fedacs_by_hand).

    omega = (2, 1, 1) / 4, sampled from p = omega = (1/2, 1/4, 1/4) (the floor does not touch the sampling);
    this round's s = (0.1, 0.5, 1) and pi = (1, 0.4, 0.5): pi s = (0.1, 0.2, 0.5) -> (1/4, 1/4, 1/2), factors
    1/s = (4, 4, 2). K = 4: client m weighs c_m * (1, 1, 1/2). (Floored only before the product: 1/s_1 = 1/0.2 = 5.)
    """
    algo = CAFedAvg(K=4, min_success=0.25, unavailable="drop")
    algo.setup(3, torch.zeros(1, dtype=F64), client_weights=torch.tensor([2.0, 1.0, 1.0]))
    counts = algo.select(0, EVERYONE3, np.random.default_rng(1)).tolist()
    close(algo.last_probabilities, vec(0.5, 0.25, 0.25))
    drawn = [m for m in range(3) if counts[m] > 0]
    assert 1 in drawn
    algo.open_round(0, ctx_for(0, 3, [0, 1, 2], drawn, drawn, s=[0.1, 0.5, 1.0], pi=[1.0, 0.4, 0.5]))
    for m in drawn:
        algo.add(m, vec(1.0), ONE)
    factor = (1.0, 1.0, 0.5)
    expected = {m: counts[m] * factor[m] for m in drawn}
    w = algo.close_round()
    weights_close(algo.last_weights, expected)
    close(w, vec(sum(expected.values())))


# ============================================================================================== CA-Fed's gap floor
def test_cafed_floors_the_loss_gap_at_zero_under_an_oracle_f_star():
    """CA-Fed (thesis ch. 2, eq. 2.23): gap_i = F_hat_i - F_i* >= 0, floored at 0 when the oracle F_i* lies above the
    filtered loss; a client never probed gets the mean of the known gaps; Gamma = the largest known gap.

    4 clients, alpha = (1, 1, 1, 1) / 4, f_star = 1, probe losses (0.5, 3, 2, nan):
      gap = (max(0.5 - 1, 0), 2, 1, mean(0, 2, 1)) = (0, 2, 1, 1), Gamma = 2
      (unfloored: (-0.5, 2, 1, 5/6)).
    kappa_bar_sq = 10 makes the bias term 4 * 10 * Gamma * (1/4)^2 = 5 for any removal, far above every mean gap,
    so nobody is dropped: q = alpha / pi with pi = (1/2, 1/2, 1, 1) -> q = (1/2, 1/2, 1/4, 1/4), and the error is
    <gap, alpha> = (0 + 2 + 1 + 1) / 4 = 1 (unfloored: 0.8333). One aggregation with deltas (1, 2, 4, 8) arriving:
    w = 1/2 + 1 + 1 + 2 = 4.5 (weights q_i).
    """
    algo = CAFed(kappa_bar_sq=10.0, pi=[0.5, 0.5, 1.0, 1.0], lam=[0.0, 0.0, 0.0, 0.0], f_star=[1.0] * 4,
                 loss_source="probe")
    algo.setup(4, torch.zeros(1, dtype=F64))
    algo.observe_losses(0, vec(0.5, 3.0, 2.0, float("nan")))
    gap, gamma = algo.loss_gaps()
    close(gap, vec(0.0, 2.0, 1.0, 1.0))
    assert gamma == 2.0
    everyone = torch.ones(4, dtype=torch.bool)
    assert algo.select(0, everyone, None).tolist() == [True, True, True, True]
    close(algo.last_q, vec(0.5, 0.5, 0.25, 0.25))
    assert abs(algo.last_error - 1.0) < 1e-12
    algo.open_round(0, ctx_for(0, 4, range(4), range(4), range(4)))
    for i, delta in enumerate((1.0, 2.0, 4.0, 8.0)):
        algo.add(i, vec(delta), ONE)
    close(algo.close_round(), vec(4.5))
    weights_close(algo.last_weights, {0: 0.5, 1: 0.5, 2: 0.25, 3: 0.25})


# ============================================================================================== F3AST's EMA rate
def test_f3ast_ema_rate_with_beta_one_fifth_by_hand():
    """F3AST, rate="ema", bias-corrected (init_rate None): v <- (1 - b) v + b 1[available], u <- (1 - b) u + b,
    r = v / u; the k = 1 available client with the largest (alpha_i / r_i)^2 is chosen and weighs alpha_i / r_i.

    b = 1/5, alpha = (1, 3) / 4.
    Round 0, both available: v = (0.2, 0.2), u = 0.2 -> r = (1, 1); scores (1/16, 9/16) -> client 1; delta 4:
      w = 3/4 * 4 = 3.
    Round 1, client 0 alone: v = 0.8 (0.2, 0.2) + 0.2 (1, 0) = (0.36, 0.16), u = 0.36 -> r = (1, 4/9); client 0,
      weight 1/4; delta 8: w = 3 + 2 = 5.
    Round 2, both: v = 0.8 (0.36, 0.16) + 0.2 = (0.488, 0.328), u = 0.488 -> r = (1, 41/61); scores 1/16 and
      (3/4 * 61/41)^2 = 1.245 -> client 1, weight 3/4 * 61/41 = 183/164; delta 164: w = 5 + 183 = 188.
    With b and 1 - b swapped, round 1 gives r_1 = 0.16 / 0.96 = 1/6, not 4/9.
    """
    algo = F3AST(k=1, beta=0.2)
    algo.setup(2, torch.zeros(1, dtype=F64), torch.tensor([1.0, 3.0]))
    w = None
    for t, (available, chosen, rates, weight, delta, after) in enumerate([
        ([0, 1], 1, (1.0, 1.0), 0.75, 4.0, 3.0),
        ([0], 0, (1.0, 4 / 9), 0.25, 8.0, 5.0),
        ([0, 1], 1, (1.0, 41 / 61), 183 / 164, 164.0, 188.0),
    ]):
        mask = torch.zeros(2, dtype=torch.bool)
        mask[available] = True
        selected = algo.select(t, mask, None)
        assert torch.nonzero(selected).flatten().tolist() == [chosen], t
        close(algo.rates, vec(*rates))
        algo.open_round(t, ctx_for(t, 2, available, [chosen], [chosen]))
        algo.add(chosen, vec(delta), ONE)
        w = algo.close_round()
        weights_close(algo.last_weights, {chosen: weight})
        close(w, vec(after))
