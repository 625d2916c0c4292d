"""The FedStale study module (scripts/studies/fedstale.py): v1's low-group swap, v2's every-client swap (the authors'
code), a 2-round run, and stacked seeds equal to single-seed runs."""


import numpy as np
import pytest
from studies import fedstale

from lightning_fedhet.data import IID
from lightning_fedhet.experiments import Cell

TINY_V1 = {**fedstale.V1_BASE, "beta": 0.5, "rounds": 2, "eval_every": 1, "metric_window_rounds": 2,
           "test_per_client": 10, "synthetic_data": True}
TINY = {**fedstale.BASE, "beta": 0.5, "rounds": 2, "eval_every": 1, "metric_window_rounds": 2, "test_per_client": 10,
        "synthetic_data": True}


def test_only_the_low_group_swaps_and_its_test_shards_carry_the_same_swap():
    # sigma = 1: every class-0 sample of a low-group client reads 1 and vice versa, in training and test shards;
    # high-group labels are untouched. Slips it catches: swapping the always-on group, swapping every client (the
    # code's reading), leaving the test shards unswapped (accuracy would then not measure the clients' objective).
    config = {**TINY_V1, "sigma": 1.0}
    data = fedstale.datamodule(config, seed=3)
    low = fedstale.groups(config).low_group(config["num_clients"], 3)
    assert low.sum() == 12
    original = fedstale._stand_in(24 * 20, 24 * 10)[0].tensors[1].numpy()
    swapped = data.train_dataset.tensors[1].numpy()
    for client, idx in enumerate(data.client_indices):
        before, after = original[idx], swapped[idx]
        if low[client]:
            expect = np.where(before == 0, 1, np.where(before == 1, 0, before))
        else:
            expect = before
        assert np.array_equal(after, expect)
    # test shards: an IID split into 24 shards of 10 images; exactly the class-0/1 images of the low group's shards
    # changed label (the stand-in test set has 240 images, all picked, in order)
    val_y = data.val_dataset.tensors[1].numpy()
    true_y = fedstale._stand_in(24 * 20, 24 * 10)[1].tensors[1].numpy()
    shards = IID().split(true_y, 24, 3)
    assert sorted(len(s) for s in shards) == [10] * 24
    expect = np.zeros(240, dtype=bool)
    for client, idx in enumerate(shards):
        expect[idx] = low[client] & np.isin(true_y[idx], [0, 1])
    assert np.array_equal(val_y != true_y, expect)
    assert np.array_equal(val_y[expect], 1 - true_y[expect])


