"""Issue 42, the products: kernel_matvec, KernelOperator, kernel_logsumexp, the Falkon fit and the GPyTorch
operator on data far from the origin (coordinates offset by ~1000 x the spread) and on all-positive data
(relu, uniform): where a path forms DIFF distances by the product formula |x|^2 + |y|^2 - 2 <x, y>, it
reads x and y shifted by one reference point, so that its error is that of centred data.

CPU: the torch path's matrix product (kernel_matvec, KernelOperator, the solvers' dense blocks), which
paths shift and which do not (DOT, direct differences, the float64 mode, operands marked as centred), the
sm_90 tensor-core plan's operands (planned as on a GPU, not run: the ``as_gpu`` fixture), KernelOperator's
one shift per operator, the gradients, logsumexp's expanded-exponent bound, a Falkon fit and the GPyTorch
operator. GPU (marker ``gpu``): the same calls on the kernels against float64 arithmetic.

Data: a 2^-12 grid, so that x + 1024 is exact in float32 and the offset data's distances are those of
the centred data bit for bit; references are float64 direct differences of the given float32 inputs.
Kernel values within 1e-5 of max(value, 1e-5); products within 1e-5 of sum |k| |v| (2e-5 on the GPU, the
bound of tests/test_matvec.py's tensor-core tests); log-sum-exp values within 1e-5 of max(1, |value|).
"""

from __future__ import annotations

import pytest
import torch

import kermac_like as km
from kermac_like import centring
from kermac_like.centring import reference_point
from kermac_like.ops import matvec as ops_matvec
from kermac_like.plan import matvec as plan_matvec_mod

F64 = torch.float64
OFFSET = 1024.0  # ~1000 x the data's spread; x + OFFSET is exact for data on the 2^-12 grid below
TOL = 1e-5  # kernel values: of max(value, 1e-5); CPU products: of sum |k| |v|
GPU_TOL = 2e-5  # GPU products, of sum |k| |v| (tests/test_matvec.py's bound of the tensor-core paths)


def grid(t: torch.Tensor) -> torch.Tensor:
    return torch.round(t * 4096) / 4096


def datasets(shape_x, shape_y, seed=0, device="cpu"):
    """{name: (x, y)}: centred randn, the same offset by OFFSET, relu(randn) and uniform [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    x, y = grid(torch.randn(shape_x, generator=g)), grid(torch.randn(shape_y, generator=g))
    out = {"centred": (x, y), "offset": (x + OFFSET, y + OFFSET), "relu": (x.relu(), y.relu()),
           "uniform": (grid(torch.rand(shape_x, generator=g)), grid(torch.rand(shape_y, generator=g)))}
    return {k: (a.to(device), b.to(device)) for k, (a, b) in out.items()}


def ref_kernel(name: str, x: torch.Tensor, y: torch.Tensor, bw: float) -> torch.Tensor:
    """float64 kernel matrix of the given inputs by direct differences."""
    d = torch.cdist(x.to(F64), y.to(F64), compute_mode="donot_use_mm_for_euclid_dist")
    if name == "gaussian_l2":
        return torch.exp(-d * d / (2 * bw * bw))
    assert name == "laplace_l2"
    return torch.exp(-d / bw)


def check_products(out, k64, v, what="", tol=TOL):
    v64 = v.to(F64)
    v64 = v64.unsqueeze(-1) if v64.dim() == 1 else v64
    o = out.to(F64).reshape(v64.shape[:-2] + (k64.shape[-2], v64.shape[-1]))
    err = (o - k64 @ v64).abs()
    mag = k64.abs() @ v64.abs()
    assert torch.all(err <= tol * mag), f"{what}: {float((err / mag).max()):.3e} of sum |k| |v|"


def check_values(k, k64, what=""):
    err = (k.to(F64) - k64).abs()
    assert torch.all(err <= TOL * k64.clamp_min(1e-5)), f"{what}: {float((err / k64.clamp_min(1e-5)).max()):.3e}"


@pytest.fixture
def shifts(monkeypatch):
    """The calls of centring.shifted_pair (the one shift of the matvec paths, plan.matvec's name for it, and of
    KernelOperator), recorded."""
    calls = []
    orig = centring.shifted_pair

    def recording(*a, **k):
        calls.append((a, k))
        return orig(*a, **k)

    monkeypatch.setattr(plan_matvec_mod, "shifted_pair", recording)
    monkeypatch.setattr(centring, "shifted_pair", recording)
    return calls


# -- CPU ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l2"])
def test_cpu_matvec_matrix_product_is_shift_invariant(name):
    """The torch path's matrix product (SQUARE inner power, more than 25 rows): every data set within float32
    error of float64 arithmetic on the given inputs; the offset data give the centred data's result."""
    desc, bw = km.preset(name), 2.0
    data = datasets((70, 6), (50, 6))
    v = torch.randn(50, 3, generator=torch.Generator().manual_seed(1))
    got = {}
    for kind, (x, y) in data.items():
        got[kind] = km.kernel_matvec(desc, x, y, v, bandwidth=bw)
        check_products(got[kind], ref_kernel(name, x, y, bw), v, f"{name} {kind}")
        k = km.KernelOperator(desc, x, y, bandwidth=bw) @ torch.eye(50)  # the kernel values themselves
        check_values(k, ref_kernel(name, x, y, bw), f"{name} {kind} values")
    err = (got["offset"] - got["centred"]).abs().to(F64)
    assert torch.all(err <= TOL * (ref_kernel(name, *data["centred"], bw) @ v.abs().to(F64)))


