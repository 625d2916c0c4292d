"""Smoke tests of the issue-5 reproduction scripts: each ``main`` runs on a tiny budget and writes its table + PNG."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPRO = Path(__file__).resolve().parents[2] / "examples" / "reproduce"


def _load(name: str):
    if str(REPRO) not in sys.path:
        sys.path.insert(0, str(REPRO))  # the scripts import their shared helpers as ``_common``
    spec = importlib.util.spec_from_file_location(f"repro_{name}", REPRO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_cafed_availability_smoke(tmp_path):
    script = _load("cafed_availability")
    out = script.main(["--seeds", "0", "--rounds", "2", "--num-clients", "8", "--eval-every", "1",
                       "--local-steps", "2", "--local-lr-scale", "0.01", "--out", str(tmp_path)])
    table = Path(out["table"]).read_text()
    assert Path(out["png"]).stat().st_size > 0
    for method in script.METHODS:
        assert f"| {method} |" in table
    assert "CA-Fed − AdaFed" in table
    assert (tmp_path / "synthetic_curves.csv").is_file()


def test_fedacs_heterogeneity_smoke(tmp_path):
    script = _load("fedacs_heterogeneity")
    out = script.main(["--seeds", "0", "--rounds", "2", "--synthetic-data", "--per-class", "10", "--test-size", "50",
                       "--methods", "FedACS", "FedAvg", "FedNova", "--out", str(tmp_path)])
    table = Path(out["table"]).read_text()
    assert Path(out["png"]).stat().st_size > 0
    for panel in ("static, one class per client", "dynamic, Dirichlet 0.1"):
        assert panel in table
    for method in ("FedACS", "FedAvg", "FedNova"):
        assert f"| {method} |" in table


def test_dynamic_uplink_is_per_round_and_seeded():
    script = _load("fedacs_heterogeneity")
    steps, channel, s_exp, a_exp = script.system("dynamic", 20)
    channel.setup(20, seed=3)
    steps.sample(5, 20, 3)  # announces round 5 to the channel
    q5 = 1.0 - channel.success_probs.numpy()
    assert np.all((q5[:10] >= 0.4) & (q5[:10] <= 0.5)) and np.all((q5[10:] >= 0.0) & (q5[10:] <= 0.1))
    steps.sample(6, 20, 3)
    assert not np.allclose(q5, 1.0 - channel.success_probs.numpy())
    assert np.allclose(q5, channel.q(5))
    np.testing.assert_allclose(s_exp, np.r_[np.full(10, 0.55), np.full(10, 0.95)])
    np.testing.assert_allclose(a_exp, np.r_[np.full(10, 5.5), np.full(10, 25.0)])
    static_steps, static_channel, s_static, _ = script.system("static", 20)
    assert list(static_steps[:3]) == [1, 3, 5] and static_steps[-1] == 39
    assert s_static[0] == pytest.approx(0.60) and s_static[-1] == pytest.approx(0.98)
