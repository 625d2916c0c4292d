"""The server's own arithmetic and options, by hand: the floating-buffer average, ``optimizer_state="persist"``
and ``max_update_norm`` (``"clip"`` / ``"reject"``).

Each test names the slip it catches; these slips once passed the whole suite.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.federation import RoundPlanner
from lightning_fedhet.participation import Full
from lightning_fedhet.server import Server
from tests.helpers import four_client_server, quiet_trainer

# four clients holding 1, 2, 3 and 4 samples, FedAvg weighted by samples; client 3's upload is lost
_server = four_client_server


# ------------------------------------------------------------------------------------------ floating buffers
def test_buffers_are_averaged_over_the_arrived_clients_with_their_sample_counts():
    # Slip caught: dividing the buffers' sample-weighted sum by every client's |D_i| (1+2+3+4 = 10) or every trained
    # client's, instead of the arrived ones' (client 1 is rejected as non-finite, client 3's upload is lost).
    server = _server(num_parameters=2, extra=2)
    assert server.begin_round(0).arrives.tolist() == [True, True, True, False]
    deltas = {
        0: torch.tensor([1.0, 0.0, 10.0, -1.0]),
        1: torch.tensor([float("nan"), 0.0, 20.0, -2.0]),
        2: torch.tensor([0.0, 1.0, 40.0, 5.0]),
        3: torch.tensor([7.0, 7.0, 70.0, 7.0]),
    }
    assert [server.submit(c, d, 0.0) for c, d in deltas.items()] == [True, False, True, False]
    new = server.close_round()
    # parameters (FedAvg samples, renormalised over arrivals): (1 * [1, 0] + 3 * [0, 1]) / 4
    # buffers: (1 * [10, -1] + 3 * [40, 5]) / (1 + 3) = [130/4, 14/4]
    torch.testing.assert_close(new, torch.tensor([0.25, 0.75, 32.5, 3.5]))
    assert server.history[-1]["received"].tolist() == [0, 2]


def test_buffers_stay_put_when_nothing_arrives():
    # Slip caught: a division by zero (or by the wrong count) when every upload is lost.
    server = _server(num_parameters=1, extra=1, lost=(0, 1, 2, 3))
    assert not server.begin_round(0).arrives.any()
    for c in range(4):
        assert not server.submit(c, torch.tensor([1.0, 1.0]), 0.0)
    torch.testing.assert_close(server.close_round(), torch.zeros(2))


def test_integer_buffers_move_by_the_rounded_sample_weighted_mean_of_the_arrived_changes():
    # Slip caught: summing the counters over clients, or weighting by the wrong clients. Arrived: 0 (|D|=1, +6) and
    # 2 (|D|=3, +2): (6 + 6) / 4 = 3; client 3 (lost, +100) must not count.
    server = _server(num_parameters=1, extra=0, init_ints=torch.tensor([5], dtype=torch.int64))
    server.begin_round(0)
    for client, change in ((0, 6), (2, 2), (3, 100)):
        server.submit(client, torch.zeros(1), 0.0, int_delta=torch.tensor([change], dtype=torch.int64))
    server.close_round()
    assert server.global_ints.tolist() == [8]


# ------------------------------------------------------------------------------------------ max_update_norm
def test_clip_scales_an_update_exactly_to_the_bound_and_keeps_its_direction():
    # Slip caught: clipping to a fraction of the bound (e.g. 0.1 * bound / norm), clipping the buffers too, or
    # clipping updates under the bound. Client 0 sends [3, 4] (norm 5 > 2): it enters as [1.2, 1.6]; client 2
    # sends [0.6, 0.8] (norm 1 < 2): untouched. Buffers (last entry) are never clipped.
    server = _server(max_update_norm=2.0, update_norm_action="clip")
    server.begin_round(0)
    assert server.submit(0, torch.tensor([3.0, 4.0, 9.0]), 0.0)
    assert server.submit(2, torch.tensor([0.6, 0.8, 1.0]), 0.0)
    new = server.close_round()
    expected_params = (1 * torch.tensor([1.2, 1.6]) + 3 * torch.tensor([0.6, 0.8])) / 4
    torch.testing.assert_close(new[:2], expected_params)
    torch.testing.assert_close(new[2:], torch.tensor([(1 * 9.0 + 3 * 1.0) / 4]))
    assert server.rejected_total == 0


def test_clipped_update_alone_has_norm_equal_to_the_bound():
    server = _server(max_update_norm=0.5, update_norm_action="clip")
    server.begin_round(0)
    server.submit(1, torch.tensor([-30.0, 40.0, 0.0]), 0.0)
    new = server.close_round()
    assert float(torch.linalg.vector_norm(new[:2])) == pytest.approx(0.5, rel=1e-6)
    torch.testing.assert_close(new[:2], torch.tensor([-0.3, 0.4]))


def test_reject_drops_an_update_over_the_bound_and_counts_it():
    # Slip caught: rejecting at the wrong side of the bound, or letting a rejected update into the average.
    server = _server(max_update_norm=2.0, update_norm_action="reject")
    server.begin_round(0)
    assert not server.submit(0, torch.tensor([3.0, 4.0, 9.0]), 0.0)
    assert server.submit(2, torch.tensor([0.6, 0.8, 1.0]), 0.0)
    torch.testing.assert_close(server.close_round(), torch.tensor([0.6, 0.8, 1.0]))
    assert server.rejected_total == 1
    assert server.history[-1]["rejected"].tolist() == [0]



def test_an_update_exactly_at_the_bound_is_kept_and_rejections_add_up_over_rounds():
    # ||(3, 4)|| = 5 = the bound, exact in float32: "over the bound" is strictly greater, so it is kept. Two rounds with
    # one rejection each: rejected_total counts both. Slips caught (mutants of the server chunk that survived):
    # `norm >= bound`, and `rejected_total = len(rejected)` instead of `+=`.
    server = _server(max_update_norm=5.0, update_norm_action="reject")
    for round in range(2):
        server.begin_round(round)
        assert server.submit(2, torch.tensor([3.0, 4.0, 1.0]), 0.0)
        assert not server.submit(0, torch.tensor([6.0, 8.0, 9.0]), 0.0)
        server.close_round()
    assert server.rejected_total == 2
    torch.testing.assert_close(server.global_vector[:2], torch.tensor([6.0, 8.0]))

# ------------------------------------------------------------------------------------------ optimizer_state
class ConstantGradient(pl.LightningModule):
    """One scalar weight; the loss ``-x w`` on a client whose samples all hold ``x`` has the gradient ``-x``
    whatever ``w`` is, so each client's update depends only on its own optimizer state."""

    def __init__(self, momentum: float) -> None:
        super().__init__()
        self.momentum = momentum
        self.w = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return -(x.mean() * self.w)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0, momentum=self.momentum)


