"""Partitioners: split a labelled training set into per-client index lists.

Every partitioner has ``split(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]``;
the result is a list of ``num_clients`` sorted ``int64`` index arrays into the dataset. Splits are pure
functions of ``(labels, num_clients, seed)``.
"""

from __future__ import annotations

import numpy as np

from lightning_fedhet._checks import check_int, check_real
from lightning_fedhet.seeding import PartitionKey, Stream, generator


def _check_num_clients(num_clients: int, num_samples: int) -> int:
    num_clients = check_int(num_clients, "num_clients")
    if num_clients > num_samples:
        raise ValueError(f"num_clients={num_clients} exceeds the number of samples ({num_samples})")
    return int(num_clients)


class Partitioner:
    """Base class. Subclasses implement :meth:`split`; ``needs_labels`` says whether labels matter."""

    needs_labels = True

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class IID(Partitioner):
    """Uniformly random split into ``num_clients`` parts of equal size (sizes differ by at most one)."""

    needs_labels = False

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        n = len(labels)
        num_clients = _check_num_clients(num_clients, n)
        perm = generator(seed, Stream.PARTITION).permutation(n)
        return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_clients)]


class Dirichlet(Partitioner):
    """Label-skewed split (Hsu et al. 2019): each class is divided among clients in proportions ``~ Dir(alpha)``.

    For every class ``c`` a vector ``q_c ~ Dirichlet(alpha * 1_N)`` is drawn and the class's (shuffled)
    samples are cut in those proportions. Small ``alpha`` gives few classes per client; ``alpha -> inf``
    tends to IID. The draw is repeated (with the next sub-seed) until every client holds at least
    ``min_samples`` samples, as in FedMA's partitioner.

    Args:
        alpha: concentration, ``> 0``.
        min_samples: minimum samples per client (``0`` allows empty clients).
        max_tries: redraws before giving up with an error.
    """

    def __init__(self, alpha: float, min_samples: int = 1, max_tries: int = 1000) -> None:
        self.alpha = check_real(alpha, "alpha", 0.0, np.inf, low_open=True, high_open=True)
        self.min_samples = check_int(min_samples, "min_samples", 0)
        self.max_tries = check_int(max_tries, "max_tries")

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        if labels is None:
            raise ValueError("Dirichlet partitioner needs labels: the dataset exposes none (targets/labels)")
        labels = np.asarray(labels).reshape(-1)
        num_clients = _check_num_clients(num_clients, len(labels))
        if num_clients * self.min_samples > len(labels):
            raise ValueError(
                f"min_samples={self.min_samples} x num_clients={num_clients} exceeds {len(labels)} samples"
            )
        classes = np.unique(labels)
        by_class = [np.flatnonzero(labels == c) for c in classes]
        for attempt in range(self.max_tries):
            rng = generator(seed, Stream.PARTITION, attempt)
            parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
            for idx in by_class:
                idx = rng.permutation(idx)
                props = rng.dirichlet(np.full(num_clients, self.alpha))
                cuts = (np.cumsum(props) * len(idx)).astype(np.int64)[:-1]
                for client, chunk in enumerate(np.split(idx, cuts)):
                    parts[client].append(chunk)
            out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
            if min(len(o) for o in out) >= self.min_samples:
                return out
        raise RuntimeError(
            f"Dirichlet(alpha={self.alpha}) gave a client with < {self.min_samples} samples in {self.max_tries} "
            "draws; lower min_samples or num_clients, or raise alpha"
        )


