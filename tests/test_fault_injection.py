"""Kill a training process with SIGKILL at chosen points (mid-round, at a round's end before its checkpoint, and
after a checkpoint write cut in half), resume from its last readable checkpoint each time: the final global model is
bitwise the uninterrupted one (CPU, FedVARP, sequential and vmap engines).

The kill points are drawn once from a seeded generator and reached by the child itself (a callback that kills its
own process when training gets there), so the test does not depend on how fast the machine is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 10

CHILD = r'''
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_fedhet import FederatedDataModule, FedHetStrategy
from lightning_fedhet.algorithms import FedVARP
from lightning_fedhet.participation import Bernoulli
from tests.helpers import TinyClassifier, flat_params, quiet_trainer, toy_dataset

engine, rounds, ckpt_dir, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
kind, kill_round, kill_step = (sys.argv[5], int(sys.argv[6]), int(sys.argv[7])) if len(sys.argv) > 5 else (None, -1, -1)
torch.set_num_threads(1)


def checkpoints():
    return sorted(ckpt_dir.glob("round=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]), reverse=True)


def newest_readable():
    for path in checkpoints():
        try:
            torch.load(path, weights_only=False)
            return str(path)
        except Exception:  # a checkpoint the kill cut in half: remove it, take the one before
            path.unlink()
    return None


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class Kill(Callback):
    """SIGKILL this process: after local step `kill_step` of round `kill_round` ("step"; at the round's end if it has
    fewer steps), at the round's end before its checkpoint ("end"), or after writing a torn copy of the newest
    checkpoint under this round's name, as a write cut in half would leave it ("torn")."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if kind == "step" and trainer.current_epoch == kill_round and batch_idx == kill_step:
            die()

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch != kill_round:
            return
        if kind == "torn":
            data = checkpoints()[0].read_bytes()
            (ckpt_dir / f"round={kill_round}.ckpt").write_bytes(data[: len(data) // 2])
        die()


ds = toy_dataset(64)
data = FederatedDataModule(ds, [np.arange(i * 8, (i + 1) * 8) for i in range(8)], batch_size=4)
strategy = FedHetStrategy(algorithm=FedVARP(), participation=Bernoulli(0.5), local_steps=3, engine=engine, seed=7)
checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="round={epoch}", save_top_k=-1, auto_insert_metric_name=False)
trainer = quiet_trainer(
    strategy=strategy, max_epochs=rounds, limit_val_batches=0, enable_checkpointing=True, callbacks=[Kill(), checkpoint]
)
model = TinyClassifier(momentum=0.9)
trainer.fit(model, datamodule=data, ckpt_path=newest_readable())
torch.save(flat_params(model), out)
'''


def _run(script: Path, engine: str, ckpt_dir: Path, out: Path, *kill) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(script), engine, str(ROUNDS), str(ckpt_dir), str(out), *map(str, kill)]
    return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)


def kill_points(seed: int = 2026) -> list[tuple[str, int, int]]:
    """Three kills in increasing rounds (each resumed run must reach the next), one of each kind, random steps."""
    rng = np.random.default_rng(seed)
    rounds = sorted(rng.choice(np.arange(1, ROUNDS - 1), size=3, replace=False).tolist())
    kinds = rng.permutation(["step", "end", "torn"]).tolist()
    return [(kind, r, int(rng.integers(0, 6))) for kind, r in zip(kinds, rounds)]


@pytest.mark.parametrize("engine", ["sequential", "vmap"])
def test_three_kills_then_resume_is_bitwise_uninterrupted(tmp_path, engine):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    reference_out = tmp_path / "reference.pt"
    ref = _run(script, engine, tmp_path / "ref_ckpt", reference_out)
    assert ref.returncode == 0, ref.stderr.decode()[-3000:]

    ckpt_dir, out = tmp_path / "ckpt", tmp_path / "out.pt"
    for kind, round, step in kill_points():
        killed = _run(script, engine, ckpt_dir, out, kind, round, step)
        assert killed.returncode == -9, (kind, round, killed.stderr.decode()[-3000:])  # it died where it was told
        assert not out.exists()
    final = _run(script, engine, ckpt_dir, out)
    assert final.returncode == 0, final.stderr.decode()[-3000:]
    assert torch.equal(torch.load(out), torch.load(reference_out))
