"""The FedAST study module (scripts/studies/fedast.py): local batches, the SGD solver, the pilot rules, a tiny run."""

import math

import numpy as np
import pytest
import torch
from studies import fedast

from lightning_fedhet.asynchronous import Request
from lightning_fedhet.experiments import Cell


def test_batch_order_is_three_whole_epochs_for_300_samples():
    # 300 samples, batch 32, tau 27: 9 batches per epoch (288 samples, drop_last), 3 epochs. Slips: batches drawn
    # with replacement, an epoch that repeats a sample, a last short batch.
    order = fedast.batch_order(300, 32, 27, np.random.default_rng(0))
    assert order.shape == (27, 32)
    for epoch in range(3):
        seen = order[9 * epoch: 9 * (epoch + 1)].ravel()
        assert len(np.unique(seen)) == 288 and seen.min() >= 0 and seen.max() < 300


def test_local_solver_is_plain_sgd_with_weight_decay_and_leaves_the_sent_model_alone():
    # Independent transcription of Algorithm 1: tau steps of torch.optim.SGD (weight decay adds wd * w to the
    # gradient) on the same batches. Slip it catches: loading the sent vector as a view, so the in-place steps
    # change the server's model (the driver's delta w_local - w_sent is then 0).
    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    data = {"x": x, "y": y, "clients": [np.arange(40), np.arange(40, 64)]}
    model = torch.nn.Linear(5, 3)
    solver = fedast.LocalSolver(model, data, task_index=0, seed=7, lr=0.1, weight_decay=0.01, batch=8, steps=4)
    sent = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone() + 0.5
    kept = sent.clone()
    request = Request(seq=3, task="t", client=0, version=0, sent_at=0.0, starts_at=0.0, finish_at=1.0,
                      local_steps=4, data_key=3)
    local = solver(request, sent)
    assert torch.equal(sent, kept)

    ref = torch.nn.Linear(5, 3)
    torch.nn.utils.vector_to_parameters(kept.clone(), ref.parameters())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, weight_decay=0.01)
    batches = fedast.batch_order(40, 8, 4, np.random.default_rng([7, 0, 3, 0]))
    for b in batches:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x[b]), y[b]).backward()
        opt.step()
    expected = torch.nn.utils.parameters_to_vector(ref.parameters()).detach()
    torch.testing.assert_close(local, expected, rtol=1e-5, atol=1e-6)


def _pilot(method: str, lr: float, seed: int, level: float) -> dict:
    grid = [10.0 * k for k in range(1, 41)]  # 400 s: the last quarter is t > 300, 10 points
    acc = {t: [level * (0.5 if g <= 300 else 1.0) + 0.01 * i for g in grid] for i, t in enumerate(fedast.TASKS)}
    return {"protocol": "pilot", "method": method, "seed": seed, "config": {"server_lr": lr},
            "metrics": {"grid": grid, "acc": acc}}


def test_pilot_decisions_follow_the_pilot_protocol_by_hand():
    # Seed 100: FedAST(S) is best at 0.1, Sync-ST at 1.0 (highest mean accuracy over the grid); D takes S's rate.
    # Plateaus (last quarter, mean over seeds 100/101): task i of S = (0.8 + 0.84) / 2 + 0.01 i = 0.82 + 0.01 i,
    # D = 0.78 + 0.01 i, Sync = 0.7 + 0.01 i; target = floor(1000 * 0.95 * best) / 1000.
    records = [_pilot("FedAST(S)", lr, 100, lvl) for lr, lvl in ((0.05, 0.6), (0.1, 0.8), (0.2, 0.7))]
    records += [_pilot("Sync-ST first-k", lr, 100, lvl) for lr, lvl in ((0.5, 0.5), (1.0, 0.7), (1.5, 0.65))]
    records += [_pilot("FedAST(S)", 0.1, 101, 0.84), _pilot("Sync-ST first-k", 1.0, 101, 0.7),
                _pilot("FedAST(D)", 0.1, 100, 0.78), _pilot("FedAST(D)", 0.1, 101, 0.78)]
    d = fedast.pilot_decisions(records)
    assert d["lr"] == {"FedAST(S)": 0.1, "Sync-ST first-k": 1.0, "FedAST(D)": 0.1}
    for i, t in enumerate(fedast.TASKS):
        assert math.isclose(d["plateau"][t]["FedAST(S)"], 0.82 + 0.01 * i)
        assert math.isclose(d["plateau"][t]["Sync-ST first-k"], 0.70 + 0.01 * i)
        assert d["targets"][t] == math.floor(1000 * 0.95 * (0.82 + 0.01 * i)) / 1000


