"""What :class:`FedHetFlowerStrategy` and :class:`LightningClient` say to each other, and the model's two forms.

Every message follows Flower's conventions, so a plain Flower ``ClientApp`` that loads ``content["arrays"]``,
trains and replies ``{"arrays": ..., "metrics": {"num-examples": ...}}`` also works with the strategy:

* down (``train`` / ``evaluate``): ``"arrays"`` (``ArrayRecord`` of the global model's ``state_dict``), ``"config"``
  (``ConfigRecord``: the user's train config plus the ``fedhet.*`` keys below), and for ``train``
  ``"client-config"`` (``ConfigRecord``: the rule's per-client instructions, ``Algorithm.client_config``).
* up (``train``): ``"arrays"`` (the trained model's ``state_dict``) and ``"metrics"`` (``MetricRecord`` with
  ``num-examples`` and ``train_loss``). The server computes the update ``w_i - w_t`` itself.
* ``query.fedhet`` (once, before round 0): the client replies ``num-examples`` (``|D_i|``) and, when its node
  config names one, its ``partition-id``.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, MetricRecord
from torch import Tensor, nn

from lightning_fedhet.flat import FlatModel

#: record names inside a message's RecordDict
ARRAYS = "arrays"
CONFIG = "config"
CLIENT_CONFIG = "client-config"
METRICS = "metrics"
#: metric names
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train_loss"
LOCAL_STEPS_METRIC = "local-steps"
#: config keys of a train message
ROUND = "fedhet.round"  # 0-based round index t
CLIENT_ID = "fedhet.client-id"  # the client id the server gave this node
LOCAL_STEPS = "fedhet.local-steps"  # K_i(t)
SEED = "fedhet.seed"  # the run's seed (the client's mini-batch order derives from it)
SERVER_ROUND = "server-round"  # Flower's 1-based round, as Flower's own strategies send it
#: the node-config key naming a node's data partition (Flower's simulation sets it on every node)
PARTITION_ID = "partition-id"
#: the message type of the start-up query (an action of its own, so it cannot clash with a user's query handler)
QUERY = "query.fedhet"


class ModelCodec:
    """Converts the model between Flower's ``ArrayRecord`` (its ``state_dict``) and the server's flat vectors.

    The server holds the global model as a float vector ``[d]`` (parameters, then floating buffers) and an int64
    vector ``[m]`` (integer buffers such as ``num_batches_tracked``), as :class:`~lightning_fedhet.flat.FlatModel`
    lays them out; the wire carries the module's ``state_dict``, so any client can load it.

    Args:
        module: a module of the trained architecture; its weights are overwritten by every conversion.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.flat = FlatModel(module)

    def to_record(self, vector: Tensor, ints: Tensor | None = None) -> ArrayRecord:
        """The ``state_dict`` whose flat form is ``vector`` (``[d]``) and ``ints`` (int64 ``[m]``)."""
        self.flat.set(vector)
        if ints is not None and ints.numel():
            self.flat.set_ints(ints)
        return ArrayRecord(self.module.state_dict())

    def from_record(self, record: ArrayRecord, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """The flat float vector ``[d]`` and int64 vector ``[m]`` of a ``state_dict`` record.

        Raises ``ValueError`` when the record's keys or shapes are not the module's.
        """
        return self.from_state_dict(record.to_torch_state_dict(), dtype)

    def from_state_dict(self, state: dict[str, Tensor], dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """The flat float vector ``[d]`` and int64 vector ``[m]`` of a ``state_dict``.

        Raises ``ValueError`` when its keys or shapes are not the module's.
        """
        try:
            self.module.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ValueError(f"the ArrayRecord does not hold this model's state_dict: {err}") from err
        return self.flat.get(dtype), self.flat.get_ints()


def weighted_metrics(records: list[MetricRecord]) -> MetricRecord | None:
    """Each metric's mean over ``records`` weighted by their ``num-examples`` (``None`` when nobody answered)."""
    weights = [float(r[NUM_EXAMPLES]) for r in records if NUM_EXAMPLES in r]
    if not records or len(weights) != len(records) or sum(weights) <= 0:
        return None
    total = sum(weights)
    names = sorted({name for r in records for name in r if name != NUM_EXAMPLES})
    out = MetricRecord()
    for name in names:
        pairs = [(float(r[name]), w) for r, w in zip(records, weights) if name in r and not isinstance(r[name], list)]
        if pairs:
            out[name] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    out[NUM_EXAMPLES] = int(total)
    return out
