"""Callbacks: per-round progress and logging helpers (installed as ``lightning_fedhet.callbacks``)."""

from .progress import RoundPrinter

__all__ = ["RoundPrinter"]
