"""The Ray backend (records equal to in-process ones, failures retried once then recorded) and W&B offline."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lightning_fedhet.experiments import Cell, Ray, load_failures, load_records, run_study
from lightning_fedhet.experiments.cli import main
from tests.experiments.small_study import STUDY, faulty_study
from tests.experiments.test_runs import assert_same_records

QUIET = {"progress": False, "log": lambda text: None}


def test_ray_tasks_give_the_in_process_records(ray_cluster, reference, tmp_path):
    # each cell x seed a task on 2 workers, the study object shipped by pickle
    result = run_study(STUDY, root=tmp_path / "one", backend=Ray(), **QUIET)
    assert len(result.written) == 12 and result.ok and result.backend == "ray"
    records = load_records(tmp_path / "one", STUDY.name)
    assert {r["seeds_in_run"] for r in records} == {1}
    assert_same_records(records, reference[1])
    # stacked groups of 3 seeds per task; the study loaded by the workers from its file (the console script's way)
    spec = str(Path(__file__).with_name("small_study.py"))
    assert main(["run", spec, "--root", str(tmp_path / "three"), "--backend", "ray", "--seeds-per-task", "3",
                 "--no-progress"]) == 0
    records = load_records(tmp_path / "three", STUDY.name)
    assert {r["seeds_in_run"] for r in records} == {3}
    assert_same_records(records, reference[1])


def test_a_failed_ray_task_is_retried_once_then_recorded_never_dropped(ray_cluster, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    study = faulty_study(str(markers))
    said = []
    result = run_study(study, root=tmp_path, backend=Ray(retries=1), progress=False, log=said.append)
    assert [r["method"] for r in load_records(tmp_path, "faulty")] == ["never", "once"]  # "once" passed its retry
    assert (markers / "once-0").exists()
    (failure,) = load_failures(tmp_path, "faulty")
    assert result.failed == [tmp_path / "records/faulty/v1/s/always/failed-seed0.json"]
    assert failure["method"] == "always" and failure["attempts"] == 2 and failure["backend"] == "ray"
    assert failure["error"].splitlines()[-1] == "ValueError: always always fails (seed 0)"
    assert "in faulty_run" in failure["error"]  # the worker's traceback
    assert any("FAILED s / always / seed 0 after 2 attempt(s)" in line for line in said)
    # the next run tries the failure again, and only it; a success replaces the failure record
    fixed = Cell("s", "always", {"fail": "never", "marker_dir": str(markers)})
    healed = dataclasses.replace(study, cells=(fixed, *study.cells[1:]))
    again = run_study(healed, root=tmp_path, backend=Ray(), **QUIET)
    assert again.skipped == 2 and len(again.written) == 1 and again.ok
    assert load_failures(tmp_path, "faulty") == [] and len(load_records(tmp_path, "faulty")) == 3


def test_wandb_offline_groups_runs_per_cell_and_logs_the_paired_table_and_figures(reference_copy, tmp_path,
                                                                                 monkeypatch):
    from lightning_fedhet.experiments import report
    from lightning_fedhet.experiments.wandb_log import WandbSink, log_report
    from tests.wandb_records import offline_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    record = load_records(reference_copy, "small")[0]
    WandbSink(STUDY, dir=tmp_path / "one").log_record(record)
    run = offline_run(tmp_path / "one")
    group, config = started_as(run["dir"])
    assert group == f"small/{record['setting']}/{record['method']}"  # a group per study and cell
    assert config["seed"] == record["seed"] and config["method"] == record["method"] and config["rounds"] == 4
    assert [row["val_acc"] for row in run["history"] if "val_acc" in row] == record["metrics"]["val_acc"]
    assert run["summary"]["record/engine"] == "vmap"

    report(STUDY, reference_copy)
    log_report(STUDY, load_records(reference_copy, "small"), reference_copy, dir=tmp_path / "rep")
    run = offline_run(tmp_path / "rep")
    assert started_as(run["dir"])[0] == "small"
    (logged,) = [row for row in run["history"] if "paired differences._type" in row]
    assert logged["paired differences._type"] == "table-file" and logged["paired differences.nrows"] == 2
    assert logged["cells.nrows"] == 4 and logged["figures/curves-v1._type"] == "image-file"
    table = json.loads((run["dir"] / "files" / logged["paired differences.path"]).read_text())
    rows = STUDY.report.paired_rows(load_records(reference_copy, "small"))
    assert table["data"] == [[r[c] for c in table["columns"]] for r in rows]


def started_as(run_dir: Path) -> tuple[str, dict]:
    """The group and the config a W&B run started with (its ``run`` record)."""
    from tests.wandb_records import read_records

    (log,) = Path(run_dir).glob("run-*.wandb")
    (run,) = [r.run for r in read_records(log) if r.WhichOneof("record_type") == "run"]
    return run.run_group, {item.key: json.loads(item.value_json) for item in run.config.update}
