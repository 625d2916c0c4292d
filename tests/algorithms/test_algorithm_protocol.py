"""The Algorithm protocol every server rule shares: setup with client sizes, the no-op hooks, selects_clients."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_fedhet.algorithms import Algorithm, FedAvg, FedStale
from tests.algorithms.rules import NUM_CLIENTS, RULE_CLASSES, RULES, rule_class


def test_the_shared_list_holds_every_rule_of_the_package():
    # a rule exported by lightning_fedhet.algorithms without an entry in tests/algorithms/rules.py fails here
    missing = set(RULE_CLASSES) - {rule_class(name) for name in RULES}
    assert not missing, sorted(cls.__name__ for cls in missing)
    assert len(RULE_CLASSES) >= 17


@pytest.mark.parametrize("name", sorted(RULES))
def test_setup_takes_and_stores_client_sizes(name):
    algo = RULES[name]()
    params = inspect.signature(type(algo).setup).parameters
    assert list(params)[:5] == ["self", "num_clients", "init_params", "client_weights", "client_sizes"]
    sizes = torch.tensor([5, 0, 3, 2, 2, 9])
    algo.setup(NUM_CLIENTS, torch.zeros(3), client_sizes=sizes)
    assert algo.client_sizes.dtype == torch.int64 and algo.client_sizes.tolist() == [5, 0, 3, 2, 2, 9]
    sizes[0] = 100  # stored as a copy
    assert int(algo.client_sizes[0]) == 5
    other = RULES[name]()
    other.setup(NUM_CLIENTS, torch.zeros(3))
    assert other.client_sizes is None


@pytest.mark.parametrize(
    "sizes, match",
    [
        (torch.tensor([1, 2]), "client_sizes must have num_clients=3 entries, got 2"),
        (torch.tensor([1, -2, 3]), r"client_sizes must be >= 0"),
        (torch.tensor([1.0, 2.5, 3.0]), "client_sizes must be whole numbers"),
        (torch.tensor([True, False, True]), "client_sizes must be integers"),
    ],
)
def test_setup_rejects_bad_client_sizes(sizes, match):
    with pytest.raises(ValueError, match=match):
        FedAvg().setup(3, torch.zeros(2), client_sizes=sizes)
    # whole numbers given as floats are accepted
    algo = FedAvg()
    algo.setup(3, torch.zeros(2), client_sizes=torch.tensor([1.0, 2.0, 3.0]))
    assert algo.client_sizes.tolist() == [1, 2, 3]


def test_default_hooks_are_no_ops():
    algo = FedAvg()
    algo.setup(3, torch.tensor([1.0, 2.0]))
    before = algo.state_dict()
    assert algo.observe_system(0, success_probs=torch.ones(3), local_steps=torch.ones(3, dtype=torch.int64)) is None
    assert algo.observe_system(1) is None
    assert algo.wants_probe_losses() is False
    assert algo.observe_losses(0, torch.tensor([0.5, float("nan"), 1.0], dtype=torch.float64)) is None
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9, weight_decay=1e-4)
    assert algo.check_client_solver(opt, "persist") is None
    assert algo.client_config(0) == {}
    assert algo.memory_bytes == 0
    after = algo.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in ("params", "client_weights"))
    # observe_system takes its oracle by keyword only
    with pytest.raises(TypeError):
        algo.observe_system(0, torch.ones(3))


@pytest.mark.parametrize("name", sorted(RULES))
def test_selects_clients_flag_says_whether_the_rule_has_its_own_select(name):
    # the planner refuses selection=UniformSample(k) for a rule that selects itself (one owner per decision)
    assert Algorithm.selects_clients is False
    assert RULES[name]().selects_clients is (rule_class(name).select is not Algorithm.select)


STALE_MEMORY = ("FedVARP", "MIFA", "FedStale")


@pytest.mark.parametrize("name", sorted(RULES))
def test_memory_bytes(name):
    # N x d x element size (fp32 default) for the stale-memory rules: 6 x 3 x 4 = 72 bytes; none for the others
    algo = RULES[name]()
    algo.setup(NUM_CLIENTS, torch.zeros(3))
    assert algo.memory_bytes == (72 if name in STALE_MEMORY else 0)
    algo = FedStale(beta=0.0)
    algo.setup(NUM_CLIENTS, torch.zeros(3))
    assert algo.memory_bytes == 0
