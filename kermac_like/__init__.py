"""kermac_like: fused, JIT-compiled CUDA kernels for kernel methods, for PyTorch.

Public API::

    cdist(x1, x2, p=2.0, *, out=None, skip_epilogue=False, compute_mode=..., autotune=None, debug=False)
    run_kernel(descriptor, a, b, *, out=None, p=None, inner_p=None, outer_p=None, bandwidth=None,
               regularization=None, regularization_offset_x=0, regularization_offset_y=0,
               epsilon=None, autotune=None, debug=False)
    cdist_grad(a, b, c, d, *, out=None, p=2.0, debug=False)
    kernel_matvec(descriptor, x, y, v, *, out=None, <run_kernel's hyper-parameters>, debug=False)
    kernel_topk(descriptor, x, y, k, *, largest=None, out=None, <run_kernel's hyper-parameters>, debug=False)
    knn(x, y, k, *, p=2.0, largest=False, out=None, compute_mode=..., debug=False)
    kernel_logsumexp(descriptor, x, y, log_weights=None, *, out=None, <hyper-parameters>, debug=False)
    precompile(descriptors, device=None, debug=False)
    KernelOperator(descriptor, x, y, **hyper)   lazy kernel matrix: shape, @, .T, diagonal(), to_dense()
    KernelDescriptor, InnerOperator, PowerType, KernelType, PRESETS, preset
    matern / rational_quadratic / powered_exponential / cauchy / inverse_multiquadric / additive /
    periodic / polynomial / kernel_expression   formula kernels (FormulaDescriptor; the torch path)
    linalg.solve_cholesky / solve_lu / eigh
    solvers.KernelRidge (kernel ridge regression: cholesky, Nystrom-preconditioned cg, Falkon; multi-GPU;
                         a scikit-learn estimator)
    gpytorch.RBFKernel / MaternKernel (GPyTorch kernels whose covariance never stores the matrix; needs
                         the [gpytorch] extra, imported on first use)
    neighbors.NearestNeighbors / KNeighborsClassifier / KNeighborsRegressor (scikit-learn's, multi-GPU)
    cluster.KMeans (scikit-learn's Lloyd k-means: knn(X, centres, 1) assignments, deterministic updates)
    rfm.RFMRegressor / RFMClassifier (Recursive Feature Machines: the AGOP in blocks through cdist_grad,
                         Cholesky or Falkon per iteration; scikit-learn estimators)
"""

from ._version import __version__

try:  # the kernel store and launcher; imported up front so a first call pays no import
    import cuda.core  # noqa: F401
except ImportError:  # CPU-only use still works through the torch path (torch_path.py)
    pass
else:  # and so is the store with the cache's warm-start reader (sqlite3): a few ms here
    import importlib as _importlib

    # the keys' inputs and the cache connection, prepared while the program makes its tensors
    _importlib.import_module(".runtime.store", __name__).prepare_in_background()
from .descriptor import PRESETS, InnerOperator, KernelDescriptor, KernelType, PowerType, preset
from .formula import (
    FormulaDescriptor,
    additive,
    cauchy,
    inverse_multiquadric,
    kernel_expression,
    matern,
    periodic,
    polynomial,
    powered_exponential,
    rational_quadratic,
)
from .ops.distance import cdist, run_kernel
from .ops.grad import cdist_grad
from .ops.knn import kernel_topk, knn
from .ops.logsumexp import kernel_logsumexp
from .ops.matvec import kernel_matvec
from .operator import KernelOperator
from .runtime.precompile import precompile

__all__ = [
    "__version__",
    "cdist",
    "run_kernel",
    "KernelOperator",
    "cdist_grad",
    "kernel_matvec",
    "kernel_topk",
    "knn",
    "kernel_logsumexp",
    "precompile",
    "KernelDescriptor",
    "InnerOperator",
    "PowerType",
    "KernelType",
    "PRESETS",
    "preset",
    "FormulaDescriptor",
    "matern",
    "rational_quadratic",
    "powered_exponential",
    "cauchy",
    "inverse_multiquadric",
    "additive",
    "periodic",
    "polynomial",
    "kernel_expression",
    "linalg",
    "solvers",
    "neighbors",
    "cluster",
    "gpytorch",
    "rfm",
]


def __getattr__(name):
    # Submodules with heavier imports load on first use.
    if name in ("linalg", "solvers", "neighbors", "cluster", "gpytorch", "rfm"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'kermac_like' has no attribute {name!r}")
