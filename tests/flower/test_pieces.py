"""The bridge's pieces without a Flower runtime: node map, availability, mini-batch order, model records, setup."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, MetricRecord  # noqa: E402

from lightning_fedhet import FederationSpec  # noqa: E402
from lightning_fedhet.algorithms import FedAvg, FedNova  # noqa: E402
from lightning_fedhet.data.streams import ClientStreams  # noqa: E402
from lightning_fedhet.flat import FlatModel  # noqa: E402
from lightning_fedhet.flower import ConnectedNodes, FedHetFlowerStrategy, ModelCodec, NodeMap, client_batches  # noqa: E402
from lightning_fedhet.flower.strategy import weighted_metrics  # noqa: E402
from lightning_fedhet.participation import Bernoulli, Trace  # noqa: E402
from lightning_fedhet.participation.recipes import LabelCorrelated  # noqa: E402
from lightning_fedhet.system import LossyChannel  # noqa: E402
from tests.helpers import TinyClassifier  # noqa: E402

# ---------------------------------------------------------------------------------------------------- NodeMap


def test_partition_ids_name_the_clients():
    """Slip caught: mapping the other way round (client -> node) or by sorted node id when partitions are known."""
    nodes = NodeMap.from_partitions({101: 2, 55: 0, 900: 1, 7: 3}, num_clients=4)
    assert nodes.node_ids == [55, 900, 101, 7]
    assert [nodes.client(n) for n in (55, 900, 101, 7)] == [0, 1, 2, 3]
    assert nodes.client(12345) is None
    assert nodes.mask([900, 7, 12345]).tolist() == [False, True, False, True]


def test_without_partition_ids_the_smallest_node_ids_are_the_clients():
    nodes = NodeMap.from_partitions({30: None, 10: None, 20: None}, num_clients=2)
    assert nodes.node_ids == [10, 20]


def test_a_client_moves_to_its_new_node_and_keeps_its_id():
    """Slip caught: the old node still mapped (two nodes for one client) or a node given two clients."""
    nodes = NodeMap([5, 6, 7]).with_node(1, 9)
    assert nodes.node_ids == [5, 9, 7] and nodes.client(9) == 1 and nodes.client(6) is None
    with pytest.raises(ValueError, match="node 7 is already client 2's"):
        nodes.with_node(0, 7)


def test_partitions_beyond_num_clients_are_left_out():
    assert NodeMap.from_partitions({1: 0, 2: 1, 3: 5}, num_clients=2).node_ids == [1, 2]


@pytest.mark.parametrize(
    "partitions, match",
    [
        ({1: 0, 2: None}, r"nodes \[2\] have no partition-id"),
        ({1: 0, 2: 0, 3: 1}, r"nodes 1 and 2 both have partition-id=0"),
        ({1: 0, 2: 2, 3: 7}, r"no node has partition-id \[1\]"),
        ({1: None}, r"num_clients=3 but only 1 node"),
    ],
)
def test_node_maps_that_cannot_be_made_are_refused(partitions, match):
    with pytest.raises(ValueError, match=match):
        NodeMap.from_partitions(partitions, num_clients=3)


# ---------------------------------------------------------------------------------------------------- availability


def test_connected_nodes_restricts_the_process_and_keeps_its_probabilities():
    """Slip caught: a disconnected node counted as available (it would be selected and never answer), or the rule
    told the empirical connection rate instead of the process's p."""
    mask = np.array([[1, 1, 0], [0, 1, 1]], dtype=bool)
    process = ConnectedNodes(Trace(mask))
    process.setup(3, seed=0)
    process.observe(torch.tensor([True, False, True]))
    assert process.sample(0).tolist() == [True, False, False]
    assert process.sample(1).tolist() == [False, False, True]
    assert process.p.tolist() == [0.5, 1.0, 0.5]  # Trace's on-frequencies, by hand
    with pytest.raises(ValueError, match=r"shape \[3\]"):
        process.observe(torch.ones(2, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------- mini-batches


@pytest.mark.parametrize("round, client, steps", [(0, 0, 1), (3, 1, 2), (5, 2, 4)])
def test_client_batches_are_the_simulated_batches(round, client, steps):
    """A node holding its partition in the partition's order trains on the simulation's mini-batches, including a
    client whose round needs a second permutation (client 2: 5 samples, 4 steps of 3).
    Slip caught: seeding with the node id or a 1-based round, or permuting dataset indices instead of positions."""
    order = np.random.default_rng(0).permutation(20)
    parts = [order[:9], order[9:15], order[15:]]
    streams = ClientStreams(None, parts, batch_size=3, seed=42)
    expected = streams.batch_indices(round, client, steps)
    positions = client_batches(len(parts[client]), client, round, steps, batch_size=3, seed=42)
    assert len(positions) == steps
    for got, want in zip(positions, expected):
        assert parts[client][got].tolist() == want.tolist()


# ---------------------------------------------------------------------------------------------------- model records


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)


def test_model_codec_round_trip_keeps_parameters_buffers_and_counters():
    """Slip caught: floating buffers dropped or put before the parameters, integer counters lost in a float cast."""
    source = _Norm()
    with torch.no_grad():
        source.norm.running_mean.copy_(torch.tensor([0.25, -1.5]))
        source.norm.num_batches_tracked.fill_(7)
    codec = ModelCodec(_Norm())
    vector, ints = codec.from_record(ArrayRecord(source.state_dict()))
    flat = FlatModel(source)
    assert torch.equal(vector, flat.get())
    assert ints.tolist() == [7]
    assert vector[flat.num_parameters :].tolist()[:2] == [0.25, -1.5]  # running_mean follows the parameters
    back = codec.to_record(vector, ints).to_torch_state_dict()
    for name, tensor in source.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_model_codec_refuses_another_architecture():
    with pytest.raises(ValueError, match="state_dict"):
        ModelCodec(_Norm()).from_record(ArrayRecord(torch.nn.Linear(3, 2).state_dict()))


def test_weighted_metrics_by_hand():
    """(0.5 * 1 + 1.0 * 3) / 4 = 0.875; a metric missing on one node is averaged over the others."""
    out = weighted_metrics(
        [MetricRecord({"num-examples": 1, "acc": 0.5, "loss": 2.0}), MetricRecord({"num-examples": 3, "acc": 1.0})]
    )
    assert out["acc"] == pytest.approx(0.875)
    assert out["loss"] == pytest.approx(2.0)
    assert out["num-examples"] == 4
    assert weighted_metrics([]) is None


# ---------------------------------------------------------------------------------------------------- setup


class _AdamClassifier(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_build_refuses_an_optimizer_the_rule_does_not_describe():
    """FedNova's ||a_i||_1 assumes SGD: an Adam client is refused before round 0, as in the simulation."""
    strategy = FedHetFlowerStrategy(_AdamClassifier(), FedNova(), num_clients=2)
    with pytest.raises(ValueError, match="FedNova"):
        strategy.build(NodeMap([5, 6]), [3, 4], ArrayRecord(_AdamClassifier().state_dict()))


def test_build_makes_the_server_from_the_initial_arrays_and_sizes():
    """Slip caught: w_0 taken from the server's template module instead of the ArrayRecord Flower starts from,
    or the clients' sizes lost (the rules' n_i)."""
    start = TinyClassifier()
    with torch.no_grad():
        start.linear.bias.fill_(0.5)
    strategy = FedHetFlowerStrategy(TinyClassifier(), FedAvg(), num_clients=2, client_weights="samples")
    strategy.build(NodeMap([5, 6]), [3, 9], ArrayRecord(start.state_dict()))
    assert torch.equal(strategy.global_params, FlatModel(start).get())
    assert strategy.server.client_sizes.tolist() == [3, 9] and strategy.server.streams is None  # sizes, no data
    assert strategy.algorithm.client_weights.tolist() == [0.25, 0.75]  # 3/12, 9/12
    with pytest.raises(ValueError, match="sizes has 1 entries"):
        other = FedHetFlowerStrategy(TinyClassifier(), num_clients=2)
        other.build(NodeMap([5, 6]), [3], ArrayRecord(start.state_dict()))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_clients=0), "num_clients"),
        (dict(num_clients=2, client_weights="equal"), "client_weights"),
        (dict(num_clients=2, local_steps=0), "local_steps"),
        (dict(num_clients=2, participation=Bernoulli(LabelCorrelated())), "label histogram"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FedHetFlowerStrategy(TinyClassifier(), **kwargs)


def test_a_spec_is_taken_and_what_only_a_simulation_has_is_refused():
    spec = FederationSpec(algorithm=FedAvg(), participation=Bernoulli(0.5), local_steps=3, num_clients=2, seed=4)
    strategy = FedHetFlowerStrategy(TinyClassifier(), spec=spec)
    assert strategy.spec is spec and strategy.algorithm is spec.algorithm
    assert (strategy.num_clients, strategy.local_steps, strategy.seed) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"cannot simulate channel=LossyChannel\(.*\), optimizer_state='persist'"):
        FedHetFlowerStrategy(TinyClassifier(), spec=FederationSpec(num_clients=2, channel=LossyChannel(0.1),
                                                                   optimizer_state="persist"))
    with pytest.raises(ValueError, match="needs the spec's num_clients"):
        FedHetFlowerStrategy(TinyClassifier(), spec=FederationSpec())
    with pytest.raises(TypeError, match="needs num_clients="):
        FedHetFlowerStrategy(TinyClassifier())
    with pytest.raises(TypeError, match="not both: got spec= and local_steps"):
        FedHetFlowerStrategy(TinyClassifier(), local_steps=2, spec=spec)


def test_module_must_be_a_torch_module():
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        FedHetFlowerStrategy(F.relu, num_clients=2)
