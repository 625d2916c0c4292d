"""The compiled vmap cohort step against an independent per-client loop, and its fall-back when compiling fails.

The reference is the definition of local training: every client gets its own copy of the model and a fresh
``torch.optim`` optimizer and takes its own number of steps on its own mini-batches. The fused update rules are
checked against it for each supported optimizer configuration with ``torch.compile`` replaced by the identity
(fast); two tests run the real compiler (about 15 s and 25 s of compilation on a 2-core CPU).
"""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedhet.engines import _compiled
from lightning_fedhet.engines.vmap import VmapCohort, padded_size

#: tests that replace torch.compile by the identity or never compile: mutation testing can run them (mutmut's
#: trampolines cannot be compiled; its chunks deselect "compile" tests but these)
WITHOUT_COMPILER = pytest.mark.without_compiler

STEPS = np.array([5, 3, 1, 4])  # unequal local steps: clients 1-3 finish early and must not move after that


class Wrapped(pl.LightningModule):
    """A plain LightningModule around ``net``; logs its loss through ``self.log`` like a user's module would."""

    def __init__(self, net: nn.Module, make_optimizer=None) -> None:
        super().__init__()
        self.net = net
        self.make_optimizer = make_optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("client_loss", loss, prog_bar=True)
        return loss


class GraphBreak(Wrapped):
    """A training step that ``torch.compile(fullgraph=True)`` cannot capture (eagerly, graph_break is a no-op)."""

    def training_step(self, batch, batch_idx):
        torch._dynamo.graph_break()
        return super().training_step(batch, batch_idx)


def logistic(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(6, 3)


def tiny_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 3 * 3, 3)
    )  # fmt: skip


def batches(shape: tuple[int, ...], steps: int = 5, clients: int = 4, seed: int = 1) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(clients, 4, *shape, generator=gen), torch.randint(0, 3, (clients, 4), generator=gen))
        for _ in range(steps)
    ]


def per_client_reference(net: nn.Module, make_optimizer, data: list[tuple], steps: np.ndarray):
    """Each client alone: a copy of ``net``, a fresh optimizer, ``steps[i]`` steps on its own batches."""
    finals, mean_losses = [], []
    for i, k_i in enumerate(steps):
        local = copy.deepcopy(net)
        opt = make_optimizer(local)
        losses = []
        for k in range(k_i):
            x, y = data[k][0][i], data[k][1][i]
            opt.zero_grad()
            loss = F.cross_entropy(local(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        finals.append(torch.cat([p.detach().reshape(-1) for p in local.parameters()]))
        mean_losses.append(np.mean(losses))
    return torch.stack(finals), torch.tensor(mean_losses, dtype=torch.float32)


def per_client_state(net: nn.Module, make_optimizer, data: list[tuple], steps: np.ndarray):
    """Each client alone, for a ``Sequential`` whose second layer is BatchNorm: its parameters then BatchNorm's
    running mean and variance ``[C, d]``, and its ``num_batches_tracked`` ``[C]``."""
    finals, tracked = [], []
    for i, k_i in enumerate(steps):
        local = copy.deepcopy(net)
        opt = make_optimizer(local)
        for k in range(k_i):
            opt.zero_grad()
            F.cross_entropy(local(data[k][0][i]), data[k][1][i]).backward()
            opt.step()
        bn = local[1]
        finals.append(torch.cat([*(p.detach().reshape(-1) for p in local.parameters()), bn.running_mean,
                                 bn.running_var]))
        tracked.append(int(bn.num_batches_tracked))
    return torch.stack(finals), tracked


def run_cohort(module: Wrapped, make_optimizer, data: list[tuple], steps: np.ndarray, compile, gathered_rows=None):
    """``gathered_rows``: hand the cohort batches of that many rows, the rows after the clients' repeating row 0 (as
    the lock-step scheduler gathers a compiled cohort's padding rows)."""
    cohort = VmapCohort(module, make_optimizer(module.net), range(len(steps)), steps, compile=compile)
    logged = []
    for k, batch in enumerate(data):
        if gathered_rows is not None:
            batch = tuple(torch.cat([t, t[:1].repeat(gathered_rows - len(t), *([1] * (t.dim() - 1)))]) for t in batch)
        _, values = cohort.step(batch, k)
        logged.append(values["client_loss"])
    return cohort, logged


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd-momentum-wd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd-dampening": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.8, dampening=0.3),
    "sgd-nesterov-maximize": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, maximize=True
    ),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam-wd": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.99), weight_decay=0.1),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1, eps=1e-6),
    "two-groups": lambda m: torch.optim.SGD(
        [{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias], "lr": 0.3}], lr=0.1, momentum=0.5
    ),
    "rmsprop (gradient-only path)": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5),
}


