"""The torch path of the formula kernels (kermac_like/formula.py): run_kernel, kernel_matvec,
kernel_topk's blocks and kernel_logsumexp for descriptors the fused templates do not know, on
any device, in blocks of bounded memory.

One block of kernel values (:func:`values`) is built from torch operations that autograd
differentiates: ``r`` from torch.cdist (l1, l2, p-norms; its matrix product for the squared
distance where torch.cdist's ``compute_mode`` rule takes it, so NaN and inf as there), torch's
matrix product (DOT), or direct differences summed through a ``(rows, cols, K)`` temporary (an
inner term of the kernel's own); then epsilon, the epilogue (the built-in families' torch forms,
or the user's expression rendered by kermac_like/expression.py), the regularised diagonal.
Powers ``z^q`` of a distance are 0 with zero gradient at z = 0 (as the package's cdist backward),
so that gradients stay finite at coincident points.

* :func:`distance`: the whole matrix at once (row blocks of at most ``block_elements`` through an
  inner term's temporary); under autograd :func:`values` itself (the matrix is the output).
* :func:`matvec`: row and column blocks, each times v while in cache: O((M + N) C + block).
  :func:`matvec_autograd`: the same forward, and a backward that recomputes each block under
  autograd and pulls ``g v^T`` back through it (to x, y and every tensor hyper-parameter;
  ``K^T g`` for v): never M x N either.
* :func:`logsumexp`: log sum_n w_n k(x_m, y_n) of a positive kernel from the log of its epilogue
  (the built-ins' closed forms, SymPy's ``expand_log`` of a user epilogue) with a running maximum
  over blocks; its backward recomputes blocks as above.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import torch

from . import expression, torch_path
from .centring import centred_together, shifted_pair
from .descriptor import InnerOperator, PowerType
from .formula import FormulaDescriptor

__all__ = ["values", "log_values", "distance", "matvec", "matvec_autograd", "logsumexp", "grad_factor"]

DIRECT = "donot_use_mm_for_euclid_dist"
DEFAULT_MODE = "use_mm_for_euclid_dist_if_necessary"
_SQRT3, _SQRT5 = math.sqrt(3.0), math.sqrt(5.0)


def _safe_pow(z: torch.Tensor, q):
    """z^q for z >= 0: 0 with zero gradient where z == 0 (q > 0)."""
    pos = z > 0
    return torch.where(pos, torch.where(pos, z, 1.0).pow(q), 0.0)


# -- the built-in families' torch forms (their formulas: formula._BUILTINS) ----------------------
def _epilogue_builtin(family: str):
    # (the fewest passes over the block: these run on N x N blocks on the CPU, with and without autograd)
    def matern32(r, P):
        s = r * (_SQRT3 / P["bandwidth"])
        return torch.exp(-s).mul_(s + 1.0) if not torch.is_grad_enabled() else (1.0 + s) * torch.exp(-s)

    def matern52(r, P):
        s = r * (_SQRT5 / P["bandwidth"])
        poly = torch.addcmul(s + 1.0, s, s, value=1.0 / 3.0)  # 1 + s + s^2 / 3
        return poly.mul_(torch.exp(-s)) if not torch.is_grad_enabled() else poly * torch.exp(-s)

    def rq(r, P):
        a, h = P["alpha"], P["bandwidth"]
        return torch.pow(1.0 + r / (2.0 * a * h * h), -a)

    def powexp(r, P):
        return torch.exp(-_safe_pow(r / P["bandwidth"], P["q"]))

    def cauchy(r, P):
        h = P["bandwidth"]
        return 1.0 / (1.0 + r / (h * h))

    def imq(r, P):
        h = P["bandwidth"]
        return torch.rsqrt(1.0 + r / (h * h))

    def periodic(r, P):
        h = P["bandwidth"]
        return torch.exp(r * (-2.0) / (h * h))

    return {"matern32": matern32, "matern52": matern52, "rational_quadratic": rq, "powered_exponential": powexp,
            "cauchy": cauchy, "inverse_multiquadric": imq, "periodic": periodic}.get(family)


def _log_epilogue_builtin(family: str):
    def matern32(r, P):
        s = r * (_SQRT3 / P["bandwidth"])
        return torch.log1p(s) - s

    def matern52(r, P):
        s = r * (_SQRT5 / P["bandwidth"])
        return torch.log1p(s + s * s / 3.0) - s

    def rq(r, P):
        a, h = P["alpha"], P["bandwidth"]
        return -a * torch.log1p(r / (2.0 * a * h * h))

    def powexp(r, P):
        return -_safe_pow(r / P["bandwidth"], P["q"])

    def cauchy(r, P):
        h = P["bandwidth"]
        return -torch.log1p(r / (h * h))

    def imq(r, P):
        h = P["bandwidth"]
        return -0.5 * torch.log1p(r / (h * h))

    def periodic(r, P):
        h = P["bandwidth"]
        return r * (-2.0) / (h * h)

    def log_sum(r, P):
        return torch.log(r)

    return {"matern32": matern32, "matern52": matern52, "rational_quadratic": rq, "powered_exponential": powexp,
            "cauchy": cauchy, "inverse_multiquadric": imq, "periodic": periodic, "additive_laplace": log_sum,
            "additive_powered_exponential": log_sum}.get(family)


def _inner_builtin(family: str):
    def add_laplace(t, P):
        return torch.exp(-t.abs() / P["bandwidth"])

    def add_powexp(t, P):
        return torch.exp(-_safe_pow(t.abs() / P["bandwidth"], P["q"]))

    def periodic(t, P):
        return torch.sin(t * math.pi / P["period"]).square()

    return {"additive_laplace": add_laplace, "additive_powered_exponential": add_powexp,
            "periodic": periodic}.get(family)


def _grad_factor_builtin(family: str):
    """phi(d; P) = (1/d) dk/dd of the built-in kernels of the l2 distance d (2 dk/d(d^2)): the gradient of
    k(|x - y|) with respect to x is phi (x - y). Closed forms, finite at d = 0; None for the other families."""
    def matern32(d, P):
        c = _SQRT3 / P["bandwidth"]
        return torch.exp(d * -c).mul_(-c * c)

    def matern52(d, P):
        c = _SQRT5 / P["bandwidth"]
        s = d * c
        return torch.exp(-s).mul_(s.add_(1.0)).mul_(-c * c / 3.0)

    def rq(d, P):
        a, h = P["alpha"], P["bandwidth"]
        return torch.pow(1.0 + d * d / (2.0 * a * h * h), -a - 1.0).mul_(-1.0 / (h * h))

    def cauchy(d, P):
        h = P["bandwidth"]
        return (1.0 + d * d / (h * h)).reciprocal_().square_().mul_(-2.0 / (h * h))

    def imq(d, P):
        h = P["bandwidth"]
        return torch.rsqrt(1.0 + d * d / (h * h)).pow_(3).mul_(-1.0 / (h * h))

    return {"matern32": matern32, "matern52": matern52, "rational_quadratic": rq, "cauchy": cauchy,
            "inverse_multiquadric": imq}.get(family)


def grad_factor(desc: FormulaDescriptor):
    """``phi(d, hypers)`` for a built-in kernel of the l2 distance (Matérn 3/2 and 5/2, rational quadratic,
    Cauchy, inverse multiquadric): :func:`_grad_factor_builtin` of the distances ``d`` (*batch, rows, cols) with
    the call's hyper-parameters (floats, or tensors over the batch modes); None for the other kernels."""
    if desc.family == "expression" or desc.has_inner or getattr(desc, "derivative", False):
        return None
    fn = _grad_factor_builtin(desc.family)
    return None if fn is None else (lambda d, hypers: fn(d, _params(desc, hypers, d.dtype, 2)))


