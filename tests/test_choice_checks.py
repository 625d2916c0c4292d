"""Every option that takes one of a few names refuses anything else with a ``ValueError`` naming the option and its
names, arrays and unhashable values included.

``value not in ("a", "b")`` compares with ``==``: for a numpy array that is elementwise, so an empty or longer array
raised numpy's "The truth value of an array ... is ambiguous" (naming nothing) and ``array(['a'])`` was let in; and
``value not in {"a": ...}`` hashes ``value``, so a list raised "unhashable type". Each option now goes through
``_checks.check_choice``; the message is written out here by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet import FedHetDDPStrategy
from lightning_fedhet._checks import check_choice
from lightning_fedhet.algorithms import OS, CAFedAvg, FedACS
from lightning_fedhet.algorithms.fednova import check_optimizer_matches
from lightning_fedhet.asynchronous import FedAST, allocation_scores
from lightning_fedhet.asynchronous.time_to_target import TimeToTarget
from lightning_fedhet.cis import CISTopology
from lightning_fedhet.data.datasets import torchvision_dataset
from lightning_fedhet.distributed import place_clients

#: inputs a config file or a caller can give that are none of the names (the first one is the property test's draw)
BAD = [np.empty((1, 0)), np.array([1.0, 2.0]), np.array(["a", "b"]), torch.tensor([1.0, 2.0]), None, 3, ["x"], {}]
BAD_IDS = ["empty-array", "array", "str-array", "tensor", "none", "int", "list", "dict"]

#: (option, a call with the option set to the value, its names as the message writes them)
SITES = [
    ("tree", lambda v: CISTopology.preset(tree=v), "('17-node', '7-node')"),
    ("serving", lambda v: CISTopology.preset(serving=v),
     "('80-15-5', '60-30-10', '45-35-20', '33-33-33', '20-35-45', '10-30-60', '5-15-80')"),
    ("partition", lambda v: CISTopology.preset(partition=v), "('biased', 'equal', 'highly-biased')"),
    ("option", lambda v: FedAST(option=v), "('S', 'D')"),
    ("allocation", lambda v: FedAST(allocation=v), "('paper', 'code')"),
    ("rule", lambda v: allocation_scores({"a": 1.0}, v, 1.0, {"a": 1.0}, {"a": 1}), "('paper', 'code')"),
    ("mode", lambda v: TimeToTarget({"a": 0.5}, mode=v), "('max', 'min')"),
    ("placement", lambda v: place_clients(None, 2, v), "('balanced', 'by_client')"),
    ("placement", lambda v: FedHetDDPStrategy(placement=v), "('balanced', 'by_client') or None"),
    ("optimizer_state", lambda v: check_optimizer_matches("FedNova", None, v, 0.0), "('reset', 'persist')"),
    ("calibrate", lambda v: FedACS(K=1, calibrate=v), "('client', 'server') or False, True (= 'client')"),
    ("calibrate", lambda v: CAFedAvg(K=1, calibrate=v), "('client', 'server') or False, True (= 'client')"),
    ("unavailable", lambda v: OS(K=1, unavailable=v), "('renormalize', 'drop')"),
    ("name", lambda v: torchvision_dataset(v, "/nonexistent"),
     "('cifar10', 'cifar100', 'fashion_mnist', 'mnist', 'svhn')"),
]


@pytest.mark.parametrize("value", BAD, ids=BAD_IDS)
@pytest.mark.parametrize("name, call, names", SITES, ids=[f"{s[0]}-{i}" for i, s in enumerate(SITES)])
def test_an_option_refuses_what_is_not_one_of_its_names(name, call, names, value):
    if value is None and ("None" in names or name == "calibrate"):
        pytest.skip("None is accepted here (FedHetDDPStrategy's default placement; calibrate=None is False)")
    with pytest.raises(ValueError) as err:
        call(value)
    assert str(err.value) == f"{name} must be one of {names}, got {value!r}"


def test_check_choice_compares_only_values_of_a_choices_type():
    assert check_choice("a", "x", ("a", "b")) == "a"
    assert check_choice(None, "x", (None, "a")) is None
    for value in (np.array("a"), np.array(["a"]), np.str_("a"), 1, True):
        with pytest.raises(ValueError, match=r"^x must be one of \('a', 1.0\), got "):
            check_choice(value, "x", ("a", 1.0))
    with pytest.raises(ValueError, match=r"^x must be one of \('a',\) or None, got 'b'$"):
        check_choice("b", "x", ("a",), alternatives="None")
