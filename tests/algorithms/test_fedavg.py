"""FedAvg on hand-computed 2-client, 2-round examples, one per weighting."""

import warnings

import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, FedAvg, RoundContext


def _ctx(round, probs=None):
    n = 2
    return RoundContext(
        round,
        n,
        torch.ones(n, dtype=torch.bool),
        torch.ones(n, dtype=torch.bool),
        torch.ones(n, dtype=torch.bool),
        participation_probs=probs,
    )


def _run(algo, rounds, client_weights=None, probs=None):
    """rounds: list of dicts client -> (delta, num_samples)."""
    algo.setup(2, torch.tensor([1.0, -1.0]), client_weights)
    for t, updates in enumerate(rounds):
        algo.open_round(t, _ctx(t, probs))
        for c, (delta, n) in updates.items():
            algo.add(c, torch.tensor(delta), ClientInfo(num_samples=n, local_steps=1))
        algo.close_round()
    return algo.params


# Round 0: both clients arrive, delta_0 = [2, 0] (n=1), delta_1 = [0, 4] (n=3).
# Round 1: only client 1 arrives, delta_1 = [2, 2] (n=3).
ROUNDS = [{0: ([2.0, 0.0], 1), 1: ([0.0, 4.0], 3)}, {1: ([2.0, 2.0], 3)}]


def test_participating_weighting_hand_computed():
    # r0: mean of both = [1, 2] -> w = [2, 1]; r1: only client 1 -> + [2, 2] -> [4, 3]
    w = _run(FedAvg("participating"), ROUNDS)
    torch.testing.assert_close(w, torch.tensor([4.0, 3.0]), atol=1e-6, rtol=0)


def test_all_weighting_hand_computed():
    # divide by N=2 always. r0: ([2,0]+[0,4])/2 = [1,2] -> [2,1]; r1: [2,2]/2 = [1,1] -> [3,2]
    w = _run(FedAvg("all"), ROUNDS)
    torch.testing.assert_close(w, torch.tensor([3.0, 2.0]), atol=1e-6, rtol=0)


def test_samples_weighting_hand_computed():
    # r0: (1*[2,0] + 3*[0,4]) / 4 = [0.5, 3] -> [1.5, 2]; r1: only client 1 -> + [2,2] -> [3.5, 4]
    w = _run(FedAvg("samples"), ROUNDS)
    torch.testing.assert_close(w, torch.tensor([3.5, 4.0]), atol=1e-6, rtol=0)


