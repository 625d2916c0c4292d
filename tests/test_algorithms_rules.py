"""Server rules of issue 4: FedVARP, MIFA, FedStale, FedAU, UPGA-PL/DMA-PL/UDMA-PL, FedNova.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import io
import itertools
import math
import warnings

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import (
    DMAPL,
    MIFA,
    UDMAPL,
    UPGAPL,
    ClientInfo,
    FedAU,
    FedAvg,
    FedNova,
    FedStale,
    FedVARP,
    IntervalEstimator,
    RoundContext,
)
from lightning_fedhet.algorithms.fednova import accumulation_norm

F64 = torch.float64


# ---------------------------------------------------------------------------------------------- helpers
def make_ctx(t, n, received, p=None, s=None, selected=None):
    recv = torch.zeros(n, dtype=torch.bool)
    recv[list(received)] = True
    sel = recv.clone() if selected is None else torch.zeros(n, dtype=torch.bool)
    if selected is not None:
        sel[list(selected)] = True
    return RoundContext(
        round=t,
        num_clients=n,
        available=sel.clone(),
        selected=sel,
        received=recv,
        participation_probs=None if p is None else torch.as_tensor(p, dtype=F64),
        success_probs=None if s is None else torch.as_tensor(s, dtype=F64),
        local_steps=None,
    )


def run_round(algo, t, n, deltas, p=None, s=None, steps=None, samples=None, selected=None):
    """One round: ``deltas`` maps client -> list of floats. Returns the new parameters."""
    algo.open_round(t, make_ctx(t, n, deltas.keys(), p=p, s=s, selected=selected))
    for c, d in deltas.items():
        info = ClientInfo(
            num_samples=1 if samples is None else samples[c],
            local_steps=1 if steps is None else steps[c],
        )
        algo.add(c, torch.tensor(d, dtype=F64), info)
    return algo.close_round().clone()


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def setup(algo, n, w0, weights=None):
    algo.setup(num_clients=n, init_params=torch.tensor(w0, dtype=F64), client_weights=weights)
    return algo


# ---------------------------------------------------------------------------------------------- FedVARP
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


# ---------------------------------------------------------------------------------------------- MIFA
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


# ---------------------------------------------------------------------------------------------- FedStale
def test_fedstale_hand_computed_known_p():
    # beta=0.5, p=[1, 0.5, 0.25], alpha=1/3: c_i = 1/(3 p_i) = [1/3, 2/3, 4/3]
    # w += beta (1/3) sum_j h_j + sum_{R} c_i (delta_i - beta h_i)
    p = [1.0, 0.5, 0.25]
    algo = setup(FedStale(beta=0.5), 3, [0.0, 0.0])
    # round 0: h=0; fresh = (1/3)[3,0] + (4/3)[0,3] = [1,4] -> w1 = [1,4]; h0=[3,0], h2=[0,3]
    close(run_round(algo, 0, 3, {0: [3, 0], 2: [0, 3]}, p=p), [1.0, 4.0])
    assert algo.last_weights == pytest.approx({0: 1 / 3, 2: 4 / 3})
    # round 1: stale = 0.5 (1/3)([3,0]+0+[0,3]) = [0.5,0.5]; fresh = (2/3)([3,3] - 0.5*0) = [2,2]
    # step = [2.5,2.5] -> w2 = [3.5, 6.5]; h1=[3,3]
    close(run_round(algo, 1, 3, {1: [3, 3]}, p=p), [3.5, 6.5])
    # round 2: stale = 0.5 (1/3)([3,0]+[3,3]+[0,3]) = [1,1]
    # fresh = (1/3)([0,3] - 0.5[3,0]) + (4/3)([6,0] - 0.5[0,3]) = [-0.5, 1] + [8, -2] = [7.5, -1]
    # step = [8.5, 0] -> w3 = [12, 6.5]
    close(run_round(algo, 2, 3, {0: [0, 3], 2: [6, 0]}, p=p), [12.0, 6.5])


def _random_run(algos, rounds=20, n=6, d=5, seed=0, weights=None):
    """Drive several algorithms with identical random rounds; return their parameter trajectories."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.2, 1.0, size=n)
    p[0] = 1.0
    w0 = torch.from_numpy(rng.normal(size=d))
    for a in algos:
        a.setup(num_clients=n, init_params=w0.clone(), client_weights=weights)
    traj = [[] for _ in algos]
    for t in range(rounds):
        mask = rng.random(n) < p
        if t == 3:
            mask[:] = False  # include an empty round
        arrived = np.flatnonzero(mask).tolist()
        deltas = {c: torch.from_numpy(rng.normal(size=d)) for c in arrived}
        ctx = make_ctx(t, n, arrived, p=p, s=p)
        for a, tr in zip(algos, traj):
            a.open_round(t, ctx)
            for c in arrived:
                a.add(c, deltas[c].clone(), ClientInfo(num_samples=10 + c, local_steps=2))
            tr.append(a.close_round().clone())
    return traj


