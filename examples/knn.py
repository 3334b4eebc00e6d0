"""k nearest neighbours: a classifier on scikit-learn's digits, then a search at 10^6 points.

    python examples/knn.py -d                        # M = N = 10^6 points in 3-D, k = 10, on a GPU
    python examples/knn.py --n 200000 --dim 64 -p 1 -k 16
    python examples/knn.py --quick -d                # seconds on a CPU

    values, indices = km.knn(x, y, k, p=p)            # (M, k) each, nearest first, no M x N matrix
    KNeighborsClassifier(5).fit(X, y).predict(X_test)  # kermac_like.neighbors, scikit-learn's API

The classifier's accuracy is printed beside scikit-learn's KNeighborsClassifier (brute force;
the same neighbours up to the order of tied ones). The search prints its time and peak extra
GPU memory, and its recall against torch in row blocks (torch.cdist, then torch.topk) on a
slice of rows, whose time is scaled to all rows.
"""

import numpy as np
import torch

from _common import fmt_ms, median_ms, parser, setup, sync

import kermac_like as km
from kermac_like.neighbors import KNeighborsClassifier

try:
    from sklearn.datasets import load_digits
    from sklearn.neighbors import KNeighborsClassifier as SkKNeighborsClassifier
except ImportError:  # an optional extra: the search still runs
    load_digits = None


def torch_blocked(x, y, k, p, block=4096):
    """What a user writes with torch alone: distances of a row block, then its top-k."""
    vals, idx = [], []
    for m0 in range(0, x.shape[0], block):
        d = torch.cdist(x[m0:m0 + block], y, p=p)
        v, i = torch.topk(d, k, largest=False)
        vals.append(v)
        idx.append(i)
    return torch.cat(vals), torch.cat(idx)


def peak_mb(fn, device):
    """Peak GPU memory of ``fn()`` beyond what was allocated before it (MB)."""
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def classify(device, args):
    if load_digits is None:
        print("digits: scikit-learn is not installed, comparison skipped")
        return
    X, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(args.seed).permutation(len(X))
    X, y = X[perm], y[perm]
    n = int(0.8 * len(X))
    xt = torch.from_numpy(X).to(device=device, dtype=torch.float32)
    yt = torch.from_numpy(y).to(device)
    ours = KNeighborsClassifier(5, debug=args.debug).fit(xt[:n], yt[:n])
    pred = ours.predict(xt[n:]).cpu().numpy()
    ref = SkKNeighborsClassifier(5, algorithm="brute").fit(X[:n], y[:n]).predict(X[n:])
    print(f"digits ({n} train, {len(X) - n} test, 64 features), 5 neighbours: accuracy "
          f"kermac_like {np.mean(pred == y[n:]):.4f}, scikit-learn {np.mean(ref == y[n:]):.4f} "
          f"(same prediction on {np.mean(pred == ref):.2%} of the points)")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000, help="points in x and in y")
    p.add_argument("--dim", type=int, default=3)
    p.add_argument("-k", type=int, default=10, help="neighbours per point")
    p.add_argument("-p", type=float, default=2.0, help="the p-norm")
    p.add_argument("--check-rows", type=int, default=1024, help="rows compared with torch")
    args = p.parse_args()
    device = setup(args)
    classify(device, args)

    n = min(args.n, 3000) if args.quick or device.type != "cuda" else args.n
    D, k = args.dim, args.k
    x = torch.randn(n, D, device=device)
    y = torch.randn(n, D, device=device)
    print(f"search: {n} x {n} points in {D}-D, k = {k}, p = {args.p:g} "
          f"(the distance matrix would take {n * n * 4 / 1e9:.3g} GB)")
    out = km.knn(x, y, k, p=args.p, debug=args.debug)
    t = median_ms(lambda: km.knn(x, y, k, p=args.p, out=out), device, repeats=args.repeats, warmup=args.warmup)
    mem = peak_mb(lambda: km.knn(x, y, k, p=args.p, out=out), device)
    r = min(args.check_rows, n)
    t_torch = median_ms(lambda: torch_blocked(x[:r], y, k, args.p), device, repeats=1, warmup=1)
    tv, ti = torch_blocked(x[:r], y, k, args.p)
    hits = sum(len(set(a) & set(b)) for a, b in zip(out[1][:r].tolist(), ti.tolist()))
    worst = float(((out[0][:r] - tv).abs() / tv.abs().clamp_min(1e-30)).max())
    print(f"knn: {fmt_ms(t)} ({n * n / t / 1e6:.3g} G pairs/s)"
          + (f", peak extra GPU memory {mem:.1f} MB" if mem is not None else ""))
    print(f"torch in row blocks of 4096 (cdist + topk): {fmt_ms(t_torch)} for {r} rows, "
          f"about {fmt_ms(t_torch * n / r)} for all")
    print(f"recall vs torch on {r} rows: {hits / (r * k):.6f}, largest relative distance difference {worst:.2e}")


if __name__ == "__main__":
    main()
