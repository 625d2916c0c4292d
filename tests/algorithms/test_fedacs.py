"""FedACS (Weng, Ren, Xiao, Skoglund, "Heterogeneity-Aware Client Sampling"): sampling probabilities (eq. 15),
the toy quadratic's fixed points (Fig. 4), aggregation ÷K with duplicates, the per-round step calibration (App. I.2),
the labelled EMA extension, input checks and resume.

Expected numbers come from closed forms or from arithmetic written out in comments, never from the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import (
    CAFedAvg,
    ClientInfo,
    FedACS,
    FedAvg,
    FedNova,
    RoundContext,
    SampledFedAvg,
    chi_square,
    fedacs_probabilities,
    surrogate_weights,
)
from tests.algorithms.selection_rounds import F64, check_resume, ctx_for, vec

# ============================================================================================== toy quadratic
# The FedACS paper's toy quadratic (Examples 1-2, Fig. 4, middle panel): F_m(x) = 1/2 ||x - E_m||^2,
# E_m ~ N(0, I_10), M = 30 clients, T_m = 1..30 local GD steps, failure probabilities q_m evenly spaced in
# [0.01, 0.3] (pairing: a fixed random permutation), uniform omega, deterministic gradients. eta = 0.002 (Fig. 7's
# value) to shorten the burn-in.
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
    # c-a-FedAvg: p = omega and each update / (1-q_m): E[update] ∝ sum_m c_m (E_m - x)  (T-weighted).
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


# ============================================================================================== by hand
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


def test_fedacs_calibrate_server_by_hand():
    one = torch.zeros(1, dtype=F64)
    # FedACS(calibrate="server"): omega = [0.5, 0.5], s = [1, 0.5], T = [1, 4]:
    # factor = [0.5*1*1 + 0.5*0.5*4] * [0.5/(1*1) + 0.5/(0.5*4)] = 1.5 * 0.75 = 1.125 on the server step
    cal = FedACS(K=4, calibrate="server")
    cal.setup(2, one)
    cal.observe_system(0, success_probs=[1.0, 0.5], local_steps=[1, 4])
    counts = cal.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(1)).tolist()
    cal.open_round(0, None)
    for m in range(2):
        if counts[m]:
            cal.add(m, vec(1.0), ClientInfo(1, 1))
    assert torch.allclose(cal.close_round(), vec(1.125 * sum(counts) / 4))


# ============================================================================================== bad input, resume, EMA
@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: FedACS(K=0), "K"),
        (lambda: FedACS(K=2.5), "K"),
        (lambda: FedACS(K=-3), "K"),
        (lambda: FedACS(K=2, omega=[0.5, 0.6]), "omega must sum to 1"),
        (lambda: FedACS(K=2, omega=[1.5, -0.5]), "omega"),
        (lambda: FedACS(K=2, unavailable="ignore"), "unavailable"),
        (lambda: FedACS(K=2, estimator="kalman"), "estimator"),
        (lambda: FedACS(K=2, estimator="ema", ema=0.0), "ema"),
        (lambda: FedACS(K=2, momentum=1.0), "momentum"),
        (lambda: FedACS(K=2, prox_mu=1.0), "local_lr"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_bad_round_inputs():
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


@pytest.mark.parametrize(
    "factory",
    [
        lambda: FedACS(K=4, momentum=0.5),
        lambda: FedACS(K=4, estimator="ema", ema=0.3, unavailable="drop", calibrate=True),
    ],
    ids=["fedacs", "fedacs_ema_drop"],
)
def test_state_dict_resume_equals_uninterrupted(factory):
    check_resume(factory)


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


def test_old_import_paths_still_work():
    import lightning_fedhet.algorithms as algorithms
    from lightning_fedhet.algorithms import fedacs

    for name in ("FedACS", "SampledFedAvg", "CAFedAvg", "OS", "SystemEstimator", "fedacs_probabilities",
                 "surrogate_weights", "chi_square"):
        assert getattr(fedacs, name) is getattr(algorithms, name), name


def test_check_client_solver_matches_the_norm_model():
    params = [torch.nn.Parameter(torch.zeros(1))]
    algo = FedACS(K=2, momentum=0.9)
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.check_client_solver(torch.optim.SGD(params, lr=0.1, momentum=0.9), "reset")  # the modelled solver
    with pytest.raises(ValueError, match=r"FedACS\(momentum=0.9\) does not match the optimizer's momentum=0\b"):
        algo.check_client_solver(torch.optim.SGD(params, lr=0.1), "reset")
    with pytest.raises(ValueError, match="torch.optim.SGD.*Adam"):
        algo.check_client_solver(torch.optim.Adam(params), "reset")
    with pytest.raises(ValueError, match="optimizer_state='persist'"):
        algo.check_client_solver(torch.optim.SGD(params, lr=0.1, momentum=0.9), "persist")
    plain = FedACS(K=2)
    plain.setup(2, torch.zeros(1, dtype=F64))
    plain.check_client_solver(torch.optim.SGD(params, lr=0.1), "persist")  # no momentum: nothing carried over
    with pytest.raises(ValueError, match="momentum"):
        plain.check_client_solver(torch.optim.SGD(params, lr=0.1, momentum=0.5), "reset")
    # rules that never use ||a||_1 take any solver; c-a-FedAvg only needs it to calibrate
    for free in (SampledFedAvg(K=2), CAFedAvg(K=2)):
        free.setup(2, torch.zeros(1, dtype=F64))
        free.check_client_solver(torch.optim.Adam(params), "persist")
    calibrated = CAFedAvg(K=2, calibrate=True)
    calibrated.setup(2, torch.zeros(1, dtype=F64))
    with pytest.raises(ValueError, match="CAFedAvg"):
        calibrated.check_client_solver(torch.optim.Adam(params), "reset")


def test_ema_estimator_is_not_pulled_onto_clients_that_hold_no_data():
    # Slip caught: counting the draws of a client with no data (it never trains) as failed arrivals, which drives its
    # s_hat to 0, its p_m ∝ 1/s_hat to 1, and every draw onto it: training stops. Clients 1 and 3 hold no data; no
    # channel, one local step: the oracle's p is omega = 1/4 each, and so must the estimator's stay (s_hat = 1 for
    # clients that always arrive, the prior 1 for those never able to train).
    from torch.utils.data import TensorDataset

    from lightning_fedhet.data.streams import ClientStreams
    from lightning_fedhet.federation import RoundPlanner
    from lightning_fedhet.participation import Full
    from lightning_fedhet.server import Server

    algo = FedACS(K=4, estimator="ema", ema=0.5)
    streams = ClientStreams(TensorDataset(torch.zeros(4, 1)), [[0, 1], [], [2, 3], []], batch_size=2)
    server = Server(RoundPlanner(Full(), algo, streams, seed=0), algo, torch.zeros(1), num_parameters=1)
    trained = 0
    for t in range(30):
        plan = server.begin_round(t)
        trained += len(plan.trained_ids)
        for client in plan.trained_ids:
            server.submit(client, torch.ones(1), 0.0)
        server.close_round()
    torch.testing.assert_close(algo.last_probabilities, torch.full((4,), 0.25, dtype=torch.float64))
    assert trained > 30  # K = 4 draws, half on clients with data: ~2 trained per round


def test_chi_square_and_surrogate_weights_by_hand():
    # chi^2(omega || Omega) = sum (omega - Omega)^2 / Omega: omega = (1/2, 1/2), Omega = (1/4, 3/4):
    # 0.0625/0.25 + 0.0625/0.75 = 1/4 + 1/12 = 1/3. An Omega of 0 where omega > 0 is infinite; where both are 0
    # the term is 0. Slips caught: `* 2` for `** 2`, the zero tests moved to 1 or >= 0.
    assert chi_square([0.5, 0.5], [0.25, 0.75]) == pytest.approx(1 / 3)
    assert chi_square([0.4, 0.4, 0.2], [0.5, 0.5, 0.0]) == float("inf")
    assert chi_square([1.0, 0.0], [1.0, 0.0]) == 0.0
    # Omega_m = p_m s_m a_m / sum: p = (1/2, 1/4, 1/4), s = (1, 1/2, 1), a = (1, 2, 4) -> (1/2, 1/4, 1) / 7/4
    torch.testing.assert_close(surrogate_weights([0.5, 0.25, 0.25], [1.0, 0.5, 1.0], [1.0, 2.0, 4.0]),
                               torch.tensor([2 / 7, 1 / 7, 4 / 7], dtype=torch.float64))
