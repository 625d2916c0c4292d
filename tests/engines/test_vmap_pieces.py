"""The vmap engine's small pieces by hand: padding a cohort to its compiled bucket, concatenating and slicing
stacked batches, the state layout's vectors, the texts of its refusals, and what a vmap fit logs.

The contract tests (``test_contract.py``) check the engine's results against the sequential engine; these pin the
helpers those results rest on, including the ones only the compiled path uses (which run outside torch.compile
here, so mutation testing sees them).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.engines._compiled import VmapUnsupported
from lightning_fedhet.engines.cohort import VmapCohort
from lightning_fedhet.engines.layout import StateLayout, clone_tree, pad_batch, pad_rows, padded_size, slice_tree
from lightning_fedhet.engines.lockstep import cat_batches, index_table
from lightning_fedhet.engines.vmap import VmapEngine, check_vmap_setup
from lightning_fedhet.system import UniformSteps
from tests.helpers import TinyClassifier, equal_clients, quiet_trainer, toy_dataset


def test_padded_size_buckets_by_hand():
    # step = max(8, 2 ** (bit_length(size) - 4)); the size rounded up to a multiple of the step
    cases = {0: 0, 1: 8, 7: 8, 8: 8, 9: 16, 16: 16, 17: 24, 31: 32, 32: 32, 33: 40, 63: 64, 64: 64, 65: 72,
             127: 128, 128: 128, 129: 144, 200: 208, 255: 256, 256: 256, 257: 288, 1000: 1024}
    assert {size: padded_size(size) for size in cases} == cases
    for size in range(1, 600):  # at most 7 rows or 12.5 % of padding, never fewer rows than clients
        assert size <= padded_size(size) <= size + max(7, size // 8)


def test_pad_rows_repeats_row_zero():
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert pad_rows(t, 2) is t
    assert pad_rows(t, 5).tolist() == [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]
    cube = torch.arange(12.0).reshape(2, 3, 2)
    padded = pad_rows(cube, 3)
    assert padded.shape == (3, 3, 2) and torch.equal(padded[2], cube[0]) and torch.equal(padded[:2], cube)


def test_pad_batch_pads_every_tensor_of_a_nested_batch():
    x, y = torch.arange(6.0).reshape(2, 3), torch.tensor([7, 8])
    padded = pad_batch({"x": x, "pair": (y, [y]), "name": "keep"}, 3)
    assert padded["x"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [0.0, 1.0, 2.0]]
    assert isinstance(padded["pair"], tuple) and isinstance(padded["pair"][1], list)
    assert padded["pair"][0].tolist() == [7, 8, 7] and padded["pair"][1][0].tolist() == [7, 8, 7]
    assert padded["name"] == "keep"


def test_slice_and_clone_trees():
    tree = {"a": torch.arange(4.0), "b": (torch.ones(4, 2), [torch.zeros(4)]), "n": 3}
    cut = slice_tree(tree, 2)
    assert cut["a"].tolist() == [0.0, 1.0] and cut["b"][0].shape == (2, 2) and cut["b"][1][0].shape == (2,)
    assert isinstance(cut["b"], tuple) and isinstance(cut["b"][1], list) and cut["n"] == 3
    copy = clone_tree(tree)
    tree["a"].add_(10.0)
    tree["b"][1][0].add_(1.0)
    assert copy["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and copy["b"][1][0].tolist() == [0.0] * 4
    assert isinstance(copy["b"], tuple) and isinstance(copy["b"][1], list) and copy["n"] == 3


def test_cat_batches_along_the_client_dimension():
    one = torch.zeros(1, 2)
    assert cat_batches([one]) is one  # a single group's batch is used as it is
    a, b = torch.zeros(1, 2), torch.ones(2, 2)
    assert cat_batches([a, b]).tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    pairs = cat_batches([(a, torch.tensor([[1]])), (b, torch.tensor([[2], [3]]))])
    assert isinstance(pairs, tuple) and pairs[0].shape == (3, 2) and pairs[1].flatten().tolist() == [1, 2, 3]
    lists = cat_batches([[a], [b], [a]])
    assert isinstance(lists, list) and lists[0].shape == (4, 2)
    dicts = cat_batches([{"x": a, "y": torch.tensor([5])}, {"x": b, "y": torch.tensor([6, 7])}])
    assert dicts["x"].shape == (3, 2) and dicts["y"].tolist() == [5, 6, 7]
    with pytest.raises(TypeError) as err:
        cat_batches([np.zeros(2), np.ones(2)])
    assert str(err.value) == "batches of type ndarray cannot be concatenated per client"


class _Buffers(TinyClassifier):
    """A float buffer and integer buffers of several shapes, between the parameters."""

    def __init__(self) -> None:
        super().__init__(in_features=2, num_classes=2)
        self.register_buffer("scale", torch.tensor([0.5, 1.5]))
        self.register_buffer("counts", torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
        self.register_buffer("seen", torch.tensor(9, dtype=torch.int64))


def test_index_table_repeats_a_finished_clients_last_batch_and_row_zero_for_padding():
    # client 0: 3 batches, client 1: 1 batch (then repeats it), client 2: 2 batches; two padding rows repeat row 0
    own = [[np.array([1, 2]), np.array([3, 4]), np.array([5, 6])], [np.array([7, 8])],
           [np.array([9, 10]), np.array([11, 12])]]
    assert index_table(own).tolist() == [
        [[1, 2], [7, 8], [9, 10]],
        [[3, 4], [7, 8], [11, 12]],
        [[5, 6], [7, 8], [11, 12]],
    ]
    assert index_table(own, 5).tolist() == [
        [[1, 2], [7, 8], [9, 10], [1, 2], [1, 2]],
        [[3, 4], [7, 8], [11, 12], [3, 4], [3, 4]],
        [[5, 6], [7, 8], [11, 12], [5, 6], [5, 6]],
    ]
    assert index_table(own, 3).shape == (3, 3, 2)


def test_state_layout_vectors_by_hand():
    module = _Buffers()
    with torch.no_grad():
        module.linear.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        module.linear.bias.copy_(torch.tensor([5.0, 6.0]))
    layout = StateLayout(module)
    floats, ints = layout.current()
    assert layout.num_parameters == 6
    assert floats.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.5, 1.5]  # parameters, then floating buffers
    assert ints.dtype == torch.int64 and ints.tolist() == [1, 2, 3, 4, 9]  # integer buffers flattened, int64
    floats, ints = StateLayout(TinyClassifier()).current()
    assert floats.shape == (5 * 3 + 3,) and ints.dtype == torch.int64 and ints.shape == (0,)


def test_a_step_scheduler_is_refused_with_the_whole_reason():
    engine = VmapEngine()
    engine.check_lr_schedulers(["epoch"])
    with pytest.raises(VmapUnsupported) as err:
        engine.check_lr_schedulers(["epoch", "step"])
    assert str(err.value) == (
        "engine='vmap' cannot run this: a learning-rate scheduler with interval='step' would advance once per round "
        "(one Lightning step) instead of once per local step; use interval='epoch' (once per round). Use "
        "engine='sequential' instead."
    )


class _Logging(TinyClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_a_vmap_fit_logs_the_round_mean_once_per_round_and_says_nothing_about_its_none():
    data = equal_clients(4)
    strategy = FedHetStrategy(local_steps=2, seed=0, engine="vmap")
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Logging(), datamodule=data)
    # the cohort steps its own copies and returns None to Lightning on purpose: no warning about it reaches the user
    assert not [w for w in caught if "returned `None`" in str(w.message)]
    # one value per round (on_epoch only): no "_step" / "_epoch" variants
    assert "train_loss" in trainer.callback_metrics
    assert not [k for k in trainer.callback_metrics if k.startswith("train_loss_")]


def test_a_new_cohorts_state_is_each_clients_start():
    module = _Buffers()
    floats, ints = StateLayout(module).current()
    starts = torch.stack([floats, floats + 1.0, floats + 2.0])
    int_starts = torch.stack([ints, ints * 2, ints * 3])
    cohort = VmapCohort(module, torch.optim.SGD(module.parameters(), lr=0.1), [4, 7, 9], np.array([2, 1, 0]),
                        starts=starts, int_starts=int_starts)
    assert torch.equal(cohort.flat_state(), starts)  # parameters then the float buffer, row by row
    assert torch.equal(cohort.flat_params(), starts[:, :6])
    assert cohort.int_state().dtype == torch.int64 and torch.equal(cohort.int_state(), int_starts)
    assert torch.isnan(cohort.mean_losses()).all()  # no step taken yet
    plain = TinyClassifier()
    cohort = VmapCohort(plain, torch.optim.SGD(plain.parameters(), lr=0.1), [0, 1], np.array([1, 1]))
    state = cohort.int_state()
    assert state.dtype == torch.int64 and state.shape == (2, 0)  # no integer buffers
    assert torch.equal(cohort.flat_state(), cohort.flat_params())  # no floating buffers
    assert torch.equal(cohort.flat_params()[1], StateLayout(plain).current()[0])  # the module's own state


class _Shown(TinyClassifier):
    """Logs one value to the progress bar only (positional arguments), one to the logger only, one to both; each as
    the round's mean, the value the vmap engine logs whatever ``on_step`` asks (it runs a round as one step)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("bar_only", loss, True, False, on_step=False, on_epoch=True)
        self.log("logger_only", 2 * loss, prog_bar=False, logger=True, on_step=False, on_epoch=True)
        self.log("both", 3 * loss, prog_bar=True, on_step=False, on_epoch=True)
        return loss


