"""Solve kernel ridge regression systems and eigendecompose kernel matrices.

Builds a batch of SPD Laplace kernel matrices K = exp(-||x_i - x_j|| / bw) + reg I,
then runs kermac_like.linalg.solve_cholesky, solve_lu and eigh on them and the
same with torch.linalg, printing residuals, reconstruction errors and timings.

    python examples/linalg.py              # GPU defaults: L=10, N=5000, C=16
    python examples/linalg.py --quick -d   # tiny sizes, seconds on a CPU, debug log

CPU tensors take the torch.linalg reference path of kermac_like.linalg.
"""

import argparse
import logging
import pathlib
import sys
import time

import torch

try:
    from kermac_like import linalg
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from kermac_like import linalg
from _common import device_arg  # noqa: E402


def laplace_matrices(L, n, d, bandwidth, reg, dtype, device, generator):
    """(L, n, n) SPD Laplace kernel matrices on random points of dimension d."""
    x = torch.randn(L, n, d, device=device, dtype=dtype, generator=generator)
    # exact distances (no matmul expansion) keep the matrix symmetric to the last bit
    k = torch.exp(-torch.cdist(x, x, compute_mode="donot_use_mm_for_euclid_dist") / bandwidth)
    k.diagonal(dim1=-2, dim2=-1).add_(reg)
    return k


def solve_residual(a, x, b):
    """max over entries of ||A x_c - b_c|| / ||b||, rows of b the right-hand sides."""
    r = (x.double() @ a.double().mT - b.double()).flatten(1).norm(dim=1)
    return (r / b.double().flatten(1).norm(dim=1)).max().item()


def eig_residual(a, w, v):
    """max over entries of ||A V - V diag(w)|| / ||A||."""
    a, w, v = a.double(), w.double(), v.double()
    r = (a @ v - v * w.unsqueeze(-2)).flatten(1).norm(dim=1)
    return (r / a.flatten(1).norm(dim=1)).max().item()


def timed(fn, device):
    """Run fn once; return (result, milliseconds) measured with CUDA events or perf_counter."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end)
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def torch_cholesky_solve(a, b):
    return torch.cholesky_solve(b.mT, torch.linalg.cholesky(a)).mT


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-d", "--debug", action="store_true", help="log kermac_like at DEBUG level")
    p.add_argument("--quick", action="store_true", help="tiny sizes (seconds on a CPU)")
    p.add_argument("-L", "--batch", type=int, default=None, help="batch of matrices (default 10, quick 3)")
    p.add_argument("-N", "--size", type=int, default=None, help="matrix size (default 5000, quick 200)")
    p.add_argument("-C", "--rhs", type=int, default=16, help="right-hand sides per matrix")
    p.add_argument("--dim", type=int, default=8, help="dimension of the random points")
    p.add_argument("--bandwidth", type=float, default=1.0)
    p.add_argument("--reg", type=float, default=1e-2, help="ridge added to the diagonal")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-eigh", action="store_true", help="skip the (slow) eigendecompositions")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if args.debug:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        logging.getLogger("kermac_like").setLevel(logging.DEBUG)

    device = device_arg(args.device, args.debug)
    dtype = getattr(torch, args.dtype)
    L = args.batch if args.batch is not None else (3 if args.quick else 10)
    n = args.size if args.size is not None else (200 if args.quick else 5000)
    c = args.rhs
    gen = torch.Generator(device=device).manual_seed(args.seed)

    a = laplace_matrices(L, n, args.dim, args.bandwidth, args.reg, dtype, device, gen)
    b = torch.randn(L, c, n, device=device, dtype=dtype, generator=gen)
    print(f"device {device}, {args.dtype}, L={L} N={n} C={c}, Laplace kernel bw={args.bandwidth} reg={args.reg}")

    rows = []

    def run(name, ours, theirs, error):
        ours()  # warm-up: handles, workspaces, caches
        theirs()
        out_ours, ms_ours = timed(ours, device)
        out_theirs, ms_theirs = timed(theirs, device)
        rows.append((name, ms_ours, ms_theirs, error(out_ours), error(out_theirs)))
        return out_ours

    x, finfo, sinfo = run(
        "solve_cholesky",
        lambda: linalg.solve_cholesky(a, b, debug=args.debug),
        lambda: (torch_cholesky_solve(a, b),),
        lambda out: solve_residual(a, out[0], b),
    )
    print(f"solve_cholesky factor_info {finfo.tolist()} solve_info {sinfo.tolist()}")
    x, finfo, sinfo = run(
        "solve_lu",
        lambda: linalg.solve_lu(a, b, debug=args.debug),
        lambda: (torch.linalg.solve(a, b.mT).mT,),
        lambda out: solve_residual(a, out[0], b),
    )
    print(f"solve_lu       factor_info {finfo.tolist()} solve_info {sinfo.tolist()}")
    if not args.no_eigh:
        w, v, info = run(
            "eigh",
            lambda: linalg.eigh(a, debug=args.debug),
            lambda: torch.linalg.eigh(a),
            lambda out: eig_residual(a, out[0], out[1]),
        )
        print(f"eigh           info {info.tolist()}")

    # A failed entry does not stop the batch: it is reported and its solution is NaN.
    bad = a.clone()
    bad[0] = -bad[0]
    x, finfo, _ = linalg.solve_cholesky(bad, b)
    print(f"one non-SPD entry: factor_info {finfo.tolist()}, "
          f"NaN rows per entry {torch.isnan(x).any(dim=-1).sum(dim=-1).tolist()}")

    unit = "ms (CUDA events)" if device.type == "cuda" else "ms (perf_counter)"
    print(f"\n| routine | kermac_like {unit} | torch.linalg {unit} | residual ours | residual torch |")
    print("| --- | --- | --- | --- | --- |")
    for name, mo, mt, eo, et in rows:
        print(f"| {name} | {mo:.1f} | {mt:.1f} | {eo:.2e} | {et:.2e} |")


if __name__ == "__main__":
    main()