@pytest.mark.parametrize("weights", [None, torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.5])])
def test_fedstale_beta0_equals_fedavg_known_p(weights):
    ref, stale = _random_run([FedAvg(weighting="known_p"), FedStale(beta=0.0, weighting="known_p")], weights=weights)
    for a, b in zip(ref, stale):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("weighting", ["participating", "known_p"])
@pytest.mark.parametrize("empty_round", ["skip", "stale"])
def test_fedstale_beta1_equals_fedvarp(weighting, empty_round):
    w = torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.5])
    algos = [
        FedVARP(weighting=weighting, empty_round=empty_round),
        FedStale(beta=1.0, weighting=weighting, empty_round=empty_round),
    ]
    varp, stale = _random_run(algos, weights=w)
    for a, b in zip(varp, stale):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # and the trajectory actually moved (not a vacuous comparison)
    assert (varp[-1] - varp[0]).abs().max() > 0.1


def test_fedstale_beta0_allocates_no_memory_and_bf16_memory():
    algo = setup(FedStale(beta=0.0), 5, [0.0] * 7)
    assert algo.memory_bytes == 0
    n, d = 5, 7
    for cls in (FedVARP, MIFA, lambda **kw: FedStale(beta=0.5, **kw)):
        lo = setup(cls(memory_dtype=torch.bfloat16), n, [0.0] * d)
        hi = setup(cls(), n, [0.0] * d)
        assert lo.memory_bytes == n * d * 2
        assert hi.memory_bytes == n * d * 4
        assert lo.memory.data.dtype == torch.bfloat16 and lo.memory.data.device.type == "cpu"
        rng = np.random.default_rng(1)
        for t in range(4):
            arrived = [c for c in range(n) if rng.random() < 0.6]
            deltas = {c: rng.normal(size=d).tolist() for c in arrived}
            a = run_round(lo, t, n, deltas, p=[0.6] * n)
            b = run_round(hi, t, n, deltas, p=[0.6] * n)
        assert a.dtype == F64
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.02)  # bf16 keeps ~3 significant digits


def test_fedstale_with_fedau_estimates_equals_known_p_fed_the_same_estimates():
    n, d = 4, 3
    rng = np.random.default_rng(3)
    est_algo = setup(FedStale(beta=0.5, p_source="fedau", fedau_K=3), n, [0.0] * d)
    known = setup(FedStale(beta=0.5), n, [0.0] * d)
    shadow = IntervalEstimator(K=3)
    shadow.setup(n)
    for t in range(12):
        arrived = [c for c in range(n) if rng.random() < [0.9, 0.5, 0.3, 0.2][c]]
        deltas = {c: rng.normal(size=d).tolist() for c in arrived}
        p_hat = shadow.estimates()
        torch.testing.assert_close(est_algo.participation_estimates(), p_hat, atol=0, rtol=0)
        a = run_round(est_algo, t, n, deltas, p=[0.01] * n)  # true p ignored with p_source="fedau"
        b = run_round(known, t, n, deltas, p=p_hat)
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[arrived] = True
        shadow.update(mask)
    assert (shadow.estimates() < 1).any()


# ---------------------------------------------------------------------------------------------- FedAU
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


# ---------------------------------------------------------------------------------------------- lossy links
# alpha = [1,1,2]/4 = [0.25, 0.25, 0.5]; success s = 1-q = [1, 0.5, 0.8]; c = alpha/s = [0.25, 0.5, 0.625]
ALPHA = torch.tensor([1.0, 1.0, 2.0])
S_PROBS = [1.0, 0.5, 0.8]
LOSSY_ROUNDS = [{0: [4, 0], 2: [0, 8]}, {1: [2, 2]}, {}]


