"""kermac_like.gpytorch against GPyTorch's own kernels (CPU, float64, N <= 200): the exact
marginal log likelihood of an ExactGP, its gradient with respect to the raw lengthscale and
the predictions, on the Cholesky path and on CG / Lanczos (max_cholesky_size 0, the same
random probes for both); the same with the pivoted-Cholesky preconditioner (gradients of every
parameter), which never solves with more than its rank of right-hand sides; the operator's
pieces; no N x N block ever built on the CG path.
"""

import pytest
import torch

gpytorch = pytest.importorskip("gpytorch")
pytest.importorskip("linear_operator")

from linear_operator.operators import DiagLinearOperator, LinearOperator  # noqa: E402

from kermac_like.gpytorch import KermacKernelLinearOperator, MaternKernel, RBFKernel, ScaledExactGP  # noqa: E402
from kermac_like.testing import gp_operator as _operator  # noqa: E402

F64 = torch.float64
CG = 0  # max_cholesky_size: every solve on CG / Lanczos
CHOLESKY = 10**4  # every solve dense


def data(n=120, d=3, batch=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(*batch, n, d, generator=g, dtype=F64) * 2 - 1
    y = torch.sin(3 * x[..., 0]) * torch.cos(x[..., 1:].sum(-1)) + 0.1 * torch.randn(*batch, n, generator=g, dtype=F64)
    return x, y


def train_step_and_predict(kernel, x, y, max_cholesky_size, lengthscale=0.7):
    """(MLL, d MLL / d raw_lengthscale, predictive mean, predictive variance) at fixed seeds."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood(batch_shape=kernel.batch_shape).to(F64)
    model = ScaledExactGP(x, y, likelihood, kernel).to(F64)
    kernel.lengthscale = torch.full_like(kernel.lengthscale, lengthscale)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    model.train()
    likelihood.train()
    torch.manual_seed(1)  # the probe vectors of the stochastic trace / logdet
    with gpytorch.settings.max_cholesky_size(max_cholesky_size):
        loss = mll(model(x), y).sum()
        loss.backward()
    grad = kernel.raw_lengthscale.grad.clone()
    model.eval()
    likelihood.eval()
    torch.manual_seed(2)
    with gpytorch.settings.max_cholesky_size(max_cholesky_size), torch.no_grad():
        pred = likelihood(model(x[..., :15, :] + 0.01))
        mean, var = pred.mean, pred.variance
    return loss.detach(), grad, mean, var


def rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("solver", ["cholesky", "cg"])
@pytest.mark.parametrize("case", ["rbf", "rbf_ard", "matern"])
def test_mll_gradient_and_prediction_match_gpytorch(case, solver):
    x, y = data()
    ours, ref = {
        "rbf": (lambda: RBFKernel(), lambda: gpytorch.kernels.RBFKernel()),
        "rbf_ard": (lambda: RBFKernel(ard_num_dims=3), lambda: gpytorch.kernels.RBFKernel(ard_num_dims=3)),
        "matern": (lambda: MaternKernel(nu=0.5), lambda: gpytorch.kernels.MaternKernel(nu=0.5)),
    }[case]
    size = CG if solver == "cg" else CHOLESKY
    a = train_step_and_predict(ours(), x, y, size)
    b = train_step_and_predict(ref(), x, y, size)
    assert rel(a[0], b[0]) <= 1e-4 and rel(a[1], b[1]) <= 1e-4, (a[:2], b[:2])
    assert rel(a[2], b[2]) <= 1e-4 and rel(a[3], b[3]) <= 1e-4


def test_batch_shape_and_priors():
    """A batch of two GPs with their own lengthscales, a prior and a constraint on them."""
    x, y = data(n=60, batch=(2,))

    def make(cls):
        return cls(batch_shape=torch.Size([2]), ard_num_dims=3,
                   lengthscale_prior=gpytorch.priors.GammaPrior(3.0, 6.0),
                   lengthscale_constraint=gpytorch.constraints.Interval(0.05, 5.0))

    a = train_step_and_predict(make(RBFKernel), x, y, CG)
    b = train_step_and_predict(make(gpytorch.kernels.RBFKernel), x, y, CG)
    assert a[1].shape == (2, 1, 3)
    for u, v in zip(a, b):
        assert rel(u, v) <= 1e-4


def test_cg_path_never_builds_the_matrix(monkeypatch):
    """On CG the products go through kernel_matvec; the only dense blocks are the pivoted
    Cholesky preconditioner's rows (at most a few rows of N). (The CPU's stored kernel matrix,
    KERMAC_LIKE_GP_DENSE, off: tests/test_gpytorch_dense.py.)"""
    monkeypatch.setenv("KERMAC_LIKE_GP_DENSE", "0")
    x, y = data(n=150)
    blocks = []
    dense = _operator.dense_covar

    def watched(x1, x2, **kw):
        blocks.append((x1.shape[-2], x2.shape[-2]))
        return dense(x1, x2, **kw)

    monkeypatch.setattr(_operator, "dense_covar", watched)
    calls = []
    matvec = _operator.kernel_matvec
    monkeypatch.setattr(_operator, "kernel_matvec", lambda *a, **k: calls.append(1) or matvec(*a, **k))
    train_step_and_predict(RBFKernel(), x, y, CG)
    assert calls, "no product went through kernel_matvec"
    assert blocks and all(min(m, n) <= 15 for m, n in blocks), blocks  # preconditioner rank, test points


def test_operator_pieces():
    x, _ = data(n=40)
    z = x[:25] + 0.1
    for kernel, ref in (("rbf", torch.exp(-torch.cdist(x, z) ** 2 / 2)), ("laplace", torch.exp(-torch.cdist(x, z)))):
        op = KermacKernelLinearOperator(x, z, kernel=kernel)
        assert op.shape == (40, 25)
        v = torch.randn(25, 2, dtype=F64)
        torch.testing.assert_close(op @ v, ref @ v)
        torch.testing.assert_close(op.to_dense(), ref)
        torch.testing.assert_close(op.mT @ torch.ones(40, dtype=F64), ref.T.sum(1))
        torch.testing.assert_close(op[3:9, 2:20].to_dense(), ref[3:9, 2:20])
        sq = KermacKernelLinearOperator(x, x + 0.05, kernel=kernel)
        dense = sq.to_dense()
        torch.testing.assert_close(sq.diagonal(), dense.diagonal())
    with pytest.raises(ValueError, match="^kernel: expected one of"):
        KermacKernelLinearOperator(x, x, kernel="periodic")


@pytest.mark.parametrize("kernel", ["rbf", "laplace"])
def test_get_indices_entries_and_gradient(kernel, monkeypatch):
    """Entries at broadcast index tensors (the pivoted-Cholesky backward's N x rank block) equal
    the dense matrix's, with the same gradient; also when the coordinates go in several chunks."""
    x1 = torch.randn(2, 60, 5, dtype=F64, requires_grad=True)
    x2 = torch.randn(2, 45, 5, dtype=F64)
    op = KermacKernelLinearOperator(x1, x2, kernel=kernel)
    b = torch.arange(2).view(2, 1, 1)
    rows, cols = torch.randint(0, 60, (1, 60, 1)), torch.randint(0, 45, (1, 1, 7))
    ref = _operator.dense_covar(x1, x2, kernel=kernel)[b, rows, cols]
    for budget in (None, 1):  # 1: math.prod reports 2^24 entries, so that each chunk is one coordinate
        if budget:
            monkeypatch.setattr(_operator.math, "prod", lambda s: 1 << 24)
        got = op._get_indices(rows, cols, b)
        assert got.shape == (2, 60, 7)
        torch.testing.assert_close(got, ref)
        g_got, = torch.autograd.grad(got.square().sum(), x1)
        g_ref, = torch.autograd.grad(ref.square().sum(), x1, retain_graph=True)
        torch.testing.assert_close(g_got, g_ref)
    # flattened indices as linear_operator passes them: rows x pivots (the pivoted-Cholesky
    # backward's block) and a general pair list
    y1 = torch.randn(60, 5, dtype=F64, requires_grad=True)
    op = KermacKernelLinearOperator(y1, x2[0], kernel=kernel)
    perm, piv = torch.randperm(60), torch.randint(0, 45, (7,))
    flat_rows, flat_cols = perm[:, None].expand(60, 7).reshape(-1), piv[None].expand(60, 7).reshape(-1)
    for r, c in ((flat_rows, flat_cols), (torch.randint(0, 60, (50,)), torch.randint(0, 45, (50,)))):
        got = op._get_indices(r, c)
        ref = _operator.dense_covar(y1, x2[0], kernel=kernel)[r, c]
        torch.testing.assert_close(got, ref)
        g_got, = torch.autograd.grad(got.square().sum(), y1)
        g_ref, = torch.autograd.grad(ref.square().sum(), y1)
        torch.testing.assert_close(g_got, g_ref)


@pytest.mark.parametrize("kernel", ["rbf", "laplace"])
def test_pivot_columns_are_the_permuted_columns(kernel):
    """pivot_columns(p) (the pivoted-Cholesky backward's K[..., :, p], differences broadcast) equals
    apply_permutation's entries through _get_indices, values and gradients, batched with an outputscale
    and with x2 broadcast over the batch."""
    from linear_operator.utils.permutation import apply_permutation

    x1 = torch.randn(2, 50, 4, dtype=F64, requires_grad=True)
    x2 = torch.randn(1, 40, 4, dtype=F64, requires_grad=True)
    s = torch.tensor([0.7, 1.9], dtype=F64, requires_grad=True)
    op = KermacKernelLinearOperator(x1, x2, kernel=kernel, outputscale=s)
    piv = torch.stack([torch.randperm(40)[:6], torch.randperm(40)[:6]])
    got = op.pivot_columns(piv)
    ref = apply_permutation(op, None, piv)
    assert got.shape == ref.shape == (2, 50, 6)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    w = torch.randn(2, 50, 6, dtype=F64)
    g_got = torch.autograd.grad((got * w).sum(), (x1, x2, s))
    g_ref = torch.autograd.grad((ref * w).sum(), (x1, x2, s))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b)


