"""KMeans on data as it comes (issue 42): KMeans(C, max_iter=20, tol=0, random_state=0).fit at N x D per data
family, on a GPU (or on the CPU at tiny sizes, to check the script).

Per family: the fit's time (median of --reps after a warm-up; CUDA-synchronised wall clock), split into the
seeding (cluster._kmeans.kmeans_plusplus), Lloyd's iterations (cluster._kmeans.lloyd) and the rest (reference point, centring
copy, checks); the points each pruned step sent to the tensor-core kernel (BoundedAssign's work list) and the
share of rows the certificate leaves to the kernel's exact rescan in one full assignment at the seeding's and
at the final centres (about the fit's reference point, as the fit sees them); the fit's ratio to the bench
family's; and, unless --no-torch, the same fit with every fused path off (KERMAC_LIKE_KMEANS_FUSED, _SEGSUM,
_ASSIGN_MMA, _BOUNDS as 0: the torch seeding and knn's SIMT argmin), its time, whether its centres are ours
bitwise, and the share of equal labels on a sample of --sample rows. Families (N x D):

  bench         bench/run.py's kmeans data: 4 x randn(C, D) means, a mean per row at random + randn
  blobs_wide    8 unit blobs at 4 x randint(0, 8) per coordinate (all positive: issue 42's slow case)
  blobs_centred the same minus its column means
  shifted100    the bench data + 100 x its spread (its mean column std)
  relu          max(randn, 0): half the entries exactly 0
  pixels        integers 0..255, 0 with probability 0.7 (ties), 10 % of the rows copies of others

GPU (one H200, ~2 minutes: 6 families x 4 fits of ~0.15-0.5 s, one torch-path fit of ~2-4 s each, compiles):

    PYTHONPATH=. python3 bench/probes/kmeans_zoo_probe.py
    PYTHONPATH=. python3 bench/probes/kmeans_zoo_probe.py --local 0 --no-torch   # the global certificate's fits

CPU check (seconds): PYTHONPATH=. python3 bench/probes/kmeans_zoo_probe.py -n 20000 --clusters 32 --reps 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kermac_like import cluster, config  # noqa: E402
from kermac_like.testing import kmeans_estimator  # noqa: E402
from kermac_like.plan import kmeans as plan_km  # noqa: E402

SWITCHES = ("kmeans_fused", "kmeans_segsum", "kmeans_assign_mma", "kmeans_bounds")  # off: the torch path


def families(n, d, C, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    randint = lambda hi, *s: torch.randint(0, hi, s, device=device, generator=g)  # noqa: E731
    means = 4 * randn(C, d)
    bench = means[randint(C, n)] + randn(n, d)
    yield "bench", bench
    centres = 4.0 * randint(8, 8, d).float()
    wide = randn(n, d) + centres[randint(8, n)]
    yield "blobs_wide", wide
    yield "blobs_centred", wide - wide.mean(0)
    del wide
    yield "shifted100", bench + 100.0 * float(bench.std(0).mean())
    del bench
    yield "relu", randn(n, d).clamp_min_(0)
    u = n - n // 10
    px = randint(256, u, d).float().masked_fill_(torch.rand(u, d, device=device, generator=g) < 0.7, 0.0)
    yield "pixels", px[torch.cat([torch.arange(u, device=device), randint(u, n - u)])[torch.randperm(n, device=device,
                                                                                                    generator=g)]]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timed:
    """The estimator's kmeans_plusplus and lloyd (cluster._kmeans's names) wrapped with synchronised timers;
    BoundedAssign.step with a record of its work list's length."""

    def __init__(self, device):
        self.device, self.parts, self.assigned = device, {}, []
        self.saved = [(kmeans_estimator, "kmeans_plusplus"), (kmeans_estimator, "lloyd"), (plan_km.BoundedAssign, "step")]
        self.saved = [(o, a, getattr(o, a)) for o, a in self.saved]
        for owner, name, fn in self.saved[:2]:
            setattr(owner, name, self._timer(name, fn))
        step = self.saved[2][2]

        def spy(ba, centres):
            out = step(ba, centres)
            self.assigned.append(ba.assigned)
            return out
        plan_km.BoundedAssign.step = spy

    def _timer(self, name, fn):
        def timed(*a, **k):
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync(self.device)
            self.parts[name] = self.parts.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
            if name == "kmeans_plusplus":
                self.start = out[0]
            return out
        return timed

    def restore(self):
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)


def fit_ms(X, C, iters, device):
    sync(device)
    t0 = time.perf_counter()
    m = cluster.KMeans(C, max_iter=iters, tol=0.0, random_state=0).fit(X)
    sync(device)
    return (time.perf_counter() - t0) * 1e3, m


