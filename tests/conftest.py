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


def _hypothesis_without_local_constants() -> None:
    """Make a derandomized property test draw the same examples whatever ran before it.

    Hypothesis (>= 6.131) draws about 5 % of its numbers and strings from a pool of literals that it collects from
    every *local* module in ``sys.modules`` (here: ``lightning_fedhet``, ``scripts/``, ...; test files excluded),
    and grows that pool whenever ``sys.modules`` grows. The pool therefore depends on which modules earlier tests
    (or the collection of other test files) happened to import, and so do the draws, even with ``derandomize=True``
    and no database: the twelve FedStale files in a row drew ``FedCIS(aggregation_base=np.empty((1, 0)))``, which
    the property file alone never drew. There is no setting for it; the pool is emptied here (the global pool of
    nasty values stays). ``tests/test_property_order.py`` fails if a Hypothesis upgrade renames what is patched.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # hypothesis not installed: the property tests skip or fail on their own
        return
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty


_hypothesis_without_local_constants()


def pytest_collection_modifyitems(config, items):
    """``FEDHET_TEST_ORDER=reverse`` runs the collected tests last to first, ``FEDHET_TEST_ORDER=shuffle:<seed>`` in
    an order drawn from ``seed`` (files and the tests inside them mixed): ``scripts/ci_property_order.sh`` runs the
    property tests so, to show that nothing they draw or check depends on what ran before them."""
    order = os.environ.get("FEDHET_TEST_ORDER", "")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        import random

        random.Random(int(order.split(":", 1)[1])).shuffle(items)
    elif order:
        raise pytest.UsageError(f"FEDHET_TEST_ORDER must be 'reverse' or 'shuffle:<seed>', got {order!r}")


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
