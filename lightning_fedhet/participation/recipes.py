"""Recipes that generate per-client participation probabilities, as used in the papers' experiments.

A recipe is passed where a process expects ``p`` (``Bernoulli(p=LabelCorrelated())``, ``Markov(p=TwoGroup(0.1),
lam=0.5)``, ``Markov(p=CAFedClasses())``) and is resolved when the process is set up, from
``(num_clients, seed)`` and, for :class:`LabelCorrelated` only, the clients' label histograms.

Label histograms are given to the *process's* ``setup`` as the keyword ``label_hist=`` (one place, so one recipe
object can be reused across partitions and seeds); a process built from such a recipe reports
``needs_label_hist = True`` so a runtime knows to pass them. The recipe's own draws (the Dirichlet affinity
vector, group and class assignments) come from ``generator(seed, Stream.PARTICIPATION, STATIC_KEY, k)``, so
they are a pure function of the seed and independent of the per-round availability draws.

Recipes:

- :class:`LabelCorrelated` (FedAU paper, App. C.6): ``p_n = C mu <kappa_n, q>``, ``q ~ Dir(alpha 1_C)`` shared by
  all clients, ``kappa_n`` the client's empirical label distribution, then floored and clipped to 1.
- :class:`TwoGroup` (FedStale paper, experiments): a random group with ``p = p_max`` (1: always on) and the rest
  with ``p = p_min``.
- :class:`CAFedClasses` (CA-Fed, thesis ch.2 §2.5.1 and the authors' code): four
  classes (more/less available x correlated/weakly correlated); returns both ``pi`` and ``lam``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from lightning_fedhet._checks import as_prob_array, check_bool, check_choice, check_real, per_client
from lightning_fedhet.seeding import STATIC_KEY, StaticKey, Stream, generator


class Recipe:
    """Base class: a generator of per-client probabilities resolved at a process's ``setup``.

    Subclasses implement :meth:`resolve`, which returns ``p`` (float64 ``[N]``) or, for recipes that also fix
    the Markov correlation, a tuple ``(p, lam)``.
    """

    needs_label_hist: bool = False
    returns_lam: bool = False

    def resolve(self, num_clients: int, seed: int, label_hist: np.ndarray | None = None) -> Any:
        raise NotImplementedError


def _static_rng(seed: int, key: StaticKey) -> np.random.Generator:
    return generator(seed, Stream.PARTICIPATION, STATIC_KEY, key)


class LabelCorrelated(Recipe):
    """FedAU's label-correlated participation probabilities (App. C.6 of the paper).

    One affinity vector ``q ~ Dirichlet(alpha * 1_C)`` is drawn per seed and shared by all clients; client n with
    empirical label distribution ``kappa_n`` (its label histogram normalised to sum 1, as in the released code)
    gets ``p_n = C * mean * <kappa_n, q>``, so ``E[p_n] = mean`` over ``q``; then ``p_n <- max(p_n, floor)`` and
    ``p_n <- min(p_n, 1)`` (the paper does not clip; here clipping is applied and warned about).

    Args:
        mean: target mean ``mu`` in ``(0, 1]`` (paper: 0.1).
        floor: minimum probability in ``[0, 1]`` (paper: 0.02; 0.0 in App. D.6).
        alpha: Dirichlet concentration ``alpha_p > 0`` (paper: 0.1).

    Needs the clients' label histograms: ``Bernoulli(LabelCorrelated()).setup(N, seed, label_hist=H)`` with
    ``H`` of shape ``[N, C]`` (counts or frequencies), or directly :meth:`probabilities`.
    """

    needs_label_hist = True

    def __init__(self, mean: float = 0.1, floor: float = 0.02, alpha: float = 0.1) -> None:
        self.mean = check_real(mean, "mean", 0.0, 1.0, low_open=True)
        self.floor = check_real(floor, "floor", 0.0, 1.0)
        self.alpha = check_real(alpha, "alpha", 0.0, np.inf, low_open=True, high_open=True)

    def affinity(self, num_classes: int, seed: int) -> np.ndarray:
        """The shared class-affinity vector ``q`` (float64 ``[C]``, sums to 1) for this seed."""
        return _static_rng(seed, StaticKey.LABEL_CORRELATED).dirichlet(np.full(int(num_classes), self.alpha))

    def probabilities(self, label_hist: np.ndarray, seed: int) -> np.ndarray:
        """Per-client participation probabilities (float64 ``[N]``) from label histograms ``[N, C]``."""
        raw = label_hist.detach().cpu().numpy() if isinstance(label_hist, torch.Tensor) else label_hist
        try:
            if isinstance(raw, (str, bytes)) or np.iscomplexobj(raw):
                raise TypeError
            hist = np.asarray(raw, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"label_hist must be a [num_clients, num_classes] array of label counts, got "
                             f"{type(label_hist).__name__}") from err
        if hist.ndim != 2 or hist.shape[0] < 1 or hist.shape[1] < 1:
            raise ValueError(f"label_hist must have shape [num_clients, num_classes], got {tuple(hist.shape)}")
        if not np.all(np.isfinite(hist)) or np.any(hist < 0):
            raise ValueError("label_hist must hold finite non-negative counts")
        totals = hist.sum(axis=1)
        if np.any(totals <= 0):
            empty = np.flatnonzero(totals <= 0)[:5].tolist()
            raise ValueError(f"label_hist: every client needs at least one sample, clients {empty} have none")
        kappa = hist / totals[:, None]
        num_classes = hist.shape[1]
        p = num_classes * self.mean * (kappa @ self.affinity(num_classes, seed))
        p = np.maximum(p, self.floor)
        over = int(np.count_nonzero(p > 1.0))
        if over:
            warnings.warn(f"LabelCorrelated: clipped {over} participation probabilities above 1 to 1", stacklevel=2)
            p = np.minimum(p, 1.0)
        return p

    def resolve(self, num_clients: int, seed: int, label_hist: np.ndarray | None = None) -> np.ndarray:
        if label_hist is None:
            raise ValueError("LabelCorrelated needs label_hist=[num_clients, num_classes] at the process's setup()")
        p = self.probabilities(label_hist, seed)
        if p.shape[0] != num_clients:
            raise ValueError(f"label_hist has {p.shape[0]} rows but num_clients is {num_clients}")
        return p

    def __repr__(self) -> str:
        return f"LabelCorrelated(mean={self.mean}, floor={self.floor}, alpha={self.alpha})"


class TwoGroup(Recipe):
    """FedStale's two participation groups (its experiments): ``p = p_max`` for one group, ``p_min`` for the other.

    The paper "randomly divides clients into two groups": one always participates (``p_max = 1``), the other has
    ``p_min`` in {0.5, ..., 0.002}. Group sizes are not stated; equal halves reproduce the thesis's axis values,
    so the default ``low_fraction = 0.5`` puts ``floor(low_fraction * N)`` clients in the low group. With
    ``shuffle=True`` (default) membership is a seeded random permutation; with ``shuffle=False`` the low group is
    the last ``floor(low_fraction * N)`` client ids.

    Args:
        p_min: probability of the less-participating group, in ``[0, 1]``.
        p_max: probability of the other group, in ``[0, 1]`` (default 1: always on).
        low_fraction: fraction of clients in the low group, in ``[0, 1]``.
        shuffle: random (seeded) or contiguous group membership.
    """

    def __init__(self, p_min: float, p_max: float = 1.0, low_fraction: float = 0.5, shuffle: bool = True) -> None:
        self.p_min = check_real(p_min, "p_min", 0.0, 1.0)
        self.p_max = check_real(p_max, "p_max", 0.0, 1.0)
        self.low_fraction = check_real(low_fraction, "low_fraction", 0.0, 1.0)
        self.shuffle = check_bool(shuffle, "shuffle")

    def low_group(self, num_clients: int, seed: int) -> np.ndarray:
        """Bool mask ``[N]`` of the low-participation group (the same one :meth:`resolve` uses)."""
        n_low = int(np.floor(self.low_fraction * num_clients))
        mask = np.zeros(num_clients, dtype=bool)
        if self.shuffle:
            mask[_static_rng(seed, StaticKey.TWO_GROUP).permutation(num_clients)[:n_low]] = True
        else:
            mask[num_clients - n_low:] = True
        return mask

    def resolve(self, num_clients: int, seed: int, label_hist: np.ndarray | None = None) -> np.ndarray:
        return np.where(self.low_group(num_clients, seed), self.p_min, self.p_max)

    def __repr__(self) -> str:
        return (f"TwoGroup(p_min={self.p_min}, p_max={self.p_max}, low_fraction={self.low_fraction}, "
                f"shuffle={self.shuffle})")


class CAFedClasses(Recipe):
    """CA-Fed's availability classes (thesis ch.2 §2.5.1 and the authors' code).

    Clients get a stationary availability ``pi`` and a signed second eigenvalue ``lam`` of their two-state chain:

    - "more available": ``pi = 1/2 + g``; "less available": ``pi = 1/2 - g``;
    - "correlated": ``lam = nu``; "weakly correlated": ``lam ~ N(0, eps^2)`` (thesis).

    ``composition`` chooses between the thesis' text and the released code, which differ:

    - ``"thesis"`` (default): the text's 2 x 2 equal classes. Class ids 0..3 = (more, correlated),
      (more, weak), (less, correlated), (less, weak), sizes as equal as possible (``numpy.array_split`` of each
      half; the more-available half gets the extra client when N is odd).
    - ``"code"``: the released code's joint matrix, matching Fig. 2.1d's three groups: the more-available half is
      all weakly correlated, the less-available half is split equally into correlated and weak; weak clients
      there use the code's ``lam = 0.5 * (N(0, eps^2) + eps)``.

    In both, ``lam`` is clipped to the feasible range ``[max(1 - 1/pi, 1 - 1/(1 - pi)), 1)`` (the code clips
    too) so that every transition probability lies in ``[0, 1]``. With ``shuffle=True`` (default) clients are
    assigned to classes by a seeded random permutation, else by contiguous id ranges in class order.

    :meth:`resolve` returns ``(pi, lam)``; use with ``Markov(p=CAFedClasses(...))`` (``lam`` must then be omitted).

    Args:
        g: availability gap, in ``(0, 1/2)`` (thesis: 0.4, so ``pi`` in {0.9, 0.1}).
        nu: eigenvalue of the correlated clients, in ``(-1, 1)`` (thesis: 0.9).
        eps: standard deviation of the weakly-correlated eigenvalues, ``>= 0`` (thesis: 0.01).
    """

    returns_lam = True

    def __init__(self, g: float = 0.4, nu: float = 0.9, eps: float = 0.01, composition: str = "thesis",
                 shuffle: bool = True) -> None:
        self.g = check_real(g, "g", 0.0, 0.5, low_open=True, high_open=True)
        self.nu = check_real(nu, "nu", -1.0, 1.0, low_open=True, high_open=True)
        self.eps = check_real(eps, "eps", 0.0, np.inf, high_open=True)
        self.composition = check_choice(composition, "composition", ("thesis", "code"))
        self.shuffle = check_bool(shuffle, "shuffle")

    def classes(self, num_clients: int, seed: int) -> np.ndarray:
        """Class id of each client (int64 ``[N]``): 0 more/correlated, 1 more/weak, 2 less/correlated, 3 less/weak."""
        more, less = np.array_split(np.arange(num_clients), 2)
        ids = np.empty(num_clients, dtype=np.int64)
        if self.composition == "thesis":
            more_corr, more_weak = np.array_split(more, 2)
            ids[more_corr] = 0
            ids[more_weak] = 1
        else:
            ids[more] = 1
        less_corr, less_weak = np.array_split(less, 2)
        ids[less_corr] = 2
        ids[less_weak] = 3
        if self.shuffle:
            ids = ids[_static_rng(seed, StaticKey.CAFED_CLASSES).permutation(num_clients)]
        return ids

    def resolve(self, num_clients: int, seed: int, label_hist: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        ids = self.classes(num_clients, seed)
        pi = np.where(ids <= 1, 0.5 + self.g, 0.5 - self.g)
        noise = _static_rng(seed, StaticKey.CAFED_LAMBDA).normal(0.0, self.eps, num_clients)
        weak = noise if self.composition == "thesis" else 0.5 * (noise + self.eps)
        lam = np.where((ids == 0) | (ids == 2), self.nu, weak)
        low = np.maximum(1.0 - 1.0 / pi, 1.0 - 1.0 / (1.0 - pi))
        lam = np.clip(lam, low, np.nextafter(1.0, 0.0))
        return pi, lam

    def __repr__(self) -> str:
        return (f"CAFedClasses(g={self.g}, nu={self.nu}, eps={self.eps}, composition={self.composition!r}, "
                f"shuffle={self.shuffle})")


def resolve_probs(spec: Any, num_clients: int, seed: int, label_hist: np.ndarray | None = None,
                  name: str = "p") -> tuple[np.ndarray, np.ndarray | None]:
    """Per-client probabilities from a scalar, a per-client array or a :class:`Recipe`.

    Returns ``(p, lam)`` with ``p`` float64 ``[N]`` in ``[0, 1]`` and ``lam`` float64 ``[N]`` for recipes that
    fix it (:class:`CAFedClasses`), else ``None``.
    """
    lam = None
    if isinstance(spec, Recipe):
        out = spec.resolve(num_clients, seed, label_hist=label_hist)
        if spec.returns_lam:
            out, lam = out
            lam = per_client(np.asarray(lam, dtype=np.float64), num_clients, "lam")
        p = per_client(as_prob_array(out, name), num_clients, name)
        return p, lam
    return per_client(as_prob_array(spec, name), num_clients, name), lam


def check_prob_spec(spec: Any, name: str = "p") -> Any:
    """Early check of a ``p`` argument: a recipe is kept as is, numbers are validated and stored as float64."""
    if isinstance(spec, Recipe):
        return spec
    return as_prob_array(spec, name)