def test_vmap_shows_each_logged_value_where_training_step_asked_like_the_sequential_engine():
    def fit(engine: str):
        data = equal_clients(4)
        # unequal local steps: a client that has finished logs nothing at later lock-steps
        strategy = FedHetStrategy(local_steps=UniformSteps(1, 3), seed=0, engine=engine)
        trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
        trainer.fit(_Shown(), datamodule=data)
        return trainer

    vmap, sequential = fit("vmap"), fit("sequential")
    for trainer in (vmap, sequential):
        assert {"bar_only", "both"} <= set(trainer.progress_bar_metrics)
        assert "logger_only" not in trainer.progress_bar_metrics
        assert {"logger_only", "both"} <= set(trainer.logged_metrics) and "bar_only" not in trainer.logged_metrics
    for name in ("bar_only", "logger_only", "both"):
        torch.testing.assert_close(vmap.callback_metrics[name], sequential.callback_metrics[name], rtol=1e-5,
                                   atol=1e-6)


class _Int32Counter(TinyClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counter", torch.tensor([3, 4], dtype=torch.int32))


def test_integer_buffers_of_any_integer_dtype_travel_as_int64():
    module = _Int32Counter()
    floats, ints = StateLayout(module).current()
    assert ints.dtype == torch.int64 and ints.tolist() == [3, 4]
    cohort = VmapCohort(module, torch.optim.SGD(module.parameters(), lr=0.1), [0, 1], np.array([1, 1]))
    assert cohort.int_state().dtype == torch.int64 and cohort.int_state().tolist() == [[3, 4], [3, 4]]


def test_vmap_setup_refusals_name_their_cause_whole():
    module = TinyClassifier()
    sgd = [torch.optim.SGD(module.parameters(), lr=0.1)]
    decayed = [torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=0.01)]

    class Rule:
        sends_client_config = True

    def refusal(optimizers, optimizer_state="reset", algorithm=None) -> str:
        server = SimpleNamespace(optimizer_state=optimizer_state, algorithm=algorithm or SimpleNamespace(
            sends_client_config=False))
        with pytest.raises(VmapUnsupported) as err:
            check_vmap_setup(module, optimizers, server)
        text, head, tail = str(err.value), "engine='vmap' cannot run this: ", ". Use engine='sequential' instead."
        assert text.startswith(head) and text.endswith(tail)
        return text.removeprefix(head).removesuffix(tail)

    adam = [torch.optim.Adam(module.parameters())]
    assert refusal(adam, "persist") == ("optimizer_state='persist' with Adam: its state holds a step count per "
                                        "client, which a cohort's stacked optimizer shares; a cohort carries SGD's "
                                        "momentum buffers only")
    assert refusal(sgd, "persist", algorithm=Rule()) == (
        "optimizer_state='persist' with a rule that trains a different part of the model on each client: a kept "
        "momentum buffer would move the parts a client does not train")
    check_vmap_setup(module, sgd, SimpleNamespace(optimizer_state="persist", algorithm=SimpleNamespace(
        sends_client_config=False)))  # SGD's momentum buffers persist
    assert refusal([]) == "the module has 0 optimizers; the engine steps exactly one"
    assert refusal(decayed, algorithm=Rule()) == (
        "Rule trains a different part of the model on each client and the optimizer has weight_decay=[0.01], which "
        "would move the parts a client does not train")
    check_vmap_setup(module, decayed, SimpleNamespace(optimizer_state="reset", algorithm=SimpleNamespace(
        sends_client_config=False)))  # weight decay is fine when every client trains the whole model


