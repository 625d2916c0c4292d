"""Protocol v2's records under the v3 decision rule: the label a page shows beside the one v2 registered.

The v3 rule (:func:`lightning_fedhet.experiments.decide`, issue #40) was chosen *after* v2's results had been seen,
so it relabels v2's records openly: a page keeps the label its v2 protocol registered and shows the v3 label beside
it, marked "v2 records, v3 rule" (:data:`MARK`) wherever it stands alone (the results index); a claim whose label
changes is a hypothesis for fresh confirmatory seeds under a v3 protocol, not a result.

:func:`relabel` decides a page's v2 claims on their raw paired 95 % intervals (the interval the v2 protocols
registered) and gives beside each the Holm-adjusted interval over the page's family of claims
(:func:`~lightning_fedhet.experiments.family_intervals`) and the label that interval would give.
:func:`registered` words a registered "not testable here" so that no page shows it for an interval that settles
the claim, nor for an incomplete cell (that is "pending").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from lightning_fedhet.experiments import Decision, decide_paired, family_intervals, fmt_ci

#: appended to a v3 label that stands for v2's records away from its page (the results index)
MARK = " (v2 records, v3 rule)"
#: the family adjustment a page shows beside the raw interval
ADJUST = "holm"
#: the page columns of :func:`cells`
HEADER = ("Holm-adjusted interval", "v3 label (v2 records, v3 rule)", "v3 label on the Holm interval")

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Relabelled:
    """One v2 claim under the v3 rule: ``raw`` decided on the raw interval (the label the page and the index give),
    ``adjusted`` on the Holm interval over the page's ``family`` claims (its ``lo, hi`` are that interval)."""

    raw: Decision
    adjusted: Decision
    family: int
    #: why a pending claim's protocol stopped short of its planned seeds (it never completes), or ``None``
    stopped: str | None = None

    def text(self, decision: Decision | None = None) -> str:
        """``decision``'s label (the raw one by default), a stopped protocol's pending claim saying why."""
        d = self.raw if decision is None else decision
        if d.label == "pending" and self.stopped:
            return f"pending ({d.n}/{d.planned} seeds; {self.stopped})"
        return d.text()

    def index_text(self) -> str:
        """The index's verdict: the v3 label, marked as v2 records under the v3 rule."""
        return self.text() + MARK


def relabel(claims: Mapping[K, tuple[Mapping[int, float], Mapping[int, float], float | None]], planned: int,
            level: float = 0.95, converged: Mapping[K, bool] | None = None,
            lr_interior: Mapping[K, bool] | None = None) -> dict[K, Relabelled]:
    """The v3 labels of a page's v2 claims, ``{key: (a, b, gain)}`` with ``a, b`` per-seed values of the claim's
    method and baseline (higher is the claim's direction) and ``gain`` the paper's effect in the same units
    (``None``: direction only); ``planned``: the v2 protocol's seeds; ``converged``: per claim, whether both of its
    cells pass the page's convergence check; ``lr_interior``: whether both cells' learning rates sit inside their
    grid (absent: passes). The family is every claim given."""
    diffs = {k: [a[s] - b[s] for s in sorted(set(a) & set(b))] for k, (a, b, _) in claims.items()}
    adjusted = family_intervals(diffs, level, ADJUST)
    ok, inside = converged or {}, lr_interior or {}

    def checks(k: K) -> dict[str, bool]:
        return {"converged": ok.get(k, True), "lr_interior": inside.get(k, True)}

    return {k: Relabelled(decide_paired(a, b, gain, planned, level=level, **checks(k)),
                          decide_paired(a, b, gain, planned, level=level, interval=adjusted[k][1:], **checks(k)),
                          len(claims))
            for k, (a, b, gain) in claims.items()}


def registered(text: str, raw: Decision) -> str:
    """The label v2's protocol registered (``text``), as a page shows it beside the v3 label ``raw``.

    A registered "not testable here (needs n seeds)" (v2's power rule: the planned seeds put the half-width below
    the paper's effect with only about 50 % power) becomes "pending (k/planned seeds; ...)" while the cell is
    incomplete, and names what the interval excludes where it excludes 0 or the paper's effect."""
    if not text.startswith("not testable"):
        return text
    detail = text[text.find("(") + 1:text.rfind(")")] if "(" in text else "power rule"
    if raw.n < raw.planned:
        return f"pending ({raw.n}/{raw.planned} seeds; registered power analysis: {detail})"
    if raw.lo > 0 or raw.hi < 0:
        excludes = "0"
    elif raw.gain is not None and raw.hi < raw.gain:
        excludes = "the paper's effect"
    else:
        return text
    return f"not testable here (registered v2 rule, {detail}; the interval excludes {excludes}: see the v3 label)"


#: a difference in percentage points, as the pages print it (each end on its side of 0 and of ``against``)
fmt_pp = functools.partial(fmt_ci, unit=" pp")


def cells(r: Relabelled, fmt: Callable[..., str]) -> tuple[str, str, str]:
    """A page row's :data:`HEADER` cells: the Holm interval (``fmt(mean, lo, hi, against=...)``, ``against`` the
    paper's effect, :attr:`~lightning_fedhet.experiments.Decision.against`), the v3 label, the label on the Holm
    interval."""
    adj = r.adjusted
    holm = "–" if adj.n < 2 else fmt(adj.mean, adj.lo, adj.hi, against=adj.against)
    return holm, f"**{r.text()}**", r.text(adj)


def note(family: int, what: str, seen: bool = True) -> str:
    """The paragraph every page with v2 records under the v3 rule shows (``family``: how many paired comparisons
    the Holm adjustment covers; ``what``: which, in words; ``seen``: whether this study's v2 results existed when
    the v3 rule was chosen)."""
    when = ("That rule was chosen *after* v2's results had been seen, so it relabels v2's records openly: each row "
            "keeps the label v2's protocol registered beside it, and every claim whose label changes needs fresh "
            "confirmatory seeds under a v3 protocol (planned there, not run here) before it counts."
            if seen else
            "That rule was chosen after other studies' v2 results had been seen but before this study had any v2 "
            "record, so it was not fitted to them; each row keeps the label v2's protocol registered beside it.")
    return (
        "**v2 records, v3 rule.** The column \"v3 label\" applies the decision rule of "
        "`lightning_fedhet.experiments.decide` to protocol v2's records: **reproduced** when the paired 95 % interval "
        "lies above 0, **opposite sign** when it lies below 0, **not reproduced** when it holds 0 and lies below the "
        "paper's effect, **inconclusive** when it holds both (with the seeds that 80 % power to resolve the paper's "
        f"effect needs, noncentral t), **pending** while a cell has fewer seeds than the protocol plans. {when} The "
        "v3 label is decided on the raw interval, as v2 registered; the Holm-adjusted interval beside it covers the "
        f"family of this page's v2 comparisons ({family}: {what}; Holm's step-down at 95 % family-wise), and the "
        "last column gives the label that interval would give.\n")
