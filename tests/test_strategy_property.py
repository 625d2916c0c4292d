"""Property: any value of FedHetStrategy's own arguments (local_steps, num_clients, seed, max_update_norm,
update_norm_action, optimizer_state, client_weights, engine) builds a strategy or raises ValueError/TypeError
naming the parameter, before any work (per-client lengths are checked against num_clients when it is given).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from property_inputs import PROPERTY, arg, bounded_junk, build, ints, junk, seeds

from lightning_fedhet import FedHetStrategy
from lightning_fedhet.participation import Bernoulli
from lightning_fedhet.system import LossyChannel, TwoGroupSteps, UniformSteps

PARAMS = ("local_steps", "num_clients", "seed", "max_update_norm", "update_norm_action", "optimizer_state",
          "client_weights", "engine")


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# strategy.py tests ``engine not in ENGINES`` (a dict) and ``optimizer_state == "persist"`` before the named checks
# run, so an unhashable engine raises "unhashable type" and an array optimizer_state numpy's "truth value of an
# array is ambiguous"; both are left to test_strategy_known_gaps below until strategy.py checks them by name.
engine_junk = junk.filter(_hashable)
optimizer_state_junk = junk.filter(lambda v: not isinstance(v, np.ndarray))

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
        "engine": st.one_of(st.sampled_from(["sequential", "vmap"]), engine_junk),
    }),
    participation=st.sampled_from([None, Bernoulli(0.5), Bernoulli([0.5, 0.2, 0.9])]),
    channel=st.sampled_from([None, LossyChannel(0.1), LossyChannel(uplink=[0.1, 0.2])]),
)
def test_strategy_arguments(kwargs, participation, channel):
    strategy = build(lambda: FedHetStrategy(participation=participation, channel=channel, **kwargs),
                     *PARAMS, "p", "uplink")
    if strategy is not None:
        assert strategy.seed >= 0


@pytest.mark.xfail(strict=True, reason="strategy.py compares engine/optimizer_state before naming them")
@pytest.mark.parametrize("kwargs", [{"engine": []}, {"optimizer_state": np.array([])}], ids=["engine", "state"])
def test_strategy_known_gaps(kwargs):
    build(lambda: FedHetStrategy(**kwargs), *PARAMS)
