"""The debiased Sinkhorn divergence between two point clouds, on kernel_logsumexp alone.

    python examples/sinkhorn.py -d                   # N = M = 10^5 points in 3-D on a GPU
    python examples/sinkhorn.py --n 1000000          # 10^6 points
    python examples/sinkhorn.py --quick -d           # seconds on a CPU

With the cost C(x, y) = |x - y|^2 / 2 and entropy eps, the dual potentials of entropic optimal
transport are soft-minima, each one kernel_logsumexp of the Gaussian kernel exp(-C / eps)
(bandwidth sqrt(eps)) with the other side's potential in the log-weights:

    f_i = -eps log sum_j exp(log b_j + g_j / eps - C(x_i, y_j) / eps)

The symmetric updates run with eps-scaling (eps from the clouds' squared diameter down to
blur^2, GeomLoss' schedule) and the divergence is S = <a, f_ab - f_aa> + <b, g_ab - g_bb>. At
a size where the dense problem fits, the transport costs <P, |x - y|^2> of the three plans are
checked against POT's log-domain Sinkhorn (``ot.sinkhorn2``, method sinkhorn_log).
"""

import math
import time

import torch

from _common import parser, setup, sync

import kermac_like as km

try:
    import ot
except ImportError:  # an optional extra: the divergence still runs
    ot = None

GAUSS = km.preset("gaussian_l2")


def softmin(eps, x, y, h, debug=False):
    """-eps log sum_j exp(h_j - |x_i - y_j|^2 / (2 eps)) for every i: one kernel_logsumexp."""
    return -eps * km.kernel_logsumexp(GAUSS, x, y, h, bandwidth=math.sqrt(eps), debug=debug)


def schedule(x, y, blur, scaling):
    diameter = float(torch.cat([x, y]).amax(0).sub(torch.cat([x, y]).amin(0)).norm())
    eps, out = diameter ** 2, []
    while eps > blur ** 2:
        out.append(eps)
        eps *= scaling ** 2
    return out + [blur ** 2]


def potentials(x, y, a, b, blur, scaling, debug=False, extra=0):
    """The debiased problem's four potentials (f_ab, g_ab, f_aa, g_bb) at eps = blur^2 (``extra``
    more averaged updates at the target eps: towards the converged solution)."""
    la, lb = a.log(), b.log()
    eps_list = schedule(x, y, blur, scaling)
    e = eps_list[0]
    f_ab, g_ab = softmin(e, x, y, lb, debug), softmin(e, y, x, la)
    f_aa, g_bb = softmin(e, x, x, la), softmin(e, y, y, lb)
    for e in eps_list + [eps_list[-1]] * extra:  # symmetric, averaged updates
        ft_ab, gt_ab = softmin(e, x, y, lb + g_ab / e), softmin(e, y, x, la + f_ab / e)
        ft_aa, gt_bb = softmin(e, x, x, la + f_aa / e), softmin(e, y, y, lb + g_bb / e)
        f_ab, g_ab = 0.5 * (f_ab + ft_ab), 0.5 * (g_ab + gt_ab)
        f_aa, g_bb = 0.5 * (f_aa + ft_aa), 0.5 * (g_bb + gt_bb)
    e = eps_list[-1]  # a last full update at the target eps
    f_ab, g_ab = softmin(e, x, y, lb + g_ab / e), softmin(e, y, x, la + f_ab / e)
    f_aa, g_bb = softmin(e, x, x, la + f_aa / e), softmin(e, y, y, lb + g_bb / e)
    return f_ab, g_ab, f_aa, g_bb, len(eps_list)


def divergence(x, y, a, b, blur, scaling, debug=False, extra=0):
    f_ab, g_ab, f_aa, g_bb, steps = potentials(x, y, a, b, blur, scaling, debug, extra)
    return float((a * (f_ab - f_aa)).sum() + (b * (g_ab - g_bb)).sum()), (f_ab, g_ab, f_aa, g_bb), steps


def plan_cost(x, y, a, b, f, g, eps):
    """<P, |x - y|^2> of the plan P_ij = a_i b_j exp((f_i + g_j - |x_i - y_j|^2 / 2) / eps) (dense)."""
    m = torch.cdist(x.double(), y.double()) ** 2
    p = a.double()[:, None] * b.double()[None] * torch.exp((f.double()[:, None] + g.double()[None] - m / 2) / eps)
    return float((p * m).sum())


def check_against_pot(device, args):
    if ot is None:
        print("POT is not installed: comparison skipped")
        return
    n = 300
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randn(n + 50, 3, generator=g, dtype=torch.float64) * 0.7 + 0.5
    a, b = torch.full((n,), 1.0 / n, dtype=torch.float64), torch.full((n + 50,), 1.0 / (n + 50), dtype=torch.float64)
    blur = 0.5
    eps = blur ** 2
    _, (f_ab, g_ab, f_aa, g_bb), steps = divergence(x.to(device), y.to(device), a.to(device), b.to(device), blur,
                                                    0.9, extra=300)  # converged, as POT's is
    f_ab, g_ab, f_aa, g_bb = (t.cpu() for t in (f_ab, g_ab, f_aa, g_bb))
    ours = [plan_cost(x, y, a, b, f_ab, g_ab, eps), plan_cost(x, x, a, a, f_aa, f_aa, eps),
            plan_cost(y, y, b, b, g_bb, g_bb, eps)]
    pot = [float(ot.sinkhorn2(p.numpy(), q.numpy(), (torch.cdist(u, v) ** 2).numpy(), 2 * eps,
                              method="sinkhorn_log", numItermax=100000, stopThr=1e-12))
           for p, q, u, v in ((a, b, x, y), (a, a, x, x), (b, b, y, y))]
    err = max(abs(o - p) / abs(p) for o, p in zip(ours, pot))
    print(f"check ({n} and {n + 50} points, eps {eps}, {steps} eps steps): plan costs <P, |x-y|^2> "
          f"{ours[0]:.6f} / {ours[1]:.6f} / {ours[2]:.6f}, POT {pot[0]:.6f} / {pot[1]:.6f} / {pot[2]:.6f}: "
          f"largest relative difference {err:.1e}")


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=None, help="points per cloud (default 10^5, --quick 1000)")
    p.add_argument("--blur", type=float, default=0.05, help="the target eps is blur^2")
    p.add_argument("--scaling", type=float, default=0.7, help="eps-scaling ratio of the blur per step")
    args = p.parse_args()
    device = setup(args)
    check_against_pot(device, args)
    n = args.n or (1000 if args.quick else 100000)
    x = torch.randn(n, 3, device=device)
    y = torch.randn(n, 3, device=device) * 0.8 + torch.tensor([0.5, 0.0, 0.0], device=device)
    a = torch.full((n,), 1.0 / n, device=device)
    sync(device)
    t0 = time.perf_counter()
    s, _, steps = divergence(x, y, a, a, args.blur, args.scaling, debug=args.debug)
    sync(device)
    print(f"Sinkhorn divergence of two clouds of {n} points in 3-D (blur {args.blur}, {steps} eps steps, "
          f"4 soft-minima each): {s:.6f} in {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
