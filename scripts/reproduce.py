"""Reproductions of the papers' claims: run records, generated pages, and the check that they agree.

    python scripts/reproduce.py list                                   # studies, protocols, cells, records so far
    python scripts/reproduce.py run cafed --seeds 0-9 [--methods CA-Fed AdaFed] [--settings synthetic]
    python scripts/reproduce.py run fedau --seeds 2 --checkpoint-dir ~/fedau-checkpoints   # a killed run resumes
    python scripts/reproduce.py report                                 # docs/results/ from the records
    python scripts/reproduce.py check                                  # exit 1 if a committed page differs
    python scripts/reproduce.py check --rerun                          # ... or a canary cell drifted at HEAD
    python scripts/reproduce.py canary fedacs                          # refresh a canary after a meant change
    python scripts/reproduce.py canary fedast --this-processor         # ... or add this processor's own record

The studies are plug-ins of ``lightning_fedhet.experiments`` (``scripts/studies/<name>.py``, each a ``Study``
declared with ``studies._repo.study``); this front end runs all of them together and writes the index
``docs/results/README.md``. ``run`` writes one JSON record per (setting, method, seed) to
``docs/results/records/<study>/<protocol>/`` and skips the ones that exist, so a study fills up over several
sessions; ``report`` and ``check`` train nothing. One study alone: ``fedhet-study run|report|check
scripts/studies/<name>.py``. See ``docs/experiments.md`` for the record format and
``docs/results/<study>/protocol-*.md`` for each protocol.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

# `python scripts/reproduce.py` puts scripts/ first on sys.path, which makes the package `studies` importable
from studies import STUDIES, _repo

from lightning_fedhet.experiments import (
    check,
    load_records,
    parse_seeds,
    report,
    rerun_canary,
    run_study,
    write_canary,
)

#: studies whose ``run`` and ``run_seeds`` take ``checkpoint_dir`` (their seeds train through
#: ``lightning_fedhet.multiseed.fit_seeds``, which can write its state and resume bit for bit)
RESUMABLE = ("fedau",)


def with_checkpoints(study, folder: str):
    """``study`` whose runs write checkpoints under ``folder`` and resume from them (see ``RESUMABLE``)."""
    if study.name not in RESUMABLE:
        raise SystemExit(f"--checkpoint-dir: {study.name}'s runs cannot resume (they do not train through "
                         f"multiseed.fit_seeds); studies that can: {', '.join(RESUMABLE)}")
    return dataclasses.replace(study, run=functools.partial(study.run, checkpoint_dir=folder),
                               run_seeds=functools.partial(study.run_seeds, checkpoint_dir=folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a study's missing (cell, seed) records")
    run.add_argument("study", choices=STUDIES)
    run.add_argument("--seeds", default=None, help="e.g. 0-9 or 0,2,5 (default: the protocol's seeds)")
    run.add_argument("--methods", nargs="+", default=None, help="only these methods (default: all)")
    run.add_argument("--settings", nargs="+", default=None, help="only these settings (default: all)")
    run.add_argument("--one-seed-at-a-time", action="store_true",
                     help="do not batch seeds into one run even where the study can")
    run.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help=f"write each run's state to DIR every so many rounds and resume a killed run from it "
                          f"(same commit, processor and device; {', '.join(RESUMABLE)} only); a finished run "
                          "removes its file")
    sub.add_parser("report", help="regenerate every page and figure of docs/results/ from the records")
    chk = sub.add_parser("check", help="exit 1 when a committed page or figure differs from the records")
    chk.add_argument("--rerun", action="store_true",
                     help="also re-run every study's canary cell at HEAD and compare it with its record bit for bit")
    chk.add_argument("--studies", nargs="+", default=None, help="with --rerun: only these studies' canaries")
    can = sub.add_parser("canary", help="(re)write a study's canary record at HEAD (after a change that moves numbers)")
    can.add_argument("studies", nargs="+", choices=STUDIES)
    can.add_argument("--this-processor", action="store_true",
                     help="keep the reference record and write this processor's own beside it (same code, kernels "
                          "that round differently); without it the reference is rewritten and the others removed")
    sub.add_parser("list", help="the studies, their protocols, cells and record counts")
    args = parser.parse_args(argv)

    if args.command == "run":
        study = _repo.load(args.study)
        if args.checkpoint_dir is not None:
            study = with_checkpoints(study, args.checkpoint_dir)
        result = run_study(study, seeds=parse_seeds(args.seeds, study.seeds), methods=args.methods,
                           settings=args.settings, backend="in-process" if args.one_seed_at_a_time else "auto",
                           progress=False)
        print(f"[{study.name}] {len(result.written)} new record(s); run `python scripts/reproduce.py report` to "
              "update the pages")
        return 1 if result.failed else 0
    if args.command == "report":
        files = report(list(_repo.studies().values()), _repo.RESULTS, index=_repo.index)
        print(f"wrote {len(files)} generated file(s) under {_repo.RESULTS}")
        return 0
    if args.command == "canary":
        for name in args.studies:
            record = write_canary(_repo.load(name), this_processor=args.this_processor)
            print(f"[{name}] canary record written ({record['wall_s']} s, commit {record['commit']})")
        return 0
    if args.command == "check":
        studies = _repo.studies()
        problems = check(list(studies.values()), _repo.RESULTS, index=_repo.index)
        if problems:
            print("docs/results/ does not match its records:\n- " + "\n- ".join(problems))
            print("regenerate with `python scripts/reproduce.py report` (and commit the records it reads)")
        else:
            print("docs/results/ matches its records")
        if args.rerun:  # the canaries run whatever the pages say: both answers are worth having
            drift = []
            for name, study in studies.items():
                if (args.studies is None or name in args.studies) and study.canary is not None:
                    found = rerun_canary(study)
                    print(f"[{name}] canary re-run: {'agrees' if not found else 'DIFFERS'}", flush=True)
                    drift += found
            if drift:
                print("numbers drifted at HEAD:\n- " + "\n- ".join(drift))
                print("if the change is meant, refresh the affected records and the canary (`reproduce.py canary "
                      "STUDY`) and say why in CHANGELOG.md")
                return 1
        return 1 if problems else 0
    for name, study in _repo.studies().items():
        records = load_records(_repo.RESULTS, name)
        print(f"{name} (protocol {study.protocol}, seeds {list(study.seeds)}): {len(study.cells)} cells, "
              f"{len(records)} records")
        for cell in study.cells:
            n = sum(r["setting"] == cell.setting and r["method"] == cell.method and r["protocol"] == study.protocol
                    for r in records)
            print(f"  {cell.setting} / {cell.method}: {n}/{len(study.seeds)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
