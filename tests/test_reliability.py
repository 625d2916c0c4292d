"""Bad input fails early and clearly; faults never corrupt the global model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_fedhet.server as server_module
from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedAvg, FedVARP
from lightning_fedhet.participation import Bernoulli
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset


def _data(clients: int = 3, per_client: int = 8) -> FederatedDataModule:
    ds = toy_dataset(clients * per_client)
    parts = [np.arange(i * per_client, (i + 1) * per_client) for i in range(clients)]
    return FederatedDataModule(ds, parts, batch_size=4)


def _fit(strategy, rounds=1, model=None, **kwargs):
    model = model or TinyClassifier()
    trainer = quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0, **kwargs)
    trainer.fit(model, datamodule=_data())
    return model, trainer


class Counter(TinyClassifier):
    """A training_step that counts its calls in an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return super().training_step(batch, batch_idx)


def test_integer_buffers_are_global_state_not_summed_over_clients():
    # 3 clients x 2 local steps: each client starts from the global counter and adds 2; equal sample counts make
    # the server's mean change 2 per round (summing over clients would give 6 per round).
    model, _ = _fit(FedHetStrategy(local_steps=2), rounds=3, model=Counter())
    assert int(model.calls) == 6


@pytest.mark.parametrize("action, expected_received", [("reject", [1]), ("clip", [0, 1])])
def test_max_update_norm_rejects_or_clips(action, expected_received):
    class Huge(TinyClassifier):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e4 if self.trainer.strategy.server.current_client == 0 else loss

    # the sequential engine: Huge reads which client is training at each step
    strategy = FedHetStrategy(local_steps=1, max_update_norm=1.0, update_norm_action=action, engine="sequential")
    model = Huge()
    before = flat_params(model).clone()
    data = FederatedDataModule(toy_dataset(16), [np.arange(8), np.arange(8, 16)], batch_size=8)
    quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0).fit(model, datamodule=data)
    assert strategy.history[0]["received"].tolist() == expected_received
    assert strategy.rejected_total == (1 if action == "reject" else 0)
    # FedAvg over the received: every applied update has norm <= 1, so the mean moves by <= 1
    assert float(torch.linalg.vector_norm(flat_params(model) - before)) <= 1.0 + 1e-6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_clients=3, local_steps=[1, 2]), "local_steps has 2 entries but num_clients is 3"),
        (dict(num_clients=3, participation=Bernoulli([0.5, 0.5])), "p"),
        (dict(max_update_norm=0.0), "max_update_norm"),
        (dict(max_update_norm=-1.0), "max_update_norm"),
        (dict(update_norm_action="drop"), "update_norm_action"),
    ],
)
def test_constructor_rejects_bad_arguments_before_fit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FedHetStrategy(**kwargs)


def test_fractional_val_check_interval_is_refused_clearly():
    with pytest.raises(ValueError, match="val_check_interval=0.5.*int number of steps"):
        _fit(FedHetStrategy(), val_check_interval=0.5)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 truncated zip"], ids=["empty", "truncated"])
def test_unreadable_checkpoint_names_the_file(tmp_path, content):
    path = tmp_path / "broken.ckpt"
    path.write_bytes(content)
    trainer = quiet_trainer(strategy=FedHetStrategy(), max_epochs=1, limit_val_batches=0)
    with pytest.raises(ValueError, match="broken.ckpt"):
        trainer.fit(TinyClassifier(), datamodule=_data(), ckpt_path=str(path))


def test_large_server_memory_suggests_bfloat16(monkeypatch):
    monkeypatch.setattr(server_module, "LARGE_MEMORY_BYTES", 10)
    with pytest.warns(UserWarning, match="memory_dtype=torch.bfloat16"):
        _fit(FedHetStrategy(algorithm=FedVARP()))


def test_resume_after_a_checkpoint_equals_uninterrupted_for_a_stateful_rule(tmp_path):
    def run(rounds, ckpt=None, callbacks=()):
        model = TinyClassifier(momentum=0.5)
        strategy = FedHetStrategy(algorithm=FedVARP(), participation=Bernoulli(0.6), local_steps=2, seed=4)
        trainer = quiet_trainer(
            strategy=strategy,
            max_epochs=rounds,
            limit_val_batches=0,
            enable_checkpointing=bool(callbacks),
            callbacks=list(callbacks),
        )
        trainer.fit(model, datamodule=_data(), ckpt_path=ckpt)
        return flat_params(model)

    full = run(6)
    run(3, callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="r{epoch}", save_top_k=-1)])
    resumed = run(6, ckpt=str(tmp_path / "repoch=2.ckpt"))
    assert torch.equal(full, resumed)


def test_fedavg_default_is_unaffected_by_norm_options():
    a, _ = _fit(FedHetStrategy(algorithm=FedAvg(), seed=1), rounds=2)
    b, _ = _fit(FedHetStrategy(algorithm=FedAvg(), seed=1, max_update_norm=1e9), rounds=2)
    assert torch.equal(flat_params(a), flat_params(b))
