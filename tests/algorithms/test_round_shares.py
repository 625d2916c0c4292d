"""Every rule's round protocol in one process.

``round_shares``: a round's clients split over two copies of the rule, their shares combined the way
:class:`~lightning_fedhet.algorithms.base.RoundShares` documents it (sums added elementwise, tables replaced by their
union in client-id order), must close the round exactly as one copy that added every update. The many-process tests
(``tests/test_strategy_ddp.py``) check the same through ``torch.distributed``; this one runs in seconds, so the
mutation chunks of the rules can include it. The combination below is written from the ``RoundShares`` docstring,
not taken from ``lightning_fedhet.distributed``.

And a round closes exactly once, for every rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import ClientInfo, RoundContext
from tests.algorithms.rules import NUM_CLIENTS, RULES
from tests.algorithms.selection_rounds import F64, draw_system, offer_round


def _combine(parts) -> None:
    """Replace every process's sums by their elementwise sum and every table by the union, in place."""
    first = parts[0]
    for i in range(len(first.sums)):
        total = sum(part.sums[i] for part in parts)
        for part in parts:
            part.sums[i].copy_(total)
    for i in range(len(first.tables)):
        if isinstance(first.tables[i], dict):
            union = {}
            for part in parts:
                union.update(part.tables[i])
            union = dict(sorted(union.items()))
            for part in parts:
                part.tables[i].clear()
                part.tables[i].update(union)
        else:
            union = sorted({c for part in parts for c in part.tables[i]})
            for part in parts:
                part.tables[i][:] = union


def _rounds(one, pair=(), rounds=8, n=NUM_CLIENTS, d=3):
    """``rounds`` random rounds of ``one``; with a ``pair``, each round's clients also split over the two copies
    (client ``i`` to ``pair[i % 2]``), whose combined shares must close the round as ``one`` does."""
    p = np.array([0.9, 0.8, 0.6, 0.5, 0.3, 0.7])
    for t in range(rounds):
        system = draw_system(t, p, d, seed=23, max_steps=4)
        for algo in (one, *pair):
            selected = offer_round(algo, t, system, select_seed=24)
        sel = selected > 0 if selected.dtype != torch.bool else selected
        arrived = sel & system.link
        ctx = RoundContext(t, n, system.avail, selected, arrived, torch.from_numpy(p), torch.from_numpy(system.s),
                           torch.where(sel, torch.from_numpy(system.steps), 0), torch.from_numpy(p))
        for algo in (one, *pair):
            algo.open_round(t, ctx)
        for i in torch.nonzero(arrived).flatten().tolist():
            info = ClientInfo(10 + i, int(system.steps[i]), loss=float(system.losses[i]))
            one.add(i, system.deltas[i], info)
            if pair:
                pair[i % 2].add(i, system.deltas[i], info)
        if not pair:
            one.close_round()
            continue
        _combine([algo.round_shares() for algo in pair])
        expected = one.close_round()
        for algo in pair:
            torch.testing.assert_close(algo.close_round(), expected, rtol=0, atol=1e-12)
            assert algo.last_weights == pytest.approx(one.last_weights, rel=1e-12)


def _setup(algo):
    algo.setup(NUM_CLIENTS, torch.tensor([0.1, -0.2, 0.3], dtype=F64), torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 2.0]))
    return algo


@pytest.mark.parametrize("name", sorted(RULES))
def test_two_halves_of_a_round_combined_equal_one_process(name):
    # client i lives in process i % 2, which alone keeps its per-client state (stale memories) when the rule shards it
    one, pair = RULES[name](), [RULES[name](), RULES[name]()]
    for rank, algo in enumerate(pair):
        algo.shard_client_state(rank, 2)
    for algo in (one, *pair):
        _setup(algo)
    _rounds(one, pair)
    assert not torch.equal(one.params, torch.tensor([0.1, -0.2, 0.3], dtype=F64))


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_round_closes_exactly_once(name):
    # Slips caught: the open-round marker not set at construction (a close before any open would not raise) or not
    # cleared by close_round (a second close would apply the round again).
    algo = _setup(RULES[name]())
    with pytest.raises(RuntimeError, match=r"^close_round\(\) called without open_round\(\)$"):
        algo.close_round()
    _rounds(algo, rounds=1)
    with pytest.raises(RuntimeError, match=r"^close_round\(\) called without open_round\(\)$"):
        algo.close_round()