def test_upgapl_hand_computed():
    algo = setup(UPGAPL(), 3, [2.0, 2.0], ALPHA)
    # round 0: w + 0.25[4,0] + 0.625[0,8] = [2,2] + [1,5] = [3,7]
    close(run_round(algo, 0, 3, LOSSY_ROUNDS[0], s=S_PROBS), [3.0, 7.0])
    assert algo.last_weights == pytest.approx({0: 0.25, 2: 0.625})
    # round 1: + 0.5[2,2] = [4,8]
    close(run_round(algo, 1, 3, LOSSY_ROUNDS[1], s=S_PROBS), [4.0, 8.0])
    # round 2: nobody -> unchanged
    close(run_round(algo, 2, 3, LOSSY_ROUNDS[2], s=S_PROBS), [4.0, 8.0])


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
        close(run_round(algo, 0, 3, LOSSY_ROUNDS[0], s=S_PROBS), [2.75, 6.75])
        # round 1: model of client 1 = [2.75,6.75] + [2,2] = [4.75, 8.75]; times c1 = 0.5 -> [2.375, 4.375]
        close(run_round(algo, 1, 3, LOSSY_ROUNDS[1], s=S_PROBS), [2.375, 4.375])
        # round 2: nobody -> Eq. 4.4 literally gives the zero model (warned), or keep w
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            close(run_round(algo, 2, 3, LOSSY_ROUNDS[2], s=S_PROBS), last)
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
    algo.open_round(0, RoundContext(0, 4, *(torch.ones(4, dtype=torch.bool),) * 3, success_probs=s))
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
    exact = {cls: torch.zeros(2, dtype=F64) for cls in (UPGAPL, DMAPL, UDMAPL)}
    for pattern in itertools.product([0, 1], repeat=4):
        prob = math.prod(float(s[i]) if b else 1 - float(s[i]) for i, b in enumerate(pattern))
        for cls in exact:
            algo = setup(cls(), 4, w0.tolist())
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


# ---------------------------------------------------------------------------------------------- FedNova
def test_fednova_hand_computed_sgd():
    algo = setup(FedNova(), 3, [0.0, 0.0])
    # round 0: steps [1,3]; q = 1/2; tau_eff = (1+3)/2 = 2; 2 * (0.5[2,0]/1 + 0.5[0,6]/3) = [2,2]
    close(run_round(algo, 0, 3, {0: [2, 0], 1: [0, 6]}, steps={0: 1, 1: 3}), [2.0, 2.0])
    assert algo.last_weights == pytest.approx({0: 1.0, 1: 1 / 3})
    # round 1: steps [2,1,6]; tau_eff = 3; 3 * (1/3)([4,4]/2 + [3,0]/1 + [0,12]/6) = [2,2]+[3,0]+[0,2] = [5,4]
    close(run_round(algo, 1, 3, {0: [4, 4], 1: [3, 0], 2: [0, 12]}, steps={0: 2, 1: 1, 2: 6}), [7.0, 6.0])
    # round 2: only client 2, 4 steps: tau_eff = 4 -> 4 * [1,1]/4 = [1,1]
    close(run_round(algo, 2, 3, {2: [1, 1]}, steps={2: 4}), [8.0, 7.0])


def test_fednova_hand_computed_momentum():
    # rho = 0.5: ||a||_1 = sum_{k=1..tau} (1 - rho^k)/(1 - rho): tau=1 -> 1; tau=2 -> 1 + 1.5 = 2.5;
    # tau=3 -> 1 + 1.5 + 1.75 = 4.25
    assert accumulation_norm(1, 0.5) == pytest.approx(1.0)
    assert accumulation_norm(2, 0.5) == pytest.approx(2.5)
    assert accumulation_norm(3, 0.5) == pytest.approx(4.25)
    algo = setup(FedNova(momentum=0.5), 3, [0.0, 0.0])
    # round 0: a = [1, 4.25]; tau_eff = 2.625; normalised: 0.5[2,0]/1 + 0.5[0,8.5]/4.25 = [1,1] -> [2.625, 2.625]
    close(run_round(algo, 0, 3, {0: [2, 0], 1: [0, 8.5]}, steps={0: 1, 1: 3}), [2.625, 2.625])
    # round 1: a = [2.5, 1]; tau_eff = 1.75; 0.5[5,5]/2.5 + 0.5[1,0]/1 = [1.5, 1] -> + [2.625, 1.75] = [5.25, 4.375]
    close(run_round(algo, 1, 3, {0: [5, 5], 2: [1, 0]}, steps={0: 2, 2: 1}), [5.25, 4.375])
    # round 2: client 1 alone, a = 2.5: 2.5 * [0, 2.5]/2.5 -> + [0, 2.5] = [5.25, 6.875]
    close(run_round(algo, 2, 3, {1: [0, 2.5]}, steps={1: 2}), [5.25, 6.875])


