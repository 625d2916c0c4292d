"""Reproduce the lossy-uplink experiment of the thesis's ch. 4 (UPGA-PL, §4.6) on Synthetic LEAF.

N = 10 clients in two groups (random halves per seed) whose uploads are lost with probability q = 0.1 and q = 0.9
(independently per round, ``LossyChannel(uplink=q_i)``). Rules: UPGA-PL (pseudo-gradients ÷ (1 - q_i), known q),
DMA-PL (average of the received models, renormalised), UDMA-PL (received models ÷ (1 - q_i), not renormalised) and,
as the reference, lossless FedAvg (``sum_i alpha_i delta_i`` with every upload arriving). ``alpha_i = |D_i|/|D|``
as in the thesis. Model: multinomial logistic regression with ridge 5e-4 (SGD weight decay).

Thesis setting -> this script's default (see docs/results/fedau_fedstale_upgapl.md):

==================== ============================================ ==============================================
knob                 thesis                                       here (default)
==================== ============================================ ==============================================
data / model         Synthetic LEAF (gamma=delta=1), linear +     same (library generator), N=10
                     ridge 5e-4; also MNIST CNN (not run here)
groups, q            two groups, q = 0.1 / 0.9 (sizes unstated)   5 + 5 (random per seed), uplink loss only
weights alpha        |D_i| / |D|                                  same (``client_weights="samples"``)
lr                   grid 1e-3 ... 1e-1, tuned per algorithm      0.05 for all (``--lr``), constant
K, batch, rounds     not stated (figures go to ~150+ rounds)      K=5, batch 32, 150 rounds
seeds                10                                           3
metric               test accuracy curves                         pooled per-client test splits, every 5 rounds;
                                                                  table: mean over the last 10% of rounds
==================== ============================================ ==============================================

Usage::

    python examples/reproduce/upgapl_lossy.py --seeds 0 1 2 --rounds 150
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

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.algorithms import DMAPL, UDMAPL, UPGAPL, FedAvg
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import SyntheticLeafFederated
from lightning_fedhet.system import LossyChannel

NAME = "upgapl_lossy"
METHODS = {
    "upgapl": "UPGA-PL",
    "dmapl": "DMA-PL",
    "udmapl": "UDMA-PL",
    "fedavg_lossless": "FedAvg (lossless)",
}


def loss_probabilities(num_clients: int, q_low: float, q_high: float, seed: int) -> np.ndarray:
    """Half the clients (a seeded random half) lose uploads with ``q_low``, the rest with ``q_high``."""
    q = np.full(num_clients, q_high)
    q[np.random.default_rng([seed, 4]).permutation(num_clients)[: num_clients // 2]] = q_low
    return q


def make_algorithm(method: str):
    if method == "upgapl":
        return UPGAPL(q="known")
    if method == "dmapl":
        return DMAPL()
    if method == "udmapl":
        return UDMAPL(q="known")
    if method == "fedavg_lossless":
        return FedAvg(weighting="all")  # sum_i alpha_i delta_i, alpha_i = |D_i|/|D|
    raise ValueError(f"unknown method {method!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--out", default=default_out(NAME))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1.0)
    p.add_argument("--q-low", type=float, default=0.1)
    p.add_argument("--q-high", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--window", type=float, default=0.1)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    quiet()
    setup_torch(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    groups: dict = {}
    start = time.perf_counter()
    for seed in args.seeds:
        dm = SyntheticLeafFederated(num_clients=args.clients, gamma=args.gamma, delta=args.delta,
                                    batch_size=args.batch_size, seed=seed)
        q = loss_probabilities(args.clients, args.q_low, args.q_high, seed)
        sizes = dm.client_sizes
        groups[seed] = (sizes[q == args.q_low].sum() / sizes.sum(), int(sizes.sum()))
        for method in args.methods:
            seed_all(seed)
            model = Classifier("logistic_regression", num_classes=10, lr=args.lr, weight_decay=args.weight_decay,
                               model_kwargs={"in_features": 60})
            strategy = FedHetStrategy(
                algorithm=make_algorithm(method),
                participation=None,
                channel=None if method == "fedavg_lossless" else LossyChannel(uplink=q),
                local_steps=args.local_steps,
                client_weights="samples",
                seed=seed,
            )
            run = fit_federated(model, dm, strategy, args.rounds, args.eval_every)
            acc = final_accuracy(run["curve"], args.rounds, args.window)
            received = np.mean([len(h["received"]) for h in strategy.history])
            results.setdefault(method, []).append(
                {"seed": seed, "acc": acc, "wall": run["wall"], "cpu": run["cpu"], "curve": run["curve"]}
            )
            print(f"[{NAME}] seed {seed} {method:16s} acc {100 * acc:5.1f}% ({received:.1f} updates/round, "
                  f"{run['wall']:.1f} s wall, {run['cpu']:.1f} s cpu, total {time.perf_counter() - start:.0f} s)",
                  flush=True)
    write_outputs(args, results, groups, out, time.perf_counter() - start)
    return results


def write_outputs(args, results: dict, groups: dict, out: Path, total: float) -> None:
    rows = []
    for method in args.methods:
        runs = results[method]
        curves = [r["curve"] for r in runs]
        at = {}
        for target in (50, 100, 150):
            vals = [a for c in curves for r, a in c if r == target]
            at[target] = f"{100 * np.mean(vals):.1f}" if vals else "-"
        rows.append([METHODS[method], fmt_pct([r["acc"] for r in runs]), at[50], at[100], at[150],
                     f"{mean_std([r['wall'] for r in runs])[0]:.1f}"])
    per_seed = [[METHODS[m]] + [f"{r['seed']}: {100 * r['acc']:.1f}" for r in results[m]] for m in args.methods]
    text = [
        "# UPGA-PL under lossy uplinks (scaled reproduction)\n",
        f"Command: `python examples/reproduce/{NAME}.py --seeds {' '.join(map(str, args.seeds))} --rounds "
        f"{args.rounds}`  ",
        f"Setting: Synthetic LEAF(gamma={args.gamma:g}, delta={args.delta:g}), N={args.clients}, logistic regression "
        f"with ridge {args.weight_decay:g}, alpha_i = |D_i|/|D|, uplink loss q={args.q_low:g} for a random half of "
        f"the clients and q={args.q_high:g} for the other half, {args.local_steps} local SGD steps, batch "
        f"{args.batch_size}, lr {args.lr:g} (all rules), {args.rounds} rounds. Accuracy on the pooled per-client "
        f"test splits; final = mean over the last {int(100 * args.window)}% of rounds (eval every "
        f"{args.eval_every}); mean ± std over seeds {args.seeds}. Total wall-clock {total:.0f} s.\n",
        markdown_table(["Rule", "final acc. (%)", "acc. @50", "acc. @100", "acc. @150", "wall-clock / run (s)"],
                       rows),
        "\nPer seed:\n",
        markdown_table(["Rule"] + ["seed: acc"] * len(args.seeds), per_seed),
        "\nShare of the training samples held by the q=" + f"{args.q_low:g} group: "
        + ", ".join(f"seed {s}: {100 * f:.0f}% of {n}" for s, (f, n) in groups.items()) + "\n",
        f"\n![accuracy vs round]({NAME}.png)\n",
    ]
    (out / "results.md").write_text("\n".join(text))
    panels = {"test accuracy": {METHODS[m]: [r["curve"] for r in results[m]] for m in args.methods}}
    plot_panels(panels, out / f"{NAME}.png", f"Synthetic LEAF(1,1), N={args.clients}, uplink loss "
                f"{args.q_low:g}/{args.q_high:g}; mean ± std over seeds {args.seeds}")
    print(f"[{NAME}] wrote {out / 'results.md'} and {out / (NAME + '.png')}")


if __name__ == "__main__":
    main()
