"""scripts/gpu/: the FedAU GPU script's rounds rule and the import of its records into the studies' record files."""

import json

from gpu import fedau_v2, import_records
from studies import fedau

from lightning_fedhet.experiments import record_path


def test_rounds_rule_takes_the_largest_ladder_step_every_worker_fits():
    # two workers, one cell each: 0.1 s/round and 5 s setup; 330 s left. 2,000 rounds project to 5 + 230 = 235 s,
    # which fits; at 0.2 s/round 2,000 do not (465 s) but 1,000 do (235 s). A worker with two cells doubles both.
    ladder = (2000, 1000, 500, 250)
    assert fedau_v2.choose_rounds({0: (0.1, 5.0), 1: (0.1, 5.0)}, {0: 1, 1: 1}, 330.0, ladder) == 2000
    assert fedau_v2.choose_rounds({0: (0.1, 5.0), 1: (0.2, 5.0)}, {0: 1, 1: 1}, 330.0, ladder) == 1000
    assert fedau_v2.choose_rounds({0: (0.1, 5.0)}, {0: 2}, 330.0, ladder) == 1000
    assert fedau_v2.choose_rounds({0: (10.0, 5.0)}, {0: 1}, 330.0, ladder) == 250  # nothing fits: the smallest


def _record(cell, **config) -> dict:
    return {"study": "fedau", "protocol": fedau.PROTOCOL, "setting": cell.setting, "method": cell.method, "seed": 3,
            "commit": "abc", "dirty": False, "device": "NVIDIA H100", "torch": "2.11", "engine": "vmap",
            "config": {**cell.config, **config}, "seeds_in_run": 10, "wall_s": 1.0, "cpu_s": 1.0,
            "metrics": {"round": [10], "val_acc": [0.5], "received": [25] * 10}, "threads": 1,
            "data_checksum": "0" * 64}


def test_import_writes_protocol_cells_and_refuses_what_is_not_one(tmp_path):
    # A record of a v2 cell at a ladder step (rounds 500, its window) is written where the studies read it; one
    # whose configuration differs from its cell (another N) or that names no cell is refused; an existing file
    # is kept unless --force.
    cell = fedau.CELLS[0]
    good = _record(cell, rounds=500, metric_window_rounds=50)
    wrong_n = _record(cell, num_clients=20)
    no_cell = {**_record(cell), "method": "FedVARP"}
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (good, wrong_n, no_cell)))
    assert import_records.main([str(jsonl), "--root", str(tmp_path)]) == 1  # two refused
    path = record_path(tmp_path, "fedau", fedau.PROTOCOL, cell.setting, cell.method, 3)
    assert json.loads(path.read_text())["config"]["rounds"] == 500
    assert "num_clients" in import_records.check_record(wrong_n)
    assert "not a cell" in import_records.check_record(no_cell)
    jsonl.write_text(json.dumps({**good, "wall_s": 2.0}) + "\n")
    assert import_records.main([str(jsonl), "--root", str(tmp_path)]) == 0
    assert json.loads(path.read_text())["wall_s"] == 1.0  # kept
    assert import_records.main([str(jsonl), "--root", str(tmp_path), "--force"]) == 0
    assert json.loads(path.read_text())["wall_s"] == 2.0
