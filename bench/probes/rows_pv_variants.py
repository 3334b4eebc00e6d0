"""rows_pv (GPyTorch's CG products, falkon_mma.cuh falkon_rows_pv_kernel) in template variants at gp_step's
size: N x N, D = 8, C columns (default 11), Gaussian at bandwidth 1 on x / 0.4; time (CUDA events, median of
9 after a warm-up) and the worst error on 512 rows against float64, relative to sum_j |k v| of the row.

    PYTHONPATH=. python3 bench/probes/rows_pv_variants.py [N] [C] [TRAITS_TAIL ...]
TRAITS_TAIL: the template arguments after <kK, kNq, (e.g. "4" for kFlush 4); none = the shipped traits.
"""
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _timing import event_ms  # noqa: E402
from kermac_like.plan.falkon import FalkonProducts  # noqa: E402
from kermac_like.runtime.specs import falkon as specs  # noqa: E402

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 50_000
C = int(sys.argv[2]) if len(sys.argv) > 2 else 11
tails = sys.argv[3:] or [""]
shipped = specs._pv_traits
g = torch.Generator(device="cuda").manual_seed(0)
x = (torch.rand(N, 8, device="cuda", generator=g) * 2 - 1) / 0.4
v = torch.randn(N, C, device="cuda", generator=g)
k64 = torch.exp(-torch.cdist(x[:512].double(), x.double()).square() / 2)
ref, mag = k64 @ v.double(), k64 @ v.double().abs()
for tail in tails:
    specs._pv_traits = (lambda kK, nq, _t=tail: shipped(kK, nq)[:-1] + f", {_t}>") if tail else shipped
    fp = FalkonProducts(x, 1.0, columns="pv")
    fp.rows_pv(x, v)
    t = statistics.median(event_ms(lambda: fp.rows_pv(x, v))[0] for _ in range(9))
    err = float(((fp.rows_pv(x, v)[:512] - ref).abs() / mag).max())
    print(f"rows_pv N={N} C={C} traits {specs._pv_traits(8, 2)}: {t:.3f} ms, max err / sum|kv| {err:.2e}", flush=True)
specs._pv_traits = shipped
