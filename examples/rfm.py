"""Recursive Feature Machines: kermac_like.rfm's estimators on scikit-learn's data sets, beside xRFM.

    python examples/rfm.py -d              # the bundled data sets, then a synthetic fit at n = 10^6 (GPU)
    python examples/rfm.py --quick -d      # small sizes, seconds on a CPU

1. A gradient check: the fused gradient contraction behind the AGOP against torch.autograd (float64).
2. scikit-learn's bundled data (diabetes regression, breast cancer and digits classification), each
   split train / validation / test (60 / 20 / 20, fixed seed, features standardised on the training
   part): RFMRegressor / RFMClassifier (laplace_l2, bandwidth 10, reg 1e-3, 5 iterations, the
   validation part as eval_set) and, where xRFM is installed, xRFM's RFM with the same splits and
   parameters: R^2 or accuracy, fit seconds.
3. The synthetic task y = x0 x1 + sin(2 x2) + 0.5 [x3 > 0] + noise at n = 10^6, D = 50 (--quick: 2000 x 16):
   fit time, peak GPU memory, relative MSE of the plain kernel (iteration 0) and of the RFM.

The RFM iteration (kermac_like/rfm): u = x S with S = M^(1/2); (K(u, u) + reg I) c = y (Cholesky, or
Falkon beyond the size that fits); M = AGOP of the fitted predictor, accumulated in blocks of
points through cdist_grad without the gradient tensor.
"""

import time

import numpy as np
import torch

from _common import parser, setup, sync

from kermac_like.rfm import RFMClassifier, RFMRegressor, function_gradients, resolve_rfm_kernel

LAPLACE_L2 = resolve_rfm_kernel("laplace_l2", 1.0, 2.0)


def laplace_gradients(x, alpha, z, mhalf, bandwidth, *, debug=False):
    """Gradients of f_o(z) = sum_i alpha[o, i] exp(-||(z - x_i) @ mhalf|| / bandwidth) w.r.t. z.

    x (n, D) training points, alpha (O, n) coefficients, z (m, D) evaluation points, mhalf (D, D).
    Returns (O, m, D). Where z_j == x_i the term's gradient is taken as 0 (the Laplace kernel's
    cusp). The gradients in the transformed space come from kermac_like.rfm's blocked contraction
    (cdist_grad on a GPU); the chain rule takes them back: grad_z f = grad_v f @ mhalf^T.
    """
    u, v = x @ mhalf, z @ mhalf
    grad_v = function_gradients(LAPLACE_L2, bandwidth, u, alpha.T, v)  # (O, m, D)
    return grad_v @ mhalf.mT


def gradient_check(device, debug=False):
    """laplace_gradients on the device against torch.autograd in float64 on a tiny case."""
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64)
    z = torch.randn(24, 6, generator=g, dtype=torch.float64)
    alpha = torch.randn(3, 40, generator=g, dtype=torch.float64)
    a = torch.randn(6, 6, generator=g, dtype=torch.float64)
    mhalf = torch.eye(6, dtype=torch.float64) + 0.3 * a  # not symmetric: checks the transposes too
    bw = 2.5
    zz = z.clone().requires_grad_(True)
    diff = (zz.unsqueeze(1) - x.unsqueeze(0)) @ mhalf  # (24, 40, 6)
    f = (torch.exp(-diff.norm(dim=-1) / bw) @ alpha.T)  # (24, 3)
    want = torch.stack([torch.autograd.grad(f[:, o].sum(), zz, retain_graph=True)[0] for o in range(3)])
    dt = torch.float32 if device.type == "cuda" else torch.float64
    got = laplace_gradients(*(t.to(device, dt) for t in (x, alpha, z, mhalf)), bw, debug=debug)
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def splits(X, y, seed):
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(X))
    a, b = int(0.6 * len(X)), int(0.8 * len(X))
    tr, va, te = idx[:a], idx[a:b], idx[b:]
    mu, sd = X[tr].mean(0), X[tr].std(0) + 1e-12
    X = (X - mu) / sd
    return X[tr], y[tr], X[va], y[va], X[te], y[te]