def test_run_cell_two_rounds_on_a_tiny_stand_in():
    out = fedstale.run_cell(Cell(fedstale.SETTING, "beta=0.5", TINY), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and len(m["val_acc"]) == 2 and all(0.0 <= v <= 1.0 for v in m["val_acc"])
    # the 12 always-on clients arrive every round
    assert all(12 <= r <= 24 and r - lo == 12 for r, lo in zip(m["received"], m["received_low"]))
    assert len(out["config"]["low_group"]) == 12
    record = {"metrics": m, "config": {**TINY, **out["config"]}}
    assert fedstale.final_acc(record) == np.mean(m["val_acc"])


def test_v2_every_client_swaps_its_pair_by_parity_in_training_and_test_shards():
    # sigma = 1, the authors' layout: client i swaps (0, 1) when i is even and (8, 9) when odd, whatever its
    # participation group. Slips it catches: swapping the low group only (v1), one pair for everybody, a test set
    # left unswapped.
    config = {**TINY, "sigma": 1.0}
    data = fedstale.datamodule(config, seed=3)
    original = fedstale._stand_in(24 * 20, 24 * 10)[0].tensors[1].numpy()
    swapped = data.train_dataset.tensors[1].numpy()
    for client, idx in enumerate(data.client_indices):
        a, b = (0, 1) if client % 2 == 0 else (8, 9)
        before = original[idx]
        assert np.array_equal(swapped[idx], np.where(before == a, b, np.where(before == b, a, before)))
    val_y = data.val_dataset.tensors[1].numpy()
    true_y = fedstale._stand_in(24 * 20, 24 * 10)[1].tensors[1].numpy()
    for client, idx in enumerate(IID().split(true_y, 24, 3)):
        a, b = (0, 1) if client % 2 == 0 else (8, 9)
        assert np.array_equal(val_y[idx], np.where(true_y[idx] == a, b, np.where(true_y[idx] == b, a, true_y[idx])))


def test_stacked_seeds_give_each_seed_its_single_seed_run():
    # run_seeds stacks the seeds in one fit_seeds run; each seed's accuracy curve, arrivals and data checksum must
    # be its own single-seed run's (same draws, same data, accuracy within float tolerance of the vmap engine).
    cell = Cell(fedstale.SETTING, "beta=0.8", {**TINY, "beta": 0.8})
    stacked = fedstale.run_seeds(cell, [0, 1])
    for seed, out in zip([0, 1], stacked):
        single = fedstale.run_cell(cell, seed)
        assert out["metrics"]["received"] == single["metrics"]["received"]
        assert out["metrics"]["round"] == single["metrics"]["round"]
        assert np.allclose(out["metrics"]["val_acc"], single["metrics"]["val_acc"], atol=1e-3)
        assert out["data_checksum"] == single["data_checksum"] and len(out["data_checksum"]) == 64
    assert stacked[0]["data_checksum"] != stacked[1]["data_checksum"]


def _v3_record(beta, seed, acc, late=0.0):
    """A v3 record whose accuracy is ``acc`` at every evaluation, plus ``late`` from round 136 on."""
    cell = next(c for c in fedstale.V3_CELLS if c.config["beta"] == beta)
    rounds = list(range(2, 151, 2))
    return {"study": "fedstale", "protocol": "v3", "setting": cell.setting, "method": cell.method, "seed": seed,
            "commit": "abc", "dirty": False, "engine": "vmap", "device": "cpu", "torch": "2", "wall_s": 1.0,
            "cpu_s": 1.0, "config": cell.config,
            "metrics": {"round": rounds, "val_acc": [acc + (late if r > 135 else 0.0) for r in rounds],
                        "received": [12] * 150, "received_low": [2] * 150}}


def test_v3_claims_by_the_rule_on_holm_intervals_and_the_convergence_check(tmp_path):
    """18 seeds. beta 0.8 - beta 0 = beta 0.8 - beta 1 = +1 pp on every seed (SD 0): every interval is [1, 1] pp ->
    C1, C2 reproduced. beta 0.5 = beta 0 = beta 1 +/- 0.1 pp alternating over the seeds (mean 0) -> C3, C4 hold 0:
    inconclusive (no paper number). Then beta 1's curve jumps by 2 pp from round 136
    on: its tail change (rounds 136-150 minus 121-135) is +2 pp > 1 pp -> C2 and C4 not converged, C1 and C3 not."""
    def records(late_for_beta1=0.0):
        out = []
        for seed in fedstale.V3_SEEDS:
            wiggle = 0.001 if seed % 2 else -0.001
            out += [_v3_record(0.0, seed, 0.70), _v3_record(0.8, seed, 0.71), _v3_record(0.2, seed, 0.70),
                    _v3_record(1.0, seed, 0.70, late_for_beta1),
                    _v3_record(0.5, seed, 0.70 + wiggle)]
        return out

    labels = {s.claim.split()[0]: s.verdict for s in fedstale.write_report(records(), tmp_path)
              if s.claim.endswith("[v3]")}
    assert labels == {"C1": "reproduced", "C2": "reproduced", "C3": "inconclusive", "C4": "inconclusive"}
    labels = {s.claim.split()[0]: s.verdict for s in fedstale.write_report(records(0.02), tmp_path)
              if s.claim.endswith("[v3]")}
    assert labels["C1"] == "reproduced" and labels["C3"] == "inconclusive"
    assert labels["C2"] == "not converged" and labels["C4"] == "not converged"
    page = (tmp_path / "fedstale.md").read_text()
    assert "+2.00 pp" in page and "0.316228 (interior)" in page
    short = [r for r in records() if r["seed"] != fedstale.V3_SEEDS[-1]]
    labels = {s.claim.split()[0]: s.verdict for s in fedstale.write_report(short, tmp_path) if s.claim.endswith("[v3]")}
    assert set(labels.values()) == {"pending (17/18 seeds)"}


def test_v4_runs_c2s_two_cells_of_v3_on_74_fresh_seeds():
    # protocol v4: beta 0.8 and FedVARP in v3's setting; 74 seeds (80 % power for 0.31 pp at v3's paired SD of C2,
    # 0.94 pp), none used by v1-v3 (0-37) or the pilots (100)
    assert fedstale.PROTOCOL == "v4" and fedstale.V4_CLAIM == "C2"
    assert fedstale.SEEDS == tuple(range(200, 274)) and len(fedstale.SEEDS) == 74
    assert not set(fedstale.SEEDS) & (set(range(38)) | {100})
    assert [c.config["beta"] for c in fedstale.CELLS] == [0.8, 1.0]
    for cell in fedstale.CELLS:
        (v3,) = [c for c in fedstale.V3_CELLS if c.method == cell.method]
        assert (cell.setting, cell.config) == (v3.setting, v3.config)
    # the canary stays v3's first cell (its committed record)
    assert fedstale.CANARY.setting == fedstale.V3_CELLS[0].setting and fedstale.CANARY.config["beta"] == 0.0
    # the plan: v3's committed C2 records (beta 0.8 - FedVARP over seeds 20-37) give the SD that needs 74 seeds
    import json
    from pathlib import Path

    from lightning_fedhet.experiments import by_seed, seeds_for_power
    root = Path(__file__).resolve().parents[1] / "docs/results/records/fedstale/v3"
    v3 = [json.loads(f.read_text()) for f in root.rglob("*.json")]
    a, b = (by_seed(v3, fedstale.final_acc, method=fedstale.method_name(x)) for x in (0.8, 1.0))
    assert sorted(a) == sorted(b) == list(fedstale.V3_SEEDS)
    sd = float(np.std([a[k] - b[k] for k in a], ddof=1))
    assert sd == pytest.approx(0.00939, abs=5e-5)
    assert seeds_for_power(sd, fedstale.PAPER_DELTA1 / 100) == len(fedstale.SEEDS) == 74


def test_v4_decides_c2_on_its_raw_interval_with_v3s_checks(tmp_path):
    """74 seeds: beta 0.8 - FedVARP = +0.1 pp +- 0.5 pp alternating (37 each), sd = 0.5 sqrt(74/73) = 0.50341 pp,
    half-width t_{0.975, 73} sd / sqrt(74) = 1.99300 (scipy) x 0.50341 / 8.60233 = 0.11663 pp -> [-0.017, 0.217] pp:
    holds 0 and lies below 0.31 pp -> not reproduced. FedVARP's curve 2 pp higher from round 136 on: tail change
    +2 pp >= 1 pp -> not converged. 73 seeds -> pending."""
    def records(late: float = 0.0, seeds=fedstale.SEEDS) -> list[dict]:
        out = []
        for k, seed in enumerate(seeds):
            d = 0.001 + (0.005 if k % 2 else -0.005)
            out += [{**_v3_record(0.8, seed, 0.76 + d), "protocol": "v4"},
                    {**_v3_record(1.0, seed, 0.76, late), "protocol": "v4"}]
        return out

    def label(recs: list[dict]) -> str:
        (s,) = [s for s in fedstale.write_report(recs, tmp_path) if s.claim.endswith("[v4]")]
        return s.verdict

    assert label(records()) == "not reproduced"
    row = next(line for line in (tmp_path / "fedstale.md").read_text().splitlines() if line.startswith("| C2 | b")
               and "74/74" in line)
    assert "0.10 pp [-0.02, 0.22]" in row and "| 0.50 |" in row  # "-0.0" would hide the sign: two decimals
    assert row.endswith("| **not reproduced** | pending |")  # v3's label beside: no v3 record here
    # a run outside the plan (seed 300, a far-off gain) is not pooled in
    stray = [{**_v3_record(0.8, 300, 0.90), "protocol": "v4"}, {**_v3_record(1.0, 300, 0.70), "protocol": "v4"}]
    assert label(records() + stray) == "not reproduced"
    assert label(records(0.02)) == "not converged"
    assert label(records(seeds=fedstale.SEEDS[:-1])) == "pending (73/74 seeds)"


def test_v4_records_leave_v3s_claims_alone(tmp_path):
    """v3's 18 seeds with every claim at +1 pp or 0 (as the v3 test), plus v4 records of the same setting name whose
    beta 0.8 is 5 pp below FedVARP: v3's labels and seed counts do not move."""
    v3 = []
    for seed in fedstale.V3_SEEDS:
        v3 += [_v3_record(0.0, seed, 0.70), _v3_record(0.8, seed, 0.71), _v3_record(0.2, seed, 0.70),
               _v3_record(1.0, seed, 0.70), _v3_record(0.5, seed, 0.70 + (0.001 if seed % 2 else -0.001))]
    v4 = [{**_v3_record(b, seed, acc), "protocol": "v4"} for seed in fedstale.SEEDS
          for b, acc in ((0.8, 0.65), (1.0, 0.70))]
    labels = {s.claim.split()[0]: s.verdict for s in fedstale.write_report(v3 + v4, tmp_path)
              if s.claim.endswith("[v3]")}
    assert labels == {"C1": "reproduced", "C2": "reproduced", "C3": "inconclusive", "C4": "inconclusive"}
    page = (tmp_path / "fedstale.md").read_text()
    assert "| C2 | beta=0.8 - beta=1 (FedVARP) | 18 | 1.0 pp [1.0, 1.0] |" in page
    assert page.count("| **opposite sign** | reproduced |") == 1  # v4's row, v3's label beside
