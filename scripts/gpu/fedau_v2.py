"""FedAU protocol v2's GPU cells (docs/results/fedau/protocol-v2.md): N = 250, the paper's rounds as far as they fit,
FedAU (K=50) against average participating and average all (and MIFA under the cyclic pattern) in the three
participation patterns, the protocol's seeds stacked in one ``fit_seeds`` run per cell, vmap on CUDA.

The one command (on a GPU machine, from the repository root, Fashion-MNIST's four IDX files in ``.gpu_data/``)::

    PYTHONPATH=. python3 scripts/gpu/fedau_v2.py --data-dir .gpu_data --out "$OUT" --budget-s 330 --commit HASH

(``HASH``: the commit the copied tree is at, recorded when the machine has no git; ``.gpu_data/`` holds copies of
``/usr/share/datasets/fashion-mnist/*.gz`` and travels with the call.) What it does, in order:

1. starts one worker process per cell (``--workers``; fewer workers take several cells each, in the protocol's
   order), each loading the data and running a **probe** of ``--probe-rounds`` rounds of its first cell to measure
   the seconds per round with every worker sharing the GPU;
2. picks the rounds ``R`` by the protocol's rule: the largest of the ladder (2000, 1000, 500, 250) for which every
   worker's cells are projected (probe rate x R x cells x 1.15, plus setup) to finish before the budget; if none
   fits, the smallest;
3. runs every cell at ``R`` rounds; each finished cell appends its seeds' records, **one JSON line per seed**, to
   ``$OUT/records.jsonl`` at once (the keys of the studies' records, ``device`` = the GPU's name), so partial
   results survive a stop; a cell still running at ``--budget-s`` stops at its next evaluation and writes nothing.

Progress goes to stdout with time stamps. ``scripts/gpu/import_records.py`` turns ``records.jsonl`` into record files
under ``docs/results/records/fedau/v2/``. ``--smoke`` runs a tiny version on the CPU (N = 20, 3 rounds, seeds 0-1,
two workers) to check the whole path before the GPU call.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]
LADDER = (2000, 1000, 500, 250)
SAFETY = 1.15  # projected time x this must fit the budget
STOP_MARGIN_S = 8.0  # cells stop this long before the budget so the records and the summary get written


def stamp(t0: float) -> str:
    return f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:6.1f}s]"


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def plan_cells(args) -> list:
    """The protocol's v2 cells in its order (``--cells`` keeps those whose ``setting/method`` it names); ``--smoke``
    shrinks them to N = 20 and 3 rounds."""
    sys.path.insert(0, str(SCRIPTS))
    from studies import fedau

    from lightning_fedhet.experiments import Cell

    cells = list(fedau.CELLS)
    if args.cells:
        cells = [c for c in cells if f"{c.setting}/{c.method}" in args.cells]
    if args.smoke:
        cells = [Cell(c.setting, c.method, {**c.config, "num_clients": 20, "rounds": 3, "eval_every": 1})
                 for c in cells]
    return cells


def append_jsonl(path: Path, lines: list[str]) -> None:
    """Append whole lines under an exclusive lock (several workers write the same file)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f, fcntl.LOCK_UN)


def provenance(args, device: str) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import torch
    from studies import _repo

    from lightning_fedhet.experiments import provenance as record_provenance

    prov = record_provenance(_repo.REPO_ROOT, _repo.CODE_PATHS)
    if prov["commit"] == "unknown":  # no git on the machine (a copied working tree): the caller names the commit
        prov["commit"] = args.commit or "unknown"  # and dirty stays None: unknown
    elif args.commit and not (args.commit.startswith(prov["commit"]) or prov["commit"].startswith(args.commit)):
        print(f"warning: --commit {args.commit} but git says {prov['commit']}; recording git's", flush=True)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores, " \
        f"{platform.machine()})"
    return {**prov, "device": name}