@functools.lru_cache(maxsize=256)
def _functions(desc: FormulaDescriptor) -> tuple:
    """(inner(t or x, y; P) or None, epilogue(r; P), log epilogue(r; P) or None) of a descriptor."""
    names = desc.param_names
    inner = None
    if desc.family != "expression":
        epi = _epilogue_builtin(desc.family)
        if desc.family == "polynomial":
            deg = desc.degree
            epi = lambda r, P: (r + P["c"]) ** deg  # noqa: E731
        elif epi is None:  # additive: the sum itself
            epi = lambda r, P: r  # noqa: E731
        if desc.has_inner:
            inner = _inner_builtin(desc.family)
        return inner, epi, _log_epilogue_builtin(desc.family)
    if desc.has_inner:
        fi = expression.torch_function(desc.sympy_inner(), ("t", "x", "y", *names))
        inner = lambda t=None, P=None, x=None, y=None: fi(t=t, x=x, y=y, **P)  # noqa: E731
    e = desc.sympy_epilogue()
    fe = expression.torch_function(e, ("r", *names))
    log_fn = None
    if desc.positive:
        sympy = expression.sympy_module()
        rr = sympy.Symbol("r", nonnegative=True)
        subs = {s: (rr if str(s) == "r" else sympy.Symbol(str(s), positive=True)) for s in e.free_symbols}
        back = {v: sympy.Symbol(str(v), real=True) for v in subs.values()}
        le = sympy.expand_log(sympy.log(e.xreplace(subs)), force=True).xreplace(back)
        try:
            fl = expression.torch_function(le, ("r", *names))
            log_fn = lambda r, P: fl(r=r, **P)  # noqa: E731
        except ValueError:  # (a form outside the grammar's torch rendering: the log of the values)
            log_fn = None
    return inner, (lambda r, P: fe(r=r, **P)), log_fn


