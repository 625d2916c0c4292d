"""Helpers shared by the tests of the rules with their own sampler (FedACS family, CA-Fed, AdaFed, F3AST).

They build masks and round contexts and drive a rule through random rounds; expected numbers are never produced
here. All deltas are ``delta_i = w_i - w_t``.
"""

from __future__ import annotations

import io
import math
from typing import NamedTuple

import numpy as np
import torch

from lightning_fedhet.algorithms import ClientInfo, RoundContext

F64 = torch.float64


def mask(n, ids):
    m = torch.zeros(n, dtype=torch.bool)
    m[list(ids)] = True
    return m


def ctx_for(t, n, available, selected, received, p=None, s=None, steps=None, pi=None):
    return RoundContext(
        round=t,
        num_clients=n,
        available=mask(n, available),
        selected=mask(n, selected),
        received=mask(n, received),
        participation_probs=None if p is None else torch.as_tensor(p, dtype=F64),
        success_probs=None if s is None else torch.as_tensor(s, dtype=F64),
        local_steps=None if steps is None else torch.as_tensor(steps, dtype=torch.int64),
        availability_probs=None if pi is None else torch.as_tensor(pi, dtype=F64),
    )


def vec(*xs):
    return torch.tensor(xs, dtype=F64)


def markov_chain(pi, lam, rounds, seed):
    """Two-state chains (thesis App. F.C): P(1|1) = lam + (1-lam) pi, P(1|0) = (1-lam) pi, stationary start."""
    pi, lam = np.asarray(pi), np.asarray(lam)
    g = np.random.default_rng(seed)
    state = g.random(pi.size) < pi
    out = np.empty((rounds, pi.size), dtype=bool)
    for t in range(rounds):
        out[t] = state
        p_on = np.where(state, lam + (1 - lam) * pi, (1 - lam) * pi)
        state = g.random(pi.size) < p_on
    return out


class System(NamedTuple):
    """One round of a random system, float64/bool ``[N]`` each (``deltas`` ``[N, d]``)."""

    p: np.ndarray  # participation probabilities
    avail: torch.Tensor
    s: np.ndarray  # success probabilities
    steps: np.ndarray
    deltas: torch.Tensor
    losses: np.ndarray
    link: torch.Tensor  # whether the upload would arrive


def draw_system(t, p, d, seed, max_steps) -> System:
    """Round ``t`` of a random system from the counter-based generator ``[seed, t]`` (local steps in
    ``1..max_steps``)."""
    g = np.random.default_rng([seed, t])
    n = len(p)
    avail = torch.from_numpy(g.random(n) < p)
    s = g.uniform(0.5, 1.0, n)
    steps = g.integers(1, max_steps + 1, n)
    deltas = torch.from_numpy(g.normal(size=(n, d)))
    losses = g.uniform(0.5, 2.0, n)
    link = torch.from_numpy(g.random(n) < s)
    return System(p, avail, s, steps, deltas, losses, link)


def offer_round(algo, t, system: System, select_seed):
    """What the server does before training: the system oracle, probe losses when asked, the rule's selection."""
    algo.observe_system(t, success_probs=torch.from_numpy(system.s), local_steps=torch.from_numpy(system.steps),
                        participation_probs=torch.from_numpy(system.p))
    if algo.wants_probe_losses():
        algo.observe_losses(t, torch.where(system.avail, torch.from_numpy(system.losses), float("nan")))
    return algo.select(t, system.avail, np.random.default_rng([select_seed, t]))


def drive(algo, start, stop, n=5, d=3):
    """Rounds ``start..stop-1`` of a random system (availability, links, local steps, deltas, losses, probes)."""
    p = np.array([0.9, 0.8, 0.6, 0.5, 0.3])
    for t in range(stop):
        system = draw_system(t, p, d, seed=17, max_steps=5)
        if t < start:
            continue
        sel = offer_round(algo, t, system, select_seed=18)
        sel = sel > 0 if sel.dtype != torch.bool else sel
        arrived = sel & system.link
        ctx = RoundContext(t, n, system.avail, sel, arrived, torch.from_numpy(p), torch.from_numpy(system.s),
                           torch.where(sel, torch.from_numpy(system.steps), 0))
        algo.open_round(t, ctx)
        for i in torch.nonzero(arrived).flatten().tolist():
            algo.add(i, system.deltas[i], ClientInfo(1, int(system.steps[i]), loss=float(system.losses[i])))
        algo.close_round()
    return algo.params.clone(), dict(algo.last_weights)


def check_resume(factory):
    """Rounds 0-3, a ``torch.save`` round trip of ``state_dict``, rounds 4-7 == 8 uninterrupted rounds, exactly."""
    n, w0, cw = 5, torch.tensor([0.1, -0.2, 0.3], dtype=F64), torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0])
    full = factory()
    full.setup(n, w0, cw)
    expected, expected_w = drive(full, 0, 8)
    first = factory()
    first.setup(n, w0, cw)
    drive(first, 0, 4)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = factory()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got, got_w = drive(resumed, 4, 8)
    assert torch.equal(got, expected)
    assert got_w == expected_w
    assert not torch.equal(expected, w0)
    assert resumed.hparams() == full.hparams()
    assert math.isfinite(float(got.sum()))
