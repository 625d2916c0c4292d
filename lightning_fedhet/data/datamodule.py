"""FederatedDataModule: a LightningDataModule that knows which samples belong to which client."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_fedhet.data.partition import Partitioner


def dataset_labels(dataset: Dataset) -> np.ndarray | None:
    """Labels of a dataset as an int array ``[n]``, or ``None`` when it exposes none.

    Looks at ``targets`` / ``labels`` attributes (torchvision), the last tensor of a ``TensorDataset``,
    and ``Subset``s of those.
    """
    from torch.utils.data import Subset, TensorDataset

    if isinstance(dataset, Subset):
        parent = dataset_labels(dataset.dataset)
        return None if parent is None else parent[np.asarray(dataset.indices)]
    for attr in ("targets", "labels"):
        value = getattr(dataset, attr, None)
        if value is not None:
            return np.asarray(value.cpu() if isinstance(value, torch.Tensor) else value).reshape(-1)
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) >= 2:
        y = dataset.tensors[-1]
        if y.dim() == 1 and not torch.is_floating_point(y):
            return y.cpu().numpy()
    return None


def split_dataset(
    dataset: Dataset, partitioner: Partitioner | Sequence[Sequence[int]], num_clients: int | None, seed: int
) -> list[np.ndarray]:
    """Per-client index lists for ``dataset`` from a partitioner or an explicit list of index lists."""
    n = len(dataset)
    if isinstance(partitioner, Partitioner):
        if num_clients is None:
            raise ValueError("num_clients is required when partitioner is a Partitioner")
        if int(num_clients) < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        labels = dataset_labels(dataset)
        if labels is None:
            if partitioner.needs_labels:
                raise ValueError(
                    f"partitioner={partitioner!r} needs labels, but the training dataset has no `targets`/`labels` "
                    "attribute and is not a TensorDataset with integer labels"
                )
            labels = np.zeros(n, dtype=np.int64)
        return partitioner.split(labels, int(num_clients), seed)
    parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in partitioner]
    if not parts:
        raise ValueError("partitioner given as index lists must hold at least one client")
    if num_clients is not None and len(parts) != num_clients:
        raise ValueError(f"num_clients={num_clients} but partitioner lists {len(parts)} clients")
    for i, p in enumerate(parts):
        if p.size and (p.min() < 0 or p.max() >= n):
            raise ValueError(f"client {i}'s indices fall outside the dataset [0, {n})")
    return parts


def _relabel(dataset: Dataset, labels: np.ndarray) -> Dataset:
    from torch.utils.data import TensorDataset

    if not isinstance(dataset, TensorDataset):
        raise ValueError("a label-swapping partitioner needs the training set as a TensorDataset (inputs, labels)")
    return TensorDataset(*dataset.tensors[:-1], torch.as_tensor(labels, dtype=dataset.tensors[-1].dtype))


class FederatedDataModule(pl.LightningDataModule):
    """Per-client training data plus ordinary validation/test loaders.

    Args:
        train_dataset: the pooled training set.
        partitioner: a :class:`~lightning_fedhet.data.Partitioner` (``IID()``, ``Dirichlet(0.5)``, ...) or an
            explicit list of per-client index lists.
        num_clients: number of clients ``N`` (required with a Partitioner).
        batch_size: local mini-batch size of every client.
        val_dataset, test_dataset: evaluated on the global model.
        eval_batch_size: batch size of validation/test loaders.
        seed: seed of the partition.

    Example::

        train, test = fashion_mnist()
        dm = FederatedDataModule(train, Dirichlet(0.5), num_clients=100, batch_size=32, val_dataset=test)
        trainer = Trainer(strategy=FedHetStrategy(participation=UniformSample(10)), max_epochs=50)
        trainer.fit(model, datamodule=dm)
    """

    def __init__(
        self,
        train_dataset: Dataset,
        partitioner: Partitioner | Sequence[Sequence[int]],
        num_clients: int | None = None,
        batch_size: int = 32,
        val_dataset: Dataset | None = None,
        test_dataset: Dataset | None = None,
        eval_batch_size: int = 1024,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.train_dataset = train_dataset
        self.partitioner = partitioner
        self.batch_size = int(batch_size)
        self.val_dataset = val_dataset
        self.test_dataset = test_dataset
        self.eval_batch_size = int(eval_batch_size)
        self.seed = int(seed)
        self.client_indices: list[np.ndarray] = split_dataset(train_dataset, partitioner, num_clients, self.seed)
        self.num_clients = len(self.client_indices)
        if isinstance(partitioner, Partitioner) and partitioner.swaps_labels:
            self.train_dataset = _relabel(
                train_dataset, partitioner.swapped_labels(dataset_labels(train_dataset), self.client_indices, self.seed)
            )

    @property
    def client_sizes(self) -> np.ndarray:
        """``|D_i|`` for each client, int64 ``[N]``."""
        return np.array([len(p) for p in self.client_indices], dtype=np.int64)

    def train_dataloader(self) -> DataLoader:
        # FedHetStrategy replaces this loader's sampling with per-client streams; batch size and
        # collate_fn are taken from it.
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.val_dataset is None else DataLoader(self.val_dataset, batch_size=self.eval_batch_size)

    def test_dataloader(self) -> DataLoader | list:
        dataset = self.test_dataset if self.test_dataset is not None else self.val_dataset
        return [] if dataset is None else DataLoader(dataset, batch_size=self.eval_batch_size)
