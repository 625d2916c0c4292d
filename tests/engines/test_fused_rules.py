"""The fused optimizer rules of ``compile=True`` by hand: which optimizers the fused path takes (and which it
hands to ``torch.optim``), the per-step scalars, one update step in closed form, and cohorts whose modules
freeze a first parameter, return a dict, draw dropout or keep BatchNorm statistics.

``torch.compile`` is replaced by the identity where a cohort runs: the fused step runs as the plain function it
compiles (so mutation runs can run these tests, see docs/testing.md).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedhet.engines import _compiled
from lightning_fedhet.engines._compiled import SCALARS, UpdateRule, step_scalars, update_rules
from tests.engines.test_vmap_compile import (
    STEPS,
    Wrapped,
    batches,
    logistic,
    per_client_reference,
    per_client_state,
    run_cohort,
)

pytestmark = pytest.mark.without_compiler


def rules_of(optimizer: torch.optim.Optimizer, net: nn.Module):
    return update_rules(optimizer, {id(p): name for name, p in net.named_parameters()})


# ---------------------------------------------------------------------------------------------- which rules
def test_sgd_and_adam_settings_are_read_into_their_rules():
    net = nn.Linear(2, 1)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, maximize=True)
    rule = UpdateRule("sgd", 0, weight_decay=0.01, momentum=0.9, nesterov=True, maximize=True)
    assert rules_of(sgd, net) == {"weight": rule, "bias": rule}
    assert rules_of(torch.optim.SGD(net.parameters(), lr=0.1), net)["bias"] == UpdateRule("sgd", 0)
    adam = torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, maximize=True)
    assert rules_of(adam, net)["weight"] == UpdateRule("adam", 0, weight_decay=0.1, maximize=True, beta1=0.8,
                                                       beta2=0.99, eps=1e-6, decoupled=False)
    # AdamW, and Adam with decoupled_weight_decay=True, decay the parameter itself
    assert rules_of(torch.optim.AdamW(net.parameters(), lr=0.01), net)["bias"].decoupled is True
    decoupled = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)
    assert rules_of(decoupled, net)["bias"] == UpdateRule("adam", 0, weight_decay=0.1, decoupled=True)


def test_groups_get_their_slots_and_frozen_parameters_no_rule():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    net[0].bias.requires_grad_(False)
    sgd = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[1].parameters(), "momentum": 0.5}], lr=0.1)
    rules = rules_of(sgd, net)
    assert sorted(rules) == ["0.weight", "1.bias", "1.weight"]
    assert rules["0.weight"] == UpdateRule("sgd", 0) and rules["1.weight"] == UpdateRule("sgd", 1, momentum=0.5)


def test_what_the_fused_path_does_not_cover_goes_to_torch_optim():
    net = nn.Linear(2, 1)
    assert rules_of(torch.optim.RMSprop(net.parameters(), lr=0.01), net) is None
    assert rules_of(torch.optim.Adam(net.parameters(), lr=0.01, amsgrad=True), net) is None
    assert rules_of(torch.optim.SGD(net.parameters(), lr=0.1, differentiable=True), net) is None
    # a hyper-parameter held in a tensor (it may change between steps; the fused graph bakes numbers in)
    for key, value in (("momentum", torch.tensor(0.9)), ("dampening", torch.tensor(0.1)),
                       ("weight_decay", torch.tensor(0.01))):
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        sgd.param_groups[0][key] = value
        assert rules_of(sgd, net) is None, key
    adam = torch.optim.Adam(net.parameters(), lr=0.01)
    adam.param_groups[0]["betas"] = torch.tensor([0.9, 0.999])
    assert rules_of(adam, net) is None


# ---------------------------------------------------------------------------------------------- scalars, one step
def test_step_scalars_by_hand():
    # SGD, dampening 0.3: (lr, 1 at the first step then 1 - dampening, unused)
    net = nn.Linear(2, 1)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, dampening=0.3)
    table = step_scalars(sgd, rules_of(sgd, net), 3)
    assert table.dtype == torch.float64 and table.shape == (3, SCALARS)
    torch.testing.assert_close(table, torch.tensor([[0.1, 1.0, 0.0], [0.1, 0.7, 0.0], [0.1, 0.7, 0.0]],
                                                   dtype=torch.float64), atol=1e-15, rtol=0)
    # Adam, lr 0.01, betas (0.8, 0.99), weight decay 0.1: (lr / (1 - 0.8^t), sqrt(1 - 0.99^t), 1 - lr wd)
    adam = torch.optim.Adam(net.parameters(), lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)
    table = step_scalars(adam, rules_of(adam, net), 2)
    expected = [[0.01 / 0.2, math.sqrt(0.01), 0.999], [0.01 / 0.36, math.sqrt(1 - 0.9801), 0.999]]
    torch.testing.assert_close(table, torch.tensor(expected, dtype=torch.float64), atol=1e-15, rtol=0)


def test_weight_decay_of_exactly_one_is_applied():
    # SGD: g = 0.5 + 1 * 2 = 2.5, p = 2 - 0.1 * 2.5 = 1.75
    p, grad = torch.tensor([2.0]), torch.tensor([0.5])
    s = torch.tensor([0.1, 1.0, 0.0])
    new, _ = _compiled._apply_rule(UpdateRule("sgd", 0, weight_decay=1.0), p, grad, (), s)
    torch.testing.assert_close(new, torch.tensor([1.75]))
    # Adam (coupled), first step: g = 2.5; m = 0.1 g, v = 0.001 g^2; step size lr / (1 - 0.9) = 0.1 and
    # sqrt(v) / sqrt(1 - 0.999) = g, so p = 2 - 0.1 * 0.25 / 2.5 = 1.99 (Adam's first step moves by lr)
    s = torch.tensor([0.1, math.sqrt(0.001), 1.0])
    state = (torch.zeros(1), torch.zeros(1))
    new, (m, v) = _compiled._apply_rule(UpdateRule("adam", 0, weight_decay=1.0), p, grad, state, s)
    torch.testing.assert_close(new, torch.tensor([1.99]))
    torch.testing.assert_close(m, torch.tensor([0.25]))
    torch.testing.assert_close(v, torch.tensor([0.00625]))


# ---------------------------------------------------------------------------------------------- cohorts
def fused_cohort(module, make, data, steps=STEPS):
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fall-back to eager would make these tests vacuous
        cohort, _ = run_cohort(module, make, data, steps, compile=True)
    assert cohort.optimizer is None  # the fused path ran (torch.optim takes over otherwise)
    return cohort


class ReturnsDict(Wrapped):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx), "extra": 1}


def test_a_training_step_returning_a_dict_trains_on_its_loss(identity_compile):
    make = lambda m: torch.optim.Adam(m.parameters(), lr=0.01)  # noqa: E731
    data = batches((6,))
    cohort = fused_cohort(ReturnsDict(logistic()), make, data)
    expected, expected_losses = per_client_reference(logistic(), make, data, STEPS)
    torch.testing.assert_close(cohort.flat_params(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(cohort.mean_losses(), expected_losses, atol=1e-6, rtol=0)


class Dropped(Wrapped):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(F.dropout(x, 0.5, training=True)), y)
        self.log("client_loss", loss)
        return loss


def test_dropout_draws_differently_per_client(identity_compile):
    # four clients on the same batches: with their own dropout masks they end apart (vmap randomness="different")
    torch.manual_seed(3)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    data = [(x.expand(4, 4, 6).clone(), y.expand(4, 4).clone()) for _ in range(3)]
    cohort = fused_cohort(Dropped(logistic()), lambda m: torch.optim.SGD(m.parameters(), lr=0.5), data,
                          np.array([3, 3, 3, 3]))
    params = cohort.flat_params()
    assert torch.isfinite(params).all() and not torch.allclose(params[0], params[1])
    # the same on the gradient-only path (RMSprop has no fused rule: torch.optim steps the stacked parameters)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        cohort, _ = run_cohort(Dropped(logistic()), lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01), data,
                               np.array([3, 3, 3, 3]), compile=True)
    assert cohort.optimizer is not None and cohort.compiled_entry.failed is None
    params = cohort.flat_params()
    assert torch.isfinite(params).all() and not torch.allclose(params[0], params[1])


def normed_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


def test_batchnorm_statistics_follow_each_clients_own_steps(identity_compile):
    # each client's running statistics after its own steps, and unchanged after its last step (finished rows must
    # not move: clients 1-3 stop early)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    data = batches((6,))
    cohort = fused_cohort(Wrapped(normed_net()), make, data)
    expected, _ = per_client_state(normed_net(), make, data, STEPS)
    torch.testing.assert_close(cohort.flat_state(), expected, atol=1e-5, rtol=0)
    assert cohort.int_state().flatten().tolist() == STEPS.tolist()  # num_batches_tracked: one per step taken


def test_the_log_collector_keeps_float32_values_and_where_each_is_shown():
    collector = _compiled.LogCollector()
    collector("acc", 0.5, True)  # a Python float, prog_bar given by position
    collector("loss", torch.tensor(2.0, dtype=torch.float64), logger=False)
    taken = collector.take()
    assert {k: (v.dtype, float(v)) for k, v in taken.items()} == {"acc": (torch.float32, 0.5),
                                                                  "loss": (torch.float32, 2.0)}
    assert collector.display == {"acc": {"prog_bar": True}, "loss": {"logger": False}}
    assert collector.take() == {} and collector.display == {"acc": {"prog_bar": True}, "loss": {"logger": False}}
