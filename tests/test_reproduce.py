"""The reproduction harness (scripts/harness.py) on a small fixture study that trains nothing.

The properties a reader of docs/results relies on: records are written once and skipped after; pages are a pure
function of the records (byte for byte, figures included); ``check`` fails when a record is deleted or a number in
a page is edited; the statistics are the textbook ones.
"""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import harness  # noqa: E402

CALLS = []


def _run(cell, seed):
    CALLS.append((cell.method, seed))
    base = 0.5 if cell.method == "A" else 0.4
    return {"metrics": {"acc": [base + 0.01 * seed, base + 0.02 * seed]}, "engine": "none"}


def _report(records, out):
    final = {m: harness.by_seed(records, lambda r: r["metrics"]["acc"][-1], method=m) for m in ("A", "B")}
    rows = [(m, harness.fmt_ci(*harness.mean_ci(list(v.values())))) for m, v in final.items()]
    (out / "toy.md").write_text("# toy\n\n" + harness.markdown_table(("method", "acc"), rows))
    fig, axes = harness.new_figure()
    for m, v in final.items():
        axes[0].plot(sorted(v), [v[s] for s in sorted(v)], label=m)
    harness.save_figure(fig, out / "toy" / "acc.png")
    mean, lo, hi, n = harness.paired(final["A"], final["B"])
    return [harness.Summary("A beats B", "+10 pp", harness.fmt_ci(mean, lo, hi) + f" ({n} seeds)",
                            harness.verdict_for_gain(lo, mean, hi, 0.10))]


TOY = harness.Study(name="toy", title="Toy", protocol="v1", seeds=(0, 1, 2),
                    cells=(harness.Cell("s", "A", {"lr": 0.1}), harness.Cell("s", "B", {"lr": 0.1})),
                    run=_run, report=_report)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "protocol-v1.md").write_text("# protocol v1 (hand-written)\n")
    CALLS.clear()
    harness.run_study(TOY, [0, 1, 2], root=tmp_path)
    harness.copy_report(root=tmp_path, studies={"toy": TOY})
    return tmp_path


def test_records_hold_the_required_keys_and_existing_runs_are_skipped(root):
    record = harness.load_records(root, "toy")[0]
    for key in ("study", "method", "setting", "seed", "commit", "config", "engine", "device", "torch", "wall_s",
                "metrics", "protocol"):
        assert key in record
    assert (record["method"], record["seed"], record["config"]) == ("A", 0, {"lr": 0.1})
    assert len(CALLS) == 6
    assert harness.run_study(TOY, [0, 1, 2, 3], root=root) == 2  # only seed 3 of both methods is new
    assert CALLS[6:] == [("A", 3), ("B", 3)]


def test_a_study_without_its_committed_protocol_refuses_to_run(tmp_path):
    with pytest.raises(SystemExit, match="protocol"):
        harness.run_study(TOY, [0], root=tmp_path)


def test_check_passes_on_a_fresh_report_and_the_report_is_byte_reproducible(root):
    assert harness.check(root=root, studies={"toy": TOY}) == []
    page = (root / "toy.md").read_text()
    # A's final accuracies 0.50, 0.52, 0.54: mean 0.52, s = 0.02, half-width t_{0.975,2} s / sqrt(3) = 4.303 x 0.0115
    assert "| A | 52.0 [47.0, 57.0] |" in page


def test_check_fails_when_a_record_is_deleted(root):
    (root / "records" / "toy" / "v1" / "s" / "a" / "seed2.json").unlink()
    problems = harness.check(root=root, studies={"toy": TOY})
    assert any(p.startswith("toy.md: differs") for p in problems)
    assert any(p.startswith("toy/acc.png: differs") for p in problems)


def test_check_fails_when_one_number_in_a_page_is_edited(root):
    page = root / "toy.md"
    page.write_text(page.read_text().replace("52.0", "53.0", 1))
    problems = harness.check(root=root, studies={"toy": TOY})
    assert len(problems) == 1 and problems[0].startswith("toy.md: differs")
    assert "53.0" in problems[0] and "52.0" in problems[0]


def test_check_flags_a_hand_written_page_that_no_record_generates(root):
    (root / "notes.md").write_text("accuracy 99 %\n")
    assert harness.check(root=root, studies={"toy": TOY}) == [
        "notes.md: committed but not generated from any record (stale or hand-written)"]


