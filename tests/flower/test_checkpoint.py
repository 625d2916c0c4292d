"""The server-side checkpoint: a ServerApp that dies and starts again with the same arguments carries on to the
uninterrupted result.

The rounds run through Flower's own ``Strategy.start`` loop against an in-process grid that hands each message to
a ``LightningClient`` (one per node, each holding its partition of tests/flower/scenario.py), so no Ray start-up is
needed; test_equivalence.py checks the same client against the in-process simulation in Flower's runtime.
"""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import torch  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from lightning_fedhet.algorithms import FedAvg, FedVARP  # noqa: E402
from lightning_fedhet.flat import FlatModel  # noqa: E402
from lightning_fedhet.flower import FedHetFlowerStrategy, LightningClient  # noqa: E402
from lightning_fedhet.flower.protocol import QUERY  # noqa: E402
from tests.flower import scenario  # noqa: E402

NODE_IDS = [501, 502, 503, 504]  # node of partition 0, 1, 2, 3


@pytest.fixture(scope="module", autouse=True)
def _task_identity():
    """What a ServerApp process has set when it builds messages (a Flower runtime sets it; here the test does)."""
    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved


class ServerKilled(RuntimeError):
    pass


class InProcessGrid:
    """The part of Flower's ``Grid`` the strategy uses, answering with LightningClient in this process.

    ``die_at_train`` kills the "ServerApp" when it sends its ``die_at_train``-th batch of train messages (1-based),
    i.e. in the middle of that round, after the previous round's checkpoint was written.
    """

    def __init__(self, die_at_train: int | None = None) -> None:
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

    def get_node_ids(self) -> list[int]:
        return list(NODE_IDS)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.train_batches += 1
            if self.train_batches == self.die_at_train:
                raise ServerKilled("the ServerApp process was killed in the middle of a round")
        handlers = {QUERY: self.client.query, MessageType.TRAIN: self.client.train}
        return [
            handlers[m.metadata.message_type](m, self.contexts[m.metadata.dst_node_id]) for m in messages
        ]


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
