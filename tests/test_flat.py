"""``all_finite`` against ``torch.isfinite(...).all()``, the definition it replaces on the hot path."""

import pytest
import torch

from lightning_fedhet.flat import all_finite, rows_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("position", [0, 1, 999])
def test_one_bad_entry_anywhere_is_found(dtype, bad, position):
    vector = torch.randn(1000).to(dtype)
    assert all_finite(vector)
    vector[position] = bad
    assert not all_finite(vector)
    assert all_finite(vector) == bool(torch.isfinite(vector).all())


def test_huge_finite_values_are_finite():
    # a check through a sum or a norm would overflow here and reject a finite update
    vector = torch.full((10,), torch.finfo(torch.float32).max)
    assert all_finite(vector) and all_finite(-vector)


def test_empty_integer_and_complex_vectors():
    assert all_finite(torch.zeros(0))
    assert all_finite(torch.arange(5))
    assert all_finite(torch.tensor([1 + 2j]))
    assert not all_finite(torch.tensor([complex(1, float("nan"))]))


def test_a_matrix_is_checked_entrywise():
    matrix = torch.zeros(3, 4)
    matrix[2, 3] = float("nan")
    assert not all_finite(matrix)


def test_rows_finite_matches_isfinite_per_row():
    matrix = torch.randn(5, 7)
    matrix[1, 3], matrix[3, 0], matrix[4, 6] = float("nan"), float("inf"), -float("inf")
    expected = [True, False, True, False, False]
    assert rows_finite(matrix).tolist() == torch.isfinite(matrix).all(dim=1).tolist() == expected
    assert rows_finite(torch.zeros(2, 0)).tolist() == [True, True]
    with pytest.raises(ValueError, match=r"\[C, d\] matrix"):
        rows_finite(torch.zeros(3))
