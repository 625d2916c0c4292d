"""The FedACS study module (scripts/studies/fedacs.py): the paper's FedVarp (eq. 114) by hand, and a 2-round run."""


import numpy as np
import pytest
import torch
from studies import fedacs

from lightning_fedhet.algorithms import ClientInfo
from lightning_fedhet.experiments import Cell


def test_paper_fedvarp_fills_a_lost_upload_with_the_last_received_update():
    # Eq. (114) transcribed: X += s (1/K) [sum_received c_m D_m^r + sum_lost c_m D_m^{r'_m}], s = sum w s a / sum w a.
    # Slips it catches: the SAGA form (memory of every client added), dividing by the arrivals, no calibration.
    K, s, a = 20, [1.0, 0.5], [1, 3]
    scale = (0.5 * 1.0 * 1 + 0.5 * 0.5 * 3) / (0.5 * 1 + 0.5 * 3)  # 0.625
    algo = fedacs.PaperFedVarp(K)
    algo.setup(num_clients=2, init_params=torch.zeros(1), client_weights=torch.tensor([0.5, 0.5]))
    rng = np.random.default_rng(0)
    expected = 0.0
    for t, arrivals in enumerate(({0: 1.0, 1: 10.0}, {0: 2.0})):
        algo.observe_system(t, success_probs=s, local_steps=a)
        counts = algo.select(t, torch.tensor([True, True]), rng).tolist()
        assert all(c > 0 for c in counts)
        algo.open_round(t, None)
        for m, d in arrivals.items():
            algo.add(m, torch.tensor([d]), ClientInfo(num_samples=1, local_steps=a[m]))
        w = algo.close_round()
        fresh = sum(counts[m] / K * d for m, d in arrivals.items())
        stale = counts[1] / K * 10.0 if 1 not in arrivals else 0.0  # client 1's round-0 update stands in
        expected += scale * (fresh + stale)
        assert float(w) == pytest.approx(expected)


def test_epoch_steps_are_epochs_times_batches_per_epoch():
    # client sizes 120 and 30 at B = 50: 3 and 1 mini-batches per epoch; static epochs 1 and 3
    steps = fedacs.EpochSteps(np.array([3, 1]), epochs=np.array([1, 3]))
    assert steps.sample(0, 2, 0).tolist() == [3, 3]
    drawn = fedacs.EpochSteps(np.array([3, 1]), low=[1, 20], high=[10, 30]).sample(5, 2, 0)
    assert drawn[0] % 3 == 0 and 1 <= drawn[0] // 3 <= 10 and 20 <= drawn[1] <= 30