def test_cpu_matvec_shifts_only_the_product_formula(shifts):
    """Shifted: a DIFF SQUARE call on the matrix product (float32 and float64 data; 16-bit data in float32);
    not: DOT, |x - y| (direct), 25 rows or fewer (direct), the float64 mode (direct differences), and
    operands marked as centred together."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(40, 5, generator=g) + OFFSET, torch.randn(30, 5, generator=g) + OFFSET
    v = torch.randn(30, 2, generator=g)
    gauss = km.preset("gaussian_l2")
    km.kernel_matvec(gauss, x, y, v, bandwidth=1.0)
    assert len(shifts) == 1
    km.kernel_matvec(gauss, x.double(), y.double(), v.double(), bandwidth=1.0)
    assert len(shifts) == 2
    # 16-bit data: shifted in float32 (their own subtraction would round), the result in their dtype
    xh, yh = (x - OFFSET).bfloat16(), (y - OFFSET).bfloat16()
    half = km.kernel_matvec(gauss, xh, yh, v.bfloat16(), bandwidth=1.0)
    assert len(shifts) == 3 and shifts[-1][1]["dtype"] == torch.float32 and half.dtype == torch.bfloat16
    k64, v64 = ref_kernel("gaussian_l2", xh, yh, 1.0), v.bfloat16().to(F64)
    assert torch.all((half.to(F64) - k64 @ v64).abs() <= 2 ** -7 * (k64 @ v64.abs()))  # bfloat16's output rounding
    del shifts[:]
    km.kernel_matvec(km.preset("dot"), x, y, v)
    km.kernel_matvec(km.preset("laplace_l1"), x, y, v, bandwidth=1.0)
    km.kernel_matvec(gauss, x[:20], y[:20], v[:20], bandwidth=1.0)
    km.kernel_matvec(gauss, x, y, v.double(), bandwidth=1.0)  # the float64 mode
    xc, yc, s = plan_matvec_mod.shifted_pair(x, y)
    plan_matvec_mod.mark_centred(s, xc, yc)
    km.kernel_matvec(gauss, xc, yc, v, bandwidth=1.0)
    assert len(shifts) == 1 and shifts[0][0][0] is x  # (the one above, by the test itself)
    xc.add_(0)  # an in-place change voids the mark
    km.kernel_matvec(gauss, xc, yc, v, bandwidth=1.0)
    assert len(shifts) == 2


def test_cpu_matvec_gradients_are_those_of_the_given_inputs():
    """kernel_matvec's x, y gradients on offset data equal float64 autograd on the given inputs (the shift is
    inside the op; the backward's direct differences read x and y as given)."""
    g = torch.Generator().manual_seed(4)
    x0, y0 = grid(torch.randn(40, 3, generator=g)), grid(torch.randn(35, 3, generator=g))
    v = torch.randn(35, 2, generator=g)
    desc = km.preset("gaussian_l2")
    grads = []
    for off in (0.0, OFFSET):
        x, y = (x0 + off).requires_grad_(), (y0 + off).requires_grad_()
        km.kernel_matvec(desc, x, y, v, bandwidth=1.5).square().sum().backward()
        grads.append((x.grad, y.grad))
    xd, yd = x0.to(F64).requires_grad_(), y0.to(F64).requires_grad_()
    (ref_kernel("gaussian_l2", xd, yd, 1.5) @ v.to(F64)).square().sum().backward()
    for gx, gy in grads:
        torch.testing.assert_close(gx.to(F64), xd.grad, rtol=1e-4, atol=1e-5 * float(xd.grad.abs().max()))
        torch.testing.assert_close(gy.to(F64), yd.grad, rtol=1e-4, atol=1e-5 * float(yd.grad.abs().max()))