class Shards(Partitioner):
    """Each client holds exactly ``classes_per_client`` classes (FedACS's and UPGA-PL's MNIST splits).

    Classes are dealt to clients round-robin over a seeded permutation of the classes: client ``i`` gets
    classes ``perm[(i*c + j) mod C]`` for ``j < c``. Each class's samples (shuffled) are then divided
    equally among the clients that hold it. With ``N = 20``, ``C = 10``, ``c = 1`` every class is split
    between two clients (FedACS one-class-per-client); with ``N = 10``, ``c = 2`` each client holds two
    classes (UPGA-PL).

    Args:
        classes_per_client: ``1 <= c <= C``.
    """

    def __init__(self, classes_per_client: int) -> None:
        self.classes_per_client = check_int(classes_per_client, "classes_per_client")

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        labels = np.asarray(labels).reshape(-1)
        num_clients = _check_num_clients(num_clients, len(labels))
        classes = np.unique(labels)
        c = self.classes_per_client
        if c > len(classes):
            raise ValueError(f"classes_per_client must be <= the number of classes ({len(classes)}), got {c}")
        rng = generator(seed, Stream.PARTITION, PartitionKey.SHARDS)
        order = rng.permutation(classes)
        holders: dict[int, list[int]] = {int(k): [] for k in classes}
        for i in range(num_clients):
            for j in range(c):
                holders[int(order[(i * c + j) % len(order)])].append(i)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k, owners in holders.items():
            idx = rng.permutation(np.flatnonzero(labels == k))
            for owner, chunk in zip(owners, np.array_split(idx, len(owners)) if owners else []):
                parts[owner].append(chunk)
        return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


class LabelSwap(Partitioner):
    """FedStale's concept-shift heterogeneity: a base split, then a fraction of two labels swapped per client.

    The FedStale paper's experiments. Reading (b) of the released code is the default: every client
    swaps one label pair, client ``i`` the pair ``pairs[i % len(pairs)]`` (MNIST: even clients (0, 1), odd
    clients (8, 9)); for each class ``a`` of the pair, ``int(n_a * fraction)`` of the client's samples of
    class ``a``, chosen at random, get the other label. Reading (a) (only the less-participating group swaps)
    is ``swap_clients=<their ids>``. ``fraction = 0`` is the IID split, ``1`` "maximum heterogeneity".
    The swap changes the training labels only; the global test set is left as is.

    Args:
        fraction: ``sigma_g^2`` in ``[0, 1]``.
        pairs: label pairs to swap (CIFAR-10 in the code: ``((3, 5), (2, 6))``).
        base: the base split (default ``IID()``).
        swap_clients: ids of the clients that swap (default: all).
    """

    needs_labels = True

    def __init__(
        self,
        fraction: float,
        pairs: tuple[tuple[int, int], ...] = ((0, 1), (8, 9)),
        base: Partitioner | None = None,
        swap_clients: list[int] | None = None,
    ) -> None:
        fraction = check_real(fraction, "fraction", 0.0, 1.0)
        pairs = tuple(tuple(int(v) for v in p) for p in pairs)
        if not pairs or any(len(p) != 2 or p[0] == p[1] for p in pairs):
            raise ValueError(f"pairs must be a non-empty list of two distinct labels each, got {pairs}")
        self.fraction = float(fraction)
        self.pairs = pairs
        self.base = base if base is not None else IID()
        self.swap_clients = None if swap_clients is None else [int(c) for c in swap_clients]

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        return self.base.split(labels, num_clients, seed)

    def swapped_labels(self, labels: np.ndarray, client_indices: list[np.ndarray], seed: int = 0) -> np.ndarray:
        """A copy of ``labels`` with each swapping client's pair swapped on ``fraction`` of its samples."""
        labels = np.asarray(labels).copy()
        original = labels.copy()
        clients = range(len(client_indices)) if self.swap_clients is None else self.swap_clients
        for i in clients:
            if not 0 <= i < len(client_indices):
                raise ValueError(f"swap_clients holds {i}, outside [0, {len(client_indices)})")
            a, b = self.pairs[i % len(self.pairs)]
            rng = generator(seed, Stream.PARTITION, PartitionKey.LABEL_SWAP, i)
            own = np.asarray(client_indices[i])
            for src, dst in ((a, b), (b, a)):
                members = own[original[own] == src]
                chosen = rng.choice(members, size=int(len(members) * self.fraction), replace=False)
                labels[chosen] = dst
        return labels
