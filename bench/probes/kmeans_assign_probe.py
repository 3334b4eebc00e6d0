"""Lloyd's assignment on tensor cores (plan.kmeans.ASSIGN_MMA, cuda_templates/kmeans_assign_mma.cuh,
issue 27) on a GPU: one assignment at N = 10^7 with the switch off (knn's SIMT kernel) and on, for
D in {8, 16, 32} x C in {256, 1024, 4096} on the bench's blob data (C Gaussian means 4 x randn, unit
noise; the centres: C of the points), and the whole fit (`bench/run.py --only kmeans`'s row: N = 10^7,
D = 16, 1024 clusters, k-means++ then 20 Lloyd iterations at tol 0) off and on. One command, < 2
minutes on an H100:

    PYTHONPATH=. python3 bench/probes/kmeans_assign_probe.py

CUDA events, medians of 5 after one warm-up call, off and on interleaved. Checks: labels equal
(count of differences, expected 0), distance bits equal, fraction of rows the certificate left to
the kernel's exact rescan; the fit: labels, centres and inertia bitwise equal off / on. The last
lines printed are one short table.

Predictions (H100 SXM, written before any measurement; bench/notes/kmeans.md, "The assignment on
mma.sync (session 13)"): one assignment, ms, off (SIMT, session 11's H200 figures) / on:
D = 8, C = 1024: 8.6 / ~3; D = 16: C = 256: 4.3 / ~1.3, C = 1024: 14.1 / ~5 (4-7), C = 4096: ~56 /
~19; D = 32, C = 1024: 28 / ~8. Uncertified rows on the blob data: < 1 %. The fit: 569 -> ~400 ms
(20 iterations 324 -> ~150 ms); torch's loop 2,039 ms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kermac_like.testing import kmeans_lloyd  # noqa: E402
from kermac_like.cluster import KMeans  # noqa: E402
from kermac_like import config  # noqa: E402
from kermac_like.plan import kmeans as plan_km  # noqa: E402
from _timing import event_ms  # noqa: E402
from _timing import interleaved as _interleaved  # noqa: E402

N = 10_000_000
SHAPES = [(16, 1024), (16, 256), (16, 4096), (8, 1024), (32, 1024), (8, 256), (8, 4096), (32, 256), (32, 4096)]
PRED = {(8, 1024): 3, (16, 256): 1.3, (16, 1024): 5, (16, 4096): 19, (32, 1024): 8}
REPS = 5


def interleaved(fn, reps=REPS):
    """{False: median ms off, True: median ms on}, {switch: last output}; one warm-up call each."""
    return _interleaved("kmeans_assign_mma", fn, reps)


def blobs(D, C, g):
    means = 4 * torch.randn(C, D, device="cuda", generator=g)
    return means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, D, device="cuda", generator=g)


def main():
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    print(torch.cuda.get_device_name(), flush=True)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for D, C in SHAPES:
        X = blobs(D, C, g)
        centres = X[torch.randperm(N, device="cuda", generator=g)[:C]].clone()
        ms, outs = interleaved(lambda X=X, centres=centres: kmeans_lloyd._assign(X, centres, False))
        (l0, d0), (l1, d1) = outs[False], outs[True]
        diff = int((l0 != l1).sum())
        same_d2 = bool(torch.equal(d0.view(torch.int64), d1.view(torch.int64)))
        with config.override(kmeans_assign_mma=True):
            cert = plan_km.plan_assign(X, centres, certificates=True).run()[2]
        unc = 1.0 - float(cert.float().mean())
        rows.append((f"assign D={D} C={C}", ms[False], ms[True], PRED.get((D, C)), f"labels differ {diff}, d2 equal "
                     f"{same_d2}, uncertified {100 * unc:.3f} %"))
        print(rows[-1], flush=True)
        X = centres = outs = l0 = d0 = l1 = d1 = cert = None
        torch.cuda.empty_cache()

    # the whole fit, the bench's data and parameters
    D, C = 16, 1024
    X = blobs(D, C, torch.Generator(device="cuda").manual_seed(1))
    fit = lambda: KMeans(C, max_iter=20, tol=0.0, random_state=0).fit(X)  # noqa: E731
    ms, outs = interleaved(fit, reps=3)
    a, b = outs[False], outs[True]
    same = (torch.equal(a.labels_, b.labels_) and torch.equal(a.cluster_centers_, b.cluster_centers_)
            and a.inertia_ == b.inertia_)
    rows.append(("fit 10^7 x 16, 1024", ms[False], ms[True], 400, f"bitwise same fit {same}"))
    print(rows[-1], flush=True)
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        from kmeans import torch_lloyd

        start = a.cluster_centers_.clone()
        t_ms, _ = event_ms(lambda: torch_lloyd(X, start, 20))
        rows.append(("torch loop, 20 iterations", t_ms, None, None, "(from the off fit's final centres)"))
    except Exception as e:  # pragma: no cover
        rows.append(("torch loop", None, None, None, f"skipped: {e}"))

    print("\n| case | off ms | on ms | predicted on | checks |\n|---|---|---|---|---|")
    for name, off, on, pred, note in rows:
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| {name} | {f(off)} | {f(on)} | {f(pred)} | {note} |")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
