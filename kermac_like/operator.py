"""KernelOperator: a lazy kernel matrix that is used like a matrix and never stored.

``K = KernelOperator(descriptor, x, y, **hyper)`` stands for the matrix that
``run_kernel(descriptor, x, y, **hyper)`` would write::

    K[..., m, n] = k(x[..., m, :], y[..., n, :]) + lambda [m + offset_x == n + offset_y]

but holds only x, y and the hyper-parameters.  Products go through
:func:`kermac_like.kernel_matvec` (memory O((M + N) C), differentiable with respect
to x, y and the right-hand side), so iterative solvers (conjugate gradients,
Lanczos, Nystrom preconditioners) can run at sizes where the matrix itself would
not fit anywhere.

========================  =========================================================
``K.shape``               ``(*batch, M, N)``; also ``K.size()``, ``K.ndim``,
                          ``K.batch_shape``
``K.dtype, K.device``     those of x and y
``K @ v``, ``K.matmul(v)``  v ``(N,)`` -> ``(*batch, M)``; v ``(..., N, C)`` ->
                          ``(..., M, C)`` (torch.matmul's rules, batches broadcast)
``u @ K``                 u ``(M,)`` -> ``(*batch, N)``; u ``(..., C, M)`` ->
                          ``(..., C, N)``: ``(K.T @ u.mT).mT``
``K.T`` (= ``K.mT``)      the transpose of the matrix modes: x and y swapped,
                          regularisation offsets swapped
``K.diagonal(offset=0)``  ``torch.diagonal(K.to_dense(), offset, -2, -1)`` in
                          O(min(M, N) K): k(x_i, y_(i+offset)), plus lambda on
                          every entry when ``offset == offset_x - offset_y``
``K.to_dense()``          ``run_kernel`` (the whole matrix: M x N memory)
========================  =========================================================

The constructor validates like run_kernel (TypeError/ValueError naming the
argument).  The operator is immutable; x and y are referenced, not copied.

Products of DIFF descriptors are translation invariant (kernel_matvec's error model):
where kernel_matvec's path forms distances by the product formula
(``ops.matvec.matvec_shifts``: the sm_90 tensor-core kernel, the torch path's matrix
product), the operator shifts x and y by their reference point once, at its first such
product, keeps the shifted copies (one tensor if y is x; rebuilt when x or y are changed
in place; shared with ``K.T``) and hands them to kernel_matvec marked as centred, so that a
CG or Lanczos loop pays no shift per product. Memory: those copies, M x K and N x K
elements, for the operator's lifetime. Under autograd (x or y requiring grad) each product
shifts the tensors themselves, a differentiable subtraction of the detached reference
point: gradients are those of x and y. DOT descriptors are never shifted (their error is
relative to |x| |y|).
"""

from __future__ import annotations

import torch

from . import centring, formula_path
from .descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType
from .ops.distance import prepare_call, run_kernel
from .ops.matvec import kernel_matvec, matvec_shifts

__all__ = ["KernelOperator"]


