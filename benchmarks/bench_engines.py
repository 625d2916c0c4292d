"""Speed of the same FedAvg work under different executors, run side by side in one process.

    python benchmarks/bench_engines.py [--task B1|B2|all] [--rounds 30] [--repeats 3] [--json out.json]

Executors (identical clients, batches and number of optimizer steps):

* ``lean``        a minimal hand-written PyTorch loop (copy global weights in, K SGD steps per client, average deltas);
* ``sequential``  ``FedHetStrategy(engine="sequential")`` inside ``Trainer.fit``;
* ``vmap``        ``FedHetStrategy(engine="vmap")``;
* ``vmap compiled`` ``FedHetStrategy(engine="vmap", compile=True)``, where this version of the strategy has the option;
* ``cohort eager`` / ``cohort compiled``  ``VmapCohort`` driven directly by a hand-written round loop (no Lightning),
  ``compile=False`` / ``True``: the engine's own cost without Lightning's per-step loop;
* ``lightning``   Lightning's own loop with no federation: one model, the same mini-batches and number of optimizer
  steps as one client after another, one Lightning step per mini-batch: the floor of any engine that runs each
  local step as a Lightning step (the sequential engine);
* ``central``     the centralised limit: one model, batch = cohort x batch size, the same number of optimizer steps;
* ``flower``      Flower's simulation engine, when ``flwr[simulation]`` is installed (``pip install -e .[bench]``).

Tasks: B1 = synthetic LEAF logistic regression (N=100, 20 clients/round, K=5, batch 32);
B2 = Fashion-MNIST CNN (N=100, Dirichlet 0.5, 10 clients/round, K=5, batch 32);
C1 = Fashion-MNIST CNN (N=150, Dirichlet 0.5, 12 clients/round, K=6, batch 20), the shape of a study's CNN cell.

``--executors a,b,...`` runs a subset (the ratios that need a missing executor are left out).

``--seeds S`` adds many seeds in one run: ``seeds xS`` is :func:`lightning_fedhet.multiseed.fit_seeds` with ``S``
seeds of the task (vmap cohorts of every seed stacked, ``compile`` as ``--seeds-compile``), against ``S`` separate
``FedHetStrategy(engine="vmap")`` runs (``separate xS``: ``S`` times one run's time per round). The result is seeds x
rounds per second of each.

``--compare docs/performance.json`` compares this run's ratios with those of the newest entry of that file that
measured the same task, and flags every ratio more than 10 % worse (``--tolerance``); the exit status is 1 when one
is. Ratios are taken side by side within one run, so they say more than absolute times on a shared machine.

``--cpu-time`` times rounds in this process's CPU time instead of wall-clock time (for a machine shared with other
processes; Flower, which runs in other processes, is then not comparable and is left out of the ratios' meaning).

Time per round is measured between the end of round 1 and the end of the last round (set-up and the first,
warm-up round excluded; for compiled executors the first round holds the compilation, reported separately as
``first_round_s``); the best of ``--repeats`` runs is kept. Ratios, not absolute times, are the result.

``--memory`` measures, in a fresh process per cohort size C = 10, 100, 1,000 (B1 model, SGD with momentum, random
inputs created beforehand and not counted), the peak resident memory added by one vmap round over the resident memory
before it (Linux: the peak is reset through ``/proc/self/clear_refs`` after three warm-up rounds, of 1 client, or of
C clients for the steady state of a long run; compilation and library loading are excluded).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer
from lightning_fedhet.model_zoo import create

from lightning_fedhet import Dirichlet, FedAvg, FederatedDataModule, FedHetStrategy, UniformSample
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import fashion_mnist, synthetic_leaf
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.engines.vmap import VmapCohort


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


TASKS = ("B1", "B2", "C1")
#: what times the rounds: wall-clock seconds, or this process's CPU seconds (``--cpu-time``, for a shared machine:
#: with one torch thread a run's CPU time counts its own work, not the time other processes held the cores)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = ["wall"]


def clock() -> float:
    return CLOCKS[_clock[0]]()


def make_task(name: str) -> Task:
    if name == "B1":
        train, _, idx, _ = synthetic_leaf(num_clients=100, gamma=0.5, delta=0.5, seed=0)
        return Task("B1", "logistic_regression", {"in_features": 60}, train, idx, clients_per_round=20)
    train, _ = fashion_mnist()
    labels = train.tensors[1].numpy()
    if name == "C1":
        idx = Dirichlet(0.5).split(labels, 150, seed=0)
        return Task("C1", "fmnist_cnn", {}, train, idx, clients_per_round=12, local_steps=6, batch_size=20)
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
        self.marks.append(clock())


def timed_trainer(rounds: int, clock: Callback, **kwargs) -> Trainer:
    """A ``Trainer`` of ``rounds`` epochs with nothing but ``clock`` around the training: no validation, logger,
    progress bar, checkpoint or model summary (``kwargs``: the strategy, devices, ...)."""
    return Trainer(
        max_epochs=rounds,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
        **kwargs,
    )


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
        marks.append(clock())
    return per_round(marks)


class _Plain(pl.LightningModule):
    """The task's model with the lean loop's training step (no per-step logging)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


