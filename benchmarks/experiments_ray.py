"""Throughput of ``lightning_fedhet.experiments``: Ray workers, and seeds stacked with ``fit_seeds`` (run by hand).

    python benchmarks/experiments_ray.py                  # both parts (about 5 minutes on 2 idle cores)
    python benchmarks/experiments_ray.py --part ray       # 2 single-thread Ray workers vs 1 (target >= 1.7x)
    python benchmarks/experiments_ray.py --part stacked   # stacked seeds vs separate runs (target >= 4x)
    python benchmarks/experiments_ray.py --json out.json  # also write the numbers

The study (defined here, so Ray's workers load it from this file): logistic regression on LEAF's
Synthetic(1, 1) with 30 clients, Bernoulli(0.2) participation, 5 local steps, FedAvg and FedVARP x 2 learning
rates, ``--rounds`` rounds, validated at the end, every run with one torch thread.

- ``ray``: every cell x seed one Ray task (no stacking), on a local cluster of 1 and then 2 single-CPU workers. The
  time is the study's, from the first task submitted to the last record written, on a warm cluster (started, and
  each worker has imported the study: both are paid once per cluster, not per study); the cold start is printed
  too. Records of both runs must agree.
- ``stacked``: one cell's ``--seeds`` seeds, one ``Trainer.fit`` each (the study's ``engine="vmap"``; the
  ``in-process`` backend) against one ``fit_seeds`` run of all of them (the ``stacked`` backend); throughput is
  runs per second. Records must agree. ``--sequential`` also times separate runs with the sequential engine.

On a machine shared with other jobs the ratios move with their load: the load average is printed before each part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.algorithms import FedAvg, FedVARP
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import SyntheticLeafFederated
from lightning_fedhet.experiments import (
    Cell,
    InProcess,
    Ray,
    Stacked,
    federated_study,
    load_records,
    load_study,
    result_of,
    run_study,
)
from lightning_fedhet.experiments.federated import FederatedRun
from lightning_fedhet.participation import Bernoulli

ROUNDS = int(os.environ.get("FEDHET_BENCH_ROUNDS", "40"))
SEEDS = int(os.environ.get("FEDHET_BENCH_SEEDS", "4"))
ENGINE = os.environ.get("FEDHET_BENCH_ENGINE", "vmap")
METHODS = {"FedAvg": FedAvg, "FedVARP": FedVARP}


@cache
def data() -> SyntheticLeafFederated:
    return SyntheticLeafFederated(num_clients=30, gamma=1.0, delta=1.0, batch_size=16)


def build(cell, seed):
    model = Classifier("logistic_regression", num_classes=10, lr=cell.config["lr"], model_kwargs={"in_features": 60})
    strategy = FedHetStrategy(algorithm=METHODS[cell.method](), participation=Bernoulli(0.2), local_steps=5,
                              engine=ENGINE, seed=seed)
    return model, data(), strategy


STUDY = federated_study("bench", build, methods=METHODS, settings={"lr=0.05": {"lr": 0.05}, "lr=0.1": {"lr": 0.1}},
                        seeds=range(SEEDS), rounds=ROUNDS, eval_every=None, metric="val_acc")

QUIET = {"progress": False, "log": lambda text: None}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def same_records(a: Path, b: Path) -> bool:
    def strip(r):
        r = result_of(r)
        del r["commit"], r["dirty"]
        return r

    one, two = load_records(a, "bench"), load_records(b, "bench")
    return len(one) == len(two) > 0 and [strip(r) for r in one] == [strip(r) for r in two]


def _warm(path: str) -> float:
    """A Ray worker's first task: import the study (torch, Lightning, the data), then hold the CPU a moment so
    that the next warm-up task lands on another worker."""
    import time

    from lightning_fedhet.experiments import load_study  # (this function is pickled by value: no globals)

    start = time.perf_counter()
    study = load_study(path)
    study.run.build(study.cells[0], 0)  # builds the data
    elapsed = time.perf_counter() - start
    time.sleep(2.0)
    return elapsed


def time_ray(workers: int, root: Path) -> dict:
    import warnings

    import ray

    study = load_study(__file__)  # workers load it by this file's path
    # the workers inherit this environment: the same study size, one thread each
    os.environ.update({"FEDHET_BENCH_ROUNDS": str(ROUNDS), "FEDHET_BENCH_SEEDS": str(SEEDS), "OMP_NUM_THREADS": "1"})
    cold = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 2**20)
    try:
        warm = ray.remote(_warm).options(num_cpus=1)
        imports = ray.get([warm.remote(str(Path(__file__).resolve())) for _ in range(workers)])
        started = time.perf_counter() - cold
        start = time.perf_counter()
        result = run_study(study, root=root, backend=Ray(seeds_per_task=1), **QUIET)
        wall = time.perf_counter() - start
    finally:
        ray.shutdown()
    assert result.ok and len(result.written) == len(study.cells) * len(study.seeds)
    records = load_records(root, "bench")
    run_wall, run_cpu = sum(r["wall_s"] for r in records), sum(r["cpu_s"] for r in records)
    return {"workers": workers, "runs": len(result.written), "study_s": round(wall, 2),
            "cluster_start_s": round(started, 2), "worker_import_s": [round(x, 1) for x in imports],
            # the runs' own times: their sum over the study's time is how many ran at once on average, and CPU over
            # wall is the share of a core each run got (below 1: other processes held the cores)
            "in_flight": round(run_wall / wall, 2), "cpu_share": round(run_cpu / run_wall, 2)}


def part_ray(out: dict) -> None:
    print(f"[ray] load average {load()}; {len(STUDY.cells)} cells x {SEEDS} seeds, {ROUNDS} rounds, one task each",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        one = time_ray(1, Path(tmp) / "one")
        print(f"[ray] 1 worker:  {one['study_s']:.1f} s for {one['runs']} runs ({one['in_flight']} at once on "
              f"average, each with {one['cpu_share']:.0%} of a core; cluster start {one['cluster_start_s']} s)",
              flush=True)
        two = time_ray(2, Path(tmp) / "two")
        print(f"[ray] 2 workers: {two['study_s']:.1f} s for {two['runs']} runs ({two['in_flight']} at once on "
              f"average, each with {two['cpu_share']:.0%} of a core; cluster start {two['cluster_start_s']} s)",
              flush=True)
        agree = same_records(Path(tmp) / "one", Path(tmp) / "two")
    speedup = one["study_s"] / two["study_s"]
    print(f"[ray] speed-up of 2 workers over 1: {speedup:.2f}x (target >= 1.7x); records agree: {agree}; "
          f"load average now {load()}", flush=True)
    out["ray"] = {"one": one, "two": two, "speedup": round(speedup, 3), "records_agree": agree}


def part_stacked(out: dict, seeds: int, sequential: bool) -> None:
    import torch

    torch.set_num_threads(1)
    cell = STUDY.cells[0]
    study = dataclasses.replace(STUDY, cells=(Cell(cell.setting, cell.method, cell.config),), seeds=tuple(range(seeds)))
    print(f"[stacked] load average {load()}; {cell.name}, {seeds} seeds, {ROUNDS} rounds", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_study(dataclasses.replace(study, seeds=(1000,)), root=Path(tmp) / "warm", backend=InProcess(), **QUIET)
        times = {}
        for name, backend in (("separate", InProcess()), ("stacked", Stacked())):
            start = time.perf_counter()
            run_study(study, root=Path(tmp) / name, backend=backend, **QUIET)
            times[name] = time.perf_counter() - start
            print(f"[stacked] {name:>8}: {times[name]:.1f} s ({seeds / times[name]:.2f} runs/s)", flush=True)
        agree = same_records(Path(tmp) / "separate", Path(tmp) / "stacked")
    ratio = times["separate"] / times["stacked"]
    print(f"[stacked] throughput of stacked seeds over separate runs: {ratio:.2f}x (target >= 4x); records agree: "
          f"{agree}", flush=True)
    out["stacked"] = {"seeds": seeds, "separate_s": round(times["separate"], 2),
                      "stacked_s": round(times["stacked"], 2), "ratio": round(ratio, 3), "records_agree": agree}
    if sequential:
        seq = dataclasses.replace(study, run=FederatedRun(_sequential_build, ("val_acc",)))
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            run_study(seq, root=tmp, backend=InProcess(), **QUIET)
        wall = time.perf_counter() - start
        print(f"[stacked] separate runs with engine='sequential': {wall:.1f} s; stacked is "
              f"{wall / times['stacked']:.2f}x their throughput", flush=True)
        out["stacked"]["separate_sequential_s"] = round(wall, 2)


def _sequential_build(cell, seed):
    model, datamodule, _ = build(cell, seed)
    return model, datamodule, FedHetStrategy(algorithm=METHODS[cell.method](), participation=Bernoulli(0.2),
                                             local_steps=5, engine="sequential", seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "ray", "stacked"], default="all")
    parser.add_argument("--stacked-seeds", type=int, default=10, help="seeds of the stacked part (default 10)")
    parser.add_argument("--sequential", action="store_true", help="also time separate sequential-engine runs")
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args()
    out: dict = {"rounds": ROUNDS, "cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if args.part in ("all", "stacked"):
        part_stacked(out, args.stacked_seeds, args.sequential)
    if args.part in ("all", "ray"):
        part_ray(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
