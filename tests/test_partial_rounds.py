"""Whatever cuts a round short or looks inside one, Lightning sees the global model."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from lightning_fedhet import FederatedDataModule, FedHetDDPStrategy, FedHetStrategy
from lightning_fedhet.participation import UniformSample
from tests.helpers import FailsAtCall, TinyClassifier, flat_params, quiet_trainer, toy_dataset


def _data() -> FederatedDataModule:
    ds = toy_dataset(60)
    return FederatedDataModule(ds, [np.arange(i * 10, (i + 1) * 10) for i in range(6)], batch_size=5, val_dataset=ds)


@pytest.mark.parametrize(
    "trainer_kwargs",
    [dict(fast_dev_run=True), dict(max_steps=7, max_epochs=5), dict(limit_train_batches=2, max_epochs=2)],
    ids=["fast_dev_run", "max_steps", "limit_train_batches"],
)
def test_a_cut_round_is_closed_and_the_module_holds_the_global_model(trainer_kwargs):
    # sequential engine: a Lightning step is one client's local step, so these settings stop mid-round
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="sequential")
    model = TinyClassifier()
    trainer = quiet_trainer(strategy=strategy, limit_val_batches=0, **trainer_kwargs)
    with pytest.warns(UserWarning, match="cut short"):
        trainer.fit(model, datamodule=_data())
    assert not strategy.server.round_open
    assert strategy.history and not strategy.history[-1]["complete"]
    torch.testing.assert_close(flat_params(model), strategy.global_params, rtol=0, atol=0)


@pytest.mark.parametrize(
    "trainer_kwargs, rounds",
    [
        (dict(fast_dev_run=True), 1),
        (dict(max_steps=3, max_epochs=5), 3),
        (dict(limit_train_batches=2, max_epochs=2), 2),
    ],
    ids=["fast_dev_run", "max_steps", "limit_train_batches"],
)
def test_under_vmap_a_lightning_step_is_a_whole_round(trainer_kwargs, rounds):
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="vmap")
    model = TinyClassifier()
    trainer = quiet_trainer(strategy=strategy, limit_val_batches=0, **trainer_kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*cut short.*")
        trainer.fit(model, datamodule=_data())
    assert trainer.global_step == rounds
    assert [h["complete"] for h in strategy.history] == [True] * rounds
    assert all(len(h["received"]) == 4 for h in strategy.history)
    torch.testing.assert_close(flat_params(model), strategy.global_params, rtol=0, atol=0)


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_an_exception_inside_a_round_leaves_the_global_model(engine):
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine=engine)
    model = FailsAtCall(fail_at=2)
    trainer = quiet_trainer(strategy=strategy, limit_val_batches=0, max_epochs=2)
    with pytest.raises(RuntimeError, match="simulated failure"), pytest.warns(UserWarning, match="cut short"):
        trainer.fit(model, datamodule=_data())
    assert not strategy.server.round_open
    assert strategy.history[-1]["complete"] is False
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
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="sequential")
    # 12 steps a round, validation every 4: twice mid-round (a client's weights in the module), once at the end
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, val_check_interval=4, callbacks=[probe])
    trainer.fit(TinyClassifier(), datamodule=data)
    assert len(probe.pairs) == 6
    for logged, expected in probe.pairs:
        assert logged == pytest.approx(expected, abs=1e-5)
    # after looking, the client that was training goes on from its own weights: the run equals one that never looked
    unseen = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="sequential")
    quiet_trainer(strategy=unseen, max_epochs=2, limit_val_batches=0).fit(TinyClassifier(), datamodule=_data())
    torch.testing.assert_close(strategy.global_params, unseen.global_params, rtol=0, atol=0)


class _DoublesInputs(TinyClassifier):
    """Doubles the inputs in ``on_after_batch_transfer``: a user's transfer hook must still run on every batch."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return 2 * x, y


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_a_users_transfer_hook_runs_on_every_local_batch(engine):
    # With inputs doubled by the hook, training on x must equal training a plain model on 2 x.
    data, doubled = _data(), _data()
    x, y = doubled.train_dataset.tensors
    doubled.train_dataset.tensors = (2 * x, y)
    hooked, plain = _DoublesInputs(), TinyClassifier()
    plain.load_state_dict(hooked.state_dict())
    for model, datamodule in ((hooked, data), (plain, doubled)):
        strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine=engine)
        quiet_trainer(strategy=strategy, limit_val_batches=0, max_epochs=2).fit(model, datamodule=datamodule)
    torch.testing.assert_close(flat_params(hooked), flat_params(plain), rtol=0, atol=0)
    assert not torch.equal(flat_params(hooked), flat_params(TinyClassifier()))


