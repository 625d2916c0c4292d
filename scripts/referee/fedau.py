"""FedAU against the authors' released code (IBM/fedau): their ``main.py`` and ours on the same inputs.

(a) Weights. The authors' ``main.py`` runs unmodified, with their participation samplers (``util/util.py``
``WorkerSampler``) and their partition / participation probabilities (``data_participation_each_node``), but with
three modules replaced in memory so that a client's local training is a unit step on its own coordinate:

- ``dataset.dataset.load_data`` returns a small labelled stand-in (the partition code needs labels only);
- ``model.model.Model`` is a linear "model" with one float64 parameter per client: one SGD step of size 1 on the
  loss ``-w[owner]`` moves the owner's coordinate by exactly 1, so ``Delta_n = e_n``;
- ``statistic.collect_stat.CollectStatistics`` records the global vector after every round and sets it back to 0,
  so each round's global vector is exactly that round's aggregate ``eta * sum_n omega_n e_n / N``.

The participation trace their samplers drew is then replayed in the library (``participation.Trace``) through the
library's ``Server`` with ``FedAU(K)`` (or ``FedAvg("participating")``), each trained client submitting ``e_n``,
and the weights the library applied (``Server.history[t]["weights"] x server_lr``) are compared with theirs.

(b) Accuracy. The authors' ``main.py`` trains for real on Fashion-MNIST (their data pipeline, model and loop; only
the evaluation is replaced by a test-set-only one in the last rounds, the stock one also scores the 60,000 training
images); the library trains the same partition (their ``dict_users``) under the same participation trace (their
samplers' draws) with ``FedHetStrategy(FedAU(K=50))``. Paired over seeds: their accuracy minus ours.
"""

from __future__ import annotations

import gzip
import logging
import os
import runpy
import shutil
import sys
import time
import types
import warnings
from pathlib import Path

import _common
import numpy as np
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAU, FedAvg
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.data import fashion_mnist
from lightning_fedhet.data.datasets import DEBIAN_FASHION_MNIST
from lightning_fedhet.data.streams import ClientStreams
from lightning_fedhet.experiments import fmt_ci, mean_ci, paired, parse_seeds
from lightning_fedhet.federation import RoundPlanner
from lightning_fedhet.participation import Trace
from lightning_fedhet.server import Server

STUDY = "fedau"
REPO = "IBM/fedau"
WEIGHT_HEADER = ("pattern (their sampler)", "K", "traces (seeds)", "max |theirs - ours|")
MODULES = ("config", "util", "dataset", "model", "statistic", "main")
FASHION_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte")


# ------------------------------------------------------------------------------------ the authors' main.py, in memory
class _UnitStepNet(torch.nn.Module):
    """One float64 parameter per client; ``forward`` returns the coordinate of the batch's owner."""

    def __init__(self, num_clients: int, owner: np.ndarray) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(num_clients, dtype=torch.float64))
        self.owner = torch.from_numpy(owner)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.w[self.owner[images[:, 0].long()]]


def _fake_modules(num_clients: int, labels: np.ndarray, owner: np.ndarray, rounds_out: list) -> dict:
    """The three stand-in modules of the weight check (see the module docstring)."""

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.targets = torch.from_numpy(labels)

        def __len__(self) -> int:
            return len(labels)

        def __getitem__(self, i: int):
            return torch.tensor([i]), int(labels[i])

    def load_data(dataset, path, device):
        return Data(), Data()

    class Model:
        def __init__(self, rand_seed=None, learning_rate=0.001, model_name=None, device=None, flatten_weight=False,
                     pretrained_model_file=None) -> None:
            self.model = _UnitStepNet(num_clients, owner)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=learning_rate)
            self.loss_fn = lambda output, target: -output[0]  # d/dw[owner] = -1: SGD with lr 1 adds exactly 1

        def update_learning_rate(self, learning_rate) -> None:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=learning_rate)

        def get_weight(self) -> torch.Tensor:
            return self.model.w.detach().clone()

        def assign_weight(self, w: torch.Tensor) -> None:
            with torch.no_grad():
                self.model.w.copy_(w)

    class CollectStatistics:
        def __init__(self, results_eval_file_prefix=None) -> None:
            pass

        def collect_stat_eval(self, seed, num_iter, model, train_data_loader, test_data_loader, w_global=None):
            rounds_out.append(w_global.detach().clone())
            w_global.zero_()  # the next round's vector is that round's aggregate alone

    return {"dataset.dataset": {"load_data": load_data}, "model.model": {"Model": Model},
            "statistic.collect_stat": {"CollectStatistics": CollectStatistics}}


