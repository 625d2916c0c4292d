"""One weighting vocabulary (``lightning_fedhet.algorithms.weighting``): every rule's ``weighting=`` takes names of it,
and a name means the same arithmetic in every rule that takes it. Each case names the slip it catches."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, FedAvg, FedNova, FedStale, RoundContext
from lightning_fedhet.algorithms.weighting import NORMALISED, WEIGHTING_MEANINGS, raw_weight, weightings
from tests.algorithms.rules import RULE_CLASSES

#: the required arguments of the rules that take ``weighting=``
_REQUIRED = {"beta": 0.5}


def _accepted(rule: type) -> tuple[str, ...]:
    """The names ``rule(weighting=...)`` accepts, read from the error a name outside the vocabulary gets."""
    required = {name: _REQUIRED[name] for name, p in inspect.signature(rule).parameters.items()
                if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD}
    with pytest.raises(ValueError, match="weighting must be one of") as err:
        rule(weighting="uniform", **required)
    names = ast.literal_eval(str(err.value).split("one of ", 1)[1].split(", got", 1)[0])
    for name in names:
        rule(weighting=name, **required)
    return names


def test_every_rule_with_a_weighting_takes_names_of_the_one_vocabulary():
    # a rule with its own word for a meaning the vocabulary already names would be a second vocabulary
    rules = [rule for rule in RULE_CLASSES if "weighting" in inspect.signature(rule).parameters]
    assert {rule.__name__ for rule in rules} >= {"FedAvg", "FedStale", "FedVARP", "FedNova"}
    for rule in rules:
        accepted = _accepted(rule)
        assert set(accepted) <= set(WEIGHTING_MEANINGS), (rule.__name__, accepted)
    assert _accepted(FedAvg) == ("participating", "all", "samples", "known_p")
    assert _accepted(FedStale) == ("participating", "known_p")
    assert _accepted(FedNova) == ("participating", "samples")


def test_a_name_outside_the_vocabulary_cannot_be_declared():
    assert weightings("participating", "samples") == ("participating", "samples")
    with pytest.raises(ValueError, match=r"\['uniform'\] are not weightings of the vocabulary"):
        weightings("participating", "uniform")


def test_the_raw_weights_by_hand():
    assert raw_weight("participating", 0.25, 7) == 0.25
    assert raw_weight("all", 0.25, 7) == 0.25
    assert raw_weight("samples", 0.25, 7) == 7.0
    assert raw_weight("known_p", 0.25, 7, 0.5) == 0.5
    assert NORMALISED == ("participating", "samples")


_ALPHA = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
_SAMPLES = (10, 30, 20)
_DELTAS = {0: torch.tensor([1.0, -2.0]), 2: torch.tensor([4.0, 0.5])}  # client 1 did not arrive
_PROBS = torch.tensor([0.8, 0.5, 0.4])


def _one_round(rule) -> tuple[torch.Tensor, dict]:
    rule.setup(num_clients=3, init_params=torch.zeros(2), client_weights=_ALPHA)
    received = torch.tensor([True, False, True])
    ctx = RoundContext(0, 3, torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool), received,
                       participation_probs=_PROBS)
    rule.open_round(0, ctx)
    for client, delta in _DELTAS.items():
        rule.add(client, delta, ClientInfo(num_samples=_SAMPLES[client], local_steps=2))  # equal local work
    return rule.close_round(), rule.last_weights


@pytest.mark.parametrize(
    ("weighting", "rules"),
    [
        ("participating", [FedAvg, lambda w: FedStale(beta=0.0, weighting=w), FedNova]),
        ("samples", [FedAvg, FedNova]),
        ("known_p", [FedAvg, lambda w: FedStale(beta=0.0, weighting=w)]),
    ],
)
def test_a_weighting_means_the_same_in_every_rule_that_takes_it(weighting, rules):
    # FedStale's beta = 0 and FedNova with equal local work are FedAvg with the same weighting
    results = [_one_round(make(weighting=weighting) if isinstance(make, type) else make(weighting)) for make in rules]
    params, weights = results[0]
    for other_params, other_weights in results[1:]:
        torch.testing.assert_close(other_params, params, rtol=1e-12, atol=1e-12)
        assert other_weights.keys() == weights.keys()
        for client in weights:
            assert other_weights[client] == pytest.approx(weights[client], rel=1e-12)
