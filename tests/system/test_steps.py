"""Local-step counts: uniform and two-group draws, per-client and scalar specs, checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedhet.system import TwoGroupSteps, UniformSteps, check_local_steps, local_steps_for

N = 50


def test_uniform_steps_range_and_distribution():
    dist = UniformSteps(2, 5)
    rounds = 2000
    draws = np.stack([dist.sample(t, N, seed=1) for t in range(rounds)])
    assert draws.dtype == np.int64 and draws.shape == (rounds, N)
    assert draws.min() == 2 and draws.max() == 5
    counts = np.bincount(draws.ravel(), minlength=6)[2:]
    n = draws.size
    assert np.all(np.abs(counts / n - 0.25) < 3 * np.sqrt(0.25 * 0.75 / n))
    assert abs(draws.mean() - 3.5) < 3 * np.sqrt((4**2 - 1) / 12 / n)
    np.testing.assert_allclose(dist.expected(N), 3.5)
    # pure in (seed, round), different across rounds and seeds
    np.testing.assert_array_equal(dist.sample(17, N, seed=1), draws[17])
    assert not np.array_equal(draws[17], draws[18])
    assert not np.array_equal(dist.sample(17, N, seed=2), draws[17])
    np.testing.assert_array_equal(local_steps_for(dist, 17, N, seed=1), draws[17])
    assert np.all(UniformSteps(3, 3).sample(0, N, 0) == 3)


def test_two_group_steps_fedacs_dynamic():
    dist = TwoGroupSteps()
    draws = np.stack([dist.sample(t, 20, seed=0) for t in range(1000)])
    first, second = draws[:, :10], draws[:, 10:]
    assert set(np.unique(first)) == set(range(1, 11))
    assert set(np.unique(second)) == set(range(20, 31))
    assert abs(first.mean() - 5.5) < 3 * np.sqrt((10**2 - 1) / 12 / first.size)
    assert abs(second.mean() - 25.0) < 3 * np.sqrt((11**2 - 1) / 12 / second.size)
    np.testing.assert_allclose(dist.expected(20), [5.5] * 10 + [25.0] * 10)
    odd = dist.sample(0, 5, seed=0)
    assert np.all(odd[:2] <= 10) and np.all(odd[2:] >= 20)


def test_local_steps_for_int_and_array():
    np.testing.assert_array_equal(local_steps_for(5, 3, 4, seed=0), [5, 5, 5, 5])
    out = local_steps_for([1, 2, 3], 0, 3, seed=0)
    assert out.dtype == np.int64 and out.tolist() == [1, 2, 3]
    assert local_steps_for(np.array([2.0, 4.0]), 0, 2, 0).tolist() == [2, 4]
    assert local_steps_for(torch.tensor([3, 1]), 0, 2, 0).tolist() == [3, 1]
    assert check_local_steps(3) == 3
    per_client = UniformSteps([1, 10], [1, 12])
    draws = np.stack([per_client.sample(t, 2, 0) for t in range(200)])
    assert np.all(draws[:, 0] == 1) and draws[:, 1].min() == 10 and draws[:, 1].max() == 12


@pytest.mark.parametrize("make, match", [
    (lambda: UniformSteps(0, 3), r"local_steps low must be integers >= 1"),
    (lambda: UniformSteps(5, 3), r"local_steps high must be >= low"),
    (lambda: UniformSteps(1.5, 3), r"local_steps low must be integers >= 1"),
    (lambda: UniformSteps([1, 2], [3, 4, 5]), r"local_steps low and high have different lengths"),
    (lambda: UniformSteps([1, 2], [3, 4]).sample(0, 3, 0), r"local_steps bounds have 2 entries"),
    (lambda: local_steps_for(0, 0, 3, 0), r"local_steps must be an integer >= 1"),
    (lambda: local_steps_for(2.5, 0, 3, 0), r"local_steps must be integers >= 1"),
    (lambda: local_steps_for([1, 0, 2], 0, 3, 0), r"local_steps must be integers >= 1"),
    (lambda: local_steps_for([1, 2], 0, 3, 0), r"local_steps has 2 entries but num_clients is 3"),
    (lambda: local_steps_for(True, 0, 3, 0), r"local_steps must be an integer >= 1"),
    (lambda: local_steps_for("3", 0, 3, 0), r"local_steps must be an integer >= 1"),
    (lambda: TwoGroupSteps(first=(0, 3)), r"first must be integers >= 1"),
])
def test_local_steps_bad_inputs(make, match):
    with pytest.raises(ValueError, match=match):
        make()
