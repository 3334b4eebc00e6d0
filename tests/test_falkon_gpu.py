"""Falkon's products on tensor cores (kermac_like.plan.falkon, cuda_templates/falkon_mma.cuh) on the GPU:
K(x, z) v and K(z, x) w against float64 arithmetic, one kernel value per pair in both (bit for bit),
bitwise repeatable, the splits of small calls, and KernelRidge's nystrom fit with them against the fit
without them (KERMAC_LIKE_FALKON_MMA=0: kernel_matvec's blocked float64 mode)."""

from __future__ import annotations

import pytest
import torch

import kermac_like as km

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability(0) < (8, 0):
    pytest.skip("needs a CUDA GPU of compute capability 8.0 or newer", allow_module_level=True)

from kermac_like.plan import falkon  # noqa: E402

DEV = torch.device("cuda", 0)
BW = 0.9


def _data(n, m, k, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.rand(n, k, device=DEV, generator=g) * 2 - 1
    h = min(m // 2, n)
    z = torch.cat([x[:h], torch.rand(m - h, k, device=DEV, generator=g)])  # centres among the rows, and not
    return x, z


def _k64(x, z):
    return torch.exp(-torch.cdist(x.double(), z.double()) ** 2 / (2 * BW ** 2))


@pytest.mark.parametrize("n,m,k,c", [(5000, 700, 3, 1), (3001, 1300, 8, 3), (2000, 513, 13, 9), (700, 300, 27, 2),
                                     (40, 2000, 8, 1)])
def test_products_against_float64(n, m, k, c):
    x, z = _data(n, m, k)
    assert falkon.serves(km.preset("gaussian_l2"), {"bandwidth": BW}, z)
    fp = falkon.FalkonProducts(z, BW)
    g = torch.Generator(device=DEV).manual_seed(1)
    v = torch.randn(m, c, device=DEV, dtype=torch.float64, generator=g)
    w = torch.randn(n, c, device=DEV, dtype=torch.float64, generator=g)
    kmat = _k64(x, z)
    # k's error is the exponent's (3xTF32 dot products): absolute in the exponent, so relative in k and
    # growing with |x - z|^2 / (2 bw^2); 4e-6 sum |k v| alone was met to 4.03e-6 at K = 27
    kmag = kmat * (1 + torch.cdist(x.double(), z.double()) ** 2 / (2 * BW ** 2) / 8)
    out_r = torch.full((n, c), float("nan"), device=DEV, dtype=torch.float64)  # poisoned: written everywhere
    out_c = torch.full((m, c), float("nan"), device=DEV, dtype=torch.float64)
    fp.rows(x, v, out=out_r)
    fp.cols(x, w, out=out_c)
    ref_r, ref_c = kmat @ v.float().double(), kmat.T @ w.float().double()
    mag_r, mag_c = kmag @ v.float().double().abs(), kmag.T @ w.float().double().abs()
    assert torch.all((out_r - ref_r).abs() <= 4e-6 * mag_r), float(((out_r - ref_r).abs() / mag_r).max())
    assert torch.all((out_c - ref_c).abs() <= 4e-6 * mag_c), float(((out_c - ref_c).abs() / mag_c).max())
    # bitwise repeatable
    assert torch.equal(fp.rows(x, v), out_r) and torch.equal(fp.cols(x, w), out_c)


def test_one_kernel_value_per_pair():
    n, m, k = 3000, 1100, 8
    x, z = _data(n, m, k, seed=3)
    fp = falkon.FalkonProducts(z, BW)
    cols_of = torch.tensor([0, 7, 300, 549, 550, 800, 1024, 1099], device=DEV)
    rows_of = torch.tensor([0, 1, 250, 549, 1000, 2047, 2048, 2999], device=DEV)
    v = torch.zeros(m, 8, device=DEV, dtype=torch.float64)
    v[cols_of, torch.arange(8, device=DEV)] = 1.0
    w = torch.zeros(n, 8, device=DEV, dtype=torch.float64)
    w[rows_of, torch.arange(8, device=DEV)] = 1.0
    kr = fp.rows(x, v)  # (n, 8): columns cols_of of K(x, z), each entry one kernel value
    kc = fp.cols(x, w)  # (m, 8): columns rows_of of K(z, x)
    a = kr[rows_of]  # K[rows_of, cols_of]
    b = kc[cols_of].T  # K(z, x)[cols_of, rows_of]^T
    assert torch.equal(a, b)
    assert torch.all(a > 0) and torch.equal(a.float().double(), a)
    ref = _k64(x[rows_of], z[cols_of])
    assert float(((a - ref).abs() / ref).max()) < 2e-6


@pytest.mark.parametrize("centres", [2000, 257])
def test_nystrom_fit_with_and_without(monkeypatch, centres):
    from kermac_like.solvers import KernelRidge

    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.rand(40000, 8, device=DEV, generator=g)
    y = torch.sin(4 * x).sum(1, keepdim=True) + 0.01 * torch.randn(40000, 1, device=DEV, generator=g)
    xt = torch.rand(2000, 8, device=DEV, generator=g)
    fits = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KERMAC_LIKE_FALKON_MMA", flag)
        est = KernelRidge("gaussian_l2", bandwidth=0.8, alpha=1e-6, solver="nystrom", n_centers=centres,
                          random_state=0, tol=1e-4)
        fits[flag] = (est.fit(x, y).predict(xt).double(), est.n_iter_, est.residual_)
    a, b = fits["1"][0], fits["0"][0]
    assert fits["1"][2] <= 1e-4 and fits["0"][2] <= 1e-4, fits
    assert float((a - b).norm() / b.norm()) < 1e-3, fits
    assert abs(fits["1"][1] - fits["0"][1]) <= 3, fits


def test_serves():
    x, z = _data(100, 50, 8)
    g = km.preset("gaussian_l2")
    assert falkon.serves(g, {"bandwidth": 1.0}, z)
    assert not falkon.serves(km.preset("laplace_l2"), {"bandwidth": 1.0}, z)
    assert not falkon.serves(g, {"bandwidth": 1.0}, z.double())
    x33, z33 = _data(100, 50, 33)
    assert not falkon.serves(g, {"bandwidth": 1.0}, z33)
    assert not falkon.serves(g, {"bandwidth": 1.0}, z.cpu())


@pytest.mark.parametrize("n,m,k,c", [(3001, 2500, 8, 11), (700, 5000, 8, 16), (2000, 1300, 5, 20), (900, 513, 13, 3),
                                     (300, 700, 27, 9)])
def test_rows_pv_against_float64(n, m, k, c):
    """The several-column rows kernel (k v on tensor cores, split f16): K(x, z) v within 4e-6 (K <= 8; in
    proportion to K beyond: the exponent's expanded form) of sum |k v| of float64 arithmetic on the float32 v,
    plus 2^-35 sum |v| (f16's subnormal k), every column written (16-column launches, a last one of 8 or 16), for a
    strided v (a column slice), split centre ranges (small n), bitwise repeatable."""
    x, z = _data(n, m, k, seed=5)
    fp = falkon.FalkonProducts(z, BW, columns="pv")
    g = torch.Generator(device=DEV).manual_seed(9)
    vw = torch.randn(m, c + 5, device=DEV, generator=g)
    v = vw[:, 2:2 + c]  # row stride c + 5
    out = fp.rows_pv(x, v)
    assert out.dtype == torch.float64 and out.shape == (n, c)
    kmat = _k64(x, z)
    ref, mag = kmat @ v.double(), kmat @ v.double().abs()
    rel = (out - ref).abs() / (mag + 2.0 ** -35 / 4e-6 * v.double().abs().sum(0))
    assert torch.all(rel <= 4e-6 * max(1.0, k / 8)), float(rel.max())
    assert float(rel.square().mean().sqrt()) <= 2e-6
    # a repeat reuses the kept launches and their buffers: the same bits, and memory allocated since untouched
    sentinel = torch.full((fp.Mp * 32,), 7.0, device=DEV)
    assert torch.equal(fp.rows_pv(x, v), out)
    v2 = torch.randn(m, c, device=DEV, generator=g).t().contiguous().t()  # column-major: another plan
    out2 = fp.rows_pv(x, v2)
    assert torch.all(sentinel == 7.0)
    assert float((out2 - kmat @ v2.double()).norm() / (kmat @ v2.double()).norm()) <= 2e-6
