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
    PROBE = 10
    REQUEST_CLIENT = 11  # asynchronous training: which client a request goes to (and Sync-ST's task split)
    REQUEST_LATENCY = 12  # asynchronous training: each request's duration


# Static (not per-round) draws of a stream live under ``generator(seed, stream, STATIC_KEY, sub_key)``. Round draws
# use ``generator(seed, stream, round)``; numpy's SeedSequence pads short entropy with zeros, so a ``sub_key >= 1``
# keeps the two families apart for every round below ``2**32 - 1``. Each sub-key names one static draw; never reuse
# a number for another draw (it would correlate the two).
STATIC_KEY = 2**32 - 1


class StaticKey(IntEnum):
    """Sub-keys of the static draws under ``STATIC_KEY`` (the stream each one is used with in brackets)."""

    LABEL_CORRELATED = 1  # [PARTICIPATION] FedAU's shared class-affinity vector
    TWO_GROUP = 2  # [PARTICIPATION] FedStale's low-participation group
    CAFED_CLASSES = 3  # [PARTICIPATION] CA-Fed's availability classes
    CYCLIC_OFFSET = 4  # [PARTICIPATION] Cyclic's per-client phases
    LATENCY_GROUPS = 5  # [LATENCY] speed-group membership
    CAFED_LAMBDA = 6  # [PARTICIPATION] CA-Fed's weakly correlated eigenvalues


class PartitionKey(IntEnum):
    """First key after ``Stream.PARTITION`` of each partitioner's draws.

    ``IID`` uses ``generator(seed, PARTITION)`` and ``Dirichlet`` its attempt number ``a`` (``generator(seed,
    PARTITION, a)``); since short entropy is zero-padded these coincide with ``SHARDS`` / ``LABEL_SWAP`` for
    ``a`` = 1, 2. The partitioners are alternatives (a ``LabelSwap`` over a ``Dirichlet`` base that needed three
    attempts is the one overlap), and the keys are kept so existing splits stay the same.
    """

    SHARDS = 1  # generator(seed, PARTITION, SHARDS)
    LABEL_SWAP = 2  # generator(seed, PARTITION, LABEL_SWAP, client)
    FIXED_SIZE = 3  # generator(seed, PARTITION, FIXED_SIZE): FixedSizeDirichlet, one stream in client order


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
