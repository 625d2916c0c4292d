"""The UPGA-PL study module (scripts/studies/upgapl.py): the decaying step size reaches the clients under vmap, the
loss groups, and the coded decision rules. No heavy training: runs use 4 clients and 3 rounds."""

import math

import numpy as np
import pytest
from studies import upgapl

from lightning_fedhet.experiments import Cell

TINY = {"num_clients": 4, "rounds": 3, "eval_every": 1, "local_steps": 1}


def test_harmonic_factor_matches_the_hand_values():
    decay = upgapl.HarmonicDecay(10)
    assert [decay(t) for t in (0, 10, 190)] == pytest.approx([1.0, 0.5, 0.05])


def test_the_decaying_step_size_is_applied_once_per_round_under_vmap():
    # slip caught: a scheduler with interval="step", or none at all, would give [0.1, 0.1, 0.1] (or the vmap engine
    # refuses it); eta_t = 0.1 * 10 / (10 + t)
    cell = Cell("decaying", "UPGA-PL", upgapl.make_config("UPGA-PL", 0.1, **TINY))
    out = upgapl.run_cell(cell, seed=1)
    assert out["engine"] == "vmap"
    assert out["metrics"]["lr"] == pytest.approx([0.1, 1 / 11, 1 / 12], rel=1e-5)
    assert out["metrics"]["round"] == [1, 2, 3] and len(out["metrics"]["val_loss"]) == 3
    assert out["config"]["q"].count(0.1) == 2 and out["config"]["q"].count(0.9) == 2


def test_the_lossless_reference_receives_every_update():
    cell = Cell("constant", "FedAvg (lossless)",
                        upgapl.make_config("FedAvg (lossless)", 0.05, lr_schedule="constant", **TINY))
    out = upgapl.run_cell(cell, seed=1)
    assert out["metrics"]["received_per_round"] == [4, 4, 4] and out["metrics"]["lr"] == [0.05] * 3


def test_loss_groups_are_half_and_half_and_seeded():
    config = upgapl.make_config("UPGA-PL", 0.1)
    q0, q0_again, q1 = (upgapl.loss_probabilities(config, s) for s in (0, 0, 1))
    assert sorted(q0.tolist()) == [0.1] * 5 + [0.9] * 5
    assert np.array_equal(q0, q0_again) and not np.array_equal(q0, q1)


def _record(setting, method, seed, final, tail_std=0.0):
    acc = [0.1] * 30 + [final + tail_std * (-1) ** k for k in range(10)]
    return {"protocol": "v1", "setting": setting, "method": method, "seed": seed, "commit": "abc", "dirty": False,
            "engine": "vmap", "device": "cpu", "torch": "2", "wall_s": 1.0, "cpu_s": 1.0,
            "config": upgapl.make_config(method, 0.1),
            "metrics": {"round": list(range(5, 205, 5)), "val_acc": acc, "received_per_round": [5] * 200,
                        "empty_rounds": [0]}}


def test_report_verdicts_follow_the_protocol_rules(tmp_path):
    records = []
    for seed in range(10):
        j = 0.002 * (1 if seed % 2 else -1)
        records += [_record("decaying", "UPGA-PL", seed, 0.90 + j), _record("decaying", "DMA-PL", seed, 0.87),
                    _record("decaying", "FedAvg (lossless)", seed, 0.905),
                    _record("decaying", "UDMA-PL", seed, 0.60, tail_std=0.1)]
    verdicts = {s.claim.split(":")[0].removeprefix("v1, "): s.verdict for s in upgapl.write_report(records, tmp_path)
                if s.claim.startswith("v1")}
    # +3 pp over DMA-PL, interval above 0 but below 12/2 pp; -0.5 pp from lossless, inside the 1 pp margin;
    # UDMA-PL at 60 % and oscillating
    assert verdicts == {"U1": "partly reproduced", "U2": "reproduced", "U3": "reproduced"}
    assert "| UPGA-PL − DMA-PL | 3.0 pp [2.8, 3.2] | 10 | 10/10 |" in (tmp_path / "upgapl.md").read_text()


def test_the_near_and_udmapl_rules():
    assert upgapl._verdict_near(-0.02, -0.005, 0.01) == "partly reproduced"
    assert upgapl._verdict_near(-0.03, -0.02, -0.01) == "not reproduced"
    assert upgapl._verdict_udmapl(0.8, (0.05, 0.01, 0.09, 10)) == "partly reproduced"
    assert upgapl._verdict_udmapl(0.8, (0.0, -0.01, 0.01, 10)) == "not reproduced"
    assert upgapl._verdict_udmapl(math.nan, (0.0, -0.01, 0.01, 10)) == "pending"


def test_v2_cells_take_their_step_sizes_from_the_thesis_grid_and_record_the_data():
    assert upgapl.STUDY.protocol == "v2" and {c.method for c in upgapl.CELLS} == set(upgapl.METHODS)
    for cell in upgapl.CELLS:
        assert cell.config["lr_schedule"] == "constant"
        assert any(math.isclose(cell.config["lr"], g) for g in upgapl.THESIS_GRID)
    cell = Cell("thesis-grid", "UPGA-PL", {**upgapl.CELLS[0].config, **TINY})
    out = upgapl.run_cell(cell, seed=1)
    assert len(out["data_checksum"]) == 64 and out["metrics"]["lr"] == [cell.config["lr"]] * 3


def test_v2_power_marks_u2_not_testable_when_its_margin_needs_more_seeds(tmp_path):
    # v1 `constant` records whose UPGA-PL - lossless differences alternate +-5 pp: SD ~5.3 pp, far too wide for the
    # 1 pp margin at 10 seeds; UPGA-PL - DMA-PL constant (SD 0): U1 stays testable
    records = []
    for seed in range(10):
        j = 0.05 * (1 if seed % 2 else -1)
        records += [_record("constant", "UPGA-PL", seed, 0.90 + j), _record("constant", "DMA-PL", seed, 0.80 + j),
                    _record("constant", "FedAvg (lossless)", seed, 0.90), _record("constant", "UDMA-PL", seed, 0.6)]
    rows, ruled_out = upgapl.power_rows(records)
    assert set(ruled_out) == {"U2"} and ruled_out["U2"].startswith("not testable here (needs ")
    verdicts = {s.claim.split(":")[0]: s.verdict for s in upgapl.write_report(records, tmp_path)}
    assert verdicts["v2, U2"] == ruled_out["U2"] and verdicts["v2, U1"] == "pending"


def test_a_v2_page_with_records_labels_u2_and_keeps_the_estimate(tmp_path):
    # slip caught: the not-testable label overwriting the section's text (a TypeError on the first v2 record)
    # v1 `constant` records whose UPGA-PL alternates +-5 pp: U2's 1 pp margin is out of reach at 10 seeds
    records = [_record("constant", m, s, 0.9 + (0.05 * (-1) ** s if m == "UPGA-PL" else 0.0))
               for m in upgapl.METHODS for s in range(10)]
    for r in [_record("thesis-grid", m, s, 0.9 - 0.01 * (m == "UPGA-PL")) for m in upgapl.METHODS for s in range(10)]:
        records.append({**r, "protocol": "v2"})
    summaries = upgapl.write_report(records, tmp_path)
    u2 = next(s for s in summaries if s.claim.startswith("v2, U2"))
    assert u2.verdict.startswith("not testable here (needs ")
    assert "-1.0 pp" in u2.ours
