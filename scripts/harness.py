"""The reproduction harness: studies, run records, statistics and generated pages.

A *study* (``scripts/studies/<name>.py``) reproduces one paper's claims under a committed protocol
(``docs/results/<name>/protocol-<version>.md``). It registers *cells* (a setting x a method, with a fully resolved
configuration) and a function that trains one cell for one seed. Every run becomes one JSON *record*::

    docs/results/records/<study>/<protocol>/<setting>/<method>/seed<k>.json

with the keys ``study, protocol, setting, method, seed, commit, dirty, config, engine, device, torch, wall_s,
cpu_s, metrics``. A record that exists is never re-run, so a study fills up over several sessions. The pages
(``docs/results/<name>.md``, figures under ``docs/results/<name>/``, the index ``docs/results/README.md``) are
generated from the records alone by the study's ``report``; ``check`` regenerates them into a temporary folder
and fails on any difference. Nothing in ``docs/results/`` but the protocols and the records is written by hand.

Statistics: a cell is summarised by its mean and a 95 % Student-t interval over seeds; two methods are compared by
the paired differences over the seeds both have (:func:`paired`).
"""

from __future__ import annotations

import dataclasses
import difflib
import filecmp
import importlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "docs" / "results"
STUDY_NAMES = ("cafed", "upgapl", "fedstale", "fedau", "fedacs", "fedcis", "fedast")
VERDICTS = ("reproduced", "partly reproduced", "direction only", "not reproduced", "not testable here")

Record = dict[str, Any]


# --------------------------------------------------------------------------------------------------- registration
@dataclasses.dataclass(frozen=True)
class Cell:
    """One configuration of a study: ``setting`` x ``method``; ``config`` is JSON-able and fully resolved."""

    setting: str
    method: str
    config: dict


@dataclasses.dataclass(frozen=True)
class Summary:
    """One row of ``docs/results/README.md`` (every field is text generated from records)."""

    claim: str
    paper: str
    ours: str
    verdict: str

    def __post_init__(self) -> None:
        if self.verdict.split(" (")[0] not in VERDICTS + ("pending",):
            raise ValueError(f"verdict must start with one of {VERDICTS + ('pending',)}, got {self.verdict!r}")


@dataclasses.dataclass(frozen=True)
class Study:
    """A registered study.

    ``run(cell, seed) -> {"metrics": {...}, "engine": str}`` trains one seed of one cell (it may also return
    ``"config"`` to record what it resolved beyond ``cell.config``); ``run_seeds(cell, seeds) -> list`` (optional)
    trains several seeds at once and returns the same dicts in order. ``report(records, out) -> list[Summary]``
    writes ``out/<name>.md`` and its figures under ``out/<name>/`` from ``records`` (every protocol version) and
    returns the index rows. ``threads`` is torch's intra-op thread count for a run.
    """

    name: str
    title: str
    protocol: str
    seeds: tuple[int, ...]
    cells: tuple[Cell, ...]
    run: Callable[[Cell, int], dict]
    report: Callable[[list[Record], Path], list[Summary]]
    run_seeds: Callable[[Cell, Sequence[int]], list[dict]] | None = None
    threads: int = 1
    #: a cheap cell (a few rounds of one of the protocol's cells) whose one record ``check --rerun`` re-runs at HEAD
    #: and compares bit for bit: the drift alarm for every number of the study
    canary: Cell | None = None
    canary_seed: int = 0

    def __post_init__(self) -> None:
        keys = [(c.setting, c.method) for c in self.cells]
        if len(set(keys)) != len(keys):
            raise ValueError(f"study {self.name}: duplicate (setting, method) cells")

    @property
    def protocol_file(self) -> str:
        return f"{self.name}/protocol-{self.protocol}.md"


def available_studies() -> dict[str, Study]:
    """Every study in ``STUDY_NAMES`` whose module exists, in that order."""
    folder = Path(__file__).resolve().parent / "studies"
    return {name: load_study(name) for name in STUDY_NAMES if (folder / f"{name}.py").is_file()}


