"""Independent (Bernoulli) availability: each client flips its own coin every round."""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_fedhet.participation._process import ProbabilityProcess, fmt_spec
from lightning_fedhet.participation.recipes import Recipe, check_prob_spec, resolve_probs


class Bernoulli(ProbabilityProcess):
    """Client ``i`` is available in round ``t`` with probability ``p_i``, independently across clients and rounds.

    This is the participation model of FedAU's theory (Assumption 4) and of FedStale's experiments.
    Round ``t`` draws ``U ~ Uniform[0, 1)^N`` from ``generator(seed, Stream.PARTICIPATION, t)`` and returns
    ``U < p``, so any round can be drawn in any order.

    Args:
        p: a probability in ``[0, 1]``, a per-client sequence of them (length ``N``, checked at ``setup``), or a
            recipe (:class:`~.recipes.LabelCorrelated`, :class:`~.recipes.TwoGroup`) resolved at ``setup``.

    Usage::

        proc = Bernoulli(0.1)
        proc.setup(num_clients=100, seed=0)
        proc.sample(3)      # torch.bool [100]
    """

    def __init__(self, p: Any) -> None:
        super().__init__()
        self._p_spec = check_prob_spec(p, "p")
        if isinstance(self._p_spec, Recipe) and self._p_spec.returns_lam:
            raise ValueError(f"p={self._p_spec!r} also fixes Markov correlations (lam); use Markov(p=...) with it")
        self._p: np.ndarray = np.empty(0)

    def _resolve(self, label_hist: np.ndarray | None) -> None:
        self._p, _ = resolve_probs(self._p_spec, self.num_clients, self.seed, label_hist, "p")

    def _sample(self, round: int) -> np.ndarray:
        return self.rng(round).random(self.num_clients) < self._p

    def _stationary(self) -> np.ndarray:
        return self._p.copy()

    def __repr__(self) -> str:
        spec = self._p_spec
        return f"Bernoulli(p={fmt_spec(spec)})"
