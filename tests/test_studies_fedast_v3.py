"""FedAST protocol v3 (scripts/studies/fedast.py): the real third task's cells, and the v3 labels on hand-made records
with hand-computed Holm intervals."""

import math

import numpy as np
import pytest
from studies import fedast

from lightning_fedhet.data import fashion_mnist

SEEDS = tuple(range(8, 23))  # protocol v3's fresh seeds, spelled out (v1 0-2, v2 3-7, pilots 100+)


def test_v3_cells_put_a_fashion_mnist_logistic_regression_in_the_stand_ins_slot():
    # One change from v2's cells in the third slot: the synthetic stand-in (60 features) becomes a multinomial logistic
    # regression on Fashion-MNIST's 784 pixels with the stand-in's step-time factor (the paper's Shakespeare c_m),
    # one client rate for both kinds of method; the image tasks, rates, horizon and targets of the image tasks stay.
    assert [c.method for c in fedast.CELLS_V3] == ["FedAST(D)", "FedAST(S)", "Sync-ST first-k"]
    for cell in fedast.CELLS_V3:
        c = cell.config
        assert c["task_order"] == ["fmnist_lenet", "fmnist_mlp", "fmnist_logreg"]
        assert fedast.task_names(c) == ("fmnist_lenet", "fmnist_mlp", "fmnist_logreg")
        new = c["tasks"]["fmnist_logreg"]
        assert (new["model"], new["model_kwargs"], new["step_time"]) == ("logistic_regression", {"in_features": 784},
                                                                          0.555)
        assert new["client_lr"] == new["client_lr_sync"] == fedast.V3_CLIENT_LR
        assert c["tasks"]["fmnist_lenet"] == fedast.TASK_SPECS["fmnist_lenet"]
        assert c["tasks"]["fmnist_mlp"] == fedast.TASK_SPECS["fmnist_mlp"]
        assert "synthetic_logreg" not in c["tasks"] and "synthetic_logreg" not in c["targets"]
        assert (c["targets"]["fmnist_lenet"], c["targets"]["fmnist_mlp"]) == (0.732, 0.792)
        assert 0.5 < c["targets"]["fmnist_logreg"] < 1.0
        assert c["horizon"] == 1200.0 and c["num_clients"] == 500 and c["local_steps"] == 27
    assert {c.method: c.config["server_lr"] for c in fedast.CELLS_V3} == fedast.CHOSEN_LR_V3
    # the target is the pilot protocol's rule, 0.95 x the best plateau rounded down to 0.001
    best = max(fedast.V3_PILOT["plateau"].values())
    assert fedast.TARGETS_V3["fmnist_logreg"] == math.floor(1000 * 0.95 * best) / 1000


def test_v3_picks_follow_the_pilot_rule_and_pass_the_gates():
    # The pilot protocol's rule on the v3 pilot's numbers: the highest mean accuracy over the grid; every pick
    # interior; the new task's curve moves by less than its target's margin (0.05 x plateau) under every method.
    auc, sync = fedast.V3_PILOT["client_lr_auc"], fedast.V3_PILOT["sync_auc"]
    assert tuple(sorted(auc)) == fedast.V3_CLIENT_LR_GRID and max(auc, key=auc.get) == fedast.V3_CLIENT_LR == 0.01
    assert tuple(sorted(sync)) == fedast.V3_SERVER_GRID["Sync-ST first-k"]
    assert max(sync, key=sync.get) == fedast.CHOSEN_LR_V3["Sync-ST first-k"] == 1.5
    checks = fedast.v3_checks()
    assert {k: place for k, (_, _, place) in checks["places"].items()} == {
        "fmnist_logreg client lr": "interior", "FedAST(D) server lr": "interior", "FedAST(S) server lr": "interior",
        "Sync-ST first-k server lr": "interior"}
    for m in fedast.METHODS:
        assert abs(fedast.V3_PILOT["tail_change"][m]) < 0.05 * fedast.V3_PILOT["plateau"][m]
        assert checks["converged"][m] and checks["interior"][m]


def test_v3_seeds_are_fresh_and_the_canary_stays_v2s():
    assert fedast.SEEDS_BY_PROTOCOL["v3"] == SEEDS == fedast.STUDY.seeds
    used = set(fedast.V1_SEEDS) | set(fedast.SEEDS) | set(fedast.PILOT_SEEDS) | set(range(100, 200))
    assert not used & set(SEEDS)
    assert fedast.STUDY.protocol == "v3" and fedast.STUDY.cells == fedast.CELLS_V3
    # the canary records (two processors) were made from v2's first cell: v3 leaves them valid
    assert fedast.CANARY.config == {**fedast.CELLS[0].config, "horizon": 30.0, "eval_every": 10.0}
    assert "task_order" not in fedast.CANARY.config and fedast.task_names(fedast.CANARY.config) == fedast.TASKS


def test_v3_task_data_gives_the_new_task_its_own_partition_of_fashion_mnist():
    # Each image task's partition is seeded by (seed, its place in the task order): the new task's clients hold 300
    # Fashion-MNIST training images each, and not the LeNet task's images. Slip it catches: a shared partition seed.
    config = fedast.CELLS_V3[0].config
    new, lenet = fedast.task_data(config, "fmnist_logreg", 8), fedast.task_data(config, "fmnist_lenet", 8)
    train, _ = fashion_mnist()
    assert new["x"].shape[1:] == (1, 28, 28) and len(new["clients"]) == 500
    assert all(len(idx) == 300 for idx in new["clients"])
    assert new["x"].flatten(1).shape[1] == 784 and len(new["test_y"]) == 10_000
    assert int(new["y"].shape[0]) == len(train)
    assert any(not np.array_equal(a, b) for a, b in zip(new["clients"], lenet["clients"]))


