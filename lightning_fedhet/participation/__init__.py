"""Availability processes: who shows up in each round."""

from lightning_fedhet.participation.base import Participation
from lightning_fedhet.participation.bernoulli import Bernoulli
from lightning_fedhet.participation.cyclic import Cyclic
from lightning_fedhet.participation.full import Full
from lightning_fedhet.participation.markov import Markov
from lightning_fedhet.participation.recipes import CAFedClasses, LabelCorrelated, Recipe, TwoGroup
from lightning_fedhet.participation.trace import Trace
from lightning_fedhet.participation.uniform import UniformSample

__all__ = [
    "Participation",
    "Full",
    "UniformSample",
    "Bernoulli",
    "Markov",
    "Cyclic",
    "Trace",
    "Recipe",
    "LabelCorrelated",
    "TwoGroup",
    "CAFedClasses",
]
