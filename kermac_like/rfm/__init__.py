"""Recursive Feature Machines on the package's fused kernels: :class:`RFMRegressor`, :class:`RFMClassifier`.

    from kermac_like.rfm import RFMRegressor
    model = RFMRegressor("laplace_l2", bandwidth=10.0, reg=1e-3, iters=5).fit(X, y, eval_set=(X_val, y_val))

Kernel ridge regression that learns its own metric from the average gradient outer product
(AGOP) of its predictor, as xRFM's leaf models; the AGOP is accumulated in blocks of points by
the fused gradient contraction (:func:`agop_sum`), never as the gradient tensor; the kernel
machine is a Cholesky solve or, beyond the size that fits, Falkon.
"""

from ._agop import agop_sum, function_gradients
from ._kernel import KERNEL_NAMES, RFMKernel, resolve_rfm_kernel
from ._rfm import RFMClassifier, RFMRegressor

__all__ = ["RFMRegressor", "RFMClassifier", "agop_sum", "function_gradients", "RFMKernel", "resolve_rfm_kernel",
           "KERNEL_NAMES"]
