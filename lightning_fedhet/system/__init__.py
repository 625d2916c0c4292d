"""System heterogeneity: lossy links, local-step counts, latency and simulated time."""

from lightning_fedhet.system.channel import LossDistribution, LossyChannel, UniformLoss
from lightning_fedhet.system.latency import ShiftedExponential, VirtualClock
from lightning_fedhet.system.steps import (
    StepDistribution,
    TwoGroupSteps,
    UniformSteps,
    check_local_steps,
    local_steps_for,
)

__all__ = [
    "LossyChannel",
    "LossDistribution",
    "UniformLoss",
    "StepDistribution",
    "UniformSteps",
    "TwoGroupSteps",
    "local_steps_for",
    "check_local_steps",
    "ShiftedExponential",
    "VirtualClock",
]
