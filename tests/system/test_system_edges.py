"""Edges of the system models that the mutation run of the ``system`` chunk found unchecked: the setup hint, one-client
channels, per-round loss draws on either link, default arguments, full error texts, the clock at its deadline,
the sum model's scale, and the independence of the random streams. Every expected number is worked out by hand in
the comment next to it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fedhet.seeding import Stream, generator
from lightning_fedhet.system import (
    LossDistribution,
    LossyChannel,
    ShiftedExponential,
    StepDistribution,
    UniformLoss,
    UniformSteps,
    VirtualClock,
    check_local_steps,
    local_steps_for,
)


class _LossOnOddRounds(LossDistribution):
    """Loss probability 0 in even rounds and 0.75 in odd rounds, for every client."""

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        return np.full(num_clients, 0.75 if round % 2 else 0.0)


class _ZeroSteps(StepDistribution):
    """A faulty user distribution: zero local steps."""

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        return np.zeros(num_clients, dtype=np.int64)


def _one_group(shift: float = 0.5, mean: float = 1.0, speed: float = 1.0, steps: str = "scale") -> ShiftedExponential:
    return ShiftedExponential(shift=shift, mean=mean, speed_factors=(speed,), group_fractions=(1.0,), steps=steps)


# ----------------------------------------------------------------------------- setup and its hint
def test_using_the_models_before_setup_raises_the_setup_hint():
    # catches the "call setup first" text changed, and num_clients starting at None (a TypeError) or at 1 (no error)
    with pytest.raises(RuntimeError) as err:
        _ = LossyChannel().success_probs
    assert str(err.value) == "LossyChannel.setup(num_clients, seed) must be called first"
    with pytest.raises(RuntimeError) as err:
        ShiftedExponential().sample(0, np.ones(1, dtype=bool))
    assert str(err.value) == "ShiftedExponential.setup(num_clients, seed) must be called first"


def test_a_channel_of_one_client_works():
    # catches the setup guard moved from num_clients < 1 to <= 1 or < 2: one client is a valid federation
    channel = LossyChannel(uplink=0.2, downlink=0.5)
    channel.setup(1, seed=0)
    # success = (1 - q_down)(1 - q_up) = 0.5 * 0.8 = 0.4
    assert channel.success_probs.tolist() == pytest.approx([0.4], rel=1e-15)
    lossless = LossyChannel()
    lossless.setup(1)
    assert lossless.downlink(0, [True]).tolist() == [True]  # U >= 0 always holds


def test_channel_setup_seeds_with_zero_by_default():
    # catches setup's default seed changed from 0: the draws must equal those of seed=0 (and differ from seed=1,
    # which checks that this test can tell the two apart: 64 clients at q = 0.5 over 4 rounds)
    def arrivals(seed: int | None) -> list[list[bool]]:
        channel = LossyChannel(uplink=0.5, downlink=0.5)
        channel.setup(64) if seed is None else channel.setup(64, seed=seed)
        everyone = np.ones(64, dtype=bool)
        return [channel.downlink(t, everyone).tolist() + channel.uplink(t, everyone).tolist() for t in range(4)]

    assert arrivals(None) == arrivals(0)
    assert arrivals(None) != arrivals(1)


def test_a_wrong_uplink_length_is_named_at_setup():
    # catches the name "uplink" dropped or changed in setup's resolution of a fixed uplink loss
    with pytest.raises(ValueError) as err:
        LossyChannel(uplink=[0.1, 0.2]).setup(3)
    assert str(err.value) == ("uplink has 2 entries but num_clients is 3; give a scalar or exactly one value per "
                              "client")


def test_uplink_names_a_trained_mask_of_the_wrong_shape():
    # catches the mask name "trained" dropped or changed in uplink()
    channel = LossyChannel(uplink=0.1)
    channel.setup(4, seed=0)
    with pytest.raises(ValueError) as err:
        channel.uplink(0, np.ones(3, dtype=bool))
    assert str(err.value) == "trained must have shape (4,), got (3,)"


# ----------------------------------------------------------------------------- per-round loss draws
@pytest.mark.parametrize("link", ["downlink", "uplink"])
def test_per_round_losses_on_either_link_follow_their_round(link):
    # q = 0 in even rounds, 0.75 in odd rounds. Catches: a distribution on the downlink refused (the isinstance test
    # short-circuited), a dynamic link using the round-0 probabilities every round, the round or the spec dropped,
    # and setup's or loss_probs_at's round changed (None, 1)
    channel = LossyChannel(**{link: _LossOnOddRounds()})
    n = 400
    channel.setup(n, seed=3)
    everyone = np.ones(n, dtype=bool)
    send = getattr(channel, link)
    assert send(0, everyone).all() and send(2, everyone).all()  # q = 0: every U >= 0 passes
    # round 1: P(pass) = 1 - 0.75 = 0.25; binomial sd sqrt(0.25 * 0.75 / 400) = 0.0217, so 0.1 is 4.6 sd
    assert abs(send(1, everyone).double().mean().item() - 0.25) < 0.1
    q_up, q_down = channel.loss_probs_at(1)
    dynamic, fixed = (q_down, q_up) if link == "downlink" else (q_up, q_down)
    assert dynamic.tolist() == [0.75] * n and fixed.tolist() == [0.0] * n
    assert channel.success_probs_at(1).tolist() == [0.25] * n  # (1 - 0.75)(1 - 0)
    # the fixed attributes are round 0's: q = 0, so every success probability is exactly 1
    assert channel.success_probs.tolist() == [1.0] * n
    assert channel.uplink_success.tolist() == channel.downlink_success.tolist() == [1.0] * n


def test_a_channel_of_seeded_per_round_losses_keeps_round_zeros_draw_as_its_fixed_probabilities():
    # success_probs & co. are documented as round 0's for a per-round channel: setup must draw them with the
    # channel's own seed, as loss_probs_at(0) does (slip: setup drawing one link without the seed)
    channel = LossyChannel(uplink=UniformLoss(0.1, 0.5), downlink=UniformLoss(0.2, 0.6))
    channel.setup(6, seed=3)
    q_up, q_down = channel.loss_probs_at(0)
    assert len(set(q_up.tolist())) == len(set(q_down.tolist())) == 6  # drawn per client
    assert channel.uplink_success.tolist() == (1.0 - q_up).tolist()
    assert channel.downlink_success.tolist() == (1.0 - q_down).tolist()
    assert channel.success_probs.tolist() == channel.success_probs_at(0).tolist()
    other = LossyChannel(uplink=UniformLoss(0.1, 0.5), downlink=UniformLoss(0.2, 0.6))
    other.setup(6, seed=4)
    assert other.loss_probs_at(0)[1].tolist() != q_down.tolist()  # the draw depends on the seed


def test_success_probability_at_a_round_multiplies_both_links():
    # catches (1 - q_down) turned into (1 + q_down): q_down = 0.5, q_up = 0.2 give 0.5 * 0.8 = 0.4, not 1.2
    channel = LossyChannel(uplink=0.2, downlink=[0.5, 0.0])
    channel.setup(2, seed=0)
    success = channel.success_probs_at(0)
    assert success.dtype == torch.float64
    assert success.tolist() == pytest.approx([0.4, 0.8], rel=1e-15)  # 0.5 * 0.8, 1.0 * 0.8


def test_repr_of_a_channel_with_per_round_losses():
    # catches the distribution's repr replaced by repr(None)
    channel = LossyChannel(uplink=UniformLoss(0.1, 0.3))
    assert repr(channel) == "LossyChannel(uplink=UniformLoss(low=array(0.1), high=array(0.3)), downlink=0)"


@pytest.mark.parametrize("low, high, message", [
    # low must stay below 1 (high_open dropped or False would accept 1.0 and then complain about low > high)
    (1.0, 0.5, "low must lie in [0, 1), got 1.0"),
    (0.0, 1.0, "high must lie in [0, 1), got 1.0"),
    # two per-client bounds of different lengths (the == 1 test of ndim changed would skip this)
    ([0.1, 0.2], [0.3, 0.4, 0.5], "low and high have different lengths (2 and 3)"),
    (0.5, 0.2, "low must be <= high, got low=0.5, high=0.2"),
])
def test_uniform_loss_refuses_bad_bounds_by_name(low, high, message):
    with pytest.raises(ValueError) as err:
        UniformLoss(low, high)
    assert str(err.value) == message


def test_uniform_loss_accepts_equal_bounds_and_per_client_bounds_of_one_length():
    # catches low <= high turned into low < high (equal bounds: q = low exactly, as U[a, a) = a + 0 * U)
    # and the length test turned into shape == shape (two per-client bounds of the same length refused)
    assert UniformLoss(0.2, 0.2).sample(0, 3, seed=0).tolist() == [0.2, 0.2, 0.2]
    q = np.stack([UniformLoss([0.1, 0.6], [0.2, 0.9]).sample(t, 2, seed=0) for t in range(20)])
    assert np.all((q[:, 0] >= 0.1) & (q[:, 0] < 0.2)) and np.all((q[:, 1] >= 0.6) & (q[:, 1] < 0.9))


@pytest.mark.parametrize("low, high, message", [
    ([0.1, 0.2], 0.3, "low has 2 entries but num_clients is 3; give a scalar or exactly one value per client"),
    (0.1, [0.2, 0.3], "high has 2 entries but num_clients is 3; give a scalar or exactly one value per client"),
])
def test_uniform_loss_names_a_bound_of_the_wrong_length(low, high, message):
    # catches the names "low" / "high" dropped or changed in sample()
    with pytest.raises(ValueError) as err:
        UniformLoss(low, high).sample(0, 3, seed=0)
    assert str(err.value) == message


def test_uniform_loss_draws_depend_on_the_seed():
    # catches the seed dropped from the loss-rate generator (every seed would then give the same rates)
    loss = UniformLoss(0.0, 0.99)
    assert not np.array_equal(loss.sample(0, 50, seed=0), loss.sample(0, 50, seed=1))


def test_loss_rates_and_local_steps_are_independent_of_the_link_draws():
    # Each kind of draw has its own stream. A stream key dropped gives generator(seed, round), which numpy pads to
    # (seed, round, 0): in round 3 that is the downlink's round-0 stream, in round 4 the uplink's. Loss rates
    # U[0, 0.99) and steps U{1 .. 2**40} are then increasing functions of the very uniforms the links compare with
    # q, correlated ~0.87 with the arrivals. Independent, the sample correlation over N = 2000 clients has sd
    # 1/sqrt(N) = 0.022; 0.112 is 5 sd (a false alarm about 6e-7 per pair, 72 pairs, and the seed is fixed).
    n, seed, rounds = 2000, 0, range(6)
    channel = LossyChannel(uplink=0.5, downlink=0.5)
    channel.setup(n, seed=seed)
    everyone = np.ones(n, dtype=bool)
    arrivals = [channel.downlink(t, everyone).double().numpy() for t in rounds]
    arrivals += [channel.uplink(t, everyone).double().numpy() for t in rounds]
    loss, steps = UniformLoss(0.0, 0.99), UniformSteps(1, 2**40)
    for r in rounds:
        for draw in (loss.sample(r, n, seed), local_steps_for(steps, r, n, seed).astype(np.float64)):
            for arrived in arrivals:
                assert abs(np.corrcoef(draw, arrived)[0, 1]) < 0.112


# ----------------------------------------------------------------------------- latency
def test_latency_defaults_are_the_documented_ones():
    # catches the defaults shift = 0.5 and mean = 1 changed: E[T] = K s (shift + mean) = 1 * 1 * (0.5 + 1) = 1.5
    model = ShiftedExponential(speed_factors=(1.0,), group_fractions=(1.0,))
    assert (model.shift, model.mean) == (0.5, 1.0)
    model.setup(3)
    assert model.expected().tolist() == [1.5, 1.5, 1.5]


def test_latency_draws_come_from_the_documented_stream():
    # The module promises round t's exponentials come from generator(seed, Stream.LATENCY, t); with one speed
    # group s = 2, K = 3: T = K s (shift + E) = 6 (0.5 + E), E ~ Exp(mean 2). Catches the seed or the stream key
    # dropped from that generator, setup's default seed changed from 0, and sample's default of one local step.
    model = _one_group(shift=0.5, mean=2.0, speed=2.0)
    model.setup(5)  # seed 0 by default
    everyone = np.ones(5, dtype=bool)
    for t in range(3):
        draws = generator(0, Stream.LATENCY, t).exponential(2.0, 5)
        np.testing.assert_allclose(model.sample(t, everyone, 3), 6 * (0.5 + draws), rtol=1e-14)
        np.testing.assert_allclose(model.sample(t, everyone), 2 * (0.5 + draws), rtol=1e-14)  # K = 1 by default
    other = _one_group(shift=0.5, mean=2.0, speed=2.0)
    other.setup(5, seed=1)
    assert not np.array_equal(other.sample(0, everyone), model.sample(0, everyone))


def test_speed_groups_are_a_seeded_permutation_of_the_fraction_sizes():
    # 40 clients at (0.25, 0.5, 0.25): group sizes round(40 * cumsum) = 10, 20, 10. Catches the permutation dropped
    # (clients in sorted group order: probability 10! 20! 10! / 40! ~ 1e-17 by chance) and the seed dropped from
    # its generator (every seed the same groups), and setup's default seed changed from 0
    def groups(seed: int | None) -> np.ndarray:
        model = ShiftedExponential()
        model.setup(40) if seed is None else model.setup(40, seed=seed)
        assert model.speed.tolist() == [(1.3, 1.0, 0.7)[g] for g in model.group]
        return model.group

    default = groups(None)
    assert default.dtype == np.int64 and np.bincount(default).tolist() == [10, 20, 10]
    assert not np.array_equal(default, np.sort(default))
    np.testing.assert_array_equal(default, groups(0))
    assert not np.array_equal(default, groups(1))


def test_summed_steps_scale_the_gamma_by_the_mean():
    # T = s (K shift + G), G ~ Gamma(K, mean): with s = 1, K = 2, shift 0.5, mean 3, E[T] = 1 + 6 = 7 (the gamma's
    # scale dropped gives 1 + 2 = 3). sd(T) = sqrt(K) mean = 4.24, over 4000 draws se = 0.067; 0.35 is 5 se
    model = _one_group(shift=0.5, mean=3.0, steps="sum")
    model.setup(1000, seed=0)
    everyone = np.ones(1000, dtype=bool)
    times = np.concatenate([model.sample(t, everyone, 2) for t in range(4)])
    assert abs(times.mean() - 7.0) < 0.35


def test_summed_steps_on_time_probability_with_a_small_slack():
    # s = 1, shift 0.5, mean 2, K = 2, D = 1.5: slack = D/s - K shift = 0.5, x = slack / mean = 0.25 and
    # P(2, x) = 1 - e^-x (1 + x). Catches x = slack * mean, max(slack, 1) instead of max(slack, 0), slack > 1
    model = _one_group(shift=0.5, mean=2.0, steps="sum")
    model.setup(2, seed=0)
    expected = 1 - math.exp(-0.25) * 1.25
    np.testing.assert_allclose(model.on_time_probs(1.5, local_steps=2), [expected] * 2, rtol=1e-12)


def test_latency_with_a_step_distribution():
    # expected: T is linear in K, so the mean time is K's mean times s (shift + mean): UniformSteps(1, 9) has
    # E[K] = 5, so 5 * 1 * 1.5 = 7.5 for every client (slip, a real bug until 2026-11: the round-0 draw of K read
    # as if it were its mean gave [13.5, 7.5, 13.5, 9.0]). The on-time probability is conditional on K: a
    # distribution is refused with the reason instead of answering for one draw.
    model = _one_group()
    model.setup(4, seed=0)
    assert model.expected(UniformSteps(1, 9)).tolist() == [7.5] * 4
    assert model.expected(UniformSteps(3, 3)).tolist() == [4.5] * 4
    with pytest.raises(ValueError) as err:
        model.on_time_probs(6.0, UniformSteps(3, 3))
    assert str(err.value) == (
        "local_steps must be an int or one int per client, got UniformSteps(low=3, high=3): the on-time probability "
        "is conditional on K; pass the round's draw (local_steps_for(distribution, round, N, seed))"
    )
    # at a given K = 3 and D = 6 ("scale"): 1 - exp(-(D / (K s) - shift) / mean) = 1 - exp(-1.5)
    np.testing.assert_allclose(model.on_time_probs(6.0, 3), [1 - math.exp(-1.5)] * 4, rtol=1e-12)


def test_latency_names_a_mask_of_the_wrong_shape():
    # catches the name "clients_mask" dropped or changed in sample()
    model = _one_group()
    model.setup(4, seed=0)
    with pytest.raises(ValueError) as err:
        model.sample(0, np.ones(3, dtype=bool))
    assert str(err.value) == "clients_mask must have shape (4,), got (3,)"


def test_group_fractions_above_one_are_refused_by_range():
    # catches the upper bound 1 of group_fractions raised to 2 (then only the sum check would complain)
    with pytest.raises(ValueError) as err:
        ShiftedExponential(speed_factors=(1.0,), group_fractions=(1.5,))
    assert str(err.value) == "group_fractions must lie in [0, 1], got 1.5"


# ----------------------------------------------------------------------------- the clock
def test_clock_error_texts():
    # catches the texts of the 1-D check (or its shape), the mask's name and the finiteness check changed
    clock = VirtualClock()
    with pytest.raises(ValueError) as err:
        clock.round_duration([[1.0, 2.0]])
    assert str(err.value) == "times must be a 1-D per-client array, got shape (1, 2)"
    with pytest.raises(ValueError) as err:
        clock.on_time([1.0, 2.0, 3.0], [True, False])
    assert str(err.value) == "mask must have shape (3,), got (2,)"
    with pytest.raises(ValueError) as err:
        clock.advance([1.0, math.inf])
    assert str(err.value) == "times must be finite and >= 0 for the clients in mask"


def test_clock_on_time_at_the_deadline_and_without_one():
    # a time equal to the deadline is on time (round_duration is min(max, deadline), so that client counted);
    # catches <= turned into <. Without a deadline on_time is the mask itself; catches the mask dropped and the
    # no-deadline branch skipped (a comparison with None)
    clock = VirtualClock()
    assert clock.on_time([1.0, 3.0], deadline=3.0).tolist() == [True, True]
    assert clock.on_time([1.0, 9.0, 2.0], [True, False, True]).tolist() == [True, False, True]


# ----------------------------------------------------------------------------- local steps
def test_local_steps_up_to_two_to_the_53():
    # 2**53 is the largest accepted count (exact in float64); catches > turned into >= and the message dropped
    assert check_local_steps(2**53) == 2**53
    with pytest.raises(ValueError) as err:
        check_local_steps(2**53 + 1)
    assert str(err.value) == "local_steps must be an integer <= 2**53, got 9007199254740993"


def test_a_user_step_distribution_output_is_checked_by_name():
    # catches the name "local_steps" dropped or changed when a StepDistribution's draw is validated
    with pytest.raises(ValueError) as err:
        local_steps_for(_ZeroSteps(), 0, 3, seed=0)
    assert str(err.value) == "local_steps must be integers >= 1, got 0.0"


def test_uniform_steps_name_a_bad_client_count():
    # catches the name "num_clients" dropped or changed in UniformSteps' bounds
    with pytest.raises(ValueError) as err:
        UniformSteps(1, 3).sample(0, 0, seed=0)
    assert str(err.value) == "num_clients must be an integer >= 1, got 0"


def test_tensors_that_require_grad_are_read_detached():
    # catches the tensor branch skipped or its attribute misspelt: numpy refuses a tensor that requires grad, so
    # only the detach() path reads it. The clock: max(1, 2) = 2. Latency with one group s = 1, shift 0, mean 1:
    # T = K (0 + E), so the K = 2 and K = 3 clients' times over their K are the same Exp(1) draws as with int steps
    clock = VirtualClock()
    assert clock.advance(torch.tensor([1.0, 2.0], requires_grad=True)) == 2.0
    assert clock.on_time(torch.tensor([1.0, 2.0], requires_grad=True), deadline=1.5).tolist() == [True, False]
    model = _one_group(shift=0.0)
    model.setup(2, seed=0)
    everyone = np.ones(2, dtype=bool)
    times = model.sample(0, everyone, torch.tensor([2.0, 3.0], requires_grad=True))
    np.testing.assert_allclose(times / [2.0, 3.0], model.sample(0, everyone, 1), rtol=1e-14)


def test_a_refused_setup_leaves_the_models_as_they_were():
    # every argument is checked before anything is assigned: a refused setup after a good one keeps the good one,
    # and one on a fresh object leaves it not set up (slip: the size assigned before the seed or the losses are
    # checked, so that later draws mix two sizes)
    channel = LossyChannel(uplink=[0.1, 0.2, 0.3], downlink=0.5)
    channel.setup(3, seed=1)
    with pytest.raises(ValueError):
        channel.setup(4, seed=1)  # three uplink losses for four clients
    with pytest.raises(ValueError):
        channel.setup(3, seed=-1)
    assert (channel.num_clients, channel.seed) == (3, 1)
    assert channel.q_up.tolist() == [0.1, 0.2, 0.3] and channel.q_down.tolist() == [0.5] * 3
    fresh = LossyChannel(uplink=[0.1, 0.2])
    with pytest.raises(ValueError):
        fresh.setup(3)
    with pytest.raises(RuntimeError, match=r"^LossyChannel.setup\(num_clients, seed\) must be called first$"):
        fresh.uplink(0, [True, True, True])
    latency = _one_group()
    latency.setup(2, seed=3)
    with pytest.raises(ValueError):
        latency.setup(5, seed=-1)
    assert (latency.num_clients, latency.seed, latency.group.tolist()) == (2, 3, [0, 0])
    assert latency.sample(0, [True, True]).shape == (2,)
    unset = _one_group()
    with pytest.raises(ValueError):
        unset.setup(4, seed=-1)
    with pytest.raises(RuntimeError, match=r"^ShiftedExponential.setup\(num_clients, seed\) must be called first$"):
        unset.sample(0, [True] * 4)


def test_group_fractions_must_sum_to_one_within_1e9():
    # the documented tolerance, at its edge (slip: numpy's isclose, whose default rtol of 1e-5 widened it 10,000x)
    ShiftedExponential(speed_factors=(1.0, 2.0), group_fractions=(0.5, 0.5 + 5e-10))
    ShiftedExponential(speed_factors=(1.0, 2.0, 3.0), group_fractions=(0.1, 0.2, 0.7))  # 0.9999999999999999
    with pytest.raises(ValueError) as err:
        ShiftedExponential(speed_factors=(1.0, 2.0), group_fractions=(0.5, 0.5 + 2e-9))
    assert str(err.value) == "group_fractions must sum to 1 (within 1e-9), got 1.000000002"
    with pytest.raises(ValueError, match=r"^group_fractions must sum to 1 \(within 1e-9\), got 0\.99999$"):
        ShiftedExponential(speed_factors=(1.0, 2.0), group_fractions=(0.5, 0.49999))
