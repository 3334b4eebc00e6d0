"""kermac_like.linalg.cholesky_3xtf32_ (the RFM solve's blocked Cholesky with 3xTF32 trailing updates,
bench/notes/rfm.md "(b)"): on the CPU the same algorithm with the tensor cores' TF32 rounding of the
low part modelled, against float64 on regularised kernel matrices of shifted, clustered and positive
data; breakdowns, bad input; on a GPU (marked) the RFM fit with the setting on against it off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kermac_like as km
from kermac_like import config
from kermac_like.linalg import cholesky_3xtf32_
from kermac_like.ops.linalg import round_tf32

F64 = torch.float64


def kernel_matrix(family: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if family == "shifted":
        x = torch.randn(n, 12, generator=g, dtype=F64) + 100.0
        k = km.run_kernel(km.PRESETS["laplace_l2"], x, x, bandwidth=6.0)
    elif family == "clustered":
        c = torch.randn(6, 12, generator=g, dtype=F64) * 10.0
        x = c[torch.arange(n) % 6] + 0.2 * torch.randn(n, 12, generator=g, dtype=F64)
        k = km.run_kernel(km.PRESETS["laplace_l1"], x, x, bandwidth=8.0)
    else:  # positive
        x = torch.rand(n, 12, generator=g, dtype=F64) * 3.0
        k = km.run_kernel(km.PRESETS["gaussian_l2"], x, x, bandwidth=1.5)
    return k + 1e-3 * torch.eye(n, dtype=F64)


def test_round_tf32_keeps_ten_mantissa_bits_and_the_rest_is_exact():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e3
    hi = round_tf32(x)
    assert bool(((hi.view(torch.int32) & 0x1FFF) == 0).all())
    assert float(((x - hi).abs() / x.abs()).max()) <= 2.0 ** -11
    assert torch.equal(hi + (x - hi), x)


@pytest.mark.parametrize("family", ["shifted", "clustered", "positive"])
@pytest.mark.parametrize("n,block", [(700, 128), (513, 64), (300, 512)])
def test_factor_is_as_accurate_as_float32_cholesky(family, n, block):
    k = kernel_matrix(family, n, n + block)
    l64 = torch.linalg.cholesky(k)
    a = k.float().contiguous()
    l32 = torch.linalg.cholesky(a)
    assert cholesky_3xtf32_(a, block=block) == 0
    assert bool((a.triu(1) == 0).all())
    err = float((a.double() - l64).norm() / l64.norm())
    ref = float((l32.double() - l64).norm() / l64.norm())
    assert err <= 3 * ref + 1e-7, (err, ref)
    # the solve of the RFM: coefficients as accurate as float32 Cholesky's
    y = torch.randn(n, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    c64 = torch.cholesky_solve(y, l64)
    got = torch.cholesky_solve(y.float(), a).double()
    want32 = torch.cholesky_solve(y.float(), l32).double()
    assert float((got - c64).norm() / c64.norm()) <= 3 * float((want32 - c64).norm() / c64.norm()) + 1e-7


def test_breakdown_reports_the_column_as_cholesky_ex():
    k = kernel_matrix("shifted", 600, 3).float().contiguous()
    for col in (5, 200, 599):
        bad = k.clone()
        bad[col, col] = -1.0
        want = int(torch.linalg.cholesky_ex(bad.clone())[1])
        assert cholesky_3xtf32_(bad, block=128) == want == col + 1


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="a:"):
        cholesky_3xtf32_(np.eye(3))
    with pytest.raises(ValueError, match="a:"):
        cholesky_3xtf32_(torch.eye(3, dtype=F64))
    with pytest.raises(ValueError, match="a:"):
        cholesky_3xtf32_(torch.eye(4)[:, :3])
    with pytest.raises(ValueError, match="a:"):
        cholesky_3xtf32_(torch.eye(4).mT[::2, ::2])
    with pytest.raises(ValueError, match="block"):
        cholesky_3xtf32_(torch.eye(4), block=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["laplace_l2", "lpq"])
def test_gpu_rfm_fit_with_the_tf32_cholesky_matches_cusolver(name):
    from kermac_like.rfm import RFMRegressor

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 20)) + 3.0
    y = x[:, 0] * x[:, 1] + np.sin(2 * x[:, 2])
    kw = dict(kernel=name, norm_p=1.5, bandwidth=8.0, iters=2, device="cuda")
    want = RFMRegressor(**kw).fit(x, y)
    with config.override(cholesky_3xtf32=True):
        got = RFMRegressor(**kw).fit(x, y)
    assert np.linalg.norm(got.M_ - want.M_) / np.linalg.norm(want.M_) < 1e-3
    assert np.linalg.norm(got.predict(x[:500]) - want.predict(x[:500])) / np.linalg.norm(want.predict(x[:500])) < 1e-3