def test_cpu_kernel_operator_shifts_once(shifts):
    """KernelOperator: one shift for any number of products (x is y: one copy), shared with K.T; an in-place
    change of x builds it anew; under autograd each product shifts the differentiable tensors themselves and
    the gradient is the given inputs'; DOT is never shifted."""
    g = torch.Generator().manual_seed(5)
    x = grid(torch.randn(60, 4, generator=g)) + OFFSET
    desc = km.preset("gaussian_l2")
    op = km.KernelOperator(desc, x, x, bandwidth=1.0, regularization=0.1)
    k64 = ref_kernel("gaussian_l2", x, x, 1.0) + 0.1 * torch.eye(60, dtype=F64)
    for c in (1, 3, 5):
        v = torch.randn(60, c, generator=g)
        check_products(op @ v, k64, v, f"C={c}")
    u = torch.randn(2, 60, generator=g)
    torch.testing.assert_close((u @ op).to(F64), u.to(F64) @ k64, rtol=1e-5, atol=1e-5 * float(k64.abs().sum(0).max()))
    assert len(shifts) == 1
    _, xs, ys = op._centred[0][3:]
    assert xs is ys and abs(float(xs.mean())) < 1
    x.add_(0.0)  # a new version of x: shifted anew
    op @ torch.ones(60)
    assert len(shifts) == 2
    # autograd: the differentiable x - s per product, gradients of the given x
    xg = x.clone().requires_grad_()
    opg = km.KernelOperator(desc, xg, xg, bandwidth=1.0)
    v = torch.randn(60, 2, generator=g)
    (opg @ v).square().sum().backward()
    xd = x.to(F64).requires_grad_()
    (ref_kernel("gaussian_l2", xd, xd, 1.0) @ v.to(F64)).square().sum().backward()
    torch.testing.assert_close(xg.grad.to(F64), xd.grad, rtol=1e-4, atol=1e-5 * float(xd.grad.abs().max()))
    del shifts[:]
    km.KernelOperator(km.preset("dot"), x, x) @ v
    km.KernelOperator(desc, x.double(), x.double(), bandwidth=1.0) @ v.double()
    assert len(shifts) == 1  # float64 data: the matrix product too


