"""Public namespace of the batched cuSOLVER solvers and eigendecomposition.

The implementation (and its documentation) is :mod:`kermac_like.ops.linalg`.
"""

from .ops.linalg import LinAlgError, cache_info, cholesky_3xtf32_, eigh, solve_cholesky, solve_lu, warmup  # noqa: F401
from .ops.linalg import __all__  # noqa: F401