def xrfm_scores(kind, X, y, Xv, yv, Xt, yt, args, device):
    """xRFM's RFM leaf with the same data and parameters: (score, seconds), or None without xRFM."""
    try:
        from xrfm.rfm_src.recursive_feature_machine import RFM
        from xrfm.rfm_src.class_conversion import ClassificationConverter
    except Exception:  # noqa: BLE001
        return None
    f32 = dict(dtype=torch.float32, device=device)
    if kind == "regression":
        Y, Yv, conv, metric = y[:, None], yv[:, None], None, "mse"
    else:
        k = int(max(y.max(), yv.max())) + 1
        conv = ClassificationConverter(mode="zero_one", n_classes=k)
        Y = conv.labels_to_numerical(torch.as_tensor(y)).numpy()
        Yv = conv.labels_to_numerical(torch.as_tensor(yv)).numpy()
        metric = "brier"
    m = RFM(kernel="l2", iters=args.iters, bandwidth=args.bandwidth, exponent=1.0, device=device, verbose=False,
            tuning_metric=metric, class_converter=conv)
    t0 = time.perf_counter()
    m.fit((torch.as_tensor(X, **f32), torch.as_tensor(Y, **f32)), (torch.as_tensor(Xv, **f32), torch.as_tensor(Yv, **f32)),
          iters=args.iters, reg=args.reg, verbose=False)
    sync(device)
    dt = time.perf_counter() - t0
    if kind == "regression":
        p = m.predict(torch.as_tensor(Xt, **f32)).cpu().numpy()[:, 0]
        return 1 - ((p - yt) ** 2).sum() / ((yt - yt.mean()) ** 2).sum(), dt
    p = m.predict_proba(torch.as_tensor(Xt, **f32)).argmax(1).cpu().numpy()
    return (p == yt).mean(), dt


def real_data(args, device):
    from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits

    print(f"\nscikit-learn's data sets (train/val/test 60/20/20, seed {args.seed}; laplace_l2, bandwidth "
          f"{args.bandwidth}, reg {args.reg}, {args.iters} iterations, the validation part as eval_set)")
    print(f"{'data set':>14s} {'metric':>9s} {'ours':>8s} {'xRFM':>8s} {'ours fit':>10s} {'xRFM fit':>10s}")
    for name, loader, kind in (("diabetes", load_diabetes, "regression"), ("breast cancer", load_breast_cancer, "class"),
                               ("digits", load_digits, "class")):
        X, y = loader(return_X_y=True)
        if args.quick and name == "digits":
            X, y = X[:400], y[:400]
        X, y, Xv, yv, Xt, yt = splits(X.astype(np.float64), y, args.seed)
        est = (RFMRegressor if kind == "regression" else RFMClassifier)(
            bandwidth=args.bandwidth, reg=args.reg, iters=args.iters, device=device, random_state=args.seed)
        t0 = time.perf_counter()
        est.fit(X, y, eval_set=(Xv, yv))
        dt = time.perf_counter() - t0
        ours = est.score(Xt, yt)
        theirs = xrfm_scores(kind, X, y, Xv, yv, Xt, yt, args, device)
        xs, xt = ("-", "-") if theirs is None else (f"{theirs[0]:.4f}", f"{theirs[1]:.2f} s")
        print(f"{name:>14s} {'R^2' if kind == 'regression' else 'accuracy':>9s} {ours:8.4f} {xs:>8s} "
              f"{dt:8.2f} s {xt:>10s}   (best iteration {est.best_iter_})")


def synthetic(args, device):
    n, d = (2000, 16) if args.quick else (args.n, 50)
    g = torch.Generator(device=device).manual_seed(args.seed)

    def task(m):
        x = torch.randn(m, d, device=device, generator=g)
        return x, x[:, 0] * x[:, 1] + torch.sin(2 * x[:, 2]) + 0.5 * (x[:, 3] > 0) + 0.1 * torch.randn(
            m, device=device, generator=g)

    x, y = task(n)
    xv, yv = task(2000)
    xt, yt = task(5000)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    est = RFMRegressor(bandwidth=args.bandwidth, reg=args.reg, iters=args.iters, device=device,
                       random_state=args.seed, verbose=args.debug, debug=args.debug).fit(x, y, eval_set=(xv, yv))
    sync(device)
    dt = time.perf_counter() - t0
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 1e9:.2f} GB" if device.type == "cuda" else ""
    var = float(yv.var())
    first, last = est.history_[0]["metric"] / var, min(h["metric"] for h in est.history_) / var
    print(f"\nsynthetic y = x0 x1 + sin(2 x2) + 0.5 [x3 > 0] + noise, n = {n}, D = {d}: fit {dt:.2f} s "
          f"({est.solver_}, {est.n_iter_} metric updates){peak}")
    test = float(((est.predict(xt) - yt) ** 2).mean() / yt.var())
    print(f"relative test MSE: {first:.4f} (plain Laplace kernel, validation) -> {last:.4f} (best RFM iteration "
          f"{est.best_iter_}, validation); test {test:.4f}")
    return first, last


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=1_000_000, help="training points of the synthetic fit")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=10.0)
    p.add_argument("--reg", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.quick:
        args.iters = 3
    device = setup(args)

    err = gradient_check(device, args.debug)
    print(f"gradient check (the AGOP's contraction vs torch.autograd, tiny case): relative error {err:.2e}")
    if err > 1e-4:
        raise SystemExit("the gradient contraction does not match autograd")
    try:
        import sklearn  # noqa: F401
    except ImportError:
        print("scikit-learn is not installed: the bundled data sets are skipped")
    else:
        real_data(args, device)
    first, last = synthetic(args, device)
    if not last < first:
        raise SystemExit("the RFM did not improve on the plain kernel")


if __name__ == "__main__":
    main()
