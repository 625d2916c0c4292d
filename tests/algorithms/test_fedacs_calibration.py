"""App. I.2's step calibration of FedACS and c-a-FedAvg: on the clients' learning rate (the paper's eta, default),
on the server step (explicit), capped, and the warning when one update's weight exceeds 1.

Every expected number is computed by hand from the paper's (111)-(112):
``eta_FedACS = eta_FedAvg * [sum omega s a][sum omega / (s a)]`` and ``eta_c-a = eta_FedAvg * sum omega s a /
sum omega a``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import CAFedAvg, ClientInfo, FedACS
from tests.algorithms.selection_rounds import F64, vec

EVERYONE = torch.ones(2, dtype=torch.bool)
ONE = ClientInfo(1, 1)


def one_round(algo, success, steps, delta=1.0, seed=1):
    """Setup on 2 clients at w = 0, one round where every drawn client sends ``delta``; returns (counts, w)."""
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.observe_system(0, success_probs=success, local_steps=steps)
    counts = algo.select(0, EVERYONE, np.random.default_rng(seed)).tolist()
    algo.open_round(0, None)
    for m in range(2):
        if counts[m]:
            algo.add(m, vec(delta), ONE)
    return counts, algo.close_round()


def test_calibrate_true_scales_the_clients_learning_rate_not_the_server_step():
    # omega = [0.5, 0.5], s = [1, 0.5], T = [1, 4]: c = [0.5 + 0.5*0.5*4] * [0.5/1 + 0.5/(0.5*4)] = 1.5 * 0.75
    # = 1.125 on eta (client lr); the aggregate keeps its weights c_m / K (server step 1).
    algo = FedACS(K=4, calibrate=True)
    counts, w = one_round(algo, [1.0, 0.5], [1, 4])
    assert algo.calibrate == "client" and algo.scales_client_lr
    assert algo.client_lr_scale == pytest.approx(1.125, abs=1e-12)
    assert algo.last_calibration == pytest.approx(1.125, abs=1e-12)
    assert torch.allclose(w, vec(sum(counts) / 4))
    assert algo.last_max_weight == pytest.approx(max(counts) / 4)


def test_calibrate_server_scales_the_server_step_and_leaves_the_clients_alone():
    algo = FedACS(K=4, calibrate="server")
    counts, w = one_round(algo, [1.0, 0.5], [1, 4])
    assert algo.client_lr_scale == 1.0 and not algo.scales_client_lr
    assert torch.allclose(w, vec(1.125 * sum(counts) / 4))


def test_calibration_cap_bounds_the_multiplier_for_either_target():
    # s = [1, 0.5], T = [1, 9]: c = [0.5 + 0.5*0.5*9] * [0.5 + 0.5/4.5] = 2.75 * (0.5 + 1/9) = 1.680555...
    exact = 2.75 * (0.5 + 1 / 9)
    free = FedACS(K=4, calibrate=True)
    one_round(free, [1.0, 0.5], [1, 9])
    assert free.client_lr_scale == pytest.approx(exact, abs=1e-12)
    capped = FedACS(K=4, calibrate=True, calibration_cap=1.5)
    one_round(capped, [1.0, 0.5], [1, 9])
    assert capped.client_lr_scale == 1.5
    server = FedACS(K=4, calibrate="server", calibration_cap=1.5)
    counts, w = one_round(server, [1.0, 0.5], [1, 9])
    assert torch.allclose(w, vec(1.5 * sum(counts) / 4))


def test_cafedavg_calibration_on_the_clients_learning_rate():
    # omega = [1/2, 1/2], s = [1, 0.5], T = [1, 3]: (0.5 + 0.75) / (0.5 + 1.5) = 0.625 on eta; the update of a
    # drawn client is divided by s as usual: w = (c_0 + 2 c_1) / K, not 0.625 times that.
    algo = CAFedAvg(K=4, calibrate=True)
    counts, w = one_round(algo, [1.0, 0.5], [1, 3], seed=3)
    assert algo.client_lr_scale == pytest.approx(0.625, abs=1e-12)
    assert torch.allclose(w, vec((counts[0] + 2 * counts[1]) / 4))


def test_no_calibration_is_algorithm_1_as_printed():
    algo = FedACS(K=4)
    counts, w = one_round(algo, [1.0, 0.5], [1, 4])
    assert algo.client_lr_scale == 1.0 and algo.last_calibration == 1.0 and not algo.calibrate
    assert torch.allclose(w, vec(sum(counts) / 4))


def test_a_weight_above_one_warns_once_naming_the_cause():
    # s = [1, 0.5], T = [1, 400]: c = [0.5 + 100] * [0.5 + 0.5/200] = 100.5 * 0.5025 = 50.50125; K = 1 draw, so the
    # one arrived update gets weight c * 1 / 1 > 1 on the server step.
    algo = FedACS(K=1, calibrate="server")
    with pytest.warns(UserWarning, match=r"applied weight 50\.5 > 1 .*calibrate='server' multiplied the step by 50\.5"):
        one_round(algo, [1.0, 0.5], [1, 400])
    assert algo.last_max_weight == pytest.approx(50.50125, abs=1e-9)
    # once per rule: the next round is silent
    algo.observe_system(1, success_probs=[1.0, 0.5], local_steps=[1, 400])
    counts = algo.select(1, EVERYONE, np.random.default_rng(2)).tolist()
    algo.open_round(1, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for m in range(2):
            if counts[m]:
                algo.add(m, vec(1.0), ONE)
        algo.close_round()


def test_weights_up_to_one_do_not_warn():
    # K = 1 draw, no calibration: the one update has weight exactly 1 (an average of one), which is no extrapolation
    algo = FedACS(K=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_round(algo, [1.0, 0.5], [1, 4])
    assert algo.last_max_weight == 1.0


def test_calibration_survives_state_dict():
    algo = FedACS(K=4, calibrate=True)
    one_round(algo, [1.0, 0.5], [1, 4])
    again = FedACS(K=4, calibrate=True)
    again.setup(2, torch.zeros(1, dtype=F64))
    again.load_state_dict(algo.state_dict())
    assert again.last_calibration == pytest.approx(1.125, abs=1e-12)


def test_calibrate_on_a_rule_without_calibration_is_refused():
    from lightning_fedhet.algorithms import SampledFedAvg

    with pytest.raises(TypeError):
        SampledFedAvg(K=2, calibrate=True)
