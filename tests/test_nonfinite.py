"""NaN and inf propagate as in torch, on every path.

What torch does (torch.cdist, float32/float64, CPU and CUDA alike; the IEEE rules
inf - inf = NaN, inf * 0 = NaN):
  * a NaN coordinate in row m of x1 (n of x2) makes out[m, :] (out[:, n]) NaN, for
    every p > 0 and every compute mode; exp(NaN), NaN + lambda and the epsilon cut
    (NaN < eps is false) keep it;
  * direct differences ("donot_use_mm_for_euclid_dist", and every p != 2): an
    infinite coordinate gives +inf, except against the same infinity (inf - inf = NaN);
  * the matrix product ("use_mm_for_euclid_dist", or the default with more than 25
    rows): ||x||^2 + ||y||^2 - 2 x.y with IEEE products, so an infinite coordinate
    gives NaN (against a 0, or against a coordinate of the same sign) or +inf
    (against a nonzero coordinate of the opposite sign);
  * p = 0 and p = inf are torch.cdist itself (its p = inf maximum skips NaN on the CPU);
  * backward: sgn(NaN) = NaN (p = 1), a NaN distance gives NaN weights (p != 1).
Our exact GPU kernels (SIMT, low-K) compute direct differences; the tensor-core paths
(mma.sync, wgmma, 16-bit) the matrix-product formula, and km.cdist picks them where
torch.cdist picks its matrix product; the 3xTF32 split keeps infinities apart from NaN
(split_tf32x3 in cuda_templates/distance_mma.cuh). The torch path (CPU, float64:
kermac_like/torch_path.py) makes the same choice with torch's own kernels: torch.cdist's
direct kernel, or the matrix product built as torch.cdist builds it. The CPU tests below
check the torch path and autograd; the GPU tests (marked gpu) each kernel path and dtype
on the same inputs.
"""

from __future__ import annotations

import os

import pytest
import torch

import kermac_like as km
from kermac_like.reference import cdist_grad_reference

NAN, INF = float("nan"), float("inf")
DIRECT, MM = "donot_use_mm_for_euclid_dist", "use_mm_for_euclid_dist"


