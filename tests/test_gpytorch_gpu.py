"""kermac_like.gpytorch on a GPU (marker ``gpu``; skipped without CUDA): float32 ExactGP steps
against GPyTorch's own RBFKernel in float64 (CG / Lanczos, same probes), the pivoted-Cholesky
preconditioner against linear_operator's on the same operator, and one training step plus a
prediction at N = 10^5, where the dense float32 kernel would take 40 GB.
"""

import time

import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")
pytest.importorskip("linear_operator")

from kermac_like.gpytorch import KermacKernelLinearOperator, MaternKernel, RBFKernel, ScaledExactGP  # noqa: E402

pytestmark = pytest.mark.gpu


def data(n, d, seed=0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(-1)) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.to(device), y.to(device)


def step(kernel, x, y, dtype, max_cholesky_size=0, predict=True):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.device, dtype)
    model = ScaledExactGP(x.to(dtype), y.to(dtype), likelihood, kernel).to(x.device, dtype)
    kernel.lengthscale = torch.full_like(kernel.lengthscale, 0.7)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    model.train()
    likelihood.train()
    torch.manual_seed(1)
    with gpytorch.settings.max_cholesky_size(max_cholesky_size):
        loss = mll(model(x.to(dtype)), y.to(dtype))
        loss.backward()
    grad = kernel.raw_lengthscale.grad.clone()
    mean = None
    if predict:
        model.eval()
        likelihood.eval()
        with gpytorch.settings.max_cholesky_size(max_cholesky_size), torch.no_grad():
            mean = likelihood(model(x[:200].to(dtype) + 0.01)).mean
    return loss.detach().double(), grad.double(), mean if mean is None else mean.double()


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("ours, ref", [(RBFKernel, gpytorch.kernels.RBFKernel),
                                       (lambda **k: MaternKernel(nu=0.5, **k),
                                        lambda **k: gpytorch.kernels.MaternKernel(nu=0.5, **k))])
def test_float32_cuda_step_matches_gpytorch(ours, ref):
    """N = 5000, D = 8, ARD, float32 on the GPU: the fused products against GPyTorch's dense float32
    kernel, both on CG / Lanczos with the same probe vectors and a CG tolerance of 1e-3 (GPyTorch's
    training default, 1, would let the two stop at different iterations); the bound is float32
    rounding amplified by the solves: two solves that each stop at a relative residual of 1e-3
    may differ by twice that (measured on an H100: 1.16e-3 on the MLL for RBF)."""
    x, y = data(5000, 8)
    with gpytorch.settings.cg_tolerance(1e-3), gpytorch.settings.eval_cg_tolerance(1e-3):
        a = step(ours(ard_num_dims=8), x, y, torch.float32)
        b = step(ref(ard_num_dims=8), x, y, torch.float32)
    assert rel(a[0], b[0]) <= 2e-3, (a[0], b[0])
    assert rel(a[1], b[1]) <= 1e-2, (a[1], b[1])
    assert rel(a[2], b[2]) <= 1e-2, rel(a[2], b[2])  # the prediction's solve stops at 1e-3 (CPU, N = 600: 7e-4)


def test_float64_cuda_matches_gpytorch_within_1e4():
    """float64 on the GPU (kernel_matvec's reference path there): the issue's 1e-4 target, without
    the pivoted-Cholesky preconditioner and with the solves run to a CG tolerance of 1e-4. With
    GPyTorch's defaults (N = 2000 is at its preconditioning threshold; CG tolerance 1) the two
    sides' MLLs differed by 2.6e-4 and their gradients by 1e-2 on an H200, deterministically,
    with predictions equal to 4e-15 and both diagonals exactly 1 (bench/notes/gpytorch.md);
    without the preconditioner they agree to 2.4e-12 (MLL) and 3.6e-9 (gradient). On CPU the
    two agree to 1e-15 with the preconditioner too. Which step of the preconditioned estimate
    diverges on CUDA is not traced (bench/notes/gpytorch.md)."""
    x, y = data(2000, 8)
    with gpytorch.settings.max_preconditioner_size(0), gpytorch.settings.cg_tolerance(1e-4), \
            gpytorch.settings.max_cg_iterations(2000):
        a = step(RBFKernel(ard_num_dims=8), x, y, torch.float64)
        b = step(gpytorch.kernels.RBFKernel(ard_num_dims=8), x, y, torch.float64)
    for u, v in zip(a, b):
        assert rel(u, v) <= 1e-4


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-4), (torch.float64, 1e-9)])
def test_preconditioner_matches_linear_operators_on_the_same_operator(dtype, bound, monkeypatch):
    """N = 20000, D = 8, GPyTorch's defaults (the pivoted-Cholesky preconditioner of rank 15 from
    N = 2000, CG / Lanczos): our preconditioner (the outputscale folded into the operator,
    KermacAddedDiagLinearOperator, its pivoted Cholesky and QR gradient) against linear_operator's
    code on the same operator (ScaleKernel's ConstantMulLinearOperator, PivotedCholesky, torch's QR
    autograd). The rows are the same, hence the pivots, the factor and the probes: the MLL and the
    gradients of every parameter agree to rounding (on CPU, float64, N = 150: <= 1e-10)."""
    x, y = data(20_000, 8)
    x, y = x.to(dtype), y.to(dtype)

    def run():
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.device, dtype)
        model = ScaledExactGP(x, y, likelihood, RBFKernel(ard_num_dims=8)).to(x.device, dtype)
        model.covar_module.base_kernel.lengthscale = 0.7
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        torch.manual_seed(1)
        with gpytorch.settings.max_cholesky_size(0):
            loss = mll(model(x), y)
            loss.backward()
        grads = torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters())])
        return loss.detach().double(), grads.double()

    a = run()
    for name in ("_mul_constant", "__add__", "add_diagonal", "pivoted_cholesky"):
        monkeypatch.delattr(KermacKernelLinearOperator, name)
    b = run()
    assert rel(a[0], b[0]) <= bound and rel(a[1], b[1]) <= 10 * bound, (a, b)