def worker(index: int, cells: list, args, conn, t0: float, deadline: float) -> None:
    """Probe the first cell, send the rate, get the rounds, run the cells, append each one's records."""
    try:
        sys.path.insert(0, str(SCRIPTS))
        import torch
        from studies import fedau

        torch.set_num_threads(1)
        seeds = parse_seeds(args.seeds)
        device = args.device
        prov = provenance(args, device)
        marks: list[tuple[float, int]] = []
        begin = time.time()
        fedau.run_seeds(cells[0], seeds, device=device, rounds=args.probe_rounds, checksum=False,
                        progress=lambda elapsed, done: marks.append((time.time(), done)))
        if len(marks) >= 2:
            rate = (marks[-1][0] - marks[-2][0]) / (marks[-1][1] - marks[-2][1])
        else:
            rate = (time.time() - begin) / args.probe_rounds
        setup = max(0.0, marks[0][0] - begin - rate * marks[0][1]) if marks else 0.0
        conn.send(("rate", index, rate, setup))
        decision = conn.recv()
        rounds = decision["rounds"]
        if not rounds:
            print(f"{stamp(t0)} worker {index}: told to stop before its cells", flush=True)
            return
        for cell in cells:
            name = f"{cell.setting}/{cell.method}"
            print(f"{stamp(t0)} worker {index}: {name} starts, {len(seeds)} seeds x {rounds} rounds", flush=True)
            last = [0.0]

            def progress(elapsed: float, done: int, name: str = name, last: list = last) -> None:
                if elapsed - last[0] >= args.progress_every_s or done == rounds:
                    last[0] = elapsed
                    print(f"{stamp(t0)} worker {index}: {name} round {done}/{rounds} ({elapsed:.0f} s in cell)",
                          flush=True)

            wall, cpu = time.perf_counter(), time.process_time()
            try:
                results = fedau.run_seeds(cell, seeds, device=device, rounds=rounds, deadline=deadline,
                                          progress=progress)
            except fedau.OutOfTime as stop:
                print(f"{stamp(t0)} worker {index}: {stop}; no record for this cell", flush=True)
                return
            wall, cpu = (time.perf_counter() - wall) / len(seeds), (time.process_time() - cpu) / len(seeds)
            lines = []
            for seed, result in zip(seeds, results):
                record = {
                    "study": "fedau", "protocol": fedau.PROTOCOL, "setting": cell.setting, "method": cell.method,
                    "seed": int(seed), **prov,
                    "config": {**cell.config, **result["config"], "rounds_rule": decision["rule"],
                               "probe_s_per_round": round(rate, 4), "gpu_workers": decision["workers"]},
                    "engine": result["engine"], "seeds_in_run": len(seeds), "wall_s": round(wall, 2),
                    "cpu_s": round(cpu, 2), "metrics": result["metrics"], "threads": torch.get_num_threads(),
                    "data_checksum": result["data_checksum"],
                }
                lines.append(json.dumps(record, sort_keys=True))
            append_jsonl(Path(args.out) / "records.jsonl", lines)
            accs = [fedau.final_acc({"metrics": r["metrics"], "config": {**cell.config, **r["config"]}})
                    for r in results]
            print(f"{stamp(t0)} worker {index}: {name} done in {wall * len(seeds):.0f} s; {len(lines)} records "
                  f"written; window accuracy per seed {', '.join(f'{100 * a:.1f}' for a in accs)}", flush=True)
    except Exception:
        print(f"{stamp(t0)} worker {index} failed:\n{traceback.format_exc()}", flush=True)
        try:
            conn.send(("failed", index, 0.0, 0.0))
        except (OSError, ValueError):
            pass
        raise SystemExit(1) from None


