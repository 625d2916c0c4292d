"""The Flower bridge's pure parts by hand: the node map at its edges, the metrics' weighted mean, the count of
rejected replies over a history, the checkpoint's configuration and its refusals, and the log line of every rejected
reply. Written for the survivors of the ``flower`` mutation chunk (docs/testing.md): each case names the slip it
catches, and each expected value or message is written out here.
"""

from __future__ import annotations

import io
import logging
import math

import numpy as np
import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402

from lightning_fedhet import UniformSample  # noqa: E402
from lightning_fedhet.algorithms import FedAvg  # noqa: E402
from lightning_fedhet.flower import FedHetFlowerStrategy, ModelCodec, NodeMap  # noqa: E402
from lightning_fedhet.flower.aggregation import submit_replies  # noqa: E402
from lightning_fedhet.flower.protocol import weighted_metrics  # noqa: E402
from lightning_fedhet.flower.replies import REASONS, RejectedReply, ReplyCheck, count_rejections  # noqa: E402
from lightning_fedhet.participation import Bernoulli, Full, Trace  # noqa: E402

NODES = [101, 202]


pytestmark = pytest.mark.usefixtures("task_identity")  # tests/flower/conftest.py


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)


def _built(nodes=tuple(NODES), sizes=(3, 4), **kwargs) -> FedHetFlowerStrategy:
    settings = dict(num_clients=len(nodes), participation=Full(), seed=4)
    strategy = FedHetFlowerStrategy(_Net(), FedAvg(), **{**settings, **kwargs})
    strategy.build(NodeMap(nodes), list(sizes), ArrayRecord(_Net().state_dict()))
    return strategy


# ---------------------------------------------------------------------------------------------------- NodeMap
def test_node_maps_at_their_edges():
    # exactly num_clients nodes without partition ids are enough
    assert NodeMap.from_partitions({3: None, 1: None}, num_clients=2).node_ids == [1, 3]
    # a partition beyond the clients is skipped, not the end of the search (node 1 comes first by id)
    assert NodeMap.from_partitions({1: 5, 2: 0, 3: 1}, num_clients=2).node_ids == [2, 3]
    # partition num_clients is beyond the clients too: two nodes naming it are no conflict
    assert NodeMap.from_partitions({1: 0, 2: 1, 3: 2, 4: 2}, num_clients=2).node_ids == [1, 2]


def _refused_map(partitions, num_clients) -> str:
    with pytest.raises(ValueError) as refused:
        NodeMap.from_partitions(partitions, num_clients=num_clients)
    return str(refused.value)


def test_node_maps_that_cannot_be_made_say_how_to_fix_them():
    assert _refused_map({1: 0, 2: None, 3: None}, 3) == (
        "nodes [2, 3] have no partition-id in their node config while others do: give every node one "
        "(flower-supernode --node-config 'partition-id=<i>') or none")
    assert _refused_map({1: 0, 2: 2}, 3) == (
        "num_clients=3 but no node has partition-id [1] (partition ids name client ids 0 .. 2)")
    assert _refused_map({1: None}, 2) == "num_clients=2 but only 1 node(s) answered"


# ---------------------------------------------------------------------------------------------------- metrics
def test_weighted_metrics_refuse_what_cannot_be_weighed():
    # one record without num-examples: no mean can be weighed (not a mean of the others)
    assert weighted_metrics([MetricRecord({"num-examples": 2, "a": 1.0}), MetricRecord({"a": 3.0})]) is None
    # no examples at all: nothing to weigh with (and no division by zero)
    assert weighted_metrics([MetricRecord({"num-examples": 0, "a": 1.0})]) is None
    # one example is enough
    assert dict(weighted_metrics([MetricRecord({"num-examples": 1, "a": 0.25})])) == {"a": 0.25, "num-examples": 1}


