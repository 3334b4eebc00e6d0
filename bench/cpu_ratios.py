"""CPU path against the torch way, as ratios measured in one process (issue 26, item 2).

    python3 bench/cpu_ratios.py                                  # every row, markdown on stdout
    PYTHONPATH=<old checkout> python3 bench/cpu_ratios.py --label before
    python3 bench/cpu_ratios.py --rows cdist_p2 --repeats 15 --json out.json

Each row times ours (the public API on CPU float32 tensors) and the torch way on the same
inputs, interleaved: every repeat runs both, in alternating order, so that a load change on
a shared machine hits both sides alike. Reported: the median of each side and the median of
the per-repeat ratios (ours / torch; the target is <= 1.25). The torch way:

* cdist: ``torch.cdist(x, y, p)`` (its own compute-mode rule: the matrix product for p = 2
  above 25 rows);
* run_kernel laplace_l2: ``torch.exp(torch.cdist(x, y) / -bw)``;
* kernel_matvec: row blocks of ``TORCH_BLOCK_ELEMENTS`` kernel entries, each
  ``torch.exp(<cdist block> / -bw) @ v`` (Gaussian: the squared distance over -2 bw^2).

Rows against the library a class stands in for (issue 46, item 2; target <= 1.0 unless noted):

* kmeans: ``kermac_like.cluster.KMeans`` against scikit-learn's ``KMeans(algorithm="lloyd")``,
  both on the same numpy float32 blobs from the same initial centres (n_init=1): 4000 x 10, 16
  clusters with the default tol and max_iter; 50 000 x 16, 64 clusters, 20 iterations (tol=0).
  ``--check`` prints the largest centre difference and both n_iter.
* cdist_grad p = 2 (a (K, M), b (N, K), c (O, K), d (N, M)): the torch way is the contraction
  split into two matrix products, ``d (c a) - ((c * b) a)`` (examples/cdist_grad.py).
* kernel_logsumexp (Gaussian, log weights (N,)): the torch way is row blocks of
  ``TORCH_BLOCK_ELEMENTS`` entries, each ``torch.logsumexp(torch.cdist(x, y) ** 2 / (-2 bw^2) + w, 1)``.
  ``--check``: the largest difference of the two results, and ``ref_err`` the largest error of ours and of
  the torch way against float64 (kernel_logsumexp of the inputs in float64).
* gpytorch (target <= 1.2): 20 Adam steps (lr 0.1) of ``kermac_like.gpytorch.ScaledExactGP`` with
  the package's ``RBFKernel(ard_num_dims=8)`` (and ``MaternKernel(nu=1.5 | 2.5)``) against the same model with
  GPyTorch's own kernel, N = 2000,
  D = 8 (x uniform in [-1, 1]^8, bench/_gp.py's y), GPyTorch's default settings (CG above
  max_cholesky_size = 800), the same probe seed. ``--check``: the final losses' difference.

Uses only the public API, so it runs against any version of the package on ``sys.path``.
Threads: torch's intra-op default (``--threads`` to change it).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

import kermac_like as km

TORCH_BLOCK_ELEMENTS = 1 << 22  # rows per block of the torch way's kernel_matvec: 16 MB of float32


def _torch_matvec(kind: str, x, y, v, bw: float):
    out = torch.empty(x.shape[0], v.shape[1])
    rows = max(1, TORCH_BLOCK_ELEMENTS // y.shape[0])
    for m0 in range(0, x.shape[0], rows):
        d = torch.cdist(x[m0:m0 + rows], y)
        k = torch.exp(d / -bw) if kind == "laplace" else torch.exp(d.square() / (-2.0 * bw * bw))
        out[m0:m0 + rows] = k @ v
    return out


def _blobs(n, d, c, seed=0):
    """(X (n, d) float32 numpy: c Gaussian blobs, init (c, d): c distinct rows of X)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    X = (4 * rng.randn(c, d)[rng.randint(0, c, n)] + rng.randn(n, d)).astype(np.float32)
    return X, X[rng.choice(n, c, replace=False)].copy()


