"""kermac_like.cdist as a drop-in for torch.cdist: p-norm distances between rows.

    python examples/cdist.py -p 1.0 -d        # GPU defaults: 10000 x 10000 x 1024
    python examples/cdist.py -p 1.3 -M 30000 -N 30000 -K 1024
    python examples/cdist.py --quick -d       # tiny sizes, seconds on a CPU

Computes out[m, n] = (sum_k |x1[m,k] - x2[n,k]|^p)^(1/p) (or the sum alone
with --skip-epilogue), checks the first rows against a float64 computation and
times it beside torch.cdist.  -d shows the JIT compilation and cache activity.
"""

import torch

from _common import fmt_ms, median_ms, parser, rel_err, setup, sync

import kermac_like as km


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("-p", type=float, default=1.0, help="the norm's p (1 and 2 have pow-free kernels)")
    p.add_argument("-M", type=int, default=10000, help="rows of x1")
    p.add_argument("-N", type=int, default=10000, help="rows of x2")
    p.add_argument("-K", type=int, default=1024, help="features")
    p.add_argument("-B", "--batch", type=int, default=0,
                   help="if > 0, x1 gets a leading batch of this size and x2 broadcasts over it")
    p.add_argument("--skip-epilogue", action="store_true", help="return sum |x-y|^p without the 1/p root")
    p.add_argument("--check-rows", type=int, default=256, help="rows of x1 checked against float64")
    args = p.parse_args(argv)
    if args.quick:
        args.M, args.N, args.K = 200, 180, 16
    device = setup(args)

    shape1 = (args.batch, args.M, args.K) if args.batch > 0 else (args.M, args.K)
    x1 = torch.randn(shape1, device=device)
    x2 = torch.randn(args.N, args.K, device=device)
    print(f"cdist p={args.p}: x1 {tuple(x1.shape)}, x2 {tuple(x2.shape)}, skip_epilogue={args.skip_epilogue}")

    out = km.cdist(x1, x2, p=args.p, skip_epilogue=args.skip_epilogue, debug=args.debug)
    sync(device)
    print(f"out {tuple(out.shape)} {out.dtype}, out[..., :2, :3] =\n{out[..., :2, :3].cpu()}")

    # Error on a slice: the first rows of x1 against every row of x2, in float64.
    r = min(args.check_rows, args.M)
    ref = torch.cdist(x1[..., :r, :].double(), x2.double(), p=args.p,
                      compute_mode="donot_use_mm_for_euclid_dist")
    if args.skip_epilogue:
        ref = ref.pow(args.p)
    tout = torch.cdist(x1, x2, p=args.p)
    if args.skip_epilogue:
        tout = tout.pow(args.p)
    e_ours = rel_err(out[..., :r, :], ref)
    e_torch = rel_err(tout[..., :r, :], ref)
    print(f"relative error vs float64 (first {r} rows): kermac_like {e_ours:.2e}, torch.cdist {e_torch:.2e}")
    del out, tout

    def ours():
        return km.cdist(x1, x2, p=args.p, skip_epilogue=args.skip_epilogue)

    def theirs():
        t = torch.cdist(x1, x2, p=args.p)
        return t.pow_(args.p) if args.skip_epilogue else t

    t_ours = median_ms(ours, device, repeats=args.repeats, warmup=args.warmup)
    t_torch = median_ms(theirs, device, repeats=args.repeats, warmup=args.warmup)
    print(f"time (median of {args.repeats}): kermac_like.cdist {fmt_ms(t_ours)}, torch.cdist {fmt_ms(t_torch)}, "
          f"speed-up {t_torch / t_ours:.2f}x")
    if e_ours > 1e-4:
        raise SystemExit(f"error {e_ours:.2e} is too large")


if __name__ == "__main__":
    main()
