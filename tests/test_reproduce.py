"""The repository's reproductions as plug-ins of ``lightning_fedhet.experiments`` (scripts/studies/_repo.py and
scripts/reproduce.py), on a small fixture study that trains nothing.

The properties a reader of docs/results relies on: records are written once and skipped after and say where they
ran (the processor included); pages and the index are a pure function of the records (byte for byte, figures
included); ``check`` fails when a record is deleted, a number in a page is edited or a page is written by hand; the
statistics are the textbook ones; a canary re-runs bit for bit on its own processor and within 1e-3 on another, its
data checksum exactly everywhere.
"""

import ast
import json
import math
import sys
from pathlib import Path

import pytest
from studies import STUDIES, _repo

from lightning_fedhet.experiments import (
    Cell,
    Summary,
    by_seed,
    canary_path,
    check,
    fmt_ci,
    load_records,
    markdown_table,
    mean_ci,
    new_figure,
    paired,
    parse_seeds,
    report,
    rerun_canary,
    run_study,
    save_figure,
    verdict_for_gain,
    write_canary,
)
from lightning_fedhet.experiments import records as records_module

REPO = Path(__file__).resolve().parents[1]
QUIET = {"progress": False, "log": lambda text: None}
CALLS = []


def _run(cell, seed):
    CALLS.append((cell.method, seed))
    base = 0.5 if cell.method == "A" else 0.4
    return {"metrics": {"acc": [base + 0.01 * seed, base + 0.02 * seed]}, "engine": "none"}


def _report(records, out):
    final = {m: by_seed(records, lambda r: r["metrics"]["acc"][-1], method=m) for m in ("A", "B")}
    rows = [(m, fmt_ci(*mean_ci(list(v.values())))) for m, v in final.items()]
    (out / "toy.md").write_text("# toy\n\n" + markdown_table(("method", "acc"), rows))
    fig, axes = new_figure()
    for m, v in final.items():
        axes[0].plot(sorted(v), [v[s] for s in sorted(v)], label=m)
    save_figure(fig, out / "toy" / "acc.png")
    mean, lo, hi, n = paired(final["A"], final["B"])
    return [Summary("A beats B", "+10 pp", fmt_ci(mean, lo, hi) + f" ({n} seeds)",
                    verdict_for_gain(lo, mean, hi, 0.10))]


TOY = _repo.study(name="toy", title="Toy", protocol="v1", seeds=(0, 1, 2),
                  cells=(Cell("s", "A", {"lr": 0.1}), Cell("s", "B", {"lr": 0.1})), run=_run, report=_report)


@pytest.fixture
def root(tmp_path):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "protocol-v1.md").write_text("# protocol v1 (hand-written)\n")
    CALLS.clear()
    run_study(TOY, root=tmp_path, **QUIET)
    report([TOY], tmp_path, index=_repo.index)
    return tmp_path


def test_a_study_of_the_repository_keeps_its_records_and_pages_in_docs_results_and_names_its_code():
    assert TOY.root == _repo.RESULTS == REPO / "docs" / "results" and TOY.require_protocol
    assert TOY.code_paths == ("lightning_fedhet", "model_zoo", "callbacks", "scripts")
    assert set(STUDIES) == {p.stem for p in (REPO / "scripts" / "studies").glob("*.py") if not p.stem.startswith("_")}


def test_records_hold_the_required_keys_and_existing_runs_are_skipped(root):
    record = load_records(root, "toy")[0]
    for key in ("study", "method", "setting", "seed", "commit", "dirty", "config", "engine", "device", "cpu",
                "torch", "python", "threads", "wall_s", "cpu_s", "metrics", "protocol"):
        assert key in record
    assert (record["method"], record["seed"], record["config"]) == ("A", 0, {"lr": 0.1})
    assert len(CALLS) == 6
    assert len(run_study(TOY, seeds=[0, 1, 2, 3], root=root, **QUIET).written) == 2  # only seed 3 is new
    assert CALLS[6:] == [("A", 3), ("B", 3)]


def test_a_study_without_its_committed_protocol_refuses_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="protocol"):
        run_study(TOY, seeds=[0], root=tmp_path, **QUIET)


def test_check_passes_on_a_fresh_report_and_the_page_ends_with_the_referee_section(root):
    assert check([TOY], root, index=_repo.index) == []
    page = (root / "toy.md").read_text()
    # A's final accuracies 0.50, 0.52, 0.54: mean 0.52, s = 0.02, half-width t_{0.975,2} s / sqrt(3) = 4.303 x 0.0115
    assert "| A | 52.0 [47.0, 57.0] |" in page
    assert page.rstrip().endswith("Not compared yet: no record under `records/toy/referee/`.")
    index = (root / "README.md").read_text()
    assert "| [Toy](toy.md) | A beats B | +10 pp | 10.0 [10.0, 10.0] (3 seeds) | **reproduced** |" in index


def test_check_fails_when_a_record_is_deleted(root):
    (root / "records" / "toy" / "v1" / "s" / "a" / "seed2.json").unlink()
    problems = check([TOY], root, index=_repo.index)
    assert any(p.startswith("toy.md: differs") for p in problems)
    assert any(p.startswith("toy/acc.png: differs") for p in problems)


def test_check_fails_when_one_number_in_a_page_is_edited(root):
    page = root / "toy.md"
    page.write_text(page.read_text().replace("52.0", "53.0", 1))
    problems = check([TOY], root, index=_repo.index)
    assert len(problems) == 1 and problems[0].startswith("toy.md: differs")
    assert "53.0" in problems[0] and "52.0" in problems[0]


