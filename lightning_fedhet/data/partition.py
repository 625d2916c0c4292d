"""Partitioners: split a labelled training set into per-client index lists.

Every partitioner has ``split(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]``;
the result is a list of ``num_clients`` sorted ``int64`` index arrays into the dataset. Splits are pure
functions of ``(labels, num_clients, seed)``.
"""

from __future__ import annotations

import numpy as np

from lightning_fedhet.seeding import Stream, generator


def _check_num_clients(num_clients: int, num_samples: int) -> int:
    if int(num_clients) != num_clients or int(num_clients) < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients}")
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
        if not (np.isfinite(alpha) and alpha > 0):
            raise ValueError(f"alpha must be a finite number > 0, got {alpha}")
        if int(min_samples) < 0:
            raise ValueError(f"min_samples must be >= 0, got {min_samples}")
        self.alpha = float(alpha)
        self.min_samples = int(min_samples)
        self.max_tries = int(max_tries)

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
