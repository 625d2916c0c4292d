"""scripts/gpu/: the import of the FedAU GPU records into the studies' record files (the device script itself:
tests/test_device_script.py)."""

import json

from gpu import import_records
from studies import fedau

from lightning_fedhet.experiments import record_path


def _record(cell, **config) -> dict:
    return {"study": "fedau", "protocol": fedau.PROTOCOL, "setting": cell.setting, "method": cell.method, "seed": 3,
            "commit": "abc", "dirty": False, "device": "NVIDIA H100", "torch": "2.11", "engine": "vmap",
            "config": {**cell.config, **config}, "seeds_in_run": 10, "wall_s": 1.0, "cpu_s": 1.0,
            "metrics": {"round": [10], "val_acc": [0.5], "received": [25] * 10}, "threads": 1,
            "data_checksum": "0" * 64}


def test_import_writes_protocol_cells_and_refuses_what_is_not_one(tmp_path):
    # A record of a v2 cell at the protocol's horizon (2,000 rounds, window 200) is written where the studies read
    # it; one at a shortened horizon (500 rounds, the old GPU ladder's step), one whose configuration differs from its
    # cell (another N) and one that names no cell are refused; an existing file is kept unless --force.
    cell = fedau.CELLS[0]
    assert (cell.config["rounds"], cell.config["metric_window_rounds"]) == (2000, 200)
    good = _record(cell, p=[0.1] * 250, gpu_workers=1)  # keys a run adds are not the cell's: not compared
    short = _record(cell, rounds=500, metric_window_rounds=50)
    wrong_n = _record(cell, num_clients=20)
    no_cell = {**_record(cell), "method": "FedVARP"}
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (good, short, wrong_n, no_cell)))
    assert import_records.main([str(jsonl), "--root", str(tmp_path)]) == 1  # three refused
    path = record_path(tmp_path, "fedau", fedau.PROTOCOL, cell.setting, cell.method, 3)
    assert json.loads(path.read_text())["config"]["rounds"] == 2000
    assert "['metric_window_rounds', 'rounds']" in import_records.check_record(short)
    assert "num_clients" in import_records.check_record(wrong_n)
    assert "not a cell" in import_records.check_record(no_cell)
    jsonl.write_text(json.dumps({**good, "wall_s": 2.0}) + "\n")
    assert import_records.main([str(jsonl), "--root", str(tmp_path)]) == 0
    assert json.loads(path.read_text())["wall_s"] == 1.0  # kept
    assert import_records.main([str(jsonl), "--root", str(tmp_path), "--force"]) == 0
    assert json.loads(path.read_text())["wall_s"] == 2.0
