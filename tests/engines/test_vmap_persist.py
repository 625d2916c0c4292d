"""A vmap cohort that keeps each client's SGD momentum (``optimizer_state="persist"``), against the definition.

The reference is each client alone: a copy of the network, ``torch.optim.SGD`` with the client's kept momentum
buffers put into its state (none for a client that has not trained yet), ``STEPS[i]`` steps on its own
mini-batches, then torch's own state read back by position as the server keeps it. The cohort must give every
client's parameters and buffers, on its eager path, its fused path (``torch.compile`` replaced by the identity) and
when the fused step fails at the first or a later step and ``torch.optim`` takes over. Nothing is compiled.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedhet.engines import _compiled
from lightning_fedhet.engines.base import export_optimizer_state
from lightning_fedhet.engines.cohort import VmapCohort, VmapUnsupported, momentum_positions
from tests.engines.test_vmap_compile import STEPS, Wrapped, batches
from tests.engines.test_vmap_fallbacks import fails_on_call

pytestmark = pytest.mark.without_compiler

SGD = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)  # noqa: E731


def net(frozen_first: bool = False) -> nn.Module:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    module[0].weight.requires_grad_(not frozen_first)
    return module


def kept_states(module: nn.Module) -> list[list[dict] | None]:
    """Clients 0 and 2 hold buffers from an earlier round (every trained parameter's, keyed by its position among
    the optimizer's parameters); clients 1 and 3 have not trained yet."""
    gen = torch.Generator().manual_seed(5)
    params = list(module.parameters())
    own = [{i: {"momentum_buffer": torch.randn(p.shape, generator=gen)} for i, p in enumerate(params)
            if p.requires_grad}]
    other = [{i: {"momentum_buffer": torch.randn(p.shape, generator=gen)} for i, p in enumerate(params)
              if p.requires_grad}]
    return [own, None, other, None]


def each_client_alone(module: nn.Module, states, data) -> tuple[torch.Tensor, list[list[dict]]]:
    finals, exported = [], []
    for i, steps in enumerate(STEPS):
        local = copy.deepcopy(module)
        optimizer = SGD(local)
        params = list(local.parameters())
        for position, entry in (states[i][0] if states[i] else {}).items():
            optimizer.state[params[position]] = {"momentum_buffer": entry["momentum_buffer"].clone()}
        for k in range(steps):
            optimizer.zero_grad()
            F.cross_entropy(local(data[k][0][i]), data[k][1][i]).backward()
            optimizer.step()
        finals.append(torch.cat([p.detach().reshape(-1) for p in local.parameters()]))
        exported.append([export_optimizer_state(optimizer)])
    return torch.stack(finals), exported


def run(module: nn.Module, states, data, compile: bool) -> VmapCohort:
    wrapped = Wrapped(module)
    cohort = VmapCohort(wrapped, SGD(module), range(len(STEPS)), STEPS, compile=compile, optimizer_states=states)
    for k, batch in enumerate(data):
        cohort.step(batch, k)
    return cohort


def assert_like_each_client_alone(cohort: VmapCohort, module: nn.Module, states, data) -> None:
    expected, exported = each_client_alone(module, states, data)
    torch.testing.assert_close(cohort.flat_params(), expected, atol=1e-5, rtol=0)
    kept = cohort.client_optimizer_states()
    for client in range(len(STEPS)):
        assert kept[client][0].keys() == exported[client][0].keys()
        for position, entry in exported[client][0].items():
            assert entry.keys() == {"momentum_buffer"}
            torch.testing.assert_close(kept[client][0][position]["momentum_buffer"], entry["momentum_buffer"],
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("frozen_first", [False, True], ids=["all-trained", "frozen-first"])
@pytest.mark.parametrize("path", ["eager", "fused"])
def test_each_client_continues_from_its_own_buffer(path, frozen_first, identity_compile):
    # Slips caught: a kept buffer not read (a reset), read into the wrong row or position, a finished client's
    # buffer stepped on by the later lock-steps (client 2 takes 1 step of 5), buffers not handed back.
    module, data = net(frozen_first), batches((6,))
    states = kept_states(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fused path must not fall back silently
        cohort = run(module, states, data, compile=path == "fused")
    assert cohort.compiled == (path == "fused")
    assert_like_each_client_alone(cohort, module, states, data)


@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_fused_step_failing_hands_the_kept_buffers_to_torch_optim(failing_call, monkeypatch):
    # call 1: the fused step fails before any step was taken, so torch.optim must start from the kept buffers, not
    # from an empty state (slip: handing over only after a step); call 3: after two fused steps
    monkeypatch.setattr(_compiled.torch, "compile", fails_on_call(failing_call))
    module, data = net(), batches((6,))
    states = kept_states(module)
    with pytest.warns(RuntimeWarning, match="injected backend failure"):
        cohort = run(module, states, data, compile=True)
    assert not cohort.compiled
    assert_like_each_client_alone(cohort, module, states, data)


def test_a_cohort_of_new_clients_equals_fresh_optimizers():
    # zeros for every client: torch's first step buf = g, exactly (dampening 0)
    module, data = net(), batches((6,))
    states = [None] * len(STEPS)
    cohort = run(module, states, data, compile=False)
    assert_like_each_client_alone(cohort, module, states, data)


def test_momentum_positions_count_every_parameter_of_every_group_in_order():
    # positions as export_optimizer_state keys them: over all groups' parameters in order, frozen ones counted;
    # a group without momentum keeps no buffer
    module = net(frozen_first=True)  # 0: frozen weight, 1: bias, 2: weight, 3: bias
    w0, b0, w1, b1 = module.parameters()
    names = {id(w0): "0.weight", id(b0): "0.bias", id(w1): "2.weight", id(b1): "2.bias"}
    optimizer = torch.optim.SGD([{"params": [w0, b0], "momentum": 0.9}, {"params": [w1], "momentum": 0.0},
                                 {"params": [b1], "momentum": 0.5}], lr=0.1)
    assert momentum_positions(optimizer, names) == [(1, "0.bias"), (3, "2.bias")]


def test_persist_refusals_name_their_cause():
    module = net()
    with pytest.raises(VmapUnsupported, match=r"persist' with Adam: its state holds a step count per client"):
        VmapCohort(Wrapped(module), torch.optim.Adam(module.parameters()), [0], np.array([1]), optimizer_states=[None])
    damped = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(VmapUnsupported, match=r"persist' with SGD dampening=0.5"):
        VmapCohort(Wrapped(module), damped, [0], np.array([1]), optimizer_states=[None])
    # dampening matters only where there is momentum: plain SGD with a dampening value keeps no buffer, and persists
    VmapCohort(Wrapped(module), torch.optim.SGD(module.parameters(), lr=0.1, dampening=0.5), [0], np.array([1]),
               optimizer_states=[None])
    with pytest.raises(ValueError, match=r"optimizer_states must hold one entry per client \(2\), got 1"):
        VmapCohort(Wrapped(module), SGD(module), [0, 1], np.array([1, 1]), optimizer_states=[None])
    reset = r"^the cohort was built without optimizer_states \(optimizer_state='reset'\)$"
    with pytest.raises(RuntimeError, match=reset):
        VmapCohort(Wrapped(module), SGD(module), [0], np.array([1])).client_optimizer_states()
