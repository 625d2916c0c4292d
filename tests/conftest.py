import os
import sys
import warnings
from pathlib import Path

import pytest

# The repository's own tools and studies live in scripts/ (the packages `studies` and `referee`, the GPU scripts in
# `gpu`), outside the wheel: appended (last, so nothing there shadows an installed module) for their tests.
SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")
if SCRIPTS not in sys.path:
    sys.path.append(SCRIPTS)

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
warnings.filterwarnings("ignore", ".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    yield


@pytest.fixture
def in_this_process():
    """For a one-process FedHetDDPStrategy fit in the test process: Lightning initialises a one-member process group
    here and sets its environment variables; both are undone afterwards."""
    import torch.distributed

    environ = dict(os.environ)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)
