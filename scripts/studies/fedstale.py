"""FedStale (Rodio & Neglia, "FedStale: leveraging stale client updates in federated learning"): the beta sweep.

The paper's recipe on Fashion-MNIST, scaled to a 2-core CPU: ``N`` clients, an IID split of the training set, two
participation groups drawn at random (half always on, half with ``p_min``, Bernoulli every round, probabilities
known to the server), and the paper's **label-swap** heterogeneity: in every client of the *second* (less
participating) group a fraction ``sigma`` of the samples of each class of one label pair get the other label
(``LabelSwap(sigma, pairs=(pair,), swap_clients=<low group>)``). Each client also holds an equal IID shard of the
test set with the same swap, and the test accuracy is measured on the union of these shards: with equal shard sizes
that is ``(1/N) sum_i acc_i``, the accuracy on the paper's objective ``(1/N) sum_i F_i``.

Methods: ``FedStale(beta)`` with known ``p_i`` (the paper's Eq. 9: ``beta = 0`` is unbiased FedAvg, ``beta = 1``
unbiased FedVARP) for ``beta`` in {0, 0.2, 0.5, 0.8, 1}.
"""

from __future__ import annotations

import functools

import harness  # scripts/ is on sys.path whenever a study is loaded
import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedStale
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import LabelSwap, fashion_mnist
from lightning_fedhet.participation import Bernoulli, TwoGroup

from . import _train

NUM_CLASSES = 10
BETAS = (0.0, 0.2, 0.5, 0.8, 1.0)


def method_name(beta: float) -> str:
    """``"beta=0.5"``; the page adds "(FedAvg)" / "(FedVARP)" at the ends."""
    return f"beta={beta:g}"


# ------------------------------------------------------------------------------------------------------------ data
@functools.lru_cache(maxsize=1)
def _fmnist() -> tuple[TensorDataset, TensorDataset]:
    return fashion_mnist()


