"""FedAU (Wang & Ji, Algorithms 1-2): hand-computed rounds, long-run weights, transcription of Algorithm 2.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, FedAU, IntervalEstimator
from tests.algorithms.rule_rounds import F64, check_resume, close, run_round, setup


def test_fedau_hand_computed():
    # K=2, alpha=1/3. Algorithm 2, starting from M=0, S=0, omega=1:
    # after round 0 (I_0=[1,0,0]): S=[1,1,1]; client 0 closes (participated): omega_0=S=1, M0=1; others open
    # after round 1 (I_1=[1,1,0]): S=[1,2,2]; all close (0,1 participated; 2 hits S=K=2):
    #   omega = [(1*1+1)/2, 2, 2] = [1, 2, 2]
    algo = setup(FedAU(K=2), 3, [0.0, 0.0])
    # round 0: omega = 1 -> w1 = (1/3)*1*[3,0] = [1, 0]
    close(run_round(algo, 0, 3, {0: [3, 0]}), [1.0, 0.0])
    # round 1: omega = [1,1,1] -> w2 = w1 + (1/3)([0,3] + [3,3]) = [1,0] + [1,2] = [2,2]
    close(run_round(algo, 1, 3, {0: [0, 3], 1: [3, 3]}), [2.0, 2.0])
    close(algo.aggregation_weights(), [1.0, 2.0, 2.0])
    # round 2: omega = [1,2,2] -> w3 = w2 + (1/3)*2*([3,0] + [0,6]) = [2,2] + [2,4] = [4,6]
    close(run_round(algo, 2, 3, {1: [3, 0], 2: [0, 6]}), [4.0, 6.0])
    assert algo.last_weights == pytest.approx({1: 2 / 3, 2: 2 / 3})
    # after round 2 (I_2=[0,1,1]): S=[1,1,1]; clients 1,2 close: (1*2+1)/2 = 1.5; client 0 open -> omega=[1,1.5,1.5]
    close(algo.aggregation_weights(), [1.0, 1.5, 1.5])
    close(algo.participation_estimates(), [1.0, 2 / 3, 2 / 3])


def test_fedau_empty_round_keeps_params_but_ticks_intervals():
    algo = setup(FedAU(K=2), 2, [1.0])
    close(run_round(algo, 0, 2, {}), [1.0])
    close(run_round(algo, 1, 2, {}), [1.0])  # both clients' first interval closes by cut-off: S=K=2
    close(algo.aggregation_weights(), [2.0, 2.0])


def _bernoulli_fedau_weight(K, n=500, rounds=4000, p=0.02, seed=0):
    rng = np.random.default_rng(seed)
    algo = setup(FedAU(K=K), n, [0.0])
    one = torch.ones(1, dtype=F64)
    info = ClientInfo(num_samples=1, local_steps=1)
    for t in range(rounds):
        algo.open_round(t, None)
        for c in np.flatnonzero(rng.random(n) < p).tolist():
            algo.add(c, one, info)
        algo.close_round()
    return algo.aggregation_weights().mean().item()


def test_fedau_bernoulli_long_run_weights():
    # K-cut-off geometric interval: E[min(G, K)] = (1 - (1-p)^K) / p = (1 - 0.98^50)/0.02 = 31.79...
    expected_k50 = (1 - 0.98**50) / 0.02
    assert expected_k50 == pytest.approx(31.8, abs=0.05)
    assert _bernoulli_fedau_weight(50) == pytest.approx(expected_k50, abs=1.5)
    # no cut-off: mean geometric interval 1/p = 50 (500 clients x ~80 intervals: std of the mean ~0.25)
    assert _bernoulli_fedau_weight(None) == pytest.approx(50.0, abs=1.5)


def _reference_algorithm2(indicators, K):
    """Direct transcription of FedAU's Algorithm 2 for one client; returns [omega_0, ..., omega_{T-1}]."""
    M = 0
    S_diamond = 0
    omega = [1]  # omega_0 = 1
    for t in range(1, len(indicators)):
        S_diamond = S_diamond + 1
        if indicators[t - 1] == 1 or (K is not None and S_diamond == K):
            S = S_diamond
            if M == 0:
                omega.append(S)
            else:
                omega.append((M * omega[t - 1] + S) / (M + 1))
            M = M + 1
            S_diamond = 0
        else:
            omega.append(omega[t - 1])
    return omega


