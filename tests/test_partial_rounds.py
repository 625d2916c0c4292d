"""Whatever cuts a round short or looks inside one, Lightning sees the global model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.participation import UniformSample
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset


def _data() -> FederatedDataModule:
    ds = toy_dataset(60)
    return FederatedDataModule(ds, [np.arange(i * 10, (i + 1) * 10) for i in range(6)], batch_size=5, val_dataset=ds)


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
@pytest.mark.parametrize(
    "trainer_kwargs",
    [dict(fast_dev_run=True), dict(max_steps=7, max_epochs=5), dict(limit_train_batches=2, max_epochs=2)],
    ids=["fast_dev_run", "max_steps", "limit_train_batches"],
)
def test_a_cut_round_is_closed_and_the_module_holds_the_global_model(engine, trainer_kwargs):
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine=engine)
    model = TinyClassifier()
    trainer = quiet_trainer(strategy=strategy, limit_val_batches=0, **trainer_kwargs)
    with pytest.warns(UserWarning, match="cut short"):
        trainer.fit(model, datamodule=_data())
    assert not strategy.server.round_open
    assert strategy.history and not strategy.history[-1]["complete"]
    torch.testing.assert_close(flat_params(model), strategy.global_params, rtol=0, atol=0)


class ValidationLoss(Callback):
    """Records the logged val loss and the loss of the server's global parameters at each validation."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self.pairs: list[tuple[float, float]] = []

    def on_validation_end(self, trainer, pl_module):
        x, y = self.dataset.tensors
        weight, bias = torch.split(trainer.strategy.server.global_vector, [15, 3])
        expected = F.cross_entropy(x @ weight.view(3, 5).T + bias, y)
        self.pairs.append((float(trainer.callback_metrics["val_loss"]), float(expected)))


def test_validation_inside_a_round_sees_the_global_model():
    data = _data()
    probe = ValidationLoss(data.val_dataset)
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3)
    # 12 steps a round, validation every 4: twice mid-round (a client's weights in the module), once at the end
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, val_check_interval=4, callbacks=[probe])
    trainer.fit(TinyClassifier(), datamodule=data)
    assert len(probe.pairs) == 6
    for logged, expected in probe.pairs:
        assert logged == pytest.approx(expected, abs=1e-5)
