"""Falkon's preconditioner in one m x m float64 buffer (A in the upper triangle, T^T in the
strict lower one, the diagonals swapped in per solve): the blocked lauum, the triangle each
triangular solve reads, B and B^T against the two-matrix construction, the retries of a failed
factorisation, the bytes it holds, and a fit against the dense solution of the Nystrom system."""

import pytest
import torch

from kermac_like import linalg
from kermac_like.solvers import KernelRidge
from kermac_like.testing import solver_kernel, solver_nystrom

f64 = torch.float64
KERNEL = solver_kernel.resolve_kernel("gaussian_l2", 1.0, None)


def centres(m, d=3, dtype=f64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(m, d, dtype=f64, generator=g) * 2 - 1).to(dtype)


def two_matrices(z, n_total, alpha, shift, a_shift=0.0):
    """T, A and B = N^-1/2 T^-1 A^-1 of the two-matrix build (the reference)."""
    m = z.shape[0]
    t = torch.linalg.cholesky(KERNEL.matrix(z, z).to(f64) + shift * torch.eye(m, dtype=f64), upper=True)
    a = torch.linalg.cholesky(t @ t.T / m + (alpha / n_total + a_shift) * torch.eye(m, dtype=f64), upper=True)
    s = n_total ** -0.5

    def apply(g):
        return torch.linalg.solve_triangular(t, torch.linalg.solve_triangular(a, g, upper=True), upper=True) * s

    def apply_t(v):
        return torch.linalg.solve_triangular(a.T, torch.linalg.solve_triangular(t.T, v, upper=False), upper=False) * s

    return t, apply, apply_t


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_solve_triangular_reads_one_triangle_and_its_diagonal():
    g = torch.Generator().manual_seed(1)
    m = 40
    w = torch.randn(m, m, dtype=f64, generator=g) / m + 2 * torch.eye(m, dtype=f64)
    v = torch.randn(m, 3, dtype=f64, generator=g)
    for upper in (True, False):
        clean = torch.triu(w) if upper else torch.tril(w)
        other = torch.ones(m, m, dtype=torch.bool).tril(-1) if upper else torch.ones(m, m, dtype=torch.bool).triu(1)
        dirty = clean.masked_fill(other, float("nan"))
        for mat, ref in ((dirty, clean), (dirty.T.contiguous().mT, clean)):  # C- and F-contiguous
            assert torch.equal(torch.linalg.solve_triangular(mat, v, upper=upper),
                               torch.linalg.solve_triangular(ref, v, upper=upper))


@pytest.mark.parametrize("rows", [7, 16, 40, 64])
def test_lauum_upper_blocked(rows):
    g = torch.Generator().manual_seed(2)
    m = 40
    t = torch.triu(torch.randn(m, m, dtype=f64, generator=g)) + 3 * torch.eye(m, dtype=f64)
    w = torch.full((m, m), float("nan"), dtype=f64)
    w.copy_(torch.tril(t.T, -1) + torch.triu(w))  # T^T strictly below the diagonal, NaN elsewhere
    lower = torch.tril(w, -1).clone()
    solver_nystrom._lauum_upper(w, t.diagonal().clone(), 0.25, rows)
    assert torch.equal(torch.tril(w, -1), lower)
    assert rel(torch.triu(w), torch.triu(0.25 * t @ t.T)) < 1e-14


@pytest.mark.parametrize("dtype", [f64, torch.float32])
def test_one_buffer_equals_two_matrices(dtype):
    m, n_total, alpha = 150, 2000, 0.05
    z = centres(m, dtype=dtype)
    pre = solver_nystrom.FalkonPreconditioner(KERNEL, z, n_total, alpha, block_rows=32)  # blocks with a remainder
    t, apply, apply_t = two_matrices(z, n_total, alpha, pre.shift)
    g = torch.randn(m, 2, dtype=f64, generator=torch.Generator().manual_seed(3))
    assert rel(pre.apply(g), apply(g)) < 1e-12
    assert rel(pre.apply_t(g), apply_t(g)) < 1e-12
    assert rel(pre.apply_t(pre.apply(g)), apply_t(apply(g))) < 1e-12  # diagonals swapped back and forth
    kzn = KERNEL.matrix(z, centres(300, seed=4).to(dtype)).to(f64)

    def products(beta):
        return kzn @ (kzn.T @ beta)

    for a in (alpha, -alpha):  # apply_a, and the residual's sign
        beta = apply(g)
        ref = apply_t(products(beta) + a * (t.T @ (t @ beta)))
        assert rel(pre.normal(g, products, a), ref) < 1e-8  # the reference multiplies by T: ~2e-10


