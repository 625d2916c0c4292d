"""Counter-based seeding: every random draw is a pure function of ``(seed, stream, round, ...)``.

Nothing in the library reads or advances global RNG state, so a run is reproducible, independent of
the engine and of how many rounds were drawn before a checkpoint, and any round can be re-drawn.
"""

from __future__ import annotations

import os
from enum import IntEnum

import numpy as np


class Stream(IntEnum):
    """Independent random streams; a new kind of draw gets a new number (never reuse one)."""

    PARTICIPATION = 1
    SELECTION = 2
    DOWNLINK = 3
    UPLINK = 4
    LOCAL_STEPS = 5
    DATA = 6
    PARTITION = 7
    LATENCY = 8
    LOSS_RATES = 9


def generator(seed: int, stream: int, *keys: int) -> np.random.Generator:
    """A fresh ``numpy.random.Generator`` for ``(seed, stream, *keys)``.

    Args:
        seed: the user's seed (any non-negative int).
        stream: a :class:`Stream` member.
        keys: further non-negative ints, typically the round and/or the client id.
    """
    entropy = [int(seed), int(stream), *(int(k) for k in keys)]
    if any(k < 0 for k in entropy):
        raise ValueError(f"seed and keys must be non-negative ints, got {entropy}")
    return np.random.Generator(np.random.Philox(np.random.SeedSequence(entropy)))


def resolve_seed(seed: int | None) -> int:
    """The run's seed: ``seed`` when given, else Lightning's global seed, else 0.

    Lightning's ``seed_everything(s)`` records ``s`` in the environment variable ``PL_GLOBAL_SEED``, so a strategy
    built with ``seed=None`` follows the seed a user sweeps the Lightning way; an explicit ``seed`` wins.

    Raises:
        ValueError: ``seed`` (or ``PL_GLOBAL_SEED``) is not an integer ``>= 0``.
    """
    source = "seed"
    if seed is None:
        env = os.environ.get("PL_GLOBAL_SEED")
        if env is None:
            return 0
        source, seed = "PL_GLOBAL_SEED", env
        try:
            seed = int(env)
        except ValueError:
            raise ValueError(f"PL_GLOBAL_SEED must be an integer >= 0, got {env!r}") from None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"{source} must be None or an integer >= 0, got {seed!r}")
    return int(seed)
