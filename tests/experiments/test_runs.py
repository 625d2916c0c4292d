"""Running a study: the same records whichever backend ran them, resume after a kill, no partial record."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_fedhet.experiments import (
    TIMING_KEYS,
    InProcess,
    Stacked,
    load_records,
    record_path,
    result_of,
    run_study,
    write_record,
)
from lightning_fedhet.experiments import records as records_module
from tests.experiments.small_study import STUDY

QUIET = {"progress": False, "log": lambda text: None}


def assert_same_records(records, reference):
    """Every key equal but the timing ones, and the commit: other sessions commit to this repository while the
    tests run, so two runs minutes apart may name different commits of the same library code."""
    assert len(records) == len(reference) == len(STUDY.cells) * len(STUDY.seeds)
    for mine, theirs in zip(records, reference):
        mine, theirs = result_of(mine), result_of(theirs)
        for record in (mine, theirs):
            del record["commit"], record["dirty"]
        assert mine == theirs, (mine["setting"], mine["method"], mine["seed"])


def test_the_reference_records_hold_what_the_study_declares(reference):
    _, records = reference
    keys = {"study", "protocol", "setting", "method", "seed", "commit", "dirty", "config", "engine", "device", "cpu",
            "torch", "python", "threads", "data_checksum", "metrics", *TIMING_KEYS}
    for record in records:
        assert set(record) == keys
        assert record["engine"] == "vmap" and record["threads"] == 1 and record["seeds_in_run"] == 1
        assert record["config"] == {"rounds": 4, "eval_every": 2, **STUDY_SETTINGS[record["setting"]]}
        assert record["metrics"]["round"] == [2, 4] and len(record["metrics"]["val_acc"]) == 2
    # the seeds differ, the data of a setting does not
    by_cell = {}
    for r in records:
        by_cell.setdefault((r["setting"], r["method"]), []).append(r)
    for runs in by_cell.values():
        assert len({r["data_checksum"] for r in runs}) == 1
        assert len({r["metrics"]["val_loss"][-1] for r in runs}) == 3
    assert len({r["data_checksum"] for r in records}) == 2  # iid and Dirichlet partitions differ


STUDY_SETTINGS = {"iid": {"alpha": None}, "dirichlet-0.3": {"alpha": 0.3}}


def test_stacked_seeds_give_the_one_at_a_time_records(reference, tmp_path):
    result = run_study(STUDY, root=tmp_path, backend=Stacked(), **QUIET)
    records = load_records(tmp_path, STUDY.name)
    assert len(result.written) == 12 and result.ok
    assert {r["seeds_in_run"] for r in records} == {3}  # one fit_seeds run per cell
    assert_same_records(records, reference[1])


def test_a_sequential_strategy_is_not_stacked_and_says_why(tmp_path):
    from tests.experiments import small_study

    def build(cell, seed):
        model, data, _ = small_study.build(cell, seed)
        return model, data, small_study.FedHetStrategy(seed=seed, engine="sequential", local_steps=2)

    study = small_study.federated_study("seq", build, methods=["FedAvg"], settings=["iid"], seeds=[0, 1],
                                        rounds=2, alpha=None)
    said = []
    run_study(study, root=tmp_path, backend="auto", progress=False, log=said.append)
    records = load_records(tmp_path, "seq")
    assert [r["engine"] for r in records] == ["sequential", "sequential"]
    assert any("one at a time (its strategy asks for engine='sequential')" in line for line in said)
    assert sum("one at a time" in line for line in said) == 1  # said once


class Killed(RuntimeError):
    pass


class KillAfter:
    """``study.run`` that raises after ``k`` runs (a kill in the middle of a study), counting the runs it made."""

    def __init__(self, run, k: int | None = None) -> None:
        self.run, self.k, self.calls = run, k, []

    def __call__(self, cell, seed):
        if self.k is not None and len(self.calls) == self.k:
            raise Killed(f"killed after {self.k} runs")
        self.calls.append((cell.setting, cell.method, seed))
        return self.run(cell, seed)


def test_a_killed_run_resumes_with_the_missing_runs_only(reference, tmp_path):
    killed = dataclasses.replace(STUDY, run=KillAfter(STUDY.run, k=5))
    with pytest.raises(Killed):
        run_study(killed, root=tmp_path, backend=InProcess(), **QUIET)
    first = load_records(tmp_path, STUDY.name)
    assert len(first) == 5
    again = KillAfter(STUDY.run)
    result = run_study(dataclasses.replace(STUDY, run=again), root=tmp_path, backend=InProcess(), **QUIET)
    done_first = {(r["setting"], r["method"], r["seed"]) for r in first}
    assert len(again.calls) == 7 and not done_first & set(again.calls)
    assert result.skipped == 5 and len(result.written) == 7
    assert_same_records(load_records(tmp_path, STUDY.name), reference[1])
    # and once complete, nothing runs
    idle = KillAfter(STUDY.run)
    assert run_study(dataclasses.replace(STUDY, run=idle), root=tmp_path, backend=InProcess(), **QUIET).skipped == 12
    assert idle.calls == []


def test_an_interrupted_write_leaves_no_partial_record(reference, tmp_path, monkeypatch):
    real_replace, renames = records_module.os.replace, []

    def interrupted_third(src, dst):
        renames.append(dst)
        if len(renames) == 3:  # the third record: its text is in the temporary file, the rename never happens
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(records_module.os, "replace", interrupted_third)
    with pytest.raises(KeyboardInterrupt):
        run_study(STUDY, root=tmp_path, backend=InProcess(), **QUIET)
    monkeypatch.setattr(records_module.os, "replace", real_replace)
    files = sorted(p.name for p in (tmp_path / "records").rglob("*") if p.is_file())
    assert files == ["seed0.json", "seed1.json"]  # whole records only: no third, no temporary file left
    # a temporary file a SIGKILL left behind is not a record: its seed runs again
    stale = record_path(tmp_path, "small", "v1", "iid", "FedAvg", 2).with_name("seed2.json.4242.tmp")
    stale.write_text('{"study": "small", "trunc')
    assert len(load_records(tmp_path, STUDY.name)) == 2
    run_study(STUDY, root=tmp_path, backend=InProcess(), **QUIET)
    assert_same_records(load_records(tmp_path, STUDY.name), reference[1])


def test_write_record_writes_whole_json_or_nothing(tmp_path):
    path = tmp_path / "a" / "seed0.json"
    with pytest.raises(TypeError, match="not JSON-able"):
        write_record(path, {"x": object()})
    assert not path.parent.exists() or not any(path.parent.iterdir())
    write_record(path, {"b": 1, "a": [1.5]})
    assert path.read_text() == '{\n "a": [\n  1.5\n ],\n "b": 1\n}\n' and json.loads(path.read_text())["b"] == 1


def test_the_progress_bar_counts_runs(reference_copy, capsys):
    record_path(reference_copy, "small", "v1", "iid", "FedVARP", 1).unlink()
    result = run_study(STUDY, root=reference_copy, backend=InProcess(), progress=True)
    err = capsys.readouterr().err
    assert len(result.written) == 1 and result.skipped == 11
    assert "1 run(s) to do, 11 already recorded" in err and "1/1" in err and "running 1" in err


def test_a_canary_rerun_is_bit_for_bit_and_finds_drift(tmp_path):
    import json as json_module

    from lightning_fedhet.experiments import Cell, canary_path, rerun_canary, write_canary

    canary = Cell("iid", "FedVARP", {"rounds": 2, "eval_every": 1, "alpha": None})
    study = dataclasses.replace(STUDY, canary=canary, canary_seed=5)
    record = write_canary(study, tmp_path)
    assert record["protocol"] == "canary" and record["seed"] == 5 and record["metrics"]["round"] == [1, 2]
    assert rerun_canary(study, tmp_path) == []
    path = canary_path(tmp_path, "small")
    drifted = json_module.loads(path.read_text())
    drifted["metrics"]["val_acc"][1] += 1e-7
    path.write_text(json_module.dumps(drifted))
    (problem,) = rerun_canary(study, tmp_path)
    assert "canary metrics differs" in problem and "(val_acc[1]: recorded" in problem
