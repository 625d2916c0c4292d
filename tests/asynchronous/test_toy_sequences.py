"""FedAST's server on hand-derived examples: f(x) = x^2/2, one SGD step of lr 1/2, eta_s = 1, constant latency.

The local solver turns the model it was sent, ``w``, into ``w - 0.5 * w = w/2``, so an update carries
``Delta = w_local - w_sent = -w_sent/2`` and a server step is ``x <- x + mean(Delta)`` (eq. 9 with eta_s = 1).
Every number is an exact binary fraction, so the comparisons are bitwise (float64).
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedhet.asynchronous import Constant, FedAST, Task, run


def sgd_on_half_square(request, w_sent):
    """One real SGD step of lr 0.5 on f(x) = x^2/2 (gradient x): w/2."""
    x = w_sent.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([x], lr=0.5)
    (x.square().sum() / 2).backward()
    optimizer.step()
    return x.detach()


def toy_server(requests, buffer, num_clients=1000, latency=1.0, seed=0):
    task = Task(torch.ones(1, dtype=torch.float64), local_steps=1, latency=latency)
    return FedAST(requests=requests, buffer=buffer, server_lr=1.0).build({"toy": task}, num_clients, seed=seed)


def trajectory(server, steps):
    """x after each of ``steps`` server steps, the step records, and every request trained."""
    xs, records, trained = [], [], []

    def solver(request, w_sent):
        trained.append(request)
        return sgd_on_half_square(request, w_sent)

    for _ in range(steps):
        records += run(server, solver, max_steps=1)
        xs.append(float(server.params("toy")[0]))
    return xs, records, trained


def assert_no_request_queued(trained):
    # The derivations assume that no request waits behind another on a client (the examples' precondition,
    # "enough clients"): with 1000 clients and seed 0 no two requests in flight share a client.
    assert trained and all(q.starts_at == q.sent_at for q in trained)


def test_R2_b2_sequence():
    # R = b = 2, x0 = 1, every request takes D = 1 s, requests sent at the same time arrive in send order.
    # t=0: send A, B with x0 = 1.
    # t=1: A (sent x0=1, Delta -1/2): |B| = 1 < 2, send C with x0 = 1.
    #      B (x0, -1/2): full -> x1 = 1 + (-1/2 - 1/2)/2 = 1/2; send D with x1 = 1/2 (line 13 after line 10).
    # t=2: C (x0, -1/2): send E with x1.  D (x1, -1/4): x2 = 1/2 + (-1/2 - 1/4)/2 = 1/2 - 3/8 = 1/8; send F (x2).
    # t=3: E (x1, -1/4): send G (x2).  F (x2, -1/16): x3 = 1/8 + (-1/4 - 1/16)/2 = 1/8 - 5/32 = -1/32; send H.
    # t=4: G (x2, -1/16): send I (x3).  H (x3, +1/64): x4 = -1/32 + (-1/16 + 1/64)/2 = -1/32 - 3/128 = -7/128.
    # t=5: I (x3, +1/64): send K (x4).  J (x4, +7/256): x5 = -7/128 + (1/64 + 7/256)/2 = -28/512 + 11/512 = -17/512.
    # t=6: K (x4, +7/256).  L (x5, +17/1024): x6 = -17/512 + (28/1024 + 17/1024)/2 = -68/2048 + 45/2048 = -23/2048.
    # In closed form x_{k+1} = x_k - (x_{k-1} + x_k)/4 for k >= 1.
    server = toy_server(2, 2)
    xs, records, trained = trajectory(server, 6)
    assert xs == [1 / 2, 1 / 8, -1 / 32, -7 / 128, -17 / 512, -23 / 2048]
    assert [r["sim_time"] for r in records] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # staleness (server steps between sending and receiving): A, B fresh; afterwards one stale, one fresh.
    assert [r["staleness"] for r in records] == [[0, 0]] + [[1, 0]] * 5
    assert all(r["R"] == 2 and r["b"] == 2 for r in records)
    assert_no_request_queued(trained)
    for k in range(1, 5):
        assert xs[k + 1] == xs[k] - (xs[k - 1] + xs[k]) / 4


def test_R4_b2_sequence():
    # R = 4, b = 2, x0 = 1, D = 1 s.
    # t=0: send A, B, C, D with x0.
    # t=1: A (-1/2): send E (x0).  B (-1/2): x1 = 1 - 1/2 = 1/2; send F (x1).
    #      C (-1/2): send G (x1).   D (-1/2): x2 = 1/2 - 1/2 = 0; send H (x2).
    # t=2: E (x0, -1/2): send I (x2).  F (x1, -1/4): x3 = 0 + (-1/2 - 1/4)/2 = -3/8; send J (x3).
    #      G (x1, -1/4): send K (x3).  H (x2, 0): x4 = -3/8 + (-1/4 + 0)/2 = -1/2; send L (x4).
    # t=3: I (x2, 0): send M (x4).  J (x3, +3/16): x5 = -1/2 + (0 + 3/16)/2 = -13/32; send N (x5).
    #      K (x3, +3/16): send O (x5).  L (x4, +1/4): x6 = -13/32 + (3/16 + 1/4)/2 = -13/32 + 7/32 = -3/16.
    server = toy_server(4, 2)
    xs, records, trained = trajectory(server, 6)
    assert xs == [1 / 2, 0.0, -3 / 8, -1 / 2, -13 / 32, -3 / 16]
    assert [r["sim_time"] for r in records] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert [r["staleness"] for r in records] == [[0, 0], [1, 1], [2, 1], [2, 1], [2, 1], [2, 1]]
    assert_no_request_queued(trained)


def test_one_client_serves_its_requests_first_come_first_served():
    # One client, R = 2, every request takes D: both first requests go to client 0 at t=0; the second waits for
    # the first, so updates arrive at D, 2D, 3D, ... (each arrival sends one request, queued behind the other).
    d = 0.75
    server = FedAST(requests=2, buffer=1, server_lr=1.0).build(
        {"toy": Task(torch.ones(1, dtype=torch.float64), latency=Constant(d))}, num_clients=1)
    records = run(server, sgd_on_half_square, max_steps=5)
    assert [r["sim_time"] for r in records] == [d, 2 * d, 3 * d, 4 * d, 5 * d]
    assert all(r["clients"] == [0] for r in records)
    # t=D: A arrives, C is sent but the client serves B until 2D, so C runs [2D, 3D]; in general the request
    # sent at kD starts at (k+1)D and finishes at (k+2)D. After 5 steps F (sent 4D) and G (sent 5D) are out.
    pending = sorted(server.state_dict()["pending"], key=lambda q: q["seq"])
    assert [(q["sent_at"], q["starts_at"], q["finish_at"]) for q in pending] == [(4 * d, 5 * d, 6 * d),
                                                                                 (5 * d, 6 * d, 7 * d)]


def test_model_versions_are_released_once_no_request_uses_them():
    server = toy_server(4, 2)
    xs, _, _ = trajectory(server, 6)
    # After x6 (R = 4, b = 2 above): in flight are M (sent with x4), N and O (x5) and P (x6); x0..x3 are gone.
    state = server.state_dict()["tasks"]["toy"]
    assert sorted(state["versions"]) == [4, 5, 6]
    assert state["refs"] == {4: 1, 5: 2, 6: 1}
    assert [float(state["versions"][v][0]) for v in (4, 5, 6)] == xs[3:6]


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="option"):
        FedAST(option="X")
    with pytest.raises(ValueError, match="requests"):
        FedAST(requests=0)
    with pytest.raises(ValueError, match="buffer"):
        FedAST(buffer={"a": 0})
    with pytest.raises(ValueError, match="server_lr"):
        FedAST(server_lr=0)
    with pytest.raises(ValueError, match="window"):
        FedAST(window=1)
    with pytest.raises(ValueError, match="allocation"):
        FedAST(allocation="sqrt")
    with pytest.raises(ValueError, match="local_steps"):
        FedAST().build({"a": Task(torch.zeros(2), local_steps=0)}, 4)
    with pytest.raises(ValueError, match="num_clients"):
        FedAST().build({"a": Task(torch.zeros(2))}, 0)
    with pytest.raises(ValueError, match="requests names tasks"):
        FedAST(requests={"b": 2}).build({"a": Task(torch.zeros(2))}, 4)
    with pytest.raises(ValueError, match="seconds"):
        Constant(0)
    with pytest.raises(TypeError, match="latency"):
        FedAST().build({"a": Task(torch.zeros(2), latency="fast")}, 4)
