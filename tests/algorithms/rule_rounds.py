"""Round drivers shared by the server-rule tests: contexts, one hand-written round, random runs, resume checks.

Expected numbers are never produced by these helpers; they only feed the rule under test.
"""

from __future__ import annotations

import io

import numpy as np
import torch

from lightning_fedhet.algorithms import ClientInfo, RoundContext

F64 = torch.float64


def make_ctx(t, n, received, p=None, s=None, selected=None):
    recv = torch.zeros(n, dtype=torch.bool)
    recv[list(received)] = True
    sel = recv.clone() if selected is None else torch.zeros(n, dtype=torch.bool)
    if selected is not None:
        sel[list(selected)] = True
    return RoundContext(
        round=t,
        num_clients=n,
        available=sel.clone(),
        selected=sel,
        received=recv,
        participation_probs=None if p is None else torch.as_tensor(p, dtype=F64),
        success_probs=None if s is None else torch.as_tensor(s, dtype=F64),
        local_steps=None,
    )


def run_round(algo, t, n, deltas, p=None, s=None, steps=None, samples=None, selected=None):
    """One round: ``deltas`` maps client -> list of floats. Returns the new parameters."""
    algo.open_round(t, make_ctx(t, n, deltas.keys(), p=p, s=s, selected=selected))
    for c, d in deltas.items():
        info = ClientInfo(
            num_samples=1 if samples is None else samples[c],
            local_steps=1 if steps is None else steps[c],
        )
        algo.add(c, torch.tensor(d, dtype=F64), info)
    return algo.close_round().clone()


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def setup(algo, n, w0, weights=None):
    algo.setup(num_clients=n, init_params=torch.tensor(w0, dtype=F64), client_weights=weights)
    return algo


def random_run(algos, rounds=20, n=6, d=5, seed=0, weights=None):
    """Drive several algorithms with identical random rounds; return their parameter trajectories."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.2, 1.0, size=n)
    p[0] = 1.0
    w0 = torch.from_numpy(rng.normal(size=d))
    for a in algos:
        a.setup(num_clients=n, init_params=w0.clone(), client_weights=weights)
    traj = [[] for _ in algos]
    for t in range(rounds):
        mask = rng.random(n) < p
        if t == 3:
            mask[:] = False  # include an empty round
        arrived = np.flatnonzero(mask).tolist()
        deltas = {c: torch.from_numpy(rng.normal(size=d)) for c in arrived}
        ctx = make_ctx(t, n, arrived, p=p, s=p)
        for a, tr in zip(algos, traj):
            a.open_round(t, ctx)
            for c in arrived:
                a.add(c, deltas[c].clone(), ClientInfo(num_samples=10 + c, local_steps=2))
            tr.append(a.close_round().clone())
    return traj


def _rounds(algo, start, stop, n=5, d=4, seed=5):
    rng = np.random.default_rng(seed)
    p = np.array([1.0, 0.7, 0.5, 0.4, 0.3])
    out = None
    for t in range(stop):
        sel = rng.random(n) < 0.9
        arrived = np.flatnonzero(sel & (rng.random(n) < p)).tolist()
        deltas = {c: rng.normal(size=d).tolist() for c in arrived}
        steps = {c: int(rng.integers(1, 6)) for c in arrived}
        if t >= start:
            out = run_round(algo, t, n, deltas, p=p, s=p, steps=steps, selected=np.flatnonzero(sel).tolist())
    return out, dict(algo.last_weights)


def check_resume(factory) -> None:
    """A rule saved after 3 of 5 random rounds and resumed from ``state_dict`` ends exactly where an uninterrupted
    run ends (same parameters, same last weights, same hparams)."""
    n = 5
    w0 = [0.1, -0.2, 0.3, 0.0]
    full = setup(factory(), n, w0, torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0]))
    expected, expected_w = _rounds(full, 0, 5)
    first = setup(factory(), n, w0, torch.tensor([1.0, 2.0, 1.0, 3.0, 1.0]))
    _rounds(first, 0, 3)
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = factory()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    got, got_w = _rounds(resumed, 3, 5)
    assert torch.equal(got, expected), type(full).__name__
    assert got_w == expected_w
    assert resumed.hparams() == full.hparams()
    assert repr(resumed).startswith(type(full).__name__ + "(")
