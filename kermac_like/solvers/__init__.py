"""Solvers of kernel methods on the package's kernels: :class:`KernelRidge`.

    from kermac_like.solvers import KernelRidge
    model = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=1e-3, solver="cg").fit(X, y)

cholesky (dense, exact), cg (Nyström-preconditioned conjugate gradients without the
matrix), nystrom (Falkon), auto; one GPU or many through torch.distributed.
"""

from .kernel_ridge import ConvergenceWarning, KernelRidge

__all__ = ["KernelRidge", "ConvergenceWarning"]
