"""Build custom fused kernels from KernelDescriptors, bulk-precompile them, run them.

    python examples/build_a_kernel.py -d          # GPU: precompiles every kernel first
    python examples/build_a_kernel.py --quick -d  # CPU: reference path, precompile skipped
    python examples/build_a_kernel.py --quick --precompile-arch sm_80   # compile cubins without a GPU

A descriptor says what is computed for every pair of rows (x, y):

    acc = sum_k inner_power(inner_operator(x_k, y_k))   DIFF: x-y, DOT: x*y; NOOP, ABS, SQUARE, POW
    d   = outer_power(acc)                              NOOP, SQRT, POW (acc^(1/p))
    out = kernel_type(d)                                NONE, LAPLACE exp(-d/bw), GAUSSIAN exp(-d^2/(2 bw^2))

Kernels beyond that menu are formula descriptors: built-in ones (km.matern(2.5),
km.rational_quadratic(), km.periodic(), ...) and kernels written as formulas,

    km.kernel_expression("(1 + sqrt(5*r)/ell + 5*r/(3*ell**2)) * exp(-sqrt(5*r)/ell)",
                         inner="(x - y)**2", params={"ell": 1.0})

(SymPy-parsed: pip install 'kermac_like[expressions]'). Those of the l2 distance (the built-in
Matérn, rational quadratic, Cauchy, ... and expressions of the squared distance r) run
kernel_matvec on the fused SIMT kernel of a GPU: the template takes the kernel as an epilogue
functor (cuda_templates/epilogue.cuh), a user's formula rendered by SymPy's C printer into a tiny
functor compiled on its first call; run_kernel and the others still take the torch path.

km.precompile compiles every instantiation the descriptors can reach in a few
NVRTC programs (in parallel processes) and stores them in the persistent cache,
so the first call of each kernel is a cache hit.  Each kernel is then compared
with the same formula written in float64 torch, and the formula kernels' kernel_matvec (which path
it took, its first call: the functor's compile; its median) with its float64 product.
"""

import time

import torch

from _common import fmt_ms, median_ms, parser, rel_err, setup, sync

import kermac_like as km
from kermac_like import KernelDescriptor
from kermac_like.testing import record_plans


def _median_dist(x, y, p):
    """A bandwidth in the bulk of the distances, so the kernel values are not all 0 or 1."""
    return float(torch.cdist(x[:64].double(), y[:64].double(), p=p).median())


