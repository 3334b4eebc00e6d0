"""Where the GPU waits in one gp_step (bench/run.py's: ExactGP MLL + backward, ScaleKernel(RBF),
D = 8, float32, max_cholesky_size 0) with kermac_like's RBFKernel at N (argv[1], default 5 x 10^4):
the step's wall time (CUDA events), the GPU's busy time, and its idle time split by the innermost
labelled range open when the GPU went idle (the pivoted-Cholesky loop, the CG loop, the backward,
...), from a torch.profiler trace after one warm-up step. Also kernel_matvec's host time per call
(from its entry to its kernel's launch) inside the CG loop.

    python3 bench/probes/gp_step_timeline.py [N] [gpytorch]
"""
import bisect
import collections
import functools
import json
import os
import pathlib
import sys
import tempfile

import gpytorch
import linear_operator
import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _gp  # noqa: E402
import kermac_like.gpytorch._operator as kop  # noqa: E402
from kermac_like.gpytorch import RBFKernel  # noqa: E402

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 50_000
WHICH = sys.argv[2] if len(sys.argv) > 2 else "ours"
x, y = _gp.data(N)


def labelled(label, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    return wrapper


linear_operator.utils.linear_cg = labelled("L:linear_cg", linear_operator.utils.linear_cg)
kop._cg.linear_cg = labelled("L:linear_cg", kop._cg.linear_cg)  # the operator's own (KERMAC_LIKE_GP_CG)
kop._PivotedCholesky.forward = staticmethod(labelled("L:pivchol_fwd", kop._PivotedCholesky.forward))
kop._ShiftedQR.forward = staticmethod(labelled("L:qr_fwd", kop._ShiftedQR.forward))
LABELS = ("L:", "kermac_like::", "InvQuadLogdet", "_PivotedCholeskyBackward", "autograd::engine")


def step(kernel_cls):
    return _gp.step(kernel_cls, x, y, functools.partial(record_function, "L:forward"),
                    functools.partial(record_function, "L:backward"))


cls = RBFKernel if WHICH == "ours" else gpytorch.kernels.RBFKernel
step(cls)
torch.cuda.synchronize()
walls = []
for _ in range(3):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step(cls)
    b.record()
    b.synchronize()
    walls.append(a.elapsed_time(b))
print(f"== {WHICH} N={N}: step {sorted(walls)[1]:.1f} ms (of {', '.join(f'{w:.1f}' for w in walls)})", flush=True)

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(cls)
    torch.cuda.synchronize()
path = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(path)
ev = json.load(open(path))["traceEvents"]
gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev
             if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
cpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
       and e["name"].startswith(LABELS)]
merged = []
for s, t in gpu:
    if merged and s <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], t)
    else:
        merged.append([s, t])
fwd = [e for e in cpu if e["name"] == "L:forward"][0]
t0 = fwd["ts"]
t1 = max(merged[-1][1], max(e["ts"] + e["dur"] for e in cpu))
busy = sum(t - s for s, t in merged)
print(f"profiled step {(t1 - t0) / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, idle {(t1 - t0 - busy) / 1e3:.1f} ms")
gaps = [(t0, merged[0][0])] + [(merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
starts = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in cpu)
idle = collections.Counter()
count = collections.Counter()
for s, t in gaps:
    if t - s <= 0:
        continue
    inner = None  # innermost labelled range open at the gap's start
    for cs, ct, name in starts:
        if cs > s:
            break
        if ct >= s and (inner is None or cs >= inner[0]):
            inner = (cs, name)
    key = inner[1][:60] if inner else "(none)"
    idle[key] += t - s
    count[key] += 1
print("GPU idle by innermost open range (ms, gaps):")
for k, v in idle.most_common(14):
    print(f"  {k:60s} {v / 1e3:8.2f} ms  {count[k]:5d}")
walls_by = collections.defaultdict(list)
for e in cpu:
    walls_by[e["name"]].append(e["dur"])
print("labelled ranges (host ms total, calls):")
for k in sorted(walls_by, key=lambda k: -sum(walls_by[k]))[:14]:
    print(f"  {k[:60]:60s} {sum(walls_by[k]) / 1e3:8.2f} ms  {len(walls_by[k]):5d}")
# kernel_matvec: host time from the op's entry to its first kernel's start on the GPU timeline
mv = sorted(e["ts"] for e in cpu if e["name"] == "kermac_like::kernel_matvec")
ks = sorted(e["ts"] for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel" and "matvec_kernel" in e["name"])
lat = []
for s in mv:
    i = bisect.bisect_left(ks, s)
    if i < len(ks):
        lat.append(ks[i] - s)
if lat:
    lat.sort()
    print(f"kernel_matvec entry -> its kernel on the GPU: median {lat[len(lat) // 2] / 1e3:.3f} ms over {len(lat)} calls")
