"""Formula kernels (kermac_like/formula.py) on the CPU torch path: values against float64
formulas written out here, every op (run_kernel, kernel_matvec, KernelOperator, kernel_topk,
kernel_logsumexp, KernelRidge), gradients by gradcheck, hyper-parameter checks, routing."""

import math
import zlib

import pytest
import torch

import kermac_like as km
from kermac_like.testing import record_plans

S3, S5 = math.sqrt(3.0), math.sqrt(5.0)


def _d(x, y, p=2.0):  # float64 p-norm distances by direct differences
    return (x[:, None, :] - y[None, :, :]).abs().pow(p).sum(-1).pow(1.0 / p)


def _t(x, y):
    return x[:, None, :] - y[None, :, :]


# (descriptor, op keyword arguments, the float64 formula of x, y)
CASES = {
    "matern32": (km.matern(1.5), dict(bandwidth=0.8),
                 lambda x, y: (1 + S3 * _d(x, y) / 0.8) * torch.exp(-S3 * _d(x, y) / 0.8)),
    "matern52": (km.matern(2.5), dict(bandwidth=1.3),
                 lambda x, y: (1 + S5 * _d(x, y) / 1.3 + 5 * _d(x, y) ** 2 / (3 * 1.3 ** 2))
                 * torch.exp(-S5 * _d(x, y) / 1.3)),
    "rq": (km.rational_quadratic(), dict(bandwidth=0.9, alpha=0.7),
           lambda x, y: (1 + _d(x, y) ** 2 / (2 * 0.7 * 0.9 ** 2)) ** -0.7),
    "powexp_p2": (km.powered_exponential(1.5), dict(bandwidth=1.1),
                  lambda x, y: torch.exp(-(_d(x, y) / 1.1) ** 1.5)),
    "powexp_p1": (km.powered_exponential(0.5, p=1.0), dict(bandwidth=2.0),
                  lambda x, y: torch.exp(-(_d(x, y, 1.0) / 2.0) ** 0.5)),
    "powexp_p13": (km.powered_exponential(q=1.0, p=1.3), dict(bandwidth=1.5),
                   lambda x, y: torch.exp(-_d(x, y, 1.3) / 1.5)),
    "cauchy": (km.cauchy(), dict(bandwidth=0.7), lambda x, y: 1 / (1 + _d(x, y) ** 2 / 0.49)),
    "imq": (km.inverse_multiquadric(), dict(bandwidth=0.7), lambda x, y: (1 + _d(x, y) ** 2 / 0.49) ** -0.5),
    "additive_laplace": (km.additive(), dict(bandwidth=0.6), lambda x, y: torch.exp(-_t(x, y).abs() / 0.6).sum(-1)),
    "additive_powexp": (km.additive("powered_exponential", q=1.5), dict(bandwidth=0.6),
                        lambda x, y: torch.exp(-(_t(x, y).abs() / 0.6) ** 1.5).sum(-1)),
    "periodic": (km.periodic(), dict(bandwidth=0.8, period=1.7),
                 lambda x, y: torch.exp(-2 * torch.sin(math.pi * _t(x, y).abs() / 1.7).pow(2).sum(-1) / 0.64)),
    "polynomial": (km.polynomial(3, c=0.5), {}, lambda x, y: (x @ y.T + 0.5) ** 3),
    "expression": (km.kernel_expression("(1 + sqrt(5*r)/ell + 5*r/(3*ell**2)) * exp(-sqrt(5*r)/ell)",
                                        params={"ell": 1.3}), {},
                   lambda x, y: (1 + S5 * _d(x, y) / 1.3 + 5 * _d(x, y) ** 2 / (3 * 1.3 ** 2))
                   * torch.exp(-S5 * _d(x, y) / 1.3)),
    "expression_inner": (km.kernel_expression("exp(-r)", inner="abs(sin(x) - y)**1.5"), {},
                         lambda x, y: torch.exp(-(torch.sin(x)[:, None, :] - y[None]).abs().pow(1.5).sum(-1))),
}


def _check(got, want, tol, scale=None):
    """Relative to max(|value|, 1e-5); ``scale``: relative to it instead (a DOT kernel's error model,
    km.polynomial: the terms' scale, as <x, y> may cancel c)."""
    ref = want.abs().clamp_min(1e-5) if scale is None else scale
    err = ((got.double() - want) / ref).abs().max().item()
    assert err <= tol, err


