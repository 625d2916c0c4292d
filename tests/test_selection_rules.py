"""Server-side selection rules of issue 5: FedACS and its baselines (SampledFedAvg = the paper's FedAvg, CAFedAvg,
OS), the step-length calibration, CA-Fed and its baselines (AdaFed, F3AST).

Expected numbers come from closed forms or from arithmetic written out in comments, never from the code under test.
All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import (
    F3AST,
    OS,
    AdaFed,
    CAFed,
    CAFedAvg,
    ClientInfo,
    FedACS,
    FedAvg,
    FedNova,
    MarkovAvailabilityEstimator,
    RoundContext,
    SampledFedAvg,
    chi_square,
    compute_weights,
    fedacs_probabilities,
    lr_scalings,
    proxy_error,
    surrogate_weights,
)
from lightning_fedhet.algorithms.calibration import effective_step

F64 = torch.float64


def mask(n, ids):
    m = torch.zeros(n, dtype=torch.bool)
    m[list(ids)] = True
    return m


def ctx_for(t, n, available, selected, received, p=None, s=None, steps=None):
    return RoundContext(
        round=t,
        num_clients=n,
        available=mask(n, available),
        selected=mask(n, selected),
        received=mask(n, received),
        participation_probs=None if p is None else torch.as_tensor(p, dtype=F64),
        success_probs=None if s is None else torch.as_tensor(s, dtype=F64),
        local_steps=None if steps is None else torch.as_tensor(steps, dtype=torch.int64),
    )


def vec(*xs):
    return torch.tensor(xs, dtype=F64)


# ============================================================================================== FedACS toy quadratic
# Spec fedacs.md §4.1 (Fig. 4, middle panel): F_m(x) = 1/2 ||x - E_m||^2, E_m ~ N(0, I_10), M = 30 clients,
# T_m = 1..30 local GD steps, failure probabilities q_m evenly spaced in [0.01, 0.3] (pairing: a fixed random
# permutation), uniform omega, deterministic gradients. eta = 0.002 (Fig. 7's value) to shorten the burn-in.
# T GD steps from x give x_T - x = (1 - (1 - eta)^T)(E_m - x) =: c_m (E_m - x) exactly (checked below).
M, D, ETA = 30, 10, 0.002
_g = np.random.default_rng(2024)
E = torch.from_numpy(_g.normal(size=(M, D)))
T_STEPS = torch.arange(1, M + 1)
Q_FAIL = torch.from_numpy(np.linspace(0.01, 0.3, M)[_g.permutation(M)])
C = 1.0 - (1.0 - ETA) ** T_STEPS.to(F64)
X_STAR = E.mean(0)
OMEGA = torch.full((M,), 1.0 / M, dtype=F64)


def closed_form(v):
    """Fixed point of an expected update sum_m v_m c'_m (E_m - x) = 0 with weights already folded into v."""
    v = v / v.sum()
    return (v[:, None] * E).sum(0)


def local_gd(x, m):
    for _ in range(int(T_STEPS[m])):
        x = x - ETA * (x - E[m])
    return x


def test_toy_local_solver_is_gd():
    x0 = torch.linspace(-1, 1, D, dtype=F64)
    for m in (0, 7, 29):
        assert torch.allclose(local_gd(x0, m) - x0, C[m] * (E[m] - x0), rtol=0, atol=1e-13)


def run_toy_packed(algo, rounds=1200, burn=400, replicas=100, seed=1, oracle=False, chi=None):
    """Drive ``algo`` through the protocol on the toy problem; return the time- and replica-averaged iterate.

    ``replicas`` independent channel realisations are stacked in one parameter vector of size ``replicas * D``:
    block ``b`` of client ``m``'s delta is ``c_m (E_m - x_b)`` if ``m``'s upload succeeds in replica ``b`` and 0
    otherwise. For rules whose weight of an arrived update depends only on the client and its draw count (all ÷K
    rules, and FedAvg with fixed weights), this is exactly ``replicas`` runs sharing the server's draws. Replica
    ``b`` of client ``m`` succeeds iff ``(u + b/replicas) mod 1 >= q_m`` with ``u ~ U[0,1)`` fresh per client and
    round: every replica is an exact Bernoulli(1 - q_m) channel, independent over clients and rounds, and the
    stratification across replicas only shrinks the Monte-Carlo error of their mean (to ~2e-4 relative here).
    K = 10^6 draws per round makes the sampling noise negligible; the fixed point does not depend on K.
    """
    algo.setup(M, X_STAR.repeat(replicas), None)
    links = np.random.default_rng([seed, 7])
    everyone = torch.ones(M, dtype=torch.bool)
    acc = torch.zeros(replicas * D, dtype=F64)
    offsets = np.arange(replicas) / replicas
    for t in range(rounds):
        if oracle:
            algo.observe_system(t, success_probs=1.0 - Q_FAIL, local_steps=T_STEPS)
        drawn = algo.select(t, everyone, np.random.default_rng([seed, t]))
        sel = drawn > 0 if drawn.dtype != torch.bool else drawn
        if chi is not None:
            omega_vs_surrogate = chi_square(OMEGA, surrogate_weights(algo.last_probabilities, 1.0 - Q_FAIL, T_STEPS))
            chi.append(omega_vs_surrogate)
        ok = torch.from_numpy(((links.random((M, 1)) + offsets) % 1.0) >= Q_FAIL.numpy()[:, None])
        algo.open_round(t, RoundContext(t, M, everyone, sel, sel, None, 1.0 - Q_FAIL, torch.where(sel, T_STEPS, 0)))
        x = algo.params.view(replicas, D)
        deltas = C[:, None, None] * (E[:, None, :] - x[None]) * ok[:, :, None]
        for m in torch.nonzero(sel).flatten().tolist():
            algo.add(m, deltas[m].reshape(-1), ClientInfo(num_samples=1, local_steps=int(T_STEPS[m])))
        algo.close_round()
        if t >= burn:
            acc += algo.params
    return (acc / (rounds - burn)).view(replicas, D).mean(0)