@pytest.mark.parametrize("stage", [0, 1])
def test_failed_factorisation_rebuilds_its_input(monkeypatch, stage):
    """The stage-th Cholesky overwrites its triangle and fails once: K_ZZ (stage 0) or T T^T / m
    + lambda I (stage 1, from the strict lower triangle) is rebuilt with a larger shift."""
    real = linalg.solve_cholesky
    calls = []

    def flaky(a, b, **kw):
        out = real(a, b, **kw)
        calls.append(a.shape)
        if len(calls) == stage + 1:
            raise torch.linalg.LinAlgError("planted failure")
        return out

    monkeypatch.setattr(linalg, "solve_cholesky", flaky)
    m, n_total, alpha = 80, 1000, 0.05
    z = centres(m)
    base = solver_nystrom.FalkonPreconditioner(KERNEL, z, n_total, alpha, block_rows=32) if stage else None
    calls.clear()
    pre = solver_nystrom.FalkonPreconditioner(KERNEL, z, n_total, alpha, block_rows=32)
    assert len(calls) == 3
    g = torch.randn(m, 1, dtype=f64, generator=torch.Generator().manual_seed(5))
    if stage == 0:
        delta0 = torch.finfo(f64).eps * m  # the first shift (K_ZZ's diagonal is 1)
        assert pre.shift == pytest.approx(10 * delta0)
        _, apply, apply_t = two_matrices(z, n_total, alpha, pre.shift)
    else:
        t, _, _ = two_matrices(z, n_total, alpha, pre.shift)
        s_diag = (t @ t.T / m).diagonal().mean() + alpha / n_total
        _, apply, apply_t = two_matrices(z, n_total, alpha, pre.shift, float(torch.finfo(f64).eps * s_diag))
        assert rel(base.apply(g), pre.apply(g)) < 1e-6  # the shift eps * mean diagonal is below rounding
    assert rel(pre.apply(g), apply(g)) < 1e-12 and rel(pre.apply_t(g), apply_t(g)) < 1e-12


def test_preconditioner_holds_one_matrix():
    m = 120
    pre = solver_nystrom.FalkonPreconditioner(KERNEL, centres(m, dtype=torch.float32), 500, 0.1)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in vars(pre).values() if isinstance(t, torch.Tensor)}
    assert sum(held.values()) == 8 * m * m + 16 * m  # the buffer and the two diagonals
    assert solver_nystrom.build_bytes(20000) - 8 * 20000**2 < 0.2e9  # the build's blocks at m = 20 000


def test_fit_equals_dense_nystrom_solution():
    g = torch.Generator().manual_seed(6)
    n, m, alpha = 1500, 100, 0.5
    x = torch.rand(n, 3, dtype=f64, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, :1]) + 0.1 * torch.randn(n, 1, dtype=f64, generator=g)
    est = KernelRidge("gaussian_l2", bandwidth=0.5, alpha=alpha, solver="nystrom", n_centers=m, tol=1e-11,
                      random_state=0).fit(x, y)
    kernel = solver_kernel.resolve_kernel("gaussian_l2", 0.5, None)
    z = est.centers_
    kzn = kernel.matrix(z, x)
    kzz = kernel.matrix(z, z) + torch.finfo(f64).eps * m * torch.eye(m, dtype=f64)  # T^T T, float64 data
    beta = torch.linalg.solve(kzn @ kzn.T + alpha * kzz, kzn @ y)  # condition number ~7e7
    xt = torch.rand(200, 3, dtype=f64, generator=g) * 2 - 1
    assert rel(est.predict(xt), kernel.matrix(xt, z) @ beta) < 1e-8  # 6e-11 (and before one buffer)
