"""Gaussian-process regression with GPyTorch on the package's matrix-free kernels.

    python examples/gp_regression.py -d               # diabetes, then one training step at N = 10^6 (GPU)
    python examples/gp_regression.py --quick -d       # a subsample and N = 1000: a minute on a CPU
    python examples/gp_regression.py -N 300000        # the large step at another N
    python examples/gp_regression.py --large-kernel matern    # the large step with Matérn 5/2

Needs gpytorch and scikit-learn (pip install "kermac_like[gpytorch,examples]").

1. An ExactGP (constant mean, ScaleKernel(k) with one lengthscale per feature) on
   scikit-learn's bundled diabetes data, trained with Adam from the same start for k = RBF and
   k = Matérn 5/2: with the package's kernel (kermac_like.gpytorch.RBFKernel / MaternKernel) and
   with GPyTorch's (gpytorch.kernels.RBFKernel / MaternKernel). Both run GPyTorch's CG / Lanczos
   (max_cholesky_size 0) in float64 with the same probe vectors, so the marginal log likelihoods
   agree to rounding at every step; the test RMSEs are printed side by side.
2. One MLL + backward step on synthetic data at N = 10^6, D = 8 (float32 on a GPU), where the
   dense kernel would take N^2 * 4 bytes = 4 TB: the time of the step and the peak GPU memory;
   ``--large-kernel matern``: Matérn 5/2 (its products and gradients on the fused kernels through
   the Matern52 epilogue functor, cuda_templates/epilogue.cuh).
"""

import os
import time

import torch

from _common import parser, setup, sync

try:
    import gpytorch

    from kermac_like.gpytorch import MaternKernel, RBFKernel, ScaledExactGP
except ImportError:  # optional extras
    gpytorch = None


def load_diabetes_split(quick, seed, device):
    """(x_train, y_train, x_test, y_test): standardised float64 tensors on ``device``."""
    import numpy as np
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    if quick:
        keep = np.random.default_rng(seed).permutation(len(x))[:200]
        x, y = x[keep], y[keep]
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed)
    mx, sx, my, sy = xtr.mean(0), xtr.std(0), ytr.mean(), ytr.std()
    return tuple(torch.as_tensor(a, dtype=torch.float64, device=device)
                 for a in ((xtr - mx) / sx, (ytr - my) / sy, (xte - mx) / sx, (yte - my) / sy))


def train(kernel, x, y, xt, yt, iters, seed):
    """Adam on the exact MLL; (MLL per iteration, test RMSE)."""
    torch.manual_seed(seed)
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x)
    model = ScaledExactGP(x, y, likelihood, kernel).to(x)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.train()
    likelihood.train()
    history = []
    with gpytorch.settings.max_cholesky_size(0):
        for _ in range(iters):
            opt.zero_grad()
            loss = -mll(model(x), y)
            loss.backward()
            opt.step()
            history.append(-loss.item())
        model.eval()
        likelihood.eval()
        with torch.no_grad():
            rmse = (likelihood(model(xt)).mean - yt).square().mean().sqrt().item()
    return history, rmse


def large_step(n, d, device, dtype, seed, kernel="rbf"):
    """One MLL + backward step of ScaleKernel(RBF(ard)) (or Matérn 5/2) at N points; (seconds, peak bytes, MLL)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, d, generator=g) * 2 - 1).to(device, dtype)
    y = (torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(n, generator=g).to(device, dtype))
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(device, dtype)
    k = RBFKernel(ard_num_dims=d) if kernel == "rbf" else MaternKernel(nu=2.5, ard_num_dims=d)
    model = ScaledExactGP(x, y, likelihood, k).to(device, dtype)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    model.train()
    likelihood.train()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with gpytorch.settings.max_cholesky_size(0):
        loss = -mll(model(x), y)
        loss.backward()
    sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return seconds, peak, -loss.item()


def main(argv=None):
    p = parser(__doc__.split("\n")[0])
    p.add_argument("-N", type=int, default=None,
                   help="points of the large step (default 10^6 on a GPU; --quick or a CPU 1000)")
    p.add_argument("--iters", type=int, default=None, help="Adam iterations on diabetes (default 50; --quick 3)")
    p.add_argument("--large-kernel", choices=("rbf", "matern"), default="rbf",
                   help="the large step's kernel: RBF or Matérn 5/2 (default rbf)")
    args = p.parse_args(argv)
    if args.debug:  # the ops run inside GPyTorch: the switch reaches them through the environment
        os.environ["KERMAC_LIKE_DEBUG"] = "1"
    device = setup(args)
    if gpytorch is None:
        raise SystemExit("this example needs gpytorch: pip install \"kermac_like[gpytorch,examples]\"")
    iters = args.iters or (3 if args.quick else 50)

    x, y, xt, yt = load_diabetes_split(args.quick, args.seed, device)
    d = x.shape[1]
    print(f"\ndiabetes: {len(x)} training / {len(xt)} test points, {d} features; ExactGP, ScaleKernel(k, ARD), "
          f"{iters} Adam steps, CG / Lanczos in float64 (times after one untimed step)")
    pairs = {
        "RBF": (("kermac_like.gpytorch.RBFKernel", lambda: RBFKernel(ard_num_dims=d)),
                ("gpytorch.kernels.RBFKernel", lambda: gpytorch.kernels.RBFKernel(ard_num_dims=d))),
        "Matérn 5/2": (("kermac_like.gpytorch.MaternKernel", lambda: MaternKernel(nu=2.5, ard_num_dims=d)),
                       ("gpytorch.kernels.MaternKernel", lambda: gpytorch.kernels.MaternKernel(nu=2.5, ard_num_dims=d))),
    }
    for kname, pair in pairs.items():
        runs = {}
        print(f" k = {kname}:")
        for name, make in pair:
            train(make(), x, y, xt, yt, 1, args.seed)  # untimed: a first call compiles its kernels (JIT)
            t0 = time.perf_counter()
            history, rmse = train(make(), x, y, xt, yt, iters, args.seed)
            runs[name] = history
            print(f"  {name:34s} MLL {history[0]:+.6f} -> {history[-1]:+.6f}, test RMSE {rmse:.4f} "
                  f"({time.perf_counter() - t0:.1f} s)")
        a, b = runs.values()
        worst = max(abs(u - v) / abs(v) for u, v in zip(a, b))
        print(f"  same MLL: largest relative difference over the {iters} steps {worst:.1e}")

    n = args.N or (1000 if args.quick or device.type != "cuda" else 1_000_000)
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    dense_gb = n * n * torch.finfo(dtype).bits / 8 / 1e9
    kname = {"rbf": "RBF", "matern": "Matérn 5/2"}[args.large_kernel]
    print(f"\nsynthetic: one MLL + backward step of ScaleKernel({kname}, ARD) at N = {n}, D = 8, {dtype} "
          f"(the dense kernel: {dense_gb:.3g} GB)")
    if device.type == "cuda":
        large_step(min(n, 4096), 8, device, dtype, args.seed, args.large_kernel)  # compiles the kernels
    seconds, peak, value = large_step(n, 8, device, dtype, args.seed, args.large_kernel)
    memory = f", peak GPU memory {peak / 2**20:.0f} MiB" if peak is not None else ""
    print(f"  step: {seconds:.2f} s{memory}, MLL {value:+.4f}")


if __name__ == "__main__":
    main()