def run_toy_single(algo, rounds=2000, burn=400, seed=3):
    """One replica with i.i.d. links (for FedNova, whose tau_eff couples the clients that arrived)."""
    algo.setup(M, X_STAR.clone(), None)
    links = np.random.default_rng([seed, 8])
    everyone = torch.ones(M, dtype=torch.bool)
    acc = torch.zeros(D, dtype=F64)
    for t in range(rounds):
        sel = algo.select(t, everyone, np.random.default_rng([seed, t]))
        arrived = sel & torch.from_numpy(links.random(M) >= Q_FAIL.numpy())
        algo.open_round(t, RoundContext(t, M, everyone, sel, arrived, None, 1.0 - Q_FAIL, torch.where(sel, T_STEPS, 0)))
        x = algo.params
        for m in torch.nonzero(arrived).flatten().tolist():
            algo.add(m, C[m] * (E[m] - x), ClientInfo(num_samples=1, local_steps=int(T_STEPS[m])))
        algo.close_round()
        if t >= burn:
            acc += algo.params
    return acc / (rounds - burn)


@pytest.fixture(scope="module")
def toy():
    chi_acs, chi_avg = [], []
    out = {
        "fedavg": run_toy_packed(SampledFedAvg(K=10**6), chi=chi_avg),
        "fedavg_full": run_toy_packed(FedAvg(weighting="all")),  # eq. (21): full participation, same surrogate
        "cafedavg": run_toy_packed(CAFedAvg(K=10**6)),
        "fedacs": run_toy_packed(FedACS(K=10**6), oracle=True, chi=chi_acs),
        "fednova": run_toy_single(FedNova()),
    }
    out["chi_fedacs"], out["chi_fedavg"] = chi_acs, chi_avg
    return out


def rel(x, y):
    return float((x - y).norm() / y.norm())


def test_toy_fedavg_fixed_point_matches_eq39(toy):
    # Eq. (39): lim E[X] = sum (1-q_m)(1-(1-eta)^T_m) E_m / sum (1-q_m)(1-(1-eta)^T_m)  (omega uniform, p = omega)
    expected = closed_form((1.0 - Q_FAIL) * C)
    assert rel(toy["fedavg"], expected) < 1e-3
    assert rel(toy["fedavg_full"], expected) < 1e-3
    # ... and that point is far from X* = mean(E_m): the test can tell them apart by ~3 orders of magnitude.
    assert float((expected - X_STAR).norm()) > 300 * 1e-3 * float(expected.norm())


def test_toy_fedacs_and_cafedavg_fixed_points(toy):
    # FedACS: p_m ∝ omega/((1-q_m) T_m), so E[update] ∝ sum_m p_m (1-q_m) c_m (E_m - x) ∝ sum_m (c_m/T_m)(E_m - x).
    acs = closed_form(C / T_STEPS)
    assert rel(toy["fedacs"], acs) < 1e-3
    # c-a-FedAvg: p = omega and each update / (1-q_m): E[update] ∝ sum_m c_m (E_m - x)  (T-weighted, spec §6.3).
    assert rel(toy["cafedavg"], closed_form(C.clone())) < 1e-3
    # Residual bias of FedACS is O(eta T_max): c_m/(eta T_m) lies in [1 - eta T_max/2, 1], hence
    # ||x_acs - X*|| <= sum |v_m - omega_m| max ||E_m - X*|| <= eta T_max max_m ||E_m - X*||.
    bound = ETA * int(T_STEPS.max()) * float((E - X_STAR).norm(dim=1).max())
    d_acs = float((toy["fedacs"] - X_STAR).norm())
    assert d_acs <= bound
    # strictly closer to X* than every baseline
    for name in ("fedavg", "fedavg_full", "cafedavg", "fednova"):
        assert d_acs < float((toy[name] - X_STAR).norm()), name
    # FedNova (full participation, normalised updates) fixes the T_m part only: its bias is the q part, ~ (1-q) weights
    assert float((toy["fednova"] - X_STAR).norm()) > 3 * d_acs