class _ValidationSteps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.steps.append(trainer.global_step)


def test_under_vmap_an_int_val_check_interval_counts_rounds_or_is_refused():
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="vmap")
    seen = _ValidationSteps()
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=6, val_check_interval=3, check_val_every_n_epoch=None, callbacks=[seen]
    )
    trainer.fit(TinyClassifier(), datamodule=_data())
    assert seen.steps == [3, 6]  # after rounds 3 and 6
    # Lightning alone would count 3 steps inside each one-step epoch and never validate: refused with the fix
    refused = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="vmap")
    with pytest.raises(ValueError, match=r"val_check_interval=3.*check_val_every_n_epoch=None"):
        quiet_trainer(strategy=refused, max_epochs=2, val_check_interval=3).fit(TinyClassifier(), datamodule=_data())


def test_an_int_val_check_interval_longer_than_a_round_is_reported_once():
    # 4 clients x 3 local steps = 12 sequential steps a round: an interval of 20 is never reached inside a round
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="sequential")
    seen = _ValidationSteps()
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, val_check_interval=20, callbacks=[seen])
    message = r"val_check_interval=20\) was not reached in round 0.*12 Lightning step"
    with pytest.warns(UserWarning, match=message) as got:
        trainer.fit(TinyClassifier(), datamodule=_data())
    assert seen.steps == []
    assert sum("was not reached" in str(w.message) for w in got) == 1
    # counted across rounds instead: 3 rounds are 36 steps, validated once, after step 20
    strategy = FedHetStrategy(participation=UniformSample(4), local_steps=3, engine="sequential")
    seen = _ValidationSteps()
    trainer = quiet_trainer(
        strategy=strategy, max_epochs=3, val_check_interval=20, check_val_every_n_epoch=None, callbacks=[seen]
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*was not reached.*")
        trainer.fit(TinyClassifier(), datamodule=_data())
    assert seen.steps == [20]


class _LogsItsLoss(TinyClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


@pytest.mark.parametrize("strategy_class", [FedHetStrategy, FedHetDDPStrategy],
                         ids=["FedHetStrategy", "FedHetDDPStrategy-one-process"])
def test_rounds_cut_short_with_validation_inside_them_close_as_cut_and_show_the_global_model(strategy_class,
                                                                                           in_this_process):
    # 4 clients of one local step a round, each epoch cut after 2 steps, validation after every step (both before the
    # cut round closes): each round is recorded as cut, every validation sees the global model (also in the rounds
    # after a cut one, which must hold it again), and the module ends with it. FedHetDDPStrategy runs one process
    # in this process.
    data = _data()
    probe = ValidationLoss(data.val_dataset)
    strategy = strategy_class(participation=UniformSample(4), local_steps=1, engine="sequential")
    one_device = dict(devices=1) if strategy_class is FedHetDDPStrategy else {}
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, limit_train_batches=2, val_check_interval=1,
                            callbacks=[probe], **one_device)
    with pytest.warns(UserWarning, match="cut short"):
        trainer.fit(_LogsItsLoss(), datamodule=data)
    assert [h["complete"] for h in strategy.history] == [False, False, False]
    assert [len(h["received"]) for h in strategy.history] == [2, 2, 2]  # two of the four clients had finished
    assert len(probe.pairs) == 6
    for logged, expected in probe.pairs:
        assert logged == pytest.approx(expected, abs=1e-5)
    torch.testing.assert_close(flat_params(trainer.lightning_module), strategy.global_params, rtol=0, atol=0)