def test_cpu_wgmma_plan_reads_shifted_operands(as_gpu):
    """The sm_90 tensor-core matvec (planned, not run): x and y shifted by their reference point, zero-padded
    to whole 16-byte rows, the kernel and b preparation reading those copies; x is y: one copy; broadcast
    batch modes stay broadcast; operands marked as centred and DOT calls: read as given."""
    g = torch.Generator().manual_seed(6)
    x, y, v = torch.randn(50, 37, generator=g) + OFFSET, torch.randn(70, 37, generator=g) + OFFSET, torch.randn(70, 2)
    desc = km.preset("gaussian_l2")

    def plan(d, a, b, w, **h):
        call = ops_matvec.prepare_matvec(d, a, b, w, **h)
        p = plan_matvec_mod.plan_matvec(call, torch.empty(call.out_shape), False)
        assert p.family == "matvec_wgmma"
        return p

    p = plan(desc, x, y, v, bandwidth=1.0)
    xs, ys = p.scratch[0], p.scratch[1]
    s = reference_point(x, y)
    assert xs.shape == (50, 40) and ys.shape == (70, 40)
    assert torch.equal(xs[:, :37], x - s) and torch.equal(ys[:, :37], y - s)
    assert not xs[:, 37:].any() and not ys[:, 37:].any()
    assert p.launches[0].args[0] == ys.data_ptr() and p.launches[1].args[0] == xs.data_ptr()
    same = plan(desc, x, x, torch.randn(50, 1), bandwidth=1.0)
    assert same.scratch[0] is same.scratch[1] and abs(float(same.scratch[0].mean())) < 1
    xb = x[:, :36].unsqueeze(0).expand(3, 50, 36)
    bat = plan(desc, xb, y[:, :36], v, bandwidth=1.0)
    assert bat.scratch[0].shape == (3, 50, 36) and bat.scratch[0].stride(0) == 0
    x40, y40 = x[:, :36].contiguous(), y[:, :36].contiguous()
    xc, yc, s = plan_matvec_mod.shifted_pair(x40, y40)
    plan_matvec_mod.mark_centred(s, xc, yc)
    assert plan(desc, xc, yc, v, bandwidth=1.0).scratch[0] is xc
    assert plan(km.preset("dot"), x40, y40, v).scratch[0] is x40


def test_cpu_solver_blocks_share_one_reference_point(monkeypatch):
    """SolverKernel.matrix on the torch path's matrix product shifts by the reference point of b (the centres),
    gram_of_rows computes it once for all its blocks, and the offset data give the centred data's blocks."""
    from kermac_like.testing import solver_kernel as _kernel

    kern = _kernel.resolve_kernel("gaussian_l2", 1.0, None)
    data = datasets((300, 4), (40, 4), seed=7)
    (xc, zc), (xo, zo) = data["centred"], data["offset"]
    torch.testing.assert_close(kern.matrix(xo, zo), kern.matrix(xc, zc), rtol=0, atol=1e-6)
    check_values(kern.matrix(xo, zo), ref_kernel("gaussian_l2", xo, zo, 1.0))
    assert kern.shifts(xo, zo) and not kern.shifts(xo[:20], zo[:20])
    assert not _kernel.resolve_kernel("dot", None, None).shifts(xo, zo)
    seen = []
    monkeypatch.setattr(_kernel, "reference_point", lambda *p: seen.append(len(p)) or reference_point(*p))
    monkeypatch.setattr(_kernel, "BLOCK_BYTES", 40 * 4 * 64)  # blocks of 64 rows
    gram = kern.gram_of_rows(xo, zo)
    assert seen == [1]
    k64 = ref_kernel("gaussian_l2", xo, zo, 1.0)
    torch.testing.assert_close(gram, k64.T @ k64, rtol=2e-5, atol=2e-5)


