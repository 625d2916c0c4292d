"""The "Against the authors' code" section of the study pages (scripts/referee) and its hook in the studies' pages
(scripts/studies/_repo.py).

What a reader relies on: a comparison record's figures (cases, largest difference, tolerance, verdict, the table,
the command) appear on the page; a study without records says "not compared yet"; referee records are never taken
for run records.
"""

import json
from pathlib import Path

import pytest
from referee import _common, section
from studies import _repo

from lightning_fedhet.experiments import Cell, check, load_records, report, run_study

WEIGHTS = {
    "study": "toy", "title": "Toy weights: theirs vs ours", "kind": "weights", "status": "compared",
    "authors": {"repo": "someone/toy", "commit": "6e9cce9b2e568666b5c3e0fab8f092a539884d7b", "files": ["main.py"]},
    "command": "python scripts/referee/toy.py --authors /tmp/scratch/toy",
    "inputs": {"description": "48 participation traces", "seeds": [1, 2, 3]},
    "cases": 48, "max_abs_diff": 8.7e-14, "tolerance": 1e-12, "agree": True,
    "notes": ["their sampler ran as released"],
    "table": {"header": ["pattern", "max |theirs - ours|"], "rows": [["cyclic-100", "8.7e-14"]]},
    "commit": "abc1234567", "dirty": False, "device": "cpu (2 cores, x86_64)", "torch": "2.0", "python": "3.11.7",
}


def write(root: Path, name: str, record: dict) -> None:
    path = root / "records" / record["study"] / "referee" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


def test_without_records_the_section_says_not_compared_yet(tmp_path):
    lines = section(tmp_path, "toy")
    assert lines[0].startswith("## Against the authors' code")
    assert "Not compared yet" in "\n".join(lines)


def test_a_weight_record_shows_its_figures_table_notes_and_command(tmp_path):
    write(tmp_path, "weights-toy", WEIGHTS)
    page = "\n".join(section(tmp_path, "toy"))
    assert "### Toy weights: theirs vs ours" in page
    assert "[someone/toy](https://github.com/someone/toy) at `6e9cce9`" in page
    assert "**agree** over 48 cases, max |theirs − ours| = 8.7e-14 (tolerance 1e-12)" in page
    assert "seeds 1-3" in page
    assert "| pattern | max \\|theirs - ours\\| |" in page  # a bar inside a cell is escaped
    assert "| cyclic-100 | 8.7e-14 |" in page
    assert "- their sampler ran as released" in page
    assert "python scripts/referee/toy.py --authors /tmp/scratch/toy" in page
    assert "Not compared yet" not in page


def test_a_disagreement_an_accuracy_interval_and_a_release_that_does_not_run_are_said_so(tmp_path):
    write(tmp_path, "a-differs", {**WEIGHTS, "title": "A", "agree": False, "max_abs_diff": 0.96})
    write(tmp_path, "b-accuracy", {**WEIGHTS, "title": "B", "kind": "accuracy", "cases": 5, "agree": True,
                                   "max_abs_diff": None, "tolerance": None,
                                   "difference": {"mean": -0.012, "low": -0.031, "high": 0.007, "seeds": 5}})
    write(tmp_path, "c-broken", {**WEIGHTS, "title": "C", "kind": "accuracy", "status": "does not run",
                                 "cases": 0, "agree": None, "max_abs_diff": None})
    page = "\n".join(section(tmp_path, "toy"))
    assert "**differ** over 48 cases, max |theirs − ours| = 0.96" in page
    assert "**no difference detected**: paired difference theirs − ours -1.2 pp [-3.1, +0.7] over 5 seeds" in page
    assert "**does not run as released**" in page
    assert page.count("- Compared (") == 2  # a comparison that did not run describes no inputs
    assert page.index("### A") < page.index("### B")  # weight comparisons come before accuracy


