"""Turn the GPU script's ``records.jsonl`` (one run record a line) into the studies' record files.

    python scripts/gpu/import_records.py path/to/records.jsonl [--force] [--dry-run]

Each line becomes ``docs/results/records/<study>/<protocol>/<setting>/<method>/seed<k>.json`` (the path the
studies read). A line is refused, naming the reason, when it lacks a record key, names a (setting, method) that is not a
cell of its study's protocol, or its configuration differs from that cell's in any key the cell declares: ``rounds``
and the metric window included, so a run shorter than its protocol's horizon is never imported (the keys a run adds,
such as the drawn ``p``, are not the cell's and are not compared). An existing record file is kept unless
``--force``. Then commit the record files and regenerate the pages with ``python scripts/reproduce.py report``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning_fedhet.experiments import load_study, record_path, write_record

STUDIES = Path(__file__).resolve().parents[1] / "studies"
RESULTS = STUDIES.parents[1] / "docs" / "results"

REQUIRED = ("study", "protocol", "setting", "method", "seed", "commit", "dirty", "device", "torch", "config",
            "engine", "seeds_in_run", "wall_s", "cpu_s", "metrics", "threads", "data_checksum")
#: keys of a cell's configuration whose value a run may resolve otherwise: none (the rounds are the protocol's)
RESOLVED: set[str] = set()


def check_record(record: dict) -> str | None:
    """Why ``record`` cannot be imported, or ``None``."""
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        return f"missing keys {missing}"
    study = load_study(str(STUDIES / f"{record['study']}.py"))
    if record["protocol"] != study.protocol:
        return f"protocol {record['protocol']!r} is not {study.name}'s current protocol {study.protocol!r}"
    cells = {(c.setting, c.method): c for c in study.cells}
    cell = cells.get((record["setting"], record["method"]))
    if cell is None:
        return f"({record['setting']!r}, {record['method']!r}) is not a cell of {study.name} {study.protocol}"
    differ = sorted(k for k, v in cell.config.items() if k not in RESOLVED and record["config"].get(k) != v)
    if differ:
        return f"configuration differs from the protocol's cell in {differ}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("--root", type=Path, default=RESULTS, help="docs/results (default)")
    parser.add_argument("--force", action="store_true", help="overwrite existing record files")
    parser.add_argument("--dry-run", action="store_true", help="check and report, write nothing")
    args = parser.parse_args(argv)
    written = kept = refused = 0
    for number, line in enumerate(args.jsonl.read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        why = check_record(record)
        where = f"line {number} ({record.get('setting')} / {record.get('method')} / seed {record.get('seed')})"
        if why:
            print(f"refused {where}: {why}")
            refused += 1
            continue
        path = record_path(args.root, record["study"], record["protocol"], record["setting"],
                                   record["method"], record["seed"])
        if path.exists() and not args.force:
            print(f"kept {path.relative_to(args.root)} (exists; --force to overwrite)")
            kept += 1
            continue
        if not args.dry_run:
            write_record(path, record)
        print(f"{'would write' if args.dry_run else 'wrote'} {path.relative_to(args.root)}")
        written += 1
    print(f"{written} written, {kept} kept, {refused} refused")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