def _params(desc: FormulaDescriptor, hypers: dict, dtype, trailing: int) -> dict:
    """The descriptor's hyper-parameters for a block: floats, or tensors in ``dtype`` with
    ``trailing`` unit modes (they broadcast over the batch modes of the block)."""
    out = {}
    for n in desc.param_names:
        h = hypers[n]
        out[n] = h.to(dtype).reshape(*h.shape, *([1] * trailing)) if isinstance(h, torch.Tensor) else h
    return out


def reduced(desc: FormulaDescriptor, a: torch.Tensor, b: torch.Tensor, hypers: dict,
            compute_mode: str = DEFAULT_MODE) -> torch.Tensor:
    """r of every pair of rows: (*batch, rows, cols)."""
    if desc.has_inner:
        fn = _functions(desc)[0]
        P = _params(desc, hypers, a.dtype, 3)
        if desc.inner_operator is InnerOperator.DIFF:
            return fn(a.unsqueeze(-2) - b.unsqueeze(-3), P).sum(-1)  # (*batch, rows, cols, K) summed
        if desc.family == "expression":
            return fn(None, P, x=a.unsqueeze(-2), y=b.unsqueeze(-3)).sum(-1)
        raise ValueError(f"descriptor: {desc!r} has no inner term in x and y")
    if desc.inner_operator is InnerOperator.DOT:
        return torch.matmul(a, b.mT)
    if desc.inner_power is PowerType.ABS:
        return torch.cdist(a, b, p=1.0, compute_mode=DIRECT)
    if desc.inner_power is PowerType.POW:
        return torch.cdist(a, b, p=desc.norm_p, compute_mode=DIRECT)
    d = torch.cdist(a, b, p=2.0, compute_mode=compute_mode)
    return d if desc.outer_power is PowerType.SQRT else d * d


def values(desc: FormulaDescriptor, a: torch.Tensor, b: torch.Tensor, hypers: dict, *, diag: int | None = None,
           epsilon=None, compute_mode: str = DEFAULT_MODE) -> torch.Tensor:
    """Kernel values of every pair of rows of a (*, rows, K) and b (*, cols, K), differentiable;
    ``hypers``: the call's (run_kernel's four and the descriptor's own); ``diag``: the offset
    (n - m within the block) of the regularised diagonal, None for none."""
    r = reduced(desc, a, b, hypers, compute_mode)
    if epsilon is not None:
        r = torch.where(r < epsilon, 0.0, r)
    k = _functions(desc)[1](r, _params(desc, hypers, r.dtype, 2))
    if not isinstance(k, torch.Tensor):  # a constant epilogue
        k = torch.full_like(r, float(k))
    lam = hypers.get("regularization")
    if lam is not None and diag is not None:
        rows, cols = k.shape[-2], k.shape[-1]
        mask = (torch.arange(cols, device=k.device) - torch.arange(rows, device=k.device).unsqueeze(-1)) == diag
        lam = lam.to(k.dtype).reshape(*lam.shape, 1, 1) if isinstance(lam, torch.Tensor) else lam
        k = k + mask.to(k.dtype) * lam
    return k


def log_values(desc: FormulaDescriptor, a, b, hypers: dict, *, epsilon=None) -> torch.Tensor:
    """log k of every pair (a positive kernel): the log epilogue where it has one, else log of the values."""
    r = reduced(desc, a, b, hypers, DIRECT)
    if epsilon is not None:
        r = torch.where(r < epsilon, 0.0, r)
    fns = _functions(desc)
    P = _params(desc, hypers, r.dtype, 2)
    out = fns[2](r, P) if fns[2] is not None else torch.log(fns[1](r, P))
    return out if isinstance(out, torch.Tensor) else torch.full_like(r, float(out))


