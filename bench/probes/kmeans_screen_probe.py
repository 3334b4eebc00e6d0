"""The bf16 screen of the k-means++ seeding (plan.kmeans.SCREEN, issue 27) on a GPU: the seeding
alone with the switch off and on, and the whole fit (`bench/run.py --only kmeans`'s row: N = 10^7,
D = 16, 1024 clusters around 4 x randn means, float32, k-means++ then 20 Lloyd iterations at
tol 0), asserting bitwise-equal centres (and indices) between off and on. One command, < 2 minutes
on an H100 (about 30 s of timed work, plus two NVRTC compiles):

    PYTHONPATH=. python3 bench/probes/kmeans_screen_probe.py

CUDA events on the current stream, medians after one warm-up call. The last lines printed are one
short table.

Prediction (H100 SXM, written before any measurement; bench/notes/kmeans.md, "The bf16 screen"):

| | off | on | reasoning |
|---|---|---|---|
| seeding, blobs (the bench data) | 244 ms (session 12) | **~95 ms** (80-130) | per centre, per point: 8 B (near, d2) + 45 % triangle candidates x 32 B of bf16 row + 0.67 % x 64 B float32 row ~ 23 B -> 228 MB ~ 76 us at ~3 TB/s, + ~12 us draw and launch gap; 1024 centres |
| seeding, Gaussian 16-D | ~350-400 ms | ~150 ms | ~100 % candidates: off, 16 scalar strided loads per row (~8 L1 wavefronts a point); on, 40 B a point -> ~135 us + 12 us a centre |
| fit (bench row) | 569 ms | **~420 ms** | 569 - 244 + ~95; torch loop 2,039 ms -> ~4.9x (the 20 Lloyd iterations, 324 ms, are left) |

Why the off column is 244 ms and not the 0.12 s that bytes alone give (45 % of rows read: 37 B a
point, 366 MB a centre): the update reads a candidate's row as 16 scalar 4-byte loads at a 64-byte
stride (the kernel takes any strides), so each warp-wide load touches 16 cache lines: ~8 L1
wavefronts a candidate, plus ~0.8 a point for the cc[near] gather; ~4.4 a point at 45 %
candidates -> ~190 us a centre on 132 SMs, the measured ~238 us with the draw. The screen reads
the 32-byte bf16 row as two 16-byte vectors (0.5 wavefronts a candidate), so L1 (~52 us) falls
below DRAM (~76 us). Falsified if the screen's seeding is above ~130 ms on the bench data.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kermac_like.cluster import KMeans, kmeans_plusplus  # noqa: E402
from kermac_like.plan import kmeans as plan_km  # noqa: E402
from _timing import event_ms  # noqa: E402

N, D, C, ITERS = 10_000_000, 16, 1024, 20
PRED = {"seed_blobs": (244, 95), "seed_gauss": (375, 150), "fit": (569, 420)}


def timed(fn, reps):
    """(median ms after one warm-up call, last output)."""
    out, times = fn(), []
    for _ in range(reps):
        ms, out = event_ms(fn)
        times.append(ms)
    return statistics.median(times), out


def main():
    assert torch.cuda.is_available()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    means = 4 * torch.randn(C, D, device=dev, generator=g)
    blobs = means[torch.randint(0, C, (N,), device=dev, generator=g)] + torch.randn(N, D, device=dev, generator=g)
    gauss = torch.randn(N, D, device=dev, generator=g)
    print(torch.cuda.get_device_name(dev), f"N={N} D={D} C={C}", flush=True)
    rows = []

    def seed(X):
        return kmeans_plusplus(X, C, None, torch.Generator(device=dev).manual_seed(0))

    for name, X in (("seed_blobs", blobs), ("seed_gauss", gauss)):
        res = {}
        for on in (False, True):
            plan_km.SCREEN = on
            ms, (c, idx) = timed(lambda: seed(X), 3)
            res[on] = (ms, c, idx)
            print(f"{name} screen={on}: {ms:.1f} ms", flush=True)
        assert torch.equal(res[False][2], res[True][2]), "indices differ"
        assert torch.equal(res[False][1].view(torch.int32), res[True][1].view(torch.int32)), "centres differ"
        rows.append((name, res[False][0], res[True][0]))

    res = {}
    for on in (False, True):
        plan_km.SCREEN = on
        ms, m = timed(lambda: KMeans(C, max_iter=ITERS, tol=0.0, random_state=0).fit(blobs), 2)
        res[on] = (ms, m.cluster_centers_, m.labels_)
        print(f"fit screen={on}: {ms:.1f} ms", flush=True)
    assert torch.equal(res[False][1].view(torch.int32), res[True][1].view(torch.int32)), "fitted centres differ"
    assert torch.equal(res[False][2], res[True][2]), "labels differ"
    rows.append(("fit", res[False][0], res[True][0]))
    plan_km.SCREEN = False

    print("\n| ms | screen off | screen on | off / on | predicted off / on |")
    print("|---|---|---|---|---|")
    for name, off, on in rows:
        p_off, p_on = PRED[name]
        print(f"| {name} | {off:.1f} | {on:.1f} | {off / on:.2f}x | {p_off} / {p_on} |")
    print("bitwise: seeding indices and centres equal off/on (blobs, Gaussian); fit centres and labels equal")


if __name__ == "__main__":
    main()