def load_study(name: str) -> Study:
    """``scripts/studies/<name>.py``'s ``STUDY``."""
    if name not in STUDY_NAMES:
        raise SystemExit(f"unknown study {name!r}; studies: {', '.join(STUDY_NAMES)}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return importlib.import_module(f"studies.{name}").STUDY


# --------------------------------------------------------------------------------------------------------- records
def slug(text: str) -> str:
    """A file-name form of a setting or method name (``"More available"`` -> ``"more-available"``)."""
    out = re.sub(r"[^a-z0-9.=+-]+", "-", text.lower()).strip("-")
    if not out:
        raise ValueError(f"cannot make a file name from {text!r}")
    return out


def record_path(root: Path, study: str, protocol: str, setting: str, method: str, seed: int) -> Path:
    return root / "records" / study / protocol / slug(setting) / slug(method) / f"seed{int(seed)}.json"


def load_records(root: Path, study: str) -> list[Record]:
    """Every record of ``study`` (all protocol versions), in a fixed order."""
    folder = root / "records" / study
    records = [json.loads(p.read_text()) for p in sorted(folder.rglob("seed*.json"))] if folder.is_dir() else []
    return sorted(records, key=lambda r: (r["protocol"], r["setting"], r["method"], r["seed"]))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def provenance() -> dict:
    """Commit (and whether the library's code differed from it), device and versions for a record."""
    import torch

    dirty = bool(_git("status", "--porcelain", "--", "lightning_fedhet", "model_zoo", "callbacks", "scripts").strip())
    return {
        "commit": _git("rev-parse", "--short=10", "HEAD").strip() or "unknown",
        "dirty": dirty,
        "device": f"cpu ({os.cpu_count()} cores, {platform.machine()})",
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def cpu_identity() -> str:
    """The processor's model name and the instruction set torch dispatches its CPU kernels for (``AVX512``,
    ``AVX2``, ...): two machines that differ here may round differently in the same code."""
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


def write_record(path: Path, record: Record) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True, default=_jsonable) + "\n")
    tmp.replace(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON-able in a record: {type(value).__name__}")


def parse_seeds(text: str | None, default: Iterable[int]) -> list[int]:
    """``"0-9"``, ``"0,3,5"`` or ``"0-2,7"``; ``None`` gives the study's registered seeds."""
    if text is None:
        return list(default)
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def run_study(study: Study, seeds: Sequence[int], methods: Sequence[str] | None = None,
              settings: Sequence[str] | None = None, root: Path = RESULTS, batch_seeds: bool = True) -> int:
    """Run every missing (cell, seed) of ``study``; write one record each. Returns the number of new records."""
    import torch

    cells = [c for c in study.cells if (methods is None or c.method in methods)
             and (settings is None or c.setting in settings)]
    if not cells:
        raise SystemExit(f"no cell of {study.name} matches methods={methods} settings={settings}; cells: "
                         + ", ".join(f"{c.setting}/{c.method}" for c in study.cells))
    if not (root / study.protocol_file).is_file():
        raise SystemExit(f"{study.name}: commit the protocol {root / study.protocol_file} before its runs")
    torch.set_num_threads(study.threads)
    prov = provenance()
    if prov["dirty"]:
        print(f"[{study.name}] warning: uncommitted changes in the library; records name commit {prov['commit']} "
              "with dirty=true", flush=True)
    todo = [(c, [s for s in seeds if not record_path(root, study.name, study.protocol, c.setting, c.method,
                                                          s).exists()]) for c in cells]
    total, done = sum(len(s) for _, s in todo), 0
    batched = batch_seeds and study.run_seeds is not None
    for cell, missing in todo:
        groups = ([missing] if missing else []) if batched else [[s] for s in missing]
        for group in groups:
            wall, cpu = time.perf_counter(), time.process_time()
            results = study.run_seeds(cell, group) if batched else [study.run(cell, group[0])]
            wall, cpu = (time.perf_counter() - wall) / len(group), (time.process_time() - cpu) / len(group)
            for seed, result in zip(group, results):
                record = {
                    "study": study.name, "protocol": study.protocol, "setting": cell.setting, "method": cell.method,
                    "seed": int(seed), **prov, "config": {**cell.config, **result.get("config", {})},
                    "engine": result["engine"], "seeds_in_run": len(group), "wall_s": round(wall, 2),
                    "cpu_s": round(cpu, 2), "metrics": result["metrics"], "threads": torch.get_num_threads(),
                }
                if result.get("data_checksum"):
                    record["data_checksum"] = result["data_checksum"]
                write_record(record_path(root, study.name, study.protocol, cell.setting, cell.method, seed), record)
                done += 1
                print(f"[{study.name} {study.protocol}] {cell.setting} / {cell.method} / seed {seed}: "
                      f"{wall:.1f} s ({done}/{total})", flush=True)
    return done


# ---------------------------------------------------------------------------------------------------------- canaries
def canary_path(root: Path, study: str) -> Path:
    """Where a study's canary record lives (not ``seed*.json``: pages never read it)."""
    return root / "records" / study / "canary.json"


def run_canary(study: Study) -> Record:
    """Train the study's canary cell once at HEAD with the study's thread count; the record it would write."""
    import torch

    if study.canary is None:
        raise SystemExit(f"{study.name} declares no canary cell")
    torch.set_num_threads(study.threads)
    cell, seed = study.canary, study.canary_seed
    wall, cpu = time.perf_counter(), time.process_time()
    result = study.run(cell, seed)
    record = {
        "study": study.name, "protocol": "canary", "setting": cell.setting, "method": cell.method, "seed": seed,
        **provenance(), "config": {**cell.config, **result.get("config", {})}, "engine": result["engine"],
        "wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
        "metrics": result["metrics"], "threads": torch.get_num_threads(),
    }
    if result.get("data_checksum"):
        record["data_checksum"] = result["data_checksum"]
    return record


def write_canary(study: Study, root: Path = RESULTS) -> Record:
    """Run the canary and (re)write its record: after a change that moves numbers on purpose (say why in
    CHANGELOG.md and refresh the study's records too)."""
    record = run_canary(study)
    write_record(canary_path(root, study.name), record)
    return record


#: what a canary re-run must reproduce exactly
CANARY_KEYS = ("config", "metrics", "data_checksum", "threads", "engine")


def rerun_canary(study: Study, root: Path = RESULTS) -> list[str]:
    """Re-run the canary at HEAD and list every difference from its committed record (empty: bit for bit)."""
    path = canary_path(root, study.name)
    if not path.is_file():
        return [f"{study.name}: no canary record {path.relative_to(root)}; write it with "
                f"`python scripts/reproduce.py canary {study.name}`"]
    committed = json.loads(path.read_text())
    fresh = json.loads(json.dumps(run_canary(study), sort_keys=True, default=_jsonable))  # the record's JSON form
    # Bit for bit on the processor the record was made on. Another processor may dispatch other kernels (oneDNN per
    # instruction set) that round differently: there floats must agree within CANARY_TOLERANCE, the rest exactly.
    exact = committed.get("cpu") == fresh.get("cpu")
    problems = []
    for key in CANARY_KEYS:
        if not _agrees(committed.get(key), fresh.get(key), exact):
            detail = _first_difference(committed.get(key), fresh.get(key))
            where = "" if exact else (f"; compared within {CANARY_TOLERANCE} on {fresh.get('cpu')}, "
                                      f"not {committed.get('cpu')}")
            problems.append(f"{study.name}: canary {key} differs from the record made at {committed['commit']} "
                            f"({detail}{where})")
    return problems


#: relative and absolute tolerance of a canary's floats when it is re-run on another processor
CANARY_TOLERANCE = 1e-3


def _agrees(a: Any, b: Any, exact: bool) -> bool:
    if exact or isinstance(a, (bool, str)) or a is None:
        return a == b
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(b, (int, float)) and abs(a - b) <= CANARY_TOLERANCE * (1.0 + abs(a))
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_agrees(a[k], b[k], exact) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_agrees(x, y, exact) for x, y in zip(a, b))
    return a == b


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else str(key))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{where}[{k}]")
    return f"{where or 'value'}: recorded {a!r}, now {b!r}"