def _row_block(desc: FormulaDescriptor, L: int, M: int, N: int, K: int, device) -> int:
    per_pair = max(1, K) if desc.has_inner else 1
    return max(1, min(M, torch_path.block_elements(device) // max(1, L * N * per_pair)))


def distance(call, out: torch.Tensor | None = None, compute_mode: str = DEFAULT_MODE) -> torch.Tensor:
    """run_kernel of a formula descriptor for a validated call (plan.DistanceCall) into ``out``
    (checked) or a fresh tensor; returns it. No autograd (the op's caller differentiates
    :func:`values` itself)."""
    work = torch_path.work_dtype(call.dtype)
    batch = tuple(call.batch)
    M, N = call.M, call.N
    L = math.prod(batch)
    if out is None:
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    if L * M * N == 0:
        return out
    a, b = call.a.to(work), call.b.to(work)
    mb = _row_block(call.desc, L, M, N, call.K, call.device)
    with torch.no_grad():
        for m0 in range(0, M, mb):
            m1 = min(M, m0 + mb)
            k = values(call.desc, a[..., m0:m1, :], b, call.hypers, diag=call.reg_diag + m0, epsilon=call.epsilon,
                       compute_mode=compute_mode)
            out[..., m0:m1, :] = k
    return out


def _matvec_blocks(call, Lk: int) -> tuple:
    nb = max(1, min(call.N, torch_path.MATVEC_COLUMNS))
    per_pair = max(1, call.K) if call.desc.has_inner else 1
    mb = max(1, min(call.M, torch_path.block_elements(call.device) // max(1, Lk * nb * per_pair)))
    return mb, nb


def _kernel_batch(call) -> int:
    shapes = [tuple(call.x.shape[:-2]), tuple(call.y.shape[:-2])]
    shapes += [tuple(h.shape) for h in call.hypers.values() if isinstance(h, torch.Tensor)]
    return math.prod(torch.broadcast_shapes(*shapes)) if shapes else 1


def matvec(call, out: torch.Tensor) -> torch.Tensor:
    """kernel_matvec of a formula descriptor for a validated call (ops.matvec.MatvecCall) into
    ``out`` (checked); returns ``out``. Blocks of at most ``block_elements`` kernel values (times
    K through an inner term's temporary), each times the matching rows of v; a float64 ``out``
    of float32/16-bit data: the kernel values widened, products and sums in float64."""
    om = out.unsqueeze(-1) if call.vector else out
    if om.numel() == 0:
        return out
    if call.N == 0:
        om.zero_()
        return out
    work = torch_path.work_dtype(call.dtype)
    acc_dt = torch.float64 if out.dtype == torch.float64 else work
    x, y, v = call.x.to(work), call.y.to(work), call.v.to(acc_dt)
    desc = call.desc
    if (desc.shift_invariant and not desc.has_inner and desc.inner_power is PowerType.SQUARE
            and torch_path.uses_mm(DEFAULT_MODE, call.M, call.N) and not centred_together(call.x, call.y)):
        # torch.cdist's matrix product of x and y shifted by their reference point (kermac_like.centring):
        # the error of centred data whatever the data's offset
        x, y, _ = shifted_pair(x, y)
    mb, nb = _matvec_blocks(call, _kernel_batch(call))
    with torch.no_grad():
        for m0 in range(0, call.M, mb):
            m1 = min(call.M, m0 + mb)
            acc = None
            for n0 in range(0, call.N, nb):
                n1 = min(call.N, n0 + nb)
                k = values(call.desc, x[..., m0:m1, :], y[..., n0:n1, :], call.hypers, diag=call.reg_diag + m0 - n0,
                           epsilon=call.epsilon)
                part = torch.matmul(k.to(acc_dt), v[..., n0:n1, :])
                acc = part if acc is None else acc + part
            om[..., m0:m1, :] = acc
    return out


class _Leaves:
    """One block's differentiable leaves of a blocked backward: x's rows [m0, m1), y's rows [n0, n1)
    and every tensor hyper-parameter in ``work``, each requiring grad where its input does; ``hp``
    the call's hyper-parameters with the tensor ones replaced by their leaves."""

    def __init__(self, call, names, x, y, hts, needs, m0, m1, n0, n1, work):
        nx, ny, nh = needs[0], needs[1], needs[2:]
        self.x = x[..., m0:m1, :].detach().to(work).requires_grad_(nx)
        self.y = y[..., n0:n1, :].detach().to(work).requires_grad_(ny)
        self.h = [h.detach().to(work).requires_grad_(n) for h, n in zip(hts, nh)]
        self.hp = dict(call.hypers)
        self.hp.update(zip(names, self.h))
        self.wanted = [t for t, n in zip((self.x, self.y, *self.h), needs) if n]


def _add_grads(grads, needs, gx, gy, gh, m0, m1, n0, n1) -> None:
    """Add one block's gradients (in the order of _Leaves.wanted) to the x, y and hyper-parameter sums."""
    grads = iter(grads)
    if needs[0]:
        gx[..., m0:m1, :] += next(grads)
    if needs[1]:
        gy[..., n0:n1, :] += next(grads)
    for i, n in enumerate(needs[2:]):
        if n:
            gh[i] += next(grads)


class _Matvec(torch.autograd.Function):
    """K(x, y) v of a formula descriptor with a blocked backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, call, names, x, y, v, *hyper_tensors):
        hp = dict(call.hypers)
        hp.update(zip(names, hyper_tensors))
        c = replace(call, x=x, y=y, v=v, hypers=hp, vector=False)
        out = torch.empty(c.out_shape, dtype=c.dtype, device=c.device)
        matvec(c, out)
        ctx.save_for_backward(x, y, v, *hyper_tensors)
        ctx.call, ctx.names = c, names
        return out

    @staticmethod
    def backward(ctx, g):
        x, y, v, *hts = ctx.saved_tensors
        call, names = ctx.call, ctx.names
        needs = ctx.needs_input_grad[2:]
        nx, ny, nv = needs[:3]
        nh = needs[3:]
        work = torch_path.work_dtype(call.dtype)
        gx = torch.zeros(x.shape, dtype=work, device=x.device) if nx else None
        gy = torch.zeros(y.shape, dtype=work, device=y.device) if ny else None
        gv = torch.zeros((*call.batch, call.N, call.C), dtype=work, device=v.device) if nv else None
        gh = [torch.zeros(h.shape, dtype=work, device=h.device) if n else None for h, n in zip(hts, nh)]
        mb, nb = _matvec_blocks(call, _kernel_batch(call))
        gw, vw = g.to(work), v.to(work)
        for m0 in range(0, call.M, mb):
            m1 = min(call.M, m0 + mb)
            for n0 in range(0, call.N, nb):
                n1 = min(call.N, n0 + nb)
                with torch.enable_grad():
                    b = _Leaves(call, names, x, y, hts, (nx, ny, *nh), m0, m1, n0, n1, work)
                    # direct differences: zero gradient at coincident points (the product form's is not)
                    k = values(call.desc, b.x, b.y, b.hp, diag=call.reg_diag + m0 - n0, epsilon=call.epsilon,
                               compute_mode=DIRECT)
                    gb = gw[..., m0:m1, :]
                    if nv:
                        gv[..., n0:n1, :] += torch.matmul(k.detach().mT, gb)
                    if not b.wanted:
                        continue
                    w = torch.matmul(gb, vw[..., n0:n1, :].mT)  # dL/dk of the block: (*batch, mb, nb)
                    if k.shape != w.shape:  # v's batch modes beyond the kernel's
                        w = w.sum_to_size(k.shape)
                    grads = torch.autograd.grad(k, b.wanted, w)
                _add_grads(grads, (nx, ny, *nh), gx, gy, gh, m0, m1, n0, n1)
        res = [None if t is None else t.to(ref.dtype) for t, ref in zip((gx, gy), (x, y))]
        res.append(None if gv is None else gv.sum_to_size(v.shape).to(v.dtype))
        res += [None if t is None else t.to(h.dtype) for t, h in zip(gh, hts)]
        return (None, None, *res)


def matvec_autograd(call) -> torch.Tensor:
    """kernel_matvec of a validated call (ops.matvec.MatvecCall) differentiable with respect to x,
    y, v and every tensor hyper-parameter, memory O((M + N) C + block) in both passes."""
    names = tuple(n for n, h in call.hypers.items() if isinstance(h, torch.Tensor))
    res = _Matvec.apply(call, names, call.x, call.y, call.v, *(call.hypers[n] for n in names))
    return res.squeeze(-1) if call.vector else res


# -- kernel_logsumexp ---------------------------------------------------------------------------
def _lse_blocks(batch: tuple, M: int, N: int, C: int, K: int, desc) -> tuple:
    B = math.prod(batch) if batch else 1
    budget = 1 << 22
    per = max(1, K) if desc.has_inner else 1
    nb = max(1, min(N, max(256, budget // max(1, B * M * C * per))))
    mb = max(1, min(M, max(1, budget // max(1, B * nb * C * per))))
    return mb, nb


def _lse_forward(call, x, y, lw, hp, work):
    batch, M, N, C = call.batch, call.M, call.N, lw.shape[-1]
    mb, nb = _lse_blocks(batch, M, N, C, call.K, call.desc)
    out = torch.empty((*batch, M, C), dtype=work, device=x.device)
    xw, yw, lww = x.to(work), y.to(work), lw.to(work).expand(*batch, N, C)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        run_max = torch.full((*batch, m1 - m0, C), -math.inf, dtype=work, device=x.device)
        run_sum = torch.zeros_like(run_max)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            lk = log_values(call.desc, xw[..., m0:m1, :], yw[..., n0:n1, :], hp, epsilon=call.epsilon)
            t = lk.unsqueeze(-1) + lww[..., None, n0:n1, :]  # (*batch, mb, nb, C)
            run_max, run_sum = torch_path.lse_accumulate(run_max, run_sum, t)
        out[..., m0:m1, :] = torch_path.lse_result(run_max, run_sum)
    return out


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, names, work, x, y, lw, *hyper_tensors):
        hp = dict(call.hypers)
        hp.update(zip(names, hyper_tensors))
        with torch.no_grad():
            out = _lse_forward(call, x, y, lw, hp, work)
        ctx.save_for_backward(x, y, lw, out, *hyper_tensors)
        ctx.call, ctx.names, ctx.work = call, names, work
        return out

    @staticmethod
    def backward(ctx, g):
        x, y, lw, out, *hts = ctx.saved_tensors
        call, names, work = ctx.call, ctx.names, ctx.work
        batch, M, N, C = call.batch, call.M, call.N, lw.shape[-1]
        mb, nb = _lse_blocks(batch, M, N, C, call.K, call.desc)
        needs = ctx.needs_input_grad[3:]
        nx, ny, nl = needs[:3]
        nh = needs[3:]
        lwe = lw.expand(*batch, N, C)
        gx = torch.zeros(x.shape, dtype=work, device=x.device) if nx else None
        gy = torch.zeros(y.shape, dtype=work, device=x.device) if ny else None
        glw = torch.zeros(lwe.shape, dtype=work, device=x.device) if nl else None
        gh = [torch.zeros(h.shape, dtype=work, device=h.device) if n else None for h, n in zip(hts, nh)]
        for m0 in range(0, M, mb):
            m1 = min(M, m0 + mb)
            for n0 in range(0, N, nb):
                n1 = min(N, n0 + nb)
                with torch.enable_grad():
                    b = _Leaves(call, names, x, y, hts, (nx, ny, *nh), m0, m1, n0, n1, work)
                    lk = log_values(call.desc, b.x, b.y, b.hp, epsilon=call.epsilon)
                    t = lk.detach().unsqueeze(-1) + lwe[..., None, n0:n1, :].to(work)
                    w = torch.exp(t - out[..., m0:m1, None, :]) * g[..., m0:m1, None, :].to(work)  # softmax weights
                    if nl:
                        glw[..., n0:n1, :] += w.sum(-3)
                    if not b.wanted:
                        continue
                    wk = w.sum(-1)
                    if wk.shape != lk.shape:
                        lk = lk.expand(wk.shape)
                    grads = torch.autograd.grad(lk, b.wanted, wk)
                _add_grads(grads, (nx, ny, *nh), gx, gy, gh, m0, m1, n0, n1)
        res = [None if gx is None else gx.to(x.dtype), None if gy is None else gy.to(y.dtype),
               None if glw is None else glw.sum_to_size(lw.shape).to(lw.dtype)]
        res += [None if t is None else t.to(h.dtype) for t, h in zip(gh, hts)]
        return (None, None, None, *res)


def logsumexp(call, lw: torch.Tensor, work: torch.dtype) -> torch.Tensor:
    """log sum_n exp(log k(x_m, y_n) + lw[n, c]) of a positive formula kernel for a validated
    call (plan.DistanceCall of x, y), lw (..., N, C): (*batch, M, C) in ``work``, differentiable
    with respect to x, y, lw and the tensor hyper-parameters."""
    names = tuple(n for n, h in call.hypers.items() if isinstance(h, torch.Tensor))
    return _LogSumExp.apply(call, names, work, call.a, call.b, lw, *(call.hypers[n] for n in names))
