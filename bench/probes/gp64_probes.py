"""Why ours and GPyTorch's RBFKernel differ by 2.6e-4 in the float64 MLL on CUDA (N = 2000, D = 8)
while they agree to 1e-16 on CPU: the same step with GPyTorch's deterministic probes, and the
plain step twice each (run-to-run spread of each side)."""
import sys

import gpytorch
import torch

sys.path.insert(0, "tests")
import test_gpytorch_gpu as t  # noqa: E402
from kermac_like.gpytorch import RBFKernel  # noqa: E402

x, y = t.data(2000, 8)
for det in (False, True):
    with gpytorch.settings.deterministic_probes(det):
        a1 = t.step(RBFKernel(ard_num_dims=8), x, y, torch.float64)
        a2 = t.step(RBFKernel(ard_num_dims=8), x, y, torch.float64)
        b1 = t.step(gpytorch.kernels.RBFKernel(ard_num_dims=8), x, y, torch.float64)
        b2 = t.step(gpytorch.kernels.RBFKernel(ard_num_dims=8), x, y, torch.float64)
    print(f"deterministic_probes={det}: ours {a1[0].item():.10f} {a2[0].item():.10f} theirs {b1[0].item():.10f} "
          f"{b2[0].item():.10f} rel(ours, theirs) mll {t.rel(a1[0], b1[0]):.2e} grad {t.rel(a1[1], b1[1]):.2e} "
          f"mean {t.rel(a1[2], b1[2]):.2e}")
xc, yc = x.cpu(), y.cpu()
c = t.step(RBFKernel(ard_num_dims=8), xc, yc, torch.float64)
print(f"cpu ours {c[0].item():.10f}")
# The preconditioner's first pivot is the argmax of the diagonal: is GPyTorch's exactly 1 on CUDA?
k = gpytorch.kernels.RBFKernel(ard_num_dims=8).to(x.device, torch.float64)
k.lengthscale = torch.full_like(k.lengthscale, 0.7)
with torch.no_grad():
    dense = k(x).to_dense()
    lazy_diag = k(x).diagonal(dim1=-2, dim2=-1)
ours_k = RBFKernel(ard_num_dims=8).to(x.device, torch.float64)
ours_k.lengthscale = torch.full_like(ours_k.lengthscale, 0.7)
with torch.no_grad():
    ours_diag = ours_k(x).diagonal(dim1=-2, dim2=-1)
for name, dg in (("gpytorch dense diag", dense.diagonal()), ("gpytorch operator diag", lazy_diag),
                 ("ours diag", ours_diag)):
    print(f"{name}: entries != 1: {int((dg != 1).sum())}, argmax {int(dg.argmax())}, min {dg.min().item():.17g}")
with gpytorch.settings.max_preconditioner_size(0), gpytorch.settings.cg_tolerance(1e-4), \
        gpytorch.settings.max_cg_iterations(2000):
    a = t.step(RBFKernel(ard_num_dims=8), x, y, torch.float64)
    b = t.step(gpytorch.kernels.RBFKernel(ard_num_dims=8), x, y, torch.float64)
print("no preconditioner, CG tol 1e-4: rel mll %.2e grad %.2e mean %.2e" % tuple(t.rel(u, v) for u, v in zip(a, b)))
