"""A small Nystrom fit (Falkon's products in the blocked float64 mode, cuda_templates/matvec.cuh kF32Group)
for compute-sanitizer's racecheck / synccheck / initcheck, which take too long over sanitize_calls.py's
whole matvec family (racecheck did not finish it in 200 s on an H100):

    compute-sanitizer --report-api-errors no --tool racecheck python3 bench/probes/sanitize_blocked.py
"""
import torch

from kermac_like.solvers import KernelRidge

g = torch.Generator(device="cuda").manual_seed(4)
xs = torch.rand(3001, 8, device="cuda", generator=g)
ys = torch.sin(4 * xs).sum(1, keepdim=True)
m = KernelRidge(kernel="gaussian_l2", bandwidth=1.5, alpha=1e-3, solver="nystrom", n_centers=200, random_state=0,
                max_iter=3).fit(xs, ys)
print("mse", float((m.predict(xs) - ys).square().mean()))
