"""Train replies are untrusted: each malformed, forged or misplaced reply is rejected, counted, and never aggregated.

Replies are built by hand and pushed through ``configure_train`` / ``aggregate_train`` without a Flower runtime. The
oracle of "nothing accepted that should not be" is a second strategy fed only the well-formed replies: both global
models must be equal, and the history must name exactly the well-formed clients as received.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

pytest.importorskip("flwr")  # the core environment has none; scripts/ci_flower.sh runs this with Flower

import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_fedhet.algorithms import FedAvg  # noqa: E402
from lightning_fedhet.flower import FedHetFlowerStrategy, NodeMap  # noqa: E402
from lightning_fedhet.flower.replies import REASONS, round_group  # noqa: E402
from lightning_fedhet.participation import Trace  # noqa: E402

NODES = [101, 202, 303, 404]
SIZES = [3, 5, 2, 6]
# round 0: clients 0, 1, 2 train, client 3 is not asked (a reply from it was not sent work)
MASK = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
STRANGER = 999  # a node that is no client of the run
NORM_BOUND = 50.0
STEPS = 2  # every client's local steps: an honest BatchNorm counter (num_batches_tracked) advances by this much


class _Net(torch.nn.Module):
    """Float parameters, a float buffer and an int64 buffer: every dtype a reply can get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 10)
            self.linear.bias.zero_()


pytestmark = pytest.mark.usefixtures("task_identity")  # tests/flower/conftest.py


class _Grid:
    def get_node_ids(self) -> list[int]:
        return list(NODES)


def _strategy(**kwargs) -> tuple[FedHetFlowerStrategy, dict[int, Message]]:
    """A strategy with round 0 open: its train messages by client id."""
    strategy = FedHetFlowerStrategy(
        _Net(), FedAvg(), num_clients=len(NODES), participation=Trace(MASK), seed=3, client_weights="samples",
        max_update_norm=NORM_BOUND, local_steps=STEPS, **kwargs,
    )
    strategy.build(NodeMap(NODES), SIZES, ArrayRecord(_Net().state_dict()))
    messages = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), _Grid())
    return strategy, {strategy.nodes.client(m.metadata.dst_node_id): m for m in messages}


def _trained_state(client: int) -> dict[str, torch.Tensor]:
    """What an honest client ``client`` sends back: the global model moved by a client-specific amount."""
    state = _Net().state_dict()
    state["linear.weight"] = state["linear.weight"] + 0.1 * (client + 1)
    state["linear.bias"] = state["linear.bias"] - 0.05 * client
    state["norm.running_mean"] = state["norm.running_mean"] + 0.01 * client
    state["norm.num_batches_tracked"] = state["norm.num_batches_tracked"] + STEPS
    return state


def _reply(
    request: Message, state: dict | None = None, loss: float = 0.5, arrays: ArrayRecord | None = None
) -> Message:
    record = arrays if arrays is not None else ArrayRecord({k: v.clone() for k, v in state.items()})
    content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 4, "train_loss": loss})})
    return Message(content, reply_to=request)


def _forged_request(node: int, group: str = round_group(0), message_type: str = MessageType.TRAIN) -> Message:
    """A request as if sent to ``node``: its reply then claims to come from ``node``."""
    return Message(RecordDict(), message_type=message_type, dst_node_id=node, group_id=group)


def _array_lying_about_its_shape(expected_shape) -> Array:
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(int(np.prod(expected_shape)) + 1, dtype=np.float32), allow_pickle=False)
    return Array(dtype="float32", shape=tuple(expected_shape), stype="numpy.ndarray", data=buffer.getvalue())


# ------------------------------------------------------------------------------------------ the kinds of reply
# each kind: (reason it is rejected for, or None when well formed; builder(request, client) -> list of replies)


def _with(state_change):
    def build(request, client):
        state = _trained_state(client)
        state_change(state)
        return [_reply(request, state)]

    return build


