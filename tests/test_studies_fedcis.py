"""The Fed-CIS study module (scripts/studies/fedcis.py): BatchNorm statistics through the rule, and a 2-round run."""


import pytest
import torch
from studies import fedcis
from torch import nn

from lightning_fedhet.experiments import Cell


def test_running_statistics_become_frozen_parameters_that_batchnorm_still_updates():
    # Slip it catches: statistics left as buffers (the server would average them over every arrival) or made
    # trainable (SGD and weight decay would move them).
    bn = nn.Sequential(nn.BatchNorm1d(3))
    assert fedcis.stats_as_parameters(bn) == 2
    names = {n for n, _ in bn.named_parameters()}
    assert {"0.running_mean", "0.running_var"} <= names and not bn[0].running_mean.requires_grad
    x = torch.tensor([[1.0, 2.0, 3.0], [3.0, 6.0, 9.0]])
    bn.train()
    bn(x)
    # momentum 0.1: running_mean = 0.9 * 0 + 0.1 * batch mean; running_var = 0.9 * 1 + 0.1 * unbiased variance
    assert torch.allclose(bn[0].running_mean, 0.1 * torch.tensor([2.0, 4.0, 6.0]))
    assert torch.allclose(bn[0].running_var, 0.9 + 0.1 * torch.tensor([2.0, 8.0, 18.0]))


@pytest.mark.parametrize("setting", list(fedcis.SETTINGS))
def test_run_cell_two_rounds_on_a_tiny_stand_in(setting):
    config = {**fedcis.BASE, "base_width": 4, "rounds": 2, "eval_every": 1, "local_steps": 1, "batch_size": 8,
              "train_size": 140, "test_size": 40, "synthetic_data": True,
              "aggregation_base": fedcis.SETTINGS[setting]}
    out = fedcis.run_cell(Cell(setting, "Serving Rate", config), seed=0)
    m = out["metrics"]
    assert m["round"] == [1, 2] and all(0.0 <= v <= 1.0 for v in m["cis_acc"])
    assert out["config"]["lambda_tilde"] == [0.8, 0.15, 0.05]
    assert sum(out["config"]["node_sizes"]) == 140


def test_v2_cells_cover_every_serving_column_but_the_equal_one():
    # 33-33-33 is left out because its serving rates are equal: Serving Rate's weights are then Equal Weight's
    assert set(fedcis.COLUMNS) == set(fedcis.TABLE_5_1["CIFAR10"]) - {"33-33-33"}
    assert {(c.setting, c.method) for c in fedcis.CELLS_V2} == {(col, m) for col in fedcis.COLUMNS
                                                                for m in fedcis.STRATEGIES}
    for cell in fedcis.CELLS_V2:
        assert cell.config["serving"] == cell.setting and cell.config["aggregation_base"] == "root_local"
        assert cell.config["optimizer_state"] == "kept across rounds (per node)"
    assert fedcis.paper_gain("80-15-5") == pytest.approx(0.043)
    assert fedcis.paper_gain("20-35-45", "CIFAR100") == pytest.approx(-0.051)


def test_v2_verdict_marks_columns_the_planned_seeds_cannot_resolve():
    # 10 planned seeds: a column needing 27 is not testable whatever its estimate; one needing 4 follows the gain rule
    assert fedcis.v2_verdict("10-30-60", 0.05, 0.03, 0.07, True, 27) == "not testable here (needs 27 seeds)"
    assert fedcis.v2_verdict("80-15-5", 0.05, 0.03, 0.07, True, 4) == "reproduced"
    assert fedcis.v2_verdict("80-15-5", 0.05, 0.03, 0.07, False, 4) == "pending"
    assert fedcis.v2_verdict("80-15-5", -0.01, -0.03, 0.01, True, 4) == "not reproduced"


def _v2_record(column: str, method: str, seed: int, acc: float) -> dict:
    return {"protocol": "v2", "setting": column, "method": method, "seed": seed,
            "metrics": {k: [acc] for k in fedcis.KEYS}, "config": {"lambda_tilde": [1 / 3] * 3}}


def _checks(records: list[dict]) -> dict[str, tuple[str, str]]:
    """Each column's convergence check from v3's and v5's records among ``records``, as `write_report` passes it."""
    return fedcis.setting_checks(fedcis._v3_claims([r for r in records if r["protocol"] == "v3"]),
                                 fedcis._v5_claims([r for r in records if r["protocol"] == "v5"]))


def test_v2_rows_carry_the_v3_label_beside_the_registered_one(tmp_path):
    # 20-35-45 only: Serving Rate - Equal Weight = -2.3 pp +- 0.5 pp alternating over 10 seeds, so sd =
    # 0.5 sqrt(10/9) = 0.527 pp and the half-width t_{0.975,9} sd / sqrt(10) = 2.262157 x 0.1667 = 0.377 pp:
    # [-2.68, -1.92] lies below 0 (opposite sign). No v1 records: v2's power rule registered "not testable here".
    # The other columns have no record: pending at 0 of 10 seeds.
    from lightning_fedhet.experiments import new_figure

    records = []
    for seed in range(10):
        d = -0.023 + 0.005 * (1 if seed % 2 else -1)
        records += [_v2_record("20-35-45", "Serving Rate", seed, 0.70 + d),
                    _v2_record("20-35-45", "Equal Weight", seed, 0.70)]
    fig, axes = new_figure()
    lines, summaries = fedcis._v2_section(records, records, axes[0], _checks(records))
    verdicts = {s.claim.split(":")[0].removeprefix("v2, Table 5.1, "): s.verdict for s in summaries}
    # no v3 run of the setting yet: its convergence check (C2's) is pending, and the index says so
    assert verdicts["20-35-45"] == "opposite sign (v2 records, v3 rule; convergence check pending)"
    assert verdicts["80-15-5"] == "pending (0/10 seeds) (v2 records, v3 rule)"
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| 20-35-45 | 10 |"))
    assert "-2.3 pp [-2.7, -1.9]" in row and "**opposite sign**" in row
    assert "not testable here (registered v2 rule, needs > 10,000 seeds; the interval excludes 0" in row


def test_a_v2_cell_runs_two_rounds_with_each_node_keeping_its_optimizer_state():
    config = {**fedcis.BASE_V2, "serving": "5-15-80", "base_width": 4, "rounds": 2, "eval_every": 1,
              "local_steps": 1, "batch_size": 8, "train_size": 140, "test_size": 40, "synthetic_data": True}
    out = fedcis.run_cell(Cell("5-15-80", "Serving Rate", config), seed=0)
    assert out["config"]["lambda_tilde"] == [0.05, 0.15, 0.8]
    assert len(out["data_checksum"]) == 64 and out["metrics"]["round"] == [1, 2]


