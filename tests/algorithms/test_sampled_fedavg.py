"""SampledFedAvg, the FedACS paper's FedAvg with importance sampling: K draws with replacement, ÷K."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, SampledFedAvg
from tests.algorithms.selection_rounds import F64, check_resume, vec


def test_sampled_fedavg_by_hand():
    one = torch.zeros(1, dtype=F64)
    # SampledFedAvg with p = [0, 1, 0]: both draws hit client 1 -> w = 0 + 2/2 * 3 = 3
    fa = SampledFedAvg(K=2, probabilities=[0.0, 1.0, 0.0])
    fa.setup(3, one)
    assert fa.select(0, torch.ones(3, dtype=torch.bool), np.random.default_rng(0)).tolist() == [0, 2, 0]
    fa.open_round(0, None)
    fa.add(1, vec(3.0), ClientInfo(1, 1))
    assert torch.allclose(fa.close_round(), vec(3.0))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: SampledFedAvg(K=0), "K"),
        (lambda: SampledFedAvg(K=2, probabilities=[0.2, 0.2]), "probabilities must sum to 1"),
    ],
)
def test_bad_constructor_arguments(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_state_dict_resume_equals_uninterrupted():
    check_resume(lambda: SampledFedAvg(K=3))
