"""examples/my_study.py loads as ``fedhet-study`` loads it and runs end to end (shrunk to 3 rounds and 2 seeds)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lightning_fedhet.experiments import Cell, check, load_records, load_study, report, run_study

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "my_study.py"


def test_the_example_study_runs_reports_and_checks(tmp_path):
    study = load_study(str(EXAMPLE))
    assert study.source == str(EXAMPLE) and len(study.cells) == 4 and study.seeds == (0, 1, 2, 3, 4)
    assert study.cells[0].config == {"rounds": 60, "eval_every": 5, "lr": 0.05, "local_steps": 5,
                                     "heterogeneity": 0.5}
    small = dataclasses.replace(study, seeds=(0, 1), cells=tuple(
        Cell(c.setting, c.method, {**c.config, "rounds": 3, "eval_every": 3}) for c in study.cells))
    result = run_study(small, root=tmp_path, progress=False, log=lambda text: None)
    assert len(result.written) == 8 and {r["seeds_in_run"] for r in load_records(tmp_path, "my-study")} == {2}
    assert report(small, tmp_path) == ["my-study.md", "my-study/curves-v1.png"]
    assert check(small, tmp_path) == []
    page = (tmp_path / "my-study.md").read_text()
    assert page.startswith("# FedVARP vs FedAvg under 20 % participation")
    assert "| strong | FedVARP − FedAvg | 2 |" in page