def _arrays(change):
    def build(request, client):
        record = ArrayRecord(_trained_state(client))
        change(record)
        return [_reply(request, arrays=record)]

    return build


def _pop(state, key):
    state.pop(key)


KINDS = {
    "good": (None, lambda request, client: [_reply(request, _trained_state(client))]),
    "error": ("failed", lambda request, client: [Message(Error(code=0, reason="node crashed"), reply_to=request)]),
    "missing-key": ("malformed", _with(lambda s: _pop(s, "linear.bias"))),
    "extra-key": ("malformed", _with(lambda s: s.__setitem__("evil", torch.zeros(2)))),
    "renamed-key": ("malformed", _with(lambda s: s.__setitem__("linear.bias2", s.pop("linear.bias")))),
    "wrong-shape": ("malformed", _with(lambda s: s.__setitem__("linear.bias", torch.zeros(3)))),
    "wrong-dtype": ("malformed", _with(lambda s: s.__setitem__("linear.weight", s["linear.weight"].double()))),
    "int-as-float": ("malformed", _with(lambda s: s.__setitem__("norm.num_batches_tracked", torch.tensor(1.0)))),
    "huge-array": ("too-large", _with(lambda s: s.__setitem__("linear.weight", torch.zeros(2000, 3)))),
    "huge-bytes": (
        "too-large",
        _arrays(lambda r: r.__setitem__(
            "linear.bias", Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"\0" * 10**6)
        )),
    ),
    "lying-header": (
        "malformed", _arrays(lambda r: r.__setitem__("linear.weight", _array_lying_about_its_shape((2, 3))))
    ),
    "garbage-bytes": (
        "malformed",
        _arrays(lambda r: r.__setitem__(
            "linear.bias", Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"not numpy")
        )),
    ),
    "counter-jump": ("int-buffer", _with(lambda s: s.__setitem__("norm.num_batches_tracked", torch.tensor(10**12)))),
    "counter-back": ("int-buffer", _with(lambda s: s.__setitem__("norm.num_batches_tracked", torch.tensor(-5)))),
    "counter-off-by-one": ("int-buffer", _with(lambda s: s["norm.num_batches_tracked"].add_(1))),
    "nan-weight": ("non-finite", _with(lambda s: s["linear.weight"].__setitem__((0, 0), float("nan")))),
    "inf-buffer": ("non-finite", _with(lambda s: s["norm.running_var"].__setitem__(1, float("inf")))),
    "inf-loss": ("non-finite", lambda request, client: [_reply(request, _trained_state(client), loss=float("inf"))]),
    "too-long": ("update-norm", _with(lambda s: s.__setitem__("linear.weight", s["linear.weight"] + 1e3))),
    "no-arrays": (
        "malformed",
        lambda request, client: [Message(RecordDict({"metrics": MetricRecord({"train_loss": 0.1})}), reply_to=request)],
    ),
    "other-round": (
        "wrong-round",
        lambda request, client: [
            _reply(_forged_request(request.metadata.dst_node_id, group=round_group(7)), _trained_state(client))
        ],
    ),
    "not-train": (
        "wrong-round",
        lambda request, client: [
            _reply(_forged_request(request.metadata.dst_node_id, message_type=MessageType.EVALUATE),
                   _trained_state(client))
        ],
    ),
    "duplicate": (
        "duplicate",
        lambda request, client: [_reply(request, _trained_state(client)), _reply(request, _trained_state(client))],
    ),
}
# replies from outside the round: a node that is no client, a client that was not asked to train (client 3)
INTRUDERS = {
    "unknown-node": ("unknown-node", lambda: _reply(_forged_request(STRANGER), _trained_state(0))),
    "not-sent-work": ("not-sent-work", lambda: _reply(_forged_request(NODES[3]), _trained_state(3))),
}


