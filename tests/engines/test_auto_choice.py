"""engine="auto" decided by hand: every branch of ``choose_engine`` (engine, compile flag and the exact reason a
user reads), the one-step ``vmap_trial`` and ``trial_batch``, without fitting anything.

The reasons are compared whole, written out here: a reason that names the wrong cause sends a user after the wrong
fix. The fits that check the chosen engine's result against the sequential engine are in ``test_auto.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_fedhet.engines.auto import COMPILE_MIN_ROUNDS, EngineChoice, choose_engine, trial_batch, vmap_trial
from tests.helpers import TinyClassifier

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
VMAP_CPU = "the model passes vmap's checks and a cohort in lock-step pays on a CPU for a model without convolutions"
VMAP_GPU = "the model passes vmap's checks and a cohort in lock-step pays on a GPU"


class _Conv(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 1, 1)


class _Manual(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _choose(module=None, optimizers=None, intervals=(), **overrides) -> EngineChoice:
    module = TinyClassifier() if module is None else module
    if optimizers is None:
        optimizers = [torch.optim.SGD(module.parameters(), lr=0.1)]
    settings = dict(sends_client_config=False, optimizer_state="reset", val_interval_inside_epoch=None, device=CPU,
                    rounds=3, compile=None)
    return choose_engine(module, optimizers, list(intervals), **{**settings, **overrides})


def _sequential(reason: str) -> EngineChoice:
    return EngineChoice("sequential", False, reason)


def test_each_refusal_picks_sequential_with_its_own_reason():
    module = TinyClassifier()
    two = [torch.optim.SGD(module.parameters(), lr=0.1), torch.optim.SGD(module.parameters(), lr=0.2)]
    decayed = [torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=1e-4)]
    lbfgs = [torch.optim.LBFGS(module.parameters())]
    adam = [torch.optim.Adam(module.parameters())]
    damped = [torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, dampening=0.1)]
    assert _choose(module, adam, optimizer_state="persist") == _sequential(
        "optimizer_state='persist' with Adam: its state holds a step count per client, which a cohort's stacked "
        "optimizer shares; a cohort carries SGD's momentum buffers only")
    assert _choose(module, damped, optimizer_state="persist") == _sequential(
        "optimizer_state='persist' with SGD dampening=0.1: a client's first step with and without a kept momentum "
        "buffer differ, and a cohort steps every client alike; use dampening=0")
    assert _choose(module, damped).name == "vmap"  # dampening matters only with persist
    assert _choose(_Manual()) == _sequential("the module uses manual optimisation")
    assert _choose(module, two) == _sequential("the module has 2 optimizers; the engine steps exactly one")
    assert _choose(module, []) == _sequential("the module has 0 optimizers; the engine steps exactly one")
    assert _choose(module, lbfgs) == _sequential(
        "optimizer LBFGS is not one whose state is elementwise (SGD, Adam, AdamW, RMSprop, Adagrad)")
    assert _choose(module, decayed, sends_client_config=True) == _sequential(
        "the rule trains a different part of the model on each client and the optimizer has weight_decay=[0.0001], "
        "which would move the parts a client does not train")
    assert _choose(module, decayed, sends_client_config=True, rule="FedCIS").reason.startswith("FedCIS trains")
    assert _choose(intervals=["epoch", "step"]) == _sequential(
        "a learning-rate scheduler steps every local step (interval='step')")
    assert _choose(val_interval_inside_epoch=2) == _sequential(
        "val_check_interval=2 is counted inside each round, which vmap runs as one step")
    assert _choose(_Conv()) == _sequential(
        "the model has convolutions and trains on a CPU, where a cohort's batched convolutions are no faster than "
        "one client at a time (vmap pays on a GPU, or for models without convolutions)")


def test_what_does_not_refuse():
    module = TinyClassifier()
    decayed = [torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=1e-4)]
    vmap = EngineChoice("vmap", False, VMAP_CPU)
    assert _choose(module, decayed) == vmap  # weight decay moves nothing else when every client trains everything
    assert _choose(sends_client_config=True) == vmap  # a per-client config without weight decay
    assert _choose(intervals=["epoch"]) == vmap
    assert _choose(val_interval_inside_epoch=1) == vmap  # validating after every round's one step is the same
    assert _choose(torch.nn.Linear(5, 3)) == vmap  # a plain module (no automatic_optimization attribute)
    assert _choose(optimizer_state="global") == vmap


@pytest.mark.without_compiler  # decides compile, compiles nothing: mutation testing runs it
def test_compile_follows_the_device_the_model_and_the_length_of_the_run():
    # CPU, no convolutions: compile from COMPILE_MIN_ROUNDS rounds on, or for a run of unknown length (None, -1)
    assert COMPILE_MIN_ROUNDS == 200
    for rounds, compiled in [(199, False), (200, True), (1000, True), (None, True), (-1, True), (0, False),
                             (1, False)]:
        assert _choose(rounds=rounds) == EngineChoice("vmap", compiled, VMAP_CPU), rounds
    # on a GPU: always compiled, a convolutional model included (it is not refused there)
    assert _choose(device=CUDA, rounds=3) == EngineChoice("vmap", True, VMAP_GPU)
    assert _choose(_Conv(), device=CUDA, rounds=3) == EngineChoice("vmap", True, VMAP_GPU)
    # an explicit compile is followed whatever the run
    assert _choose(rounds=1000, compile=False) == EngineChoice("vmap", False, VMAP_CPU)
    assert _choose(rounds=3, compile="max-autotune") == EngineChoice("vmap", "max-autotune", VMAP_CPU)


@pytest.mark.without_compiler
def test_describe_says_the_engine_and_compile_only_when_compiling():
    prefix = "FedHetStrategy(engine='auto') trains with engine="
    assert EngineChoice("vmap", True, "why").describe() == prefix + "'vmap' with compile=True: why"
    assert EngineChoice("vmap", "max-autotune", "r").describe() == prefix + "'vmap' with compile='max-autotune': r"
    assert EngineChoice("vmap", False, "why").describe() == prefix + "'vmap': why"
    assert EngineChoice("sequential", True, "why").describe() == prefix + "'sequential': why"


class _Recording(TinyClassifier):
    """BatchNorm (float and integer buffers) plus its own integer counter; records the batch_idx it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.batch_indices: list = []

    def forward(self, x):
        return self.linear(self.norm(x))

    def training_step(self, batch, batch_idx):
        self.batch_indices.append(batch_idx)
        self.calls += 1
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss


