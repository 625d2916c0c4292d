"""FedAU protocol v2's cells on a GPU (docs/results/fedau/protocol-v2.md): the full horizon, whole cells in the
protocol's order, resumable over several calls.

Part b of ``scripts/gpu/device_run.py``, which is the one command (its docstring gives the call, the data it needs and
how the next session resumes). Every cell runs at its protocol's **2,000 rounds**, never fewer: there is no rounds
option, and :func:`plan` takes the rounds from ``studies.fedau.CELLS``. A cell is FedAU (K=50), average
participating, average all or MIFA in one participation pattern, its 10 seeds stacked in one
``studies.fedau.run_seeds`` run (``fit_seeds``: vmap on CUDA).

- **Done cells are skipped, and so are done seeds**: a cell is done when each of its seeds has a record at the cell's
  configuration (protocol v2, its N and its rounds) in the committed record files ``docs/results/records/fedau/v2/``
  (``--records-root``) or in a ``--done`` JSON-lines file (an earlier call's ``records.jsonl``); a cell of which
  some seeds have a record (run on the CPU, seed by seed, as the protocol's amendment of 2026-11-29 allows) runs only
  the others, stacked.
- **Order**: the rest run in the protocol's order of priority (``CELLS``: Bernoulli, cyclic, Markov), one after
  another in one worker process (``--workers 2``: two processes share the GPU, each taking the next cell when it is
  free; worth it once a call has measured a cell at well under half the budget, since two cells that share the GPU
  each take longer and, with nothing measured, may both project past the deadline).
- **A cell that cannot finish is not started**: before a cell starts, its time is projected from what this call
  measured (the longest finished cell's wall time, x :data:`SAFETY`; before any cell has finished, the measured or
  ``--s-per-round`` seconds per round x rounds x :data:`SAFETY` + :data:`SETUP_GUESS_S`), each measurement taken on a
  cell with as many seeds as this one, or else scaled to its seeds (:func:`estimate_cell_s`). When the whole cell
  does not fit the time left, the most of its seeds that do fit run, stacked (:func:`seeds_that_fit`; each seed's
  record stands alone, and the next call runs the others): a cell longer than a call (MIFA's 10 seeds take about
  790 s on the H200) is split over calls by seeds, never shortened in rounds. When not even one seed fits, neither
  the cell nor any later cell starts. With nothing measured yet, a cell is its own probe: after
  ``probe_rounds`` rounds, and at every evaluation after that, it projects its end from its own seconds per round
  (x :data:`SAFETY`, + :data:`TAIL_S`) and stops at once, writing nothing, when that is past the deadline.
- **Each finished cell is written at once**: its seeds' records, one JSON line per seed, appended to
  ``$OUT/records.jsonl`` (the studies' record keys; ``device`` the GPU's name); ``$OUT/cells.json`` holds every
  cell's state (done before / done / partly done / abandoned / not started / failed, with times and seconds per
  round) and is rewritten after every event, so a stopped call leaves it current.
"""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]
STUDY = "fedau"
PROBE_ROUNDS = 30  # a cell's first projection of its own end (3 evaluations at eval_every = 10)
SAFETY = 1.1  # projected seconds x this must fit the time left
SETUP_GUESS_S = 20.0  # a cell's set-up (10 partitions, models, test sets on the device) before any cell has finished
TAIL_S = 10.0  # after the last round: the data's sha256 per seed and the records
GRACE_S = 15.0  # past the deadline, running cells stop at their next evaluation; then they are terminated
SMOKE = {"num_clients": 20, "rounds": 3, "eval_every": 1, "synthetic_data": True}
SMOKE_SEEDS = (0, 1)
SMOKE_PROBE_ROUNDS = 2


def _studies():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    from studies import fedau

    return fedau


