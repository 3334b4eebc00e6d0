"""Nyström preconditioners built on sampled landmarks with run_kernel and linalg.

* :class:`LandmarkNystromPreconditioner` for CG on the full system (K + alpha I) c = y:
  the randomized Nyström preconditioner of Frangella, Tropp and Udell (2021) with the
  sampled columns of K as its test matrix. With landmarks Z (m rows),
  K ~ K_nZ K_ZZ^-1 K_Zn = F F^T, F = K_nZ U^-1 (K_ZZ + delta I = U^T U). The eigenpairs of
  F F^T come from the m x m matrix S = F^T F = U^-T (K_Zn K_nZ) U^-1 = V Lambda V^T:
  F F^T = Q Lambda Q^T with Q = F V Lambda^-1/2 (N x l, orthonormal). The preconditioner
  P^-1 = (lambda_l + mu) Q (Lambda + mu)^-1 Q^T + (I - Q Q^T) (mu = alpha) applies as
  r + K_nZ (M (K_Zn r)), M = W diag((lambda_l + mu) / (Lambda + mu) - 1) W^T, W = U^-1 V Lambda^-1/2:
  two products against the m landmarks per iteration and no N x m matrix in memory.
  Building it costs one pass of K_nZ blocks (2 N m^2 flops for K_Zn K_nZ), m x m
  factorisations in float64, and one all_reduce of the m x m Gram matrix.
* :class:`FalkonPreconditioner` for the Nyström estimator (Rudi et al. 2017): with
  K_ZZ + delta I = T^T T and T T^T / m + (alpha / N) I = A^T A, B = N^-1/2 T^-1 A^-1 makes
  B^T (K_Zn K_nZ + alpha K_ZZ) B close to the identity.

Translation invariance: K_ZZ (and the landmark preconditioner's K_ZZ and K_Zn K_nZ) come from
the kernel's dense blocks, whose DIFF distances are formed from operands shifted by the
reference point of the centres z where a block takes the product formula
(solvers._kernel.SolverKernel.matrix; run_kernel's tensor cores shift by the same point), one
point for every block of a matrix. So the factorisations see K_ZZ with the error of centred data
whatever the data's offset (at 1000 x the spread the unshifted product formula loses ~eps 10^6
times the spread's square in every exponent). The products over the rows are shift invariant as
well, with no shifted copy of the rows: plan.falkon's kernels centre x and z on the centres' mean
as they load them, kernel_matvec's paths as its docstring says.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .. import linalg
from ..centring import reference_point

log = logging.getLogger("kermac_like.solvers")

__all__ = ["factor_upper", "LandmarkNystromPreconditioner", "FalkonPreconditioner", "sample_indices",
           "gather_global_rows", "build_bytes", "BLOCK_BYTES"]

# Row blocks of the Falkon preconditioner's m x m work (K_ZZ rows, T T^T) hold at most about this
# many bytes and rows: 838 float64 rows of m = 20 000.
BLOCK_BYTES = 1 << 27
BLOCK_ROWS = 1024


def sample_indices(n_total: int, m: int, seed: int) -> torch.Tensor:
    """m distinct indices of [0, n_total), sorted: a function of (n_total, m, seed) only, the same on
    every rank and for every number of ranks (the indices are global row numbers: the rows of the
    ranks' shards concatenated in rank order).

    O(m) memory and time whatever n_total (numpy's Generator.choice without replacement: Floyd's
    set sampling for m much smaller than n_total, a permutation otherwise), so that N = 10^9 does
    not build an N-element permutation on every rank.
    """
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    idx = rng.choice(int(n_total), size=int(m), replace=False, shuffle=False)
    return torch.from_numpy(np.sort(idx).astype(np.int64))


def gather_global_rows(comm, x_local: torch.Tensor, offset: int, idx: torch.Tensor, device=None) -> torch.Tensor:
    """Rows ``idx`` (global indices, rank blocks in rank order) of the distributed X, on every rank,
    on ``device`` (default: x_local's). Each rank fills the rows it holds into an (m, D) block of
    zeros and one all_reduce sums the blocks: m * D numbers move, X itself never does."""
    device = x_local.device if device is None else torch.device(device)
    if not comm.active:
        return x_local[idx.to(x_local.device)].to(device)
    n = x_local.shape[0]
    mine = (idx >= offset) & (idx < offset + n)
    pos = mine.nonzero().flatten()
    z = torch.zeros((idx.numel(), x_local.shape[1]), dtype=x_local.dtype, device=device)
    z[pos.to(device)] = x_local[(idx[mine] - offset).to(x_local.device)].to(device)
    return comm.all_reduce(z)


def factor_upper(a: torch.Tensor, *, jitter: float, what: str, rebuild=None) -> tuple[torch.Tensor, float]:
    """Upper U with a + delta I = U^T U (float64), delta = jitter * mean(diag a), raised by
    10x until the factorisation succeeds (at most 8 times). Returns (U, delta).

    Without ``rebuild`` a copy of ``a`` is factored (``a`` is kept; U has zeros below its diagonal). With
    ``rebuild`` (a callable returning a fresh ``a``), only ``a``'s upper triangle is read, it is
    overwritten with U (the strict lower triangle kept: Falkon's one-buffer preconditioner holds
    T^T there) and a retry factors ``rebuild()``: no second m x m matrix (no identity either: the
    shift goes on the diagonal in place)."""
    scale = float(a.diagonal().mean().abs()) or 1.0
    delta = jitter * scale
    dtype = a.dtype
    rhs = torch.zeros((1, a.shape[0]), dtype=a.dtype, device=a.device)
    for attempt in range(8):
        if rebuild is None:
            work = a.clone(memory_format=torch.contiguous_format)
        else:
            work = a if attempt == 0 else rebuild()
        if not work.is_contiguous():
            work = work.contiguous()
        work.diagonal().add_(delta)
        try:
            linalg.solve_cholesky(work, rhs, overwrite_a=True, check_errors=True)
            return (work.triu_() if rebuild is None else work), delta
        except torch.linalg.LinAlgError:
            log.info("%s: Cholesky failed with shift %.3e; retrying with %.3e", what, delta, max(delta * 10, 1e-300))
            delta = delta * 10 if delta > 0 else torch.finfo(dtype).eps * scale
            del work
            if rebuild is not None:
                a = None  # the overwritten a is garbage now: let it go before rebuilding
    raise torch.linalg.LinAlgError(f"{what}: not positive definite even with a diagonal shift of {delta:.3e}")


def _jitter(dtype: torch.dtype, m: int) -> float:
    return torch.finfo(dtype).eps * m


class LandmarkNystromPreconditioner:
    """P^-1 ~ (K + alpha I)^-1 from landmarks ``z`` (see the module docstring).

    Two choices keep its application accurate in float32, where the Z-coefficient basis
    (U^-1, Lambda^-1/2) amplifies rounding: the shift delta of K_ZZ is at least
    0.01 alpha m / N (K_ZZ's eigenvalue theta stands for about (N / m) theta of K, and
    directions of K below alpha do not slow CG down), and only eigenvalues of S above
    max(0.1 alpha, sqrt(eps) lambda_max) are deflated. The CG around it uses the
    flexible (Polak-Ribiere) step, which tolerates the remaining rounding of P.
    """

    def __init__(self, kernel, x_local: torch.Tensor, z: torch.Tensor, alpha: float, n_total: int, comm, *,
                 debug=False):
        self.kernel, self.x, self.z, self.comm = kernel, x_local, z, comm
        m = z.shape[0]
        mu = float(alpha)
        kzz = kernel.matrix(z, z).to(torch.float64)
        jitter = max(_jitter(x_local.dtype, m), 0.01 * mu * m / n_total)
        u, self.shift = factor_upper(kzz, jitter=jitter, what="landmark matrix K_ZZ")
        del kzz
        g = comm.all_reduce(kernel.gram_of_rows(x_local, z))  # K_Zn K_nZ, summed over ranks
        y = torch.linalg.solve_triangular(u.T, g, upper=False)  # U^-T G
        s = torch.linalg.solve_triangular(u, y, upper=True, left=False)  # U^-T G U^-1
        del g, y
        s = 0.5 * (s + s.T)
        w, v, _ = linalg.eigh(s.contiguous(), check_errors=True)
        del s
        lam_max = float(w[-1])
        cut = max(0.1 * mu, lam_max * torch.finfo(x_local.dtype).eps ** 0.5)
        keep = w > cut
        w, v = w[keep], v[:, keep]
        self.rank = int(w.numel())
        lam_l = float(w[0]) if self.rank else 0.0
        d = (lam_l + mu) / (w + mu) - 1.0
        wm = torch.linalg.solve_triangular(u, v, upper=True) / w.sqrt()  # U^-1 V Lambda^-1/2
        self.m_mat = (wm * d) @ wm.T
        self.eigenvalues = w.flip(0)
        if debug:
            log.debug("landmark Nystrom preconditioner: m=%d, rank kept %d, lambda_max=%.3e, lambda_l=%.3e, "
                      "mu=%.3e, K_ZZ shift %.3e", m, self.rank, lam_max, lam_l, mu, self.shift)

    def __call__(self, r: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            return r.clone()
        dt = self.x.dtype  # the products run in the data's dtype, r may be float64
        t = self.comm.all_reduce(self.kernel.matvec(self.z, self.x, r.to(dt)))  # K_Zn r, (m, C)
        t = (self.m_mat @ t.to(torch.float64)).to(dt)
        return r + self.kernel.matvec(self.x, self.z, t).to(r.dtype)


class FalkonPreconditioner:
    """B = N^-1/2 T^-1 A^-1 of Falkon (see the module docstring), float64, in one m x m buffer.

    Falkon's layout (falkon/preconditioner/falkon_preconditioner.py): ``w``'s upper triangle holds
    A, its strict lower triangle T^T; the two diagonals are kept as vectors and the one a triangular
    solve needs is copied onto ``w``'s diagonal first (torch.linalg.solve_triangular reads one
    triangle and the diagonal). The build holds ``w`` and row blocks of at most about BLOCK_BYTES:

    1. K_ZZ in row blocks of ``kernel.matrix`` (the data's dtype) converted into ``w``;
    2. T: K_ZZ + delta I = T^T T in place (linalg.solve_cholesky: ``w``'s upper triangle); T^T
       copied into the strict lower triangle, T's diagonal into ``dt``;
    3. T T^T / m + lambda I into the upper triangle (:func:`_lauum_upper`, blocked, from the lower
       triangle and ``dt``), factored in place: A in the upper triangle, the lower one kept.

    A failed factorisation rebuilds its input (K_ZZ, or T T^T from the lower triangle) with a
    larger shift (:func:`factor_upper`). Device bytes: 8 m^2 + 16 m + :func:`build_bytes`'s
    temporaries (and cuSOLVER's potrf workspace), against 16 m^2 + a float32 and a float64 copy
    of K_ZZ for the two-matrix build.
    """

    def __init__(self, kernel, z: torch.Tensor, n_total: int, alpha: float, *, debug=False, block_rows=None):
        m = z.shape[0]
        self.scale = n_total ** -0.5
        rows = block_rows or _block_rows(m)
        self.w = w = torch.empty((m, m), dtype=torch.float64, device=z.device)

        # One reference point for every row block of K_ZZ where kernel.matrix shifts its operands (the
        # torch path's matrix product; run_kernel's tensor cores shift by the same point, z's)
        ref = reference_point(z) if _shifts(kernel, z) else None

        def kzz():  # K_ZZ in row blocks: no m x m matrix but w
            for r0 in range(0, m, rows):
                w[r0:r0 + rows].copy_(_matrix(kernel, z[r0:r0 + rows], z, ref))
            return w

        # The shift of K_ZZ: the spectral size of its entries' rounding, eps sqrt(m), with float32/16-bit
        # data (Falkon's products run in float64 and its system takes T^T T = K_ZZ + delta I itself, so
        # delta is a ridge on beta: eps32 m, 2.4e-3 at m = 20 000, cost 8 % of test MSE at N = 10^6);
        # eps m with float64 data.
        jitter = _jitter(z.dtype, m) if z.dtype == torch.float64 else torch.finfo(z.dtype).eps * m ** 0.5
        _, self.shift = factor_upper(kzz(), jitter=jitter, what="centre matrix K_ZZ", rebuild=kzz)
        self.dt = w.diagonal().clone()
        for r0 in range(0, m, rows):  # T^T into the strict lower triangle
            r1 = min(r0 + rows, m)
            w[r1:, r0:r1].copy_(w[r0:r1, r1:].mT)
            blk = w[r0:r1, r0:r1]
            blk.copy_(torch.triu(blk) + torch.triu(blk, 1).mT)
        lam = float(alpha) / n_total

        def inner():  # T T^T / m + lambda I into the upper triangle
            _lauum_upper(w, self.dt, 1.0 / m, rows)
            w.diagonal().add_(lam)
            return w

        factor_upper(inner(), jitter=0.0, what="Falkon's T T^T / m + lambda I", rebuild=inner)
        self.da = w.diagonal().clone()
        self._on = "a"  # whose diagonal w holds
        if debug:
            log.debug("Falkon preconditioner: m=%d, lambda=%.3e, K_ZZ shift %.3e", m, lam, self.shift)

    def _diag(self, which: str) -> torch.Tensor:
        if self._on != which:
            self.w.diagonal().copy_(self.dt if which == "t" else self.da)
            self._on = which
        return self.w

    # A = triu(w) and T^T = tril(w) with their own diagonals; w.mT's upper triangle is T.
    def _a_inv(self, g):
        return torch.linalg.solve_triangular(self._diag("a"), g, upper=True)

    def _a_inv_t(self, g):
        return torch.linalg.solve_triangular(self._diag("a").mT, g, upper=False)

    def _t_inv(self, g):
        return torch.linalg.solve_triangular(self._diag("t").mT, g, upper=True)

    def _t_inv_t(self, g):
        return torch.linalg.solve_triangular(self._diag("t"), g, upper=False)

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """B g."""
        return self._t_inv(self._a_inv(g)) * self.scale

    def apply_t(self, v: torch.Tensor) -> torch.Tensor:
        """B^T v."""
        return self._a_inv_t(self._t_inv_t(v)) * self.scale

    def normal(self, g: torch.Tensor, products, alpha: float) -> torch.Tensor:
        """B^T (products(B g) + alpha T^T T B g), where T^T T = K_ZZ + delta I: Falkon's form,
        B^T T^T T B = A^-T A^-1 / N, with no product by T (four triangular solves)."""
        u = self._a_inv(g)
        p = products(self._t_inv(u) * self.scale)
        return self._a_inv_t(self._t_inv_t(p) * self.scale + (alpha * self.scale ** 2) * u)


def _shifts(kernel, z: torch.Tensor) -> bool:
    """Whether ``kernel.matrix`` shifts its operands for blocks against z (SolverKernel.shifts)."""
    shifts = getattr(kernel, "shifts", None)
    return bool(shifts is not None and shifts(z, z))


def _matrix(kernel, a: torch.Tensor, b: torch.Tensor, ref):
    return kernel.matrix(a, b) if ref is None else kernel.matrix(a, b, reference=ref)


def _block_rows(m: int) -> int:
    """Rows of the blocks of the m x m work: float64 rows of m of at most BLOCK_BYTES, at most
    BLOCK_ROWS (the rows x rows temporaries stay small for m of a few thousand)."""
    return max(1, min(m, BLOCK_ROWS, BLOCK_BYTES // (8 * max(1, m))))


def build_bytes(m: int) -> int:
    """Device bytes of the Falkon preconditioner: the m x m float64 buffer and two diagonals, plus
    the largest temporaries of its build (one m x rows float64 block and three rows x rows ones
    of :func:`_lauum_upper`; K_ZZ's float32 rows x m block comes before them). cuSOLVER's potrf
    workspace is not included."""
    b = _block_rows(m)
    return 8 * m * m + 16 * m + 8 * m * b + 24 * b * b


def _lauum_upper(w: torch.Tensor, d: torch.Tensor, scale: float, rows: int) -> None:
    """LAPACK lauum with the factor and the result in opposite triangles: the upper triangle of
    ``w`` (its diagonal included) receives scale T T^T, where T^T is ``w``'s strict lower triangle
    with the diagonal ``d``; the strict lower triangle is only read.

    Column blocks J of the result: S[:J1, J] = L[J0:, :J1]^T L[J0:, J] (L = T^T, zero above its
    diagonal) reads L below row J0 and writes above the diagonal of w (and the upper part of the
    diagonal block J, whose L part is taken from tril(w, -1) and d): the blocks are independent.
    Temporaries: a (J1, rows) block and three (rows, rows) ones."""
    m = w.shape[0]
    for j0 in range(0, m, rows):
        j1 = min(j0 + rows, m)
        blk = w[j0:j1, j0:j1]
        ljj = torch.tril(blk, -1)
        ljj.diagonal().copy_(d[j0:j1])
        out = torch.mm(w[j1:, :j1].mT, w[j1:, j0:j1])  # rows below block J
        out[:j0].addmm_(w[j0:j1, :j0].mT, ljj)
        out[j0:].addmm_(ljj.mT, ljj)
        out.mul_(scale)
        w[:j0, j0:j1].copy_(out[:j0])
        blk.copy_(torch.triu(out[j0:]) + torch.tril(blk, -1))