def test_fednova_proximal_norm_and_torch_sgd_unrolling():
    # prox, eta*mu = 0.5: a = [(1-0.5)^{tau-t}] -> tau=2: 0.5 + 1 = 1.5; tau=3: 0.25 + 0.5 + 1 = 1.75
    assert accumulation_norm(2, 0.0, 0.5) == pytest.approx(1.5)
    assert accumulation_norm(3, 0.0, 0.5) == pytest.approx(1.75)
    assert FedNova(prox_mu=5.0, local_lr=0.1).norm(3) == pytest.approx(1.75)
    # With a constant gradient g, delta = -eta ||a||_1 g exactly for any solver: check against torch.optim.SGD
    g = torch.tensor([1.0, -2.0], dtype=F64)
    for rho, mu, steps in ((0.0, 0.0, 5), (0.9, 0.0, 7), (0.0, 2.0, 6), (0.7, 1.5, 9)):
        eta = 0.1
        x0 = torch.tensor([0.3, 0.4], dtype=F64)
        x = x0.clone().requires_grad_(True)
        opt = torch.optim.SGD([x], lr=eta, momentum=rho)
        for _ in range(steps):
            opt.zero_grad()
            loss = (g * x).sum() + 0.5 * mu * ((x - x0) ** 2).sum()
            loss.backward()
            opt.step()
        delta = x.detach() - x0
        torch.testing.assert_close(delta, -eta * accumulation_norm(steps, rho, eta * mu) * g, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weighting", ["participating", "samples"])
def test_fednova_equal_steps_equals_fedavg(momentum, weighting):
    nova, avg = _random_run(
        [FedNova(momentum=momentum, weighting=weighting), FedAvg(weighting=weighting)],
        weights=torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.5]),
    )
    for a, b in zip(nova, avg):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------------------------- state dicts
FACTORIES = {
    "fedvarp": lambda: FedVARP(),
    "fedvarp_known": lambda: FedVARP(weighting="known_p", memory_dtype=torch.bfloat16),
    "mifa": lambda: MIFA(),
    "fedstale": lambda: FedStale(beta=0.3),
    "fedstale_fedau": lambda: FedStale(beta=0.7, p_source="fedau", fedau_K=4),
    "fedau": lambda: FedAU(K=3),
    "fedau_inf": lambda: FedAU(K=None, server_lr=0.5),
    "upgapl": lambda: UPGAPL(),
    "upgapl_est": lambda: UPGAPL(q="estimate"),
    "dmapl": lambda: DMAPL(),
    "udmapl": lambda: UDMAPL(q=[0.1, 0.2, 0.3, 0.4, 0.5], empty_round="keep"),
    "fednova": lambda: FedNova(momentum=0.5, prox_mu=1.0, local_lr=0.1),
}


