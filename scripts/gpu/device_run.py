"""The one prepared device call: the CUDA engine contract, then FedAU protocol v2's cells at 2,000 rounds, then a GPU
row for the engine benchmarks, each part writing its results under ``$OUT`` as soon as it ends.

When a session is lent a GPU, this call gets the device before anything else (issue 40, item 6). Preparation, here
(the device machine has no internet and no git, so the data travels in a carried folder and the commit is named)::

    mkdir -p .gpu_data && cp /usr/share/datasets/fashion-mnist/*.gz .gpu_data/   # ignored by git; 30 MB
    git status --porcelain -- lightning_fedhet model_zoo callbacks scripts      # must print nothing
    git rev-parse HEAD                                                           # HASH below

The call (the device tool's ``run``, with ``carry: [".gpu_data"]`` and ``timeout_s: 600``)::

    PYTHONUNBUFFERED=1 python3 scripts/gpu/device_run.py --data-dir .gpu_data --out "$OUT" --budget-s 540 --commit HASH

In order, within ``--budget-s`` seconds from the start (every part stops :data:`STOP_MARGIN_S` before it, so the
files get written; progress lines with time stamps go to stdout and ``$OUT/log.txt``):

a. **Engine contract** (``contract_smoke.py``, at most ``--contract-s`` = 60 s): the sequential engine, the vmap
   engine and stacked seeds on the device for FedAvg, FedVARP and FedAU, global parameters within 1e-5 ->
   ``$OUT/contract.json``. If it fails, the call stops here (exit 1): a silent divergence on CUDA would poison the
   records.
b. **FedAU v2** (``fedau_v2.py``): the protocol's cells at its full 2,000 rounds, whole cells in its order of
   priority, skipping the cells already done (committed records, or ``--done`` files), never starting one whose
   projected time does not fit what is left -> ``$OUT/records.jsonl`` (each finished cell appended at once) and
   ``$OUT/cells.json`` (every cell's state, seconds per round measured).
c. **Benchmark row** (``bench_row.py``): B1 and B2 on the device, seeds stacked, as ratios to the centralised limit
   -> ``$OUT/bench.json``; a task that does not fit the time left is skipped, and the file says so.

Everything runs in float32 without TF32 (:func:`fedau_v2.full_float32`), the contract and the records alike.

**Between calls, and how the next call resumes.** The files come back under the reply's ``files_at``. Import the
records and commit them before the next call (the next call reads which cells are done from the committed record
files, which travel with the working tree)::

    python scripts/gpu/import_records.py <files_at>/records.jsonl     # -> docs/results/records/fedau/v2/
    git add docs/results/records/fedau/v2 && git commit -m "records: FedAU v2 cells from the GPU call"
    python scripts/reproduce.py report                                # the FedAU page

then run the same call again: it skips every cell whose 10 records are there and continues with the next in the
protocol's order. Where the records could not be imported first, copy ``records.jsonl`` into ``.gpu_data/`` and add
``--done .gpu_data/records.jsonl``. ``cells.json`` gives the seconds per round measured, as ``[seeds, s]`` pairs;
pass the largest of a whole cell (10 seeds) as ``--s-per-round`` so the first cell is judged before it starts, and
``--workers 2`` once a cell took well under half the budget. A cell longer than a call runs as many of its seeds as
fit, and the next call the others (``fedau_v2.seeds_that_fit``). A call that finished nothing (every cell
"abandoned": not even one seed fits a call) says so in ``cells.json``; then the protocol's horizon does not fit one
call on that device, which a later protocol must address (this script does not shorten it).

``--smoke`` runs the whole path on the CPU, tiny (contract on the CPU; N = 20, 3 rounds, seeds 0-1 and random
stand-in images for the cells; B1/B2 2 rounds, 2 seeds stacked): 46 CPU-seconds for all three parts and both
processes (one worker), 160 s of wall time on the shared 2-core machine at load 9; ``tests/test_device_script.py``
runs it.
"""

from __future__ import annotations

import time

T0 = time.time()  # the budget counts from here, before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the packages gpu and studies
from gpu import _source_checkout  # noqa: E402

_source_checkout.install()

