"""KernelRidge on two GPUs through NCCL (torchrun) equals one process (needs two GPUs of
compute capability 8.0+; skipped otherwise). The CPU/gloo counterpart is in test_solvers.py."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["KRR_ROOT"])
from kermac_like.solvers import KernelRidge
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", device_id=torch.device("cuda", local))
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
x = torch.rand(20001, 8, generator=g) * 2 - 1
y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(20001, generator=g)
xt = torch.rand(500, 8, generator=g) * 2 - 1
rows = torch.arange(20001).chunk(world)[rank]
out = {}
for solver, kw in [("cholesky", {}), ("cg", dict(n_landmarks=1000)), ("nystrom", dict(n_centers=2000))]:
    m = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=1.0, solver=solver, tol=1e-6, random_state=0, **kw)
    m.fit(x[rows].cuda(), y[rows].cuda())
    out[solver] = (m.predict(xt.cuda()).cpu(), m.n_iter_)
try:
    KernelRidge("gaussian_l2", bandwidth=1.0, alpha=1.0, solver="cg").fit(
        x[rows].cuda(), y[rows][: 5 if rank else None].cuda())
except ValueError as e:
    out["error"] = str(e)
if rank == 0:
    torch.save(out, os.environ["KRR_OUT"])
dist.destroy_process_group()
'''


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_gpus_match_one(tmp_path):
    from kermac_like.solvers import KernelRidge

    script = tmp_path / "krr_nccl.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, KRR_ROOT=ROOT, KRR_OUT=str(tmp_path / "out.pt"), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["error"].startswith("y: has 5 rows but X has 10000 (on rank 1)"), out["error"]
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20001, 8, generator=g) * 2 - 1
    y = torch.sin(2 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(20001, generator=g)
    xt = torch.rand(500, 8, generator=g) * 2 - 1
    for solver, kw in [("cholesky", {}), ("cg", dict(n_landmarks=1000)), ("nystrom", dict(n_centers=2000))]:
        m = KernelRidge("gaussian_l2", bandwidth=1.0, alpha=1.0, solver=solver, tol=1e-6, random_state=0, **kw)
        ref = m.fit(x.cuda(), y.cuda()).predict(xt.cuda()).cpu()
        two, _ = out[solver]
        err = float((two - ref).norm() / ref.norm())
        assert err < (1e-5 if solver == "cholesky" else 1e-4), (solver, err)
