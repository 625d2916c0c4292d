"""Fed-CIS (thesis ch. 5, Algorithm 6): Serving Rate vs Equal Weight on the 7-node tree at 80-15-5 (Table 5.1),
early-exit ResNet-18 on Fashion-MNIST, under two labelled readings of the update of the BatchNorm statistics.

The 7-node tree (``CISTopology.preset("7-node", "80-15-5")``): 4 leaves hold exit 1, 2 middle nodes exit 2, the
root exit 3; requests arrive at the leaves, so the serving rates are Lambda = (0.80, 0.15, 0.05). Equal data
partition (1/3 of the training pool per layer, split evenly inside a layer, IID), full participation, p = 0 (every
node trains its largest exit, on that exit's loss only), eta_s = 1, equal local work (K mini-batches per node).

Settings (the thesis says nothing of BatchNorm; its released code aggregates the running statistics with the same
weights as the parameters). In both, the running means and variances of every BatchNorm layer go through the rule
exactly like the parameters (:func:`stats_as_parameters`), never through the server's separate sample-weighted
buffer average:

- ``Alg. 6 (literal)``: ``FedCIS(aggregation_base="literal")``, line 11 applied to every entry of the model,
  statistics included: ``w_{t+1} = w_t + sum Lt_e |D_i|/|D_e| delta_i``;
- ``released code``: ``FedCIS(aggregation_base="root_local", exit_masks=...)``: the global model is the root's
  trained model, moved towards each other node on the coordinates of its exit's sub-model (blocks up to the exit
  and that exit's head, statistics included): ``w_{t+1} = w_r + sum_{c != r} a_c M_{e_c} (w_c - w_r)``.
"""

from __future__ import annotations

import functools
import math

import harness  # scripts/ is on sys.path whenever a study is loaded
import numpy as np
import torch
from lightning_fedhet.callbacks import CISAccuracy
from lightning_fedhet.model_zoo import early_exit_resnet18
from torch import nn
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms.fedcis import FedCIS, exit_masks
from lightning_fedhet.cis import CISTopology
from lightning_fedhet.data import fashion_mnist
from lightning_fedhet.early_exit_module import EarlyExitClassifier

from . import _train

NUM_CLASSES = 10
STRATEGIES = {"Serving Rate": "serving_rate", "Equal Weight": "equal"}
SETTINGS = {"Alg. 6 (literal)": "literal", "released code": "root_local"}


def stats_as_parameters(module: nn.Module) -> int:
    """Turn every BatchNorm running mean/variance of ``module`` into a frozen ``nn.Parameter`` (in place).

    ``F.batch_norm`` still updates them in place in training mode and reads them in eval mode; as parameters they
    are part of the vector the server rule aggregates (with the rule's weights and, under ``root_local``, the exit
    masks), instead of a floating buffer the server averages over every arrival. Returns the number of tensors
    converted. The integer ``num_batches_tracked`` stays a buffer (unused with the default BN momentum).
    """
    count = 0
    for sub in module.modules():
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and sub.track_running_stats:
            for name in ("running_mean", "running_var"):
                value = sub._buffers.pop(name)
                sub.register_parameter(name, nn.Parameter(value, requires_grad=False))
                count += 1
    return count


