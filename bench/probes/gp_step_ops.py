"""Where one gp_step (bench/run.py's: ExactGP MLL + backward, ScaleKernel(RBF), D = 8, float32,
max_cholesky_size 0) spends its time at N (argv[1], default 5 x 10^4) with kermac_like's RBFKernel
and with GPyTorch's own: torch.profiler tables (CUDA time by kernel, CPU time by op) and the wall
time of each step (CUDA events), after one warm-up step of each.

    python3 bench/probes/gp_step_ops.py [N]
"""
import sys

import gpytorch
import torch
from torch.profiler import ProfilerActivity, profile

from kermac_like.gpytorch import RBFKernel, ScaledExactGP

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 50_000
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
x = torch.rand(N, 8, device=dev, generator=g) * 2 - 1
y = torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(N, device=dev, generator=g)


def step(kernel_cls):
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(dev)
    model = ScaledExactGP(x, y, likelihood, kernel_cls()).to(dev)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    model.train()
    likelihood.train()
    torch.manual_seed(0)
    with gpytorch.settings.max_cholesky_size(0):
        loss = -mll(model(x), y)
        loss.backward()
    return float(loss)


for name, cls in (("ours", RBFKernel), ("gpytorch", gpytorch.kernels.RBFKernel)):
    step(cls)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step(cls)
    b.record()
    b.synchronize()
    print(f"== {name}: step {a.elapsed_time(b):.1f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(cls)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