def test_v3_cells_and_plans_follow_the_protocol():
    # protocol v3: R1-R6 every column without aggregating the heads; C1-C4 v2's setting on fresh seeds (from 10)
    # in the columns whose v2 label changed; planned seeds as its table: 10, 12, 20, 20, 20, 20 / 15, 13, 12, 15
    assert [(cid, col, heads) for cid, col, heads in fedcis.CLAIMS_V3][:2] == [
        ("R1", "80-15-5", "heads not aggregated"), ("R2", "60-30-10", "heads not aggregated")]
    assert [col for cid, col, _ in fedcis.CLAIMS_V3 if cid.startswith("C")] == [
        "45-35-20", "20-35-45", "10-30-60", "5-15-80"]
    sizes = {cid: (plan[0], len(plan)) for cid, plan in fedcis.PLAN.items()}
    assert sizes == {"R1": (0, 10), "R2": (0, 12), "R3": (0, 20), "R4": (0, 20), "R5": (0, 20), "R6": (0, 20),
                     "C1": (10, 15), "C2": (10, 13), "C3": (10, 12), "C4": (10, 15)}
    assert set().union(*map(set, fedcis.PLAN.values())) == set(fedcis.SEEDS_V3)
    assert len(fedcis.CELLS_V3) == 20 and fedcis.CELLS_V3[0].setting == "80-15-5, heads not aggregated"
    for cell in fedcis.CELLS_V3:
        c = cell.config
        assert c["aggregate_heads"] == cell.setting.endswith(", heads aggregated")
        assert c["aggregation_base"] == "root_local" and c["eval_every"] == 2 and c["rounds"] == 20
        assert c["serving"] == cell.setting.split(",")[0]
        # v2's setting but for the evaluation schedule and the new key
        assert {k: v for k, v in c.items() if k not in ("eval_every", "aggregate_heads", "serving")} == \
            {k: v for k, v in fedcis.BASE_V2.items() if k not in ("eval_every", "serving")}


def test_heads_not_aggregated_marks_exactly_the_heads():
    config = {**fedcis.BASE_V3, "base_width": 4, "aggregate_heads": False}
    model, _, rule = fedcis.build(config, "Serving Rate", "root_local")
    net = model.model
    heads = sum(t.numel() for h in net.heads for t in h.parameters())
    assert rule.aggregate_heads is False and int(rule.head_mask.sum()) == heads
    _, _, rule = fedcis.build({**config, "aggregate_heads": True}, "Serving Rate", "root_local")
    assert rule.aggregate_heads is True and rule.head_mask is None
    _, _, rule = fedcis.build(fedcis.BASE_V2, "Serving Rate", "root_local")  # v2's configs have no key
    assert rule.aggregate_heads is True


def test_a_v3_cell_runs_two_rounds_on_a_tiny_stand_in():
    config = {**fedcis.CELLS_V3[0].config, "base_width": 4, "rounds": 2, "eval_every": 1, "local_steps": 1,
              "batch_size": 8, "train_size": 140, "test_size": 40, "synthetic_data": True}
    out = fedcis.run_cell(Cell(fedcis.CELLS_V3[0].setting, "Serving Rate", config), seed=0)
    assert out["metrics"]["round"] == [1, 2] and out["config"]["lambda_tilde"] == [0.8, 0.15, 0.05]


def _v3_record(setting: str, method: str, seed: int, final: float, late: float = 0.0) -> dict:
    # evaluations every 2 rounds; the curve is flat at `final` but for round 18 at `final - late`
    curve = [final] * 10
    curve[8] = final - late
    return {"protocol": "v3", "setting": setting, "method": method, "seed": seed,
            "metrics": {"round": list(range(2, 21, 2)), **{k: list(curve) for k in fedcis.KEYS}},
            "config": {"lambda_tilde": [1 / 3] * 3}}


def test_v3_claim_decided_on_the_holm_interval_with_the_convergence_check():
    """R1 (80-15-5, heads not aggregated), seeds 0-9: Serving Rate - Equal Weight = 6 pp +- 0.5 pp alternating, so
    sd = 0.5 sqrt(10/9) = 0.52705 pp. The other 9 claims have no record (no p-value: ordered last), so Holm's first
    step puts R1 at level 1 - 0.05/10 = 0.995: half-width t_{0.9975, 9} sd / sqrt(10) = 3.68966 x 0.16667 =
    0.61494 pp -> [5.39, 6.61] pp above 0: reproduced. With Equal Weight's seed-mean curve 0.6 pp lower at round 18
    than at 20, |tail_change| = 0.6 pp >= 0.5 pp: not converged."""
    def records(late: float) -> list[dict]:
        out = []
        for seed in range(10):
            d = 0.06 + 0.005 * (1 if seed % 2 else -1)
            out += [_v3_record("80-15-5, heads not aggregated", "Serving Rate", seed, 0.70 + d),
                    _v3_record("80-15-5, heads not aggregated", "Equal Weight", seed, 0.70, late)]
        return out

    claims = fedcis._v3_claims(records(0.004))
    r1 = claims["R1"]
    assert r1["holm"][1] == pytest.approx(0.06 - 0.0061494, abs=1e-6)
    assert r1["holm"][2] == pytest.approx(0.06 + 0.0061494, abs=1e-6)
    assert r1["tails"]["Equal Weight"] == pytest.approx(0.004) and r1["decision"].label == "reproduced"
    assert claims["R2"]["decision"].text() == "pending (0/12 seeds)"
    assert fedcis._v3_claims(records(0.006))["R1"]["decision"].label == "not converged"



def test_v2_labels_take_the_convergence_check_of_v3_runs_of_the_same_setting():
    """v2's records evaluate rounds 10 and 20 only, so the check comes from v3's confirmatory cell of the same
    setting. 20-35-45 (C2, seeds 10-22): v2's gain -2.3 pp +- 0.5 pp alternating over seeds 0-9 lies below 0
    ([-2.68, -1.92], as the test above). With C2's Equal Weight curve 0.6 pp lower at round 18 than at 20 (>= 0.5 pp)
    the label is "not converged" and the sign row shows "?"; at 0.4 pp it stays "opposite sign". 80-15-5 (no v3
    cell of this setting): v2's gain +6 pp +- 0.5 pp is reproduced, the index says its convergence is not shown."""
    from lightning_fedhet.experiments import new_figure

    def records(late: float, c2_seeds: range = range(10, 23)) -> tuple[list[dict], list[dict]]:
        v2, v3 = [], []
        for seed in range(10):
            d = 0.005 * (1 if seed % 2 else -1)
            v2 += [_v2_record("20-35-45", "Serving Rate", seed, 0.70 - 0.023 + d),
                   _v2_record("20-35-45", "Equal Weight", seed, 0.70),
                   _v2_record("80-15-5", "Serving Rate", seed, 0.70 + 0.06 + d),
                   _v2_record("80-15-5", "Equal Weight", seed, 0.70)]
        for seed in c2_seeds:
            v3 += [_v3_record("20-35-45, heads aggregated", "Serving Rate", seed, 0.68),
                   _v3_record("20-35-45, heads aggregated", "Equal Weight", seed, 0.70, late)]
        return v2, v3

    def verdicts(v2: list[dict], v3: list[dict]) -> dict[str, str]:
        fig, axes = new_figure()
        _, summaries = fedcis._v2_section(v2, v2 + v3, axes[0], _checks(v2 + v3))
        return {s.claim.split(":")[0].removeprefix("v2, Table 5.1, "): s.verdict for s in summaries}

    failing = verdicts(*records(0.006))
    assert failing["20-35-45"] == "not converged (v2 records, v3 rule)"
    # protocol v5 registered C5 (80-15-5, heads aggregated) as this column's check: pending until it has its seeds
    assert failing["80-15-5"] == "reproduced (v2 records, v3 rule; convergence check pending)"
    assert fedcis.setting_checks(fedcis._v3_claims(records(0.006)[1]))["80-15-5"] == (
        "not shown", "not shown (no v3 run of this setting)")
    assert verdicts(*records(0.004))["20-35-45"] == "opposite sign (v2 records, v3 rule)"
    assert verdicts(*records(0.006, range(10, 15)))["20-35-45"] == (
        "opposite sign (v2 records, v3 rule; convergence check pending)")
    assert fedcis.setting_checks(fedcis._v3_claims(records(0.006)[1]))["20-35-45"] == (
        "fails", "**fails** (C2, seeds 10-22)")

    fig, axes = new_figure()
    v2, v3 = records(0.006)
    lines, _ = fedcis._v3_section(fedcis._v3_claims(v3), v3, v2, axes[0], _checks(v2 + v3))
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| ours, heads aggregated"))
    # 20-35-45's -2.3 pp is resolved but its setting's check fails: its sign in brackets (no verdict), not "?"
    assert row.split(" | ")[1:7] == ["+", "?", "?", "(−)", "?", "?"]

