"""kernel_matvec's internal entry points under one stable name (the op lives in
:mod:`kermac_like.ops.matvec`, its planning in :mod:`kermac_like.plan`, its torch path in
:mod:`kermac_like.reference`): what the backward, KernelOperator and the solvers build on.

    call = prepare_matvec(descriptor, x, y, v, **hyper_parameters)   # validation
    out  = matvec_forward(call, out=None)                            # no autograd
    call.transposed(w), call.with_v(w)                               # K^T w, K w
"""

from .ops.matvec import SCRATCH_BYTES, MatvecCall, kernel_matvec, matvec_forward, prepare_matvec
from .reference import matvec_reference

__all__ = ["kernel_matvec", "MatvecCall", "prepare_matvec", "matvec_forward", "matvec_reference", "SCRATCH_BYTES"]
