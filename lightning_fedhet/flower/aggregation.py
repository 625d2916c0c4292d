"""One round's train replies, from Flower's messages to the Server: checked, then submitted in client-id order.

:func:`submit_replies` is the body of :meth:`FedHetFlowerStrategy.aggregate_train
<lightning_fedhet.flower.strategy.FedHetFlowerStrategy.aggregate_train>` before the Server closes the round. Every
reply is untrusted (see :mod:`lightning_fedhet.flower.replies` for the checks and the reasons of a rejection).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import torch
from flwr.app import Message

from lightning_fedhet.flower.nodes import NodeMap
from lightning_fedhet.flower.protocol import ModelCodec
from lightning_fedhet.flower.replies import (
    DUPLICATE,
    FAILED,
    NON_FINITE,
    NOT_SENT_WORK,
    UNKNOWN_NODE,
    UPDATE_NORM,
    RejectedReply,
    ReplyCheck,
)
from lightning_fedhet.server import Server

log = logging.getLogger("flwr")  # Flower's logger: the messages appear with Flower's own


def submit_replies(
    server: Server,
    nodes: NodeMap,
    check: ReplyCheck,
    codec: ModelCodec,
    replies: Iterable[Message],
    sent: Mapping[str, int] | None = None,
) -> tuple[dict[str, list[int]], list[float]]:
    """Check every reply of the open round and submit the good ones' updates ``w_i - w_t`` to ``server``.

    ``sent`` maps the message id of each train message to its node: an error reply the SuperLink makes for a node
    that is gone (``NODE_UNAVAILABLE``) comes from the SuperLink, and is counted under the node its message went to.

    Returns ``(refused, losses)``: the node ids of the rejected replies per reason, and the training losses of the
    accepted ones. The updates go to the Server in client-id order (the simulation's, so the float sums are the
    same); the round is left open.
    """
    plan = server.plan
    if plan is None:
        raise RuntimeError("aggregate_train without an open round: configure_train must come first")
    refused: dict[str, list[int]] = {}

    def refuse(node: int, reason: str, detail: str) -> None:
        refused.setdefault(reason, []).append(int(node))
        log.warning("round %d: rejected a reply from node %d (%s): %s", plan.round, node, reason, detail)

    claims: dict[int, list[tuple[int, Message]]] = {}
    for reply in replies:
        node = int(reply.metadata.src_node_id)
        if reply.has_error() and sent:
            node = int(sent.get(reply.metadata.reply_to_message_id, node))
        client = nodes.client(node)
        if reply.has_error():
            refuse(node, FAILED, f"client {client}: {reply.error.reason}")
        elif client is None:
            refuse(node, UNKNOWN_NODE, "the node is no client of this run")
        elif not bool(plan.trained[client]):
            refuse(node, NOT_SENT_WORK, f"client {client} was not asked to train in round {plan.round}")
        else:
            try:
                check.check_envelope(reply, plan.round)
            except RejectedReply as err:
                refuse(node, err.reason, str(err))
                continue
            claims.setdefault(client, []).append((node, reply))
    losses = []
    for client in sorted(claims):  # the simulation's order, so the float sums are the same
        if len(claims[client]) > 1:  # which one is the node's is unknowable: none is taken
            for node, _ in claims[client]:
                refuse(node, DUPLICATE, f"{len(claims[client])} replies for client {client}")
            continue
        node, reply = claims[client][0]
        try:
            state, loss = check.state_dict(reply)
            vector, ints = codec.from_state_dict(state)
            check.check_integers(ints, server.global_ints, int(plan.local_steps[client]))
        except RejectedReply as err:
            refuse(node, err.reason, str(err))
            continue
        delta = vector.to(server.global_vector) - server.global_vector
        int_delta = ints - server.global_ints if server.global_ints.numel() else None
        if server.submit(client, delta, loss, int_delta=int_delta):
            losses.append(loss)
        elif not bool(torch.isfinite(delta).all()):
            refuse(node, NON_FINITE, "the update has a NaN or an infinity (rejected by the Server)")
        else:
            refuse(node, UPDATE_NORM, f"the update is longer than max_update_norm={server.max_update_norm}")
    return refused, losses
