"""What everyone outside a federated strategy reads of its run: the spec's settings, the history, the global model.

:class:`FederatedRun` is the declared face of ``FedHetStrategy`` and ``FedHetDDPStrategy`` (both inherit it through
``FederatedStrategyMixin``). The round callbacks (``lightning_fedhet.callbacks``) check a trainer's strategy against
this class, so they depend on it alone and not on the strategies, which add ``RoundMetrics`` to every fit: the
callbacks sit between this module and the strategies, and no import runs back up.
"""

from __future__ import annotations

import torch

from lightning_fedhet.config_summary import federated_config
from lightning_fedhet.server import Server
from lightning_fedhet.spec import FederationSpec, SpecSetting


class FederatedRun:
    """A federated run's public state: its :class:`~lightning_fedhet.spec.FederationSpec` (each setting also as an
    attribute of the same name: ``run.local_steps`` is ``run.spec.local_steps``) and its
    :class:`~lightning_fedhet.server.Server` (``None`` before the fit builds it)."""

    spec: FederationSpec
    server: Server | None = None

    # the spec's settings under the names the strategies always had (read-only: they are the spec's)
    algorithm = SpecSetting()
    participation = SpecSetting()
    local_steps = SpecSetting()
    selection = SpecSetting()
    channel = SpecSetting()
    latency = SpecSetting()
    deadline = SpecSetting()
    num_clients = SpecSetting()
    partitioner = SpecSetting()
    engine = SpecSetting()
    compile = SpecSetting()
    seed_argument = SpecSetting("seed")
    optimizer_state_mode = SpecSetting("optimizer_state")
    client_weights = SpecSetting()
    max_update_norm = SpecSetting()
    update_norm_action = SpecSetting()

    @property
    def seed(self) -> int:
        """The seed of every draw: the explicit one, else Lightning's global seed, else 0."""
        return self.spec.run_seed()

    def federated_config(self) -> dict:
        """The federated experiment as a flat, JSON-able dict (logged as every logger's hyper-parameters)."""
        return federated_config(self)

    @property
    def history(self) -> list[dict]:
        """One record per closed round (``[]`` before the first)."""
        return [] if self.server is None else self.server.history

    @property
    def rejected_total(self) -> int:
        """Client updates rejected as non-finite (or too large) so far."""
        return 0 if self.server is None else self.server.rejected_total

    @property
    def next_round(self) -> int:
        return 0 if self.server is None else self.server.next_round

    @property
    def global_params(self) -> torch.Tensor | None:
        """The current global model as a flat vector ``[d]`` (parameters, then floating buffers); None before fit."""
        return None if self.server is None else self.server.global_vector
