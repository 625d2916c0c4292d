"""Every rule's :meth:`round_shares` in one process: a round's clients split over two copies of the rule, their
shares combined the way :class:`~lightning_fedhet.algorithms.base.RoundShares` documents it (sums added elementwise,
tables replaced by their union in client-id order), must close the round exactly as one copy that added every update.

The many-process tests (``tests/test_strategy_ddp.py``) check the same through ``torch.distributed``; this one runs
in milliseconds, so the mutation chunks of the rules can include it. The combination below is written from the
``RoundShares`` docstring, not taken from ``lightning_fedhet.distributed``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.algorithms import (
    DMAPL,
    F3AST,
    MIFA,
    OS,
    UDMAPL,
    UPGAPL,
    AdaFed,
    CAFed,
    CAFedAvg,
    ClientInfo,
    FedACS,
    FedAU,
    FedAvg,
    FedNova,
    FedStale,
    FedVARP,
    RoundContext,
    SampledFedAvg,
)
from lightning_fedhet.algorithms.fedcis import FedCIS
from lightning_fedhet.cis import CISTopology
from tests.algorithms.selection_rounds import F64


def _star() -> CISTopology:
    """Root 0 (exits 1-2) and five leaves (exit 1), requests at the leaves, a quarter forwarded to the root."""
    return CISTopology([[1, 2, 3, 4, 5], [], [], [], [], []], [2, 1, 1, 1, 1, 1], arrival=[0.0] + [1.0] * 5,
                       transfer_cap=[0.0] + [0.25] * 5)


_MASKS = torch.tensor([[True, True, False], [True, False, True]])  # exit 1, exit 2 over the 3 coordinates

RULES = {
    "FedAvg-known_p": lambda: FedAvg(weighting="known_p"),
    "FedAvg-samples": lambda: FedAvg(weighting="samples"),
    "FedVARP": FedVARP,
    "MIFA": MIFA,
    "FedStale": lambda: FedStale(beta=0.5),
    "FedAU": lambda: FedAU(K=3),
    "UPGAPL": UPGAPL,
    "DMAPL": DMAPL,
    "UDMAPL": UDMAPL,
    "FedNova": lambda: FedNova(momentum=0.5),
    "FedNova-selected": lambda: FedNova(divisor="selected"),
    "FedACS": lambda: FedACS(K=3, momentum=0.5),
    "SampledFedAvg": lambda: SampledFedAvg(K=3),
    "CAFedAvg": lambda: CAFedAvg(K=3),
    "OS": lambda: OS(K=3),
    "CAFed": lambda: CAFed(tau=0.0),
    "AdaFed": AdaFed,
    "F3AST": lambda: F3AST(k=3),
    "FedCIS": lambda: FedCIS(_star(), p=0.3),
    "FedCIS-root_local": lambda: FedCIS(_star(), p=0.3, aggregation_base="root_local", exit_masks=_MASKS),
}


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


def _rounds(one, pair, rounds=8, n=6, d=3):
    p = np.array([0.9, 0.8, 0.6, 0.5, 0.3, 0.7])
    for t in range(rounds):
        g = np.random.default_rng([23, t])
        avail = torch.from_numpy(g.random(n) < p)
        s = g.uniform(0.5, 1.0, n)
        steps = g.integers(1, 5, n)
        deltas = torch.from_numpy(g.normal(size=(n, d)))
        losses = g.uniform(0.5, 2.0, n)
        link = torch.from_numpy(g.random(n) < s)
        for algo in (one, *pair):
            algo.observe_system(t, success_probs=torch.from_numpy(s), local_steps=torch.from_numpy(steps),
                                participation_probs=torch.from_numpy(p))
            if algo.wants_probe_losses():
                algo.observe_losses(t, torch.where(avail, torch.from_numpy(losses), float("nan")))
            selected = algo.select(t, avail, np.random.default_rng([24, t]))
        sel = selected > 0 if selected.dtype != torch.bool else selected
        arrived = sel & link
        ctx = RoundContext(t, n, avail, selected, arrived, torch.from_numpy(p), torch.from_numpy(s),
                           torch.where(sel, torch.from_numpy(steps), 0), torch.from_numpy(p))
        for algo in (one, *pair):
            algo.open_round(t, ctx)
        for i in torch.nonzero(arrived).flatten().tolist():
            info = ClientInfo(10 + i, int(steps[i]), loss=float(losses[i]))
            one.add(i, deltas[i], info)
            pair[i % 2].add(i, deltas[i], info)
        _combine([algo.round_shares() for algo in pair])
        expected = one.close_round()
        for algo in pair:
            torch.testing.assert_close(algo.close_round(), expected, rtol=0, atol=1e-12)
            assert algo.last_weights == pytest.approx(one.last_weights, rel=1e-12)


@pytest.mark.parametrize("name", sorted(RULES))
def test_two_halves_of_a_round_combined_equal_one_process(name):
    # client i lives in process i % 2, which alone keeps its per-client state (stale memories) when the rule shards it
    one, pair = RULES[name](), [RULES[name](), RULES[name]()]
    for rank, algo in enumerate(pair):
        algo.shard_client_state(rank, 2)
    for algo in (one, *pair):
        algo.setup(6, torch.tensor([0.1, -0.2, 0.3], dtype=F64), torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0, 2.0]))
    _rounds(one, pair)
    assert not torch.equal(one.params, torch.tensor([0.1, -0.2, 0.3], dtype=F64))
