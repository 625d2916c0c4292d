"""Trace-driven availability: replay, wrap-around, file formats, checks."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_fedhet.participation import Trace
from tests.participation.processes import draw


def test_trace_replays_and_wraps(tmp_path):
    rng = np.random.default_rng(0)
    mask = rng.random((30, 8)) < 0.4
    proc = Trace(mask)
    proc.setup(8, seed=0)
    for t in (0, 5, 29, 30, 31, 95):
        np.testing.assert_array_equal(proc.sample(t).numpy(), mask[t % 30])
    np.testing.assert_allclose(proc.p.numpy(), mask.mean(axis=0))
    assert proc.num_rounds == 30
    np.save(tmp_path / "m.npy", mask)
    np.savez(tmp_path / "m.npz", mask=mask.astype(np.int8), other=np.zeros(2))
    np.savetxt(tmp_path / "m.csv", mask.astype(int), fmt="%d", delimiter=",")
    for name in ("m.npy", "m.npz", "m.csv"):
        loaded = Trace(tmp_path / name)
        loaded.setup(8)
        np.testing.assert_array_equal(draw(loaded, range(60)), np.concatenate([mask, mask]))


@pytest.mark.parametrize("make, match", [
    (lambda: Trace(np.ones((5, 3), dtype=bool)).setup(4), r"mask has 3 clients .* num_clients is 4"),
    (lambda: Trace(np.array([[0, 2]])), r"mask must hold only 0/1"),
    (lambda: Trace(np.ones(5)), r"mask must have shape \[T, N\]"),
    (lambda: Trace("/nonexistent/trace.npy"), r"mask: no such file"),
])
def test_bad_inputs_raise_value_error_naming_parameter(make, match):
    with pytest.raises(ValueError, match=match):
        make()
