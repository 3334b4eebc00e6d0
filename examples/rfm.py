"""A Recursive Feature Machine: kernel ridge regression that learns its own metric.

    python examples/rfm.py -d              # GPU defaults: n=8000 training points, D=20
    python examples/rfm.py --quick -d      # tiny sizes, seconds on a CPU

The target depends on 2 of D coordinates (y = x_0 * x_1).  Each iteration

    1. features      u = x @ Mhalf                              (Mhalf = M^(1/2), M starts as I)
    2. kernel        K = exp(-||u_i - u_j|| / bw) + reg I       km.run_kernel, regularisation fused
    3. solve         alpha = K^-1 y                             km.linalg.solve_cholesky
    4. gradients     grad_x f at every training point           km.cdist_grad (p = 2)
    5. AGOP          M = mean_j G_j G_j^T  (D x D), Mhalf = sqrtm(M)   km.linalg.eigh

and the test error should fall as M concentrates on the two relevant coordinates.

Gradient of f(z) = sum_i alpha_i exp(-||(z - x_i) Mhalf|| / bw) in terms of
cdist_grad (out[o,n,m] = sum_k c[o,k] a[k,m] (d[n,m] - b[n,k]) for p = 2), with
u_i = x_i Mhalf, v_j = z_j Mhalf:

    grad_v f(v_j) = -(1/bw) sum_i alpha_i [k(u_i, v_j) / ||v_j - u_i||] (v_j - u_i)
    k (contracted)  -> training point i      a[i, j] = k(u_i, v_j) / ||v_j - u_i||  (0 where the distance is 0)
    n               -> feature coordinate    b[f, i] = u_i[f]        (b = u^T)
    o               -> output                c[o, i] = alpha[o, i]
    m               -> evaluation point j    d[f, j] = v_j[f]        (d = v^T)

so grad_v f = -(1/bw) out^T, and by the chain rule grad_z f = grad_v f @ Mhalf^T.
"""

import time

import torch

from _common import fmt_ms, parser, setup, sync

import kermac_like as km


def laplace_gradients(x, alpha, z, mhalf, bandwidth, *, debug=False):
    """Gradients of f_o(z) = sum_i alpha[o, i] exp(-||(z - x_i) @ mhalf|| / bandwidth) w.r.t. z.

    x (n, D) training points, alpha (O, n) coefficients, z (m, D) evaluation
    points, mhalf (D, D).  Returns (O, m, D).  Where z_j == x_i the term's
    gradient is taken as 0 (the Laplace kernel has a cusp there).
    """
    u = x @ mhalf  # (n, D)
    v = z @ mhalf  # (m, D)
    kmat = km.run_kernel(km.preset("laplace_l2"), u, v, bandwidth=bandwidth, debug=debug)  # (n, m)
    # exact differences (no |u|^2 + |v|^2 - 2uv expansion): a point's distance to itself is 0
    dist = km.cdist(u, v, compute_mode="donot_use_mm_for_euclid_dist", debug=debug)  # (n, m)
    # where the distance is (near) 0 the (v_j - u_i) factor is 0 too: any finite weight will do
    tiny = 1e-6 * bandwidth
    a = torch.where(dist > tiny, kmat / dist.clamp_min(tiny), torch.zeros((), dtype=kmat.dtype, device=kmat.device))
    out = km.cdist_grad(a, u.mT.contiguous(), alpha.contiguous(), v.mT.contiguous(), p=2.0, debug=debug)  # (O, D, m)
    grad_v = out.mT * (-1.0 / bandwidth)  # (O, m, D)
    return grad_v @ mhalf.mT


def agop(grads):
    """Average gradient outer product over points and outputs: (O, m, D) -> (D, D)."""
    g = grads.reshape(-1, grads.shape[-1])
    return (g.mT @ g) / grads.shape[1]


def sqrtm_psd(m, debug=False):
    """Symmetric square root with km.linalg.eigh (negative round-off eigenvalues clipped)."""
    w, v, _ = km.linalg.eigh(m.contiguous(), debug=debug)
    return (v * w.clamp_min(0).sqrt()) @ v.mT