@pytest.mark.parametrize("K", [1, 3, 50, None])
def test_fedau_matches_transcription_of_algorithm2_on_1000_sequences(K):
    n, rounds = 1000, 60
    rng = np.random.default_rng(7)
    p = rng.uniform(0.02, 0.6, size=n)
    masks = rng.random((rounds, n)) < p  # 1,000 random participation sequences (one per client)
    ref = np.array([_reference_algorithm2(masks[:, i].astype(int).tolist(), K) for i in range(n)], dtype=float).T
    algo = setup(FedAU(K=K), n, [0.0])
    one = torch.ones(1, dtype=F64)
    info = ClientInfo(num_samples=1, local_steps=1)
    for t in range(rounds):
        assert np.array_equal(algo.aggregation_weights().numpy(), ref[t]), f"round {t}"
        algo.open_round(t, None)
        for c in np.flatnonzero(masks[t]).tolist():
            algo.add(c, one, info)
        algo.close_round()
        for c, w in algo.last_weights.items():
            assert w == pytest.approx(ref[t, c] / n, rel=1e-12)


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: FedAU(K=3), id="fedau"),
        pytest.param(lambda: FedAU(K=None, server_lr=0.5), id="fedau_inf"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedAU(K=0), "K"),
        (lambda: FedAU(K=-5), "K"),
        (lambda: FedAU(K=2.5), "K"),
        (lambda: IntervalEstimator(K=0), "K"),
        # beyond int64 the interval counters cannot be compared with K (found by the property test: K = 2**64
        # raised an OverflowError at the first round instead of a ValueError at construction)
        (lambda: FedAU(K=2**64), r"^K \(FedAU cut-off interval\) must be an integer in \[1, 2\*\*63 - 1\]"),
        (lambda: FedAU(server_lr=-1.0), "server_lr"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_the_largest_cutoff_runs_like_no_cutoff_for_any_feasible_run():
    # K = 2**63 - 1 is accepted and, since no interval can reach it, gives the same estimates as K = None.
    # Slip caught: an off-by-one bound that refuses the largest int64 or overflows comparing with it.
    big, none = IntervalEstimator(K=2**63 - 1), IntervalEstimator(K=None)
    for est in (big, none):
        est.setup(3)
    for mask in ([1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]):
        for est in (big, none):
            est.update(torch.tensor(mask))
    torch.testing.assert_close(big.omega, none.omega)


# ------------------------------------------------------------------------ against the fedau chunk's survivors
def test_fedau_with_non_uniform_client_weights_by_hand():
    # Algorithm 1 with alpha = [1/4, 3/4]: w += sum_{n in S_t} alpha_n omega_n delta_n. Round 0: only client 1
    # arrives (delta 0); client 0's interval stays open (S_0 = 1). Round 1: both arrive, omega = [1, 1] (no interval
    # of client 0 has closed yet): w += 1/4 * 1 * 4 + 3/4 * 0 = 1; client 0's interval closes at length 2.
    # Round 2: client 0 alone, omega_0 = 2: w += 1/4 * 2 * 4 = 2 -> 3. Slip caught: the weights dropped (uniform
    # 1/2 would give 2 and then 6).
    algo = setup(FedAU(K=50), 2, [0.0], weights=torch.tensor([1.0, 3.0], dtype=F64))
    close(run_round(algo, 0, 2, {1: [0.0]}), [0.0])
    close(run_round(algo, 1, 2, {0: [4.0], 1: [0.0]}), [1.0])
    torch.testing.assert_close(algo.aggregation_weights(), torch.tensor([2.0, 1.0], dtype=F64))
    close(run_round(algo, 2, 2, {0: [4.0]}), [3.0])
    assert algo.last_weights == pytest.approx({0: 0.5})


def test_defaults_state_and_options():
    # The paper's K = 50 is the default of both; the estimator's documented dtypes (int64 counters, float64 omega);
    # state before setup; rounds counted.
    assert FedAU().K == 50 and IntervalEstimator().K == 50
    assert FedAU(K=None, server_lr=0.5).hparams() == {"K": None, "server_lr": 0.5}
    est = IntervalEstimator(K=3)
    assert est.state_dict() == {"K": 3, "num_clients": 0, "rounds": 0, "count": None, "current": None, "omega": None}
    fresh = IntervalEstimator(K=3)
    fresh.load_state_dict(est.state_dict())
    assert fresh.omega is None and fresh.rounds == 0
    with pytest.raises(RuntimeError, match=r"^IntervalEstimator.setup\(num_clients\) must be called first$"):
        est.update(torch.tensor([True]))
    est.setup(1)
    assert (est.count.dtype, est.current.dtype, est.omega.dtype) == (torch.int64, torch.int64, F64)
    for _ in range(4):
        est.update(torch.tensor([False]))
    assert est.rounds == 4 and est.state_dict()["rounds"] == 4
    with pytest.raises(ValueError, match=r"^state was saved with K=3 but this estimator has K=None$"):
        IntervalEstimator(K=None).load_state_dict(est.state_dict())
    with pytest.raises(ValueError, match=r"^participation mask must have num_clients=1 entries, got 2$"):
        est.update(torch.tensor([True, False]))
    algo = FedAU()
    algo.setup(2, torch.zeros(1, dtype=F64), None, torch.tensor([3, 5]))
    assert algo.client_sizes.tolist() == [3, 5]


def test_one_client_is_enough_and_zero_is_refused():
    IntervalEstimator().setup(1)
    with pytest.raises(ValueError, match=r"^num_clients must be >= 1, got 0$"):
        IntervalEstimator().setup(0)


@pytest.mark.parametrize(
    "server_lr, message",
    [(0.0, r"^server_lr must lie in \(0, inf\), got 0.0$"), (float("inf"), r"^server_lr must be finite, got inf$")],
)
def test_server_lr_outside_its_range_is_refused(server_lr, message):
    with pytest.raises(ValueError, match=message):
        FedAU(server_lr=server_lr)
