"""Per-client mini-batch streams, a pure function of ``(seed, round, client)``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_fedhet.seeding import Stream, generator, generators


class ClientStreams:
    """Which samples each client's local steps use.

    In round ``t`` client ``i`` walks through a fresh random permutation of its indices (seeded by
    ``(seed, t, i)``), drawing a new permutation whenever one is used up, and takes consecutive
    mini-batches of ``min(batch_size, |D_i|)`` samples. Nothing carries over between rounds, so any
    round can be replayed and a resumed run sees the same batches.

    Args:
        dataset: the pooled training dataset.
        client_indices: per-client index arrays into ``dataset``.
        batch_size: local mini-batch size ``B``.
        seed: data-order seed.
        collate_fn: how a list of samples becomes a batch (the user's DataLoader's).
        num_workers, pin_memory: passed to the DataLoader used when batches cannot be sliced directly.
    """

    def __init__(
        self,
        dataset: Dataset,
        client_indices: Sequence[np.ndarray],
        batch_size: int,
        seed: int = 0,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.client_indices = [np.asarray(c, dtype=np.int64) for c in client_indices]
        # read on every submitted update: computed once, read-only so no caller can change it by accident
        self._sizes = np.array([len(c) for c in self.client_indices], dtype=np.int64)
        self._sizes.flags.writeable = False
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.collate_fn = collate_fn or default_collate
        self.num_workers = int(num_workers)
        self.pin_memory = bool(pin_memory)
        # Slicing a TensorDataset gives exactly what default_collate would, without per-sample work.
        self._sliceable = (
            isinstance(dataset, TensorDataset) and self.collate_fn is default_collate and self.num_workers == 0
        )

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client, ``|D_i|`` (int64 ``[N]``, read-only)."""
        return self._sizes

    def batch_indices(self, round: int, client: int, num_steps: int) -> list[np.ndarray]:
        """Dataset indices of client ``client``'s ``num_steps`` mini-batches in round ``round``."""
        own = self._own(client)
        return self._draw(own, generator(self.seed, Stream.DATA, round, client), num_steps)

    def round_batch_indices(
        self, round: int, clients: Sequence[int], num_steps: Sequence[int]
    ) -> list[list[np.ndarray]]:
        """:meth:`batch_indices` of each client of ``clients`` (``num_steps[i]`` mini-batches for ``clients[i]``), the
        same draws; their generators are built together (:func:`~lightning_fedhet.seeding.generators`), which is
        faster for a round's cohort."""
        owns = [self._own(client) for client in clients]
        rngs = generators(self.seed, Stream.DATA, round, clients)
        return [self._draw(own, rng, int(k)) for own, rng, k in zip(owns, rngs, num_steps)]

    def _own(self, client: int) -> np.ndarray:
        own = self.client_indices[client]
        if own.size == 0:
            raise ValueError(f"client {client} holds no samples")
        return own

    def _draw(self, own: np.ndarray, rng: np.random.Generator, num_steps: int) -> list[np.ndarray]:
        """``num_steps`` consecutive mini-batches of a walk through fresh permutations of ``own`` drawn by ``rng``."""
        size = min(self.batch_size, own.size)
        needed = size * num_steps
        order = [rng.permutation(own) for _ in range(-(-needed // own.size))]
        flat = np.concatenate(order)[:needed]
        return list(flat.reshape(num_steps, size))

    def probe_indices(self, round: int, client: int) -> np.ndarray:
        """Dataset indices of the one mini-batch client ``client`` evaluates at ``w_t`` in round ``round``.

        Drawn from a stream of its own, so probing a client does not change its training batches.
        """
        own = self.client_indices[client]
        if own.size == 0:
            raise ValueError(f"client {client} holds no samples")
        rng = generator(self.seed, Stream.PROBE, round, client)
        return rng.permutation(own)[: min(self.batch_size, own.size)]

    def batch(self, indices: np.ndarray):
        """One mini-batch from dataset indices ``[B]``."""
        return next(iter(self.iterate([indices])))

    def stacked_batch(self, indices: np.ndarray):
        """One mini-batch per client, stacked on a leading client dim, from indices ``[C, B]`` (vmap engine)."""
        if self._sliceable:
            index = torch.from_numpy(indices)
            flat = index.reshape(-1)
            return [_rows(t, flat).view(*index.shape, *t.shape[1:]) for t in self.dataset.tensors]
        return stack_batches([self.collate_fn([self.dataset[int(i)] for i in row]) for row in indices])

    def iterate(self, schedule: Sequence[np.ndarray]) -> Iterator:
        """Yield the batches for a list of index arrays, in order."""
        if self._sliceable:
            tensors = self.dataset.tensors
            for idx in schedule:
                index = torch.from_numpy(idx)
                yield [_rows(t, index) for t in tensors]
            return
        if not schedule:
            return
        loader = DataLoader(
            self.dataset,
            batch_sampler=[idx.tolist() for idx in schedule],
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
        yield from loader


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[index]`` for a 1-D index (``index_select``: about twice as fast as advanced indexing on a CPU)."""
    return tensor.index_select(0, index.to(tensor.device, non_blocking=True))


def stack_batches(batches: Sequence) -> object:
    """Stack a list of per-client batches (tensors, or lists/tuples/dicts of tensors) on a new dim 0."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(batches))
    if isinstance(first, dict):
        return {k: stack_batches([b[k] for b in batches]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(stack_batches([b[i] for b in batches]) for i in range(len(first)))
    raise TypeError(f"batches of type {type(first).__name__} cannot be stacked per client")
