"""Pages and figures generated from records only, and the check that the committed ones are what records give.

The building blocks (tables, figures, bands, paired tables, provenance) are in
:mod:`~lightning_fedhet.experiments.pages` and importable from here too.

:class:`Report` is the generic page of a study: a table of cells (mean and 95 % interval over seeds of the final
value of the study's metric), a table of paired differences against a baseline method, the metric's curves with
95 % bands as a PNG, the verdicts of declared :class:`Claim` s, and how to reproduce it with its provenance. A study
that needs more subclasses it and extends :meth:`Report.sections` instead of rewriting the page.

:func:`generate` writes the pages of some studies (and optionally an index) into a folder; :func:`report` brings
a results folder up to date (removing generated files that the records no longer give); :func:`check` regenerates
into a temporary folder and lists every file that differs byte for byte. Figures are drawn with matplotlib's
defaults and saved without time stamps, so the same records give the same bytes.
"""

from __future__ import annotations

import copy
import difflib
import filecmp
import inspect
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from lightning_fedhet.experiments.decision import ADJUSTMENTS, Decision, decide_paired, family_intervals
from lightning_fedhet.experiments.pages import (  # noqa: F401  (re-exported: report.markdown_table, ...)
    band,
    compute_used,
    final_value,
    markdown_table,
    new_figure,
    paired_differences,
    provenance_table,
    reproduce_section,
    save_figure,
)
from lightning_fedhet.experiments.records import Record, load_records
from lightning_fedhet.experiments.stats import by_seed, direction, fmt_ci, mean_ci, paired
from lightning_fedhet.experiments.study import Study, Summary, resolve_root, set_default_report

#: files under a results folder that are written by hand, never generated: the records and the protocols
HAND_WRITTEN = re.compile(r"(^records/)|(/protocol-[^/]+\.md$)")

IndexEntry = tuple[Study, list[Summary], list[Record]]
Index = Callable[[list[IndexEntry], Path], None]


# ---------------------------------------------------------------------------------------------------------- claims
class Claim:
    """A claim to decide from the records: ``method`` beats ``baseline`` in ``setting`` (a higher metric), by
    about ``paper_gain`` (> 0, in the metric's units) if given; decided by
    :func:`~lightning_fedhet.experiments.decision.decide` on the paired interval (the report's ``adjust`` says
    whether the raw or the family-adjusted one)."""

    def __init__(self, text: str, setting: str, method: str, baseline: str, paper: str = "",
                 paper_gain: float | None = None) -> None:
        self.text, self.setting, self.method, self.baseline = text, setting, method, baseline
        self.paper, self.paper_gain = paper, paper_gain