def test_v3_ablation_pairs_v2_records_with_the_released_code_runs():
    """80-15-5, seeds 0-9: v2's gain (heads aggregated) 6 pp every seed, v3's (heads not) 2 pp +- 1 pp alternating:
    the difference is 4 pp -+ 1 pp, sd = sqrt(10/9) = 1.05409 pp, raw half-width t_{0.975, 9} x 1.05409 / sqrt(10) =
    2.26216 x 0.33333 = 0.75405 pp: [3.2, 4.8]. The other columns have no pair: Holm's first step is 1 - 0.05/6."""
    from lightning_fedhet.experiments import new_figure

    v2, v3 = [], []
    for seed in range(10):
        v2 += [_v2_record("80-15-5", "Serving Rate", seed, 0.76), _v2_record("80-15-5", "Equal Weight", seed, 0.70)]
        d = 0.02 + 0.01 * (1 if seed % 2 else -1)
        v3 += [_v3_record("80-15-5, heads not aggregated", "Serving Rate", seed, 0.70 + d),
               _v3_record("80-15-5, heads not aggregated", "Equal Weight", seed, 0.70)]
    fig, axes = new_figure()
    lines, summaries = fedcis._v3_section(fedcis._v3_claims(v3), v3, v2, axes[0], _checks(v2 + v3))
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| 80-15-5 | 10 |"))
    assert "| 6.0 pp [6.0, 6.0] | 2.0 pp [1.2, 2.8] | 4.0 pp [3.2, 4.8] |" in row
    assert row.endswith("aggregating the heads adds to the gain |")
    assert len(summaries) == 10


# ------------------------------------------------------------------------------------------------------ protocol v4
def test_v4_runs_both_settings_of_the_columns_that_failed_at_40_rounds_on_fresh_seeds():
    # protocol v4: v3's registered fallback, both settings of each column whose v3 cell failed the check, 40 rounds
    assert fedcis.CELLS_V4[0].config["rounds"] == fedcis.ROUNDS_V4 == 40
    assert {(col, heads) for _, col, heads in fedcis.CLAIMS_V4} == {
        (col, heads) for col in fedcis.COLUMNS_V4 for heads in fedcis.HEADS}
    assert [cid for cid, _, _ in fedcis.CLAIMS_V4] == [cid + "L" for cid, col, _ in fedcis.CLAIMS_V3
                                                        if col in fedcis.COLUMNS_V4]
    assert set(fedcis.PLAN_V4) == {cid for cid, _, _ in fedcis.CLAIMS_V4}
    v4_seeds = set().union(*map(set, fedcis.PLAN_V4.values()))
    assert v4_seeds == set(fedcis.SEEDS_V4) and not v4_seeds & set(fedcis.SEEDS_V3)  # fresh
    assert all(10 <= len(plan) <= 20 for plan in fedcis.PLAN_V4.values())
    # the protocol's table: the columns whose v3 heads-aggregated cells (C2, C3, C4) failed the check
    assert fedcis.COLUMNS_V4 == ("20-35-45", "10-30-60", "5-15-80")
    assert {cid: len(plan) for cid, plan in fedcis.PLAN_V4.items()} == {
        "R4L": 20, "R5L": 20, "R6L": 16, "C2L": 10, "C3L": 10, "C4L": 10}
    assert len(fedcis.CELLS_V4) == 2 * len(fedcis.CLAIMS_V4)
    # the heads-aggregated cells (whose v3 checks failed) run first
    assert fedcis.CELLS_V4[0].setting.endswith("heads aggregated, 40 rounds")
    for cell in fedcis.CELLS_V4:
        c = cell.config
        assert c["rounds"] == 40 and c["eval_every"] == 2 and cell.setting.endswith(", 40 rounds")
        assert c["aggregate_heads"] == (", heads aggregated," in cell.setting)
        # v3's setting but for the horizon
        assert {k: v for k, v in c.items() if k not in ("rounds", "aggregate_heads", "serving")} == \
            {k: v for k, v in fedcis.BASE_V3.items() if k not in ("rounds", "serving")}
    # the canary stays v3's first cell (its committed record)
    assert fedcis.CANARY.setting == fedcis.CELLS_V3[0].setting and fedcis.CANARY.config["rounds"] == 2


def _v4_record(setting: str, method: str, seed: int, final: float, late: float = 0.0) -> dict:
    # evaluations every 2 rounds up to 40; flat at `final` but rounds 34 and 36 at `final - late`
    curve = [final] * 20
    curve[16] = curve[17] = final - late
    return {"protocol": "v4", "setting": setting, "method": method, "seed": seed,
            "metrics": {"round": list(range(2, 41, 2)), **{k: list(curve) for k in fedcis.KEYS}},
            "config": {"lambda_tilde": [1 / 3] * 3}}