def make_task(n, d, device, generator):
    x = torch.randn(n, d, device=device, generator=generator)
    y = x[:, 0] * x[:, 1]
    return x, y[:, None]  # (n, d), (n, 1)


def fit_predict(x, y, xt, mhalf, bandwidth, reg, debug):
    """Kernel ridge regression with the metric mhalf: (alpha (1, n), test predictions (m, 1))."""
    u, ut = x @ mhalf, xt @ mhalf
    kmat = km.run_kernel(km.preset("laplace_l2"), u, u, bandwidth=bandwidth, regularization=reg, debug=debug)
    alpha, info, _ = km.linalg.solve_cholesky(kmat, y.mT.contiguous(), overwrite_a=True, debug=debug)  # (1, n)
    ktest = km.run_kernel(km.preset("laplace_l2"), ut, u, bandwidth=bandwidth, debug=debug)  # (m, n)
    return alpha, ktest @ alpha.mT, info


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
    f32 = dict(dtype=torch.float32, device=device)
    got = laplace_gradients(x.to(**f32), alpha.to(**f32), z.to(**f32), mhalf.to(**f32), bw, debug=debug)
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=8000, help="training points")
    p.add_argument("--n-test", type=int, default=4000)
    p.add_argument("-D", type=int, default=20, help="input dimension (2 coordinates matter)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--bandwidth", type=float, default=10.0)
    p.add_argument("--reg", type=float, default=1e-3)
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.n_test, args.iters = 400, 300, 3
    device = setup(args)

    err = gradient_check(device, args.debug)
    print(f"gradient check (cdist_grad mapping vs torch.autograd, float64, tiny case): relative error {err:.2e}")
    if err > 1e-4:
        raise SystemExit("the cdist_grad gradient does not match autograd")

    gen = torch.Generator(device=device).manual_seed(args.seed)
    x, y = make_task(args.n, args.D, device, gen)
    xt, yt = make_task(args.n_test, args.D, device, gen)
    D = args.D
    mhalf = torch.eye(D, device=device)
    print(f"task: y = x_0 * x_1 with x in R^{D}; n={args.n} train, {args.n_test} test; "
          f"bandwidth {args.bandwidth}, reg {args.reg}")
    print(f"{'iter':>4s} {'test MSE':>10s} {'rel. MSE':>9s} {'M mass on x0,x1':>16s} {'time':>10s}")
    first = last = None
    for it in range(args.iters + 1):
        sync(device)
        t0 = time.perf_counter()
        alpha, pred, info = fit_predict(x, y, xt, mhalf, args.bandwidth, args.reg, args.debug)
        mse = ((pred - yt) ** 2).mean().item()
        rel = mse / yt.var().item()
        m = mhalf @ mhalf
        mass = (m[0, 0] + m[1, 1]).item() / m.diagonal().sum().item()
        if it < args.iters:
            grads = laplace_gradients(x, alpha, x, mhalf, args.bandwidth, debug=args.debug)  # (1, n, D)
            m_new = agop(grads)
            m_new = m_new * (D / m_new.diagonal().sum())  # keep the trace at D: distances stay in the bandwidth's range
            mhalf = sqrtm_psd(m_new, args.debug)
        sync(device)
        dt = (time.perf_counter() - t0) * 1e3
        if int(info.item()) != 0:
            print(f"warning: Cholesky info {int(info.item())} at iteration {it}")
        print(f"{it:4d} {mse:10.5f} {rel:9.4f} {mass:16.3f} {fmt_ms(dt):>10s}")
        first = rel if first is None else first
        last = rel
    top = torch.linalg.eigh((mhalf @ mhalf).double().cpu())[1][:, -2:]  # the two leading eigen-directions
    print(f"weight of the two leading eigen-directions of M on (x0, x1): "
          f"{top[:2].pow(2).sum().item() / 2:.3f} (1 = exactly those coordinates)")
    print(f"relative test MSE: {first:.4f} (plain Laplace kernel) -> {last:.4f} after {args.iters} RFM iterations")


if __name__ == "__main__":
    main()
