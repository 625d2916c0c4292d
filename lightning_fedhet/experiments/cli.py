"""``fedhet-study``: run a study's missing records, generate its page, check the page against the records.

    fedhet-study run examples/my_study.py                       # every missing (cell, seed); resumes where it stopped
    fedhet-study run mypackage.studies.sweep --seeds 0-9 --backend ray --workers 2
    fedhet-study run my_study.py --backend ray --address auto   # on the Ray cluster this machine belongs to
    fedhet-study report examples/my_study.py [--wandb]          # <root>/<name>.md and its figures, from records
    fedhet-study check examples/my_study.py [--rerun]           # exit 1 if the page differs (or the canary drifted)
    fedhet-study list examples/my_study.py                      # cells and how many records each has

STUDY is a module path or a ``.py`` file (``:NAME`` picks another attribute than ``STUDY``). Records go to
``<root>/records/<study>/<protocol>/<setting>/<method>/seed<k>.json`` (``--root``, default the study's own root,
else ``./results``).

Exit status: 0 on success, 1 when runs fail or a page differs from its records, 2 for a usage error (a study file
that is missing or cannot be read, a study that fails to import or has no STUDY, a bad --seeds): one line on stderr
names it; --debug (or JSONARGPARSE_DEBUG=1, as for lightning-fedhet) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from lightning_fedhet.experiments.backends import Backend, Ray, Stacked, resolve_backend
from lightning_fedhet.experiments.records import load_failures, load_records, parse_seeds
from lightning_fedhet.experiments.report import check, report
from lightning_fedhet.experiments.runner import rerun_canary, run_study, write_canary
from lightning_fedhet.experiments.study import Study, load_study, resolve_root


class UsageError(Exception):
    """A mistake in what the user asked for (the study named, its file, ``--seeds``): reported in one line, exit 2."""


#: what ``--debug`` says in every help (the environment variable is the one ``lightning-fedhet`` reads)
_DEBUG_HELP = "on a usage error, raise it with its traceback instead of one line (same as JSONARGPARSE_DEBUG=1)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedhet-study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, many: bool = False) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("study", nargs="+" if many else None, help="a module path or a .py file (optionally :NAME)")
        p.add_argument("--root", default=None, help="the results folder (default: the study's, else ./results)")
        # also after the command; SUPPRESS: absent here, it leaves the top-level --debug as it was
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
        return p

    run = command("run", "run the study's missing (cell, seed) records")
    run.add_argument("--seeds", default=None, help="e.g. 0-9 or 0,2,5 (default: the study's seeds)")
    run.add_argument("--methods", nargs="+", default=None, help="only these methods")
    run.add_argument("--settings", nargs="+", default=None, help="only these settings")
    run.add_argument("--backend", default="auto", choices=["auto", "in-process", "stacked", "ray"],
                     help="auto: seeds stacked where the study can, else one at a time (default)")
    run.add_argument("--max-seeds", type=int, default=None, help="stacked: at most this many seeds per run")
    run.add_argument("--address", default=None, help="ray: join this cluster (default: start a local one)")
    run.add_argument("--workers", type=int, default=None, help="ray: runs at once on the local cluster")
    run.add_argument("--seeds-per-task", type=int, default=1, help="ray: stacked seeds per task (default 1)")
    run.add_argument("--retries", type=int, default=1, help="ray: retries of a failed task before it is recorded")
    run.add_argument("--wandb", action="store_true", help="also log every new record to W&B")
    run.add_argument("--wandb-project", default=None, help="W&B project (default: the study's name)")
    bar = run.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always a progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="one line per record instead")

    rep = command("report", "regenerate the studies' pages and figures from their records", many=True)
    rep.add_argument("--wandb", action="store_true", help="also log the paired table and the figures to W&B")
    rep.add_argument("--wandb-project", default=None, help="W&B project (default: the study's name)")
    chk = command("check", "exit 1 when a page or figure differs from what the records give", many=True)
    chk.add_argument("--rerun", action="store_true", help="also re-run each study's canary and compare bit for bit")
    can = command("canary", "(re)write the study's canary record at the current code")
    can.add_argument("--this-processor", action="store_true",
                     help="keep the reference record and write this processor's own beside it (same code, kernels "
                          "that round differently); without it the reference is rewritten and the others removed")
    command("list", "the study's cells and how many records each has")
    return parser


def _backend(args: argparse.Namespace, study: Study) -> Backend:
    if args.backend == "ray":
        return Ray(address=args.address, workers=args.workers, seeds_per_task=args.seeds_per_task,
                   retries=args.retries)
    if args.backend == "stacked" or (args.backend == "auto" and args.max_seeds is not None):
        return Stacked(max_seeds=args.max_seeds)
    return resolve_backend(args.backend, study)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedhet-study`` console script: the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)
    try:
        return _command(args)
    except UsageError as err:
        if args.debug or os.environ.get("JSONARGPARSE_DEBUG", "").lower() in ("1", "true", "yes", "on"):
            raise
        print(f"fedhet-study: error: {err}", file=sys.stderr)
        return 2


def _load(spec: str) -> Study:
    """:func:`load_study`, each way it can fail because of what the user named raised as one :class:`UsageError`
    (chained to the cause, which ``--debug`` shows)."""
    head, colon, tail = spec.rpartition(":")
    target = head if colon and not re.search(r"[\\/]", tail) else spec  # "C:\x.py" is a path, "x.py:NAME" not
    path = Path(target)
    if target.endswith(".py") or path.is_file():  # a file (load_study's rule), else a module path
        if not path.exists():
            raise UsageError(f"no study file {target!r}")
        try:
            path.read_bytes()
        except OSError as err:  # a folder, no permission
            raise UsageError(f"cannot read the study file {target!r}: {err.strerror or err}") from err
    try:
        return load_study(spec)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (target == missing or target.startswith(missing + ".")):
            raise UsageError(f"no study module {target!r} (no module {missing!r} to import)") from err
        raise UsageError(f"the study {spec!r} failed to import: {_one_line(err)}") from err
    except TypeError as err:
        if "must be a lightning_fedhet.experiments.Study" in str(err):  # load_study's word for a missing STUDY
            raise UsageError(str(err)) from err
        raise UsageError(f"the study {spec!r} failed to import: {_one_line(err)}") from err
    except Exception as err:  # noqa: BLE001 - anything the study's own code raises while it is imported
        raise UsageError(f"the study {spec!r} failed to import: {_one_line(err)}") from err


def _one_line(err: BaseException) -> str:
    """``Type: first line of the message`` and where to see the rest (the study's own code raised it)."""
    lines = str(err).strip().splitlines()
    said = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return f"{said} (--debug shows the traceback)"


#: one part of ``--seeds``: a seed or an increasing range of seeds
_SEED_PART = re.compile(r"(\d+)(?:-(\d+))?")


def _check_seeds(text: str | None) -> None:
    """Refuse a ``--seeds`` that :func:`parse_seeds` cannot read or that names no seed (``5-2``), naming it."""
    if text is None:
        return
    for part in text.split(","):
        match = _SEED_PART.fullmatch(part.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise UsageError(
                f"--seeds {text!r}: {part.strip()!r} is not a seed or an increasing range of seeds "
                "(non-negative ints: e.g. 0-9, 0,2,5 or 0-2,7)"
            )


def _command(args: argparse.Namespace) -> int:
    if args.command == "run":
        _check_seeds(args.seeds)
        study = _load(args.study)
        result = run_study(study, seeds=parse_seeds(args.seeds, study.seeds), methods=args.methods,
                           settings=args.settings, root=args.root, backend=_backend(args, study),
                           progress=args.progress, wandb=args.wandb, wandb_project=args.wandb_project)
        if result.failed:
            print(f"{len(result.failed)} run(s) failed; their errors are in:\n  "
                  + "\n  ".join(str(p) for p in result.failed), file=sys.stderr)
            return 1
        print(f"run `fedhet-study report {args.study}` to update the page", file=sys.stderr)
        return 0
    if args.command in ("report", "check"):
        studies = [_load(spec) for spec in args.study]
        if args.command == "report":
            files = report(studies, args.root, wandb=args.wandb, wandb_project=args.wandb_project)
            print(f"wrote {len(files)} generated file(s) under {resolve_root(studies[0], args.root)}")
            return 0
        problems = check(studies, args.root)
        if problems:
            print("pages differ from their records:\n- " + "\n- ".join(problems))
            print(f"regenerate with `fedhet-study report {' '.join(args.study)}`")
            return 1
        print("the pages match their records")
        if args.rerun:
            drift = []
            for study in studies:
                if study.canary is not None:
                    found = rerun_canary(study, args.root)
                    print(f"[{study.name}] canary re-run: {'agrees' if not found else 'DIFFERS'}", flush=True)
                    drift += found
            if drift:
                print("numbers drifted:\n- " + "\n- ".join(drift))
                return 1
        return 0
    study = _load(args.study)
    if args.command == "canary":
        record = write_canary(study, args.root, this_processor=args.this_processor)
        print(f"[{study.name}] canary record written ({record['wall_s']} s, commit {record['commit']})")
        return 0
    root = resolve_root(study, args.root)
    records, failures = load_records(root, study.name), load_failures(root, study.name)
    print(f"{study.name} (protocol {study.protocol}, seeds {list(study.seeds)}): {len(study.cells)} cells, "
          f"{len(records)} records, {len(failures)} failed")
    for cell in study.cells:
        n = sum(r["setting"] == cell.setting and r["method"] == cell.method and r["protocol"] == study.protocol
                for r in records)
        print(f"  {cell.name}: {n}/{len(study.seeds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
