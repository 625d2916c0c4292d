"""Reproduce FedStale's β trade-off (Rodio & Neglia 2024), scaled to a 2-core CPU.

N = 24 clients in two participation groups (``TwoGroup``: half always on, half with ``p_min``), Bernoulli draws,
known ``p_i``; ``FedStale(beta)`` for ``beta`` in {0, 0.25, 0.5, 0.75, 1} (0 = unbiased FedAvg, 1 = FedVARP) at a
low and a high level of data heterogeneity.

Data heterogeneity (``--split``):

- ``labelswap`` (default, the paper's recipe, reading (a) of fedstale.md §6.2.1): Fashion-MNIST is split IID
  into equal shards; in every client of the *less-participating* group a fraction ``sigma`` of the samples of
  each class of the pair ``--swap-pair`` (default 0 "T-shirt/top" <-> 1 "trouser", as [C]'s MNIST pair) get the
  other label. Each client also gets an IID shard of the test set with the same swap, and accuracy is measured
  on the union of these shards (equal sizes, so it is ``(1/N) sum_i acc_i``: the paper's objective).
  ``--hets`` are the ``sigma`` values (default 0.0 and 1.0).
- ``dirichlet``: label skew: each client's class proportions ``~ Dir(alpha)``, every class cut among the clients
  in proportion (FedAU's partition, near-equal client sizes, so ``(1/N) sum_i F_i`` is close to the pooled
  objective); ``--hets`` are the alphas (default ``100 0.1``: near-IID and strongly skewed); accuracy on a
  plain test subset (``clients * test_per_client`` images).

Paper setting -> this script's default (see docs/results/fedau_fedstale_upgapl.md):

======================= ==================================== ===========================================
knob                    paper                                here (default)
======================= ==================================== ===========================================
dataset / model         MNIST, CIFAR-10; CNNs                Fashion-MNIST subset (24 x 250); logistic reg.
N, groups               24, two groups (sizes unstated)      24, 12 always on + 12 with p_min
p_min                   0.5 ... 0.002 (8 values)             0.1 (p_avg/p_min = 5.5), ``--p-min`` list
sigma (label swap)      0, 0.2, ..., 1.0                     0.0 and 1.0; or ``--split dirichlet`` with
                                                             alpha 100 / 0.1 (the run in fedau_fedstale_upgapl.md)
beta                    0, 0.2, 0.5, 0.8, 1                  0, 0.25, 0.5, 0.75, 1
K, batch                5, 128                               5, 64
client lr               grid 1e-2 ... 1e-4, tuned            0.05 for all beta (not tuned)
rounds                  ~10/p_min                            10/p_min = 100
seeds                   3                                    2
metric                  test accuracy (round unstated)       mean over the last 10% of rounds
======================= ==================================== ===========================================

Usage::

    python examples/reproduce/fedstale_beta.py --seeds 0 1                               # paper's label swap
    python examples/reproduce/fedstale_beta.py --seeds 0 1 --split dirichlet --hets 100 0.1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
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
from fedau_participation import fedau_partition
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedStale
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import fashion_mnist
from lightning_fedhet.participation import Bernoulli, TwoGroup

NAME = "fedstale_beta"


def swap_labels(labels: np.ndarray, idx: np.ndarray, pair: tuple[int, int], sigma: float,
                rng: np.random.Generator) -> None:
    """In place: a fraction ``sigma`` of ``idx``'s samples of class ``a`` get label ``b`` and vice versa."""
    a, b = pair
    own = labels[idx]
    chosen = {}
    for src in (a, b):
        members = idx[own == src]
        chosen[src] = rng.permutation(members)[: int(len(members) * sigma)]
    labels[chosen[a]] = b
    labels[chosen[b]] = a


def iid_shards(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(s).astype(np.int64) for s in np.array_split(rng.permutation(n), num_clients)]


