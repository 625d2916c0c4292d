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
    assert {(c.setting, c.method) for c in fedcis.CELLS} == {(col, m) for col in fedcis.COLUMNS
                                                             for m in fedcis.STRATEGIES}
    for cell in fedcis.CELLS:
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
    lines, summaries = fedcis._v2_section(records, records, axes[0])
    verdicts = {s.claim.split(":")[0].removeprefix("v2, Table 5.1, "): s.verdict for s in summaries}
    assert verdicts["20-35-45"] == "opposite sign (v2 records, v3 rule)"
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
