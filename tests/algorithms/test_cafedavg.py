"""c-a-FedAvg (communication-aware FedAvg; FedACS paper eq. (113)): importance sampling, updates ÷ s_m, ÷K."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import CAFedAvg, ClientInfo
from tests.algorithms.selection_rounds import F64, check_resume, ctx_for, vec


def test_cafedavg_by_hand():
    one = torch.zeros(1, dtype=F64)
    # c-a-FedAvg with omega = [1, 0]: K = 2 draws of client 0, s_0 = 0.5 -> w = 2/2 * 4 / 0.5 = 8
    ca = CAFedAvg(K=2)
    ca.setup(2, one, torch.tensor([1.0, 0.0]))
    assert ca.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(0)).tolist() == [2, 0]
    ca.open_round(0, ctx_for(0, 2, [0, 1], [0], [0], s=[0.5, 1.0]))
    ca.add(0, vec(4.0), ClientInfo(1, 1))
    assert torch.allclose(ca.close_round(), vec(8.0))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="K"):
        CAFedAvg(K=0)


def test_state_dict_resume_equals_uninterrupted():
    check_resume(lambda: CAFedAvg(K=3, unavailable="drop", calibrate=True))


def test_drop_divides_by_availability_times_success():
    # unavailable="drop": the divisor is pi_m s_m. omega = [1, 0], K = 2 draws of client 0, s_0 = 0.5, pi_0 = 0.8:
    # w = (2/2) * 4 / (0.8 * 0.5) = 10 (renormalize would divide by s_0 alone: 8).
    # Slips caught: dividing by s / pi, the drop branch skipped or taken for "renormalize".
    for unavailable, expected in (("drop", 10.0), ("renormalize", 8.0)):
        ca = CAFedAvg(K=2, unavailable=unavailable)
        ca.setup(2, torch.zeros(1, dtype=F64), torch.tensor([1.0, 0.0]))
        ca.select(0, torch.ones(2, dtype=torch.bool), np.random.default_rng(0))
        ca.open_round(0, ctx_for(0, 2, [0, 1], [0], [0], s=[0.5, 1.0], pi=[0.8, 1.0]))
        ca.add(0, vec(4.0), ClientInfo(1, 1))
        torch.testing.assert_close(ca.close_round(), vec(expected))


def test_the_ema_estimator_reads_the_rounds_availability_steps_and_arrivals():
    # With ema=1 the estimates are the last observation: pi = this round's availability (1, 0, 1), ||a||_1 = the
    # steps each client was told to run (plain SGD: 2 and 3; client 1, never told, takes their mean 2.5), and s = 1
    # for a drawn client that arrived, 0 for one that did not, 1 (the prior) for a client never drawn.
    # Slips caught: the availability, the steps or the arrivals not read from the round's context, `steps >= 0`.
    ca = CAFedAvg(K=2, estimator="ema", ema=1.0)
    ca.setup(3, torch.zeros(1, dtype=F64))
    counts = ca.select(0, torch.tensor([True, False, True]), np.random.default_rng(1))
    drawn = torch.nonzero(counts).flatten().tolist()
    assert drawn == [0, 2]  # this seed draws both available clients: one arrives, one does not
    arrived = drawn[:1]
    ctx = ctx_for(0, 3, [0, 2], drawn, arrived)
    ctx.local_steps = torch.tensor([2, 0, 3])
    ca.open_round(0, ctx)
    for client in arrived:
        ca.add(client, vec(1.0), ClientInfo(1, 2))
    ca.close_round()
    est = ca.estimator
    torch.testing.assert_close(est.availability(), torch.tensor([1.0, 0.0, 1.0], dtype=F64))
    torch.testing.assert_close(est.norms(), torch.tensor([2.0, 2.5, 3.0], dtype=F64))
    expected_s = [1.0 if (c in arrived or c not in drawn) else 0.0 for c in range(3)]
    torch.testing.assert_close(est.success(), torch.tensor(expected_s, dtype=F64))