def _stacked_batch(batch_size: int = 4):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, batch_size, 5, generator=gen), torch.randint(0, 3, (1, batch_size), generator=gen)


def test_the_trial_transforms_a_step_with_buffers_and_changes_nothing():
    module = _Recording()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    log = module.log
    assert vmap_trial(module, _stacked_batch(), lambda batch: batch) is None
    assert module.batch_indices == [0]  # the first step of a round
    assert module.log == log  # the module's own log is given back
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # counter, running statistics, weights unchanged


class _ReturnsNothing(TinyClassifier):
    def training_step(self, batch, batch_idx):
        return None


class _LongError(TinyClassifier):
    def training_step(self, batch, batch_idx):
        raise RuntimeError("x" * 400 + "\nsecond line")


def test_the_trial_names_why_the_step_cannot_be_transformed():
    assert vmap_trial(_ReturnsNothing(), _stacked_batch(), lambda b: b) == (
        "training_step must return the loss tensor (or a dict with 'loss')")
    # torch.func's own refusals: the first line of the message, at most 300 characters of it
    assert vmap_trial(_LongError(), _stacked_batch(), lambda b: b) == (
        "torch.func could not transform training_step (" + "x" * 300 + ")")
    module = _LongError()
    log = module.log
    vmap_trial(module, _stacked_batch(), lambda b: b)
    assert module.log == log


class _Streams:
    """Records which (round, client) the trial batch is drawn for; a client's batch holds its id."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def probe_indices(self, round: int, client: int) -> np.ndarray:
        self.asked.append((round, client))
        return np.array([client, client])

    def stacked_batch(self, indices: np.ndarray) -> np.ndarray:
        return indices


def test_the_trial_batch_is_the_first_client_with_data_at_round_zero():
    streams = _Streams()
    assert trial_batch(streams, np.array([False, False, True, True])).tolist() == [[2, 2]]
    assert streams.asked == [(0, 2)]
    assert trial_batch(streams, np.array([True, False])).tolist() == [[0, 0]]
    assert trial_batch(streams, np.array([False, False])) is None
    assert streams.asked == [(0, 2), (0, 0)]
