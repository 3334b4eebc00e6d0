"""Falkon (KernelRidge solver="nystrom") on the CPU with the products of kernel_matvec's blocked
float64 mode emulated exactly (bench/notes/krr_1e9.md, "blocked float64 mode"): against the float64
mode's products with the same float32 kernel values, iterations, residual, test R^2 and the
difference of the predictions. No GPU.

Each chunk's K(x_c, z) is computed once (float32, run_kernel's CPU path) and K(z, x_c) is its
transpose, as the GPU's symmetric form gives. Float64 mode: K.double() @ v. Blocked: v rounded to
float32, each group of G consecutive points summed by FFMA in float32 (fl32(k v + s), the product
exact in float64), the group sums added in float64.

    PYTHONPATH=. python3 bench/probes/falkon_blocked_numerics.py [--n 20000] [--m 2000] [--groups 8 16 256]
"""
import argparse
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import large_scale_krr as ex  # noqa: E402
from kermac_like.solvers import KernelRidge  # noqa: E402
from kermac_like.solvers import _kernel  # noqa: E402

CACHE = {}
GROUP = [0]  # 0: the float64 mode


def dense(a, b, kernel):
    """K(a, b) in float32, with K(z, x_c) the transpose of K(x_c, z) (bitwise, as on the GPU)."""
    key = (a.data_ptr(), a.shape, b.data_ptr(), b.shape)
    if key not in CACHE:
        tkey = (b.data_ptr(), b.shape, a.data_ptr(), a.shape)
        if tkey in CACHE:
            return CACHE[tkey].T
        CACHE[key] = kernel.matrix(a, b)
    return CACHE[key]


def blocked(k, v, g, exact_v=False):
    """sum_n k[:, n] v[n] as the blocked kernel forms it: groups of g points in float32 FFMA
    (``exact_v``: v unrounded, only the group sums rounded: what a hi/lo split of v would give)."""
    na, nb = k.shape
    pad = -nb % g
    k = torch.nn.functional.pad(k, (0, pad)).reshape(na, -1, g)
    vr = v.double() if exact_v else v.float().double()
    vr = torch.nn.functional.pad(vr, (0, 0, 0, pad)).reshape(-1, g, v.shape[1])
    out = torch.empty((na, v.shape[1]), dtype=torch.float64)
    for c in range(v.shape[1]):
        s = torch.zeros(k.shape[:2], dtype=torch.float32)
        for j in range(g):
            s = (k[:, :, j].double() * vr[None, :, j, c] + s.double()).float()
        out[:, c] = s.double().sum(1)
    return out


WHICH = ["both"]  # which products are blocked: both, kzn (K(z, x_c) u), knz (K(x_c, z) v)
EXACT_V = [False]


def emulated(self, a, b, v, out=None, *, f32_partials=False):
    k = dense(a, b, self)
    side = "kzn" if a.shape[0] < b.shape[0] else "knz"
    on = GROUP[0] and f32_partials and WHICH[0] in ("both", side)
    r = blocked(k, v, GROUP[0], EXACT_V[0]) if on else k.double() @ v.double()
    if out is not None:
        out.copy_(r)
        return out
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--m", type=int, default=2_000)
    ap.add_argument("--d", type=int, default=8)
    ap.add_argument("--lam", type=float, default=1e-6)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--groups", type=int, nargs="*", default=[8, 16, 256])
    ap.add_argument("--which", choices=("both", "kzn", "knz"), default="both")
    ap.add_argument("--exact-v", action="store_true", help="v unrounded (only the group sums in float32)")
    args = ap.parse_args()
    WHICH[0], EXACT_V[0] = args.which, args.exact_v
    torch.manual_seed(0)
    X, y = ex.make_data(args.n, args.d)
    Xt, yt, ft = ex.make_test(5000, args.d)
    _kernel.SolverKernel.matvec = emulated
    rows, preds = [], {}
    for g in [0, *args.groups]:
        GROUP[0] = g
        t0 = time.perf_counter()
        est = KernelRidge("gaussian_l2", bandwidth=1.5, alpha=args.lam * args.n, solver="nystrom",
                          n_centers=args.m, tol=args.tol, random_state=0, max_iter=200).fit(X, y)
        p = est.predict(Xt).double()
        preds[g] = p
        r2 = 1 - float(((p - yt.double()) ** 2).sum() / ((yt.double() - yt.double().mean()) ** 2).sum())
        mse_f = float(((p - ft.double()) ** 2).mean())
        rows.append((g, est.n_iter_, float(est.residual_), r2, mse_f, time.perf_counter() - t0))
        print(rows[-1], flush=True)
    print(f"\n== Falkon, blocked products emulated (N={args.n}, m={args.m}, D={args.d}, lam {args.lam:g}, "
          f"tol {args.tol:g}; blocked: {args.which}{', v exact' if args.exact_v else ''})")
    print("products            iterations  residual   R^2      MSE vs f   pred. diff vs float64 mode")
    for g, it, res, r2, mse, _ in rows:
        name = "float64 mode" if g == 0 else f"blocked, {g} points"
        diff = float((preds[g] - preds[0]).norm() / preds[0].norm())
        print(f"{name:20s}{it:6d}      {res:.3e}  {r2:.5f}  {mse:.3e}  {diff:.2e}")


if __name__ == "__main__":
    main()
