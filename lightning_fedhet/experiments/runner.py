"""The driver: run a study's missing records on a backend, with a progress bar, and the canary re-run.

Resume is the rule, not an option: a (cell, seed) whose record exists is never run again, and a record is written
in one rename (:func:`~lightning_fedhet.experiments.records.write_record`), so a run stopped at any point (a kill,
Ctrl-C, a crash after ``k`` runs) is continued by running the same command again, which runs only what is missing.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_fedhet.experiments.backends import Backend, Outcome, Task, execute, resolve_backend
from lightning_fedhet.experiments.records import (
    Record,
    code_version,
    dumps,
    failure_path,
    first_difference,
    record_path,
    slug,
    write_record,
)
from lightning_fedhet.experiments.study import Cell, Study, resolve_root

Log = Callable[[str], None]


@dataclasses.dataclass
class RunReport:
    """What :func:`run_study` did: records written, seeds that already had one, and the failures it recorded."""

    written: list[Path] = dataclasses.field(default_factory=list)
    skipped: int = 0
    failed: list[Path] = dataclasses.field(default_factory=list)
    backend: str = ""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


def missing_runs(study: Study, root: Path, seeds: Sequence[int], cells: Sequence[Cell]) -> list[tuple[Cell, list]]:
    """Per cell, the seeds of ``seeds`` without a record under ``root`` (cells with none left are dropped)."""
    out = []
    for cell in cells:
        todo = [int(s) for s in seeds
                if not record_path(root, study.name, study.protocol, cell.setting, cell.method, s).exists()]
        if todo:
            out.append((cell, todo))
    return out


def _repo(study: Study) -> Path | None:
    """Where the study's code lives, for its commit: the folder of its file, else the current folder."""
    if study.source and study.source.split(":")[0].endswith(".py"):
        return Path(study.source.split(":")[0]).parent
    return None


def make_record(study: Study, cell: Cell, seed: int, result: dict, code: dict) -> Record:
    """The record of one run from its result (as :func:`~lightning_fedhet.experiments.backends.execute` returns
    it) and the code version the driver ran."""
    record = {
        "study": study.name, "protocol": study.protocol, "setting": cell.setting, "method": cell.method,
        "seed": int(seed), **code, "config": {**cell.config, **result.get("config", {})},
        "engine": result["engine"], "metrics": result["metrics"],
        **{k: result[k] for k in ("device", "cpu", "torch", "python", "threads", "wall_s", "cpu_s",
                                  "seeds_in_run")},
    }
    if result.get("data_checksum"):
        record["data_checksum"] = result["data_checksum"]
    if result.get("resumed"):  # the run continued from a checkpoint: where, and the earlier processes' seconds
        record["resumed"] = result["resumed"]
    return record