def test_an_accuracy_record_with_one_interval_per_setting_shows_each_with_its_label(tmp_path):
    # fractions in the record, percentage points with one decimal on the page: 0.004 -> +0.4, -0.0191 -> -1.9
    differences = [{"label": "beta=0", "mean": 0.004, "low": -0.0191, "high": 0.0261, "seeds": 5},
                   {"label": "beta=0.8", "mean": -0.031, "low": -0.052, "high": -0.0102, "seeds": 5}]
    write(tmp_path, "acc", {**WEIGHTS, "kind": "accuracy", "cases": 10, "agree": False, "max_abs_diff": None,
                            "tolerance": None, "differences": differences})
    page = "\n".join(section(tmp_path, "toy"))
    assert ("**they differ**: paired differences theirs − ours, beta=0 +0.4 pp [-1.9, +2.6]; "
            "beta=0.8 -3.1 pp [-5.2, -1.0] over 5 seeds each") in page


def test_an_accuracy_record_of_several_settings_shows_each_codes_contrast_with_the_first(tmp_path):
    # theirs: beta 0.8 - beta 0 = +1, 0, +2 pp over seeds 0-2: mean 1.0, sd 1.0, half-width t_{0.975,2} / sqrt(3)
    # = 4.303 / 1.732 = 2.48 -> [-1.5, 3.5]; ours: 0 on every seed; theirs - ours paired: theirs' numbers again
    accuracy = {"0": {"authors": {"0": 0.60, "1": 0.62, "2": 0.64}, "library": {"0": 0.6, "1": 0.6, "2": 0.6}},
                "0.8": {"authors": {"0": 0.61, "1": 0.62, "2": 0.66}, "library": {"0": 0.6, "1": 0.6, "2": 0.6}}}
    differences = [{"label": f"beta={b}", "mean": 0.0, "low": -0.01, "high": 0.01, "seeds": 3} for b in (0, 0.8)]
    write(tmp_path, "acc", {**WEIGHTS, "kind": "accuracy", "cases": 6, "agree": True, "max_abs_diff": None,
                            "tolerance": None, "differences": differences, "accuracy": accuracy})
    page = "\n".join(section(tmp_path, "toy"))
    assert "The contrast with beta=0 within each code" in page
    assert "| beta=0.8 − beta=0 | 1.0 pp [-1.5, 3.5] | 0.0 pp [0.0, 0.0] | 1.0 pp [-1.5, 3.5] | 3 |" in page
    # one setting (theirs and ours per seed, as FedAU's record): no contrast table
    write(tmp_path, "acc", {**WEIGHTS, "kind": "accuracy", "cases": 3, "agree": True, "max_abs_diff": None,
                            "tolerance": None, "accuracy": accuracy["0"]})
    assert "The contrast with" not in "\n".join(section(tmp_path, "toy"))


def test_report_appends_the_section_to_every_page_and_referee_records_are_not_run_records(tmp_path):
    def run(cell, seed):
        return {"metrics": {"acc": [0.5]}, "engine": "none"}

    def report_page(records, out):
        (out / "toy.md").write_text(f"# toy\n\n{len(records)} runs\n")
        return []

    study = _repo.study(name="toy", title="Toy", protocol="v1", seeds=(0,), cells=(Cell("s", "A", {}),), run=run,
                        report=report_page)
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "protocol-v1.md").write_text("# protocol\n")
    run_study(study, root=tmp_path, progress=False, log=lambda text: None)
    report(study, tmp_path)
    page = (tmp_path / "toy.md").read_text()
    assert page.startswith("# toy\n\n1 runs\n\n## Against the authors' code")
    assert "Not compared yet" in page
    write(tmp_path, "weights-toy", WEIGHTS)
    assert len(load_records(tmp_path, "toy")) == 1  # the referee record is not a run record
    assert check(study, tmp_path)  # the committed page is now stale
    report(study, tmp_path)
    assert check(study, tmp_path) == []
    assert "max |theirs − ours| = 8.7e-14" in (tmp_path / "toy.md").read_text()


def test_referee_records_refuse_the_run_records_name(tmp_path):
    with pytest.raises(ValueError, match="seed"):
        _common.record_path(tmp_path, "toy", "seed0")
    assert _common.record_path(tmp_path, "toy", "Weights FedAU").name == "weights-fedau.json"
