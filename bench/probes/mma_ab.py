"""cdist p = 2 on the mma.sync kernel (KERMAC_LIKE_WGMMA=0), timed with CUDA events: run once per
package tree (PYTHONPATH) to compare two versions of distance_mma.cuh on the same GPU.

    KERMAC_LIKE_WGMMA=0 PYTHONPATH=old python3 bench/probes/mma_ab.py old
    KERMAC_LIKE_WGMMA=0 PYTHONPATH=new python3 bench/probes/mma_ab.py new
"""

import statistics
import sys

import torch

import kermac_like as km

label = sys.argv[1] if len(sys.argv) > 1 else "?"
x = torch.randn(30000, 1024, device="cuda")
y = torch.randn(30000, 1024, device="cuda")
ref = torch.cdist(x[:64].double(), y.double())
for _ in range(2):
    out = km.cdist(x, y)
torch.cuda.synchronize()
err = ((out[:64].double() - ref).norm() / ref.norm()).item()
ts = []
for _ in range(7):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    km.cdist(x, y, out=out)
    e.record()
    e.synchronize()
    ts.append(s.elapsed_time(e))
print(f"mma cdist p=2 30000^2 x 1024 [{label}] ({km.__file__}): median {statistics.median(ts):.2f} ms "
      f"(min {min(ts):.2f}), error {err:.1e}")
