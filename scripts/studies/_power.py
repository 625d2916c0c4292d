"""Power of a paired comparison over seeds, for the v2 protocols' power analyses and the pages that show them.

The paired 95 % interval over ``n`` seeds has half-width ``t_{0.975, n-1} * sd / sqrt(n)``, where ``sd`` is the
standard deviation (ddof 1) of the per-seed differences. :func:`seeds_needed` (the package's, with this page's
conventions) is the smallest ``n`` whose half-width is below ``effect``: fewer seeds cannot put the interval above 0
even when the true gain equals ``effect``. That rule gives only about 50 % power (the interval lands above 0 about
half the time when the true gain is ``effect``); :func:`seeds_80` is the number of seeds for 80 % power
(:func:`lightning_fedhet.experiments.seeds_for_power`, noncentral t), which the power tables show beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_fedhet.experiments import seeds_for_power
from lightning_fedhet.experiments import seeds_needed as experiments_seeds_needed

MAX_SEEDS = 10_000


def seeds_needed(sd: float, effect: float, max_seeds: int = MAX_SEEDS) -> int | None:
    """Smallest ``n >= 2`` with ``t_{0.975, n-1} * sd / sqrt(n) < |effect|``
    (:func:`lightning_fedhet.experiments.seeds_needed`); ``None`` when ``effect`` is 0, ``sd`` is not finite, or more
    than ``max_seeds`` would be needed."""
    if not math.isfinite(sd) or effect == 0:
        return None
    return experiments_seeds_needed(sd, abs(effect), max_seeds=max_seeds)


def seeds_80(sd: float, effect: float, max_seeds: int = MAX_SEEDS) -> int | None:
    """Fewest seeds whose paired 95 % test resolves a true gain ``|effect|`` with 80 % power
    (:func:`lightning_fedhet.experiments.seeds_for_power`); ``None`` as :func:`seeds_needed`."""
    if not math.isfinite(sd) or effect == 0:
        return None
    return seeds_for_power(sd, abs(effect), max_seeds=max_seeds)


def paired_sd(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    """Standard deviation (ddof 1) of ``a[s] - b[s]`` over the seeds both have, and that number of seeds."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return math.nan, len(seeds)
    return float(np.std([a[s] - b[s] for s in seeds], ddof=1)), len(seeds)


def needed_text(n: int | None) -> str:
    return "> 10,000" if n is None else str(n)


def power_row(label: str, sd: float, n_sd: int, effect: float, planned: int) -> tuple[str, ...]:
    """One row of a power table: what was compared, the paired SD it came from, the effect, seeds needed (the v2
    protocols' rule, about 50 % power), seeds for 80 % power, and whether the planned seeds suffice by v2's rule."""
    need = seeds_needed(sd, effect)
    ok = need is not None and need <= planned
    return (label, f"{100 * sd:.2f} pp ({n_sd} seeds)", f"{100 * effect:+.2f} pp", needed_text(need),
            needed_text(seeds_80(sd, effect)), f"{planned}: " + ("enough" if ok else "too few"))


POWER_HEADER: Sequence[str] = ("comparison", "paired SD (v1 records)", "effect to resolve",
                               "seeds needed (half-width < effect: ≈ 50 % power)", "seeds for 80 % power",
                               "planned seeds (v2's rule)")
