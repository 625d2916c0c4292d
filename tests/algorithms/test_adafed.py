"""AdaFed as run in CA-Fed's experiments (Tan et al. 2022): every available client, alpha/pi normalised per round."""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.algorithms import AdaFed, ClientInfo
from tests.algorithms.selection_rounds import F64, check_resume, ctx_for, mask, vec

ALPHA4 = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)


def test_adafed_hand_computed():
    # alpha = [0.1, 0.2, 0.3, 0.4], pi = [0.5, 0.25, 0.75, 1.0] -> alpha/pi = [0.2, 0.8, 0.4, 0.4]
    # round 0: available S = {0, 1, 3}: sum = 0.2 + 0.8 + 0.4 = 1.4 -> q = [1/7, 4/7, 0, 2/7]
    # client 1's upload is lost (its share stays in the normaliser): w = 0 + (1/7)*7 + (2/7)*14 = 1 + 4 = 5
    algo = AdaFed()
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    pi = [0.5, 0.25, 0.75, 1.0]
    assert algo.select(0, mask(4, [0, 1, 3]), None).tolist() == [True, True, False, True]
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [0, 1, 3], [0, 3], pi=pi))
    algo.add(0, vec(7.0), ClientInfo(1, 1))
    algo.add(3, vec(14.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(5.0))
    assert algo.last_weights == pytest.approx({0: 1 / 7, 3: 2 / 7})
    # round 1: S = {1, 2}: 0.8 + 0.4 = 1.2 -> q_1 = 2/3, q_2 = 1/3; deltas 3 and -3 -> w = 5 + 2 - 1 = 6
    algo.select(1, mask(4, [1, 2]), None)
    algo.open_round(1, ctx_for(1, 4, [1, 2], [1, 2], [1, 2], pi=pi))
    algo.add(1, vec(3.0), ClientInfo(1, 1))
    algo.add(2, vec(-3.0), ClientInfo(1, 1))
    assert torch.allclose(algo.close_round(), vec(6.0))


def test_bad_inputs():
    with pytest.raises(ValueError, match="pi_source"):
        AdaFed(pi_source="oracle")
    ada = AdaFed()
    ada.setup(2, torch.zeros(1, dtype=F64))
    ada.select(0, torch.ones(2, dtype=torch.bool), None)
    with pytest.raises(ValueError, match="availability_probs"):
        ada.open_round(0, ctx_for(0, 2, [0, 1], [0, 1], [0, 1]))


def test_state_dict_resume_equals_uninterrupted():
    check_resume(lambda: AdaFed(pi_source="estimate"))


def test_known_pi_is_the_availability_not_the_probability_of_being_aggregated():
    # Slip caught: dividing by RoundContext.participation_probs (availability x links) instead of the availability.
    # N = 2, alpha = 1/2 each, availability pi = (0.5, 1), client 0's upload is lost half the time (P(aggregated) =
    # (0.25, 1)). In a round where both are available: alpha/pi = (1, 0.5) -> q = (2/3, 1/3); dividing by
    # P(aggregated) would give alpha/p = (2, 0.5) -> (0.8, 0.2).
    from torch.utils.data import TensorDataset

    from lightning_fedhet.data.streams import ClientStreams
    from lightning_fedhet.federation import RoundPlanner
    from lightning_fedhet.participation import Bernoulli
    from lightning_fedhet.server import Server
    from lightning_fedhet.system import LossyChannel

    algo = AdaFed()
    streams = ClientStreams(TensorDataset(torch.zeros(2, 1)), [[0], [1]], batch_size=1)
    planner = RoundPlanner(Bernoulli([0.5, 1.0]), algo, streams, channel=LossyChannel(uplink=[0.5, 0.0]), seed=1)
    server = Server(planner, algo, torch.zeros(1, dtype=F64), num_parameters=1)
    for t in range(50):
        plan = server.begin_round(t)
        for client in plan.trained_ids:
            server.submit(client, vec(1.0), 0.0)
        server.close_round()
        if plan.arrives.all():
            assert server.history[-1]["weights"] == pytest.approx({0: 2 / 3, 1: 1 / 3})
            break
    else:
        pytest.fail("no round in which both clients arrived")


# ------------------------------------------------------------------------ against the adafed chunk's survivors
def test_the_normaliser_is_the_selected_set_of_the_context_and_one_member_gets_weight_one():
    # Selected S = {0, 1} among available {0, 1, 3} (a strategy-level selection): q over S only,
    # alpha/pi = [0.2, 0.8] -> q = [0.2, 0.8]; then a round with S = {2} alone: alpha/pi = 0.4 < 1, normalised to 1.
    # Slips caught: normalising over the available set, and `total > 1` (a sum below 1 left unnormalised).
    pi = [0.5, 0.25, 0.75, 1.0]
    algo = AdaFed()
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    algo.open_round(0, ctx_for(0, 4, [0, 1, 3], [0, 1], [0, 1], pi=pi))
    algo.add(0, vec(1.0), ClientInfo(1, 1))
    algo.add(1, vec(1.0), ClientInfo(1, 1))
    algo.close_round()
    assert algo.last_weights == pytest.approx({0: 0.2, 1: 0.8})
    torch.testing.assert_close(algo.last_pi, torch.tensor(pi, dtype=F64))
    algo.open_round(1, ctx_for(1, 4, [2], [2], [2], pi=pi))
    algo.add(2, vec(3.0), ClientInfo(1, 1))
    torch.testing.assert_close(algo.close_round(), vec(1.0 * 0.2 + 1.0 * 0.8 + 3.0))
    assert algo.last_weights == pytest.approx({2: 1.0})


def test_without_a_context_the_estimate_normalises_over_the_clients_seen_available():
    # pi_source="estimate", no RoundContext: S = the availability observed by select(). Clients 0, 1, 3 share one
    # history, so their pi_hat are equal and q_i = alpha_i / (0.1 + 0.2 + 0.4). Slips caught: reading ctx.selected
    # from a missing context, or the estimate path skipping the observed set.
    algo = AdaFed(pi_source="estimate")
    algo.setup(4, torch.zeros(1, dtype=F64), ALPHA4)
    assert algo.last_pi is None
    algo.select(0, mask(4, [0, 1, 3]), None)
    algo.open_round(0, None)
    for client in (0, 1, 3):
        algo.add(client, vec(1.0), ClientInfo(1, 1))
    algo.close_round()
    assert algo.last_weights == pytest.approx({0: 0.1 / 0.7, 1: 0.2 / 0.7, 3: 0.4 / 0.7})
    torch.testing.assert_close(algo.last_pi[[0, 1, 3]], algo.last_pi[0].expand(3))


def test_known_pi_without_a_context_is_refused_naming_the_setting_and_the_field():
    algo = AdaFed()
    algo.setup(2, torch.zeros(1, dtype=F64))
    algo.select(0, torch.ones(2, dtype=torch.bool), None)
    with pytest.raises(ValueError, match=r"^AdaFed\(pi_source='known'\) needs RoundContext\.availability_probs$"):
        algo.open_round(0, None)


def test_a_selected_set_of_zero_total_weight_leaves_the_model_unchanged():
    # alpha_0 = 0 (a client without data under sample weights): alone in S, sum alpha/pi = 0, so q_0 = 0, not 0/0.
    # Slips caught: `total >= 0` and dropping the guard (nan weights reach the model).
    algo = AdaFed()
    algo.setup(2, torch.zeros(1, dtype=F64), torch.tensor([0.0, 1.0], dtype=F64))
    algo.open_round(0, ctx_for(0, 2, [0], [0], [0], pi=[0.5, 0.5]))
    algo.add(0, vec(5.0), ClientInfo(0, 1))
    torch.testing.assert_close(algo.close_round(), vec(0.0))
    assert algo.last_weights == {0: 0.0}


def test_setup_keeps_the_sizes_and_the_options_are_reported():
    algo = AdaFed(pi_source="estimate", server_lr=0.5)
    algo.setup(3, torch.zeros(1, dtype=F64), None, torch.tensor([4, 0, 2]))
    assert algo.client_sizes.tolist() == [4, 0, 2]
    assert algo.hparams() == {"pi_source": "estimate", "server_lr": 0.5}
    probs = algo.selection_probs(0)
    assert probs.dtype == F64 and probs.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match=r"^pi_source must be one of"):
        AdaFed(pi_source="oracle")


def test_a_selected_mask_of_the_wrong_length_is_refused_naming_it():
    algo = AdaFed()
    algo.setup(2, torch.zeros(1, dtype=F64))
    ctx = ctx_for(0, 2, [0], [0], [0], pi=[0.5, 0.5])
    object.__setattr__(ctx, "selected", torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^selected "):
        algo.open_round(0, ctx)