def full_float32() -> None:
    """Float32 matrix products and convolutions without TF32 on CUDA (PyTorch lets cuDNN use TF32 by default): the
    records then carry float32 arithmetic, as on the CPU, and the engine contract's 1e-5 can hold (with TF32 a vmap
    cohort's grouped convolutions and per-client convolutions differ by about 1e-4 after one round on an H100)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def plan(smoke: bool = False, only: list[str] | None = None) -> list:
    """The protocol's v2 cells in its order of priority (``only``: the ``setting/method`` names to keep); ``smoke``
    shrinks each to N = 20, 3 rounds, an evaluation every round and random stand-in images (seconds on a CPU)."""
    from lightning_fedhet.experiments import Cell

    cells = list(_studies().CELLS)
    if only:
        unknown = sorted(set(only) - {name(c) for c in cells})
        if unknown:
            raise ValueError(f"--cells: {unknown} are not cells of the protocol; cells: {[name(c) for c in cells]}")
        cells = [c for c in cells if name(c) in only]
    if smoke:
        cells = [Cell(c.setting, c.method, {**c.config, **SMOKE}) for c in cells]
    return cells


def plan_seeds(smoke: bool = False) -> tuple[int, ...]:
    return SMOKE_SEEDS if smoke else tuple(_studies().SEEDS)


def name(cell) -> str:
    return f"{cell.setting}/{cell.method}"


def complete_seeds(records, cell) -> set[int]:
    """The seeds of ``cell`` among ``records`` run at its configuration (protocol, N and rounds)."""
    fedau = _studies()
    return {int(r["seed"]) for r in records
            if r.get("study") == STUDY and r.get("protocol") == fedau.PROTOCOL and r.get("setting") == cell.setting
            and r.get("method") == cell.method and r["config"].get("rounds") == cell.config["rounds"]
            and r["config"].get("num_clients") == cell.config["num_clients"]}


def _recorded(cells, seeds, records_root: Path | None, done_files=()) -> dict[str, tuple[set[int], set[int]]]:
    """``{name: (seeds with a record file under records_root, seeds with a record there or in done_files)}``."""
    from lightning_fedhet.experiments import record_path

    fedau = _studies()
    lines = []
    for path in done_files:
        lines += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    found = {}
    for cell in cells:
        files = [record_path(records_root, STUDY, fedau.PROTOCOL, cell.setting, cell.method, s) for s in seeds
                 ] if records_root is not None else []
        committed = [json.loads(f.read_text()) for f in files if f.is_file()]
        found[name(cell)] = (complete_seeds(committed, cell), complete_seeds(committed + lines, cell))
    return found


def record_plan(cells, seeds, records_root: Path | None, done_files=()) -> tuple[dict[str, str], dict[str, list[int]]]:
    """``(done, to_run)`` from one read of the records: ``done`` is ``{name: where}`` for every cell whose ``seeds``
    all have a record, in the record files under ``records_root`` (``docs/results``, where
    ``scripts/gpu/import_records.py`` writes them; ``None``: none) or in the lines of ``done_files``; ``to_run`` is
    ``{name: the seeds of seeds, in order, that have no record}`` for every other cell (every seed for a cell with
    none)."""
    done, to_run = {}, {}
    for cell_name, (committed, anywhere) in _recorded(cells, seeds, records_root, done_files).items():
        if committed >= set(seeds):
            done[cell_name] = f"records under {records_root}"
        elif anywhere >= set(seeds):
            done[cell_name] = "records in " + ", ".join(str(p) for p in done_files)
        else:
            to_run[cell_name] = [s for s in seeds if s not in anywhere]
    return done, to_run


def estimate_cell_s(rounds: int, seeds: int, cell_walls: list[tuple[int, float]],
                    rates: list[tuple[int, float]]) -> float | None:
    """Projected seconds of a whole cell of ``seeds`` stacked seeds, from measurements given as ``(seeds of the
    measured cell, value)``: the longest finished cell's wall time x :data:`SAFETY`; else the slowest seconds per round
    x ``rounds`` x :data:`SAFETY` + :data:`SETUP_GUESS_S`; else ``None`` (nothing measured: the cell probes itself).

    Only cells with ``seeds`` seeds count while there are any (walls before rates); otherwise every measurement is
    scaled to ``seeds`` in proportion. A cell's time grows with its stacked seeds (on the H200: 0.054 s a round for
    2 seeds, 0.21 for 10), so a 2-seed cell's 110 s says nothing directly about a 10-seed cell, which takes 430 s."""
    kinds = ((cell_walls, lambda wall_s: wall_s * SAFETY),
             (rates, lambda rate: rate * rounds * SAFETY + SETUP_GUESS_S))
    for values, to_seconds in kinds:
        same = [v for n, v in values if n == seeds]
        if same:
            return to_seconds(max(same))
    for values, to_seconds in kinds:
        if values:
            return to_seconds(max(v * seeds / n for n, v in values))
    return None


