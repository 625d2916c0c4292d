"""tests/flower needs Flower (the extra ``lightning-fedhet[flower]``).

The core environment has no Flower, so these tests skip there; scripts/ci_flower.sh runs them in the environment
that has it, with ``FEDHET_REQUIRE_FLOWER=1``, which turns a missing Flower into a failure instead of a skip.
"""

import importlib.util
import os

import pytest

# No reports from the test machine: Flower's telemetry, its update check and Ray's usage statistics stay off.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

if importlib.util.find_spec("flwr") is None and os.environ.get("FEDHET_REQUIRE_FLOWER") == "1":
    raise pytest.UsageError("FEDHET_REQUIRE_FLOWER=1 but flwr is not installed: pip install 'lightning-fedhet[flower]'")


@pytest.fixture(scope="module")
def task_identity():
    """What a ServerApp process has set when it builds messages (a Flower runtime sets it; here the test does). A
    module whose tests build messages asks for it: ``pytestmark = pytest.mark.usefixtures("task_identity")``."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = saved