class LogsEachReduction(TinyClassifier):
    """Logs per step with each reduction ``self.log`` offers, by name, as a function, and by position."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_max", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("loss_min", loss, on_step=False, on_epoch=True, reduce_fx=torch.min)
        self.log("steps_taken", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("loss_mean", loss, False, True, False, True, "mean")
        return loss


def test_vmap_reduces_each_logged_value_as_training_step_asked_like_the_sequential_engine():
    # the sequential engine's epoch value is Lightning's own reduction over the round's local steps; the vmap engine
    # reduces its clients' per-step values the same way (slip: every name averaged, whatever reduce_fx says)
    def fit(engine: str):
        strategy = FedHetStrategy(local_steps=UniformSteps(1, 3), seed=0, engine=engine)
        trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
        trainer.fit(LogsEachReduction(), datamodule=equal_clients(4))
        return trainer, strategy

    (vmap, strategy), (sequential, _) = fit("vmap"), fit("sequential")
    for name in ("loss_max", "loss_min", "steps_taken", "loss_mean"):
        torch.testing.assert_close(vmap.callback_metrics[name], sequential.callback_metrics[name], rtol=1e-5,
                                   atol=1e-6)
    steps = strategy.history[-1]["local_steps"]
    assert float(vmap.callback_metrics["steps_taken"]) == sum(steps.values()) >= 4  # one per client step
    assert vmap.callback_metrics["loss_max"] > vmap.callback_metrics["loss_mean"] > vmap.callback_metrics["loss_min"]


class _FirstStepOnly(TinyClassifier):
    """Logs 1 at each client's first local step only (under vmap, batch_idx is the local step), to the progress bar,
    summed; and its loss at every step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 0:
            self.log("started", 1.0, prog_bar=True, logger=False, on_step=False, on_epoch=True, reduce_fx="sum")
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss


