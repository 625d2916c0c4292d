"""The server-rule base class by hand: ClientInfo and RoundContext checks, the Algorithm's defaults, its
checkpoints, the never-aggregated warning and the texts of its errors.

Written against the survivors of the ``base`` mutation chunk (docs/testing.md): each test names the slip it
catches. FedAvg stands in where a concrete rule is needed; ``Plain`` is the smallest subclass (it sums deltas).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms.base import Algorithm, ClientInfo, RoundContext, RoundShares
from lightning_fedhet.algorithms.fedavg import FedAvg
from tests.helpers import error_text

MASK3 = torch.ones(3, dtype=torch.bool)


class Plain(Algorithm):
    """The smallest rule: w + sum of the round's deltas; its accumulator is None outside a round."""

    def __init__(self) -> None:
        super().__init__()
        self.round_sum: dict[int, torch.Tensor] | None = None

    def open_round(self, round, ctx) -> None:
        super().open_round(round, ctx)
        self.round_sum = {}

    def add(self, client, delta, info) -> None:
        self._check_update(client, delta, self.round_sum, self.round_sum)
        self.round_sum[client] = delta

    def close_round(self) -> torch.Tensor:
        self.params = self.params + sum(self.round_sum.values(), torch.zeros_like(self.params))
        self.round_sum = None
        return self.params


# ---------------------------------------------------------------------------------------------- ClientInfo
def test_client_info_accepts_zero_and_reads_one_element_tensors():
    # zero samples and zero steps are allowed (a client that ran no step); a loss arrives as a float
    info = ClientInfo(num_samples=0, local_steps=0)
    assert (info.num_samples, info.local_steps) == (0, 0) and np.isnan(info.loss)
    info = ClientInfo(num_samples=4, local_steps=3, loss=torch.tensor(0.5))
    assert (info.num_samples, info.local_steps, info.loss) == (4, 3, 0.5) and type(info.loss) is float
    assert ClientInfo(1, 1, loss=np.float32(0.25)).loss == 0.25
    assert ClientInfo(1, 1, loss=torch.tensor([0.75])).loss == 0.75


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_samples=-1, local_steps=1), "num_samples must be an integer >= 0, got -1"),
        (dict(num_samples=1, local_steps=-1), "local_steps must be an integer >= 0, got -1"),
        (dict(num_samples=1, local_steps=1.5), "local_steps must be an integer >= 0, got 1.5"),
        (dict(num_samples=1, local_steps=1, loss="x"), "loss must be a real number (nan if not reported), got 'x'"),
        (dict(num_samples=1, local_steps=1, loss=True), "loss must be a real number (nan if not reported), got True"),
        (dict(num_samples=1, local_steps=1, loss=torch.ones(2)),
         "loss must be a real number (nan if not reported), got tensor([1., 1.])"),
        (dict(num_samples=1, local_steps=1, loss=torch.tensor(True)),
         "loss must be a real number (nan if not reported), got tensor(True)"),
        (dict(num_samples=1, local_steps=1, loss=torch.tensor(1 + 1j)),
         "loss must be a real number (nan if not reported), got tensor(1.+1.j)"),
    ],
)
def test_client_info_refuses_with_the_field_and_its_range(kwargs, message):
    assert error_text(lambda: ClientInfo(**kwargs)) == message


# ---------------------------------------------------------------------------------------------- RoundContext
def test_round_context_checks_its_masks():
    ctx = RoundContext(round=3, num_clients=3, available=MASK3, selected=MASK3, received=MASK3)
    assert (ctx.round, ctx.num_clients) == (3, 3)
    make = dict(round=0, num_clients=3, available=MASK3, selected=MASK3, received=MASK3)
    assert error_text(lambda: RoundContext(**{**make, "num_clients": 0})) == (
        "num_clients must be an integer >= 1, got 0"
    )
    assert error_text(lambda: RoundContext(**{**make, "available": MASK3[:2]})) == (
        "available must be a tensor of shape (3,) (one entry per client), got (2,)"
    )
    assert error_text(lambda: RoundContext(**{**make, "received": [1, 1, 1]})) == (
        "received must be a tensor of shape (3,) (one entry per client), got list"
    )


# ---------------------------------------------------------------------------------------------- the base class
def test_a_rule_before_setup():
    algo = Plain()
    assert algo.num_clients == 0 and algo.params is None and algo.client_weights is None
    assert algo.ctx is None and algo.client_sizes is None and algo.last_weights == {}
    assert algo.shard_client_state(0, 2) is False  # nothing to shard by default
    # a checkpoint of a rule never set up holds None, and loads as such
    state = algo.state_dict()
    assert state == {"num_clients": 0, "params": None, "client_weights": None, "client_sizes": None}
    other = Plain()
    other.load_state_dict(state)
    assert other.params is None and other.client_weights is None and other.client_sizes is None
    assert error_text(kind=RuntimeError, call=lambda: algo.open_round(0, None)) == (
        "Plain.setup() must be called before the first round"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, torch.zeros(2)), "num_clients must be an integer >= 1, got 0"),
        ((2, torch.zeros(2, 1)), "init_params must be a flat tensor of shape [d], got shape (2, 1)"),
        ((2, [0.0, 1.0]), "init_params must be a flat tensor of shape [d], got list"),
        ((2, torch.zeros(2), [-1.0, 1.0]), "client_weights must lie in [0, inf], got -1.0"),
        ((2, torch.zeros(2), None, ["a", "b"]), "client_sizes must be integers |D_i| >= 0, one per client, got ['a', "
                                                "'b']"),
    ],
)
def test_setup_refuses_with_the_argument_and_its_range(args, message):
    assert error_text(lambda: Plain().setup(*args)) == message


