"""The generic report, its statistics against scipy computed here, check, the console script and the import graph."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from lightning_fedhet.experiments import (
    LABELS,
    Claim,
    Report,
    check,
    fmt_ci,
    fmt_vs_bound,
    generate,
    load_records,
    mean_ci,
    paired,
    report,
    seeds_needed,
    verdict_for_gain,
)
from lightning_fedhet.experiments.cli import main
from tests.experiments.small_study import STUDY

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fedhet"


def test_the_paired_interval_is_scipys_t_interval_on_the_differences(reference_copy):
    report(STUDY, reference_copy)
    page = (reference_copy / "small.md").read_text()
    records = load_records(reference_copy, "small")
    rows = STUDY.report.paired_rows(records)
    assert [(r["setting"], r["method"], r["baseline"]) for r in rows] == [
        ("iid", "FedVARP", "FedAvg"), ("dirichlet-0.3", "FedVARP", "FedAvg")]
    for row in rows:
        final = {(r["method"], r["seed"]): r["metrics"]["val_acc"][-1] for r in records
                 if r["setting"] == row["setting"]}
        differences = np.array([final["FedVARP", s] - final["FedAvg", s] for s in (0, 1, 2)])
        low, high = stats.t.interval(0.95, len(differences) - 1, loc=differences.mean(),
                                     scale=stats.sem(differences))
        assert row["seeds"] == 3
        assert row["mean"] == pytest.approx(differences.mean(), rel=1e-12, abs=1e-15)
        assert (row["low"], row["high"]) == pytest.approx((low, high), rel=1e-12, abs=1e-15)
        shown = f"{100 * differences.mean():.1f} [{100 * low:.1f}, {100 * high:.1f}]"
        assert f"| {row['setting']} | FedVARP − FedAvg | 3 | {shown} |" in page
    # a cell's interval likewise
    values = [r["metrics"]["val_acc"][-1] for r in records if r["setting"] == "iid" and r["method"] == "FedAvg"]
    low, high = stats.t.interval(0.95, 2, loc=np.mean(values), scale=stats.sem(values))
    assert f"| iid | FedAvg | 3 | {100 * np.mean(values):.1f} [{100 * low:.1f}, {100 * high:.1f}] |" in page
    assert (reference_copy / "small" / "curves-v1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_statistics_by_hand():
    assert mean_ci([1.0])[0] == 1.0 and math.isnan(mean_ci([1.0])[1])
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(stats.t.ppf(0.975, 2) * 1.0 / math.sqrt(3))
    assert paired({0: 3.0, 1: 5.0, 2: 9.0}, {0: 1.0, 1: 2.0, 5: 0.0})[3] == 2  # seeds both have
    assert fmt_ci(0.5, 0.25, 0.75) == "50.0 [25.0, 75.0]" and fmt_ci(math.nan, 0, 0) == "–"
    assert verdict_for_gain(0.01, 0.02, 0.03, paper_gain=0.03) == "reproduced"
    assert verdict_for_gain(0.001, 0.01, 0.02, paper_gain=0.03) == "partly reproduced"
    assert verdict_for_gain(-0.01, 0.01, 0.03) == "direction only"
    assert verdict_for_gain(-0.03, -0.01, 0.01) == "not reproduced"
    # n = 2: t = 12.7, 12.7 * 1 / 1.41 = 9.0 > 1; n = 7: 2.447 / 2.646 = 0.925 < 1; n = 6: 2.571 / 2.449 > 1
    assert seeds_needed(1.0, 1.0) == 7


@pytest.mark.parametrize(("ci", "against", "text"), [
    ((0.005, 0.001, 0.009), (), "0.5 [0.1, 0.9]"),                 # nothing to disambiguate
    ((0.005, -0.0004, 0.01), (), "0.50 [-0.04, 1.00]"),           # "-0.0" would hide the sign: 0 is always read
    ((0.005, 0.0004, 0.01), (), "0.50 [0.04, 1.00]"),             # ... and "0.0" would look like a tie
    ((0.005, 0.0, 0.01), (), "0.5 [0.0, 1.0]"),                   # an end exactly 0 is no ambiguity
    ((-0.0096, -0.02722, 0.00802), (0.008,), "-0.960 [-2.722, 0.802]"),  # Fed-CIS v3 R5 against +0.8 pp
    ((-0.0096, -0.02722, 0.00802), (), "-1.0 [-2.7, 0.8]"),       # without the effect, one decimal
    ((0.0011, -0.0003, 0.0026), (0.0031,), "0.11 [-0.03, 0.26]"),   # 0.3 vs 0.3: two decimals tell
    ((0.5, 0.4999999999, 0.6), (0.5,), "50.000000 [50.000000, 60.000000]"),  # 6 decimals at most, then stop
])
def test_fmt_ci_shows_which_side_of_0_and_the_effect_each_end_lies(ci, against, text):
    assert fmt_ci(*ci, against=against) == text
    assert fmt_ci(math.nan, 0.0, 0.0, against=against) == "–"


@pytest.mark.parametrize(("value", "bound", "text"), [
    (0.0048, 0.005, "+0.48"),      # two decimals already say which side of 0.50 it lies on
    (0.00497, 0.005, "+0.497"),    # "+0.50" would read as the bound itself: one more decimal
    (0.00503, 0.005, "+0.503"),
    (-0.00497, 0.005, "-0.497"),   # the bound is two-sided: |value| against |bound|
    (0.0049996, 0.005, "+0.49996"),  # as many decimals as it takes ...
    (0.004999999999, 0.005, "+0.500000"),  # ... up to 6
    (0.005, 0.005, "+0.50"),       # exactly the bound: nothing to disambiguate
    (0.0099, 0.01, "+0.99"),
    (0.00996, 0.01, "+0.996"),     # FedStale's bound, 1 pp
    (math.nan, 0.005, "–"),
])
def test_fmt_vs_bound_shows_which_side_of_the_bound_a_value_lies(value, bound, text):
    assert fmt_vs_bound(value, bound) == text
    if text != "–":
        assert fmt_vs_bound(value, bound, unit=" pp") == text + " pp"


def test_report_and_check_agree_byte_for_byte_and_find_a_change(reference_copy):
    assert report(STUDY, reference_copy) == ["small.md", "small/curves-v1.png"]
    assert check(STUDY, reference_copy) == []
    first = (reference_copy / "small" / "curves-v1.png").read_bytes()
    report(STUDY, reference_copy)
    assert (reference_copy / "small" / "curves-v1.png").read_bytes() == first  # reproducible figure
    page = reference_copy / "small.md"
    page.write_text(page.read_text().replace("| 3 |", "| 4 |", 1))
    (reference_copy / "small" / "old.png").write_bytes(b"stale")
    problems = check(STUDY, reference_copy)
    assert any(p.startswith("small.md: differs") for p in problems)
    assert "small/old.png: not generated from any record (stale or written by hand)" in problems
    report(STUDY, reference_copy)
    assert check(STUDY, reference_copy) == [] and not (reference_copy / "small" / "old.png").exists()


def test_a_report_subclass_extends_the_page_and_claims_get_verdicts(reference_copy):
    class WithNote(Report):
        def sections(self, records, out):
            blocks = super().sections(records, out)
            return blocks[:2] + ["## Note\n", f"{len(records)} runs.\n"] + blocks[2:]

    claim = Claim("FedVARP beats FedAvg on Dirichlet data", "dirichlet-0.3", "FedVARP", "FedAvg", paper="+3 pp",
                  paper_gain=0.03)
    study = dataclasses.replace(STUDY, report=WithNote(metric="val_acc", claims=[claim]))
    generate(study, reference_copy, reference_copy / "out")
    page = (reference_copy / "out" / "small.md").read_text()
    assert "## Note\n\n12 runs." in page and "## Claims" in page
    (summary,) = study.report.summaries(load_records(reference_copy, "small"))
    # 12 runs: the small study's 3 seeds x 2 methods x 2 settings; the claim's cell has every planned seed
    assert summary.claim == claim.text and summary.verdict.split(" (")[0] in LABELS[:4]
    assert "Holm-adjusted" in page and "deciding interval" in page


def test_a_claims_interval_shows_its_end_below_the_papers_effect(reference_copy):
    """A paper effect 0.01 pp above the raw interval's upper end prints, at the page's one decimal, as that end:
    its end must show it lies below the effect (the label is decided on that), and the digits must be its own."""
    claim = Claim("FedVARP beats FedAvg on Dirichlet data", "dirichlet-0.3", "FedVARP", "FedAvg", paper_gain=0.03)
    study = dataclasses.replace(STUDY, report=Report(metric="val_acc", claims=[claim], adjust="none"))
    records = load_records(reference_copy, "small")
    ((_, (_, _, hi, _), _),) = study.report.claim_rows(records)
    shown = round(100 * hi, 1)
    effect = (100 * hi + shown + 0.05) / 2 / 100  # above hi, below where hi's one-decimal text would change
    assert hi < effect and f"{100 * hi:.1f}" == f"{100 * effect:.1f}"  # the tie the page must not show
    claim = Claim(claim.text, "dirichlet-0.3", "FedVARP", "FedAvg", paper_gain=effect)
    study = dataclasses.replace(STUDY, report=Report(metric="val_acc", claims=[claim], adjust="none"))
    (summary,) = study.report.summaries(records)
    shown_hi = float(summary.ours.split("[")[1].split("]")[0].split(", ")[1])
    assert shown_hi < 100 * effect and shown_hi == pytest.approx(100 * hi, abs=0.005)  # hi to two decimals


def test_the_console_script_runs_reports_and_checks(reference_copy, capsys):
    spec = str(Path(__file__).with_name("small_study.py"))  # a file, as a user names theirs
    assert main(["run", spec, "--root", str(reference_copy), "--no-progress"]) == 0
    assert "0 run(s) to do, 12 already recorded" in capsys.readouterr().err
    assert main(["report", spec, "--root", str(reference_copy)]) == 0
    assert main(["check", spec, "--root", str(reference_copy)]) == 0
    (reference_copy / "small.md").write_text("# edited by hand\n")
    assert main(["check", spec, "--root", str(reference_copy)]) == 1
    assert main(["list", "tests.experiments.small_study", "--root", str(reference_copy)]) == 0
    assert "iid / FedAvg: 3/3" in capsys.readouterr().out


def test_the_library_never_imports_experiments_and_experiments_only_public_modules():
    below, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        inside = "experiments" in path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                if not inside and name.startswith("lightning_fedhet.experiments"):
                    below.append(f"{path.relative_to(PACKAGE)} imports {name}")
                if inside and name.startswith("lightning_fedhet") and \
                        not name.startswith("lightning_fedhet.experiments"):
                    used.add(name)
    assert below == []
    assert used and all(not part.startswith("_") for name in used for part in name.split("."))
