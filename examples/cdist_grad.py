"""kermac_like.cdist_grad: the gradient contraction of cdist, as used by RFMs.

    python examples/cdist_grad.py -d              # GPU defaults: L=2 K=5000 M=5000 N=768 O=16, p=2
    python examples/cdist_grad.py -p 1.3
    python examples/cdist_grad.py --quick -d      # tiny sizes, seconds on a CPU

Computes, for every batch entry l,

    out[o, n, m] = sum_k c[o,k] a[k,m] sgn(d[n,m] - b[n,k]) |d[n,m] - b[n,k]|^(p-1)

with a (K, M) the kernel weights, b (N, K) the data (one column per training
point), c (O, K) the coefficients and d (N, M) the points where the gradient
is taken (see examples/rfm.py for the full story).  Checks a slice against a
float64 evaluation of that formula and, for p = 2 (where the sum splits into
two matrix products), times it beside the best torch formulation.
"""

import torch

from _common import fmt_ms, median_ms, parser, rel_err, setup, sync

import kermac_like as km


def torch_cdist_grad_p2(a, b, c, d):
    """The p = 2 case with torch matrix products (no K x N x M temporary):
    out[o,n,m] = d[n,m] (c a)[o,m] - sum_k (c[o,k] b[n,k]) a[k,m]."""
    O, N, K = c.shape[-2], b.shape[-2], c.shape[-1]
    ca = c @ a  # (..., O, M)
    cb = (c.unsqueeze(-2) * b.unsqueeze(-3)).reshape(*c.shape[:-2], O * N, K)  # (..., O*N, K)
    out = (cb @ a).unflatten(-2, (O, N))  # (..., O, N, M)
    return out.neg_().addcmul_(d.unsqueeze(-3), ca.unsqueeze(-2))


def formula_float64(a, b, c, d, p, n_rows, m_cols):
    """The definition, evaluated literally in float64 for out[..., :, :n_rows, :m_cols]."""
    a, b, c, d = a.double(), b.double(), c.double(), d.double()
    a, b, d = a[..., :m_cols], b[..., :n_rows, :], d[..., :n_rows, :m_cols]
    diff = d.unsqueeze(-2) - b.unsqueeze(-1)  # (..., n, K, m)
    phi = torch.sign(diff) * diff.abs().pow(p - 1.0)
    return torch.einsum("...ok,...km,...nkm->...onm", c, a, phi)


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("-p", type=float, default=2.0, help="p of the norm being differentiated")
    p.add_argument("-L", type=int, default=2, help="batch size (0: no batch mode)")
    p.add_argument("-K", type=int, default=5000, help="contracted mode (training points)")
    p.add_argument("-M", type=int, default=5000, help="evaluation points")
    p.add_argument("-N", type=int, default=768, help="features")
    p.add_argument("-O", type=int, default=16, help="outputs (coefficient rows)")
    args = p.parse_args(argv)
    if args.quick:
        args.L, args.K, args.M, args.N, args.O = 2, 200, 160, 16, 3
    device = setup(args)

    L = (args.L,) if args.L > 0 else ()
    K, M, N, O = args.K, args.M, args.N, args.O
    a = torch.rand(*L, K, M, device=device)
    b = torch.randn(*L, N, K, device=device)
    c = torch.randn(*L, O, K, device=device)
    d = torch.randn(*L, N, M, device=device)
    print(f"cdist_grad p={args.p}: a {tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}, d {tuple(d.shape)}")

    out = km.cdist_grad(a, b, c, d, p=args.p, debug=args.debug)
    sync(device)
    print(f"out {tuple(out.shape)} {out.dtype}, out[..., 0, :2, :3] =\n{out[..., 0, :2, :3].cpu()}")

    n_rows, m_cols = min(N, 8), min(M, 256)
    ref = formula_float64(a, b, c, d, args.p, n_rows, m_cols)
    e_ours = rel_err(out[..., :n_rows, :m_cols], ref)
    line = f"relative error vs float64 (out[..., :{n_rows}, :{m_cols}]): kermac_like {e_ours:.2e}"
    if args.p == 2:
        tout = torch_cdist_grad_p2(a, b, c, d)
        line += f", torch matmul formula {rel_err(tout[..., :n_rows, :m_cols], ref):.2e}"
        del tout
    print(line)
    del out

    t_ours = median_ms(lambda: km.cdist_grad(a, b, c, d, p=args.p), device,
                       repeats=args.repeats, warmup=args.warmup)
    line = f"time (median of {args.repeats}): kermac_like.cdist_grad {fmt_ms(t_ours)}"
    if args.p == 2:
        t_torch = median_ms(lambda: torch_cdist_grad_p2(a, b, c, d), device,
                            repeats=args.repeats, warmup=args.warmup)
        line += f", torch matmul formula {fmt_ms(t_torch)}, speed-up {t_torch / t_ours:.2f}x"
    else:
        line += " (torch has no fused formulation for p != 2)"
    print(line)
    if e_ours > 1e-4:
        raise SystemExit(f"error {e_ours:.2e} is too large")


if __name__ == "__main__":
    main()
