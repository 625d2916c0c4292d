"""Property: any argument to a partitioner (IID, Dirichlet, Shards, LabelSwap) or to its ``split(labels,
num_clients, seed)`` builds a valid split or raises ValueError/TypeError naming the parameter.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_fedhet.data import IID, Dirichlet, LabelSwap, Shards
from tests.property_inputs import PROPERTY, arg, as_count, bounded_junk, build, counts, ints, junk, seeds

_label_lists = st.lists(st.integers(0, 9), min_size=1, max_size=60)
labels_ = st.one_of(
    _label_lists.map(lambda v: np.array(v, dtype=np.int64)),
    _label_lists,
    _label_lists.map(torch.tensor),
    _label_lists.map(lambda v: np.array(v, dtype=np.float32)),
    junk,
)


def check_split(partitioner, labels, num_clients, seed, *params: str):
    """``split`` returns ``num_clients`` sorted, disjoint int64 index arrays into the dataset, or raises naming a
    parameter of the split or of the partitioner."""
    if partitioner is None:
        return None
    repr(partitioner)
    parts = build(lambda: partitioner.split(labels, num_clients, seed), "labels", "num_clients", "seed", *params)
    if parts is None:
        return None
    # IID splits the rows of ``labels``; the label-based partitioners flatten them
    n = np.asarray(labels).shape[0] if isinstance(partitioner, IID) else np.asarray(labels).size
    assert len(parts) == as_count(num_clients)
    for part in parts:
        assert part.dtype == np.int64 and np.all(np.diff(part) > 0)
        assert part.size == 0 or (part[0] >= 0 and part[-1] < n)
    everything = np.concatenate(parts)
    assert np.unique(everything).size == everything.size
    return parts


@PROPERTY
@given(labels=labels_, num_clients=counts, seed=seeds)
def test_iid(labels, num_clients, seed):
    parts = check_split(IID(), labels, num_clients, seed)
    if parts is not None:
        sizes = [p.size for p in parts]
        assert sum(sizes) == np.asarray(labels).shape[0] and max(sizes) - min(sizes) <= 1


@PROPERTY
@given(alpha=arg(st.floats(1e-3, 1e3)), min_samples=st.one_of(st.integers(0, 3), bounded_junk),
       max_tries=st.one_of(st.integers(1, 20), bounded_junk), labels=labels_, num_clients=counts, seed=seeds)
def test_dirichlet(alpha, min_samples, max_tries, labels, num_clients, seed):
    partitioner = build(lambda: Dirichlet(alpha, min_samples, max_tries), "alpha", "min_samples", "max_tries")
    parts = check_split(partitioner, labels, num_clients, seed, "min_samples", "alpha")
    if parts is not None:
        assert sum(p.size for p in parts) == len(labels)
        assert min(p.size for p in parts) >= partitioner.min_samples


@PROPERTY
@given(classes_per_client=arg(ints(1, 4)), labels=labels_, num_clients=counts, seed=seeds)
def test_shards(classes_per_client, labels, num_clients, seed):
    partitioner = build(lambda: Shards(classes_per_client), "classes_per_client")
    parts = check_split(partitioner, labels, num_clients, seed, "classes_per_client")
    if parts is not None:
        held = [np.unique(np.asarray(labels)[p]).size for p in parts if p.size]
        assert all(h <= partitioner.classes_per_client for h in held)


@PROPERTY
@given(fraction=arg(st.floats(0, 1)), pairs=arg(st.sampled_from([((0, 1), (8, 9)), [(3, 5)], [[2, 6], [1, 0]]])),
       base=st.one_of(st.none(), st.sampled_from([IID(), Shards(2), Dirichlet(1.0)]), junk),
       swap_clients=st.one_of(st.none(), st.lists(st.integers(0, 4), max_size=3), junk),
       labels=labels_, num_clients=counts, seed=seeds)
def test_label_swap(fraction, pairs, base, swap_clients, labels, num_clients, seed):
    partitioner = build(lambda: LabelSwap(fraction, pairs, base, swap_clients),
                        "fraction", "pairs", "base", "swap_clients")
    parts = check_split(partitioner, labels, num_clients, seed, "classes_per_client", "min_samples", "alpha")
    if parts is None:
        return
    swapped = build(lambda: partitioner.swapped_labels(labels, parts, seed), "swap_clients")
    if swapped is not None:
        original = np.asarray(labels).reshape(-1)
        assert swapped.shape == original.shape
        in_pairs = np.isin(original, np.array(partitioner.pairs).reshape(-1))
        assert np.array_equal(swapped[~in_pairs], original[~in_pairs])