@pytest.mark.filterwarnings("ignore:KernelRidge")
def test_cpu_nystrom_fit_on_offset_data():
    """KernelRidge(solver="nystrom") on the CPU: the offset data's predictions are the centred data's (K_ZZ of
    the preconditioner from shifted blocks; without the shift, the product formula's K_ZZ gave predictions 3e-2
    away and 30x the test error here)."""
    from kermac_like.solvers import KernelRidge

    g = torch.Generator().manual_seed(8)
    x = grid(torch.rand(300, 3, generator=g))
    y = torch.sin(3 * x).sum(1, keepdim=True)
    xt = grid(torch.rand(100, 3, generator=g))
    preds = []
    for off in (0.0, OFFSET):
        est = KernelRidge("gaussian_l2", bandwidth=0.5, alpha=1e-3, solver="nystrom", n_centers=50, random_state=0,
                          tol=1e-3)
        preds.append(est.fit(x + off, y).predict(xt + off).to(F64))
    want = torch.sin(3 * xt).sum(1, keepdim=True).to(F64)
    assert float((preds[1] - preds[0]).norm() / preds[0].norm()) < 1e-4
    assert float((preds[1] - want).square().mean()) < 2 * float((preds[0] - want).square().mean()) + 1e-8


def test_cpu_logsumexp_expand_bound_on_centred_data():
    """expand_params: the bound is formed from the data about their centre, so offset data get the same flag
    (and a centre moved by the offset); kernel_logsumexp's values on the offset data are the centred data's."""
    from kermac_like.plan.logsumexp import expand_params

    g = torch.Generator().manual_seed(9)
    x, y = grid(torch.randn(500, 3, generator=g)), grid(torch.randn(2000, 3, generator=g))
    desc = km.preset("gaussian_l2")
    for bw in (0.3, 1.0, 3.0):
        a, b = expand_params(desc, x, y, bw), expand_params(desc, x + OFFSET, y + OFFSET, bw)
        assert a[0] == b[0]
        torch.testing.assert_close(b[1:] - OFFSET, a[1:], rtol=0, atol=1e-3)
    assert expand_params(desc, x, y, 1.0)[0] == 1.0
    lw = torch.randn(2000, generator=g)
    a = km.kernel_logsumexp(desc, x, y, lw, bandwidth=0.7)
    b = km.kernel_logsumexp(desc, x + OFFSET, y + OFFSET, lw, bandwidth=0.7)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cpu_gpytorch_operator_products(settings):
    """The GPyTorch RBFKernel's operator, matrix-free (the setting gp_dense off; the stored matrix's products
    are tests/test_gpytorch_dense.py's): its inputs centred once per forward (the operator built with
    centred=True: no product shifts them again), its products on offset and all-positive data within float32
    error of float64 arithmetic on the given inputs; an operator built from offset tensors directly: shifted
    per product, same accuracy."""
    gpytorch = pytest.importorskip("gpytorch")
    settings(gp_dense=False)
    from kermac_like.gpytorch import KermacKernelLinearOperator, RBFKernel

    kernel = RBFKernel()
    kernel.lengthscale = 0.75
    ls = kernel.lengthscale.detach().item()
    data = datasets((80, 3), (80, 3), seed=10)
    v = torch.randn(80, 3, generator=torch.Generator().manual_seed(11))
    calls = []
    orig = plan_matvec_mod.shifted_pair
    try:
        plan_matvec_mod.shifted_pair = lambda *a, **k: calls.append(1) or orig(*a, **k)
        for kind, (x, _) in data.items():
            with gpytorch.settings.max_cholesky_size(0), torch.no_grad():
                op = kernel(x).evaluate_kernel()
                assert isinstance(op, KermacKernelLinearOperator) and op.centred
                out = op @ v
            check_products(out, ref_kernel("gaussian_l2", x, x, ls), v, kind)
        assert not calls
        x = data["offset"][0]
        with torch.no_grad():
            out = KermacKernelLinearOperator(x, x, kernel="rbf") @ v
        check_products(out, ref_kernel("gaussian_l2", x, x, 1.0), v, "direct")
        assert len(calls) == 1
        with pytest.raises(TypeError, match="^centred: expected a bool"):
            KermacKernelLinearOperator(x, x, kernel="rbf", centred=1)
    finally:
        plan_matvec_mod.shifted_pair = orig


