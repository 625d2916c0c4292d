from __future__ import annotations

import shutil

import pytest

from lightning_fedhet.experiments import InProcess, load_records, run_study
from tests.experiments.small_study import STUDY


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The small study run one cell x seed at a time in this process: ``(root, records)``; copy, do not modify."""
    root = tmp_path_factory.mktemp("reference")
    run_study(STUDY, root=root, backend=InProcess(), progress=False, log=lambda text: None)
    return root, load_records(root, STUDY.name)


@pytest.fixture
def reference_copy(reference, tmp_path):
    """A writable copy of the reference results folder."""
    root = tmp_path / "results"
    shutil.copytree(reference[0], root)
    return root


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster of 2 CPUs for the Ray tests (started once: starting Ray and importing torch in its
    workers is most of their time)."""
    ray = pytest.importorskip("ray", reason="the Ray backend's tests need the [ray] extra (pip install ray)")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 2**20)
    yield ray
    ray.shutdown()
