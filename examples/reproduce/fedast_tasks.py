"""FedAST vs synchronous simultaneous training: simulated time until every task reaches its target.

Reduced-scale version of the FedAST paper's heterogeneous experiment (Askin et al., UAI 2024, §5.2, Figs. 6-7
and App. D.6): several different models train at once on one client pool, each stops at its target accuracy and
its requests (or clients) go to the others. The measured quantity is the simulated time at which the *last* task
reaches its target ("time to train all tasks to completion"). Methods:

================= ================================================================================================
FedAST(D)         ``FedAST(option="D")``: buffered asynchronous, requests re-split every 0.75 M sum(R) updates
                  (paper's sqrt rule), ``R/b`` fixed
FedAST(S)         ``FedAST(option="S")``: same with the uniform, fixed allocation
FedAST no buffer  ``FedAST(option="S", buffer=1)``, server lr scaled down as in the paper (0.038 vs 0.1)
Sync-ST           ``SyncST()``: each round the available clients are split across the tasks, every task waits for
                  all of its clients, FedAvg (server lr 1)
Sync-ST first-k   ``SyncST(first_k=k)``: each task keeps its first k arrivals (the paper's straggler mitigation)
================= ================================================================================================

Tasks (one client pool of N clients; the two Fashion-MNIST tasks share the clients' data):

=========== ============================================ ======================== ==========================
task        model                                        data                     latency c_m (s per step)
=========== ============================================ ======================== ==========================
fmnist_cnn  LeNet-5 (``lenet5_fmnist``, the paper's)      Fashion-MNIST, Dir(0.1)  0.240 (paper: FMNIST)
fmnist_mlp  MLP 784-200-200-10 (``fedast_mlp_mnist``)     Fashion-MNIST, Dir(0.1)  0.148 (paper: MNIST MLP)
synthetic   logistic regression                          synthetic LEAF(0.5,0.5)  0.148 (not in the paper;
                                                                                  the MLP's, an upper bound)
=========== ============================================ ======================== ==========================

Latency: the paper's shifted exponential, ``tau * s_i * (0.5 c_m + Exp(c_m))`` per request, speed groups 25 %
x1.3, 50 % x1, 25 % x0.7. Availability: 30 % of the clients, independently per slot (FedAST) or per round
(Sync-ST). Everything else is in ``--help``; docs/results/fedast.md lists what differs from the paper.

Usage::

    python examples/reproduce/fedast_tasks.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
from _common import default_out, markdown_table, mean_std, quiet, seed_all, setup_torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_fedhet.asynchronous import FedAST, FedASTServer, FedASTStrategy, MultiTaskModule, SyncST, TimeToTarget
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import Dirichlet, FederatedDataModule, fashion_mnist, synthetic_leaf
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import ShiftedExponential

NAME = "fedast"
TASKS = ("fmnist_cnn", "fmnist_mlp", "synthetic")
METHODS = ("FedAST(D)", "FedAST(S)", "FedAST no buffer", "Sync-ST", "Sync-ST first-k")
STEP_TIME = {"fmnist_cnn": 0.240, "fmnist_mlp": 0.148, "synthetic": 0.148}
MODEL = {"fmnist_cnn": "lenet5_fmnist", "fmnist_mlp": "fedast_mlp_mnist", "synthetic": "logistic_regression"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--clients", type=int, default=200, help="N (paper: 1000)")
    p.add_argument("--availability", type=float, default=0.3, help="fraction of available clients (paper: 0.3)")
    p.add_argument("--slot", type=float, default=3.0, help="seconds per availability slot (FedAST)")
    p.add_argument("--local-steps", type=int, default=9, help="tau (paper: 27 = 3 epochs of 300 samples)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--requests", type=int, default=20, help="initial R_m per task (paper demo: 96)")
    p.add_argument("--buffer", type=int, default=2, help="initial b_m (paper demo: 3, R/b = 32)")
    p.add_argument("--server-lr", type=float, default=0.3, help="FedAST eta_s (paper: 0.1 at R/b = 32)")
    p.add_argument("--nobuffer-lr", type=float, default=0.17,
                   help="no-buffer eta_s (paper: 0.038 = 1.14 x 0.1/3 per update; here 1.14 x 0.3/2)")
    p.add_argument("--first-k", type=int, default=6, help="Sync-ST first-k (paper: 30 of ~75 per task)")
    p.add_argument("--targets", type=float, nargs=3, default=[0.65, 0.70, 0.40], metavar=TASKS,
                   help="target validation accuracy per task")
    p.add_argument("--client-lr", type=float, nargs=3, default=[0.06, 0.1, 0.01], metavar=TASKS,
                   help="client SGD learning rates (paper: FMNIST 0.06, MNIST 0.1; synthetic: ours)")
    p.add_argument("--weight-decay", type=float, default=3e-4)
    p.add_argument("--fedast-eval-every", type=int, default=12,
                   help="FedAST validates every this many server steps (paper: every 4 rounds of each task)")
    p.add_argument("--max-sim-time", type=float, default=500.0, help="give up after this many seconds")
    p.add_argument("--val-size", type=int, default=2000, help="Fashion-MNIST test images used for validation")
    p.add_argument("--train-size", type=int, default=None, help="use only this many Fashion-MNIST images")
    p.add_argument("--out", default=default_out(NAME))
    p.add_argument("--merge", nargs="+", default=None, metavar="RUNS_JSON",
                   help="write the table and plot from runs.json files of earlier invocations (e.g. one per seed)")
    return p.parse_args(argv)


def load_data(args, seed: int) -> dict[str, FederatedDataModule]:
    train, test = fashion_mnist()
    if args.train_size is not None:
        train = TensorDataset(*(t[: args.train_size] for t in train.tensors))
    val = TensorDataset(*(t[: args.val_size] for t in test.tensors))
    fmnist = FederatedDataModule(train, Dirichlet(0.1), num_clients=args.clients, batch_size=args.batch_size,
                                 val_dataset=val, eval_batch_size=1000, seed=seed)
    # both Fashion-MNIST tasks see the same client data (a client holds one data set, two models train on it)
    syn_train, syn_test, syn_idx, _ = synthetic_leaf(args.clients, 0.5, 0.5, seed=seed)
    synthetic = FederatedDataModule(syn_train, syn_idx, batch_size=args.batch_size, val_dataset=syn_test,
                                    eval_batch_size=4096, seed=seed)
    return {"fmnist_cnn": fmnist, "fmnist_mlp": fmnist, "synthetic": synthetic}


def make_module(args, dms) -> MultiTaskModule:
    tasks = {}
    for task, lr in zip(TASKS, args.client_lr):
        kwargs = {"in_features": 60} if task == "synthetic" else {}
        tasks[task] = Classifier(MODEL[task], num_classes=10, lr=lr, weight_decay=args.weight_decay,
                                 model_kwargs=kwargs)
    return MultiTaskModule(tasks, datamodules=dms)


def make_rule(method: str, args):
    if method == "FedAST(D)":
        return FedAST(option="D", requests=args.requests, buffer=args.buffer, server_lr=args.server_lr)
    if method == "FedAST(S)":
        return FedAST(option="S", requests=args.requests, buffer=args.buffer, server_lr=args.server_lr)
    if method == "FedAST no buffer":
        return FedAST(option="S", requests=args.requests, buffer=1, server_lr=args.nobuffer_lr)
    if method == "Sync-ST":
        return SyncST()
    return SyncST(first_k=args.first_k)


class CurveRecorder(Callback):
    """``(sim_time, task, val_acc)`` after every validation run."""

    def __init__(self) -> None:
        self.points: list[tuple[float, str, float]] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        server = trainer.strategy.server
        if trainer.sanity_checking or server is None:
            return
        for task in TASKS:
            key = f"{task}/val_acc"
            if task in server.active_tasks and key in trainer.callback_metrics:
                self.points.append((float(server.clock), task, float(trainer.callback_metrics[key])))


def run_one(method: str, seed: int, args, dms) -> dict:
    seed_all(seed)
    module = make_module(args, dms)
    latency = {t: ShiftedExponential(shift=0.5 * STEP_TIME[t], mean=STEP_TIME[t]) for t in TASKS}
    strategy = FedASTStrategy(make_rule(method, args), participation=Bernoulli(args.availability),
                              latency=latency, local_steps=args.local_steps, slot=args.slot, seed=seed)
    ttt = TimeToTarget(dict(zip(TASKS, args.targets)), max_sim_time=args.max_sim_time)
    curve = CurveRecorder()
    is_sync = method.startswith("Sync")
    trainer = Trainer(
        strategy=strategy, max_epochs=-1, check_val_every_n_epoch=1 if is_sync else args.fedast_eval_every,
        callbacks=[curve, ttt], logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu",
    )
    wall = time.perf_counter()
    trainer.fit(module)
    server = strategy.server
    times = {t: (math.inf if ttt.times[t] is None else ttt.times[t]) for t in TASKS}
    realloc = [r for r in server.reallocations if "skipped" not in r] if isinstance(server, FedASTServer) else []
    return {
        "method": method, "seed": seed, "times": times, "last": max(times.values()),
        "updates": int(trainer.global_step // args.local_steps), "steps": len(server.history),
        "wall": time.perf_counter() - wall, "curve": curve.points,
        "staleness": float(np.mean([s for h in server.history for s in h["staleness"]])),
        "reallocations": [{"sim_time": r["sim_time"], "R": r["R"]} for r in realloc],
    }


def fmt(values, budget: float) -> str:
    """``mean ± std`` over seeds (ddof=1), or which seeds did not reach the target within the budget."""
    values = list(values)
    missed = sum(math.isinf(v) for v in values)
    if not missed:
        m, s = mean_std(values)
        return f"{m:.0f} ± {s:.0f}"
    done = ", ".join(f"{v:.0f}" for v in values if not math.isinf(v))
    return f"{missed}/{len(values)} seeds > {budget:.0f}" + (f" (others: {done})" if done else "")


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    quiet()
    setup_torch(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        runs = [r for path in args.merge for r in json.loads(Path(path).read_text())]
        for r in runs:
            r["times"] = {t: float(v) for t, v in r["times"].items()}
            r["last"] = float(r["last"])
        args.seeds = sorted({r["seed"] for r in runs})
        write_outputs(args, runs, out, sum(r["wall"] for r in runs))
        return runs
    runs: list[dict] = []
    start = time.perf_counter()
    for seed in args.seeds:
        dms = load_data(args, seed)
        for method in args.methods:
            result = run_one(method, seed, args, dms)
            runs.append(result)
            (out / "runs.json").write_text(json.dumps(runs, default=float, indent=1))  # kept if interrupted
            times = " ".join(f"{t}={v:.0f}" for t, v in result["times"].items())
            print(f"[{NAME}] seed {seed} {method:17s} last {result['last']:7.0f} s ({times}) "
                  f"updates {result['updates']} staleness {result['staleness']:.2f} wall {result['wall']:.0f} s "
                  f"(total {time.perf_counter() - start:.0f} s)", flush=True)
    total = time.perf_counter() - start
    write_outputs(args, runs, out, total)
    return runs


def write_outputs(args, runs: list[dict], out: Path, total: float) -> None:
    by_method = {m: [r for r in runs if r["method"] == m] for m in args.methods}
    header = ["Method"] + [f"{t} (s)" for t in TASKS] + ["all tasks (s)", "updates trained", "mean staleness",
                                                         "wall / run (s)"]
    rows = []
    for method, rs in by_method.items():
        if not rs:
            continue
        budget = args.max_sim_time
        rows.append([method] + [fmt([r["times"][t] for r in rs], budget) for t in TASKS] + [
            fmt([r["last"] for r in rs], budget), f"{np.mean([r['updates'] for r in rs]):.0f}",
            f"{np.mean([r['staleness'] for r in rs]):.2f}", f"{np.mean([r['wall'] for r in rs]):.0f}"])
    gains = []

    def gain(a: str, b: str) -> str | None:
        """(T_b - T_a) / T_b on the mean last-task times; a run that never finished counts as the budget."""
        ra, rb = by_method.get(a), by_method.get(b)
        if not ra or not rb:
            return None
        cap = lambda r: min(r["last"], args.max_sim_time)  # noqa: E731
        ta, tb = np.mean([cap(r) for r in ra]), np.mean([cap(r) for r in rb])
        unfinished = sum(math.isinf(r["last"]) for r in ra + rb)
        bound = ""
        if unfinished:
            bound = (f" ({unfinished} run(s) did not finish within {args.max_sim_time:.0f} s and count as "
                     f"{args.max_sim_time:.0f} s, so this is not an estimate)")
        per_seed = [(cap(y) - cap(x)) / cap(y) for x, y in zip(ra, rb)]
        return (f"{a} vs {b}: {100 * (tb - ta) / tb:+.1f} % less time{bound}; per seed: "
                + ", ".join(f"{100 * g:+.1f} %" for g in per_seed))

    for pair in (("FedAST(D)", "Sync-ST first-k"), ("FedAST(D)", "Sync-ST"), ("FedAST(S)", "Sync-ST first-k"),
                 ("FedAST(D)", "FedAST(S)"), ("FedAST(S)", "FedAST no buffer")):
        g = gain(*pair)
        if g is not None:
            gains.append(g)
    table = markdown_table(header, rows)
    text = (f"Simulated seconds until each task reached its target (mean ± std over seeds {args.seeds}; "
            f"budget {args.max_sim_time:.0f} s)\n\n{table}\n" + "\n".join(f"- {g}" for g in gains)
            + f"\n\nTotal wall-clock: {total:.0f} s.\n\n![time to target]({NAME}.png)\n")
    (out / "results.md").write_text(text)
    (out / "runs.json").write_text(json.dumps(runs, default=float, indent=1))
    plot(args, runs, out / f"{NAME}.png")
    print(text)


def plot(args, runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in args.methods if any(r["method"] == m for r in runs)]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    budget = args.max_sim_time
    fig = plt.figure(figsize=(16, 8.5))
    grid = fig.add_gridspec(2, 3)
    # time to target per task and for all tasks; a seed that never got there counts as the budget (hatched)
    ax = fig.add_subplot(grid[0, :2])
    width = 0.8 / len(methods)
    labels = list(TASKS) + ["all tasks (last)"]
    for i, method in enumerate(methods):
        rs = [r for r in runs if r["method"] == method]
        values = [[r["times"][t] for r in rs] for t in TASKS] + [[r["last"] for r in rs]]
        capped = [[min(v, budget) for v in vs] for vs in values]
        x = np.arange(len(labels)) + i * width
        missed = [any(math.isinf(v) for v in vs) for vs in values]
        ax.bar(x, [np.mean(c) for c in capped], width, yerr=[np.std(c) for c in capped], color=colors[method],
               label=method, capsize=2, hatch=None)
        for xi, c, miss in zip(x, capped, missed):
            if miss:
                ax.bar(xi, np.mean(c), width, fill=False, hatch="//", edgecolor="black", lw=0)
    ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels)
    ax.set_ylabel("simulated seconds to target")
    ax.set_title(f"time to target, mean ± std over seeds {sorted({r['seed'] for r in runs})} "
                 f"(hatched: some seed not there within {budget:.0f} s, counted as {budget:.0f})")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    seed = runs[0]["seed"]
    # FedAST(D): R_m at each reallocation
    ax = fig.add_subplot(grid[0, 2])
    r = next((r for r in runs if r["method"] == "FedAST(D)" and r["seed"] == seed), None)
    if r is not None and r["reallocations"]:
        times = [0.0] + [x["sim_time"] for x in r["reallocations"]]
        for task in TASKS:
            values = [args.requests] + [x["R"].get(task, 0) for x in r["reallocations"]]
            ax.step(times, values, where="post", label=task)
        ax.legend(fontsize=8)
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("R_m after each reallocation")
    ax.set_title(f"FedAST(D) requests per task, seed {seed}")
    ax.grid(alpha=0.3)
    # validation accuracy against simulated time, one panel per task, first seed
    for j, (task, target) in enumerate(zip(TASKS, args.targets)):
        ax = fig.add_subplot(grid[1, j])
        for method in methods:
            r = next(r for r in runs if r["method"] == method and r["seed"] == seed)
            pts = [(t, a) for t, k, a in r["curve"] if k == task]
            if pts:
                ax.plot(*zip(*pts), color=colors[method], lw=1.0, label=method)
        ax.axhline(target, color="black", lw=0.8, ls="--")
        ax.set_xlabel("simulated seconds")
        ax.set_ylabel("validation accuracy")
        ax.set_title(f"{task} (target {target:.2f}), seed {seed}")
        ax.grid(alpha=0.3)
        if j == 0:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