def test_v4_claim_decided_on_holm_over_its_family_with_the_check_over_rounds_34_to_40():
    """C3L (10-30-60, heads aggregated): Serving Rate - Equal Weight = -3 pp +- 0.5 pp alternating over its planned
    seeds, sd = 0.5 sqrt(n/(n-1)) pp. The other five claims have no record, so Holm's first step puts C3L at
    1 - 0.05/6 = 0.991667. With n = 10: sd = 0.52705 pp, t_{0.995833, 9} = 3.36420 (scipy), half-width
    3.36420 x 0.52705 / sqrt(10) = 0.56070 pp: [-3.56, -2.44] below 0, opposite sign. Equal Weight's rounds 34-36
    0.6 pp below its rounds 38-40: |tail_change| = 0.6 pp >= 0.5 pp, not converged; at 0.4 pp it passes."""
    plan = fedcis.PLAN_V4["C3L"]
    assert len(plan) == 10  # the hand computation's n

    def records(late: float) -> list[dict]:
        out = []
        for k, seed in enumerate(plan):
            d = -0.03 + 0.005 * (1 if k % 2 else -1)
            out += [_v4_record("10-30-60, heads aggregated, 40 rounds", "Serving Rate", seed, 0.75 + d),
                    _v4_record("10-30-60, heads aggregated, 40 rounds", "Equal Weight", seed, 0.75, late)]
        return out

    c3 = fedcis._v4_claims(records(0.004))["C3L"]
    assert c3["holm"][1] == pytest.approx(-0.03 - 0.0056070, abs=1e-6)
    assert c3["holm"][2] == pytest.approx(-0.03 + 0.0056070, abs=1e-6)
    assert c3["tails"]["Equal Weight"] == pytest.approx(0.004) and c3["decision"].label == "opposite sign"
    assert fedcis._v4_claims(records(0.006))["C3L"]["decision"].label == "not converged"
    # the page: v4's label beside v3's label of the same cell at 20 rounds
    from lightning_fedhet.experiments import new_figure

    fig, axes = new_figure()
    lines, summaries = fedcis._v4_section(fedcis._v4_claims(records(0.004)), fedcis._v3_claims([]), axes[0])
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| C3L |"))
    assert "**opposite sign**" in row and row.endswith("| pending (0/12 seeds) |")
    assert any(s.verdict == "opposite sign" and "C3L" in s.claim for s in summaries)
    assert not any("Not converged at 40 rounds" in line for line in lines)
    # not converged: the page names the claim and the strategy whose curve moves, with the pilot's caveat
    text = "\n".join(fedcis._v4_section(fedcis._v4_claims(records(0.006)), fedcis._v3_claims([]), axes[0])[0])
    assert "): C3L (Equal Weight +0.60 pp). Those claims get no verdict under v4. The protocol's two-seed" in text


def test_v4_futility_stop_ends_a_heads_not_aggregated_cell_whose_drift_is_resolved(monkeypatch):
    """R5L (10-30-60, heads not aggregated, 20 planned): Equal Weight's rounds 34-36 sit 1 pp below its rounds 38-40
    in every run, so each run's tail change is +1 pp and drift_check's interval is [1, 1] pp, beyond ±0.5 pp. At 10
    seeds the cell stops and reads "not converged" (10/10 of what it ran); at 9 seeds it is still pending; a drift of
    0.4 pp in every run ([0.4, 0.4], within the bound) does not stop it."""
    plan = list(fedcis.PLAN_V4["R5L"])
    assert len(plan) == 20 and fedcis.FUTILITY_AFTER == 10

    def records(n: int, late: float) -> list[dict]:
        out = []
        for seed in plan[:n]:
            out += [_v4_record("10-30-60, heads not aggregated, 40 rounds", "Serving Rate", seed, 0.70),
                    _v4_record("10-30-60, heads not aggregated, 40 rounds", "Equal Weight", seed, 0.72, late)]
        return out

    stopped = fedcis._v4_claims(records(10, 0.01))["R5L"]
    assert stopped["stopped"] and stopped["decision"].label == "not converged" and stopped["decision"].n == 10
    (sentence,) = fedcis._v4_unsettled(fedcis._v4_claims(records(10, 0.01)))
    assert "R5L (stopped: per-run drift resolved; Equal Weight +1.00 pp)" in sentence and "pilot" not in sentence
    assert fedcis._v4_claims(records(9, 0.01))["R5L"]["decision"].text() == "pending (9/20 seeds)"
    running = fedcis._v4_claims(records(10, 0.004))["R5L"]
    assert not running["stopped"] and running["decision"].text() == "pending (10/20 seeds)"
    # the stop is the heads-not-aggregated cells' only: a heads-aggregated cell with the same drift stays pending
    monkeypatch.setitem(fedcis.PLAN_V4, "C3L", range(100, 120))
    agg = [{**r, "setting": "10-30-60, heads aggregated, 40 rounds"} for r in records(10, 0.01)]
    assert fedcis._v4_claims(agg)["C3L"]["decision"].text() == "pending (10/20 seeds)"


# ------------------------------------------------------------------------------------------------------ protocol v5
def test_v5_confirms_r1_and_v2s_unchecked_columns_in_v3s_setting_on_fresh_seeds():
    # protocol v5: R1c (80-15-5, heads not aggregated), C5 (80-15-5) and C6 (60-30-10) heads aggregated; planned
    # seeds 16, 10, 10 from 200, disjoint from v3's 0-24, v4's 100-119 and the pilots' 900-901
    assert fedcis.CLAIMS_V5 == (("R1c", "80-15-5", "heads not aggregated"), ("C5", "80-15-5", "heads aggregated"),
                                ("C6", "60-30-10", "heads aggregated"))
    assert {cid: (plan[0], len(plan)) for cid, plan in fedcis.PLAN_V5.items()} == {
        "R1c": (200, 16), "C5": (200, 10), "C6": (200, 10)}
    seeds = set().union(*map(set, fedcis.PLAN_V5.values()))
    assert seeds == set(fedcis.SEEDS_V5)
    assert not seeds & (set(fedcis.SEEDS_V3) | set(fedcis.SEEDS_V4) | {900, 901})
    assert [(c.setting, c.method) for c in fedcis.CELLS_V5][:2] == [
        ("80-15-5, heads not aggregated", "Serving Rate"), ("80-15-5, heads not aggregated", "Equal Weight")]
    for cell in fedcis.CELLS_V5:  # v3's cell of the same setting and method, but for the column (C5, C6)
        column, heads = cell.setting.split(", ")
        (v3,) = [c for c in fedcis.CELLS_V3 if c.method == cell.method and c.setting.endswith(", " + heads)
                 and c.config["serving"] == ("80-15-5" if heads == "heads not aggregated" else "45-35-20")]
        assert cell.config == {**v3.config, "serving": column} and cell.config["rounds"] == 20


def _v5_record(setting: str, method: str, seed: int, final: float, late: float = 0.0) -> dict:
    return {**_v3_record(setting, method, seed, final, late), "protocol": "v5"}