def test_a_name_logged_at_some_local_steps_only_keeps_where_it_is_shown_and_its_reduction():
    # the cohort remembers only its last step's self.log arguments: a name logged at the first of two local steps
    # must still be summed and shown on the progress bar (slip: the arguments read after the round's last step)
    strategy = FedHetStrategy(local_steps=2, seed=0, engine="vmap")
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_val_batches=0)
    trainer.fit(_FirstStepOnly(), datamodule=equal_clients(4))
    assert float(trainer.progress_bar_metrics["started"]) == len(strategy.history[-1]["local_steps"]) == 4
    assert "started" not in trainer.logged_metrics


class _MedianLogged(TinyClassifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_median", loss, on_step=False, on_epoch=True, reduce_fx=torch.median)
        return loss


def test_a_reduction_the_vmap_engine_cannot_follow_is_refused_naming_the_call():
    strategy = FedHetStrategy(local_steps=2, seed=0, engine="vmap")
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"^self\.log\('loss_median', reduce_fx=<built-in method median .*>\): use "
                                         r"'mean', 'sum', 'max' or 'min'$"):
        trainer.fit(_MedianLogged(), datamodule=equal_clients(4))


class _ShapeBranch(TinyClassifier):
    """From the second local step on, logs one name only in the cohort of 2-sample batches, then one in every
    cohort (a branch on the batch's shape is a Python branch under vmap, fine)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx >= 1 and batch[0].shape[0] == 2:
            self.log("small_late", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        if batch_idx >= 1:
            self.log("late", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")
        return loss


def test_a_name_no_client_took_a_step_for_is_skipped_and_the_next_names_are_logged():
    # two cohorts by batch size: client 0 (16 samples, batches of 4, two steps) and client 1 (2 samples, one step).
    # At the second lock-step the small cohort (first: cohorts go by batch size) runs with its only client finished,
    # so "small_late" gets no value and is not logged; "late", logged after it, still is (slip: `continue` ->
    # `break`)
    data = FederatedDataModule(toy_dataset(18), [np.arange(16), np.arange(16, 18)], batch_size=4)
    strategy = FedHetStrategy(local_steps=[2, 1], seed=0, engine="vmap")
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, limit_val_batches=0)
    trainer.fit(_ShapeBranch(), datamodule=data)
    assert "small_late" not in trainer.callback_metrics
    assert float(trainer.callback_metrics["late"]) == 1.0  # client 0's second step
