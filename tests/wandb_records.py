"""Read an offline W&B run back from its ``run-<id>.wandb`` file (no server, no network).

The file is a LevelDB-style log (W&B's transaction log): a 7-byte header ``:W&B`` + magic + version, then 32 KiB
blocks of records, each ``crc32 (4) | length (2) | type (1) | payload``, a payload split over blocks as
FIRST/MIDDLE/LAST pieces. Each payload is a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"not a W&B transaction log: {path}"
    pos, pending, records = HEADER, b"", []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a record header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):  # the writer is still appending this record
            break
        payload = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            pending, complete = b"", payload
        elif kind == FIRST:
            pending, complete = payload, None
        elif kind == MIDDLE:
            pending, complete = pending + payload, None
        elif kind == LAST:
            pending, complete = b"", pending + payload
        else:  # zero padding at the end of the file
            break
        if complete is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(complete)
            records.append(record)
    return records


def offline_run(save_dir: Path, timeout: float = 60.0) -> dict:
    """``{"config", "history" (rows), "summary", "files", "metrics" (define_metric calls), "dir"}`` of the run.

    ``run.finish()`` returns before W&B's service has written the whole log, so this waits (up to ``timeout``
    seconds) for the run's closing ``exit`` record.
    """
    runs = sorted(Path(save_dir).glob("wandb/offline-run-*"))
    assert len(runs) == 1, runs
    (log,) = runs[0].glob("run-*.wandb")
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(log)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    config, history, summary, files, metrics = {}, [], {}, [], []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "config":
            for item in record.config.update:
                key = ".".join([item.key] if item.key else list(item.nested_key))
                config[key] = json.loads(item.value_json)
        elif kind == "history":
            history.append({
                ".".join([i.key] if i.key else list(i.nested_key)): json.loads(i.value_json)
                for i in record.history.item
            })
        elif kind == "summary":
            for item in record.summary.update:
                key = ".".join([item.key] if item.key else list(item.nested_key))
                summary[key] = json.loads(item.value_json)
        elif kind == "files":
            files.extend(f.path for f in record.files.files)
        elif kind == "metric":  # define_metric
            m = record.metric
            metrics.append({("glob" if m.glob_name else "name"): m.glob_name or m.name, "step_metric": m.step_metric})
    return {"config": config, "history": history, "summary": summary, "files": files, "metrics": metrics,
            "dir": runs[0]}
