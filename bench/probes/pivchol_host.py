"""Host time of the operator's pivoted-Cholesky forward (_PivotedCholesky.apply, no gradient asked for) on
the CPU at N = 5 x 10^4, D = 8, rank 15 (GPyTorch's max_preconditioner_size): the current forward
(no synchronisation per iteration, the pivot's row straight from the points) against a copy of the
forward before it (``old_forward``: apply_permutation for the row, ``errors.max() > tol`` read on the
host every iteration), median of 5 calls after one warm-up each; the outputs must be equal bit for
bit. old_forward runs on this checkout's operator (its _get_indices, _squared_distances); --rev REV
also times REV's own _PivotedCholesky.apply in a subprocess (its kermac_like from git archive), e.g.
--rev 75adefa, the commit before the deferred stop. On a GPU the same loop's host time is what keeps
the GPU idle (bench/notes/gpytorch.md); on the CPU it also includes the arithmetic.

    python bench/probes/pivchol_host.py [N] [D] [rank] [float32|float64] [--rev REV]
"""
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's kermac_like, not an installed one
from linear_operator import settings
from linear_operator.utils.permutation import apply_permutation

from kermac_like.gpytorch._operator import KermacKernelLinearOperator, _PivotedCholesky


def old_forward(ctx, representation_tree, rank, error_tol, *matrix_args):
    """_PivotedCholesky.forward as it was before the deferred stop (git 75adefa)."""
    matrix = representation_tree(*matrix_args)
    *batch, n = matrix.shape[:-1]
    tol = settings.preconditioner_tolerance.value() if error_tol is None else error_tol
    diag = matrix._approx_diagonal().clone()  # the residual diagonal, updated in place
    rank = min(rank, n)
    L = diag.new_zeros(*batch, rank, n)
    orig_error = diag.max(-1).values
    errors = diag.norm(1, dim=-1) / orig_error
    perm = torch.arange(n, device=diag.device).repeat(*batch, 1)
    m = 0
    while m == 0 or (m < rank and errors.max() > tol):
        values, at = diag.gather(-1, perm[..., m:]).max(-1)
        at = (at + m).unsqueeze(-1)
        pi_m = perm.gather(-1, at)  # (*batch, 1)
        perm.scatter_(-1, at, perm[..., m:m + 1].clone())
        perm[..., m:m + 1] = pi_m
        L_m = L[..., m, :]
        L_m.scatter_(-1, pi_m, values.sqrt().unsqueeze(-1))
        if m + 1 < n:
            rest = perm[..., m + 1:]
            new = apply_permutation(matrix, pi_m, None).squeeze(-2).gather(-1, rest)
            if m > 0:
                prev = L[..., :m, :]
                new -= (prev.gather(-1, pi_m.unsqueeze(-2).expand(*batch, m, 1))
                        * prev.gather(-1, rest.unsqueeze(-2).expand(*batch, m, n - m - 1))).sum(-2)
            new /= L_m.gather(-1, pi_m)
            L_m.scatter_(-1, rest, new)
            diag.scatter_(-1, rest, diag.gather(-1, rest) - new**2)
            errors = diag.gather(-1, rest).norm(1, dim=-1) / orig_error
        m += 1
    ctx.save_for_backward(perm[..., :m].contiguous(), *matrix_args)
    ctx.mark_non_differentiable(perm)
    return L[..., :m, :].mT.contiguous(), perm


class _OldPivotedCholesky(torch.autograd.Function):
    forward = staticmethod(old_forward)

    @staticmethod
    def backward(ctx, grad_factor, _):
        raise NotImplementedError


ROOT = Path(__file__).resolve().parents[2]


def inputs(n, d, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(n, d, generator=g, dtype=dtype) * 2 - 1) / 0.7
    op = KermacKernelLinearOperator(x, x, kernel="rbf", outputscale=torch.tensor(1.3, dtype=dtype))
    return op.representation_tree(), op.representation()


def time_revision(rev, n, d, rank, dtype):
    """(median ms, times, (factor, perm)) of REV's _PivotedCholesky.apply, run from its own kermac_like."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(f"git -C {ROOT} archive {rev} kermac_like | tar -x -C {tmp}", shell=True, check=True)
        (Path(tmp) / "probe.py").write_text(Path(__file__).read_text())
        code = (f"import sys, torch; sys.argv = ['probe']; sys.path.insert(0, {tmp!r}); import probe; "
                f"tree, args = probe.inputs({n}, {d}, torch.{str(dtype).split('.')[1]}); "
                f"med, times, out = probe.median_ms(lambda: probe._PivotedCholesky.apply(tree, {rank}, None, *args)); "
                f"torch.save((med, times, out), {tmp!r} + '/out.pt')")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([sys.executable, "-c", code], cwd=tmp, env=env, check=True)
        return torch.load(Path(tmp) / "out.pt")


def median_ms(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), times, out


def main():
    argv = sys.argv[1:]
    rev = None
    if "--rev" in argv:
        i = argv.index("--rev")
        rev, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    n = int(float(argv[0])) if len(argv) > 0 else 50_000
    d = int(argv[1]) if len(argv) > 1 else 8
    rank = int(argv[2]) if len(argv) > 2 else 15
    dtype = getattr(torch, argv[3]) if len(argv) > 3 else torch.float32
    tree, args = inputs(n, d, dtype)
    print(f"N = {n}, D = {d}, rank {rank}, {dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    res = {}
    for name, fn in (("old_forward", _OldPivotedCholesky.apply), ("forward", _PivotedCholesky.apply)):
        med, times, res[name] = median_ms(lambda: fn(tree, rank, None, *args))
        print(f"{name:>12}: {med:8.2f} ms per call (median of 5; {', '.join(f'{t:.1f}' for t in times)})")
    if rev is not None:
        med, times, res[rev] = time_revision(rev, n, d, rank, dtype)
        print(f"{rev:>12}: {med:8.2f} ms per call (median of 5; {', '.join(f'{t:.1f}' for t in times)}; subprocess)")
    f1, p1 = res["forward"]
    for name, (f0, p0) in res.items():
        if name != "forward":
            print(f"forward == {name} bit for bit:", torch.equal(f0, f1) and torch.equal(p0, p1))
    print("rank reached:", f1.shape[-1])


if __name__ == "__main__":
    main()
