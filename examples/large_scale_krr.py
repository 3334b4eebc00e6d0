"""Kernel ridge regression at N = 1 000 000 without the N x N matrix, on one GPU or many.

    python examples/large_scale_krr.py                                 # N = 10^6, D = 8, Gaussian, cg
    python examples/large_scale_krr.py --solver nystrom --n-centers 20000
    torchrun --nproc_per_node=2 examples/large_scale_krr.py            # two GPUs (NCCL)
    python examples/large_scale_krr.py --quick -d                      # small, seconds on a CPU
    torchrun --nproc_per_node=2 examples/large_scale_krr.py --quick    # two CPU processes (gloo)

The data have a known answer: X uniform in [-1, 1]^D, y = f(X) + noise with a smooth f
(noise 0.1, so the best possible test MSE against the noisy y is 0.01, against f it is 0).
The training rows come in fixed chunks of 16384, each from its own seed; rank r of R takes
chunks r, r + R, ...: the same data set whatever the number of processes. Prints the fit
time, CG iterations, relative residual and the test error; with --check-exact (default
with --quick) also the exact solution (cholesky) on the same data and the relative
difference of the two test errors.
"""

from __future__ import annotations

import math
import os
import time
import warnings

import torch

from _common import parser

import kermac_like as km  # noqa: F401
from kermac_like.solvers import KernelRidge

CHUNK = 16384


def target(x: torch.Tensor) -> torch.Tensor:
    """The smooth function to learn (uses the first 8 coordinates; D >= 8 is assumed)."""
    return (torch.sin(math.pi * (x[:, 0] + x[:, 1]) / 2) * torch.cos(math.pi * x[:, 2] / 2)
            + 0.5 * torch.tanh(x[:, 3] + x[:, 4] - x[:, 5]) + 0.25 * x[:, 6] * x[:, 7])