def _reference(good_clients: list[int]) -> torch.Tensor:
    """The global model after round 0 when exactly ``good_clients`` answered, each well formed."""
    strategy, requests = _strategy()
    strategy.aggregate_train(1, [_reply(requests[c], _trained_state(c)) for c in good_clients])
    return strategy.global_params.clone()


def _run(kinds: dict[int, str], intruders: list[str], order: list[int] | None = None):
    strategy, requests = _strategy()
    replies, expected = [], {}
    for client, kind in kinds.items():
        reason, build = KINDS[kind]
        built = build(requests[client], client)
        replies += built
        if reason is not None:
            expected[reason] = expected.get(reason, 0) + len(built)
    for name in intruders:
        reason, build = INTRUDERS[name]
        replies.append(build())
        expected[reason] = expected.get(reason, 0) + 1
    if order is not None:
        replies = [replies[i % len(replies)] for i in order] if replies else replies
        replies = list({id(r): r for r in replies}.values())  # a permutation: each reply once
    strategy.aggregate_train(1, replies)
    return strategy, expected


# ------------------------------------------------------------------------------------------ by hand


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "good"])
def test_each_bad_reply_is_rejected_counted_and_the_round_goes_on(kind):
    """Client 0 sends a bad reply of one kind, clients 1 and 2 good ones: the round closes on 1 and 2 alone, as if
    client 0 had never answered, and the reason is counted. Slip caught: a check missing for one kind (the bad
    model reaches the rule and moves the global model), a crash on it (the round is lost), or a wrong reason."""
    strategy, expected = _run({0: kind, 1: "good", 2: "good"}, [])
    record = strategy.history[-1]
    assert record["received"].tolist() == [1, 2]
    assert {r: len(n) for r, n in record["replies_rejected"].items()} == expected
    assert torch.equal(strategy.global_params, _reference([1, 2]))
    assert strategy.rejected_replies[KINDS[kind][0]] == expected[KINDS[kind][0]]


@pytest.mark.parametrize("intruder", list(INTRUDERS))
def test_replies_from_outside_the_round_are_rejected(intruder):
    strategy, expected = _run({0: "good", 1: "good", 2: "good"}, [intruder])
    record = strategy.history[-1]
    assert record["received"].tolist() == [0, 1, 2]
    assert {r: len(n) for r, n in record["replies_rejected"].items()} == expected
    assert torch.equal(strategy.global_params, _reference([0, 1, 2]))


def test_honest_replies_are_all_taken_and_nothing_is_counted():
    strategy, _ = _run({0: "good", 1: "good", 2: "good"}, [])
    assert strategy.history[-1]["replies_rejected"] == {}
    assert sum(strategy.rejected_replies.values()) == 0 and set(strategy.rejected_replies) == set(REASONS)
    assert float((strategy.global_params - _Net_vector()).abs().max()) > 1e-2  # the round really moved the model


def test_non_finite_and_too_long_updates_are_also_in_the_servers_rejected_ids():
    """The Server saw them (and refused them before the rule): history["rejected"] names those clients."""
    strategy, _ = _run({0: "nan-weight", 1: "too-long", 2: "good"}, [])
    assert strategy.history[-1]["rejected"].tolist() == [0, 1]
    assert strategy.history[-1]["replies_rejected"] == {"non-finite": [NODES[0]], "update-norm": [NODES[1]]}


