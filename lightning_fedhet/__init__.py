"""lightning-fedhet: federated learning under client heterogeneity as a PyTorch Lightning strategy.

Example::

    from lightning.pytorch import Trainer
    from lightning_fedhet import FedHetStrategy, FederatedDataModule, FedAvg, UniformSample, Dirichlet

    strategy = FedHetStrategy(algorithm=FedAvg(), participation=UniformSample(10), local_steps=5)
    Trainer(strategy=strategy, max_epochs=50).fit(model, datamodule=FederatedDataModule(train, Dirichlet(0.5), 100))
"""

# first: from a source checkout that is not installed, finds lightning_fedhet.callbacks and .model_zoo
from lightning_fedhet import _source_checkout  # noqa: F401  isort: skip
from lightning_fedhet import asynchronous  # noqa: F401  (registers the "fedast" strategy)
from lightning_fedhet.algorithms import Algorithm, ClientInfo, FedAvg, RoundContext
from lightning_fedhet.data import IID, Dirichlet, FederatedDataModule
from lightning_fedhet.participation import Full, Participation, UniformSample
from lightning_fedhet.spec import FederationSpec
from lightning_fedhet.strategy import FedHetStrategy
from lightning_fedhet.strategy_ddp import FedHetDDPStrategy

__version__ = "0.1.0"

__all__ = [
    "FedHetStrategy",
    "FedHetDDPStrategy",
    "FederationSpec",
    "FederatedDataModule",
    "Algorithm",
    "ClientInfo",
    "RoundContext",
    "FedAvg",
    "Participation",
    "Full",
    "UniformSample",
    "IID",
    "Dirichlet",
]