# ------------------------------------------------------------------------------------------------------ statistics
def mean_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Mean and two-sided Student-t interval of the mean: ``(mean, low, high)``; one value gives ``(v, nan, nan)``."""
    from scipy import stats

    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(arr.mean())
    if arr.size == 1:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, arr.size - 1) * arr.std(ddof=1) / math.sqrt(arr.size))
    return mean, mean - half, mean + half


def by_seed(records: Iterable[Record], value: Callable[[Record], float], **match: str) -> dict[int, float]:
    """``{seed: value(record)}`` over the records whose fields equal ``match`` (e.g. ``method="FedAU"``)."""
    return {r["seed"]: float(value(r)) for r in records if all(r[k] == v for k, v in match.items())}


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float, int]:
    """Mean and 95 % interval of ``a - b`` over the seeds both have, and that number of seeds."""
    seeds = sorted(set(a) & set(b))
    mean, lo, hi = mean_ci([a[s] - b[s] for s in seeds])
    return mean, lo, hi, len(seeds)


def fmt_ci(mean: float, lo: float, hi: float, scale: float = 100.0, digits: int = 1, unit: str = "") -> str:
    """``"72.9 [70.1, 75.6]"`` (``scale`` 100 turns fractions into percent or percentage points)."""
    if math.isnan(mean):
        return "–"
    m = f"{scale * mean:.{digits}f}{unit}"
    return m if math.isnan(lo) else f"{m} [{scale * lo:.{digits}f}, {scale * hi:.{digits}f}]"


def verdict_for_gain(lo: float, mean: float, hi: float, paper_gain: float | None = None,
                     ratio: float = 0.5) -> str:
    """The decision rule most protocols use for "method A beats method B by about the paper's gain".

    - ``reproduced``: the paired interval lies above 0 and the mean gain is at least ``ratio`` x the paper's;
    - ``partly reproduced``: the interval lies above 0 but the gain is smaller than that;
    - ``direction only``: the mean gain is positive but the interval reaches 0;
    - ``not reproduced``: the mean gain is 0 or negative.
    """
    if math.isnan(mean):
        return "pending"
    if lo > 0:
        return "reproduced" if paper_gain is None or mean >= ratio * paper_gain else "partly reproduced"
    return "direction only" if mean > 0 else "not reproduced"


# ------------------------------------------------------------------------------------------------- pages & figures
def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    """A matplotlib figure drawn with the library's defaults (no user rc), so the PNG bytes are reproducible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcdefaults()
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig, path: Path) -> None:
    """Write a PNG without time stamps or version metadata (same records -> same bytes)."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def reproduce_section(records: Sequence[Record], commands: Sequence[str]) -> list[str]:
    """The end of a study page, as Markdown lines: the shell ``commands`` that regenerate it, then the provenance
    table and the compute the records took."""
    return ["## Reproduce\n", "```bash", *commands, "```\n", "## Provenance\n", provenance_table(records),
            f"\nCompute: {compute_used(records)}."]


def compute_used(records: Sequence[Record]) -> str:
    """``"12.3 CPU-min on cpu (2 cores, x86_64)"`` summed over records (wall time where CPU time is missing)."""
    if not records:
        return "–"
    minutes = sum(r.get("cpu_s", r["wall_s"]) for r in records) / 60
    devices = sorted({r["device"] for r in records})
    return f"{minutes:.1f} CPU-min, {len(records)} runs on {'; '.join(devices)}"


def provenance_table(records: Sequence[Record]) -> str:
    """Commits, engines, torch versions and run counts behind a page."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault((r["protocol"], r["commit"] + ("+dirty" if r.get("dirty") else ""), r["engine"],
                           r["device"], r["torch"]), []).append(r)
    rows = [(*key, len(rs), f"{sum(r['wall_s'] for r in rs) / 60:.1f}") for key, rs in sorted(groups.items())]
    return markdown_table(("protocol", "commit", "engine", "device", "torch", "runs", "wall min"), rows)


