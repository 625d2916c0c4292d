"""Rounds per second in the FedAU setting on one GPU: sequential clients, the vmap cohort (eager, compiled, CUDA
graphs) and the centralised limit, with the projected time of a 10,000-round run.

    python benchmarks/bench_gpu_fedau.py [--rounds 60] [--json out.json] [--skip-strategy]

Setting (FedAU, Wang & Ji 2024, CIFAR-10 configuration): N = 250 clients, the paper's CNN for 32x32x3 inputs
(551,786 parameters), label-correlated Bernoulli participation (mean p = 0.1, floor 0.02, Dirichlet(0.1) label
histograms: about 25 clients per round, a different number every round), 5 local steps of plain SGD (lr 0.05) with
mini-batches of 16, FedAvg aggregation. The images are synthetic (random), which changes nothing in the arithmetic.

Executors (the same cohorts and the same mini-batch indices):

* ``lean sequential``   a minimal hand-written per-client loop (what the FedAU reference code does per round);
* ``strategy sequential`` / ``strategy vmap``  ``FedHetStrategy`` inside ``Trainer.fit`` (needs Lightning);
* ``vmap eager`` / ``vmap compiled`` / ``vmap reduce-overhead``  ``VmapCohort`` driven directly, without Lightning,
  with ``compile=False``, ``True`` and ``"reduce-overhead"`` (CUDA graphs);
* ``central eager`` / ``central reduce-overhead``  the centralised limit: one model, one batch of all the round's
  samples (cohort x 16) per step, 5 steps per round.

Compilation and CUDA-graph recording are one-time costs: every executor first runs one untimed round per distinct
cohort size of the timed rounds (reported as warm-up seconds), then the timed rounds. Runs without Lightning: the
engine module is imported without the package's ``__init__`` when that import fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import traceback
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
N_CLIENTS, SAMPLES, LOCAL_STEPS, BATCH, LR, CLASSES = 250, 200, 5, 16, 0.05, 10


def import_vmap_cohort():
    """``VmapCohort``; without the package ``__init__`` (and so without Lightning) if the plain import fails."""
    sys.path.insert(0, str(ROOT))
    try:
        from lightning_fedhet.engines.vmap import VmapCohort

        return VmapCohort, "lightning_fedhet package"
    except ImportError as err:
        for name in [m for m in sys.modules if m.startswith("lightning_fedhet")]:
            del sys.modules[name]
        for name in ("lightning_fedhet", "lightning_fedhet.engines"):
            path = name.replace(".", "/")
            pkg = types.ModuleType(name)
            pkg.__path__ = [str(ROOT / path)]
            sys.modules[name] = pkg
        module = importlib.import_module("lightning_fedhet.engines.vmap")
        return module.VmapCohort, f"engine module alone ({err})"


class FedAUCNN(nn.Module):
    """FedAU's CIFAR-10 CNN (as ``model_zoo.FedAUCNN``), 551,786 parameters.

    Conv(3-32, k3, p1)-ReLU-Pool2-Conv(32-32, k3, p1)-ReLU-Pool2-FC(2048-256)-ReLU-FC(256-64)-ReLU-FC(64-10).
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(2048, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10)
        )  # fmt: skip

    def forward(self, x):
        return self.classifier(self.features(x))


class Client(nn.Module):
    """What VmapCohort needs of a LightningModule: ``training_step`` and ``log`` (a no-op here)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = FedAUCNN()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def log(self, *args, **kwargs) -> None:
        pass


def participation_probabilities(rng: np.random.Generator) -> np.ndarray:
    """FedAU's label-correlated p_n: C * mean * <kappa_n, q>, floored at 0.02 (kappa_n ~ Dir(0.1), q ~ Dir(0.1))."""
    kappa = rng.dirichlet(np.full(CLASSES, 0.1), size=N_CLIENTS)
    q = rng.dirichlet(np.full(CLASSES, 0.1))
    return np.minimum(np.maximum(CLASSES * 0.1 * kappa @ q, 0.02), 1.0)