class _PlainWithOptimizer(_Plain):
    def __init__(self, net: torch.nn.Module, lr: float) -> None:
        super().__init__(net)
        self.lr = lr

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class _RoundsOfBatches:
    """Yields round ``e``'s mini-batches (every client's local steps, one after another) at the ``e``-th pass."""

    def __init__(self, task: Task, rounds: int) -> None:
        x_all, y_all = task.dataset.tensors
        self.rounds = [
            [(x_all[torch.from_numpy(idx)], y_all[torch.from_numpy(idx)]) for _, batches in cohort for idx in batches]
            for cohort in schedule(task, rounds)
        ]
        self.passes = 0

    def __len__(self) -> int:
        return len(self.rounds[0])

    def __iter__(self):
        batches = self.rounds[min(self.passes, len(self.rounds) - 1)]
        self.passes += 1
        return iter(batches)


def run_lightning(task: Task, rounds: int) -> float:
    """Lightning's loop alone (no federation, no weight resets): same batches and steps as the sequential engine."""
    torch.manual_seed(0)
    module = _PlainWithOptimizer(create(task.model, **task.model_kwargs), task.lr)
    clock = _RoundClock()
    timed_trainer(rounds, clock).fit(module, train_dataloaders=_RoundsOfBatches(task, rounds))
    return per_round(clock.marks)


def run_cohort(task: Task, rounds: int, compile: bool | str) -> tuple[float, float]:
    """``VmapCohort`` in a hand-written round loop: (s per round, seconds of the first round)."""
    torch.manual_seed(0)
    module = _Plain(create(task.model, **task.model_kwargs))
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=task.lr)
    x_all, y_all = task.dataset.tensors
    global_vec = torch.nn.utils.parameters_to_vector(params).detach().clone()
    start = clock()
    marks = []
    for cohort_plan in schedule(task, rounds):
        torch.nn.utils.vector_to_parameters(global_vec.clone(), params)
        clients = [c for c, _ in cohort_plan]
        cohort = VmapCohort(module, opt, clients, np.full(len(clients), task.local_steps), compile=compile)
        for k in range(task.local_steps):
            index = torch.from_numpy(np.stack([batches[k] for _, batches in cohort_plan]))
            cohort.step((x_all[index], y_all[index]), k)
        global_vec = cohort.flat_params().mean(0)
        marks.append(clock())
    return per_round(marks), marks[0] - start


def _strategy_parts(task: Task, seed: int, engine: str, **options):
    """The task's module, datamodule and strategy for one seed (what a single run and each stacked seed use)."""
    model = Classifier(task.model, lr=task.lr, model_kwargs=task.model_kwargs)
    model.training_step = _no_log_step.__get__(model)  # same work as the lean loop: no per-step logging
    dm = FederatedDataModule(task.dataset, task.client_indices, batch_size=task.batch_size)
    strategy = FedHetStrategy(
        algorithm=FedAvg(),
        participation=UniformSample(task.clients_per_round),
        local_steps=task.local_steps,
        engine=engine,
        seed=seed,
        **options,
    )
    return model, dm, strategy


def run_strategy(task: Task, rounds: int, engine: str, seed: int = 0, **options) -> float:
    torch.manual_seed(seed)
    model, dm, strategy = _strategy_parts(task, seed, engine, **options)
    clock = _RoundClock()
    timed_trainer(rounds, clock, strategy=strategy).fit(model, datamodule=dm)
    return per_round(clock.marks)