# ---------------------------------------------------------------------------------------------------- rejections
def test_rejections_are_counted_over_the_history():
    # a reason met in two rounds adds up; a record without the entry (before any reply was checked) counts nothing;
    # a reason not in REASONS (an older history's) is counted from 0 under its own name
    history = [{"replies_rejected": {"failed": [1, 2]}}, {}, {"replies_rejected": {"failed": [3], "legacy": [4]}}]
    assert count_rejections(history) == {**dict.fromkeys(REASONS, 0), "failed": 3, "legacy": 1}
    assert count_rejections([]) == dict.fromkeys(REASONS, 0)


# ---------------------------------------------------------------------------------------------------- checkpoint
def test_the_checkpoint_configuration_names_each_setting_as_written():
    strategy = _built(participation=Bernoulli(0.5), local_steps=[1, 2], selection=UniformSample(1),
                      client_weights="samples", max_update_norm=3.0, update_norm_action="clip")
    assert strategy.state_dict()["configuration"] == {
        "algorithm": "FedAvg(weighting='participating', server_lr=1.0)",
        "num_clients": "2",
        "participation": "Bernoulli(p=0.5)",
        "local_steps": "[1, 2]",
        "selection": "UniformSample(k=1)",
        "seed": "4",
        "client_weights": "samples",
        "max_update_norm": "3.0",
        "update_norm_action": "clip",
        "model": "linear.weight:float32[2, 3], linear.bias:float32[2], norm.weight:float32[2], norm.bias:float32[2], "
                 "norm.running_mean:float32[2], norm.running_var:float32[2], norm.num_batches_tracked:int64[]",
        "client_sizes": "[3, 4]",
    }


def _refused_state(strategy, state) -> str:
    with pytest.raises(ValueError) as refused:
        strategy.load_state_dict(state)
    return str(refused.value)


def test_a_checkpoint_of_another_format_or_configuration_is_refused_naming_what_differs():
    strategy = _built()
    assert _refused_state(strategy, {"format": 2}) == (
        "not a FedHetFlowerStrategy checkpoint of format 1 (found format 2)")
    assert _refused_state(strategy, [1]) == "not a FedHetFlowerStrategy checkpoint of format 1 (found format 'list')"
    state = strategy.state_dict()
    # a key only the checkpoint has (or only this run) differs too; every difference is named, in key order
    state["configuration"] = {**state["configuration"], "seed": "5", "extra": "x"}
    assert _refused_state(strategy, state) == (
        "the checkpoint is of another configuration (extra: checkpoint 'x', this run None; seed: checkpoint '5', "
        "this run '4'): start a new checkpoint_path or run with the checkpoint's settings")


def test_a_checkpoint_goes_into_new_folders_and_loads_with_a_log_line(tmp_path, caplog):
    strategy = _built()
    path = tmp_path / "runs" / "a" / "server.pt"  # two folders that do not exist yet
    strategy.save_checkpoint(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["server.pt"]
    with caplog.at_level(logging.INFO, logger="flwr"):
        _built().load_checkpoint(path)
    assert f"FedHetFlowerStrategy: loaded {path} (next round 0)" in caplog.messages


def test_an_unreadable_checkpoint_names_the_file_and_the_error(tmp_path):
    path = tmp_path / "server.pt"
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError) as refused:
        _built().load_checkpoint(path)
    assert str(refused.value).startswith(f"checkpoint '{path}' cannot be read (UnpicklingError: ")


# ---------------------------------------------------------------------------------------------------- aggregation
def _round_zero(strategy):
    """Round 0 opened: its train messages by client id, with the message ids Flower's grid would give them."""
    messages = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), _Grid(strategy.nodes.node_ids))
    by_client = {strategy.nodes.client(m.metadata.dst_node_id): m for m in messages}
    for client, message in by_client.items():
        message.metadata.__dict__["_message_id"] = f"message-{client}"
    return by_client


