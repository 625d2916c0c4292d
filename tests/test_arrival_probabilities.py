"""The probabilities the server hands the rules are the true ones: ``E[1{arrived} / prob] = 1``, measured by simulating
the planner's own draws (participation, links, deadline), and a known-q rule (UPGA-PL) is then unbiased.

Slips caught: a success probability that leaves out the deadline (measured 0.92, 0.63 and 0.38 instead of 1 in three
deadline settings before the fix), a participation probability that leaves out the channel, the deadline or the
rule's own selection, and UPGA-PL dividing by the link's success alone under partial participation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_fedhet.algorithms import UPGAPL, FedAvg
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlanner
from lightning_fedhet.participation import Bernoulli, Full
from lightning_fedhet.server import Server
from lightning_fedhet.system import LossyChannel, ShiftedExponential, UniformSteps

N = 4
ROUNDS = 3000
# deadline settings: loose, medium, tight for the slow clients (speed factors 1 and 2, 1-3 local steps)
DEADLINES = [6.0, 3.0, 1.6]


def _streams() -> ClientStreams:
    return ClientStreams(TensorDataset(torch.zeros(2 * N, 1)), [[2 * i, 2 * i + 1] for i in range(N)], batch_size=2)


def _planner(algorithm, deadline: float, participation=None, seed: int = 5) -> RoundPlanner:
    algorithm.setup(N, torch.zeros(N, dtype=torch.float64))
    return RoundPlanner(
        participation if participation is not None else Bernoulli([0.9, 0.6, 0.8, 0.5]),
        algorithm,
        _streams(),
        local_steps=UniformSteps(1, 3),
        channel=LossyChannel(uplink=[0.1, 0.3, 0.0, 0.2], downlink=[0.0, 0.1, 0.2, 0.0]),
        latency=ShiftedExponential(shift=0.5, mean=0.5, speed_factors=(1.0, 2.0), group_fractions=(0.5, 0.5)),
        deadline=deadline,
        seed=seed,
    )


def _check_mean_one(arrived: np.ndarray, probs: np.ndarray, what: str) -> None:
    """``mean_t 1{arrived_t} / p_t = 1`` within 5 standard deviations (``sqrt(sum_t (1 - p_t) / p_t) / T``) over the
    rounds ``t`` with ``p_t > 0``; in a round with ``p_t = 0`` (a deadline the client cannot meet) it never arrives."""
    assert not arrived[probs == 0].any(), what
    for i in range(arrived.shape[1]):
        rows = probs[:, i] > 0
        p, hits = probs[rows, i], arrived[rows, i]
        mean = (hits / p).mean()
        tolerance = 5.0 * np.sqrt(((1.0 - p) / p).sum()) / rows.sum()
        assert abs(mean - 1.0) < tolerance, (what, i, mean, tolerance)


@pytest.mark.parametrize("deadline", DEADLINES)
def test_inverse_probability_weights_have_mean_one(deadline):
    planner = _planner(FedAvg(weighting="known_p"), deadline)
    agg, suc, arrived, selected = [], [], [], []
    for t in range(ROUNDS):
        plan = planner.plan(t)
        ctx = planner.context(plan)
        agg.append(ctx.participation_probs.numpy())
        suc.append(ctx.success_probs.numpy())
        arrived.append(plan.arrives.numpy())
        selected.append(plan.selected.numpy())
    agg, suc, arrived, selected = map(np.asarray, (agg, suc, arrived, selected))
    # E[1{aggregated} / P(aggregated)] = 1 over all rounds
    _check_mean_one(arrived, agg, "participation_probs")
    # E[1{arrived} / P(arrived | selected) | selected] = 1 over the rounds each client was selected
    _check_mean_one(np.where(selected, arrived, False), np.where(selected, suc, 0.0), "success_probs")
    # the deadline bites in this setting: some client's success probability is well below its link's
    links = (1 - np.array([0.1, 0.3, 0.0, 0.2])) * (1 - np.array([0.0, 0.1, 0.2, 0.0]))
    assert (suc.mean(axis=0) < links - 0.05).any() or deadline == DEADLINES[0]


@pytest.mark.parametrize("deadline", DEADLINES)
def test_upgapl_known_q_is_unbiased_under_partial_participation_and_a_deadline(deadline):
    # Client i always sends e_i (a unit vector): the lossless target is sum_i alpha_i e_i = (1/N, ..., 1/N) per round,
    # UPGA-PL's step is sum_{arrived} alpha_i / P(aggregated_i) e_i, so coordinate i's mean over the rounds is 1/N up
    # to sampling error (per-round std alpha_i sqrt((1 - P) / P)).
    algorithm = UPGAPL(q="known")
    planner = _planner(algorithm, deadline)
    server = Server(planner, algorithm, torch.zeros(N, dtype=torch.float64), num_parameters=N)
    # the rounds in which each client can arrive at all (local steps drawn with the planner's own stream)
    target = sum((planner.aggregation_probs(t, planner_steps(planner, t)) > 0).numpy() / N for t in range(ROUNDS))
    variance = np.zeros(N)  # sum over rounds of the per-round variance of coordinate i, alpha_i^2 (1 - P) / P
    for t in range(ROUNDS):
        plan = server.begin_round(t)
        p = plan.aggregation_probs.numpy()
        variance += np.where(p > 0, (1.0 / N) ** 2 * (1.0 - p) / np.where(p > 0, p, 1.0), 0.0)
        for client in plan.trained_ids:
            server.submit(client, torch.eye(N, dtype=torch.float64)[client], 0.0)
        server.close_round()
    mean = server.global_vector.numpy() / ROUNDS
    # rounds where a client cannot make the deadline (P = 0) contribute 0 instead of 1/N: the target is the share
    # of rounds in which it can
    np.testing.assert_array_less(np.abs(mean - target / ROUNDS), 5.0 * np.sqrt(variance) / ROUNDS)


def planner_steps(planner: RoundPlanner, round: int) -> np.ndarray:
    from lightning_fedhet.system.steps import local_steps_for

    return local_steps_for(planner.local_steps, round, N, planner.seed)


def test_full_participation_without_deadline_keeps_the_thesis_setting():
    # Every client selected, no deadline: P(aggregated) is exactly the link's (1 - q_down)(1 - q_up).
    algorithm = UPGAPL()
    algorithm.setup(N, torch.zeros(1))
    planner = RoundPlanner(Full(), algorithm, _streams(), channel=LossyChannel(uplink=[0.1, 0.3, 0.0, 0.2]), seed=0)
    ctx = planner.context(planner.plan(0))
    expected = torch.tensor([0.9, 0.7, 1.0, 0.8], dtype=torch.float64)
    torch.testing.assert_close(ctx.participation_probs, expected)
    torch.testing.assert_close(ctx.success_probs, expected)
    torch.testing.assert_close(ctx.availability_probs, torch.ones(N, dtype=torch.float64))


class HalfSampler(FedAvg):
    """FedAvg(known_p) with its own sampler: each available client is asked with probability 1/2 (independently)."""

    selects_clients = True

    def __init__(self) -> None:
        super().__init__(weighting="known_p")

    def select(self, round, available, rng):
        return available & torch.from_numpy(rng.random(self.num_clients) < 0.5)

    def selection_probs(self, round):
        return torch.full((self.num_clients,), 0.5, dtype=torch.float64)


def test_participation_probs_include_the_rules_own_selection():
    # Slip caught: P(aggregated) taken as availability x links for a rule that asks only some available clients
    # (here 1/2 of them): the 1/p weights would then be half of what unbiasedness needs.
    planner = _planner(HalfSampler(), DEADLINES[1])
    agg, arrived = [], []
    for t in range(ROUNDS):
        plan = planner.plan(t)
        agg.append(planner.context(plan).participation_probs.numpy())
        arrived.append(plan.arrives.numpy())
    _check_mean_one(np.asarray(arrived), np.asarray(agg), "participation_probs with the rule's selection")


def test_a_sampler_without_a_closed_form_gives_no_participation_probs():
    class Opaque(HalfSampler):
        def selection_probs(self, round):
            return None

    planner = _planner(Opaque(), DEADLINES[1])
    assert planner.context(planner.plan(0)).participation_probs is None


def test_participation_probs_follow_a_non_stationary_availability():
    # Cyclic(offset="inactive") starts every client off: in round 0 a client is on only when its first active round
    # is 0, with probability 1/inactive = 1/7 for period 10, p = 0.3 (3 on, 7 off), not the stationary 0.3.
    from lightning_fedhet.participation import Cyclic

    algorithm = FedAvg(weighting="known_p")
    algorithm.setup(N, torch.zeros(1))
    planner = RoundPlanner(Cyclic(10, 0.3, offset="inactive"), algorithm, _streams(), seed=0)
    torch.testing.assert_close(planner.context(planner.plan(0)).participation_probs,
                               torch.full((N,), 1 / 7, dtype=torch.float64))


def test_a_samplers_draw_counts_reach_the_round_context():
    # Slip caught: the planner collapsing a with-replacement sampler's counts to a mask, which left the rules'
    # multiplicity handling (FedNova's m_i, Eq. 116a) unreachable.
    from lightning_fedhet.algorithms import SampledFedAvg

    algorithm = SampledFedAvg(K=12)
    algorithm.setup(N, torch.zeros(1))
    planner = RoundPlanner(Full(), algorithm, _streams(), seed=2)
    plan = planner.plan(0)
    ctx = planner.context(plan)
    assert ctx.selected.dtype == torch.int64 and int(ctx.selected.sum()) == 12
    assert torch.equal(ctx.selected, algorithm.last_counts)
    assert torch.equal(plan.selected, ctx.selected > 0)
    assert int(ctx.selected.max()) > 1  # 12 draws over 4 clients: some client is drawn more than once
