"""The Fed-CIS study module (scripts/studies/fedcis.py): BatchNorm statistics through the rule, and a 2-round run."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import harness  # noqa: E402
from studies import fedcis  # noqa: E402


def test_running_statistics_become_frozen_parameters_that_batchnorm_still_updates():
    # Slip it catches: statistics left as buffers (the server would average them over every arrival) or made
    # trainable (SGD and weight decay would move them).
    bn = nn.Sequential(nn.BatchNorm1d(3))
    assert fedcis.stats_as_parameters(bn) == 2
    names = {n for n, _ in bn.named_parameters()}
    assert {"0.running_mean", "0.running_var"} <= names and not bn[0].running_mean.requires_grad
    x = torch.tensor([[1.0, 2.0, 3.0], [3.0, 6.0, 9.0]])
    bn.train()
    bn(x)
    # momentum 0.1: running_mean = 0.9 * 0 + 0.1 * batch mean; running_var = 0.9 * 1 + 0.1 * unbiased variance
    assert torch.allclose(bn[0].running_mean, 0.1 * torch.tensor([2.0, 4.0, 6.0]))
    assert torch.allclose(bn[0].running_var, 0.9 + 0.1 * torch.tensor([2.0, 8.0, 18.0]))


@pytest.mark.parametrize("setting", list(fedcis.SETTINGS))
def test_run_cell_two_rounds_on_a_tiny_stand_in(setting):
    config = {**fedcis.BASE, "base_width": 4, "rounds": 2, "eval_every": 1, "local_steps": 1, "batch_size": 8,
              "train_size": 140, "test_size": 40, "synthetic_data": True,
              "aggregation_base": fedcis.SETTINGS[setting]}
    out = fedcis.run_cell(harness.Cell(setting, "Serving Rate", config), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and all(0.0 <= v <= 1.0 for v in m["cis_acc"])
    assert out["config"]["lambda_tilde"] == [0.8, 0.15, 0.05]
    assert sum(out["config"]["node_sizes"]) == 140