@pytest.mark.parametrize("name", sorted(CASES))
def test_values_against_float64_formulas(name):
    desc, kw, formula = CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000)  # the same data in every process
    x = torch.randn(13, 4, generator=g, dtype=torch.float64)
    y = torch.randn(9, 4, generator=g, dtype=torch.float64)
    want = formula(x, y)
    scale = None
    if desc.family == "polynomial":
        scale = ((x.abs() @ y.abs().T) + abs(dict(desc.params)["c"])) ** desc.degree
    _check(km.run_kernel(desc, x, y, **kw), want, 1e-12, scale)
    _check(km.run_kernel(desc, x.float(), y.float(), **kw), want, 1e-5, scale)
    v = torch.randn(9, 2, generator=g, dtype=torch.float64)
    mv = km.kernel_matvec(desc, x, y, v, **kw)
    assert torch.allclose(mv, want @ v, rtol=1e-12, atol=1e-12)
    assert torch.allclose(km.KernelOperator(desc, x, y, **kw) @ v, want @ v, rtol=1e-12, atol=1e-12)
    if desc.positive:
        lse = km.kernel_logsumexp(desc, x, y, **kw)
        assert torch.allclose(lse, torch.logsumexp(want.log(), -1), rtol=1e-12, atol=1e-12)
    vals, idx = km.kernel_topk(desc, x, y, 3, **kw)
    ref = torch.topk(want, 3)
    assert torch.equal(idx, ref.indices) and torch.allclose(vals, ref.values, rtol=1e-12)