def test_toy_fedacs_chi_square_zero_every_round(toy):
    assert len(toy["chi_fedacs"]) == 1200
    assert max(toy["chi_fedacs"]) < 1e-9
    # importance sampling (p = omega) is inconsistent here: Omega ∝ (1-q_m) T_m
    assert min(toy["chi_fedavg"]) > 0.1


def test_fedacs_dynamic_setting_chi_square_zero_every_round():
    # Fig. 4 right panel: every round clients 0..14 draw T ~ U{1..10}, q ~ U[0.2, 0.4]; clients 15..29 draw
    # T ~ U{20..30}, q ~ U[0, 0.2]. p^(r) is recomputed from that round's oracle values (Algorithm 1 line 4).
    n = 30
    algo = FedACS(K=15)
    algo.setup(n, torch.zeros(2, dtype=F64))
    g = np.random.default_rng(11)
    half = n // 2
    for t in range(60):
        steps = np.concatenate([g.integers(1, 11, half), g.integers(20, 31, n - half)])
        q = np.concatenate([g.uniform(0.2, 0.4, half), g.uniform(0.0, 0.2, n - half)])
        algo.observe_system(t, success_probs=1.0 - q, local_steps=steps)
        counts = algo.select(t, torch.ones(n, dtype=torch.bool), np.random.default_rng(t))
        assert int(counts.sum()) == 15
        assert chi_square(torch.full((n,), 1.0 / n), surrogate_weights(algo.last_probabilities, 1.0 - q, steps)) < 1e-9
        assert chi_square(torch.full((n,), 1.0 / n), surrogate_weights(torch.full((n,), 1.0 / n), 1.0 - q, steps)) > 0.1
        algo.open_round(t, None)
        algo.close_round()


# ============================================================================================== FedACS by hand
def test_fedacs_probabilities_by_hand_and_unavailable_modes():
    # omega = [2, 1, 1]/4 = [0.5, 0.25, 0.25], s = 1-q = [1, 0.5, 0.8], T = [2, 4, 5]
    # omega/(sT) = [0.5/2, 0.25/2, 0.25/4] = [0.25, 0.125, 0.0625], sum 0.4375 -> p = [4/7, 2/7, 1/7]
    s, steps = [1.0, 0.5, 0.8], [2, 4, 5]
    assert torch.allclose(fedacs_probabilities([0.5, 0.25, 0.25], s, steps), vec(4 / 7, 2 / 7, 1 / 7))
    algo = FedACS(K=7)
    algo.setup(3, torch.zeros(1, dtype=F64), torch.tensor([2.0, 1.0, 1.0]))
    algo.observe_system(0, success_probs=s, local_steps=steps)
    counts = algo.select(0, torch.ones(3, dtype=torch.bool), np.random.default_rng(0))
    assert counts.dtype == torch.int64 and int(counts.sum()) == 7
    assert torch.allclose(algo.last_probabilities, vec(4 / 7, 2 / 7, 1 / 7))
    # Omega = p s T / sum = [4/7*2, 2/7*2, 1/7*4]/(16/7) = [0.5, 0.25, 0.25] = omega -> chi^2 = 0
    assert chi_square(algo.omega, surrogate_weights(algo.last_probabilities, s, steps)) < 1e-12
    # renormalize: client 1 unavailable -> p over {0, 2} = [4, 0, 1]/5; no draw lands on client 1
    algo.observe_system(1, success_probs=s, local_steps=steps)
    counts = algo.select(1, torch.tensor([True, False, True]), np.random.default_rng(1))
    assert torch.allclose(algo.last_probabilities, vec(0.8, 0.0, 0.2))
    assert counts[1] == 0 and int(counts.sum()) == 7
    # drop: draws over all clients with availability folded into s: pi = [1, 1, 0.5] -> s_eff = [1, 0.5, 0.4]
    # omega/(s_eff T) = [0.25, 0.125, 0.125] -> p = [0.5, 0.25, 0.25]; draws on unavailable client 1 are lost
    drop = FedACS(K=1000, unavailable="drop")
    drop.setup(3, torch.zeros(1, dtype=F64), torch.tensor([2.0, 1.0, 1.0]))
    drop.observe_system(0, success_probs=s, local_steps=steps, participation_probs=[1.0, 1.0, 0.5])
    counts = drop.select(0, torch.tensor([True, False, True]), np.random.default_rng(2))
    assert torch.allclose(drop.last_probabilities, vec(0.5, 0.25, 0.25))
    assert counts[1] == 0 and 0 < int(counts.sum()) < 1000


