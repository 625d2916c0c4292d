"""Partitioners, dataset loaders (on files created here) and the synthetic LEAF generator."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from lightning_fedhet.data import (
    IID,
    Dirichlet,
    FederatedDataModule,
    LabelSwap,
    Shards,
    dataset_labels,
    fashion_mnist,
    synthetic_leaf,
    torchvision_dataset,
)
from lightning_fedhet.data.streams import ClientStreams


def _is_partition(parts, n):
    allidx = np.concatenate(parts)
    return len(allidx) == n and len(np.unique(allidx)) == n


def test_iid_split_sizes_and_determinism():
    labels = np.zeros(103)
    parts = IID().split(labels, 10, seed=1)
    assert _is_partition(parts, 103)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3
    assert all(np.array_equal(a, b) for a, b in zip(parts, IID().split(labels, 10, seed=1)))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, IID().split(labels, 10, seed=2)))


def test_dirichlet_partition_properties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 5000)
    parts = Dirichlet(0.5).split(labels, 50, seed=0)
    assert _is_partition(parts, 5000)
    assert min(len(p) for p in parts) >= 1
    # small alpha -> skewed label mix: the mean share of a client's largest class is far above IID's ~0.1+
    def top_share(alpha):
        parts = Dirichlet(alpha).split(labels, 50, 0)
        return np.mean([np.bincount(labels[p], minlength=10).max() / len(p) for p in parts])

    assert top_share(0.1) > 0.6
    assert top_share(100.0) < 0.25
    assert top_share(0.1) > top_share(0.5) > top_share(100.0)


def test_dirichlet_min_samples_is_enforced_and_errors_name_parameters():
    labels = np.repeat(np.arange(10), 50)
    parts = Dirichlet(0.3, min_samples=5).split(labels, 10, seed=0)
    assert min(len(p) for p in parts) >= 5
    with pytest.raises(ValueError, match="min_samples"):
        Dirichlet(0.01, min_samples=40, max_tries=3).split(labels, 10, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        Dirichlet(0.0)
    with pytest.raises(ValueError, match="alpha"):
        Dirichlet(-1)
    with pytest.raises(ValueError, match="num_clients"):
        Dirichlet(0.5).split(labels, 0)
    with pytest.raises(ValueError, match="num_clients"):
        IID().split(labels, 0)


def test_datamodule_explicit_index_lists_and_errors():
    ds = torch.utils.data.TensorDataset(torch.randn(10, 2), torch.arange(10))
    dm = FederatedDataModule(ds, [[0, 1, 2], [3, 4]], batch_size=2)
    assert dm.num_clients == 2 and dm.client_sizes.tolist() == [3, 2]
    with pytest.raises(ValueError, match="outside the dataset"):
        FederatedDataModule(ds, [[0, 10]])
    with pytest.raises(ValueError, match="num_clients is required"):
        FederatedDataModule(ds, IID())
    with pytest.raises(ValueError, match="num_clients"):
        FederatedDataModule(ds, IID(), num_clients=0)
    with pytest.raises(ValueError, match="batch_size"):
        FederatedDataModule(ds, IID(), num_clients=2, batch_size=0)


def test_client_streams_are_pure_functions_of_round_and_cover_data():
    ds = torch.utils.data.TensorDataset(torch.arange(20).float(), torch.zeros(20, dtype=torch.long))
    streams = ClientStreams(ds, [np.arange(0, 7), np.arange(7, 20)], batch_size=4, seed=3)
    b = streams.batch_indices(5, 0, 3)  # client 0 has 7 samples: 12 indices from two permutations
    assert [len(x) for x in b] == [4, 4, 4]
    flat = np.concatenate(b)
    assert set(flat[:7]) == set(range(7))  # first pass is a permutation of the client's data
    assert all(np.array_equal(x, y) for x, y in zip(b, streams.batch_indices(5, 0, 3)))
    assert not all(np.array_equal(x, y) for x, y in zip(b, streams.batch_indices(6, 0, 3)))
    small = ClientStreams(ds, [np.arange(3)], batch_size=8).batch_indices(0, 0, 2)
    assert [len(x) for x in small] == [3, 3]
    batches = list(streams.iterate(b))
    assert torch.equal(batches[0][0], ds.tensors[0][torch.from_numpy(b[0])])


def _write_idx(path, array):
    header = struct.pack(">BBBB", 0, 0, 8, array.ndim) + b"".join(struct.pack(">I", s) for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reader_on_created_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 28, 28))
    labels = np.array([0, 1, 2, 3, 4, 9])
    for prefix in ("train", "t10k"):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images)
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels)
    train, test = fashion_mnist(tmp_path)
    x, y = train.tensors
    assert x.shape == (6, 1, 28, 28) and x.dtype == torch.float32
    assert y.tolist() == labels.tolist()
    expected = (images[2, 5, 7] / 255.0 - 0.2860) / 0.3530
    assert float(x[2, 0, 5, 7]) == pytest.approx(expected, abs=1e-6)
    assert dataset_labels(test).tolist() == labels.tolist()


def test_fashion_mnist_missing_gives_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHET_FASHION_MNIST", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        fashion_mnist(tmp_path / "empty")


def test_torchvision_mnist_loader_on_created_raw_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.full((4, 28, 28), 255)
    labels = np.array([7, 1, 0, 3])
    for prefix in ("train", "t10k"):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", images)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", labels)
        # torchvision reads the uncompressed files
        for kind in ("images-idx3", "labels-idx1"):
            with gzip.open(raw / f"{prefix}-{kind}-ubyte.gz") as src, open(raw / f"{prefix}-{kind}-ubyte", "wb") as dst:
                dst.write(src.read())
    ds = torchvision_dataset("mnist", tmp_path, train=True)
    x, y = ds.tensors
    assert x.shape == (4, 1, 28, 28) and y.tolist() == [7, 1, 0, 3]
    assert float(x.max()) == pytest.approx((1.0 - 0.1307) / 0.3081, abs=1e-5)


def test_torchvision_cifar10_loader_on_created_batches(tmp_path, monkeypatch):
    import torchvision

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": [i % 10, (i + 1) % 10]}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [str(i) for i in range(10)]}, f)
    # the files are ours, so torchvision's md5 check of the official archive cannot pass
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: True)
    ds = torchvision_dataset("cifar10", tmp_path, train=True)
    x, y = ds.tensors
    assert x.shape == (10, 3, 32, 32)
    assert y.tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5]
    with pytest.raises(ValueError, match="name must be one of"):
        torchvision_dataset("imagenet", tmp_path)


def test_synthetic_leaf_shapes_and_heterogeneity():
    train, test, train_idx, test_idx = synthetic_leaf(num_clients=20, gamma=0.5, delta=0.5, seed=0)
    assert train.tensors[0].shape[1] == 60
    assert len(train_idx) == 20 and _is_partition(train_idx, len(train))
    assert _is_partition(test_idx, len(test))
    sizes = np.array([len(i) + len(j) for i, j in zip(train_idx, test_idx)])
    assert sizes.min() >= 50  # lognormal + 50
    # every client has a 90/10 split
    assert all(abs(len(j) - round(0.1 * (len(i) + len(j)))) <= 1 for i, j in zip(train_idx, test_idx))
    # labels are the argmax of each client's own linear model: several classes overall
    assert len(torch.unique(train.tensors[1])) >= 5
    same = synthetic_leaf(num_clients=20, seed=0)[0]
    assert torch.equal(same.tensors[0], train.tensors[0])
    # gamma = delta = 0 makes the clients' input means identical in distribution; larger delta spreads them
    spread = lambda d: np.std([train_d.tensors[0][i].mean().item() for i in idx_d])  # noqa: E731
    train_d, _, idx_d, _ = synthetic_leaf(num_clients=30, gamma=0.0, delta=0.0, seed=1)
    low = spread(0)
    train_d, _, idx_d, _ = synthetic_leaf(num_clients=30, gamma=0.0, delta=2.0, seed=1)
    assert spread(2) > 2 * low
    with pytest.raises(ValueError, match="gamma"):
        synthetic_leaf(gamma=-1)


def test_shards_give_exactly_c_classes_and_split_classes_evenly():
    labels = np.repeat(np.arange(10), 100)
    parts = Shards(1).split(labels, 20, seed=0)
    assert _is_partition(parts, 1000)
    assert all(len(np.unique(labels[p])) == 1 for p in parts)
    assert sorted(len(p) for p in parts) == [50] * 20  # each class split between two clients
    parts2 = Shards(2).split(labels, 10, seed=3)
    assert all(len(np.unique(labels[p])) == 2 for p in parts2)
    with pytest.raises(ValueError, match="classes_per_client"):
        Shards(11).split(labels, 10)
    with pytest.raises(ValueError, match="classes_per_client"):
        Shards(0)


def test_label_swap_swaps_the_stated_fraction_per_client():
    labels = np.repeat(np.arange(10), 40)
    ds = torch.utils.data.TensorDataset(torch.randn(400, 3), torch.as_tensor(labels))
    dm = FederatedDataModule(ds, LabelSwap(0.5), num_clients=4, batch_size=4, seed=1)
    new = dm.train_dataset.tensors[1].numpy()
    for i, idx in enumerate(dm.client_indices):
        a, b = ((0, 1), (8, 9))[i % 2]
        for src, dst in ((a, b), (b, a)):
            members = idx[labels[idx] == src]
            assert np.sum(new[members] == dst) == int(len(members) * 0.5)
        untouched = idx[~np.isin(labels[idx], (a, b))]
        assert np.array_equal(new[untouched], labels[untouched])
    same = FederatedDataModule(ds, LabelSwap(0.0), num_clients=4, batch_size=4, seed=1)
    assert np.array_equal(same.train_dataset.tensors[1].numpy(), labels)
    with pytest.raises(ValueError, match="fraction"):
        LabelSwap(1.5)


def test_a_partitioner_declares_that_it_swaps_labels():
    # the datamodule relabels for partitioners that say so (swaps_labels), not for any object with such a method
    class Flip(IID):
        swaps_labels = True

        def swapped_labels(self, labels, client_indices, seed=0):
            return 1 - labels

    labels = np.tile([0, 1], 8)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 2), torch.as_tensor(labels))
    assert not IID().swaps_labels and LabelSwap(0.5).swaps_labels
    flipped = FederatedDataModule(ds, Flip(), num_clients=2)
    assert np.array_equal(flipped.train_dataset.tensors[1].numpy(), 1 - labels)
    assert FederatedDataModule(ds, IID(), num_clients=2).train_dataset is ds
    assert np.array_equal(IID().swapped_labels(labels, [np.arange(16)]), labels)  # the base's no-op