def test_blocks_batches_and_tensor_hyper_parameters():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 300, 3, generator=g, dtype=torch.float64)
    y = torch.randn(1, 70, 3, generator=g, dtype=torch.float64)
    alpha = torch.tensor([0.5, 2.0], dtype=torch.float64)
    d = km.rational_quadratic()
    k = km.run_kernel(d, x, y, bandwidth=1.0, alpha=alpha, regularization=0.25, regularization_offset_x=3)
    dist2 = torch.cdist(x, y.expand(2, 70, 3), compute_mode="donot_use_mm_for_euclid_dist") ** 2
    want = (1 + dist2 / (2 * alpha[:, None, None])) ** -alpha[:, None, None]
    rows = torch.arange(300)[:, None] + 3 == torch.arange(70)
    want = want + 0.25 * rows
    assert torch.allclose(k, want, rtol=1e-10, atol=1e-12)
    v = torch.randn(70, 2, generator=g, dtype=torch.float64)
    mv = km.kernel_matvec(d, x, y, v, bandwidth=1.0, alpha=alpha, regularization=0.25, regularization_offset_x=3)
    assert torch.allclose(mv, want @ v, rtol=1e-10, atol=1e-10)
    # float32 data offset far from the origin: the matrix product path reads them shifted
    xs, ys = (x[0] + 1000).float(), (y[0] + 1000).float()
    mv32 = km.kernel_matvec(km.matern(2.5), xs, ys, v.float(), bandwidth=1.0)
    ref = km.run_kernel(km.matern(2.5), x[0], y[0], bandwidth=1.0) @ v
    assert (mv32.double() - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_gradients_by_gradcheck():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(4, 2, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.tensor([0.9], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([1.4], dtype=torch.float64, requires_grad=True)
    per = torch.tensor([1.7], dtype=torch.float64, requires_grad=True)
    pe, pd, rq = km.powered_exponential(), km.periodic(), km.rational_quadratic()
    gc = torch.autograd.gradcheck
    assert gc(lambda x, y, h, q: km.run_kernel(pe, x, y, bandwidth=h, q=q), (x, y, h, q))
    assert gc(lambda x, y, v, h, q: km.kernel_matvec(pe, x, y, v, bandwidth=h, q=q), (x, y, v, h, q))
    assert gc(lambda x, y, v, per: km.kernel_matvec(pd, x, y, v, bandwidth=1.2, period=per, regularization=0.3),
              (x, y, v, per))
    assert gc(lambda x, v, a: km.KernelOperator(rq, x, x, bandwidth=1.0, alpha=a) @ v, (x, v[:, :1].repeat(2, 1)[:5], h))
    assert gc(lambda x, y, h: km.kernel_topk(km.matern(1.5), x, y, 2, bandwidth=h)[0], (x, y, h))
    lw = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    assert gc(lambda x, y, lw, h: km.kernel_logsumexp(km.additive(), x, y, lw, bandwidth=h), (x, y, lw, h))
    # coincident points: finite gradients (zero where the distance is zero)
    xx = x.detach().clone().requires_grad_()
    km.kernel_matvec(km.matern(2.5), xx, xx, torch.ones(5, 1, dtype=torch.float64), bandwidth=1.0).sum().backward()
    assert torch.isfinite(xx.grad).all()


def test_hyper_parameter_errors_name_the_argument():
    x = torch.randn(4, 2)
    with pytest.raises(ValueError, match="alpha"):
        km.rational_quadratic(alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        km.run_kernel(km.rational_quadratic(), x, x, bandwidth=1.0, alpha=-1.0)
    with pytest.raises(ValueError, match="alpha: .*needs a value"):
        km.run_kernel(km.rational_quadratic(), x, x, bandwidth=1.0)
    for bad in (0.0, 2.5, -1.0):
        with pytest.raises(ValueError, match="q"):
            km.powered_exponential(q=bad)
    with pytest.raises(ValueError, match="period"):
        km.periodic(period=0.0)
    with pytest.raises(ValueError, match="period"):
        km.run_kernel(km.periodic(), x, x, bandwidth=1.0, period=-2.0)
    with pytest.raises(TypeError, match="degree"):
        km.polynomial(2.0)
    with pytest.raises(ValueError, match="degree"):
        km.polynomial(0)
    with pytest.raises(ValueError, match="nu"):
        km.matern(3.5)
    with pytest.raises(TypeError, match="gamma"):
        km.run_kernel(km.matern(2.5), x, x, bandwidth=1.0, gamma=2.0)
    with pytest.raises(TypeError, match="alpha"):
        km.run_kernel(km.preset("gaussian_l2"), x, x, bandwidth=1.0, alpha=2.0)
    with pytest.raises(TypeError, match="bandwidth"):
        km.run_kernel(km.polynomial(2), x, x, bandwidth=1.0)
    with pytest.raises(TypeError, match="p:"):
        km.run_kernel(km.matern(2.5), x, x, bandwidth=1.0, p=2.0)
    with pytest.raises(ValueError, match="positive"):
        km.kernel_logsumexp(km.polynomial(2), x, x)
    with pytest.raises(ValueError, match="bandwidth"):
        km.kernel_matvec(km.cauchy(), x, x, torch.ones(4))
    out = torch.full((4, 4), 7.0)
    with pytest.raises(ValueError):
        km.run_kernel(km.cauchy(), x, x, bandwidth=-1.0, out=out)
    assert (out == 7.0).all()


def test_descriptors_routing_and_identity():
    assert km.matern(0.5) is km.preset("laplace_l2")  # the fused preset itself
    assert km.preset("gaussian_l2").fused_ok and not km.matern(2.5).fused_ok
    assert km.matern(2.5) == km.matern(nu=2.5) and hash(km.matern(2.5)) == hash(km.matern(2.5))
    assert km.matern(2.5) != km.matern(1.5) and km.rational_quadratic(1.0) != km.rational_quadratic(2.0)
    assert len({km.matern(1.5), km.matern(2.5), km.cauchy(), km.cauchy()}) == 3
    # the shipped descriptors' C++ arguments are unchanged; a formula's carries its full hash
    assert km.preset("laplace_l2").cpp_args() == ("kermac_like::Inner::Diff, kermac_like::Power::Square, "
                                                  "kermac_like::Power::Sqrt, kermac_like::Epilogue::Laplace")
    assert km.matern(2.5).key() in km.matern(2.5).cpp_args() and len(km.matern(2.5).key()) == 64
    x = torch.randn(30, 3)
    with record_plans() as plans:
        km.kernel_matvec(km.matern(2.5), x, x, torch.ones(30), bandwidth=1.0)
        km.run_kernel(km.cauchy(), x, x, bandwidth=1.0)
    assert [p.family for p in plans] == ["reference", "reference"]
    with pytest.raises(TypeError, match="descriptor"):
        km.ops._library.descriptor_ints(km.cauchy())


def test_kernel_ridge_takes_any_descriptor():
    from kermac_like.solvers import KernelRidge

    g = torch.Generator().manual_seed(3)
    X = torch.randn(120, 3, generator=g, dtype=torch.float64)
    y = torch.sin(X[:, 0])
    for desc, kw in ((km.matern(2.5), dict(bandwidth=1.0)), (km.rational_quadratic(alpha=0.5), dict(bandwidth=1.0)),
                     (km.polynomial(2), {})):
        m = KernelRidge(kernel=desc, alpha=1e-3, solver="cholesky", **kw).fit(X, y)
        K = km.run_kernel(desc, X, X, **kw)
        coef = torch.linalg.solve(K + 1e-3 * torch.eye(120, dtype=torch.float64), y)
        assert torch.allclose(torch.as_tensor(m.predict(X)), K @ coef, rtol=1e-6, atol=1e-6)