# ---------------------------------------------------------------------------------------------------------- Report
class Report:
    """The generic study page; ``report(records, out) -> [Summary]`` writes ``out/<name>.md`` and
    ``out/<name>/curves-<protocol>.png``.

    Args:
        metric: the metric the page summarises (a key of the records' ``metrics``); ``None``: the only one there
            besides ``round``.
        baseline: the method the paired differences subtract (default: the study's first method).
        value: ``value(record) -> float``, a run's number (default: the metric's final value).
        claims: :class:`Claim` s to decide; each gives a row of the page's verdicts and of the index.
        label: the metric's name in tables (default: ``metric``, with the scale when it is not 1).
        scale, digits, unit: how numbers print (``scale=100``: fractions as percent).
        curves: draw the metric's curves over rounds (where the records hold series with a ``round`` series).
        higher_is_better: whether a larger value is better (sets the word in the paired table).
        commands: the shell lines of the page's "Reproduce" section.
        adjust: the interval that decides the claims: ``"holm"`` (default), ``"bonferroni"`` over the page's
            claims (one family), or ``"none"`` (the raw one); the page shows the raw interval beside it.

    A study binds its report (:meth:`bind`): the page's name, title, protocol and cell order come from it.
    Extend a page by overriding :meth:`sections` (and calling it), e.g. to add a table after the cells.
    """

    def __init__(self, metric: str | None = None, baseline: str | None = None, *,
                 value: Callable[[Record], float] | None = None, claims: Sequence[Claim] = (),
                 label: str | None = None, scale: float = 100.0, digits: int = 1, unit: str = "",
                 curves: bool = True, higher_is_better: bool = True, level: float = 0.95,
                 commands: Sequence[str] | None = None, adjust: str = "holm") -> None:
        self.metric, self.baseline, self._value = metric, baseline, value
        if adjust not in ADJUSTMENTS:
            raise ValueError(f"adjust must be one of {ADJUSTMENTS}, got {adjust!r}")
        self.adjust = adjust
        self.claims, self.label, self.scale, self.digits, self.unit = tuple(claims), label, scale, digits, unit
        self.curves, self.higher_is_better, self.level = curves, higher_is_better, level
        self.commands = commands
        self.name, self.title, self.protocol = "study", "Study", None
        self.settings: list[str] = []
        self.methods: list[str] = []
        self.planned = 1

    # -------------------------------------------------------------------------------------------------- binding
    def bind(self, study: Study) -> Report:
        """A copy that knows the study's name, title, protocol and the order of its settings and methods."""
        bound = copy.copy(self)
        bound.name, bound.title, bound.protocol = study.name, study.title, study.protocol
        bound.settings, bound.methods = study.settings, study.methods
        bound.planned = max(len(study.seeds), 1)
        return bound

    def __call__(self, records: list[Record], out: Path) -> list[Summary]:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{self.name}.md").write_text("\n".join(self.sections(records, out)).rstrip("\n") + "\n")
        return self.summaries(records)

    # ---------------------------------------------------------------------------------------------------- values
    def metric_name(self, records: Sequence[Record]) -> str:
        """The metric this page summarises."""
        if self.metric is not None:
            return self.metric
        names = sorted({k for r in records for k in r["metrics"]} - {"round"})
        if len(names) != 1:
            raise ValueError(f"{self.name}: Report(metric=...) must name one of the records' metrics {names}")
        return names[0]

    def value(self, record: Record) -> float:
        """A run's number (default: the final value of the metric)."""
        return float(self._value(record)) if self._value is not None else final_value(record, self.metric_name(
            [record]))

    def fmt(self, mean: float, lo: float, hi: float, against: Sequence[float] = ()) -> str:
        """``mean [lo, hi]`` in the page's units, each end shown on its side of 0 and of ``against`` (a claim's
        paper effect, raw units): see :func:`~lightning_fedhet.experiments.fmt_ci`."""
        return fmt_ci(mean, lo, hi, self.scale, self.digits, self.unit, against)

    def metric_label(self, records: Sequence[Record]) -> str:
        if self.label is not None:
            return self.label
        metric = self.metric_name(records)
        return metric if self.scale == 1 else f"{metric} × {self.scale:g}"

    def protocols(self, records: Sequence[Record]) -> list[str]:
        """The protocol versions in the records, the study's current one first."""
        found = sorted({r["protocol"] for r in records})
        return ([self.protocol] if self.protocol in found else []) + [p for p in found if p != self.protocol]

    def order(self, records: Sequence[Record], key: str, declared: Sequence[str]) -> list[str]:
        found = {r[key] for r in records}
        return [x for x in declared if x in found] + sorted(found - set(declared))

    def baseline_of(self, methods: Sequence[str]) -> str | None:
        if self.baseline is not None:
            return self.baseline
        return (self.methods or list(methods) or [None])[0]

    # ---------------------------------------------------------------------------------------------------- tables
    def cells_table(self, records: Sequence[Record]) -> str:
        """Setting, method, seeds and the metric's mean [95 % interval] per cell."""
        rows = []
        for setting in self.order(records, "setting", self.settings):
            for method in self.order(records, "method", self.methods):
                values = list(by_seed(records, self.value, setting=setting, method=method).values())
                if values:
                    rows.append((setting, method, len(values), self.fmt(*mean_ci(values, self.level))))
        label = f"{self.metric_label(records)} (mean [{self.level:.0%} CI])"
        return markdown_table(("setting", "method", "seeds", label), rows)

    def paired_rows(self, records: Sequence[Record]) -> list[dict]:
        """Per setting and method other than the baseline: the paired difference method - baseline over the seeds
        both ran (raw numbers, in the metric's units)."""
        methods = self.order(records, "method", self.methods)
        baseline = self.baseline_of(methods)
        rows = []
        for setting in self.order(records, "setting", self.settings):
            base = by_seed(records, self.value, setting=setting, method=baseline)
            for method in methods:
                if method == baseline:
                    continue
                mine = by_seed(records, self.value, setting=setting, method=method)
                if not mine or not base:
                    continue
                mean, lo, hi, n = paired(mine, base, self.level)
                rows.append({"setting": setting, "method": method, "baseline": baseline, "seeds": n,
                             "mean": mean, "low": lo, "high": hi, "direction": direction(lo, mean, hi)})
        return rows

    def paired_table(self, records: Sequence[Record]) -> str:
        """The paired differences as a Markdown table."""
        good, bad = ("better", "worse") if self.higher_is_better else ("worse", "better")
        words = {"higher": f"higher ({good})", "lower": f"lower ({bad})"}
        rows = [(r["setting"], f"{r['method']} − {r['baseline']}", r["seeds"],
                 self.fmt(r["mean"], r["low"], r["high"]), words.get(r["direction"], r["direction"]))
                for r in self.paired_rows(records)]
        return markdown_table(("setting", "difference", "paired seeds", f"mean [{self.level:.0%} CI]",
                               "interval says"), rows)

    # ---------------------------------------------------------------------------------------------------- curves
    def curve_figure(self, records: Sequence[Record], path: Path) -> bool:
        """The metric over rounds per setting (one panel each), a line per method with its 95 % band; False when
        the records hold no series to draw."""
        metric = self.metric_name(records)
        series = [r for r in records if isinstance(r["metrics"].get(metric), list) and "round" in r["metrics"]]
        if not series:
            return False
        settings = self.order(series, "setting", self.settings)
        fig, axes = new_figure(ncols=len(settings))
        for ax, setting in zip(axes, settings):
            for method in self.order(series, "method", self.methods):
                runs = [r for r in series if r["setting"] == setting and r["method"] == method]
                rounds = sorted({x for r in runs for x in r["metrics"]["round"]})
                if not rounds:
                    continue
                points = []
                for x in rounds:
                    values = [r["metrics"][metric][r["metrics"]["round"].index(x)] for r in runs
                              if x in r["metrics"]["round"]]
                    points.append(mean_ci(values, self.level))
                mean = [self.scale * p[0] for p in points]
                lo = [self.scale * p[1] for p in points]
                hi = [self.scale * p[2] for p in points]
                (line,) = ax.plot(rounds, mean, label=f"{method} ({len(runs)} seeds)")
                if not all(math.isnan(v) for v in lo):
                    ax.fill_between(rounds, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            ax.set_title(setting)
            ax.set_xlabel("round")
            ax.set_ylabel(self.metric_label(records))
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        save_figure(fig, path)
        return True

    # ---------------------------------------------------------------------------------------------------- claims
    def claim_rows(self, records: Sequence[Record]) -> list[tuple[Claim, tuple[float, float, float, int], Decision]]:
        """Each claim with its raw paired interval ``(mean, low, high, seeds)`` and its
        :class:`~lightning_fedhet.experiments.decision.Decision` (on the ``adjust`` interval; pending until every
        planned seed of both methods is in)."""
        pairs = []
        for claim in self.claims:
            mine = by_seed(records, self.value, setting=claim.setting, method=claim.method)
            base = by_seed(records, self.value, setting=claim.setting, method=claim.baseline)
            pairs.append((mine, base))
        diffs = {i: [a[s] - b[s] for s in sorted(set(a) & set(b))] for i, (a, b) in enumerate(pairs)}
        adjusted = family_intervals(diffs, self.level, self.adjust)
        out = []
        for i, (claim, (mine, base)) in enumerate(zip(self.claims, pairs)):
            decision = decide_paired(mine, base, claim.paper_gain, self.planned, level=self.level,
                                     interval=adjusted[i][1:])
            out.append((claim, paired(mine, base, self.level), decision))
        return out

    def summaries(self, records: Sequence[Record]) -> list[Summary]:
        """The index rows: one per claim, on the current protocol's records."""
        current = [r for r in records if r["protocol"] == self.protocol] if self.protocol else list(records)
        return [Summary(claim.text, claim.paper, f"{self.fmt(m, lo, hi, d.against)} ({n} seeds)", d.text())
                for claim, (m, lo, hi, n), d in self.claim_rows(current)]

    # ---------------------------------------------------------------------------------------------------- page
    def reproduce_commands(self) -> list[str]:
        if self.commands is not None:
            return list(self.commands)
        return ["fedhet-study run STUDY      # the missing runs only (STUDY: the module or .py file that defines it)",
                "fedhet-study report STUDY   # this page and its figures, from the records",
                "fedhet-study check STUDY    # fails when this page differs from what the records give"]

    def sections(self, records: list[Record], out: Path) -> list[str]:
        """The page as a list of Markdown blocks; extend it in a subclass."""
        blocks = [f"# {self.title}\n"]
        if not records:
            return blocks + ["No run records yet: `fedhet-study run STUDY` writes them.\n"]
        metric = self.metric_name(records)
        blocks.append(
            f"Generated by `fedhet-study report` from {len(records)} run records (`records/{self.name}/`); do not "
            f"edit. A run's number is {'the final ' + metric if self._value is None else metric}; a cell shows the "
            f"mean and the {self.level:.0%} Student-t interval over its seeds, and methods are compared by the "
            f"differences over the seeds both ran (paired).\n")
        for protocol in self.protocols(records):
            mine = [r for r in records if r["protocol"] == protocol]
            blocks += [f"## Cells (protocol {protocol})\n", self.cells_table(mine)]
            if self.paired_rows(mine):
                blocks += [f"## Paired differences (protocol {protocol})\n", self.paired_table(mine)]
            figure = f"{self.name}/curves-{protocol}.png"
            if self.curves and self.curve_figure(mine, out / figure):
                blocks += [f"## Curves (protocol {protocol})\n",
                           f"![{metric} over rounds, mean and {self.level:.0%} band over seeds]({figure})\n"]
        if self.claims:
            rows = [(c.text, c.paper or "–", f"{self.fmt(m, lo, hi, d.against)} ({n} seeds)",
                     self.fmt(d.mean, d.lo, d.hi, d.against),
                     f"**{d.text()}**")
                    for c, (m, lo, hi, n), d in self.claim_rows(
                        [r for r in records if r["protocol"] == self.protocol] or records)]
            adjusted = {"none": "the same (no family adjustment)", "holm": "Holm-adjusted over this page's claims",
                        "bonferroni": "Bonferroni-adjusted over this page's claims"}[self.adjust]
            blocks += ["## Claims\n", f"Decided by the rule of `lightning_fedhet.experiments.decide` on the interval "
                       f"{adjusted}.\n",
                       markdown_table(("claim", "paper", "ours (paired, mean [95 % CI])", "deciding interval",
                                       "verdict"), rows)]
        blocks += reproduce_section(records, self.reproduce_commands())
        return blocks


set_default_report(Report)


# ------------------------------------------------------------------------------------------------- report & check

def default_index(entries: list[IndexEntry], out: Path) -> None:
    """``out/README.md``: one row per claim of every study (a study without claims: one row)."""
    rows = []
    for study, summaries, records in entries:
        link = f"[{study.title}]({study.name}.md)"
        for s in summaries or [None]:
            rows.append((link, s.claim if s else "–", s.paper if s else "–", s.ours if s else "–",
                         f"**{s.verdict}**" if s else "–", compute_used(records)))
    text = ["# Results\n", "Generated by `fedhet-study report` from the run records in `records/`; do not edit.\n",
            markdown_table(("study", "claim", "paper", "ours", "verdict", "compute"), rows)]
    (out / "README.md").write_text("\n".join(text))


def generate(studies: Study | Sequence[Study], root: str | Path, out: str | Path,
             index: Index | None = None) -> list[Path]:
    """Write every study's page and figures (and the index, with ``index``) into ``out`` from ``root``'s records;
    the files written."""
    studies = [studies] if isinstance(studies, Study) else list(studies)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    for study in studies:
        records = load_records(Path(root), study.name)
        entries.append((study, list(_call_report(study.report, records, out, Path(root)) or []), records))
    if index is not None:
        index(entries, out)
    return sorted(p for p in out.rglob("*") if p.is_file())


def _call_report(page: Callable, records: list[Record], out: Path, root: Path) -> list[Summary]:
    """``page(records, out)``, or ``page(records, out, root=root)`` for a report that takes the results folder the
    records come from (to read other files kept there, such as comparisons stored beside the records)."""
    try:
        takes_root = "root" in inspect.signature(page).parameters
    except (TypeError, ValueError):
        takes_root = False
    return page(records, out, root=root) if takes_root else page(records, out)


def _owned(rel: str, studies: Sequence[Study], whole_root: bool) -> bool:
    """Whether a generated file at ``rel`` (relative to the results root) belongs to what ``generate`` writes."""
    if HAND_WRITTEN.search(rel):
        return False
    return whole_root or any(rel == f"{s.name}.md" or rel.startswith(f"{s.name}/") for s in studies)


def _root_of(studies: Sequence[Study], root: str | Path | None) -> Path:
    return resolve_root(studies[0], root)


def report(studies: Study | Sequence[Study], root: str | Path | None = None, index: Index | None = None,
           wandb: bool = False, wandb_project: str | None = None) -> list[str]:
    """Bring ``root``'s pages and figures up to date with its records; the generated files (relative paths).

    Generated files that the records no longer give are removed: those of the studies' own pages (``<name>.md``,
    ``<name>/``) or, with an ``index``, every file under ``root`` but the records and the protocols. With ``wandb``,
    each study's paired table (a ``wandb.Table``) and figures go to a W&B run of its group.
    """
    studies = [studies] if isinstance(studies, Study) else list(studies)
    root = _root_of(studies, root)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(studies, root, fresh, index)
        generated = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and rel not in generated and _owned(rel, studies, index is not None):
                p.unlink()
        for rel in sorted(generated):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh / rel, root / rel)
    if wandb:
        from lightning_fedhet.experiments.wandb_log import log_report

        for study in studies:
            log_report(study, load_records(root, study.name), root, project=wandb_project)
    return sorted(generated)


def check(studies: Study | Sequence[Study], root: str | Path | None = None, index: Index | None = None) -> list[str]:
    """Differences between ``root``'s pages and figures and a fresh :func:`generate` (byte for byte); empty when
    they agree. A generated file that is missing, differs, or a stale one the records no longer give, is listed."""
    studies = [studies] if isinstance(studies, Study) else list(studies)
    root = _root_of(studies, root)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(studies, root, fresh, index)
        generated = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
        committed = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} if root.is_dir() else set()
        for rel in sorted(generated):
            ours, theirs = fresh / rel, root / rel
            if not theirs.is_file():
                problems.append(f"{rel}: generated from the records but not in {root}")
            elif not filecmp.cmp(ours, theirs, shallow=False):
                detail = ""
                if rel.endswith(".md"):
                    diff = difflib.unified_diff(theirs.read_text().splitlines(), ours.read_text().splitlines(),
                                                "committed", "from records", lineterm="", n=0)
                    detail = "\n    " + "\n    ".join(list(diff)[2:12])
                problems.append(f"{rel}: differs from what the records give{detail}")
        for rel in sorted(committed - generated):
            if _owned(rel, studies, index is not None):
                problems.append(f"{rel}: not generated from any record (stale or written by hand)")
    return problems

