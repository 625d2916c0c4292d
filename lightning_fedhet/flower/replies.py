"""Train replies are untrusted input: each is checked before anything of it reaches the Server or the rule.

Anyone who can reach the SuperLink with a registered node may answer anything, so :class:`ReplyCheck` reads a reply
as data, never as the model's own ``state_dict``: it checks who sent it and for which round, then the record's keys,
each array's declared dtype, shape and byte size (before decoding it, so a huge array is refused unread), then the
decoded array against the declaration (so a lying header is refused too), then the integer buffers against the
global ones (:meth:`ReplyCheck.check_integers`; ``max_update_norm`` bounds the float parameters only). A reply that
fails is rejected with one of the reasons below, counted in the round's history (``history[t]["replies_rejected"]``:
reason -> node ids) and logged; the round goes on with the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord
from torch import Tensor, nn

from lightning_fedhet.flower.protocol import ARRAYS, METRICS, TRAIN_LOSS

#: reasons a train reply is not aggregated (the keys of ``history[t]["replies_rejected"]``)
FAILED = "failed"  # the node answered an error (it crashed, timed out, or its ClientApp raised): a lost upload
UNKNOWN_NODE = "unknown-node"  # the sender is no client of this run
NOT_SENT_WORK = "not-sent-work"  # the sender's client was not asked to train this round
WRONG_ROUND = "wrong-round"  # the reply answers another round's message (or is not a train reply)
DUPLICATE = "duplicate"  # several replies claim the same client this round: all of them are refused
MALFORMED = "malformed"  # records, keys, dtypes, shapes or metrics are not the model's
TOO_LARGE = "too-large"  # an array holds more bytes than the model's array of that name
NON_FINITE = "non-finite"  # a NaN or an infinity in the weights or the training loss (rejected by the Server)
UPDATE_NORM = "update-norm"  # ||w_i - w_t|| > max_update_norm with update_norm_action="reject" (by the Server)
INT_BUFFER = "int-buffer"  # an integer buffer (a step counter) moved by other than 0 or the round's local steps
REASONS = (
    FAILED, UNKNOWN_NODE, NOT_SENT_WORK, WRONG_ROUND, DUPLICATE, MALFORMED, TOO_LARGE, NON_FINITE, UPDATE_NORM,
    INT_BUFFER,
)

#: bytes an array's serialised form may hold beyond its payload (NumPy's .npy header, 64 to a few hundred bytes)
HEADER_SLACK = 4096


def round_group(round: int) -> str:
    """The ``group_id`` of round ``round``'s train messages (a reply carries its request's ``group_id``)."""
    return f"fedhet-round-{int(round)}"


class RejectedReply(ValueError):
    """A reply that is not aggregated; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class _Expected:
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def max_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize + HEADER_SLACK


