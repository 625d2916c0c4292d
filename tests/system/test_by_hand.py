"""System models checked where the mutation run found them unchecked: the virtual clock's checkpoint carries its
deadline, FedAST's latency settings, the two-group step sampler's draws and errors, and the reprs."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.seeding import STATIC_KEY, StaticKey, Stream
from lightning_fedhet.system import LossyChannel, ShiftedExponential, TwoGroupSteps, UniformSteps, VirtualClock


def test_the_clock_checkpoint_carries_the_deadline():
    clock = VirtualClock(deadline=30.0)
    clock.time, clock.rounds = 12.5, 3
    state = clock.state_dict()
    assert state == {"time": 12.5, "rounds": 3, "deadline": 30.0}
    other = VirtualClock()
    other.load_state_dict(state)
    assert (other.time, other.rounds, other.deadline) == (12.5, 3, 30.0)
    older = VirtualClock(deadline=5.0)  # a checkpoint written before the deadline was saved keeps the clock's own
    older.load_state_dict({"time": 1.0, "rounds": 1})
    assert older.deadline == 5.0
    none = VirtualClock(deadline=5.0)  # a saved "no deadline" is restored as such
    none.load_state_dict({"time": 0.0, "rounds": 0, "deadline": None})
    assert none.deadline is None


def test_fedast_latency_settings_by_hand():
    # shift = c / 2, mean = c with c the task's seconds per step (MNIST: 0.148)
    mnist = ShiftedExponential.fedast()
    assert (mnist.shift, mnist.mean) == pytest.approx((0.074, 0.148))
    cifar = ShiftedExponential.fedast("cifar10", speed_factors=(1.0,), group_fractions=(1.0,))
    assert (cifar.shift, cifar.mean) == pytest.approx((0.114, 0.228))
    assert cifar.speed_factors.tolist() == [1.0] and cifar.group_fractions.tolist() == [1.0]
    with pytest.raises(ValueError, match=r"^task must be one of"):
        ShiftedExponential.fedast("MNIST")


def test_two_group_steps_draw_each_half_from_its_range():
    steps = TwoGroupSteps(first=(1, 2), second=(7, 7))
    drawn = np.stack([steps.sample(t, 5, seed=0) for t in range(50)])
    assert drawn.dtype == np.int64
    assert set(drawn[:, :2].ravel().tolist()) == {1, 2}  # clients 0 .. N//2 - 1
    assert set(drawn[:, 2:].ravel().tolist()) == {7}
    with pytest.raises(ValueError, match=r"^num_clients must be"):
        steps.sample(0, 0, seed=0)
    assert repr(steps) == "TwoGroupSteps(first=(1, 2), second=(7, 7))"


def test_reprs():
    assert repr(UniformSteps(1, 5)) == "UniformSteps(low=1, high=5)"
    assert repr(UniformSteps([1, 2, 3], [4, 5, 6])) == (
        "UniformSteps(low=<3 per-client values>, high=<3 per-client values>)")
    assert repr(LossyChannel(uplink=[0.1, 0.2])) == "LossyChannel(uplink=<2 per-client values>, downlink=0)"
    assert repr(LossyChannel(uplink=0.1, downlink=0.2)) == "LossyChannel(uplink=0.1, downlink=0.2)"


def _one_group(steps: str) -> ShiftedExponential:
    latency = ShiftedExponential(shift=0.5, mean=1.0, speed_factors=(2.0,), group_fractions=(1.0,), steps=steps)
    latency.setup(3, seed=0)
    return latency


def test_on_time_probabilities_by_hand_in_both_step_models():
    # speed s = 2, shift 0.5, mean 1, deadline D = 5
    total = _one_group("sum")  # T = s (K shift + G), G ~ Gamma(K, mean): P = P(K, (D/s - K shift) / mean)
    k1 = 1 - np.exp(-(5 / 2 - 0.5))  # K = 1: an exponential
    k2 = 1 - np.exp(-1.5) * (1 + 1.5)  # K = 2: (D/s - 2 shift) = 1.5, P(2, x) = 1 - e^-x (1 + x)
    np.testing.assert_allclose(total.on_time_probs(5.0), [k1] * 3, rtol=1e-12)  # one local step by default
    np.testing.assert_allclose(total.on_time_probs(5.0, local_steps=2), [k2] * 3, rtol=1e-12)
    np.testing.assert_allclose(total.on_time_probs(0.5, local_steps=2), [0.0] * 3)  # D/s below K shift: never
    scaled = _one_group("scale")  # T = K s (shift + E): P = 1 - exp(-(D/(K s) - shift) / mean)
    np.testing.assert_allclose(scaled.on_time_probs(5.0, local_steps=2), [1 - np.exp(-0.75)] * 3, rtol=1e-12)
    np.testing.assert_allclose(scaled.on_time_probs(1.0, local_steps=2), [0.0] * 3)  # D/(K s) below shift: never
    # a mean of 2 (the slack is divided by the mean, not multiplied): 1 - exp(-(5/4 - 0.5) / 2)
    slower = ShiftedExponential(shift=0.5, mean=2.0, speed_factors=(2.0,), group_fractions=(1.0,), steps="scale")
    slower.setup(3, seed=0)
    np.testing.assert_allclose(slower.on_time_probs(5.0, local_steps=2), [1 - np.exp(-0.375)] * 3, rtol=1e-12)
    with pytest.raises(ValueError, match=r"^deadline must"):
        total.on_time_probs(0.0)


def test_on_time_probabilities_and_means_match_the_sampled_times():
    # the closed forms against the sampler itself: 4000 rounds x 3 clients, K = 2 local steps
    for steps in ("sum", "scale"):
        latency = _one_group(steps)
        times = np.stack([latency.sample(t, np.ones(3, dtype=bool), local_steps=2) for t in range(4000)])
        p = latency.on_time_probs(5.0, local_steps=2)[0]
        # binomial standard error sqrt(p (1 - p) / 12000) < 0.0046: 4 of them
        assert abs(np.mean(times <= 5.0) - p) < 0.019, steps
        # E[T] = K s (shift + mean) = 2 * 2 * 1.5 = 6
        np.testing.assert_allclose(latency.expected(local_steps=2), [6.0] * 3)
        assert abs(times.mean() - 6.0) < 0.15, steps  # sd of T <= 2 * 2 * sqrt(2) here, / sqrt(12000) ~ 0.05
    assert _one_group("sum").expected().tolist() == [3.0] * 3  # one local step by default


def test_speed_groups_are_drawn_from_their_documented_static_stream():
    # the counter-based seeding written out (Philox keyed by seed, the latency stream, the static key and the
    # groups' sub-key): groups drawn from another key would be correlated with one round's latencies and change
    # every published result for the same seed
    latency = ShiftedExponential(shift=0.5, mean=1.0, speed_factors=(1.0, 3.0), group_fractions=(0.3, 0.7))
    latency.setup(10, seed=5)
    perm = np.random.Generator(np.random.Philox(np.random.SeedSequence(
        [5, int(Stream.LATENCY), STATIC_KEY, int(StaticKey.LATENCY_GROUPS)]))).permutation(10)
    expected = np.empty(10, dtype=np.int64)
    expected[perm] = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]  # 30 % in the first group, 70 % in the second
    assert latency.group.tolist() == expected.tolist()
    assert latency.speed.tolist() == [1.0 if g == 0 else 3.0 for g in expected]
