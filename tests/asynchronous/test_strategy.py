"""FedASTStrategy + MultiTaskModule + TimeToTarget through Lightning: logging, stopping, resuming, refusals."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedhet import IID, FederatedDataModule
from lightning_fedhet.asynchronous import CappedPool, FedAST, FedASTStrategy, MultiTaskModule, SyncST, TimeToTarget
from lightning_fedhet.classifier import Classifier
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, ShiftedExponential
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset


def _dm(seed=0, val=True):
    return FederatedDataModule(toy_dataset(160, seed=seed), IID(), num_clients=8, batch_size=4,
                               val_dataset=toy_dataset(60, seed=9) if val else None)


class CountingClassifier(Classifier):
    """Counts its validation batches."""

    def __init__(self, lr=0.1):
        super().__init__("logistic_regression", num_classes=3, lr=lr, model_kwargs={"in_features": 5})
        self.validated = 0

    def validation_step(self, batch, batch_idx):
        self.validated += 1
        super().validation_step(batch, batch_idx)


def _classifier(lr=0.1):
    return CountingClassifier(lr)


def _module(a=None, b=None):
    torch.manual_seed(0)
    return MultiTaskModule({"a": a or _classifier(), "b": b or _classifier(0.2)},
                           datamodules={"a": _dm(0), "b": _dm(1)})


def _latency():
    return {"a": ShiftedExponential.fedast("mnist"), "b": ShiftedExponential.fedast("cifar10")}


def test_tasks_train_with_their_own_optimizers_and_log_with_a_prefix():
    strategy = FedASTStrategy(FedAST(requests=3, buffer=2, server_lr=0.5), local_steps=2, latency=_latency())
    module = _module()
    trainer = quiet_trainer(strategy=strategy, max_epochs=6)
    trainer.fit(module)
    metrics = trainer.callback_metrics
    # Classifier logs "train_loss" and the torchmetrics object "val_acc": both arrive prefixed by task
    assert {"a/train_loss", "b/train_loss", "a/val_acc", "b/val_acc", "a/val_loss", "b/val_loss"} <= set(metrics)
    # one epoch per server step; every task stepped
    assert len(strategy.history) == 6 and {h["task"] for h in strategy.history} == {"a", "b"}
    assert trainer.global_step == 2 * strategy.server.updates  # 2 local steps per received update
    # after the epoch every task module holds its task's global model
    for name in ("a", "b"):
        torch.testing.assert_close(flat_params(module.tasks[name]), strategy.server.params(name), atol=0, rtol=0)
    # the learning rates differ per task: the server read each optimizer's own lr (for Algorithm 4)
    assert strategy.server.states["a"].client_lr == 0.1 and strategy.server.states["b"].client_lr == 0.2
    # sim time is non-decreasing over server steps
    times = [h["sim_time"] for h in strategy.history]
    assert times == sorted(times) and times[0] > 0


def test_time_to_target_stops_a_task_and_hands_its_requests_to_the_others():
    # Task "a" reaches its target (val_loss <= 10, always true) at the first validation; "b" never does (<= 0).
    strategy = FedASTStrategy(FedAST(option="S", requests={"a": 4, "b": 2}, buffer=2, server_lr=0.5),
                              local_steps=1, latency=_latency(), participation=Bernoulli(0.5), slot=2.0)
    ttt = TimeToTarget({"a": 10.0, "b": 0.0}, monitor="val_loss", mode="min", max_sim_time=60.0)
    trainer = quiet_trainer(strategy=strategy, max_epochs=200, check_val_every_n_epoch=3, callbacks=[ttt])
    module = _module()
    trainer.fit(module)
    history = strategy.history
    stop_at = ttt.times["a"]
    assert stop_at == history[2]["sim_time"]  # the third server step, when Lightning first validated
    assert ttt.rounds["a"] == sum(h["task"] == "a" for h in history[:3])
    assert ttt.times["b"] is None
    assert all(h["task"] == "b" for h in history[3:]) and len(history) > 3
    # "a"'s 4 requests went to "b" (R: 2 -> 6, b keeps R/b = 1 -> 6)
    assert history[-1]["R"] == 6 and history[-1]["b"] == 6
    # stopped because the simulated clock passed the budget, within one server step of it
    assert history[-2]["sim_time"] <= 60.0 < strategy.server.clock
    # a stopped task is not evaluated any more: "a" validated once (1 batch), "b" at every validation
    assert module.tasks["a"].validated == 1 and module.tasks["b"].validated == len(history) // 3


def _strategy_d():
    return FedASTStrategy(FedAST(option="D", requests=4, buffer=2, server_lr=0.5, window=2, period=0.25),
                          local_steps=2, latency=_latency(), participation=Bernoulli(0.7), seed=3)


def test_resume_from_a_checkpoint_equals_uninterrupted(tmp_path):
    full = _strategy_d()
    m_full = _module()
    quiet_trainer(strategy=full, max_epochs=10).fit(m_full)
    assert any("skipped" not in r for r in full.server.reallocations)  # the dynamic path ran

    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
    quiet_trainer(strategy=_strategy_d(), max_epochs=5, enable_checkpointing=True, callbacks=[ckpt]).fit(_module())
    resumed = _strategy_d()
    m_resumed = _module()
    quiet_trainer(strategy=resumed, max_epochs=10).fit(m_resumed, ckpt_path=str(tmp_path / "last.ckpt"))

    for name in ("a", "b"):
        torch.testing.assert_close(flat_params(m_resumed.tasks[name]), flat_params(m_full.tasks[name]),
                                   atol=0, rtol=0)
    assert resumed.history == full.history
    assert resumed.server.reallocations == full.server.reallocations


def test_syncst_rounds_are_epochs_and_first_k_keeps_the_fastest():
    # CappedPool(1.0): every round draws all 8 clients (the default 0.3 would draw 2)
    strategy = FedASTStrategy(SyncST(first_k=2), local_steps=1, latency=_latency(), seed=4, pool=CappedPool(1.0))
    trainer = quiet_trainer(strategy=strategy, max_epochs=3)
    trainer.fit(_module())
    history = strategy.history
    # every round both tasks step (8 clients, 4 each, 2 kept each), then the clock jumps to the round's end
    assert [h["task"] for h in history] == ["a", "b"] * 3
    assert all(h["R"] == 4 and h["b"] == 2 and h["staleness"] == [0, 0] for h in history)
    assert [h["sync_round"] for h in history] == [0, 0, 1, 1, 2, 2]


def test_refusals_name_the_cause():
    with pytest.raises(ValueError, match="takes no engine .got engine='vmap'.: each request trains"):
        FedASTStrategy(engine="vmap")
    with pytest.raises(ValueError, match="takes no channel: lossy channels are not modelled"):
        FedASTStrategy(channel=LossyChannel(uplink=0.1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'lokal_steps'"):
        FedASTStrategy(lokal_steps=2)
    assert {"engine", "channel"}.isdisjoint(inspect.signature(FedASTStrategy).parameters)  # not taken to refuse
    with pytest.raises(TypeError, match="rule"):
        FedASTStrategy(rule="fedast")
    with pytest.raises(ValueError, match="local_steps"):
        FedASTStrategy(local_steps={"a": 0})
    with pytest.raises(TypeError, match="MultiTaskModule"):
        quiet_trainer(strategy=FedASTStrategy(), max_epochs=1).fit(TinyClassifier(), datamodule=_dm())
    with pytest.raises(ValueError, match="same client pool"):
        module = MultiTaskModule({"a": TinyClassifier(), "b": TinyClassifier()}, datamodules={
            "a": _dm(), "b": FederatedDataModule(toy_dataset(40), IID(), num_clients=4, batch_size=4)})
        quiet_trainer(strategy=FedASTStrategy(), max_epochs=1).fit(module)
    with pytest.raises(ValueError, match="targets"):
        TimeToTarget({})


def test_registered_strategy_name():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "fedast" in StrategyRegistry
    assert isinstance(pl.Trainer(strategy="fedast", logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False).strategy, FedASTStrategy)
