"""The round planner by hand, without a Trainer: its defaults, which seed each process gets, the strategy-level
selection, the arrival probabilities in closed form and the texts of its errors.

Written against the survivors of the ``federation`` mutation chunk (docs/testing.md); each test names the slip it
catches. Four clients hold two samples each; labels 0, 1, 1, 2, 2, 2, 0, 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlan, RoundPlanner, mask_ids
from lightning_fedhet.participation import Bernoulli, Full, LabelCorrelated, UniformSample
from lightning_fedhet.seeding import Stream, generator
from lightning_fedhet.system import LossDistribution, LossyChannel, ShiftedExponential, UniformSteps, local_steps_for

N = 4
LABELS = torch.tensor([0, 1, 1, 2, 2, 2, 0, 0])


def streams(with_labels: bool = True) -> ClientStreams:
    tensors = (torch.zeros(2 * N, 1), LABELS) if with_labels else (torch.zeros(2 * N, 1),)
    return ClientStreams(TensorDataset(*tensors), [[2 * i, 2 * i + 1] for i in range(N)], batch_size=2)


def planner(participation=None, algorithm=None, **kwargs) -> RoundPlanner:
    algorithm = algorithm or FedAvg()
    algorithm.setup(N, torch.zeros(1))
    return RoundPlanner(participation or Full(), algorithm, streams(), **kwargs)


class SelectsItself(FedAvg):
    selects_clients = True


def test_defaults_one_local_step_and_seed_zero():
    plan = planner().plan(0)
    assert plan.local_steps.tolist() == [1, 1, 1, 1]  # local_steps=1 by default
    # seed 0 by default: the availability draws of an unseeded planner are seed 0's
    unseeded, seeded = planner(Bernoulli(0.5)), planner(Bernoulli(0.5), seed=0)
    assert [unseeded.plan(t).available.tolist() for t in range(6)] == [
        seeded.plan(t).available.tolist() for t in range(6)
    ]


def test_the_planners_seed_reaches_the_participation_process():
    # a planner seeded 5 draws what a Bernoulli process set up with seed 5 draws (slip: the process left at its
    # default seed 0)
    got = planner(Bernoulli(0.5), seed=5)
    reference = Bernoulli(0.5)
    reference.setup(N, 5)
    draws = [got.plan(t).available.tolist() for t in range(8)]
    assert draws == [reference.sample(t).tolist() for t in range(8)]
    default = Bernoulli(0.5)
    default.setup(N, 0)
    assert draws != [default.sample(t).tolist() for t in range(8)]  # the premise: seeds 0 and 5 differ here


def test_a_strategy_level_selection_keeps_k_clients_and_is_checked():
    plans = [planner(selection=UniformSample(2), seed=1).plan(t) for t in range(5)]
    assert all(int(p.selected.sum()) == 2 and bool(p.available.all()) for p in plans)
    # k/N for always-available clients: 2/4
    assert planner(selection=UniformSample(2)).selection_probs(0).tolist() == [0.5] * 4
    with pytest.raises(ValueError) as err:
        planner(selection=UniformSample(5))
    assert str(err.value) == "k must be <= num_clients=4, got k=5"
    with pytest.raises(TypeError) as err:
        planner(selection=Full())
    assert str(err.value) == "selection must be a UniformSample(k), got Full"
    with pytest.raises(ValueError) as err:
        planner(algorithm=SelectsItself(), selection=UniformSample(2))
    assert str(err.value) == (
        "selection=UniformSample(k=2) conflicts with SelectsItself, which selects clients itself: drop selection= "
        "(one owner per decision)"
    )


def test_a_deadline_needs_a_latency_model():
    with pytest.raises(ValueError) as err:
        planner(deadline=2.0)
    assert str(err.value) == "deadline needs a latency model (latency=ShiftedExponential(...))"


def test_aggregation_probabilities_at_given_steps_in_closed_form():
    # one speed group, "scale": T = K (0.5 + E), E ~ Exp(mean 0.5): P(T <= 2 | K) = 1 - exp(-(2/K - 0.5) / 0.5)
    # = 1 - e^-3, 1 - e^-1, 1 - e^(-1/3) for K = 1, 2, 3, and 0 for K = 4 (2/4 = shift). Links: downlink and
    # uplink losses (0, 0.1, 0.2, 0) and (0.1, 0.3, 0, 0.2). Everyone available and kept: P(selected) = 1.
    plan = planner(local_steps=UniformSteps(1, 3), channel=LossyChannel(uplink=[0.1, 0.3, 0.0, 0.2],
                                                                         downlink=[0.0, 0.1, 0.2, 0.0]),
                   latency=ShiftedExponential(shift=0.5, mean=0.5, speed_factors=(1.0,), group_fractions=(1.0,)),
                   deadline=2.0, seed=3)
    links = np.array([0.9, 0.9 * 0.7, 0.8, 0.8])
    on_time = np.array([1 - math.exp(-3), 1 - math.exp(-1), 1 - math.exp(-1 / 3), 0.0])
    # the probabilities at the steps asked for (slip: at the round's own draw of 1-3 steps)
    got = plan.aggregation_probs(7, np.array([1, 2, 3, 4]))
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), links * on_time, rtol=1e-12)
    np.testing.assert_allclose(plan.success_probs(7, [1, 2, 3, 4]).numpy(), links * on_time, rtol=1e-12)


def test_label_histograms_by_hand():
    # client i holds samples 2i, 2i+1: labels (0, 1), (1, 2), (2, 2), (0, 0); classes 0, 1, 2
    hist = planner().label_histograms()
    assert hist.dtype == np.int64
    assert hist.tolist() == [[1, 1, 0], [0, 1, 1], [0, 0, 2], [2, 0, 0]]
    algorithm = FedAvg()
    algorithm.setup(N, torch.zeros(1))
    unlabelled = RoundPlanner(Full(), algorithm, streams(with_labels=False))
    with pytest.raises(ValueError) as err:
        unlabelled.label_histograms()
    assert str(err.value) == "this participation recipe needs labels, but the training dataset exposes none"


class Records(FedAvg):
    """FedAvg that records what the planner hands it: the system oracle, the probe losses and the selection rng."""

    def __init__(self, probe: bool = False, counts: list[int] | None = None) -> None:
        super().__init__()
        self.probe, self.counts = probe, counts
        self.system: list[tuple] = []
        self.losses: list[tuple] = []
        self.uniforms: list[float] = []

    def observe_system(self, round, *, success_probs=None, local_steps=None, participation_probs=None):
        self.system.append((round, success_probs, local_steps, participation_probs))

    def wants_probe_losses(self) -> bool:
        return self.probe

    def observe_losses(self, round, losses):
        self.losses.append((round, losses))

    def select(self, round, available, rng):
        self.uniforms.append(float(rng.random()))
        if self.counts is not None:  # a sampler with replacement: draws per client
            return torch.tensor(self.counts)
        return super().select(round, available, rng)


class LossOnOddRounds(LossDistribution):
    """Uplink loss 0 in even rounds and 0.5 in odd rounds, for every client."""

    def sample(self, round: int, num_clients: int, seed: int) -> np.ndarray:
        return np.full(num_clients, 0.5 if round % 2 else 0.0)


def test_the_rule_observes_this_rounds_system_and_its_own_selection_stream():
    # availability p = (1, 0, 1, 0.5); steps (1, 2, 3, 1); uplink loss 0.5 in odd rounds. In round 3 the oracle gets
    # success 0.5 for everyone (slip: round 0's links, success 1), the steps as int64 and the availability; select's
    # generator is generator(seed, SELECTION, round) (slips: the seed or the stream left out)
    algorithm = Records()
    plan = planner(Bernoulli([1.0, 0.0, 1.0, 0.5]), algorithm, local_steps=[1, 2, 3, 1],
                   channel=LossyChannel(uplink=LossOnOddRounds()), seed=7).plan(3)
    round_, success, steps, availability = algorithm.system[-1]
    assert round_ == 3 and success.tolist() == [0.5] * 4 and plan.success_probs.tolist() == [0.5] * 4
    assert steps.dtype == torch.int64 and steps.tolist() == [1, 2, 3, 1]
    assert availability.tolist() == [1.0, 0.0, 1.0, 0.5]
    assert algorithm.uniforms == [float(generator(7, Stream.SELECTION, 3).random())]
    # client 1 is never available: it trains nothing (0 steps, not 1); no latency model: the round takes 0 s
    assert plan.local_steps[1] == 0 and plan.duration == 0.0
    assert planner(Bernoulli([1.0, 0.0, 1.0, 0.5]), seed=7).aggregation_probs(3, np.ones(4, dtype=np.int64)) \
        .tolist() == [1.0, 0.0, 1.0, 0.5]
    odd = planner(channel=LossyChannel(uplink=LossOnOddRounds()))
    assert odd.aggregation_probs(1, np.ones(4, dtype=np.int64)).tolist() == [0.5] * 4  # round 1's links
    assert odd.aggregation_probs(2, np.ones(4, dtype=np.int64)).tolist() == [1.0] * 4


def test_probe_losses_are_asked_of_the_engine_for_this_round():
    algorithm = Records(probe=True)
    losses = torch.tensor([0.5, 1.5, 2.5, 3.5], dtype=torch.float64)
    calls = []

    def probe(round, available):
        calls.append((round, available.tolist()))
        return losses

    planner(Bernoulli([1.0, 0.0, 1.0, 1.0]), algorithm).plan(4, probe=probe)
    assert calls == [(4, [True, False, True, True])]
    assert algorithm.losses == [(4, losses)]
    with pytest.raises(RuntimeError) as err:
        planner(algorithm=Records(probe=True)).plan(0)
    assert str(err.value) == "Records needs probe losses but no engine provides them"


def test_a_sampler_with_replacement_gives_counts_and_the_selected_mask():
    # the rule drew client 0 twice and client 2 once: selected = counts > 0 (slips: >= 0 selects all, > 1 drops 2)
    plan = planner(algorithm=Records(counts=[2, 0, 1, 0])).plan(0)
    assert plan.selection_counts.dtype == torch.int64 and plan.selection_counts.tolist() == [2, 0, 1, 0]
    assert plan.selected.tolist() == [True, False, True, False]
    context = planner(algorithm=Records(counts=[2, 0, 1, 0])).context(plan)
    assert context.selected.tolist() == [2, 0, 1, 0] and context.local_steps.tolist() == [1, 0, 1, 0]


def test_success_probabilities_without_a_channel_or_a_deadline_and_at_the_rounds_own_draw():
    latency = dict(shift=0.5, mean=0.5, speed_factors=(1.0,), group_fractions=(1.0,))
    # a latency model without a deadline: every selected update arrives (no closed form needed, None)
    assert planner(latency=ShiftedExponential(**latency)).success_probs(0) is None
    # a deadline and no channel: the on-time probability alone, at K = 1: 1 - e^-3 (see the closed form above)
    alone = planner(latency=ShiftedExponential(**latency), deadline=2.0)
    np.testing.assert_allclose(alone.success_probs(0).numpy(), [1 - math.exp(-3)] * 4, rtol=1e-12)
    # without steps given: this round's draw of the step distribution (the plan uses the same)
    drawn = planner(local_steps=UniformSteps(1, 3), latency=ShiftedExponential(**latency), deadline=2.0, seed=4)
    for t in (0, 5):
        steps = local_steps_for(UniformSteps(1, 3), t, N, 4)
        torch.testing.assert_close(drawn.success_probs(t), drawn.success_probs(t, steps))
        torch.testing.assert_close(drawn.plan(t).success_probs, drawn.success_probs(t, steps))


def test_a_client_without_data_is_never_trained():
    algorithm = FedAvg()
    algorithm.setup(N, torch.zeros(1))
    empty_second = ClientStreams(TensorDataset(torch.zeros(2 * N, 1), LABELS), [[0, 1], [], [4, 5], [6, 7]],
                                 batch_size=2)
    plan = RoundPlanner(Full(), algorithm, empty_second).plan(0)
    assert plan.selected.tolist() == [True] * 4 and plan.trained.tolist() == [True, False, True, True]
    assert plan.local_steps.tolist() == [1, 0, 1, 1]


def test_a_label_correlated_recipe_gets_the_planners_seed_and_the_label_histograms():
    # Bernoulli(LabelCorrelated()) needs the clients' label histograms; it is set up with the planner's seed (slip:
    # left at seed 0, which changes the recipe's class affinities and the draws)
    got = planner(Bernoulli(LabelCorrelated(mean=0.5, floor=0.1, alpha=0.5)), seed=5)
    histograms = np.array([[1, 1, 0], [0, 1, 1], [0, 0, 2], [2, 0, 0]])  # see test_label_histograms_by_hand
    draws = [got.plan(t).available.tolist() for t in range(12)]
    for seed, same in ((5, True), (0, False)):
        reference = Bernoulli(LabelCorrelated(mean=0.5, floor=0.1, alpha=0.5))
        reference.setup(N, seed, label_hist=histograms)
        assert (draws == [reference.sample(t).tolist() for t in range(12)]) is same, seed


def test_trained_ids_follow_the_mask_through_changes_in_place_and_new_masks():
    # slips: ids cached once for good (an in-place change or a new mask not seen), the cached list handed out
    trained = torch.tensor([False, True, False, True])
    plan = RoundPlan(0, trained.clone(), trained.clone(), trained, trained.clone(), np.array([0, 2, 0, 1]))
    assert plan.trained_ids == [1, 3]
    plan.trained_ids.append(7)  # the caller's own list
    assert plan.trained_ids == [1, 3]
    plan.trained[0] = True  # in place
    assert plan.trained_ids == [0, 1, 3]
    plan.trained = torch.tensor([False, False, True, False])  # a new mask
    assert plan.trained_ids == [2]
    assert dataclasses.replace(plan, trained=torch.tensor([True, False, False, False])).trained_ids == [0]
    assert mask_ids(torch.tensor([True, False, True])).tolist() == [0, 2]
    assert mask_ids(torch.tensor([True, False, True])).dtype == torch.int64
    assert mask_ids(torch.zeros(3, dtype=torch.bool)).tolist() == []
