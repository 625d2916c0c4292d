"""The vmap cohort's compiled paths with BatchNorm buffers and padding rows, and what happens when compiling fails.

A compiled cohort of 4 clients is padded to 8 stacked rows (``padded_size``). When the compiled step fails in the
middle of a round, the cohort drops its padding rows, hands the fused step's parameters and optimizer state to
``torch.optim`` and goes on eagerly; the gradient-only path (optimizers with no fused rule, here RMSprop) falls back
to the eager gradient the same way. Each case is checked against the definition of local training: every client its
own copy of the model and a fresh optimizer, ``STEPS[i]`` steps on its own mini-batches, BatchNorm statistics
included. ``torch.compile`` is replaced by the identity, or by a wrapper that fails on one call, so these tests
compile nothing (mutation runs can run them, see docs/testing.md).
"""

from __future__ import annotations

import re
import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fedhet.engines import _compiled
from lightning_fedhet.engines._compile_policy import warn_compile_failed
from lightning_fedhet.engines.cohort import VmapCohort, VmapUnsupported, check_vmap_support
from tests.engines.test_vmap_compile import STEPS, Wrapped, batches, logistic, per_client_state, run_cohort
from tests.helpers import error_text

pytestmark = pytest.mark.without_compiler

SGD_MOMENTUM = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)  # noqa: E731
RMSPROP = lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5)  # noqa: E731  (no fused rule)
INJECTED = (r"^torch.compile could not compile the vmap cohort step \(RuntimeError: injected backend failure\); "
            r"running it uncompiled$")


def normed_net(frozen_first: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # no bias before BatchNorm: its gradient is zero up to rounding, which RMSprop's g / (sqrt(v) + eps) would
    # amplify into noise that differs between a stacked and a per-client computation
    net = nn.Sequential(nn.Linear(6, 4, bias=False), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    net[0].weight.requires_grad_(not frozen_first)
    return net


def fails_on_call(number: int):
    """A stand-in for torch.compile whose compiled function raises on its ``number``-th call (1-based)."""

    def compile(fn, **kwargs):
        calls = []

        def run(*args):
            calls.append(1)
            if len(calls) == number:
                raise RuntimeError("injected backend failure")
            return fn(*args)

        return run

    return compile


def assert_like_each_client_alone(cohort: VmapCohort, net: nn.Module, make, data) -> None:
    expected, tracked = per_client_state(net, make, data, STEPS)
    torch.testing.assert_close(cohort.flat_state(), expected, atol=1e-5, rtol=0)
    assert cohort.int_state().flatten().tolist() == tracked == STEPS.tolist()


def test_the_gradient_only_path_keeps_each_clients_batchnorm_statistics(identity_compile):
    # RMSprop has no fused rule: the compiled gradient runs on 8 padded rows and torch.optim steps the 4 real ones;
    # a finished client's statistics must stay where its last step left them (slip: the step not told which rows
    # are active)
    data = batches((6,))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fall-back to the eager gradient would be vacuous
        cohort, _ = run_cohort(Wrapped(normed_net()), RMSPROP, data, STEPS, compile=True)
    assert cohort.optimizer is not None and cohort.compiled_entry.failed is None and cohort.compiled
    assert_like_each_client_alone(cohort, normed_net(), RMSPROP, data)


def test_a_gradient_only_step_failing_in_mid_round_goes_on_eagerly_with_one_warning(monkeypatch):
    # steps 0-1 take the compiled gradient on padded rows, step 2 fails: the padding rows (BatchNorm statistics
    # included) are dropped, the same round goes on with the eager gradient, the failure is recorded once
    monkeypatch.setattr(_compiled.torch, "compile", fails_on_call(3))
    data = batches((6,))
    with pytest.warns(RuntimeWarning, match=INJECTED) as record:
        cohort, _ = run_cohort(Wrapped(normed_net()), RMSPROP, data, STEPS, compile=True)
    assert len(record) == 1
    assert not cohort.compiled and cohort.compiled_entry.failed == "RuntimeError: injected backend failure"
    assert cohort.flat_state().shape == (4, 6 * 4 + 4 + 4 + 4 * 3 + 3 + 4 + 4)
    assert_like_each_client_alone(cohort, normed_net(), RMSPROP, data)


@pytest.mark.parametrize("frozen_first", [False, True], ids=["all-trained", "frozen-first"])
def test_a_fused_step_failing_in_mid_round_hands_every_trained_parameters_state_to_torch_optim(frozen_first,
                                                                                             monkeypatch):
    # the fused step runs steps 0-1 on 8 padded rows; step 2 fails. torch.optim must take over each trained
    # parameter's momentum (slip: stopping at a frozen first parameter, which has no state, leaves the later ones
    # without theirs) and the buffers without their padding rows
    monkeypatch.setattr(_compiled.torch, "compile", fails_on_call(3))
    data = batches((6,))
    with pytest.warns(RuntimeWarning, match=INJECTED):
        cohort, _ = run_cohort(Wrapped(normed_net(frozen_first)), SGD_MOMENTUM, data, STEPS, compile=True)
    assert cohort.optimizer is not None  # torch.optim took over
    assert_like_each_client_alone(cohort, normed_net(frozen_first), SGD_MOMENTUM, data)
    if frozen_first:
        torch.testing.assert_close(cohort.flat_params()[:, :24], normed_net()[0].weight.detach().reshape(1, -1)
                                   .expand(4, -1))


# ---------------------------------------------------------------------------------------------- texts
def test_the_failure_warning_names_the_type_and_first_line_of_the_cause_within_400_characters():
    def warned(err: Exception) -> str:
        entry = types.SimpleNamespace(failed=None)
        with pytest.warns(RuntimeWarning) as record:
            warn_compile_failed(entry, err)
        message = str(record[0].message)
        assert message == (f"torch.compile could not compile the vmap cohort step ({entry.failed}); "
                           "running it uncompiled")
        return entry.failed

    assert warned(ValueError("  first line\nsecond line ")) == "ValueError: first line"
    assert warned(RuntimeError()) == "RuntimeError: "  # an empty message: the type alone
    assert warned(RuntimeError("   ")) == "RuntimeError: "
    long = warned(KeyError("x" * 1000))  # KeyError quotes its argument
    assert len(long) == 400 and long == ("KeyError: '" + "x" * 1000)[:400]
    # recorded once: a second failure of the same entry neither overwrites the cause nor warns
    entry = types.SimpleNamespace(failed="RuntimeError: first")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_compile_failed(entry, ValueError("second"))
    assert entry.failed == "RuntimeError: first"


def test_batchnorm_with_a_cumulative_average_is_refused_with_the_reason():
    net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4, momentum=None))
    text = error_text(lambda: check_vmap_support(Wrapped(net), torch.optim.SGD(net.parameters(), lr=0.1)),
                      VmapUnsupported)
    assert text == (
        "engine='vmap' cannot run this: module 'net.1' (BatchNorm1d) has momentum=None (a cumulative moving average "
        "of its running statistics), whose step size is read per client as a Python float; give it a momentum. "
        "Use engine='sequential' instead."
    )


def test_starts_of_the_wrong_shape_are_refused_with_both_shapes():
    module = Wrapped(logistic())  # 21 parameters, no buffers
    text = error_text(lambda: VmapCohort(module, torch.optim.SGD(module.parameters(), lr=0.1), [0, 1, 2],
                                         np.array([1, 1, 1]), starts=torch.zeros(3, 20),
                                         int_starts=torch.zeros(3, 0, dtype=torch.int64)))
    assert re.fullmatch(re.escape("starts must have shape [3, d] for 3 clients, got (3, 20)"), text)