def test_integer_buffers_are_checked_not_bounded_by_the_norm():
    """``max_update_norm`` bounds the float parameters only, so the integer buffers have a check of their own: a
    counter that did not move (the layer did not run) or moved by the round's local steps is taken, and the global
    counter becomes their sample-weighted mean; one that jumped is refused although the float update is tiny. Slip
    caught: a forged num_batches_tracked (sent back by 10**12) reaching the global model, or an honest counter of a
    layer that did not run refused."""
    strategy, requests = _strategy()
    still = _trained_state(0)
    still["norm.num_batches_tracked"] = torch.tensor(0)  # client 0's BatchNorm did not run
    jumped = _trained_state(1)
    jumped["norm.num_batches_tracked"] = torch.tensor(10**12)
    replies = [_reply(requests[0], still), _reply(requests[1], jumped), _reply(requests[2], _trained_state(2))]
    strategy.aggregate_train(1, replies)
    record = strategy.history[-1]
    assert record["received"].tolist() == [0, 2]
    assert record["replies_rejected"] == {"int-buffer": [NODES[1]]}
    # sample-weighted mean of the changes 0 (client 0, 3 samples) and 2 (client 2, 2 samples), rounded: 1
    assert strategy.server.global_ints.tolist() == [round((3 * 0 + 2 * STEPS) / 5)]


def test_the_superlinks_error_for_a_gone_node_counts_under_that_node():
    """A SuperNode that dies mid-round never answers; the SuperLink answers its message with an error of its own
    (``src_node_id`` the SuperLink's), naming the message only. It is counted under the node the message went to.
    Slip caught: the loss recorded under the SuperLink's id (tests/flower/test_deployment.py saw ``failed: [1]``)."""
    strategy, requests = _strategy()
    for client, message in requests.items():
        message.metadata.__dict__["_message_id"] = f"message-{client}"  # what Flower's grid sets when it pushes
    gone = Message(Error(code=3, reason="Node Unavailable"), reply_to=requests[0])
    gone.metadata.__dict__["_src_node_id"] = 1  # the SuperLink's answer
    strategy.aggregate_train(1, [gone, _reply(requests[1], _trained_state(1)), _reply(requests[2], _trained_state(2))])
    record = strategy.history[-1]
    assert record["received"].tolist() == [1, 2]
    assert record["replies_rejected"] == {"failed": [NODES[0]]}


def test_check_integers_by_hand():
    from lightning_fedhet.flower.replies import RejectedReply, ReplyCheck

    expected = torch.tensor([7, 0], dtype=torch.int64)
    ReplyCheck.check_integers(torch.tensor([7, 0]), expected, 3)
    ReplyCheck.check_integers(torch.tensor([10, 3]), expected, 3)
    ReplyCheck.check_integers(torch.tensor([7, 3]), expected, 3)  # one layer ran, the other did not
    for bad in ([9, 0], [6, 0], [10, 4], [7, 2**62]):
        with pytest.raises(RejectedReply, match="integer buffers changed by") as err:
            ReplyCheck.check_integers(torch.tensor(bad), expected, 3)
        assert err.value.reason == "int-buffer"
    with pytest.raises(RejectedReply, match="2 integer buffer entries, expected 1"):
        ReplyCheck.check_integers(torch.tensor([1, 2]), torch.tensor([1]), 3)


def _Net_vector() -> torch.Tensor:  # noqa: N802 - the initial global vector
    strategy, _ = _strategy()
    return strategy.global_params.clone()


# ------------------------------------------------------------------------------------------ fuzz


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    kinds=st.fixed_dictionaries({c: st.sampled_from(sorted(KINDS)) for c in range(3)}),
    intruders=st.lists(st.sampled_from(sorted(INTRUDERS)), max_size=3),
    order=st.permutations(range(12)),
)
def test_fuzz_only_well_formed_replies_are_accepted(kinds, intruders, order):
    """Any mix of bad kinds, intruders and arrival order: no crash, the received clients are exactly those whose one
    reply was well formed, every other reply is counted under its reason, and the global model is the one the
    well-formed replies alone give. Slip caught: a check that depends on the order of arrival, a duplicate taken
    when its twin comes first, or a rejected reply that still reached the rule."""
    strategy, expected = _run(kinds, intruders, order)
    good = sorted(c for c, kind in kinds.items() if kind == "good")
    record = strategy.history[-1]
    assert record["received"].tolist() == good
    assert {r: len(n) for r, n in record["replies_rejected"].items()} == expected
    assert torch.equal(strategy.global_params, _reference(good))
