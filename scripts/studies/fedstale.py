"""FedStale (Rodio & Neglia, "FedStale: leveraging stale client updates in federated learning"): the beta sweep.

The paper's recipe on Fashion-MNIST, scaled to a 2-core CPU: ``N`` clients, an IID split of the training set, two
participation groups drawn at random (half always on, half with ``p_min``, Bernoulli every round, probabilities
known to the server), and the paper's **label-swap** heterogeneity: a fraction ``sigma`` of the samples of each
class of a label pair get the other label. Protocol v1 swapped one pair in the *second* (less participating) group
only (``LabelSwap(sigma, pairs=(pair,), swap_clients=<low group>)``); protocol v2 follows the authors' code, every
client swapping, client ``i`` the pair ``[(0, 1), (8, 9)][i % 2]`` (``LabelSwap(sigma)``). Each client also holds an
equal IID shard of the test set with the same swap, and the test accuracy is measured on the union of these shards:
with equal shard sizes that is ``(1/N) sum_i acc_i``, the accuracy on the paper's objective ``(1/N) sum_i F_i``.

Methods: ``FedStale(beta)`` with known ``p_i`` (the paper's Eq. 9: ``beta = 0`` is unbiased FedAvg, ``beta = 1``
unbiased FedVARP) for ``beta`` in {0, 0.2, 0.5, 0.8, 1}. Protocol v3 (``V3_CELLS``) runs them to convergence at an
interior learning rate; protocol v4 (``CELLS``) runs C2's two cells (beta 0.8, FedVARP) on 74 fresh seeds.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedStale
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import LabelSwap, fashion_mnist
from lightning_fedhet.experiments import (
    Cell,
    Summary,
    by_seed,
    decide_paired,
    family_intervals,
    fmt_ci,
    fmt_mean_ci,
    fmt_vs_bound,
    grid_place,
    markdown_table,
    mean_ci,
    new_figure,
    paired,
    reproduce_section,
    save_figure,
    seeds_done,
    tail_change,
    verdict_for_gain,
)
from lightning_fedhet.participation import Bernoulli, TwoGroup

from . import _repo, _train, _v3

NUM_CLASSES = 10
BETAS = (0.0, 0.2, 0.5, 0.8, 1.0)
SWAP_ALL = "every client: client i swaps swap_pairs[i % 2] (the authors' code)"


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
    """The label-swap heterogeneity over an IID base split. Protocol v1: only the low group swaps ``sigma`` of one
    pair's samples (a literal reading of "the second group"). Protocol v2: every client swaps, client ``i`` the pair
    ``swap_pairs[i % 2]`` (the authors' code: even clients (0, 1), odd clients (8, 9))."""
    if c["swap_group"] == SWAP_ALL:
        return LabelSwap(c["sigma"], pairs=tuple(tuple(p) for p in c["swap_pairs"]))
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
def _build(cell, seed: int):
    """``(model, datamodule, strategy, low)`` of one seed, exactly as its run makes them (after seeding)."""
    c = cell.config
    data = datamodule(c, seed)
    _train.seed_all(seed)
    model = Classifier(c["model"], num_classes=NUM_CLASSES, lr=c["lr"],
                       model_kwargs={"width": c["width"], "hidden": c["hidden"]})
    strategy = FedHetStrategy(
        algorithm=FedStale(beta=c["beta"], weighting=c["weighting"], p_source=c["p_source"],
                           server_lr=c["server_lr"]),
        participation=Bernoulli(groups(c)), local_steps=c["local_steps"], engine=c["engine"], seed=seed)
    return model, data, strategy, groups(c).low_group(c["num_clients"], seed)


def _result(c: dict, curve, history: list[dict], participation, low: np.ndarray, data, engine: str) -> dict:
    if not np.array_equal(participation.p.numpy() < c["p_max"], low):
        raise RuntimeError("the participation's low group differs from the one the study reads")
    metrics = _train.series(curve)
    metrics["received"] = [len(h["received"]) for h in history]
    metrics["received_low"] = [int(low[h["received"].numpy()].sum()) for h in history]
    x, y = data.train_dataset.tensors
    return {"metrics": metrics, "engine": engine, "config": {"low_group": np.flatnonzero(low).tolist()},
            "data_checksum": _train.data_checksum(data.client_indices, x, y)}


def _needs_gpu(c: dict) -> None:
    if c.get("needs_gpu") and not torch.cuda.is_available():
        raise SystemExit("this cell waits for a GPU (the protocol's GPU cells); no CUDA device here")


def run_cell(cell, seed: int) -> dict:
    """Train one beta for one seed; metrics per evaluation: per-client-shard test accuracy; per round: arrivals."""
    c = cell.config
    _needs_gpu(c)
    torch.set_num_threads(1)
    model, data, strategy, low = _build(cell, seed)
    curve = _train.fit(model, data, strategy, c["rounds"], c["eval_every"])
    return _result(c, curve, strategy.history, strategy.participation, low, data, c["engine"])


def run_seeds(cell, seeds) -> list[dict]:
    """Every seed of ``seeds`` at once (:func:`lightning_fedhet.multiseed.fit_seeds`: their cohorts stacked in one
    vmap per round); each seed's result equals :func:`run_cell`'s for that seed within float tolerance (the engine
    contract). Only for cells whose engine is ``"vmap"``; the accuracy is computed on the validation tensors
    directly (the same micro accuracy as the Classifier's ``val_acc``)."""
    from lightning_fedhet.multiseed import fit_seeds

    c = cell.config
    _needs_gpu(c)
    if c["engine"] != "vmap":
        return [run_cell(cell, seed) for seed in seeds]
    torch.set_num_threads(1)
    device = "cuda" if c.get("needs_gpu") else "cpu"
    built: dict[int, tuple] = {}

    def build(seed: int):
        built[seed] = _build(cell, seed)  # seeds itself again: fit_seeds' seed_everything is the same call
        return built[seed][:3]

    def evaluate(module, seed: int, round: int) -> dict:
        x, y = built[seed][1].val_dataset.tensors
        module.eval()
        with torch.no_grad():
            correct = sum(int((module(x[s:s + 2400].to(device)).argmax(1).cpu() == y[s:s + 2400]).sum())
                          for s in range(0, len(y), 2400))
        return {"val_acc": correct / len(y)}

    _train.quiet()
    runs = fit_seeds(build, list(seeds), c["rounds"], eval_every=c["eval_every"], evaluate=evaluate, device=device)
    return [_result(c, run.evals, run.history, run.strategy.participation, built[run.seed][3], built[run.seed][1],
                    "vmap x seeds (multiseed.fit_seeds)") for run in runs]


# ------------------------------------------------------------------------------------------------ protocol v1 cells
SETTING = "sigma=0.6, p_avg/p_min=3"
V1_SEEDS = (0, 1, 2, 3, 4)
V1_LR = 0.316  # client learning rate 10^-0.5, chosen on pilot seed 100 (protocol v1)
V1_BASE = {
    "data": "fashion_mnist (all 60,000 training images, IID split)", "num_clients": 24, "low_fraction": 0.5,
    "p_max": 1.0, "p_min": 0.2, "participation": "Bernoulli, i.i.d. over rounds", "sigma": 0.6, "swap_pair": [0, 1],
    "swap_group": "low-participation group", "test_per_client": 50, "model": "fmnist_cnn", "width": 8, "hidden": 32,
    "local_steps": 5, "batch_size": 32, "lr": V1_LR, "local_solver": "SGD (no momentum, no weight decay)",
    "server_lr": 1.0, "weighting": "known_p", "p_source": "known", "rounds": 50, "eval_every": 2,
    "metric_window_rounds": 10, "engine": "vmap",
}
V1_CELLS = tuple(Cell(SETTING, method_name(b), {**V1_BASE, "beta": b}) for b in BETAS)

# ------------------------------------------------------------------------------------------------ protocol v2 cells
PROTOCOL = "v2"
SEEDS = tuple(range(14))  # the power analysis of protocol v2 (80 % power for C1 and C2 at v1's paired SDs)
LR = 1e-2  # the top of the paper's grid {1e-2, ..., 1e-4}, the best on pilot seed 100 (protocol v2)
BASE = {**{k: v for k, v in V1_BASE.items() if k != "swap_pair"}, "swap_group": SWAP_ALL,
        "swap_pairs": [[0, 1], [8, 9]], "lr": LR}
GPU_SETTING = SETTING + ", paper width"
#: the order the CPU cells run in (C1 and C2 first, then C3/C4's beta = 0.5, then the descriptive beta = 0.2)
RUN_ORDER = (0.0, 0.8, 1.0, 0.5, 0.2)
CELLS = tuple(Cell(SETTING, method_name(b), {**BASE, "beta": b}) for b in RUN_ORDER) + tuple(
    Cell(GPU_SETTING, method_name(b), {**BASE, "beta": b, "width": 32, "hidden": 128, "batch_size": 128,
                                               "needs_gpu": True}) for b in RUN_ORDER)
V2_SEEDS, V2_CELLS = SEEDS, CELLS

# ------------------------------------------------------------------------------------------------ protocol v3 cells
PROTOCOL = "v3"
#: fresh seeds (none used by v1, v2 or the pilots): 80 % power for C1 at v2's paired SD needs 18
SEEDS = tuple(range(20, 38))
#: the client learning-rate grid of protocol v3: the paper's top value 1e-2 extended upwards until the pick is interior
V3_GRID = (1e-2, 10 ** -1.5, 1e-1, 10 ** -0.5, 1.0)
V3_LR = 10 ** -0.5  # the pilot's pick (seed 100; protocol v3, "Pilot"), interior: 1e-1 lower, 1 diverges
V3_ROUNDS = 150
#: protocol v3's convergence check: |tail_change| of a cell's seed-mean accuracy curve below 1 pp
CONVERGENCE_BOUND = 0.01
V3_SETTING = SETTING + ", converged"
V3_BASE = {**BASE, "lr": V3_LR, "lr_grid": list(V3_GRID), "rounds": V3_ROUNDS}
CELLS = tuple(Cell(V3_SETTING, method_name(b), {**V3_BASE, "beta": b}) for b in RUN_ORDER)
V3_SEEDS, V3_CELLS = SEEDS, CELLS

# ------------------------------------------------------------------------------------------------ protocol v4 cells
# C2 alone, powered: v3's setting and check, the two cells C2 compares (beta 0.8 against FedVARP), on fresh seeds.
PROTOCOL = "v4"
#: the claim v4 tests (v3: inconclusive, 74 seeds for 80 % power at v3's paired SD)
V4_CLAIM = "C2"
#: fresh seeds (v1-v3 ran 0-37, the pilots 100): 80 % power to resolve the paper's Delta_1 = 0.31 pp at v3's
#: paired SD of C2 (0.94 pp), raw 95 % (v4's family is this one claim)
SEEDS = tuple(range(200, 274))
CELLS = tuple(Cell(V3_SETTING, method_name(b), {**V3_BASE, "beta": b}) for b in (0.8, 1.0))
#: per protocol: its seeds and cells (the page shows every protocol with its own verdicts)
PROTOCOLS = {"v1": (V1_SEEDS, V1_CELLS), "v2": (V2_SEEDS, V2_CELLS), "v3": (V3_SEEDS, V3_CELLS),
             PROTOCOL: (SEEDS, CELLS)}

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


def describe(c: dict) -> str:
    """One setting's recipe in words, from its cell configuration."""
    n_low = int(c["low_fraction"] * c["num_clients"])
    if c["swap_group"] == SWAP_ALL:
        swap = (f"every client swaps a fraction sigma = {c['sigma']:g} of one label pair, client i the pair "
                f"{' / '.join(str(tuple(p)) for p in c['swap_pairs'])} by i mod 2 (the authors' code)")
    else:
        swap = (f"the low group swaps a fraction sigma = {c['sigma']:g} of labels {c['swap_pair'][0]} and "
                f"{c['swap_pair'][1]}")
    return (f"N = {c['num_clients']} ({n_low} with p_min = {c['p_min']:g}, the others always on; Bernoulli, p "
            f"known); {swap}, in training and test shards; {c['rounds']} rounds; CNN width {c['width']}, hidden "
            f"{c['hidden']}; batch {c['batch_size']}; {c['local_steps']} local steps; client lr {c['lr']:g}")


def _beta_rows(recs: list[dict], setting: str, seeds: tuple, acc: dict, complete: dict) -> list[tuple]:
    rows = []
    for b in BETAS:
        rs = [r for r in recs if r["setting"] == setting and r["method"] == method_name(b)]
        n = f"{len(rs)}/{len(seeds)}" + ("" if complete[b] else " (incomplete)")
        low = mean_ci([np.mean(r["metrics"]["received_low"]) for r in rs])
        rows.append((_label(b), n, fmt_mean_ci(list(acc[b].values())),
                     fmt_ci(*low, scale=1.0, digits=2)))
    return rows


def _setting_section(protocol: str, setting: str, cells: list, seeds: tuple, recs: list[dict], summaries: list,
                     primary: bool) -> list[str]:
    c = cells[0].config
    lines = [f"### {setting}\n", describe(c) + ".\n"]
    betas_here = [cell.config["beta"] for cell in cells]
    if c.get("needs_gpu") and not recs:
        lines.append(f"**Waiting for a GPU**: {len(cells)} cells x {len(seeds)} seeds, none run yet (see the "
                     "protocol for the cost on this machine).\n")
        return lines
    acc = {b: by_seed(recs, final_acc, setting=setting, method=method_name(b)) for b in BETAS}
    complete = {b: b in betas_here and len(acc[b]) >= len(seeds) for b in BETAS}
    lines.append(markdown_table(
        ("method", "seeds", "test accuracy % (mean [95 % CI])", "low-group clients per round"),
        _beta_rows(recs, setting, seeds, acc, complete)))
    means = {b: mean_ci(list(acc[b].values()))[0] for b in BETAS if acc[b]}
    if means:
        best = max(means, key=lambda b: means[b])
        state = "" if all(complete[b] for b in betas_here) else " (incomplete cells)"
        lines.append(f"\nBest beta by mean accuracy: **{best:g}**{state} (paper: {PAPER_BETA_OPT:g}).\n")
    lines.append("Paired differences (percentage points) and verdicts; the half-width is the paired interval's, "
                 "beside the paper's effect it must beat:\n")
    prow = []
    for cid, b, base, gain, where in CLAIMS:
        mean, lo, hi, n = paired(acc[b], acc[base])
        ok = complete[b] and complete[base]
        verdict = (verdict_for_gain(lo, mean, hi, None if gain is None else gain / 100) if ok
                   else "pending")
        half = (hi - lo) / 2
        resolves = "–" if gain is None or half != half else ("yes" if 100 * half < gain else "no")
        if verdict in ("direction only", "not reproduced") and resolves == "no" and lo <= 0 <= hi:
            verdict += " (interval wider than the paper's effect)"
        paper = "a gain (no number in the text)" if gain is None else f"+{gain:g} pp"
        ours = fmt_ci(mean, lo, hi, unit=" pp")
        width = "–" if half != half else f"{100 * half:.2f} pp"
        prow.append((cid, f"{_label(b)} - {_label(base)}", n, ours, width, resolves, paper, f"**{verdict}**"))
        if primary:
            summaries.append(Summary(f"{cid} {where} [{protocol}]", paper, f"{ours} ({n} seeds)", verdict))
    lines.append(markdown_table(("claim", "difference", "seeds", "ours (mean [95 % CI])", "half-width",
                                         "half-width < paper's effect", "paper", "verdict"), prow))
    lines.append("")
    return lines


def _v2_relabel(recs: list[dict], labels: dict | None = None) -> list[str]:
    """Protocol v2's claims under the v3 rule, beside the labels v2 registered ("v2 records, v3 rule"). The v3 rule
    withholds a verdict from cells that fail protocol v3's convergence check, and every v2 cell does (its accuracy
    still rises by about 3 pp over the last 20 % of its 50 rounds); the labels the intervals alone would give are
    shown beside."""
    acc = {b: by_seed(recs, final_acc, setting=SETTING, method=method_name(b)) for b in BETAS}
    change = {b: _v3_checks(recs, b)[0] for b in BETAS if acc[b]}
    gains = {cid: (acc[b], acc[base], None if gain is None else gain / 100) for cid, b, base, gain, _ in CLAIMS}
    relabelled = _v3.relabel(gains, len(V2_SEEDS))
    rows = []
    for cid, b, base, gain, _ in CLAIMS:
        r = relabelled[cid]
        mean, lo, hi, _n = paired(acc[b], acc[base])
        registered = (verdict_for_gain(lo, mean, hi, None if gain is None else gain / 100)
                      if r.raw.n >= len(V2_SEEDS) else "pending")
        conv = all(abs(change.get(x, 0.0)) < CONVERGENCE_BOUND for x in (b, base))
        v3 = decide_paired(acc[b], acc[base], None if gain is None else gain / 100, len(V2_SEEDS), converged=conv)
        drift = ", ".join(f"{100 * change[x]:+.1f}" for x in (b, base) if x in change)
        holm, raw_label, on_holm = _v3.cells(r, _v3.fmt_pp)
        if labels is not None:
            labels[cid] = v3.text() + _v3.MARK
        rows.append((cid, f"{_label(b)} - {_label(base)}", _v3.fmt_pp(mean, lo, hi, against=r.raw.against),
                     registered, holm, f"**{v3.text()}** (change {drift} pp)", raw_label.strip("*"), on_holm))
    return [_v3.note(len(CLAIMS), "C1-C4"),
            "Protocol v3's convergence check (|change of the seed-mean accuracy over the last 20 % of rounds| < "
            f"{100 * CONVERGENCE_BOUND:g} pp) fails for every v2 cell: the v2 runs still climb at round 50. Under the "
            "v3 rule they get no verdict; the last two columns give the labels the raw and the Holm intervals alone "
            "would give.\n",
            markdown_table(("claim", "difference", "ours (raw 95 % CI)", "v2 label (registered rule)",
                            "Holm-adjusted interval", "v3 label (v2 records, v3 rule)", "the raw interval alone",
                            "the Holm interval alone"), rows), ""]


def _v3_checks(recs: list[dict], beta: float) -> tuple[float, bool]:
    """A v3 cell's convergence check: ``tail_change`` of its seed-mean curve and whether it is below the bound."""
    runs = [r for r in recs if r["method"] == method_name(beta)]
    curve = np.mean([r["metrics"]["val_acc"] for r in runs], axis=0)
    change = tail_change(runs[0]["metrics"]["round"], curve)
    return change, abs(change) < CONVERGENCE_BOUND


def _v3_section(recs: list[dict], summaries: list) -> list[str]:
    """Protocol v3: each beta with its convergence check and the learning rate's place in its grid, and C1-C4
    decided by :func:`~lightning_fedhet.experiments.decide` on Holm intervals over the four claims."""
    planned = len(V3_SEEDS)
    place = grid_place(V3_LR, V3_GRID)
    recs = [r for r in recs if r["seed"] in set(V3_SEEDS)]  # a run outside the plan is not pooled in
    acc = {b: by_seed(recs, final_acc, setting=V3_SETTING, method=method_name(b)) for b in BETAS}
    checks = {b: _v3_checks(recs, b) for b in BETAS if acc[b]}
    rows = [(_label(b), f"{V3_LR:g} ({place})", fmt_mean_ci(list(acc[b].values())),
             fmt_vs_bound(checks[b][0], CONVERGENCE_BOUND, unit=" pp"),
             "yes" if checks[b][1] else "**no**", seeds_done(len(acc[b]), planned))
            for b in BETAS if acc[b]]
    lines = [f"### {V3_SETTING}\n", describe(V3_CELLS[0].config) + ".\n",
             markdown_table(("method", "client lr (place in the grid)", "test accuracy % (mean [95 % CI])",
                             "convergence: change over the last 20 % of rounds (seed-mean curve)",
                             f"converged (< {100 * CONVERGENCE_BOUND:g} pp)", "seeds"), rows)]
    means = {b: mean_ci(list(acc[b].values()))[0] for b in BETAS if acc[b]}
    if means:
        best = max(means, key=lambda b: means[b])
        done = all(len(acc[b]) >= planned for b in BETAS)
        lines.append(f"\nBest beta by mean accuracy: **{best:g}**{'' if done else ' (incomplete cells)'} "
                     f"(paper: {PAPER_BETA_OPT:g}).\n")
    diffs = {cid: [acc[b][k] - acc[base][k] for k in sorted(set(acc[b]) & set(acc[base]))]
             for cid, b, base, _, _ in CLAIMS}
    holm = family_intervals(diffs, method="holm")
    prow = []
    for cid, b, base, gain, where in CLAIMS:
        conv = all(checks.get(x, (0.0, True))[1] for x in (b, base))
        d = decide_paired(acc[b], acc[base], None if gain is None else gain / 100, planned,
                          interval=holm[cid][1:], converged=conv, lr_interior=place == "interior")
        mean, lo, hi, n = paired(acc[b], acc[base])
        paper = "a gain (no number in the text)" if gain is None else f"+{gain:g} pp"
        prow.append((cid, f"{_label(b)} - {_label(base)}", n, _v3.fmt_pp(mean, lo, hi), _v3.fmt_pp(d.mean, d.lo, d.hi),
                     paper, f"**{d.text()}**"))
        summaries.append(Summary(f"{cid} {where} [v3]", paper, f"{_v3.fmt_pp(mean, lo, hi)} ({n} seeds)", d.text()))
    lines += ["Claims, decided by `lightning_fedhet.experiments.decide` on **Holm intervals over the four claims** "
              "(the raw 95 % interval beside); a claim whose cells are not converged, or whose learning rate sits at "
              "its grid's edge, gets no verdict:\n",
              markdown_table(("claim", "difference", "seeds", "ours (raw 95 % CI)", "deciding interval (Holm, 4 "
                              "claims)", "paper", "v3 label"), prow), ""]
    return lines


def _v4_section(recs: list[dict], summaries: list) -> list[str]:
    """Protocol v4: C2 alone on its planned seeds, v3's setting and checks, decided by
    :func:`~lightning_fedhet.experiments.decide` on its raw 95 % interval (a family of one); v3's label beside, read
    from ``summaries`` (v3's section runs first: :data:`PROTOCOLS` is in order)."""
    cid, b, base, gain, where = next(c for c in CLAIMS if c[0] == V4_CLAIM)
    planned, place = len(SEEDS), grid_place(V3_LR, V3_GRID)
    recs = [r for r in recs if r["seed"] in set(SEEDS)]  # a run outside the plan is not pooled in
    acc = {x: by_seed(recs, final_acc, setting=V3_SETTING, method=method_name(x)) for x in (b, base)}
    checks = {x: _v3_checks(recs, x) for x in (b, base) if acc[x]}
    rows = [(_label(x), f"{V3_LR:g} ({place})", fmt_mean_ci(list(acc[x].values())),
             fmt_vs_bound(checks[x][0], CONVERGENCE_BOUND, unit=" pp"),
             "yes" if checks[x][1] else "**no**", seeds_done(len(acc[x]), planned))
            for x in (b, base) if acc[x]]
    conv = all(checks.get(x, (0.0, True))[1] for x in (b, base))
    d = decide_paired(acc[b], acc[base], gain / 100, planned, converged=conv, lr_interior=place == "interior")
    before = [x for x in summaries if x.claim == f"{cid} {where} [v3]"]
    paper = f"+{gain:g} pp"
    ours = "–" if d.n == 0 else _v3.fmt_pp(d.mean, d.lo, d.hi)
    summaries.append(Summary(f"{cid} {where} [v4]", paper, f"{ours} ({d.n} seeds)", d.text()))
    sd = float(np.std([acc[b][k] - acc[base][k] for k in sorted(set(acc[b]) & set(acc[base]))], ddof=1)) \
        if d.n > 1 else float("nan")
    return [
        f"### {V3_SETTING}: {cid} alone\n",
        f"v3's setting, cells and checks for the two betas {cid} compares, on {planned} fresh seeds "
        f"({SEEDS[0]}-{SEEDS[-1]}), planned for 80 % power to resolve the paper's {paper} at v3's paired SD. Decided "
        "by `lightning_fedhet.experiments.decide` on the **raw 95 % interval** (v4's family is this one claim); a "
        "cell whose seed-mean curve moves by 1 pp or more over the last 20 % of rounds, or whose learning rate sits "
        "at its grid's edge, gets no verdict.\n",
        markdown_table(("method", "client lr (place in the grid)", "test accuracy % (mean [95 % CI])",
                        "convergence: change over the last 20 % of rounds (seed-mean curve)",
                        f"converged (< {100 * CONVERGENCE_BOUND:g} pp)", "seeds"), rows) if rows else
        "No records yet.\n",
        "",
        markdown_table(("claim", "difference", "seeds", "ours (raw 95 % CI, decides)", "paired SD (pp)", "paper",
                        "v4 label", f"v3 label ({len(V3_SEEDS)} seeds)"),
                       [(cid, f"{_label(b)} - {_label(base)}", f"{d.n}/{planned}", ours,
                         "–" if sd != sd else f"{100 * sd:.2f}", paper, f"**{d.text()}**",
                         before[0].verdict if before else "–")]),
        "",
    ]


def write_report(records: list[dict], out) -> list:
    out_dir = out / "fedstale"
    lines = [
        "# FedStale: the weight of stale updates, beta, on Fashion-MNIST with label-swap heterogeneity\n",
        "Generated by `python scripts/reproduce.py report` from the records in `records/fedstale/`; do not edit.\n",
        "Protocols: " + ", ".join(f"[{p}](fedstale/protocol-{p}.md)" for p in PROTOCOLS) + " (each committed before "
        "its runs; each lists the paper's setting beside ours, every departure and its reason). The page shows "
        "every protocol's results with its own verdicts.\n",
        "## Claims (quoted from the paper)\n",
        "- Fig. 5 (thesis Fig. 3.5), exact participation probabilities, sigma = 0.6, p_avg/p_min = 3: "
        f"beta_opt = {PAPER_BETA_OPT:g}, gain over FedAvg Delta_0 = {PAPER_DELTA0:g} pp, gain over FedVARP "
        f"Delta_1 = {PAPER_DELTA1:g} pp (MNIST).",
        "- Fig. 3: \"FedStale (beta = 0.5), without particular fine-tuning, consistently outperforms FedVARP in "
        "settings of moderate participation heterogeneity and improves over FedAvg as client data become "
        "heterogeneous (already at sigma >= 0.2).\" (no numbers in the text).\n",
        "Metric: mean accuracy on the union of the per-client test shards over the evaluations in the last "
        f"{V1_BASE['metric_window_rounds']} rounds (one every {V1_BASE['eval_every']} rounds), Fashion-MNIST.\n",
        "Decision rule per claim (paired over seeds, gain = acc(FedStale(beta)) - acc(baseline)): **reproduced** "
        "when the 95 % interval of the mean gain lies above 0 and the mean is at least half the paper's gain (or, "
        "where the paper gives no number, when the interval lies above 0); **partly reproduced** when above 0 but "
        "smaller; **direction only** when the mean is positive but the interval reaches 0; **not reproduced** when "
        "the mean gain is 0 or negative; **pending** while a cell has fewer records than the protocol's seeds. An "
        "inconclusive verdict (interval around 0) whose interval is wider than the paper's effect says so: such a "
        "test could not have resolved the paper's gain. (Protocols v1 and v2.)\n",
        "Protocol v3 decides with the library's rule, `lightning_fedhet.experiments.decide`: **reproduced** when the "
        "deciding interval lies above 0, **opposite sign** when below 0, **not reproduced** when it holds 0 and lies "
        "below the paper's gain, **inconclusive** when it holds both (or, for a claim without a number, holds 0), "
        "**pending** while a cell has fewer seeds than planned; the deciding interval is Holm-adjusted over C1-C4; a "
        "cell that fails its convergence check or whose learning rate sits at its grid's edge gets no verdict. "
        "Protocol v4 tests C2 alone with the same rule and checks on fresh seeds; its family is that one claim, so "
        "its raw interval decides.\n",
    ]
    summaries: list = []
    fig, axes = new_figure(ncols=2, width=5.0, height=3.6)
    for k, (protocol, (seeds, cells)) in enumerate(PROTOCOLS.items()):
        recs = [r for r in records if r["protocol"] == protocol]
        lines.append(f"## Results, protocol {protocol} ({len(seeds)} seeds)\n")
        primary = V3_SETTING if protocol in ("v3", "v4") else SETTING
        if protocol == "v4":
            lines += _v4_section(recs, summaries)
        elif protocol == "v3":
            if recs:
                lines += _v3_section(recs, summaries)
            else:
                lines.append("No records yet: every claim is **pending**.\n")
                summaries += [Summary(f"{cid} {where} [v3]", "a gain (no number in the text)" if gain is None
                                      else f"+{gain:g} pp", "–", "pending") for cid, _, _, gain, where in CLAIMS]
        else:
            settings = list(dict.fromkeys(cell.setting for cell in cells))
            for setting in settings:
                here = [cell for cell in cells if cell.setting == setting]
                srecs = [r for r in recs if r["setting"] == setting]
                lines += _setting_section(protocol, setting, here, seeds, srecs, summaries, setting == SETTING)
                if protocol == "v2" and setting == SETTING and srecs:
                    labels: dict[str, str] = {}
                    lines += _v2_relabel(srecs, labels)
                    summaries[:] = [dataclasses.replace(x, verdict=labels[x.claim.split()[0]])
                                    if x.claim.endswith("[v2]") and x.claim.split()[0] in labels else x
                                    for x in summaries]
        acc = {b: by_seed(recs, final_acc, setting=primary, method=method_name(b)) for b in BETAS}
        xs = [b for b in BETAS if acc[b]]
        cis = [mean_ci(list(acc[b].values())) for b in xs]
        axes[0].errorbar([x + 0.01 * k for x in xs], [100 * m for m, _, _ in cis],
                         yerr=[[100 * (m - lo) if lo == lo else 0 for m, lo, _ in cis],
                               [100 * (hi - m) if hi == hi else 0 for m, _, hi in cis]], marker="o", capsize=3,
                         label=f"protocol {protocol}")
        if protocol in ("v3", "v4"):
            for b in xs:
                rs = [r for r in recs if r["setting"] == primary and r["method"] == method_name(b)]
                curves = np.array([r["metrics"]["val_acc"] for r in rs])
                axes[1].plot(rs[0]["metrics"]["round"], 100 * curves.mean(0), ("-", ":")[protocol == "v4"],
                             color=f"C{BETAS.index(b)}", label=f"{protocol} {_label(b)} (n={len(rs)})")
    axes[0].set(title=SETTING, xlabel="beta",
                ylabel=f"test accuracy %, last {V1_BASE['metric_window_rounds']} rounds (95 % CI)")
    axes[0].legend(fontsize=7)
    axes[1].set(title="protocols v3, v4: test accuracy per round, mean over seeds", xlabel="round",
                ylabel="test accuracy %")
    if axes[1].lines:
        axes[1].legend(fontsize=7)
    save_figure(fig, out_dir / "accuracy.png")
    lines += [
        "![accuracy against beta, and per round](fedstale/accuracy.png)\n",
        *reproduce_section(records, (
            f"OMP_NUM_THREADS=1 python scripts/reproduce.py run fedstale --seeds {SEEDS[0]}-{SEEDS[-1]}   "
            "# protocol v4 (C2's two cells; chunks such as --seeds 200-209 resume)",
            "# v3: from a checkout of the commit its records name (from v4 on, `run fedstale` runs v4's cells)",
            f"OMP_NUM_THREADS=1 python scripts/reproduce.py run fedstale --settings '{V3_SETTING}'   # protocol v3",
            "python scripts/reproduce.py report                                  # this page, from the records",
        )),
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out / "fedstale.md").write_text("\n".join(lines) + "\n")
    return summaries


#: re-run bit for bit by `reproduce.py check --rerun` (CI): the protocol's first cell, cut to a few seconds
CANARY = Cell(V3_CELLS[0].setting, V3_CELLS[0].method,
                      {**V3_CELLS[0].config, "rounds": 2, "eval_every": 2, "metric_window_rounds": 2})

STUDY = _repo.study(name="fedstale", title="FedStale", protocol=PROTOCOL, seeds=SEEDS, cells=CELLS, run=run_cell,
                      report=write_report, threads=1, run_seeds=run_seeds, canary=CANARY)
