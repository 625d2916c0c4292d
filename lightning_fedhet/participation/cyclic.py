"""Cyclic availability (FedAU's ``cyclic-100`` pattern): fixed on/off blocks with a random phase per client."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import check_choice, check_int, check_round
from lightning_fedhet.participation._process import ProbabilityProcess, fmt_spec
from lightning_fedhet.participation.recipes import Recipe, check_prob_spec, resolve_probs
from lightning_fedhet.seeding import STATIC_KEY, StaticKey, Stream, generator

MAX_PERIOD = 10**9


class Cyclic(ProbabilityProcess):
    """Each client is on for ``active`` consecutive rounds, then off for ``inactive`` rounds, and repeats.

    Block lengths follow FedAU's released code (``cyclic-100``) exactly::

        active   = max(1, round(period * p_i))      # Python/numpy round: halves go to the even integer
        inactive = max(1, period - active)

    so a client's cycle is ``active + inactive`` rounds long: ``period`` except when ``round(period * p_i)`` is 0
    or ``period`` (then ``period + 1``). The long-run frequency, reported as :attr:`p`, is therefore
    ``active / (active + inactive)``, not the requested ``p_i`` (e.g. ``p = 1`` gives ``period / (period + 1)``,
    ``p = 0`` gives ``1 / period``).

    Phase offsets (the paper says "random initial offset", the code offsets within the inactive phase), one per
    client, drawn once from
    ``generator(seed, Stream.PARTICIPATION, STATIC_KEY, StaticKey.CYCLIC_OFFSET)``:

    - ``offset="uniform"`` (default): uniform over the whole cycle, so every round's availability is exactly
      ``Bernoulli(active / (active + inactive))`` marginally (the paper's "to simulate a stationary random
      process").
    - ``offset="inactive"``: FedAU's code: every client starts in its off block at a uniform position within it,
      so its first active round is uniform on ``{0, ..., inactive - 1}``. The process is then not stationary: the
      probability that client ``i`` is on in round ``t`` is ``#{u in 0..inactive-1 : (t - u) mod cycle < active} /
      inactive`` (0 in round 0 unless ``u = 0`` is possible, ...), whose average over a cycle is :attr:`p`;
      :meth:`marginal_probs` gives it round by round, and the server divides by it.

    Client ``i`` is on in round ``t`` iff ``(t + phase_i) mod (active_i + inactive_i) < active_i``; no state, any
    round in ``O(N)``.

    Args:
        period: nominal cycle length in rounds, integer in ``[1, 10**9]`` (FedAU: 100).
        p: target participation probability in ``[0, 1]``: scalar, per-client sequence or recipe.
        offset: ``"uniform"`` or ``"inactive"``.
    """

    def __init__(self, period: int, p: Any, offset: str = "uniform") -> None:
        super().__init__()
        # bounded so that block lengths and phases stay exact int64 arithmetic (a billion rounds is longer than any run)
        self.period = check_int(period, "period", 1, MAX_PERIOD)
        self._p_spec = check_prob_spec(p, "p")
        if isinstance(self._p_spec, Recipe) and self._p_spec.returns_lam:
            raise ValueError(f"p={self._p_spec!r} also fixes Markov correlations (lam); use Markov(p=...) with it")
        self.offset = check_choice(offset, "offset", ("uniform", "inactive"))
        self.active = self.inactive = self.phase = np.empty(0, dtype=np.int64)

    @staticmethod
    def block_lengths(period: int, p: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(active, inactive)`` block lengths (int64) for ``period`` and probabilities ``p`` (FedAU's rule)."""
        active = np.maximum(1, np.rint(period * np.asarray(p, dtype=np.float64))).astype(np.int64)
        inactive = np.maximum(1, period - active).astype(np.int64)
        return active, inactive

    def _resolve(self, label_hist: np.ndarray | None) -> None:
        p, _ = resolve_probs(self._p_spec, self.num_clients, self.seed, label_hist, "p")
        self.active, self.inactive = self.block_lengths(self.period, p)
        cycle = self.active + self.inactive
        rng = generator(self.seed, Stream.PARTICIPATION, STATIC_KEY, StaticKey.CYCLIC_OFFSET)
        if self.offset == "uniform":
            self.phase = rng.integers(0, cycle)
        else:
            # FedAU's code starts every client inactive with ``rounds_to_switch ~ randint(0, inactive - 1)``: the
            # first active round u is uniform on {0, ..., inactive - 1}; phase = cycle - u puts round u at the
            # start of an active block (u = 0: active from round 0).
            first_active = rng.integers(0, self.inactive)
            self.phase = (cycle - first_active) % cycle
        self._cycle = cycle

    def _sample(self, round: int) -> np.ndarray:
        return (round + self.phase) % self._cycle < self.active

    def _stationary(self) -> np.ndarray:
        return self.active / self._cycle

    def marginal_probs(self, round: int) -> Tensor:
        """``P(on in round round)`` per client, float64 ``[N]``: :attr:`p` under ``offset="uniform"``; under
        ``"inactive"`` the share of the equally likely first-active rounds ``u in {0, ..., inactive - 1}`` for which
        ``(round - u) mod cycle < active``."""
        check_round(round)
        self._check_setup()
        if self.offset == "uniform":
            return self.p
        # client on iff (t - u) mod c < a, u uniform on [0, I): count the integers x in the window [t - I + 1, t]
        # (x = t - u; shifted by a multiple of c so that its top is t mod c) whose residue lies in [0, a)
        t = int(round)
        a, inactive, c = self.active, self.inactive, self._cycle
        hi = t % c  # residue of u = 0; the window is hi, hi-1, ..., hi-I+1 (mod c)
        lo = hi - inactive + 1
        # The window holds I = c - a residues. Where it wraps below 0, the wrapped part is [lo + c, c - 1] =
        # [hi + a + 1, c - 1], above every active residue [0, a - 1]; so the active ones in the window are those of
        # [max(lo, 0), min(hi, a - 1)], a count that is never negative (lo > a - 1 would need hi > c - 1).
        on = np.minimum(hi, a - 1) - np.maximum(lo, 0) + 1
        return torch.as_tensor(on / inactive, dtype=torch.float64)

    def __repr__(self) -> str:
        return f"Cyclic(period={self.period}, p={fmt_spec(self._p_spec)}, offset={self.offset!r})"
