"""System heterogeneity: lossy channel rates, local-step draws, latency model and virtual clock."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.system import (
    LossyChannel,
    ShiftedExponential,
    TwoGroupSteps,
    UniformSteps,
    VirtualClock,
    check_local_steps,
    local_steps_for,
)

N = 50


# ----------------------------------------------------------------------------- channel
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


# ----------------------------------------------------------------------------- local steps
def test_uniform_steps_range_and_distribution():
    dist = UniformSteps(2, 5)
    rounds = 2000
    draws = np.stack([dist.sample(t, N, seed=1) for t in range(rounds)])
    assert draws.dtype == np.int64 and draws.shape == (rounds, N)
    assert draws.min() == 2 and draws.max() == 5
    counts = np.bincount(draws.ravel(), minlength=6)[2:]
    n = draws.size
    assert np.all(np.abs(counts / n - 0.25) < 3 * np.sqrt(0.25 * 0.75 / n))
    assert abs(draws.mean() - 3.5) < 3 * np.sqrt((4**2 - 1) / 12 / n)
    np.testing.assert_allclose(dist.expected(N), 3.5)
    # pure in (seed, round), different across rounds and seeds
    np.testing.assert_array_equal(dist.sample(17, N, seed=1), draws[17])
    assert not np.array_equal(draws[17], draws[18])
    assert not np.array_equal(dist.sample(17, N, seed=2), draws[17])
    np.testing.assert_array_equal(local_steps_for(dist, 17, N, seed=1), draws[17])
    assert np.all(UniformSteps(3, 3).sample(0, N, 0) == 3)


def test_two_group_steps_fedacs_dynamic():
    dist = TwoGroupSteps()
    draws = np.stack([dist.sample(t, 20, seed=0) for t in range(1000)])
    first, second = draws[:, :10], draws[:, 10:]
    assert set(np.unique(first)) == set(range(1, 11))
    assert set(np.unique(second)) == set(range(20, 31))
    assert abs(first.mean() - 5.5) < 3 * np.sqrt((10**2 - 1) / 12 / first.size)
    assert abs(second.mean() - 25.0) < 3 * np.sqrt((11**2 - 1) / 12 / second.size)
    np.testing.assert_allclose(dist.expected(20), [5.5] * 10 + [25.0] * 10)
    odd = dist.sample(0, 5, seed=0)
    assert np.all(odd[:2] <= 10) and np.all(odd[2:] >= 20)


def test_local_steps_for_int_and_array():
    np.testing.assert_array_equal(local_steps_for(5, 3, 4, seed=0), [5, 5, 5, 5])
    out = local_steps_for([1, 2, 3], 0, 3, seed=0)
    assert out.dtype == np.int64 and out.tolist() == [1, 2, 3]
    assert local_steps_for(np.array([2.0, 4.0]), 0, 2, 0).tolist() == [2, 4]
    assert local_steps_for(torch.tensor([3, 1]), 0, 2, 0).tolist() == [3, 1]
    assert check_local_steps(3) == 3
    per_client = UniformSteps([1, 10], [1, 12])
    draws = np.stack([per_client.sample(t, 2, 0) for t in range(200)])
    assert np.all(draws[:, 0] == 1) and draws[:, 1].min() == 10 and draws[:, 1].max() == 12


@pytest.mark.parametrize("make, match", [
    (lambda: UniformSteps(0, 3), r"local_steps low must be integers >= 1"),
    (lambda: UniformSteps(5, 3), r"local_steps high must be >= low"),
    (lambda: UniformSteps(1.5, 3), r"local_steps low must be integers >= 1"),
    (lambda: UniformSteps([1, 2], [3, 4, 5]), r"local_steps low and high have different lengths"),
    (lambda: UniformSteps([1, 2], [3, 4]).sample(0, 3, 0), r"local_steps bounds have 2 entries"),
    (lambda: local_steps_for(0, 0, 3, 0), r"local_steps must be an integer >= 1"),
    (lambda: local_steps_for(2.5, 0, 3, 0), r"local_steps must be integers >= 1"),
    (lambda: local_steps_for([1, 0, 2], 0, 3, 0), r"local_steps must be integers >= 1"),
    (lambda: local_steps_for([1, 2], 0, 3, 0), r"local_steps has 2 entries but num_clients is 3"),
    (lambda: local_steps_for(True, 0, 3, 0), r"local_steps must be an integer >= 1"),
    (lambda: local_steps_for("3", 0, 3, 0), r"local_steps must be an integer >= 1"),
    (lambda: TwoGroupSteps(first=(0, 3)), r"local_steps low must be integers >= 1"),
])
def test_local_steps_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- latency
def test_shifted_exponential_moments_and_shift():
    model = ShiftedExponential(shift=0.5, mean=1.0, speed_factors=(1.0,), group_fractions=(1.0,))
    model.setup(1000, seed=0)
    everyone = np.ones(1000, dtype=bool)
    times = np.stack([model.sample(t, everyone, 3) for t in range(20)])  # 20,000 draws
    assert times.min() >= 3 * 0.5
    per_step = times / 3 - 0.5  # Exp(1)
    n = per_step.size
    assert abs(per_step.mean() - 1.0) < 3 / np.sqrt(n)
    assert abs(per_step.std() - 1.0) < 0.05
    np.testing.assert_allclose(model.expected(3), 4.5)
    # the "sum" variant: same mean, variance K * mean^2 instead of K^2 * mean^2
    summed = ShiftedExponential(shift=0.5, mean=1.0, speed_factors=(1.0,), group_fractions=(1.0,), steps="sum")
    summed.setup(1000, seed=0)
    times = np.stack([summed.sample(t, everyone, 3) for t in range(20)])
    assert times.min() >= 1.5
    assert abs(times.mean() - 4.5) < 3 * np.sqrt(3 / n)
    assert abs(times.var() - 3.0) < 0.2


def test_shifted_exponential_fedast_groups_masks_and_purity():
    model = ShiftedExponential.fedast("mnist")
    assert (model.shift, model.mean) == (0.074, 0.148)
    model.setup(1000, seed=3)
    assert np.bincount(model.group).tolist() == [250, 500, 250]
    np.testing.assert_allclose(np.sort(np.unique(model.speed)), [0.7, 1.0, 1.3])
    normal = model.group == 1
    np.testing.assert_allclose(model.expected(27)[normal], 5.994)  # fedast.md §1.3 example
    mask = np.arange(1000) % 2 == 0
    steps = np.where(mask, 27, 0)
    out = model.sample(4, torch.from_numpy(mask), steps)
    assert out.dtype == np.float64 and np.all(out[~mask] == 0.0)
    assert np.all(out[mask] >= 27 * 0.074 * model.speed[mask] - 1e-12)
    np.testing.assert_array_equal(out, model.sample(4, mask, steps))
    # a client's draw does not depend on who else got a request
    np.testing.assert_array_equal(model.sample(4, np.ones(1000, dtype=bool), 27)[mask], out[mask])
    assert not np.array_equal(model.sample(5, mask, steps), out)
    # slow clients are slower on average
    many = np.stack([model.sample(t, np.ones(1000, dtype=bool), 1) for t in range(20)])
    by_group = [many[:, model.group == g].mean() for g in range(3)]
    np.testing.assert_allclose(by_group, np.array([1.3, 1.0, 0.7]) * 0.222, rtol=0.05)


@pytest.mark.parametrize("make, match", [
    (lambda: ShiftedExponential(mean=0.0), r"mean must lie in \(0, inf\)"),
    (lambda: ShiftedExponential(shift=-1.0), r"shift must lie in \[0, inf\)"),
    (lambda: ShiftedExponential(group_fractions=(0.5, 0.2, 0.2)), r"group_fractions must sum to 1"),
    (lambda: ShiftedExponential(speed_factors=(1.0, 0.0, 2.0)), r"speed_factors must lie in \(0, inf\)"),
    (lambda: ShiftedExponential(speed_factors=(1.0, 2.0)), r"same length"),
    (lambda: ShiftedExponential(steps="max"), r"steps must be"),
    (lambda: ShiftedExponential.fedast("imagenet"), r"task must be one of"),
    (lambda: _setup_latency().sample(0, np.ones(4, dtype=bool), 0), r"local_steps must be integers >= 1, got 0.0"),
    (lambda: _setup_latency().sample(0, np.ones(4, dtype=bool), [1, 2]), r"local_steps must be an int or"),
    (lambda: VirtualClock(deadline=0.0), r"deadline must lie in \(0, inf\)"),
    (lambda: VirtualClock().advance([1.0, -2.0]), r"times must be finite and >= 0"),
])
def test_latency_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _setup_latency() -> ShiftedExponential:
    model = ShiftedExponential()
    model.setup(4, seed=0)
    return model


# ----------------------------------------------------------------------------- clock
def test_virtual_clock_durations_deadline_and_state():
    clock = VirtualClock()
    times = np.array([1.0, 4.0, 2.5, 9.0])
    mask = np.array([True, True, True, False])
    assert clock.advance(times, mask) == 4.0
    assert clock.advance(torch.tensor(times), deadline=3.0) == 3.0
    np.testing.assert_array_equal(clock.on_time(times, deadline=3.0), [True, False, True, False])
    assert clock.advance(times, np.zeros(4, dtype=bool)) == 0.0  # empty round
    assert clock.time == 7.0 and clock.rounds == 3
    state = clock.state_dict()
    resumed = VirtualClock()
    resumed.load_state_dict(state)
    assert resumed.time == 7.0 and resumed.rounds == 3
    with_deadline = VirtualClock(deadline=2.0)
    assert with_deadline.round_duration(times, mask) == 2.0
    assert with_deadline.round_duration([0.5, 1.5]) == 1.5
    np.testing.assert_array_equal(with_deadline.on_time(times, mask), [True, False, False, False])
    assert with_deadline.time == 0.0  # round_duration does not advance the clock


def test_per_round_loss_draws_follow_uniform_loss_and_reach_the_oracle():
    from lightning_fedhet.system import LossyChannel, UniformLoss

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