def run_authors_weights(authors: Path, flags: list[str], num_clients: int, labels: np.ndarray) -> dict:
    """Run the authors' ``main.py`` with ``flags`` on the unit-step stand-ins: their per-round aggregate
    ``[T, N]``, the participation trace their samplers drew ``[T, N]`` and their ``p_n``."""
    rounds: list[torch.Tensor] = []
    draws: list[bool] = []
    captured: dict = {}
    owner = np.full(len(labels), -1, dtype=np.int64)
    argv = sys.argv
    with _common.authors_on_path(authors, MODULES):
        sys.argv = ["main.py", *flags]
        try:
            for name, attrs in _fake_modules(num_clients, labels, owner, rounds).items():
                module = types.ModuleType(name)
                module.__dict__.update(attrs)
                __import__(name.split(".")[0])  # the real package (its __init__), then the stand-in below it
                sys.modules[name] = module
            with _common.quiet():
                util = __import__("util.util", fromlist=["util"])
                partition_fn, sample_fn = util.data_participation_each_node, util.WorkerSampler.sample

                def data_participation_each_node(data_train, n_nodes):
                    dict_users, p = partition_fn(data_train, n_nodes)
                    for n in range(n_nodes):
                        owner[np.asarray(dict_users[n], dtype=np.int64)] = n
                    captured["p"] = np.asarray(p, dtype=np.float64)
                    return dict_users, p

                def sample(self):
                    out = bool(sample_fn(self))
                    draws.append(out)
                    return out

                util.data_participation_each_node = data_participation_each_node
                util.WorkerSampler.sample = sample
                runpy.run_path(str(authors / "main.py"), run_name="__main__")
        finally:
            sys.argv = argv
    aggregate = torch.stack(rounds).numpy()
    trace = np.asarray(draws, dtype=bool).reshape(len(rounds), num_clients)
    return {"aggregate": aggregate, "trace": trace, "p": captured["p"]}


def library_weights(trace: np.ndarray, method: str, K: int | None, server_lr: float) -> np.ndarray:
    """The library's ``Server`` replaying ``trace`` with unit updates: the coefficient applied to each client's
    update per round ``[T, N]`` (``server_lr x`` the weight in ``history``; 0 where absent)."""
    T, N = trace.shape
    algo = FedAU(K=K, server_lr=server_lr) if method == "adaptive" else FedAvg("participating", server_lr=server_lr)
    streams = ClientStreams(TensorDataset(torch.zeros(N, 1)), [np.array([i]) for i in range(N)], batch_size=1)
    server = Server(RoundPlanner(Trace(trace), algo, streams, local_steps=1, seed=0), algo,
                    torch.zeros(N, dtype=torch.float64), num_parameters=N)
    eye = torch.eye(N, dtype=torch.float64)
    out = np.zeros((T, N))
    for t in range(T):
        plan = server.begin_round(t)
        for client in plan.trained_ids:
            server.submit(client, eye[client], 0.0)
        before = server.global_vector.clone()
        server.close_round()
        for client, weight in server.history[t]["weights"].items():
            out[t, client] = server_lr * weight
        # the vector the server applied is the same sum (guards against weights that are logged but not used)
        applied = (server.global_vector - before).numpy()
        if np.abs(applied - out[t]).max() > 1e-12:
            raise AssertionError(f"round {t}: the applied step differs from the logged weights")
    return out