class Workload:
    def __init__(self, rounds: int, device: torch.device, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        p = participation_probabilities(rng)
        self.cohorts = []
        while len(self.cohorts) < rounds:
            c = np.flatnonzero(rng.random(N_CLIENTS) < p)
            if len(c):
                self.cohorts.append(c)
        self.batches = [rng.integers(0, SAMPLES, size=(len(c), LOCAL_STEPS, BATCH)) for c in self.cohorts]
        gen = torch.Generator(device=device).manual_seed(seed)
        self.x = torch.randn(N_CLIENTS, SAMPLES, 3, 32, 32, device=device, generator=gen)
        self.y = torch.randint(0, CLASSES, (N_CLIENTS, SAMPLES), device=device, generator=gen)
        self.device = device
        self.mean_p = float(p.mean())

    def round_data(self, r: int):
        """The round's mini-batches ``[C, K, B, 3, 32, 32]`` and labels ``[C, K, B]`` (one gather on the GPU)."""
        clients = torch.as_tensor(self.cohorts[r], device=self.device)
        idx = torch.as_tensor(self.batches[r], device=self.device)
        rows = clients[:, None, None]
        return self.x[rows, idx], self.y[rows, idx]

    def warmup_rounds(self, timed: range) -> list[int]:
        """One round for each distinct cohort size among ``timed``."""
        first: dict[int, int] = {}
        for r in timed:
            first.setdefault(len(self.cohorts[r]), r)
        return sorted(first.values())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def run_lean(w: Workload, rounds: list[int], state: dict) -> None:
    model, global_vec = state["model"], state["global"]
    params = list(model.parameters())
    for r in rounds:
        x, y = w.round_data(r)
        total = torch.zeros_like(global_vec)
        for i in range(x.shape[0]):
            torch.nn.utils.vector_to_parameters(global_vec.clone(), params)  # params become views of the copy
            opt = torch.optim.SGD(params, lr=LR)
            for k in range(LOCAL_STEPS):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model.net(x[i, k]), y[i, k]).backward()
                opt.step()
            total += torch.nn.utils.parameters_to_vector(params).detach() - global_vec
        global_vec = global_vec + total / x.shape[0]
    state["global"] = global_vec


def make_run_vmap(cohort_cls, compile):
    def run(w: Workload, rounds: list[int], state: dict) -> None:
        model = state["model"]
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR)
        for r in rounds:
            torch.nn.utils.vector_to_parameters(state["global"].clone(), params)
            x, y = w.round_data(r)
            cohort = cohort_cls(model, opt, list(range(x.shape[0])), np.full(x.shape[0], LOCAL_STEPS), compile=compile)
            for k in range(LOCAL_STEPS):
                cohort.step((x[:, k], y[:, k]), k)
            state["global"] = cohort.flat_params().mean(0)

    return run


def make_run_central(compiled: bool):
    def run(w: Workload, rounds: list[int], state: dict) -> None:
        model = state["model"]
        if "opt" not in state:
            state["opt"] = torch.optim.SGD(model.parameters(), lr=LR)
            opt = state["opt"]

            def step(xb, yb):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model.net(xb), yb).backward()
                opt.step()

            state["step"] = torch.compile(step, mode="reduce-overhead") if compiled else step
        for r in rounds:
            x, y = w.round_data(r)
            for k in range(LOCAL_STEPS):
                state["step"](x[:, k].reshape(-1, 3, 32, 32), y[:, k].reshape(-1))

    return run


def time_executor(name, run, w: Workload, timed: range, device) -> dict:
    torch.manual_seed(0)
    model = Client().to(device)
    state = {"model": model, "global": flat(model)}
    sync(device)
    t0 = time.perf_counter()
    run(w, w.warmup_rounds(timed), state)
    sync(device)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(w, list(timed), state)
    sync(device)
    per_round = (time.perf_counter() - t0) / len(timed)
    return {"s_per_round": per_round, "warmup_s": warm, "rounds": len(timed)}


def run_strategy(engine: str, w: Workload, rounds: int, device) -> dict:
    """FedHetStrategy inside Trainer.fit on the same model and setting (its own cohorts and batches)."""
    import lightning.pytorch as pl
    from torch.utils.data import TensorDataset

    from lightning_fedhet import FederatedDataModule, FedHetStrategy
    from lightning_fedhet.participation import Bernoulli

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = FedAUCNN()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            sync(device)
            self.marks.append(time.perf_counter())

    x = w.x.reshape(-1, 3, 32, 32).cpu()
    y = w.y.reshape(-1).cpu()
    parts = [np.arange(n * SAMPLES, (n + 1) * SAMPLES) for n in range(N_CLIENTS)]
    rng = np.random.default_rng(0)
    dm = FederatedDataModule(TensorDataset(x, y), parts, batch_size=BATCH)
    strategy = FedHetStrategy(
        participation=Bernoulli(participation_probabilities(rng)),
        local_steps=LOCAL_STEPS,
        engine=engine,
        device=torch.device(device.type, device.index or 0) if device.type == "cuda" else device,
    )
    clock = Clock()
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=rounds + 1,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[clock],
    )
    trainer.fit(Module(), datamodule=dm)
    per_round = (clock.marks[-1] - clock.marks[0]) / (len(clock.marks) - 1)
    cohort = float(np.mean([len(h["received"]) for h in strategy.history]))
    return {"s_per_round": per_round, "warmup_s": float("nan"), "rounds": rounds, "mean_cohort": cohort}