# -------------------------------------------------------------------------------------------------- report & check
INDEX = "README.md"
HAND_WRITTEN = re.compile(r"(^records/)|(/protocol-[^/]+\.md$)")


def report(out: Path, root: Path = RESULTS, studies: dict[str, Study] | None = None) -> list[Path]:
    """Regenerate every study page, figure and the index into ``out`` from ``root``'s records; the files written."""
    studies = studies if studies is not None else available_studies()
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, study in studies.items():
        records = load_records(root, name)
        summaries = study.report(records, out)
        # every page ends with "Against the authors' code", from records/<study>/referee/ (scripts/referee)
        from referee import section

        page = out / f"{name}.md"
        text = page.read_text().rstrip("\n") + "\n\n" if page.is_file() else ""
        page.write_text(text + "\n".join(section(root, name)).rstrip("\n") + "\n")
        for summary in summaries:
            rows.append((f"[{study.title}]({name}.md)", summary.claim, summary.paper, summary.ours,
                         f"**{summary.verdict}**", compute_used(records)))
    index = [
        "# Reproductions\n",
        "Generated by `python scripts/reproduce.py report` from the run records in `records/`; do not edit.",
        "Each study's protocol (`<study>/protocol-<version>.md`) was committed before the runs it reports.",
        "Intervals are 95 % Student-t intervals over seeds; comparisons are paired over the same seeds.\n",
        markdown_table(("study", "claim", "paper", "ours (mean [95 % CI], seeds)", "verdict", "compute"), rows),
        "\n## Regenerate\n",
        "```bash",
        "python scripts/reproduce.py run STUDY [--seeds 0-9] [--methods A B] [--settings S]  # missing runs only",
        "python scripts/reproduce.py report     # every page and figure here, from the records",
        "python scripts/reproduce.py check      # fails when a committed page differs from the records",
        "```",
    ]
    (out / INDEX).write_text("\n".join(index) + "\n")
    return sorted(p for p in out.rglob("*") if p.is_file())


