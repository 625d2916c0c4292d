"""Smoke tests of the reproduction scripts (examples/reproduce/): a tiny budget, into tmp_path.

Each script's ``main(argv)`` runs 2 rounds with 1 seed on tiny data and must write its markdown table and PNG.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REPRO = Path(__file__).resolve().parents[2] / "examples" / "reproduce"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(REPRO))
    try:
        yield {name: importlib.import_module(name) for name in ("fedau_participation", "fedstale_beta",
                                                               "upgapl_lossy")}
    finally:
        sys.path.remove(str(REPRO))


def _check_outputs(out: Path, png: str, expected_rows: list[str]) -> str:
    table = (out / "results.md").read_text()
    assert (out / png).is_file() and (out / png).stat().st_size > 1000
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "± " in table and f"]({png})" in table
    for row in expected_rows:
        assert row in table
    return table


def test_fedau_participation_smoke(scripts, tmp_path):
    pytest.importorskip("matplotlib")
    try:
        scripts["fedau_participation"].fashion_mnist()
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)")
    results = scripts["fedau_participation"].main([
        "--seeds", "0", "--rounds", "2", "--clients", "8", "--samples-per-client", "10", "--test-size", "100",
        "--eval-every", "1", "--batch-size", "4", "--local-steps", "1", "--out", str(tmp_path),
    ])
    assert len(results) == 3 * 6 and all(len(runs) == 1 for runs in results.values())
    _check_outputs(tmp_path, "fedau_participation.png", ["| FedAU (K=50) |", "| Average participating |",
                                                         "| Known participation statistics |"])


def test_fedstale_beta_smoke(scripts, tmp_path):
    pytest.importorskip("matplotlib")
    try:
        scripts["fedstale_beta"].fashion_mnist()
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)")
    results = scripts["fedstale_beta"].main([
        "--seeds", "0", "--rounds", "2", "--clients", "4", "--samples-per-client", "10", "--test-per-client", "5",
        "--eval-every", "1", "--batch-size", "4", "--local-steps", "1", "--betas", "0", "0.5", "1",
        "--out", str(tmp_path),
    ])
    assert set(results) == {(0.1, h, b) for h in (0.0, 1.0) for b in (0.0, 0.5, 1.0)}
    _check_outputs(tmp_path, "fedstale_beta.png", ["| 0 (FedAvg) |", "| 1 (FedVARP) |", "Best beta"])


def test_fedstale_swap_labels(scripts):
    import numpy as np

    labels = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    idx = np.arange(8)
    scripts["fedstale_beta"].swap_labels(labels, idx, (0, 1), 0.5, np.random.default_rng(0))
    assert (labels == 1).sum() == 2 + 2 - 1 and (labels == 0).sum() == 4 - 2 + 1 and (labels == 2).sum() == 2


def test_upgapl_lossy_smoke(scripts, tmp_path):
    pytest.importorskip("matplotlib")
    results = scripts["upgapl_lossy"].main([
        "--seeds", "0", "--rounds", "2", "--clients", "4", "--eval-every", "1", "--local-steps", "1",
        "--out", str(tmp_path),
    ])
    assert set(results) == {"upgapl", "dmapl", "udmapl", "fedavg_lossless"}
    _check_outputs(tmp_path, "upgapl_lossy.png", ["| UPGA-PL |", "| DMA-PL |", "| UDMA-PL |", "| FedAvg (lossless) |"])
