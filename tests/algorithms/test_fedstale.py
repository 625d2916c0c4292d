"""FedStale (FedStale paper Eq. 9, Algorithm 2) and its stale memory.

Hand-computed examples write out the arithmetic in comments; expected numbers are never produced by the code
under test. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import MIFA, ClientInfo, FedAvg, FedStale, FedVARP, IntervalEstimator, StaleMemory
from tests.algorithms.rule_rounds import F64, check_resume, close, make_ctx, random_run, run_round, setup


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


@pytest.mark.parametrize("weights", [None, torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.5])])
def test_fedstale_beta0_equals_fedavg_known_p(weights):
    ref, stale = random_run([FedAvg(weighting="known_p"), FedStale(beta=0.0, weighting="known_p")], weights=weights)
    for a, b in zip(ref, stale):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


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


@pytest.mark.parametrize(
    "factory",
    [
        pytest.param(lambda: FedStale(beta=0.3), id="fedstale"),
        pytest.param(lambda: FedStale(beta=0.7, p_source="fedau", fedau_K=4), id="fedstale_fedau"),
    ],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


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
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    # known_p with a zero probability
    algo = setup(FedStale(beta=0.5), 3, [0.0])
    with pytest.warns(RuntimeWarning, match="never aggregated"):
        algo.open_round(0, make_ctx(0, 3, [0], p=[0.5, 0.0, 1.0]))
    algo.close_round()
    with pytest.raises(ValueError, match=r"participation_probs.*\[0, 1\]"):
        algo.open_round(1, make_ctx(1, 3, [0], p=[0.5, 1.5, 1.0]))
    with pytest.raises(ValueError, match="participation_probs"):
        algo.open_round(0, make_ctx(0, 3, [0]))  # unknown p


# N = 2, alpha = 1/2, p = (0.5, 0.5) for known_p (c_i = alpha_i / p_i = 1). Round 0: client 0 sends 4; round 1:
# client 1 sends 2; round 2: nobody; round 3: client 0 sends 1.
MEMORY_ROUNDS = [{0: [4.0]}, {1: [2.0]}, {}, {0: [1.0]}]
MEMORY_CASES = {
    # MIFA (refresh, then w += (y_0 + y_1)/2; empty round applies the memory): 2, 2 + 3 = 5, 5 + 3 = 8, 8 + 1.5
    "MIFA": (lambda dtype: MIFA(memory_dtype=dtype), [2.0, 5.0, 8.0, 9.5]),
    # FedVARP, participating, empty round skipped: 0 + 4 = 4; (4 + 0)/2 + (2 - 0) -> 8; 8; (4 + 2)/2 + (1 - 4) -> 8
    "FedVARP": (lambda dtype: FedVARP(memory_dtype=dtype), [4.0, 8.0, 8.0, 8.0]),
    # FedStale(0.5), known_p: 4; 0.5 (4 + 0)/2 + (2 - 0) -> 7; 7; 0.5 (4 + 2)/2 + (1 - 0.5 * 4) -> 7.5
    "FedStale": (lambda dtype: FedStale(beta=0.5, memory_dtype=dtype), [4.0, 7.0, 7.0, 7.5]),
}


@pytest.mark.parametrize("name", sorted(MEMORY_CASES))
def test_float64_memory_gives_the_float32_result(name):
    # A float64 memory on the parameters' device must move its running total H = sum_j alpha_j h_j like any other
    # dtype (reading the old row must not alias the row being overwritten).
    build, expected = MEMORY_CASES[name]
    traj = {}
    for dtype in (torch.float32, torch.float64):
        algo = build(dtype)
        algo.setup(2, torch.zeros(1))  # fp32 parameters on the CPU, like the memory's default device
        traj[dtype] = []
        for t, deltas in enumerate(MEMORY_ROUNDS):
            algo.open_round(t, make_ctx(t, 2, deltas.keys(), p=[0.5, 0.5]))
            for c, d in deltas.items():
                algo.add(c, torch.tensor(d), ClientInfo(1, 1))
            traj[dtype].append(float(algo.close_round()))
        assert traj[dtype] == pytest.approx(expected, abs=1e-6), (name, dtype)
    assert traj[torch.float64] == pytest.approx(traj[torch.float32], abs=1e-5)


def test_stale_memory_running_total_in_float64():
    mem = StaleMemory(torch.float64)
    mem.allocate(2, 3, torch.tensor([0.25, 0.75], dtype=F64), torch.device("cpu"))
    mem.write(0, torch.tensor([4.0, 0.0, -4.0]))
    mem.write(1, torch.tensor([1.0, 1.0, 1.0]))
    mem.write(0, torch.tensor([0.0, 8.0, 0.0]))  # replaces row 0: H = 0.25 [0, 8, 0] + 0.75 [1, 1, 1]
    torch.testing.assert_close(mem.total, torch.tensor([0.75, 2.75, 0.75], dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(mem.read(0, like=torch.zeros(3)), torch.tensor([0.0, 8.0, 0.0]), atol=0, rtol=0)
