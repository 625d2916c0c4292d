"""The one weighting vocabulary of the rules that weight each arrived update (``weighting=``).

FedAvg, FedStale (and FedVARP, its ``beta = 1``) and FedNova take a ``weighting=`` from this list, each the names
whose meaning it implements, and a name means the same in every one of them: the raw weight ``r_i`` of an arrived
client ``i`` (``alpha_i`` the client weights given to ``Algorithm.setup``, ``n_i`` its ``ClientInfo.num_samples``,
``p_i`` the probability that its update is aggregated) and whether the round's weights are normalised over the
clients whose update arrived (``R_t``):

============== ===================== ================================ ==========================
weighting      raw weight ``r_i``    normalised over ``R_t``          taken by
============== ===================== ================================ ==========================
participating  ``alpha_i``           yes: ``alpha_i / sum alpha_j``   FedAvg, FedStale, FedNova
samples        ``n_i``               yes: ``n_i / sum n_j``           FedAvg, FedNova
all            ``alpha_i``           no (an absent client counts as   FedAvg
                                     a zero update)
known_p        ``alpha_i / p_i``     no (unbiased: ``E[1/p_i] = 1``)  FedAvg, FedStale
============== ===================== ================================ ==========================

FedNova divides each update by its client's ``||a_i||_1`` on top of these weights and rescales by ``tau_eff``; with
equal local work it is FedAvg with the same weighting. FedStale's ``beta = 0`` is FedAvg with the same weighting.
"""

from __future__ import annotations

from lightning_fedhet._checks import check_choice

#: every weighting, with its meaning (the table above)
WEIGHTING_MEANINGS: dict[str, str] = {
    "participating": "alpha_i, normalised over the arrived clients",
    "samples": "n_i (the client's samples), normalised over the arrived clients",
    "all": "alpha_i, not normalised (an absent client counts as a zero update)",
    "known_p": "alpha_i / p_i, not normalised (unbiased)",
}
#: the weightings normalised over the clients whose update arrived
NORMALISED = ("participating", "samples")


def weightings(*names: str) -> tuple[str, ...]:
    """A rule's accepted weightings (in the order its error message lists them), each a name of the vocabulary."""
    unknown = [name for name in names if name not in WEIGHTING_MEANINGS]
    if unknown:
        raise ValueError(f"{unknown} are not weightings of the vocabulary {tuple(WEIGHTING_MEANINGS)}")
    return names


def check_weighting(weighting: str, accepted: tuple[str, ...]) -> str:
    """``weighting`` if it is one of ``accepted`` (a rule's :func:`weightings`), else the ``ValueError`` naming them."""
    return check_choice(weighting, "weighting", accepted)


def raw_weight(weighting: str, alpha: float, num_samples: int, prob: float | None = None) -> float:
    """Client ``i``'s raw weight ``r_i`` under ``weighting`` (``prob``: ``p_i``, read for ``"known_p"`` only)."""
    if weighting == "samples":
        return float(num_samples)
    if weighting == "known_p":
        return alpha / prob
    return alpha
