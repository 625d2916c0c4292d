"""The engines' shared pieces by hand: the loss probe CA-Fed selects on, the optimizer-state snapshots that
``optimizer_state="persist"`` keeps per client, and how the many-process engine aggregates what ``training_step``
logs over a round and merges it over processes."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.engines.base import (
    apply_client_config,
    export_optimizer_state,
    import_optimizer_state,
    log_reduction,
    probe_losses,
    reduce_logged,
)
from lightning_fedhet.engines.sequential import SequentialEngine
from lightning_fedhet.engines.sharded import PADDING, RoundLogs, ShardedSequentialEngine, combine_logs
from lightning_fedhet.engines.vmap import VmapEngine
from lightning_fedhet.flat import FlatModel
from lightning_fedhet.participation import Trace
from tests.helpers import TinyClassifier, equal_clients, quiet_trainer


class _Affine(torch.nn.Module):
    """``training_step`` = w * (sum of the batch) + b; returns a dict when asked; records batch_idx and logging."""

    def __init__(self, as_dict: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))
        self.as_dict = as_dict
        self.batch_indices: list[int] = []
        self.logged: list[str] = []

    def log(self, name, value, **kwargs) -> None:
        self.logged.append(name)

    def training_step(self, batch, batch_idx):
        self.batch_indices.append(batch_idx)
        self.log("train_loss", 0.0)
        loss = self.w * batch.sum() + self.b
        return {"loss": loss, "other": 7.0} if self.as_dict else loss


class _Streams:
    """Client c's probe batch at round r is the indices [10 r + c]; a batch is its indices as floats."""

    def probe_indices(self, round: int, client: int) -> np.ndarray:
        return np.array([10 * round + client])

    def batch(self, indices: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(indices, dtype=torch.float32)


@pytest.mark.parametrize("as_dict", [False, True])
def test_probe_losses_are_each_available_clients_loss_at_the_global_model(as_dict: bool):
    module = _Affine(as_dict)
    has_data = torch.tensor([True, True, False, True, True])
    server = SimpleNamespace(num_clients=5, global_vector=torch.tensor([2.0, 0.5]), planner=SimpleNamespace(
        has_data=has_data), streams=_Streams())
    available = torch.tensor([True, False, True, True, True])
    moved: list = []

    def to_device(batch):
        moved.append(batch)
        return batch

    losses = probe_losses(module, FlatModel(module), server, to_device, 3, available)
    # w_t = (w, b) = (2, 0.5); round 3: client c's batch is [30 + c], loss 2 (30 + c) + 0.5
    # client 1 is unavailable, client 2 holds no data: NaN
    assert losses.dtype == torch.float64
    assert losses[[0, 3, 4]].tolist() == [60.5, 66.5, 68.5]
    assert math.isnan(losses[1]) and math.isnan(losses[2])
    assert module.batch_indices == [0, 0, 0] and len(moved) == 3
    assert module.logged == []  # self.log is silenced during the probe ...
    module.log("after", 1.0)
    assert module.logged == ["after"]  # ... and given back
    assert module.w.item() == 2.0 and module.b.item() == 0.5  # the module holds w_t, untrained


def test_optimizer_state_snapshots_are_copies_both_ways():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    param.grad = torch.ones(2)
    optimizer.step()
    optimizer.state[param]["visits"] = 3  # a non-tensor entry is kept as it is
    snapshot = export_optimizer_state(optimizer)
    assert list(snapshot) == [0] and snapshot[0]["visits"] == 3
    assert snapshot[0]["momentum_buffer"].tolist() == [1.0, 1.0]
    optimizer.step()  # the optimizer's buffer moves on in place (0.9 * 1 + 1); the snapshot does not
    assert snapshot[0]["momentum_buffer"].tolist() == [1.0, 1.0]

    other = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    import_optimizer_state(other, snapshot)
    other.step()  # 0.9 * 1 + 1 in the imported buffer; the snapshot it came from stays
    assert other.state[param]["momentum_buffer"].tolist() == pytest.approx([1.9, 1.9])
    assert snapshot[0]["momentum_buffer"].tolist() == [1.0, 1.0] and other.state[param]["visits"] == 3


def test_round_logs_keep_each_names_aggregate_over_the_round():
    logs = RoundLogs()
    logs.batch = (torch.zeros(4, 5), torch.zeros(4))  # batch size 4, as Lightning would extract it
    logs("loss", torch.tensor(2.0), prog_bar=True)
    logs("loss", 1.0, batch_size=2)
    logs("seen", 3, reduce_fx="sum", logger=False)
    logs("seen", torch.tensor([4.0]), reduce_fx=torch.sum)
    logs("top", -5.0, reduce_fx="max")
    logs("top", -7.0, reduce_fx=torch.max)
    logs("low", 5.0, reduce_fx="min")
    logs("low", 7.0, reduce_fx="min")
    logs("avg", 1.5, reduce_fx="avg")
    assert logs.aggregates() == {
        "loss": ("mean", 2.0 * 4 + 1.0 * 2, 6, True, None),  # sum of value * batch size, summed sizes
        "seen": ("sum", 7.0, 8, False, False),
        "top": ("max", -5.0, 8, False, None),  # all negative: the start is -inf, not 0
        "low": ("min", 5.0, 8, False, None),  # all positive: the start is +inf, not 0
        "avg": ("mean", 1.5 * 4, 4, False, None),
    }
    logs.clear()
    assert logs.aggregates() == {}


def test_round_logs_refuse_what_cannot_be_merged_naming_the_call():
    logs = RoundLogs()
    logs.batch = torch.zeros(3, 2)
    with pytest.raises(ValueError) as err:
        logs("loss", 1.0, reduce_fx="median")
    assert str(err.value) == "self.log('loss', reduce_fx='median'): use 'mean', 'sum', 'max' or 'min'"
    with pytest.raises(ValueError) as err:
        logs("acc", torch.ones(2))
    assert str(err.value) == "self.log('acc', ...) needs a scalar, got a tensor of shape (2,)"
    with pytest.raises(TypeError) as err:
        logs("m", {"value": 1.0})
    assert str(err.value) == (
        "self.log('m', <dict>) in training_step: FedHetDDPStrategy aggregates logged values over each round across "
        "processes, so it needs a number or a scalar tensor (log the metric's value, e.g. a torchmetrics.functional "
        "result, not a Metric object)")
    with pytest.raises(ValueError) as err:  # a callable without a __name__
        logs("loss", 1.0, reduce_fx=functools.partial(torch.mean))
    assert str(err.value).startswith("self.log('loss', reduce_fx=functools.partial(")
    logs("loss", 1.0)
    with pytest.raises(ValueError) as err:
        logs("loss", 1.0, reduce_fx="sum")
    assert str(err.value) == "self.log('loss') was called with reduce_fx 'mean' and 'sum' in a round"


def test_combine_logs_merges_processes_like_one_process():
    rank0 = {"loss": ("mean", 6.0, 3, True, None), "seen": ("sum", 2.0, 3, False, False),
             "top": ("max", -4.0, 3, False, None), "low": ("min", 2.0, 3, False, None)}
    rank1 = {"loss": ("mean", 10.0, 2, False, True), "seen": ("sum", 5.0, 2, True, True),
             "top": ("max", -1.0, 2, False, None), "low": ("min", 3.0, 2, False, None),
             "empty": ("mean", 0.0, 0, False, None)}
    combined = combine_logs([rank0, rank1])
    assert list(combined) == ["empty", "loss", "low", "seen", "top"]  # sorted: the same order on every process
    assert combined["loss"] == (16.0 / 5, 5, "mean", True, None)  # flags of the first process that logged it
    assert combined["seen"] == (7.0, 5, "sum", False, False)
    assert combined["top"] == (-1.0, 5, "max", False, None)
    assert combined["low"] == (2.0, 5, "min", False, None)
    value, count, *rest = combined["empty"]
    assert math.isnan(value) and count == 0 and rest == ["mean", False, None]
    # the other rank order gives the same values
    swapped = combine_logs([rank1, rank0])
    assert {k: v[:3] for k, v in swapped.items() if k != "empty"} == {
        k: v[:3] for k, v in combined.items() if k != "empty"}


def test_log_reductions_by_name_or_function_and_a_refusal_naming_the_call():
    names = [log_reduction("loss", r) for r in ("mean", "avg", "sum", "max", "min")]
    assert names == ["mean", "mean", "sum", "max", "min"] and log_reduction("loss") == "mean"
    assert [log_reduction("loss", f) for f in (torch.mean, torch.sum, torch.max, torch.min)] == [
        "mean", "sum", "max", "min"]
    with pytest.raises(ValueError) as err:
        log_reduction("loss", "median")
    assert str(err.value) == "self.log('loss', reduce_fx='median'): use 'mean', 'sum', 'max' or 'min'"
    values = torch.tensor([1.0, 4.0, 2.0])
    reduced = [float(reduce_logged(values, r)) for r in ("mean", "sum", "max", "min")]
    assert reduced == [pytest.approx(7 / 3), 7.0, 4.0, 1.0]


class _LogRecorder:
    """Stands in for the LightningModule's ``log``: records each call, or refuses the names in ``refuse`` the way
    Lightning refuses ``self.log`` in a hook where it allows no logging."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, torch.Tensor, dict]] = []

    def log(self, name, value, **kwargs) -> None:
        if name in self.refuse:
            raise MisconfigurationException("You can't `self.log()` in `on_train_end`")
        self.calls.append((name, value, kwargs))


def test_the_merged_round_metrics_are_logged_once_per_round_where_asked_and_a_refusal_is_said():
    # each merged value is logged once for the round (an epoch value, never a step value), shown where the first
    # process's self.log asked; a metric Lightning refuses is skipped with a warning naming it and the reason, and
    # the others are still logged
    engine = ShardedSequentialEngine(SimpleNamespace())
    engine.module = _LogRecorder(refuse=("top",))
    with pytest.warns(UserWarning) as record:
        engine._emit_logs({"loss": (1.75, 8, "mean", True, None), "top": (7.0, 3, "max", False, False),
                           "seen": (5.0, 0, "sum", False, True)})
    assert [str(w.message) for w in record] == [
        "round metric 'top' not logged: You can't `self.log()` in `on_train_end`"]
    assert [(name, float(value)) for name, value, _ in engine.module.calls] == [("loss", 1.75), ("seen", 5.0)]
    shown = [(kw["prog_bar"], kw["logger"], kw["on_step"], kw["on_epoch"]) for _, _, kw in engine.module.calls]
    assert shown == [(True, None, False, True), (False, True, False, True)]


class _Indexed(TinyClassifier):
    """Records the batch_idx Lightning gives each step."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_indices: list = []

    def training_step(self, batch, batch_idx):
        self.batch_indices.append(batch_idx)
        return super().training_step(batch, batch_idx)


def _sequential_fit(model, rounds: int, **options) -> FedHetStrategy:
    data = equal_clients(3)
    strategy = FedHetStrategy(seed=1, engine="sequential", **options)
    quiet_trainer(strategy=strategy, max_epochs=rounds, limit_val_batches=0).fit(model, datamodule=data)
    return strategy


def test_rounds_of_no_step_and_of_one_step():
    # round 0: every client available, one local step each -> 3 steps; then one client of one step, then nobody
    trace = torch.tensor([[1, 1, 1], [0, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    model = _Indexed()
    strategy = _sequential_fit(model, 4, participation=Trace(trace), local_steps=1)
    history = strategy.history
    assert [h["received"].tolist() for h in history] == [[0, 1, 2], [1], [], [0]]
    assert all(h["complete"] for h in history)  # a round nobody trains in is closed as a whole round
    assert model.batch_indices == [0, 1, 2, 0, 0]  # Lightning's index inside each round, passed on as it is
    assert strategy.server.next_round == 4


@pytest.mark.without_compiler  # constructs engines, compiles nothing: mutation testing runs it
def test_engines_refuse_compile_where_unsupported():
    with pytest.raises(ValueError) as err:
        SequentialEngine(compile=True)
    assert str(err.value) == "compile=True is not supported by engine='sequential'; use engine='vmap'"
    assert VmapEngine(compile=True).compile is True


def test_a_rule_that_sends_a_config_needs_configure_client():
    class Rule:
        pass

    apply_client_config(TinyClassifier(), Rule(), {})  # nothing to send: nothing asked of the module
    with pytest.raises(TypeError) as err:
        apply_client_config(TinyClassifier(), Rule(), {"exit": 1, "depth": 2})
    assert str(err.value) == (
        "Rule sends ['depth', 'exit'] to each client: the LightningModule must define configure_client(**config) "
        "(EarlyExitClassifier does)")
    seen = []
    module = TinyClassifier()
    module.configure_client = lambda **config: seen.append(config)
    apply_client_config(module, Rule(), {"exit": 1})
    assert seen == [{"exit": 1}]


def test_a_padding_step_says_what_it_is():
    assert repr(PADDING) == "PADDING"


class RecordsUpdates(FedAvg):
    """FedAvg that records each arriving client's loss and the size of its update."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[float, float]] = {}

    def add(self, client, delta, info) -> None:
        self.seen[client] = (info.loss, float(delta.abs().sum()))
        super().add(client, delta, info)


class SkipsClientOne(TinyClassifier):
    """Client 1's training_step returns None at every step (Lightning then skips its optimizer step)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.strategy.server.current_client == 1:
            return None
        return super().training_step(batch, batch_idx)


def test_a_client_whose_every_step_returns_none_arrives_with_a_nan_loss_and_no_change():
    # the sequential engine hands the rule each client's mean training loss; a client that never returned a loss
    # has none (nan, not 0 and not an error), and its update is zero: it took no optimizer step
    rule = RecordsUpdates()
    strategy = FedHetStrategy(algorithm=rule, local_steps=2, seed=0, engine="sequential")
    quiet_trainer(strategy=strategy, max_epochs=1).fit(SkipsClientOne(), datamodule=equal_clients(3))
    assert sorted(rule.seen) == [0, 1, 2]
    loss, change = rule.seen[1]
    assert math.isnan(loss) and change == 0.0
    assert all(np.isfinite(rule.seen[c][0]) and rule.seen[c][0] > 0 and rule.seen[c][1] > 0 for c in (0, 2))
