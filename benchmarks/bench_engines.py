"""Speed of the same FedAvg work under different executors, run side by side in one process.

    python benchmarks/bench_engines.py [--task B1|B2|all] [--rounds 30] [--repeats 3] [--json out.json]

Executors (identical clients, batches and number of optimizer steps):

* ``lean``        a minimal hand-written PyTorch loop (copy global weights in, K SGD steps per client, average deltas);
* ``sequential``  ``FedHetStrategy(engine="sequential")`` inside ``Trainer.fit``;
* ``vmap``        ``FedHetStrategy(engine="vmap")``;
* ``central``     the centralised limit: one model, batch = cohort x batch size, the same number of optimizer steps;
* ``flower``      Flower's simulation engine, when ``flwr[simulation]`` is installed (``pip install -e .[bench]``).

Tasks: B1 = synthetic LEAF logistic regression (N=100, 20 clients/round, K=5, batch 32);
B2 = Fashion-MNIST CNN (N=100, Dirichlet 0.5, 10 clients/round, K=5, batch 32).

Time per round is measured between the end of round 1 and the end of the last round (set-up and the first,
warm-up round excluded); the best of ``--repeats`` runs is kept. Ratios, not absolute times, are the result.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning_fedhet.model_zoo import create

from lightning_fedhet import Dirichlet, FedAvg, FederatedDataModule, FedHetStrategy, UniformSample
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import fashion_mnist, synthetic_leaf
from lightning_fedhet.data.streams import ClientStreams


@dataclass
class Task:
    name: str
    model: str
    model_kwargs: dict
    dataset: object
    client_indices: list
    clients_per_round: int
    local_steps: int = 5
    batch_size: int = 32
    lr: float = 0.05


def make_task(name: str) -> Task:
    if name == "B1":
        train, _, idx, _ = synthetic_leaf(num_clients=100, gamma=0.5, delta=0.5, seed=0)
        return Task("B1", "logistic_regression", {"in_features": 60}, train, idx, clients_per_round=20)
    train, _ = fashion_mnist()
    labels = train.tensors[1].numpy()
    idx = Dirichlet(0.5).split(labels, 100, seed=0)
    return Task("B2", "fmnist_cnn", {}, train, idx, clients_per_round=10)


def schedule(task: Task, rounds: int, seed: int = 0):
    """The rounds' cohorts and batches, drawn exactly as FedHetStrategy draws them."""
    participation = UniformSample(task.clients_per_round)
    participation.setup(len(task.client_indices), seed)
    streams = ClientStreams(task.dataset, task.client_indices, task.batch_size, seed=seed)
    plan = []
    for t in range(rounds):
        clients = torch.nonzero(participation.sample(t)).flatten().tolist()
        plan.append([(c, streams.batch_indices(t, c, task.local_steps)) for c in clients])
    return plan


class _RoundClock(Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.marks.append(time.perf_counter())


def per_round(marks: list[float]) -> float:
    return (marks[-1] - marks[0]) / (len(marks) - 1)


def run_lean(task: Task, rounds: int) -> float:
    torch.manual_seed(0)
    model = create(task.model, **task.model_kwargs)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=task.lr)
    x_all, y_all = task.dataset.tensors
    global_vec = torch.nn.utils.parameters_to_vector(params).detach().clone()
    marks = []
    for cohort in schedule(task, rounds):
        total = torch.zeros_like(global_vec)
        for _, batches in cohort:
            torch.nn.utils.vector_to_parameters(global_vec.clone(), params)
            opt.state.clear()
            for idx in batches:
                index = torch.from_numpy(idx)
                opt.zero_grad()
                F.cross_entropy(model(x_all[index]), y_all[index]).backward()
                opt.step()
            total += torch.nn.utils.parameters_to_vector(params).detach() - global_vec
        global_vec = global_vec + total / len(cohort)
        marks.append(time.perf_counter())
    return per_round(marks)


