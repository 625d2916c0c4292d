"""engine="auto": vmap when the run passes vmap's checks (and vmap pays on the device), sequential otherwise, said once.

Each case names the slip it catches: a choice that ignores a refusal (the fit would crash or silently diverge), a
choice that is not announced, or a run whose result is not the sequential engine's.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import yaml

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import UniformSteps
from tests.helpers import TinyClassifier, equal_clients, quiet_trainer


class _Notes(logging.Handler):
    """Collects what Lightning's ``rank_zero_info`` logger prints (it does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def notes():
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = _Notes(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def _fit(model, rounds: int = 3, **kwargs) -> FedHetStrategy:
    dm = equal_clients(6)
    options = dict(participation=Bernoulli(0.7), local_steps=UniformSteps(1, 3), seed=4)
    strategy = FedHetStrategy(**{**options, **kwargs})
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(model, datamodule=dm)
    return strategy


def test_auto_picks_vmap_for_a_model_that_passes_and_says_so_once(notes):
    auto = _fit(TinyClassifier(momentum=0.5), engine="auto")
    said = [message for message in notes if "engine='auto'" in message]
    assert len(said) == 1 and "engine='vmap'" in said[0], said
    assert auto.engine_choice.name == "vmap" and auto.engine_choice.compile is False  # 3 rounds: not worth compiling
    reference = _fit(TinyClassifier(momentum=0.5), engine="sequential")
    torch.testing.assert_close(auto.global_params, reference.global_params, rtol=1e-5, atol=1e-6)


class _Branching(TinyClassifier):
    """Python control flow on a tensor's value: torch.func cannot transform it (vmap would refuse at round 0)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if loss > 100:  # data-dependent branch
            loss = loss * 0.5
        return loss


def test_auto_falls_back_to_sequential_when_torch_func_cannot_transform_the_step(notes):
    auto = _fit(_Branching(), engine="auto")
    assert auto.engine_choice.name == "sequential"
    assert "torch.func could not transform training_step" in auto.engine_choice.reason
    said = [message for message in notes if "engine='auto'" in message]
    assert len(said) == 1 and "engine='sequential'" in said[0] and "torch.func" in said[0]
    reference = _fit(_Branching(), engine="sequential")
    torch.testing.assert_close(auto.global_params, reference.global_params, rtol=0, atol=0)


class _Counting(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def training_step(self, batch, batch_idx):
        self.seen += 1
        return super().training_step(batch, batch_idx)


def test_the_trial_step_changes_nothing():
    # the trial gradient runs on copies: an integer buffer the step increments ends where the sequential run's does
    auto, reference = _fit(_Counting(), engine="auto"), _fit(_Counting(), engine="sequential")
    assert auto.engine_choice.name == "vmap"
    assert torch.equal(auto.server.global_ints, reference.server.global_ints)
    torch.testing.assert_close(auto.global_params, reference.global_params, rtol=1e-5, atol=1e-6)


class _Conv(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 1, 1)

    def forward(self, x):
        return self.linear(self.conv(x.unsqueeze(1)).squeeze(1))


class _AdamModel(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_auto_keeps_sgd_momentum_per_client_on_vmap():
    # optimizer_state="persist" with SGD momentum: auto picks vmap, and the run is the sequential engine's
    reference = _fit(TinyClassifier(momentum=0.5), engine="sequential", optimizer_state="persist")
    auto = _fit(TinyClassifier(momentum=0.5), engine="auto", optimizer_state="persist")
    assert auto.engine_choice.name == "vmap"
    torch.testing.assert_close(auto.global_params, reference.global_params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("make_model", "kwargs", "cause"),
    [
        (_AdamModel, dict(optimizer_state="persist"), "optimizer_state='persist' with Adam"),
        (_Conv, {}, "convolutions and trains on a CPU"),
    ],
    ids=["persist-adam", "cnn-on-cpu"],
)
def test_auto_picks_sequential_naming_the_cause(make_model, kwargs, cause):
    auto = _fit(make_model(), engine="auto", **kwargs)
    assert auto.engine_choice.name == "sequential"
    assert cause in auto.engine_choice.reason


@pytest.mark.without_compiler  # validates arguments, compiles nothing: mutation testing runs it
def test_auto_follows_an_explicit_compile_and_validates_it():
    with pytest.raises(ValueError, match="compile must be"):
        FedHetStrategy(engine="auto", compile="fast")
    with pytest.raises(ValueError, match="engine='auto' is FedHetStrategy's"):
        from lightning_fedhet.strategy_ddp import FedHetDDPStrategy

        FedHetDDPStrategy(engine="auto")


@pytest.mark.parametrize(
    ("make_model", "engine", "lightning_steps"),
    [
        # vmap: one Lightning step per round, 3 rounds
        (lambda: TinyClassifier(momentum=0.5), "vmap", 3),
        # sequential: one Lightning step per local step: 3 rounds x 6 clients (Full) x 2 local steps = 36
        (_Branching, "sequential", 36),
    ],
    ids=["vmap-able", "not-vmap-able"],
)
def test_the_default_engine_is_auto_and_trains_with_its_choice(notes, tmp_path, make_model, engine, lightning_steps):
    """``FedHetStrategy()`` with no ``engine``: auto's choice is said once, and it is the engine that ran (told apart
    by Lightning's step count) and the one the loggers get as ``fedhet.engine.ran``."""
    from lightning.pytorch.loggers import CSVLogger

    strategy = FedHetStrategy(local_steps=2, seed=4)
    assert strategy.engine == "auto"
    logger = CSVLogger(tmp_path)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, limit_val_batches=0, logger=logger)
    trainer.fit(make_model(), datamodule=equal_clients(6))
    said = [message for message in notes if "engine='auto'" in message]
    assert len(said) == 1 and f"engine={engine!r}" in said[0], said
    assert strategy.engine_choice.name == engine
    assert trainer.global_step == lightning_steps
    assert strategy.federated_config()["engine.ran"] == engine
    with open(f"{logger.log_dir}/hparams.yaml") as f:
        logged = yaml.safe_load(f)["fedhet"]
    assert (logged["engine"], logged["engine.ran"], logged["engine.compile"]) == ("auto", engine, False)