def test_v5_claim_decided_on_holm_over_its_family_of_three():
    """R1c, seeds 200-215: Serving Rate - Equal Weight = 6 pp +- 0.5 pp alternating, sd = 0.5 sqrt(16/15) =
    0.51640 pp. C5 and C6 have no record, so Holm's first step puts R1c at 1 - 0.05/3: half-width
    t_{0.991667, 15} sd / 4 = 2.69374 (scipy) x 0.51640 / 4 = 0.34776 pp -> [5.65, 6.35] pp: reproduced. Equal
    Weight's round 18 0.6 pp below its round 20 -> |tail_change| = 0.6 pp >= 0.5: not converged."""
    def records(late: float) -> list[dict]:
        out = []
        for k, seed in enumerate(fedcis.PLAN_V5["R1c"]):
            d = 0.06 + 0.005 * (1 if k % 2 else -1)
            out += [_v5_record("80-15-5, heads not aggregated", "Serving Rate", seed, 0.70 + d),
                    _v5_record("80-15-5, heads not aggregated", "Equal Weight", seed, 0.70, late)]
        return out

    claims = fedcis._v5_claims(records(0.004))
    assert claims["R1c"]["holm"][1] == pytest.approx(0.06 - 0.0034776, abs=1e-6)
    assert claims["R1c"]["holm"][2] == pytest.approx(0.06 + 0.0034776, abs=1e-6)
    assert claims["R1c"]["decision"].label == "reproduced"
    assert claims["C5"]["decision"].text() == "pending (0/10 seeds)"
    # seeds outside the plan (v3's R1 ran seeds 0-9 of the same setting name) do not count
    stray = [{**r, "seed": r["seed"] - 200} for r in records(0.004)]
    assert fedcis._v5_claims(stray)["R1c"]["decision"].text() == "pending (0/16 seeds)"
    assert fedcis._v5_claims(records(0.006))["R1c"]["decision"].label == "not converged"
    # the page: v5's label beside v3's label of R1 (no v3 record here: pending at 0 of 10)
    from lightning_fedhet.experiments import new_figure

    fig, axes = new_figure()
    lines, summaries = fedcis._v5_section(fedcis._v5_claims(records(0.006)), fedcis._v3_claims([]), [], axes[0])
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| R1c |"))
    assert "**not converged**" in row and row.endswith("| v3 R1: pending (0/10 seeds) |")
    assert "**Not converged at 20 rounds**: R1c (Equal Weight +0.60 pp)." in "\n".join(lines)
    assert [s.verdict for s in summaries] == ["not converged", "pending (0/10 seeds)", "pending (0/10 seeds)"]


def test_v2_labels_of_80_15_5_and_60_30_10_take_the_check_of_v5s_c5_and_c6():
    """v2's 80-15-5 records: +6 pp +- 0.5 pp alternating over seeds 0-9, reproduced on the raw interval (as above).
    v5's C5 (the same setting, seeds 200-209) gives their check: Equal Weight 0.6 pp lower at round 18 than at 20
    (>= 0.5 pp) -> "not converged"; 0.4 pp -> the label stands with nothing appended; 5 of 10 seeds -> pending."""
    from lightning_fedhet.experiments import new_figure

    def records(late: float, seeds: range = range(200, 210)) -> list[dict]:
        out = []
        for seed in range(10):
            d = 0.005 * (1 if seed % 2 else -1)
            out += [_v2_record("80-15-5", "Serving Rate", seed, 0.76 + d),
                    _v2_record("80-15-5", "Equal Weight", seed, 0.70)]
        for seed in seeds:
            out += [_v5_record("80-15-5, heads aggregated", "Serving Rate", seed, 0.76),
                    _v5_record("80-15-5, heads aggregated", "Equal Weight", seed, 0.70, late)]
        return out

    def verdict(recs: list[dict]) -> str:
        fig, axes = new_figure()
        v2 = [r for r in recs if r["protocol"] == "v2"]
        _, summaries = fedcis._v2_section(v2, recs, axes[0], _checks(recs))
        return next(s.verdict for s in summaries if s.claim.startswith("v2, Table 5.1, 80-15-5:"))

    assert verdict(records(0.006)) == "not converged (v2 records, v3 rule)"
    assert verdict(records(0.004)) == "reproduced (v2 records, v3 rule)"
    assert verdict(records(0.004, range(200, 205))) == (
        "reproduced (v2 records, v3 rule; convergence check pending)")
    v5 = fedcis._v5_claims([r for r in records(0.004) if r["protocol"] == "v5"])
    checks = fedcis.setting_checks({cid: {"diffs": [], "converged": False} for cid in fedcis.PLAN}, v5)
    assert checks["80-15-5"] == ("passes", "passes (C5, seeds 200-209)")
    assert checks["60-30-10"] == ("pending", "pending (C6: 0/10 seeds)")
    assert checks["45-35-20"] == ("pending", "pending (C1: 0/15 seeds)")  # v3's C1, not a v5 claim
    # v5's page shows C5's earlier label: v2's records under the v3 rule, before any check
    fig, axes = new_figure()
    v2 = [r for r in records(0.004) if r["protocol"] == "v2"]
    lines, _ = fedcis._v5_section(v5, fedcis._v3_claims([]), v2, axes[0])
    row = next(line for line in "\n".join(lines).splitlines() if line.startswith("| C5 |"))
    assert row.endswith("| v2 records before v5: reproduced, convergence not shown |")


def test_the_page_brackets_v2s_80_15_5_sign_when_c5_fails_and_lists_v5s_commands(tmp_path):
    """The whole page from v2 records (80-15-5: +6 pp +- 0.5 pp, seeds 0-9), v3 records (80-15-5 heads not
    aggregated: +2 pp, seeds 0-9) and v5's C5 with Equal Weight 0.6 pp lower at round 18 than at 20 (fails): the
    sign row of v2's setting reads "(+)" at 80-15-5 (a resolved sign, not a verdict); the ablation still pairs v2's
    10 seeds with v3's (v5's seeds 200-209 are no v2/v3 pair); the Reproduce section lists v5's planned commands."""
    meta = {"commit": "abc", "dirty": False, "engine": "sequential", "device": "cpu", "torch": "2", "wall_s": 1.0,
            "cpu_s": 1.0}
    recs = []
    for seed in range(10):
        d = 0.005 * (1 if seed % 2 else -1)
        recs += [_v2_record("80-15-5", "Serving Rate", seed, 0.76 + d),
                 _v2_record("80-15-5", "Equal Weight", seed, 0.70),
                 _v3_record("80-15-5, heads not aggregated", "Serving Rate", seed, 0.72),
                 _v3_record("80-15-5, heads not aggregated", "Equal Weight", seed, 0.70)]
    for seed in fedcis.PLAN_V5["C5"]:
        recs += [_v5_record("80-15-5, heads aggregated", "Serving Rate", seed, 0.76),
                 _v5_record("80-15-5, heads aggregated", "Equal Weight", seed, 0.70, 0.006)]
    recs = [{**meta, **r} for r in recs]
    summaries = fedcis.write_report(recs, tmp_path)
    page = (tmp_path / "fedcis.md").read_text().splitlines()
    sign = next(line for line in page if line.startswith("| ours, heads aggregated (v2 records"))
    assert sign.split(" | ")[1:3] == ["(+)", "?"]  # resolved but unsettled: its sign, bracketed; no records: ?
    assert sign.endswith("| 0 of 6 | 0 of 6 |")  # a bracketed sign is no verdict, so it agrees with no row
    assert any(line.startswith("| 80-15-5 | 10 | 6.0 pp") for line in page)  # the v3 ablation: v2's 10 seeds
    assert ("OMP_NUM_THREADS=1 python scripts/reproduce.py run fedcis --seeds 200-215 --settings '80-15-5, heads not "
            "aggregated' --one-seed-at-a-time   # R1c") in page
    verdict = {s.claim: s.verdict for s in summaries}
    assert verdict["v5, Table 5.1, 80-15-5: Serving Rate beats Equal Weight on CIS accuracy (C5, heads aggregated)"] \
        == "not converged"


