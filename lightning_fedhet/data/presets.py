"""Ready-made federated datamodules for configs and the CLI (datasets are built from plain arguments)."""

from __future__ import annotations

import numpy as np

from lightning_fedhet.data.datamodule import FederatedDataModule
from lightning_fedhet.data.datasets import fashion_mnist, synthetic_leaf, torchvision_dataset
from lightning_fedhet.data.partition import Dirichlet, Partitioner


class FashionMNISTFederated(FederatedDataModule):
    """Fashion-MNIST split over ``num_clients`` clients; the test set validates and tests the global model.

    Works offline with Debian's ``dataset-fashion-mnist`` (see :func:`~lightning_fedhet.data.fashion_mnist`).

    Args:
        num_clients: ``N``.
        partitioner: default ``Dirichlet(0.5)``.
        batch_size: local mini-batch size.
        data_dir: folder with the IDX files (optional), or torchvision's root with ``download=True``.
        download: let torchvision download the data when it is not found.
        val_size: number of test images used for per-round validation (``None``: all 10,000).
        eval_batch_size, seed: as in :class:`FederatedDataModule`.
    """

    def __init__(
        self,
        num_clients: int = 100,
        partitioner: Partitioner | None = None,
        batch_size: int = 32,
        data_dir: str | None = None,
        download: bool = False,
        val_size: int | None = None,
        eval_batch_size: int = 1000,
        seed: int = 0,
    ) -> None:
        train, test = fashion_mnist(data_dir, download=download)
        val = test
        if val_size is not None:
            from torch.utils.data import Subset

            if not 1 <= val_size <= len(test):
                raise ValueError(f"val_size must be in [1, {len(test)}], got {val_size}")
            val = Subset(test, np.arange(val_size))
        super().__init__(
            train,
            partitioner if partitioner is not None else Dirichlet(0.5),
            num_clients=num_clients,
            batch_size=batch_size,
            val_dataset=val,
            test_dataset=test,
            eval_batch_size=eval_batch_size,
            seed=seed,
        )


class TorchvisionFederated(FederatedDataModule):
    """A torchvision dataset (``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``, ``svhn``) split over clients."""

    def __init__(
        self,
        name: str,
        data_dir: str,
        num_clients: int = 100,
        partitioner: Partitioner | None = None,
        batch_size: int = 32,
        download: bool = False,
        eval_batch_size: int = 1000,
        seed: int = 0,
    ) -> None:
        train = torchvision_dataset(name, data_dir, train=True, download=download)
        test = torchvision_dataset(name, data_dir, train=False, download=download)
        super().__init__(
            train,
            partitioner if partitioner is not None else Dirichlet(0.5),
            num_clients=num_clients,
            batch_size=batch_size,
            val_dataset=test,
            test_dataset=test,
            eval_batch_size=eval_batch_size,
            seed=seed,
        )


class SyntheticLeafFederated(FederatedDataModule):
    """LEAF Synthetic(gamma, delta): each client's data is generated for it (see :func:`synthetic_leaf`).

    Validation/test use the pooled per-client held-out splits.
    """

    def __init__(
        self,
        num_clients: int = 100,
        gamma: float = 0.5,
        delta: float = 0.5,
        batch_size: int = 32,
        eval_batch_size: int = 4096,
        seed: int = 0,
    ) -> None:
        train, test, train_idx, test_idx = synthetic_leaf(num_clients, gamma, delta, seed=seed)
        self.test_client_indices = test_idx
        super().__init__(
            train,
            train_idx,
            batch_size=batch_size,
            val_dataset=test,
            test_dataset=test,
            eval_batch_size=eval_batch_size,
            seed=seed,
        )
