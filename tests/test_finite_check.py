"""The driver's finiteness check (one aminmax pass)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from eagle3_compat.generator import _all_finite  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_entry_is_seen(dtype, bad):
    x = torch.randn(257, 64).to(dtype)
    assert _all_finite(x)
    for row, col in ((0, 0), (256, 63), (100, 17)):
        y = x.clone()
        y[row, col] = bad
        assert not _all_finite(y)


def test_finite_values_whose_sum_overflows_are_finite():
    big = torch.full((64, 64), 3.0e38, dtype=torch.float32)
    assert not torch.isfinite(big.sum())
    assert _all_finite(big)
    big[3, 3] = float("nan")
    assert not _all_finite(big)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_extremes_and_subnormals_are_finite(dtype):
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0], dtype=dtype)
    x = torch.cat([x, x.new_tensor([info.tiny / 4])])  # a subnormal
    assert _all_finite(x)
    assert _all_finite(x[::2])  # not contiguous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_position_of_short_tensors(dtype):
    """A NaN or an infinity anywhere, including the scalar tail that the
    vectorised reduction handles apart, for every length up to 130."""
    for n in range(1, 131):
        x = torch.linspace(-3, 3, n).to(dtype)
        assert _all_finite(x)
        for i in range(n):
            for bad in (float("nan"), float("inf"), float("-inf")):
                y = x.clone()
                y[i] = bad
                assert not _all_finite(y), (n, i, bad)


def test_empty_is_finite():
    assert _all_finite(torch.empty(0, 8, dtype=torch.bfloat16))


def test_other_dtypes():
    x = torch.randn(10, dtype=torch.float64)
    assert _all_finite(x)
    x[4] = float("nan")
    assert not _all_finite(x)