def _kmeans_rows():
    try:
        from sklearn.cluster import KMeans as SkKMeans
    except ImportError:
        return
    from kermac_like.cluster import KMeans

    for (n, d, c), kw in (((4000, 10, 16), {}), ((50000, 16, 64), dict(max_iter=20, tol=0.0))):
        def ours(X, init, c=c, kw=kw):
            m = KMeans(c, init=init, n_init=1, **kw).fit(X)
            return torch.from_numpy(m.cluster_centers_), m.n_iter_

        def theirs(X, init, c=c, kw=kw):
            m = SkKMeans(c, init=init, n_init=1, algorithm="lloyd", **kw).fit(X)
            return torch.from_numpy(m.cluster_centers_), m.n_iter_

        label = f"{n}x{d}, {c} clusters" + (f", {kw['max_iter']} it." if kw else "")
        yield (f"kmeans_{n}x{d}x{c}", label, lambda n=n, d=d, c=c: _blobs(n, d, c), ours, theirs)


def _gp_rows():
    try:
        import gpytorch

        from kermac_like.gpytorch import MaternKernel, RBFKernel, ScaledExactGP
    except ImportError:
        return

    def inputs(n=2000, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.rand(n, 8, generator=g) * 2 - 1
        y = torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(n, generator=g)
        return x, y

    def train(kernel_cls, x, y, steps=20):
        torch.manual_seed(0)
        likelihood = gpytorch.likelihoods.GaussianLikelihood()
        model = ScaledExactGP(x, y, likelihood, kernel_cls(ard_num_dims=8))
        mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model.train()
        likelihood.train()
        for _ in range(steps):
            opt.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            opt.step()
        return loss.detach()

    yield ("gpytorch_rbf_adam20", "N=2000, D=8, 20 Adam steps", inputs,
           lambda x, y: train(RBFKernel, x, y), lambda x, y: train(gpytorch.kernels.RBFKernel, x, y))
    for nu in (1.5, 2.5):
        ours, theirs = (functools.partial(cls, nu=nu) for cls in (MaternKernel, gpytorch.kernels.MaternKernel))
        yield (f"gpytorch_matern{int(nu * 10)}_adam20", f"N=2000, D=8, Matérn {nu}, 20 Adam steps", inputs,
               lambda x, y, ours=ours: train(ours, x, y), lambda x, y, theirs=theirs: train(theirs, x, y))


def _torch_logsumexp(x, y, w, bw: float):
    out = torch.empty(x.shape[0])
    rows = max(1, TORCH_BLOCK_ELEMENTS // y.shape[0])
    for m0 in range(0, x.shape[0], rows):
        out[m0:m0 + rows] = torch.logsumexp(torch.cdist(x[m0:m0 + rows], y).square() / (-2.0 * bw * bw) + w, 1)
    return out


def _lse_inputs(m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(m, k, generator=g), torch.randn(m, generator=g)


def _torch_cdist_grad_p2(a, b, c, d):
    O, N = c.shape[-2], b.shape[-2]
    ca = c @ a
    cb = (c.unsqueeze(-2) * b.unsqueeze(-3)).flatten(-3, -2)
    return (cb @ a).unflatten(-2, (O, N)).neg_().addcmul_(d.unsqueeze(-3), ca.unsqueeze(-2))


def _grad_inputs(K, M, N, O, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(K, M, generator=g), torch.randn(N, K, generator=g), torch.randn(O, K, generator=g),
            torch.randn(N, M, generator=g))


def rows():
    """(name, shape label, make inputs: (m, n, k, c) for _inputs or a callable, ours, torch way)."""
    for p in (1.0, 2.0):
        for m, k in ((2000, 3), (2000, 64), (4000, 256)):
            yield (f"cdist_p{p:g}_k{k}", f"{m}x{m}x{k}", (m, m, k, 0),
                   lambda x, y, v, p=p: km.cdist(x, y, p), lambda x, y, v, p=p: torch.cdist(x, y, p))
    lap = km.preset("laplace_l2")
    yield ("run_kernel_laplace_l2_k64", "2000x2000x64", (2000, 2000, 64, 0),
           lambda x, y, v: km.run_kernel(lap, x, y, bandwidth=8.0), lambda x, y, v: torch.exp(torch.cdist(x, y) / -8.0))
    for kind in ("gaussian", "laplace"):
        desc = km.preset(f"{kind}_l2")
        for c in (1, 16):
            yield (f"kernel_matvec_{kind}_c{c}", f"4000x4000x64 C={c}", (4000, 4000, 64, c),
                   lambda x, y, v, d=desc: km.kernel_matvec(d, x, y, v, bandwidth=8.0),
                   lambda x, y, v, kind=kind: _torch_matvec(kind, x, y, v, 8.0))
    gauss = km.preset("gaussian_l2")
    for k in (3, 64):
        yield (f"logsumexp_gaussian_k{k}", f"4000x4000x{k}, C=1", lambda k=k: _lse_inputs(4000, k),
               lambda x, y, w: km.kernel_logsumexp(gauss, x, y, w, bandwidth=1.0),
               lambda x, y, w: _torch_logsumexp(x, y, w, 1.0))
    yield ("cdist_grad_p2", "K=M=2000, N=32, O=4", lambda: _grad_inputs(2000, 2000, 32, 4),
           lambda a, b, c, d: km.cdist_grad(a, b, c, d, p=2.0), _torch_cdist_grad_p2)
    yield from _kmeans_rows()
    yield from _gp_rows()


def _inputs(m, n, k, c, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    y = torch.randn(n, k, generator=g)
    v = torch.randn(n, c, generator=g) if c else None
    return x, y, v


def _time(fn, args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def measure(ours, theirs, args, repeats: int, warmup: int) -> dict:
    for _ in range(warmup):
        ours(*args)
        theirs(*args)
    t_ours, t_torch, ratios = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            a = _time(ours, args)
            b = _time(theirs, args)
        else:
            b = _time(theirs, args)
            a = _time(ours, args)
        t_ours.append(a)
        t_torch.append(b)
        ratios.append(a / b)
    return {"ours_ms": statistics.median(t_ours), "torch_ms": statistics.median(t_torch),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ours_all": t_ours, "torch_all": t_torch}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated substrings of the row names to run")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", default="", help="also write the measurements to this file")
    ap.add_argument("--check", action="store_true", help="also print the max abs difference ours - torch way")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = [w for w in args.rows.split(",") if w]
    print(f"# {args.label or 'kermac_like'} {km.__version__} ({km.__file__}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.repeats} interleaved repeats, medians")
    print("| row | shape | ours ms | torch ms | ours/torch (min-max) |")
    print("|---|---|---|---|---|")
    results = {}
    gauss_l2 = km.preset("gaussian_l2")
    for name, shape, dims, ours, theirs in rows():
        if wanted and not any(w in name for w in wanted):
            continue
        inp = dims() if callable(dims) else _inputs(*dims)
        r = measure(ours, theirs, inp, args.repeats, args.warmup)
        extra = ""
        if args.check:
            a, b = ours(*inp), theirs(*inp)
            if isinstance(a, tuple):  # (result, n_iter)
                extra = f" n_iter {a[1]} / {b[1]}"
                a, b = a[0], b[0]
            r["max_abs_diff"] = (a - b).abs().max().item()
            extra = f" diff {r['max_abs_diff']:.1e}" + extra
            if name.startswith("logsumexp"):
                ref = km.kernel_logsumexp(gauss_l2, *(t.double() for t in inp), bandwidth=1.0)
                r["ref_err"] = [(t.double() - ref).abs().max().item() for t in (a, b)]
                extra += " ref_err {:.1e} / {:.1e}".format(*r["ref_err"])
        results[name] = dict(shape=shape, **r)
        print(f"| {name} | {shape} | {r['ours_ms']:.2f} | {r['torch_ms']:.2f} | {r['ratio']:.2f} "
              f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f}){extra} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "threads": torch.get_num_threads(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
