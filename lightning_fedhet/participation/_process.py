"""Common base of the processes parameterised by per-client probabilities (Bernoulli, Markov, Cyclic)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_fedhet.participation.base import Participation
from lightning_fedhet.participation.recipes import Recipe


class ProbabilityProcess(Participation):
    """A process whose ``p`` may be a scalar, a per-client array or a :class:`~.recipes.Recipe`.

    ``setup(num_clients, seed, label_hist=None)``: ``label_hist`` (``[N, C]`` label counts) is only needed, and
    only used, when a recipe reports ``needs_label_hist`` (see :attr:`needs_label_hist`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._p_spec: Any = None

    @property
    def needs_label_hist(self) -> bool:
        """Whether :meth:`setup` must be given ``label_hist=`` (a recipe such as ``LabelCorrelated`` is used)."""
        return isinstance(self._p_spec, Recipe) and self._p_spec.needs_label_hist

    def setup(self, num_clients: int, seed: int = 0, *, label_hist: np.ndarray | None = None) -> None:
        super().setup(num_clients, seed)
        self._resolve(label_hist)

    def _resolve(self, label_hist: np.ndarray | None) -> None:
        raise NotImplementedError


def fmt_spec(spec: Any) -> str:
    """Short text of a probability argument for ``__repr__``: the number, ``<per-client>`` or the recipe."""
    if spec is None:
        return "None"
    if isinstance(spec, Recipe):
        return repr(spec)
    arr = np.asarray(spec)
    return f"{float(arr):g}" if arr.ndim == 0 else f"<{arr.shape[0]} per-client values>"
