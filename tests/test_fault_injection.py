"""Kill a training process with SIGKILL at random points, resume from its last readable checkpoint each time:
the final global model is bitwise the uninterrupted one (CPU, FedVARP, sequential and vmap engines)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 150  # long enough that three kills land before the run ends, also on an idle machine

CHILD = r'''
import sys
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedVARP
from lightning_fedhet.participation import Bernoulli
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset

engine, rounds, ckpt_dir, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)


def newest_readable():
    for path in sorted(ckpt_dir.glob("round=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]), reverse=True):
        try:
            torch.load(path, weights_only=False)
            return str(path)
        except Exception:  # a checkpoint the kill cut in half: take the one before
            continue
    return None


ds = toy_dataset(64)
data = FederatedDataModule(ds, [np.arange(i * 8, (i + 1) * 8) for i in range(8)], batch_size=4)
strategy = FedHetStrategy(algorithm=FedVARP(), participation=Bernoulli(0.5), local_steps=3, engine=engine, seed=7)
checkpoints = ModelCheckpoint(dirpath=ckpt_dir, filename="round={epoch}", save_top_k=-1, auto_insert_metric_name=False)
trainer = quiet_trainer(
    strategy=strategy, max_epochs=rounds, limit_val_batches=0, enable_checkpointing=True, callbacks=[checkpoints]
)
model = TinyClassifier(momentum=0.9)
trainer.fit(model, datamodule=data, ckpt_path=newest_readable())
torch.save(flat_params(model), out)
'''


def _start(script: Path, engine: str, ckpt_dir: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(script), engine, str(ROUNDS), str(ckpt_dir), str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_three_random_kills_then_resume_is_bitwise_uninterrupted(tmp_path, engine):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    reference_out = tmp_path / "reference.pt"
    ref = _start(script, engine, tmp_path / "ref_ckpt", reference_out)
    assert ref.wait(timeout=300) == 0, ref.stderr.read().decode()[-3000:]

    rng = np.random.default_rng(2026)
    ckpt_dir, out = tmp_path / "ckpt", tmp_path / "out.pt"
    kills = 0
    while kills < 3:
        proc = _start(script, engine, ckpt_dir, out)
        before = len(list(ckpt_dir.glob("*.ckpt"))) if ckpt_dir.exists() else 0
        deadline = time.monotonic() + 120
        # wait until this process has written a new checkpoint, then kill it at a random moment
        while proc.poll() is None and time.monotonic() < deadline:
            if ckpt_dir.exists() and len(list(ckpt_dir.glob("*.ckpt"))) > before:
                break
            time.sleep(0.05)
        time.sleep(float(rng.uniform(0.0, 0.6)))
        if proc.poll() is not None:
            break  # it finished before the kill: nothing left to interrupt
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills == 3, "the run finished before three kills; make it longer"
    final = _start(script, engine, ckpt_dir, out)
    assert final.wait(timeout=300) == 0, final.stderr.read().decode()[-3000:]
    assert torch.equal(torch.load(out), torch.load(reference_out))
