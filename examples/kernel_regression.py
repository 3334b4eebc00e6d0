"""Kernel ridge regression end to end, with a batched bandwidth sweep, beside scikit-learn.

    python examples/kernel_regression.py -d                     # digits, Laplace-l2 kernel
    python examples/kernel_regression.py --dataset diabetes
    python examples/kernel_regression.py --kernel laplace_l1    # scikit-learn's "laplacian" kernel
    python examples/kernel_regression.py --quick -d             # a subsample, seconds on a CPU

The data ship with scikit-learn (pip install "kermac_like[examples]"); without
it a synthetic task is used and the comparison is skipped.

For L bandwidths at once (an (L,) hyper-parameter tensor):

    K_l   = exp(-||x_i - x_j|| / bw_l) + reg * I     one fused km.run_kernel call, (L, n, n)
    alpha = K_l^-1 Y                                 km.linalg.solve_cholesky, all L in one call
    pred  = K_l(X_test, X) alpha                     km.run_kernel again, then a batched matmul

and the same fit with sklearn.kernel_ridge.KernelRidge (float64, its own
kernel matrices) for each bandwidth; the test errors must agree within 1%.
"""

import math
import time

import torch

from _common import fmt_ms, parser, rel_err, setup, sync

import kermac_like as km

try:
    import sklearn
    from sklearn.datasets import load_diabetes, load_digits
    from sklearn.kernel_ridge import KernelRidge
    from sklearn.metrics.pairwise import euclidean_distances
    from sklearn.model_selection import train_test_split
except ImportError:  # an optional extra: the example still runs on synthetic data
    sklearn = None


def load(name, quick, seed):
    """(X_train, X_test, Y_train, Y_test, n_classes or 0, description) as float64 numpy arrays."""
    import numpy as np

    if sklearn is None:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((300 if quick else 3000, 10))
        y = (np.sin(2 * x[:, 0]) + x[:, 1] * x[:, 2])[:, None]
        n = int(0.8 * len(x))
        return x[:n], x[n:], y[:n], y[n:], 0, f"synthetic regression ({len(x)} x 10)"
    if name == "digits":
        x, labels = load_digits(return_X_y=True)
        x = x / 16.0  # pixel intensities 0..16 -> 0..1
        y = np.eye(10)[labels]  # one-hot targets: classification by regression
        classes = 10
    else:
        x, t = load_diabetes(return_X_y=True)
        y = ((t - t.mean()) / t.std())[:, None]  # standardised target
        classes = 0
    if quick:
        keep = np.random.default_rng(seed).permutation(len(x))[:300]
        x, y = x[keep], y[keep]
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed)
    return xtr, xte, ytr, yte, classes, f"scikit-learn {name} ({x.shape[0]} x {x.shape[1]})"


def test_errors(pred, y, classes):
    """Mean squared error (and accuracy for classification) per bandwidth; pred (L, n, C)."""
    mse = ((pred - y) ** 2).mean(dim=(-2, -1))
    acc = (pred.argmax(-1) == y.argmax(-1)).double().mean(-1) if classes else None
    return mse, acc


def fit_ours(desc, xtr, ytr, xte, bws, reg, debug):
    """Kernel ridge regression for every bandwidth in bws (L,): predictions (L, n_test, C)."""
    L = bws.shape[0]
    k_train = km.run_kernel(desc, xtr, xtr, bandwidth=bws, regularization=reg, debug=debug)  # (L, n, n)
    rhs = ytr.mT.expand(L, -1, -1).contiguous()  # (L, C, n): each row one right-hand side
    # overwrite_a: the factor replaces K in place (no second L x n x n buffer)
    alpha, factor_info, _ = km.linalg.solve_cholesky(k_train, rhs, overwrite_a=True, debug=debug)  # (L, C, n)
    k_test = km.run_kernel(desc, xte, xtr, bandwidth=bws, debug=debug)  # (L, n_test, n)
    return k_test @ alpha.mT, factor_info  # (L, n_test, C)