def check(root: Path = RESULTS, studies: dict[str, Study] | None = None) -> list[str]:
    """Differences between the committed pages and a fresh :func:`report`; empty when they agree."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        report(fresh, root=root, studies=studies)
        generated = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
        committed = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
        for rel in sorted(generated):
            ours, theirs = fresh / rel, root / rel
            if not theirs.is_file():
                problems.append(f"{rel}: generated from the records but not committed")
            elif not filecmp.cmp(ours, theirs, shallow=False):
                detail = ""
                if rel.endswith(".md"):
                    diff = difflib.unified_diff(theirs.read_text().splitlines(), ours.read_text().splitlines(),
                                                "committed", "from records", lineterm="", n=0)
                    detail = "\n    " + "\n    ".join(list(diff)[2:12])
                problems.append(f"{rel}: differs from what the records give{detail}")
        for rel in sorted(committed - generated):
            if not HAND_WRITTEN.search(rel):
                problems.append(f"{rel}: committed but not generated from any record (stale or hand-written)")
    return problems


def copy_report(root: Path = RESULTS, studies: dict[str, Study] | None = None) -> list[str]:
    """``report`` into ``root`` itself, removing generated files that the records no longer give."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        report(fresh, root=root, studies=studies)
        generated = {p.relative_to(fresh).as_posix() for p in fresh.rglob("*") if p.is_file()}
        for p in sorted(root.rglob("*")):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and rel not in generated and not HAND_WRITTEN.search(rel):
                p.unlink()
        for rel in sorted(generated):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh / rel, root / rel)
    return sorted(generated)
