"""What every referee script shares: its command line, importing the authors' code from a scratch folder, stubs for
packages their code imports but this environment lacks, and writing one JSON record per comparison.

The authors' code is never copied into this repository: each script takes ``--authors PATH``, a folder outside it
holding an export of their repository (``git --git-dir=<mirror> archive <commit> | tar -x -C PATH``), and imports
from there at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.machinery
import io
import json
import math
import shlex
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from lightning_fedhet.experiments import provenance
from lightning_fedhet.experiments import write_record as write_json
from lightning_fedhet.experiments.records import slug

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "docs" / "results"
#: the paths whose uncommitted changes mark a record dirty (as for the run records: scripts/studies/_repo.py)
CODE_PATHS = ("lightning_fedhet", "model_zoo", "callbacks", "scripts")

KINDS = ("weights", "accuracy")
#: "compared": the comparison ran; "not run": skipped here (notes say why); "does not run": the authors' release
#: fails as released (notes say how); "no released code": nothing to compare with.
STATUSES = ("compared", "not run", "does not run", "no released code")


def parse_args(description: str, extra: Iterable[tuple[Sequence[str], dict]] = ()) -> argparse.Namespace:
    """``--authors PATH`` (required), ``--authors-commit SHA``, ``--root`` (the ``docs/results`` folder written
    to) and ``--no-accuracy`` (only the weight comparisons), plus the script's own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--authors", required=True, type=Path, help="scratch folder with the authors' code")
    parser.add_argument("--authors-commit", default=None,
                        help="the commit the folder was exported from (recorded; default: PATH/.referee-commit)")
    parser.add_argument("--root", type=Path, default=RESULTS, help="docs/results folder to write records to")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy comparison (b)")
    for flags, kwargs in extra:
        parser.add_argument(*flags, **kwargs)
    args = parser.parse_args()
    args.authors = args.authors.resolve()
    if not args.authors.is_dir():
        parser.error(f"--authors {args.authors} is not a folder")
    if args.authors_commit is None:
        marker = args.authors / ".referee-commit"
        args.authors_commit = marker.read_text().strip() if marker.is_file() else "unknown"
    return args


def command_line() -> str:
    """The command as it was typed (``python scripts/referee/<study>.py ...``), for the record."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(REPO_ROOT)
    except ValueError:
        pass
    return " ".join(shlex.quote(a) for a in ["python", str(script), *sys.argv[1:]])


# ---------------------------------------------------------------------------------------------- the authors' code
@contextlib.contextmanager
def authors_on_path(path: Path, modules: Iterable[str] = ()) -> Iterator[None]:
    """``path`` first on ``sys.path``; the top-level ``modules`` (and their submodules) are dropped from
    ``sys.modules`` before and after, so their names (``utils``, ``config`` ...) resolve to the authors' files and
    do not leak into the next import."""
    names = set(modules)

    def purge() -> None:
        for key in list(sys.modules):
            if key.split(".")[0] in names:
                del sys.modules[key]

    purge()
    sys.path.insert(0, str(path))
    try:
        yield
    finally:
        sys.path.remove(str(path))
        purge()


def stub_missing(name: str, **attributes: Any) -> bool:
    """Put an in-memory module ``name`` (dotted names create their parents) holding ``attributes`` into
    ``sys.modules`` when ``name`` cannot be imported here; nothing is written to disk. True when stubbed."""
    if name in sys.modules:
        return False
    try:
        importlib.import_module(name)
        return False
    except ImportError:
        pass
    parts = name.split(".")
    for k in range(1, len(parts) + 1):
        key = ".".join(parts[:k])
        if key in sys.modules:
            continue
        try:  # a real parent package (e.g. the authors' `learners`) is kept; only what is missing is made up
            importlib.import_module(key)
            continue
        except ImportError:
            pass
        module = types.ModuleType(key)
        module.__path__ = []  # a package, so submodules can hang below it
        # a spec, so importlib.util.find_spec (torch._dynamo scans for optional packages) does not raise
        module.__spec__ = importlib.machinery.ModuleSpec(key, loader=None, is_package=True)
        sys.modules[key] = module
        if k > 1:
            setattr(sys.modules[".".join(parts[: k - 1])], parts[k - 1], module)
    for key, value in attributes.items():
        setattr(sys.modules[name], key, value)
    return True


class Anything:
    """A stand-in that accepts any call or attribute (a logger, a progress bar) and does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Anything:
        return self

    def __getattr__(self, name: str) -> Anything:
        return self

    def __enter__(self) -> Anything:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Swallow what the authors' code prints (it prints every round)."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# ------------------------------------------------------------------------------------------------------ records
def record_path(root: Path, study: str, short_name: str) -> Path:
    if short_name.startswith("seed"):
        raise ValueError("referee records must not be named seed*.json (those are run records)")
    return root / "records" / study / "referee" / f"{slug(short_name)}.json"


def make_record(study: str, title: str, kind: str, args: argparse.Namespace, repo: str, files: Sequence[str],
                inputs: str, seeds: Sequence[int], cases: int, max_abs_diff: float | None, tolerance: float | None,
                agree: bool | None, notes: Sequence[str], table: dict | None = None,
                status: str = "compared", **extra: Any) -> dict:
    """One comparison's record (the keys ``scripts/referee/__init__.py`` renders), with the provenance of
    :func:`lightning_fedhet.experiments.provenance`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    if max_abs_diff is not None and not math.isfinite(max_abs_diff):
        raise ValueError(f"max_abs_diff must be finite, got {max_abs_diff}")
    record = {
        "study": study, "title": title, "kind": kind, "status": status,
        "authors": {"repo": repo, "commit": args.authors_commit, "files": list(files)},
        "command": command_line(),
        "inputs": {"description": inputs, "seeds": [int(s) for s in seeds]},
        "cases": int(cases), "max_abs_diff": None if max_abs_diff is None else float(max_abs_diff),
        "tolerance": None if tolerance is None else float(tolerance),
        "agree": None if agree is None else bool(agree),
        "notes": list(notes),
        **provenance(REPO_ROOT, CODE_PATHS),
        **extra,
    }
    if table is not None:
        record["table"] = {"header": list(table["header"]), "rows": [list(r) for r in table["rows"]]}
    return record


def write_record(root: Path, short_name: str, record: dict) -> Path:
    path = record_path(root, record["study"], short_name)
    write_json(path, record)
    print(f"[referee {record['study']}] {path.relative_to(root)}: cases={record['cases']} "
          f"max_abs_diff={record['max_abs_diff']} agree={record['agree']}", flush=True)
    return path


def sci(x: float | None) -> str:
    """``1.2e-15`` style for the tables (``0`` for an exact zero)."""
    if x is None:
        return "–"
    return "0" if x == 0 else f"{x:.2g}"


def dump(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