def fit_sklearn(kernel, xtr, ytr, xte, bw, reg):
    if kernel == "laplace_l1":  # scikit-learn's "laplacian" kernel is exp(-gamma ||x - y||_1)
        model = KernelRidge(alpha=reg, kernel="laplacian", gamma=1.0 / bw).fit(xtr, ytr)
        return model.predict(xte)
    model = KernelRidge(alpha=reg, kernel="precomputed")
    model.fit(math.e ** (-euclidean_distances(xtr, xtr) / bw), ytr)
    return model.predict(math.e ** (-euclidean_distances(xte, xtr) / bw))


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--dataset", choices=["digits", "diabetes"], default="digits")
    p.add_argument("--kernel", choices=["laplace_l2", "laplace_l1"], default="laplace_l2")
    p.add_argument("--reg", type=float, default=1e-3, help="ridge regularisation added on the diagonal")
    p.add_argument("--bandwidths", type=float, nargs="+", default=None,
                   help="bandwidths (default: 0.25x to 8x the median training distance)")
    args = p.parse_args(argv)
    device = setup(args)
    desc = km.preset(args.kernel)

    xtr_np, xte_np, ytr_np, yte_np, classes, what = load(args.dataset, args.quick, args.seed)
    xtr = torch.tensor(xtr_np, dtype=torch.float32, device=device)
    xte = torch.tensor(xte_np, dtype=torch.float32, device=device)
    ytr = torch.tensor(ytr_np, dtype=torch.float32, device=device)
    yte = torch.tensor(yte_np, dtype=torch.float64, device=device)
    pnorm = 1.0 if args.kernel == "laplace_l1" else 2.0
    if args.bandwidths is None:
        med = torch.cdist(xtr[:256].double(), xtr.double(), p=pnorm).median().item()
        factors = (0.5, 1.0, 2.0, 4.0) if args.quick else (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
        args.bandwidths = [med * f for f in factors]
    bws = torch.tensor(args.bandwidths, dtype=torch.float32, device=device)
    print(f"data: {what}; train {tuple(xtr.shape)}, test {tuple(xte.shape)}, targets {ytr.shape[1]} column(s)")
    print(f"kernel {args.kernel} {desc!r}, reg {args.reg:g}, {len(bws)} bandwidths in one batch: "
          f"{[round(b, 3) for b in bws.tolist()]}")

    # The fused kernel matrix against float64 torch on a slice (first bandwidth, first rows).
    r = min(256, xtr.shape[0])
    k_slice = km.run_kernel(desc, xtr[:r], xtr, bandwidth=bws, regularization=args.reg, debug=args.debug)
    d64 = torch.cdist(xtr[:r].double(), xtr.double(), p=pnorm, compute_mode="donot_use_mm_for_euclid_dist")
    ref = torch.exp(-d64 / bws.double()[:, None, None]) + args.reg * torch.eye(r, xtr.shape[0], device=device,
                                                                              dtype=torch.float64)
    print(f"kernel matrix: relative error vs float64 torch (first {r} rows) {rel_err(k_slice, ref):.2e}")
    del k_slice, d64, ref

    if device.type == "cuda":  # warm-up: compiles (or loads from the cache) the kernels
        fit_ours(desc, xtr, ytr, xte, bws, args.reg, args.debug)
        sync(device)
    t0 = time.perf_counter()
    pred, factor_info = fit_ours(desc, xtr, ytr, xte, bws, args.reg, args.debug)
    sync(device)
    t_ours = (time.perf_counter() - t0) * 1e3
    bad = factor_info.nonzero().flatten().tolist()
    if bad:
        print(f"warning: Cholesky failed for bandwidth index(es) {bad} (not positive definite in float32)")
    mse, acc = test_errors(pred.double(), yte, classes)
    print(f"kermac_like: {len(bws)} fits (kernel + Cholesky solve + prediction) in {fmt_ms(t_ours)} on {device.type}")

    sk_mse = sk_acc = None
    t_sk = 0.0
    if sklearn is None:
        print("scikit-learn is not installed: KernelRidge comparison skipped "
              "(pip install 'kermac_like[examples]')")
    else:
        sk_mse, sk_acc = [], []
        t0 = time.perf_counter()
        for bw in bws.tolist():
            sk_pred = torch.tensor(fit_sklearn(args.kernel, xtr_np, ytr_np, xte_np, bw, args.reg))
            sk_pred = sk_pred.reshape(len(yte_np), -1)[None]
            m, a = test_errors(sk_pred, yte.cpu(), classes)
            sk_mse.append(m.item())
            sk_acc.append(a.item() if a is not None else None)
        t_sk = (time.perf_counter() - t0) * 1e3
        print(f"scikit-learn {sklearn.__version__} KernelRidge (float64, CPU): {len(bws)} fits in {fmt_ms(t_sk)}")

    head = f"\n{'bandwidth':>10s} {'test MSE':>11s}"
    head += f" {'accuracy':>9s}" if classes else ""
    if sk_mse is not None:
        head += f" {'sklearn MSE':>12s}" + (f" {'sk acc.':>8s}" if classes else "") + f" {'rel. diff':>10s}"
    print(head)
    worst = 0.0
    for i, bw in enumerate(bws.tolist()):
        line = f"{bw:10.4g} {mse[i].item():11.5f}"
        line += f" {acc[i].item():9.4f}" if classes else ""
        if sk_mse is not None:
            rd = abs(mse[i].item() - sk_mse[i]) / sk_mse[i]
            worst = max(worst, rd)
            line += f" {sk_mse[i]:12.5f}" + (f" {sk_acc[i]:8.4f}" if classes else "") + f" {rd:10.2e}"
        print(line)
    best = int(mse.argmin())
    print(f"\nbest bandwidth {bws[best].item():.4g}: test MSE {mse[best].item():.5f}"
          + (f", accuracy {acc[best].item():.4f}" if classes else ""))
    if sk_mse is not None:
        verdict = "OK" if worst < 0.01 else "MISMATCH"
        print(f"max relative difference in test MSE vs scikit-learn KernelRidge: {100 * worst:.4f}% "
              f"(tolerance 1%: {verdict})")
        if worst >= 0.01:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