def test_known_p_weighting_hand_computed():
    # alpha = 1/2 each, p = [0.5, 0.25]: q = [1, 2].
    # r0: 1*[2,0] + 2*[0,4] = [2, 8] -> [3, 7]; r1: 2*[2,2] = [4,4] -> [7, 11]
    w = _run(FedAvg("known_p"), ROUNDS, probs=torch.tensor([0.5, 0.25], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([7.0, 11.0]), atol=1e-6, rtol=0)


def test_all_weighting_with_sample_sized_alpha():
    # alpha = |D_i|/|D| = [1/4, 3/4], no renormalisation over the arrived clients ("average all" in delta space).
    # r0: 0.25*[2,0] + 0.75*[0,4] = [0.5, 3] -> [1.5, 2]; r1: 0.75*[2,2] = [1.5,1.5] -> [3, 3.5]
    w = _run(FedAvg("all"), ROUNDS, client_weights=torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(w, torch.tensor([3.0, 3.5]), atol=1e-6, rtol=0)


def test_server_lr_scales_the_step_and_weights_are_reported():
    algo = FedAvg("participating", server_lr=0.5)
    w = _run(algo, ROUNDS)
    # r0: [1,-1] + 0.5*[1,2] = [1.5, 0]; r1: + 0.5*[2,2] -> [2.5, 1]
    torch.testing.assert_close(w, torch.tensor([2.5, 1.0]), atol=1e-6, rtol=0)
    assert algo.last_weights == {1: 1.0}


def test_empty_round_leaves_params_unchanged():
    algo = FedAvg()
    algo.setup(2, torch.tensor([1.0, 2.0]))
    algo.open_round(0, _ctx(0))
    torch.testing.assert_close(algo.close_round(), torch.tensor([1.0, 2.0]))
    assert algo.last_weights == {}


def test_state_dict_round_trip():
    a = FedAvg()
    _run(a, ROUNDS[:1])
    b = FedAvg()
    b.load_state_dict(a.state_dict())
    for algo in (a, b):
        algo.open_round(1, _ctx(1))
        algo.add(1, torch.tensor([2.0, 2.0]), ClientInfo(3, 1))
        algo.close_round()
    torch.testing.assert_close(a.params, b.params)


@pytest.mark.parametrize(
    "kwargs, match",
    [({"weighting": "median"}, "weighting"), ({"server_lr": 0.0}, "server_lr"), ({"server_lr": -1}, "server_lr")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedAvg(**kwargs)


def test_known_p_needs_the_probabilities_and_warns_once_about_clients_never_aggregated():
    # Slip caught: raising every round for a client with p_i = 0 (it never arrives, so its 1/p_i is never used), or
    # dividing the others by the wrong probability. Client 1 (p = 0) is never aggregated; client 0 (p = 0.5, alpha
    # 1/2) sends 3: w = 0 + (1/2) / 0.5 * 3 = 3 per round.
    algo = FedAvg("known_p")
    algo.setup(2, torch.zeros(2))
    with pytest.raises(ValueError, match="participation_probs"):
        algo.open_round(0, _ctx(0, probs=None))
    with pytest.warns(RuntimeWarning, match=r"1 client\(s\) have RoundContext.participation_probs = 0 \(ids 1\)"):
        algo.open_round(0, _ctx(0, probs=torch.tensor([0.5, 0.0])))
    algo.add(0, torch.tensor([3.0, 0.0]), ClientInfo(1, 1))
    torch.testing.assert_close(algo.close_round(), torch.tensor([3.0, 0.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        algo.open_round(1, _ctx(1, probs=torch.tensor([0.5, 0.0])))
    algo.add(0, torch.tensor([3.0, 0.0]), ClientInfo(1, 1))
    torch.testing.assert_close(algo.close_round(), torch.tensor([6.0, 0.0]))


def test_setup_validation():
    with pytest.raises(ValueError, match="num_clients"):
        FedAvg().setup(0, torch.zeros(2))
    with pytest.raises(ValueError, match="client_weights"):
        FedAvg().setup(2, torch.zeros(2), torch.tensor([1.0, 2.0, 3.0]))


def test_errors_name_the_parameter_at_the_start_of_the_message():
    # Anchored matches: a message that merely contains the name somewhere (or a mangled name) does not pass.
    # Slips caught: a wrong parameter named in the error, a reworded or emptied message.
    with pytest.raises(ValueError, match=r"^weighting must be one of"):
        FedAvg(weighting="median")
    with pytest.raises(ValueError, match=r"^server_lr must lie in \(0, inf\)"):
        FedAvg(server_lr=0.0)
    algo = FedAvg("known_p")
    algo.setup(2, torch.zeros(2))
    for ctx in (None, _ctx(0, probs=None)):  # no context at all, or one without the probabilities
        with pytest.raises(ValueError, match=r"^weighting='known_p' needs RoundContext\.participation_probs"):
            algo.open_round(0, ctx)


def test_close_round_needs_an_open_round_every_time():
    # Slips caught: the open-round marker not cleared by close_round (a second close would aggregate again),
    # or not set at construction (a close before any open would not raise).
    algo = FedAvg()
    algo.setup(2, torch.zeros(2))
    with pytest.raises(RuntimeError, match=r"^close_round\(\) called without open_round\(\)$"):
        algo.close_round()
    algo.open_round(0, _ctx(0))
    algo.add(0, torch.tensor([1.0, 1.0]), ClientInfo(1, 1))
    torch.testing.assert_close(algo.close_round(), torch.tensor([1.0, 1.0]))
    with pytest.raises(RuntimeError, match=r"^close_round\(\) called without open_round\(\)$"):
        algo.close_round()


def test_hparams_are_the_constructor_arguments():
    # What loggers record as the rule's hyperparameters. Slip caught: a key renamed or a value not the argument.
    assert FedAvg("samples", server_lr=0.5).hparams() == {"weighting": "samples", "server_lr": 0.5}
