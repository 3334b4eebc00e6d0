"""The torch path: run_kernel, cdist and kernel_matvec on torch's own kernels.

It serves every call the CUDA kernels do not take (plan.py decides): CPU tensors, float64
on any device, GPUs before sm_80, K = 0. The direct-difference code of reference.py (an
M x block x K temporary) stays the tests' oracle; this path is built from the kernels a
torch user would call, with the package's semantics:

* the sums ``acc`` (:class:`_Sums`): torch.cdist's vectorised direct-difference kernels for
  the ABS and POW inner powers and for SQUARE where torch.cdist computes directly; torch's
  matrix product where torch.cdist takes it (SQUARE inner power, :func:`uses_mm` of the
  call's compute mode and its M and N), with ``|x|^2 + |y|^2 - 2 x.y`` built as torch.cdist
  builds it, so that NaN and inf come out as there; the matrix product for DOT; direct
  differences through a ``(rows, N, K)`` temporary only for a per-batch (tensor) inner_p;
* the outer power, epsilon, the epilogue and the regularised diagonal in place on the
  block (:class:`_Epilogue`: ``sqrt_``, ``pow_``, ``div_``, ``exp_``, ``add_``), in the
  reference's order of operations;
* run_kernel and cdist: the whole matrix at once, as torch.cdist computes it (row blocks only
  for a tensor inner_p's temporary); kernel_matvec: row and column blocks of a bounded number
  of entries, each times v while still in cache, so that it needs memory O((M + N) C + block)
  only; torch's intra-op threads inside every op.

float16/bfloat16 inputs are computed in float32 and rounded once, into the output.
"""

from __future__ import annotations

import math

import torch

from .descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType
from .layout import broadcast_shapes

__all__ = ["distance", "matvec", "work_dtype", "block_elements", "uses_mm", "lse_accumulate", "lse_result", "DIRECT",
           "MATVEC_COLUMNS"]

DIRECT = "donot_use_mm_for_euclid_dist"
DEFAULT_MODE = "use_mm_for_euclid_dist_if_necessary"

# Elements of one block (all batch entries together). CPU: 16 MB of float32, within the L3
# cache while the epilogue and the product with v run on it, and few blocks: each op starts
# torch's intra-op threads once, which costs far more than a cache miss on a loaded machine
# (kernel_matvec 4000 x 4000 x 64 on 2 shared cores: 2^20 entries 63 ms on one thread but
# 250-700 ms on two; 2^22 80 ms and 250 ms; bench/notes/cpu_path.md). GPU (float64, old
# GPUs): large enough that launches do not dominate.
CPU_BLOCK_ELEMENTS = 1 << 22
GPU_BLOCK_ELEMENTS = 1 << 24
# Column block of kernel_matvec: the rows of x meet at most this many points of y at once.
MATVEC_COLUMNS = 4096


def uses_mm(compute_mode: str, M: int, N: int) -> bool:
    """torch.cdist's choice between the matrix-product (norm expansion) and the
    direct-difference computation of p = 2 distances, mirrored so that both give the
    same NaN and inf (tests/test_nonfinite.py): "use_mm_for_euclid_dist_if_necessary"
    takes the matrix product when either operand has more than 25 rows. On a GPU the matrix
    product is the tensor-core kernel, the direct computation the exact kernels (low-K, SIMT:
    plan/autotune.py); here torch's matrix product and torch.cdist's direct kernels."""
    if compute_mode == "use_mm_for_euclid_dist":
        return True
    return compute_mode == "use_mm_for_euclid_dist_if_necessary" and (M > 25 or N > 25)


def lse_accumulate(run_max: torch.Tensor, run_sum: torch.Tensor, t: torch.Tensor) -> tuple:
    """One block of a running log-sum-exp over dim -2 of ``t`` (*batch, m, nb, C): the new
    (running maximum, sum of exp(terms - maximum)); rows whose terms are all -inf so far keep
    nothing to rescale."""
    new_max = torch.maximum(run_max, t.amax(-2))
    safe = torch.where(torch.isfinite(new_max), new_max, 0)
    return new_max, run_sum * torch.exp(run_max - safe) + torch.exp(t - safe.unsqueeze(-2)).sum(-2)