def test_float64_rhs_of_float32_data():
    """A float64 right-hand side of float32 points takes kernel_matvec's float64 mode (no gradient
    asked for): float64 result, the float32 kernel values' accuracy."""
    x, _ = data(n=50)
    op = KermacKernelLinearOperator(x.float(), x.float(), kernel="rbf")
    v = torch.randn(50, 3, dtype=F64)
    out = op._matmul(v)
    assert out.dtype == F64
    ref = torch.exp(-torch.cdist(x, x) ** 2 / 2) @ v
    assert rel(out, ref) <= 1e-6


def test_lengthscale_gradient_through_kernel_matvec():
    """d/d lengthscale of u^T K v through the operator's product equals the dense one."""
    x, _ = data(n=30, d=2)
    u, v = torch.randn(30, 2, dtype=F64), torch.randn(30, 2, dtype=F64)
    grads = []
    for lazy in (True, False):
        ls = torch.tensor([[0.6, 1.3]], dtype=F64, requires_grad=True)
        op = KermacKernelLinearOperator(x / ls, x / ls, kernel="laplace")
        val = (u * (op @ v if lazy else op.to_dense() @ v)).sum()
        grads.append(torch.autograd.grad(val, ls)[0])
    torch.testing.assert_close(grads[0], grads[1])