def _rounds(algo, start, stop, n=5, d=4, seed=5):
    rng = np.random.default_rng(seed)
    p = np.array([1.0, 0.7, 0.5, 0.4, 0.3])
    out = None
    for t in range(stop):
        sel = rng.random(n) < 0.9
        arrived = np.flatnonzero(sel & (rng.random(n) < p)).tolist()
        deltas = {c: rng.normal(size=d).tolist() for c in arrived}
        steps = {c: int(rng.integers(1, 6)) for c in arrived}
        if t >= start:
            out = run_round(algo, t, n, deltas, p=p, s=p, steps=steps, selected=np.flatnonzero(sel).tolist())
    return out, dict(algo.last_weights)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_resume_equals_uninterrupted(name):
    n = 5
    w0 = [0.1, -0.2, 0.3, 0.0]
    full = setup(FACTORIES[name](), n, w0, torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0]))
    expected, expected_w = _rounds(full, 0, 5)
    first = setup(FACTORIES[name](), n, w0, torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0]))
    _rounds(first, 0, 3)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = FACTORIES[name]()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got, got_w = _rounds(resumed, 3, 5)
    assert torch.equal(got, expected), name
    assert got_w == expected_w
    assert resumed.hparams() == full.hparams()
    assert repr(resumed).startswith(type(full).__name__ + "(")


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedStale(beta=-0.1), "beta"),
        (lambda: FedStale(beta=1.5), "beta"),
        (lambda: FedStale(beta=float("nan")), "beta"),
        (lambda: FedStale(beta=0.5, weighting="all"), "weighting"),
        (lambda: FedStale(beta=0.5, p_source="oracle"), "p_source"),
        (lambda: FedStale(beta=0.5, weighting="participating", p_source="fedau"), "p_source"),
        (lambda: FedStale(beta=0.5, p_source="fedau", fedau_K=0), "K"),
        (lambda: FedStale(beta=0.5, server_lr=0), "server_lr"),
        (lambda: FedVARP(weighting="samples"), "weighting"),
        (lambda: FedVARP(memory_dtype=torch.int32), "memory_dtype"),
        (lambda: FedVARP(empty_round="never"), "empty_round"),
        (lambda: MIFA(empty_round="never"), "empty_round"),
        (lambda: FedAU(K=0), "K"),
        (lambda: FedAU(K=-5), "K"),
        (lambda: FedAU(K=2.5), "K"),
        (lambda: IntervalEstimator(K=0), "K"),
        (lambda: FedAU(server_lr=-1.0), "server_lr"),
        (lambda: UPGAPL(q=[0.1, 1.0]), "q"),
        (lambda: UPGAPL(q=[-0.1, 0.5]), "q"),
        (lambda: UPGAPL(q="oracle"), "q"),
        (lambda: UDMAPL(empty_round="nan"), "empty_round"),
        (lambda: FedNova(momentum=1.0), "momentum"),
        (lambda: FedNova(momentum=-0.1), "momentum"),
        (lambda: FedNova(prox_mu=-1.0), "prox_mu"),
        (lambda: FedNova(prox_mu=0.1), "local_lr"),
        (lambda: FedNova(prox_mu=20.0, local_lr=0.1), "local_lr \\* prox_mu"),
        (lambda: FedNova(weighting="all"), "weighting"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    # known_p with a zero probability
    algo = setup(FedStale(beta=0.5), 3, [0.0])
    with pytest.raises(ValueError, match=r"participation_probs.*\(0, 1\]"):
        algo.open_round(0, make_ctx(0, 3, [0], p=[0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="participation_probs"):
        algo.open_round(0, make_ctx(0, 3, [0]))  # unknown p
    with pytest.raises(ValueError, match="participation_probs"):
        setup(FedVARP(weighting="known_p"), 3, [0.0]).open_round(0, make_ctx(0, 3, [0], p=[0.5, 1.5, 1.0]))
    # q >= 1 (success probability 0) for a known-q lossy rule
    with pytest.raises(ValueError, match="success_probs"):
        setup(UPGAPL(), 3, [0.0]).open_round(0, make_ctx(0, 3, [0], s=[0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="success_probs"):
        setup(UDMAPL(), 3, [0.0]).open_round(0, make_ctx(0, 3, [0]))
    with pytest.raises(ValueError, match="num_clients"):
        setup(UPGAPL(q=[0.1, 0.2]), 3, [0.0])
    # FedNova needs at least one local step
    nova = setup(FedNova(), 2, [0.0])
    nova.open_round(0, None)
    with pytest.raises(ValueError, match="local_steps"):
        nova.add(0, torch.zeros(1, dtype=F64), ClientInfo(num_samples=1, local_steps=0))
    # the same client twice in a round, and a wrong shape
    varp = setup(FedVARP(), 2, [0.0, 0.0])
    varp.open_round(0, None)
    varp.add(0, torch.zeros(2, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="already added"):
        varp.add(0, torch.zeros(2, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="shape"):
        varp.add(1, torch.zeros(3, dtype=F64), ClientInfo(1, 1))
