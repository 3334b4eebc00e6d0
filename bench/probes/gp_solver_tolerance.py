"""How far ours is from GPyTorch's own RBFKernel in one gp_step (bench/run.py's: ScaleKernel(RBF), D = 8,
float32, max_cholesky_size 0, the same probe vectors), at GPyTorch's CG tolerance (1) and at a tight one
(0.01): the MLL and the raw-lengthscale gradient, relative differences; and ours against ours with the
package's switches off (KERMAC_LIKE_GP_TC, _SYMGRAD, _CG = 0: kernel_matvec products, two contraction passes,
linear_operator's linear_cg). A difference that shrinks with the tolerance is the solver's, not the kernels'.

    python3 bench/probes/gp_solver_tolerance.py [N]      (default 2 x 10^4)
"""
import contextlib
import os
import pathlib
import sys

import gpytorch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _gp  # noqa: E402
from kermac_like.gpytorch import RBFKernel  # noqa: E402

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 20_000
x, y = _gp.data(N)


def step(kernel_cls, tol):
    """(MLL, raw-lengthscale gradient) of _gp's step, at CG tolerance ``tol`` (None: GPyTorch's)."""
    def settings():
        ctx = contextlib.ExitStack()
        if tol is not None:
            ctx.enter_context(gpytorch.settings.cg_tolerance(tol))
            ctx.enter_context(gpytorch.settings.max_cg_iterations(2000))
        return ctx

    loss, model = _gp.model_step(kernel_cls, x, y, settings)
    return -float(loss), model.covar_module.base_kernel.raw_lengthscale.grad.detach().clone()


def rel(a, b):
    return abs(a - b) / abs(b) if isinstance(a, float) else float((a - b).norm() / b.norm())


for tol in (None, 0.01):
    theirs = step(gpytorch.kernels.RBFKernel, tol)
    ours = step(RBFKernel, tol)
    print(f"N={N} cg_tolerance {'default (1)' if tol is None else tol}: MLL ours {ours[0]:.6f} GPyTorch {theirs[0]:.6f} "
          f"(rel {rel(ours[0], theirs[0]):.1e}); raw-lengthscale gradient rel {rel(ours[1], theirs[1]):.1e}", flush=True)
    for switch in ("KERMAC_LIKE_GP_TC", "KERMAC_LIKE_GP_SYMGRAD", "KERMAC_LIKE_GP_CG"):
        os.environ[switch] = "0"
        off = step(RBFKernel, tol)
        del os.environ[switch]
        print(f"    ours vs ours with {switch}=0: MLL rel {rel(ours[0], off[0]):.1e}, gradient rel "
              f"{rel(ours[1], off[1]):.1e}", flush=True)
