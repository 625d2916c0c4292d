"""Counter-based seeding: every random draw is a pure function of ``(seed, stream, round, ...)``.

Nothing in the library reads or advances global RNG state, so a run is reproducible, independent of
the engine and of how many rounds were drawn before a checkpoint, and any round can be re-drawn.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
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


def generators(seed: int, stream: int, round: int, keys: Sequence[int]) -> list[np.random.Generator]:
    """``[generator(seed, stream, round, k) for k in keys]``: the same streams, built together.

    A round draws one generator per client (its mini-batches), and building one costs about 15 us on a CPU, most of
    it numpy's ``SeedSequence`` hashing its entropy. Here the hashing is done once for all keys: the words shared by
    every key as Python ints, the rest vectorised over the keys (:func:`_seed_pools`, a transcription of numpy's
    ``SeedSequence``), and each ``Philox`` takes its key from that pool (:class:`_PooledSeedSequence`). Entropy
    words of 2**32 or more, and fewer than 10 keys (where one by one is faster), go through :func:`generator`.
    """
    shared = [int(seed), int(stream), int(round)]
    keys = [int(k) for k in keys]
    if any(k < 0 for k in shared + keys):
        raise ValueError(f"seed and keys must be non-negative ints, got {shared} and keys {keys}")
    if len(keys) < _TOGETHER_FROM or max(shared + keys) >= 2**32:
        return [generator(seed, stream, round, k) for k in keys]
    pools = _seed_pools([*shared, np.array(keys, dtype=np.uint32)])
    philox_keys = _generate_state(pools, 2 * _PHILOX_KEY_WORDS).view("<u8").astype(np.uint64)
    return [
        np.random.Generator(np.random.Philox(_PooledSeedSequence(pool, key))) for pool, key in zip(pools, philox_keys)
    ]


# numpy's SeedSequence (numpy/random/bit_generator.pyx): a pool of 4 uint32 words, its hash and mix constants
_POOL_SIZE = 4
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = 16
_MASK = 0xFFFFFFFF
# Philox asks its seed sequence for a key of 2 uint64 words
_PHILOX_KEY_WORDS = 2
# the number of keys from which building the generators together is faster (measured on a 2-core CPU: 139 against
# 148 us for 10 keys, 178 against 302 us for 20, 564 against 1,530 us for 100)
_TOGETHER_FROM = 10

Word = int | np.ndarray  # one uint32 word: shared by every key (a Python int) or one per key (uint32 array)


def _hash_constants(start: int, mult: int, count: int) -> list[int]:
    """The running hash constant before each of ``count`` hashes (it evolves the same way whatever is hashed)."""
    out = []
    for _ in range(count):
        out.append(start)
        start = (start * mult) & _MASK
    return out


# mix_entropy hashes the 4 entropy words, then 12 pool words (4 sources x 3 destinations)
_MIX_CONSTANTS = _hash_constants(_INIT_A, _MULT_A, _POOL_SIZE + _POOL_SIZE * (_POOL_SIZE - 1))


def _hashmix(value: Word, const: int) -> Word:
    mult = (const * _MULT_A) & _MASK
    if isinstance(value, int):
        value = ((value ^ const) * mult) & _MASK
        return value ^ (value >> _XSHIFT)
    value = (value ^ np.uint32(const)) * np.uint32(mult)
    return value ^ (value >> np.uint32(_XSHIFT))


def _mix(x: Word, y: Word) -> Word:
    # a Python int's product is taken modulo 2**32 first: numpy warns about overflow in scalar arithmetic
    left = (_MIX_MULT_L * x) & _MASK if isinstance(x, int) else x * np.uint32(_MIX_MULT_L)
    right = (_MIX_MULT_R * y) & _MASK if isinstance(y, int) else y * np.uint32(_MIX_MULT_R)
    if isinstance(left, int) and isinstance(right, int):
        result = (left - right) & _MASK
        return result ^ (result >> _XSHIFT)
    result = np.uint32(left) - np.uint32(right) if isinstance(left, int) else left - np.uint32(right)
    return result ^ (result >> np.uint32(_XSHIFT))


def _seed_pools(entropy: list[Word]) -> np.ndarray:
    """numpy's ``SeedSequence(entropy).pool`` for every key: ``entropy`` holds 4 words (ints below 2**32, an
    array of them for the words that differ between keys, at least one); uint32 ``[keys, 4]``. ``mix_entropy`` line
    by line; a pool word stays a Python int until it is mixed with a word that differs between keys."""
    constants = iter(_MIX_CONSTANTS)
    mixer = [_hashmix(entropy[i], next(constants)) for i in range(_POOL_SIZE)]
    for src in range(_POOL_SIZE):
        for dst in range(_POOL_SIZE):
            if src != dst:
                mixer[dst] = _mix(mixer[dst], _hashmix(mixer[src], next(constants)))
    size = max(len(word) for word in mixer if isinstance(word, np.ndarray))
    return np.stack([np.broadcast_to(np.uint32(word), (size,)) for word in mixer], axis=1)


def _generate_state(pools: np.ndarray, n_words: int) -> np.ndarray:
    """``SeedSequence.generate_state(n_words, np.uint32)`` for each pool row (uint32 ``[n, 4]`` -> ``[n, n_words]``)."""
    out = np.empty((pools.shape[0], n_words), dtype=np.uint32)
    for i, const in enumerate(_hash_constants(_INIT_B, _MULT_B, n_words)):
        value = (pools[:, i % _POOL_SIZE] ^ np.uint32(const)) * np.uint32((const * _MULT_B) & _MASK)
        out[:, i] = value ^ (value >> np.uint32(_XSHIFT))
    return out


class _PooledSeedSequence(np.random.bit_generator.ISeedSequence):
    """A ``SeedSequence`` whose pool is computed already (:func:`_seed_pools`); ``Philox`` reads its key from it."""

    def __init__(self, pool: np.ndarray, philox_key: np.ndarray) -> None:
        self.pool = pool
        self._philox_key = philox_key

    def generate_state(self, n_words: int, dtype=np.uint32) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype == np.uint64 and n_words == _PHILOX_KEY_WORDS:
            return self._philox_key.copy()
        if dtype not in (np.dtype(np.uint32), np.dtype(np.uint64)):
            raise ValueError("only support uint32 or uint64")
        words = n_words * (2 if dtype == np.uint64 else 1)
        state = _generate_state(self.pool[None, :], words)[0]
        return state.view("<u8").astype(np.uint64) if dtype == np.uint64 else state


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