def _stand_in(n_train: int, n_test: int) -> tuple[TensorDataset, TensorDataset]:
    """Random images with balanced labels, for the smoke test (no Fashion-MNIST needed)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_test, 1, 28, 28, generator=gen)
    y = torch.arange(n_train + n_test) % NUM_CLASSES
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def groups(c: dict) -> TwoGroup:
    """The two participation groups (the low group's ids are a pure function of the seed)."""
    return TwoGroup(p_min=c["p_min"], p_max=c["p_max"], low_fraction=c["low_fraction"])


def label_swap(c: dict, seed: int) -> LabelSwap:
    """The paper's heterogeneity: the low group swaps ``sigma`` of the pair's samples (reading of "the second
    group"); an IID base split."""
    low = np.flatnonzero(groups(c).low_group(c["num_clients"], seed)).tolist()
    return LabelSwap(c["sigma"], pairs=(tuple(c["swap_pair"]),), swap_clients=low)


def datamodule(c: dict, seed: int) -> FederatedDataModule:
    """Training set split IID over the clients with the low group's labels swapped; the validation set is the
    union of equal per-client IID test shards (``test_per_client`` images each) carrying the same swap."""
    n = c["num_clients"]
    train, test = _stand_in(n * 20, n * c["test_per_client"]) if c.get("synthetic_data") else _fmnist()
    swap = label_swap(c, seed)
    rng = np.random.default_rng([seed, 0x7E57])
    pick = torch.from_numpy(np.sort(rng.permutation(len(test))[: n * c["test_per_client"]]))
    tx, ty = test.tensors[0][pick], test.tensors[1][pick].numpy()
    shards = swap.split(ty, n, seed)  # an IID split of the picked test images, equal sizes
    val = TensorDataset(tx, torch.as_tensor(swap.swapped_labels(ty, shards, seed), dtype=torch.int64))
    return FederatedDataModule(train, swap, num_clients=n, batch_size=c["batch_size"], val_dataset=val,
                               eval_batch_size=1200, seed=seed)


# ------------------------------------------------------------------------------------------------------------- run
def run_cell(cell, seed: int) -> dict:
    """Train one beta for one seed; metrics per evaluation: per-client-shard test accuracy; per round: arrivals."""
    c = cell.config
    torch.set_num_threads(1)
    data = datamodule(c, seed)
    _train.seed_all(seed)
    model = Classifier(c["model"], num_classes=NUM_CLASSES, lr=c["lr"],
                       model_kwargs={"width": c["width"], "hidden": c["hidden"]})
    strategy = FedHetStrategy(
        algorithm=FedStale(beta=c["beta"], weighting=c["weighting"], p_source=c["p_source"],
                           server_lr=c["server_lr"]),
        participation=Bernoulli(groups(c)), local_steps=c["local_steps"], engine=c["engine"], seed=seed)
    curve = _train.fit(model, data, strategy, c["rounds"], c["eval_every"])
    low = groups(c).low_group(c["num_clients"], seed)
    if not np.array_equal(strategy.participation.p.numpy() < c["p_max"], low):
        raise RuntimeError("the participation's low group differs from the label-swapping group")
    metrics = _train.series(curve)
    metrics["received"] = [len(h["received"]) for h in strategy.history]
    metrics["received_low"] = [int(low[h["received"].numpy()].sum()) for h in strategy.history]
    return {"metrics": metrics, "engine": c["engine"],
            "config": {"low_group": np.flatnonzero(low).tolist()}}


# ------------------------------------------------------------------------------------------------ protocol v1 cells
PROTOCOL = "v1"
SEEDS = (0, 1, 2, 3, 4)
LR = 0.316  # client learning rate 10^-0.5, chosen on pilot seed 100 (see the protocol)
SETTING = "sigma=0.6, p_avg/p_min=3"
BASE = {
    "data": "fashion_mnist (all 60,000 training images, IID split)", "num_clients": 24, "low_fraction": 0.5,
    "p_max": 1.0, "p_min": 0.2, "participation": "Bernoulli, i.i.d. over rounds", "sigma": 0.6, "swap_pair": [0, 1],
    "swap_group": "low-participation group", "test_per_client": 50, "model": "fmnist_cnn", "width": 8, "hidden": 32,
    "local_steps": 5, "batch_size": 32, "lr": LR, "local_solver": "SGD (no momentum, no weight decay)",
    "server_lr": 1.0, "weighting": "known_p", "p_source": "known", "rounds": 50, "eval_every": 2,
    "metric_window_rounds": 10, "engine": "vmap",
}
CELLS = tuple(harness.Cell(SETTING, method_name(b), {**BASE, "beta": b}) for b in BETAS)

#: The paper's Fig. 5 (thesis Fig. 3.5), "Exact" row, sigma = 0.6, p_avg/p_min = 3: beta_opt and its accuracy gains
#: in percentage points over FedAvg (Delta_0) and over FedVARP (Delta_1).
PAPER_BETA_OPT, PAPER_DELTA0, PAPER_DELTA1 = 0.8, 0.75, 0.31
#: (claim id, beta, baseline beta, paper gain in pp or None (direction only), where the paper states it)
CLAIMS = (
    ("C1", 0.8, 0.0, PAPER_DELTA0, "Fig. 5: FedStale(beta_opt = 0.8) beats FedAvg by Delta_0 = 0.75 pp"),
    ("C2", 0.8, 1.0, PAPER_DELTA1, "Fig. 5: FedStale(beta_opt = 0.8) beats FedVARP by Delta_1 = 0.31 pp"),
    ("C3", 0.5, 0.0, None, "Fig. 3: FedStale(0.5) improves over FedAvg once sigma >= 0.2"),
    ("C4", 0.5, 1.0, None, "Fig. 3: FedStale(0.5) outperforms FedVARP at moderate participation heterogeneity"),
)


# --------------------------------------------------------------------------------------------------------- report
def final_acc(r: dict) -> float:
    """Mean test accuracy over the evaluations in the last ``metric_window_rounds`` rounds."""
    m, c = r["metrics"], r["config"]
    last = c["rounds"] - c["metric_window_rounds"]
    return float(np.mean([a for k, a in zip(m["round"], m["val_acc"]) if k > last]))


def _label(beta: float) -> str:
    return method_name(beta) + (" (FedAvg)" if beta == 0 else " (FedVARP)" if beta == 1 else "")


def write_report(records: list[dict], out) -> list:
    out_dir = out / "fedstale"
    B, n_low = BASE, int(BASE["low_fraction"] * BASE["num_clients"])
    lines = [
        "# FedStale: the weight of stale updates, beta, on Fashion-MNIST with label-swap heterogeneity\n",
        "Generated by `python scripts/reproduce.py report` from the records in `records/fedstale/`; do not edit.\n",
        f"Protocol: [fedstale/protocol-{PROTOCOL}.md](fedstale/protocol-{PROTOCOL}.md) (committed before the runs; "
        "it lists the paper's setting beside ours, every departure and its reason).\n",
        "## Claims (quoted from the paper)\n",
        "- Fig. 5 (thesis Fig. 3.5), exact participation probabilities, sigma = 0.6, p_avg/p_min = 3: "
        f"beta_opt = {PAPER_BETA_OPT:g}, gain over FedAvg Delta_0 = {PAPER_DELTA0:g} pp, gain over FedVARP "
        f"Delta_1 = {PAPER_DELTA1:g} pp (MNIST).",
        "- Fig. 3: \"FedStale (beta = 0.5), without particular fine-tuning, consistently outperforms FedVARP in "
        "settings of moderate participation heterogeneity and improves over FedAvg as client data become "
        "heterogeneous (already at sigma >= 0.2).\" (no numbers in the text).\n",
        f"Ours: Fashion-MNIST, N = {B['num_clients']} ({n_low} with p_min = {B['p_min']:g}, the others always on; "
        f"Bernoulli, p known), the low group swaps a fraction sigma = {B['sigma']:g} of labels "
        f"{B['swap_pair'][0]} and {B['swap_pair'][1]} (T-shirt/top, trouser) in its training and test shards, "
        f"{B['rounds']} rounds (10 / p_min), a small CNN (width {B['width']}, hidden {B['hidden']}), batch "
        f"{B['batch_size']}, lr {B['lr']:g} chosen on a pilot seed. Metric: mean accuracy on the union of the "
        f"per-client test shards over the evaluations in the last {B['metric_window_rounds']} rounds (one every "
        f"{B['eval_every']} rounds).\n",
        "Decision rule per claim (paired over seeds, gain = acc(FedStale(beta)) - acc(baseline)): **reproduced** "
        "when the 95 % interval of the mean gain lies above 0 and the mean is at least half the paper's gain (or, "
        "where the paper gives no number, when the interval lies above 0); **partly reproduced** when above 0 but "
        "smaller; **direction only** when the mean is positive but the interval reaches 0; **not reproduced** when "
        "the mean gain is 0 or negative; **pending** while a cell has fewer records than the protocol's seeds.\n",
    ]
    summaries = []
    protocols = sorted({r["protocol"] for r in records} | {PROTOCOL})
    fig, axes = harness.new_figure(ncols=2, width=5.0, height=3.6)
    for protocol in protocols:
        recs = [r for r in records if r["protocol"] == protocol]
        lines.append(f"## Results, protocol {protocol}: {SETTING}\n")
        acc = {b: harness.by_seed(recs, final_acc, method=method_name(b)) for b in BETAS}
        complete = {b: len(acc[b]) >= len(SEEDS) for b in BETAS}
        rows = []
        for b in BETAS:
            rs = [r for r in recs if r["method"] == method_name(b)]
            n = f"{len(rs)}/{len(SEEDS)}" + ("" if complete[b] else " (incomplete)")
            low = harness.mean_ci([np.mean(r["metrics"]["received_low"]) for r in rs])
            rows.append((_label(b), n, harness.fmt_ci(*harness.mean_ci(list(acc[b].values()))),
                         harness.fmt_ci(*low, scale=1.0, digits=2)))
        lines.append(harness.markdown_table(
            ("method", "seeds", "test accuracy % (mean [95 % CI])", "low-group clients per round"), rows))
        means = {b: harness.mean_ci(list(acc[b].values()))[0] for b in BETAS if acc[b]}
        if means:
            best = max(means, key=lambda b: means[b])
            state = "" if all(complete.values()) else " (incomplete cells)"
            lines.append(f"\nBest beta by mean accuracy: **{best:g}**{state} (paper: {PAPER_BETA_OPT:g}).\n")
        lines.append("Paired differences (percentage points) and verdicts:\n")
        prow = []
        for cid, b, base, gain, where in CLAIMS:
            mean, lo, hi, n = harness.paired(acc[b], acc[base])
            ok = complete[b] and complete[base]
            verdict = (harness.verdict_for_gain(lo, mean, hi, None if gain is None else gain / 100) if ok
                       else "pending")
            paper = "a gain (no number in the text)" if gain is None else f"+{gain:g} pp"
            ours = harness.fmt_ci(mean, lo, hi, unit=" pp")
            prow.append((cid, f"{_label(b)} - {_label(base)}", n, ours, paper, f"**{verdict}**"))
            if protocol == PROTOCOL:
                summaries.append(harness.Summary(f"{cid} {where}", paper, f"{ours} ({n} seeds)", verdict))
        lines.append(harness.markdown_table(("claim", "difference", "seeds", "ours (mean [95 % CI])", "paper",
                                             "verdict"), prow))
        lines.append("")
        if protocol == PROTOCOL:
            xs = [b for b in BETAS if acc[b]]
            cis = [harness.mean_ci(list(acc[b].values())) for b in xs]
            axes[0].errorbar(xs, [100 * m for m, _, _ in cis],
                             yerr=[[100 * (m - lo) if lo == lo else 0 for m, lo, _ in cis],
                                   [100 * (hi - m) if hi == hi else 0 for m, _, hi in cis]], marker="o", capsize=3)
            for b in xs:
                rs = [r for r in recs if r["method"] == method_name(b)]
                curves = np.array([r["metrics"]["val_acc"] for r in rs])
                axes[1].plot(rs[0]["metrics"]["round"], 100 * curves.mean(0), label=f"{_label(b)} (n={len(rs)})")
    axes[0].set(title=f"{SETTING} (protocol {PROTOCOL})", xlabel="beta",
                ylabel=f"test accuracy %, last {B['metric_window_rounds']} rounds (95 % CI)")
    axes[1].set(title="test accuracy per round, mean over seeds", xlabel="round", ylabel="test accuracy %")
    axes[1].legend(fontsize=7)
    harness.save_figure(fig, out_dir / "accuracy.png")
    lines += [
        "![accuracy against beta, and per round](fedstale/accuracy.png)\n",
        *harness.reproduce_section(records, (
            "OMP_NUM_THREADS=1 python scripts/reproduce.py run fedstale          # the missing (cell, seed) records",
            "python scripts/reproduce.py report                                  # this page, from the records",
        )),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out / "fedstale.md").write_text("\n".join(lines) + "\n")
    return summaries


STUDY = harness.Study(name="fedstale", title="FedStale", protocol=PROTOCOL, seeds=SEEDS, cells=CELLS, run=run_cell,
                      report=write_report, threads=1)
