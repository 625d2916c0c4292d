"""The engine contract on one device, in under a minute: the vmap engine and stacked seeds give the sequential run.

Part a of ``scripts/gpu/device_run.py``, run before any record is made on a device: the CPU test
(``tests/engines/test_contract.py``, ``tests/engines/test_multiseed.py``) never sees CUDA's kernels (cuDNN's grouped
convolutions for a vmap cohort, other summation orders), so a divergence there would go into the FedAU records
unnoticed. For each of three rules (FedAvg over the participating clients, FedVARP, FedAU with ``K = 2``, so its
cut-off acts within the run) one tiny federation runs :data:`ROUNDS` rounds three ways on ``device``:

* ``sequential``: ``Trainer.fit`` with ``FedHetStrategy(engine="sequential")`` (the reference);
* ``vmap``: the same with ``engine="vmap"``;
* ``stacked``: :func:`lightning_fedhet.multiseed.fit_seeds` with two seeds, the path the FedAU cells take; its first
  seed is compared with the reference.

The federation: 6 clients of 16 random 1x8x8 images, 10 classes, a tiny CNN (Conv 1-4 3x3, ReLU, max-pool 2,
linear 64-10: a convolution, as in the FedAU network), plain SGD (lr 0.05, batch 4), Bernoulli(0.7) availability
and 1 to 3 local steps per client (unequal steps exercise the cohort's masking). A check passes when the largest
absolute difference of the global parameters ``[d]`` is at most :data:`TOLERANCE` and the round records name the
same received clients; the run must also have moved the parameters (else the comparison says nothing) and finish
within ``budget_s``: the rules left when the budget is spent count as failed.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn
from torch.utils.data import TensorDataset

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAU, FedAvg, FedVARP
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.multiseed import fit_seeds
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import UniformSteps

ROUNDS = 4
TOLERANCE = 1e-5  # max |global parameter difference| between two engines, absolute
SEEDS = (3, 11)  # the stacked run's seeds; the first is compared with the sequential reference
RULES = {
    "FedAvg": lambda: FedAvg(weighting="participating"),
    "FedVARP": lambda: FedVARP(weighting="participating"),
    "FedAU": lambda: FedAU(K=2),
}
_GEN = torch.Generator().manual_seed(0)
_DATA = TensorDataset(torch.randn(96, 1, 8, 8, generator=_GEN), torch.randint(0, 10, (96,), generator=_GEN))


def tiny_cnn() -> nn.Module:
    """Conv(1-4, 3x3, pad 1)-ReLU-MaxPool(2)-Linear(64-10) for ``[B, 1, 8, 8]`` inputs: 330 parameters."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10))


def _build(rule: str, device: torch.device, engine: str = "sequential"):
    def build(seed: int):
        model = Classifier(tiny_cnn(), num_classes=10, lr=0.05)
        data = FederatedDataModule(_DATA, [np.arange(i * 16, (i + 1) * 16) for i in range(6)], batch_size=4)
        strategy = FedHetStrategy(algorithm=RULES[rule](), participation=Bernoulli(0.7),
                                  local_steps=UniformSteps(1, 3), engine=engine, seed=seed, device=device)
        return model, data, strategy

    return build


def _single(rule: str, device: torch.device, engine: str, seed: int) -> tuple[FedHetStrategy, torch.Tensor]:
    """One seed's ordinary run (``seed_everything`` then build, as :func:`fit_seeds` builds each seed): the
    strategy after :data:`ROUNDS` rounds and the initial parameters ``[d]``."""
    seed_everything(seed, workers=False, verbose=False)
    model, data, strategy = _build(rule, device, engine)(seed)
    start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    Trainer(strategy=strategy, accelerator="cpu" if device.type == "cpu" else "gpu", devices=1, max_epochs=ROUNDS,
            limit_val_batches=0, logger=False, enable_progress_bar=False, enable_checkpointing=False,
            enable_model_summary=False, num_sanity_val_steps=0).fit(model, datamodule=data)
    return strategy, start


def _received(history: list[dict]) -> list[list[int]]:
    return [torch.nonzero(h["received"]).flatten().tolist() for h in history]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def run(device: str | torch.device = "cuda", budget_s: float = 60.0, log=print) -> dict:
    """Every rule's three runs on ``device``; ``{"pass": bool, "checks": [...], ...}`` (JSON-ready). ``log`` gets
    one line per check."""
    device = torch.device(device)
    start = time.perf_counter()
    checks, missing = [], []
    for rule in RULES:
        if time.perf_counter() - start > budget_s:
            missing.append(rule)
            continue
        reference, initial = _single(rule, device, "sequential", SEEDS[0])
        moved = _diff(reference.global_params, initial)
        vmap, _ = _single(rule, device, "vmap", SEEDS[0])
        stacked = fit_seeds(_build(rule, device), list(SEEDS), ROUNDS, device=device)[0]
        for engine, params, history in (("vmap", vmap.global_params, vmap.history),
                                         ("stacked", stacked.global_params, stacked.history)):
            diff = _diff(params, reference.global_params)
            same_clients = _received(history) == _received(reference.history)
            ok = diff <= TOLERANCE and same_clients and moved > 100 * TOLERANCE
            checks.append({"rule": rule, "engine": engine, "max_abs_diff": diff, "same_received": same_clients,
                           "moved_from_initial": moved, "pass": ok})
            log(f"contract {rule:8s} {engine:8s} vs sequential: max |diff| {diff:.2e} (tolerance {TOLERANCE:g}), "
                f"same received clients {same_clients}, parameters moved {moved:.2e}: {'pass' if ok else 'FAIL'}")
    elapsed = time.perf_counter() - start
    return {
        "pass": bool(checks) and not missing and all(c["pass"] for c in checks),
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "tolerance": TOLERANCE, "rounds": ROUNDS, "seconds": round(elapsed, 2),
        "budget_s": budget_s, "not_run_over_budget": missing, "checks": checks,
        "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
    }