def test_mean_ci_and_paired_difference_match_hand_computation():
    mean, lo, hi = harness.mean_ci([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # t_{0.975,3} * s / sqrt(n), s^2 = 5/3
    assert (mean, lo, hi) == pytest.approx((2.5, 2.5 - half, 2.5 + half))
    # paired over the common seeds only: differences (1, 3) -> mean 2, t_{0.975,1} = 12.706, s = sqrt(2)
    mean, lo, hi, n = harness.paired({0: 2.0, 1: 5.0, 2: 9.0}, {0: 1.0, 1: 2.0})
    assert (mean, n) == (2.0, 2) and hi - mean == pytest.approx(12.706204736 * math.sqrt(2) / math.sqrt(2))
    assert math.isnan(harness.mean_ci([0.3])[1])


def test_verdict_rule():
    assert harness.verdict_for_gain(0.01, 0.05, 0.09, paper_gain=0.06) == "reproduced"
    assert harness.verdict_for_gain(0.001, 0.01, 0.02, paper_gain=0.06) == "partly reproduced"
    assert harness.verdict_for_gain(-0.01, 0.02, 0.05, paper_gain=0.06) == "direction only"
    assert harness.verdict_for_gain(-0.05, -0.01, 0.03, paper_gain=0.06) == "not reproduced"


def test_seed_ranges_parse():
    assert harness.parse_seeds("0-2,7", ()) == [0, 1, 2, 7]
    assert harness.parse_seeds(None, (4, 5)) == [4, 5]


# ------------------------------------------------------------------------------------------------- canary re-runs
def test_records_carry_the_thread_count(root):
    import torch

    assert harness.load_records(root, "toy")[0]["threads"] == torch.get_num_threads() == TOY.threads


DRIFT = {"offset": 0.0}


def _run_drifting(cell, seed):
    return {"metrics": {"acc": [0.5 + DRIFT["offset"], 0.25]}, "engine": "none", "data_checksum": "abc"}


CANARY_TOY = harness.Study(name="toy", title="Toy", protocol="v1", seeds=(0,), cells=TOY.cells, run=_run_drifting,
                           report=_report, canary=harness.Cell("s", "A", {"lr": 0.1, "rounds": 2}), canary_seed=7)


def test_a_canary_rerun_is_silent_at_the_same_numbers_and_names_the_first_drifted_value(tmp_path):
    DRIFT["offset"] = 0.0
    harness.write_canary(CANARY_TOY, root=tmp_path)
    record = harness.load_records(tmp_path, "toy")  # the canary is not a page's record
    assert record == [] and harness.canary_path(tmp_path, "toy").is_file()
    assert harness.rerun_canary(CANARY_TOY, root=tmp_path) == []
    DRIFT["offset"] = 1e-12  # the smallest drift counts: bit for bit
    problems = harness.rerun_canary(CANARY_TOY, root=tmp_path)
    assert len(problems) == 1 and "canary metrics differs" in problems[0]
    assert "acc[0]: recorded 0.5, now 0.500000000001" in problems[0]
    DRIFT["offset"] = 0.0


def test_a_missing_canary_record_is_a_problem_that_says_how_to_write_it(tmp_path):
    (problem,) = harness.rerun_canary(CANARY_TOY, root=tmp_path)
    assert "no canary record" in problem and "reproduce.py canary toy" in problem


def test_on_another_processor_a_canary_agrees_within_the_tolerance_and_still_names_a_real_drift(tmp_path):
    import json

    DRIFT["offset"] = 0.0
    harness.write_canary(CANARY_TOY, root=tmp_path)
    path = harness.canary_path(tmp_path, "toy")
    record = json.loads(path.read_text())
    record["cpu"] = "Some Other CPU; AVX2"
    path.write_text(json.dumps(record))
    DRIFT["offset"] = 1e-6  # rounding of another instruction set: within 1e-3 (1 + |x|)
    assert harness.rerun_canary(CANARY_TOY, root=tmp_path) == []
    DRIFT["offset"] = 0.01  # a real change of the numbers
    (problem,) = harness.rerun_canary(CANARY_TOY, root=tmp_path)
    assert "acc[0]: recorded 0.5, now 0.51" in problem and "compared within 0.001" in problem
    record["data_checksum"] = "other data"
    path.write_text(json.dumps(record))
    DRIFT["offset"] = 0.0
    (problem,) = harness.rerun_canary(CANARY_TOY, root=tmp_path)
    assert "canary data_checksum differs" in problem  # the data must be the same bytes on any processor
