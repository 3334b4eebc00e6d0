"""The two p = 1 calls issue #16 still misses, for a profiler (Nsight Compute):
cdist p=1 at 20000^2 x 37 (low-K kernel) and 30000^2 x 1024 (SIMT kernel), out given, three
calls each (the first compiles / warms up).

    ncu --kernel-name regex:"distance_(lowk_)?kernel" --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis python3 bench/probes/profile_p1.py lowk|simt
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kermac_like as km  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "lowk"
M, K = (20000, 37) if which == "lowk" else (30000, 1024)
x = torch.randn(M, K, device="cuda")
y = torch.randn(M, K, device="cuda")
out = torch.empty(M, M, device="cuda")
for _ in range(3):
    km.cdist(x, y, p=1.0, out=out)
torch.cuda.synchronize()
print(which, "done")