STOP_MARGIN_S = 25.0  # every part ends this long before --budget-s: stragglers stopped, files written
PARTS = ("contract", "fedau", "bench")


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding Fashion-MNIST's four IDX files (.gz)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where the results go (default: $OUT)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="wall-clock seconds for the whole call")
    parser.add_argument("--commit", default=None, help="the commit the copied tree is at (the machine has no git)")
    parser.add_argument("--workers", type=int, default=1, help="processes sharing the GPU for the FedAU cells")
    parser.add_argument("--s-per-round", type=float, default=None,
                        help="seconds per round of a cell measured by an earlier call (cells.json), so the first cell "
                             "is judged before it starts")
    parser.add_argument("--done", nargs="+", default=[], type=Path,
                        help="JSON-lines files of records not yet imported (an earlier call's records.jsonl)")
    parser.add_argument("--records-root", type=Path, default=None,
                        help="where the committed records are (default: docs/results; --smoke: none)")
    parser.add_argument("--cells", nargs="+", default=None, help="only these 'setting/method' cells")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in this order: {PARTS}")
    parser.add_argument("--contract-s", type=float, default=60.0, help="the contract smoke's limit")
    parser.add_argument("--bench-rounds", type=int, default=30)
    parser.add_argument("--bench-seeds", type=int, default=10)
    parser.add_argument("--progress-every-s", type=float, default=30.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="the whole path on the CPU, tiny, in under a minute")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(args.parts) - set(PARTS):
        parser.error(f"--parts must name parts among {PARTS}, got {args.parts}")
    if not args.out:
        parser.error("--out is required when $OUT is not set")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.budget_s <= STOP_MARGIN_S:
        parser.error(f"--budget-s must exceed the stop margin {STOP_MARGIN_S:.0f} s, got {args.budget_s}")
    if not args.smoke and "fedau" in args.parts and not args.data_dir:
        parser.error("--data-dir is required for the FedAU cells (Fashion-MNIST's IDX files)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from gpu import _log

    log = _log.Log(T0, out / "log.txt")
    deadline = T0 + args.budget_s - STOP_MARGIN_S
    if args.data_dir:
        os.environ["FEDHET_FASHION_MNIST"] = str(Path(args.data_dir).resolve())  # the workers inherit it
    bench_estimates = None
    if args.smoke:
        args.device, args.bench_rounds, args.bench_seeds, args.progress_every_s = "cpu", 2, 2, 0.0
        bench_estimates = {"B1": 1.0, "B2": 1.0}
    import torch
    from gpu import bench_row, contract_smoke, fedau_v2

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("no CUDA device here: run with --smoke (CPU) or on a GPU machine")
        return 2
    fedau_v2.full_float32()
    fedau_v2._studies()._train.quiet()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    log(f"device run: {args.device} ({device_name}), torch {torch.__version__}, budget {args.budget_s:.0f} s "
        f"(parts end by +{deadline - T0:.0f} s), commit {args.commit or 'not given'}, parts {', '.join(args.parts)}"
        f"{', SMOKE' if args.smoke else ''}; results -> {out}")
    status = 0

    if "contract" in args.parts:
        limit = min(args.contract_s, max(0.0, deadline - time.time()))
        contract = contract_smoke.run(args.device, budget_s=limit, log=log)
        fedau_v2.write_json(out / "contract.json", contract)
        log(f"a. contract {'PASS' if contract['pass'] else 'FAIL'} in {contract['seconds']:.1f} s -> contract.json")
        if not contract["pass"]:
            reason = "not run: the engine contract failed on this device (contract.json)"
            fedau_v2.write_json(out / "cells.json", {"skipped": reason})
            fedau_v2.write_json(out / "bench.json", {"skipped": reason})
            log(f"stopping: {reason}")
            return 1

    if "fedau" in args.parts:
        cells = fedau_v2.plan(args.smoke, args.cells)
        seeds = fedau_v2.plan_seeds(args.smoke)
        root = args.records_root or (None if args.smoke else Path(__file__).resolve().parents[2] / "docs" / "results")
        done, to_run = fedau_v2.record_plan(cells, seeds, root, args.done)
        summary = fedau_v2.run_cells(
            cells, seeds, device=args.device, out=out, deadline=deadline, workers=args.workers, log=log, done=done,
            to_run=to_run, s_per_round=args.s_per_round, commit=args.commit,
            probe_rounds=fedau_v2.SMOKE_PROBE_ROUNDS if args.smoke else fedau_v2.PROBE_ROUNDS,
            progress_every_s=args.progress_every_s)
        if any(c["state"] == "failed" for c in summary["cells"].values()):
            status = 1
        log("b. fedau cells -> records.jsonl, cells.json")

    if "bench" in args.parts:
        bench = bench_row.run(args.device, deadline, rounds=args.bench_rounds, seeds=args.bench_seeds, log=log,
                              estimate_s=bench_estimates)
        fedau_v2.write_json(out / "bench.json", bench)
        log("c. bench -> bench.json")

    written = sorted(p.name for p in out.iterdir() if p.is_file())
    log(f"device run ends at +{time.time() - T0:.0f} s of {args.budget_s:.0f}; files: {', '.join(written)}")
    print(json.dumps({"exit": status, "files": written}), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
