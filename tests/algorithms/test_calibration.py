"""Step-length calibration of the FedACS paper (App. I.2): effective steps and learning-rate multipliers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, FedNova, RoundContext, lr_scalings
from lightning_fedhet.algorithms.calibration import effective_step


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


def test_fednova_effective_steps_by_hand():
    # omega = [0.5, 0.5], s = [1, 0.5], a = [1, 4]: sum omega s = 0.75, sum omega s a = 1.5
    # the paper's FedNova (÷K, eq. 116a): 1.5, multiplier 1; over the arrived clients: tau_eff = 1.5 / 0.75 = 2,
    # multiplier sum omega s = 0.75
    assert effective_step("fednova", [0.5, 0.5], [1.0, 0.5], [1, 4]) == pytest.approx(1.5)
    assert effective_step("fednova_arrived", [0.5, 0.5], [1.0, 0.5], [1, 4]) == pytest.approx(2.0)
    sc = lr_scalings([0.5, 0.5], [1.0, 0.5], [1, 4])
    assert sc["fednova"].client == pytest.approx(1.0) and sc["fednova_arrived"].client == pytest.approx(0.75)
    # lossless links: both FedNova forms take FedAvg's step
    assert lr_scalings([0.3, 0.7], 1.0, [2, 5])["fednova_arrived"].client == pytest.approx(1.0)


@pytest.mark.parametrize("divisor, method", [("selected", "fednova"), ("arrived", "fednova_arrived")])
def test_fednova_measured_step_matches_the_calibration(divisor, method):
    # Every client trains each round; half of them (s = 1, T = 1) always arrive, the other half (s = 0.5, T = 4)
    # arrive with probability 1/2. Client m's delta is -a_m * 1 (one unit of gradient per unit of ||a||_1), so the
    # round's step is -E_step for the effective step of the table. 200 clients, 150 rounds: the ratio estimator
    # tau_eff has relative sd ~ 0.5/sqrt(200) per round; 0.03 is > 10 standard errors of the 150-round mean.
    n = 200
    s = np.where(np.arange(n) < n // 2, 1.0, 0.5)
    steps = np.where(np.arange(n) < n // 2, 1, 4)
    algo = FedNova(divisor=divisor)
    algo.setup(n, torch.zeros(1, dtype=torch.float64))
    everyone = torch.ones(n, dtype=torch.bool)
    g = np.random.default_rng(0)
    moves = []
    for t in range(150):
        arrived = torch.from_numpy(g.random(n) < s)
        before = float(algo.params)
        algo.open_round(t, RoundContext(t, n, everyone, everyone, arrived, None, torch.from_numpy(s),
                                        torch.from_numpy(steps)))
        for m in torch.nonzero(arrived).flatten().tolist():
            algo.add(m, torch.tensor([-float(steps[m])], dtype=torch.float64), ClientInfo(1, int(steps[m])))
        moves.append(before - float(algo.close_round()))
    expected = effective_step(method, np.full(n, 1 / n), s, steps)
    assert np.mean(moves) == pytest.approx(expected, abs=0.03)
    assert expected == pytest.approx(1.5 if method == "fednova" else 2.0)
