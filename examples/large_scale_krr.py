"""Kernel ridge regression at N = 1 000 000 without the N x N matrix, on one GPU or many.

    python examples/large_scale_krr.py                                 # N = 10^6, D = 8, Gaussian, cg
    python examples/large_scale_krr.py --solver nystrom --n-centers 20000
    torchrun --nproc_per_node=2 examples/large_scale_krr.py            # two GPUs (NCCL)
    python examples/large_scale_krr.py --quick -d                      # small, seconds on a CPU
    torchrun --nproc_per_node=2 examples/large_scale_krr.py --quick    # two CPU processes (gloo)
    torchrun --nproc_per_node=2 examples/large_scale_krr.py -N 1000000000 --solver nystrom --n-centers 20000
    python examples/large_scale_krr.py -N 1000000000 --solver nystrom --host-data --max-gpu-bytes 16e9

The data have a known answer: X uniform in [-1, 1]^D, y = f(X) + noise with a smooth f
(noise 0.1, so the best possible test MSE against the noisy y is 0.01, against f it is 0).
The training rows come in fixed chunks (16384 rows; 2^20 above N = 10^8; N / 64 below 2^18), each from its own
seed; rank r of R takes the r-th of R contiguous runs of chunks and generates only those, on its
own device (a CUDA generator on a GPU, the CPU one otherwise): the shards concatenated in rank
order are the same rows in the same order whatever the number of processes (for a given device
type), so KernelRidge's random_state picks the same centres and landmarks and the fit is the same,
and no rank ever holds more than its share.
--host-data keeps the rows in host memory (the estimator runs on the GPU, device=, streaming
row chunks when they do not fit or --max-gpu-bytes says so). Prints the fit
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

from _common import device_arg, parser

import kermac_like as km  # noqa: F401
from kermac_like.solvers import KernelRidge

CHUNK = 16384
CHUNK_BIG = 1 << 20  # above BIG_N rows: fewer generator seeds (a billion rows in 954 chunks)
BIG_N = 10**8


def target(x: torch.Tensor) -> torch.Tensor:
    """The smooth function to learn (uses the first 8 coordinates; D >= 8 is assumed)."""
    return (torch.sin(math.pi * (x[:, 0] + x[:, 1]) / 2) * torch.cos(math.pi * x[:, 2] / 2)
            + 0.5 * torch.tanh(x[:, 3] + x[:, 4] - x[:, 5]) + 0.25 * x[:, 6] * x[:, 7])


def chunk_rows(n: int) -> int:
    """Rows of one generator chunk: a function of n only (the data set does not depend on the number
    of ranks); small n is cut into 64 chunks so that up to 64 ranks each hold some rows (a rank without
    rows would only wait for the others)."""
    if n > BIG_N:
        return CHUNK_BIG
    return CHUNK if n >= 16 * CHUNK else max(1, -(-n // 64))


def make_data(n: int, d: int, *, rank: int = 0, world: int = 1, seed: int = 0, noise: float = 0.1,
              dtype=torch.float32, device="cpu", host: bool = False, pin: bool = False):
    """This rank's chunks of the n training rows: (X, y), each chunk generated in float64 on
    ``device`` and written into this rank's share (on the host with ``host``, pinned with ``pin``)."""
    device = torch.device(device)
    chunk = chunk_rows(n)
    chunks = -(-n // chunk)
    mine = list(range(rank * chunks // world, (rank + 1) * chunks // world))
    rows = [min(chunk, n - k * chunk) for k in mine]
    where = torch.device("cpu") if host else device
    x = torch.empty((sum(rows), d), dtype=dtype, device=where, pin_memory=pin and host and device.type == "cuda")
    y = torch.empty((sum(rows),), dtype=dtype, device=where, pin_memory=pin and host and device.type == "cuda")
    g = torch.Generator(device=device)
    at = 0
    for k, r in zip(mine, rows):
        g.manual_seed(seed * 1_000_003 + k)
        xc = torch.rand(r, d, dtype=torch.float64, generator=g, device=device) * 2 - 1
        yc = target(xc) + noise * torch.randn(r, dtype=torch.float64, generator=g, device=device)
        x[at:at + r].copy_(xc)
        y[at:at + r].copy_(yc)
        at += r
    return x, y


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
    p.add_argument("--host-data", action="store_true",
                   help="keep X, y in host memory; the estimator runs on the GPU (device=) and streams them")
    p.add_argument("--pin", action="store_true", help="with --host-data: the rows in pinned host memory")
    p.add_argument("--max-gpu-bytes", type=float, default=None,
                   help="nystrom's per-rank device memory limit (e.g. 16e9): rows past it are streamed")
    args = p.parse_args(argv)
    if args.D < 8:
        p.error("-D: the target function uses 8 coordinates; pass -D >= 8")
    rank, world, device = init_distributed()
    if args.device is not None and world == 1:
        device = device_arg(args.device, args.debug)
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

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_data = time.perf_counter()
    x, y = make_data(n, args.D, rank=rank, world=world, seed=args.seed, dtype=dtype, device=device,
                     host=args.host_data, pin=args.pin)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    share_gb = (x.numel() * x.element_size() + y.numel() * y.element_size()) / 1e9
    say(f"data: {x.shape[0]} rows on rank 0 ({share_gb:.2f} GB of X and y{' in host memory' if args.host_data else ''}),"
        f" generated in {time.perf_counter() - t_data:.2f} s")
    xt, yt, ft = make_test(n_test, args.D, seed=args.seed, dtype=dtype, device=device)

    def model(solver, **kw):
        return KernelRidge(args.kernel, bandwidth=args.bandwidth, alpha=alpha, solver=solver, tol=args.tol,
                           max_iter=args.max_iter, n_landmarks=n_landmarks, random_state=args.seed,
                           debug=args.debug, verbose=args.verbose, device=device,
                           max_gpu_bytes=None if args.max_gpu_bytes is None else int(args.max_gpu_bytes), **kw)

    kw = {"n_centers": n_centers} if args.solver in ("nystrom", "auto") else {}
    if not args.no_warmup and device.type == "cuda":  # compile the kernels on a small problem first
        # 2048 rows on every rank (a rank-sharded 2048 would leave ranks > 0 without rows, compiling
        # nothing: one chunk), and
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
    say(f"fit: {m.fit_time_:.2f} s ({m.solver_}), {m.n_iter_} iterations, relative residual {res}"
        + (f", data {m.data_mode_}" if hasattr(m, "data_mode_") else ""))
    if world == 1 and m.solver_ == "cg":  # the true residual ||y - (K + alpha I) c|| / ||y||: one more product
        r = y - m.predict(x) - alpha * m.dual_coef_[:, 0]
        say(f"true relative residual {float(r.double().norm() / y.double().norm()):.2e}")
    r2 = m.score(xt, yt)
    say(f"test MSE vs f {mse_f:.5f}, vs noisy y {mse_y:.5f} (noise floor 0.01), R^2 {r2:.4f}, "
        f"predict {n_test} rows {t_pred:.3f} s")
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    peaks = [peak]
    if world > 1:
        import torch.distributed as dist

        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
    if device.type == "cuda":
        say("peak GPU memory per rank: " + ", ".join(f"rank {r} {p:.2f} GB" for r, p in enumerate(peaks))
            + f" (rank 0's share of X and y {share_gb:.2f} GB{', in host memory' if args.host_data else ''})")
    result = dict(model=m, fit_s=m.fit_time_, n_iter=m.n_iter_, residual=m.residual_, test_mse=mse_f,
                  test_mse_noisy=mse_y, n=n, world=world, r2=r2, peak_gpu_gb=peaks,
                  data_mode=getattr(m, "data_mode_", None))
    if check_exact and (args.check_exact or n <= 50_000):
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