def test_matern_other_nu_rejected():
    """GPyTorch's three smoothness values are served (0.5 fused, 1.5 and 2.5 formula kernels); any other
    nu is a ValueError naming the argument and the accepted values."""
    for nu in (0.5, 1.5, 2.5):
        assert MaternKernel(nu=nu).nu == nu
    for nu in (1.0, 3.5):
        with pytest.raises(ValueError, match="^nu: expected 0.5, 1.5 or 2.5"):
            MaternKernel(nu=nu)


def test_is_a_drop_in():
    k = RBFKernel(ard_num_dims=4)
    assert isinstance(k, gpytorch.kernels.RBFKernel) and k.lengthscale.shape == (1, 4)
    assert isinstance(MaternKernel(), gpytorch.kernels.MaternKernel)


# ---- the pivoted-Cholesky preconditioner (KermacAddedDiagLinearOperator) ----

PRECONDITIONED = 100  # min_preconditioning_size below the tests' N: rank 15 (GPyTorch's default) from N = 100
RANK = gpytorch.settings.max_preconditioner_size.value()


def preconditioned_step(kernel, x, y, likelihood=None):
    """(MLL, every parameter's gradient flattened in name order, predictive mean, variance) on CG /
    Lanczos with the preconditioner, at fixed seeds; the likelihood's preconditioner must be built."""
    likelihood = likelihood or gpytorch.likelihoods.GaussianLikelihood(batch_shape=kernel.batch_shape)
    model = ScaledExactGP(x, y, likelihood.to(F64), kernel).to(F64)
    kernel.lengthscale = torch.full_like(kernel.lengthscale, 0.7)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    model.train()
    likelihood.train()
    torch.manual_seed(1)
    with gpytorch.settings.max_cholesky_size(CG), gpytorch.settings.min_preconditioning_size(PRECONDITIONED):
        covar = likelihood(model(x)).lazy_covariance_matrix.evaluate_kernel()
        assert covar._preconditioner()[0] is not None
        torch.manual_seed(1)
        loss = mll(model(x), y).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters())])
        model.eval()
        likelihood.eval()
        torch.manual_seed(2)
        with torch.no_grad():
            f = model(x[..., :15, :] + 0.01)
            pred = f if isinstance(likelihood, gpytorch.likelihoods.FixedNoiseGaussianLikelihood) else likelihood(f)
    return loss.detach(), grads, pred.mean, pred.variance


