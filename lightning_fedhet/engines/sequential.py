"""The sequential engine (default): one client at a time through Lightning's own training loop.

Each Lightning step is one local step of one client, so any LightningModule works unchanged: the user's
``training_step``, optimizer, precision plugin, gradient clipping and ``self.log`` all run as usual. At a client's
first step the engine loads what :meth:`Server.start_client` sends (global weights, the rule's config, the
optimizer state); after its last step the client's delta ``w_i - w_t`` goes to :meth:`Server.submit`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from lightning_fedhet.engines.base import Engine, export_optimizer_state
from lightning_fedhet.federation import RoundPlan


class SequentialEngine(Engine):
    """One client after another; see the module docstring."""

    name = "sequential"

    def __init__(self, compile: bool | str = False) -> None:
        super().__init__(compile)
        self._losses: list[torch.Tensor] = []

    def _round_batches(self, plan: RoundPlan) -> Iterator:
        return self.server.streams.iterate(plan.batches)

    def _position(self) -> tuple[int, int]:
        return self.plan.schedule[self.step]

    def on_batch_start(self) -> None:
        client, local_step = self._position()
        if local_step == 0:
            self.load_client(self.server.start_client(client))
            self._losses = []

    def on_batch_end(self, output: Any) -> None:
        plan = self.plan
        client, local_step = self._position()
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        self.step += 1
        if local_step + 1 == plan.local_steps[client]:
            self._end_client(client)
        if self.step == plan.num_steps:
            self.close_round()

    def _end_client(self, client: int) -> None:
        server = self.server
        state = None
        if server.optimizer_state == "persist":
            state = [export_optimizer_state(optimizer) for optimizer in self.optimizers]
        delta = self.flat.get(server.global_vector.dtype).to(server.global_vector.device) - server.global_vector
        # one host sync per client, not per step
        loss = float(torch.stack(self._losses).float().mean()) if self._losses else float("nan")
        int_delta = self.flat.get_ints() - server.global_ints if server.global_ints.numel() else None
        server.submit(client, delta, loss, state, int_delta)