def test_step_at_1e5_without_the_matrix():
    """One MLL + backward step and a prediction at N = 10^5, D = 8 (ScaleKernel(RBF), GPyTorch's
    defaults): finite, and the peak memory far below the 40 GB of the dense float32 kernel."""
    n = 100_000
    x, y = data(n, 8)
    x, y = x.float(), y.float()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loss, grad, mean = step(RBFKernel(ard_num_dims=8), x, y, torch.float32, max_cholesky_size=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(mean).all()
    assert peak < 2 * 2**30, f"peak {peak / 2**30:.2f} GiB"  # the dense kernel: n^2 * 4 B = 37 GiB
    print(f"N = {n}: MLL {float(loss):.4f}, step + prediction {seconds:.1f} s, peak {peak / 2**20:.0f} MiB")


def test_cg_products_on_tensor_cores(monkeypatch):
    """The operator's several-column products (CG / Lanczos) run on the tensor-core rows kernel
    (kermac_like.testing.gp_products): the same product as kernel_matvec's SIMT kernel
    (KERMAC_LIKE_GP_TC=0) within 2e-6 relative, and a training step takes that path."""
    from kermac_like.testing import gp_products as _products
    from kermac_like.plan.falkon import FalkonProducts

    x, _ = data(6000, 8, seed=2)
    x1 = (x.float() / 0.6).contiguous()
    op = KermacKernelLinearOperator(x1, x1, kernel="rbf")
    rhs = torch.randn(6000, 11, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
    with torch.no_grad():
        tc = op._matmul(rhs)
        assert "_kl_tc_products" in op.__dict__
        monkeypatch.setenv("KERMAC_LIKE_GP_TC", "0")
        simt = op._matmul(rhs)
        monkeypatch.delenv("KERMAC_LIKE_GP_TC")
        vec = op._matmul(rhs[:, 0])  # one column: kernel_matvec
    assert tc.dtype == torch.float32 and tc.shape == (6000, 11)
    assert rel(tc, simt) <= 2e-6, rel(tc, simt)
    assert rel(vec, simt[:, 0]) <= 1e-6
    calls = []
    real = FalkonProducts.rows_pv
    monkeypatch.setattr(FalkonProducts, "rows_pv", lambda self, *a: calls.append(1) or real(self, *a))
    xs, ys = data(3000, 8)
    loss, grad, _ = step(RBFKernel(), xs, ys, torch.float32, predict=False)
    assert calls and torch.isfinite(loss) and torch.isfinite(grad).all()
    assert _products.MIN_COLUMNS == 2


def test_pivoted_cholesky_graph_is_the_eager_loop(monkeypatch):
    """The pivoted-Cholesky loop replayed from its CUDA graph (captured once per shape on copies of the
    operator's tensors) gives the eager loop's factor and permutation bit for bit, for two operators of one
    shape (the second replays the first's graph on its own data) and a tolerance stop."""
    from kermac_like.testing import gp_operator as _operator

    x, _ = data(3000, 8, seed=5)
    x = x.float()
    _operator._PIVOT_GRAPHS.clear()
    for scale, tol in ((0.7, None), (0.45, 0.3)):
        op = KermacKernelLinearOperator(x / scale, x / scale, kernel="rbf", outputscale=torch.tensor(1.3, device="cuda"))
        with torch.no_grad():
            f_graph, p_graph = op.pivoted_cholesky(15, error_tol=tol, return_pivots=True)
            monkeypatch.setenv("KERMAC_LIKE_GP_GRAPH", "0")
            f_eager, p_eager = op.pivoted_cholesky(15, error_tol=tol, return_pivots=True)
            monkeypatch.delenv("KERMAC_LIKE_GP_GRAPH")
        assert torch.equal(p_graph, p_eager) and f_graph.shape == f_eager.shape
        assert torch.equal(f_graph.view(torch.int32), f_eager.view(torch.int32))
    assert len(_operator._PIVOT_GRAPHS) == 1 and all(v is not False for v in _operator._PIVOT_GRAPHS.values())