def test_fedacs_aggregation_divides_by_K_and_weights_duplicates():
    algo = FedACS(K=5)
    algo.setup(3, torch.tensor([1.0, 1.0], dtype=F64))
    algo.observe_system(0, success_probs=[1.0, 0.5, 0.8], local_steps=[2, 4, 5])
    counts = algo.select(0, torch.ones(3, dtype=torch.bool), np.random.default_rng(3)).tolist()
    drawn = [m for m in range(3) if counts[m] > 0]
    lost = drawn[-1]  # the last drawn client's upload fails; the divisor stays K = 5
    algo.open_round(0, ctx_for(0, 3, range(3), drawn, drawn[:-1]))
    deltas = {0: vec(1.0, 0.0), 1: vec(0.0, 2.0), 2: vec(-4.0, 4.0)}
    for m in drawn[:-1]:
        algo.add(m, deltas[m], ClientInfo(1, 1))
    w = algo.close_round()
    expected = vec(1.0, 1.0) + sum((counts[m] / 5) * deltas[m] for m in drawn if m != lost)
    assert torch.allclose(w, expected)
    assert algo.last_weights == {m: counts[m] / 5 for m in drawn if m != lost}


def test_sampled_fedavg_cafedavg_os_calibrate_by_hand():
    one = torch.zeros(1, dtype=F64)
    # SampledFedAvg with p = [0, 1, 0]: both draws hit client 1 -> w = 0 + 2/2 * 3 = 3
    fa = SampledFedAvg(K=2, probabilities=[0.0, 1.0, 0.0])
    fa.setup(3, one)
    assert fa.select(0, torch.ones(3, dtype=torch.bool), np.random.default_rng(0)).tolist() == [0, 2, 0]
    fa.open_round(0, None)
    fa.add(1, vec(3.0), ClientInfo(1, 1))
    assert torch.allclose(fa.close_round(), vec(3.0))
    # c-a-FedAvg with omega = [1, 0]: K = 2 draws of client 0, s_0 = 0.5 -> w = 2/2 * 4 / 0.5 = 8
    ca = CAFedAvg(K=2)
    ca.setup(2, one, torch.tensor([1.0, 0.0]))
    assert ca.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(0)).tolist() == [2, 0]
    ca.open_round(0, ctx_for(0, 2, [0, 1], [0], [0], s=[0.5, 1.0]))
    ca.add(0, vec(4.0), ClientInfo(1, 1))
    assert torch.allclose(ca.close_round(), vec(8.0))
    # OS, omega = [0.5, 0.5]: round 0 has no norms yet -> p = omega. Feed norms 3 and 1; round 1: p ∝ [1.5, 0.5]
    # = [0.75, 0.25], and an arrived update of client m is weighted count_m * (omega_m / p_m) / K.
    os_ = OS(K=8)
    os_.setup(2, one)
    c0 = os_.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(5)).tolist()
    assert torch.allclose(os_.last_probabilities, vec(0.5, 0.5)) and min(c0) > 0
    os_.open_round(0, None)
    os_.add(0, vec(3.0), ClientInfo(1, 1))
    os_.add(1, vec(-1.0), ClientInfo(1, 1))
    w0 = os_.close_round()  # counts * (0.5 / 0.5) / 8
    assert torch.allclose(w0, vec((3.0 * c0[0] - 1.0 * c0[1]) / 8))
    c1 = os_.select(1, torch.ones(2, dtype=torch.bool), np.random.default_rng(6)).tolist()
    assert torch.allclose(os_.last_probabilities, vec(0.75, 0.25))
    os_.open_round(1, None)
    for m in range(2):
        if c1[m]:
            os_.add(m, vec(1.0), ClientInfo(1, 1))
    w1 = os_.close_round()
    assert torch.allclose(w1 - w0, vec(c1[0] * (0.5 / 0.75) / 8 + c1[1] * (0.5 / 0.25) / 8))
    # FedACS(calibrate=True): omega = [0.5, 0.5], s = [1, 0.5], T = [1, 4]:
    # factor = [0.5*1*1 + 0.5*0.5*4] * [0.5/(1*1) + 0.5/(0.5*4)] = 1.5 * 0.75 = 1.125 on the server step
    cal = FedACS(K=4, calibrate=True)
    cal.setup(2, one)
    cal.observe_system(0, success_probs=[1.0, 0.5], local_steps=[1, 4])
    counts = cal.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(1)).tolist()
    cal.open_round(0, None)
    for m in range(2):
        if counts[m]:
            cal.add(m, vec(1.0), ClientInfo(1, 1))
    assert torch.allclose(cal.close_round(), vec(1.125 * sum(counts) / 4))


