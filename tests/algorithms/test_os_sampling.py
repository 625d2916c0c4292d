"""OS, optimal client sampling (Chen, Horváth, Richtárik; FedACS paper eq. (20)): p ∝ omega * last update norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import OS, ClientInfo
from tests.algorithms.selection_rounds import F64, check_resume, vec


def test_os_by_hand():
    one = torch.zeros(1, dtype=F64)
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


@pytest.mark.parametrize("build, match", [(lambda: OS(K=0), "K"), (lambda: OS(K=2, mix=1.0), "mix")])
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_state_dict_resume_equals_uninterrupted():
    check_resume(lambda: OS(K=3, mix=0.1))


def test_any_client_solver_is_accepted():
    # OS weighs by update norms, never by ||a||_1
    algo = OS(K=2)
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.check_client_solver(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]), "persist")