def test_r1c_is_set_beside_v3s_r1_with_welchs_interval():
    """R1 (v3, 10 seeds): 0 pp +- 1 pp alternating; R1c (v5, 16 seeds): +4 pp +- 1 pp alternating. Difference 4 pp;
    Welch: s1^2/n1 = (1 x 16/15)/16 = 0.0667, s2^2/n2 = (1 x 10/9)/10 = 0.1111, se = sqrt(0.1778) = 0.4216 pp,
    df = 0.1778^2 / (0.0667^2/15 + 0.1111^2/9) = 0.03160 / (0.000296 + 0.001372) = 18.95, t_{0.975, 18.95} = 2.0932
    (scipy), half-width 0.8826 pp -> [3.1, 4.9] pp. One seed of R1: no sentence."""
    def cell(setting, proto, seeds, gain, cpu):
        out = []
        for k, seed in enumerate(seeds):
            d = gain + (0.01 if k % 2 else -0.01)
            out += [{**_v3_record(setting, "Serving Rate", seed, 0.40 + d), "protocol": proto, "cpu": cpu},
                    {**_v3_record(setting, "Equal Weight", seed, 0.40), "protocol": proto, "cpu": cpu}]
        return out

    r1 = fedcis._v3_claims(cell("80-15-5, heads not aggregated", "v3", range(10), 0.0, "Intel"))["R1"]
    r1c = fedcis._v5_claims(cell("80-15-5, heads not aggregated", "v5", range(200, 216), 0.04, "AMD"))["R1c"]
    (text,) = fedcis._r1_against_r1c(r1, r1c)
    assert "R1c +4.0 pp over 16 seeds, R1 +0.0 pp over 10. Their difference is +4.0 pp, Welch 95 % interval " \
           "[3.1, 4.9] pp" in text
    assert "different processors (R1: Intel; R1c: AMD)" in text
    one = fedcis._v3_claims(cell("80-15-5, heads not aggregated", "v3", range(1), 0.0, "Intel"))["R1"]
    assert fedcis._r1_against_r1c(one, r1c) == []


# ------------------------------------------------------------------------------------------------------ protocol v6
V6_COLUMNS = ["80-15-5", "60-30-10", "20-35-45", "10-30-60", "5-15-80"]


def test_v6_runs_v2s_setting_at_the_thesiss_100_rounds_with_one_equal_weight_run_per_seed():
    # protocol v6: the five columns whose heads-aggregated check failed (v3's C2-C4, v5's C5, C6), 100 rounds, fresh
    # seeds from 300; Serving Rate per column, one Equal Weight cell scored on every column's tree
    assert fedcis.PROTOCOL == "v6" and fedcis.CELLS == fedcis.CELLS_V6 and fedcis.SEEDS == fedcis.SEEDS_V6
    assert [(cid, col) for cid, col, heads in fedcis.CLAIMS_V6 if heads == "heads aggregated"] == list(zip(
        ["C5T", "C6T", "C2T", "C3T", "C4T"], V6_COLUMNS))
    seeds = set().union(*map(set, fedcis.PLAN_V6.values()))
    assert seeds == set(fedcis.SEEDS_V6)
    assert not seeds & (set(fedcis.SEEDS_V3) | set(fedcis.SEEDS_V4) | set(fedcis.SEEDS_V5) | {900, 901})
    equal, *served = fedcis.CELLS_V6  # Equal Weight first: a seed's runs pair up as they land
    assert [(c.setting, c.method) for c in served] == [(f"{col}, heads aggregated, 100 rounds", "Serving Rate")
                                                       for col in V6_COLUMNS]
    for cell in served:  # v2's setting as v3 evaluates it (every 2 rounds), but for the horizon
        assert cell.config == {**fedcis.BASE_V3, "serving": cell.setting.split(",")[0], "aggregate_heads": True,
                               "rounds": 100}
    assert (equal.setting, equal.method) == ("every column, heads aggregated, 100 rounds", "Equal Weight")
    assert equal.config == {**served[0].config, "cis_columns": V6_COLUMNS}
    assert fedcis.CANARY.setting == fedcis.CELLS_V3[0].setting  # the canary stays v3's first cell


def test_v6_plans_every_claim_at_v4s_cap_of_20_seeds():
    """Protocol v6: every claim plans v4's cap, 20 seeds. The rule of v4 (80 % power at 1 - 0.05/5 to resolve the
    |mean| of the cell's last check from its paired SD, 10 to 20 seeds) would plan 10 for four claims and 20 for C2T;
    recomputed here from the committed records of the last checks (v4's C2L-C4L, v5's C5, C6)."""
    import glob
    import json
    from pathlib import Path

    import numpy as np

    from lightning_fedhet.experiments import seeds_for_power

    assert {cid: (plan[0], len(plan)) for cid, plan in fedcis.PLAN_V6.items()} == dict.fromkeys(
        ("C5T", "C6T", "C2T", "C3T", "C4T"), (300, 20))
    root = Path(__file__).resolve().parents[1] / "docs/results/records/fedcis"
    recs = [json.loads(Path(p).read_text()) for p in glob.glob(str(root / "v[45]/**/seed*.json"), recursive=True)]
    last = {**fedcis._v4_claims([r for r in recs if r["protocol"] == "v4"]),
            **fedcis._v5_claims([r for r in recs if r["protocol"] == "v5"])}
    need = {}
    for cid, (_, eid) in fedcis.EARLIER_V6.items():
        d = np.asarray(last[eid]["diffs"])
        assert d.size == 10
        need[cid] = seeds_for_power(float(d.std(ddof=1)), abs(float(d.mean())), level=1 - 0.05 / 5)
    assert need == {"C5T": 4, "C6T": 6, "C2T": 21, "C3T": 7, "C4T": 8}


def _tiny(config: dict) -> dict:
    return {**config, "base_width": 4, "rounds": 2, "eval_every": 1, "local_steps": 1, "batch_size": 8,
            "train_size": 140, "test_size": 40, "synthetic_data": True}


