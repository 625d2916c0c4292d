"""A rule's per-round client learning-rate multiplier (``Algorithm.client_lr_scale``, FedACS's
``calibrate="client"``) is applied by every engine for that round only.

Equivalence: plain local SGD at ``lr * c`` is exactly what a client runs when its optimizer has ``lr`` and the rule
asks for ``c``; so a run of a rule that asks ``c = 3`` at ``lr = 0.1`` must equal plain FedAvg at ``lr = 0.3``
(within rounding of ``0.1 * 3``), and the optimizer's ``lr`` reads 0.1 again after every round.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.engines.vmap import VmapUnsupported
from lightning_fedhet.multiseed import fit_seeds
from tests.helpers import TinyClassifier, equal_clients, flat_params, quiet_trainer


class ScaledFedAvg(FedAvg):
    """FedAvg whose clients run ``scale`` times the optimizer's learning rate in round ``t`` (``scale ** (t+1)`` with
    ``grow``, so a multiplier that changes every round is followed and not compounded)."""

    def __init__(self, scale: float, grow: bool = False) -> None:
        super().__init__()
        self.scale, self.grow, self.seen_lrs = scale, grow, []

    @property
    def scales_client_lr(self) -> bool:
        return True

    def open_round(self, round, ctx) -> None:
        super().open_round(round, ctx)
        self.client_lr_scale = self.scale ** (round + 1) if self.grow else self.scale


class LrSpy(TinyClassifier):
    """Records the optimizer's lr at every local step (under vmap the cohort's own optimizer: not recorded)."""

    def __init__(self, lr: float) -> None:
        super().__init__(lr=lr)
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        optimizer = self.trainer.optimizers[0]
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))
        return super().training_step(batch, batch_idx)


def run(algorithm, lr: float, engine: str, rounds: int = 3) -> tuple[torch.Tensor, TinyClassifier]:
    model = LrSpy(lr)
    strategy = FedHetStrategy(algorithm=algorithm, engine=engine, local_steps=3, seed=0)
    quiet_trainer(strategy=strategy, max_epochs=rounds).fit(model, datamodule=equal_clients(4))
    return flat_params(model), model


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_a_scaled_round_equals_plain_sgd_at_the_scaled_learning_rate(engine):
    scaled, model = run(ScaledFedAvg(3.0), lr=0.1, engine=engine)
    plain, _ = run(FedAvg(), lr=0.1 * 3.0, engine=engine)
    torch.testing.assert_close(scaled, plain, rtol=0, atol=1e-6)
    assert model.trainer.optimizers[0].param_groups[0]["lr"] == 0.1  # restored exactly after the last round
    if engine == "sequential":
        assert model.lrs == pytest.approx([0.1 * 3.0] * len(model.lrs)) and len(model.lrs) == 3 * 4 * 3


def test_the_multiplier_of_each_round_applies_to_that_round_only():
    # rounds 0, 1, 2 ask for 2, 4, 8: compounding (scaling the already-scaled lr) would give 2, 8, 64
    _, model = run(ScaledFedAvg(2.0, grow=True), lr=0.1, engine="sequential")
    per_round = [model.lrs[k * 12] for k in range(3)]
    assert per_round == pytest.approx([0.2, 0.4, 0.8])


def test_sequential_and_vmap_agree_under_a_changing_multiplier():
    seq, _ = run(ScaledFedAvg(1.5, grow=True), lr=0.05, engine="sequential")
    vm, _ = run(ScaledFedAvg(1.5, grow=True), lr=0.05, engine="vmap")
    torch.testing.assert_close(seq, vm, rtol=0, atol=1e-6)


def test_fit_seeds_refuses_a_rule_that_scales_the_clients_learning_rate():
    def build(seed):
        strategy = FedHetStrategy(algorithm=ScaledFedAvg(2.0), local_steps=1, seed=seed)
        return TinyClassifier(), equal_clients(2), strategy

    message = (r"^engine='vmap' cannot run this: seed 0's ScaledFedAvg\(.*\) scales the clients' learning rate every "
               r"round \(calibrate='client'\), which differs between seeds and cannot be stacked: fit the seeds one "
               r"at a time with Trainer\.fit\. Use engine='sequential' instead\.$")
    with pytest.raises(VmapUnsupported, match=message):
        fit_seeds(build, seeds=[0, 1], rounds=1)