def load_data(args, seed: int, het: float, low_group: np.ndarray):
    """Training subset split over the clients, with the chosen heterogeneity, and the evaluation set."""
    train, test = fashion_mnist(args.data_dir)
    rng = np.random.default_rng([seed, 7])
    n_train = min(len(train), args.clients * args.samples_per_client)
    pick = rng.permutation(len(train))[:n_train]
    x, y = train.tensors[0][pick].clone(), train.tensors[1][pick].clone().numpy()
    n_test = min(len(test), args.clients * args.test_per_client)
    tpick = rng.permutation(len(test))[:n_test]
    tx, ty = test.tensors[0][tpick].clone(), test.tensors[1][tpick].clone().numpy()
    if args.split == "labelswap":
        parts = iid_shards(n_train, args.clients, rng)
        test_parts = iid_shards(n_test, args.clients, rng)
        for client in np.flatnonzero(low_group):
            swap_labels(y, parts[client], tuple(args.swap_pair), het, rng)
            swap_labels(ty, test_parts[client], tuple(args.swap_pair), het, rng)
        train_ds = TensorDataset(x, torch.as_tensor(y))
        val = TensorDataset(tx, torch.as_tensor(ty))
    else:
        train_ds = TensorDataset(x, torch.as_tensor(y))
        parts = fedau_partition(y, args.clients, het, rng)
        val = TensorDataset(tx, torch.as_tensor(ty))
    return FederatedDataModule(train_ds, parts, batch_size=args.batch_size, val_dataset=val, eval_batch_size=2000)