@pytest.mark.parametrize("case", ["rbf_ard", "matern", "batch", "fixed_noise"])
def test_preconditioned_step_matches_gpytorch(case):
    """With the preconditioner (rank 15, Woodbury with the noise, its logdet correction), float64:
    ours (its own pivoted Cholesky and QR gradient on the scaled operator) against linear_operator's
    on GPyTorch's dense ScaleKernel: the MLL, the gradients of the raw lengthscale, outputscale,
    noise and constant mean, and the predictions agree to 1e-6 (CPU, N = 150: <= 3e-9, Matern's
    distances). The noise is constant (GaussianLikelihood) or not (fixed heteroscedastic noise plus a
    learned one). The first pivot is a tie of equal diagonal entries, which GPyTorch's distances
    break by their rounding: index 0 on both sides for this data (see the same-operator test)."""
    x, y = data(n=150, batch=(2,) if case == "batch" else ())
    ours, ref = {
        "rbf_ard": (lambda: RBFKernel(ard_num_dims=3), lambda: gpytorch.kernels.RBFKernel(ard_num_dims=3)),
        "matern": (lambda: MaternKernel(nu=0.5), lambda: gpytorch.kernels.MaternKernel(nu=0.5)),
        "batch": (lambda: RBFKernel(batch_shape=torch.Size([2])),
                  lambda: gpytorch.kernels.RBFKernel(batch_shape=torch.Size([2]))),
        "fixed_noise": (RBFKernel, gpytorch.kernels.RBFKernel),
    }[case]

    def likelihood():
        if case == "fixed_noise":
            noise = 0.01 + 0.02 * x[:, 0].abs()
            return gpytorch.likelihoods.FixedNoiseGaussianLikelihood(noise, learn_additional_noise=True)
        return None

    a = preconditioned_step(ours(), x, y, likelihood())
    b = preconditioned_step(ref(), x, y, likelihood())
    for u, v in zip(a, b):
        assert rel(u, v) <= 1e-6, (u, v)


def _graph(fn):
    """The names of the autograd nodes behind fn."""
    names, todo, seen = set(), [fn], set()
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(type(f).__name__)
        todo.extend(g for g, _ in f.next_functions)
    return names


