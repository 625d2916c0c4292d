"""Property: any argument to a channel, a step distribution or a latency model builds a working object or raises
ValueError/TypeError naming the parameter; the same for ``setup(num_clients, seed)``, where lengths are checked.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_fedhet.system import (
    LossyChannel,
    ShiftedExponential,
    TwoGroupSteps,
    UniformLoss,
    UniformSteps,
    VirtualClock,
    local_steps_for,
)
from tests.property_inputs import PROPERTY, arg, as_count, build, counts, ints, junk, probs, seeds

loss_probs = probs(0.0, 0.999)


@PROPERTY
@given(low=arg(loss_probs), high=arg(loss_probs), num_clients=counts, seed=seeds)
def test_uniform_loss(low, high, num_clients, seed):
    dist = build(lambda: UniformLoss(low, high), "low", "high")
    if dist is None:
        return
    repr(dist)
    q = build(lambda: dist.sample(2, num_clients, seed), "low", "high", "num_clients", "seed")
    if q is not None:
        assert q.shape == (as_count(num_clients),) and np.all((q >= 0) & (q < 1))


@PROPERTY
@given(uplink=arg(st.one_of(loss_probs, st.builds(UniformLoss, st.just(0.1), st.just(0.3)))),
       downlink=arg(loss_probs), num_clients=counts, seed=seeds)
def test_lossy_channel(uplink, downlink, num_clients, seed):
    channel = build(lambda: LossyChannel(uplink=uplink, downlink=downlink), "uplink", "downlink")
    if channel is None:
        return
    repr(channel)
    if build(lambda: channel.setup(num_clients, seed) or True, "num_clients", "seed", "uplink", "downlink") is None:
        return
    n = channel.num_clients
    everyone = torch.ones(n, dtype=torch.bool)
    got = channel.downlink(3, everyone)
    arrived = channel.uplink(3, got)
    assert got.shape == arrived.shape == (n,) and not bool((arrived & ~got).any())
    # a pure function of (seed, round), whatever the other clients sent
    assert torch.equal(channel.downlink(3, everyone), got) and torch.equal(channel.uplink(3, got), arrived)
    assert torch.equal(channel.uplink(3, everyone) & got, arrived)
    success = channel.success_probs
    assert bool(((success > 0) & (success <= 1)).all())
    q_up, q_down = channel.loss_probs_at(0)
    torch.testing.assert_close(success, torch.as_tensor((1 - q_down) * (1 - q_up), dtype=torch.float64))


@PROPERTY
@given(low=arg(ints(1, 6)), high=arg(ints(1, 9)), num_clients=counts, seed=seeds)
def test_uniform_steps(low, high, num_clients, seed):
    dist = build(lambda: UniformSteps(low, high), "low", "high")
    if dist is None:
        return
    repr(dist)
    steps = build(lambda: local_steps_for(dist, 1, num_clients, seed), "local_steps", "num_clients", "seed")
    if steps is not None:
        assert steps.dtype == np.int64 and steps.shape == (as_count(num_clients),) and np.all(steps >= 1)
        assert np.all(np.isfinite(dist.expected(as_count(num_clients))))
        assert np.array_equal(local_steps_for(dist, 1, num_clients, seed), steps)  # determinism in the seed
        assert np.all((steps >= dist.low) & (steps <= dist.high))


pairs = st.tuples(ints(1, 5), ints(5, 9))


@PROPERTY
@given(first=arg(pairs), second=arg(pairs), num_clients=counts, seed=seeds)
def test_two_group_steps(first, second, num_clients, seed):
    dist = build(lambda: TwoGroupSteps(first, second), "first", "second")
    if dist is None:
        return
    repr(dist)
    steps = build(lambda: local_steps_for(dist, 1, num_clients, seed), "local_steps", "num_clients", "seed")
    if steps is not None:
        assert steps.shape == (as_count(num_clients),) and np.all(steps >= 1)


positive = st.floats(min_value=1e-3, max_value=10.0)


@PROPERTY
@given(shift=arg(st.floats(0.0, 10.0)), mean=arg(positive),
       speed_factors=arg(st.sampled_from([(1.3, 1.0, 0.7), (1.0,), [2.0, 0.5]])),
       group_fractions=arg(st.sampled_from([(0.25, 0.5, 0.25), (1.0,), [0.5, 0.5]])),
       steps=arg(st.sampled_from(["scale", "sum"])), num_clients=counts, seed=seeds)
def test_shifted_exponential(shift, mean, speed_factors, group_fractions, steps, num_clients, seed):
    latency = build(lambda: ShiftedExponential(shift, mean, speed_factors, group_fractions, steps),
                    "shift", "mean", "speed_factors", "group_fractions", "steps")
    if latency is None:
        return
    repr(latency)
    if build(lambda: latency.setup(num_clients, seed) or True, "num_clients", "seed") is None:
        return
    n = latency.num_clients
    times = latency.sample(2, np.ones(n, dtype=bool), 3)
    # shift/mean/speed factors near 1e308 overflow to inf latencies, which a deadline handles; never nan or < 0
    assert times.shape == (n,) and np.all(times >= 0)
    assert np.all(latency.expected(3) >= 0)


@PROPERTY
@given(deadline=st.one_of(st.none(), positive, junk), times=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=5))
def test_virtual_clock(deadline, times):
    clock = build(lambda: VirtualClock(deadline), "deadline")
    if clock is None:
        return
    repr(clock)
    duration = clock.advance(times)
    assert duration == (max(times) if clock.deadline is None else min(max(times), clock.deadline))
    assert clock.time == duration