def uncertified(X, ref, centres):
    """Shares of rows the certificate leaves to the rescan in one full assignment (None: not on this device):
    (global: B about the reference point, rows in order; local: about each CTA's reference centre, rows
    ordered by their labels, the labels of the global assignment as the old ones)."""
    if not plan_km.assign_serves(X, centres) or X.shape[1] > plan_km.ASSIGN_UP_TO:
        return None, None
    Xc = X if ref is None else X - ref
    c = centres.contiguous()
    labels, _, cert = plan_km.plan_assign(Xc, c, certificates=True).run()
    glob = 1.0 - float(cert.float().mean())
    rows = torch.sort(labels, stable=True).indices.int()
    old = labels.clone()
    _, _, cert = plan_km.plan_assign(Xc, c, certificates=True, rows=rows, n_rows=Xc.shape[0], labels=old,
                                     local=True).run()
    if not torch.equal(old, labels):
        raise AssertionError("local certificate: labels differ from the global assignment's")
    return glob, 1.0 - float(cert.float().mean())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10_000_000)
    ap.add_argument("-d", type=int, default=16)
    ap.add_argument("--clusters", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sample", type=int, default=1 << 16, help="rows whose labels are compared with the torch path")
    ap.add_argument("--only", nargs="*", help="families to run (default: all)")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch-path fit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local", choices=("auto", "on", "off", "0", "1"), default=None,
                    help="the setting kmeans_local for the fits (the local certificate; default: the environment's)")
    args = ap.parse_args()
    if args.local is not None:
        os.environ["KERMAC_LIKE_KMEANS_LOCAL"] = str(args.local)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    N, D, C = args.n, args.d, args.clusters
    print(f"{device} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}: N={N} D={D} clusters={C} "
          f"iterations={args.iters} tol=0, median of {args.reps} after a warm-up")
    rows, base = [], None
    for name, X in families(N, D, C, args.seed, device):
        if args.only and name not in args.only:
            continue
        X = X.contiguous()
        fit_ms(X, C, args.iters, device)  # warm-up (compiles on a first call)
        times, parts, steps = [], [], []
        for _ in range(args.reps):
            timer = Timed(device)
            try:
                ms, m = fit_ms(X, C, args.iters, device)
            finally:
                timer.restore()
            times.append(ms)
            parts.append(timer.parts)
            steps = timer.assigned
        med = statistics.median(times)
        seed_ms = statistics.median(p.get("kmeans_plusplus", 0.0) for p in parts)
        lloyd_ms = statistics.median(p.get("lloyd", 0.0) for p in parts)
        ref = None if getattr(m, "_centring", None) is None else m._centring[0]
        final = m.cluster_centers_ if ref is None else m._centring[1]
        (unc0, loc0), (unc1, loc1) = uncertified(X, ref, timer.start), uncertified(X, ref, final)
        base = med if name == "bench" else base
        ratio = f" ({med / base:5.2f}x bench)" if base else ""
        line = (f"{name:14s} fit {med:8.1f} ms{ratio} | seeding {seed_ms:7.1f} | Lloyd "
                f"{lloyd_ms:7.1f} | rest {med - seed_ms - lloyd_ms:6.1f} | reference point "
                f"{'0 (no copy)' if ref is None else 'shifted'}")
        if unc0 is not None:
            line += (f" | uncertified at start {unc0:.3f} (local {loc0:.4f}), at end {unc1:.3f} (local {loc1:.4f})"
                     f" | kmeans_local={config.get('kmeans_local')}")
        print(line)
        if steps:
            print(f"{'':14s} points per pruned step (of {N}): {steps}; sum {sum(steps) / N:.2f} N")
        if not args.no_torch:
            with config.override(**dict.fromkeys(SWITCHES, False)):
                t_ms, t = fit_ms(X, C, args.iters, device)
            pick = torch.Generator(device=device).manual_seed(1)
            idx = torch.randperm(N, device=device, generator=pick)[:args.sample]
            same_c = torch.equal(t.cluster_centers_, m.cluster_centers_)
            agree = float((t.labels_[idx] == m.labels_[idx]).float().mean())
            print(f"{'':14s} torch path {t_ms:8.1f} ms: centres {'bitwise equal' if same_c else 'differ'} "
                  f"(max |diff| {float((t.cluster_centers_ - m.cluster_centers_).abs().max()):.3g}), labels equal "
                  f"on {agree:.5f} of {idx.numel()} sampled rows, inertia ratio {m.inertia_ / t.inertia_:.7f}")
        rows.append((name, med))
        del X
    print("\n| family | fit ms | x bench |\n|---|---|---|")
    for name, med in rows:
        print(f"| {name} | {med:.1f} | {med / base:.2f} |" if base else f"| {name} | {med:.1f} | - |")


if __name__ == "__main__":
    main()
