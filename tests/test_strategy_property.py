"""Property: any value of FedHetStrategy's own arguments (local_steps, num_clients, seed, max_update_norm,
update_norm_action, optimizer_state, client_weights, engine) builds a strategy or raises ValueError/TypeError
naming the parameter, before any work (per-client lengths are checked against num_clients when it is given).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, TwoGroupSteps, UniformSteps
from tests.property_inputs import PROPERTY, arg, bounded_junk, build, ints, junk, seeds

PARAMS = ("local_steps", "num_clients", "seed", "max_update_norm", "update_norm_action", "optimizer_state",
          "client_weights", "engine")


# an unhashable engine and an array optimizer_state are checked by name too (test_unhashable_engine_... below)
engine_junk = junk
optimizer_state_junk = junk

local_steps = st.one_of(
    ints(1, 10),
    st.lists(st.integers(1, 5), min_size=1, max_size=5),
    st.builds(UniformSteps, st.integers(1, 3), st.integers(3, 6)),
    st.builds(TwoGroupSteps),
)


@PROPERTY
@given(
    kwargs=st.fixed_dictionaries({}, optional={
        "local_steps": arg(local_steps),
        "num_clients": st.one_of(st.none(), st.integers(1, 6), bounded_junk),
        "seed": st.one_of(st.none(), seeds),
        "max_update_norm": st.one_of(st.none(), arg(st.floats(1e-3, 1e3))),
        "update_norm_action": arg(st.sampled_from(["reject", "clip"])),
        "optimizer_state": st.one_of(st.sampled_from(["reset", "persist"]), optimizer_state_junk),
        "client_weights": arg(st.sampled_from(["uniform", "samples"])),
        "engine": st.one_of(st.sampled_from(["sequential", "vmap", "auto"]), engine_junk),
    }),
    participation=st.sampled_from([None, Bernoulli(0.5), Bernoulli([0.5, 0.2, 0.9])]),
    channel=st.sampled_from([None, LossyChannel(0.1), LossyChannel(uplink=[0.1, 0.2])]),
)
def test_strategy_arguments(kwargs, participation, channel):
    strategy = build(lambda: FedHetStrategy(participation=participation, channel=channel, **kwargs),
                     *PARAMS, "p", "uplink")
    if strategy is not None:
        # a strategy that builds keeps what it was given (a slip that swapped or defaulted an option fails)
        assert strategy.seed >= 0
        assert strategy.engine == kwargs.get("engine", "auto")
        assert strategy.optimizer_state_mode == kwargs.get("optimizer_state", "reset")
        assert strategy.update_norm_action == kwargs.get("update_norm_action", "reject")
        assert strategy.client_weights == kwargs.get("client_weights", "uniform")
        bound = kwargs.get("max_update_norm")
        assert (strategy.max_update_norm is None) if bound is None else float(strategy.max_update_norm) == float(bound)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine": []}, r"engine must be one of \('sequential', 'vmap', 'auto'\), got \[\]"),
        ({"optimizer_state": np.array([])}, r"optimizer_state must be one of \('reset', 'persist'\), got array"),
    ],
    ids=["engine", "state"],
)
def test_unhashable_engine_and_array_optimizer_state_are_refused_by_name(kwargs, message):
    # Once gaps (an unhashable engine raised "unhashable type", an array optimizer_state numpy's "truth value is
    # ambiguous"); the checks now name the parameter and the allowed values.
    with pytest.raises(ValueError, match=message):
        FedHetStrategy(**kwargs)
