"""Helpers shared by the availability-process tests: drawing masks and checking frequencies statistically."""

from __future__ import annotations

import numpy as np

N = 50
T = 20_000


def draw(proc, rounds) -> np.ndarray:
    """Stack ``proc.sample(t)`` for ``t`` in ``rounds`` into a bool ``[len(rounds), N]`` array."""
    return np.stack([proc.sample(t).numpy() for t in rounds])


def assert_frequencies(masks: np.ndarray, p: np.ndarray, inflation: np.ndarray | float = 1.0) -> None:
    """Per-client frequencies within 4.5 SE (Bonferroni over 50 clients) and the pooled one within 3 SE.

    ``inflation`` is the variance factor of a time average of a correlated 0/1 sequence, ``(1+lam)/(1-lam)`` for a
    stationary two-state chain (1 for independent rounds).
    """
    rounds = masks.shape[0]
    var = p * (1 - p) / rounds * inflation
    freq = masks.mean(axis=0)
    z = (freq - p) / np.sqrt(var)
    assert np.max(np.abs(z)) < 4.5, f"max |z| = {np.max(np.abs(z)):.2f}"
    pooled_z = (freq.sum() - p.sum()) / np.sqrt(np.sum(var))
    assert abs(pooled_z) < 3.0, f"pooled z = {pooled_z:.2f}"


def lag1_autocorrelation(masks: np.ndarray) -> np.ndarray:
    x = masks.astype(np.float64)
    x = x - x.mean(axis=0)
    return (x[1:] * x[:-1]).mean(axis=0) / x.var(axis=0)
