"""Run records: one JSON file per (cell, seed), written atomically, never re-run once it exists.

A record lives at ``<root>/records/<study>/<protocol>/<setting>/<method>/seed<k>.json`` and has the keys

``study, protocol, setting, method, seed`` (what ran), ``commit, dirty`` (the code it ran, from git),
``config`` (the cell's resolved configuration), ``engine, device, cpu, torch, python, threads`` (how it ran),
``data_checksum`` (sha256 of the training data, when the run reports it), ``metrics`` (what it measured) and
``wall_s, cpu_s, seeds_in_run`` (how long it took, and with how many seeds it shared one stacked run).

The last three (:data:`TIMING_KEYS`) depend on the machine's load and on how the seeds were scheduled; every other
key is the same whichever backend ran the record (:func:`result_of` drops them for comparisons). A run that
continued from a checkpoint (:func:`lightning_fedhet.multiseed.fit_seeds`) also has ``resumed``
(``{"from_rounds": [...], "wall_s", "cpu_s"}``: the rounds it resumed at and the earlier processes' seconds, which
``wall_s`` and ``cpu_s`` include); it is scheduling too, and :func:`result_of` drops it. A run that failed
after its retries leaves ``failed-seed<k>.json`` beside where its record would be (never matched by ``seed*.json``)
with the error, and is tried again by the next ``run``.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Record = dict[str, Any]

#: keys that say how long a run took and how it was scheduled, not what it computed
TIMING_KEYS = ("wall_s", "cpu_s", "seeds_in_run")
#: keys that say how a run was scheduled, which :func:`result_of` drops: the timing keys and ``resumed``
SCHEDULING_KEYS = (*TIMING_KEYS, "resumed")


def slug(text: str) -> str:
    """A file-name form of a setting or method name (``"More available"`` -> ``"more-available"``)."""
    out = re.sub(r"[^a-z0-9.=+-]+", "-", str(text).lower()).strip("-")
    if not out:
        raise ValueError(f"cannot make a file name from {text!r}")
    return out


def record_path(root: Path, study: str, protocol: str, setting: str, method: str, seed: int) -> Path:
    """Where the record of one (cell, seed) lives under ``root``."""
    return Path(root) / "records" / study / protocol / slug(setting) / slug(method) / f"seed{int(seed)}.json"


def failure_path(root: Path, study: str, protocol: str, setting: str, method: str, seed: int) -> Path:
    """Where a failed (cell, seed) is recorded: beside its record, under a name ``seed*.json`` does not match."""
    return record_path(root, study, protocol, setting, method, seed).with_name(f"failed-seed{int(seed)}.json")


def load_records(root: Path, study: str) -> list[Record]:
    """Every record of ``study`` under ``root`` (all protocol versions), in a fixed order."""
    return _load(Path(root) / "records" / study, "seed*.json")


def load_failures(root: Path, study: str) -> list[Record]:
    """Every failure of ``study`` under ``root`` that no later run has replaced by a record."""
    return _load(Path(root) / "records" / study, "failed-seed*.json")


def _load(folder: Path, pattern: str) -> list[Record]:
    records = [json.loads(p.read_text()) for p in sorted(folder.rglob(pattern))] if folder.is_dir() else []
    return sorted(records, key=lambda r: (r["protocol"], r["setting"], r["method"], r["seed"]))


def dumps(record: Record) -> str:
    """The exact text of a record file (sorted keys, one-space indent, a final newline)."""
    return json.dumps(record, indent=1, sort_keys=True, default=_jsonable) + "\n"


def write_record(path: Path, record: Record) -> None:
    """Write ``record`` to ``path`` atomically: a temporary file in the same folder, then a rename.

    An interrupted write (a kill, Ctrl-C, a full disk) leaves either no file or the whole record at ``path``,
    never part of one; the temporary file is removed when Python gets the chance.
    """
    path = Path(path)
    text = dumps(record)  # fails (not JSON-able) before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-able in a record: {type(value).__name__}")


def result_of(record: Record) -> Record:
    """``record`` without :data:`SCHEDULING_KEYS`: what two runs of the same (cell, seed) must agree on bit for
    bit."""
    return {k: v for k, v in record.items() if k not in SCHEDULING_KEYS}


def first_difference(a: Any, b: Any, where: str = "") -> str:
    """Where two JSON values first differ, e.g. ``"metrics.val_acc[3]: recorded 0.5, now 0.51"``; ``""`` if equal."""
    if a == b:
        return ""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else str(key))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{where}[{k}]")
    return f"{where or 'value'}: recorded {a!r}, now {b!r}"


def parse_seeds(text: str | None, default: Iterable[int]) -> list[int]:
    """``"0-9"``, ``"0,3,5"`` or ``"0-2,7"``; ``None`` gives ``default``."""
    if text is None:
        return list(default)
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


# ------------------------------------------------------------------------------------------------------ provenance
def _git(repo: Path, *args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def code_version(repo: Path | None = None, code_paths: Sequence[str] = ()) -> dict:
    """``{"commit", "dirty"}`` of the git repository holding ``repo`` (default: the current folder).

    ``dirty`` is whether the code under ``code_paths`` (paths relative to the repository's top, wherever ``repo``
    lies in it) differs from the commit: a tracked file changed, or a file git does not ignore added there. With
    no ``code_paths``, tracked files only (every tracked file): a study writes its new records inside the
    repository, and they must not make the next record dirty. Without git, or outside a repository, the code
    version is unknown: ``{"commit": "unknown", "dirty": None}`` (not ``False``: nothing says the code was clean).
    """
    repo = Path(repo if repo is not None else Path.cwd())
    repo = repo if repo.is_dir() else repo.parent
    top = _git(repo, "rev-parse", "--show-toplevel").strip()
    commit = _git(repo, "rev-parse", "--short=10", "HEAD").strip() if top else ""
    if not commit:
        return {"commit": "unknown", "dirty": None}
    untracked = "--untracked-files=normal" if code_paths else "--untracked-files=no"
    status = _git(Path(top), "status", "--porcelain", untracked, "--", *code_paths)
    return {"commit": commit, "dirty": bool(status.strip())}


def describe_device(device: Any = "cpu") -> str:
    """A record's ``device``: ``"cpu (2 cores, x86_64)"`` or ``"cuda (NVIDIA H100 80GB HBM3)"``."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({os.cpu_count()} cores, {platform.machine()})"
    return device.type


def cpu_identity() -> str:
    """The processor's model name and the instruction set torch dispatches its CPU kernels for (``AVX512``,
    ``AVX2``, ...): two machines that differ here may round differently in the same code (a canary re-run compares
    bit for bit only on the same one)."""
    import torch

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        model = platform.processor() or "unknown"
    return f"{model}; {torch.backends.cpu.get_cpu_capability()}"


def machine(device: Any = "cpu") -> dict:
    """The keys of a record that describe where it ran: ``device, cpu, torch, python, threads``."""
    import torch

    return {"device": describe_device(device), "cpu": cpu_identity(), "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads()}


def provenance(repo: Path | None = None, code_paths: Sequence[str] = (), device: Any = "cpu") -> dict:
    """Commit (and whether the code differed from it), device, processor, versions and thread count for a
    record."""
    return {**code_version(repo, code_paths), **machine(device)}
