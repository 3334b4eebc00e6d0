"""One K = 264 call of distance_wgmma_kernel (l2, Tf32x3, 2 x 131 x 300: every stage ring
wraps) in a given cluster size, for compute-sanitizer racecheck: does the report on the
stage reuse (consumers' ldmatrix reads vs the loader's next cp.async writes) depend on the
cluster's remote mbarrier arrivals?

    compute-sanitizer --tool racecheck --report-api-errors no python3 bench/probes/racecheck_wgmma_cluster.py wgmma
    ... racecheck_wgmma_cluster.py wgmma-c1      # the same kernel with kClusterM = 1
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import try_wgmma as tw  # noqa: E402

try:
    from cuda.core import Device
except ImportError:
    from cuda.core.experimental import Device

tw.DEV = Device(torch.cuda.current_device())  # what try_wgmma's main() sets up
tw.DEV.set_current()
tw.STREAM = tw.torch_stream()
variant = sys.argv[1] if len(sys.argv) > 1 else "wgmma"
cfg = ("Diff", "Sqrt", "None", "RowMajor", "Tf32x3")
g = torch.Generator(device="cuda").manual_seed(3)
a = tw.padded(torch.randn(2, 131, 264, device="cuda", generator=g))
b = tw.padded(torch.randn(2, 300, 264, device="cuda", generator=g))
out = torch.full((2, 131, 300), float("nan"), device="cuda")
tw.run(tw.VARIANTS[variant], cfg, a, b, out)
torch.cuda.synchronize()
ref = torch.cdist(a.double(), b.double())
err = float((out.double() - ref).norm() / ref.norm())
print(f"{variant}: relative error {err:.2e}", "ok" if err < 1e-5 else "WRONG")