def lse_result(run_max: torch.Tensor, run_sum: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp of a running (maximum, sum): -inf (or NaN) rows as their maximum."""
    return torch.where(torch.isfinite(run_max), run_sum.log() + run_max, run_max)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the path computes in: float32 for 16-bit inputs, else the inputs'."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def block_elements(device: torch.device) -> int:
    return CPU_BLOCK_ELEMENTS if device.type == "cpu" else GPU_BLOCK_ELEMENTS




def _shape_of(h) -> tuple:
    return tuple(h.shape) if isinstance(h, torch.Tensor) else ()


def _pairwise(h, work, ndim_tail: int = 2):
    """A hyper-parameter as a float or a tensor in ``work`` broadcasting over (*batch, rows, cols)."""
    if isinstance(h, torch.Tensor):
        return h.to(dtype=work).reshape(*h.shape, *([1] * ndim_tail))
    return h


class _Sums:
    """The sums of one call in blocks: :meth:`block` gives ``(t, root)`` with
    ``t = acc ** (1 / root)`` over the rows m0:m1 of a and n0:n1 of b, ``(*batch, rows, cols)``
    where ``batch`` (:attr:`batch`) broadcasts a, b and a tensor inner_p."""

    def __init__(self, desc: KernelDescriptor, a, b, inner_p, mm: bool, work: torch.dtype):
        a, b = a.to(work), b.to(work)
        self.a, self.b, self.K = a, b, a.shape[-1]
        self.per_pair = 1  # temporary elements per output of a block
        self.pads = None
        shapes = [a.shape[:-2], b.shape[:-2]]
        if desc.inner_operator is InnerOperator.DOT:
            self.kind, self.root = "dot", 1.0
        elif desc.inner_power is PowerType.SQUARE and mm:
            self.kind, self.root = "mm", 1.0
            # A block of its own (no dst) whose distance is wanted is torch.cdist's own result.
            self.cdist_root = desc.outer_power is PowerType.SQRT and desc.kernel_type is not KernelType.GAUSSIAN
        elif desc.inner_power is PowerType.SQUARE:
            self.kind, self.p, self.root = "cdist", 2.0, 2.0
        elif desc.inner_power is PowerType.ABS:
            self.kind, self.p, self.root = "cdist", 1.0, 1.0
        elif isinstance(inner_p, torch.Tensor):
            self.kind, self.root, self.per_pair = "direct", 1.0, max(1, self.K)
            self.p = inner_p.to(dtype=work).reshape(*inner_p.shape, 1, 1, 1)
            shapes.append(inner_p.shape)
        else:
            self.kind, self.p, self.root = "cdist", float(inner_p), float(inner_p)
        self.batch = broadcast_shapes(*shapes)

    def _padded(self):
        """a and b for torch.cdist's matrix-product form (aten _euclidean_dist):
        [-2x, |x|^2, 1] . [y, 1, |y|^2] = |x - y|^2."""
        if self.pads is None:
            a, b = self.a, self.b
            an, bn = a.pow(2).sum(-1, keepdim=True), b.pow(2).sum(-1, keepdim=True)
            self.pads = (torch.cat([a.mul(-2), an, torch.ones_like(an)], -1),
                         torch.cat([b, torch.ones_like(bn), bn], -1))
        return self.pads

    def block(self, m0: int, m1: int, n0: int, n1: int, dst: torch.Tensor | None):
        """``(t, root)`` of a block; the matrix products write ``dst`` (contiguous, the
        block's shape) when given."""
        a, b = self.a[..., m0:m1, :], self.b[..., n0:n1, :]
        if self.kind == "mm":
            if dst is None and self.cdist_root:
                return torch.cdist(a, b, p=2.0, compute_mode="use_mm_for_euclid_dist"), 2.0
            pa, pb = self._padded()
            a, b = pa[..., m0:m1, :], pb[..., n0:n1, :]
        if self.kind in ("dot", "mm"):
            if dst is not None and tuple(dst.shape[:-2]) == self.batch:
                t = torch.matmul(a, b.mT, out=dst)
            else:
                t = torch.matmul(a, b.mT)
            if self.kind == "mm":
                t.clamp_min_(0)
            return t, self.root
        if self.kind == "cdist":
            return torch.cdist(a, b, p=self.p, compute_mode=DIRECT), self.root
        diff = (a.unsqueeze(-2) - b.unsqueeze(-3)).abs_()  # (*batch, rows, cols, K)
        return torch.pow(diff, self.p).sum(-1), self.root


class _Epilogue:
    """Outer power, epsilon, kernel and regularisation of one call, in place on a block."""

    def __init__(self, desc: KernelDescriptor, hypers: dict, epsilon, work: torch.dtype):
        self.outer = {PowerType.NOOP: 1.0, PowerType.SQRT: 2.0}.get(desc.outer_power)
        if self.outer is None:
            self.outer = _pairwise(hypers["outer_p"], work)
        self.kernel, self.epsilon = desc.kernel_type, epsilon
        bw = _pairwise(hypers["bandwidth"], work)
        # exp(-d / bw) and exp(-(d * d) / (2 bw^2)) as d / (-bw) and (d * d) / (-(2 bw^2)): the
        # same quotients (IEEE division is symmetric in sign)
        if self.kernel is KernelType.LAPLACE:
            self.denominator = -bw
        elif self.kernel is KernelType.GAUSSIAN:
            self.denominator = -(2.0 * bw * bw)
        lam = hypers["regularization"]
        self.lam = lam.to(dtype=work).reshape(*lam.shape, 1) if isinstance(lam, torch.Tensor) else lam
        self.batch = broadcast_shapes(*(_shape_of(h) for h in hypers.values()))

    def apply(self, t: torch.Tensor, root, batch: tuple, diag: int, target: torch.Tensor | None):
        """The kernel values of the block ``t = acc ** (1 / root)`` (batch modes ``batch``, the
        call's), written over ``t`` or into ``target`` (the block's full shape) when ``t``'s
        batch is narrower; ``diag``: the regularised diagonal's offset in the block."""
        if tuple(t.shape[:-2]) != batch:
            if target is None:
                target = t.new_empty((*batch, *t.shape[-2:]))
            t = target.copy_(t.expand_as(target))
        q = self.outer
        # The Gaussian of a square root takes the sum as it is: no sqrt_ and square (no epsilon
        # to compare with the root)
        squared = (self.kernel is KernelType.GAUSSIAN and self.epsilon is None and not isinstance(q, torch.Tensor)
                   and q == 2.0 and root == 1.0)
        if isinstance(q, torch.Tensor):
            t.pow_(root / q)
        elif root != q and not squared:
            if root == 2.0 and q == 1.0:
                t.mul_(t)
            elif root == 1.0 and q == 2.0:
                t.sqrt_()
            else:
                t.pow_(root / q)
        if self.epsilon is not None:
            t.masked_fill_(t < self.epsilon, 0)
        if self.kernel is KernelType.LAPLACE:
            t.div_(self.denominator).exp_()
        elif self.kernel is KernelType.GAUSSIAN:
            if not squared:
                t.mul_(t)
            t.div_(self.denominator).exp_()
        if self.lam is not None:
            t.diagonal(diag, -2, -1).add_(self.lam)
        return t


def _buffer(n: int, dtype, device):
    return torch.empty(n, dtype=dtype, device=device) if n else None


def distance(call, out: torch.Tensor | None = None, compute_mode: str = DEFAULT_MODE) -> torch.Tensor:
    """run_kernel for a validated call (``plan.DistanceCall``) into ``out`` (checked:
    ``(*batch, M, N)``, the call's dtype, any layout), or into a fresh tensor (None);
    returns it.

    SQUARE inner powers follow torch.cdist's ``compute_mode`` rule (the matrix product above
    25 rows by default): NaN and inf as torch.cdist gives them on the same inputs. The matrix
    is computed whole, as torch.cdist does (its only temporary is the result itself; the
    fewest passes of the fewest ops), in place in ``out`` where ``out`` is contiguous in the
    work dtype; in row blocks of at most :func:`block_elements` only through the
    ``(rows, N, K)`` temporary of a tensor inner_p."""
    M, N = call.M, call.N
    work = work_dtype(call.dtype)
    batch = tuple(call.batch)
    L = math.prod(batch)
    if L * M * N == 0:
        return out if out is not None else torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    sums = _Sums(call.desc, call.a, call.b, call.hypers["inner_p"], uses_mm(compute_mode, M, N), work)
    epi = _Epilogue(call.desc, call.hypers, call.epsilon, work)
    mb = M if sums.per_pair == 1 else max(1, min(M, block_elements(call.device) // (L * N * sums.per_pair)))
    if out is None:
        if mb == M:  # the result of torch's kernels is the output
            t, root = sums.block(0, M, 0, N, None)
            t = epi.apply(t, root, batch, call.reg_diag, None)
            return t if t.dtype == call.dtype else t.to(call.dtype)
        out = torch.empty(call.out_shape, dtype=call.dtype, device=call.device)
    # out's own rows are the block when they are contiguous in the work dtype
    direct = out.dtype == work and out.is_contiguous() and (mb == M or L == 1)
    buf = None if direct else _buffer(L * mb * N, work, call.device)
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        ob = out[..., m0:m1, :]
        dst = ob if direct else buf[: L * (m1 - m0) * N].view(*batch, m1 - m0, N)
        t, root = sums.block(m0, m1, 0, N, dst)
        t = epi.apply(t, root, batch, call.reg_diag + m0, dst)
        if t is not ob:
            ob.copy_(t)
    return out


def matvec(call, out: torch.Tensor) -> torch.Tensor:
    """kernel_matvec for a validated call (``ops.matvec.MatvecCall``) into ``out`` (checked);
    returns ``out``. Kernel blocks of at most :func:`block_elements` (rows) x MATVEC_COLUMNS
    (points of y), each times the matching rows of v, accumulated per row block: memory beyond
    inputs and output O((M + N) C + block).

    The kernel blocks are run_kernel's with its default compute mode (SQUARE inner powers by
    the matrix product where torch.cdist takes it: M or N above 25), computed in the inputs'
    dtype (float32 for 16-bit). The float64 mode (a float64 ``out`` of float32/16-bit
    inputs): direct differences for every descriptor (K(x, y) is bitwise the transpose of
    K(y, x)), the float32 kernel values widened, products and sums in float64."""
    om = out.unsqueeze(-1) if call.vector else out
    if om.numel() == 0:
        return out
    M, N, C = call.M, call.N, call.C
    if N == 0:  # an empty sum
        om.zero_()
        return out
    work = work_dtype(call.dtype)
    acc_dt = torch.float64 if out.dtype == torch.float64 else work
    wide = acc_dt != work
    mm = not wide and uses_mm(DEFAULT_MODE, M, N)
    sums = _Sums(call.desc, call.x, call.y, call.hypers["inner_p"], mm, work)
    epi = _Epilogue(call.desc, call.hypers, call.epsilon, work)
    kbatch = broadcast_shapes(sums.batch, epi.batch)  # the kernel's batch (v's may add modes)
    Lk = math.prod(kbatch)
    v = call.v.to(acc_dt)
    nb = max(1, min(N, MATVEC_COLUMNS))
    mb = max(1, min(M, block_elements(call.device) // max(1, Lk * nb * sums.per_pair)))
    tile = _buffer(Lk * mb * nb, work, call.device)
    tile_wide = _buffer(Lk * mb * nb, acc_dt, call.device) if wide else None
    batch = tuple(call.batch)
    acc_buf = torch.empty(math.prod(batch) * mb * C, dtype=acc_dt, device=call.device)
    plain = not batch  # 2-D products: addmm_ accumulates in place
    for m0 in range(0, M, mb):
        m1 = min(M, m0 + mb)
        acc = acc_buf[: math.prod(batch) * (m1 - m0) * C].view(*batch, m1 - m0, C)
        for n0 in range(0, N, nb):
            n1 = min(N, n0 + nb)
            size = Lk * (m1 - m0) * (n1 - n0)
            dst = tile[:size].view(*kbatch, m1 - m0, n1 - n0)
            t, root = sums.block(m0, m1, n0, n1, dst)
            k = epi.apply(t, root, kbatch, call.reg_diag + m0 - n0, dst)
            if wide:
                k = tile_wide[:size].view(k.shape).copy_(k)
            vb = v[..., n0:n1, :]
            if n0 == 0:
                torch.matmul(k, vb, out=acc)
            elif plain:
                acc.addmm_(k, vb)
            else:
                acc.add_(torch.matmul(k, vb))
        om[..., m0:m1, :].copy_(acc)
    return out