def run_seeds(task: Task, rounds: int, num_seeds: int, compile: bool, device: str = "cpu") -> tuple[float, float]:
    """``fit_seeds`` with ``num_seeds`` seeds of the task on ``device``: (s per round of all seeds together, first
    round s)."""
    from lightning_fedhet.multiseed import fit_seeds

    marks: list[float] = []

    def mark(module, seed, round) -> dict:
        if seed == 0:
            sync(device)
            marks.append(clock())
        return {}

    start = clock()
    options = {"compile": True} if compile else {}
    fit_seeds(
        lambda seed: _strategy_parts(task, seed, "vmap", **options),
        range(num_seeds),
        rounds,
        eval_every=1,
        evaluate=mark,
        device=device,
    )
    return per_round(marks), marks[0] - start


def _no_log_step(self, batch, batch_idx):
    x, y = batch
    return F.cross_entropy(self(x), y)


def run_central(task: Task, rounds: int, device: str = "cpu") -> float:
    """One model, batch = cohort x batch size, K steps per round: the physical limit for the same samples (on
    ``device``, the whole data set there beforehand)."""
    torch.manual_seed(0)
    model = create(task.model, **task.model_kwargs).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=task.lr)
    x_all, y_all = (t.to(device) for t in task.dataset.tensors)
    marks = []
    for cohort in schedule(task, rounds):
        for k in range(task.local_steps):
            index = torch.from_numpy(np.concatenate([batches[k] for _, batches in cohort])).to(device)
            opt.zero_grad()
            F.cross_entropy(model(x_all[index]), y_all[index]).backward()
            opt.step()
        sync(device)
        marks.append(clock())
    return per_round(marks)


def sync(device: str | torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA runs asynchronously), so that the clock read next counts it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_child(clients: int, compile: bool, warm_clients: int) -> None:
    """One process, one cohort size: print the peak resident memory a vmap round adds (B1 shapes, random data).

    The warm-up rounds have ``warm_clients`` clients: 1 measures what a round of ``clients`` needs beyond a tiny
    one; ``clients`` measures what a later round of the same size adds (allocator reuse, leaks).
    """
    torch.manual_seed(0)
    module = _Plain(create("logistic_regression", in_features=60))
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    steps, batch = 5, 32
    data = [(torch.randn(clients, batch, 60), torch.randint(0, 10, (clients, batch))) for _ in range(steps)]

    def one_round(size: int) -> None:
        cohort = VmapCohort(module, opt, range(size), np.full(size, steps), compile=compile)
        for k in range(steps):
            cohort.step((data[k][0][:size], data[k][1][:size]), k)
        cohort.flat_params()

    for _ in range(3):  # warm-up: library loading, the allocator's first pages, compilation
        one_round(warm_clients)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident set size (VmHWM)
    before = _rss_kib("VmRSS")
    one_round(clients)
    peak = _rss_kib("VmHWM")
    num_params = sum(p.numel() for p in module.parameters())
    print(json.dumps({"clients": clients, "compile": compile, "warm_clients": warm_clients,
                      "peak_growth_mib": (peak - before) / 1024,
                      "stacked_params_mib": clients * num_params * 4 / 2**20,
                      "batch_mib": steps * clients * batch * 61 * 4 / 2**20}))


def memory_table() -> list[dict]:
    rows = []
    for compile, warm in ((False, "1"), (False, "same"), (True, "same")):
        for clients in (10, 100, 1000):
            warm_clients = str(clients) if warm == "same" else warm
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", str(clients), "--warm-clients", warm_clients]
                + (["--compile"] if compile else []),
                capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                print(out.stderr[-2000:])
                continue
            rows.append(json.loads(lines[-1]))
            print(rows[-1], flush=True)
    return rows