def compare_weights(args, method: str, patterns, cutoffs, seeds, num_clients: int, rounds: int) -> dict:
    labels = np.arange(5000) % 10  # the stand-in's labels: 10 balanced classes (the partition needs labels only)
    server_lr = 1.0
    rows, worst, cases, events, per_trace = [], 0.0, 0, 0, []
    for pattern in patterns:
        for K in cutoffs:
            diffs = []
            for seed in seeds:
                flags = ["-data", "fashion", "-weighting", method, "-participation", pattern,
                         "-total-workers", str(num_clients), "-iters-total", str(rounds), "-iters-per-round", "1",
                         "-iters-per-eval", "1", "-lr", "1.0", "-lr-global", str(server_lr), "-gpu", "0",
                         "-save-checkpoint", "0", "-save-final-model", "0", "-seeds", str(seed)]
                if K is not None:
                    flags += ["-k-adaptive", str(K)]
                theirs = run_authors_weights(args.authors, flags, num_clients, labels)
                ours = library_weights(theirs["trace"], method, K, server_lr)
                diff = float(np.abs(theirs["aggregate"] - ours).max())
                # absent clients carry weight 0 in both
                if np.any(ours[~theirs["trace"]] != 0):
                    raise AssertionError("the library applied a weight to an absent client")
                diffs.append(diff)
                cases += 1
                events += int(theirs["trace"].sum())
                per_trace.append({"pattern": pattern, "K": K, "seed": seed, "max_abs_diff": diff,
                                  "participations": int(theirs["trace"].sum()),
                                  "max_weight": float(theirs["aggregate"].max() * num_clients / server_lr)})
            worst = max(worst, max(diffs))
            label = "–" if method != "adaptive" else ("inf (100000)" if K is None else str(K))
            rows.append([pattern, label, len(seeds), _common.sci(max(diffs))])
    return {"rows": rows, "worst": worst, "cases": cases, "events": events, "per_trace": per_trace}


