"""The driver by hand (``runner.run_study`` and its failure records, ``records.py``'s paths, loading and machine
description, the backends' task plans, the study declaration): the gaps the ``experiments-driver`` mutation chunk
found (docs/testing.md). Every study here trains nothing: its runs return a fixed dict at once, so each expected
message, path and count below is written out by hand.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from lightning_fedhet.experiments import Backend, Cell, InProcess, Outcome, Ray, Stacked, Study, Task, execute
from lightning_fedhet.experiments import backends as backends_module
from lightning_fedhet.experiments import records as records_module
from lightning_fedhet.experiments import runner as runner_module
from lightning_fedhet.experiments import study as study_module
from lightning_fedhet.experiments.records import (
    describe_device,
    failure_path,
    load_failures,
    load_records,
    machine,
    provenance,
    record_path,
    result_of,
)
from lightning_fedhet.experiments.runner import make_record, missing_runs, run_study
from lightning_fedhet.experiments.study import load_study, resolve_root

CODE = {"commit": "c0ffee1234", "dirty": False}


def _value_run(cell: Cell, seed: int) -> dict:
    """A run that trains nothing: its metric is ``10 * seed + len(method)``, so each record is known by hand."""
    return {"metrics": {"v": 10 * seed + len(cell.method)}, "engine": "none"}


def _value_run_seeds(cell: Cell, seeds) -> list[dict]:
    return [_value_run(cell, s) for s in seeds]


CELLS = (Cell("More available", "A", {"lr": 0.1}), Cell("More available", "BB", {"lr": 0.2}),
         Cell("rare", "A", {"lr": 0.3}))
TOY = Study(name="drv", cells=CELLS, seeds=(0, 1), run=_value_run, report=lambda records, out: [])


CODE_ASKED: list[tuple] = []


@pytest.fixture(autouse=True)
def _fixed_code(monkeypatch):
    """Every record names the same commit, clean (the shared tree's own state would decide the dirty warning);
    ``CODE_ASKED`` keeps what each call asked about."""
    CODE_ASKED.clear()
    monkeypatch.setattr(runner_module, "code_version",
                        lambda repo=None, code_paths=(): CODE_ASKED.append((repo, code_paths)) or dict(CODE))


def _quiet_run(study, root, **kwargs):
    said: list[str] = []
    report = run_study(study, root=root, progress=False, log=said.append, **kwargs)
    return report, said


# ------------------------------------------------------------------------------------------------ paths, loading
def test_record_and_failure_paths_by_hand():
    assert record_path(Path("/r"), "st", "v2", "More available", "Fed Avg", 3) == \
        Path("/r/records/st/v2/more-available/fed-avg/seed3.json")
    assert failure_path(Path("/r"), "st", "v2", "More available", "Fed Avg", 3) == \
        Path("/r/records/st/v2/more-available/fed-avg/failed-seed3.json")
    assert record_path("r", "st", "v1", "s", "m", 7.0).name == "seed7.json"  # int(seed): not "seed7.0.json"


def test_loading_sorts_by_protocol_setting_method_seed_and_keeps_failures_apart(tmp_path):
    def rec(protocol, setting, method, seed):
        return {"protocol": protocol, "setting": setting, "method": method, "seed": seed}

    made = [rec("v2", "a", "m", 0), rec("v1", "b", "m", 1), rec("v1", "a", "n", 10), rec("v1", "a", "n", 2),
            rec("v1", "a", "m", 5)]
    for r in made:
        records_module.write_record(record_path(tmp_path, "st", r["protocol"], r["setting"], r["method"], r["seed"]), r)
    failed = rec("v1", "a", "m", 9)
    records_module.write_record(failure_path(tmp_path, "st", "v1", "a", "m", 9), failed)
    records_module.write_record(record_path(tmp_path, "other", "v1", "a", "m", 0), rec("v1", "a", "m", 0))
    # seed 10 after seed 2: sorted by number, not by file name
    assert load_records(tmp_path, "st") == [rec("v1", "a", "m", 5), rec("v1", "a", "n", 2), rec("v1", "a", "n", 10),
                                            rec("v1", "b", "m", 1), rec("v2", "a", "m", 0)]
    assert load_failures(tmp_path, "st") == [failed]
    assert load_records(tmp_path, "none") == [] and load_failures(tmp_path, "none") == []
    assert load_records(str(tmp_path), "other") == [rec("v1", "a", "m", 0)]


def test_git_gives_its_output_as_text_and_nothing_when_it_fails(tmp_path):
    """In a repository without commits ``git rev-parse HEAD`` prints ``HEAD`` and fails: a failure gives ``""``,
    whatever git printed."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert records_module._git(tmp_path, "rev-parse", "--show-toplevel") == f"{tmp_path.resolve()}\n"
    assert records_module._git(tmp_path, "rev-parse", "HEAD") == ""


def test_git_outside_a_repository_and_without_git_gives_empty_text(tmp_path, monkeypatch):
    assert records_module._git(tmp_path, "rev-parse", "HEAD") == ""  # CalledProcessError: not a repository
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all: OSError
    assert records_module._git(tmp_path, "--version") == ""


# ------------------------------------------------------------------------------------------ machine description
def test_describe_device_by_hand(monkeypatch):
    monkeypatch.setattr(records_module.os, "cpu_count", lambda: 7)
    monkeypatch.setattr(records_module.platform, "machine", lambda: "riscv64")
    assert describe_device() == "cpu (7 cores, riscv64)"
    assert describe_device("cpu") == "cpu (7 cores, riscv64)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"Fake GPU {device.index}")
    assert describe_device("cuda:1") == "cuda (Fake GPU 1)"
    assert describe_device("meta") == "meta"


class _FakeCpuinfo:
    text: str | None = None

    def __init__(self, path):
        assert str(path) == "/proc/cpuinfo"

    def read_text(self):
        if self.text is None:
            raise OSError("no /proc here")
        return self.text


def test_cpu_identity_reads_the_first_model_name_and_the_instruction_set(monkeypatch):
    monkeypatch.setattr(records_module, "Path", _FakeCpuinfo)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(_FakeCpuinfo, "text", "processor\t: 0\nmodel name\t: Fake CPU @ 2.0GHz: rev 1\n"
                                              "model name\t: Second\n")
    assert records_module.cpu_identity() == "Fake CPU @ 2.0GHz: rev 1; AVX2"
    monkeypatch.setattr(_FakeCpuinfo, "text", "processor\t: 0\n")  # no model name line
    assert records_module.cpu_identity() == "unknown; AVX2"
    monkeypatch.setattr(_FakeCpuinfo, "text", None)  # no /proc/cpuinfo: the platform's name, else unknown
    monkeypatch.setattr(records_module.platform, "processor", lambda: "arm")
    assert records_module.cpu_identity() == "arm; AVX2"
    monkeypatch.setattr(records_module.platform, "processor", lambda: "")
    assert records_module.cpu_identity() == "unknown; AVX2"


def test_machine_and_provenance_by_hand(monkeypatch):
    monkeypatch.setattr(records_module, "describe_device", lambda device="cpu": f"dev {device}")
    monkeypatch.setattr(records_module, "cpu_identity", lambda: "Fake; AVX2")
    monkeypatch.setattr(records_module.platform, "python_version", lambda: "3.99.1")
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    monkeypatch.setattr(records_module, "code_version", lambda repo=None, code_paths=(): {"commit": f"{repo}",
                                                                                           "dirty": code_paths})
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        expected = {"device": "dev cpu", "cpu": "Fake; AVX2", "torch": "9.9.9", "python": "3.99.1", "threads": 3}
        assert machine() == expected
        assert machine("cuda") == {**expected, "device": "dev cuda"}
        assert provenance("here", ("a",), "meta") == {"commit": "here", "dirty": ("a",), **expected,
                                                      "device": "dev meta"}
        assert provenance() == {"commit": "None", "dirty": (), **expected}
    finally:
        torch.set_num_threads(previous)


# ------------------------------------------------------------------------------------------------- the driver
def test_missing_runs_lists_each_cells_seeds_without_a_record(tmp_path):
    records_module.write_record(record_path(tmp_path, "drv", "v1", "More available", "A", 1), {})
    records_module.write_record(failure_path(tmp_path, "drv", "v1", "rare", "A", 0), {})  # a failure: still missing
    for seed in (0, 1):
        records_module.write_record(record_path(tmp_path, "drv", "v1", "More available", "BB", seed), {})
    assert missing_runs(TOY, tmp_path, [0, 1.0], CELLS) == [(CELLS[0], [0]), (CELLS[2], [0, 1])]


def test_the_repository_of_a_study_is_its_files_folder():
    def with_source(source):
        return runner_module._repo(dataclasses.replace(TOY, source=source))

    assert with_source("some/where/sweep.py") == Path("some/where")
    assert with_source("some/where/sweep.py:OTHER") == Path("some/where")
    assert with_source("package.sweep") is None and with_source(None) is None


def test_make_record_by_hand():
    result = {"metrics": {"v": 1}, "engine": "e", "config": {"lr": 0.5, "rounds": 3}, "device": "d", "cpu": "c",
              "torch": "t", "python": "p", "threads": 2, "wall_s": 1.5, "cpu_s": 2.5, "seeds_in_run": 4,
              "data_checksum": "sum", "note": "not recorded"}
    record = make_record(TOY, CELLS[0], 3.0, result, CODE)
    assert record == {"study": "drv", "protocol": "v1", "setting": "More available", "method": "A", "seed": 3,
                      "commit": "c0ffee1234", "dirty": False, "config": {"lr": 0.5, "rounds": 3}, "engine": "e",
                      "metrics": {"v": 1}, "device": "d", "cpu": "c", "torch": "t", "python": "p", "threads": 2,
                      "wall_s": 1.5, "cpu_s": 2.5, "seeds_in_run": 4, "data_checksum": "sum"}
    assert type(record["seed"]) is int
    del result["config"]
    result["data_checksum"] = ""  # no checksum reported: no key
    record = make_record(TOY, CELLS[0], 3, result, CODE)
    assert record["config"] == {"lr": 0.1} and "data_checksum" not in record


def test_a_run_logs_what_it_does_and_writes_one_record_per_cell_and_seed(tmp_path):
    report, said = _quiet_run(TOY, tmp_path)
    prefix = "[drv v1]"
    assert said[0] == f"{prefix} 6 run(s) to do, 0 already recorded; in this process, one cell x seed at a time " \
                      "(1 torch thread(s))"
    assert said[1:7] == [f"{prefix} {cell.name} / seed {seed}: 0.0 s ({k}/6)"
                         for k, (cell, seed) in enumerate(((c, s) for c in CELLS for s in (0, 1)), start=1)]
    assert re.fullmatch(r"\[drv v1\] 6 new record\(s\), 0 failed, \d+\.\d s", said[7]) and len(said) == 8
    assert report.backend == "in-process" and report.skipped == 0 and report.failed == [] and report.ok
    assert report.written == [record_path(tmp_path, "drv", "v1", c.setting, c.method, s) for c in CELLS
                              for s in (0, 1)]
    assert report.wall_s == round(report.wall_s, 2) and report.wall_s >= 0
    records = load_records(tmp_path, "drv")
    assert [(r["setting"], r["method"], r["seed"], r["metrics"]["v"], r["config"]["lr"]) for r in records] == [
        ("More available", "A", 0, 1, 0.1), ("More available", "A", 1, 11, 0.1),
        ("More available", "BB", 0, 2, 0.2), ("More available", "BB", 1, 12, 0.2),
        ("rare", "A", 0, 1, 0.3), ("rare", "A", 1, 11, 0.3)]
    assert all(r["commit"] == "c0ffee1234" and r["dirty"] is False and r["seeds_in_run"] == 1 for r in records)
    assert [p.name for p in tmp_path.iterdir()] == ["records"]  # nothing else, no W&B folder without wandb=True
    # again: nothing to do, every record skipped
    assert CODE_ASKED == [(None, ())]  # no source: the current folder's repository, every tracked file
    filed = dataclasses.replace(TOY, source="some/where/sweep.py", code_paths=("lib", "sweep.py"))
    _quiet_run(filed, tmp_path)
    assert CODE_ASKED[-1] == (Path("some/where"), ("lib", "sweep.py"))
    again, said = _quiet_run(TOY, tmp_path, seeds=[1, 2], methods=["A"], settings=["rare"])
    assert said[0] == f"{prefix} 1 run(s) to do, 1 already recorded; in this process, one cell x seed at a time " \
                      "(1 torch thread(s))"
    assert again.written == [record_path(tmp_path, "drv", "v1", "rare", "A", 2)] and again.skipped == 1


def test_a_dirty_tree_and_a_runs_note_are_said_once(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "code_version", lambda repo=None, code_paths=(): {"commit": "abc",
                                                                                         "dirty": True})

    def noted(cell, seed):
        return {**_value_run(cell, seed), "note": "the data came from a cache"}

    _, said = _quiet_run(dataclasses.replace(TOY, run=noted), tmp_path, methods=["BB"])
    assert said[1] == "[drv v1] warning: uncommitted changes; records name commit abc with dirty=true"
    assert said[2] == "[drv v1] the data came from a cache" and said.count(said[2]) == 1
    assert len(said) == 2 + 1 + 2 + 1  # start, warning, note, two records, summary


def test_a_protocol_must_be_committed_before_the_runs(tmp_path):
    study = dataclasses.replace(TOY, require_protocol=True)
    with pytest.raises(FileNotFoundError) as error:
        run_study(study, root=tmp_path, progress=False, log=lambda text: None)
    assert str(error.value) == f"drv: commit the protocol {tmp_path / 'drv' / 'protocol-v1.md'} before its runs"
    (tmp_path / "drv").mkdir()
    (tmp_path / "drv" / "protocol-v1.md").write_text("# v1\n")
    assert len(run_study(study, root=tmp_path, progress=False, log=lambda text: None).written) == 6


class _Failing(Backend):
    """Fails every task of method ``BB`` after 3 attempts; the others succeed; records the started tasks."""

    name = "failing"

    def __init__(self):
        self.started: list[tuple] = []
        self.closed = False

    def execute(self, study, tasks, started=None):
        try:
            for task in tasks:
                started(task)
                self.started.append(task.seeds)
                if task.cell.method == "BB":
                    yield Outcome(task, error="Traceback ...\n  File x\nValueError: boom\n  \n", attempts=3)
                else:
                    yield Outcome(task, execute(study, task))
        finally:
            self.closed = True


def test_failures_are_recorded_said_and_replaced_by_a_later_success(tmp_path):
    backend = _Failing()
    report, said = _quiet_run(TOY, tmp_path, backend=backend, seeds=[4])
    path = failure_path(tmp_path, "drv", "v1", "More available", "BB", 4)
    assert said[2] == f"[drv v1] FAILED More available / BB / seed 4 after 3 attempt(s): ValueError: boom " \
                      f"(recorded in {path})"
    assert re.fullmatch(r"\[drv v1\] 2 new record\(s\), 1 failed, \d+\.\d s", said[-1]) and len(said) == 5
    assert report.failed == [path] and not report.ok and report.backend == "failing" and backend.closed
    assert json.loads(path.read_text()) == {
        "study": "drv", "protocol": "v1", "setting": "More available", "method": "BB", "seed": 4,
        "commit": "c0ffee1234", "dirty": False, "config": {"lr": 0.2}, "backend": "failing", "attempts": 3,
        "error": "Traceback ...\n  File x\nValueError: boom\n  \n"}
    assert load_failures(tmp_path, "drv") == [json.loads(path.read_text())]
    assert [r["method"] for r in load_records(tmp_path, "drv")] == ["A", "A"]
    # the next run tries only the failed one again; its success removes the failure record
    report, said = _quiet_run(TOY, tmp_path, seeds=[4])
    assert report.written == [record_path(tmp_path, "drv", "v1", "More available", "BB", 4)] and report.skipped == 2
    assert not path.exists() and load_failures(tmp_path, "drv") == []


def test_a_stopped_run_closes_its_backend_at_once(tmp_path):
    """Ctrl-C while a record is said: the backend's clean-up (Ray cancels its queue) runs before run_study returns
    control, not whenever the generator is collected (the traceback still holds it here)."""
    backend = _Failing()

    def stop(text):
        if "seed" in text and "run(s) to do" not in text:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as stopped:  # its traceback keeps run_study's frame, and the generator
        run_study(TOY, root=tmp_path, backend=backend, progress=False, log=stop, seeds=[0])
    assert backend.closed and backend.started == [(0,)] and stopped.traceback


class _NeverStarted(InProcess):
    """Yields each outcome without saying it started (a backend may: the bar then counts nothing running)."""

    def execute(self, study, tasks, started=None):
        yield from super().execute(study, tasks, None)


def test_the_wall_time_is_rounded_to_hundredths_and_a_task_need_not_say_it_started(tmp_path, monkeypatch):
    assert len(run_study(TOY, root=tmp_path, backend=_NeverStarted(), progress=False, log=lambda text: None)
               .written) == 6
    clock = iter([100.0, 103.456])
    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    report, said = _quiet_run(TOY, tmp_path)
    assert report.wall_s == 3.46 and said[-1] == "[drv v1] 0 new record(s), 0 failed, 3.5 s"


def test_the_progress_bar_counts_runs_and_replaces_the_per_record_lines(tmp_path, capsys):
    said: list[str] = []
    stackable = dataclasses.replace(TOY, run_seeds=_value_run_seeds)
    run_study(stackable, root=tmp_path, progress=True, log=said.append)
    assert len(said) == 2  # the plan and the summary: the bar shows the records
    bar = capsys.readouterr().err
    # a cell's 2 seeds run stacked: "running 2" while one runs, "running 0" at the end
    assert "drv: 100%" in bar and "| 6/6 [" in bar and "run/s" in bar and "running 2]" in bar
    assert bar.rstrip().endswith("running 0]") and "running 1]" not in bar
    said.clear()
    run_study(TOY, root=tmp_path, progress=True, log=said.append)
    assert capsys.readouterr().err == "" and len(said) == 2  # nothing to do: no bar at all
    assert said[0].startswith("[drv v1] 0 run(s) to do, 6 already recorded; ")


def test_the_default_log_writes_to_stderr(tmp_path, capsys):
    run_study(TOY, root=tmp_path, progress=False, seeds=[0], methods=["BB"])
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("[drv v1] 1 run(s) to do, 0 already recorded; ")
    assert err[1] == "[drv v1] More available / BB / seed 0: 0.0 s (1/1)" and len(err) == 3


def test_auto_stacks_a_cells_seeds_and_records_how_many_shared_a_run(tmp_path):
    study = dataclasses.replace(TOY, run_seeds=_value_run_seeds, seeds=(0, 1, 2))
    report, said = _quiet_run(study, tmp_path)
    assert report.backend == "stacked"
    assert said[0].endswith("in this process, all missing seeds of a cell stacked in one run (1 torch thread(s))")
    records = load_records(tmp_path, "drv")
    assert len(records) == 9 and {r["seeds_in_run"] for r in records} == {3}
    assert [r["metrics"]["v"] for r in records[:3]] == [1, 11, 21]


# ----------------------------------------------------------------------------------------------- the backends
def test_a_task_is_one_seed_or_several_stacked():
    cell = CELLS[0]
    assert Task(cell, (1,)).stacked is False and Task(cell, (1, 2), stacked=True).seeds == (1, 2)
    Task(cell, (1,), stacked=True)
    for seeds, stacked in (((), False), ((), True), ((1, 2), False)):
        with pytest.raises(ValueError) as error:
            Task(cell, seeds, stacked)
        assert str(error.value) == f"a task runs one seed, or several stacked; got seeds={seeds}, stacked={stacked}"
    assert Outcome(Task(cell, (1,))).attempts == 1 and Outcome(Task(cell, (1,))).error is None


def test_execute_sets_the_studys_threads_and_shares_the_time_among_stacked_seeds(monkeypatch):
    seen = []

    def run_seeds(cell, seeds):
        seen.append(torch.get_num_threads())
        return [{"metrics": {"v": s}, "engine": "e", "device": "cuda" if s == 2 else None} for s in seeds]

    study = dataclasses.replace(TOY, run_seeds=run_seeds, threads=2)
    clock = iter([100.0, 103.708])  # 3.708 s over 3 seeds: 1.236 s each, 1.24 in hundredths
    monkeypatch.setattr(backends_module.time, "perf_counter", lambda: next(clock))
    cpu = iter([10.0, 11.0])  # 1 s over 3: 0.333... s each, 0.33
    monkeypatch.setattr(backends_module.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(backends_module, "machine", lambda: {"device": "cpu (x)", "cpu": "c", "threads": 2})
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = execute(study, Task(CELLS[0], (1, 2, 3), stacked=True))
        assert seen == [2] and torch.get_num_threads() == 1  # restored
    finally:
        torch.set_num_threads(previous)
    base = {"engine": "e", "cpu": "c", "threads": 2, "wall_s": 1.24, "cpu_s": 0.33, "seeds_in_run": 3}
    assert out == [{**base, "metrics": {"v": 1}, "device": "cpu (x)"}, {**base, "metrics": {"v": 2}, "device": "cuda"},
                   {**base, "metrics": {"v": 3}, "device": "cpu (x)"}]


def test_a_resumed_result_adds_the_earlier_processes_seconds_and_its_record_says_where_it_resumed(monkeypatch):
    # this process: 2.5 s wall, 2.0 s CPU for 2 stacked seeds (1.25 / 1.0 each); the earlier processes' share per
    # seed, as run_seeds reports it: 100.004 s wall, 60.111 s CPU -> 101.25 (101.254) and 61.11 (61.111)
    earlier = {"from_rounds": [400, 1300], "wall_s": 100.004, "cpu_s": 60.111}

    def run_seeds(cell, seeds):
        return [{"metrics": {"v": s}, "engine": "e", **({"resumed": earlier} if s == 1 else {})} for s in seeds]

    study = dataclasses.replace(TOY, run_seeds=run_seeds)
    clock, cpu = iter([10.0, 12.5]), iter([5.0, 7.0])
    monkeypatch.setattr(backends_module.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(backends_module.time, "process_time", lambda: next(cpu))
    monkeypatch.setattr(backends_module, "machine", lambda: {"device": "cpu (x)", "cpu": "c", "threads": 1,
                                                             "torch": "t", "python": "p"})
    resumed, fresh = execute(study, Task(CELLS[0], (1, 2), stacked=True))
    assert (resumed["wall_s"], resumed["cpu_s"]) == (101.25, 61.11)
    assert (fresh["wall_s"], fresh["cpu_s"]) == (1.25, 1.0)
    record = make_record(TOY, CELLS[0], 1, resumed, CODE)
    assert record["resumed"] == earlier and "resumed" not in make_record(TOY, CELLS[0], 2, fresh, CODE)
    # scheduling, not a result: a resumed record compares equal to an uninterrupted one
    assert result_of(record) == result_of({**make_record(TOY, CELLS[0], 1, fresh, CODE), "metrics": {"v": 1}})


def test_execute_refuses_a_wrong_number_or_shape_of_results(monkeypatch):
    monkeypatch.setattr(backends_module, "machine", lambda: {"device": "cpu"})
    short = dataclasses.replace(TOY, run_seeds=lambda cell, seeds: [{"metrics": {}, "engine": "e"}])
    with pytest.raises(RuntimeError) as error:
        execute(short, Task(CELLS[0], (1, 2), stacked=True))
    assert str(error.value) == "drv More available / A: 1 results for seeds [1, 2]"
    for result, shown in (({"metrics": {}}, "['metrics']"), ({"engine": "e"}, "['engine']"), ([2, 1], "[2, 1]"),
                          ({"engine": "e", "metrics": {}, "a": 1}, None)):
        study = dataclasses.replace(TOY, run=lambda cell, seed, result=result: result)
        if shown is None:
            assert execute(study, Task(CELLS[0], (1,)))[0]["a"] == 1
            continue
        with pytest.raises(TypeError) as error:
            execute(study, Task(CELLS[0], (1,)))
        assert str(error.value) == f"drv More available / A: a run must return a dict with 'metrics' and 'engine', " \
                                   f"got {shown}"


def test_plans_and_descriptions_by_hand(monkeypatch):
    missing = [(CELLS[0], [0, 1, 2, 3, 4]), (CELLS[1], [7])]
    stackable = dataclasses.replace(TOY, run_seeds=_value_run_seeds, threads=2)
    one_by_one = [Task(CELLS[0], (s,)) for s in range(5)] + [Task(CELLS[1], (7,))]
    assert InProcess().plan(stackable, missing) == one_by_one
    assert Stacked().plan(TOY, missing) == one_by_one  # no run_seeds
    assert Stacked().plan(stackable, missing) == [Task(CELLS[0], (0, 1, 2, 3, 4), True), Task(CELLS[1], (7,), True)]
    assert Stacked(2).plan(stackable, missing) == [Task(CELLS[0], (0, 1), True), Task(CELLS[0], (2, 3), True),
                                                   Task(CELLS[0], (4,), True), Task(CELLS[1], (7,), True)]
    assert backends_module.stacked_tasks([(CELLS[0], [])], None) == []
    assert Ray(seeds_per_task=3).plan(stackable, missing) == [Task(CELLS[0], (0, 1, 2), True),
                                                              Task(CELLS[0], (3, 4), True), Task(CELLS[1], (7,), True)]
    assert Ray(seeds_per_task=3).plan(TOY, missing) == one_by_one and Ray().plan(stackable, missing) == one_by_one
    assert Ray(seeds_per_task=2).plan(stackable, missing)[0] == Task(CELLS[0], (0, 1), True)
    assert InProcess().describe(stackable) == "in this process, one cell x seed at a time (2 torch thread(s))"
    assert Stacked().describe(TOY) == "in this process, one seed at a time (drv has no run_seeds to stack them)"
    assert Stacked(4).describe(stackable) == "in this process, up to 4 seeds of a cell stacked in one run " \
                                             "(2 torch thread(s))"
    assert Backend().describe(TOY) == "backend" and Backend().plan(TOY, missing) == one_by_one
    monkeypatch.setattr(backends_module.os, "cpu_count", lambda: 7)
    assert Ray().describe(stackable) == "on a local Ray cluster of 3 worker(s) x 2 thread(s), each cell x seed a " \
                                        "task, retried 1 time(s) before it is recorded as failed"
    assert Ray(workers=5, seeds_per_task=2, retries=0).describe(stackable) == (
        "on a local Ray cluster of 5 worker(s) x 2 thread(s), up to 2 stacked seeds of a cell a task, retried 0 "
        "time(s) before it is recorded as failed")
    assert Ray(address="ray://h:1", seeds_per_task=2).describe(TOY) == (
        "on the Ray cluster at ray://h:1, each cell x seed a task, retried 1 time(s) before it is recorded as failed")
    monkeypatch.setattr(backends_module.os, "cpu_count", lambda: None)
    assert Ray()._workers(stackable) == 1 and Ray()._workers(TOY) == 1  # an unknown count: one CPU
    with pytest.raises(NotImplementedError):
        next(iter(Backend().execute(TOY, [])))


def test_backend_arguments_are_checked():
    for make, message in ((lambda: Stacked(0), "max_seeds must be >= 1 or None, got 0"),
                          (lambda: Ray(workers=0), "workers must be >= 1, got 0"),
                          (lambda: Ray(seeds_per_task=0), "seeds_per_task must be >= 1, got 0"),
                          (lambda: Ray(retries=-1), "retries must be >= 0, got -1")):
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == message
    assert Stacked(1).max_seeds == 1 and Stacked("3").max_seeds == 3 and Stacked().max_seeds is None
    ray = Ray(address="auto", workers=1, seeds_per_task="2", retries="0", init_kwargs={"x": 1})
    assert (ray.address, ray.workers, ray.seeds_per_task, ray.retries, ray.init_kwargs) == ("auto", 1, 2, 0, {"x": 1})
    assert Ray().init_kwargs == {} and Ray().retries == 1 and Ray().seeds_per_task == 1 and Ray().address is None


def test_resolve_backend_by_name():
    stackable = dataclasses.replace(TOY, run_seeds=_value_run_seeds)
    resolve = backends_module.resolve_backend
    assert type(resolve("auto", TOY)) is InProcess and type(resolve("auto", stackable)) is Stacked
    assert type(resolve("in-process", stackable)) is InProcess and type(resolve("inprocess", TOY)) is InProcess
    assert type(resolve("stacked", TOY)) is Stacked and type(resolve("ray", TOY)) is Ray
    mine = Stacked(2)
    assert resolve(mine, TOY) is mine
    with pytest.raises(ValueError) as error:
        resolve("dask", TOY)
    assert str(error.value) == "backend must be 'auto', one of ['in-process', 'inprocess', 'ray', 'stacked'] or a " \
                               "Backend, got 'dask'"


def test_rays_error_text_and_its_import(monkeypatch):
    assert backends_module._ray_error(RuntimeError("\x1b[31mTraceback\x1b[0m\nValueError: x\n  ")) == \
        "Traceback\nValueError: x"
    assert backends_module._ray_error(RuntimeError("")) == "RuntimeError: RuntimeError('')"
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError) as error:
        backends_module.import_ray()
    assert str(error.value) == "the Ray backend needs Ray: pip install 'lightning-fedhet[ray]'"


def test_a_ray_worker_loads_the_study_once_by_its_source(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(backends_module, "execute", lambda study, task: calls.append((study, task)) or ["r"])
    loaded = []
    monkeypatch.setattr(study_module, "load_study", lambda spec: loaded.append(spec) or TOY)
    monkeypatch.setattr(backends_module, "_LOADED", {})
    task = Task(CELLS[0], (1,))
    assert backends_module._ray_task("x.py", task) == ["r"] and backends_module._ray_task("x.py", task) == ["r"]
    assert loaded == ["x.py"] and calls == [(TOY, task), (TOY, task)]
    other = dataclasses.replace(TOY, name="other")
    assert backends_module._ray_task(other, task) == ["r"] and calls[-1] == (other, task) and loaded == ["x.py"]


class _FakeRef:
    def __init__(self, value, error=None):
        self.value, self.error = value, error


class _FakeRay:
    """Just enough of Ray for ``Ray.execute`` in this process: each task runs when it is waited on."""

    def __init__(self, initialized=False, cpus=4, fail=(), events=None):
        self.initialized, self.cpus, self.fail = initialized, cpus, set(fail)
        self.log: list = []
        self.events = [] if events is None else events

    def is_initialized(self):
        return self.initialized

    def init(self, address=None, **kwargs):
        self.log.append(("init", address, kwargs))
        warnings.warn("Ray's notice about accelerator variables", FutureWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)

    def put(self, value):
        self.log.append(("put", value))
        if value == "broken.py":
            raise RuntimeError("the object store is full")
        return ("payload", value)

    def remote(self, fn):
        assert fn is backends_module._ray_task
        fake = self

        class Options:
            def options(self, **kwargs):
                fake.log.append(("options", kwargs))
                return self

            def remote(self, payload, task):
                assert payload[0] == "payload"  # what put gave
                if task.seeds[0] in fake.fail:
                    return _FakeRef(None, RuntimeError(f"\x1b[1mValueError: seed {task.seeds[0]}\x1b[0m"))
                return _FakeRef([{"seed": s} for s in task.seeds])

        return Options()

    def cluster_resources(self):
        return {} if self.cpus is None else {"CPU": self.cpus}

    def wait(self, refs, num_returns):
        assert num_returns == 1
        self.events.append(f"done {refs[0].value[0]['seed'] if refs[0].value else 'error'}")
        return refs[:1], refs[1:]

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def cancel(self, ref, force):
        self.log.append(("cancel", ref.value[0]["seed"], force))

    def shutdown(self):
        self.log.append(("shutdown",))


def test_ray_execute_starts_what_fits_retries_and_records_failures(monkeypatch):
    fake = _FakeRay(cpus=4, fail={2})
    monkeypatch.setattr(backends_module, "import_ray", lambda: fake)
    study = dataclasses.replace(TOY, threads=2, source="x.py")
    tasks = [Task(CELLS[0], (s,)) for s in range(4)]
    started = []
    with pytest.warns(UserWarning, match="another warning"):  # Ray's FutureWarning alone is silenced
        outcomes = list(Ray(workers=3, retries=2, init_kwargs={"extra": 1}).execute(
            study, tasks, lambda task: started.append(task) or fake.events.append(f"start {task.seeds[0]}")))
    # 4 CPUs / 2 threads: 2 start at once, each finished task starts the next
    assert [t.seeds for t in started] == [(0,), (1,), (2,), (3,)]
    assert fake.events == ["start 0", "start 1", "done 0", "start 2", "done 1", "start 3", "done error", "done 3"]
    assert [o.results for o in outcomes] == [[{"seed": 0}], [{"seed": 1}], None, [{"seed": 3}]]
    assert outcomes[2].error == "ValueError: seed 2" and outcomes[2].attempts == 3
    assert [o.attempts for o in outcomes] == [1, 1, 3, 1] and [o.task for o in outcomes] == tasks
    assert fake.log == [
        ("init", None, {"include_dashboard": False, "log_to_driver": False, "num_cpus": 6,
                        "object_store_memory": 256 * 2**20, "extra": 1}),
        ("put", "x.py"), ("options", {"num_cpus": 2, "max_retries": 2, "retry_exceptions": True}), ("shutdown",)]


@pytest.mark.filterwarnings("ignore:another warning")
def test_ray_execute_joins_a_cluster_and_cancels_what_is_left_when_stopped(monkeypatch):
    fake = _FakeRay(cpus=1)
    monkeypatch.setattr(backends_module, "import_ray", lambda: fake)
    tasks = [Task(CELLS[0], (s,)) for s in range(3)]
    run = Ray(address="ray://h:1").execute(TOY, tasks)  # started None: nothing to call
    assert next(run).results == [{"seed": 0}]
    run.close()
    assert fake.log[0] == ("init", "ray://h:1", {"include_dashboard": False, "log_to_driver": False})
    assert fake.log[1] == ("put", TOY)  # no source: the study object itself
    assert fake.log[3:] == [("cancel", 1, True), ("cancel", 2, True), ("shutdown",)]
    # a cluster this process joined before (neither init nor shutdown) that reports no CPUs: one task at a time
    already = _FakeRay(initialized=True, cpus=None)
    monkeypatch.setattr(backends_module, "import_ray", lambda: already)
    assert len(list(Ray().execute(TOY, tasks, lambda task: already.events.append(f"start {task.seeds[0]}")))) == 3
    assert already.events == ["start 0", "done 0", "start 1", "done 1", "start 2", "done 2"]
    assert [entry[0] for entry in already.log] == ["put", "options"]
    # its own local cluster of os.cpu_count() // threads workers; a failure before any task still shuts it down
    broken = _FakeRay()
    monkeypatch.setattr(backends_module, "import_ray", lambda: broken)
    monkeypatch.setattr(backends_module.os, "cpu_count", lambda: 9)
    with pytest.raises(RuntimeError, match="^the object store is full$"):
        list(Ray().execute(dataclasses.replace(TOY, threads=2, source="broken.py"), tasks))
    assert broken.log[0][2]["num_cpus"] == 8 and broken.log[-1] == ("shutdown",)


# -------------------------------------------------------------------------------------------------- the study
def test_cells_and_studies_check_their_declaration():
    for setting, method in (("??", "m"), ("s", "??")):
        with pytest.raises(ValueError, match=r"^cannot make a file name from '\?\?'$"):
            Cell(setting, method)
    with pytest.raises(TypeError) as error:
        Cell("s", "m", {"f": object})
    assert str(error.value).startswith("cell s/m: config must be JSON-able (Object of type type is not JSON")
    assert Cell("s", "m").config == {} and Cell("More", "A b").name == "More / A b"

    def study(**kwargs):
        return Study(**{"name": "drv", "cells": CELLS, "seeds": (0, 1), "run": _value_run, **kwargs})

    for kwargs, message in (({"cells": ()}, "study drv: no cells"),
                            ({"cells": (Cell("a b", "m"), Cell("A-B", "M"))},
                             "study drv: duplicate (setting, method) cells"),
                            ({"seeds": (1, 2, 1.0)}, "study drv: seeds must be distinct, got [1, 2, 1]"),
                            ({"threads": 0}, "study drv: threads must be >= 1, got 0")):
        with pytest.raises(ValueError) as error:
            study(**kwargs)
        assert str(error.value) == message
    for kwargs in ({"name": "!"}, {"protocol": "?"}):
        with pytest.raises(ValueError, match="cannot make a file name"):
            study(**kwargs)
    made = study(cells=list(CELLS), seeds=[2.0, 1], code_paths=["a"], title="")
    assert made.cells == CELLS and made.seeds == (2, 1) and made.code_paths == ("a",) and made.title == "drv"
    assert study(title="T").title == "T" and made.protocol_file == "drv/protocol-v1.md"
    assert made.settings == ["More available", "rare"] and made.methods == ["A", "BB"]


def test_select_cells_by_method_and_setting():
    assert TOY.select() == list(CELLS) and TOY.select(["A"]) == [CELLS[0], CELLS[2]]
    assert TOY.select(settings=["rare"]) == [CELLS[2]] and TOY.select(["BB"], ["rare"]) == []
    assert TOY.select([], []) == []
    with pytest.raises(ValueError) as error:
        TOY.select(["Z", "A", "Y"])
    assert str(error.value) == "study drv has no method ['Y', 'Z']; methods: ['A', 'BB']"
    with pytest.raises(ValueError) as error:
        TOY.select(settings=["x"])
    assert str(error.value) == "study drv has no setting ['x']; settings: ['More available', 'rare']"


def test_a_summary_verdict_must_start_with_a_label():
    study_module.Summary("c", "p", "o", "reproduced (3 seeds)")
    study_module.Summary("c", "p", "o", "not reproduced (at 95 %)")  # a label of two words, then its note
    study_module.Summary("c", "p", "o", "lr at grid edge")
    with pytest.raises(ValueError):
        study_module.Summary("c", "p", "o", "reproduced mostly")  # a label, then no " (": not a label
    with pytest.raises(ValueError, match=r"^verdict must start with one of .*, got 'fine'$"):
        study_module.Summary("c", "p", "o", "fine")


def test_the_default_report_is_bound_to_its_study(monkeypatch):
    class Bound:
        def bind(self, study):
            self.study = study
            return self

    monkeypatch.setattr(study_module, "_DEFAULT_REPORT", [])
    assert Study(name="drv", cells=CELLS, seeds=(0,), run=_value_run).report is None
    study_module.set_default_report(Bound)
    made = Study(name="drv", cells=CELLS, seeds=(0,), run=_value_run)
    assert isinstance(made.report, Bound) and made.report.study.name == "drv"
    study_module.set_default_report(Bound)
    assert len(study_module._DEFAULT_REPORT) == 1
    own = Bound()
    assert Study(name="x", cells=CELLS, seeds=(0,), run=_value_run, report=own).report.study.name == "x"


def test_resolve_root_by_hand():
    assert resolve_root(TOY) == Path("results") and resolve_root(TOY, "here") == Path("here")
    placed = dataclasses.replace(TOY, root="there")
    assert resolve_root(placed) == Path("there") and resolve_root(placed, Path("here")) == Path("here")


STUDY_FILE = """
from lightning_fedhet.experiments import Cell, Study
STUDY = Study(name="filed", cells=(Cell("s", "m"),), seeds=(0,), run=lambda cell, seed: {{}})
OTHER = Study(name="other", cells=(Cell("s", "m"),), seeds=(0,), run=lambda cell, seed: {{}})
NOT_A_STUDY = 3
{extra}
"""


def test_load_study_from_a_file_by_attribute(tmp_path, monkeypatch):
    path = tmp_path / "loose_sweep.py"
    path.write_text(STUDY_FILE.format(extra="import helper_beside\nHELPER = helper_beside.VALUE"))
    (tmp_path / "helper_beside.py").write_text("VALUE = 5\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    study = load_study(str(path))
    assert study.name == "filed" and study.source == str(path)
    assert tmp_path.as_posix() == sys.path[0]  # the file's folder goes first, as `python FILE` does
    module = sys.modules["_fedhet_study_loose_sweep"]
    assert module.HELPER == 5
    assert load_study(str(path)).name == "filed" and sys.modules["_fedhet_study_loose_sweep"] is module  # once
    dotted = tmp_path / "dotted.v2.py"
    dotted.write_text(STUDY_FILE.format(extra=""))
    assert load_study(str(dotted)).source == str(dotted) and "_fedhet_study_dotted_v2" in sys.modules
    (tmp_path / "twin").mkdir()  # another file of the same name: its own study, not the module loaded before
    twin = tmp_path / "twin" / "loose_sweep.py"
    twin.write_text(STUDY_FILE.format(extra="").replace('name="filed"', 'name="twin"'))
    assert load_study(str(twin)).name == "twin" and sys.modules["_fedhet_study_loose_sweep"].__file__ == str(twin)
    other = load_study(f"{path}:OTHER")
    assert other.name == "other" and other.source == f"{path}:OTHER"
    assert load_study(str(path), attribute="OTHER").source == f"{path}:OTHER"
    with pytest.raises(TypeError) as error:
        load_study(f"{path}:NOT_A_STUDY")
    assert str(error.value) == f"{path}:NOT_A_STUDY: NOT_A_STUDY must be a lightning_fedhet.experiments.Study, got int"
    with pytest.raises(FileNotFoundError) as error:
        load_study(str(tmp_path / "nowhere.py"))
    assert str(error.value) == f"no study file {tmp_path / 'nowhere.py'}"


def test_a_study_file_that_fails_to_import_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = tmp_path / "broken_sweep.py"
    path.write_text("raise RuntimeError('broken')\n")
    with pytest.raises(RuntimeError, match="broken"):
        load_study(str(path))
    assert "_fedhet_study_broken_sweep" not in sys.modules


def test_load_study_from_a_package_file_and_a_module(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    package = tmp_path / "drvpkg_x" / "inner"
    package.mkdir(parents=True)
    (tmp_path / "drvpkg_x" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "sweep.py").write_text(STUDY_FILE.format(extra="from . import sibling\nHELPER = sibling.VALUE"))
    (package / "sibling.py").write_text("VALUE = 6\n")
    study = load_study(str(package / "sweep.py"))
    assert study.source == str(package / "sweep.py") and sys.modules["drvpkg_x.inner.sweep"].HELPER == 6
    assert sys.path[0] == str(tmp_path)  # the folder above the outermost package, first
    by_module = load_study("drvpkg_x.inner.sweep:OTHER")
    assert by_module.name == "other" and by_module.source == "drvpkg_x.inner.sweep:OTHER"
    assert load_study("drvpkg_x.inner.sweep").source == "drvpkg_x.inner.sweep"
    with pytest.raises(TypeError) as error:
        load_study(f"{package / 'sweep.py'}:NOT_A_STUDY")
    assert str(error.value) == f"{package / 'sweep.py'}:NOT_A_STUDY: NOT_A_STUDY must be a " \
                               "lightning_fedhet.experiments.Study, got int"
    for module in [m for m in sys.modules if m.startswith("drvpkg_x")]:
        monkeypatch.delitem(sys.modules, module)


def test_a_package_file_shadowed_by_another_package_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    first, second = tmp_path / "a", tmp_path / "b"
    for root in (first, second):
        (root / "drvshadow").mkdir(parents=True)
        (root / "drvshadow" / "__init__.py").write_text("")
        (root / "drvshadow" / "sweep.py").write_text(STUDY_FILE.format(extra=""))
    sys.path.insert(0, str(first))
    sys.path.append(str(second))  # on the path, but after the other package of the same name
    with pytest.raises(ImportError) as error:
        load_study(str(second / "drvshadow" / "sweep.py"))
    assert str(error.value) == (f"{second / 'drvshadow' / 'sweep.py'}: importing drvshadow.sweep found "
                                f"{first / 'drvshadow' / 'sweep.py'} instead (another package of that name comes "
                                f"first on sys.path)")
    for module in [m for m in sys.modules if m.startswith("drvshadow")]:
        monkeypatch.delitem(sys.modules, module)


def test_windows_drives_and_package_names(tmp_path):
    assert study_module._is_windows_drive("C:\\x.py") and study_module._is_windows_drive("C:/x.py")
    assert not study_module._is_windows_drive("C:x") and not study_module._is_windows_drive("a.py:NAME")
    assert not study_module._is_windows_drive("C:") and study_module._is_windows_drive("C:/")
    assert not study_module._is_windows_drive("ab/x.py") and not study_module._is_windows_drive("C:Xy")
    (tmp_path / "not-an-identifier").mkdir()
    (tmp_path / "not-an-identifier" / "__init__.py").write_text("")
    assert study_module._import_from_package(tmp_path / "not-an-identifier" / "sweep.py") is None
    assert study_module._import_from_package(tmp_path / "loose.py") is None




# ------------------------------------------------------------------------------------------------- the canary
def test_run_canary_records_its_one_run_under_the_protocol_canary(monkeypatch):
    with pytest.raises(ValueError) as error:
        runner_module.run_canary(TOY)
    assert str(error.value) == "drv declares no canary cell"
    monkeypatch.setattr(backends_module, "machine", lambda: {"device": "cpu (x)", "cpu": "Fake", "torch": "t",
                                                             "python": "p", "threads": 2})
    study = dataclasses.replace(TOY, canary=Cell("rare", "BB", {"rounds": 2}), canary_seed=7, threads=2)
    record = runner_module.run_canary(study)
    assert {k: v for k, v in record.items() if k not in ("wall_s", "cpu_s")} == {
        "study": "drv", "protocol": "canary", "setting": "rare", "method": "BB", "seed": 7, "commit": "c0ffee1234",
        "dirty": False, "config": {"rounds": 2}, "engine": "none", "metrics": {"v": 72}, "device": "cpu (x)",
        "cpu": "Fake", "torch": "t", "python": "p", "threads": 2}
    assert "seeds_in_run" not in record and study.protocol == "v1"
    assert CODE_ASKED == [(None, ())]
    runner_module.run_canary(dataclasses.replace(study, source="some/where/sweep.py", code_paths=("lib",)))
    assert CODE_ASKED[-1] == (Path("some/where"), ("lib",))


def test_write_canary_replaces_the_reference_or_writes_beside_it(tmp_path, monkeypatch):
    """``this_processor``: the reference when there is none or it was made on this processor, else a record of
    this processor's own beside it; by default the reference, and every processor's own record goes."""
    made = {"cpu": "Here"}
    monkeypatch.setattr(runner_module, "run_canary", lambda study: dict(made))
    study = dataclasses.replace(TOY, root=tmp_path)
    reference, here, there = (runner_module.canary_path(tmp_path, "drv", cpu) for cpu in (None, "Here", "There"))
    assert runner_module.write_canary(study, this_processor=True) == made
    assert json.loads(reference.read_text()) == made and not here.exists()
    made["n"] = 2  # made on the reference's processor again: the reference is rewritten
    runner_module.write_canary(study, this_processor=True)
    assert json.loads(reference.read_text()) == {"cpu": "Here", "n": 2} and not here.exists()
    made.update(cpu="There", n=3)  # another processor: its own record, the reference kept
    runner_module.write_canary(study, this_processor=True)
    assert json.loads(reference.read_text()) == {"cpu": "Here", "n": 2}
    assert json.loads(there.read_text()) == {"cpu": "There", "n": 3}
    made["n"] = 4
    runner_module.write_canary(study, root=tmp_path)
    assert json.loads(reference.read_text()) == {"cpu": "There", "n": 4} and not there.exists()
    assert sorted(p.name for p in reference.parent.iterdir()) == ["canary.json"]


def test_the_canary_of_a_processor_is_the_reference_or_its_own_record(tmp_path):
    reference = runner_module.canary_path(tmp_path, "drv")
    assert reference == tmp_path / "records" / "drv" / "canary.json"
    assert runner_module.canary_path(str(tmp_path), "drv", "Fake CPU @ 2GHz; AVX2") == \
        tmp_path / "records" / "drv" / "canary.fake-cpu-2ghz-avx2.json"
    assert runner_module._canary_for(tmp_path, "drv", "Fake") is None
    records_module.write_record(reference, {"cpu": "Ref"})
    assert runner_module._canary_for(tmp_path, "drv", "Ref") == {"cpu": "Ref"}
    assert runner_module._canary_for(tmp_path, "drv", "Fake") is None
    own = runner_module.canary_path(tmp_path, "drv", "Fake")
    records_module.write_record(own, {"cpu": "Fake", "mine": True})
    assert runner_module._canary_for(tmp_path, "drv", "Fake") == {"cpu": "Fake", "mine": True}
    assert runner_module._canary_for(tmp_path, "drv", "Ref") == {"cpu": "Ref"}


def test_a_windows_drive_is_part_of_the_file_name_not_an_attribute(tmp_path, monkeypatch):
    """``C:/sweep.py`` is a file (here a folder ``C:`` under the current one), not ``C`` with attribute
    ``/sweep.py``."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "C:").mkdir()
    (tmp_path / "C:" / "drive_sweep.py").write_text(STUDY_FILE.format(extra=""))
    study = load_study("C:/drive_sweep.py")
    assert study.name == "filed" and study.source == str(tmp_path / "C:" / "drive_sweep.py")
    with pytest.raises(FileNotFoundError) as error:
        load_study("C:\\nowhere.py")
    assert str(error.value) == "no study file C:\\nowhere.py"


def test_progress_none_shows_the_bar_when_stderr_is_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    said: list[str] = []
    run_study(TOY, root=tmp_path, log=said.append, seeds=[0], methods=["BB"])
    assert "drv: 100%" in capsys.readouterr().err and len(said) == 2  # the bar, and no per-record line
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    run_study(TOY, root=tmp_path, log=said.append, seeds=[1], methods=["BB"])
    assert capsys.readouterr().err == "" and said[3] == "[drv v1] More available / BB / seed 1: 0.0 s (1/1)"


def test_wandb_logs_each_new_record_once_and_closes(tmp_path, monkeypatch):
    """``wandb=True``: one sink for the run (the study, its project, the results folder), each record written
    logged as its file reads, no failure logged, and the sink closed; nothing to do: no sink at all."""
    from lightning_fedhet.experiments import wandb_log

    sinks = []

    class Sink:
        def __init__(self, study, project=None, dir=None):  # noqa: A002 - WandbSink's own keyword
            self.made, self.logged, self.closed = (study.name, project, dir), [], False
            sinks.append(self)

        def log_record(self, record):
            self.logged.append((record["method"], record["seed"], record["metrics"]["v"]))

        def close(self):
            self.closed = True

    monkeypatch.setattr(wandb_log, "WandbSink", Sink)
    _quiet_run(TOY, tmp_path, backend=_Failing(), seeds=[1], settings=["More available"], wandb=True,
               wandb_project="proj")
    (sink,) = sinks
    assert sink.made == ("drv", "proj", tmp_path) and sink.closed and sink.logged == [("A", 1, 11)]  # BB failed
    _quiet_run(TOY, tmp_path, seeds=[1], settings=["More available"], wandb=True, wandb_project="proj")
    assert len(sinks) == 2 and sinks[1].logged == [("BB", 1, 12)]
    _quiet_run(TOY, tmp_path, seeds=[1], settings=["More available"], wandb=True)
    assert len(sinks) == 2  # nothing left to run
