"""Callbacks: per-round progress, logging helpers and CIS evaluation (installed as ``lightning_fedhet.callbacks``)."""

from .cis import CISAccuracy, CISResult, cis_accuracy, cis_evaluate, cis_evaluate_scores, exit_confidence
from .progress import RoundPrinter

__all__ = [
    "RoundPrinter",
    "CISAccuracy",
    "CISResult",
    "cis_accuracy",
    "cis_evaluate",
    "cis_evaluate_scores",
    "exit_confidence",
]