#: ratio name -> (numerator, denominator, "higher" or "lower" is better); a ratio is reported when both executors ran
RATIOS = {
    "sequential/lean (time)": ("sequential", "lean", "lower"),
    "lightning/lean (time): Lightning's loop alone": ("lightning", "lean", "lower"),
    "sequential/lightning (time): the federation's own cost": ("sequential", "lightning", "lower"),
    "vmap/lean (time)": ("vmap", "lean", "lower"),
    "sequential/vmap (speed-up of vmap)": ("sequential", "vmap", "higher"),
    "vmap samples/s / central samples/s": ("central", "vmap", "higher"),
    "cohort eager samples/s / central samples/s": ("central", "cohort eager", "higher"),
    "cohort compiled samples/s / central samples/s": ("central", "cohort compiled", "higher"),
    "cohort eager/cohort compiled (speed-up of compile)": ("cohort eager", "cohort compiled", "higher"),
    "sequential/cohort compiled": ("sequential", "cohort compiled", "higher"),
    "vmap compiled samples/s / central samples/s": ("central", "vmap compiled", "higher"),
    "sequential/vmap compiled": ("sequential", "vmap compiled", "higher"),
    "flower/sequential (time)": ("flower", "sequential", "higher"),
    "flower/cohort compiled (time)": ("flower", "cohort compiled", "higher"),
    "flower/vmap (time)": ("flower", "vmap", "higher"),
    "flower/vmap compiled (time)": ("flower", "vmap compiled", "higher"),
}


def compute_ratios(times: dict[str, float]) -> tuple[dict[str, float], dict[str, str]]:
    """The ratios whose executors ran, and which direction is better for each."""
    ratios, better = {}, {}
    for name, (num, den, direction) in RATIOS.items():
        if num in times and den in times:
            ratios[name], better[name] = times[num] / times[den], direction
    return ratios, better


def compare(results: dict, baseline_file: str, tolerance: float) -> list[str]:
    """Lines flagging every ratio of ``results`` more than ``tolerance`` worse than in the newest entry of
    ``baseline_file`` (``docs/performance.json``) that measured the same task; ``better`` says each ratio's good
    direction (entries without it take this run's)."""
    with open(baseline_file) as f:
        committed = json.load(f)
    flags, report = [], []
    for task, now in results["tasks"].items():
        entry, base = _newest_with(committed, task)
        if base is None:
            report.append(f"{task}: no committed measurement to compare with")
            continue
        better = {**now.get("better", {}), **base.get("better", {})}
        for name, value in now["ratios"].items():
            if name not in base.get("ratios", {}) or name not in better:
                continue
            old = base["ratios"][name]
            change = value / old - 1 if better[name] == "higher" else old / value - 1  # < 0: worse
            line = f"{task} {name}: {old:.3f} ({entry}) -> {value:.3f} ({change:+.0%})"
            report.append(line)
            if change < -tolerance:
                flags.append("WORSE " + line)
    print("\ncomparison with " + baseline_file)
    for line in report:
        print("  " + line)
    for line in flags:
        print(line)
    return flags