class _Grid:
    """The part of Flower's Grid that configure_train asks: the connected nodes (here the run's own)."""

    def __init__(self, nodes) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def _reply(request: Message, sender: int | None = None, state: dict | None = None) -> Message:
    content = RecordDict({"arrays": ArrayRecord(_Net().state_dict() if state is None else state),
                          "metrics": MetricRecord({"num-examples": 4, "train_loss": 0.5})})
    reply = Message(content, reply_to=request)
    if sender is not None:
        reply.metadata.__dict__["_src_node_id"] = sender
    return reply


def test_submit_replies_needs_an_open_round():
    strategy = _built()
    with pytest.raises(RuntimeError) as refused:
        submit_replies(strategy.server, strategy.nodes, strategy._replies, strategy.codec, [])
    assert str(refused.value) == "aggregate_train without an open round: configure_train must come first"


def test_each_rejected_reply_is_logged_with_its_round_node_reason_and_detail(caplog):
    strategy = _built()
    requests = _round_zero(strategy)
    crashed = Message(Error(code=0, reason="node crashed"), reply_to=requests[0])
    stranger = _reply(requests[1], sender=999)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(1, [crashed, stranger])
    logged = caplog.messages
    assert "round 0: rejected a reply from node 101 (failed): client 0: node crashed" in logged
    assert "round 0: rejected a reply from node 999 (unknown-node): the node is no client of this run" in logged


def test_only_an_error_reply_is_placed_by_the_message_it_answers():
    # a well-formed reply counts under its sender (node 202, client 1), whatever message it answers (client 0's);
    # the message-to-node map is for the SuperLink's errors, which come from the SuperLink
    strategy = _built()
    requests = _round_zero(strategy)
    strategy.aggregate_train(1, [_reply(requests[0], sender=NODES[1])])
    assert strategy.history[-1]["received"].tolist() == [1]
    # an error that answers no message of this round (its id unknown) counts under the node it came from
    strategy = _built()
    requests = _round_zero(strategy)
    lost = Message(Error(code=3, reason="gone"), reply_to=_stray_request())
    lost.metadata.__dict__["_src_node_id"] = NODES[0]
    strategy.aggregate_train(1, [lost, _reply(requests[1])])
    assert strategy.history[-1]["replies_rejected"] == {"failed": [NODES[0]]}


def _stray_request() -> Message:
    request = Message(RecordDict(), message_type="train", dst_node_id=NODES[0], group_id="fedhet-round-0")
    request.metadata.__dict__["_message_id"] = "message-of-no-round"
    return request


# ---------------------------------------------------------------------------------------------------- ReplyCheck
def _check_fails(reply: Message) -> tuple[str, str]:
    with pytest.raises(RejectedReply) as refused:
        ReplyCheck(_Net()).state_dict(reply)
    return refused.value.reason, str(refused.value)


def _content(arrays: ArrayRecord | None = None, metrics: MetricRecord | None = None) -> Message:
    records = {}
    if arrays is not None:
        records["arrays"] = arrays
    if metrics is not None:
        records["metrics"] = metrics
    request = Message(RecordDict(), message_type="train", dst_node_id=NODES[0], group_id="fedhet-round-0")
    return Message(RecordDict(records), reply_to=request)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _with_array(name: str, array: Array) -> ArrayRecord:
    record = ArrayRecord(_Net().state_dict())
    record[name] = array
    return record


def test_each_refusal_of_a_replys_records_and_arrays_says_what_is_wrong():
    assert _check_fails(_content(metrics=MetricRecord({"train_loss": 0.1}))) == (
        "malformed", "no ArrayRecord 'arrays' (records: ['metrics'])")
    state = _Net().state_dict()
    state["evil"] = state.pop("linear.bias")
    assert _check_fails(_content(ArrayRecord(state))) == (
        "malformed", "the arrays' names are not the model's: missing ['linear.bias'], extra ['evil']")
    # declared float64 with the right shape: refused by its declaration, before anything is decoded
    state = _Net().state_dict()
    state["linear.weight"] = state["linear.weight"].double()
    assert _check_fails(_content(ArrayRecord(state))) == (
        "malformed", "'linear.weight' is declared numpy.ndarray float64 (2, 3), expected numpy.ndarray float32 (2, 3)")
    # declared with another stype only
    other = Array(dtype="float32", shape=(2,), stype="other", data=_npy(np.zeros(2, dtype=np.float32)))
    assert _check_fails(_content(_with_array("linear.bias", other))) == (
        "malformed", "'linear.bias' is declared other float32 (2,), expected numpy.ndarray float32 (2,)")
    # declared float32 (2,), but the bytes hold float64 (2,): refused once decoded, naming what they hold
    lying = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=_npy(np.zeros(2, dtype=np.float64)))
    assert _check_fails(_content(_with_array("linear.bias", lying))) == (
        "malformed", "'linear.bias' decodes to (dtype('float64'), (2,)), not its declared float32 (2,)")


