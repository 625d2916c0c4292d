"""The client side: a Flower ``ClientApp`` that trains the user's LightningModule with a Lightning ``Trainer``."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_fedhet._checks import check_int
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.flower.protocol import (
    ARRAYS,
    CLIENT_CONFIG,
    CLIENT_ID,
    CONFIG,
    LOCAL_STEPS,
    LOCAL_STEPS_METRIC,
    METRICS,
    NUM_EXAMPLES,
    PARTITION_ID,
    ROUND,
    SEED,
    TRAIN_LOSS,
)

#: the Trainer settings of a client's round (quiet, nothing written to disk); ``trainer_kwargs`` override them
TRAINER_DEFAULTS: dict[str, Any] = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def client_batches(num_samples: int, client: int, round: int, steps: int, batch_size: int, seed: int) -> list:
    """Positions ``[B]`` in the client's own dataset of each of its ``steps`` mini-batches in round ``round``.

    The same draw as the simulation's :class:`~lightning_fedhet.data.streams.ClientStreams` for client ``client``
    (a fresh permutation of its samples per round, seeded by ``(seed, round, client)``, mini-batches of
    ``min(batch_size, num_samples)``): when the client's dataset lists its samples in the order of its partition
    in the simulation, it trains on exactly the simulated mini-batches.
    """
    # a permutation of positions 0..n-1 equals the permutation of the partition's indices, read through them
    indices = [np.zeros(0, dtype=np.int64)] * client + [np.arange(num_samples, dtype=np.int64)]
    streams = ClientStreams(None, indices, batch_size=batch_size, seed=seed)
    return streams.batch_indices(round, client, steps)


class _StepLosses(Callback):
    """Keeps each local step's training loss (the mean is the reply's ``train_loss``, as in the simulation)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(loss.detach())

    def mean(self) -> float:
        return float(torch.stack(self.losses).float().mean()) if self.losses else math.nan