@pytest.mark.parametrize(
    ("optimizer_state", "expected"),
    [
        # persist: SGD's momentum buffer b <- 0.5 b + g carries across rounds, so client i moves by
        # x_i (1, 1.5, 1.75) in rounds 0, 1, 2; FedAvg over clients with x = 1 and 3 (mean 2): 2 * 4.25 = 8.5
        ("persist", 8.5),
        # reset: a fresh buffer every round, client i moves by x_i each round: 2 * 3 = 6
        ("reset", 6.0),
    ],
)
@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_persisted_momentum_carries_across_rounds_per_client(optimizer_state, expected, engine):
    # Slips caught: "persist" behaving as "reset" (6.0 instead of 8.5), or the clients' states mixed up (one shared
    # buffer would give client 1 in round 0 the buffer of client 0: a different total); under either engine.
    x = torch.tensor([1.0, 1.0, 3.0, 3.0]).unsqueeze(1)
    data = FederatedDataModule(TensorDataset(x), [[0, 1], [2, 3]], batch_size=2)
    strategy = FedHetStrategy(algorithm=FedAvg(), participation=Full(), optimizer_state=optimizer_state,
                              engine=engine)
    model = ConstantGradient(momentum=0.5)
    quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0).fit(model, datamodule=data)
    assert float(model.w.detach()) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_persisted_state_is_the_clients_own_with_two_local_steps(engine):
    # Two local steps per round, momentum 0.5, one client with x = 2: buffers 1, 1.5 | 1.75, 1.875 (x g), so
    # persist moves w by 2 (1 + 1.5 + 1.75 + 1.875) = 12.25 over two rounds; reset by 2 (1 + 1.5) * 2 = 10.
    x = torch.full((2, 1), 2.0)
    data = FederatedDataModule(TensorDataset(x), [[0, 1]], batch_size=2)
    results = {}
    for mode in ("persist", "reset"):
        strategy = FedHetStrategy(algorithm=FedAvg(), local_steps=2, optimizer_state=mode, engine=engine)
        model = ConstantGradient(momentum=0.5)
        quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0).fit(model, datamodule=data)
        results[mode] = float(model.w.detach())
    assert results == pytest.approx({"persist": 12.25, "reset": 10.0}, abs=1e-6)


def test_a_client_that_is_never_available_is_warned_about_once_and_the_run_goes_on():
    # Slip caught: the known-p rules raising in every round because one p_i is 0 (decision: the client never
    # contributes, and one warning says its data is never seen). Client 0 is never available; client 1 (p = 1/2,
    # alpha = 1/2, delta 1) moves w by (1/2) / (1/2) = 1 in each round it arrives.
    import warnings

    from lightning_fedhet.participation import Bernoulli

    dataset = TensorDataset(torch.zeros(2, 1))
    streams = ClientStreams(dataset, [[0], [1]], batch_size=1)
    algorithm = FedAvg(weighting="known_p")
    server = Server(RoundPlanner(Bernoulli([0.0, 0.5]), algorithm, streams, seed=0), algorithm, torch.zeros(1), 1)
    arrivals = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(20):
            plan = server.begin_round(t)
            assert not plan.available[0]
            arrivals += int(plan.arrives[1])
            for client in plan.trained_ids:
                server.submit(client, torch.ones(1), 0.0)
            server.close_round()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "ids 0" in messages[0] and "never seen" in messages[0]
    assert arrivals > 0
    torch.testing.assert_close(server.global_vector, torch.tensor([float(arrivals)]))