def test_equal_weight_trains_the_same_in_every_column_so_one_run_scores_them_all(monkeypatch):
    """The premise of v6's Equal Weight cell: two Equal Weight runs whose trees differ only in the serving column end
    with the same global model, bit for bit (every parameter and BatchNorm statistic), on the same data with the
    same weights; one run scored on several columns gives each column's CIS accuracy of its own run. Serving Rate's
    weights read the column: its final models differ (the check can see a dependence), and a Serving Rate cell may
    not score several columns."""
    finals = []
    fit = fedcis._train.fit

    def keep_final_model(model, *args, **kwargs):
        out = fit(model, *args, **kwargs)
        finals.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return out

    monkeypatch.setattr(fedcis._train, "fit", keep_final_model)
    equal = fedcis.CELLS_V6[0]
    runs = {col: fedcis.run_cell(Cell(col, "Equal Weight", _tiny({**equal.config, "serving": col,
                                                                  "cis_columns": None})), seed=3)
            for col in ("80-15-5", "5-15-80")}
    a, b = finals
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert runs["80-15-5"]["data_checksum"] == runs["5-15-80"]["data_checksum"]
    assert runs["80-15-5"]["config"] == runs["5-15-80"]["config"]  # node sizes and weights (1/3 each)
    both = fedcis.run_cell(Cell(equal.setting, "Equal Weight",
                                _tiny({**equal.config, "cis_columns": ["80-15-5", "5-15-80"]})), seed=3)["metrics"]
    assert all(torch.equal(finals[2][k], a[k]) for k in a)
    for col, run in runs.items():
        assert both[fedcis.cis_key(col)] == run["metrics"]["cis_acc"]
        assert all(both[f"val_acc_exit{e}"] == run["metrics"][f"val_acc_exit{e}"] for e in (1, 2, 3))
    assert runs["80-15-5"]["metrics"]["cis_acc"] != runs["5-15-80"]["metrics"]["cis_acc"]  # the trees score apart
    served = [fedcis.run_cell(Cell(col, "Serving Rate", _tiny({**equal.config, "serving": col, "cis_columns": None})),
                              seed=3) for col in ("80-15-5", "5-15-80")]
    c, d = finals[3:]
    assert served[0]["config"]["lambda_tilde"] != served[1]["config"]["lambda_tilde"]
    assert not all(torch.equal(c[k], d[k]) for k in c)
    with pytest.raises(ValueError, match="cis_columns: only Equal Weight"):
        fedcis.run_cell(Cell("x", "Serving Rate", _tiny(equal.config)), seed=3)


def _v6_record(setting: str, method: str, seed: int, cis: float | dict, late: float = 0.0) -> dict:
    """Evaluations every 2 rounds up to 100; flat but for rounds 82-90 at ``late`` below (tail_change = late).
    ``cis``: the CIS accuracy, or per column (the Equal Weight cell's ``cis_acc_<column>``)."""
    def curve(v: float) -> list[float]:
        return [v - late if 80 < r <= 90 else v for r in range(2, 101, 2)]

    keys = {fedcis.cis_key(c): curve(v) for c, v in cis.items()} if isinstance(cis, dict) else {"cis_acc": curve(cis)}
    return {"protocol": "v6", "setting": setting, "method": method, "seed": seed,
            "metrics": {"round": list(range(2, 101, 2)), **{f"val_acc_exit{e}": curve(0.5) for e in (1, 2, 3)},
                        **keys}, "config": {"lambda_tilde": [1 / 3] * 3}}


def test_v6_claim_reads_equal_weights_cis_of_its_own_column_and_is_decided_on_holm_over_five():
    """C5T (80-15-5): Serving Rate 0.76 +- 0.005 alternating over seeds 300-319; the Equal Weight cell scores 0.70 on
    80-15-5's tree and 0.80 on every other column's. So C5T's difference is 6 pp +- 0.5 pp, sd = 0.5 sqrt(20/19) =
    0.51299 pp; the other four claims have no Serving Rate record (ordered last), so Holm's first step puts C5T at
    1 - 0.05/5: half-width t_{0.995, 19} sd / sqrt(20) = 2.86093 (scipy) x 0.11471 = 0.32817 pp -> [5.67, 6.33]:
    reproduced. Equal Weight's rounds 82-90 0.6 pp below its rounds 92-100 -> |tail_change| = 0.6 pp: not
    converged."""
    def records(late: float, seeds=fedcis.PLAN_V6["C5T"]) -> list[dict]:
        out = []
        for k, seed in enumerate(seeds):
            d = 0.005 * (1 if k % 2 else -1)
            out += [_v6_record("80-15-5, heads aggregated, 100 rounds", "Serving Rate", seed, 0.76 + d),
                    _v6_record(fedcis.EVERY_COLUMN_V6, "Equal Weight", seed,
                               {col: 0.70 if col == "80-15-5" else 0.80 for col in V6_COLUMNS}, late)]
        return out

    claims = fedcis._v6_claims(records(0.004))
    c5 = claims["C5T"]
    assert c5["holm"][1] == pytest.approx(0.06 - 0.0032817, abs=1e-6)
    assert c5["holm"][2] == pytest.approx(0.06 + 0.0032817, abs=1e-6)
    assert c5["decision"].label == "reproduced" and c5["tails"]["Equal Weight"] == pytest.approx(0.004)
    # the other columns: Equal Weight's runs are set out there with their own tree's score, but without Serving
    # Rate's runs they are no pair, so they enter neither the difference nor the checks
    c6 = [r for r in fedcis._per_column(records(0.004)) if r["setting"] == "60-30-10, heads aggregated, 100 rounds"]
    assert len(c6) == 20 and {r["metrics"]["cis_acc"][-1] for r in c6} == {0.80}
    assert claims["C6T"]["decision"].text() == "pending (0/20 seeds)" and claims["C6T"]["cell"] == []
    assert fedcis._v6_claims(records(0.006))["C5T"]["decision"].label == "not converged"
    # the page: v6's label beside v5's C5 (no v5 record here: pending), the sign row, the not-converged sentence
    from lightning_fedhet.experiments import new_figure

    fig, axes = new_figure()
    earlier = {"v4": fedcis._v4_claims([]), "v5": fedcis._v5_claims([])}
    lines, summaries = fedcis._v6_section(fedcis._v6_claims(records(0.004)), earlier, axes[0])
    text = "\n".join(lines)
    row = next(line for line in text.splitlines() if line.startswith("| C5T |"))
    assert "**reproduced**" in row and row.endswith("| v5 C5 (20 rounds): pending (0/10 seeds) |")
    c2 = next(line for line in text.splitlines() if line.startswith("| C2T |"))
    assert c2.endswith("| v4 C2L (40 rounds): pending (0/10 seeds) |")
    sign = next(line for line in text.splitlines() if line.startswith("| ours, heads aggregated, 100 rounds"))
    assert sign.split(" | ")[1:] == ["+", "?", "–", "?", "?", "? |"]
    assert summaries[0].verdict == "reproduced" and summaries[0].claim.endswith("(C5T, heads aggregated, 100 rounds)")
    lines, _ = fedcis._v6_section(fedcis._v6_claims(records(0.006)), earlier, axes[0])
    # 0.6 pp in every run: the per-run drift is resolved beyond the bound, so the stop ends C5T at its first 10 seeds
    assert "**Not converged at 100 rounds**: C5T (stopped: per-run drift resolved; Equal Weight +0.60 pp)." in \
        "\n".join(lines)
    # no verdict, but the resolved sign of its interval is still reported, in brackets
    sign = next(line for line in "\n".join(lines).splitlines()
                if line.startswith("| ours, heads aggregated, 100 rounds"))
    assert sign.split(" | ")[1:] == ["(+)", "?", "–", "?", "?", "? |"]


