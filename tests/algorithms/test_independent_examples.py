"""Hand-computed examples that were missing: FedNova with sample weights and with draw counts, FedStale for
participating clients with 0 < beta < 1, MIFA with non-uniform weights, SampledFedAvg's rule (3). Every expected
number is worked out in the comments from the papers' equations, never from the code under test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import MIFA, ClientInfo, FedNova, FedStale, RoundContext, SampledFedAvg
from tests.algorithms.rule_rounds import F64, close, run_round, setup


def test_fednova_with_sample_weights():
    # Slip caught: FedNova ignoring n_i under weighting="samples", or normalising by the wrong ||a||_1.
    # n = (1, 3), tau = (1, 2) (SGD: ||a||_1 = tau), deltas 2 and 6 -> normalised 2/1 = 2, 6/2 = 3.
    # tau_eff = (1 * 1 + 3 * 2) / 4 = 7/4; w = 0 + 7/4 * (1/4 * 2 + 3/4 * 3) = 7/4 * 11/4 = 77/16
    algo = setup(FedNova(weighting="samples"), 2, [0.0])
    close(run_round(algo, 0, 2, {0: [2.0], 1: [6.0]}, steps=[1, 2], samples=[1, 3]), [77 / 16])
    # the weight applied to each raw delta: n_i / sum n * tau_eff / ||a_i||_1 = (1/4 * 7/4, 3/4 * 7/8)
    assert algo.last_weights == pytest.approx({0: 7 / 16, 1: 21 / 32})


def _counts_ctx(t, counts, received):
    counts = torch.tensor(counts)
    recv = torch.zeros(len(counts), dtype=torch.bool)
    recv[list(received)] = True
    return RoundContext(t, len(counts), counts > 0, counts, recv)


def test_fednova_selected_divisor_counts_a_client_drawn_twice_twice():
    # FedACS paper Eq. 116a with K = 3 draws, client 0 drawn twice: m = (2, 1, 0), alpha = 1/3, one local step each.
    # Both arrive (deltas 3 and 6): sum over S of m alpha = 1, tau_eff = 1: w = 2/3 * 3 + 1/3 * 6 = 4.
    # Client 1 lost: w = 2/3 * 3 / 1 = 2 (not renormalised to 3). Slip caught: multiplicity dropped (m = 1 -> 3 / 2).
    for received, expected in (([0, 1], 4.0), ([0], 2.0)):
        algo = setup(FedNova(divisor="selected"), 3, [0.0])
        algo.open_round(0, _counts_ctx(0, [2, 1, 0], received))
        for c, d in ((0, 3.0), (1, 6.0)):
            if c in received:
                algo.add(c, torch.tensor([d], dtype=F64), ClientInfo(1, 1))
        close(algo.close_round(), [expected])


def test_fedstale_participating_with_beta_between_zero_and_one():
    # FedStale paper update with the fresh part over the participating clients (weighting="participating"):
    #   w <- w + sum_{i in S} alpha_i (delta_i - beta h_i) / sum_{i in S} alpha_i + beta sum_j alpha_j h_j
    # N = 2, alpha = (1/4, 3/4), beta = 0.5, memories h = 0 at first, then each arrival stores its delta.
    # Round 0, both arrive with 4 and 2: fresh (1/4 4 + 3/4 2) / 1 = 2.5, stale 0 -> w = 2.5; h = (4, 2).
    # Round 1, client 1 alone with 6: fresh 3/4 (6 - 0.5 2) / (3/4) = 5; stale 0.5 (1/4 4 + 3/4 2) = 1.25
    #   -> w = 2.5 + 6.25 = 8.75; h = (4, 6).
    # Round 2, client 0 alone with -4: fresh (-4 - 2) = -6; stale 0.5 (1 + 4.5) = 2.75 -> w = 8.75 - 3.25 = 5.5.
    # Slips caught: the stale term taken after this round's replacement, beta applied to the fresh part twice.
    algo = setup(FedStale(beta=0.5, weighting="participating"), 2, [0.0], weights=torch.tensor([1.0, 3.0]))
    close(run_round(algo, 0, 2, {0: [4.0], 1: [2.0]}), [2.5])
    close(run_round(algo, 1, 2, {1: [6.0]}), [8.75])
    close(run_round(algo, 2, 2, {0: [-4.0]}), [5.5])


def test_mifa_with_non_uniform_weights():
    # MIFA: refresh the arrived clients' memories y_i, then w <- w + sum_j alpha_j y_j over ALL clients.
    # alpha = (1/4, 3/4). Round 0: client 0 sends 4: y = (4, 0) -> w = 1. Round 1: client 1 sends 2: y = (4, 2)
    # -> w = 1 + (1 + 1.5) = 3.5. Round 2: nobody (default empty_round="stale" applies the memory) -> 6.
    # Slip caught: uniform weights (round 1 would give 1 + 3 = 4) or averaging over the arrived clients only.
    algo = setup(MIFA(), 2, [0.0], weights=torch.tensor([1.0, 3.0]))
    close(run_round(algo, 0, 2, {0: [4.0]}), [1.0])
    close(run_round(algo, 1, 2, {1: [2.0]}), [3.5])
    close(run_round(algo, 2, 2, {}), [6.0])


def test_sampled_fedavg_divides_the_draw_weighted_sum_by_k():
    # Rule (3) of the FedACS paper: w <- w + (1/K) sum_{m received} c_m delta_m, c_m the number of draws. With K = 5
    # draws from p = (0.5, 0.3, 0.2), clients' deltas (1, 10, 100): whatever the draw, the step is
    # (c_0 1 + c_1 10 + c_2 100) / 5 if all arrive, and a lost client's term is just missing (divisor still K).
    # Slips caught: dividing by the number of distinct clients, or by the arrivals, or ignoring c_m.
    algo = SampledFedAvg(K=5, probabilities=[0.5, 0.3, 0.2])
    algo.setup(3, torch.zeros(1, dtype=F64))
    counts = algo.select(0, torch.ones(3, dtype=torch.bool), np.random.default_rng(4)).tolist()
    assert sum(counts) == 5
    drawn = [m for m in range(3) if counts[m] > 0]
    lost = drawn[-1]  # its upload is lost
    algo.open_round(0, _counts_ctx(0, counts, [m for m in drawn if m != lost]))
    deltas = {0: 1.0, 1: 10.0, 2: 100.0}
    for m in drawn:
        if m != lost:
            algo.add(m, torch.tensor([deltas[m]], dtype=F64), ClientInfo(1, 1))
    expected = sum(counts[m] * deltas[m] for m in drawn if m != lost) / 5
    close(algo.close_round(), [expected])


def test_os_sampling_with_mix():
    # OS (FedACS paper eq. 20) mixed with omega: p = (1 - mix) omega n / sum(omega n) + mix omega, aggregated with
    # c_m omega_m / p_m / K. omega = (1/2, 1/2), mix = 1/2, K = 8.
    # Round 0, no norm known: p = (1/2, 1/2). Both drawn (8 draws; checked), deltas (3, 4) and (0, 1): norms 5, 1.
    # Round 1: omega n = (2.5, 0.5) -> (5/6, 1/6); p = (5/12 + 1/4, 1/12 + 1/4) = (2/3, 1/3);
    # factors omega / p = (3/4, 3/2). Slips caught: mix applied the other way round, norms of the wrong round,
    # the factor omega/p left out (the plain average would not be unbiased).
    from lightning_fedhet.algorithms import OS

    algo = OS(K=8, mix=0.5)
    algo.setup(2, torch.zeros(2, dtype=F64))
    rng = np.random.default_rng(0)
    counts = algo.select(0, torch.ones(2, dtype=torch.bool), rng).tolist()
    assert all(c > 0 for c in counts)
    torch.testing.assert_close(algo.last_probabilities, torch.tensor([0.5, 0.5], dtype=F64))
    algo.open_round(0, _counts_ctx(0, counts, [0, 1]))
    algo.add(0, torch.tensor([3.0, 4.0], dtype=F64), ClientInfo(1, 1))
    algo.add(1, torch.tensor([0.0, 1.0], dtype=F64), ClientInfo(1, 1))
    # round 0's step: factors omega / p = 1: (c_0 (3, 4) + c_1 (0, 1)) / 8
    expected = (counts[0] * torch.tensor([3.0, 4.0]) + counts[1] * torch.tensor([0.0, 1.0])).double() / 8
    torch.testing.assert_close(algo.close_round(), expected)
    counts = algo.select(1, torch.ones(2, dtype=torch.bool), rng).tolist()
    torch.testing.assert_close(algo.last_probabilities, torch.tensor([2 / 3, 1 / 3], dtype=F64))
    algo.open_round(1, _counts_ctx(1, counts, [m for m in range(2) if counts[m] > 0]))
    step = torch.zeros(2, dtype=F64)
    for m, (factor, delta) in enumerate(((0.75, [1.0, 0.0]), (1.5, [0.0, 2.0]))):
        if counts[m] > 0:
            algo.add(m, torch.tensor(delta, dtype=F64), ClientInfo(1, 1))
            step += counts[m] * factor * torch.tensor(delta, dtype=F64) / 8
    torch.testing.assert_close(algo.close_round(), expected + step)


def test_adafed_estimated_pi():
    # AdaFed with pi_source="estimate": pi_hat is the Beta(1, 1) posterior mean of each client's availability over
    # the rounds observed so far (this round included: select() observes it first), (on + 1) / (rounds + 2).
    # alpha = (1/2, 1/2). Round 0: both available: pi_hat = (2/3, 2/3) -> q = (1/2, 1/2); deltas 2 and 4 -> w = 3.
    # Round 1: only client 0: pi_hat = (3/4, 2/4); S = {0}: q_0 = 1 -> w = 3 + 1 = 4.
    # Round 2: both: pi_hat = (4/5, 3/5): alpha/pi = (5/8, 5/6), sum 35/24 -> q = (3/7, 4/7); deltas 7, 7 -> w = 11.
    # Slips caught: the estimate taken before this round's observation, or weights not renormalised over S_t.
    from lightning_fedhet.algorithms import AdaFed

    algo = AdaFed(pi_source="estimate")
    algo.setup(2, torch.zeros(1, dtype=F64))
    rounds = [([0, 1], {0: 2.0, 1: 4.0}, 3.0), ([0], {0: 1.0}, 4.0), ([0, 1], {0: 7.0, 1: 7.0}, 11.0)]
    for t, (avail, deltas, expected) in enumerate(rounds):
        mask = torch.zeros(2, dtype=torch.bool)
        mask[avail] = True
        algo.select(t, mask, None)
        algo.open_round(t, RoundContext(t, 2, mask, mask, mask))
        for c, d in deltas.items():
            algo.add(c, torch.tensor([d], dtype=F64), ClientInfo(1, 1))
        close(algo.close_round(), [expected])
    torch.testing.assert_close(algo.last_pi, torch.tensor([4 / 5, 3 / 5], dtype=F64))