def test_an_array_may_hold_its_payload_and_4096_bytes_more():
    # linear.bias: 2 float32 = 8 bytes, so at most 8 + 4096 = 4104 bytes; 4104 bytes of zeros are read (and are no
    # .npy), 4105 are refused unread
    at_bound = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"\0" * 4104)
    reason, detail = _check_fails(_content(_with_array("linear.bias", at_bound)))
    assert reason == "malformed" and detail.startswith("'linear.bias' cannot be decoded: ValueError: ")
    over = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"\0" * 4105)
    assert _check_fails(_content(_with_array("linear.bias", over))) == (
        "too-large", "'linear.bias' holds 4105 bytes, more than its 4104")
    # data that is no bytes (Flower's Array refuses it when made, not when set afterwards in the same process)
    forged = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"")
    forged.data = "0" * 8
    assert _check_fails(_content(_with_array("linear.bias", forged))) == (
        "too-large", "'linear.bias' holds str bytes, more than its 4104")


def test_the_training_loss_is_read_when_sent_and_refused_when_not_a_finite_number():
    good = ArrayRecord(_Net().state_dict())
    check = ReplyCheck(_Net())
    # none sent (no metrics, or metrics without it): NaN, which the rules that read losses report
    assert math.isnan(check.state_dict(_content(good))[1])
    assert math.isnan(check.state_dict(_content(good, MetricRecord({"num-examples": 3})))[1])
    assert check.state_dict(_content(good, MetricRecord({"train_loss": 0.25})))[1] == 0.25
    assert _check_fails(_content(good, MetricRecord({"train_loss": [0.5]}))) == (
        "malformed", "'train_loss' is list, not a number")
    assert _check_fails(_content(good, MetricRecord({"train_loss": float("inf")}))) == (
        "non-finite", "'train_loss' is inf")


def test_integer_buffers_refusals_name_the_reason_and_at_most_five_changes():
    with pytest.raises(RejectedReply) as refused:
        ReplyCheck.check_integers(torch.tensor([1, 2]), torch.tensor([1]), 3)
    assert refused.value.reason == "int-buffer"
    with pytest.raises(RejectedReply) as refused:
        ReplyCheck.check_integers(torch.tensor([1, 2, 4, 5, 6, 7, 0]), torch.zeros(7, dtype=torch.int64), 3)
    assert str(refused.value) == "integer buffers changed by [1, 2, 4, 5, 6], not by 0 or the round's 3 local steps"


# ---------------------------------------------------------------------------------------------------- codec, map
def test_the_codec_writes_the_integer_buffers_given_and_reads_in_the_dtype_asked():
    codec = ModelCodec(_Net())
    vector = torch.arange(16, dtype=torch.float32)  # 6 + 2 parameters, 2 + 2 + 2 + 2 float values more
    assert int(codec.to_record(vector, torch.tensor([9])).to_torch_state_dict()["norm.num_batches_tracked"]) == 9
    record = codec.to_record(vector)  # no integer buffers given: the vector alone
    floats, ints = codec.from_record(record, torch.float64)
    assert floats.dtype == torch.float64 and floats.tolist() == list(range(16))
    assert codec.from_state_dict(record.to_torch_state_dict(), torch.float64)[0].dtype == torch.float64


