"""Reproduce FedAU's Table 1 (Wang & Ji), scaled down to a 2-core CPU.

Heterogeneous, label-correlated participation (``LabelCorrelated``: ``p_n = C mu <kappa_n, q>``, ``q ~ Dir(alpha_p)``,
floor 0.02) under three patterns with the same stationary ``p_n``: Bernoulli, Markov (FedAU's ``markov-0.05``) and
cyclic. Methods: FedAU (K=50), "average participating", "average all", FedVARP, MIFA, "known participation
statistics" (FedAvg ÷ p_n). Data: Fashion-MNIST, partitioned as FedAU's released code does (per client
``Dir(alpha_d)`` class proportions, every class split in proportion to them).

Paper setting -> this script's default (see docs/results/fedau_fedstale_upgapl.md):

=============================== ============================== ===============================================
knob                            paper                          here (default)
=============================== ============================== ===============================================
dataset / model                 SVHN, CIFAR-10/100, CINIC-10;  Fashion-MNIST subset (50 x 200 samples);
                                2-conv CNNs                    logistic regression (``--model cnn``: small CNN)
clients N                       250                            50
alpha_d, alpha_p, mean, floor   0.1, 0.1, 0.1, 0.02            same
local steps I, batch            5, 16                          same
rounds                          2,000-20,000                   300
cyclic period                   100                            50 (``--period``)
lr (gamma, eta)                 grid-searched per method       gamma=0.05 for all; eta=1, "average all" eta=10
metric                          mean acc. over last 10% of     mean over the last 20% of rounds (2,000 test
                                rounds (every 10 rounds)       images, every 10 rounds)
seeds                           5                              2
=============================== ============================== ===============================================

Usage::

    python examples/reproduce/fedau_participation.py --seeds 0 1 --rounds 300
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from _common import (
    default_out,
    final_accuracy,
    fit_federated,
    fmt_pct,
    markdown_table,
    mean_std,
    plot_panels,
    quiet,
    seed_all,
    setup_torch,
)
from torch.utils.data import Subset, TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import MIFA, FedAU, FedAvg, FedVARP
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import fashion_mnist
from lightning_fedhet.participation import Bernoulli, Cyclic, LabelCorrelated, Markov

NAME = "fedau_participation"
PATTERNS = ("bernoulli", "markov", "cyclic")
METHODS = {
    "fedau": "FedAU (K=50)",
    "participating": "Average participating",
    "all": "Average all",
    "fedvarp": "FedVARP (N x memory)",
    "mifa": "MIFA (N x memory)",
    "known_p": "Known participation statistics",
}


def fedau_partition(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
                    num_classes: int = 10) -> list[np.ndarray]:
    """FedAU's released partition (fedau.md §4.2): ``L[n] ~ Dir(alpha 1_C)``; class c is cut among clients in
    proportion ``L[n, c] / sum_m L[m, c]`` with rounded cumulative boundaries. Redrawn until no client is empty."""
    for _ in range(100):
        weights = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in range(num_classes):
            idx = rng.permutation(np.flatnonzero(labels == c))
            share = weights[:, c] / weights[:, c].sum()
            ends = np.round(len(idx) * np.cumsum(share)).astype(np.int64)
            starts = np.concatenate([[0], ends[:-1]])
            for n in range(num_clients):
                parts[n].append(idx[starts[n]:ends[n]])
        out = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(o) for o in out) > 0:
            return out
    raise RuntimeError("could not draw a partition without empty clients")


def make_participation(pattern: str, args) -> object:
    recipe = LabelCorrelated(mean=args.mean, floor=args.floor, alpha=args.alpha_p)
    if pattern == "bernoulli":
        return Bernoulli(recipe)
    if pattern == "markov":
        return Markov(p=recipe, max_on=0.05)
    if pattern == "cyclic":
        return Cyclic(args.period, recipe, offset="uniform")
    raise ValueError(f"unknown pattern {pattern!r}")


def make_algorithm(method: str, args) -> object:
    if method == "fedau":
        return FedAU(K=args.K)
    if method in ("participating", "known_p"):
        return FedAvg(weighting=method)
    if method == "all":
        return FedAvg(weighting="all", server_lr=args.all_server_lr or 1.0 / args.mean)
    if method == "fedvarp":
        return FedVARP(weighting="participating")
    if method == "mifa":
        return MIFA()
    raise ValueError(f"unknown method {method!r}")


def load_data(args, seed: int):
    """Fashion-MNIST subset (``clients * samples_per_client`` training images), FedAU partition, test subset."""
    train, test = fashion_mnist(args.data_dir)
    rng = np.random.default_rng(seed)
    n_train = min(len(train), args.clients * args.samples_per_client)
    pick = np.sort(rng.permutation(len(train))[:n_train])
    x, y = train.tensors
    sub = TensorDataset(x[pick].clone(), y[pick].clone())
    parts = fedau_partition(sub.tensors[1].numpy(), args.clients, args.alpha_d, rng)
    val = Subset(test, np.arange(min(len(test), args.test_size)))
    dm = FederatedDataModule(sub, parts, batch_size=args.batch_size, val_dataset=val, eval_batch_size=2000)
    return dm


def make_model(args) -> Classifier:
    if args.model == "logreg":
        return Classifier("logistic_regression", num_classes=10, lr=args.lr, model_kwargs={"in_features": 784})
    return Classifier("fmnist_cnn", num_classes=10, lr=args.lr, model_kwargs={"width": args.width, "hidden": 32})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--out", default=default_out(NAME))
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--samples-per-client", type=int, default=200)
    p.add_argument("--test-size", type=int, default=2000, help="test images used for evaluation")
    p.add_argument("--model", choices=["logreg", "cnn"], default="logreg")
    p.add_argument("--width", type=int, default=8, help="CNN width (--model cnn)")
    p.add_argument("--lr", type=float, default=0.05, help="client learning rate gamma (all methods)")
    p.add_argument("--all-server-lr", type=float, default=None, help="eta of 'average all' (default 1/mean)")
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--window", type=float, default=0.2, help="report mean accuracy over this last fraction")
    p.add_argument("--period", type=int, default=50, help="cyclic period (paper: 100)")
    p.add_argument("--mean", type=float, default=0.1)
    p.add_argument("--floor", type=float, default=0.02)
    p.add_argument("--alpha-p", type=float, default=0.1)
    p.add_argument("--alpha-d", type=float, default=0.1)
    p.add_argument("--K", type=int, default=50, help="FedAU cut-off")
    p.add_argument("--data-dir", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet()
    setup_torch(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}  # (pattern, method) -> list of {seed, acc, wall, cpu, curve}
    participation_stats: dict = {}
    start = time.perf_counter()
    for seed in args.seeds:
        dm = load_data(args, seed)
        for pattern in args.patterns:
            for method in args.methods:
                seed_all(seed)
                model = make_model(args)
                strategy = FedHetStrategy(
                    algorithm=make_algorithm(method, args),
                    participation=make_participation(pattern, args),
                    local_steps=args.local_steps,
                    seed=seed,
                )
                run = fit_federated(model, dm, strategy, args.rounds, args.eval_every)
                acc = final_accuracy(run["curve"], args.rounds, args.window)
                received = np.mean([len(h["received"]) for h in strategy.history])
                p = strategy.participation.p.numpy()
                participation_stats[(seed, pattern)] = (float(p.mean()), float((p <= args.floor + 1e-12).mean()),
                                                        float(p.max()), float(received))
                results.setdefault((pattern, method), []).append(
                    {"seed": seed, "acc": acc, "wall": run["wall"], "cpu": run["cpu"], "curve": run["curve"]}
                )
                print(f"[{NAME}] seed {seed} {pattern:9s} {method:13s} acc {100 * acc:5.1f}% "
                      f"({received:.1f} clients/round, {run['wall']:.1f} s wall, {run['cpu']:.1f} s cpu, "
                      f"total {time.perf_counter() - start:.0f} s)", flush=True)
    write_outputs(args, results, participation_stats, out, time.perf_counter() - start)
    return results


def write_outputs(args, results: dict, stats: dict, out: Path, total: float) -> None:
    header = ["Method"] + [f"{p.capitalize()} acc. (%)" for p in args.patterns] + ["wall-clock / run (s)"]
    rows = []
    for method in args.methods:
        row = [METHODS[method]]
        walls = []
        for pattern in args.patterns:
            runs = results.get((pattern, method), [])
            row.append(fmt_pct([r["acc"] for r in runs]) if runs else "-")
            walls += [r["wall"] for r in runs]
        row.append(f"{mean_std(walls)[0]:.1f}" if walls else "-")
        rows.append(row)
    per_seed = []
    for (pattern, method), runs in results.items():
        per_seed.append([pattern, METHODS[method]] + [f"{r['seed']}: {100 * r['acc']:.1f}" for r in runs])
    width = max(len(r) for r in per_seed) if per_seed else 2
    per_seed = [r + [""] * (width - len(r)) for r in per_seed]
    stat_rows = [[s, pat, f"{m:.3f}", f"{100 * f:.0f}%", f"{mx:.2f}", f"{rc:.1f}"]
                 for (s, pat), (m, f, mx, rc) in stats.items()]
    text = [
        "# FedAU participation patterns (scaled reproduction)\n",
        f"Command: `python examples/reproduce/{NAME}.py --seeds {' '.join(map(str, args.seeds))} "
        f"--rounds {args.rounds}`  ",
        f"Setting: Fashion-MNIST subset ({args.clients} clients x {args.samples_per_client} samples, FedAU "
        f"Dir({args.alpha_d}) partition), model `{args.model}`, LabelCorrelated(mean={args.mean}, floor={args.floor}, "
        f"alpha_p={args.alpha_p}), {args.local_steps} local SGD steps, batch {args.batch_size}, lr {args.lr}, "
        f"'average all' server lr {args.all_server_lr or 1.0 / args.mean:g}, cyclic period {args.period}, "
        f"{args.rounds} rounds. Accuracy = mean test accuracy ({args.test_size} test images) over the last "
        f"{int(100 * args.window)}% of rounds, evaluated every {args.eval_every} rounds; mean ± std over seeds "
        f"{args.seeds}. Total wall-clock {total:.0f} s.\n",
        markdown_table(header, rows),
        "\nPer seed:\n",
        markdown_table(["pattern", "method"] + ["seed: acc"] * (width - 2), per_seed),
        "\nParticipation drawn (per seed and pattern): mean p_n, share of clients at the floor, max p_n, mean "
        "clients received per round (of the last method run):\n",
        markdown_table(["seed", "pattern", "mean p", "at floor", "max p", "clients/round"], stat_rows),
        f"\n![accuracy vs round]({NAME}.png)\n",
    ]
    (out / "results.md").write_text("\n".join(text))
    panels = {
        pattern: {METHODS[m]: [r["curve"] for r in results.get((pattern, m), [])] for m in args.methods}
        for pattern in args.patterns
    }
    plot_panels(panels, out / f"{NAME}.png", f"FedAU setting on Fashion-MNIST ({args.model}, N={args.clients}); "
                f"mean ± std over seeds {args.seeds}")
    print(f"[{NAME}] wrote {out / 'results.md'} and {out / (NAME + '.png')}")


if __name__ == "__main__":
    main()
