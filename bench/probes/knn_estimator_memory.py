"""Where NearestNeighbors.kneighbors' extra GPU memory goes at M = N = 10^6, D = 128, k = 10
(knn_multi_gpu.py measured 854 MB on one GPU against the bare knn call's 28.6 MB with out=).

Peak extra memory (torch.cuda.max_memory_allocated beyond what was allocated before) of:
knn with out=, knn without out, torch.isfinite(x).all(), NearestNeighbors.kneighbors; and the
allocations of the last one over 1 MB (torch.cuda.memory._record_memory_history).

    python bench/probes/knn_estimator_memory.py
"""
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from kermac_like import knn  # noqa: E402
from kermac_like.neighbors import NearestNeighbors  # noqa: E402

M = N = int(os.environ.get("KNN_N", 1_000_000))
D, K = 128, 10


def peak(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, r


x = torch.randn(M, D, device="cuda")
y = torch.randn(N, D, device="cuda")
v = torch.empty(M, K, device="cuda")
i = torch.empty(M, K, dtype=torch.int64, device="cuda")
knn(x, y, K, out=(v, i))  # warm-up (compiles)
nn = NearestNeighbors(n_neighbors=K).fit(y)
nn.kneighbors(x)
rows = []
rows.append(("knn(x, y, k, out=(v, i))", peak(lambda: knn(x, y, K, out=(v, i)))[0]))
rows.append(("knn(x, y, k) (outputs 120 MB)", peak(lambda: knn(x, y, K))[0]))
rows.append(("torch.isfinite(x).all()", peak(lambda: bool(torch.isfinite(x).all()))[0]))
rows.append(("NearestNeighbors.kneighbors(x)", peak(lambda: nn.kneighbors(x))[0]))
try:
    torch.cuda.memory._record_memory_history(max_entries=100000)
    nn.kneighbors(x)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    big = []
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            pass
    for ev in snap.get("device_traces", [[]])[0]:
        if ev["action"] == "alloc" and ev["size"] > 1 << 20:
            fr = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in ev.get("frames", [])
                  if "kermac_like" in f["filename"] or "neighbors" in f["filename"]][:4]
            big.append((ev["size"] / 2**20, " <- ".join(fr)))
    print("allocations over 1 MB in kneighbors:")
    for mb, where in big:
        print(f"  {mb:9.1f} MB  {where}")
except Exception as e:  # noqa: BLE001
    print("memory history not available:", e)
print(f"\n| call | peak extra GPU memory (MB) |  ({torch.cuda.get_device_name()}, M = N = {M}, D = {D}, k = {K})")
print("|---|---|")
for name, mb in rows:
    print(f"| {name} | {mb:.1f} |")
