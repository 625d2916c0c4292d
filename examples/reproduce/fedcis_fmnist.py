"""Fed-CIS on Fashion-MNIST, 7-node tree: Serving Rate vs Equal Weight, two update bases (thesis ch. 5, Table 5.1).

Reproduces the comparison of thesis Table 5.1 (equal data partition, p = 0) at one serving setting (default 80-15-5)
with :class:`~lightning_fedhet.algorithms.fedcis.FedCIS`, :class:`~lightning_fedhet.FedHetStrategy` and
:class:`~lightning_fedhet.EarlyExitClassifier`, on Fashion-MNIST instead of CIFAR10, scaled to a 2-core CPU:

================== =================================================== ==============================================
                   thesis (App. F and the released code)               here (defaults)
================== =================================================== ==============================================
data               CIFAR10, 45k train / 10k test                       Fashion-MNIST (28x28 grey), 59k train, 1k
                                                                       held-out val (curves), 10k test (final)
model              ResNet-18, width 64, exits after blocks 3/9/17,     same blocks and exits, ``in_channels=1``,
                   stage strides (1,1,2,2), BatchNorm                  ``base_width=16``, strides (1,2,2,2)
                                                                       (``"standard"``: exit 2/3 ~2.5x cheaper;
                                                                       exit 1 is before any stride), BatchNorm
rounds T           100                                                 ``--rounds`` (30)
local work         each node the same number of updates                ``--local-steps`` K = 10 mini-batches for
                   (root 1 epoch of 15k, leaves 4 epochs of 3.75k)     every node (~1/150 of the thesis's
                                                                       sample-gradients over the run)
optimiser          SGD lr 0.1 cosine, momentum 0.9, wd 5e-4, batch     SGD lr ``--lr`` 0.05 constant, momentum 0.9,
                   128, momentum kept across rounds, augmentation      wd 5e-4, batch 32, optimiser state reset each
                                                                       round, no augmentation
aggregation        released code: global = root's trained model        both, ``--bases``: ``literal`` = Algorithm 6
                   (alias)                                             (``FedCIS`` default, update added to
                                                                       ``w_t``), ``root_local`` = the code's alias
                                                                       (``aggregation_base="root_local"``); eta_s 1
seeds              9, 42, 67                                           ``--seeds`` (0 1)
================== =================================================== ==============================================

Everything else follows the thesis: 7-node tree (4 leaves with exit 1, 2 middle nodes with exit 2, root with exit
3), requests only at the leaves with the released code's rates, equal data partition (1/3 of the data per layer,
split evenly inside a layer, IID), full participation, every node trains its largest exit (p = 0), CIS accuracy
by normalised-entropy serving (``CISAccuracy``).

Run (about 3-4 minutes per run on one core; finished runs are cached as JSON and skipped)::

    python examples/reproduce/fedcis_fmnist.py                       # 2 strategies x 2 bases x seeds 0 1, report
    python examples/reproduce/fedcis_fmnist.py --bases literal       # Algorithm 6 only
    python examples/reproduce/fedcis_fmnist.py --report-only         # rebuild table + PNG from the JSON files

Writes ``<out>/runs/<serving>_<strategy>_<base>_s<seed>.json``, ``<out>/table_<serving>.md`` and
``<out>/fedcis_fmnist_<serving>.png`` (``--out`` defaults to ``docs/results/fedcis``). Run files written before
``--bases`` existed (``<serving>_<strategy>_s<seed>.json``) count as ``literal``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning_fedhet.callbacks import CISAccuracy
from lightning_fedhet.model_zoo import early_exit_resnet18
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms.fedcis import AGGREGATION_BASES, FedCIS, exit_masks
from lightning_fedhet.cis import CISTopology
from lightning_fedhet.data import fashion_mnist
from lightning_fedhet.early_exit_module import EarlyExitClassifier

NAMES = {"serving_rate": "Serving Rate", "equal": "Equal Weight", "flops": "FLOPS Prop", "balanced": "Balanced Adj"}
BASE_NAMES = {"literal": "Alg. 6", "root_local": "root-local (code)"}
DATA_SEED = 1234  # the split of the data over nodes is the same in every run (the thesis reuses index files)


def split_data(topo: CISTopology, val_size: int):
    """Fashion-MNIST -> (train pool, per-node index lists, val set, test set); shares from ``topo.data_fraction``."""
    train, test = fashion_mnist()
    x, y = train.tensors
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(DATA_SEED))
    val_idx, pool_idx = perm[:val_size], perm[val_size:]
    pool = TensorDataset(x[pool_idx], y[pool_idx])
    n = len(pool_idx)
    counts = [int(math.floor(float(f) * n)) for f in topo.data_fraction]
    counts[0] += n - sum(counts)  # rounding remainder to the root
    order = torch.randperm(n, generator=torch.Generator().manual_seed(DATA_SEED + 1)).tolist()
    parts, start = [], 0
    for c in counts:
        parts.append(order[start : start + c])
        start += c
    return pool, parts, TensorDataset(x[val_idx], y[val_idx]), test


class Curve(pl.Callback):
    """Keeps the per-exit and CIS accuracy on the validation set after each validation (one entry per check)."""

    def __init__(self, num_exits: int) -> None:
        self.num_exits = num_exits
        self.points: list[dict] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        point = {"round": trainer.current_epoch + 1}
        for e in range(1, self.num_exits + 1):
            point[f"exit{e}"] = float(m[f"val_acc_exit{e}"])
        point["cis"] = float(m["cis_acc"])
        self.points.append(point)
        print(f"  round {point['round']:3d}  " + "  ".join(f"{k}={v:.4f}" for k, v in point.items() if k != "round"))


def label(strategy: str, base: str) -> str:
    return f"{NAMES.get(strategy, strategy)}, {BASE_NAMES[base]}"


def run(strategy: str, base: str, seed: int, args, topo: CISTopology, data) -> dict:
    torch.manual_seed(seed)
    pool, parts, val, test = data
    net = early_exit_resnet18(
        num_classes=10, exits=(3, 9), in_channels=1, base_width=args.base_width, stride_layout=args.stride_layout
    )
    model = EarlyExitClassifier(model=net, num_classes=10, lr=args.lr, momentum=0.9, weight_decay=5e-4)
    kwargs = {"flops": net.exit_flops((1, 28, 28))} if strategy == "flops" else {}
    if base == "root_local":
        # the released code's sub-model of exit e: the blocks up to the exit and that exit's head
        units = [list(net.blocks[: net.exit_blocks[e]]) + [net.heads[e]] for e in range(net.num_exits)]
        kwargs["exit_masks"] = exit_masks(model, units)
    algo = FedCIS(topo, lambda_tilde=strategy, p=args.p, aggregation_base=base, **kwargs)
    fed = FedHetStrategy(algorithm=algo, local_steps=args.local_steps, seed=seed)
    dm = FederatedDataModule(
        pool, parts, batch_size=args.batch_size, val_dataset=val, test_dataset=test, eval_batch_size=500
    )
    cis = CISAccuracy(topo)
    curve = Curve(topo.num_exits)
    trainer = pl.Trainer(
        strategy=fed,
        accelerator="cpu",
        max_epochs=args.rounds,
        check_val_every_n_epoch=args.val_every,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cis, curve],
    )
    t0 = time.time()
    trainer.fit(model, datamodule=dm)
    fit_s = time.time() - t0
    res = trainer.test(model, datamodule=dm, verbose=False)[0]
    node_acc = cis.last_result.node_accuracy.tolist()
    return {
        "strategy": strategy,
        "aggregation_base": base,
        "seed": seed,
        "lambda_tilde": [float(v) for v in algo.last_lambda_tilde],
        "test_acc_exit": [float(res[f"test_acc_exit{e}"]) for e in range(1, topo.num_exits + 1)],
        "test_cis_acc": float(res["test_cis_acc"]),
        "test_cis_acc_node": [None if math.isnan(a) else a for a in node_acc],
        "curve": curve.points,
        "fit_seconds": fit_s,
        "total_seconds": time.time() - t0,
        "sizes": [len(p) for p in parts],
        "config": vars(args) | {"out": str(args.out)},
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std(unbiased=True)) if len(values) > 1 else 0.0


def report(args, topo: CISTopology) -> str:
    runs = sorted((args.out / "runs").glob(f"{args.serving}_*_s*.json"))
    results = [json.loads(p.read_text()) for p in runs]
    for r in results:
        r.setdefault("aggregation_base", "literal")  # runs written before the root-local base existed
    results = [
        r
        for r in results
        if r["strategy"] in args.strategies and r["seed"] in args.seeds and r["aggregation_base"] in args.bases
    ]
    if not results:
        raise SystemExit(f"no finished runs under {args.out / 'runs'}")
    lam = [round(float(v), 4) for v in topo.serving_rates(normalize=True)]
    lines = [
        f"Fashion-MNIST, 7-node tree, serving {args.serving} (Lambda = {lam}), equal partition, p = {args.p}; "
        f"test accuracy (%) on the 10,000 test images, mean ± std over seeds.",
        "",
        "| strategy | base | Lambda-tilde | seeds | exit 1 | exit 2 | exit 3 | CIS accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for base, strategy in [(b, s) for b in args.bases for s in args.strategies]:
        rs = sorted(
            (r for r in results if r["strategy"] == strategy and r["aggregation_base"] == base), key=lambda r: r["seed"]
        )
        if not rs:
            continue
        cells = []
        stats = {}
        for e in range(topo.num_exits):
            m, s = mean_std([100 * r["test_acc_exit"][e] for r in rs])
            stats[f"exit{e + 1}"] = (m, s)
            cells.append(f"{m:.1f} ± {s:.1f}")
        m, s = mean_std([100 * r["test_cis_acc"] for r in rs])
        stats["cis"] = (m, s)
        cells.append(f"**{m:.1f} ± {s:.1f}**")
        lt = "(" + ", ".join(f"{v:.3f}" for v in rs[0]["lambda_tilde"]) + ")"
        seeds = ",".join(str(r["seed"]) for r in rs)
        lines.append(
            f"| {NAMES.get(strategy, strategy)} | {BASE_NAMES[base]} | {lt} | {seeds} | " + " | ".join(cells) + " |"
        )
        summary[label(strategy, base)] = (rs, stats)
    lines += ["", "Per seed (exit 1 / exit 2 / exit 3 / CIS, %):", ""]
    for name, (rs, _) in summary.items():
        for r in rs:
            accs = " / ".join(f"{100 * a:.1f}" for a in r["test_acc_exit"])
            lines.append(
                f"- {name}, seed {r['seed']}: {accs} / {100 * r['test_cis_acc']:.1f} (fit {r['fit_seconds']:.0f} s)"
            )
    table = "\n".join(lines) + "\n"
    (args.out / f"table_{args.serving}.md").write_text(table)
    plot(args, topo, summary)
    return table


def plot(args, topo: CISTopology, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(13, 4.5))
    keys = [f"exit{e}" for e in range(1, topo.num_exits + 1)] + ["cis"]
    labels = [f"exit {e}" for e in range(1, topo.num_exits + 1)] + ["CIS"]
    width = 0.8 / max(1, len(summary))
    for k, (name, (rs, stats)) in enumerate(summary.items()):
        xs = [i + (k - (len(summary) - 1) / 2) * width for i in range(len(keys))]
        ax0.bar(
            xs,
            [stats[key][0] for key in keys],
            width,
            yerr=[stats[key][1] for key in keys],
            label=name,
            capsize=3,
        )
        for r in rs:
            rounds = [pt["round"] for pt in r["curve"]]
            ls = "-" if r is rs[0] else "--"
            color = f"C{k}"
            ax1.plot(rounds, [100 * pt["exit1"] for pt in r["curve"]], ls, color=color, alpha=0.9)
            ax1.plot(rounds, [100 * pt["cis"] for pt in r["curve"]], ls, color=color, alpha=0.45, marker="o", ms=3)
    ax0.set_xticks(range(len(keys)), labels)
    ax0.set_ylabel("test accuracy (%)")
    ax0.set_title(f"Fashion-MNIST, 7-node CIS, {args.serving}, after {args.rounds} rounds")
    ax0.legend(fontsize=8)
    ax1.set_xlabel("round")
    ax1.set_ylabel("validation accuracy (%)")
    ax1.set_title("exit 1 (lines) and CIS (dots); solid/dashed = seeds")
    ax1.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / f"fedcis_fmnist_{args.serving}.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--serving", default="80-15-5")
    ap.add_argument("--partition", default="equal")
    ap.add_argument("--strategies", nargs="+", default=["serving_rate", "equal"])
    ap.add_argument("--bases", nargs="+", choices=AGGREGATION_BASES, default=list(AGGREGATION_BASES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--local-steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--p", type=float, default=0.0)
    ap.add_argument("--base-width", type=int, default=16)
    ap.add_argument("--stride-layout", default="standard")
    ap.add_argument("--val-every", type=int, default=5)
    ap.add_argument("--val-size", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("docs/results/fedcis"))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    topo = CISTopology.preset("7-node", args.serving, partition=args.partition)
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        data = split_data(topo, args.val_size)
        for seed in args.seeds:
            for base, strategy in [(b, s) for b in args.bases for s in args.strategies]:
                path = args.out / "runs" / f"{args.serving}_{strategy}_{base}_s{seed}.json"
                if path.exists():
                    print(f"skip {path} (done)")
                    continue
                print(f"== {strategy} {base} seed {seed}", flush=True)
                result = run(strategy, base, seed, args, topo, data)
                path.write_text(json.dumps(result, indent=1))
                print(
                    f"   test exits {[round(100 * a, 2) for a in result['test_acc_exit']]}  "
                    f"CIS {100 * result['test_cis_acc']:.2f}  ({result['total_seconds']:.0f} s)",
                    flush=True,
                )
    print(report(args, topo))


if __name__ == "__main__":
    main()
