import os
import warnings

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
warnings.filterwarnings("ignore", ".*does not have many workers.*")


@pytest.fixture(autouse=True)
def _quiet_lightning(monkeypatch):
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    yield
