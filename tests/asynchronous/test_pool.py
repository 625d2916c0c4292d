"""Client pools: the paper's capped pool (uniform draws over all N, cap on distinct busy clients, skipped requests,
FIFO queues) and the availability pool (requests wait)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.asynchronous import AvailabilityPool, CappedPool, Constant, FedAST, SyncST, Task, run
from lightning_fedhet.participation import Bernoulli, Full
from lightning_fedhet.seeding import Stream, generator


def _draw(seed, key, n):
    """The paper's draw, transcribed: client ~ Uniform{0..n-1} from the request's own counter-based stream."""
    return int(generator(seed, Stream.REQUEST_CLIENT, key).integers(n))


def test_capped_pool_skips_an_idle_client_beyond_the_cap_and_queues_a_busy_one():
    # N = 10, cap round(0.3 * 10) = 3. Clients 0, 1, 2 busy until t = 5; at t = 1 the cap is reached, so a draw
    # of 0, 1 or 2 is queued on that client and any other draw is skipped (None), never queued or redrawn.
    # With only 0 and 1 busy every draw goes through. Slip caught: a skipped request redrawn or sent to a busy
    # client instead (the answer would be a client for every key), or the cap counted as >= cap + 1.
    pool = CappedPool(0.3)
    pool.setup(10, seed=5)
    assert pool.cap == 3
    full = np.array([5.0, 5.0, 5.0] + [0.0] * 7)
    two = np.array([5.0, 5.0] + [0.0] * 8)
    outcomes = set()
    for key in range(200):
        drawn = _draw(5, key, 10)
        expected = drawn if drawn < 3 else None
        assert pool.assign(1.0, full, key) == (expected, 1.0)
        assert pool.assign(1.0, two, key) == (drawn, 1.0)
        outcomes.add(expected is None)
    assert outcomes == {True, False}  # both cases occurred
    # at t = 5 the three clients are free again (busy means busy_until > t): nobody is skipped
    assert all(pool.assign(5.0, full, key)[0] == _draw(5, key, 10) for key in range(50))


def test_hand_traced_server_with_a_skip_and_a_fifo_queue():
    # N = 4, CappedPool(0.5): at most 2 distinct busy clients. One task, R = 3, b = 1, eta_s = 1, every request
    # takes 1 s. Seed 1170's first five client draws are 0, 1, 2, 3, 3 (asserted below).
    # t = 0, line 4: request 0 -> client 0 (ends 1), request 1 -> client 1 (ends 1); the third draw, client 2,
    #   is idle while 2 clients are busy: skipped, so only 2 requests are in flight.
    # t = 1: request 0 arrives (b = 1: a server step); clients 0 and 1 are free at t = 1 (busy means busy_until
    #   > t), so K = min(R - in_flight, 2) = min(3 - 1, 2) = 2 new requests: draw 3 -> client 3 (starts 1, ends
    #   2), draw 4 -> client 3 again, busy: queued behind it, first come first served (starts 2, ends 3).
    # Slip caught: the skipped request queued (3 in flight at t = 0), K = 1 in option S after a skip (the task
    # would stay at 2 requests), or a second request on a busy client started at once (starts_at 1).
    seed = 1170
    assert [_draw(seed, k, 4) for k in range(5)] == [0, 1, 2, 3, 3]
    server = FedAST(option="S", requests=3, buffer=1, server_lr=1.0).build(
        {"t": Task(torch.zeros(1), latency=Constant(1.0))}, num_clients=4, pool=CappedPool(0.5), seed=seed)
    pending = server.state_dict()["pending"]
    assert [(q["seq"], q["client"], q["finish_at"]) for q in pending] == [(0, 0, 1.0), (1, 1, 1.0)]
    assert server.skipped == {"t": 1} and server.states["t"].in_flight == 2
    run(server, lambda q, w: w + 1.0, max_steps=1)
    assert server.history[0]["requests"] == [0] and server.history[0]["sim_time"] == 1.0
    new = sorted((q for q in server.state_dict()["pending"] if q["seq"] >= 2), key=lambda q: q["seq"])
    assert [(q["client"], q["sent_at"], q["starts_at"], q["finish_at"]) for q in new] == [
        (3, 1.0, 1.0, 2.0), (3, 1.0, 2.0, 3.0)]
    assert server.states["t"].in_flight == 3


def test_capped_pool_never_exceeds_the_cap_and_every_task_keeps_training():
    # Invariant: at every arrival at most cap distinct clients are busy. R_total = 2 x 12 = 24 > cap = 6 of 20
    # clients, so requests are skipped all the time; both tasks keep taking steps (top-ups at their arrivals).
    # Slip caught: counting requests instead of distinct clients, or a task starved after all its sends skipped.
    tasks = {m: Task(torch.zeros(1), latency=Constant(1.0 + 0.5 * i)) for i, m in enumerate(("a", "b"))}
    server = FedAST(option="S", requests=12, buffer=3, server_lr=1.0).build(
        tasks, num_clients=20, pool=CappedPool(0.3), seed=0)
    seen = []
    for _ in range(400):
        request = server.pop()
        seen.append(int(np.count_nonzero(server.busy > server.clock)))
        sent = server.sent_params(request)
        server.submit(request, sent + 1.0 - sent)
    assert max(seen) <= 6 and sum(server.skipped.values()) > 0
    assert {h["task"] for h in server.history} == {"a", "b"}


def test_syncst_round_uses_a_uniform_capped_set_of_clients():
    # CappedPool(0.3) over 40 clients: each round draws round(0.3 * 40) = 12 distinct clients (busy ones included),
    # split 6/6 over the two tasks; first_k = None keeps all. Slip caught: Sync-ST using every client, or the
    # task split overlapping.
    tasks = {m: Task(torch.zeros(1), latency=Constant(1.0)) for m in ("a", "b")}
    server = SyncST().build(tasks, num_clients=40, pool=CappedPool(0.3), seed=2)
    run(server, lambda q, w: w + 1.0, max_steps=6)
    for r in range(3):
        a, b = server.history[2 * r], server.history[2 * r + 1]
        assert len(a["clients"]) == 6 and len(b["clients"]) == 6 and not set(a["clients"]) & set(b["clients"])


def test_pool_resolution_and_refusals():
    tasks = {"t": Task(torch.zeros(1), latency=1.0)}
    assert isinstance(FedAST(requests=2, buffer=1).build(tasks, 10).pool, CappedPool)  # the paper's, by default
    built = FedAST(requests=2, buffer=1).build(tasks, 10, participation=Bernoulli(0.5), slot=2.0)
    assert isinstance(built.pool, AvailabilityPool) and built.pool.slot == 2.0
    with pytest.raises(ValueError, match="either pool"):
        FedAST().build(tasks, 10, participation=Full(), pool=CappedPool())
    with pytest.raises(ValueError, match="fraction"):
        CappedPool(0.0)
    with pytest.raises(ValueError, match="option D keeps R_m / b_m fixed"):
        FedAST(option="D", requests=5, buffer=2)