# -- GPU ------------------------------------------------------------------------------------------------------------
DEV = "cuda"


def _cuda_data(shape_x, shape_y, seed=0):
    return datasets(shape_x, shape_y, seed=seed, device=DEV)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l2"])
@pytest.mark.parametrize("K", [3, 40])
def test_gpu_kernel_matvec(name, K):
    """kernel_matvec on the GPU (K = 3: the fused SIMT kernel; K = 40: the sm_90 tensor-core kernel, elsewhere
    run_kernel's tensor-core tiles): products and kernel values of every data set against float64; the offset
    data's products are the centred data's."""
    desc, bw = km.preset(name), float(K) ** 0.5
    data = _cuda_data((3000, K), (4000, K), seed=K)
    v = torch.randn(4000, 3, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    got = {}
    for kind, (x, y) in data.items():
        got[kind] = km.kernel_matvec(desc, x, y, v, bandwidth=bw)
        k64 = ref_kernel(name, x, y, bw)
        check_products(got[kind], k64, v, f"{name} K={K} {kind}", GPU_TOL)
        check_values(km.kernel_matvec(desc, x[:300], y[:64], torch.eye(64, device=DEV), bandwidth=bw),
                     k64[:300, :64], f"{name} K={K} {kind} values")
    err = (got["offset"] - got["centred"]).abs().to(F64)
    assert torch.all(err <= 2 * GPU_TOL * (ref_kernel(name, *data["centred"], bw) @ v.abs().to(F64)))


@pytest.mark.gpu
@pytest.mark.parametrize("K", [3, 40])
def test_gpu_kernel_operator(K):
    """KernelOperator @ on the GPU (one shift per operator where the path takes the product formula), against
    float64, the offset data giving the centred data's products; K.T @ too."""
    desc, bw = km.preset("gaussian_l2"), float(K) ** 0.5
    data = _cuda_data((2500, K), (2500, K), seed=20 + K)
    g = torch.Generator(DEV).manual_seed(2)
    v = torch.randn(2500, 4, device=DEV, generator=g)
    got = {}
    for kind, (x, y) in data.items():
        op = km.KernelOperator(desc, x, y, bandwidth=bw)
        k64 = ref_kernel("gaussian_l2", x, y, bw)
        got[kind] = op @ v
        check_products(got[kind], k64, v, f"K={K} {kind}", GPU_TOL)
        check_products(op.T @ v, k64.T, v, f"K={K} {kind} transposed", GPU_TOL)
        check_products(op @ v[:, 0], k64, v[:, 0], f"K={K} {kind} vector", GPU_TOL)
    err = (got["offset"] - got["centred"]).abs().to(F64)
    assert torch.all(err <= 2 * GPU_TOL * (ref_kernel("gaussian_l2", *data["centred"], bw) @ v.abs().to(F64)))


@pytest.mark.gpu
@pytest.mark.parametrize("name,bw", [("gaussian_l2", 1.0), ("gaussian_l2", 0.3), ("laplace_l2", 1.0)])
def test_gpu_kernel_logsumexp(name, bw, monkeypatch):
    """kernel_logsumexp on the GPU (the fused kernel: one column takes the expanded exponent where its bound
    allows, two columns the direct form) within 1e-5 of max(1, |value|) of float64 on the given inputs; the
    offset data's values are the centred data's."""
    desc = km.preset(name)
    data = _cuda_data((2000, 3), (5000, 3), seed=30)
    g = torch.Generator(DEV).manual_seed(3)
    lw = torch.randn(5000, 2, device=DEV, generator=g)
    got = {}
    for kind, (x, y) in data.items():
        d = torch.cdist(x.to(F64), y.to(F64), compute_mode="donot_use_mm_for_euclid_dist")
        phi = d * d / (2 * bw * bw) if name == "gaussian_l2" else d / bw
        for cols in (lw[:, 0], lw):
            out = km.kernel_logsumexp(desc, x, y, cols, bandwidth=bw)
            l64 = cols.to(F64)
            ref = torch.logsumexp(-phi.unsqueeze(-1) + (l64.unsqueeze(-1) if l64.dim() == 1 else l64).unsqueeze(0), 1)
            ref = ref.squeeze(-1) if cols.dim() == 1 else ref
            err = (out.to(F64) - ref).abs()
            assert torch.all(err <= TOL * ref.abs().clamp_min(1)), (kind, cols.dim(), float(err.max()))
            got[(kind, cols.dim())] = out
    for c in (1, 2):
        a, b = got[("centred", c)].to(F64), got[("offset", c)].to(F64)
        assert torch.all((a - b).abs() <= 2 * TOL * a.abs().clamp_min(1))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:KernelRidge")
@pytest.mark.parametrize("D", [4, 40])
def test_gpu_nystrom_fit(D):
    """KernelRidge(solver="nystrom") on the GPU (D = 4: Falkon's tensor-core products; D = 40: kernel_matvec's
    blocked float64 mode) on uniform (all-positive) data and the same offset by 1024: the predictions agree,
    and agree with a float64 fit on the same float32 inputs, to the solves' tolerance (the CPU model: 1.5e-4
    between the float32 and float64 fits; an unshifted product formula would put ~0.3 into K_ZZ's exponents)."""
    from kermac_like.solvers import KernelRidge

    g = torch.Generator().manual_seed(40 + D)
    x = grid(torch.rand(6000, D, generator=g)).to(DEV)
    y = torch.sin(3 * x[:, :4]).sum(1, keepdim=True)
    xt = grid(torch.rand(500, D, generator=g)).to(DEV)
    bw = 0.3 * D ** 0.5

    def fit(a, at):
        est = KernelRidge("gaussian_l2", bandwidth=bw, alpha=1e-3, solver="nystrom", n_centers=300, random_state=0,
                          tol=1e-5)
        return est.fit(a, y.to(a.dtype)).predict(at).to(F64)

    base, off, f64 = fit(x, xt), fit(x + OFFSET, xt + OFFSET), fit(x.double(), xt.double())
    assert float((off - base).norm() / base.norm()) < 1e-3
    assert float((base - f64).norm() / f64.norm()) < 1e-3
    assert float((off - f64).norm() / f64.norm()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("D", [3, 40])
def test_gpu_gpytorch_rbf_operator_matmul(D):
    """The GPyTorch RBFKernel's operator on the GPU: several columns (D = 3: the tensor-core CG products; D = 40:
    kernel_matvec) and one column (kernel_matvec) against float64 arithmetic on the given float32 inputs, on
    offset and all-positive data; the offset data's products are the centred data's."""
    gpytorch = pytest.importorskip("gpytorch")
    from kermac_like.gpytorch import KermacKernelLinearOperator, RBFKernel

    kernel = RBFKernel().to(DEV)
    kernel.lengthscale = 0.5 * D ** 0.5
    ls = kernel.lengthscale.detach().item()
    data = _cuda_data((3000, D), (3000, D), seed=50 + D)
    v = torch.randn(3000, 6, device=DEV, generator=torch.Generator(DEV).manual_seed(5))
    got = {}
    for kind, (x, _) in data.items():
        with gpytorch.settings.max_cholesky_size(0), torch.no_grad():
            op = kernel(x).evaluate_kernel()
            assert isinstance(op, KermacKernelLinearOperator)
            got[kind] = op @ v
            one = op @ v[:, 0]
        k64 = ref_kernel("gaussian_l2", x, x, ls)
        check_products(got[kind], k64, v, f"D={D} {kind}", GPU_TOL)
        check_products(one, k64, v[:, 0], f"D={D} {kind} one column", GPU_TOL)
    err = (got["offset"] - got["centred"]).abs().to(F64)
    assert torch.all(err <= 2 * GPU_TOL * (ref_kernel("gaussian_l2", *data["centred"], ls) @ v.abs().to(F64)))
