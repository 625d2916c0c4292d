"""Partitioners: split a labelled training set into per-client index lists.

Every partitioner has ``split(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]``;
the result is a list of ``num_clients`` sorted ``int64`` index arrays into the dataset. Splits are pure
functions of ``(labels, num_clients, seed)``. Every partitioner but :class:`FixedSizeDirichlet` gives disjoint
parts; that one repeats the data set when the clients need more samples than it holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lightning_fedhet._checks import MAX_EXACT_INT, check_int, check_real, check_seed
from lightning_fedhet.seeding import PartitionKey, Stream, generator


def _check_num_clients(num_clients: int, num_samples: int) -> int:
    num_clients = check_int(num_clients, "num_clients")
    if num_clients > num_samples:
        raise ValueError(f"num_clients={num_clients} exceeds the number of samples ({num_samples})")
    return int(num_clients)


def _check_labels(labels: Any, flatten: bool = True) -> np.ndarray:
    """``labels`` (sequence, numpy array or tensor) as a non-empty array of finite real class labels, flattened
    unless ``flatten=False`` (then one row per sample)."""
    what = f"labels must be a non-empty 1-D array of class labels (numbers), got {type(labels).__name__}"
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    if labels is None or isinstance(labels, (str, bytes)):
        raise ValueError(what)
    try:
        arr = np.asarray(labels)
    except (TypeError, ValueError) as err:  # ragged nested sequences
        raise ValueError(what) from err
    if arr.ndim == 0:
        raise ValueError(what)
    if flatten:
        arr = arr.reshape(-1)
    if arr.size == 0 or arr.dtype.kind not in "biuf":
        raise ValueError(what)
    if arr.dtype.kind == "f" and not np.all(np.isfinite(arr)):
        raise ValueError("labels must be finite")
    return arr


class Partitioner:
    """Base class. Subclasses implement :meth:`split`; ``needs_labels`` says whether labels matter, and
    ``swaps_labels`` whether the clients train on labels that :meth:`swapped_labels` changes (label noise)."""

    needs_labels = True
    swaps_labels = False

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        raise NotImplementedError

    def swapped_labels(self, labels: np.ndarray, client_indices: list[np.ndarray], seed: int = 0) -> np.ndarray:
        """The labels the clients train on; unchanged unless the partitioner ``swaps_labels``."""
        return labels

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class IID(Partitioner):
    """Uniformly random split into ``num_clients`` parts of equal size (sizes differ by at most one)."""

    needs_labels = False

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        n = _check_labels(labels, flatten=False).shape[0]  # only the number of samples (rows) matters here
        num_clients = _check_num_clients(num_clients, n)
        perm = generator(check_seed(seed), Stream.PARTITION).permutation(n)
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
        labels = _check_labels(labels)
        num_clients = _check_num_clients(num_clients, len(labels))
        seed = check_seed(seed)
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
        raise ValueError(
            f"Dirichlet(alpha={self.alpha}) gave a client with < {self.min_samples} samples in {self.max_tries} "
            "draws; lower min_samples or num_clients, or raise alpha"
        )


class FixedSizeDirichlet(Partitioner):
    """Every client holds exactly ``samples_per_client`` samples, its label mix drawn from ``Dir(alpha)``.

    The FedAST paper's split (Askin et al. 2024, App. C.4: "each client has 300 data points", Dirichlet
    ``alpha = 0.1``, "repeating the train set if necessary"), following the authors' code: client after client,
    ``p_i ~ Dirichlet(alpha * 1_C)`` over the ``C`` classes present in ``labels``; the counts ``n * p_i`` are
    rounded to integers summing to exactly ``n = samples_per_client`` (floors, then one more for the largest
    remainders, ties to the lower class; the code's plain ``round`` can give ``n +- 1``); each class's count is
    taken without replacement from that class's pool, a seeded permutation of its samples. When a pool runs dry
    it is refilled with a fresh permutation of the whole class, the samples this client already holds moved to
    the back, so a client never holds one sample twice and every sample of a class is handed out once before any
    is handed out again. Clients may therefore share samples (they do whenever ``N * n`` exceeds the data set).

    All draws come from ``generator(seed, PARTITION, PartitionKey.FIXED_SIZE)``, one stream in client order.

    Args:
        samples_per_client: ``n >= 1``, samples per client (paper: 300).
        alpha: concentration ``> 0`` (paper: 0.1); small values give one or two classes per client.

    Raises:
        ValueError: when a client's share of one class exceeds the samples of that class (it cannot hold them
            without repeating a sample); lower ``samples_per_client`` or raise ``alpha``.
    """

    def __init__(self, samples_per_client: int, alpha: float) -> None:
        self.samples_per_client = check_int(samples_per_client, "samples_per_client")
        self.alpha = check_real(alpha, "alpha", 0.0, np.inf, low_open=True, high_open=True)

    @staticmethod
    def counts(n: int, props: np.ndarray) -> np.ndarray:
        """Integers summing to ``n`` closest to ``n * props`` (largest remainder, ties to the lower index)."""
        ideal = n * np.asarray(props, dtype=np.float64)
        out = np.floor(ideal).astype(np.int64)
        order = sorted(range(len(out)), key=lambda c: (-(ideal[c] - out[c]), c))
        for c in order[: n - int(out.sum())]:
            out[c] += 1
        return out

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        if labels is None:
            raise ValueError("FixedSizeDirichlet needs labels: the dataset exposes none (targets/labels)")
        labels = _check_labels(labels)
        num_clients = check_int(num_clients, "num_clients")
        rng = generator(check_seed(seed), Stream.PARTITION, PartitionKey.FIXED_SIZE)
        classes = np.unique(labels)
        members = [np.flatnonzero(labels == c) for c in classes]
        pools = [rng.permutation(m) for m in members]
        n = self.samples_per_client
        parts = []
        for client in range(num_clients):
            counts = self.counts(n, rng.dirichlet(np.full(len(classes), self.alpha)))
            own = []
            for c, k in enumerate(counts):
                if k > len(members[c]):
                    raise ValueError(
                        f"client {client} needs {k} samples of class {classes[c]!r}, which has only "
                        f"{len(members[c])}: samples_per_client={n} cannot be met without repeating a sample "
                        f"within a client; lower samples_per_client or raise alpha (got {self.alpha:g})"
                    )
                taken = pools[c][:k]
                pools[c] = pools[c][k:]
                if len(taken) < k:  # the pool ran dry: refill it, this client's samples at the back
                    fresh = rng.permutation(members[c])
                    held = np.isin(fresh, taken)
                    pools[c] = np.concatenate([fresh[~held], fresh[held]])
                    more = pools[c][: k - len(taken)]
                    pools[c] = pools[c][k - len(taken):]
                    taken = np.concatenate([taken, more])
                own.append(taken)
            parts.append(np.sort(np.concatenate(own)).astype(np.int64))
        return parts


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
        labels = _check_labels(labels)
        num_clients = _check_num_clients(num_clients, len(labels))
        seed = check_seed(seed)
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
    swaps_labels = True

    def __init__(
        self,
        fraction: float,
        pairs: tuple[tuple[int, int], ...] = ((0, 1), (8, 9)),
        base: Partitioner | None = None,
        swap_clients: list[int] | None = None,
    ) -> None:
        self.fraction = check_real(fraction, "fraction", 0.0, 1.0)
        self.pairs = self._check_pairs(pairs)
        if base is not None and not isinstance(base, Partitioner):
            raise TypeError(f"base must be a Partitioner (IID(), Dirichlet(alpha), ...), got {type(base).__name__}")
        self.base = base if base is not None else IID()
        self.swap_clients = None if swap_clients is None else self._check_clients(swap_clients)

    @staticmethod
    def _check_pairs(pairs: Any) -> tuple[tuple[int, int], ...]:
        what = f"pairs must be a non-empty list of two distinct labels (integers >= 0) each, got {pairs!r}"
        try:
            if isinstance(pairs, (str, bytes)):
                raise TypeError(what)
            items = [tuple(p) for p in pairs]
        except TypeError as err:  # not a sequence of sequences
            raise ValueError(what) from err
        if not items or any(len(p) != 2 for p in items):
            raise ValueError(what)
        checked = tuple((check_int(a, "pairs", 0, MAX_EXACT_INT), check_int(b, "pairs", 0, MAX_EXACT_INT))
                        for a, b in items)
        if any(a == b for a, b in checked):
            raise ValueError(what)
        return checked

    @staticmethod
    def _check_clients(swap_clients: Any) -> list[int]:
        try:
            if isinstance(swap_clients, (str, bytes)):
                raise TypeError
            ids = list(swap_clients)
        except TypeError as err:
            raise ValueError(f"swap_clients must be None or a list of client ids (integers >= 0), got "
                             f"{swap_clients!r}") from err
        return [check_int(c, "swap_clients", 0) for c in ids]

    def split(self, labels: np.ndarray, num_clients: int, seed: int = 0) -> list[np.ndarray]:
        return self.base.split(labels, num_clients, seed)

    def swapped_labels(self, labels: np.ndarray, client_indices: list[np.ndarray], seed: int = 0) -> np.ndarray:
        """A copy of ``labels`` with each swapping client's pair swapped on ``fraction`` of its samples."""
        labels = _check_labels(labels).copy()
        seed = check_seed(seed)
        original = labels.copy()
        clients = range(len(client_indices)) if self.swap_clients is None else self.swap_clients
        for i in clients:
            if not 0 <= i < len(client_indices):
                raise ValueError(f"swap_clients holds {i}, outside [0, {len(client_indices)})")
            a, b = self.pairs[i % len(self.pairs)]
            rng = generator(seed, Stream.PARTITION, PartitionKey.LABEL_SWAP, i)
            own = np.asarray(client_indices[i]).reshape(-1)
            if own.size and (own.dtype.kind not in "iu" or own.min() < 0 or own.max() >= len(labels)):
                raise ValueError(f"client_indices[{i}] must hold integer indices in [0, {len(labels)})")
            for src, dst in ((a, b), (b, a)):
                members = own[original[own] == src]
                chosen = rng.choice(members, size=int(len(members) * self.fraction), replace=False)
                labels[chosen] = dst
        return labels
