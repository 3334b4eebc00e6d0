"""Gaussian kernel sums on a point cloud without the kernel matrix (KeOps' benchmark (a)).

    python examples/kernel_matvec.py -d                 # N = M = 10^6 points in 3-D on a GPU
    python examples/kernel_matvec.py --n 200000 --dim 256 --columns 16
    python examples/kernel_matvec.py --quick -d         # seconds on a CPU

    out[m, c] = sum_n exp(-|x_m - y_n|^2 / (2 bw^2)) v[n, c]      km.kernel_matvec

At N = M = 10^6 the kernel matrix would take 4 TB in float32; kernel_matvec keeps memory
linear in N + M. The example checks a slice of rows against torch done in row blocks
(cdist, exp, matmul: what a user writes) and against float64, and prints time and peak
memory of both.
"""

import math

import torch

from _common import fmt_ms, median_ms, parser, rel_err, setup, sync

import kermac_like as km
from kermac_like.matvec import matvec_reference, prepare_matvec


def torch_blocked(x, y, v, bw, block=4096):
    out = torch.empty(x.shape[0], v.shape[1], dtype=x.dtype, device=x.device)
    for m0 in range(0, x.shape[0], block):
        k = torch.cdist(x[m0:m0 + block], y).square_().mul_(-0.5 / (bw * bw)).exp_()
        torch.matmul(k, v, out=out[m0:m0 + block])
    return out


def peak_mb(fn, device):
    if device.type != "cuda":
        return None
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000, help="points in x and in y")
    p.add_argument("--dim", type=int, default=3)
    p.add_argument("--columns", type=int, default=1, help="columns of v")
    p.add_argument("--bandwidth", type=float, default=None, help="default: 1 (D=3) or sqrt(D)")
    p.add_argument("--check-rows", type=int, default=256, help="rows compared with torch and float64")
    args = p.parse_args()
    device = setup(args)
    n = min(args.n, 3000) if args.quick or device.type != "cuda" else args.n
    D, C = args.dim, args.columns
    bw = args.bandwidth or (1.0 if D <= 3 else math.sqrt(D))
    desc = km.preset("gaussian_l2")
    x = torch.randn(n, D, device=device)
    y = torch.randn(n, D, device=device)
    v = torch.rand(n, C, device=device)
    print(f"Gaussian kernel sums: {n} x {n} points in {D}-D, {C} column(s), bandwidth {bw:g} "
          f"(the matrix would take {n * n * 4 / 1e9:.3g} GB)")

    out = km.kernel_matvec(desc, x, y, v, bandwidth=bw, debug=args.debug)
    t = median_ms(lambda: km.kernel_matvec(desc, x, y, v, bandwidth=bw, out=out), device,
                  repeats=args.repeats, warmup=args.warmup)
    mem = peak_mb(lambda: km.kernel_matvec(desc, x, y, v, bandwidth=bw, out=out), device)
    r = min(args.check_rows, n)
    t_torch_rows = median_ms(lambda: torch_blocked(x[:r], y, v, bw), device, repeats=1, warmup=0)
    mem_torch = peak_mb(lambda: torch_blocked(x, y, v, bw), device) if n <= 200_000 else None
    call = prepare_matvec(desc, x[:r].double(), y.double(), v.double(), bandwidth=bw)
    ref = matvec_reference(call)
    ours_err = rel_err(out[:r], ref)
    torch_err = rel_err(torch_blocked(x[:r], y, v, bw), ref)
    est = t_torch_rows * n / r
    print(f"kernel_matvec: {fmt_ms(t)} ({n * n / t / 1e6:.3g} G pairs/s)"
          + (f", peak extra GPU memory {mem:.1f} MB" if mem is not None else ""))
    print(f"torch in row blocks of 4096: {fmt_ms(t_torch_rows)} for {r} rows, about {fmt_ms(est)} for all"
          + (f", peak extra memory {mem_torch:.0f} MB" if mem_torch is not None else ""))
    print(f"relative error vs float64 on {r} rows: kernel_matvec {ours_err:.2e}, torch {torch_err:.2e}")
    assert ours_err < 1e-5, ours_err


if __name__ == "__main__":
    main()
