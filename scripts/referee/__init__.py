"""The authors' released code as referee: comparison scripts (``scripts/referee/<study>.py``, run by hand with
``--authors PATH``, a scratch export of their repository outside this one) and the page section they feed.

Each script writes one JSON record per comparison to ``docs/results/records/<study>/referee/<name>.json`` (never
``seed*.json``: the run records' name) with the keys ``study, title, kind ("weights" | "accuracy"), status,
authors {repo, commit, files}, command, inputs {description, seeds}, cases, max_abs_diff, tolerance, agree, notes``,
an optional ``table {header, rows}``, for accuracy an optional paired ``difference {mean, low, high, seeds}`` or
``differences`` (a list of them, each with a ``label``), and the provenance of
``lightning_fedhet.experiments.provenance()``.
:func:`section` renders them as the "Against the authors' code" section that every study page ends with
(``scripts/studies/_repo.py`` appends it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

HEADING = "## Against the authors' code\n"
_STATUS_TEXT = {
    "not run": "not run",
    "does not run": "does not run as released",
    "no released code": "no released code",
}


def load(root: Path, study: str) -> list[dict]:
    """The referee records of ``study`` under ``root/records/<study>/referee/``, weights before accuracy."""
    folder = root / "records" / study / "referee"
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
    return sorted(records, key=lambda r: (r.get("kind") != "weights", r.get("title", "")))


def _figure(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return "0" if x == 0 else f"{x:.2g}"


def _result(r: dict) -> str:
    status = r.get("status", "compared")
    if status != "compared":
        return f"**{_STATUS_TEXT.get(status, status)}** (reasons below)"
    if r["kind"] == "weights":
        verdict = {True: "agree", False: "differ", None: "–"}[r.get("agree")]
        tol = "" if r.get("tolerance") is None else f" (tolerance {_figure(r['tolerance'])})"
        diff = "" if r.get("max_abs_diff") is None else f", max |theirs − ours| = {_figure(r['max_abs_diff'])}{tol}"
        return f"**{verdict}** over {r['cases']:,} cases{diff}"
    verdict = {True: "no difference detected", False: "they differ", None: "–"}[r.get("agree")]
    if r.get("differences"):  # one paired difference per setting (label), e.g. per beta
        parts = [f"{d['label']} {100.0 * d['mean']:+.1f} pp [{100.0 * d['low']:+.1f}, {100.0 * d['high']:+.1f}]"
                 for d in r["differences"]]
        seeds = {d["seeds"] for d in r["differences"]}
        each = f" over {seeds.pop()} seeds each" if len(seeds) == 1 else ""
        return f"**{verdict}**: paired differences theirs − ours, {'; '.join(parts)}{each}"
    diff = r.get("difference")
    if diff:
        scale = 100.0
        interval = (f"{scale * diff['mean']:+.1f} pp [{scale * diff['low']:+.1f}, {scale * diff['high']:+.1f}] over "
                    f"{diff['seeds']} seeds")
        return f"**{verdict}**: paired difference theirs − ours {interval}"
    return f"**{verdict}** over {r['cases']} seeds"


def _cell(value) -> str:
    return str(value).replace("|", "\\|")  # a bar inside a cell ("max |a - b|") would split the column


def _table(table: dict) -> list[str]:
    header = [_cell(h) for h in table["header"]]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
    return lines


def section(root: Path, study: str) -> list[str]:
    """Markdown lines of the "Against the authors' code" section of ``study``'s page, from its referee records;
    a one-line "not compared yet" section when there are none."""
    records = load(Path(root), study)
    if not records:
        return [HEADING, f"Not compared yet: no record under `records/{study}/referee/`.\n"]
    lines = [
        HEADING,
        "Each rule was run against the authors' released code on identical inputs (their code stays outside this "
        f"repository; the scripts import it from a scratch folder). Generated from `records/{study}/referee/`; "
        "the command under each comparison regenerates its record.\n",
    ]
    for r in records:
        a = r["authors"]
        compared = r.get("status", "compared") == "compared"
        lines += [
            f"### {r['title']}\n",
            f"- Authors' code: [{a['repo']}](https://github.com/{a['repo']}) at `{str(a['commit'])[:7]}` "
            f"({', '.join(f'`{f}`' for f in a['files'])})",
            *([f"- Compared ({r['kind']}): {r['inputs']['description']}"
               + (f"; seeds {_seeds(r['inputs']['seeds'])}" if r["inputs"].get("seeds") else "")] if compared else []),
            f"- Result: {_result(r)}",
            f"- Run at commit `{r['commit']}`{' (uncommitted changes)' if r.get('dirty') else ''}, torch "
            f"{r['torch']}, Python {r['python']}, {r['device']}\n",
        ]
        if r.get("table"):
            lines += _table(r["table"]) + [""]
        if r.get("notes"):
            lines += [f"- {n}" for n in r["notes"]] + [""]
        lines += contrasts(r)
        lines += ["```bash", r["command"], "```\n"]
    return lines


def contrasts(r: dict) -> list[str]:
    """For an accuracy record of several settings (``accuracy``: ``{setting: {"authors": {seed: acc}, "library":
    {seed: acc}}}``, the first setting the baseline), each other setting's contrast with the baseline within each
    code, over the seeds, and theirs − ours of that contrast paired over the seeds: whether the two codes agree on
    the effect a claim is about, not only on the level. Lines of a table; none for a record of one setting."""
    from lightning_fedhet.experiments import fmt_ci, mean_ci, paired

    acc = r.get("accuracy") or {}
    if len(acc) < 2 or not all(isinstance(v, dict) and {"authors", "library"} <= set(v) for v in acc.values()):
        return []
    names = [d["label"] for d in r.get("differences") or []]
    names = names if len(names) == len(acc) else list(acc)
    (base, *others), (base_name, *other_names) = list(acc), names

    def contrast(code: str, setting: str) -> dict[int, float]:
        a, b = acc[setting][code], acc[base][code]
        return {int(s): a[s] - b[s] for s in sorted(a, key=int) if s in b}

    rows = []
    for setting, name in zip(others, other_names):
        theirs, ours = contrast("authors", setting), contrast("library", setting)
        mean, lo, hi, n = paired(theirs, ours)
        rows.append([f"{name} − {base_name}", fmt_ci(*mean_ci(list(theirs.values())), unit=" pp"),
                     fmt_ci(*mean_ci(list(ours.values())), unit=" pp"), fmt_ci(mean, lo, hi, unit=" pp"), n])
    return [f"The contrast with {base_name} within each code (mean [95 % CI] over seeds; theirs − ours paired over "
            "the seeds):\n",
            *_table({"header": ["contrast", "authors' code", "library", "theirs − ours", "seeds"], "rows": rows}),
            ""]


def _seeds(seeds: list[int]) -> str:
    """``0-4`` for a run of consecutive seeds, else the list."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))
