"""Step-length calibration of the FedACS paper (App. I.2): effective steps and learning-rate multipliers."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.algorithms import lr_scalings
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
