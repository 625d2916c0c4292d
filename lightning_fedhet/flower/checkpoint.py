"""The server-side checkpoint of :class:`~lightning_fedhet.flower.strategy.FedHetFlowerStrategy`.

Everything a run needs to carry on between rounds: the Server's state (global model with its floating and integer
buffers, the rule's per-client memories, the history, the round counter) and a description of the run's
configuration, which a resumed run must match. Written atomically, read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("flwr")  # Flower's logger: the messages appear with Flower's own
#: the layout of FedHetFlowerStrategy.state_dict (a file of another layout is refused)
CHECKPOINT_FORMAT = 1


class CheckpointMixin:
    """:meth:`state_dict` / :meth:`load_state_dict` and their files, for the strategy (which provides ``spec``,
    ``seed``, ``module``, ``num_clients``, ``server``, ``_client_sizes`` and ``_require_server``)."""

    def state_dict(self) -> dict:
        """Everything the run needs to carry on between rounds: the Server's state (global model, the rule's
        memories, the history, the round counter) and a description of the run's configuration.

        The participation, selection and local-step draws are pure functions of ``(seed, round)`` (the draw of
        round ``t`` never depends on the draws before it), so the seed and the round counter are their whole
        random state: a resumed run draws round ``t`` exactly as the uninterrupted one.
        """
        server = self._require_server()
        return {"format": CHECKPOINT_FORMAT, "configuration": self._configuration(), "server": server.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into the built Server; refuses a state of another configuration."""
        server = self._require_server()
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a FedHetFlowerStrategy checkpoint of format {CHECKPOINT_FORMAT} (found format {found!r})"
            )
        mine, theirs = self._configuration(), state["configuration"]
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if differ:
            lines = "; ".join(f"{k}: checkpoint {theirs.get(k)!r}, this run {mine.get(k)!r}" for k in differ)
            raise ValueError(f"the checkpoint is of another configuration ({lines}): start a new checkpoint_path "
                             "or run with the checkpoint's settings")
        server.load_state_dict(state["server"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` (between rounds). The file is replaced atomically, so a server killed
        while writing leaves the previous round's checkpoint whole."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(self.state_dict(), partial)
        os.replace(partial, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a :meth:`save_checkpoint` file into the built Server (tensors and plain containers only:
        ``torch.load(weights_only=True)``, so a file cannot run code)."""
        try:
            state = torch.load(Path(path), map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated file, another format, or a pickle that weights_only refuses
            raise ValueError(f"checkpoint {str(path)!r} cannot be read ({type(err).__name__}: {err})") from err
        self.load_state_dict(state)
        log.info("FedHetFlowerStrategy: loaded %s (next round %d)", path, self.server.next_round)

    def _configuration(self) -> dict[str, str]:
        """What a checkpoint must agree on with the run that loads it (as strings)."""
        spec = self.spec
        return {
            "algorithm": repr(spec.algorithm),
            "num_clients": str(self.num_clients),
            "participation": repr(spec.participation),
            "local_steps": repr(spec.local_steps),
            "selection": repr(spec.selection),
            "seed": str(self.seed),
            "client_weights": str(spec.client_weights),
            "max_update_norm": repr(spec.max_update_norm),
            "update_norm_action": str(spec.update_norm_action),
            "model": ", ".join(
                f"{name}:{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                for name, t in self.module.state_dict().items()
            ),
            "client_sizes": repr(self._client_sizes),
        }