def test_calibration_scalings_by_hand():
    # omega = [0.5, 0.5], s = [1, 0.5], a = [1, 4]
    # FedAvg effective step  sum omega s a = 0.5 + 1 = 1.5
    # FedACS 1/sum omega/(s a) = 1/0.75;       scaling = 1.5 * 0.75 = 1.125
    # c-a-FedAvg sum omega a = 2.5;            scaling = 1.5 / 2.5 = 0.6 (FedVarp the same); FedNova, FedAU, OS: 1
    assert effective_step("fedavg", [0.5, 0.5], [1.0, 0.5], [1, 4]) == pytest.approx(1.5)
    assert effective_step("fedacs", [0.5, 0.5], [1.0, 0.5], [1, 4]) == pytest.approx(4 / 3)
    sc = lr_scalings([0.5, 0.5], [1.0, 0.5], [1, 4])
    assert sc["fedacs"].client == pytest.approx(1.125) and sc["fedacs"].server == 1.0
    assert sc["cafedavg"].client == pytest.approx(0.6) and sc["fedvarp"].client == pytest.approx(0.6)
    assert sc["fedavg"].client == sc["fednova"].client == sc["fedau"].client == sc["os"].client == pytest.approx(1.0)
    srv = lr_scalings([0.5, 0.5], [1.0, 0.5], [1, 4], target="server")
    assert srv["fedacs"].server == pytest.approx(1.125) and srv["fedacs"].client == 1.0
    # FedACS's multiplier is >= 1 (Cauchy-Schwarz), c-a-FedAvg's <= 1, on random systems
    g = np.random.default_rng(0)
    for _ in range(20):
        om, s, a = g.dirichlet(np.ones(6)), g.uniform(0.1, 1, 6), g.integers(1, 40, 6)
        sc = lr_scalings(om, s, a)
        assert sc["fedacs"].client >= 1 - 1e-12 and sc["cafedavg"].client <= 1 + 1e-12


# ============================================================================================== AdaFed / F3AST
ALPHA4 = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)


