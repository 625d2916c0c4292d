"""Federated data: partitioners, the FederatedDataModule and offline-capable dataset loaders."""

from lightning_fedhet.data.datamodule import FederatedDataModule, dataset_labels, split_dataset
from lightning_fedhet.data.datasets import fashion_mnist, synthetic_leaf, to_tensor_dataset, torchvision_dataset
from lightning_fedhet.data.partition import IID, Dirichlet, FixedSizeDirichlet, LabelSwap, Partitioner, Shards
from lightning_fedhet.data.presets import FashionMNISTFederated, SyntheticLeafFederated, TorchvisionFederated

__all__ = [
    "FederatedDataModule",
    "FashionMNISTFederated",
    "TorchvisionFederated",
    "SyntheticLeafFederated",
    "Partitioner",
    "IID",
    "Dirichlet",
    "FixedSizeDirichlet",
    "Shards",
    "LabelSwap",
    "dataset_labels",
    "split_dataset",
    "fashion_mnist",
    "synthetic_leaf",
    "torchvision_dataset",
    "to_tensor_dataset",
]