def test_a_tiny_run_is_deterministic_and_stops_tasks_at_their_targets():
    config = {**fedast.BASE, **fedast.method_config("FedAST(D)", 0.1), "num_clients": 20, "requests": 4,
              "buffer": 2, "horizon": 40.0, "eval_every": 10.0, "targets": {"fmnist_lenet": 0.0}}
    cell = Cell("tiny", "FedAST(D)", config)
    first, second = fedast.run_cell(cell, 0), fedast.run_cell(cell, 0)
    assert first == second
    m = first["metrics"]
    assert m["grid"] == [10.0, 20.0, 30.0, 40.0]
    # a target of 0 is reached at the first grid time; the task is stopped, its later values are None
    assert m["time_to_target"]["fmnist_lenet"] == 10.0 and m["acc"]["fmnist_lenet"][1:] == [None] * 3
    assert all(0.0 <= v <= 1.0 for v in m["acc"]["fmnist_mlp"])
    assert sum(m["updates"].values()) > 0


def test_v2_time_is_the_last_image_task_and_only_image_tasks_censor_it():
    # Protocol v2's claims read the last of the two image tasks; a synthetic task that never reached its target
    # censors v1's time (the last of all tasks) but not v2's. Slip it catches: v2 still reading the stand-in.
    record = {"config": {"horizon": 1200.0},
              "metrics": {"time_to_target": {"fmnist_lenet": 230.0, "fmnist_mlp": 90.0, "synthetic_logreg": None}}}
    assert fedast.last_image_time(record) == (230.0, False)
    assert fedast.last_time(record) == (1200.0, True)
    record["metrics"]["time_to_target"]["fmnist_mlp"] = None
    assert fedast.last_image_time(record) == (1200.0, True)
    assert fedast.PROTOCOLS[fedast.PROTOCOL]["time_of"] is fedast.last_image_time
    assert all(c.config["claim_tasks"] == list(fedast.IMAGE_TASKS) for c in fedast.CELLS)


def _v2_record(method: str, seed: int, lenet: float) -> dict:
    return {"protocol": "v2", "method": method, "seed": seed, "config": {"horizon": 1200.0},
            "metrics": {"time_to_target": {"fmnist_lenet": lenet, "fmnist_mlp": 50.0, "synthetic_logreg": None}}}


def test_v2_claims_under_the_v3_rule_h2_direction_only():
    """Five seeds; the LeNet task is always the later image task (MLP at 50 s). FedAST(S) at 100 s, FedAST(D) at
    110, 90, 105, 95, 100 s: H2's gains (T_S - T_D) / T_S = -0.1, 0.1, -0.05, 0.05, 0, mean 0, sd sqrt(0.025 / 4) =
    0.0790569, half-width t_{0.975,4} sd / sqrt(5) = 2.776445 x 0.0353553 = 0.098162: [-0.0982, 0.0982] holds 0, and
    H2 is direction only ("up to 11.9 %"), so inconclusive; read with +11.9 % as the effect, 0.098 < 0.119: not
    reproduced. Sync-ST at 200 s: H1's gains 0.45 ... 0.55 and H1s's 0.5 lie above 0, but the learning-rate check
    withholds their verdict."""
    recs = []
    for seed, d in zip(fedast.SEEDS, (110.0, 90.0, 105.0, 95.0, 100.0)):
        recs += [_v2_record("FedAST(D)", seed, d), _v2_record("FedAST(S)", seed, 100.0),
                 _v2_record("Sync-ST first-k", seed, 200.0)]
    out = fedast.v3_labels(recs, fedast.SEEDS, fedast.last_image_time)
    h2 = out["H2"].raw
    assert h2.label == "inconclusive" and h2.gain is None
    assert (h2.mean, h2.lo, h2.hi) == pytest.approx((0.0, -0.098162, 0.098162), abs=1e-6)
    assert out["H2"].index_text() == "inconclusive (v2 records, v3 rule)"
    # H1's and H1s's gains 0.45 ... 0.55 lie above 0, but Sync-ST's server rate 1.5 sits at the top of the pilot
    # protocol's grid (0.5, 1, 1.5): no verdict. H2's rates (0.1 in 0.05, 0.1, 0.2) are interior; nothing censored.
    assert out["H1"].raw.label == out["H1s"].raw.label == "lr at grid edge" and out["H1"].raw.mean == pytest.approx(0.5)
    assert out["H1"].raw.lo > 0
    assert fedast.v2_lr_places() == {"FedAST(D)": "interior", "FedAST(S)": "interior", "Sync-ST first-k": "upper edge"}
    assert fedast.v2_checks(recs, fedast.last_image_time) == {
        "H1": (0, 0, True, False), "H1s": (0, 0, True, False), "H2": (0, 0, True, True)}
    assert "**not reproduced** (the interval's upper end 9.8 % against 11.9 %)" in fedast.v3_h2_reading(
        recs, fedast.SEEDS, fedast.last_image_time)
    assert fedast.narrowed_endpoint(recs) == ("LeNet task only (endpoint chosen after v1; the paper's all-task claim "
                                              "is untested)")
    assert "censored at the horizon in 5 of 5 FedAST(D) − Sync-ST pairs" in fedast.narrowed_text(recs)
