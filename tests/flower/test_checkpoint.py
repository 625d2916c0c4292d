"""Restarts: a ServerApp that dies and starts again from its server-side checkpoint, and a SuperNode that comes back
under a new node id, both carry on to the uninterrupted result.

The rounds run through Flower's own ``Strategy.start`` loop against an in-process grid that hands each message to
a ``LightningClient`` (one per node, each holding its partition of tests/flower/scenario.py), so no Ray start-up is
needed; test_equivalence.py checks the same client against the in-process simulation in Flower's runtime.
"""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import torch  # noqa: E402
from flwr.app import ArrayRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict  # noqa: E402

from lightning_fedhet.algorithms import FedAvg, FedVARP  # noqa: E402
from lightning_fedhet.flat import FlatModel  # noqa: E402
from lightning_fedhet.flower import FedHetFlowerStrategy, LightningClient  # noqa: E402
from lightning_fedhet.flower.protocol import QUERY  # noqa: E402
from tests.flower import scenario  # noqa: E402

NODE_IDS = [501, 502, 503, 504]  # node of partition 0, 1, 2, 3


pytestmark = pytest.mark.usefixtures("task_identity")  # tests/flower/conftest.py


class ServerKilled(RuntimeError):
    pass


class InProcessGrid:
    """The part of Flower's ``Grid`` the strategy uses, answering with LightningClient in this process.

    ``die_at_train`` kills the "ServerApp" when it sends its ``die_at_train``-th batch of train messages (1-based),
    i.e. in the middle of that round, after the previous round's checkpoint was written.
    """

    def __init__(self, die_at_train: int | None = None, after_train: dict | None = None) -> None:
        self.client = LightningClient(
            lambda context: scenario.module(),
            lambda context: scenario.node_dataset(int(context.node_config["partition-id"])),
            batch_size=scenario.BATCH_SIZE,
        )
        self.contexts = {
            node: Context(run_id=1, node_id=node, node_config={"partition-id": i}, state=RecordDict(), run_config={})
            for i, node in enumerate(NODE_IDS)
        }
        self.die_at_train = die_at_train
        self.train_batches = 0
        # train batch k -> what happens to the nodes right after it (see restart, join)
        self.after_train = after_train or {}
        self.node_ids = list(NODE_IDS)
        self.queried: list[int] = []

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def join(self, node: int, partition: int | None) -> None:
        """A node joins (``partition=None``: its node config names none)."""
        config = {} if partition is None else {"partition-id": partition}
        self.contexts[node] = Context(run_id=1, node_id=node, node_config=config, state=RecordDict(), run_config={})
        self.node_ids.append(node)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.train_batches += 1
            if self.train_batches == self.die_at_train:
                raise ServerKilled("the ServerApp process was killed in the middle of a round")
        handlers = {QUERY: self._query, MessageType.TRAIN: self.client.train}
        replies = []
        for m in messages:
            node = m.metadata.dst_node_id
            if node not in self.node_ids:  # what the SuperLink answers for a node that is gone
                replies.append(Message(Error(code=5, reason="node unavailable"), reply_to=m))
            else:
                replies.append(handlers[m.metadata.message_type](m, self.contexts[node]))
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.after_train.get(self.train_batches, lambda grid: None)(self)
        return replies

    def restart(self, old: int, new: int) -> None:
        """Node ``old`` is gone, and its SuperNode is back under node id ``new``."""
        partition = self.contexts[old].node_config["partition-id"]
        self.node_ids.remove(old)
        self.join(new, partition)

    def _query(self, msg: Message, context: Context) -> Message:
        self.queried.append(context.node_id)
        if "partition-id" not in context.node_config:  # a node of no partition holds no data here
            return Message(RecordDict({"metrics": MetricRecord({"num-examples": 0})}), reply_to=msg)
        return self.client.query(msg, context)


def _strategy(path=None, rule=FedVARP) -> FedHetFlowerStrategy:
    kwargs = scenario.strategy_kwargs("FedVARP")
    kwargs["algorithm"] = rule()
    return FedHetFlowerStrategy(scenario.module(), num_clients=scenario.NUM_CLIENTS, checkpoint_path=path, **kwargs)


def _start(strategy: FedHetFlowerStrategy, grid: InProcessGrid):
    return strategy.start(grid, ArrayRecord(scenario.module().state_dict()), num_rounds=scenario.ROUNDS, timeout=5)


def _same_history(mine: list[dict], theirs: list[dict]) -> None:
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], torch.Tensor):
                assert a[key].tolist() == b[key].tolist(), key
            else:
                assert a[key] == b[key], key


@pytest.fixture(scope="module")
def uninterrupted():
    strategy = _strategy()
    _start(strategy, InProcessGrid())
    return strategy


