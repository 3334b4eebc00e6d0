"""The pieces of the pivoted-Cholesky backward at N (argv[1]) inside one gp_step: apply_permutation,
psd_safe_cholesky, inverse_permutation, solve_triangular, Tensor.backward (wall seconds; on a GPU
each piece is timed after a synchronisation inside gp_step_profile's 'pieces' mode); first a
microbenchmark of solve_triangular(L (15 x 15), B (15 x N)) forward + backward (linear_operator's
PivotedCholesky.backward) against B^T inv(L)^T with inv(L) from a 15 x 15 solve (the operator's own
_PivotedCholesky, which the gp_step takes since the operator brings its preconditioner: the
linear_operator pieces no longer run there).

    python bench/probes/gp_pivchol_pieces.py 1000000
"""
import sys, time, torch
sys.argv = ["x", sys.argv[1], "pieces"]
import linear_operator.functions._pivoted_cholesky as fpc
import kermac_like.gpytorch._operator as op
def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter(); r = fn(*a, **k)
        dt = time.perf_counter() - t
        if dt > 0.005: print(f"      {name}: {dt:.3f} s", flush=True)
        return r
    return w
if torch.cuda.is_available():
    n = int(float(sys.argv[1]))
    L = torch.linalg.cholesky(torch.eye(15, device="cuda") * 2 + 0.1).requires_grad_(True)
    B = torch.randn(15, n, device="cuda", requires_grad=True)
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        X = torch.linalg.solve_triangular(L, B, upper=False)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        X.sum().backward()
        torch.cuda.synchronize()
        print(f"solve_triangular (15 x 15) \\ (15 x {n}): forward {t1 - t:.3f} s, backward {time.perf_counter() - t1:.3f} s",
              flush=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        X = B.mT @ torch.linalg.solve_triangular(L, torch.eye(15, device="cuda"), upper=False).mT
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        X.sum().backward()
        torch.cuda.synchronize()
        print(f"B^T inv(L)^T, ({n} x 15) @ (15 x 15): forward {t1 - t:.3f} s, backward {time.perf_counter() - t1:.3f} s",
              flush=True)
for mod in (fpc, op):
    for n in ("apply_permutation", "psd_safe_cholesky", "inverse_permutation"):
        if hasattr(mod, n):
            setattr(mod, n, timed(n, getattr(mod, n)))
torch.linalg.solve_triangular = timed("solve_triangular", torch.linalg.solve_triangular)
torch.Tensor.backward = timed("Tensor.backward", torch.Tensor.backward)
exec(open("bench/probes/gp_step_profile.py").read())
