"""Batched and broadcast hyper-parameters in one kernel launch.

    python examples/broadcast_kernel.py -d          # GPU defaults: L=4 bandwidths, B=8 data batches
    python examples/broadcast_kernel.py --quick -d  # tiny sizes, seconds on a CPU

Hyper-parameters of km.run_kernel (p, bandwidth, regularization) may be
tensors; their shapes broadcast against the data's batch modes like any torch
operands.  With data x (B, M, K), y (B, N, K) and a bandwidth tensor of shape
(L, 1), one call computes all L x B kernel matrices, out (L, B, M, N): a
hyper-parameter sweep without a Python loop.  Each case is checked against a
loop of single calls with scalar hyper-parameters.
"""

import torch

from _common import fmt_ms, median_ms, parser, setup, sync

import kermac_like as km


def loop_reference(desc, x, y, out_shape, *, p=None, bandwidth=None, regularization=None):
    """The same matrices, one run_kernel call per (l, b) with float hyper-parameters."""
    L, B = out_shape[0], out_shape[1]
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)

    # the broadcast value of each hyper-parameter for entry (l, b), read to the host once
    host = {k: (None if v is None else v.expand(L, B).tolist())
            for k, v in dict(p=p, bandwidth=bandwidth, regularization=regularization).items()}

    def pick(name, l, b):
        v = host[name]
        return None if v is None else v[l][b]

    for l in range(L):
        for b in range(B):
            xb = x[b] if x.dim() == 3 else x
            yb = y[b] if y.dim() == 3 else y
            out[l, b] = km.run_kernel(desc, xb, yb, p=pick("p", l, b), bandwidth=pick("bandwidth", l, b),
                                      regularization=pick("regularization", l, b))
    return out


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("-L", type=int, default=4, help="number of bandwidths (and regularisations)")
    p.add_argument("-B", type=int, default=8, help="data batch")
    p.add_argument("-M", type=int, default=2048)
    p.add_argument("-N", type=int, default=2048)
    p.add_argument("-K", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:
        args.L, args.B, args.M, args.N, args.K = 3, 2, 64, 48, 8
    device = setup(args)
    L, B, M, N, K = args.L, args.B, args.M, args.N, args.K

    x = torch.randn(B, M, K, device=device)
    y = torch.randn(B, N, K, device=device)
    y_shared = torch.randn(N, K, device=device)
    scale = (2.0 * K) ** 0.5  # typical l2 distance between rows of standard normal data
    bandwidth = scale * torch.logspace(-0.5, 0.5, L, device=device).reshape(L, 1)  # (L, 1)
    regularization = torch.logspace(-3, -1, L, device=device).reshape(L, 1)  # (L, 1)
    per_batch_p = torch.linspace(1.0, 2.0, B, device=device)  # (B,)
    p_scale = K ** (1 / 1.5) * 1.2  # a p-norm bandwidth in the bulk of the distances

    cases = [
        ("laplace_l2: bandwidth (L,1) and regularization (L,1) over data (B,)", km.preset("laplace_l2"),
         x, y, dict(bandwidth=bandwidth, regularization=regularization)),
        ("laplace_p: p (B,) per data batch, bandwidth (L,1)", km.preset("laplace_p"),
         x, y, dict(p=per_batch_p, bandwidth=bandwidth * (p_scale / scale))),
        ("gaussian_l2: data x (B,M,K) against a shared y (N,K), bandwidth (L,1)", km.preset("gaussian_l2"),
         x, y_shared, dict(bandwidth=bandwidth)),
    ]
    print(f"bandwidths {[round(v, 3) for v in bandwidth.flatten().tolist()]}, "
          f"regularizations {[round(v, 4) for v in regularization.flatten().tolist()]}, "
          f"per-batch p {[round(v, 3) for v in per_batch_p.tolist()]}")
    worst = 0.0
    for title, desc, a, b, hyper in cases:
        print(f"\n{title}")
        out = km.run_kernel(desc, a, b, debug=args.debug, **hyper)
        sync(device)
        ref = loop_reference(desc, a, b, tuple(out.shape), **hyper)
        diff = (out - ref).abs().max().item()
        worst = max(worst, diff)
        print(f"  one call: out {tuple(out.shape)}; max |batched - loop of {L * B} single calls| = {diff:.2e}; "
              f"kernel values in [{out.min().item():.3g}, {out.max().item():.3g}]")
        del out, ref
        t_batched = median_ms(lambda: km.run_kernel(desc, a, b, **hyper), device,
                              repeats=args.repeats, warmup=args.warmup)
        t_loop = median_ms(lambda: loop_reference(desc, a, b, (L, B, M, N), **hyper), device,
                           repeats=args.repeats, warmup=args.warmup)
        print(f"  time: batched {fmt_ms(t_batched)}, loop {fmt_ms(t_loop)} ({t_loop / t_batched:.1f}x)")
    print(f"\nworst difference batched vs loop: {worst:.2e}")
    if worst > 1e-5:
        raise SystemExit("batched and looped results differ")


if __name__ == "__main__":
    main()