def make_data(n: int, d: int, *, rank: int = 0, world: int = 1, seed: int = 0, noise: float = 0.1,
              dtype=torch.float32, device="cpu"):
    """This rank's chunks of the n training rows: (X, y), generated in float64 on the CPU."""
    xs, ys = [], []
    for k in range(rank, -(-n // CHUNK), world):
        rows = min(CHUNK, n - k * CHUNK)
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        x = torch.rand(rows, d, dtype=torch.float64, generator=g) * 2 - 1
        y = target(x) + noise * torch.randn(rows, dtype=torch.float64, generator=g)
        xs.append(x)
        ys.append(y)
    x = torch.cat(xs) if xs else torch.empty(0, d, dtype=torch.float64)
    y = torch.cat(ys) if ys else torch.empty(0, dtype=torch.float64)
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


def make_test(n: int, d: int, *, seed: int = 0, noise: float = 0.1, dtype=torch.float32, device="cpu"):
    """(X_test, y_test noisy, f(X_test)): the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 999_999_937)
    x = torch.rand(n, d, dtype=torch.float64, generator=g) * 2 - 1
    f = target(x)
    y = f + noise * torch.randn(n, dtype=torch.float64, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (x, y, f))


def init_distributed():
    """(rank, world, device): torchrun's environment, or a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            return dist.get_rank(), world, torch.device("cuda", local)
        dist.init_process_group("gloo")
        return dist.get_rank(), world, torch.device("cpu")
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return 0, 1, dev


def main(argv=None):
    p = parser(__doc__.split("\n")[0])
    p.add_argument("-N", type=int, default=None, help="training rows (default 1 000 000; --quick 1000)")
    p.add_argument("-D", type=int, default=8, help="features (>= 8)")
    p.add_argument("--kernel", default="gaussian_l2", help="a preset with a LAPLACE/GAUSSIAN epilogue")
    p.add_argument("--bandwidth", type=float, default=1.5)
    p.add_argument("--lam", type=float, default=None, help="ridge per sample: alpha = lam * N (default 1e-6; --quick 1e-4)")
    p.add_argument("--solver", default="cg", choices=("auto", "cholesky", "cg", "nystrom"))
    p.add_argument("--n-landmarks", type=int, default=None, help="cg's preconditioner (default 5000; --quick 100)")
    p.add_argument("--n-centers", type=int, default=None, help="nystrom's centres (default 20000; --quick 200)")
    p.add_argument("--tol", type=float, default=1e-4, help="relative residual to reach")
    p.add_argument("--max-iter", type=int, default=None)
    p.add_argument("--n-test", type=int, default=None, help="test rows (default 10000; --quick 300)")
    p.add_argument("--dtype", default=None, choices=("float32", "float64"),
                   help="default float32 (float64 with --quick on a CPU)")
    p.add_argument("--check-exact", action="store_true", help="also fit cholesky on the same data (N must fit)")
    p.add_argument("--no-warmup", action="store_true", help="skip the small warm-up fit (JIT compilation)")
    p.add_argument("--verbose", action="store_true", help="a tqdm bar of the CG iterations")
    args = p.parse_args(argv)
    if args.D < 8:
        p.error("-D: the target function uses 8 coordinates; pass -D >= 8")
    rank, world, device = init_distributed()
    if args.device is not None and world == 1:
        device = torch.device(args.device)
    q = args.quick
    n = args.N or (1000 if q else 1_000_000)
    n_test = args.n_test or (300 if q else 10_000)
    lam = args.lam if args.lam is not None else (1e-4 if q else 1e-6)
    dtype = getattr(torch, args.dtype or ("float64" if q and device.type == "cpu" else "float32"))
    n_landmarks = args.n_landmarks if args.n_landmarks is not None else min(n, 100 if q else 5000)
    n_centers = args.n_centers if args.n_centers is not None else min(n, 200 if q else 20000)
    check_exact = args.check_exact or q
    alpha = lam * n
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.debug:
        import logging

        logging.basicConfig(level=logging.INFO, format=f"[rank {rank} %(name)s] %(message)s")
        logging.getLogger("kermac_like").setLevel(logging.DEBUG)
    say(f"kermac_like {km.__version__}, torch {torch.__version__}; {world} process(es) on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (CPU reference path)'}")
    say(f"N = {n}, D = {args.D}, {args.kernel} bandwidth {args.bandwidth}, alpha = {alpha:g} (lam {lam:g}), "
        f"{dtype}, solver {args.solver}, tol {args.tol:g}")

    x, y = make_data(n, args.D, rank=rank, world=world, seed=args.seed, dtype=dtype, device=device)
    xt, yt, ft = make_test(n_test, args.D, seed=args.seed, dtype=dtype, device=device)

    def model(solver, **kw):
        return KernelRidge(args.kernel, bandwidth=args.bandwidth, alpha=alpha, solver=solver, tol=args.tol,
                           max_iter=args.max_iter, n_landmarks=n_landmarks, random_state=args.seed,
                           debug=args.debug, verbose=args.verbose, **kw)

    kw = {"n_centers": n_centers} if args.solver == "nystrom" else {}
    if not args.no_warmup and device.type == "cuda":  # compile the kernels on a small problem first
        # 2048 rows on every rank (a rank-sharded 2048 would leave ranks > 0 empty: one chunk), and
        # the same 16 rows to predict on every rank (predict is collective).
        xw, yw = make_data(2048, args.D, seed=args.seed + 1 + rank, dtype=dtype, device=device)
        xq = make_test(16, args.D, seed=args.seed + 1, dtype=dtype, device=device)[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the ConvergenceWarning of max_iter=3
            KernelRidge(args.kernel, bandwidth=args.bandwidth, alpha=1.0, solver=args.solver if args.solver != "auto"
                        else "cg", n_landmarks=64, n_centers=64 if args.solver == "nystrom" else None,
                        random_state=0, max_iter=3, tol=1e-30).fit(xw, yw).predict(xq)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = model(args.solver, **kw).fit(x, y)
    for w in caught:
        say(f"warning: {w.message}")
    t0 = time.perf_counter()
    pred = m.predict(xt)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_pred = time.perf_counter() - t0
    mse_f = float(((pred.double() - ft.double()) ** 2).mean())
    mse_y = float(((pred.double() - yt.double()) ** 2).mean())
    res = "-" if m.residual_ is None else f"{m.residual_:.2e}"
    say(f"fit: {m.fit_time_:.2f} s ({m.solver_}), {m.n_iter_} iterations, relative residual {res}")
    if world == 1 and m.solver_ == "cg":  # the true residual ||y - (K + alpha I) c|| / ||y||: one more product
        r = y - m.predict(x) - alpha * m.dual_coef_[:, 0]
        say(f"true relative residual {float(r.double().norm() / y.double().norm()):.2e}")
    say(f"test MSE vs f {mse_f:.5f}, vs noisy y {mse_y:.5f} (noise floor 0.01), R^2 {m.score(xt, yt):.4f}, "
        f"predict {n_test} rows {t_pred:.3f} s")
    result = dict(model=m, fit_s=m.fit_time_, n_iter=m.n_iter_, residual=m.residual_, test_mse=mse_f,
                  test_mse_noisy=mse_y, n=n, world=world)
    if check_exact:
        del m
        e = KernelRidge(args.kernel, bandwidth=args.bandwidth, alpha=alpha, solver="cholesky").fit(x, y)
        pe = e.predict(xt)
        mse_e = float(((pe.double() - ft.double()) ** 2).mean())
        say(f"exact (cholesky): fit {e.fit_time_:.2f} s, test MSE vs f {mse_e:.5f}; "
            f"test error difference {abs(mse_f - mse_e) / mse_e * 100:.2f}%")
        result.update(exact_fit_s=e.fit_time_, exact_test_mse=mse_e)
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