class KernelOperator:
    """Lazy kernel matrix ``K[..., m, n] = k(x_m, y_n)`` (+ regularisation); see the module docstring.

    Arguments are those of :func:`kermac_like.run_kernel` with ``a, b`` named
    ``x, y``: ``p`` (sets ``inner_p`` and ``outer_p``), ``inner_p``, ``outer_p``,
    ``bandwidth``, ``regularization`` with ``regularization_offset_x`` and
    ``regularization_offset_y``, ``epsilon`` (floats, or tensors over batch modes),
    ``debug``, and a formula kernel's own hyper-parameters (kermac_like/formula.py) as
    keyword arguments.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0], [1.0], [2.0]])
    >>> K = km.KernelOperator(km.preset("gaussian_l2"), x, x, bandwidth=1.0)
    >>> K.shape
    torch.Size([3, 3])
    >>> K @ torch.tensor([[1.0], [0.0], [-1.0]])               # kernel_matvec underneath
    tensor([[ 0.8647],
            [ 0.0000],
            [-0.8647]])
    >>> K.diagonal()
    tensor([1., 1., 1.])
    >>> K.to_dense()
    tensor([[1.0000, 0.6065, 0.1353],
            [0.6065, 1.0000, 0.6065],
            [0.1353, 0.6065, 1.0000]])
    """

    __slots__ = ("descriptor", "x", "y", "hypers", "regularization_offset_x", "regularization_offset_y", "epsilon",
                 "debug", "batch_shape", "_M", "_N", "_centred")

    def __init__(self, descriptor: KernelDescriptor, x: torch.Tensor, y: torch.Tensor, *, p=None, inner_p=None,
                 outer_p=None, bandwidth=None, regularization=None, regularization_offset_x: int = 0,
                 regularization_offset_y: int = 0, epsilon=None, debug: bool = False, **params):
        call = prepare_call(descriptor, x, y, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                            regularization=regularization, regularization_offset_x=regularization_offset_x,
                            regularization_offset_y=regularization_offset_y, epsilon=epsilon, names=("x", "y"),
                            params=params)
        self.descriptor = descriptor
        self.x, self.y = x, y
        self.hypers = dict(call.hypers)  # inner_p, outer_p, bandwidth, regularization: resolved
        self.regularization_offset_x = int(regularization_offset_x)
        self.regularization_offset_y = int(regularization_offset_y)
        self.epsilon = call.epsilon
        self.debug = bool(debug)
        self.batch_shape = tuple(call.batch)
        self._M, self._N = call.M, call.N
        # [(x, y, their versions, reference point s, x - s, y - s)]: built by the first product that
        # needs the shift (_operands), shared with the transpose (whose x is this y)
        self._centred = [None]

    # -- what it is ------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.batch_shape, self._M, self._N))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def _kwargs(self) -> dict:
        kw = {k: v for k, v in self.hypers.items() if v is not None}
        kw.update(regularization_offset_x=self.regularization_offset_x,
                  regularization_offset_y=self.regularization_offset_y, epsilon=self.epsilon, debug=self.debug)
        return kw

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v if not isinstance(v, torch.Tensor) else tuple(v.shape)}"
                       for k, v in self.hypers.items() if v is not None)
        return (f"KernelOperator({self.descriptor!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}{', ' + hp if hp else ''})")

    # -- products --------------------------------------------------------------------------
    def matmul(self, v: torch.Tensor, *, out=None) -> torch.Tensor:
        """``K @ v`` through :func:`kermac_like.kernel_matvec` (v ``(N,)`` or ``(..., N, C)``);
        x and y shifted by their reference point where its path takes the product formula
        (see the module docstring)."""
        x, y = self._operands(v, out)
        return kernel_matvec(self.descriptor, x, y, v, out=out, **self._kwargs())

    def _operands(self, v, out) -> tuple:
        """(x, y) for kernel_matvec: as given, or shifted by their reference point (cached; per
        call under autograd) where the product's path forms distances by the product formula."""
        x, y = self.x, self.y
        if not (isinstance(v, torch.Tensor) and x.dtype in (torch.float32, torch.float64)):
            return x, y  # 16-bit data: kernel_matvec shifts float32 copies per call
        wide = x.dtype != torch.float64 and (v.dtype == torch.float64
                                             or (isinstance(out, torch.Tensor) and out.dtype == torch.float64))
        if torch.compiler.is_compiling() or not matvec_shifts(self.descriptor, x, y, wide):
            return x, y
        try:
            key = (x._version, y._version)
        except RuntimeError:  # inference tensors: kernel_matvec shifts them per call
            return x, y
        grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
        entry = self._centred[0]
        if entry is not None and entry[0] is x and entry[1] is y and entry[2] == key:
            s, xc, yc = entry[3:]
        elif entry is not None and entry[0] is y and entry[1] is x and entry[2] == key[::-1]:  # built by K.T
            s, yc, xc = entry[3:]
        else:
            s = xc = yc = None
        if s is None or (xc is None and not grad):
            if grad:  # the reference point alone: the products shift x and y themselves below
                s = centring.pair_reference(x, y)
            else:
                xc, yc, s = centring.shifted_pair(x, y, point=s)
                centring.mark_centred(s, xc, yc)
            self._centred[0] = (x, y, key, s, xc, yc)
        if not grad:
            return xc, yc
        # differentiable: x - s and y - s themselves (s is detached), one tensor where y is x
        xg = (x - s.to(x.dtype)) if (x.requires_grad or xc is None) else xc
        yg = xg if y is x else (y - s.to(y.dtype)) if (y.requires_grad or yc is None) else yc
        centring.mark_centred(s, xg, yg)
        return xg, yg

    def __matmul__(self, v):
        if not isinstance(v, torch.Tensor):
            return NotImplemented
        return self.matmul(v)

    def __rmatmul__(self, u):
        if not isinstance(u, torch.Tensor):
            return NotImplemented
        if u.dim() == 1:
            return self.T.matmul(u)
        return self.T.matmul(u.mT).mT

    # -- transpose -------------------------------------------------------------------------
    @property
    def T(self) -> "KernelOperator":
        """The transpose of the matrix modes (batch modes stay): x and y swapped, offsets swapped."""
        t = KernelOperator(self.descriptor, self.y, self.x, regularization_offset_x=self.regularization_offset_y,
                           regularization_offset_y=self.regularization_offset_x, epsilon=self.epsilon,
                           debug=self.debug, **{k: v for k, v in self.hypers.items() if v is not None})
        t._centred = self._centred  # the shifted copies, shared
        return t

    mT = T

    def t(self) -> "KernelOperator":
        return self.T

    # -- entries ------------------------------------------------------------------------------
    def to_dense(self, *, out=None) -> torch.Tensor:
        """The whole matrix, ``run_kernel(descriptor, x, y, ...)`` (M x N memory)."""
        return run_kernel(self.descriptor, self.x, self.y, out=out, **self._kwargs())

    def diagonal(self, offset: int = 0) -> torch.Tensor:
        """``torch.diagonal(K.to_dense(), offset, -2, -1)`` without the matrix.

        Entry i is ``k(x[i + r0], y[i + c0])`` with ``r0 = max(0, -offset)``,
        ``c0 = max(0, offset)``, i < min(M - r0, N - c0); lambda is added to every
        entry when ``offset == regularization_offset_x - regularization_offset_y``
        (those are the regularised entries), to none otherwise.  For ``y is x`` and
        a distance descriptor the main diagonal is the epilogue at distance 0 plus
        lambda: 0 (NONE) or 1 (LAPLACE, GAUSSIAN), plus lambda.  Shape
        ``(*batch, length)``; differentiable through torch autograd.
        """
        if isinstance(offset, bool) or not isinstance(offset, int):
            raise TypeError(f"offset: expected an integer, got {type(offset).__name__}")
        desc, M, N = self.descriptor, self._M, self._N
        r0, c0 = max(0, -offset), max(0, offset)
        n = max(0, min(M - r0, N - c0))
        x, y = self.x[..., r0:r0 + n, :], self.y[..., c0:c0 + n, :]
        wide = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype
        x, y = x.to(wide), y.to(wide)

        def hyper(name, extra):
            h = self.hypers[name]
            if isinstance(h, torch.Tensor):
                return h.to(wide).reshape(*h.shape, *([1] * extra))
            return h

        if not desc.fused_ok:  # a formula kernel: its values of the paired rows
            hp = {k: (h.to(wide).reshape(*h.shape, 1) if isinstance(h, torch.Tensor) else h)
                  for k, h in self.hypers.items()}
            if offset != self.regularization_offset_x - self.regularization_offset_y:
                hp["regularization"] = None
            k = formula_path.values(desc, x.unsqueeze(-2), y.unsqueeze(-2), hp, diag=0, epsilon=self.epsilon)
            return k[..., 0, 0].expand(*self.batch_shape, n).to(self.dtype)
        if desc.inner_operator is InnerOperator.DOT:
            acc = (x * y).sum(-1)
        else:
            t = x - y
            if desc.inner_power is PowerType.ABS:
                acc = t.abs().sum(-1)
            elif desc.inner_power is PowerType.SQUARE:
                acc = (t * t).sum(-1)
            else:
                acc = t.abs().pow(hyper("inner_p", 2)).sum(-1)
        if desc.outer_power is PowerType.SQRT:
            acc = acc.sqrt()
        elif desc.outer_power is PowerType.POW:
            acc = acc.pow(1.0 / hyper("outer_p", 1))
        if self.epsilon is not None:
            acc = torch.where(acc < self.epsilon, torch.zeros((), dtype=wide, device=acc.device), acc)
        if desc.kernel_type is KernelType.LAPLACE:
            acc = torch.exp(-acc / hyper("bandwidth", 1))
        elif desc.kernel_type is KernelType.GAUSSIAN:
            bw = hyper("bandwidth", 1)
            acc = torch.exp(-(acc * acc) / (2.0 * bw * bw))
        lam = self.hypers["regularization"]
        if lam is not None and offset == self.regularization_offset_x - self.regularization_offset_y:
            acc = acc + hyper("regularization", 1)
        acc = acc.expand(*self.batch_shape, n)
        return acc.to(self.dtype)
