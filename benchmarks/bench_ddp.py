"""Rounds per second of FedHetDDPStrategy on 2 processes x 1 thread vs FedHetStrategy on 1 process x 2 threads.

    python benchmarks/bench_ddp.py [--task B1|B2|all] [--engines sequential,vmap] [--rounds 8] [--repeats 3]
                                   [--json out.json]

Tasks as in ``bench_engines.py``: B1 = synthetic LEAF logistic regression (N=100, 20 clients/round, K=5, batch 32);
B2 = Fashion-MNIST CNN (N=100, Dirichlet 0.5, 10 clients/round, K=5, batch 32). FedAvg, the same plan, clients and
mini-batches in both configurations (the two-process run equals the one-process run up to summation order).

Every run is a fresh subprocess (``--child``): ``1x2`` is ``FedHetStrategy`` with ``torch.set_num_threads(2)``;
``2x1`` is ``FedHetDDPStrategy`` with ``Trainer(devices=2, accelerator="cpu")`` (gloo, ``OMP_NUM_THREADS=1``,
Lightning's ``popen`` launcher). Time per round is measured on rank 0 from the end of round 1 to the end of the last
round. Configurations are interleaved within each repeat so that load from other programs hits them alike; the
minimum and the median over repeats are reported. The two-process child also times the all-reduce of the model's
``d`` floats and of a ResNet-18-sized vector (11.2 M floats) on this machine, for the scaling model in
``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESNET18_PARAMS = 11_173_962
SPEEDUPS = ("speedup_vs_1x2", "speedup_vs_1x1")  # torchvision resnet18(num_classes=10): the vector a round all-reduces


def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from lightning.pytorch import Callback

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engines import _no_log_step, make_task, timed_trainer

    from lightning_fedhet import FedAvg, FederatedDataModule, FedHetDDPStrategy, FedHetStrategy, UniformSample
    from lightning_fedhet.classifier import Classifier

    if args.procs == 1:
        torch.set_num_threads(args.threads)
    task = make_task(args.task)
    torch.manual_seed(0)
    model = Classifier(task.model, lr=task.lr, model_kwargs=task.model_kwargs)
    model.training_step = _no_log_step.__get__(model)
    data = FederatedDataModule(task.dataset, task.client_indices, batch_size=task.batch_size)
    settings = dict(
        algorithm=FedAvg(),
        participation=UniformSample(task.clients_per_round),
        local_steps=task.local_steps,
        engine=args.engine,
    )
    marks: list[float] = []
    cpu_marks: list[float] = []

    class Clock(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            marks.append(time.perf_counter())
            cpu_marks.append(time.process_time())  # this process's CPU seconds (all its threads)

    if args.procs == 1:
        strategy, devices = FedHetStrategy(**settings), 1
    else:
        strategy, devices = FedHetDDPStrategy(**settings), args.procs
    trainer = timed_trainer(args.rounds, Clock(), strategy=strategy, accelerator="cpu", devices=devices)
    trainer.fit(model, datamodule=data)
    cpu = (cpu_marks[-1] - cpu_marks[0]) / (len(cpu_marks) - 1)
    out = {
        "s_per_round": (marks[-1] - marks[0]) / (len(marks) - 1),
        "cpu_s_per_round": [cpu],
        "threads": torch.get_num_threads(),
        "d": int(strategy.global_params.numel()),
    }
    if args.procs > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, cpu)
        out["cpu_s_per_round"] = every
        out["merge_s_per_round"] = strategy.comm.merge_seconds / max(strategy.comm.merges, 1)
        out["allreduce_s"] = {"model": _allreduce_time(out["d"]), "resnet18": _allreduce_time(RESNET18_PARAMS)}
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(out))
        dist.barrier()
        dist.destroy_process_group()  # a clean exit on every process
        return
    Path(args.out).write_text(json.dumps(out))


def _allreduce_time(numel: int, repeats: int = 5) -> float:
    import torch
    import torch.distributed as dist

    vector = torch.zeros(numel)
    dist.all_reduce(vector)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(vector)
        times.append(time.perf_counter() - start)
    return min(times)


def run(task: str, engine: str, procs: int, threads: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
            env.pop(key, None)
        command = [sys.executable, __file__, "--child", "--task", task, "--engine", engine]
        command += ["--procs", str(procs), "--threads", str(threads), "--rounds", str(rounds), "--out", str(out)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        if not out.exists():
            raise RuntimeError(f"{task}/{engine}/{procs} processes failed:\n{proc.stderr[-4000:]}")
        if proc.returncode != 0:  # the result was written; report a failure at exit without discarding it
            print(f"  note: {task}/{engine}/{procs}x{threads} exited with code {proc.returncode} after its result")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="all", choices=["B1", "B2", "all"])
    parser.add_argument("--engines", default="sequential,vmap")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="sequential", help=argparse.SUPPRESS)
    parser.add_argument("--procs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    tasks = ["B1", "B2"] if args.task == "all" else [args.task]
    layouts = [(1, 2), (2, 1), (1, 1)]  # (processes, threads per process)
    configs = [(t, e, p, n) for t in tasks for e in args.engines.split(",") for p, n in layouts]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    started = time.strftime("%Y-%m-%d %H:%M")
    for repeat in range(args.repeats):
        for config in configs:  # interleaved: load from other programs hits every configuration alike
            runs[config].append(run(*config, args.rounds))
            r = runs[config][-1]
            print(f"repeat {repeat}: {config[0]} {config[1]:<10} {config[2]}x{config[3]}: "
                  f"{r['s_per_round']:.4f} s/round", flush=True)
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "started": started,
        "load_average_at_end": os.getloadavg(),
        "rounds": args.rounds,
        "repeats": args.repeats,
        "rows": [],
    }
    print(f"\n{'task':<5}{'engine':<12}{'1x2 s/round':>20}{'2x1 s/round':>20}{'1x1 s/round':>20}"
          f"{'2x1 vs 1x2':>14}{'2x1 vs 1x1':>14}   (min/median)")
    for task in tasks:
        for engine in args.engines.split(","):
            times = {f"{p}x{n}": [r["s_per_round"] for r in runs[(task, engine, p, n)]] for p, n in layouts}
            stats = {key: {"min": min(v), "median": statistics.median(v), "all": v} for key, v in times.items()}
            two = runs[(task, engine, 2, 1)]
            row = {
                "task": task,
                "engine": engine,
                "s_per_round": stats,
                "speedup_vs_1x2": {k: stats["1x2"][k] / stats["2x1"][k] for k in ("min", "median")},
                "speedup_vs_1x1": {k: stats["1x1"][k] / stats["2x1"][k] for k in ("min", "median")},
                "d": two[0]["d"],
                "allreduce_s": {key: min(r["allreduce_s"][key] for r in two) for key in ("model", "resnet18")},
                "merge_s_per_round": [r.get("merge_s_per_round") for r in two],
                # CPU seconds per round: the busiest process, and all processes together (medians over repeats)
                "cpu_s_per_round": {
                    f"{p}x{n}": {
                        "max_process": statistics.median(max(r["cpu_s_per_round"]) for r in layout_runs),
                        "all_processes": statistics.median(sum(r["cpu_s_per_round"]) for r in layout_runs),
                    }
                    for p, n in layouts
                    for layout_runs in [runs[(task, engine, p, n)]]
                },
            }
            cpu = row["cpu_s_per_round"]
            # what 2 dedicated cores would give if waiting cost nothing: the busiest process's CPU time per round
            row["dedicated_core_estimate_vs_1x1"] = cpu["1x1"]["max_process"] / cpu["2x1"]["max_process"]
            row["cpu_overhead_2x1_vs_1x1"] = cpu["2x1"]["all_processes"] / cpu["1x1"]["all_processes"]
            results["rows"].append(row)
            cells = "".join(f"{stats[k]['min']:>10.4f}/{stats[k]['median']:<9.4f}" for k in ("1x2", "2x1", "1x1"))
            ups = "".join(f"{row[k]['min']:>7.2f}/{row[k]['median']:<6.2f}" for k in SPEEDUPS)
            print(f"{task:<5}{engine:<12}{cells}{ups}")
            print("      CPU s/round (busiest process): " + ", ".join(
                f"{k} {v['max_process']:.4f}" for k, v in cpu.items()) +
                f"; 2x1 CPU total / 1x1: {row['cpu_overhead_2x1_vs_1x1']:.2f}; "
                f"dedicated-core estimate 2x1 vs 1x1: {row['dedicated_core_estimate_vs_1x1']:.2f}")
            print(f"      all-reduce (gloo, 2 processes): d={row['d']}: {row['allreduce_s']['model'] * 1e3:.3f} ms; "
                  f"ResNet-18 ({RESNET18_PARAMS} floats): {row['allreduce_s']['resnet18'] * 1e3:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