def refusal(cell, seeds: int, cell_walls: list[tuple[int, float]], rates: list[tuple[int, float]],
            left_s: float) -> str | None:
    """Why ``cell``, run with ``seeds`` stacked seeds, must not start with ``left_s`` seconds left before the deadline
    (its projection, by :func:`estimate_cell_s`, does not fit; or less than :data:`SETUP_GUESS_S` is left), or
    ``None``: it starts."""
    estimate = estimate_cell_s(int(cell.config["rounds"]), seeds, cell_walls, rates)
    if left_s <= SETUP_GUESS_S or (estimate is not None and estimate > left_s):
        projected = "nothing measured" if estimate is None else f"projected {estimate:.0f} s"
        return f"{projected}, {left_s:.0f} s left before the deadline"
    return None


def seeds_that_fit(cell, seeds: list[int], cell_walls: list[tuple[int, float]], rates: list[tuple[int, float]],
                   left_s: float) -> list[int]:
    """The first of ``seeds`` (all of them, or as many as fit, at least one) that ``cell`` can run, stacked, in
    ``left_s`` seconds by :func:`refusal`; ``[]`` when not even one seed fits."""
    for count in range(len(seeds), 0, -1):
        if refusal(cell, count, cell_walls, rates, left_s) is None:
            return list(seeds[:count])
    return []


def nothing_fits(cell, seeds: list[int], cell_walls: list[tuple[int, float]], rates: list[tuple[int, float]],
                 left_s: float) -> str:
    """Why not even one of ``seeds`` starts (when :func:`seeds_that_fit` gives ``[]``): the whole cell's refusal."""
    return f"{refusal(cell, len(seeds), cell_walls, rates, left_s)} (not even one seed fits)"