def test_check_flags_a_hand_written_page_that_no_record_generates(root):
    (root / "notes.md").write_text("accuracy 99 %\n")
    assert check([TOY], root, index=_repo.index) == [
        "notes.md: not generated from any record (stale or written by hand)"]


def test_mean_ci_and_paired_difference_match_hand_computation():
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0, 4.0])
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # t_{0.975,3} * s / sqrt(n), s^2 = 5/3
    assert (mean, lo, hi) == pytest.approx((2.5, 2.5 - half, 2.5 + half))
    # paired over the common seeds only: differences (1, 3) -> mean 2, t_{0.975,1} = 12.706, s = sqrt(2)
    mean, lo, hi, n = paired({0: 2.0, 1: 5.0, 2: 9.0}, {0: 1.0, 1: 2.0})
    assert (mean, n) == (2.0, 2) and hi - mean == pytest.approx(12.706204736 * math.sqrt(2) / math.sqrt(2))
    assert math.isnan(mean_ci([0.3])[1])


def test_verdict_rule():
    assert verdict_for_gain(0.01, 0.05, 0.09, paper_gain=0.06) == "reproduced"
    assert verdict_for_gain(0.001, 0.01, 0.02, paper_gain=0.06) == "partly reproduced"
    assert verdict_for_gain(-0.01, 0.02, 0.05, paper_gain=0.06) == "direction only"
    assert verdict_for_gain(-0.05, -0.01, 0.03, paper_gain=0.06) == "not reproduced"


def test_seed_ranges_parse():
    assert parse_seeds("0-2,7", ()) == [0, 1, 2, 7]
    assert parse_seeds(None, (4, 5)) == [4, 5]


def test_records_carry_the_thread_count_and_the_processor(root):
    record = load_records(root, "toy")[0]
    assert record["threads"] == TOY.threads == 1 and record["cpu"] == records_module.cpu_identity()


def test_without_git_the_code_version_is_unknown_not_clean(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "_git", lambda repo, *args: "")
    assert records_module.code_version(tmp_path, ("scripts",)) == {"commit": "unknown", "dirty": None}


# ------------------------------------------------------------------------------------------------- canary re-runs
DRIFT = {"offset": 0.0}


def _run_drifting(cell, seed):
    return {"metrics": {"acc": [0.5 + DRIFT["offset"], 0.25]}, "engine": "none", "data_checksum": "abc"}


CANARY_TOY = _repo.study(name="toy", title="Toy", protocol="v1", seeds=(0,), cells=TOY.cells, run=_run_drifting,
                         report=_report, canary=Cell("s", "A", {"lr": 0.1, "rounds": 2}), canary_seed=7)


def test_a_canary_rerun_is_silent_at_the_same_numbers_and_names_the_first_drifted_value(tmp_path):
    DRIFT["offset"] = 0.0
    record = write_canary(CANARY_TOY, root=tmp_path)
    assert record["cpu"] == records_module.cpu_identity() and record["protocol"] == "canary"
    assert load_records(tmp_path, "toy") == [] and canary_path(tmp_path, "toy").is_file()  # not a page's record
    assert rerun_canary(CANARY_TOY, root=tmp_path) == []
    DRIFT["offset"] = 1e-12  # the smallest drift counts on the same processor: bit for bit
    problems = rerun_canary(CANARY_TOY, root=tmp_path)
    assert len(problems) == 1 and "canary metrics differs" in problems[0]
    assert "acc[0]: recorded 0.5, now 0.500000000001" in problems[0]
    DRIFT["offset"] = 0.0


def test_a_missing_canary_record_is_a_problem_that_says_how_to_write_it(tmp_path):
    (problem,) = rerun_canary(CANARY_TOY, root=tmp_path)
    assert "no canary record" in problem and "fedhet-study canary" in problem


def test_on_another_processor_a_canary_agrees_within_the_tolerance_and_still_names_a_real_drift(tmp_path):
    DRIFT["offset"] = 0.0
    write_canary(CANARY_TOY, root=tmp_path)
    path = canary_path(tmp_path, "toy")
    record = json.loads(path.read_text())
    record["cpu"] = "Some Other CPU; AVX2"
    path.write_text(json.dumps(record))
    DRIFT["offset"] = 1e-6  # rounding of another instruction set: within 1e-3 (1 + |x|)
    assert rerun_canary(CANARY_TOY, root=tmp_path) == []
    DRIFT["offset"] = 0.01  # a real change of the numbers
    (problem,) = rerun_canary(CANARY_TOY, root=tmp_path)
    assert "acc[0]: recorded 0.5, now 0.51" in problem and "compared within 0.001" in problem
    record["data_checksum"] = "abd"
    path.write_text(json.dumps(record))
    DRIFT["offset"] = 0.0
    (problem,) = rerun_canary(CANARY_TOY, root=tmp_path)
    assert "canary data_checksum differs" in problem  # the data must be the same bytes on any processor
    DRIFT["offset"] = 0.0


# ------------------------------------------------------------------------------------------------- the front end
def test_reproduce_lists_the_studies_in_the_index_order(capsys):
    import reproduce

    assert reproduce.main(["list"]) == 0
    names = [line.split(" ")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert names == list(STUDIES)


def test_a_study_file_loads_as_the_module_of_the_package_studies():
    from lightning_fedhet.experiments import load_study

    study = load_study(str(REPO / "scripts" / "studies" / "fedstale.py"))
    assert study.name == "fedstale" and study.root == _repo.RESULTS
    assert sys.modules["studies.fedstale"].STUDY.cells == study.cells


def test_no_script_imports_the_removed_harness():
    for path in (REPO / "scripts").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert "harness" not in names, path
