"""Run lightning-fedhet's server rules in a Flower deployment (extra ``lightning-fedhet[flower]``).

* :class:`FedHetFlowerStrategy` (server side, a Flower Message-API ``Strategy``) drives the same
  :class:`~lightning_fedhet.server.Server` and :class:`~lightning_fedhet.algorithms.base.Algorithm` as the simulation:
  the rule selects the clients, the rule aggregates their updates, and the per-client state (stale memories,
  participation intervals) is kept per client id, each Flower node being mapped to one client id for the whole run.
* :class:`LightningClient` (client side) trains the user's LightningModule with a Lightning ``Trainer`` for the
  round's local steps and replies with the trained weights, its sample count and its training loss.

Example (a Flower app's ``server_app.py`` and ``client_app.py``)::

    strategy = FedHetFlowerStrategy(MyModule(), FedVARP(), num_clients=10, local_steps=5)
    result = strategy.start(grid, initial_arrays=ArrayRecord(MyModule().state_dict()), num_rounds=50)

    app = LightningClient(lambda ctx: MyModule(), load_partition, batch_size=32).client_app()
"""

try:
    import flwr  # noqa: F401
except ImportError as err:  # pragma: no cover - only without the extra
    raise ImportError(
        "lightning_fedhet.flower needs Flower: pip install 'lightning-fedhet[flower]'"
    ) from err

from lightning_fedhet.flower.client import LightningClient, client_batches
from lightning_fedhet.flower.connected import ConnectedNodes
from lightning_fedhet.flower.nodes import NodeMap
from lightning_fedhet.flower.protocol import ModelCodec
from lightning_fedhet.flower.strategy import FedHetFlowerStrategy

__all__ = ["FedHetFlowerStrategy", "LightningClient", "NodeMap", "ConnectedNodes", "ModelCodec", "client_batches"]