def test_v6_futility_stop_is_judged_once_on_the_first_10_seeds_and_keeps_them():
    """C2T plans 20 seeds, as every v6 claim. Equal Weight's rounds 82-90 sit 1 pp below its rounds 92-100 in every
    run: each run's tail change is +1 pp, drift_check's interval [1, 1] pp lies beyond ±0.5 pp, so with seeds
    300-309 paired C2T stops and reads "not converged" at 10 seeds; at 9 it is pending. The stop is final: the
    shared Equal Weight cell's seeds 310-319 (run for the other claims), or a Serving Rate run of those seeds made by
    mistake, do not enter it. A claim whose first 10 seeds drift 0.4 pp (within the bound) goes on, and is not
    stopped later however its seeds 310-319 drift."""
    plan = list(fedcis.PLAN_V6["C2T"])
    assert fedcis.FUTILITY_AFTER_V6 == 10 and len(plan) == 20

    def sr(seeds, value=0.79):
        return [_v6_record("20-35-45, heads aggregated, 100 rounds", "Serving Rate", s, value) for s in seeds]

    def ew(seeds, late):
        return [_v6_record(fedcis.EVERY_COLUMN_V6, "Equal Weight", s, dict.fromkeys(V6_COLUMNS, 0.80), late)
                for s in seeds]

    stopped = fedcis._v6_claims(sr(plan[:10]) + ew(plan[:10], 0.01))["C2T"]
    assert stopped["stopped"] and stopped["decision"].label == "not converged" and stopped["decision"].n == 10
    assert fedcis._v6_claims(sr(plan[:9]) + ew(plan[:9], 0.01))["C2T"]["decision"].text() == "pending (9/20 seeds)"
    later = fedcis._v6_claims(sr(plan[:10]) + ew(plan, 0.01) + sr(plan[10:13], 0.70))["C2T"]
    assert later["stopped"] and later["decision"].n == 10 and len(later["cell"]) == 20
    assert later["diffs"] == pytest.approx([-0.01] * 10)  # seeds 310-312's Serving Rate runs are not pooled
    going = fedcis._v6_claims(sr(plan[:10]) + ew(plan[:10], 0.004))["C2T"]
    assert not going["stopped"] and going["decision"].text() == "pending (10/20 seeds)"
    drifting_late = sr(plan) + ew(plan[:10], 0.004) + ew(plan[10:], 0.02)
    late = fedcis._v6_claims(drifting_late)["C2T"]
    assert not late["stopped"] and late["decision"].n == 20 and late["decision"].label == "not converged"


def test_v6_page_says_where_each_claims_futility_stop_stands_and_what_is_left_to_run():
    """Seeds 300-309 of every column, Equal Weight's runs drifting 0.4 pp (within ±0.5 pp). C2T's Serving Rate runs
    drift 1 pp each (interval [1, 1] pp, resolved beyond 0.5): C2T stops, the other four go on, and the page's
    commands for seeds 310-319 name the Equal Weight cell and the four columns that go on, not 20-35-45. With seed
    309 of C4T's Serving Rate missing, C4T is not judged yet and the commands keep the placeholder. With every
    Serving Rate cell drifting, every claim stops and nothing is left to run."""
    first = list(fedcis.PLAN_V6["C5T"])[:10]
    cmd = "run"

    def records(late: dict, seeds=first) -> list[dict]:
        return ([_v6_record(fedcis.EVERY_COLUMN_V6, "Equal Weight", s, dict.fromkeys(V6_COLUMNS, 0.80), 0.004)
                 for s in first] +
                [_v6_record(fedcis.v6_setting(col), "Serving Rate", s, 0.79, late.get(col, 0.0))
                 for col in V6_COLUMNS for s in (seeds if col == "5-15-80" else first)])

    claims = fedcis._v6_claims(records({"20-35-45": 0.01}))
    assert fedcis._futility_v6(claims) == {"C5T": "goes on", "C6T": "goes on", "C2T": "stopped", "C3T": "goes on",
                                          "C4T": "goes on"}
    assert fedcis._futility_sentence(fedcis._futility_v6(claims)) == (
        "\n**Futility stop** (judged once per claim, on seeds 300-309): C2T: stopped there, **not converged** (their "
        "Serving Rate cells' seeds 310-319 are not run); C5T, C6T, C3T, C4T: go on to their 20 planned seeds.\n")
    assert fedcis._reproduce_v6(claims, cmd) == [
        "for s in $(seq 300 309); do run --seeds $s --one-seed-at-a-time; done",
        "for s in $(seq 310 319); do run --seeds $s --settings 'every column, heads aggregated, 100 rounds' "
        "'80-15-5, heads aggregated, 100 rounds' '60-30-10, heads aggregated, 100 rounds' "
        "'10-30-60, heads aggregated, 100 rounds' '5-15-80, heads aggregated, 100 rounds' --one-seed-at-a-time; "
        "done   # the columns whose claim goes on"]
    waiting = fedcis._v6_claims(records({"20-35-45": 0.01}, seeds=first[:9]))
    assert fedcis._futility_v6(waiting)["C4T"] == "not judged yet"
    assert fedcis._futility_sentence(fedcis._futility_v6(waiting)).endswith(
        "; C4T: not judged yet (waiting for runs of seeds 300-309).\n")
    assert fedcis._reproduce_v6(waiting, cmd)[1].endswith(
        "'<column>, heads aggregated, 100 rounds' --one-seed-at-a-time; done   # with each column whose claim goes on")
    every = fedcis._v6_claims(records(dict.fromkeys(V6_COLUMNS, 0.01)))
    assert set(fedcis._futility_v6(every).values()) == {"stopped"}
    assert fedcis._reproduce_v6(every, cmd)[1] == "# seeds 310-319: none (the futility stop ended every claim)"


def test_the_whole_page_takes_v6s_equal_weight_record_without_a_plain_cis_acc(tmp_path):
    """A v6 seed as it lands (the Equal Weight cell's record logs cis_acc_<column> only, and C5T's Serving Rate
    record): the page is written, C5T counts 1 of 20 seeds, and the Equal Weight rows read that one run per column."""
    meta = {"commit": "abc", "dirty": False, "engine": "sequential", "device": "cpu", "torch": "2", "wall_s": 1.0,
            "cpu_s": 1.0}
    recs = [{**meta, **_v6_record(fedcis.EVERY_COLUMN_V6, "Equal Weight", 300, dict.fromkeys(V6_COLUMNS, 0.70))},
            {**meta, **_v6_record("80-15-5, heads aggregated, 100 rounds", "Serving Rate", 300, 0.75)}]
    assert "cis_acc" not in recs[0]["metrics"]
    summaries = fedcis.write_report(recs, tmp_path)
    page = (tmp_path / "fedcis.md").read_text().splitlines()
    assert any(line.startswith("| C5T | 80-15-5 | heads aggregated | 1/20 | 5.0 pp") for line in page)
    ew = [line for line in page if line.startswith("| 60-30-10 | heads aggregated | Equal Weight |")]
    assert ew[0].startswith("| 60-30-10 | heads aggregated | Equal Weight | 0/20")  # no Serving Rate run: no pair
    verdict = {s.claim: s.verdict for s in summaries}
    assert verdict["v6, Table 5.1, 80-15-5: Serving Rate beats Equal Weight on CIS accuracy (C5T, heads aggregated, "
                   "100 rounds)"] == "pending (1/20 seeds)"
