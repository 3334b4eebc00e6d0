"""Where one gp_step (bench/run.py's: ExactGP MLL + backward, ScaleKernel(RBF), D = 8, float32,
max_cholesky_size 0) spends its time at N (argv[1], default 5 x 10^4) with kermac_like's RBFKernel
and with GPyTorch's own: torch.profiler tables (CUDA time by kernel, CPU time by op) and the wall
time of each step (CUDA events), after one warm-up step of each.

    python3 bench/probes/gp_step_ops.py [N]
"""
import pathlib
import sys

import gpytorch
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _gp  # noqa: E402
from kermac_like.gpytorch import RBFKernel  # noqa: E402

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 50_000
x, y = _gp.data(N)


def step(kernel_cls):
    return float(_gp.step(kernel_cls, x, y))


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
