"""Server rules (DESIGN.md §2.3): framework-free functions of flat parameter vectors."""

from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext
from lightning_fedhet.algorithms.fedau import FedAU, IntervalEstimator
from lightning_fedhet.algorithms.fedavg import FedAvg
from lightning_fedhet.algorithms.fednova import FedNova
from lightning_fedhet.algorithms.fedstale import FedStale, StaleMemory
from lightning_fedhet.algorithms.fedvarp import FedVARP
from lightning_fedhet.algorithms.mifa import MIFA
from lightning_fedhet.algorithms.upgapl import DMAPL, UDMAPL, UPGAPL

__all__ = [
    "Algorithm",
    "ClientInfo",
    "RoundContext",
    "FedAvg",
    "FedVARP",
    "MIFA",
    "FedStale",
    "StaleMemory",
    "FedAU",
    "IntervalEstimator",
    "UPGAPL",
    "DMAPL",
    "UDMAPL",
    "FedNova",
]