def test_preconditioner_solves_with_at_most_rank_right_hand_sides(monkeypatch):
    """One training step (MLL + backward) with the preconditioner: ours never calls
    torch.linalg.solve_triangular with more right-hand sides than the rank, and its graph holds neither
    linear_operator's PivotedCholesky nor torch's QR backward (which solves with R^H for all N rows);
    GPyTorch's dense ScaleKernel(RBFKernel) does all three (the spy sees them)."""
    x, y = data(n=150)
    solves = []
    solve = torch.linalg.solve_triangular

    def spy(A, B, *, upper, left=True, unitriangular=False, out=None):
        solves.append(B.shape[-1] if left else B.shape[-2])
        return solve(A, B, upper=upper, left=left, unitriangular=unitriangular, out=out)

    monkeypatch.setattr(torch.linalg, "solve_triangular", spy)
    seen = []
    for kernel in (RBFKernel(), gpytorch.kernels.RBFKernel()):
        solves.clear()
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(F64)
        model = ScaledExactGP(x, y, likelihood, kernel).to(F64)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        with gpytorch.settings.max_cholesky_size(CG), gpytorch.settings.min_preconditioning_size(PRECONDITIONED):
            loss = mll(model(x), y)
            names = _graph(loss.grad_fn)
            loss.backward()
        seen.append((max(solves, default=0), "PivotedCholeskyBackward" in names, "LinalgQrBackward0" in names))
    assert seen[0] == (RANK, False, False), seen  # ours: the rank x rank inverse of the pivots' Cholesky factor
    assert seen[1] == (150 - RANK, True, True), seen


def test_preconditioner_matches_linear_operators_on_the_same_operator(monkeypatch):
    """Our operator with and without this module's preconditioner pieces (the outputscale folded in,
    its AddedDiag, pivoted Cholesky and QR gradient): the same pivots and factor, so the same MLL to
    rounding, and the same gradients."""
    x, y = data(n=150)
    a = preconditioned_step(RBFKernel(ard_num_dims=3), x, y)
    for name in ("_mul_constant", "__add__", "add_diagonal", "pivoted_cholesky"):
        monkeypatch.delattr(KermacKernelLinearOperator, name)
    b = preconditioned_step(RBFKernel(ard_num_dims=3), x, y)
    for u, v in zip(a, b):
        assert rel(u, v) <= 1e-10, (u, v)


def test_outputscale_folds_into_the_operator():
    """mul by a constant (ScaleKernel's outputscale, batched or not) keeps the operator, with the
    outputscale in its products, entries, diagonal and dense blocks and differentiable; + a diagonal
    gives the AddedDiag with this module's preconditioner."""
    x, _ = data(n=30, batch=(2,))
    s = torch.tensor([0.5, 2.0], dtype=F64, requires_grad=True)
    op = KermacKernelLinearOperator(x, x + 0.1, kernel="laplace").mul(s.view(2, 1, 1)).mul(torch.tensor(3.0, dtype=F64))
    assert isinstance(op, KermacKernelLinearOperator)
    ref = 3 * s.view(2, 1, 1) * torch.exp(-torch.cdist(x, x + 0.1))
    v = torch.randn(2, 30, 3, dtype=F64)
    torch.testing.assert_close(op @ v, ref @ v)
    torch.testing.assert_close(op.to_dense(), ref)
    torch.testing.assert_close(op.diagonal(), ref.diagonal(dim1=-2, dim2=-1))
    b, r, c = torch.tensor([1, 0, 1]), torch.tensor([3, 7, 29]), torch.tensor([0, 7, 5])
    torch.testing.assert_close(op._get_indices(r, c, b), ref[b, r, c])
    torch.testing.assert_close(op[1, 2:9, 4:6].to_dense(), ref[1, 2:9, 4:6])
    g, = torch.autograd.grad((op @ v).sum(), s)
    torch.testing.assert_close(g, torch.autograd.grad((ref @ v).sum(), s)[0])
    for added in (op + DiagLinearOperator(torch.ones(2, 30, dtype=F64)), op.add_diagonal(torch.tensor(0.1, dtype=F64))):
        assert isinstance(added, _operator.KermacAddedDiagLinearOperator) and added._linear_op is op
    with pytest.raises(TypeError, match="^outputscale: expected a tensor"):
        KermacKernelLinearOperator(x, x, kernel="rbf", outputscale=2.0)
    with pytest.raises(ValueError, match="^rank: expected a positive int"):
        op.pivoted_cholesky(0)