def test_adafed_hand_computed():
    # alpha = [0.1, 0.2, 0.3, 0.4], pi = [0.5, 0.25, 0.75, 1.0] -> alpha/pi = [0.2, 0.8, 0.4, 0.4]
    # round 0: available S = {0, 1, 3}: sum = 0.2 + 0.8 + 0.4 = 1.4 -> q = [1/7, 4/7, 0, 2/7]
    # client 1's upload is lost (its share stays in the normaliser): w = 0 + (1/7)*7 + (2/7)*14 = 1 + 4 = 5
    algo = AdaFed()
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    pi = [0.5, 0.25, 0.75, 1.0]
    assert algo.select(0, mask(4, [0, 1, 3]), None).tolist() == [True, True, False, True]
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [0, 1, 3], [0, 3], p=pi))
    algo.add(0, vec(7.0), ClientInfo(1, 1))
    algo.add(3, vec(14.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(5.0))
    assert algo.last_weights == pytest.approx({0: 1 / 7, 3: 2 / 7})
    # round 1: S = {1, 2}: 0.8 + 0.4 = 1.2 -> q_1 = 2/3, q_2 = 1/3; deltas 3 and -3 -> w = 5 + 2 - 1 = 6
    algo.select(1, mask(4, [1, 2]), None)
    algo.open_round(1, ctx_for(1, 4, [1, 2], [1, 2], [1, 2], p=pi))
    algo.add(1, vec(3.0), ClientInfo(1, 1))
    algo.add(2, vec(-3.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(6.0))


def test_f3ast_hand_computed():
    # alpha = [0.1, 0.2, 0.3, 0.4], beta = 0.5, r starts at 0.5 for everyone, k = 2
    # round 0, available {0, 1, 3}: r = 0.5*0.5 + 0.5*[1, 1, 0, 1] = [0.75, 0.75, 0.25, 0.75]
    #   scores alpha^2/r^2 over available: 0: 0.01/0.5625 = 0.0178, 1: 0.04/0.5625 = 0.0711, 3: 0.16/0.5625 = 0.284
    #   -> top 2 = {3, 1}; weights alpha/r: q_1 = 0.2/0.75 = 4/15, q_3 = 0.4/0.75 = 8/15
    #   deltas 15 and 30 -> w = 4 + 16 = 20
    algo = F3AST(k=2, beta=0.5, init_rate=0.5)
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    assert algo.select(0, mask(4, [0, 1, 3]), None).tolist() == [False, True, False, True]
    assert torch.allclose(algo.rates, vec(0.75, 0.75, 0.25, 0.75))
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [1, 3], [1, 3]))
    algo.add(1, vec(15.0), ClientInfo(1, 1))
    algo.add(3, vec(30.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(20.0))
    assert algo.last_weights == pytest.approx({1: 4 / 15, 3: 8 / 15})
    # round 1, available {0, 1, 2}: r = 0.5*[0.75, 0.75, 0.25, 0.75] + 0.5*[1, 1, 1, 0] = [0.875, 0.875, 0.625, 0.375]
    #   scores: 0: 0.01/0.7656 = 0.0131, 1: 0.04/0.7656 = 0.0522, 2: 0.09/0.3906 = 0.2304 -> top 2 = {2, 1}
    #   q_1 = 0.2/0.875 = 8/35, q_2 = 0.3/0.625 = 0.48; client 2's upload lost -> w = 20 + (8/35)*35 = 28
    assert algo.select(1, mask(4, [0, 1, 2]), None).tolist() == [False, True, True, False]
    algo.open_round(1, ctx_for(1, 4, [0, 1, 2], [1, 2], [1]))
    algo.add(1, vec(35.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(28.0))
    # bias-corrected EMA without init_rate: after rounds on/off/on with beta = 0.5:
    # v = 0.5, 0.25, 0.625; u = 0.5, 0.75, 0.875 -> r = 0.625/0.875 = 5/7
    b = F3AST(k=1, beta=0.5)
    b.setup(1, torch.zeros(1, dtype=F64))
    for t, on in enumerate([True, False, True]):
        b.select(t, torch.tensor([on]), None)
    assert torch.allclose(b.rates, vec(5 / 7))


# ============================================================================================== CA-Fed
def markov_chain(pi, lam, rounds, seed):
    """Two-state chains (thesis App. F.C): P(1|1) = lam + (1-lam) pi, P(1|0) = (1-lam) pi, stationary start."""
    pi, lam = np.asarray(pi), np.asarray(lam)
    g = np.random.default_rng(seed)
    state = g.random(pi.size) < pi
    out = np.empty((rounds, pi.size), dtype=bool)
    for t in range(rounds):
        out[t] = state
        p_on = np.where(state, lam + (1 - lam) * pi, (1 - lam) * pi)
        state = g.random(pi.size) < p_on
    return out


def test_markov_estimator_converges():
    # 4 classes of the thesis (pi in {0.9, 0.1} x lambda in {0.9, 0}). After R = 20000 rounds the standard error of
    # pi_hat is sqrt(pi(1-pi)/R * (1+lam)/(1-lam)) <= 0.0093 and of lam_hat <= ~0.007 (P(1->1) from ~2000 visits of
    # state 1 for pi = 0.1): a 0.04 tolerance is > 4 standard errors.
    pi, lam = [0.9, 0.9, 0.1, 0.1], [0.9, 0.0, 0.9, 0.0]
    est = MarkovAvailabilityEstimator()
    est.setup(4)
    for row in markov_chain(pi, lam, 20000, seed=0):
        est.update(torch.from_numpy(row))
    assert torch.allclose(est.pi_hat(), torch.tensor(pi, dtype=F64), atol=0.04)
    assert torch.allclose(est.lam_hat(), torch.tensor(lam, dtype=F64), atol=0.04)
    # far from the prior's starting point (1/2, 0) for every client that should move
    assert (est.pi_hat() - 0.5).abs().min() > 0.3 and est.lam_hat()[[0, 2]].min() > 0.8


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


def test_cafed_round_drops_the_expected_client_and_aggregates_unnormalised():
    # same numbers through the rule: oracle pi/lam, losses observed as [1, 1, 1] then [1.1, 1.1, 2.0] (beta = 1):
    # F_hat = [1.1, 1.1, 2.0], F_hat* = [1, 1, 1] -> gap = [0.1, 0.1, 1.0], Gamma = 1.0
    algo = CAFed(kappa_bar_sq=0.1, pi=[0.9, 0.9, 0.1], lam=[0.0, 0.0, 0.9], loss_source="probe")
    algo.setup(3, torch.zeros(2, dtype=F64))
    algo.observe_losses([1.0, 1.0, 1.0])
    algo.observe_losses([1.1, 1.1, 2.0])
    assert algo.select(0, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, False]
    algo.open_round(0, ctx_for(0, 3, [0, 1, 2], [0, 1], [0, 1]))
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
        keep.observe_losses([1.0, 1.0, 1.0])
        keep.observe_losses([1.1, 1.1, 2.0])
        assert keep.select(0, torch.ones(3, dtype=torch.bool), None).tolist() == [True, True, True]
        assert torch.allclose(keep.last_q, torch.tensor([10 / 27, 10 / 27, 10 / 3], dtype=F64))


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


# ============================================================================================== bad input
@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedACS(K=0), "K"),
        (lambda: FedACS(K=2.5), "K"),
        (lambda: FedACS(K=-3), "K"),
        (lambda: SampledFedAvg(K=0), "K"),
        (lambda: CAFedAvg(K=0), "K"),
        (lambda: OS(K=0), "K"),
        (lambda: FedACS(K=2, omega=[0.5, 0.6]), "omega must sum to 1"),
        (lambda: FedACS(K=2, omega=[1.5, -0.5]), "omega"),
        (lambda: SampledFedAvg(K=2, probabilities=[0.2, 0.2]), "probabilities must sum to 1"),
        (lambda: FedACS(K=2, unavailable="ignore"), "unavailable"),
        (lambda: FedACS(K=2, estimator="kalman"), "estimator"),
        (lambda: FedACS(K=2, estimator="ema", ema=0.0), "ema"),
        (lambda: FedACS(K=2, momentum=1.0), "momentum"),
        (lambda: FedACS(K=2, prox_mu=1.0), "local_lr"),
        (lambda: OS(K=2, mix=1.0), "mix"),
        (lambda: CAFed(tau=-0.1), "tau"),
        (lambda: CAFed(kappa_bar_sq=-1.0), "kappa_bar_sq"),
        (lambda: CAFed(beta=0.0), "beta"),
        (lambda: CAFed(pi=[0.5, 0.0]), "pi"),
        (lambda: CAFed(lam=[0.5, 1.5]), "lam"),
        (lambda: CAFed(loss_source="val"), "loss_source"),
        (lambda: CAFed(server_lr=0.0), "server_lr"),
        (lambda: MarkovAvailabilityEstimator(pi_prior=(0.0, 1.0)), "pi_prior"),
        (lambda: MarkovAvailabilityEstimator(transition_prior=0.0), "transition_prior"),
        (lambda: AdaFed(pi_source="oracle"), "pi_source"),
        (lambda: F3AST(k=0), "k"),
        (lambda: F3AST(k=2, beta=1.5), "beta"),
        (lambda: F3AST(k=2, init_rate=[0.5, 0.0]), "init_rate"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
    with pytest.raises(ValueError, match="tau"):
        compute_weights([1.0], [1.0], [0.0], 0.0, [1.0], [0.0], 1.0, tau=-1.0)
    algo = FedACS(K=2)
    algo.setup(3, torch.zeros(1, dtype=F64))
    with pytest.raises(ValueError, match="success_probs"):
        algo.observe_system(0, success_probs=[0.5, 1.2, 1.0])
    with pytest.raises(ValueError, match="local_steps"):
        algo.observe_system(0, local_steps=[1, 0, 2])
    with pytest.raises(ValueError, match="num_clients"):
        algo.observe_system(0, success_probs=[0.5, 0.5])
    with pytest.raises(ValueError, match="omega"):
        setup_fail = FedACS(K=2, omega=[0.5, 0.5])
        setup_fail.setup(3, torch.zeros(1, dtype=F64))
    with pytest.raises(RuntimeError, match="select"):
        algo.open_round(0, None)  # no select() for round 0
    algo.observe_system(0, success_probs=[1.0, 1.0, 1.0], local_steps=[1, 1, 1])
    counts = algo.select(0, torch.tensor([True, True, False]), np.random.default_rng(0))
    algo.open_round(0, None)
    with pytest.raises(ValueError, match="not drawn"):
        algo.add(2, torch.zeros(1, dtype=F64), ClientInfo(1, 1))
    drawn = int(torch.nonzero(counts).flatten()[0])
    algo.add(drawn, torch.zeros(1, dtype=F64), ClientInfo(1, 1))
    with pytest.raises(ValueError, match="already added"):
        algo.add(drawn, torch.zeros(1, dtype=F64), ClientInfo(1, 1))
    with pytest.warns(UserWarning, match="observe_system"):
        lazy = FedACS(K=1)
        lazy.setup(2, torch.zeros(1))
        lazy.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(0))
    ada = AdaFed()
    ada.setup(2, torch.zeros(1, dtype=F64))
    ada.select(0, torch.ones(2, dtype=torch.bool), None)
    with pytest.raises(ValueError, match="participation_probs"):
        ada.open_round(0, ctx_for(0, 2, [0, 1], [0, 1], [0, 1]))
    cafed = CAFed()
    cafed.setup(2, torch.zeros(1, dtype=F64))
    with pytest.raises(ValueError, match="availability"):
        cafed.open_round(0, None)
    with pytest.raises(ValueError, match="num_clients"):
        CAFed(pi=[0.5, 0.5, 0.5]).setup(2, torch.zeros(1, dtype=F64))


# ============================================================================================== resume
FACTORIES = {
    "fedacs": lambda: FedACS(K=4, momentum=0.5),
    "fedacs_ema_drop": lambda: FedACS(K=4, estimator="ema", ema=0.3, unavailable="drop", calibrate=True),
    "sampled_fedavg": lambda: SampledFedAvg(K=3),
    "cafedavg": lambda: CAFedAvg(K=3, unavailable="drop", calibrate=True),
    "os": lambda: OS(K=3, mix=0.1),
    "cafed": lambda: CAFed(kappa_bar_sq=0.5),
    "adafed": lambda: AdaFed(pi_source="estimate"),
    "f3ast": lambda: F3AST(k=2, beta=0.2),
}


def _drive(algo, start, stop, n=5, d=3):
    p = np.array([0.9, 0.8, 0.6, 0.5, 0.3])
    for t in range(stop):
        g = np.random.default_rng([17, t])
        avail = torch.from_numpy(g.random(n) < p)
        s = g.uniform(0.5, 1.0, n)
        steps = g.integers(1, 6, n)
        deltas = torch.from_numpy(g.normal(size=(n, d)))
        losses = g.uniform(0.5, 2.0, n)
        link = g.random(n) < s
        if t < start:
            continue
        if hasattr(algo, "observe_system"):
            algo.observe_system(t, success_probs=s, local_steps=steps, participation_probs=p)
        sel = algo.select(t, avail, np.random.default_rng([18, t]))
        sel = sel > 0 if sel.dtype != torch.bool else sel
        arrived = sel & torch.from_numpy(link)
        ctx = RoundContext(t, n, avail, sel, arrived, torch.from_numpy(p), torch.from_numpy(s),
                           torch.where(sel, torch.from_numpy(steps), 0))
        algo.open_round(t, ctx)
        for i in torch.nonzero(arrived).flatten().tolist():
            algo.add(i, deltas[i], ClientInfo(1, int(steps[i]), loss=float(losses[i])))
        algo.close_round()
    return algo.params.clone(), dict(algo.last_weights)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_state_dict_resume_equals_uninterrupted(name):
    n, w0, cw = 5, torch.tensor([0.1, -0.2, 0.3], dtype=F64), torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0])
    full = FACTORIES[name]()
    full.setup(n, w0, cw)
    expected, expected_w = _drive(full, 0, 8)
    first = FACTORIES[name]()
    first.setup(n, w0, cw)
    _drive(first, 0, 4)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = FACTORIES[name]()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got, got_w = _drive(resumed, 4, 8)
    assert torch.equal(got, expected), name
    assert got_w == expected_w
    assert not torch.equal(expected, w0)
    assert resumed.hparams() == full.hparams()
    assert math.isfinite(float(got.sum()))