class Indexed(Wrapped):
    """Records the batch_idx each (traced) step is given; the identity "compile" runs it as plain Python."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.batch_indices: list = []

    def training_step(self, batch, batch_idx):
        self.batch_indices.append(batch_idx)
        return super().training_step(batch, batch_idx)


@WITHOUT_COMPILER
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fused_update_equals_per_client_torch_optim(name, identity_compile):
    make = OPTIMIZERS[name]
    data = batches((6,))
    module = Indexed(logistic())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to eager would make this test vacuous
        cohort, _ = run_cohort(module, make, data, STEPS, compile=True)
    assert cohort.compiled_entry is not None and cohort.compiled_entry.failed is None
    # the fused path ran (no torch.optim optimizer) for every optimizer it covers: SGD, Adam, AdamW
    assert (cohort.optimizer is None) == (name != "rmsprop (gradient-only path)")
    assert module.batch_indices == [0, 1, 2, 3, 4]  # local step k is the k-th batch of the round
    expected, expected_losses = per_client_reference(logistic(), make, data, STEPS)
    torch.testing.assert_close(cohort.flat_params(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(cohort.mean_losses(), expected_losses, atol=1e-6, rtol=0)


@WITHOUT_COMPILER
@pytest.mark.parametrize("compile", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize(("frozen", "columns"), [("weight", slice(0, 18)), ("bias", slice(18, 21))],
                         ids=["frozen-first", "frozen-last"])
def test_a_frozen_parameter_stays_put_and_the_others_train_like_torch_optim(frozen, columns, compile,
                                                                            identity_compile):
    # on the fused step and on the eager path, a frozen parameter first or last in the module: it keeps its value,
    # and the others match a per-client torch.optim loop (slips: a frozen parameter moved; `continue` -> `break`
    # after a frozen first parameter, leaving the later ones untrained)
    net = logistic()
    getattr(net, frozen).requires_grad_(False)
    make = OPTIMIZERS["sgd-momentum-wd"]
    data = batches((6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to eager would make the fused case vacuous
        cohort, _ = run_cohort(Wrapped(net), make, data, STEPS, compile=compile)
    assert (cohort.optimizer is None) == compile  # the fused path ran, or torch.optim steps the stacked parameters
    expected, _ = per_client_reference(net, make, data, STEPS)
    torch.testing.assert_close(cohort.flat_params(), expected, atol=1e-6, rtol=0)
    kept = getattr(net, frozen).detach().reshape(1, -1).expand(4, -1)
    torch.testing.assert_close(cohort.flat_params()[:, columns], kept)


@pytest.mark.parametrize(
    ("make_net", "shape", "optimizer"),
    [(logistic, (6,), "sgd-momentum-wd"), (tiny_cnn, (1, 6, 6), "adamw")],
    ids=["logistic-sgd-momentum", "cnn-adamw"],
)
def test_compiled_cohort_equals_uncompiled_and_per_client_loop(make_net, shape, optimizer):
    make = OPTIMIZERS[optimizer]
    data = batches(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to eager would make this test vacuous
        compiled, logged = run_cohort(Wrapped(make_net()), make, data, STEPS, compile=True)
    eager, eager_logged = run_cohort(Wrapped(make_net()), make, data, STEPS, compile=False)
    expected, expected_losses = per_client_reference(make_net(), make, data, STEPS)
    torch.testing.assert_close(compiled.flat_params(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled.flat_params(), eager.flat_params(), atol=1e-5, rtol=0)
    torch.testing.assert_close(compiled.mean_losses(), expected_losses, atol=1e-5, rtol=0)
    for got, want in zip(logged, eager_logged):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # where the value is shown survives compilation (recorded while tracing, without a recompilation)
    assert compiled.log_display == eager.log_display == {"client_loss": {"prog_bar": True}}


def test_compile_failure_falls_back_with_one_warning_naming_the_cause():
    make = OPTIMIZERS["sgd-momentum-wd"]
    data = batches((6,))
    module = GraphBreak(logistic())
    with pytest.warns(RuntimeWarning, match=r"torch.compile could not compile.*graph_break|Unsupported") as record:
        first, _ = run_cohort(module, make, data, STEPS, compile=True)
    assert len([w for w in record if "torch.compile" in str(w.message)]) == 1
    expected, _ = per_client_reference(logistic(), make, data, STEPS)
    torch.testing.assert_close(first.flat_params(), expected, atol=1e-6, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the next round of the same module neither retries nor warns again
        second, _ = run_cohort(module, make, data, STEPS, compile=True)
    torch.testing.assert_close(second.flat_params(), expected, atol=1e-6, rtol=0)


@WITHOUT_COMPILER
@pytest.mark.parametrize("gathered_rows", [None, 8])
@pytest.mark.parametrize("optimizer", ["sgd-momentum-wd", "adam-wd"])
def test_failure_in_mid_round_hands_the_state_to_torch_optim(optimizer, gathered_rows, monkeypatch):
    """A recompilation that fails at local step 2: steps 0-1 ran fused, the rest eagerly from the same state; also
    with batches that carry the bucket's padding rows (4 clients: 8 rows), which the eager steps drop."""

    def fails_on_third_call(fn, **kwargs):
        calls = []

        def run(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected backend failure")
            return fn(*args)

        return run

    monkeypatch.setattr(_compiled.torch, "compile", fails_on_third_call)
    make = OPTIMIZERS[optimizer]
    data = batches((6,))
    cause = (r"^torch.compile could not compile the vmap cohort step \(RuntimeError: injected backend failure\); "
             r"running it uncompiled$")
    with pytest.warns(RuntimeWarning, match=cause):
        cohort, _ = run_cohort(Wrapped(logistic()), make, data, STEPS, compile=True, gathered_rows=gathered_rows)
    expected, expected_losses = per_client_reference(logistic(), make, data, STEPS)
    torch.testing.assert_close(cohort.flat_params(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(cohort.mean_losses(), expected_losses, atol=1e-6, rtol=0)


@WITHOUT_COMPILER
def test_uncompiled_cohort_gives_each_step_its_batch_index():
    # the eager path: local step k gets batch_idx k, as the compiled path (slip: the step's index not passed on)
    module = Indexed(logistic())
    run_cohort(module, OPTIMIZERS["sgd"], batches((6,)), STEPS, compile=False)
    assert module.batch_indices == [0, 1, 2, 3, 4]


@WITHOUT_COMPILER
def test_uncompiled_cohort_accumulates_mean_losses_per_client():
    make = OPTIMIZERS["sgd"]
    data = batches((6,))
    cohort, _ = run_cohort(Wrapped(logistic()), make, data, STEPS, compile=False)
    _, expected_losses = per_client_reference(logistic(), make, data, STEPS)
    torch.testing.assert_close(cohort.mean_losses(), expected_losses, atol=1e-6, rtol=0)


@WITHOUT_COMPILER
@pytest.mark.parametrize("bad", ["fast", 1, None])
def test_compile_argument_is_validated(bad):
    module = Wrapped(logistic())
    with pytest.raises(ValueError, match="compile must be False, True or one of"):
        VmapCohort(module, OPTIMIZERS["sgd"](module.net), [0, 1], np.array([1, 1]), compile=bad)


@WITHOUT_COMPILER
@pytest.mark.parametrize(
    ("size", "bucket"), [(1, 8), (4, 8), (8, 8), (9, 16), (38, 40), (64, 64), (65, 72), (130, 144), (1000, 1024)]
)
def test_compiled_cohorts_are_padded_to_few_bucket_sizes(size, bucket):
    # multiples of 8 up to 64, then multiples of 2**(bit_length - 4): at most 12.5 % padding above 64
    assert padded_size(size) == bucket


class CountsCalls(Wrapped):
    """A training step that changes a plain Python attribute: a constant to torch.compile, new at every call."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__(net)
        self.counter = 0

    def training_step(self, batch, batch_idx):
        self.counter += 1
        return super().training_step(batch, batch_idx)


def test_a_step_that_keeps_recompiling_falls_back_once_naming_the_attribute():
    # Each call sees a new self.counter, so each would compile a new graph (64 times before the guard existed). After
    # RECOMPILE_GUARD_LIMIT recompilations the cohort runs eagerly, warns once naming the attribute, and still gives
    # each client's own training (the counter does not enter the loss). Slip caught: a guard that never triggers
    # (compiles grow with the steps) or one that names no cause.
    make = OPTIMIZERS["sgd-momentum-wd"]
    data = batches((6,), steps=8)
    steps = np.array([8, 6, 3, 7])
    module = CountsCalls(logistic())
    with pytest.warns(RuntimeWarning, match=r"kept recompiling.*training_step changes self\.counter") as record:
        cohort, _ = run_cohort(module, make, data, steps, compile=True)
    assert len([w for w in record if "recompiling" in str(w.message)]) == 1
    entry = cohort.compiled_entry
    recompiles = {str(reason).split(":", 1)[0] for reason in torch._dynamo.utils.guard_failures.get(entry.code, ())}
    assert len(recompiles) <= _compiled.RECOMPILE_GUARD_LIMIT  # compile ids of the graphs that were replaced
    assert module.counter == 8  # every step ran
    expected, _ = per_client_reference(logistic(), make, data, steps)
    torch.testing.assert_close(cohort.flat_params(), expected, atol=1e-5, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a later round neither compiles again nor warns again
        again, _ = run_cohort(module, make, data, steps, compile=True)
    assert not again.compiled
