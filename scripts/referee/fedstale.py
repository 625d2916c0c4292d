"""FedStale against the authors' released code (arodio/FedStale): server rounds on the same updates, and trainings.

(a) Weights: their server round and ours on the same trace and the same client updates.

The authors' server round runs as released: ``aggregator.CentralizedAggregator.mix`` with their ``Learner``
(``learners/learner.py``), ``HistoryTracker`` (``history_tracker.py``), the ``HistorySGD`` server optimiser with
``history_coefficient = beta`` (``utils/optim.py``), ``average_learners`` (``utils/torch_utils.py``) and, choosing
who trains, their ``ActivitySimulator`` (``activity_simulator.py``) and ``UnbiasedClientsSampler``
(``client_sampler.py``, weights ``alpha_i / p_i`` with the exact ``p``). Only local training is replaced: their
``Client`` (``client.py``) is subclassed so that ``step()`` sets the client's model to the global model plus a
fixed update ``Delta_i(t)`` (dyadic numbers, drawn here from a seed), so both codes aggregate the same updates.

The library's ``FedStale(beta, weighting="known_p")`` is given the same trace (who trained), the same ``p`` the
authors' sampler divides by, the same ``alpha`` and the same updates; the global vectors after every round are
compared, for beta in {0, 0.2, 0.5, 0.8, 1}.

(b) Accuracy. The authors' ``train.py`` trains for real (``--accuracy-authors PATH``: an export of their commit
9584ad9, the parent of 3d61c42, where ``paper_experiments/mnist/run.sh``'s flags, the label-swap data code and a
consistent known-``p`` sampler still exist): their ``data/mnist/generate_data.py`` splits the data as run.sh does,
with the four Fashion-MNIST IDX files in the place of MNIST's, and ``train.py`` runs with their CNN, client SGD,
``HistorySGD`` server, ``ActivitySimulator`` and ``UnbiasedClientsSampler``. Replaced in memory: the import of the
never-committed ``learners.learners_ensemble`` and of scikit-learn (imported, not used on this path), and their
logging (``write_logs``) by a test-shard-only evaluation in the last rounds. The library trains the same clients'
images and (swapped) labels, from the same initial weights, under the same availability trace with
``FedHetStrategy(FedStale(beta))``. Paired over seeds per beta: their accuracy minus ours.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import io
import logging
import os
import runpy
import shutil
import sys
import time
import warnings
from pathlib import Path

import _common
import numpy as np
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedStale
from lightning_fedhet.algorithms.base import ClientInfo, RoundContext
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data.datasets import DEBIAN_FASHION_MNIST
from lightning_fedhet.experiments import fmt_ci, mean_ci, paired, parse_seeds
from lightning_fedhet.participation import Trace

STUDY = "fedstale"
REPO = "arodio/FedStale"
MODULES = ("aggregator", "client", "client_sampler", "activity_simulator", "history_tracker", "learners", "utils",
           "sklearn")
FILES = ["aggregator.py", "client.py", "client_sampler.py", "activity_simulator.py", "history_tracker.py",
         "learners/learner.py", "utils/optim.py", "utils/torch_utils.py"]
BETAS = (0.0, 0.2, 0.5, 0.8, 1.0)
#: their server optimiser's weight decay as released (utils/utils.py, get_optimizer("history"))
RELEASED_SERVER_WEIGHT_DECAY = 5e-4


class _Flat(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim))  # float32: their aggregation weights are float32


def _stubs() -> list[str]:
    """In-memory stand-ins for what the release imports but does not ship or this environment lacks."""
    stubbed = []
    if _common.stub_missing("learners.learners_ensemble"):
        stubbed.append("learners.learners_ensemble (imported by aggregator.py:12, absent from the repository)")
    if _common.stub_missing("sklearn.metrics", pairwise_distances=_common.Anything):
        stubbed.append("sklearn.metrics.pairwise_distances")
    if _common.stub_missing("sklearn.cluster", AgglomerativeClustering=_common.Anything):
        stubbed.append("sklearn.cluster.AgglomerativeClustering")
    return stubbed


def run_authors(mods, beta: float, weight_decay: float, n: int, rounds: int, dim: int, probs, lr: float,
                seed: int, updates) -> dict:
    aggregator, client_mod, client_sampler, activity_simulator, history_tracker, learner_mod, optim = mods

    def learner(opt=None) -> object:
        model = _Flat(dim)
        return learner_mod.Learner(model, criterion=None, metric=None, device="cpu",
                                   optimizer=opt(model) if opt else None)

    class Loader:
        def __init__(self, size: int) -> None:
            self.dataset = [None] * size

    class UnitUpdateClient(client_mod.Client):
        """Their Client; local training = the fixed update of this round."""

        round = 0

        def step(self, *args, **kwargs):
            self.counter += 1
            delta = torch.from_numpy(updates(UnitUpdateClient.round, self.id)).to(torch.float32)
            self.learner.set_param_tensor(self.learner.get_param_tensor() + delta)

    clients = [UnitUpdateClient(learner(), Loader(100), Loader(10), Loader(10), logger=None, local_steps=1, id_=i)
               for i in range(n)]
    global_learner = learner(lambda m: optim.HistorySGD(m.parameters(), lr=lr, momentum=0.0,
                                                        weight_decay=weight_decay, history_coefficient=beta))
    tracker = history_tracker.HistoryTracker(list(range(n)), [learner() for _ in range(n)], learner())
    agg = aggregator.CentralizedAggregator(clients=clients, global_learner=global_learner, history_tracker=tracker,
                                           log_freq=1, global_train_logger=None, global_test_logger=None, seed=seed)
    simulator = activity_simulator.ActivitySimulator(n, rounds, list(probs), rng=np.random.default_rng(seed))
    sampler = client_sampler.UnbiasedClientsSampler(clients, list(probs), simulator, None, False)
    out = {"w": [], "trace": np.zeros((rounds, n), dtype=bool), "q": [],
           "p_sampler": np.array([sampler.participation_dict[i] for i in range(n)]),
           # ActivitySimulator gives the probabilities to contiguous blocks of clients (activity_simulator.py)
           "p_simulator": np.repeat(np.asarray(probs, dtype=np.float64), n // len(probs))}
    for t in range(rounds):
        UnitUpdateClient.round = t
        ids, weights = sampler.sample(t)
        out["trace"][t, ids] = True
        out["q"].append(dict(zip(ids, weights)))
        agg.mix(ids, weights)
        out["w"].append(global_learner.get_param_tensor().detach().to(torch.float64).numpy().copy())
    return out


def run_library(beta: float, n: int, dim: int, trace: np.ndarray, p_used: np.ndarray, alpha: np.ndarray, lr: float,
                updates) -> list[np.ndarray]:
    algo = FedStale(beta, weighting="known_p", server_lr=lr, memory_dtype=torch.float64)
    algo.setup(n, torch.zeros(dim, dtype=torch.float64), client_weights=torch.from_numpy(alpha))
    probs = torch.from_numpy(p_used.astype(np.float64))
    out = []
    for t in range(trace.shape[0]):
        mask = torch.from_numpy(trace[t])
        algo.open_round(t, RoundContext(t, n, mask, mask, mask, participation_probs=probs))
        for i in np.flatnonzero(trace[t]):
            algo.add(int(i), torch.from_numpy(updates(t, int(i))), ClientInfo(num_samples=1, local_steps=1))
        out.append(algo.close_round().numpy().copy())
    return out


# ------------------------------------------------------------------------------------- (b) accuracy, both trainings
#: modules of their training path (top-level names purged before and after, so nothing leaks between runs)
TRAIN_MODULES = MODULES + ("train", "datasets", "models", "activity_estimator", "generate_data")
ACCURACY_FILES = ["paper_experiments/mnist/run.sh", "data/mnist/generate_data.py", "data/mnist/utils.py", "train.py",
                  "datasets.py", "models.py", "utils/utils.py", "utils/args.py", "utils/optim.py", "aggregator.py",
                  "client.py", "client_sampler.py", "activity_simulator.py", "history_tracker.py",
                  "learners/learner.py"]
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte")
#: their SubMNIST transform: ToTensor() then Normalize((0.1307,), (0.3081,))
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
#: the reduced setting both codes train (run.sh's layout; the data fraction, batch, lr and rounds cut to a CPU)
ACCURACY = {"num_clients": 24, "s_frac": 0.05, "data_seed": 12345, "participation_probs": (1.0, 0.2),
            "swap_proportion": 0.6, "batch_size": 32, "lr": 0.05, "server_lr": 1.0, "rounds": 50, "eval_every": 5,
            "window": 10, "weight_decay": 5e-4}
ACCURACY_BETAS = (0.0, 0.8, 1.0)


class KnownProbabilityTrace(Trace):
    """A replayed availability trace whose ``p`` is the probability the trace was drawn with (what their sampler
    divides by), not the trace's empirical frequency."""

    def __init__(self, mask: np.ndarray, p: np.ndarray) -> None:
        super().__init__(mask)
        self.known_p = np.asarray(p, dtype=np.float64)

    def _stationary(self) -> np.ndarray:
        return self.known_p.copy()