def run_strategy(task: Task, rounds: int, engine: str) -> float:
    torch.manual_seed(0)
    model = Classifier(task.model, lr=task.lr, model_kwargs=task.model_kwargs)
    model.training_step = _no_log_step.__get__(model)  # same work as the lean loop: no per-step logging
    dm = FederatedDataModule(task.dataset, task.client_indices, batch_size=task.batch_size)
    strategy = FedHetStrategy(
        algorithm=FedAvg(),
        participation=UniformSample(task.clients_per_round),
        local_steps=task.local_steps,
        engine=engine,
    )
    clock = _RoundClock()
    trainer = Trainer(
        strategy=strategy,
        max_epochs=rounds,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(model, datamodule=dm)
    return per_round(clock.marks)


def _no_log_step(self, batch, batch_idx):
    x, y = batch
    return F.cross_entropy(self(x), y)


def run_central(task: Task, rounds: int) -> float:
    """One model, batch = cohort x batch size, K steps per round: the physical limit for the same samples."""
    torch.manual_seed(0)
    model = create(task.model, **task.model_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=task.lr)
    x_all, y_all = task.dataset.tensors
    marks = []
    for cohort in schedule(task, rounds):
        for k in range(task.local_steps):
            index = torch.from_numpy(np.concatenate([batches[k] for _, batches in cohort]))
            opt.zero_grad()
            F.cross_entropy(model(x_all[index]), y_all[index]).backward()
            opt.step()
        marks.append(time.perf_counter())
    return per_round(marks)


def run_flower(task: Task, rounds: int, python: str | None) -> float | None:
    """Seconds per round of Flower's simulation engine (``flower_baseline.py`` in a subprocess), or None."""
    import subprocess
    import sys
    from pathlib import Path

    python = python or sys.executable
    probe = subprocess.run([python, "-c", "import flwr.simulation"], capture_output=True)
    if probe.returncode != 0:
        return None
    script = Path(__file__).resolve().parent / "flower_baseline.py"
    out = subprocess.run(
        [python, str(script), "--task", task.name, "--rounds", str(max(3, rounds))],
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        print(out.stderr[-2000:])
        return None
    return json.loads(lines[-1])["s_per_round"]


def samples_per_round(task: Task) -> int:
    return task.clients_per_round * task.local_steps * task.batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="all", choices=["B1", "B2", "all"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--flower-python", default=None, help="python of an environment with flwr[simulation]")
    args = parser.parse_args()
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}",
        "tasks": {},
    }
    for name in ["B1", "B2"] if args.task == "all" else [args.task]:
        task = make_task(name)
        runners = {
            "lean": lambda task=task: run_lean(task, args.rounds),
            "sequential": lambda task=task: run_strategy(task, args.rounds, "sequential"),
            "vmap": lambda task=task: run_strategy(task, args.rounds, "vmap"),
            "central": lambda task=task: run_central(task, args.rounds),
        }
        times = {}
        for _ in range(args.repeats):
            for key, runner in runners.items():  # interleaved, so load changes hit every executor alike
                times[key] = min(times.get(key, float("inf")), runner())
        flower = run_flower(task, args.rounds, args.flower_python)
        if flower is not None:
            times["flower"] = flower
        row = {
            key: {"s_per_round": t, "rounds_per_s": 1 / t, "samples_per_s": samples_per_round(task) / t}
            for key, t in times.items()
        }
        ratios = {
            "sequential/lean (time)": times["sequential"] / times["lean"],
            "vmap/lean (time)": times["vmap"] / times["lean"],
            "sequential/vmap (speed-up of vmap)": times["sequential"] / times["vmap"],
            "vmap samples/s / central samples/s": times["central"] / times["vmap"],
        }
        if "flower" in times:
            ratios["flower/sequential (time)"] = times["flower"] / times["sequential"]
        results["tasks"][name] = {
            "per_executor": row,
            "ratios": ratios,
            "flower": "flwr not installed" if flower is None else "ok",
        }
        print(
            f"\n{name}: {task.model}, N={len(task.client_indices)}, {task.clients_per_round} clients/round, "
            f"K={task.local_steps}, batch {task.batch_size}, {args.rounds} rounds, best of {args.repeats}"
        )
        print(f"{'executor':<12}{'s/round':>10}{'rounds/s':>10}{'samples/s':>12}")
        for key, r in row.items():
            print(f"{key:<12}{r['s_per_round']:>10.4f}{r['rounds_per_s']:>10.1f}{r['samples_per_s']:>12.0f}")
        for key, value in ratios.items():
            print(f"  {key}: {value:.2f}")
        if flower is None:
            print("  flower: not available (pip install -e .[bench], or --flower-python)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