def append_jsonl(path: Path, lines: list[str]) -> None:
    """Append whole lines under an exclusive lock (several workers write the same file)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
        fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file, so a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def provenance(commit: str | None, device: str, log) -> dict:
    """The record's commit (git's where there is git, else ``commit``, with ``dirty`` null: unknown), versions and
    device name."""
    import torch
    from studies import _repo

    from lightning_fedhet.experiments import provenance as record_provenance

    prov = record_provenance(_repo.REPO_ROOT, _repo.CODE_PATHS)
    if prov["commit"] == "unknown":  # no git on the machine (a copied working tree): the caller names the commit
        prov["commit"] = commit or "unknown"
    elif commit and not (commit.startswith(prov["commit"]) or prov["commit"].startswith(commit)):
        # git answered for an enclosing repository (e.g. a `git archive` copy inside a stale checkout, as on the
        # device machine): the caller's commit names the tree that runs; whether it is clean is unknown
        log(f"warning: --commit {commit} but git says {prov['commit']} (an enclosing repository); recording "
            f"--commit, dirty unknown")
        prov["commit"], prov["dirty"] = commit, None
    name_ = torch.cuda.get_device_name() if device.startswith("cuda") else \
        f"cpu ({os.cpu_count()} cores, {platform.machine()})"
    return {**prov, "device": name_}


def worker(index: int, conn, job: dict, log) -> None:
    """Ask the parent for a cell, run its seeds (the order names them), report; until told to stop. ``job``: device,
    commit, deadline, out, probe_rounds, progress_every_s, workers."""
    current = None
    try:
        sys.path.insert(0, str(SCRIPTS))
        from gpu import _source_checkout

        _source_checkout.install()
        import torch

        fedau = _studies()
        torch.set_num_threads(1)  # the GPU does the work; 16 cores, several workers
        full_float32()
        fedau._train.quiet()
        deadline, device = job["deadline"], job["device"]
        prov = provenance(job["commit"], device, log)
        while True:
            conn.send(("ready", index, None, None))
            order = conn.recv()
            if order[0] == "stop":
                return
            cell, seeds = order[1], list(order[2])
            current, rounds = name(cell), int(cell.config["rounds"])
            log(f"worker {index}: {current} starts: {len(seeds)} seeds x {rounds} rounds")
            begin, marks, shown = time.time(), [], [0.0]

            def progress(elapsed: float, done: int, cell_name: str = current, rounds: int = rounds,
                         marks: list = marks, shown: list = shown) -> None:
                now = time.time()
                marks.append((now, done))
                if now - shown[0] >= job["progress_every_s"] or done == rounds:
                    shown[0] = now
                    log(f"worker {index}: {cell_name} round {done}/{rounds} ({elapsed:.0f} s in the cell)")
                if done >= job["probe_rounds"] and len(marks) >= 2 and done < rounds:
                    rate = (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])
                    finish = now + (rounds - done) * rate * SAFETY + TAIL_S
                    if finish > deadline:
                        raise fedau.OutOfTime(f"at round {done} of {rounds}, {rate:.4f} s per round: projected to end "
                                              f"{finish - deadline:.0f} s after the deadline")

            wall, cpu = time.perf_counter(), time.process_time()
            try:
                results = fedau.run_seeds(cell, seeds, device=device, deadline=deadline, progress=progress)
            except fedau.OutOfTime as stop:
                rate = ((marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1])) if len(marks) >= 2 else None
                log(f"worker {index}: {current} stopped {stop}; no record for this cell")
                conn.send(("abandoned", index, current, {"why": str(stop), "s_per_round": rate,
                                                          "wall_s": round(time.time() - begin, 1)}))
                current = None
                continue
            except Exception:  # this cell only (a CUDA error that breaks the process fails the next cells too)
                text = traceback.format_exc()
                log(f"worker {index}: {current} failed:\n{text}")
                conn.send(("failed", index, current, {"traceback": text[-3000:]}))
                current = None
                continue
            wall_s = time.perf_counter() - wall
            cpu_s = time.process_time() - cpu
            lines = []
            for seed, result in zip(seeds, results):
                record = {
                    "study": STUDY, "protocol": fedau.PROTOCOL, "setting": cell.setting, "method": cell.method,
                    "seed": int(seed), **prov,
                    "config": {**cell.config, **result["config"], "gpu_workers": job["workers"],
                               "cuda_tf32": bool(torch.backends.cudnn.allow_tf32)},
                    "engine": result["engine"], "seeds_in_run": len(seeds), "wall_s": round(wall_s / len(seeds), 2),
                    "cpu_s": round(cpu_s / len(seeds), 2), "metrics": result["metrics"],
                    "threads": torch.get_num_threads(), "data_checksum": result["data_checksum"],
                }
                lines.append(json.dumps(record, sort_keys=True))
            append_jsonl(Path(job["out"]) / "records.jsonl", lines)
            rate = (marks[-1][0] - marks[0][0]) / (marks[-1][1] - marks[0][1]) if len(marks) >= 2 else None
            accs = [fedau.final_acc({"metrics": r["metrics"], "config": {**cell.config, **r["config"]}})
                    for r in results]
            log(f"worker {index}: {current} done in {wall_s:.0f} s, {len(lines)} records written; window accuracy per "
                f"seed {', '.join(f'{100 * a:.1f}' for a in accs)}")
            conn.send(("done", index, current, {"wall_s": round(wall_s, 1), "s_per_round": rate,
                                                 "records": len(lines),
                                                 "window_acc_mean": round(sum(accs) / len(accs), 4)}))
            current = None
    except Exception:
        text = traceback.format_exc()
        log(f"worker {index} failed{' in ' + current if current else ''}; it stops:\n{text}")
        try:
            conn.send(("failed", index, current, {"traceback": text[-3000:], "worker_stopped": True}))
        except (OSError, ValueError):
            pass


def run_cells(cells, seeds, *, device: str, out: Path, deadline: float, workers: int, log,
              done: dict[str, str] | None = None, to_run: dict[str, list[int]] | None = None,
              s_per_round: float | None = None, commit: str | None = None, probe_rounds: int = PROBE_ROUNDS,
              progress_every_s: float = 30.0) -> dict:
    """Run the cells not in ``done`` as the module docstring says, each with its seeds in ``to_run`` (default: every
    seed of ``seeds``; :func:`record_plan` gives them); the final ``cells.json`` content."""
    out = Path(out)
    done = done or {}
    to_run = {name(c): list((to_run or {}).get(name(c), seeds)) for c in cells if name(c) not in done}
    rounds = max(int(c.config["rounds"]) for c in cells)
    status: dict[str, dict] = {name(c): ({"state": "done before", "where": done[name(c)]} if name(c) in done
                                         else {"state": "waiting"}) for c in cells}
    walls: list[tuple[int, float]] = []  # (seeds, wall seconds) of the cells finished this call
    rates: list[tuple[int, float]] = []  # (seeds, seconds per round) measured this call, finished and abandoned
    given = [(len(seeds), s_per_round)] if s_per_round else []  # --s-per-round is a whole cell's (every seed)
    # measured_*: [seeds of the cell, value] pairs
    summary = {"protocol": _studies().PROTOCOL, "rounds": rounds, "seeds": list(seeds), "device": device,
               "plan": [name(c) for c in cells], "cells": status, "workers": workers,
               "s_per_round_given": s_per_round, "measured_s_per_round": rates, "measured_cell_wall_s": walls,
               "safety": SAFETY}

    def save() -> None:
        summary["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(out / "cells.json", summary)

    queue = [c for c in cells if name(c) not in done]
    partial = {n: s for n, s in to_run.items() if len(s) < len(seeds)}
    log(f"fedau v2: {len(cells)} cells at {rounds} rounds x {len(seeds)} seeds; {len(done)} done before "
        f"({', '.join(done) or 'none'}); {len(queue)} to run in this order: {', '.join(name(c) for c in queue)}"
        + "".join(f"; {n}: only seeds {s} (the others have records)" for n, s in partial.items()))
    save()
    left_s = deadline - time.time()
    first = None
    if queue and not seeds_that_fit(queue[0], to_run[name(queue[0])], [], given, left_s):
        first = nothing_fits(queue[0], to_run[name(queue[0])], [], given, left_s)
    if first:  # judged from --s-per-round alone: not even one seed fits, so no worker is started
        log(f"{name(queue[0])}: not started: {first}")
        for cell in queue:
            status[name(cell)] = {"state": "not started", "why": first}
        save()
        return summary
    if not queue:
        return summary
    ctx = mp.get_context("spawn")
    job = {"device": device, "commit": commit, "deadline": deadline, "out": str(out),
           "probe_rounds": probe_rounds, "progress_every_s": progress_every_s, "workers": workers}
    conns, procs = {}, {}
    for w in range(min(workers, len(queue))):
        ours, theirs = ctx.Pipe()
        conns[w] = ours
        procs[w] = ctx.Process(target=worker, args=(w, theirs, job, log), daemon=True)  # never outlives the call
        procs[w].start()
        theirs.close()
    next_cell, refused = 0, None
    try:
        next_cell, refused = _dispatch(queue, to_run, conns, procs, status, walls, rates, given, deadline, log, save)
    finally:
        for proc in procs.values():
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
    for cell in queue[next_cell:]:
        status[name(cell)] = {"state": "not started", "why": refused or "no worker left (see the log)"}
    save()
    counts = {}
    for s in status.values():
        counts[s["state"]] = counts.get(s["state"], 0) + 1
    log("fedau v2: " + ", ".join(f"{n} {state}" for state, n in counts.items()))
    return summary


def _dispatch(queue, to_run, conns, procs, status, walls, rates, given, deadline, log, save
              ) -> tuple[int, str | None]:
    """The parent's loop: hand each free worker the next cell with its seeds in ``to_run`` (as many as fit), book what
    the workers report; the index of the first cell not handed out, and why it was refused (or ``None``)."""
    next_cell, refused, running = 0, None, {}
    handed: dict[str, list[int]] = {}  # the seeds each cell was given this call
    while conns:
        left = deadline + GRACE_S - time.time()
        ready = wait(list(conns.values()), timeout=max(0.0, left))
        if not ready:
            for w in list(conns):
                log(f"worker {w} still running {GRACE_S:.0f} s past the deadline: terminated")
                if running.get(w):
                    status[running[w]] = {"state": "stopped at the budget"}
                procs[w].terminate()
                del conns[w]
            break
        for conn in ready:
            w = next(k for k, c in conns.items() if c is conn)
            try:
                kind, _, cell_name, info = conn.recv()
            except (EOFError, OSError):
                if running.get(w):
                    status[running[w]] = {"state": "failed", "why": f"worker {w} exited without a word"}
                del conns[w]
                continue
            if kind == "ready":
                running[w] = None
                if next_cell >= len(queue):
                    conn.send(("stop",))
                    del conns[w]
                    continue
                cell = queue[next_cell]
                known, left_s, wanted = rates + given, deadline - time.time(), to_run[name(cell)]
                chunk = seeds_that_fit(cell, wanted, walls, known, left_s)
                if not chunk:
                    refused = nothing_fits(cell, wanted, walls, known, left_s)
                    log(f"{name(cell)}: not started: {refused}")
                    conn.send(("stop",))
                    del conns[w]
                    continue
                conn.send(("run", cell, chunk))
                handed[name(cell)] = chunk
                estimate = estimate_cell_s(int(cell.config["rounds"]), len(chunk), walls, known)
                status[name(cell)] = {"state": "running", "worker": w, "seeds": chunk,
                                      "projected_s": None if estimate is None else round(estimate, 1)}
                if len(chunk) < len(wanted):
                    whole = refusal(cell, len(wanted), walls, known, left_s)
                    status[name(cell)]["seeds_left"] = wanted[len(chunk):]
                    log(f"{name(cell)}: the whole cell does not fit ({whole}); seeds {chunk} run now, "
                        f"{wanted[len(chunk):]} wait for the next call")
                running[w] = name(cell)
                next_cell += 1
            elif kind == "done":
                chunk, wanted = handed[cell_name], to_run[cell_name]
                status[cell_name] = {"state": "done", **info} if len(chunk) == len(wanted) else {
                    "state": "partly done", "seeds": chunk, "seeds_left": wanted[len(chunk):], **info}
                walls.append((len(chunk), info["wall_s"]))
                if info.get("s_per_round"):
                    rates.append((len(chunk), info["s_per_round"]))
            elif kind == "abandoned":
                status[cell_name] = {"state": "abandoned", **info}
                if info.get("s_per_round"):
                    rates.append((len(handed[cell_name]), info["s_per_round"]))
            elif kind == "failed":
                if cell_name:
                    status[cell_name] = {"state": "failed", **info}
                if info.get("worker_stopped"):
                    del conns[w]
            save()
    return next_cell, refused