# ------------------------------------------------------------------------------------- (b) accuracy, both trainings
def prepare_fashion_mnist(authors: Path) -> str:
    """Their loader wants the four IDX files under ``data_files/FashionMNISTEnhanced/raw`` (torchvision's folder
    for the subclass); gunzip them there from the system copy the library reads. Returns what was done."""
    raw = authors / "data_files" / "FashionMNISTEnhanced" / "raw"
    if all((raw / f).is_file() for f in FASHION_FILES):
        return f"Fashion-MNIST IDX files already in {raw.relative_to(authors)}"
    source = Path(os.environ.get("FEDHET_FASHION_MNIST", DEBIAN_FASHION_MNIST))
    raw.mkdir(parents=True, exist_ok=True)
    for f in FASHION_FILES:
        with gzip.open(source / f"{f}.gz", "rb") as src, open(raw / f, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return f"the four Fashion-MNIST IDX files gunzipped from {source} into {raw.relative_to(authors)}"


def run_authors_training(authors: Path, flags: list[str], eval_after: int, iters_per_round: int, cache: dict) -> dict:
    """The authors' ``main.py`` training for real. Replaced in memory: the evaluation (test set only, only for
    rounds > ``eval_after``; their ``Model.accuracy`` does the scoring) and ``load_data`` (memoised across seeds:
    their PIL pass over 70,000 images is deterministic). Captured: ``dict_users``, ``p_n``, the trace drawn."""
    draws: list[bool] = []
    captured: dict = {"acc": []}
    argv = sys.argv
    with _common.authors_on_path(authors, MODULES):
        sys.argv = ["main.py", *flags]
        try:
            with _common.quiet():
                config = __import__("config")
                dataset_module = __import__("dataset.dataset", fromlist=["dataset"])
                real_load = dataset_module.load_data

                def load_data(dataset, path, device):
                    if "data" not in cache:
                        cache["data"] = real_load(dataset, path, device)
                    return cache["data"]

                dataset_module.load_data = load_data

                class CollectStatistics:
                    def __init__(self, results_eval_file_prefix=None) -> None:
                        pass

                    def collect_stat_eval(self, seed, num_iter, model, train_loader, test_loader, w_global=None):
                        rnd = num_iter // iters_per_round
                        if rnd > eval_after:
                            _, acc = model.accuracy(test_loader, w_global, config.device)
                            captured["acc"].append((rnd, float(acc)))

                stat = types.ModuleType("statistic.collect_stat")
                stat.CollectStatistics = CollectStatistics
                __import__("statistic")
                sys.modules["statistic.collect_stat"] = stat
                util = __import__("util.util", fromlist=["util"])
                partition_fn, sample_fn = util.data_participation_each_node, util.WorkerSampler.sample

                def data_participation_each_node(data_train, n_nodes):
                    dict_users, p = partition_fn(data_train, n_nodes)
                    captured["parts"] = [np.sort(np.asarray(dict_users[n], dtype=np.int64)) for n in range(n_nodes)]
                    captured["p"] = np.asarray(p, dtype=np.float64)
                    return dict_users, p

                def sample(self):
                    out = bool(sample_fn(self))
                    draws.append(out)
                    return out

                util.data_participation_each_node = data_participation_each_node
                util.WorkerSampler.sample = sample
                runpy.run_path(str(authors / "main.py"), run_name="__main__")
        finally:
            sys.argv = argv
    n = len(captured["parts"])
    captured["trace"] = np.asarray(draws, dtype=bool).reshape(-1, n)
    return captured


def run_library_training(parts, trace: np.ndarray, seed: int, rounds: int, eval_rounds, c: dict) -> list:
    """The library on the same partition and participation trace: ``FedHetStrategy(FedAU(K))`` with the paper's
    CNN, the same local SGD; test accuracy (all 10,000 images, Lightning validation of the global model every 10
    rounds) after each of ``eval_rounds``."""
    train, test = fashion_mnist()
    seed_everything(seed, workers=False, verbose=False)
    model = Classifier(c["model"], num_classes=10, lr=c["client_lr"], model_kwargs={"in_channels": 1, "input_size": 28})
    data = FederatedDataModule(train, [list(p) for p in parts], batch_size=c["batch_size"], val_dataset=test,
                               eval_batch_size=1000, seed=seed)
    strategy = FedHetStrategy(algorithm=FedAU(K=c["K"], server_lr=c["server_lr"]), participation=Trace(trace),
                              local_steps=c["local_steps"], engine="vmap", seed=seed)
    acc: list = []

    class Curve(Callback):
        def on_validation_end(self, trainer, pl_module) -> None:
            rnd = trainer.current_epoch + 1
            if not trainer.sanity_checking and rnd in eval_rounds:
                acc.append((rnd, float(trainer.callback_metrics["val_acc"])))

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    trainer = Trainer(strategy=strategy, max_epochs=rounds, check_val_every_n_epoch=10, logger=False,
                      callbacks=[Curve()], enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    return acc


def compare_accuracy(args, seeds, rounds: int, window: int) -> dict:
    c = {"model": "fedau_cnn_svhn", "client_lr": 0.1, "server_lr": 1.0, "K": 50, "local_steps": 5, "batch_size": 16,
         "num_clients": 50, "pattern": "bernoulli"}
    prepared = prepare_fashion_mnist(args.authors)
    eval_every = 10
    eval_rounds = set(range(rounds - window + eval_every, rounds + 1, eval_every))
    cache: dict = {}
    theirs, ours, per_seed, cpu = {}, {}, [], {"authors": 0.0, "library": 0.0}
    for seed in seeds:
        flags = ["-data", "fashion", "-weighting", "adaptive", "-k-adaptive", str(c["K"]), "-lr", str(c["client_lr"]),
                 "-lr-global", str(c["server_lr"]), "-participation", c["pattern"], "-total-workers",
                 str(c["num_clients"]), "-iters-total", str(rounds * c["local_steps"]), "-iters-per-round",
                 str(c["local_steps"]), "-minibatch", str(c["batch_size"]), "-iters-per-eval",
                 str(eval_every * c["local_steps"]), "-gpu", "0", "-save-checkpoint", "0", "-save-final-model", "0",
                 "-seeds", str(seed)]
        t0 = time.process_time()
        run = run_authors_training(args.authors, flags, rounds - window, c["local_steps"], cache)
        cpu["authors"] += time.process_time() - t0
        t0 = time.process_time()
        lib = run_library_training(run["parts"], run["trace"], seed, rounds, eval_rounds, c)
        cpu["library"] += time.process_time() - t0
        a, b = float(np.mean([v for _, v in run["acc"]])), float(np.mean([v for _, v in lib]))
        if [r for r, _ in run["acc"]] != [r for r, _ in lib]:
            raise AssertionError(f"evaluated rounds differ: {run['acc']} vs {lib}")
        theirs[seed], ours[seed] = a, b
        per_seed.append([seed, f"{100 * a:.1f}", f"{100 * b:.1f}", f"{100 * (a - b):+.1f}",
                         f"{run['trace'].sum(1).mean():.1f}"])
        print(f"[referee fedau] seed {seed}: authors {a:.4f} library {b:.4f}", flush=True)
    mean, lo, hi, n = paired(theirs, ours)
    return {"c": c, "theirs": theirs, "ours": ours, "diff": (mean, lo, hi, n), "rows": per_seed, "cpu": cpu,
            "prepared": prepared, "eval_rounds": sorted(eval_rounds)}


# ---------------------------------------------------------------------------------------------------------- main
def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], [
        (("--weight-seeds",), {"default": "1-3", "help": "seeds of the authors' samplers for (a)"}),
        (("--accuracy-seeds",), {"default": "1-5", "help": "seeds of (b)"}),
    ])
    torch.set_num_threads(1)
    weight_seeds = parse_seeds(args.weight_seeds, ())
    files = ["main.py", "util/util.py", "config.py"]
    patterns = ("bernoulli", "markov-0.05", "cyclic-100", "cyclic-50")
    num_clients, rounds = 50, 400
    shim = ("Replaced in memory (not edited, nothing written to their folder): `dataset.dataset.load_data` (a "
            "5,000-sample labelled stand-in, 10 balanced classes), `model.model.Model` (one float64 coordinate per "
            "client; a local round is one SGD step of size 1 that adds exactly 1 to the client's coordinate) and "
            "`statistic.collect_stat` (records the global vector each round and resets it to 0, so a round's vector "
            "is that round's aggregate). Their `main.py`, `config.py` and `util/util.py` (samplers, partition, "
            "participation probabilities, interval bookkeeping, aggregation) run as released.")

    res = compare_weights(args, "adaptive", patterns, (50, 10, 1, None), weight_seeds, num_clients, rounds)
    tol = 1e-12
    record = _common.make_record(
        STUDY, "FedAU weights: the authors' main.py vs the library's Server with FedAU(K)", "weights", args, REPO,
        files,
        f"N = {num_clients} clients, {rounds} rounds; participation traces drawn by the authors' own samplers "
        f"(`-participation` {', '.join(patterns)}) with their partition and p_n (Dir(0.1) data and participation, "
        "floor 0.02), cut-off K in {50, 10, 1, none}; the same trace replayed in the library "
        "(participation.Trace); every participating client's update is the unit vector of its own coordinate, so "
        "the aggregate's coordinate n is the weight omega_n / N applied to client n",
        weight_seeds, res["cases"], res["worst"], tol, res["worst"] <= tol,
        [shim,
         f"{res['events']:,} client participations compared in all (every round of every trace, absent clients "
         "included: both give them weight 0).",
         "Their `-k-adaptive` default 100000 (no cut-off within 400 rounds) is the library's K=None.",
         "The largest weight omega seen: " + f"{max(t['max_weight'] for t in res['per_trace']):g}."],
        table={"header": WEIGHT_HEADER, "rows": res["rows"]},
        per_trace=res["per_trace"])
    _common.write_record(args.root, "weights-fedau", record)

    res = compare_weights(args, "average_participating", patterns, (None,), weight_seeds, num_clients, rounds)
    record = _common.make_record(
        STUDY, "Average participating (the baseline): the authors' main.py vs the library's FedAvg('participating')",
        "weights", args, REPO, files,
        f"as the FedAU weight check (N = {num_clients}, {rounds} rounds, the authors' samplers and p_n), with "
        "`-weighting average_participating`: weight 1/|S_t| on each participant",
        weight_seeds, res["cases"], res["worst"], tol, res["worst"] <= tol,
        [shim, f"{res['events']:,} client participations compared."],
        table={"header": WEIGHT_HEADER, "rows": res["rows"]},
        per_trace=res["per_trace"])
    _common.write_record(args.root, "weights-average-participating", record)

    if args.no_accuracy:
        return
    seeds = parse_seeds(args.accuracy_seeds, ())
    rounds_b, window = 150, 30
    res = compare_accuracy(args, seeds, rounds_b, window)
    mean, lo, hi, n = res["diff"]
    agree = bool(lo <= 0 <= hi)
    a_ci = fmt_ci(*mean_ci(list(res["theirs"].values())))
    b_ci = fmt_ci(*mean_ci(list(res["ours"].values())))
    c = res["c"]
    record = _common.make_record(
        STUDY, "FedAU accuracy: the authors' training loop vs the library's, same partition and trace", "accuracy",
        args, REPO, files + ["dataset/dataset.py", "model/model.py", "model/cnn_mnist.py"],
        f"Fashion-MNIST (all 60,000 training images), N = {c['num_clients']}, {rounds_b} rounds, Bernoulli "
        f"participation with the authors' p_n, FedAU K = {c['K']}, gamma = {c['client_lr']}, eta = {c['server_lr']}, "
        f"{c['local_steps']} local SGD steps of {c['batch_size']} images. Their run draws the partition and the "
        "trace (their seed); the library trains that partition under that trace (participation.Trace) with the "
        f"same seed for its own draws (initialisation, minibatch order). Metric: mean test accuracy (all 10,000 "
        f"test images) over the evaluations after rounds {', '.join(map(str, res['eval_rounds']))}",
        seeds, n, None, None, agree,
        [f"Paired difference (theirs - ours): {fmt_ci(mean, lo, hi, unit=' pp')} over {n} seeds; "
         f"theirs {a_ci} %, ours {b_ci} % (mean [95 % CI]). `agree` means the paired interval contains 0.",
         "Still different between the two runs: the model initialisation and minibatch order (each code's own "
         "RNG), their per-client minibatch iterator that persists across rounds and drops short batches vs the "
         "library's per-round permutation, input normalisation (their (0.1307, 0.3081), the library's (0.2860, "
         "0.3530)), and their `ModelCNNMnist` vs the library's `fedau_cnn_svhn(in_channels=1, input_size=28)` "
         "(the same layers and the same Kaiming initialisation scheme).",
         "Replaced in memory: their evaluation (`statistic.collect_stat`; the stock one also scores the 60,000 "
         "training images at every evaluation) by one that scores the test set with their own `Model.accuracy`, "
         f"only in the last {window} rounds; `load_data` memoised across seeds (deterministic). "
         + res["prepared"] + ".",
         f"CPU time: authors {res['cpu']['authors'] / 60:.1f} min, library {res['cpu']['library'] / 60:.1f} min "
         "(1 thread, nice 10, shared 2-core machine)."],
        table={"header": ["seed", "authors' loop %", "library %", "difference (pp)", "participants per round"],
               "rows": res["rows"] + [["mean [95 % CI]", a_ci, b_ci, fmt_ci(mean, lo, hi), ""]]},
        difference={"mean": mean, "low": lo, "high": hi, "seeds": n},
        accuracy={"authors": {str(k): v for k, v in res["theirs"].items()},
                  "library": {str(k): v for k, v in res["ours"].items()}},
        cpu_s={k: round(v, 1) for k, v in res["cpu"].items()})
    _common.write_record(args.root, "accuracy-fedau", record)


if __name__ == "__main__":
    main()