def _record(method: str, seed: int, last: float | None) -> dict:
    """A v3 record whose image tasks finish at 50 and 60 s and whose new task (the last) at ``last`` s."""
    return {"protocol": "v3", "method": method, "seed": seed, "config": {"horizon": 1200.0},
            "metrics": {"time_to_target": {"fmnist_lenet": 50.0, "fmnist_mlp": 60.0, "fmnist_logreg": last}}}


def _records(seeds=SEEDS) -> list[dict]:
    """Sync-ST at 400 s, FedAST(S) at 200 s, FedAST(D) at 180 s (7 seeds), 220 s (7 seeds), 200 s (the last)."""
    d_times = [180.0] * 7 + [220.0] * 7 + [200.0]
    recs = []
    for seed, d in zip(seeds, d_times):
        recs += [_record("FedAST(D)", seed, d), _record("FedAST(S)", seed, 200.0),
                 _record("Sync-ST first-k", seed, 400.0)]
    return recs


@pytest.fixture
def settled(monkeypatch):
    """The pilot's convergence check passed by every method (plateau 80 %: bound 4 pp; changes 0.5 pp)."""
    monkeypatch.setitem(fedast.V3_PILOT, "plateau", dict.fromkeys(fedast.METHODS, 0.8))
    monkeypatch.setitem(fedast.V3_PILOT, "tail_change", dict.fromkeys(fedast.METHODS, 0.005))


def test_v3_labels_by_hand_on_holm_intervals(settled):
    """Gains on the last task's time, per seed:
    H1  (400 - T_D) / 400: 0.55 x7, 0.45 x7, 0.5: mean 0.5, sd sqrt(14 x 0.05^2 / 14) = 0.05;
    H1s (400 - 200) / 400 = 0.5 on every seed: sd 0, p-value 0;
    H2  (200 - T_D) / 200: 0.1 x7, -0.1 x7, 0: mean 0, sd 0.1, p-value 1.
    Holm over the three (alpha 0.05): H1s first at alpha/3 (width 0, excludes 0), H1 next at alpha/2:
    half-width t_{0.9875,14} x 0.05 / sqrt(15) = 2.5095694 x 0.0129099 = 0.0323984, then H2 at alpha:
    t_{0.975,14} x 0.1 / sqrt(15) = 2.1447867 x 0.0258199 = 0.0553782. H1, H1s lie above 0: reproduced; H2 holds 0
    and is direction only (the paper's "up to 11.9 %" bounds it from above): inconclusive, with no seed count."""
    out = fedast.v3_decisions(_records(), SEEDS)
    h1, h1s, h2 = (out[k][0] for k in ("H1", "H1s", "H2"))
    assert (h1.mean, h1.lo, h1.hi) == pytest.approx((0.5, 0.5 - 0.0323984, 0.5 + 0.0323984), abs=1e-6)
    assert (h1s.lo, h1s.hi) == pytest.approx((0.5, 0.5))
    assert (h2.mean, h2.lo, h2.hi) == pytest.approx((0.0, -0.0553782, 0.0553782), abs=1e-6)
    assert h1.label == h1s.label == "reproduced" and h1.gain == 0.401
    assert h2.label == "inconclusive" and h2.gain is None and h2.text() == "inconclusive"
    assert all(out[k][2] == 0 for k in out)  # no censored pair


def test_v3_labels_wait_for_every_planned_seed(settled):
    out = fedast.v3_decisions(_records(SEEDS[:14]), SEEDS)
    assert {k: d.text() for k, (d, _, _) in out.items()} == dict.fromkeys(("H1", "H1s", "H2"), "pending (14/15 seeds)")


def test_v3_gates_a_sync_curve_that_still_moves_and_a_rate_at_its_grid_edge(settled, monkeypatch):
    # Sync-ST's new-task curve still moving by 5 pp over the last 20 % (bound 0.05 x 0.8 = 4 pp): the two claims
    # against Sync-ST get no verdict, H2 (FedAST(D) vs FedAST(S)) keeps its own.
    monkeypatch.setitem(fedast.V3_PILOT["tail_change"], "Sync-ST first-k", 0.05)
    out = fedast.v3_decisions(_records(), SEEDS)
    assert [out[k][0].label for k in ("H1", "H1s", "H2")] == ["not converged", "not converged", "inconclusive"]
    monkeypatch.setitem(fedast.V3_PILOT["tail_change"], "Sync-ST first-k", -0.039)  # inside the 4-pp bound
    monkeypatch.setitem(fedast.CHOSEN_LR_V3, "Sync-ST first-k", fedast.V3_SERVER_GRID["Sync-ST first-k"][-1])
    out = fedast.v3_decisions(_records(), SEEDS)
    assert [out[k][0].label for k in ("H1", "H1s", "H2")] == ["lr at grid edge", "lr at grid edge", "inconclusive"]


def test_v3_counts_a_run_that_never_reached_the_last_target_at_the_horizon(settled):
    # Sync-ST's new task censored on the last seed: its time is the horizon, 1,200 s, so that seed's H1 gain is
    # (1200 - 200) / 1200 = 5/6, and the pair is counted as censored in the row's label.
    recs = _records()
    recs[-1] = _record("Sync-ST first-k", SEEDS[-1], None)
    d, gains, censored = fedast.v3_decisions(recs, SEEDS)["H1"]
    assert gains[SEEDS[-1]] == pytest.approx(5 / 6) and censored == 1
    summaries: list = []
    text = "\n".join(fedast._v3_claims(recs, SEEDS, 1200.0, summaries))
    assert "**reproduced (1 of 15 pairs censored at 1200 s)**" in text
    assert summaries[0].verdict == "reproduced (1 of 15 pairs censored at 1200 s)"
