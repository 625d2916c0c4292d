"""Counter-based seeding: every random draw is a pure function of ``(seed, stream, round, ...)``.

Nothing in the library reads or advances global RNG state, so a run is reproducible, independent of
the engine and of how many rounds were drawn before a checkpoint, and any round can be re-drawn.
"""

from __future__ import annotations

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
    REQUEST_CLIENT = 11  # asynchronous training: which client a request goes to (and Sync-ST's task split)
    REQUEST_LATENCY = 12  # asynchronous training: each request's duration


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
