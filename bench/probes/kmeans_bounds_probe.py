"""Lloyd's iterations with distance bounds (plan.kmeans.BOUNDS, BoundedAssign, issue 27) on a GPU: the
bench's k-means (N = 10^7, D = 16, 1024 clusters, blob data: Gaussian means 4 x randn, unit noise) from
the same k-means++ centres, 20 iterations at tol 0 with the bounds off and on (interleaved, CUDA events,
medians of 3 after a warm-up each), the points assigned per step, and the time of one step's parts
(centre statistics, filter, work-list assignment, update). Checks: labels, centres, inertia and n_iter
bitwise equal off / on. One command, < 1 minute on an H100:

    PYTHONPATH=. python3 bench/probes/kmeans_bounds_probe.py

Prediction (written before any measurement; bench/notes/kmeans.md, "Pruned Lloyd iterations"): a CPU
simulation of the bounds on the same distribution (N = 2e5) keeps 54-99.7 % of the points per step
(mean ~87 %), so 20 iterations 187 -> ~50 ms (first assignment 8 ms + 20 x (~1.1 ms of work-list
assignment + 0.8 ms update + ~0.3 ms filter and statistics)); the fit 340-361 -> ~205 ms.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kermac_like.cluster import KMeans, kmeans_plusplus, segment_sums  # noqa: E402
from kermac_like.plan import kmeans as plan_km  # noqa: E402
from _timing import event_ms, interleaved  # noqa: E402

N, D, C, ITERS, REPS = 10_000_000, 16, 1024, 20, 3


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    means = 4 * torch.randn(C, D, device="cuda", generator=g)
    X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, D, device="cuda", generator=g)
    seed_ms, (start, _) = event_ms(lambda: kmeans_plusplus(X, C, None, torch.Generator(device="cuda").manual_seed(0)))
    seed_ms, (start, _) = event_ms(lambda: kmeans_plusplus(X, C, None, torch.Generator(device="cuda").manual_seed(0)))
    fit = lambda: KMeans(C, init=start, max_iter=ITERS, tol=0.0).fit(X)  # noqa: E731
    assigned = []
    step = plan_km.BoundedAssign.step

    def spy(self, centres):
        out = step(self, centres)
        assigned.append(self.assigned)
        return out

    plan_km.BoundedAssign.step = spy
    times, outs = interleaved("kmeans_bounds", fit, REPS, before=assigned.clear)
    a, b = outs[False], outs[True]
    same = (torch.equal(a.labels_, b.labels_) and torch.equal(a.cluster_centers_, b.cluster_centers_)
            and a.inertia_ == b.inertia_ and a.n_iter_ == b.n_iter_)
    print("points assigned per step (bounds on):", assigned)
    # one step's parts, on the fitted model's last centres moved by one more update
    ba = plan_km.BoundedAssign(X, C)
    c0 = start.contiguous()
    ba.first(c0)
    sums, wsum = segment_sums(X, ba.labels, None, C)
    c1 = (sums / wsum.clamp(min=1)[:, None]).float()
    kap = plan_km.bound_consts(D)[2]
    t_stats, _ = event_ms(lambda: plan_km.centre_bounds(c0, c1, ba.rmax, kap))
    t_step, (_, changed) = event_ms(lambda: ba.step(c1))
    t_update, _ = event_ms(lambda: segment_sums(X, ba.labels, None, C))
    t_exact, _ = event_ms(ba.exact_d2)
    off, on = times[False], times[True]
    # where the centre statistics' time goes
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            plan_km.centre_bounds(c0, c1, ba.rmax, kap)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=40))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=4, max_name_column_width=40))
    print(f"first step after k-means++: {ba.assigned} points assigned, {changed} changed")
    print()
    print("| quantity | ms |")
    print("|---|---|")
    print(f"| k-means++ ({C} centres) | {seed_ms:.1f} |")
    print(f"| {ITERS} iterations, bounds off | {off:.1f} |")
    print(f"| {ITERS} iterations, bounds on | {on:.1f} ({off / on:.2f}x) |")
    print(f"| fit estimate (k-means++ + iterations on) | {seed_ms + on:.1f} |")
    print(f"| centre statistics | {t_stats:.2f} |")
    print(f"| first pruned step (filter + work list) | {t_step:.2f} |")
    print(f"| update (segment sums) | {t_update:.2f} |")
    print(f"| exact distances (all points) | {t_exact:.2f} |")
    print(f"| bitwise same fit off / on | {same} |")


if __name__ == "__main__":
    main()