def choose_rounds(rates: dict[int, tuple[float, float]], loads: dict[int, int], remaining: float,
                  ladder: tuple[int, ...]) -> int:
    """The largest ladder value whose projected time fits ``remaining`` seconds for every worker; else the
    smallest."""
    for rounds in ladder:
        if all(setup * loads[w] + rate * rounds * loads[w] * SAFETY <= remaining for w, (rate, setup) in rates.items()):
            return rounds
    return ladder[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder holding Fashion-MNIST's four IDX files (.gz)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="where records.jsonl goes (default: $OUT)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="wall-clock limit for the whole script")
    parser.add_argument("--seeds", default=None, help="e.g. 0-9 (default: the protocol's seeds)")
    parser.add_argument("--rounds", type=int, default=None, help="force the rounds (no ladder choice)")
    parser.add_argument("--probe-rounds", type=int, default=20)
    parser.add_argument("--workers", type=int, default=None, help="processes sharing the GPU (default: one a cell)")
    parser.add_argument("--cells", nargs="+", default=None, help="only these 'setting/method' cells")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--commit", default=None,
                        help="the commit the copied tree is at, recorded when git is not available (dirty: null)")
    parser.add_argument("--progress-every-s", type=float, default=30.0)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run: N = 20, 3 rounds, seeds 0-1")
    args = parser.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.budget_s - STOP_MARGIN_S
    if not args.out:
        parser.error("--out is required when $OUT is not set")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    os.environ["FEDHET_FASHION_MNIST"] = str(Path(args.data_dir).resolve())  # workers inherit it
    ladder = LADDER
    if args.smoke:
        args.device, args.seeds, args.probe_rounds = "cpu", args.seeds or "0-1", 2
        args.workers, ladder = args.workers or 2, (3,)
    sys.path.insert(0, str(SCRIPTS))
    from studies import fedau

    args.seeds = args.seeds or f"{min(fedau.SEEDS)}-{max(fedau.SEEDS)}"
    if args.rounds:
        ladder = (args.rounds,)
    cells = plan_cells(args)
    if not cells:
        parser.error("no cell matches --cells")
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke (CPU) or on a GPU machine", flush=True)
        return 2
    workers = min(args.workers or len(cells), len(cells))
    assignment = {w: cells[w::workers] for w in range(workers)}
    print(f"{stamp(t0)} fedau v2: {len(cells)} cells, seeds {args.seeds}, {workers} workers on {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}, budget "
          f"{args.budget_s:.0f} s, ladder {ladder}; records -> {Path(args.out) / 'records.jsonl'}", flush=True)
    ctx = mp.get_context("spawn")
    pipes, procs = {}, {}
    for w, mine in assignment.items():
        ours, theirs = ctx.Pipe()
        pipes[w] = ours
        procs[w] = ctx.Process(target=worker, args=(w, mine, args, theirs, t0, deadline), daemon=False)
    rates: dict[int, tuple[float, float]] = {}
    for proc in procs.values():
        proc.start()
    probe_deadline = t0 + 0.5 * args.budget_s
    for w, conn in pipes.items():
        left = max(0.0, probe_deadline - time.time())
        if conn.poll(left):
            kind, index, rate, setup = conn.recv()
            if kind == "rate":
                rates[index] = (rate, setup)
                print(f"{stamp(t0)} worker {index} probe: {rate:.3f} s per round ({len(parse_seeds(args.seeds))} "
                      f"seeds stacked), setup {setup:.1f} s", flush=True)
        else:
            print(f"{stamp(t0)} worker {w}: no probe result in time; it is stopped", flush=True)
    if not rates:
        print(f"{stamp(t0)} no worker finished its probe; nothing to run", flush=True)
        for proc in procs.values():
            proc.terminate()
        return 1
    remaining = deadline - time.time()
    rounds = choose_rounds(rates, {w: len(assignment[w]) for w in rates}, remaining, ladder)
    rule = (f"ladder {ladder}: the largest whose projected time (probe rate x rounds x cells x {SAFETY}, plus setup) "
            f"fit the {args.budget_s:.0f} s budget")
    print(f"{stamp(t0)} rounds chosen: {rounds} ({rule}; {remaining:.0f} s left)", flush=True)
    for w, conn in pipes.items():
        try:  # each worker records the rule with its own probe rate
            conn.send({"rounds": rounds if w in rates else 0, "rule": rule, "workers": workers})
        except (OSError, BrokenPipeError):
            pass
    for w, proc in procs.items():
        proc.join(max(0.0, deadline + STOP_MARGIN_S - time.time() - 2.0))
        if proc.is_alive():
            print(f"{stamp(t0)} worker {w} still running at the budget; stopped", flush=True)
            proc.terminate()
            proc.join(2.0)
    path = Path(args.out) / "records.jsonl"
    n = sum(1 for _ in open(path)) if path.is_file() else 0
    print(f"{stamp(t0)} done: {n} records in {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