def test_setup_defaults_and_client_sizes_in_any_form():
    algo = Plain()
    algo.setup(4, torch.zeros(2))
    assert algo.client_weights.dtype == torch.float64 and algo.client_weights.tolist() == [0.25] * 4
    assert algo.selection_probs(0).dtype == torch.float64 and algo.selection_probs(0).tolist() == [1.0] * 4
    # sizes as a list, as whole floats, and as a float tensor that requires grad: all int64 (slips: the tensor
    # branch taken for a list, a tensor with grad handed to numpy, the int64 conversion dropped)
    for sizes in ([6, 2, 4, 0], [6.0, 2.0, 4.0, 0.0], torch.tensor([6.0, 2.0, 4.0, 0.0], requires_grad=True)):
        algo.setup(4, torch.zeros(2), client_sizes=sizes)
        assert algo.client_sizes.dtype == torch.int64 and algo.client_sizes.tolist() == [6, 2, 4, 0], sizes


def test_checkpoint_round_trip_keeps_the_client_sizes():
    algo = Plain()
    algo.setup(3, torch.tensor([1.0, 2.0]), client_weights=[1.0, 1.0, 2.0], client_sizes=[5, 0, 7])
    resumed = Plain()
    resumed.load_state_dict(algo.state_dict())
    assert resumed.num_clients == 3 and resumed.params.tolist() == [1.0, 2.0]
    assert resumed.client_weights.tolist() == [0.25, 0.25, 0.5] and resumed.client_sizes.tolist() == [5, 0, 7]
    # an older checkpoint without client_sizes loads with none
    state = algo.state_dict()
    del state["client_sizes"]
    older = Plain()
    older.load_state_dict(state)
    assert older.client_sizes is None


def test_a_round_keeps_its_context_and_checks_each_update():
    algo = Plain()
    algo.setup(3, torch.zeros(2))
    assert error_text(kind=RuntimeError, call=lambda: algo.add(0, torch.zeros(2), ClientInfo(1, 1))) == (
        "add() called without open_round()"
    )
    ctx = RoundContext(round=0, num_clients=3, available=MASK3, selected=MASK3, received=MASK3)
    algo.last_weights = {0: 1.0}  # what a rule leaves after closing a round
    algo.open_round(0, ctx)
    assert algo.ctx is ctx and algo.last_weights == {}
    assert error_text(kind=IndexError, call=lambda: algo.add(3, torch.zeros(2), ClientInfo(1, 1))) == (
        "client id 3 out of range [0, 3)"
    )
    assert error_text(lambda: algo.add(0, torch.zeros(3), ClientInfo(1, 1))) == (
        "delta of client 0 has shape (3,), expected (2,)"
    )
    algo.add(2, torch.ones(2), ClientInfo(1, 1))
    assert error_text(lambda: algo.add(2, torch.ones(2), ClientInfo(1, 1))) == (
        "client 2 already added in this round"
    )
    assert algo.close_round().tolist() == [1.0, 1.0]


def test_context_probabilities_are_checked_and_never_aggregated_clients_named():
    algo = Plain()
    algo.setup(12, torch.zeros(1))
    assert error_text(lambda: algo._context_probs(None, "participation_probs", "weighting='known_p'")) == (
        "weighting='known_p' needs RoundContext.participation_probs"
    )
    assert error_text(lambda: algo._context_probs([0.5] * 11 + [1.5], "participation_probs", "x")) == (
        "RoundContext.participation_probs must lie in [0, 1], got 1.5"
    )
    assert error_text(lambda: algo._context_probs([0.5, 0.5], "participation_probs", "x")).startswith(
        "RoundContext.participation_probs has 2 entries but num_clients is 12"
    )
    tail = "they are never aggregated, so their data is never seen and the update is unbiased only for the " \
           "objective over the other clients"
    with pytest.warns(RuntimeWarning) as caught:
        probs = algo._context_probs([0.0] * 11 + [1.0], "participation_probs", "weighting='known_p'")
    assert probs.dtype == torch.float64 and probs.tolist() == [0.0] * 11 + [1.0]
    assert str(caught[0].message) == (  # eleven ids: the first ten, then "..."
        "Plain (weighting='known_p'): 11 client(s) have RoundContext.participation_probs = 0 (ids 0, 1, 2, 3, 4, 5, "
        f"6, 7, 8, 9, ...): {tail}"
    )
    with pytest.warns(RuntimeWarning) as caught:
        algo._context_probs([0.0] * 10 + [1.0, 1.0], "success_probs", "x")
    assert str(caught[0].message) == (  # exactly ten ids: all shown, no "..."
        f"Plain (x): 10 client(s) have RoundContext.success_probs = 0 (ids 0, 1, 2, 3, 4, 5, 6, 7, 8, 9): {tail}"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same clients again: warned once
        algo._context_probs([0.0] * 10 + [1.0, 1.0], "success_probs", "x")


def test_repr_names_the_rule_and_its_settings():
    assert repr(FedAvg()) == "FedAvg(weighting='participating', server_lr=1.0)"
    assert repr(Plain()) == "Plain()"


def test_round_shares_extend_appends_both_lists():
    a, b = torch.ones(2), torch.zeros(2)
    first, second = {0: 1.0}, [3]
    shares = RoundShares([a], [first]).extend(RoundShares([b], [second]))
    assert shares.sums[0] is a and shares.sums[1] is b and len(shares.sums) == 2
    assert shares.tables == [first, second]