def kernels(x, y):
    """(name, descriptor, keyword arguments, float64 torch formula) for each example kernel."""
    bw1, bw15, bw2 = _median_dist(x, y, 1.0), _median_dist(x, y, 1.5), _median_dist(x, y, 2.0)

    def diff(a, b):
        return a.unsqueeze(-2) - b.unsqueeze(-3)  # (M, N, K)

    def matern52(a, b):
        s = 5 ** 0.5 * diff(a, b).pow(2).sum(-1).sqrt() / bw2
        return (1 + s + s * s / 3) * torch.exp(-s)

    def bump(a, b):  # a compactly supported bump plus a Gaussian tail, of the squared distance
        r = diff(a, b).pow(2).sum(-1)
        return torch.where(r < bw2 ** 2, (1 - r / bw2 ** 2) ** 2, 0.0) + 0.5 * torch.exp(-r / bw2 ** 2)

    try:  # user-written kernels: the same Matern 5/2, as a formula of the squared distance r, and a new one
        written = [("Matern 5/2, user-written", km.kernel_expression(
            "(1 + sqrt(5*r)/ell + 5*r/(3*ell**2)) * exp(-sqrt(5*r)/ell)", inner="(x - y)**2",
            params={"ell": None}), dict(ell=bw2), matern52),
            ("bump + Gaussian tail, user-written", km.kernel_expression(
                "where(r < c**2, (1 - r/c**2)**2, 0) + w*exp(-r/c**2)", params={"c": None, "w": 0.5}),
             dict(c=bw2), bump)]
    except ImportError as e:  # SymPy missing
        print(f"(the user-written kernel is skipped: {e})")
        written = []
    return written + [
        ("Matern 5/2, built-in", km.matern(2.5), dict(bandwidth=bw2), matern52),
        ("laplace, p=1.5 norm", KernelDescriptor("diff", "pow", "pow", "laplace"), dict(p=1.5, bandwidth=bw15),
         lambda a, b: torch.exp(-diff(a, b).abs().pow(1.5).sum(-1).pow(1 / 1.5) / bw15)),
        ("dot product", KernelDescriptor("dot", "noop", "noop", "none"), {},
         lambda a, b: a @ b.T),
        ("sqrt of l1 distance", KernelDescriptor("diff", "abs", "sqrt", "none"), {},
         lambda a, b: diff(a, b).abs().sum(-1).sqrt()),
        ("gaussian, l2", km.preset("gaussian_l2"), dict(bandwidth=bw2),
         lambda a, b: torch.exp(-diff(a, b).pow(2).sum(-1) / (2 * bw2 ** 2))),
        ("laplace of squared l2", KernelDescriptor("diff", "square", "noop", "laplace"), dict(bandwidth=bw2 ** 2),
         lambda a, b: torch.exp(-diff(a, b).pow(2).sum(-1) / bw2 ** 2)),
        ("(sum |x-y|^3)^(1/2)", KernelDescriptor("diff", "pow", "pow", "none"), dict(inner_p=3.0, outer_p=2.0),
         lambda a, b: diff(a, b).abs().pow(3).sum(-1).sqrt()),
        ("laplace l1 + 0.1 on the diagonal", km.preset("laplace_l1"), dict(bandwidth=bw1, regularization=0.1),
         lambda a, b: torch.exp(-diff(a, b).abs().sum(-1) / bw1) + 0.1 * torch.eye(a.shape[0], b.shape[0],
                                                                                  dtype=a.dtype, device=a.device)),
    ]


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("-M", type=int, default=8192)
    p.add_argument("-N", type=int, default=8192)
    p.add_argument("-K", type=int, default=256)
    p.add_argument("--precompile-arch", default=None,
                   help="compile for this arch (e.g. sm_80) even without a GPU; on a CPU the default is to skip")
    p.add_argument("--check-rows", type=int, default=32, help="rows checked against float64")
    args = p.parse_args(argv)
    if args.quick:
        args.M, args.N, args.K = 200, 160, 16
    device = setup(args)

    x = torch.randn(args.M, args.K, device=device)
    y = torch.randn(args.N, args.K, device=device)
    table = kernels(x, y)
    descriptors = list(dict.fromkeys(d for _, d, _, _ in table if d.fused_ok))  # (formulas: the torch path)
    print(f"{len(descriptors)} fused descriptors and {len(table) - len(descriptors)} formula kernels:")
    for name, desc, kw, _ in table:
        args_txt = ", ".join(f"{k}={v:.4g}" for k, v in kw.items())
        print(f"  {name:34s} {desc!r} {args_txt}")

    # Bulk precompile: many kernels per NVRTC program, programs in parallel processes.
    t0 = time.perf_counter()
    try:
        summary = km.precompile(descriptors, device=device if device.type == "cuda" else None,
                                arch=args.precompile_arch, debug=args.debug)
    except ValueError as e:  # no CUDA device and no arch given
        print(f"precompile skipped: {e}")
        print("  (compiling every instantiation takes minutes on a small CPU; "
              "pass --precompile-arch sm_80 to do it anyway)")
    else:
        print(f"precompile: {summary['requested']} instantiations for {summary['arch']}: "
              f"{summary['compiled']} compiled in {summary['programs']} program(s), {summary['cached']} already "
              f"cached, {time.perf_counter() - t0:.1f} s")

    r = min(args.check_rows, args.M)
    worst = 0.0
    print(f"\n{'kernel':34s} {'first call':>12s} {'median':>10s} {'rel. error vs float64':>22s}")
    for name, desc, kw, formula in table:
        a, b = (x, x) if "diagonal" in name else (x, y)
        t0 = time.perf_counter()
        out = km.run_kernel(desc, a, b, debug=args.debug, **kw)
        sync(device)
        first = (time.perf_counter() - t0) * 1e3
        ref = formula(a[:r].double(), b.double())
        err = rel_err(out[:r], ref)
        worst = max(worst, err)
        del out
        ms = median_ms(lambda: km.run_kernel(desc, a, b, **kw), device, repeats=args.repeats, warmup=args.warmup)
        print(f"{name:34s} {fmt_ms(first):>12s} {fmt_ms(ms):>10s} {err:>22.2e}")
    # kernel_matvec of the formula kernels: on a GPU the fused kernel with the kernel's epilogue functor
    v = torch.rand(args.N, 1, device=device)
    print(f"\n{'kernel_matvec':34s} {'path':>10s} {'first call':>12s} {'median':>10s} {'rel. error vs float64':>22s}")
    for name, desc, kw, formula in table:
        if desc.fused_ok:
            continue
        t0 = time.perf_counter()
        with record_plans() as plans:
            out = km.kernel_matvec(desc, x, y, v, **kw)
        sync(device)
        first = (time.perf_counter() - t0) * 1e3
        path = "fused" if plans.families == ["matvec"] else "torch"
        err = rel_err(out[:r], formula(x[:r].double(), y.double()) @ v.double())
        worst = max(worst, err)
        ms = median_ms(lambda: km.kernel_matvec(desc, x, y, v, **kw), device, repeats=args.repeats,
                       warmup=args.warmup)
        print(f"{name:34s} {path:>10s} {fmt_ms(first):>12s} {fmt_ms(ms):>10s} {err:>22.2e}")
    print(f"\nworst relative error: {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("error too large")


if __name__ == "__main__":
    main()