def test_node_maps_refuse_repeated_nodes_and_mask_as_booleans():
    with pytest.raises(ValueError) as refused:
        NodeMap([1, 1])
    assert str(refused.value) == "node_ids must be distinct, got [1, 1]"
    mask = NodeMap([5, 6]).mask([6, 9])
    assert mask.dtype == torch.bool and mask.tolist() == [False, True]


# ---------------------------------------------------------------------------------------------------- a round
def test_the_update_is_the_reply_minus_the_global_model_floats_and_counters():
    # global model w_0 with its counter at 5; one client, 2 local steps, sends w_0 + 1 and its counter at 7: the new
    # global model is w_0 + 1 (FedAvg of one update, server_lr 1) and the counter 5 + 2 = 7
    start = _Net()
    start.norm.num_batches_tracked.fill_(5)
    strategy = FedHetFlowerStrategy(_Net(), FedAvg(), num_clients=1, participation=Full(), seed=4, local_steps=2)
    strategy.build(NodeMap(NODES[:1]), [3], ArrayRecord(start.state_dict()))
    before = strategy.global_params.clone()
    messages = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), _Grid(NODES[:1]))
    trained = {k: v + 1 if v.is_floating_point() else v + 2 for k, v in start.state_dict().items()}
    content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 3})})
    strategy.aggregate_train(1, [Message(content, reply_to=list(messages)[0])])
    torch.testing.assert_close(strategy.global_params, before + 1, rtol=0, atol=1e-6)
    assert strategy.server.global_ints.tolist() == [7]


def test_each_reason_is_logged_with_its_detail(caplog):
    # 3 clients, client 2 not asked; client 0 answers twice, client 1 with a NaN
    strategy = _built((101, 202, 303), (3, 4, 5), participation=Trace(np.array([[1, 1, 0]], dtype=bool)),
                      max_update_norm=1.0)
    requests = _round_zero(strategy)
    nan_state = _Net().state_dict()
    nan_state["linear.weight"][0, 0] = float("nan")
    replies = [_reply(requests[0]), _reply(requests[0]), _reply(requests[1], state=nan_state),
               _reply(requests[0], sender=303)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(1, replies)
    assert _details(caplog) == {
        ("not-sent-work", 303): "client 2 was not asked to train in round 0",
        ("duplicate", 101): "2 replies for client 0",
        ("non-finite", 202): "the update has a NaN or an infinity (rejected by the Server)",
    }
    # round 0 of another run: a reply of another kind, a malformed model, an update longer than max_update_norm
    strategy = _built((101, 202, 303), (3, 4, 5), max_update_norm=1.0)
    requests = _round_zero(strategy)
    evaluate = Message(RecordDict(), message_type="evaluate", dst_node_id=101, group_id="fedhet-round-0")
    missing = _Net().state_dict()
    missing.pop("linear.bias")
    far = {k: v + 100 if v.is_floating_point() else v for k, v in _Net().state_dict().items()}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(1, [_reply(evaluate), _reply(requests[1], state=missing),
                                     _reply(requests[2], state=far)])
    assert _details(caplog) == {
        ("wrong-round", 101): "a 'evaluate' reply of group 'fedhet-round-0', not a train reply of round 0",
        ("malformed", 202): "the arrays' names are not the model's: missing ['linear.bias'], extra []",
        ("update-norm", 303): "the update is longer than max_update_norm=1.0",
    }


def _details(caplog) -> dict[tuple[str, int], str]:
    """(reason, node) -> detail of each 'round 0: rejected a reply from node N (reason): detail' line."""
    out = {}
    for message in caplog.messages:
        if not message.startswith("round 0: rejected a reply from node "):
            continue  # the round's other lines (who was selected, ...)
        head, _, detail = message.partition("): ")
        node, _, reason = head.removeprefix("round 0: rejected a reply from node ").partition(" (")
        out[(reason, int(node))] = detail
    return out