def _newest_with(committed: dict, task: str) -> tuple[str | None, dict | None]:
    """The last entry (file order is oldest first) with a measurement of ``task``."""
    found = (None, None)
    for key, entry in committed.items():
        runs = [entry] if "tasks" in entry else [v for v in entry.values() if isinstance(v, dict) and "tasks" in v]
        for run in runs:
            if task in run["tasks"] and "ratios" in run["tasks"][task]:
                found = (key, run["tasks"][task])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="all", help=f"one of {TASKS}, a comma-separated list, 'all' (B1,B2) or none")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--executors", default=None, help="comma-separated subset of the executors (default: all)")
    parser.add_argument("--seeds", type=int, default=0, help="also time S seeds in one run against S separate runs")
    parser.add_argument("--seeds-compile", action="store_true", help="compile the stacked seeds' cohort")
    parser.add_argument("--cpu-time", action="store_true", help="time rounds in process CPU time (shared machine)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--compare", default=None, help="a performance.json to compare this run's ratios with")
    parser.add_argument("--tolerance", type=float, default=0.10, help="flag ratios worse by more than this")
    parser.add_argument("--flower-python", default=None, help="python of an environment with flwr[simulation]")
    parser.add_argument("--memory", action="store_true", help="peak RSS of a vmap round for C = 10, 100, 1000")
    parser.add_argument("--rss-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm-clients", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child is not None:
        rss_child(args.rss_child, args.compile, args.warm_clients)
        return
    _clock[0] = "cpu" if args.cpu_time else "wall"
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}",
        "command": " ".join(sys.argv),
        "clock": _clock[0],
        "tasks": {},
    }
    strategy_compiles = "compile" in inspect.signature(FedHetStrategy.__init__).parameters
    tasks = {"all": ["B1", "B2"], "none": []}.get(args.task, args.task.split(","))
    for name in tasks:
        if name not in TASKS:
            raise SystemExit(f"--task must name tasks among {TASKS}, got {name!r}")
        task = make_task(name)
        runners = {
            "lean": lambda task=task: run_lean(task, args.rounds),
            "lightning": lambda task=task: run_lightning(task, args.rounds),
            "sequential": lambda task=task: run_strategy(task, args.rounds, "sequential"),
            "vmap": lambda task=task: run_strategy(task, args.rounds, "vmap"),
            "cohort eager": lambda task=task: run_cohort(task, args.rounds, False),
            "cohort compiled": lambda task=task: run_cohort(task, args.rounds, True),
            "central": lambda task=task: run_central(task, args.rounds),
        }
        if strategy_compiles:
            runners["vmap compiled"] = lambda task=task: run_strategy(task, args.rounds, "vmap", compile=True)
        if args.seeds:
            runners["seeds"] = lambda task=task: run_seeds(task, args.rounds, args.seeds, args.seeds_compile)
        if args.executors:
            wanted = args.executors.split(",")
            unknown = sorted(set(wanted) - set(runners) - {"flower"})
            if unknown:
                raise SystemExit(f"--executors: unknown {unknown}; known: {sorted(runners)}")
            runners = {key: runner for key, runner in runners.items() if key in wanted}
        times, first_round = {}, {}
        for _ in range(args.repeats):
            for key, runner in runners.items():  # interleaved, so load changes hit every executor alike
                out = runner()
                if isinstance(out, tuple):
                    out, first = out
                    first_round[key] = min(first_round.get(key, float("inf")), first)
                times[key] = min(times.get(key, float("inf")), out)
        flower = None
        if args.executors is None or "flower" in args.executors.split(","):
            flower = run_flower(task, args.rounds, args.flower_python)
        if flower is not None:
            times["flower"] = flower
        row = {
            key: {"s_per_round": t, "rounds_per_s": 1 / t, "samples_per_s": samples_per_round(task) / t}
            for key, t in times.items()
        }
        for key, first in first_round.items():
            row[key]["first_round_s"] = first
        ratios, better = compute_ratios(times)
        if "seeds" in times:
            # seeds x rounds per second: S seeds per stacked round against one seed per round of a separate run
            row["seeds"]["seeds_x_rounds_per_s"] = args.seeds / times["seeds"]
            for key in ("vmap", "vmap compiled", "sequential"):
                if key in times:
                    row[key]["seeds_x_rounds_per_s"] = 1 / times[key]
                    ratio = f"seeds/separate {key} (seeds x rounds per s)"
                    ratios[ratio], better[ratio] = times[key] * args.seeds / times["seeds"], "higher"
        results["tasks"][name] = {
            "per_executor": row,
            "ratios": ratios,
            "better": better,
            "flower": "flwr not installed" if flower is None else "ok",
        }
        if args.seeds:
            results["tasks"][name]["seeds"] = {"S": args.seeds, "compile": args.seeds_compile}
        print(
            f"\n{name}: {task.model}, N={len(task.client_indices)}, {task.clients_per_round} clients/round, "
            f"K={task.local_steps}, batch {task.batch_size}, {args.rounds} rounds, best of {args.repeats}"
        )
        print(f"{'executor':<16}{'s/round':>10}{'rounds/s':>10}{'samples/s':>12}{'first round s':>15}")
        for key, r in row.items():
            first = f"{r['first_round_s']:.2f}" if "first_round_s" in r else ""
            print(f"{key:<16}{r['s_per_round']:>10.4f}{r['rounds_per_s']:>10.1f}{r['samples_per_s']:>12.0f}{first:>15}")
        for key, value in ratios.items():
            print(f"  {key}: {value:.2f}")
        if flower is None:
            print("  flower: not run (pip install -e .[bench], or --flower-python)")
        if not strategy_compiles:
            print("  vmap compiled: this FedHetStrategy has no compile option; the cohort rows measure the engine")
    if args.memory:
        results["memory"] = memory_table()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.compare and compare(results, args.compare, args.tolerance):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