def normalised(images: torch.Tensor) -> torch.Tensor:
    """``uint8 [n, 28, 28]`` -> ``float32 [n, 1, 28, 28]`` as their SubMNIST gives them (ToTensor, Normalize)."""
    return images.unsqueeze(1).to(torch.float32).div(255).sub(MNIST_MEAN).div(MNIST_STD)


def eval_rounds(rounds: int, every: int, window: int) -> list[int]:
    """The rounds whose test accuracy is averaged: the multiples of ``every`` in the last ``window`` rounds."""
    return [r for r in range(every, rounds + 1, every) if r > rounds - window]


def prepare_data(authors: Path, c: dict) -> tuple[list[str], str]:
    """run.sh's data step in their folder: the four Fashion-MNIST IDX files where torchvision's ``MNIST`` reads
    MNIST's (``data/mnist/raw_data/MNIST/raw``, so nothing is downloaded), then their ``generate_data.py`` (cwd
    ``data/mnist``, ``all_data`` removed first as run.sh does). Returns the stand-ins used and what was done."""
    mnist = authors / "data" / "mnist"
    raw = mnist / "raw_data" / "MNIST" / "raw"
    source = Path(os.environ.get("FEDHET_FASHION_MNIST", DEBIAN_FASHION_MNIST))
    raw.mkdir(parents=True, exist_ok=True)
    for f in FASHION_FILES:
        with gzip.open(source / f"{f}.gz", "rb") as src, open(raw / f, "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(mnist / "all_data", ignore_errors=True)
    flags = ["--n_tasks", str(c["num_clients"]), "--s_frac", str(c["s_frac"]), "--test_tasks_frac", "0.0",
             "--seed", str(c["data_seed"])]
    argv = sys.argv
    with _common.authors_on_path(mnist, ("utils", "generate_data", "sklearn")), contextlib.chdir(mnist):
        def not_used(*args, **kwargs):
            raise RuntimeError("train_test_split is only called with --test_tasks_frac > 0")

        stubbed = ["sklearn.model_selection.train_test_split (generate_data.py)"] if _common.stub_missing(
            "sklearn.model_selection", train_test_split=not_used) else []
        sys.argv = ["generate_data.py", *flags]
        try:
            runpy.run_path("generate_data.py", run_name="__main__")
        finally:
            sys.argv = argv
    return stubbed, (f"the four Fashion-MNIST IDX files gunzipped from {source} into {raw.relative_to(authors)} (the "
                     "files torchvision's MNIST reads), then their data/mnist/generate_data.py " + " ".join(flags))


def run_authors_training(authors: Path, flags: list[str], evaluated: list[int],
                         server_weight_decay: float | None = None) -> dict:
    """Their ``train.py`` with ``flags``, in their folder. Captured: the availability matrix their simulator drew,
    every client's training and test shard (images, labels after their swap), the initial global weights, and the
    test accuracy (all clients' test shards, weighted by size as their ``write_logs``) after each round in
    ``evaluated``, scored by their ``Learner.evaluate_iterator``. ``server_weight_decay``: None runs their server
    optimiser as released (``HistorySGD`` with weight decay 5e-4); a number builds it with that weight decay
    instead (their ``get_optimizer`` wrapped in memory for ``"history"`` only; the clients' SGD is untouched)."""
    captured: dict = {"acc": []}
    argv = sys.argv
    with (_common.authors_on_path(authors, TRAIN_MODULES), contextlib.chdir(authors), _common.quiet(),
          contextlib.redirect_stderr(io.StringIO())):
        stubbed = _stubs()
        sys.argv = ["train.py", *flags]
        try:
            utils_mod = importlib.import_module("utils.utils")
            aggregator_mod = sys.modules["aggregator"]
            simulator_fn, aggregator_fn = utils_mod.get_activity_simulator, utils_mod.get_aggregator

            def get_activity_simulator(*args, **kwargs):
                simulator = simulator_fn(*args, **kwargs)
                captured["available"] = simulator.participation_matrix.T.astype(bool)  # [T, N]
                return simulator

            def get_aggregator(*args, **kwargs):
                agg = aggregator_fn(*args, **kwargs)
                captured["init"] = agg.global_learner.get_param_tensor().detach().clone()
                captured["server_weight_decay"] = agg.global_learner.optimizer.param_groups[0]["weight_decay"]
                captured["clients"] = [
                    {"train": (c.train_iterator.dataset.data.clone(), c.train_iterator.dataset.targets.clone()),
                     "test": (c.test_iterator.dataset.data.clone(), c.test_iterator.dataset.targets.clone()),
                     "first": c.train_iterator.dataset[0][0]} for c in agg.clients]
                return agg

            def write_logs(self) -> None:
                if self.c_round not in evaluated:
                    return
                correct = total = 0.0
                for client in self.clients:  # every client holds the global model after mix()
                    _, acc = client.learner.evaluate_iterator(client.test_iterator)
                    correct += acc * client.n_test_samples
                    total += client.n_test_samples
                captured["acc"].append((self.c_round, correct / total))

            if server_weight_decay is not None:
                history_sgd = utils_mod.HistorySGD  # utils/utils.py: from .optim import *

                def get_optimizer(optimizer_name, model, lr_initial, mu=0., history_coefficient=1.0,
                                  _released=utils_mod.get_optimizer):
                    if optimizer_name != "history":
                        return _released(optimizer_name, model, lr_initial, mu, history_coefficient)
                    return history_sgd([q for q in model.parameters() if q.requires_grad], lr=lr_initial,
                                       momentum=0., weight_decay=server_weight_decay,
                                       history_coefficient=history_coefficient)

                utils_mod.get_optimizer = get_optimizer
            utils_mod.get_activity_simulator = get_activity_simulator
            utils_mod.get_aggregator = get_aggregator
            aggregator_mod.CentralizedAggregator.write_logs = write_logs
            runpy.run_path("train.py", run_name="__main__")
        finally:
            sys.argv = argv
    captured["stubbed"] = stubbed
    return captured


def run_library_training(run: dict, beta: float, seed: int, c: dict, evaluated: list[int]) -> list:
    """The library on their clients' data (the same images, normalised as theirs, and the same swapped labels),
    from their initial weights, under their availability trace with the probabilities they divide by:
    ``FedHetStrategy(FedStale(beta))``, one local epoch of whole batches per round (their drop_last epoch),
    client SGD with their weight decay. Test accuracy on the union of their test shards after each round in
    ``evaluated``."""
    clients = run["clients"]
    for k, client in enumerate(clients):  # the inputs are theirs bit for bit
        if not torch.equal(normalised(client["train"][0][:1])[0], client["first"]):
            raise AssertionError(f"client {k}: the normalised image differs from their SubMNIST's")
    x = torch.cat([normalised(cl["train"][0]) for cl in clients])
    y = torch.cat([cl["train"][1] for cl in clients]).to(torch.int64)
    sizes = [len(cl["train"][1]) for cl in clients]
    bounds = np.cumsum([0, *sizes])
    parts = [list(range(bounds[i], bounds[i + 1])) for i in range(len(sizes))]
    val = TensorDataset(torch.cat([normalised(cl["test"][0]) for cl in clients]),
                        torch.cat([cl["test"][1] for cl in clients]).to(torch.int64))
    n = len(clients)
    probs = np.repeat(np.asarray(c["participation_probs"], dtype=np.float64), n // len(c["participation_probs"]))
    seed_everything(seed, workers=False, verbose=False)
    # the FedStale code's MnistCNN (the same layers in the same order), set to their initial global weights
    model = Classifier("mnist_cnn", num_classes=10, lr=c["lr"], weight_decay=c["weight_decay"])
    # a copy: vector_to_parameters makes the parameters views of the vector, which training then changes in place
    torch.nn.utils.vector_to_parameters(run["init"].to(torch.float32).clone(), model.model.parameters())
    data = FederatedDataModule(TensorDataset(x, y), parts, batch_size=c["batch_size"], val_dataset=val,
                               eval_batch_size=1000, seed=seed)
    strategy = FedHetStrategy(
        algorithm=FedStale(beta, weighting="known_p", server_lr=c["server_lr"]),
        participation=KnownProbabilityTrace(run["available"][: c["rounds"]], probs),
        local_steps=[max(1, s // c["batch_size"]) for s in sizes], client_weights="samples", engine="vmap",
        seed=seed)
    acc: list = []

    class Curve(Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            rnd = trainer.current_epoch + 1
            if not trainer.sanity_checking and rnd in evaluated:
                acc.append((rnd, float(trainer.callback_metrics["val_acc"])))

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    trainer = Trainer(strategy=strategy, max_epochs=c["rounds"], check_val_every_n_epoch=c["eval_every"],
                      logger=False, callbacks=[Curve()], enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu")
    trainer.fit(model, datamodule=data)
    return acc


def compare_accuracy(authors: Path, seeds, betas, c: dict, log_dir: Path) -> dict:
    stubbed, prepared = prepare_data(authors, c)
    participants = []
    evaluated = eval_rounds(c["rounds"], c["eval_every"], c["window"])
    theirs: dict = {b: {} for b in betas}
    ours: dict = {b: {} for b in betas}
    rows, cpu, info = [], {"authors": 0.0, "library": 0.0}, {}
    for beta in betas:
        for seed in seeds:
            flags = ["mnist", "--n_rounds", str(c["rounds"]), "--participation_probs",
                     *map(str, c["participation_probs"]), "--bz", str(c["batch_size"]), "--lr", str(c["lr"]),
                     "--log_freq", "1", "--device", "cpu", "--optimizer", "sgd", "--server_optimizer", "history",
                     "--history_coefficient", str(beta), "--swap_labels", "--swap_proportion",
                     str(c["swap_proportion"]), "--logs_dir", str(log_dir / f"b_{beta:g}" / f"seed_{seed}"),
                     "--seed", str(seed), "--verbose", "0"]
            t0 = time.process_time()
            run = run_authors_training(authors, flags, evaluated, c.get("authors_server_weight_decay"))
            cpu["authors"] += time.process_time() - t0
            wanted = c.get("authors_server_weight_decay")
            wanted = RELEASED_SERVER_WEIGHT_DECAY if wanted is None else wanted
            if run["server_weight_decay"] != wanted:
                raise AssertionError(f"their server optimiser ran with weight decay {run['server_weight_decay']}, "
                                     f"not {wanted}")
            t0 = time.process_time()
            lib = run_library_training(run, beta, seed, c, evaluated)
            cpu["library"] += time.process_time() - t0
            if [r for r, _ in run["acc"]] != evaluated or [r for r, _ in lib] != evaluated:
                raise AssertionError(f"evaluated rounds differ: {run['acc']} vs {lib} (wanted {evaluated})")
            a, b = float(np.mean([v for _, v in run["acc"]])), float(np.mean([v for _, v in lib]))
            theirs[beta][seed], ours[beta][seed] = a, b
            participants.append(float(run["available"][: c["rounds"]].sum(1).mean()))
            info = {"sizes": [len(cl["train"][1]) for cl in run["clients"]],  # the split is seed 12345's in all runs
                    "test": sum(len(cl["test"][1]) for cl in run["clients"]), "stubbed": run["stubbed"] + stubbed,
                    "participants": float(np.mean(participants))}
            rows.append([f"{beta:g}", seed, f"{100 * a:.1f}", f"{100 * b:.1f}", f"{100 * (a - b):+.1f}"])
            print(f"[referee fedstale] beta {beta:g} seed {seed}: authors {a:.4f} library {b:.4f} "
                  f"(cpu {cpu['authors']:.0f} s / {cpu['library']:.0f} s)", flush=True)
    diffs = {b: paired(theirs[b], ours[b]) for b in betas}
    return {"theirs": theirs, "ours": ours, "diffs": diffs, "rows": rows, "cpu": cpu, "prepared": prepared,
            "evaluated": evaluated, **info}


def weights_record(args: argparse.Namespace) -> None:
    """(a): the server step on fixed updates; writes ``weights-server-step.json``."""
    seeds = parse_seeds(args.seeds, ())
    dim, lr = 16, 1.0
    # (clients, participation_probs): their run.sh layout (24 clients, the first half always on) with the paper's
    # p_min = 0.2, and a dyadic control (32 clients, p = 0.25: alpha_i / p_i = 1/32, 1/8 exactly in float32)
    configs = ((24, (1.0, 0.2)), (32, (1.0, 0.25)))
    with _common.authors_on_path(args.authors, MODULES):
        stubbed = _stubs()
        import activity_simulator
        import aggregator
        import client as client_mod
        import client_sampler
        import history_tracker
        from learners import learner as learner_mod
        from utils import optim

        mods = (aggregator, client_mod, client_sampler, activity_simulator, history_tracker, learner_mod, optim)
        rows, worst, cases, wd_effect, mismatched, exact = [], 0.0, 0, 0.0, {}, {}
        for n, probs in configs:
            alpha = np.full(n, 1.0 / n)  # their clients_weights: n_train_samples / total, equal sizes here
            for beta in BETAS:
                diffs = []
                for seed in seeds:
                    def updates(t, i, seed=seed):
                        # dyadic values: their float32 sums of them are exact
                        return np.random.default_rng([seed, t, i]).integers(-8, 9, size=dim).astype(np.float64) / 8

                    theirs = run_authors(mods, beta, 0.0, n, args.rounds, dim, probs, lr, seed, updates)
                    ours = run_library(beta, n, dim, theirs["trace"], theirs["p_sampler"], alpha, lr, updates)
                    diffs.append(max(float(np.abs(a - b).max()) for a, b in zip(theirs["w"], ours)))
                    mismatched[n] = int((theirs["p_sampler"] != theirs["p_simulator"]).sum())
                    released = run_authors(mods, beta, RELEASED_SERVER_WEIGHT_DECAY, n, args.rounds, dim, probs, lr,
                                           seed, updates)
                    wd_effect = max(wd_effect, max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))
                                                   for a, b in zip(released["w"], theirs["w"])))
                    cases += args.rounds
                worst = max(worst, max(diffs))
                exact[(n, beta)] = max(diffs) == 0.0
                rows.append([n, f"[{probs[0]:g}, {probs[1]:g}]", f"{beta:g}", len(seeds) * args.rounds,
                             _common.sci(max(diffs))])
    exact_betas = [f"{b:g}" for b in BETAS if exact[(32, b)]]
    # their weights are float32 (aggregator.py: torch.tensor(weights, dtype=torch.float32)) and the model is
    # float32; beta = 0.2 / 0.8 are not dyadic, so their float32 arithmetic rounds at ~1e-7 of |w|
    tol = 1e-5
    record = _common.make_record(
        STUDY, "FedStale server step: the authors' CentralizedAggregator.mix vs the library's FedStale", "weights",
        args, REPO, FILES,
        f"{args.rounds} rounds, d = {dim}; two layouts: 24 clients with participation_probs [1.0, 0.2] (their "
        "run.sh layout, the first half always on, the paper's p_min) and 32 clients with [1.0, 0.25] (a dyadic "
        "control: every weight exact in float32); availability drawn by the authors' ActivitySimulator; weights "
        "alpha_i / p_i from their UnbiasedClientsSampler (exact p); client updates Delta_i(t) with entries in "
        "{-1, -7/8, ..., 1}, seeded by (seed, round, client); server lr 1. Each case is one round: the whole "
        "global vector after the round is compared",
        seeds, cases, worst, tol, worst <= tol,
        ["Run as released: CentralizedAggregator.mix, Learner, HistoryTracker, HistorySGD (history_coefficient = "
         "beta), average_learners, ActivitySimulator, UnbiasedClientsSampler. Their Client is subclassed so that "
         "step() adds the fixed update instead of training. Stubbed in memory because the release imports them "
         "but they are absent: " + "; ".join(stubbed) + ".",
         "Their server optimiser is built here with weight decay 0 (the library has none); their "
         "utils.get_optimizer('history') uses weight_decay=5e-4: with it, their global vector moves by up to "
         f"{wd_effect:.2g} of its size over {args.rounds} rounds on these inputs (a recipe difference, not part "
         "of the rule).",
         "Their aggregation weights and model are float32 (aggregator.py: torch.tensor(weights, "
         "dtype=torch.float32)), the library computes in float64: in the dyadic control the two agree exactly "
         f"(difference 0) for beta in {{{', '.join(exact_betas)}}}; elsewhere they differ by float32 rounding "
         "(1/24, 0.2 and 0.8 are not dyadic).",
         f"Release bug (exact-p path only): client_sampler.get_participation_dict tiles the probabilities "
         f"(np.tile: client i gets probs[i % 2]) while ActivitySimulator assigns them in contiguous blocks "
         f"(client i gets probs[i // (N/2)]): {mismatched[24]} of 24 clients ({mismatched[32]} of 32) are divided "
         "by the other group's p. "
         "The library here is given the p their sampler used, so the step is compared on identical inputs; the "
         "released scripts estimate p instead (--unknown_participation_probs).",
         "The release does not run as released (see the accuracy record): aggregator.py imports "
         "learners.learners_ensemble, which the repository does not contain."],
        table={"header": ["clients", "participation_probs", "beta", "rounds compared", "max |w_theirs - w_ours|"],
               "rows": rows})
    _common.write_record(args.root, "weights-server-step", record)


def accuracy_record(args: argparse.Namespace) -> None:
    """(b): both trainings on the same clients' data, initial weights and trace; writes ``accuracy-fedstale.json``."""
    authors = args.accuracy_authors
    marker = authors / ".referee-commit"
    ns = argparse.Namespace(**{**vars(args), "authors_commit": (marker.read_text().strip() if marker.is_file()
                                                                 else "unknown")})
    seeds = parse_seeds(args.accuracy_seeds, ())
    server_wd = args.authors_server_weight_decay
    c = {**ACCURACY, "authors_server_weight_decay": server_wd}
    res = compare_accuracy(authors, seeds, ACCURACY_BETAS, c, authors / "logs" / "referee")
    differences, rows, agree = [], list(res["rows"]), True
    notes = []
    for beta in ACCURACY_BETAS:
        mean, lo, hi, n = res["diffs"][beta]
        agree = agree and bool(lo <= 0 <= hi)
        a_ci = fmt_ci(*mean_ci(list(res["theirs"][beta].values())))
        b_ci = fmt_ci(*mean_ci(list(res["ours"][beta].values())))
        differences.append({"label": f"beta={beta:g}", "mean": mean, "low": lo, "high": hi, "seeds": n})
        rows.append([f"{beta:g}", "mean [95 % CI]", a_ci, b_ci, fmt_ci(mean, lo, hi)])
        notes.append(f"beta = {beta:g}: paired difference (theirs - ours) {fmt_ci(mean, lo, hi, unit=' pp')} over "
                     f"{n} seeds; theirs {a_ci} %, ours {b_ci} % (mean [95 % CI]).")
    p_low = c["participation_probs"][1]
    sizes = res["sizes"]
    record = _common.make_record(
        STUDY, "FedStale accuracy: the authors' train.py vs the library's, same clients' data, start and trace"
        + ("" if server_wd is None else f"; their server weight decay set to {server_wd:g}"),
        "accuracy", ns, REPO, ACCURACY_FILES,
        f"Fashion-MNIST in MNIST's place through their run.sh data step: N = {c['num_clients']} clients, their IID "
        f"split of s_frac = {c['s_frac']:g} of the 70,000 images (split seed {c['data_seed']}: {sum(sizes):,} "
        f"training images, {min(sizes)}-{max(sizes)} per client, and {res['test']} test images in per-client "
        f"shards); their label swap --swap_proportion {c['swap_proportion']:g} (client task_k swaps labels (0, 1) "
        "if k is even, (8, 9) if odd, in its training and test shard); participation_probs "
        f"[{c['participation_probs'][0]:g}, {p_low:g}] (their ActivitySimulator: half the clients always on, half "
        f"Bernoulli({p_low:g}), {res['participants']:.1f} per round on average), p known (their "
        "UnbiasedClientsSampler: alpha_i / p_i); FedStale(beta) for beta in "
        f"{{{', '.join(f'{b:g}' for b in ACCURACY_BETAS)}}} (their HistorySGD server, history_coefficient = beta, "
        f"server lr {c['server_lr']:g}); their CNN; {c['rounds']} rounds of one local epoch of whole batches of "
        f"{c['batch_size']} (their drop_last epoch: floor(n_i / {c['batch_size']}) SGD steps), client lr "
        f"{c['lr']:g}, weight decay {c['weight_decay']:g}. Their run draws the trace and the initial weights (their "
        "seed); the library trains the same clients' images and labels from those weights under that trace. "
        "Metric: test accuracy on the union of the clients' test shards (their write_logs weighting), mean over "
        f"the evaluations after rounds {', '.join(map(str, res['evaluated']))}",
        seeds, len(seeds) * len(ACCURACY_BETAS), None, None, agree,
        [*notes,
         "`agree` means every beta's paired interval contains 0.",
         "Their commit: 9584ad9, the parent of 3d61c42 (\"data heterogeneity\", which removed --swap_labels / "
         "--swap_proportion from utils/args.py with the label-swap data code, so HEAD cannot run "
         "paper_experiments/*/run.sh). At 9584ad9 run.sh's flags parse and the known-p sampler gives each client "
         "its own group's p (np.repeat, as the ActivitySimulator's blocks; HEAD's np.tile does not, see the weight "
         "record). HEAD's other change, de3c12e, fixes the estimated-p path (at 9584ad9 --unknown_participation_probs "
         "weighs a client by 1/p_hat_i, without alpha_i), so that flag is left out here: p is known, the paper's "
         "\"Exact\" setting. No commit contains learners/learners_ensemble.py.",
         "From run.sh, reduced to one CPU core: s_frac 0.05 (run.sh 0.2), --bz 32 (128), --lr 0.05 (5e-3), "
         f"{c['rounds']} rounds (4000), participation {p_low:g} (run.sh 0.5; the paper's p_min), "
         f"--swap_proportion {c['swap_proportion']:g} (one of run.sh's grid), --log_freq 1, --device cpu.",
         "Replaced in memory (nothing written to their files): imports that fail here get in-memory stand-ins, "
         "none of them called on this path (learners.learners_ensemble was never committed; scikit-learn is not "
         "installed): " + "; ".join(res["stubbed"]) + ". Their CentralizedAggregator.write_logs (every round it "
         "scores every client's training and test split and "
         "writes TensorBoard scalars) by one that scores the clients' test shards with their own "
         f"Learner.evaluate_iterator after rounds {', '.join(map(str, res['evaluated']))} only. get_activity_simulator "
         "and get_aggregator are wrapped to read the trace, the clients' data and the initial weights, unchanged. "
         + res["prepared"][0].upper() + res["prepared"][1:] + ".",
         "The same on both sides: every client's images (the library gets them normalised as their SubMNIST "
         "does, (0.1307, 0.3081), checked bit for bit on each client's first image) and labels after their swap, "
         "the client sizes and alpha_i = n_i / n, the initial global weights (theirs copied into the library's "
         "mnist_cnn, the same layers in the same order), the availability trace and the p_i divided by, the local "
         "epoch, lr and client weight decay, the test shards.",
         "Still different: the minibatch order (their DataLoader shuffles from torch's global generator, the "
         "library draws a permutation per seed, round and client); "
         + ("their server optimiser's weight decay 5e-4 (utils.get_optimizer('history'); the library's server step "
            "has none); " if server_wd is None else "")
         + "their model and aggregation in float32 with the stale-update memory as per-client model copies, the "
         "library's vmap cohort step (float32, summation order).",
         *([] if server_wd is None else [
             f"Their server optimiser is built with weight decay {server_wd:g} in place of the released 5e-4: "
             "utils.utils.get_optimizer is wrapped in memory for 'history' (their HistorySGD, momentum 0, their "
             "history_coefficient), every other optimiser as released. The library's server step has no weight "
             "decay, so this removes the one recipe difference the first accuracy record named. This record was "
             "made after that record had been seen, to test that named difference; it does not replace it."]),
         f"CPU time: authors {res['cpu']['authors'] / 60:.1f} min, library {res['cpu']['library'] / 60:.1f} min "
         "(1 thread, nice 10, shared 2-core machine)."],
        table={"header": ["beta", "seed", "authors' train.py %", "library %", "difference (pp)"], "rows": rows},
        differences=differences,
        accuracy={f"{b:g}": {"authors": {str(k): v for k, v in res["theirs"][b].items()},
                             "library": {str(k): v for k, v in res["ours"][b].items()}} for b in ACCURACY_BETAS},
        cpu_s={k: round(v, 1) for k, v in res["cpu"].items()})
    _common.write_record(args.root, "accuracy-fedstale" + ("" if server_wd is None else
                                                          f"-server-wd-{server_wd:g}"), record)


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], [
        (("--seeds",), {"default": "0-2", "help": "seeds of the traces and updates of (a)"}),
        (("--rounds",), {"type": int, "default": 60, "help": "rounds of (a)"}),
        (("--no-weights",), {"action": "store_true", "help": "skip the weight comparison (a)"}),
        (("--accuracy-authors",), {"type": Path, "default": None,
                                   "help": "scratch export of their commit 9584ad9 for (b) (train.py trains there)"}),
        (("--accuracy-seeds",), {"default": "0-4", "help": "seeds of (b), paired per beta"}),
        (("--authors-server-weight-decay",), {"type": float, "default": None,
                                              "help": "(b): build their server optimiser with this weight decay "
                                                      "(default: as released, 5e-4); writes "
                                                      "accuracy-fedstale-server-wd-X.json"}),
    ])
    torch.set_num_threads(1)
    if not args.no_weights:
        weights_record(args)
    if args.no_accuracy:
        return
    if args.accuracy_authors is None or not args.accuracy_authors.is_dir():
        raise SystemExit("(b) needs --accuracy-authors PATH, an export of their commit 9584ad9 (or --no-accuracy)")
    args.accuracy_authors = args.accuracy_authors.resolve()
    accuracy_record(args)


if __name__ == "__main__":
    main()
