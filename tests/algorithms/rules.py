"""The one list of server rules that the protocol, round-share, property and engine contract tests iterate.

:data:`RULE_CLASSES` is read from the package (every :class:`Algorithm` subclass ``lightning_fedhet.algorithms``
exports), so a new rule is in it without anyone adding it here. :data:`RULES` gives each of them an instance to test
(name -> factory; a rule with another code path worth testing has a variant named ``Rule-variant``), for
:data:`NUM_CLIENTS` clients; ``test_algorithm_protocol`` fails when a class of :data:`RULE_CLASSES` has no entry.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import lightning_fedhet.algorithms as algorithms
from lightning_fedhet.algorithms import (
    DMAPL,
    F3AST,
    MIFA,
    OS,
    UDMAPL,
    UPGAPL,
    AdaFed,
    Algorithm,
    CAFed,
    CAFedAvg,
    FedACS,
    FedAU,
    FedAvg,
    FedCIS,
    FedNova,
    FedStale,
    FedVARP,
    SampledFedAvg,
)
from lightning_fedhet.cis import CISTopology

#: every server rule of the package
RULE_CLASSES: tuple[type[Algorithm], ...] = tuple(
    obj
    for obj in (getattr(algorithms, name) for name in algorithms.__all__)
    if isinstance(obj, type) and issubclass(obj, Algorithm) and obj is not Algorithm
)

#: clients the instances of RULES are made for (FedCIS's tree has this many nodes)
NUM_CLIENTS = 6


def star_topology() -> CISTopology:
    """Root 0 (exits 1-2) and five leaves (exit 1), requests at the leaves, a quarter forwarded to the root."""
    return CISTopology([[1, 2, 3, 4, 5], [], [], [], [], []], [2, 1, 1, 1, 1, 1], arrival=[0.0] + [1.0] * 5,
                       transfer_cap=[0.0] + [0.25] * 5)


#: FedCIS's exit 1 and exit 2 over 3 coordinates (aggregation_base="root_local")
EXIT_MASKS = torch.tensor([[True, True, False], [True, False, True]])

#: name -> a fresh instance, every rule of RULE_CLASSES at least once
RULES: dict[str, Callable[[], Algorithm]] = {
    "FedAvg": FedAvg,
    "FedAvg-known_p": lambda: FedAvg(weighting="known_p"),
    "FedAvg-samples": lambda: FedAvg(weighting="samples"),
    "FedVARP": FedVARP,
    "MIFA": MIFA,
    "FedStale": lambda: FedStale(beta=0.5),
    "FedAU": lambda: FedAU(K=3),
    "UPGAPL": UPGAPL,
    "DMAPL": DMAPL,
    "UDMAPL": UDMAPL,
    "FedNova": lambda: FedNova(momentum=0.5),  # the clients' SGD momentum (checked at setup)
    "FedNova-selected": lambda: FedNova(divisor="selected"),
    "FedACS": lambda: FedACS(K=4, momentum=0.5),
    "SampledFedAvg": lambda: SampledFedAvg(K=4),
    "CAFedAvg": lambda: CAFedAvg(K=4),
    "OS": lambda: OS(K=4),
    "CAFed": lambda: CAFed(tau=0.0),
    "CAFed-probe": lambda: CAFed(tau=0.0, loss_source="probe"),
    "AdaFed": AdaFed,
    "F3AST": lambda: F3AST(k=3),
    "FedCIS": lambda: FedCIS(star_topology(), p=0.3),
    "FedCIS-root_local": lambda: FedCIS(star_topology(), p=0.3, aggregation_base="root_local", exit_masks=EXIT_MASKS),
}


def rule_class(name: str) -> type[Algorithm]:
    """The class of ``RULES[name]`` (``"FedNova-selected"`` -> ``FedNova``)."""
    return type(RULES[name]())