def run_study(
    study: Study,
    *,
    seeds: Sequence[int] | None = None,
    methods: Sequence[str] | None = None,
    settings: Sequence[str] | None = None,
    root: str | Path | None = None,
    backend: str | Backend = "auto",
    progress: bool | None = None,
    wandb: bool = False,
    wandb_project: str | None = None,
    log: Log | None = None,
) -> RunReport:
    """Run every missing (cell, seed) of ``study`` on ``backend`` and write one record each under ``root``.

    Args:
        seeds: the seeds to have (default: the study's).
        methods, settings: only these cells (default: all).
        root: the results folder (default: the study's ``root``, else ``./results``).
        backend: ``"auto"`` (stacked seeds where the study has ``run_seeds``, else one at a time),
            ``"in-process"``, ``"stacked"``, ``"ray"`` or a :class:`~lightning_fedhet.experiments.backends.Backend`.
        progress: a progress bar over the runs (done, running, ETA); ``None``: when stderr is a terminal. Without
            it, one line per record.
        wandb: also log each record as a W&B run (grouped per study and cell; ``WANDB_MODE=offline`` works).
        wandb_project: the W&B project (default: the study's name).
        log: where messages go (default: ``print`` to stderr, through the progress bar when there is one).

    Returns:
        A :class:`RunReport`. Failed runs (Ray, after the retry) are recorded as ``failed-seed<k>.json`` and listed
        there; they run again next time.
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    root = resolve_root(study, root)
    cells = study.select(methods, settings)
    seeds = [int(s) for s in (study.seeds if seeds is None else seeds)]
    if study.require_protocol and not (root / study.protocol_file).is_file():
        raise FileNotFoundError(f"{study.name}: commit the protocol {root / study.protocol_file} before its runs")
    chosen = resolve_backend(backend, study)
    todo = missing_runs(study, root, seeds, cells)
    total = sum(len(s) for _, s in todo)
    summary = RunReport(skipped=len(cells) * len(seeds) - total, backend=chosen.name)
    show = sys.stderr.isatty() if progress is None else bool(progress)
    bar = tqdm(total=total, desc=study.name, unit="run", disable=not show or total == 0, dynamic_ncols=True,
               file=sys.stderr)
    say = log or (lambda text: tqdm.write(text, file=sys.stderr))
    code = code_version(_repo(study), study.code_paths)
    prefix = f"[{study.name} {study.protocol}]"
    say(f"{prefix} {total} run(s) to do, {summary.skipped} already recorded; {chosen.describe(study)}")
    if code["dirty"]:
        say(f"{prefix} warning: uncommitted changes; records name commit {code['commit']} with dirty=true")
    sink = None
    if wandb and total:
        from lightning_fedhet.experiments.wandb_log import WandbSink

        sink = WandbSink(study, project=wandb_project, dir=root)
    notes: set[str] = set()
    running: dict[int, int] = {}  # id(task) -> its seeds, for the tasks under way
    done = 0

    def started(task: Task) -> None:
        running[id(task)] = len(task.seeds)
        bar.set_postfix_str(f"running {sum(running.values())}", refresh=True)

    tasks = chosen.plan(study, todo)
    outcomes = chosen.execute(study, tasks, started)
    try:
        for outcome in outcomes:
            running.pop(id(outcome.task), None)
            for seed, path, result in _store(study, root, outcome, code, chosen.name, summary):
                done += 1
                note = result.get("note") if result else None
                if note and note not in notes:
                    notes.add(note)
                    say(f"{prefix} {note}")
                if result is None:
                    say(f"{prefix} FAILED {outcome.task.cell.name} / seed {seed} after {outcome.attempts} "
                        f"attempt(s): {outcome.error.strip().splitlines()[-1]} (recorded in {path})")
                elif not show:
                    say(f"{prefix} {outcome.task.cell.name} / seed {seed}: {result['wall_s']:.1f} s ({done}/{total})")
                if sink is not None and result is not None:
                    sink.log_record(json.loads(path.read_text()))
            bar.update(len(outcome.task.seeds))
            bar.set_postfix_str(f"running {sum(running.values())}", refresh=False)
    finally:
        if inspect.isgenerator(outcomes):  # a backend's clean-up (Ray cancels what is queued) runs now, not at GC
            outcomes.close()
        bar.close()
        if sink is not None:
            sink.close()
    summary.wall_s = round(time.perf_counter() - start, 2)
    say(f"{prefix} {len(summary.written)} new record(s), {len(summary.failed)} failed, {summary.wall_s:.1f} s")
    return summary


def _store(study: Study, root: Path, outcome: Outcome, code: dict, backend: str,
           summary: RunReport) -> list[tuple[int, Path, dict | None]]:
    """Write the records (or failure records) of one finished task; ``[(seed, path, result or None)]``."""
    cell, out = outcome.task.cell, []
    for k, seed in enumerate(outcome.task.seeds):
        args = (root, study.name, study.protocol, cell.setting, cell.method, seed)
        if outcome.error is None:
            result = outcome.results[k]
            path = record_path(*args)
            write_record(path, make_record(study, cell, seed, result, code))
            failure_path(*args).unlink(missing_ok=True)
            summary.written.append(path)
            out.append((int(seed), path, result))
        else:
            path = failure_path(*args)
            write_record(path, {
                "study": study.name, "protocol": study.protocol, "setting": cell.setting, "method": cell.method,
                "seed": int(seed), **code, "config": cell.config, "backend": backend,
                "attempts": outcome.attempts, "error": outcome.error,
            })
            summary.failed.append(path)
            out.append((int(seed), path, None))
    return out


# ---------------------------------------------------------------------------------------------------------- canary
#: what a canary re-run must reproduce (``data_checksum`` exactly on every processor; see :func:`rerun_canary`)
CANARY_KEYS = ("config", "metrics", "data_checksum", "threads", "engine")

#: relative and absolute tolerance of a canary's floats when it is re-run on another processor than its record's
CANARY_TOLERANCE = 1e-3


def canary_path(root: Path, study: str, processor: str | None = None) -> Path:
    """Where a study's canary record lives (not ``seed*.json``: pages never read it).

    ``processor`` None: the reference record, ``canary.json``. A processor's name (a record's ``cpu``): the record
    of the same cell made on that processor, ``canary.<slug>.json``, beside the reference.
    """
    name = "canary.json" if processor is None else f"canary.{slug(processor)}.json"
    return Path(root) / "records" / study / name


def _canary_for(root: Path, study: str, processor: str | None) -> dict[str, Any] | None:
    """The canary record made on ``processor`` (the reference's or a sibling's), or None."""
    for path in (canary_path(root, study), canary_path(root, study, processor)):
        if path.is_file():
            record = json.loads(path.read_text())
            if record.get("cpu") == processor:
                return record
    return None


def run_canary(study: Study) -> Record:
    """Train the study's canary cell once, in this process, with the study's thread count; the record it gives."""
    if study.canary is None:
        raise ValueError(f"{study.name} declares no canary cell")
    cell, seed = study.canary, int(study.canary_seed)
    (result,) = execute(study, Task(cell, (seed,)))
    record = make_record(dataclasses.replace(study, protocol="canary"), cell, seed, result,
                         code_version(_repo(study), study.code_paths))
    record.pop("seeds_in_run")
    return record


def write_canary(study: Study, root: str | Path | None = None, *, this_processor: bool = False) -> Record:
    """Run the canary and write its record.

    By default (after a change that moves numbers on purpose) it becomes the reference ``canary.json`` and every
    other processor's record of the study is removed: they describe the old numbers. ``this_processor`` True
    keeps the reference and writes this processor's own record beside it, for a processor whose kernels round
    differently at the same code (say so in CHANGELOG.md: the re-run there is then compared bit for bit).
    """
    root = resolve_root(study, root)
    record = run_canary(study)
    reference = canary_path(root, study.name)
    if not this_processor:
        for stale in reference.parent.glob("canary.*.json"):
            stale.unlink()
        write_record(reference, record)
    elif not reference.is_file() or json.loads(reference.read_text()).get("cpu") == record["cpu"]:
        write_record(reference, record)
    else:
        write_record(canary_path(root, study.name, record["cpu"]), record)
    return record


def rerun_canary(study: Study, root: str | Path | None = None) -> list[str]:
    """Re-run the canary at the current code and list every difference from its record (empty: it agrees).

    Where a record was made on this processor (its ``cpu``: model and instruction set; the reference or a
    processor's own record) the re-run must agree with it bit for bit. Another processor may dispatch other
    kernels (oneDNN per instruction set) that round differently: there every float must agree with the reference
    within :data:`CANARY_TOLERANCE` (``|a - b| <= tol (1 + |a|)``) and everything else exactly;
    ``data_checksum`` (the bytes the clients trained on) is exact everywhere.
    """
    root = resolve_root(study, root)
    path = canary_path(root, study.name)
    if not path.is_file():
        how = f"fedhet-study canary {study.source}" if study.source else "fedhet-study canary STUDY"
        return [f"{study.name}: no canary record {path}; write it with `{how}`"]
    fresh = json.loads(dumps(run_canary(study)))  # the record's JSON form
    own = _canary_for(root, study.name, fresh.get("cpu"))
    exact = own is not None
    committed: dict[str, Any] = own if own is not None else json.loads(path.read_text())
    problems = []
    for key in CANARY_KEYS:
        if not _agrees(committed.get(key), fresh.get(key), exact or key == "data_checksum"):
            where = "" if exact else (f"; compared within {CANARY_TOLERANCE} on {fresh.get('cpu')}, which has "
                                      f"no canary record of its own, not {committed.get('cpu')}")
            problems.append(f"{study.name}: canary {key} differs from the record made at {committed['commit']} "
                            f"({first_difference(committed.get(key), fresh.get(key))}{where})")
    return problems


def _agrees(a: Any, b: Any, exact: bool) -> bool:
    """Whether two JSON values agree: equal, or (``exact`` False) equal but for floats within the tolerance."""
    if exact or isinstance(a, (bool, str)) or a is None:
        return a == b
    if isinstance(a, float) or isinstance(b, float):
        return (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(b, bool)
                and abs(a - b) <= CANARY_TOLERANCE * (1.0 + abs(a)))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_agrees(a[k], b[k], exact) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_agrees(x, y, exact) for x, y in zip(a, b))
    return a == b