@pytest.mark.parametrize("batch, error_tol", [((), None), ((2,), None), ((), 1.0)])
def test_pivoted_cholesky_matches_linear_operator(batch, error_tol):
    """The factor, pivots and gradient (lengthscale, outputscale) of the operator's pivoted Cholesky
    against linear_operator's PivotedCholesky Function on the same operator (the same rows, so the
    same pivots: against a dense copy, equal diagonal entries would be ties broken by the rounding
    of its distances); also when error_tol stops it early (at 7 of 10 here). The factor is the
    dense matrix's: F F^T equals K on the pivots' rows and columns."""
    x, _ = data(n=60, batch=batch)
    w = torch.randn(*batch, 60, 10, dtype=F64)
    out = []
    for ours in (True, False):
        ls = torch.tensor(2.0, dtype=F64, requires_grad=True)
        s = torch.full(batch, 1.7, dtype=F64, requires_grad=True)
        op = KermacKernelLinearOperator(x / ls, x / ls, kernel="rbf", outputscale=s)
        pivoted_cholesky = (KermacKernelLinearOperator if ours else LinearOperator).pivoted_cholesky
        factor, perm = pivoted_cholesky(op, 10, error_tol=error_tol, return_pivots=True)
        out.append((factor, perm, *torch.autograd.grad((factor * w[..., :factor.shape[-1]]).sum(), (ls, s))))
    factor, perm = out[0][:2]
    assert factor.shape[-1] == (7 if error_tol else 10)
    assert torch.equal(perm, out[1][1])
    for u, v in zip(out[0], out[1]):
        torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-12)
    cols = perm[..., None, :factor.shape[-1]].expand(*batch, 60, -1)
    torch.testing.assert_close((factor @ factor.mT).detach().gather(-1, cols), op.to_dense().detach().gather(-1, cols))


def test_shifted_qr_gradient():
    """_ShiftedQR's logdet gradient (k x k work) equals torch's QR autograd; Q and R equal torch's."""
    a = torch.randn(2, 40, 6, dtype=F64, requires_grad=True)
    c = torch.tensor([[[0.3]], [[1.2]]], dtype=F64, requires_grad=True)
    q, r, logdet = _operator._ShiftedQR.apply(a, c)
    q_ref, r_ref = torch.linalg.qr(torch.cat((a, c * torch.eye(6, dtype=F64)), dim=-2))
    torch.testing.assert_close(q, q_ref[..., :40, :])
    torch.testing.assert_close(r, r_ref)
    w = torch.tensor([0.7, -1.3], dtype=F64)
    ref = r_ref.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1).mul(2)
    for u, v in zip(torch.autograd.grad((w * logdet).sum(), (a, c)), torch.autograd.grad((w * ref).sum(), (a, c))):
        torch.testing.assert_close(u, v)


# ---- the pivoted-Cholesky forward bit for bit (deferred stop, rows from the points) ----

def _pivoted_choleskys(op, rank, error_tol=None):
    """(factor, permutation) of this module's _PivotedCholesky and of linear_operator's own PivotedCholesky
    Function on the same operator."""
    from linear_operator.functions._pivoted_cholesky import PivotedCholesky

    return tuple(f.apply(op.representation_tree(), rank, error_tol, *op.representation())
                 for f in (_operator._PivotedCholesky, PivotedCholesky))


def _duplicated(k, copies, d=3, seed=0):
    """k distinct points, each `copies` times, interleaved: K has rank k."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(k, d, generator=g, dtype=F64) * 4 - 2).repeat(copies, 1)


def _bits(t):
    """t's bits as integers: equal bits, NaN included."""
    return t.view({torch.float64: torch.int64, torch.float32: torch.int32}[t.dtype])


@pytest.mark.parametrize("case", ["tolerance", "duplicates", "full", "laplace", "batch", "batch_tolerance",
                                  "batch_nan", "rank_ge_n", "float32", "dense"])