def check_equal(w: Workload, cohort_cls, device) -> dict:
    """Max |difference| of the parameters after one round (round 0) against the lean per-client loop."""
    out = {}
    results = {}
    for name, run in [
        ("lean", run_lean),
        ("vmap eager", make_run_vmap(cohort_cls, False)),
        ("vmap compiled", make_run_vmap(cohort_cls, True)),
        ("vmap reduce-overhead", make_run_vmap(cohort_cls, "reduce-overhead")),
    ]:
        torch.manual_seed(0)
        model = Client().to(device)
        state = {"model": model, "global": flat(model)}
        try:
            run(w, [0], state)
            results[name] = state["global"]
        except Exception as err:  # noqa: BLE001 - report and go on
            out[name] = f"failed: {type(err).__name__}: {err}"[:300]
    for name, vec in results.items():
        if name != "lean" and "lean" in results:
            out[name] = float((vec - results["lean"]).abs().max())
    return out


def profile(w: Workload, cohort_cls, device) -> None:
    """Print the GPU kernels that take the time of a few rounds (vmap compiled, central eager)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, run in [("vmap compiled", make_run_vmap(cohort_cls, True)), ("central eager", make_run_central(False))]:
        torch.manual_seed(0)
        model = Client().to(device)
        state = {"model": model, "global": flat(model)}
        run(w, [60, 61], state)
        sync(device)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(w, [60, 61, 62], state)
            sync(device)
        print(f"\n{name}: 3 rounds")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="timed rounds of the vmap and central executors")
    parser.add_argument("--sequential-rounds", type=int, default=15, help="timed rounds of the sequential loops")
    parser.add_argument("--skip-strategy", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated executor names")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true", help="top GPU kernels of vmap and central rounds")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cohort_cls, source = import_vmap_cohort()
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "vmap_cohort_from": source,
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        info["lightning"] = None
    print(json.dumps(info), flush=True)
    n_total = max(args.rounds, args.sequential_rounds) + 60
    w = Workload(n_total, device)
    sizes = [len(c) for c in w.cohorts]
    print(f"mean p {w.mean_p:.3f}; cohort size mean {np.mean(sizes):.1f} (min {min(sizes)}, max {max(sizes)})")
    eq = check_equal(w, cohort_cls, device)
    print("max |param - lean loop| after one round:", json.dumps(eq), flush=True)
    timed_fast = range(60, 60 + args.rounds)
    timed_seq = range(60, 60 + args.sequential_rounds)
    executors = [
        ("lean sequential", run_lean, timed_seq),
        ("vmap eager", make_run_vmap(cohort_cls, False), timed_fast),
        ("vmap compiled", make_run_vmap(cohort_cls, True), timed_fast),
        ("vmap reduce-overhead", make_run_vmap(cohort_cls, "reduce-overhead"), timed_fast),
        ("central eager", make_run_central(False), timed_fast),
        ("central reduce-overhead", make_run_central(True), timed_fast),
    ]
    only = set(args.only.split(",")) if args.only else None
    results = {}
    for name, run, timed in executors:
        if only and name not in only:
            continue
        try:
            results[name] = time_executor(name, run, w, timed, device)
            results[name]["mean_cohort"] = float(np.mean([len(w.cohorts[r]) for r in timed]))
        except Exception as err:  # noqa: BLE001 - report and go on
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        print(name, json.dumps(results[name]), flush=True)
    if args.profile and device.type == "cuda":
        profile(w, cohort_cls, device)
    if not args.skip_strategy and info["lightning"] is not None:
        for engine in ("sequential", "vmap"):
            name = f"strategy {engine}"
            if only and name not in only:
                continue
            try:
                results[name] = run_strategy(engine, w, args.sequential_rounds, device)
            except Exception as err:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                results[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            print(name, json.dumps(results[name]), flush=True)
    print(f"\nFedAU setting on {info['device']}, torch {info['torch']}")
    print(f"{'executor':<26}{'s/round':>10}{'rounds/s':>10}{'samples/s':>12}{'10k rounds':>12}{'warm-up s':>11}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<26} {r['error']}")
            continue
        s = r["s_per_round"]
        samples = r["mean_cohort"] * LOCAL_STEPS * BATCH / s
        hours = s * 10_000 / 3600
        warm = "-" if math.isnan(r["warmup_s"]) else f"{r['warmup_s']:.1f}"
        print(f"{name:<26}{s:>10.4f}{1 / s:>10.1f}{samples:>12.0f}{hours:>11.2f}h{warm:>11}")
    print("FedAU paper: about 4 h per 10,000-round run on an RTX 3070 (1.44 s/round, evaluation included)")
    if args.json:
        Path(args.json).write_text(json.dumps({"info": info, "equality": eq, "results": results}, indent=2))


if __name__ == "__main__":
    main()
