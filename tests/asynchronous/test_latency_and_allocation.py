"""Request durations (paper App. C.6) and the dynamic allocation (Algorithms 3-4, eq. 3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_fedhet.asynchronous import (
    CappedPool,
    FedAST,
    Task,
    allocation_scores,
    normalized_variance,
    request_duration,
    run,
    split_budget,
)
from lightning_fedhet.seeding import Stream, generator
from lightning_fedhet.system import ShiftedExponential


def test_request_duration_means_per_speed_group():
    # The paper's latency with the authors' scale: X = beta + Exp(mean 2 beta), beta = 0.5 c s, times tau = 27.
    # MNIST c = 0.148: normal (s = 1) 27 * (0.074 + 0.148) = 5.994 s, slow (s = 1.3) 7.792 s, fast (0.7) 4.196 s.
    # 20,000 draws per group; the duration's coefficient of variation is 0.148 / 0.222 = 2/3, so the sample
    # mean's relative standard error is (2/3)/sqrt(20000) = 0.47 % and the 1 % tolerance is 2.1 standard errors
    # (the draws are seeded, so the outcome is fixed).
    model = ShiftedExponential.fedast("mnist")
    model.setup(num_clients=8, seed=3)
    expected = {1.0: 5.994, 1.3: 7.792, 0.7: 4.196}
    for speed, mean in expected.items():
        client = int(np.flatnonzero(np.isclose(model.speed, speed))[0])
        draws = [request_duration(model, client, 27, generator(3, Stream.REQUEST_LATENCY, seq))
                 for seq in range(20_000)]
        assert np.mean(draws) == pytest.approx(mean, rel=0.01)
        # the shift is a hard floor: 27 * 0.074 * s
        assert min(draws) >= 27 * 0.074 * speed
    assert np.bincount(model.group).tolist() == [2, 4, 2]  # 25 % slow, 50 % normal, 25 % fast


def test_request_duration_is_one_scaled_draw():
    # steps="scale": duration = tau * s * (shift + Exp(mean)) with ONE exponential draw (not tau of them).
    model = ShiftedExponential(shift=0.5, mean=1.0, speed_factors=(2.0,), group_fractions=(1.0,))
    model.setup(num_clients=1)
    exp = generator(0, Stream.REQUEST_LATENCY, 7).exponential(1.0)
    got = request_duration(model, 0, 5, generator(0, Stream.REQUEST_LATENCY, 7))
    assert got == pytest.approx(5 * 2.0 * (0.5 + exp), rel=1e-12)


def test_normalized_variance_by_hand():
    # Updates (1, 0), (3, 0): mean (2, 0), squared deviations 1 and 1, mean 1, / ||mean||^2 = 4 -> 0.25.
    assert normalized_variance(torch.tensor([[1.0, 0.0], [3.0, 0.0]])) == pytest.approx(0.25)
    # invariant to a common scaling (so raw deltas give Algorithm 4's value for Delta / (tau eta_c))
    u = torch.randn(8, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert normalized_variance(u * 7.0) == pytest.approx(normalized_variance(u), rel=1e-9)
    assert normalized_variance(torch.tensor([[1.0], [-1.0]])) == math.inf


def test_paper_rule_variances_1_and_4_split_384_into_128_and_256():
    # eq. 3: R_m / sigma_hat_m equal for all m, sum R fixed. sigma_hat^2 = (1, 4) -> sigma_hat = (1, 2)
    # -> R = 384 * (1/3, 2/3) = (128, 256). With eta_c = eta_s = tau = 1, sigma_hat^2 = sigma_tilde^2.
    ones = {"a": 1.0, "b": 1.0}
    scores = allocation_scores({"a": 1.0, "b": 4.0}, "paper", 1.0, ones, {"a": 1, "b": 1})
    assert scores == {"a": 1.0, "b": 2.0}
    assert split_budget(384, scores) == {"a": 128, "b": 256}
    # the authors' code is linear in the variance: R ∝ (1, 4) -> 76.8, 307.2 -> (77, 307)
    code = allocation_scores({"a": 1.0, "b": 4.0}, "code", 1.0, ones, {"a": 1, "b": 1})
    assert split_budget(384, code) == {"a": 77, "b": 307}
    # ... in multiples of its 32-request chunks: 2.4 and 9.6 chunks -> 2 and 10
    assert split_budget(384, code, quantum=32) == {"a": 64, "b": 320}


def test_paper_rule_folds_in_eta_c_eta_s_tau():
    # sigma_hat^2 = eta_c eta_s tau sigma_tilde^2 (Algorithm 4 line 3): equal sigma_tilde, tau 4 vs 1 -> R 2:1.
    scores = allocation_scores({"a": 0.5, "b": 0.5}, "paper", 0.1, {"a": 0.2, "b": 0.2}, {"a": 4, "b": 1})
    assert scores["a"] / scores["b"] == pytest.approx(2.0)
    assert split_budget(30, scores) == {"a": 20, "b": 10}


def test_split_budget_keeps_a_minimum_and_the_total():
    assert split_budget(10, {"a": 1.0, "b": 0.0, "c": 0.0}) == {"a": 8, "b": 1, "c": 1}
    assert split_budget(7, {"a": 1.0, "b": 1.0}) == {"a": 4, "b": 3}  # tie on the remainder: first listed
    with pytest.raises(ValueError, match="multiple of quantum"):
        split_budget(100, {"a": 1.0}, quantum=32)
    with pytest.raises(ValueError, match="scores"):
        split_budget(10, {"a": 0.0})


def _linear_solver(slopes):
    """Local solver for task m: one step on f_i(x) = |x - c_i|^2/2 with client-specific centres (heterogeneity)."""

    def solve(request, w_sent):
        centre = torch.full_like(w_sent, float(request.client % 5)) * slopes[request.task]
        return w_sent - 0.5 * (w_sent - centre)

    return solve


def test_dynamic_reallocation_preserves_budget_and_ratio():
    # Two tasks, R = 8 each, b = 4 (R/b = 2). Task "het" has client-dependent optima, task "homo" has the same
    # optimum on every client (zero inter-client variance once converged) -> "het" should gain requests.
    tasks = {"het": Task(torch.zeros(3), latency=1.0), "homo": Task(torch.zeros(3) + 5.0, latency=1.0)}
    rule = FedAST(option="D", requests=8, buffer=4, server_lr=1.0, window=4, period=0.75)
    server = rule.build(tasks, num_clients=50, seed=1, pool=CappedPool(1.0))  # no skipped request
    run(server, _linear_solver({"het": 1.0, "homo": 0.0}), max_steps=120)
    done = [r for r in server.reallocations if "skipped" not in r]
    assert done, "no reallocation happened"
    # period = 0.75 * M * sum R = 0.75 * 2 * 16 = 24 updates between reallocations
    assert all(b["updates"] - a["updates"] >= 24 for a, b in zip(server.reallocations, server.reallocations[1:]))
    for r in done:
        assert sum(r["R"].values()) == 16
        for m in ("het", "homo"):
            # R_m / b_m = 2 held exactly (Algorithm 3 line 4): R_m in multiples of 2, b_m = R_m / 2. Slip caught:
            # b = round(R / 2) with R in units of 1 (R = 5 gives b = 3 (R/b = 5/3), R = 1 gives b = 1 (R/b = 1))
            assert r["R"][m] % 2 == 0 and r["b"][m] * 2 == r["R"][m]
        # R_m ∝ sigma_hat_m (paper rule) up to one 2-request quantum (largest remainder, or the one quantum a task
        # keeps at least when its score is ~0)
        share = r["score"]["het"] / (r["score"]["het"] + r["score"]["homo"])
        assert abs(r["R"]["het"] - 16 * share) <= 2
    # on average over the reallocations (single estimates from V = 4 updates are noisy)
    assert np.mean([r["R"]["het"] for r in done]) > 8
    # the gradual transition: in-flight counts approach the new targets by at most max_new per arrival
    last = server.history[-1]
    assert last["in_flight"] <= server.states[last["task"]].R


def test_stop_task_moves_its_requests_to_the_others_static():
    tasks = {n: Task(torch.zeros(1), latency=1.0) for n in ("a", "b", "c")}
    server = FedAST(option="S", requests={"a": 6, "b": 4, "c": 2}, buffer=2, server_lr=1.0).build(tasks, 100)
    run(server, lambda q, w: w + 1.0, max_steps=4)
    server.stop_task("a")
    # 6 freed requests shared ∝ current R (4, 2): 4 and 2 -> R = (8, 4); b keeps R/b = (2, 1) -> (4, 4)
    assert server.states["b"].R == 8 and server.states["c"].R == 4
    assert server.states["b"].b == 4 and server.states["c"].b == 4
    # option S sends the extra requests at once; nothing of "a" remains in flight
    pending = server.state_dict()["pending"]
    assert sum(q["task"] == "b" for q in pending) == 8
    assert sum(q["task"] == "c" for q in pending) == 4
    assert not any(q["task"] == "a" for q in pending)
    assert server.active_tasks == ["b", "c"] and server.finish_times["a"] == server.clock
    run(server, lambda q, w: w + 1.0, max_steps=10)
    assert all(r["task"] != "a" for r in server.history[4:])