def make_model(args) -> Classifier:
    if args.model == "logreg":
        return Classifier("logistic_regression", num_classes=10, lr=args.lr, model_kwargs={"in_features": 784})
    return Classifier("fmnist_cnn", num_classes=10, lr=args.lr, model_kwargs={"width": args.width, "hidden": 32})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: round(10 / p_min), the paper's horizon)")
    p.add_argument("--out", default=default_out(NAME))
    p.add_argument("--betas", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--p-min", type=float, nargs="+", default=[0.1], help="low group's participation probability")
    p.add_argument("--split", choices=["labelswap", "dirichlet"], default="labelswap")
    p.add_argument("--hets", type=float, nargs="+", default=None,
                   help="heterogeneity levels, low first: sigma for labelswap (default 0 1), alpha for dirichlet "
                        "(default 100 0.1)")
    p.add_argument("--swap-pair", type=int, nargs=2, default=[0, 1], help="the two swapped classes")
    p.add_argument("--clients", type=int, default=24)
    p.add_argument("--samples-per-client", type=int, default=250)
    p.add_argument("--test-per-client", type=int, default=100)
    p.add_argument("--model", choices=["logreg", "cnn"], default="logreg")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--window", type=float, default=0.1)
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    if args.hets is None:
        args.hets = [0.0, 1.0] if args.split == "labelswap" else [100.0, 0.1]
    return args


def het_label(args, het: float) -> str:
    return f"sigma={het:g}" if args.split == "labelswap" else f"Dir({het:g})"


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet()
    setup_torch(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}  # (p_min, het, beta) -> list of runs
    start = time.perf_counter()
    for p_min in args.p_min:
        rounds = args.rounds or int(round(10 / p_min))
        for seed in args.seeds:
            groups = TwoGroup(p_min=p_min, p_max=1.0, low_fraction=0.5)
            low = groups.low_group(args.clients, seed)
            for het in args.hets:
                dm = load_data(args, seed, het, low)
                for beta in args.betas:
                    seed_all(seed)
                    strategy = FedHetStrategy(
                        algorithm=FedStale(beta=beta, weighting="known_p"),
                        participation=Bernoulli(TwoGroup(p_min=p_min, p_max=1.0, low_fraction=0.5)),
                        local_steps=args.local_steps,
                        seed=seed,
                    )
                    run = fit_federated(make_model(args), dm, strategy, rounds, args.eval_every)
                    assert np.array_equal(strategy.participation.p.numpy() < 1, low)
                    acc = final_accuracy(run["curve"], rounds, args.window)
                    results.setdefault((p_min, het, beta), []).append(
                        {"seed": seed, "acc": acc, "wall": run["wall"], "cpu": run["cpu"], "curve": run["curve"],
                         "rounds": rounds})
                    print(f"[{NAME}] p_min {p_min:g} seed {seed} {het_label(args, het):10s} beta {beta:4.2f} "
                          f"acc {100 * acc:5.1f}% ({run['wall']:.1f} s wall, {run['cpu']:.1f} s cpu, "
                          f"total {time.perf_counter() - start:.0f} s)", flush=True)
    write_outputs(args, results, out, time.perf_counter() - start)
    return results


def write_outputs(args, results: dict, out: Path, total: float) -> None:
    sections = [
        "# FedStale: accuracy vs beta (scaled reproduction)\n",
        f"Command: `python examples/reproduce/{NAME}.py --seeds {' '.join(map(str, args.seeds))} --split {args.split}"
        f" --hets {' '.join(f'{h:g}' for h in args.hets)} --p-min {' '.join(f'{p:g}' for p in args.p_min)}`  ",
        f"Setting: Fashion-MNIST subset ({args.clients} clients x {args.samples_per_client} samples), model "
        f"`{args.model}`, two groups of {args.clients // 2} (p = 1 and p = p_min, Bernoulli), heterogeneity "
        f"`{args.split}`" + (f" (pair {tuple(args.swap_pair)} swapped in the low group)" if args.split == "labelswap"
                             else "") + f", {args.local_steps} local SGD steps, batch {args.batch_size}, lr {args.lr}"
        f", known p_i. Accuracy = mean over the last {int(100 * args.window)}% of rounds (eval every "
        f"{args.eval_every}); mean ± std over seeds {args.seeds}. Total wall-clock {total:.0f} s.\n",
    ]
    panels: dict = {}
    for p_min in args.p_min:
        header = ["beta"] + [f"{het_label(args, h)} acc. (%)" for h in args.hets] + ["wall-clock / run (s)"]
        rows = []
        best = {h: max(args.betas, key=lambda b, h=h: mean_std([r["acc"] for r in results[(p_min, h, b)]])[0])
                for h in args.hets}
        for beta in args.betas:
            row = [f"{beta:g}" + (" (FedAvg)" if beta == 0 else " (FedVARP)" if beta == 1 else "")]
            walls = []
            for h in args.hets:
                runs = results[(p_min, h, beta)]
                cell = fmt_pct([r["acc"] for r in runs])
                row.append(f"**{cell}**" if beta == best[h] else cell)
                walls += [r["wall"] for r in runs]
            row.append(f"{mean_std(walls)[0]:.1f}")
            rows.append(row)
        rounds = results[(p_min, args.hets[0], args.betas[0])][0]["rounds"]
        sections.append(f"\n## p_min = {p_min:g} (p_avg/p_min = {(1 + p_min) / 2 / p_min:.1f}), {rounds} rounds\n")
        sections.append(markdown_table(header, rows))
        sections.append("\nBest beta (bold): " + ", ".join(f"{het_label(args, h)}: {best[h]:g}" for h in args.hets))
        per_seed = [[f"{b:g}", het_label(args, h)] + [f"{r['seed']}: {100 * r['acc']:.1f}"
                                                      for r in results[(p_min, h, b)]]
                    for h in args.hets for b in args.betas]
        sections.append("\n\nPer seed:\n")
        sections.append(markdown_table(["beta", "heterogeneity"] + ["seed: acc"] * (len(per_seed[0]) - 2), per_seed))
        for h in args.hets:
            panels[f"p_min={p_min:g}, {het_label(args, h)}"] = {
                f"beta={b:g}": [r["curve"] for r in results[(p_min, h, b)]] for b in args.betas
            }
    sections.append(f"\n![accuracy vs round]({NAME}.png)\n")
    (out / "results.md").write_text("\n".join(sections))
    plot_panels(panels, out / f"{NAME}.png", f"FedStale(beta), {args.split} heterogeneity, N={args.clients}; "
                f"mean ± std over seeds {args.seeds}")
    print(f"[{NAME}] wrote {out / 'results.md'} and {out / (NAME + '.png')}")


if __name__ == "__main__":
    main()
