"""Lossy links: arrival rates, independence of the two links, purity, per-round loss draws, checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.system import LossyChannel, UniformLoss

N = 50


def test_lossy_channel_arrival_rate():
    q_down = np.linspace(0.0, 0.5, N)
    q_up = 0.2
    channel = LossyChannel(uplink=q_up, downlink=q_down)
    channel.setup(N, seed=0)
    success = (1 - q_down) * (1 - q_up)
    np.testing.assert_allclose(channel.success_probs.numpy(), success)
    np.testing.assert_allclose(channel.uplink_success.numpy(), 0.8)
    np.testing.assert_allclose(channel.downlink_success.numpy(), 1 - q_down)
    assert channel.success_probs.dtype == torch.float64
    rounds = 10_000
    everyone = torch.ones(N, dtype=torch.bool)
    got = np.empty((rounds, N), dtype=bool)
    arrived = np.empty((rounds, N), dtype=bool)
    for t in range(rounds):
        down = channel.downlink(t, everyone)
        up = channel.uplink(t, down)
        assert down.dtype == torch.bool and up.dtype == torch.bool
        got[t], arrived[t] = down.numpy(), up.numpy()
    assert not np.any(arrived & ~got)  # nothing arrives from a client that missed the model
    for rate, p in ((got.mean(axis=0), 1 - q_down), (arrived.mean(axis=0), success)):
        se = np.sqrt(p * (1 - p) / rounds)
        z = np.divide(rate - p, se, out=np.zeros(N), where=se > 0)
        assert np.max(np.abs(z)) < 4.5
        assert abs((rate - p).sum() / np.sqrt((se**2).sum())) < 3
    # uplink losses are independent of downlink losses: P(up | down) = 1 - q_up
    cond = arrived.sum() / got.sum()
    assert abs(cond - 0.8) < 3 * np.sqrt(0.16 / got.sum())
    assert got[:, 0].all()  # q_down = 0: always received


def test_lossy_channel_is_pure_and_selection_independent():
    channel = LossyChannel(uplink=[0.3] * 20, downlink=0.4)
    channel.setup(20, seed=5)
    everyone = np.ones(20, dtype=bool)
    some = np.arange(20) % 3 == 0
    full = channel.downlink(7, everyone).numpy()
    part = channel.downlink(7, torch.from_numpy(some)).numpy()
    np.testing.assert_array_equal(part, full & some)
    np.testing.assert_array_equal(channel.uplink(7, everyone).numpy(), channel.uplink(7, everyone).numpy())
    assert not np.array_equal(channel.uplink(7, everyone).numpy(), full)  # separate streams
    other = LossyChannel(uplink=0.3, downlink=0.4)
    other.setup(20, seed=6)
    assert not all(np.array_equal(other.downlink(t, everyone).numpy(), channel.downlink(t, everyone).numpy())
                   for t in range(5))
    lossless = LossyChannel()
    lossless.setup(4)
    assert lossless.uplink(0, torch.tensor([True, False, True, True])).tolist() == [True, False, True, True]


@pytest.mark.parametrize("make, match", [
    (lambda: LossyChannel(uplink=1.0), r"uplink must lie in \[0, 1\)"),
    (lambda: LossyChannel(downlink=-0.1), r"downlink must lie in \[0, 1\)"),
    (lambda: LossyChannel(uplink=[0.1, 1.2]), r"uplink must lie in \[0, 1\)"),
    (lambda: LossyChannel(downlink=[0.1, 0.2]).setup(3), r"downlink has 2 entries but num_clients is 3"),
    (lambda: _setup_channel().downlink(0, np.ones(3, dtype=bool)), r"selected must have shape \(4,\)"),
    (lambda: _setup_channel().uplink(-1, np.ones(4, dtype=bool)), r"round must be >= 0"),
])
def test_lossy_channel_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _setup_channel() -> LossyChannel:
    channel = LossyChannel(uplink=0.1)
    channel.setup(4, seed=0)
    return channel


def test_per_round_loss_draws_follow_uniform_loss_and_reach_the_oracle():
    channel = LossyChannel(uplink=UniformLoss(0.1, 0.9))
    channel.setup(num_clients=400, seed=2)
    q0, _ = channel.loss_probs_at(0)
    q1, _ = channel.loss_probs_at(1)
    assert channel.dynamic and not np.allclose(q0, q1)
    assert 0.1 <= q0.min() and q0.max() < 0.9 and abs(q0.mean() - 0.5) < 0.05
    np.testing.assert_array_equal(q0, channel.loss_probs_at(0)[0])  # pure function of (seed, round)
    torch.testing.assert_close(channel.success_probs_at(1), torch.as_tensor(1 - q1, dtype=torch.float64))
    # arrivals in round t follow that round's q: over clients, P(arrive) = mean(1 - q_t)
    everyone = torch.ones(400, dtype=torch.bool)
    rates = [float(channel.uplink(t, everyone).double().mean()) for t in range(200)]
    expected = [float(1 - channel.loss_probs_at(t)[0].mean()) for t in range(200)]
    assert abs(np.mean(rates) - np.mean(expected)) < 0.01
    with pytest.raises(ValueError, match="low must be <= high"):
        UniformLoss(0.5, 0.2)
