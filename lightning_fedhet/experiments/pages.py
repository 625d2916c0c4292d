"""The pieces every study page is built from, generic or a study's own: Markdown tables, reproducible figures, a
curve with its band over seeds, a method paired against others, and the page's provenance.

Figures are drawn with matplotlib's defaults and saved without time stamps, so the same records give the same
bytes. :mod:`~lightning_fedhet.experiments.report` builds the generic page from them; a study's own page (the
paper reproductions of this repository, say) uses them beside its own tables and figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_fedhet.experiments.records import Record
from lightning_fedhet.experiments.stats import fmt_ci, mean_ci, paired


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (ends with a newline)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    """A matplotlib figure and its row of axes, drawn with matplotlib's defaults (no user rc), so the PNG bytes
    depend on the data only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcdefaults()
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def figure_title(fig, title: str, fontsize: float = 9) -> None:
    """``fig.suptitle(title)`` wrapped to the figure's width (about 14 characters an inch at 9 pt, scaled with
    ``fontsize``), so that a long title over a narrow figure is not cut at both edges."""
    import textwrap

    width = max(20, int(14 * fig.get_figwidth() * 9 / fontsize))
    fig.suptitle(textwrap.fill(title, width=width), fontsize=fontsize)


def save_figure(fig, path: Path) -> None:
    """Write a PNG without time stamps or version metadata (same records -> same bytes) and close the figure."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def band(ax, x: Sequence[float], runs: Sequence[Sequence[float]], label: str, scale: float = 100.0,
         level: float = 0.95, alpha: float = 0.15, **line) -> None:
    """One method's curve on ``ax``: the mean over ``runs`` (one series per seed, each over ``x``) and, with two
    or more seeds, its Student-t band at ``level`` in the line's colour; ``line``: ``ax.plot``'s keywords."""
    import numpy as np

    values = scale * np.asarray(runs, dtype=np.float64)
    stats = [mean_ci(values[:, j], level) for j in range(values.shape[1])]
    (drawn,) = ax.plot(x, [s[0] for s in stats], label=label, **line)
    if len(runs) > 1:
        ax.fill_between(x, [s[1] for s in stats], [s[2] for s in stats], color=drawn.get_color(), alpha=alpha, lw=0)


def paired_differences(values: dict[str, dict[int, float]], method: str, others: Sequence[str],
                       scale: float = 100.0, digits: int = 1, unit: str = " pp",
                       level: float = 0.95) -> tuple[str, dict[str, tuple[float, float, float, int]]]:
    """``method`` against each of ``others`` over the seeds both ran (``values[m]``: ``{seed: value}``): a Markdown
    table (difference, mean [CI], seeds, how many seeds ``method`` is ahead) and ``{other: (mean, low, high, n)}``."""
    diffs, rows = {}, []
    for other in others:
        mean, lo, hi, n = paired(values[method], values[other], level)
        diffs[other] = (mean, lo, hi, n)
        common = sorted(set(values[method]) & set(values[other]))
        ahead = sum(values[method][s] > values[other][s] for s in common)
        rows.append((f"{method} − {other}", fmt_ci(mean, lo, hi, scale, digits, unit), n, f"{ahead}/{n}"))
    header = ("difference", f"mean [{level:.0%} CI]".replace("%", " %"), "seeds", f"seeds {method} ahead")
    return markdown_table(header, rows), diffs


def compute_used(records: Sequence[Record]) -> str:
    """``"12.3 CPU-min, 40 runs on cpu (2 cores, x86_64)"`` summed over records (wall time where CPU is missing)."""
    if not records:
        return "–"
    minutes = sum(r.get("cpu_s", r["wall_s"]) for r in records) / 60
    devices = sorted({r["device"] for r in records})
    return f"{minutes:.1f} CPU-min, {len(records)} runs on {'; '.join(devices)}"


def provenance_table(records: Sequence[Record]) -> str:
    """Commits, engines, devices, processors, torch versions and run counts behind a page.

    The processor (a record's ``cpu``: model name and the instruction set torch's CPU kernels use) is a column of
    its own because a re-run is bit for bit the same only on the same processor: the same commit and seed on
    another one gives other floats, and a training run amplifies them. Records written before the field existed
    read "not recorded". A commit shows as git's 10-character abbreviation, as
    :func:`lightning_fedhet.experiments.records.code_version` writes it, also where a record names it whole
    (records imported from a machine without git, given ``--commit``)."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault((r["protocol"], r["commit"][:10] + ("+dirty" if r.get("dirty") else ""), r["engine"],
                           r["device"], r.get("cpu") or "not recorded", r["torch"]), []).append(r)
    rows = [(*key, len(rs), f"{sum(r['wall_s'] for r in rs) / 60:.1f}") for key, rs in sorted(groups.items())]
    return markdown_table(("protocol", "commit", "engine", "device", "processor", "torch", "runs", "wall min"), rows)


def reproduce_section(records: Sequence[Record], commands: Sequence[str]) -> list[str]:
    """The end of a study page, as Markdown lines: the shell ``commands`` that regenerate it, then the provenance
    table and the compute the records took."""
    return ["## Reproduce\n", "```bash", *commands, "```\n", "## Provenance\n", provenance_table(records),
            f"\nCompute: {compute_used(records)}."]


def final_value(record: Record, metric: str) -> float:
    """The last value of ``record["metrics"][metric]`` (a series), or the value itself (a number)."""
    value = record["metrics"][metric]
    return float(value[-1] if isinstance(value, list) else value)
