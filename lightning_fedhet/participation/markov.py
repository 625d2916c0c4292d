"""Two-state Markov availability: each client's on/off state is a time-correlated chain."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedhet._checks import as_prob_array, check_int, per_client
from lightning_fedhet.participation._process import ProbabilityProcess, fmt_spec
from lightning_fedhet.participation.recipes import Recipe, check_prob_spec, resolve_probs


class Markov(ProbabilityProcess):
    """Independent two-state (off/on) Markov chains, one per client, started from their stationary law.

    Three parameterisations (exactly one):

    - ``Markov(p=..., lam=...)`` (thesis ch.2, App. F.C): stationary probability ``p`` and signed second
      eigenvalue ``lam`` in ``(-1, 1)``; ``P(off->on) = p (1 - lam)``, ``P(on->off) = (1 - p)(1 - lam)``.
      Both must lie in ``[0, 1]``, i.e. ``lam >= max(1 - 1/p, 1 - 1/(1 - p))`` (only negative ``lam`` can fail).
      ``lam = 0`` is Bernoulli(p); ``lam -> 1`` gives long on/off stints. ``p`` may be a recipe; with
      :class:`~.recipes.CAFedClasses` the recipe also gives ``lam`` (omit it then).
    - ``Markov(p_on=..., p_off=...)``: ``p_on = P(off->on)``, ``p_off = P(on->off)``, each in ``[0, 1]`` with
      ``0 < p_on + p_off < 2`` (else the chain is frozen or periodic); ``p = p_on / (p_on + p_off)``,
      ``lam = 1 - p_on - p_off``.
    - ``Markov(p=..., max_on=0.05)`` (FedAU's code, ``markov-0.05``): ``a = P(off->on) = max_on``,
      ``b = P(on->off) = a (1/p - 1)``; if ``b > 1``: ``a <- a/b``, ``b <- 1``. Stationary probability stays ``p``.

    Every argument may be a scalar or a per-client array (``p`` also a recipe). Initial state: ``Bernoulli(p)``
    (stationary start, Assumption 1 of the thesis; CA-Fed's code). FedAU's code applies one transition before
    returning round 0; from a stationary start that has the same law, so round 0 here is the stationary draw.

    **Purity and cost.** ``sample(t)`` is a pure function of ``(seed, t)``: the state at round 0 is
    ``U_0 < p`` and the step into round ``s >= 1`` uses ``U_s`` (stays on iff ``U_s < 1 - P(on->off)``, turns on iff
    ``U_s < P(off->on)``), with ``U_s ~ Uniform[0, 1)^N`` from ``generator(seed, Stream.PARTICIPATION, s)``.
    Because round ``t`` depends on ``U_0..U_t``, states are cached, never carried as hidden randomness:

    - a checkpoint of the state at every multiple of ``block`` rounds (bit-packed, ``N/8`` bytes each), kept in
      a dict; checkpoints are filled in order, each computed from the previous one;
    - the last state drawn.

    Drawing round ``t`` starts from the later of the last drawn state (if at or before ``t``) and the checkpoint
    at ``block * floor(t / block)`` and simulates forward, so drawing rounds ``0..T-1`` in order costs one ``O(N)``
    step per round, and re-drawing any round already passed costs at most ``block - 1`` steps. Only the first
    visit beyond the last checkpoint simulates up to it (``O(t N)`` once). Memory: ``N t / (8 block)`` bytes.

    Args:
        p: stationary availability probability, ``[0, 1]`` (scalar, per-client sequence or recipe).
        lam: second eigenvalue, ``(-1, 1)``.
        p_on: ``P(off->on)`` in ``[0, 1]``.
        p_off: ``P(on->off)`` in ``[0, 1]``.
        max_on: FedAU's largest ``P(off->on)``, in ``(0, 1]``.
        block: checkpoint spacing in rounds, ``>= 1``.
    """

    def __init__(self, p: Any = None, lam: Any = None, *, p_on: Any = None, p_off: Any = None, max_on: Any = None,
                 block: int = 128) -> None:
        super().__init__()
        self.block = check_int(block, "block")
        given = {k for k, v in dict(p=p, lam=lam, p_on=p_on, p_off=p_off, max_on=max_on).items() if v is not None}
        recipe_lam = isinstance(p, Recipe) and p.returns_lam
        if given == {"p", "lam"} or (given == {"p"} and recipe_lam):
            self.form = "lam"
        elif given == {"p_on", "p_off"}:
            self.form = "transition"
        elif given == {"p", "max_on"}:
            self.form = "max_on"
        else:
            raise ValueError("Markov takes exactly one of (p=, lam=), (p_on=, p_off=) or (p=, max_on=); got "
                             f"{sorted(given) or 'nothing'}")
        if recipe_lam and given != {"p"}:
            raise ValueError(f"p={p!r} already fixes lam; use Markov(p={p!r}) without lam or max_on")
        self._p_spec = None if p is None else check_prob_spec(p, "p")
        self._lam_spec = None if lam is None else as_prob_array(lam, "lam", -1.0, 1.0, True, True)
        self._p_on_spec = None if p_on is None else as_prob_array(p_on, "p_on")
        self._p_off_spec = None if p_off is None else as_prob_array(p_off, "p_off")
        self._max_on_spec = None if max_on is None else as_prob_array(max_on, "max_on", low_open=True)
        # Fail early on infeasible combinations whenever the lengths are already known to agree.
        if self.form == "transition":
            self._transition_to_stationary(self._p_on_spec, self._p_off_spec)
        elif self.form == "lam" and not isinstance(self._p_spec, Recipe):
            self._lam_to_transition(self._p_spec, self._lam_spec)
        self._a = self._b = self._pi = np.empty(0)
        self._reset_cache()

    # ------------------------------------------------------------------ parameter conversion
    @staticmethod
    def _pair(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``x, y`` broadcast to a common 1-D shape, or None when their per-client lengths differ."""
        try:
            x, y = np.broadcast_arrays(np.atleast_1d(x), np.atleast_1d(y))
        except ValueError:
            return None  # reported as a per-client length error at setup
        return x, y

    @classmethod
    def _lam_to_transition(cls, p: np.ndarray, lam: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        pair = cls._pair(p, lam)
        if pair is None:
            return None
        p, lam = pair
        a = p * (1.0 - lam)
        b = (1.0 - p) * (1.0 - lam)
        bad = np.flatnonzero((a > 1.0) | (b > 1.0))
        if bad.size:
            pi, li = float(p[bad[0]]), float(lam[bad[0]])
            # pi = 0 or 1 fails only for lam < 0 (then P(on->off) or P(off->on) = 1 - lam > 1): the bound is 0
            low = max(1.0 - 1.0 / pi if pi > 0 else -math.inf, 1.0 - 1.0 / (1.0 - pi) if pi < 1 else -math.inf)
            raise ValueError(f"Markov(p, lam): infeasible pair p={pi:g}, lam={li:g}; P(off->on) = p(1-lam) and "
                             f"P(on->off) = (1-p)(1-lam) must lie in [0, 1], so for this p lam must lie in "
                             f"[{low:g}, 1)")
        return a, b

    @classmethod
    def _transition_to_stationary(cls, a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
        pair = cls._pair(a, b)
        if pair is None:
            return None
        a, b = pair
        total = a + b
        bad = np.flatnonzero((total <= 0.0) | (total >= 2.0))
        if bad.size:
            raise ValueError(f"Markov(p_on, p_off): inconsistent pair p_on={float(a[bad[0]]):g}, "
                             f"p_off={float(b[bad[0]]):g}; p_on + p_off must lie in (0, 2) (0: the chain never "
                             f"moves and has no unique stationary law, 2: it alternates deterministically)")
        return a / total

    @staticmethod
    def fedau_transitions(p: Any, max_on: Any = 0.05) -> tuple[np.ndarray, np.ndarray]:
        """FedAU's code's rule: ``(a, b) = (P(off->on), P(on->off))`` for stationary ``p`` and ``max_on``.

        ``a = max_on``, ``b = a (1/p - 1)``; where ``b > 1``: ``a <- a / b``, ``b <- 1`` (exactly when
        ``p < max_on / (1 + max_on)``, 1/21 for 0.05). ``p = 0`` gives ``(0, 1)``. Example: ``p = 0.02``,
        ``max_on = 0.05`` gives ``b = 1`` and ``a = 0.05 / 2.45 = 0.020408...``. Returns float64 arrays.
        """
        p, a = np.broadcast_arrays(as_prob_array(p, "p"), as_prob_array(max_on, "max_on", low_open=True))
        p, a = p.astype(np.float64), a.astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            b = a * (1.0 / p - 1.0)
        over = b > 1.0
        a = np.where(over, a / np.where(over, b, 1.0), a)
        b = np.where(over, 1.0, b)
        return a, b

    def _resolve(self, label_hist: np.ndarray | None) -> None:
        n = self.num_clients
        if self.form == "transition":
            a = per_client(self._p_on_spec, n, "p_on")
            b = per_client(self._p_off_spec, n, "p_off")
            pi = self._transition_to_stationary(a, b)
        else:
            pi, recipe_lam = resolve_probs(self._p_spec, n, self.seed, label_hist, "p")
            if self.form == "max_on":
                a, b = self.fedau_transitions(pi, per_client(self._max_on_spec, n, "max_on"))
            else:
                lam = recipe_lam if recipe_lam is not None else per_client(self._lam_spec, n, "lam")
                a, b = self._lam_to_transition(pi, lam)
        self._a, self._b, self._pi = np.asarray(a, np.float64), np.asarray(b, np.float64), np.asarray(pi, np.float64)
        self._stay = 1.0 - self._b
        self._reset_cache()

    # ------------------------------------------------------------------ sampling
    def _reset_cache(self) -> None:
        self._checkpoints: dict[int, np.ndarray] = {}
        self._last_round: int | None = None
        self._last_state: np.ndarray | None = None

    def round_uniforms(self, round: int) -> np.ndarray:
        """The ``N`` uniforms that decide every client's transition into round ``round`` (a pure function of
        seed and round; the chain draws them once per round it advances through)."""
        return self.rng(round).random(self.num_clients)

    def _step(self, state: np.ndarray, round: int) -> np.ndarray:
        """State of round ``round`` from the state of round ``round - 1``."""
        return self.round_uniforms(round) < np.where(state, self._stay, self._a)

    def _state(self, round: int) -> np.ndarray:
        block = self.block
        start, state = -1, None
        if self._checkpoints:
            k = min(round // block, len(self._checkpoints) - 1)  # checkpoints are contiguous from block 0
            start = k * block
            state = np.unpackbits(self._checkpoints[k], count=self.num_clients).astype(bool)
        if self._last_round is not None and start <= self._last_round <= round:
            start, state = self._last_round, self._last_state
        if state is None:
            start, state = 0, self.round_uniforms(0) < self._pi
            self._checkpoints[0] = np.packbits(state)
        for s in range(start + 1, round + 1):
            state = self._step(state, s)
            if s % block == 0 and s // block not in self._checkpoints:
                self._checkpoints[s // block] = np.packbits(state)
        self._last_round, self._last_state = round, state
        return state.copy()

    def _sample(self, round: int) -> np.ndarray:
        return self._state(round)

    def _stationary(self) -> np.ndarray:
        return self._pi.copy()

    # ------------------------------------------------------------------ parameters after setup
    @property
    def lam(self) -> Tensor:
        """Signed second eigenvalue ``1 - P(off->on) - P(on->off)`` per client, ``torch.float64 [N]``."""
        self._check_setup()
        return torch.as_tensor(1.0 - self._a - self._b, dtype=torch.float64)

    @property
    def p_on(self) -> Tensor:
        """``P(off->on)`` per client, ``torch.float64 [N]``."""
        self._check_setup()
        return torch.as_tensor(self._a.copy(), dtype=torch.float64)

    @property
    def p_off(self) -> Tensor:
        """``P(on->off)`` per client, ``torch.float64 [N]``."""
        self._check_setup()
        return torch.as_tensor(self._b.copy(), dtype=torch.float64)

    def __repr__(self) -> str:
        if self.form == "transition":
            args = f"p_on={fmt_spec(self._p_on_spec)}, p_off={fmt_spec(self._p_off_spec)}"
        elif self.form == "max_on":
            args = f"p={fmt_spec(self._p_spec)}, max_on={fmt_spec(self._max_on_spec)}"
        else:
            args = f"p={fmt_spec(self._p_spec)}" + ("" if self._lam_spec is None else
                                                    f", lam={fmt_spec(self._lam_spec)}")
        return f"Markov({args})"