def test_pivoted_cholesky_forward_is_linear_operators_bit_for_bit(case):
    """The factor and the whole permutation equal linear_operator's PivotedCholesky on the same operator
    bit for bit, with the rank it stops at: by error_tol before the rank (random points, or duplicated
    points whose residual vanishes after their k distinct ones, so that the iterations past the stop
    meet zero or negative residuals: NaN or inf that must stay out of the result), at the full rank, for
    a batch of two operators (each with its outputscale; the stop is at the batch's largest error: 7
    and 4 alone, 7 together), with rank >= N (to N), in float32, and for another operator type (a dense
    one: its rows through apply_permutation). batch_nan: the first entry's residual vanishes after 4
    pivots, so that its fifth row holds NaN and NaN errors, at which linear_operator's test
    ``errors.max() > tol`` is False: both stop at 5 with the same NaN."""
    x, _ = data(n=60)
    x, s = x / 0.7, torch.tensor(1.7, dtype=F64)
    rank, error_tol, expect = 10, None, 10
    if case == "tolerance":
        x, error_tol, expect = x * 0.7 / 2, 1.0, 7
    elif case == "duplicates":
        x, expect = _duplicated(6, 10), 6
    elif case in ("batch", "batch_tolerance"):
        x, _ = data(n=60, batch=(2,))
        x, s = x / torch.tensor([0.7, 1.0], dtype=F64).view(2, 1, 1), torch.tensor([1.7, 0.6], dtype=F64)
        if case == "batch_tolerance":
            x, error_tol, expect = x * torch.tensor([0.35, 1 / 3], dtype=F64).view(2, 1, 1), 1.0, 7
    elif case == "batch_nan":
        x = torch.stack([_duplicated(4, 15), _duplicated(7, 9, seed=1)[:60]])
        s, expect = torch.tensor([1.7, 0.6], dtype=F64), 5
    elif case == "rank_ge_n":
        x, rank, expect = data(n=12)[0] * 4, 20, 12
    elif case == "float32":
        x, s = x.float(), s.float()
    op = KermacKernelLinearOperator(x, x, kernel="laplace" if case == "laplace" else "rbf", outputscale=s)
    if case == "dense":
        from linear_operator.operators import DenseLinearOperator

        op = DenseLinearOperator(op.to_dense())
    (factor, perm), (ref_factor, ref_perm) = _pivoted_choleskys(op, rank, error_tol)
    assert factor.shape == ref_factor.shape == (*x.shape[:-2], x.shape[-2], expect), (factor.shape, ref_factor.shape)
    assert factor.dtype == ref_factor.dtype and factor.is_contiguous()
    assert torch.equal(_bits(factor), _bits(ref_factor))
    assert torch.equal(perm, ref_perm)
    assert torch.equal(perm.sort(-1).values, torch.arange(x.shape[-2]).expand_as(perm))
    if case == "batch_nan":
        assert factor[0, :, 4].isnan().any() and not factor[:, :, :4].isnan().any()
    else:
        assert torch.isfinite(factor).all()


def test_pivoted_cholesky_stops_where_linear_operators_loop_stops():
    """For each m0 in 1 .. rank, an error_tol between the relative errors after iterations m0 - 2 and
    m0 - 1 (the residual diagonal's 1-norm over the unpivoted points / the largest diagonal entry):
    linear_operator's loop stops at m0 exactly, and so does ours, with the same factor and permutation
    (the permutation restored from the iterations past the stop). A stop index off by one fails here."""
    x, _ = data(n=80, d=2)
    op = KermacKernelLinearOperator(x / 0.4, x / 0.4, kernel="rbf")
    rank = 12
    (full, perm), _ = _pivoted_choleskys(op, rank, 0.0)
    diag = op.diagonal()
    errors = [(diag - full[:, :j + 1].square().sum(-1))[perm[j + 1:]].abs().sum() / diag.max()
              for j in range(rank - 1)]
    assert all(a > b > 0 for a, b in zip(errors, errors[1:]))  # so that each m0 has its interval
    for m0 in range(1, rank + 1):
        hi = 2 * errors[0] if m0 == 1 else errors[m0 - 2]
        lo = errors[m0 - 1] if m0 < rank else errors[-1] / 2
        tol = float((hi * lo).sqrt())
        (factor, p), (ref_factor, ref_p) = _pivoted_choleskys(op, rank, tol)
        assert ref_factor.shape[-1] == m0, (m0, ref_factor.shape)
        assert factor.shape[-1] == m0, (m0, factor.shape)
        assert torch.equal(factor, ref_factor) and torch.equal(p, ref_p)
        assert torch.equal(factor, full[:, :m0])


