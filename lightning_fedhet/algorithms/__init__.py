"""Server rules: framework-free functions of flat parameter vectors (one public rule per module)."""

from lightning_fedhet.algorithms.adafed import AdaFed
from lightning_fedhet.algorithms.availability_estimators import MarkovAvailabilityEstimator
from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext
from lightning_fedhet.algorithms.cafed import CAFed, compute_weights, proxy_error
from lightning_fedhet.algorithms.cafedavg import CAFedAvg
from lightning_fedhet.algorithms.calibration import LRScaling, effective_step, lr_scalings
from lightning_fedhet.algorithms.f3ast import F3AST
from lightning_fedhet.algorithms.fedacs import (
    FedACS,
    SystemEstimator,
    chi_square,
    fedacs_probabilities,
    surrogate_weights,
)
from lightning_fedhet.algorithms.fedau import FedAU, IntervalEstimator
from lightning_fedhet.algorithms.fedavg import FedAvg
from lightning_fedhet.algorithms.fedcis import FedCIS, code_sampling_matrix, lambda_tilde_weights, sampling_matrix
from lightning_fedhet.algorithms.fednova import FedNova
from lightning_fedhet.algorithms.fedstale import FedStale, StaleMemory
from lightning_fedhet.algorithms.fedvarp import FedVARP
from lightning_fedhet.algorithms.mifa import MIFA
from lightning_fedhet.algorithms.os_sampling import OS
from lightning_fedhet.algorithms.sampled_fedavg import SampledFedAvg
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
    "FedACS",
    "SampledFedAvg",
    "CAFedAvg",
    "OS",
    "SystemEstimator",
    "fedacs_probabilities",
    "surrogate_weights",
    "chi_square",
    "CAFed",
    "AdaFed",
    "F3AST",
    "MarkovAvailabilityEstimator",
    "compute_weights",
    "proxy_error",
    "LRScaling",
    "effective_step",
    "lr_scalings",
    "FedCIS",
    "sampling_matrix",
    "code_sampling_matrix",
    "lambda_tilde_weights",
]