def test_fedacs_ema_estimator_extension_learns_the_system():
    # Extension beyond the paper: no oracle; EMA (rate 0.005, std ~ sqrt(b/(2-b) s(1-s)) <= 0.025) of arrivals of
    # drawn clients and of the steps they were told to run. Static system: s = [0.9, 0.6, 0.75, 0.5], T = [1, 2, 3, 4].
    n, s, steps = 4, np.array([0.9, 0.6, 0.75, 0.5]), torch.tensor([1, 2, 3, 4])
    algo = FedACS(K=40, estimator="ema", ema=0.005)
    algo.setup(n, torch.zeros(1, dtype=F64))
    everyone = torch.ones(n, dtype=torch.bool)
    links = np.random.default_rng(4)
    for t in range(1500):
        counts = algo.select(t, everyone, np.random.default_rng([9, t]))
        sel = counts > 0
        arrived = sel & torch.from_numpy(links.random(n) < s)
        algo.open_round(t, RoundContext(t, n, everyone, sel, arrived, None, None, torch.where(sel, steps, 0)))
        for i in torch.nonzero(arrived).flatten().tolist():
            algo.add(i, torch.zeros(1, dtype=F64), ClientInfo(1, int(steps[i])))
        algo.close_round()
    est = algo.estimator
    assert torch.allclose(est.success(), torch.from_numpy(s), atol=0.1)
    assert torch.allclose(est.norms(), steps.to(F64))
    oracle = fedacs_probabilities(torch.full((n,), 0.25), s, steps)  # ∝ 1/(s T) = [1.11, 0.83, 0.44, 0.5]
    algo.select(1500, everyone, np.random.default_rng(0))
    assert torch.allclose(algo.last_probabilities, oracle, atol=0.03)
