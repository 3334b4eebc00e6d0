"""k-means: scikit-learn's digits beside scikit-learn's KMeans, then 10^7 points in 16-D, 1024 clusters.

    python examples/kmeans.py -d                        # N = 10^7, D = 16, 1024 clusters, on a GPU
    python examples/kmeans.py --n 2000000 --clusters 256
    python examples/kmeans.py --quick -d                # seconds on a CPU

    KMeans(1024, random_state=0).fit(X)                 # kermac_like.cluster, scikit-learn's API
    labels = km.knn(X, centres, 1)[1]                   # each Lloyd assignment: the fused argmin

The digits (1797 x 64, 10 clusters) are clustered by kermac_like.cluster.KMeans and by
scikit-learn's KMeans(algorithm="lloyd") from the same k-means++ centres (scikit-learn's
kmeans_plusplus): the same labels and inertia in float64, on the chosen device. The
synthetic run times k-means++ and the fit (20 Lloyd iterations, tol = 0), then the same 20
iterations from the same centres written with torch alone, in row blocks (torch.cdist,
argmin, index_add_).
"""

import time

import numpy as np
import torch

from _common import fmt_ms, parser, setup, sync

from kermac_like.cluster import KMeans, kmeans_plusplus

try:
    from sklearn.cluster import KMeans as SkKMeans
    from sklearn.cluster import kmeans_plusplus as sk_kmeans_plusplus
    from sklearn.datasets import load_digits
except ImportError:  # an optional extra: the synthetic run still works
    SkKMeans = None

TORCH_BLOCK_ELEMENTS = 1 << 28  # distances of one torch row block (1 GB of float32)


def torch_lloyd(X, centres, n_iter):
    """What a user writes with torch alone: per iteration, row blocks of distances
    (torch.cdist), their argmin, and the centres' sums and counts by index_add_.
    Returns (centres, inertia of the last assignment)."""
    N, D = X.shape
    C = centres.shape[0]
    block = max(1, min(N, TORCH_BLOCK_ELEMENTS // C))
    inertia = 0.0
    for _ in range(n_iter):
        sums = torch.zeros((C, D), dtype=X.dtype, device=X.device)
        counts = torch.zeros(C, dtype=X.dtype, device=X.device)
        total = torch.zeros((), dtype=torch.float64, device=X.device)
        for m0 in range(0, N, block):
            xb = X[m0:m0 + block]
            d, lab = torch.cdist(xb, centres).min(1)
            total += d.double().square().sum()
            sums.index_add_(0, lab, xb)
            counts.index_add_(0, lab, torch.ones_like(d))
        centres = torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], centres)
        inertia = total
    return centres, float(inertia)


def digits(device, args):
    if SkKMeans is None:
        print("digits: scikit-learn is not installed, comparison skipped")
        return
    X = load_digits().data
    init, _ = sk_kmeans_plusplus(X, 10, random_state=args.seed)
    t0 = time.perf_counter()
    ref = SkKMeans(10, init=init, n_init=1, algorithm="lloyd").fit(X)
    t_ref = time.perf_counter() - t0
    Xt, it = torch.from_numpy(X).to(device), torch.from_numpy(init).to(device)
    t0 = time.perf_counter()
    ours = KMeans(10, init=it, debug=args.debug).fit(Xt)
    sync(device)
    t_ours = time.perf_counter() - t0
    same = np.array_equal(ours.labels_.cpu().numpy(), ref.labels_)
    print(f"digits ({X.shape[0]} x {X.shape[1]}, 10 clusters, float64) from the same k-means++ centres: "
          f"same labels as scikit-learn: {'yes' if same else 'NO'}, inertia {ours.inertia_:.6f} vs "
          f"{ref.inertia_:.6f} (relative difference {abs(ours.inertia_ / ref.inertia_ - 1):.1e}), "
          f"{ours.n_iter_} vs {ref.n_iter_} iterations; {fmt_ms(t_ours * 1e3)} vs {fmt_ms(t_ref * 1e3)}")
    o32 = KMeans(10, init=it.float(), debug=args.debug).fit(Xt.float())
    print(f"digits in float32: {np.mean(o32.labels_.cpu().numpy() == ref.labels_):.2%} of the labels equal, "
          f"inertia relative difference {abs(o32.inertia_ / ref.inertia_ - 1):.1e}")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000_000, help="synthetic points")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--clusters", type=int, default=1024)
    p.add_argument("--iters", type=int, default=20, help="Lloyd iterations (tol = 0)")
    args = p.parse_args()
    device = setup(args)
    digits(device, args)

    small = args.quick or device.type != "cuda"
    n = min(args.n, 10_000) if small else args.n
    C = min(args.clusters, 32) if small else args.clusters
    D, iters = args.dim, args.iters
    g = torch.Generator(device=device).manual_seed(args.seed)
    # a mixture of C Gaussians, so that the clusters are real
    means = 4 * torch.randn(C, D, device=device, generator=g)
    X = means[torch.randint(0, C, (n,), device=device, generator=g)] + torch.randn(n, D, device=device, generator=g)
    print(f"synthetic: {n} points in {D}-D, {C} clusters, float32 "
          f"(the distance matrix would take {n * C * 4 / 1e9:.3g} GB)")
    model = KMeans(C, max_iter=iters, tol=0.0, random_state=args.seed, debug=args.debug)
    model.fit(X)  # warm-up: kernels compiled and cached
    sync(device)
    t0 = time.perf_counter()
    model.fit(X)
    sync(device)
    t_fit = time.perf_counter() - t0
    t0 = time.perf_counter()
    start, _ = kmeans_plusplus(X, C, None, torch.Generator(device=device).manual_seed(args.seed))
    sync(device)
    t_seed = time.perf_counter() - t0
    print(f"KMeans fit (k-means++ + {model.n_iter_} Lloyd iterations): {fmt_ms(t_fit * 1e3)}, of which "
          f"k-means++ {fmt_ms(t_seed * 1e3)}; inertia {model.inertia_:.6g}")
    t0 = time.perf_counter()
    ours = KMeans(C, init=start, max_iter=iters, tol=0.0, debug=args.debug).fit(X)
    sync(device)
    t_lloyd = time.perf_counter() - t0
    t0 = time.perf_counter()
    _, torch_inertia = torch_lloyd(X, start, iters)
    sync(device)
    t_torch = time.perf_counter() - t0
    print(f"{iters} Lloyd iterations from the same centres: ours {fmt_ms(t_lloyd * 1e3)}, torch in row blocks "
          f"(cdist, argmin, index_add_) {fmt_ms(t_torch * 1e3)} ({t_torch / t_lloyd:.1f}x); inertia of the last "
          f"assignment: torch {torch_inertia:.6g}, ours (final centres) {ours.inertia_:.6g}")


if __name__ == "__main__":
    main()