@pytest.mark.parametrize("kernel", ["rbf", "laplace"])
def test_pivot_row_is_apply_permutations_row(kernel, monkeypatch):
    """pivot_row(p) (the forward's row of K, straight from the points) equals apply_permutation's row
    (the entries _get_indices gives) bit for bit: batched with an outputscale and x2 broadcast over the
    batch, and with the coordinates in several chunks."""
    from linear_operator.utils.permutation import apply_permutation

    x1 = torch.randn(2, 50, 4, dtype=F64)
    s = torch.tensor([0.7, 1.9], dtype=F64)
    for op in (KermacKernelLinearOperator(x1, torch.randn(1, 50, 4, dtype=F64), kernel=kernel, outputscale=s),
               KermacKernelLinearOperator(x1[0], x1[0] + 0.1, kernel=kernel),
               KermacKernelLinearOperator(x1.float(), x1.float(), kernel=kernel, outputscale=s.float())):
        piv = torch.randint(0, 50, (*op.batch_shape, 1))
        for budget in (None, 1):
            with monkeypatch.context() as mp:
                if budget:  # each chunk one coordinate
                    mp.setattr(_operator.math, "prod", lambda s: 1 << 24)
                got = op.pivot_row(piv)
                ref = apply_permutation(op, piv, None).squeeze(-2)
            assert got.shape == ref.shape == (*op.batch_shape, 50)
            assert torch.equal(got, ref)


@pytest.mark.parametrize("kernel_cls", [RBFKernel, MaternKernel])
def test_training_backward_is_one_contraction_pass(kernel_cls, monkeypatch):
    """x in both slots of the training covariance: the bilinear derivative's x1 and x2 terms in one contraction
    with 2C columns; the gradients of every parameter equal linear_operator's generic derivative (two passes)."""
    from kermac_like.ops import matvec_backward

    calls = []
    orig = matvec_backward.contraction

    def counting(*a, **k):
        calls.append(a[3].shape[-1])  # columns
        return orig(*a, **k)

    monkeypatch.setattr(matvec_backward, "contraction", counting)
    monkeypatch.setattr(_operator, "contraction", counting)
    monkeypatch.setenv("KERMAC_LIKE_GP_DENSE", "0")  # the matrix-free backward (the stored matrix's: test_gpytorch_dense)
    x, y = data(n=150)

    def step():
        calls.clear()
        likelihood = gpytorch.likelihoods.GaussianLikelihood().to(F64)
        model = ScaledExactGP(x, y, likelihood, kernel_cls()).to(F64)
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        model.train()
        likelihood.train()
        torch.manual_seed(1)
        with gpytorch.settings.max_cholesky_size(CG):
            loss = -mll(model(x), y)
            loss.backward()
        return list(calls), [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ours_calls, ours = step()
    monkeypatch.setenv("KERMAC_LIKE_GP_SYMGRAD", "0")
    theirs_calls, theirs = step()
    assert len(ours_calls) == 1 and len(theirs_calls) == 2
    assert ours_calls[0] == 2 * theirs_calls[0]
    assert torch.equal(ours[0], theirs[0])
    for a, b in zip(ours[1:], theirs[1:]):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-14), (a - b).abs().max()


def test_bilinear_derivative_of_two_inputs_keeps_both_terms():
    """x1 and x2 distinct tensors (equal values): no single pass; each gets its own gradient."""
    x, _ = data(n=40)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    s = torch.tensor(1.3, dtype=F64, requires_grad=True)
    op = KermacKernelLinearOperator(x1, x2, kernel="rbf", outputscale=s)
    g = torch.Generator().manual_seed(5)
    u, v = torch.randn(40, 3, generator=g, dtype=F64), torch.randn(40, 3, generator=g, dtype=F64)
    g1, g2, gs = op._bilinear_derivative(u, v)
    dense = _operator.dense_covar(x1, x2, kernel="rbf", outputscale=s)
    r1, r2, rs = torch.autograd.grad((u * (dense @ v)).sum(), (x1, x2, s))
    for a, b in ((g1, r1), (g2, r2), (gs, rs)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
    shared = x.clone().requires_grad_()
    op = KermacKernelLinearOperator(shared, shared, kernel="rbf", outputscale=s)
    gx, none, gs = op._bilinear_derivative(u, v)
    rx, rs = torch.autograd.grad((u * (_operator.dense_covar(shared, shared, kernel="rbf", outputscale=s) @ v)).sum(),
                                 (shared, s))
    assert none is None and torch.allclose(gx, rx, rtol=1e-10, atol=1e-13) and torch.allclose(gs, rs, rtol=1e-12)