class ReplyCheck:
    """Checks train replies against the model a module's ``state_dict`` describes.

    Args:
        module: a module of the trained architecture (its ``state_dict`` names, dtypes and shapes are the
            only ones accepted).
    """

    def __init__(self, module: nn.Module) -> None:
        self.expected: dict[str, _Expected] = {
            name: _Expected(np.dtype(str(tensor.dtype).removeprefix("torch.")), tuple(tensor.shape))
            for name, tensor in module.state_dict().items()
        }

    def check_envelope(self, reply: Message, round: int) -> None:
        """Raise :class:`RejectedReply` (``wrong-round``) unless ``reply`` is a train reply to round ``round``."""
        metadata = reply.metadata
        if metadata.message_type != MessageType.TRAIN or metadata.group_id != round_group(round):
            raise RejectedReply(
                WRONG_ROUND,
                f"a {metadata.message_type!r} reply of group {metadata.group_id!r}, not a train reply of round {round}",
            )

    def state_dict(self, reply: Message) -> tuple[dict[str, Tensor], float]:
        """The reply's model as a ``state_dict`` of the expected names, dtypes and shapes, and its training loss
        (NaN when it sends none). Raises :class:`RejectedReply` otherwise."""
        content = reply.content
        if ARRAYS not in content.array_records:
            raise RejectedReply(MALFORMED, f"no ArrayRecord {ARRAYS!r} (records: {sorted(content.keys())})")
        record = content.array_records[ARRAYS]
        state = self._arrays(record)
        loss = self._loss(content.metric_records.get(METRICS))
        return state, loss

    def _arrays(self, record: ArrayRecord) -> dict[str, Tensor]:
        names = set(record.keys())
        if names != set(self.expected):
            missing, extra = sorted(set(self.expected) - names), sorted(names - set(self.expected))
            raise RejectedReply(MALFORMED, f"the arrays' names are not the model's: missing {missing}, extra {extra}")
        # every declaration and size first, so that nothing is decoded from a reply that is refused anyway
        for name, want in self.expected.items():
            array = record[name]
            if not isinstance(array.data, bytes) or len(array.data) > want.max_bytes:
                size = len(array.data) if isinstance(array.data, bytes) else type(array.data).__name__
                raise RejectedReply(TOO_LARGE, f"{name!r} holds {size} bytes, more than its {want.max_bytes}")
            if array.stype != "numpy.ndarray" or array.dtype != str(want.dtype) or tuple(array.shape) != want.shape:
                raise RejectedReply(
                    MALFORMED,
                    f"{name!r} is declared {array.stype} {array.dtype} {tuple(array.shape)}, expected "
                    f"numpy.ndarray {want.dtype} {want.shape}",
                )
        state = {}
        for name, want in self.expected.items():
            try:
                value = record[name].numpy()
            except Exception as err:  # any decoding failure of untrusted bytes is a malformed reply
                raise RejectedReply(MALFORMED, f"{name!r} cannot be decoded: {type(err).__name__}: {err}") from err
            if not isinstance(value, np.ndarray) or value.dtype != want.dtype or value.shape != want.shape:
                got = (getattr(value, "dtype", None), getattr(value, "shape", None))
                raise RejectedReply(MALFORMED, f"{name!r} decodes to {got}, not its declared {want.dtype} {want.shape}")
            state[name] = torch.from_numpy(np.array(value, copy=True))
        return state

    @staticmethod
    def check_integers(ints: Tensor, expected: Tensor, local_steps: int) -> None:
        """Raise :class:`RejectedReply` (``int-buffer``) unless every integer buffer of the reply (int64 ``[m]``, the
        flat form of e.g. BatchNorm's ``num_batches_tracked``) equals the global value ``expected`` or the global
        value plus the client's ``local_steps`` this round.

        ``max_update_norm`` bounds the float parameters only, so the integer buffers need a check of their own: the
        only integer buffers of the library's models are step counters, which a client's round advances by one per
        local step (a layer that runs) or leaves alone (a layer that does not); any other value (a counter sent back
        by a million, or negative) would move the global counter, averaged with the others, and is refused.
        """
        if ints.shape != expected.shape:
            raise RejectedReply(INT_BUFFER, f"{ints.numel()} integer buffer entries, expected {expected.numel()}")
        change = ints.to(torch.int64) - expected.to(torch.int64)
        bad = ~((change == 0) | (change == int(local_steps)))
        if bool(bad.any()):
            wrong = sorted({int(c) for c in change[bad].tolist()})[:5]
            raise RejectedReply(
                INT_BUFFER,
                f"integer buffers changed by {wrong}, not by 0 or the round's {int(local_steps)} local steps",
            )

    @staticmethod
    def _loss(metrics: MetricRecord | None) -> float:
        if metrics is None or TRAIN_LOSS not in metrics:
            return float("nan")  # a plain Flower ClientApp need not send one; the rules that read it say so
        value = metrics[TRAIN_LOSS]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RejectedReply(MALFORMED, f"{TRAIN_LOSS!r} is {type(value).__name__}, not a number")
        if not np.isfinite(value):
            raise RejectedReply(NON_FINITE, f"{TRAIN_LOSS!r} is {value}")
        return float(value)


def count_rejections(records: list[Mapping]) -> dict[str, int]:
    """Rejected replies per reason over history records (those without ``replies_rejected`` count nothing)."""
    totals = dict.fromkeys(REASONS, 0)
    for record in records:
        for reason, nodes in record.get("replies_rejected", {}).items():
            totals[reason] = totals.get(reason, 0) + len(nodes)
    return totals
