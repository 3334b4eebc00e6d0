"""linalg's first call does not wait for the GPU once linalg.warmup() has run.

Each check runs in a fresh process (the one-time work is per process): warmup, then
a ~1 s torch.cuda._sleep queued on the current stream, then the first call of one
routine; the call must return to the host long before the sleep ends.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

CHILD = r"""
import json, sys, time, torch
import kermac_like as km
dev = torch.device("cuda")
n = int(sys.argv[2])
x = torch.randn(3, n, n, device=dev, dtype=torch.float64)
a = x @ x.mT + n * torch.eye(n, device=dev, dtype=torch.float64)
b = torch.randn(3, 2, n, device=dev, dtype=torch.float64)
km.linalg.warmup(dev, sizes=(n,), dtypes=(torch.float64,))
cycles = int(1.0 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # about 1 s
torch.cuda._sleep(cycles)
t0 = time.perf_counter()
fn = getattr(km.linalg, sys.argv[1])
res = fn(a) if sys.argv[1] == "eigh" else fn(a, b)
host = time.perf_counter() - t0
torch.cuda.synchronize()
total = time.perf_counter() - t0
print("RESULT " + json.dumps({"host_s": host, "total_s": total}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("routine,n", [("solve_cholesky", 96), ("solve_lu", 96), ("eigh", 64)])
def test_first_call_after_warmup_does_not_wait_for_the_gpu(routine, n):
    pytest.importorskip("nvmath")
    r = subprocess.run([sys.executable, "-c", CHILD, routine, str(n)], capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    t = json.loads(line[0][7:])
    assert t["total_s"] > 0.5, t  # the sleep did run
    assert t["host_s"] < 0.3 * t["total_s"], t
