"""The framework-free servers: resuming, Sync-ST's round timing, availability slots, rejected updates."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lightning_fedhet.asynchronous import FedAST, SyncST, Task, run
from lightning_fedhet.participation import Bernoulli, Full, Trace
from lightning_fedhet.seeding import Stream, generator
from lightning_fedhet.system import ShiftedExponential


def _tasks():
    return {
        "mnist": Task(torch.zeros(4), local_steps=27, latency=ShiftedExponential.fedast("mnist"), client_lr=0.1),
        "cifar": Task(torch.ones(6), local_steps=27, latency=ShiftedExponential.fedast("cifar10"), client_lr=0.1),
    }


def _solver(request, w_sent):
    # deterministic, client- and task-dependent local work (heterogeneous optima)
    centre = (request.client % 7) * (1.0 if request.task == "mnist" else -0.5)
    return w_sent - 0.3 * (w_sent - centre) + 0.01 * request.seq


def _build(rule):
    return rule.build(_tasks(), num_clients=40, participation=Bernoulli(0.3), slot=5.0, seed=2)


@pytest.mark.parametrize("rule", [
    FedAST(option="D", requests={"mnist": 6, "cifar": 6}, buffer=2, server_lr=0.5, window=3, period=0.5),
    SyncST(first_k=3, clients_per_round=10),
], ids=["fedast-D", "syncst-first-k"])
def test_resume_mid_run_equals_uninterrupted(rule):
    full = _build(rule)
    run(full, _solver, max_steps=40)

    first = _build(rule)
    run(first, _solver, max_steps=17)
    request = first.pop()  # a request popped but not yet submitted goes into the state too
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = _build(rule)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))  # checkpoint-safe types only
    sent = resumed.sent_params(request)
    resumed.submit(request, _solver(request, sent) - sent)
    run(resumed, _solver, max_steps=len(full.history) - len(resumed.history))

    assert resumed.history == full.history
    for name in ("mnist", "cifar"):
        assert torch.equal(resumed.params(name), full.params(name))
    assert resumed.clock == full.clock
    if isinstance(rule, FedAST):
        assert resumed.reallocations == full.reallocations
        assert any("skipped" not in r for r in full.reallocations)


def test_syncst_round_timing_by_hand():
    # Independent transcription of a Sync-ST round (paper §5.2 and the authors' code): the available clients are
    # shuffled and split half/half; each runs one request of duration tau * s_i * (0.5 c + Exp(c)) starting when
    # its queue is free; each task keeps its first k = 2 arrivals; the round ends at the last kept arrival; the
    # discarded stragglers keep their clients busy into the next round.
    seed, n = 7, 12
    tasks = {"mnist": Task(torch.zeros(1), local_steps=27, latency=ShiftedExponential.fedast("mnist")),
             "cifar": Task(torch.zeros(1), local_steps=27, latency=ShiftedExponential.fedast("cifar10"))}
    server = SyncST(first_k=2).build(tasks, num_clients=n, participation=Full(), seed=seed)
    run(server, lambda q, w: w + 1.0, max_steps=4)  # two rounds, two tasks each

    speed = ShiftedExponential.fedast("mnist")
    speed.setup(n, seed)
    c = {"mnist": 0.148, "cifar": 0.228}
    busy = np.zeros(n)
    clock, seq = 0.0, 0
    for r in range(2):
        order = generator(seed, Stream.REQUEST_CLIENT, r).permutation(np.arange(n))
        ends = []
        for m, clients in (("mnist", np.sort(order[:6])), ("cifar", np.sort(order[6:]))):
            jobs = []
            for client in clients:
                exp = generator(seed, Stream.REQUEST_LATENCY, seq).exponential(c[m] * speed.speed[client])
                duration = 27 * (0.5 * c[m] * speed.speed[client] + exp)
                start = max(clock, busy[client])
                busy[client] = start + duration
                jobs.append((start + duration, seq, int(client)))
                seq += 1
            kept = sorted(jobs)[:2]
            record = server.history[2 * r + (m == "cifar")]
            assert record["task"] == m
            assert record["clients"] == sorted(k[2] for k in kept)
            ends.append(kept[-1][0])
        clock = max(ends)
        assert server.history[2 * r]["sim_time"] == pytest.approx(clock, rel=1e-12)
    # some straggler of round 0 was still running when round 1 started
    assert server.history[0]["sim_time"] < busy.max()


def test_requests_wait_for_an_available_client():
    # Availability trace by 10-s slots: slot 0 nobody, slot 1 only client 2, slot 2 only client 0.
    mask = np.array([[False, False, False], [False, False, True], [True, False, False]])
    server = FedAST(requests=1, buffer=1, server_lr=1.0).build(
        {"t": Task(torch.zeros(1), latency=4.0)}, num_clients=3, participation=Trace(mask), slot=10.0)
    records = run(server, lambda q, w: w + 1.0, max_steps=3)
    # sent at t=0 -> no one until slot 1 (t=10): client 2, back at 14; the next one is sent at 14 (slot 1,
    # client 2) and is back at 18; the third is sent at 18 (still slot 1) and is back at 22.
    assert [(r["clients"], r["sim_time"]) for r in records] == [([2], 14.0), ([2], 18.0), ([2], 22.0)]
    run(server, lambda q, w: w + 1.0, max_steps=1)
    # sent at t=22: slot 2 (t in [20, 30)) has only client 0
    assert server.history[-1]["clients"] == [0] and server.history[-1]["sim_time"] == 26.0


def test_non_finite_updates_are_rejected_and_counted():
    server = FedAST(requests=2, buffer=2, server_lr=1.0).build({"t": Task(torch.zeros(2), latency=1.0)}, 50)

    def solver(request, w):
        return w + (float("nan") if request.seq == 1 else 1.0)

    records = run(server, solver, max_steps=2)
    # first step: updates of requests 0 (+1) and 1 (nan): the nan one is dropped, the mean is over the other
    assert records[0]["rejected"] == [1] and records[0]["requests"] == [0, 1]
    assert torch.equal(server.params("t"), torch.full((2,), 2.0))  # 0 + 1, then + mean(+1, +1)
    assert server.rejected_total == 1
