"""AdaFed as run in CA-Fed's experiments (Tan et al. 2022): every available client, alpha/pi normalised per round."""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import AdaFed, ClientInfo
from tests.algorithms.selection_rounds import F64, check_resume, ctx_for, mask, vec

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


def test_bad_inputs():
    with pytest.raises(ValueError, match="pi_source"):
        AdaFed(pi_source="oracle")
    ada = AdaFed()
    ada.setup(2, torch.zeros(1, dtype=F64))
    ada.select(0, torch.ones(2, dtype=torch.bool), None)
    with pytest.raises(ValueError, match="participation_probs"):
        ada.open_round(0, ctx_for(0, 2, [0, 1], [0, 1], [0, 1]))


def test_state_dict_resume_equals_uninterrupted():
    check_resume(lambda: AdaFed(pi_source="estimate"))