class CosineEarlyExitClassifier(EarlyExitClassifier):
    """:class:`EarlyExitClassifier` with the thesis's schedule (App. F and the released code): SGD whose learning
    rate follows a cosine from ``lr`` to ``0.01 lr`` over ``rounds`` rounds (one Lightning epoch is one round),
    stepped once per round."""

    def __init__(self, *args, rounds: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds = int(rounds)

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.rounds,
                                                              eta_min=0.01 * self.hparams.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


@functools.lru_cache(maxsize=1)
def _fmnist() -> tuple[TensorDataset, TensorDataset]:
    return fashion_mnist()


def split(topology: CISTopology, config: dict, seed: int):
    """``(train pool, per-node index lists, test subset)``: ``train_size`` training images shared out by
    ``topology.data_fraction`` (IID, seeded) and ``test_size`` test images (the same for every seed)."""
    if config.get("synthetic_data"):  # tiny stand-in for the smoke test
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(NUM_CLASSES * 30, 1, 28, 28, generator=gen)
        y = torch.arange(NUM_CLASSES * 30) % NUM_CLASSES
        train, test = TensorDataset(x, y), TensorDataset(x[:60].clone(), y[:60].clone())
    else:
        train, test = _fmnist()
    x, y = train.tensors
    rng = np.random.default_rng([seed, 0xC15])
    order = rng.permutation(len(y))[: config["train_size"]]
    counts = [int(math.floor(float(f) * len(order))) for f in topology.data_fraction]
    counts[0] += len(order) - sum(counts)
    parts, start = [], 0
    for c in counts:
        parts.append(np.sort(order[start:start + c]))
        start += c
    tx, ty = test.tensors
    keep = torch.from_numpy(np.random.default_rng(0x7E57).permutation(len(ty))[: config["test_size"]])
    return train, parts, TensorDataset(tx[keep], ty[keep])


def build(config: dict, method: str, base: str):
    """``(module, topology, FedCIS rule)`` for a cell; the module's BatchNorm statistics are parameters."""
    topo = CISTopology.preset("7-node", config["serving"], partition=config["partition"])
    net = early_exit_resnet18(num_classes=NUM_CLASSES, exits=tuple(config["exits"]), in_channels=1,
                              base_width=config["base_width"], stride_layout=config["stride_layout"])
    stats_as_parameters(net)
    model = CosineEarlyExitClassifier(model=net, num_classes=NUM_CLASSES, lr=config["lr"],
                                      momentum=config["momentum"], weight_decay=config["weight_decay"],
                                      rounds=config["rounds"])
    kwargs = {}
    if base == "root_local":
        # the released code's sub-model of exit e: the blocks up to the exit and that exit's head
        units = [list(net.blocks[: net.exit_blocks[e]]) + [net.heads[e]] for e in range(net.num_exits)]
        kwargs["exit_masks"] = exit_masks(model, units)
    rule = FedCIS(topo, lambda_tilde=STRATEGIES[method], p=config["p"], aggregation_base=base, **kwargs)
    return model, topo, rule


def run_cell(cell, seed: int) -> dict:
    """Train one (setting, strategy) for one seed; metrics: per-exit and CIS test accuracy at each evaluation."""
    c = cell.config
    torch.set_num_threads(1)
    _train.seed_all(seed)
    model, topo, rule = build(c, cell.method, SETTINGS[cell.setting])
    train, parts, test = split(topo, c, seed)
    data = FederatedDataModule(train, parts, batch_size=c["batch_size"], val_dataset=test, eval_batch_size=500,
                               seed=seed)
    strategy = FedHetStrategy(algorithm=rule, local_steps=c["local_steps"], engine=c["engine"], seed=seed)
    names = tuple(f"val_acc_exit{e}" for e in range(1, topo.num_exits + 1)) + ("cis_acc",)
    # CISAccuracy logs cis_acc at the end of the validation epoch, before the curve reads it
    points = _train.fit(model, data, strategy, c["rounds"], c["eval_every"], names=names,
                        callbacks=(CISAccuracy(topo),))
    metrics = _train.series(points)
    return {"metrics": metrics, "engine": c["engine"],
            "config": {"node_sizes": [len(p) for p in parts],
                       "lambda_tilde": [round(float(v), 6) for v in rule.last_lambda_tilde]}}


# ------------------------------------------------------------------------------------------------ protocol v1 cells
PROTOCOL = "v1"
SEEDS = (0, 1, 2, 3, 4)
BASE = {
    "data": "fashion_mnist", "serving": "80-15-5", "partition": "equal", "train_size": 12000, "test_size": 2000,
    "model": "early_exit_resnet18", "exits": [3, 9], "base_width": 16, "stride_layout": "standard",
    "batchnorm_statistics": "aggregated by the rule like the parameters (stats_as_parameters)",
    "participation": "all nodes every round", "p": 0.0, "server_lr": 1.0, "prob_weighting": "inverse",
    "lr": 0.1, "lr_schedule": "cosine to 0.01 lr over the rounds, stepped per round", "momentum": 0.9,
    "weight_decay": 5e-4, "optimizer_state": "reset each round", "batch_size": 32, "local_steps": 10,
    "rounds": 20, "eval_every": 10, "confidence": "norm_entropy", "engine": "sequential",
}
CELLS = tuple(harness.Cell(setting, method, {**BASE, "aggregation_base": base})
              for setting, base in SETTINGS.items() for method in STRATEGIES)
#: Thesis Table 5.1 (equal partition, 80-15-5, CIS accuracy %, mean ± spread over 3 seeds).
PAPER = {"CIFAR10": (54.2, 2.4, 49.9, 1.2), "CIFAR100": (45.0, 0.7, 39.8, 1.2)}
PAPER_GAIN = 0.043  # CIFAR10: Serving Rate - Equal Weight, the thesis's "+4.3 p.p."


# --------------------------------------------------------------------------------------------------------- report
def last(r: dict, key: str) -> float:
    """``key`` at the last evaluation (after the last round), on the test subset."""
    return float(r["metrics"][key][-1])


def write_report(records: list[dict], out) -> list:
    out_dir = out / "fedcis"
    keys = ("val_acc_exit1", "val_acc_exit2", "val_acc_exit3", "cis_acc")
    lines = [
        "# Fed-CIS: Serving Rate vs Equal Weight on the 7-node tree, 80-15-5 (Fashion-MNIST)\n",
        "Generated by `python scripts/reproduce.py report` from the records in `records/fedcis/`; do not edit.\n",
        f"Protocol: [fedcis/protocol-{PROTOCOL}.md](fedcis/protocol-{PROTOCOL}.md) (committed before the runs; it "
        "lists every departure from the thesis's setting and the reason).\n",
        "## Claim (quoted from the thesis)\n",
        "Ch. 5, Table 5.1 (equal data partition, 7-node tree, p = 0), serving setting 80-15-5: \"Serving Rate\" "
        "(Lambda-tilde = Lambda) gives a higher CIS accuracy than \"Equal Weight\" (Lambda-tilde_e = 1/E); on CIFAR10 "
        "by 4.3 p.p.\n",
        harness.markdown_table(("dataset", "Serving Rate", "Equal Weight", "difference"),
                               [(d, f"{a} ± {sa}", f"{b} ± {sb}", f"{a - b:+.1f} p.p.")
                                for d, (a, sa, b, sb) in PAPER.items()]),
        "\nDecision rule (per setting): the paired difference Serving Rate - Equal Weight of the CIS accuracy after "
        "the last round over the same seeds is **reproduced** when its 95 % interval lies above 0 and its mean is "
        "at least half the thesis's +4.3 p.p., **partly reproduced** when above 0 but smaller, **direction only** "
        "when the mean is positive but the interval reaches 0, **not reproduced** otherwise; **pending** while a "
        "cell has fewer than its seeds.\n",
    ]
    summaries = []
    protocols = sorted({r["protocol"] for r in records} | {PROTOCOL})
    fig, axes = harness.new_figure(ncols=len(SETTINGS), width=5.0, height=3.6)
    for protocol in protocols:
        recs = [r for r in records if r["protocol"] == protocol]
        lines.append(f"## Results, protocol {protocol}\n")
        rows, prow = [], []
        for k, setting in enumerate(SETTINGS):
            for j, method in enumerate(STRATEGIES):
                rs = [r for r in recs if r["setting"] == setting and r["method"] == method]
                n = f"{len(rs)}/{len(SEEDS)}" + ("" if len(rs) >= len(SEEDS) else " (incomplete)")
                lt = "(" + ", ".join(f"{v:.3f}" for v in rs[0]["config"]["lambda_tilde"]) + ")" if rs else "–"
                rows.append((setting, method, lt, n,
                             *[harness.fmt_ci(*harness.mean_ci([last(r, key) for r in rs])) for key in keys]))
                if protocol == PROTOCOL and rs:
                    for e, key in enumerate(keys):
                        vals = [100 * last(r, key) for r in rs]
                        mean, lo, hi = harness.mean_ci(vals)
                        x = e + (j - 0.5) * 0.38
                        axes[k].bar(x, mean, 0.36, color=f"C{j}", label=method if e == 0 else None)
                        axes[k].plot([x] * len(vals), vals, "k.", ms=3)
            sr = harness.by_seed(recs, lambda r: last(r, "cis_acc"), setting=setting, method="Serving Rate")
            ew = harness.by_seed(recs, lambda r: last(r, "cis_acc"), setting=setting, method="Equal Weight")
            mean, lo, hi, n = harness.paired(sr, ew)
            complete = len(sr) >= len(SEEDS) and len(ew) >= len(SEEDS)
            verdict = harness.verdict_for_gain(lo, mean, hi, PAPER_GAIN) if complete else "pending"
            e1 = harness.paired(*[harness.by_seed(recs, lambda r: last(r, "val_acc_exit1"), setting=setting,
                                                  method=m) for m in STRATEGIES])
            prow.append((setting, n, harness.fmt_ci(mean, lo, hi, unit=" pp"), "+4.3 pp (CIFAR10)",
                         harness.fmt_ci(*e1[:3], unit=" pp"), f"**{verdict}**"))
            if protocol == PROTOCOL:
                summaries.append(harness.Summary(
                    f"Table 5.1, 80-15-5: Serving Rate beats Equal Weight on CIS accuracy ({setting})",
                    "+4.3 pp (CIFAR10: 54.2 vs 49.9)", f"{harness.fmt_ci(mean, lo, hi, unit=' pp')} ({n} seeds)",
                    verdict))
        lines.append("Test accuracy % (2,000 test images) after the last round, mean [95 % CI]:\n")
        lines.append(harness.markdown_table(("setting", "strategy", "Lambda-tilde", "seeds", "exit 1", "exit 2",
                                             "exit 3", "CIS accuracy"), rows))
        lines.append("\nPaired over seeds, Serving Rate - Equal Weight:\n")
        lines.append(harness.markdown_table(("setting", "seeds", "CIS accuracy", "thesis", "exit 1 alone",
                                             "verdict"), prow))
        lines.append("")
    for k, setting in enumerate(SETTINGS):
        axes[k].set_xticks(range(4), ["exit 1", "exit 2", "exit 3", "CIS"])
        axes[k].set(title=f"{setting} (protocol {PROTOCOL})", ylabel="test accuracy % (bars: mean; dots: seeds)")
        axes[k].legend(fontsize=7)
    harness.save_figure(fig, out_dir / "accuracy.png")
    lines += [
        "![per-exit and CIS test accuracy after the last round](fedcis/accuracy.png)\n",
        *harness.reproduce_section(records, (
            "OMP_NUM_THREADS=1 python scripts/reproduce.py run fedcis            # the missing (cell, seed) records",
            "python scripts/reproduce.py report                                  # this page, from the records",
        )),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out / "fedcis.md").write_text("\n".join(lines) + "\n")
    return summaries


STUDY = harness.Study(name="fedcis", title="Fed-CIS", protocol=PROTOCOL, seeds=SEEDS, cells=CELLS, run=run_cell,
                      report=write_report, threads=1)
