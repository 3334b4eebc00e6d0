"""Issue #16 probe: does an m-contiguous (ColMajor) operand, which the SIMT and low-K kernels copy
with 16-byte cp.async instead of 4-byte transposing copies, make cdist p=1 faster? The profile
(bench/notes/distance.md) puts the largest non-issue stall of the K = 1024 kernel at the 4-byte
LDGSTS (lg_throttle) and half the low-K kernel's warp time in its tile loads.

    python3 bench/probes/p1_layouts.py        (GPU; table last)

Columns: row-major inputs read as they are (plan.distance._kmajor off), ColMajor inputs (x = xt.t()),
row-major inputs transposed by torch inside the timed call, and the public call (which makes
k-major copies where plan.distance._kmajor_worthwhile says so).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kermac_like as km  # noqa: E402
from _timing import time_calls  # noqa: E402
from kermac_like.plan import distance as P  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--quick", action="store_true", help="only K = 128 and K = 37")
args = parser.parse_args()
dev = torch.device("cuda")
rows = []
cases = [(30000, 1024, "cdist", 5), (20000, 256, "cdist", 10), (20000, 128, "cdist", 10), (20000, 96, "cdist", 10),
         (4096, 512, "cdist", 20), (4096, 1024, "cdist", 20), (10000, 1024, "pnorm", 5), (20000, 37, "cdist", 20)]
if args.quick:
    cases = [c for c in cases if c[1] in (128, 37)]
for M, K, op, reps in cases:
    out = torch.empty(M, M, device=dev)

    def call(x, y, op=op, out=out):
        if op == "cdist":
            return km.cdist(x, y, p=1.0, out=out)
        if op == "pnorm":
            return km.cdist(x, y, p=1.5, out=out)
        return km.run_kernel(km.preset("laplace_l2"), x, y, bandwidth=1.0, out=out)

    def pre(x, y, call=call):
        return call(x.t().contiguous().t(), y.t().contiguous().t())

    variants = {
        "row": (call, lambda: (torch.randn(M, K, device=dev), torch.randn(M, K, device=dev))),
        "col": (call, lambda: (torch.randn(K, M, device=dev).t(), torch.randn(K, M, device=dev).t())),
        "row+T": (pre, lambda: (torch.randn(M, K, device=dev), torch.randn(M, K, device=dev))),
        "public": (call, lambda: (torch.randn(M, K, device=dev), torch.randn(M, K, device=dev))),
    }
    res = {}
    for name, (fn, mk) in variants.items():
        P.clear_templates()
        limit = 1 << 62 if name == "row" else P.SHIPPED.kmajor_min_out  # "row": no k-major copies
        with P.spec_override(kmajor_min_out=limit):
            t = time_calls(fn, mk, dev, repeats=reps, warmup=2, keep_last=True)
        x, y = t.last_inputs
        pp = 1.5 if op == "pnorm" else 1.0
        ref = torch.cdist(x[:512].double(), y[:512].double(), p=pp) if op != "laplace" else \
            torch.exp(-torch.cdist(x[:512].double(), y[:512].double()))
        err = float(((out[:512, :512].double() - ref).abs().max() / ref.abs().max()))
        res[name] = (t.median_ms, err)
        print(M, K, op, name, f"{t.median_ms:.3f} ms err {err:.1e}", flush=True)
    rows.append((M, K, op, res))
    del out
    torch.cuda.empty_cache()
print("== p1_layouts (ms, median)")
print(f"{'case':<22}{'row':>10}{'col':>10}{'row+T':>10}{'public':>10}")
for M, K, op, res in rows:
    print(f"{f'{op} {M}^2 x {K}':<22}" + "".join(f"{res[n][0]:>10.3f}" for n in ("row", "col", "row+T", "public")))
