"""One small federated experiment, run in process (FedHetStrategy) and on Flower (FedHetFlowerStrategy).

4 clients of unequal size, unequal local steps, and a fixed availability trace in which every client misses a
round, so the stale memories of FedVARP and the participation intervals of FedAU matter.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Subset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAU, FedAvg, FedVARP
from lightning_fedhet.participation import Trace
from tests.helpers import TinyClassifier, quiet_trainer, toy_dataset

NUM_CLIENTS = 4
ROUNDS = 3
SIZES = (10, 14, 7, 17)  # |D_i|
BATCH_SIZE = 4  # client 2 (7 samples) wraps into a second permutation within its round
LOCAL_STEPS = (1, 3, 2, 2)
SEED = 7
# rows are rounds, columns clients: each client misses at least one round
MASK = np.array([[1, 1, 0, 1], [0, 1, 1, 0], [1, 0, 1, 1]], dtype=bool)
RULES = {
    "FedAvg": lambda: FedAvg(),
    "FedVARP": lambda: FedVARP(),
    "FedAU": lambda: FedAU(K=50),
}


def dataset():
    return toy_dataset(n=sum(SIZES), seed=3)


def partitions() -> list[np.ndarray]:
    """Each client's indices into :func:`dataset`, shuffled so that a partition is not a contiguous block."""
    order = np.random.default_rng(11).permutation(sum(SIZES))
    return np.split(order, np.cumsum(SIZES)[:-1])


def module() -> TinyClassifier:
    return TinyClassifier(lr=0.5)


def strategy_kwargs(rule: str) -> dict:
    return dict(
        algorithm=RULES[rule](),
        participation=Trace(MASK),
        local_steps=list(LOCAL_STEPS),
        seed=SEED,
        client_weights="samples",
    )


def run_in_process(rule: str) -> tuple[object, FedHetStrategy]:
    """The simulation: returns (final module, strategy)."""
    model = module()
    # the sequential engine: the nodes train one client at a time through Lightning's loop, as it does
    strategy = FedHetStrategy(**strategy_kwargs(rule), engine="sequential")
    datamodule = FederatedDataModule(dataset(), partitions(), batch_size=BATCH_SIZE)
    quiet_trainer(strategy=strategy, max_epochs=ROUNDS).fit(model, datamodule=datamodule)
    return model, strategy


def node_dataset(partition_id: int) -> Subset:
    """What node ``partition-id`` holds: its partition's samples, in the partition's order."""
    return Subset(dataset(), partitions()[partition_id].tolist())