def test_a_killed_server_resumed_from_its_checkpoint_equals_the_uninterrupted_run(uninterrupted, tmp_path):
    """The ServerApp dies in the middle of round 1 (its round-0 checkpoint written); a new one started with the same
    arguments loads the checkpoint, runs rounds 1 and 2 only, and ends on the uninterrupted global model and
    history. FedVARP's per-client memories and a trace in which every client misses a round make the rule's state
    matter. Slip caught: memories, the history or the round counter not restored (round 0 re-run, or round 1 drawn
    as round 0), the participation or selection drawn from a restarted stream, or the checkpoint written mid-round."""
    path = tmp_path / "server.pt"
    with pytest.raises(ServerKilled):
        _start(_strategy(path), InProcessGrid(die_at_train=2))
    assert path.exists() and not path.with_name("server.pt.partial").exists()
    resumed = _strategy(path)
    grid = InProcessGrid()
    _start(resumed, grid)
    assert grid.train_batches == scenario.ROUNDS - 1  # round 0 was not trained again
    assert float((resumed.global_params - uninterrupted.global_params).abs().max()) <= 1e-6
    assert float((resumed.global_params - FlatModel(scenario.module()).get()).abs().max()) > 1e-2  # the rounds moved it
    _same_history(resumed.history, uninterrupted.history)
    # a third start on the finished run's checkpoint trains nothing and keeps the model
    finished = _strategy(path)
    grid = InProcessGrid()
    _start(finished, grid)
    assert grid.train_batches == 0 and torch.equal(finished.global_params, resumed.global_params)


def test_the_checkpoint_holds_the_rules_memories(uninterrupted, tmp_path):
    """Slip caught: a checkpoint without the rule's state (a resumed FedVARP would start from empty memories)."""
    path = tmp_path / "server.pt"
    uninterrupted.save_checkpoint(path)
    state = torch.load(path, weights_only=True)
    assert state["server"]["next_round"] == scenario.ROUNDS
    loaded = _strategy()
    loaded.build(uninterrupted.nodes, [int(s) for s in uninterrupted.server.client_sizes],
                 ArrayRecord(scenario.module().state_dict()))
    loaded.load_checkpoint(path)
    for key, value in uninterrupted.algorithm.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded.algorithm.state_dict()[key], value), key


def test_a_checkpoint_of_another_configuration_is_refused(uninterrupted, tmp_path):
    path = tmp_path / "server.pt"
    uninterrupted.save_checkpoint(path)
    other = _strategy(path, rule=FedAvg)
    with pytest.raises(ValueError, match=r"another configuration \(algorithm: checkpoint .FedVARP\(.*this run .FedAvg"):
        _start(other, InProcessGrid())
    kwargs = {**scenario.strategy_kwargs("FedVARP"), "seed": scenario.SEED + 1}
    reseeded = FedHetFlowerStrategy(scenario.module(), num_clients=scenario.NUM_CLIENTS, checkpoint_path=path, **kwargs)
    with pytest.raises(ValueError, match=r"another configuration \(seed: checkpoint '7', this run '8'\)"):
        _start(reseeded, InProcessGrid())


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on the hand-made pickle below
def test_a_file_that_is_not_a_checkpoint_is_refused_without_running_it(tmp_path):
    """torch.load(weights_only=True): a pickle of arbitrary objects is refused, never unpickled."""
    path = tmp_path / "server.pt"
    path.write_bytes(pickle.dumps({"format": 1, "payload": _Pickled()}))
    with pytest.raises(ValueError, match="cannot be read"):
        _start(_strategy(path), InProcessGrid())
    assert not _Pickled.unpickled
    torch.save({"something": "else"}, path)
    with pytest.raises(ValueError, match="not a FedHetFlowerStrategy checkpoint"):
        _start(_strategy(path), InProcessGrid())


class _Pickled:
    unpickled = False

    def __init__(self) -> None:
        self.anything = 1

    def __setstate__(self, state):
        _Pickled.unpickled = True


def test_a_node_back_under_a_new_node_id_keeps_its_client_id_and_memories(uninterrupted):
    """Client 1's SuperNode dies after round 0 and comes back (no persistent key) as node 602 before round 1, in
    which the trace makes client 1 available: the strategy asks the newcomer its partition-id, moves client 1 to
    node 602, and the run equals the uninterrupted one (the same clients train, FedVARP's memory of client 1 is
    used). Slip caught: a node map fixed for the whole run (client 1 never trains again), or the newcomer taken as a
    new client (memories lost)."""
    strategy = _strategy()
    grid = InProcessGrid(after_train={1: lambda grid: grid.restart(NODE_IDS[1], 602)})
    _start(strategy, grid)
    assert strategy.nodes.node_ids == [NODE_IDS[0], 602, NODE_IDS[2], NODE_IDS[3]]
    assert 1 in strategy.history[1]["received"].tolist()
    assert float((strategy.global_params - uninterrupted.global_params).abs().max()) <= 1e-6
    _same_history(strategy.history, uninterrupted.history)


def test_newcomers_that_are_no_clients_are_not_adopted():
    """A node naming no partition is asked once and never again; a node claiming client 0 while client 0's node is
    still connected does not take it over (asked again each round, in case the old node is only timing out).
    Slip caught: a hijack of a connected client's id, or a query to every stranger every round."""
    strategy = _strategy()
    # after round 0: a node of no partition, and an impostor of client 0, whose node 501 stays connected
    grid = InProcessGrid(after_train={1: lambda grid: (grid.join(700, None), grid.join(701, 0))})
    _start(strategy, grid)
    assert strategy.nodes.node_ids == NODE_IDS
    assert grid.queried.count(700) == 1
    assert grid.queried.count(701) == scenario.ROUNDS - 1  # before rounds 1 and 2