class LightningClient:
    """A Flower client that trains a LightningModule for the round's local steps with a Lightning ``Trainer``.

    Handles three message types (register them all with :meth:`client_app`, or each on your own ``ClientApp``):

    * ``train``: load the global model, apply the rule's per-client config (``module.configure_client(**config)``,
      e.g. Fed-CIS's exit), run ``fedhet.local-steps`` optimizer steps of the module's own ``training_step`` and
      optimizer, reply the trained weights, ``num-examples`` (``|D_i|``), ``train_loss`` (mean over the local steps)
      and ``local-steps``. From a strategy that sends no ``fedhet.*`` keys (one of Flower's own): one step, round
      0, the node's ``partition-id`` as client id, seed 0.
    * ``evaluate``: ``trainer.validate`` of the global model on ``val_data_fn(context)``; reply the logged metrics and
      ``num-examples``.
    * ``query.fedhet``: reply ``num-examples`` and the node config's ``partition-id`` (when set), once per run.

    Each message builds a fresh module (``module_fn``) and ``Trainer``, so every round starts from a fresh
    optimizer state, as the simulation's ``optimizer_state="reset"``; learning-rate schedulers restart too.
    The mini-batches are those of the simulation (see :func:`client_batches`), so a Flower run replays the
    simulated one; stochastic layers (dropout) draw from torch's global generator and do not.

    Args:
        module_fn: ``module_fn(context) -> LightningModule`` (its weights are overwritten by the global model).
        train_data_fn: ``train_data_fn(context) -> Dataset``: this node's training samples, in a fixed order.
        batch_size: local mini-batch size ``B`` (clients with fewer samples use all of them).
        val_data_fn: optional ``val_data_fn(context) -> Dataset`` for ``evaluate`` messages.
        collate_fn: optional collate function of the DataLoaders (default: torch's).
        trainer_kwargs: ``Trainer`` arguments (precision, gradient clipping, accelerator, callbacks, ...);
            ``max_steps``/``max_epochs`` are set by the round.
        quiet: silence Lightning's per-fit notices (devices found, tips, "no val_dataloader") that a client would
            otherwise print every round; warnings and errors still show.
    """

    def __init__(
        self,
        module_fn: Callable[[Context], pl.LightningModule],
        train_data_fn: Callable[[Context], Dataset],
        *,
        batch_size: int,
        val_data_fn: Callable[[Context], Dataset] | None = None,
        collate_fn: Callable | None = None,
        trainer_kwargs: dict[str, Any] | None = None,
        quiet: bool = True,
    ) -> None:
        self.module_fn = module_fn
        self.quiet = bool(quiet)
        self.train_data_fn = train_data_fn
        self.batch_size = check_int(batch_size, "batch_size")
        self.val_data_fn = val_data_fn
        self.collate_fn = collate_fn
        trainer_kwargs = dict(trainer_kwargs or {})
        for key in ("max_steps", "max_epochs", "limit_train_batches"):
            if key in trainer_kwargs:
                raise ValueError(
                    f"trainer_kwargs must not set {key!r}: the server's local steps set each round's length"
                )
        self.trainer_kwargs = trainer_kwargs

    # ------------------------------------------------------------------ handlers
    def query(self, msg: Message, context: Context) -> Message:
        """Reply ``num-examples`` and, when the node config has one, ``partition-id``."""
        metrics: dict[str, int] = {NUM_EXAMPLES: len(self.train_data_fn(context))}
        partition = context.node_config.get(PARTITION_ID)
        if partition is not None:
            metrics[PARTITION_ID] = int(partition)
        return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

    def train(self, msg: Message, context: Context) -> Message:
        """Train for the round's local steps and reply the trained weights and metrics."""
        config = msg.content[CONFIG] if CONFIG in msg.content.config_records else {}
        steps = int(config.get(LOCAL_STEPS, 1))
        client = int(config.get(CLIENT_ID, context.node_config.get(PARTITION_ID, 0)))
        round_ = int(config.get(ROUND, 0))
        seed = int(config.get(SEED, 0))
        module = self._load(msg, context)
        if CLIENT_CONFIG in msg.content.config_records and len(msg.content[CLIENT_CONFIG]):
            _configure_client(module, dict(msg.content[CLIENT_CONFIG]))
        dataset = self.train_data_fn(context)
        if len(dataset) == 0:
            raise ValueError(f"client {client} (node {context.node_id}) holds no training samples")
        batches = client_batches(len(dataset), client, round_, steps, self.batch_size, seed)
        loader = DataLoader(dataset, batch_sampler=[b.tolist() for b in batches], collate_fn=self.collate_fn)
        losses = _StepLosses()
        with self._quieted():
            trainer = self._trainer(losses, max_steps=steps, max_epochs=1, limit_val_batches=0)
            trainer.fit(module, train_dataloaders=loader)
        metrics = MetricRecord({NUM_EXAMPLES: len(dataset), TRAIN_LOSS: losses.mean(), LOCAL_STEPS_METRIC: steps})
        content = RecordDict({ARRAYS: ArrayRecord(_cpu_state(module)), METRICS: metrics})
        return Message(content, reply_to=msg)

    def evaluate(self, msg: Message, context: Context) -> Message:
        """Validate the global model on this node's validation data; reply the logged metrics."""
        if self.val_data_fn is None:
            raise ValueError("LightningClient got an evaluate message but was built without val_data_fn")
        module = self._load(msg, context)
        dataset = self.val_data_fn(context)
        loader = DataLoader(dataset, batch_size=self.batch_size, collate_fn=self.collate_fn)
        with self._quieted():
            results = self._trainer().validate(module, dataloaders=loader, verbose=False)
        metrics = {name: float(value) for name, value in (results[0] if results else {}).items()}
        metrics[NUM_EXAMPLES] = len(dataset)
        return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)

    def client_app(self) -> ClientApp:
        """A ``ClientApp`` with the three handlers registered."""
        app = ClientApp()
        app.train()(self.train)
        app.evaluate()(self.evaluate)
        app.query("fedhet")(self.query)
        return app

    # ------------------------------------------------------------------ pieces
    def _load(self, msg: Message, context: Context) -> pl.LightningModule:
        module = self.module_fn(context)
        module.load_state_dict(msg.content[ARRAYS].to_torch_state_dict(), strict=True)
        return module

    @contextlib.contextmanager
    def _quieted(self) -> Iterator[None]:
        if not self.quiet:
            yield
            return
        logger = logging.getLogger("lightning.pytorch")
        level = logger.level
        logger.setLevel(logging.WARNING)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*val_dataloader.*")
                yield
        finally:
            logger.setLevel(level)

    def _trainer(self, *callbacks: Callback, **round_kwargs: Any) -> pl.Trainer:
        kwargs = {**TRAINER_DEFAULTS, **self.trainer_kwargs, **round_kwargs}
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
        return pl.Trainer(**kwargs)


def _configure_client(module: pl.LightningModule, config: dict) -> None:
    configure = getattr(module, "configure_client", None)  # the user's module, not one of ours
    if configure is None:
        raise TypeError(
            f"the server's rule sends {sorted(config)} to each client: the LightningModule must define "
            "configure_client(**config) (EarlyExitClassifier does)"
        )
    configure(**config)


def _cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu() for name, tensor in module.state_dict().items()}