@pytest.mark.parametrize("method", ["FedACS", "FedVarp"])
def test_run_cell_two_rounds_on_a_tiny_stand_in(method):
    config = {**fedacs.BASE, "heterogeneity": fedacs.heterogeneity("dynamic"), "rounds": 2, "per_client": 10,
              "test_size": 50, "synthetic_data": True}
    out = fedacs.run_cell(Cell("dynamic", method, config), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and len(m["val_acc"]) == 2 and len(m["local_steps"]) == 2
    assert all(0.0 <= v <= 1.0 for v in m["val_acc"]) and all(r <= t for r, t in zip(m["received"], m["trained"]))


def _v2_record(method, setting, seed, accs, losses, calibration):
    return {"protocol": "v2", "method": method, "setting": setting, "seed": seed,
            "metrics": {"val_acc": accs, "val_loss": losses, "calibration": calibration}}


def test_acceptance_names_each_collapsed_run_and_counts_per_cell():
    """Two v2 records by hand: FedACS (calibrated), dynamic, seed 4 ends at accuracies 0.10 x 4 and 0.14 (mean of the
    last five 0.108 <= 0.15: collapsed; largest loss inf, largest multiplier 7.72 -> "7.7"); FedACS, dynamic, seed 4
    ends at 0.6 (not collapsed). So 1 of 1 calibrated dynamic run collapsed, 0 of 1 uncalibrated, the other cells 0 of
    0, and the criterion has failed although most planned runs are missing."""
    recs = [_v2_record("FedACS (calibrated)", "dynamic", 4, [0.5, 0.1, 0.1, 0.1, 0.1, 0.14],
                       [2.0, float("inf"), 3.0], [1.0, 7.72, 2.0]),
            _v2_record("FedACS", "dynamic", 4, [0.6] * 6, [1.0, 1.2], [1.0, 1.0])]
    page, index = fedacs.acceptance(recs)
    assert page.startswith("**Protocol v2's acceptance criterion failed.**")
    assert "FedACS, dynamic: 0 of 1; FedACS, static: 0 of 0; FedACS (calibrated), dynamic: 1 of 1" in page
    assert "seed 4: final 10.8 %, largest val loss inf, largest multiplier 7.7" in page
    assert index == ("protocol v2's acceptance criterion failed: FedACS (calibrated) collapsed in 1 of 1 dynamic runs "
                     "(finals 10.8 %; largest val loss inf)")


def test_acceptance_is_undecided_without_a_collapse_until_every_planned_run_exists():
    """One uncollapsed record of the 40 planned (2 methods x 2 settings x 10 seeds): not decided, no index clause;
    a largest loss of 3.54e32 prints as "3.5e32"."""
    recs = [_v2_record("FedACS", "static", 0, [0.6] * 6, [1.0], [1.0])]
    page, index = fedacs.acceptance(recs)
    assert page.startswith("**Protocol v2's acceptance criterion is not decided yet (1 of 40 runs).**")
    assert index == ""
    assert fedacs._loss(3.54e32) == "3.5e32" and fedacs._loss(48.1) == "48"


def _rounds_record(method: str, setting: str, seed: int, hit: int) -> dict:
    """A v2 record whose accuracy first reaches the threshold at round ``hit`` of 30."""
    return {"protocol": "v2", "method": method, "setting": setting, "seed": seed,
            "config": {"rounds": 30, "threshold": 0.5},
            "metrics": {"round": list(range(1, 31)), "val_acc": [0.1] * (hit - 1) + [0.6] * (31 - hit)}}


def test_v2_claims_under_the_v3_rule_from_the_rounds_ratio():
    """Dynamic: FedACS reaches 50 % at round 10 in every seed, FedAvg at round 4 (even seeds) or 6 (odd): the gain
    rounds(FedAvg) / rounds(FedACS) - 1 is -0.6 or -0.4, mean -0.5, sd 0.1 sqrt(10/9) = 0.10541, half-width
    t_{0.975,9} x 0.10541 / sqrt(10) = 2.262157 x 0.033333 = 0.075406: [-0.5754, -0.4246] lies below 0, opposite
    sign (the paper's effect: 1.43 - 1 = 0.43). The three other claims have no record: pending at 0 of 10."""
    recs = [r for s in range(10) for r in (_rounds_record("FedACS", "dynamic", s, 10),
                                           _rounds_record("FedAvg", "dynamic", s, 6 if s % 2 else 4))]
    out = fedacs.v3_labels(recs)
    assert set(out) == {("dynamic", "FedAvg"), ("dynamic", "c-a-FedAvg"), ("dynamic", "FedVarp"), ("static", "FedAvg")}
    d = out[("dynamic", "FedAvg")].raw
    assert d.label == "opposite sign" and d.gain == pytest.approx(0.43)
    assert (d.mean, d.lo, d.hi) == pytest.approx((-0.5, -0.5754, -0.4246), abs=1e-4)
    assert out[("static", "FedAvg")].index_text() == "pending (0/10 seeds) (v2 records, v3 rule)"


def test_v2_claims_are_held_to_the_censoring_check_and_the_learning_rate_grid():
    """The convergence check of a first-passage metric, by hand. Dynamic FedAvg vs FedACS: FedACS reaches 50 % at
    round 10, FedAvg at round 4 or 6 (gain -0.6 / -0.4, interval [-0.575, -0.425] below 0). FedACS never reaching
    the threshold in seed 0 counts round 31: the gain there, 4/31 - 1, is an upper bound, which an opposite sign
    survives (the check passes, the label stays). The baseline never reaching it in seed 1 makes its gain
    31/10 - 1 = 2.1 a lower bound, against the interval's side: not converged. Pushing the baseline's gains above
    0 (FedAvg at 20/22, FedACS at 10) with FedACS censored in seed 0 fails the check for a reproduced claim, and so
    does a pair with both runs censored (its 31 / 31 hides a gain of either sign). The client learning rate 0.05
    sits inside the pilots' grid (0.02, 0.05, 0.1)."""
    def labels(acs_hit: dict, avg_hit: dict) -> tuple[str, str]:
        recs = [r for s in range(10)
                for r in (_rounds_record("FedACS", "dynamic", s, acs_hit.get(s, 10)),
                          _rounds_record("FedAvg", "dynamic", s, avg_hit.get(s, 6 if s % 2 else 4)))]
        out = fedacs.v3_labels(recs)[("dynamic", "FedAvg")].raw
        return out.label, fedacs.checks_section(recs)[1].splitlines()[2]

    label, row = labels({0: 31}, {})
    assert label == "opposite sign" and row == "| dynamic: FedAvg vs FedACS | 10 | 1 | 0 | passes |"
    label, row = labels({}, {1: 31})
    assert label == "not converged" and row == "| dynamic: FedAvg vs FedACS | 10 | 0 | 1 | **fails** |"
    up = {s: 20 if s % 2 else 22 for s in range(10)}
    assert labels({}, up)[0] == "reproduced"
    assert labels({0: 31}, {**up, 0: 31})[0] == "not converged"  # both censored: 31 / 31 hides a gain of any sign
    assert labels({0: 31}, up)[0] == "not converged"
    assert fedacs.grid_place(fedacs.BASE["lr"], fedacs.LR_GRID) == "interior"
