"""Latency (FedAST's shifted exponential with speed groups) and the virtual clock."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.system import ShiftedExponential, VirtualClock

N = 50


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
    np.testing.assert_allclose(model.expected(27)[normal], 5.994)  # FedAST App. C.6: 27 steps x (0.074 + 0.148)
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