def operands(M=31, N=29, K=7, batch=(), dtype=torch.float64, device="cpu", seed=0):
    """Random x (batch, M, K), y (batch, N, K) with a NaN (x row 3), +-inf against
    random-signed coordinates (x rows 5, 6) and the same +inf on both sides (x row 5,
    y row 2): every NaN / inf rule above is exercised."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, M, K, generator=g, dtype=torch.float64)
    y = torch.randn(*batch, N, K, generator=g, dtype=torch.float64)
    x[..., 3, 1] = NAN
    x[..., 5, 0] = INF
    x[..., 6, 2] = -INF
    y[..., 2, 0] = INF
    y[..., 4, min(3, K - 1)] = NAN
    return x.to(dtype=dtype, device=device), y.to(dtype=dtype, device=device)


def assert_like(got, want, *, rtol=1e-6, atol=1e-6):
    """Same NaN, +inf and -inf positions; finite values close."""
    got, want = got.double().cpu(), want.double().cpu()
    assert got.shape == want.shape
    for name, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = (f(got) != f(want)).nonzero()
        assert diff.numel() == 0, f"{name} positions differ at {diff[:6].tolist()}"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=rtol, atol=atol)


def mm_distance(x, y, squared=False):
    """torch's matrix-product formula in float64 (torch.cdist's _euclidean_dist)."""
    x, y = x.double(), y.double()
    d2 = (x * x).sum(-1)[..., :, None] + (y * y).sum(-1)[..., None, :] - 2 * (x @ y.mT)
    d2 = d2.clamp_min(0)
    return d2 if squared else d2.sqrt()


def epilogue(d, kind, bw, lam, reg_diag, eps):
    """run_kernel's epilogue on a float64 distance (the reference's order)."""
    if eps is not None:
        d = torch.where(d < eps, torch.zeros_like(d), d)
    if kind == "laplace":
        d = torch.exp(-d / bw)
    elif kind == "gaussian":
        d = torch.exp(-(d * d) / (2 * bw * bw))
    M, N = d.shape[-2:]
    mask = (torch.arange(N)[None, :] - torch.arange(M)[:, None]) == reg_diag
    return d + torch.where(mask.to(d.device), lam, 0.0)


# -- CPU: the torch path and autograd ---------------------------------------------------------
def test_torch_itself_behaves_as_documented():
    x, y = operands()
    direct, mm = torch.cdist(x, y, compute_mode=DIRECT), torch.cdist(x, y, compute_mode=MM)
    for d in (direct, mm):
        assert torch.isnan(d[3]).all() and torch.isnan(d[:, 4]).all()
    assert torch.isnan(direct[5, 2]) and torch.isposinf(direct[5, 0]) and torch.isposinf(direct[6, 0])
    assert torch.isnan(mm[5]).any() and torch.isposinf(mm[5]).any()  # the sign rule of the product
    assert_like(mm, mm_distance(x, y), rtol=1e-9)


@pytest.mark.parametrize("p", [1.0, 2.0, 1.3, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_cdist_is_torch_cdist(p, dtype):
    """Every compute mode gives torch.cdist's NaN and inf (p = 2: the matrix product's above 25 rows
    by default, as on the GPU)."""
    x, y = operands(batch=(2,), dtype=dtype)
    for mode in (DIRECT, "use_mm_for_euclid_dist_if_necessary", MM):
        out = torch.full((2, 31, 29), -7.0, dtype=dtype)
        km.cdist(x, y, p, out=out, compute_mode=mode)
        assert_like(out, torch.cdist(x, y, p, compute_mode=mode), rtol=1e-5 if dtype == torch.float32 else 1e-12)
    if p == 2:  # a call of at most 25 rows computes directly in the default mode
        assert_like(km.cdist(x[:, :20], y[:, :25], p), torch.cdist(x[:, :20], y[:, :25], p, compute_mode=DIRECT),
                    rtol=1e-5 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_lane_is_torch_cdist_bitwise(dtype):
    """The plain CPU call (ops.distance._cpu_cdist: torch.cdist's own kernel without the general
    checks) gives torch.cdist's bits for every p, compute mode, NaN and inf, batch or not; calls
    it does not take (a broadcast batch, bad p or K) go the general way, errors naming the argument."""
    x, y = operands(batch=(2,), dtype=dtype)
    for p in (0.0, 0.5, 1, 1.5, 2.0, 3.0, INF):
        for mode in (DIRECT, "use_mm_for_euclid_dist_if_necessary", MM):
            for a, b in ((x, y), (x[0], y[0])):
                got, want = km.cdist(a, b, p, compute_mode=mode), torch.cdist(a, b, p, compute_mode=mode)
                assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(km.cdist(x, y[:1]).nan_to_num(), torch.cdist(x, y[:1]).nan_to_num())  # broadcast batch
    with pytest.raises(ValueError, match="^p: "):
        km.cdist(x, y, -1.0)
    with pytest.raises(ValueError, match="^x2: "):
        km.cdist(x, y[..., :2])
    with pytest.raises(ValueError, match="^compute_mode: "):
        km.cdist(x, y, compute_mode="fast")


@pytest.mark.parametrize("p", [0.0, INF])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_p0_and_pinf_are_torch_cdist(p, dtype):
    x, y = operands(dtype=dtype)
    wide = dtype in (torch.float32, torch.float64)  # torch.cdist takes no 16-bit data on the CPU
    want = torch.cdist(x, y, p) if wide else torch.cdist(x.float(), y.float(), p).to(dtype)
    out = torch.full(want.shape, -7.0, dtype=dtype)
    assert km.cdist(x, y, p, out=out) is out
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("mode", [DIRECT, "use_mm_for_euclid_dist_if_necessary"])
@pytest.mark.parametrize("name", ["l1", "l2", "squared_l2", "laplace_l1", "laplace_l2", "gaussian_l2", "laplace_p"])
def test_cpu_run_kernel_epilogues(name, mode):
    desc = km.PRESETS[name]
    x, y = operands(batch=(2,))
    kw = {"p": 1.3} if desc.needs_inner_p else {}
    bw = 2.5
    got = km.run_kernel(desc, x, y, bandwidth=bw if desc.needs_bandwidth else None, regularization=0.5,
                        regularization_offset_y=1, epsilon=1e-3, compute_mode=mode, **kw)
    p = {"l1": 1.0, "laplace_l1": 1.0, "laplace_p": 1.3}.get(name, 2.0)
    d = torch.cdist(x, y, p, compute_mode=mode)
    if name == "squared_l2":
        d = d * d
    kind = "laplace" if "laplace" in name else "gaussian" if "gaussian" in name else "none"
    assert_like(got, epilogue(d, kind, bw, 0.5, -1, 1e-3), rtol=1e-9)


@pytest.mark.parametrize("mode", [DIRECT, "use_mm_for_euclid_dist_if_necessary"])
@pytest.mark.parametrize("p", [1.0, 2.0, 1.3])
@pytest.mark.parametrize("bad", [NAN, INF], ids=["nan", "inf"])
def test_cpu_autograd_like_torch(p, bad, mode):
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y0 = torch.randn(28, 3, generator=g, dtype=torch.float64)
    x0[7, 1] = bad
    w = torch.randn(30, 28, generator=g, dtype=torch.float64)
    grads = []
    for f in (lambda a, b: km.cdist(a, b, p, compute_mode=mode), lambda a, b: torch.cdist(a, b, p, compute_mode=mode)):
        x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        (f(x, y) * w).sum().backward()
        grads.append((x.grad, y.grad))
    assert torch.isnan(grads[1][0]).any() or bad == INF
    for ours, theirs in zip(grads[0], grads[1]):
        assert_like(ours, theirs, rtol=1e-9, atol=1e-9)


def test_cpu_autograd_epilogue_keeps_nan():
    x, y = operands()
    x.requires_grad_()
    km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=2.0).sum().backward()
    assert torch.isnan(x.grad[3]).all() and torch.isnan(x.grad).all()  # column 4 of the output is NaN


@pytest.mark.parametrize("p", [1.0, 2.0, 1.3, torch.tensor([1.0, 1.3])])
def test_cdist_grad_reference_sign_of_nan_is_nan(p):
    g = torch.Generator().manual_seed(2)
    K, M, N, O = 6, 5, 4, 3
    a, b = torch.randn(2, K, M, generator=g), torch.randn(2, N, K, generator=g)
    c, d = torch.randn(2, O, K, generator=g), torch.randn(2, N, M, generator=g)
    b[:, 1, 2] = NAN
    d[:, 3, 0] = NAN
    out = km.cdist_grad(a, b, c, d, p=p)
    bad = torch.zeros(2, N, M, dtype=torch.bool)
    bad[:, 1, :] = True
    bad[:, 3, 0] = True
    assert torch.equal(out.isnan(), bad[:, None].expand_as(out))


# -- GPU: every kernel path and dtype ----------------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@gpu
@needs_cuda
def test_gpu_known_case_nan_row_of_a_self_distance():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(50, 8, device="cuda", generator=g)
    x[7, 3] = NAN
    ours, theirs = km.cdist(x, x), torch.cdist(x, x)
    assert int(theirs.isnan().sum()) == 99
    assert torch.equal(ours.isnan(), theirs.isnan())


@gpu
@needs_cuda
@pytest.mark.parametrize("K", [3, 8])
@pytest.mark.parametrize("name", ["l2", "squared_l2", "laplace_l2", "gaussian_l2"])
def test_gpu_lowk_matrix_product_semantics(caplog, K, name):
    """Default mode, more than 25 rows, K <= 8: the low-K kernel with the matrix product's
    NaN/inf (kMmNonFinite) gives torch's matrix-product positions; an overflowing square
    (3e19) too. A batch of 2 x 131 x 97: flagged and clean tiles."""
    x, y = operands(M=131, N=97, K=K, batch=(2,), dtype=torch.float32, device="cuda")
    x[1, 40, 0] = 3e19
    desc = km.PRESETS[name]
    bw = 3.0
    kind = "laplace" if "laplace" in name else "gaussian" if "gaussian" in name else "none"
    out = torch.full((2, 131, 97), -7.0, device="cuda")
    with caplog.at_level("DEBUG", logger="kermac_like"):
        km.run_kernel(desc, x, y, out=out, bandwidth=bw if desc.needs_bandwidth else None, debug=True)
    assert "low-K path" in caplog.text and "tensor-core path" not in caplog.text
    assert not (out == -7.0).any()
    squared = name == "squared_l2"
    d32 = torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist").double()  # torch's own float32 product
    assert torch.isposinf(d32[1, 40]).any()  # the overflowing square
    where = epilogue(d32 * d32 if squared else d32, kind, bw, 0.0, 0, None)  # NaN/inf positions
    value = epilogue(mm_distance(x, y, squared), kind, bw, 0.0, 0, None)  # finite values (float64)
    want = torch.where(torch.isfinite(where), value, where)
    assert_like(out, want, rtol=1e-4, atol=1e-4)


# (path, dtype, tf32): "simt" = exact kernel (torch's direct differences), "mma" =
# mma.sync (KERMAC_LIKE_WGMMA=0), "wgmma" = the sm_90a kernel; the tensor-core paths
# follow torch's matrix-product formula.
PATHS = [("simt", torch.float32, False), ("mma", torch.float32, False), ("mma", torch.float32, True),
         ("mma", torch.float16, False), ("mma", torch.bfloat16, False), ("wgmma", torch.float32, False),
         ("wgmma", torch.float32, True)]
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _set_path(monkeypatch, set_tf32, path, tf32):
    if path == "wgmma" and not _sm90():
        pytest.skip("wgmma needs sm_90")
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0" if path == "mma" else "always")
    set_tf32(tf32)
    return DIRECT if path == "simt" else MM


@gpu
@needs_cuda
@pytest.mark.parametrize("path,dtype,tf32", PATHS, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("name", ["l2", "squared_l2", "laplace_l2", "gaussian_l2"])
def test_gpu_p2_paths(monkeypatch, set_tf32, caplog, path, dtype, tf32, name):
    mode = _set_path(monkeypatch, set_tf32, path, tf32)
    if path == "simt" and dtype != torch.float32:
        pytest.skip("the exact kernel is float32")
    desc = km.PRESETS[name]
    x, y = operands(M=131, N=97, K=40, batch=(2,), dtype=dtype, device="cuda")  # 16-byte rows, a K tail
    bw = 3.0
    kind = "laplace" if "laplace" in name else "gaussian" if "gaussian" in name else "none"
    for lam, eps in ((0.0, None), (0.5, 1e-3)):
        out = torch.full((2, 131, 97), -7.0, dtype=dtype, device="cuda")
        with caplog.at_level("DEBUG", logger="kermac_like"):
            km.run_kernel(desc, x, y, out=out, compute_mode=mode, bandwidth=bw if desc.needs_bandwidth else None,
                          regularization=lam or None, regularization_offset_x=1, epsilon=eps, debug=True)
        assert ("tensor-core path" in caplog.text) == (path != "simt")
        assert not (out == -7.0).any()
        squared = name == "squared_l2"
        d = mm_distance(x, y, squared) if path != "simt" else torch.cdist(x.double(), y.double(), compute_mode=DIRECT)
        if path == "simt" and squared:
            d = d * d
        want = epilogue(d, kind, bw, lam, 1, eps).to(dtype).double()
        tol = 3e-3 if tf32 else TOL[dtype]
        assert_like(out, want, rtol=tol, atol=tol)


@gpu
@needs_cuda
@pytest.mark.parametrize("name,p", [("l1", 1.0), ("p_norm", 1.3), ("laplace_l1", 1.0), ("laplace_p", 3.0),
                                    ("p_norm_skip_root", 0.7)])
def test_gpu_simt_other_p(name, p):
    desc = km.PRESETS[name]
    x, y = operands(M=131, N=97, K=37, batch=(2,), dtype=torch.float32, device="cuda")
    kw = {"p": p} if desc.needs_inner_p else {}
    out = torch.full((2, 131, 97), -7.0, device="cuda")
    km.run_kernel(desc, x, y, out=out, bandwidth=4.0 if desc.needs_bandwidth else None, regularization=0.5,
                  epsilon=1e-3, **kw)
    want = km.run_kernel(desc, x.double().cpu(), y.double().cpu(), bandwidth=4.0 if desc.needs_bandwidth else None,
                         regularization=0.5, epsilon=1e-3, **kw)
    assert torch.isnan(want).any() and torch.isinf(want).any() or desc.needs_bandwidth
    assert_like(out, want, rtol=1e-4, atol=1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("mma", [False, True], ids=["simt", "mma"])
@pytest.mark.parametrize("p", [1.0, 2.0, 1.3, 0.6])
def test_gpu_cdist_grad(monkeypatch, mma, p):
    monkeypatch.setenv("KERMAC_LIKE_GRAD_MMA", "1" if mma else "0")
    g = torch.Generator().manual_seed(3)
    K, M, N, O = 45, 37, 21, 5
    a, b = torch.randn(2, K, M, generator=g), torch.randn(2, N, K, generator=g)
    c, d = torch.randn(2, O, K, generator=g), torch.randn(2, N, M, generator=g)
    b[:, 1, 2] = NAN
    d[:, 3, 0] = NAN
    a[:, 4, 6] = NAN
    dev = [t.cuda() for t in (a, b, c, d)]
    out = torch.full((2, O, N, M), -7.0, device="cuda")
    km.cdist_grad(*dev, out=out, p=p)
    want = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(), p)
    assert torch.isnan(want).any() and torch.isfinite(want).any()
    assert_like(out, want, rtol=2e-4, atol=2e-4)


@gpu
@needs_cuda
@pytest.mark.parametrize("path", ["simt", "mma", "wgmma"])
@pytest.mark.parametrize("p", [1.0, 2.0, 1.3])
def test_gpu_autograd_nan_like_torch(monkeypatch, set_tf32, path, p):
    mode = _set_path(monkeypatch, set_tf32, path, False)
    if p != 2 and path != "simt":
        pytest.skip("only p = 2 has a tensor-core path")
    g = torch.Generator().manual_seed(4)
    x0, y0 = torch.randn(2, 40, 9, generator=g), torch.randn(2, 33, 9, generator=g)
    x0[1, 7, 1] = NAN
    w = torch.randn(2, 40, 33, generator=g)
    grads = []
    for dev, f in (("cuda", lambda a, b: km.cdist(a, b, p, compute_mode=mode)),
                   ("cpu", lambda a, b: torch.cdist(a, b, p, compute_mode=mode))):
        x = x0.double().to(dev) if dev == "cpu" else x0.to(dev)
        y = y0.double().to(dev) if dev == "cpu" else y0.to(dev)
        x.requires_grad_(), y.requires_grad_()
        (f(x, y) * w.to(x)).sum().backward()
        grads.append((x.grad, y.grad))
    for ours, theirs in zip(*grads):
        assert_like(ours, theirs, rtol=1e-3, atol=1e-3)
