"""A round's generators built together (``seeding.generators``) are numpy's own, key for key.

The reference is numpy: ``generator(seed, stream, round, k)`` is ``Generator(Philox(SeedSequence([seed, stream,
round, k])))``, and ``generators`` transcribes ``SeedSequence``'s hashing to run it for many keys at once. The pools
pinned below were printed by numpy 2.4 (``np.random.SeedSequence([0, 6, 5, 17]).pool``); numpy keeps
``SeedSequence``'s output fixed across versions.
"""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.seeding import Stream, generator, generators
from tests.helpers import toy_dataset


def test_the_pool_and_the_philox_key_are_numpys():
    keys = list(range(10, 22))  # 12 keys: built together
    gens = generators(0, 6, 5, keys)
    seq = gens[keys.index(17)].bit_generator.seed_seq
    assert seq.pool.tolist() == [4190964282, 734873260, 2575055895, 1142104552]
    assert seq.generate_state(2, np.uint64).tolist() == [11216735491998779157, 17993364854961419723]


@pytest.mark.parametrize("count", [1, 9, 10, 33])  # one by one below 10 keys, together from 10
def test_every_key_draws_what_its_own_generator_draws(count):
    rng = np.random.default_rng(count)
    for seed, stream, round in [(0, Stream.DATA, 3), tuple(int(v) for v in rng.integers(0, 2**32, 3))]:
        keys = [0, 2**32 - 1] + [int(k) for k in rng.integers(0, 2**32, count)]
        keys = keys[:count]
        for key, built in zip(keys, generators(seed, stream, round, keys)):
            own = generator(seed, stream, round, key)
            assert built.permutation(40).tolist() == own.permutation(40).tolist()
            assert built.random(3).tolist() == own.random(3).tolist()
            numpys = np.random.SeedSequence([seed, stream, round, key])
            assert built.bit_generator.seed_seq.pool.tolist() == numpys.pool.tolist()
            for words, dtype in [(3, np.uint32), (5, np.uint64), (2, np.uint64), (8, np.uint32)]:
                got = built.bit_generator.seed_seq.generate_state(words, dtype)
                assert got.dtype == dtype and got.tolist() == numpys.generate_state(words, dtype).tolist()


def test_words_of_two_to_the_32_or_more_take_numpys_own_path():
    keys = list(range(12))
    for seed, key_offset in [(2**32, 0), (1, 2**40)]:
        shifted = [k + key_offset for k in keys]
        for key, built in zip(shifted, generators(seed, 6, 1, shifted)):
            assert built.random(2).tolist() == generator(seed, 6, 1, key).random(2).tolist()


def test_a_negative_key_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"seed and keys must be non-negative ints, got \[0, 6, 1\] and keys"):
        generators(0, 6, 1, [3] * 11 + [-1])


def test_a_rounds_batch_indices_are_each_clients_own():
    data = toy_dataset(n=200)
    sizes = [3, 7, 16, 30, 44, 100]
    bounds = np.cumsum([0] + sizes)
    streams = ClientStreams(data, [np.arange(bounds[i], bounds[i + 1]) for i in range(6)], batch_size=8, seed=4)
    clients = [5, 0, 2, 3, 1, 4, 0, 5, 2, 3, 1, 4]  # 12 draws: generators built together
    steps = [3, 1, 2, 5, 4, 1, 2, 2, 1, 3, 6, 2]
    together = streams.round_batch_indices(7, clients, steps)
    for client, k, own in zip(clients, steps, together):
        expected = streams.batch_indices(7, client, k)
        assert [batch.tolist() for batch in own] == [batch.tolist() for batch in expected]
