"""scripts/gpu/device_run.py, the one prepared device call, run on the CPU with ``--smoke`` (N = 20, 3 rounds, seeds
0-1, random stand-in images; the contract and the bench tiny): the files appear, the contract passes (and fails on a
divergence), a second call skips the cells and the seeds already done, a cell whose projection does not fit is not
started or, when some of its seeds fit, runs those, and the real plan runs every cell at the protocol's 2,000 rounds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu import contract_smoke, device_run, fedau_v2
from studies import fedau

from lightning_fedhet.algorithms import FedAvg
from lightning_fedhet.experiments import record_path, write_record

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "device_run.py"
NAMES = [f"{c.setting}/{c.method}" for c in fedau.CELLS]


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke")
    _run(out, "--workers", "2")
    return out


def test_smoke_runs_every_part_and_writes_its_files(smoke):
    assert {"contract.json", "records.jsonl", "cells.json", "bench.json", "log.txt"} <= {p.name for p in
                                                                                         smoke.iterdir()}
    contract = json.loads((smoke / "contract.json").read_text())
    assert contract["pass"] and contract["device"] == "cpu"
    assert [(c["rule"], c["engine"]) for c in contract["checks"]] == [
        (rule, engine) for rule in ("FedAvg", "FedVARP", "FedAU") for engine in ("vmap", "stacked")]
    assert all(c["max_abs_diff"] <= 1e-5 and c["same_received"] for c in contract["checks"])
    records = _lines(smoke / "records.jsonl")
    assert len(records) == 10 * 2  # 10 cells x seeds 0-1, each cell written whole
    assert sorted({f"{r['setting']}/{r['method']}" for r in records}) == sorted(NAMES)
    assert {(r["config"]["rounds"], r["config"]["num_clients"], r["seeds_in_run"]) for r in records} == {(3, 20, 2)}
    cells = json.loads((smoke / "cells.json").read_text())
    assert cells["plan"] == NAMES and {c["state"] for c in cells["cells"].values()} == {"done"}
    bench = json.loads((smoke / "bench.json").read_text())
    b1 = bench["tasks"]["B1"]
    assert set(b1["ratios"]) == {"stacked x1 samples/s / central samples/s", "stacked x2 samples/s / central samples/s"}
    # ratio = seeds x t_central / t_stacked, from the row's own times
    row = b1["per_executor"]
    assert b1["ratios"]["stacked x2 samples/s / central samples/s"] == pytest.approx(
        2 * row["central"]["s_per_round"] / row["stacked x2"]["s_per_round"])
    assert "ratios" in bench["tasks"]["B2"] or "skipped" in bench["tasks"]["B2"]  # B2 needs Fashion-MNIST
    log = (smoke / "log.txt").read_text()
    assert re.search(r"^\[\d\d:\d\d:\d\d \+ *\d+\.\ds\] a\. contract PASS", log, re.M)


def test_a_second_call_skips_the_cells_and_the_seeds_already_done(smoke, tmp_path):
    # The first 8 cells' records come in a --done file (a call's records.jsonl not yet imported), the 9th's as record
    # files under --records-root (as the import writes them), and seed 0 of the 10th in the --done file (as a CPU run
    # of one seed leaves it): only the 10th cell runs, and only its seed 1.
    records = _lines(smoke / "records.jsonl")
    done = tmp_path / "done.jsonl"
    done.write_text("".join(json.dumps(r) + "\n" for r in records if f"{r['setting']}/{r['method']}" in NAMES[:8]
                            or (f"{r['setting']}/{r['method']}" == NAMES[9] and r["seed"] == 0)))
    root = tmp_path / "results"
    for r in records:
        if f"{r['setting']}/{r['method']}" == NAMES[8]:
            write_record(record_path(root, "fedau", r["protocol"], r["setting"], r["method"], r["seed"]), r)
    out = tmp_path / "out"
    _run(out, "--parts", "fedau", "--done", str(done), "--records-root", str(root))
    cells = json.loads((out / "cells.json").read_text())["cells"]
    assert [cells[n]["state"] for n in NAMES] == ["done before"] * 9 + ["done"]
    assert str(root) in cells[NAMES[8]]["where"] and str(done) in cells[NAMES[0]]["where"]
    assert [(f"{r['setting']}/{r['method']}", r["seed"], r["seeds_in_run"]) for r in _lines(out / "records.jsonl")
            ] == [(NAMES[9], 1, 1)]
    assert cells[NAMES[9]]["state"] == "done"
    assert fedau_v2.record_plan(fedau_v2.plan(smoke=True), (0, 1), root, [done])[1] == {NAMES[9]: [1]}
    assert not (out / "contract.json").exists() and not (out / "bench.json").exists()  # --parts fedau


def test_record_plan_names_each_cells_seeds_without_a_record_at_its_configuration(tmp_path):
    # Smoke cells (N = 20, 3 rounds), seeds 0-2. Cell 0: every seed in the --done file -> done, nothing left. Cell 1:
    # seed 1 committed under the root, seed 2 in the --done file, seed 0 only at another horizon (2,000 rounds,
    # which is not the cell's) -> seed 0 left. Every other cell: no record -> all three, in order.
    cells = fedau_v2.plan(smoke=True)
    names = [fedau_v2.name(c) for c in cells]

    def rec(cell, seed, rounds=3):
        return {"study": "fedau", "protocol": fedau.PROTOCOL, "setting": cell.setting, "method": cell.method,
                "seed": seed, "config": {"rounds": rounds, "num_clients": 20}}

    root = tmp_path / "results"
    write_record(record_path(root, "fedau", fedau.PROTOCOL, cells[1].setting, cells[1].method, 1), rec(cells[1], 1))
    write_record(record_path(root, "fedau", fedau.PROTOCOL, cells[1].setting, cells[1].method, 0),
                 rec(cells[1], 0, rounds=2000))
    done = tmp_path / "done.jsonl"
    done.write_text("".join(json.dumps(r) + "\n" for r in [rec(cells[0], 0), rec(cells[0], 1), rec(cells[0], 2),
                                                           rec(cells[1], 2)]))
    done_cells, left = fedau_v2.record_plan(cells, (0, 1, 2), root, [done])
    assert left == {names[1]: [0], **{n: [0, 1, 2] for n in names[2:]}}
    assert done_cells == {names[0]: f"records in {done}"}


def test_a_cell_that_does_not_fit_is_not_started(tmp_path):
    # 1,000 s per round measured earlier: a 3-round cell projects to 3 x 1,000 x 1.1 + 20 = 3,320 s, more than a
    # 200 s budget leaves; neither it nor a later cell starts, and no record is written.
    out = tmp_path / "out"
    _run(out, "--parts", "fedau", "--s-per-round", "1000", "--budget-s", "200")
    cells = json.loads((out / "cells.json").read_text())["cells"]
    assert {c["state"] for c in cells.values()} == {"not started"}
    assert all(c["why"].startswith("projected 3320 s") for c in cells.values())
    assert not (out / "records.jsonl").exists()


def test_the_projection_rule_by_hand():
    cell = fedau.CELLS[0]  # 2,000 rounds
    assert fedau_v2.estimate_cell_s(2000, 10, [], []) is None  # nothing measured: the cell probes itself
    rates = [(10, 0.1), (10, 0.05)]
    assert fedau_v2.estimate_cell_s(2000, 10, [], rates) == pytest.approx(0.1 * 2000 * 1.1 + 20)  # 240 s
    walls = [(10, 150.0), (10, 180.0)]
    assert fedau_v2.estimate_cell_s(2000, 10, walls, [(10, 0.1)]) == pytest.approx(180 * 1.1)  # a whole cell: 198 s
    assert fedau_v2.refusal(cell, 10, [], [(10, 0.1)], 241.0) is None
    assert fedau_v2.refusal(cell, 10, [], [(10, 0.1)], 239.0).startswith("projected 240 s, 239 s left")
    assert fedau_v2.refusal(cell, 10, [], [], 100.0) is None
    assert fedau_v2.refusal(cell, 10, [], [], 20.0) is not None  # under the set-up guess: nothing starts


def test_a_cell_that_does_not_fit_whole_runs_the_seeds_that_fit():
    cell = fedau.CELLS[0]  # 2,000 rounds; a 10-seed cell measured at 0.2 s a round
    rates = [(10, 0.2)]
    # 10 seeds: 0.2 x 2000 x 1.1 + 20 = 460 s; k seeds, scaled: 44 k + 20 s
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], rates, 461.0) == list(range(10))
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], rates, 459.0) == list(range(9))  # 416 s fits
    assert fedau_v2.seeds_that_fit(cell, [3, 5, 8], [], rates, 300.0) == [3, 5, 8]  # 152 s: the remainder, whole
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], rates, 200.0) == [0, 1, 2, 3]  # 196 s; 5 take 240
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], rates, 65.0) == [0]  # one seed takes 64 s
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], rates, 63.0) == []
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], [], 100.0) == list(range(10))  # it probes itself
    assert fedau_v2.seeds_that_fit(cell, list(range(10)), [], [], 20.0) == []  # under the set-up guess


def test_a_call_splits_a_cell_that_does_not_fit_by_seeds(tmp_path):
    # Smoke cells (3 rounds, seeds 0-1) said to take 100 s a round for both seeds: the whole first cell projects to
    # 100 x 3 x 1.1 + 20 = 350 s, more than the 275 s a 300 s budget leaves; seed 0 alone, 185 s, fits and runs. The
    # second cell is then judged by the first's one-seed wall (seconds), so its seed 0 runs too; seed 1 of each waits.
    out = tmp_path / "out"
    _run(out, "--parts", "fedau", "--s-per-round", "100", "--budget-s", "300", "--cells", *NAMES[:2])
    cells = json.loads((out / "cells.json").read_text())["cells"]
    for n in NAMES[:2]:
        assert cells[n]["state"] == "partly done" and cells[n]["seeds"] == [0] and cells[n]["seeds_left"] == [1]
    assert [(f"{r['setting']}/{r['method']}", r["seed"], r["seeds_in_run"]) for r in _lines(out / "records.jsonl")
            ] == [(NAMES[0], 0, 1), (NAMES[1], 0, 1)]
    assert "seeds [0] run now, [1] wait for the next call" in (out / "log.txt").read_text()


def test_the_projection_counts_the_seeds_of_the_cell():
    # The GPU call of 2026-11-29: a 2-seed remainder finished in 110 s (0.054 s a round); the next cells have 10
    # seeds (0.21-0.22 s a round), 416 s were left. Projecting them from the 2-seed wall (121 s) started seven cells
    # that each abandoned after 30 rounds.
    small_wall, given = [(2, 110.0)], [(10, 0.2299), (2, 0.054)]
    # a measurement on a cell of the same seed count wins, a given rate over a wall of another size: 525.8 s
    assert fedau_v2.estimate_cell_s(2000, 10, small_wall, given) == pytest.approx(0.2299 * 2000 * 1.1 + 20)
    assert fedau_v2.refusal(fedau.CELLS[0], 10, small_wall, given, 416.0).startswith("projected 526 s")
    # nothing of the same size: scaled in proportion to the seeds, 110 s x 10 / 2 x 1.1 = 605 s
    assert fedau_v2.estimate_cell_s(2000, 10, small_wall, []) == pytest.approx(605.0)
    # the slowest once scaled: 110 x 10 / 2 = 550 s beats 200 x 10 / 5 = 400 s
    assert fedau_v2.estimate_cell_s(2000, 10, [(5, 200.0), *small_wall], []) == pytest.approx(605.0)
    # and down: a 10-seed cell of 430 s projects a 2-seed remainder at 430 x 2 / 10 x 1.1 = 94.6 s
    assert fedau_v2.estimate_cell_s(2000, 2, [(10, 430.0)], [(10, 0.21)]) == pytest.approx(94.6)
    # a same-size wall beats a same-size rate (the wall includes set-up and evaluations)
    assert fedau_v2.estimate_cell_s(2000, 2, [(2, 110.0)], [(2, 0.3)]) == pytest.approx(121.0)


def test_the_real_plan_runs_every_cell_at_the_protocols_full_horizon():
    cells = fedau_v2.plan(smoke=False)
    assert [f"{c.setting}/{c.method}" for c in cells] == NAMES  # the protocol's order of priority
    assert {(c.config["rounds"], c.config["num_clients"]) for c in cells} == {(2000, 250)}
    assert fedau_v2.plan_seeds() == tuple(range(10))
    with pytest.raises(SystemExit):  # no way to shorten the horizon from the command line
        device_run.parse_args(["--out", "x", "--data-dir", "d", "--rounds", "250"])


def test_the_contract_smoke_fails_on_a_divergence_and_on_its_budget(monkeypatch):
    # The reference (first rule made) steps with server_lr 1.0, the vmap and stacked runs with 1.5: their global
    # parameters differ by far more than 1e-5, and both checks fail.
    made = []

    def drifting():
        made.append(1)
        return FedAvg(weighting="participating", server_lr=1.0 if len(made) == 1 else 1.5)

    monkeypatch.setattr(contract_smoke, "RULES", {"FedAvg": drifting})
    result = contract_smoke.run("cpu")
    assert not result["pass"] and [c["pass"] for c in result["checks"]] == [False, False]
    assert min(c["max_abs_diff"] for c in result["checks"]) > 1e-3
    over = contract_smoke.run("cpu", budget_s=-1.0)  # nothing may start: the rules left count as failed
    assert not over["pass"] and over["not_run_over_budget"] == ["FedAvg"] and over["checks"] == []


def test_the_device_command_fits_the_tool_and_is_the_documented_one():
    command = next(line.strip() for line in device_run.__doc__.splitlines()
                   if line.strip().startswith("PYTHONUNBUFFERED=1 python3 scripts/gpu/device_run.py"))
    assert len(command) < 2000
    assert command in (ROOT / "docs" / "performance.md").read_text()
    args = device_run.parse_args(command.split()[3:])  # after the environment, python3 and the script
    assert (args.data_dir, args.budget_s, args.commit, args.workers) == (".gpu_data", 540.0, "HASH", 1)
    assert args.parts == ["contract", "fedau", "bench"]


def test_a_source_checkout_that_was_never_installed_imports(tmp_path):
    # The device machine has the copied tree and no install: without the editable install's finder,
    # lightning_fedhet's __init__ cannot find lightning_fedhet.callbacks; the script's finder maps it (and model_zoo).
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        "sys.path[:] = [p for p in sys.path if '__editable__' not in p]\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import importlib.util\n"
        "print('installed' if importlib.util.find_spec('lightning_fedhet') else 'not-installed')\n"
        "from gpu import _source_checkout\n"
        "_source_checkout.install()\n"
        "import lightning_fedhet.model_zoo, lightning_fedhet.callbacks\n"
        "print(lightning_fedhet.model_zoo.__file__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, path = proc.stdout.split()
    if where == "installed":
        pytest.skip("lightning_fedhet is installed as a regular package here: no source layout to map")
    assert path == str(ROOT / "model_zoo" / "__init__.py")
