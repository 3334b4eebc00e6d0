"""The covariance of the package's GPyTorch kernels: a linear_operator LinearOperator whose
products run through :func:`kermac_like.kernel_matvec` and never store the matrix.

``KermacKernelLinearOperator(x1, x2, kernel="rbf", outputscale=None)`` stands for
``s k(x1_m, x2_n)`` with x1, x2 already divided by the lengthscale (``(*batch, M, D)``,
``(*batch, N, D)``): ``exp(-|x1 - x2|^2 / 2)`` ("rbf") or ``exp(-|x1 - x2|)`` ("laplace",
Matern nu = 1/2), s the outputscale (``(*batch)``, 1 when None). It is linear_operator's
KernelLinearOperator (indexing, batch shapes, transposes, the representation the autograd
Functions rebuild it from) with

* ``_matmul``: ``kernel_matvec`` (O((M + N) C) memory). A float64 right-hand side of float32
  data takes kernel_matvec's float64 mode (float64 products and sums) where no gradient is
  asked for, as in the solves of CG and Lanczos. On the CPU, below DENSE_CPU_ELEMENTS entries, the
  products without gradient multiply by the kernel matrix formed once per operator
  (``_dense_kernel``: kernel_matvec's own entries; at N = 2000 the same bits as its one block),
  and the RBF training backward is two products with it;
* gradients (``_bilinear_derivative``): kernel_matvec's backward contraction with respect to x1 and
  x2, and autograd carries them on to the lengthscale through ``x / lengthscale``. For one tensor
  in both slots (a training covariance: the kernels pass ``x / lengthscale`` once) the x1 and x2
  terms are one contraction pass over the pairs with 2C columns instead of two with C (-6 ms of a
  5 x 10^4 training step on an H100); elsewhere linear_operator's autograd of ``_matmul``;
* ``_diagonal``: O(N) from the paired rows;
* ``to_dense``: the dense matrix with GPyTorch's own distance functions (differentiable),
  only for the small blocks that linear_operator densifies (the Cholesky path below
  ``gpytorch.settings.max_cholesky_size``, test blocks of predictions);
* ``mul`` by a constant (ScaleKernel's outputscale): the same operator with the outputscale
  folded in, so that the likelihood's noise is added to this operator and not to a
  ConstantMulLinearOperator around it;
* ``+`` a diagonal (the likelihood's noise): a :class:`KermacAddedDiagLinearOperator`, whose solves
  run the package's linear_cg (kermac_like/gpytorch/_cg.py: linear_operator's, bit for bit, without
  its per-iteration host reads before its stopping rule can act and without the product with the
  zero initial guess) and whose pivoted-Cholesky preconditioner is linear_operator's (same pivots, factor, Woodbury solve and
  logdet, same settings) with its forward and backward in rank x rank solves and N x rank
  products. linear_operator's own backward solves triangular systems with all N rows as
  right-hand sides (its PivotedCholesky Function, torch's QR backward): PivotedCholesky.backward
  took 17 s of a gp_step at N = 10^6 on an H200 (bench/notes/gpytorch.md).

Error model: the kernels depend on x1 - x2 only, and every path computes them so. The products
that form distances by the product formula centre their operands: the tensor-core CG products
(_products.py) on x2's mean inside the kernels, kernel_matvec's tensor-core and matrix-product
paths on the operands' reference point, except for an operator built with ``centred=True``
(kernels.py centres x1 and x2 on x1's mean once per forward), whose operands kernel_matvec reads
as they are (centring.mark_centred), so that no CG iteration shifts them again. The entries
(pivoted Cholesky rows and columns, the diagonal) are direct differences, and dense blocks
GPyTorch's sq_dist / dist on x1, x2 centred on x1's mean. So data offset by 1000 x its spread
give the products of centred data, to the float32 rounding of the inputs.
"""

from __future__ import annotations

import math

import torch
from torch.utils.weak import WeakIdKeyDictionary
from gpytorch.kernels.kernel import dist, sq_dist
from linear_operator import settings
from linear_operator.operators import AddedDiagLinearOperator, DiagLinearOperator, KernelLinearOperator
from linear_operator.utils.cholesky import psd_safe_cholesky
from linear_operator.utils.permutation import apply_permutation

from ..centring import mark_centred, shifted_pair
from ..descriptor import preset
from ..ops.distance import run_kernel
from ..ops.matvec import WIDE_OUT_INPUTS, kernel_matvec, matvec_shifts, prepare_matvec
from ..ops.matvec_backward import contraction
from . import _cg, _products, _switches

__all__ = ["KermacLinearOperatorBase", "KermacKernelLinearOperator", "KermacAddedDiagLinearOperator", "dense_covar",
           "KERNELS", "DENSE_CPU_ELEMENTS"]

# name -> the package's descriptor, evaluated at bandwidth 1 on x / lengthscale
KERNELS = {"rbf": preset("gaussian_l2"), "laplace": preset("laplace_l2")}

# On the CPU an operator whose kernel matrix has at most this many entries (all batch entries; float32:
# 128 MB, a square N of 5792) forms it once, at its first product, and multiplies by it (KERMAC_LIKE_GP_DENSE).
# kernel_matvec's torch path recomputes the same entries at every product (its blocks: the padded matrix
# product, the exponential), ~30 ms at N = 2000, D = 8 on one core, where the product with the stored matrix
# takes ~2 ms; GPyTorch's own kernels store the matrix at every N.
DENSE_CPU_ELEMENTS = 1 << 25

# The CPU's kernel matrices (KermacLinearOperatorBase._kept) by the first tensor they were formed from, then by
# what else they depend on; an entry goes with that tensor.
_SHARED = WeakIdKeyDictionary()


def dense_covar(x1: torch.Tensor, x2: torch.Tensor, *, kernel: str, outputscale=None, centred: bool = False
                ) -> torch.Tensor:
    """The dense kernel matrix (GPyTorch's formulas), for small blocks. Both distances are formed by the
    product formula (torch.cdist's matrix product, sq_dist's expansion) on x1, x2 centred on x1's mean, as
    sq_dist does itself and GPyTorch's MaternKernel does before dist (translation invariant); ``centred``:
    x1 and x2 come centred (the operator's flag), dist reads them as they are."""
    if kernel == "rbf":
        k = sq_dist(x1, x2).div_(-2.0).exp_()  # (centres on x1's mean itself)
    elif centred:
        k = dist(x1, x2).neg_().exp_()
    else:
        mean = x1.detach().mean(dim=-2, keepdim=True)
        k = dist(x1 - mean, x2 - mean).neg_().exp_()
    return k if outputscale is None else k * outputscale[..., None, None]


class KermacLinearOperatorBase(KernelLinearOperator):
    """What the package's GPyTorch operators share (:class:`KermacKernelLinearOperator`, the formula kernels'
    KermacFormulaLinearOperator): linear_operator's KernelLinearOperator (shape, batch modes, transposes,
    indexing, the representation) with the CPU's kernel matrix formed once per operator for its products."""

    def _dense_serves(self) -> bool:
        """Whether the products multiply by the stored kernel matrix (``KERMAC_LIKE_GP_DENSE``): x1 and x2
        CPU tensors of one dtype, float32 or float64, at most DENSE_CPU_ELEMENTS entries over the batch."""
        x1, x2 = self.x1, self.x2
        if not (_switches.on("DENSE") and x1.device.type == "cpu" and x2.device.type == "cpu"
                and x1.dtype in (torch.float32, torch.float64) and x2.dtype == x1.dtype):
            return False
        entries = math.prod(_broadcast_shape(x1.shape[:-2], x2.shape[:-2])) * x1.shape[-2] * x2.shape[-2]
        return entries <= DENSE_CPU_ELEMENTS

    def _kept(self, tensors: tuple, build, tag):
        """``build()``, kept until one of ``tensors`` changes (storage, version, shape, strides): on the operator,
        and for the other operators of the same ``tensors[0]`` and ``tag`` (what else the build depends on) as
        long as that tensor lives. linear_operator rebuilds an operator from its representation inside each
        of its autograd Functions (the log-determinant's CG, the preconditioner), so one training step makes
        several operators of the same tensors, which form the matrix once."""
        key = tuple((t.data_ptr(), t._version, tuple(t.shape), t.stride()) for t in tensors)
        cached = self.__dict__.get("_kl_dense")
        if cached is not None and cached[0] == key:
            return cached[1]
        shelf = _SHARED.get(tensors[0])
        hit = None if shelf is None else shelf.get(tag)
        if hit is None or hit[0] != key:
            hit = (key, build())
            if shelf is None:
                shelf = _SHARED[tensors[0]] = {}
            shelf[tag] = hit
        self.__dict__["_kl_dense"] = hit
        return hit[1]


class KermacKernelLinearOperator(KermacLinearOperatorBase):
    """KernelLinearOperator with the matrix-free products of the package; see the module docstring.

    ``x1``, ``x2``: the inputs already divided by the lengthscale; ``kernel``: "rbf" or "laplace".

    >>> import torch
    >>> from kermac_like.gpytorch import KermacKernelLinearOperator
    >>> z = torch.tensor([[0.0], [1.0], [2.0]])
    >>> K = KermacKernelLinearOperator(z, z, kernel="rbf")      # exp(-|z1 - z2|^2 / 2)
    >>> K @ torch.ones(3, 1)
    tensor([[1.7419],
            [2.2131],
            [1.7419]])
    >>> KermacKernelLinearOperator(z, z, kernel="laplace").to_dense()[0]
    tensor([1.0000, 0.3679, 0.1353])
    """

    def __init__(self, x1, x2, covar_func=None, num_outputs_per_input=(1, 1), num_nonbatch_dimensions=None,
                 **params):
        covar_func = dense_covar if covar_func is None else covar_func
        kernel = params.get("kernel")
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {sorted(KERNELS)}, got {kernel!r}")
        if tuple(num_outputs_per_input) != (1, 1):
            raise ValueError(f"num_outputs_per_input: expected (1, 1), got {num_outputs_per_input!r}")
        if not params.get("centred", False):
            params.pop("centred", None)
        elif params["centred"] is not True:
            raise TypeError(f"centred: expected a bool, got {type(params['centred']).__name__}")
        if params.get("outputscale") is None:
            params.pop("outputscale", None)
        elif not torch.is_tensor(params["outputscale"]):
            got = type(params["outputscale"]).__name__
            raise TypeError(f"outputscale: expected a tensor (*batch) or None, got {got}")
        num_nonbatch_dimensions = {"outputscale": 0, **(num_nonbatch_dimensions or {})}
        super().__init__(x1, x2, covar_func=covar_func, num_outputs_per_input=num_outputs_per_input,
                         num_nonbatch_dimensions=num_nonbatch_dimensions, **params)

    @property
    def kernel(self) -> str:
        return self.nontensor_params["kernel"]

    @property
    def centred(self) -> bool:
        """Whether x1 and x2 come centred together (``centred=True``: the package's kernels centre them on x1's
        mean once per forward), so that kernel_matvec reads them as they are (no shift per product)."""
        return bool(self.nontensor_params.get("centred", False))

    @property
    def outputscale(self) -> torch.Tensor | None:
        """The scale s (``(*batch)``), None for 1."""
        return self.tensor_params.get("outputscale")

    def _scaled(self, k: torch.Tensor, *batch_indices) -> torch.Tensor:
        """k times the outputscale: at ``batch_indices`` (index tensors that broadcast with k), or without
        them over k's trailing dimensions (k ``(*batch, ...)``)."""
        s = self.outputscale
        if s is None:
            return k
        return k * (s[batch_indices] if batch_indices else s.reshape(*s.shape, *[1] * (k.dim() - s.dim())))

    def _mul_constant(self, other) -> KermacKernelLinearOperator:
        # ScaleKernel's orig_output.mul(outputscale): other () or (*batch), differentiable
        other = torch.as_tensor(other, dtype=self.dtype, device=self.device)
        s = other if self.outputscale is None else self.outputscale * other
        return self.__class__(self.x1, self.x2, covar_func=self.covar_func,
                              num_outputs_per_input=self.num_outputs_per_input,
                              num_nonbatch_dimensions=self.num_nonbatch_dimensions,
                              **{**self.tensor_params, "outputscale": s}, **self.nontensor_params)

    def __add__(self, other):
        if isinstance(other, DiagLinearOperator):
            return KermacAddedDiagLinearOperator(self, other)
        return super().__add__(other)

    def add_diagonal(self, diag: torch.Tensor):
        added = super().add_diagonal(diag)
        return KermacAddedDiagLinearOperator(self, added._diag_tensor)

    def pivoted_cholesky(self, rank: int, error_tol: float | None = None, return_pivots: bool = False):
        """linear_operator's partial pivoted Cholesky factor (N x rank, the same pivots and values), whose
        backward solves only rank x rank triangular systems (see :class:`_PivotedCholesky`)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank: expected a positive int, got {rank!r}")
        factor, pivots = _PivotedCholesky.apply(self.representation_tree(), rank, error_tol, *self.representation())
        return (factor, pivots) if return_pivots else factor

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        # rhs: (*batch2, N, C) or (N,) -> (..., M, C) or (..., M)
        return self._scaled(self._kernel_matmul(rhs))

    def _kernel_matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        """k(x1, x2) rhs without the outputscale."""
        x1, x2 = self.x1, self.x2
        grad = torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or rhs.requires_grad)
        wide = rhs.dtype == torch.float64 and x1.dtype in WIDE_OUT_INPUTS and not grad
        if not wide and rhs.dtype != x1.dtype:
            rhs = rhs.to(x1.dtype)
        if not grad and not wide:  # CG / Lanczos: several columns on tensor cores where served
            out = _products.matmul(self, x1, x2, rhs)
            if out is not None:
                return out
            dense = self._dense_kernel()  # the CPU: the kernel matrix formed once
            if dense is not None:
                return torch.matmul(dense[0], rhs)
        x1, x2 = x1.contiguous(), x2.contiguous()
        if self.centred:  # centred together (kernels.py): read as they are, whichever tensors carry them now
            mark_centred(object(), x1, x2)
        return kernel_matvec(KERNELS[self.kernel], x1, x2, rhs.contiguous(), bandwidth=1.0)

    def _dense_kernel(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k(x1, x2) ``(*batch, M, N)`` without the outputscale, the x1 it was formed from) on the CPU where it
        has at most DENSE_CPU_ELEMENTS entries, else None. Formed once per operator (again if x1 or x2 changed
        in place) outside autograd, as kernel_matvec's torch path forms its blocks: run_kernel's matrix product
        on x1 and x2 as given for an operator built ``centred``, else shifted by their reference point where
        that path shifts them (ops.matvec.matvec_shifts), so the same entries; below MATVEC_COLUMNS points of
        x2 and CPU_BLOCK_ELEMENTS entries (kermac_like/torch_path.py) it is kernel_matvec's one block, and the
        product with it kernel_matvec's result bit for bit."""
        if not self._dense_serves():
            return None
        x1, x2 = self.x1, self.x2

        def build():
            desc = KERNELS[self.kernel]
            a, b = x1.detach(), x2.detach()
            if not self.centred and matvec_shifts(desc, a, b, False):
                a, b, _ = shifted_pair(a, b)
            out = torch.empty(*_broadcast_shape(x1.shape[:-2], x2.shape[:-2]), x1.shape[-2], x2.shape[-2],
                              dtype=x1.dtype)
            with torch.no_grad():
                run_kernel(desc, a, b, bandwidth=1.0, out=out)
            return out, a

        return self._kept((x1, x2), build, (self.kernel, self.centred))

    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor):
        # The gradients of sum_c u_c^T (s K(x1, x2)) v_c (GPyTorch's training backward: U the solves, V the
        # probes). For one x in both slots (a training covariance, kernels.py passes the same tensor) the x1
        # and x2 terms of kernel_matvec's backward, two contraction passes over all pairs,
        #   sum_n phi_mn (s u_m . v_n) psi(x_m - x_n)  +  sum_n phi_nm (v_m . s u_n) psi(x_m - x_n)
        # (phi symmetric in m, n), are one pass with 2C columns, [s U, V] . [V, s U], returned as x1's
        # gradient (autograd adds x2's None to it: the same tensor). The outputscale's from one product
        # without autograd. Elsewhere (batch modes, two inputs, KERMAC_LIKE_GP_SYMGRAD=0) linear_operator's.
        x, s = self.x1, self.outputscale
        if not (_switches.on("SYMGRAD") and _same_autograd_tensor(x, self.x2) and x.requires_grad and x.dim() == 2
                and left_vecs.dim() == 2 and right_vecs.dim() == 2 and set(self.tensor_params) <= {"outputscale"}):
            return super()._bilinear_derivative(left_vecs, right_vecs)
        u = left_vecs.to(x.dtype)
        v = right_vecs.to(x.dtype)
        su = u if s is None else u * s.detach().to(x.dtype)
        dense = self._dense_kernel()
        if dense is not None:
            # the CPU: d/dx_m of exp(-|x_m - x_n|^2 / 2) is -(x_m - x_n) k_mn, so with W = (s U V^T + V s U^T) o K
            # the contraction is sum_n W_mn (x_n - x_m) = (W x)_m - (sum_n W_mn) x_m: products with the stored K,
            # on x as K was formed from it (centred or shifted; the sum is translation invariant). The two terms
            # cancel where x_m is far from the points near it: W x and the row sums in float64 (float32 there:
            # 3.8e-6 relative error against float64 at N = 1500, D = 8, against 5e-7 for the contraction's direct
            # differences; float64: as the contraction, bench/notes/cpu_paths.md). The Laplace kernel's
            # -(x_m - x_n) k_mn / d_mn: W o K / d with the distances by direct differences (the product formula
            # loses near pairs, whose 1 / d is large), 0 at d = 0 as the contraction's
            k, xs = dense
            w = torch.matmul(torch.cat([su, v], -1), torch.cat([v, su], -1).mT).mul_(k)
            if self.kernel == "laplace":
                d = torch.cdist(xs, xs, compute_mode="donot_use_mm_for_euclid_dist")
                w = torch.where(d > 0, w / d, 0.0)
            w = w.to(torch.float64)
            xs = xs.to(torch.float64)
            gx = torch.matmul(w, xs).sub_(w.sum(-1, keepdim=True) * xs)
        else:
            call = prepare_matvec(KERNELS[self.kernel], x, x, v, bandwidth=1.0)
            hp = call.hypers
            gx = contraction(call.desc, x.detach(), x.detach(), torch.cat([su, v], -1), torch.cat([v, su], -1),
                             inner_p=hp["inner_p"], outer_p=hp["outer_p"], bandwidth=hp["bandwidth"],
                             epsilon=call.epsilon)
        gs = None
        if s is not None and s.requires_grad:
            with torch.no_grad():
                gs = (left_vecs * self._kernel_matmul(right_vecs)).sum().reshape(s.shape).to(s.dtype)
        return (gx.to(x.dtype), None) + (() if s is None else (gs,))

    def _get_indices(self, row_index, col_index, *batch_indices) -> torch.Tensor:
        # Entries s k(x1[row], x2[col]) at index tensors, as the pivoted-Cholesky preconditioner asks
        # for them (its rows). The base class runs GPyTorch's batched sq_dist on N x rank 1 x 1
        # matrices, whose padded temporaries took 4.6 GB at N = 10^6, D = 8: here direct differences.
        a, b = self.x1[(*batch_indices, row_index)], self.x2[(*batch_indices, col_index)]
        return self._scaled(self._of_squared_distance(_squared_distances(a, b)), *batch_indices)

    def pivot_row(self, pivot: torch.Tensor) -> torch.Tensor:
        """K[..., p, :]: ``(*batch, N)`` for one pivot per batch entry (``(*batch, 1)``), the pivoted-Cholesky
        forward's row: the operations of _get_indices on the same number of entries, in the same
        layout, so the same bits as apply_permutation's row, without its N x D gathers of x1 and x2."""
        xp = self.x1.gather(-2, pivot.unsqueeze(-1).expand(*pivot.shape, self.x1.shape[-1]))
        return self._scaled(self._of_squared_distance(_squared_distances(xp, self.x2)))

    def pivot_columns(self, pivots: torch.Tensor) -> torch.Tensor:
        """K[..., :, p]: ``(*batch, N, m)`` for pivots ``(*batch, m)``, the entries _get_indices gives for
        all rows x the pivots (the pivoted-Cholesky backward's block), with x2's pivot rows gathered once
        and the differences broadcast: no N x m gather of x1, whose backward scattered N m D duplicate
        gradients (index_put, 11.9 ms of a 5 x 10^4 step; bench/notes/gpytorch.md)."""
        x2 = self.x2.expand(*pivots.shape[:-1], *self.x2.shape[-2:])
        xp = x2.gather(-2, pivots.unsqueeze(-1).expand(*pivots.shape, x2.shape[-1]))
        sq = _squared_distances(self.x1.unsqueeze(-2), xp.unsqueeze(-3))
        return self._scaled(self._of_squared_distance(sq))

    def _diagonal(self) -> torch.Tensor:
        # s k(x1_i, x2_i): (*batch, N)
        return self._scaled(self._of_squared_distance((self.x1 - self.x2).square().sum(-1)))

    def _of_squared_distance(self, sq: torch.Tensor) -> torch.Tensor:
        """k from squared distances; the Laplace kernel's distance is the square root of a clamped
        square, as GPyTorch's dist forms it (gradient 0 at 0)."""
        if self.kernel == "rbf":
            return sq.div(-2.0).exp()
        return sq.clamp_min(1e-30).sqrt().neg().exp()

    def to_dense(self) -> torch.Tensor:
        return self.covar_mat


def _same_autograd_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are one tensor of the autograd graph (so that a gradient given to one counts for both):
    the same object, or, as saved tensors come back from a Function's context, the same output of the same
    node over the same memory."""
    if a is b:
        return True
    return (a.grad_fn is not None and a.grad_fn is b.grad_fn and a.output_nr == b.output_nr
            and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _broadcast_shape(s: tuple, t: tuple) -> tuple:
    """The broadcast of two valid shapes (the caller's elementwise op checks them): 1-2 us on the host
    where torch.broadcast_shapes (torch 2.13, Python) took 13-16 us, once per pivoted-Cholesky row."""
    s, t = (1,) * (len(t) - len(s)) + tuple(s), (1,) * (len(s) - len(t)) + tuple(t)
    return tuple(u if v == 1 else v for u, v in zip(s, t))


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b|^2 over the last dimension, a and b broadcast against each other, summed over coordinate
    chunks so that no temporary holds more than 2^24 values."""
    n = math.prod(_broadcast_shape(a.shape[:-1], b.shape[:-1]))
    chunk = max(1, (1 << 24) // max(1, n))
    if chunk >= a.shape[-1]:  # one chunk
        return (a - b).square().sum(-1)
    sq = None
    for k0 in range(0, a.shape[-1], chunk):
        part = (a[..., k0:k0 + chunk] - b[..., k0:k0 + chunk]).square().sum(-1)
        sq = part if sq is None else sq + part
    return sq


class _PivotedCholesky(torch.autograd.Function):
    """linear_operator's PivotedCholesky (functions/_pivoted_cholesky.py) for this module's operator: the
    same greedy pivots (largest residual diagonal, ties in its permutation order, its error_tol stop)
    and the same factor and permutation, bit for bit; the same gradient, that of ``K[:, p] L^-T`` with
    ``L = chol(K[p, p])`` at fixed pivots p, but as ``K[:, p] @ inv(L)^T``: linear_operator's backward
    solves ``L X = K[p', p]^T`` with all N - rank rows p' as right-hand sides (cuBLAS trsm at rank x N:
    9.1 s forward and as much backward at N = 10^6, rank 15, on an H200).

    The stop is deferred, so that the host never waits for the device inside the loop: the forward runs
    all rank iterations without the tolerance test, keeps each iteration's residual 1-norm in a device
    tensor, and reads the errors once at the end to find the m at which linear_operator's loop would
    have stopped (``errors.max() > tol`` false, NaN included). It returns the first m rows and the
    permutation with the later iterations' swaps undone; whatever those iterations met (zero or
    negative residuals, NaN, inf) stays in rows it discards. The pivot's row of K comes straight from
    the points (:meth:`KermacKernelLinearOperator.pivot_row`, the same bits as apply_permutation's,
    which other operators keep), and the factor is kept with its columns in pivot order and the
    residual diagonal as an extra row, so that one gather and one scatter swap both."""

    @staticmethod
    def forward(ctx, representation_tree, rank, error_tol, *matrix_args):
        matrix = representation_tree(*matrix_args)
        *batch, n = matrix.shape[:-1]
        tol = settings.preconditioner_tolerance.value() if error_tol is None else error_tol
        rank = min(rank, n)
        state = _pivot_graph_state(representation_tree, matrix, rank, matrix_args)
        if state is None:
            G, perm, sw, norms, orig_error = _pivot_loop(matrix, rank)
        else:
            G, perm, sw, norms, orig_error = state
            perm = perm.clone()  # returned and edited below; the graph's own buffer is rewritten by its next replay
        # linear_operator's loop runs iteration m while m == 0 or (m < rank and errors.max() > tol), errors
        # those of iteration m - 1: it stops after the first iteration whose test fails (NaN included)
        m = rank
        if rank > 1:
            errors = norms / orig_error
            stop = torch.ones(rank, dtype=torch.uint8, device=G.device)
            stop[:-1] = ~(errors.reshape(rank - 1, -1).amax(-1) > tol)
            m = int(stop.argmax()) + 1  # the one synchronisation
        factor = G.new_empty(*batch, n, m)
        factor.scatter_(-2, perm.unsqueeze(-1).expand(*batch, n, m), G[..., :m, :].mT)
        for j in range(rank - 1, m - 1, -1):  # undo the swaps of the iterations past the stop
            idx, pj = sw[j].movedim(0, -1), perm[..., j:]
            pj.scatter_(-1, idx[..., :2], pj.gather(-1, idx[..., 1:]))
        ctx.representation_tree = representation_tree
        ctx.save_for_backward(perm[..., :m].contiguous(), *matrix_args)
        ctx.mark_non_differentiable(perm)
        return factor, perm

    @staticmethod
    def backward(ctx, grad_factor, _):
        pivots, *args = ctx.saved_tensors
        with torch.enable_grad():
            args = [a.detach().requires_grad_(True) if a.is_floating_point() else a for a in args]
            op = ctx.representation_tree(*args)
            cols = (op.pivot_columns(pivots) if isinstance(op, KermacKernelLinearOperator)  # K[..., :, p]: (*batch, N, m)
                    else apply_permutation(op, None, pivots))
            m = pivots.shape[-1]
            L = psd_safe_cholesky(cols.gather(-2, pivots.unsqueeze(-1).expand(*pivots.shape, m)))
            eye = torch.eye(m, dtype=L.dtype, device=L.device).expand_as(L)
            factor = cols @ torch.linalg.solve_triangular(L, eye, upper=False).mT
            wrt = [a for a in args if a.requires_grad]
            grads = iter(torch.autograd.grad(factor, wrt, grad_factor, allow_unused=True))
        return (None, None, None, *(next(grads) if a.requires_grad else None for a in args))


def _pivot_loop(matrix, rank: int):
    """The rank iterations of _PivotedCholesky's forward, sync-free (see its docstring): the factor G in pivot
    order with the residual diagonal as row rank, the permutation, each iteration's swap sw, the residual's
    1-norms and the first diagonal's maximum."""
    *batch, n = matrix.shape[:-1]
    diag = matrix._approx_diagonal()
    if isinstance(matrix, KermacKernelLinearOperator):
        row_of = matrix.pivot_row
    else:
        def row_of(pivot):
            return apply_permutation(matrix, pivot, None).squeeze(-2)
    # G[..., j, i] = L[..., j, perm[..., i]] (L linear_operator's rank x n factor, perm the current
    # permutation), G[..., rank, i] the residual diagonal at perm[..., i]: swapping columns m and m + a
    # of G swaps both. sw[j, 1] is iteration j's a (relative to j), sw[j, 0] = sw[j, 2] = 0, so that
    # gather(sw[j, 1:]) then scatter(sw[j, :2]) swaps entries j and j + a.
    G = diag.new_zeros(*batch, rank + 1, n)
    G[..., rank, :] = diag
    orig_error = diag.max(-1).values
    perm = torch.arange(n, device=diag.device).repeat(*batch, 1)
    sw = perm.new_zeros(rank, 3, *batch)
    values = diag.new_empty(rank, *batch)
    norms = diag.new_empty(rank - 1, *batch)  # the residual's 1-norm after iterations 0 .. rank - 2
    for m in range(rank):
        torch.max(G[..., rank, m:], -1, out=(values[m], sw[m, 1]))
        idx = sw[m].movedim(0, -1)  # (*batch, 3)
        pm = perm[..., m:]
        swapped = pm.gather(-1, idx[..., 1:])  # (perm[m + a], perm[m])
        pm.scatter_(-1, idx[..., :2], swapped)
        Gm = G[..., m:]
        gidx = idx.unsqueeze(-2).expand(*batch, rank + 1, 3)
        Gm.scatter_(-1, gidx[..., :2], Gm.gather(-1, gidx[..., 1:]))
        torch.sqrt(values[m], out=G[..., m, m])
        if m + 1 < n:
            new = G[..., m, m + 1:]  # L[..., m, perm[..., m + 1:]]
            torch.gather(row_of(swapped[..., :1]), -1, perm[..., m + 1:], out=new)
            if m > 0:
                new -= (G[..., :m, m:m + 1] * G[..., :m, m + 1:]).sum(-2)
            new /= G[..., m, m:m + 1]
            if m + 1 < rank:  # the residual diagonal and its error for the next iteration
                residual = G[..., rank, m + 1:] - new**2
                G[..., rank, m + 1:] = residual
                torch.linalg.vector_norm(residual, 1, -1, out=norms[m])
    return G, perm, sw, norms, orig_error


_PIVOT_GRAPHS: dict = {}


def _pivot_graph_state(representation_tree, matrix, rank: int, matrix_args):
    """_pivot_loop's outputs from a CUDA graph of it (the loop is host-bound: ~22 small kernels an iteration,
    bench/notes/gpytorch.md), captured once per (operator type, shapes, strides, dtypes, rank) on copies of
    the operator's tensors and replayed after copying them in: the same kernels, so the same bits. None
    (the caller runs the loop eagerly) off CUDA, for other operators, with KERMAC_LIKE_GP_GRAPH=0, or where
    the capture failed once for that key. The outputs belong to the graph: used before its next replay."""
    if not (isinstance(matrix, KermacKernelLinearOperator) and _switches.on("GRAPH")):
        return None
    tensors = [a for a in matrix_args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else None
    if (device is None or device.type != "cuda" or any(a.device != device for a in tensors)
            or device.index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing()):
        return None  # captured and replayed on the current device only
    key = (type(matrix), matrix.kernel, rank, device.index,
           tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else ("v", repr(a))
                 for a in matrix_args))
    entry = _PIVOT_GRAPHS.get(key)
    if entry is None:
        if len(_PIVOT_GRAPHS) >= 8:
            _PIVOT_GRAPHS.clear()
        static = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in matrix_args]
        try:
            with torch.no_grad():
                smatrix = representation_tree(*static)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    _pivot_loop(smatrix, rank)  # warm-up, as torch.cuda.graph asks
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outputs = _pivot_loop(smatrix, rank)
            entry = (static, graph, outputs)
        except Exception:  # not capturable here: the eager loop from now on for this key
            entry = False
        _PIVOT_GRAPHS[key] = entry
    if entry is False:
        return None
    static, graph, outputs = entry
    with torch.no_grad():
        for dst, src in zip(static, matrix_args):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
    return outputs


class _ShiftedQR(torch.autograd.Function):
    """``Q[..., :N, :]``, R and ``2 log|det R|`` of the QR ``[A; c I] = Q R`` (A ``(*batch, N, k)``, c
    ``(*batch, 1, 1)``), as AddedDiagLinearOperator._init_cache forms it for the Woodbury solve and
    the logdet. ``2 log|det R| = logdet(A^T A + c^2 I)`` is differentiable in k x k work:
    ``d/dA = 2 Q[:N] R^-T``, ``d/dc = 2 c |R^-1|_F^2``; Q and R are constants, as the preconditioner
    only applies them inside linear_operator's Functions (torch's QR backward would solve
    ``X R^H = G`` for all N + k rows)."""

    @staticmethod
    def forward(ctx, a, c):
        n, k = a.shape[-2:]
        eye = torch.eye(k, dtype=a.dtype, device=a.device)
        q, r = torch.linalg.qr(torch.cat((a, c * eye), dim=-2))
        q = q[..., :n, :]
        ctx.save_for_backward(q, torch.linalg.solve_triangular(r, eye.expand_as(r), upper=True), c)
        ctx.mark_non_differentiable(q, r)
        return q, r, r.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1).mul(2)

    @staticmethod
    def backward(ctx, _q, _r, grad):
        q, r_inv, c = ctx.saved_tensors
        grad = grad[..., None, None]
        grad_c = grad * 2 * c * r_inv.square().sum((-2, -1), keepdim=True) if ctx.needs_input_grad[1] else None
        return grad * 2 * (q @ r_inv.mT), grad_c


class KermacAddedDiagLinearOperator(AddedDiagLinearOperator):
    """``K + D`` for a :class:`KermacKernelLinearOperator` K (the likelihood's noise D): linear_operator's
    AddedDiagLinearOperator, whose preconditioner (``_preconditioner``: the rank
    ``max_preconditioner_size`` pivoted Cholesky factor F of K, ``(F F^T + D)^-1`` by Woodbury through
    the QR of ``[F; D^1/2]``, its logdet) takes F from K.pivoted_cholesky and the QR from
    :class:`_ShiftedQR`: no triangular solve with N right-hand sides, forward or backward."""

    def _solve(self, rhs: torch.Tensor, preconditioner=None, num_tridiag: int | None = 0):
        # linear_operator's LinearOperator._solve with the package's linear_cg (the same bits, no host waits
        # where its stopping rule cannot act, no product with the zero initial guess: kermac_like/gpytorch/_cg.py)
        if not _switches.on("CG"):
            return super()._solve(rhs, preconditioner, num_tridiag=num_tridiag)
        mat = rhs if rhs.dim() > 1 else rhs.unsqueeze(-1)
        zero_residual = (torch.Size((*torch.broadcast_shapes(self.batch_shape, mat.shape[:-2]), *mat.shape[-2:])),
                         torch.promote_types(rhs.dtype, self.dtype))
        return _cg.linear_cg(self._matmul, rhs, n_tridiag=num_tridiag, max_iter=settings.max_cg_iterations.value(),
                             max_tridiag_iter=settings.max_lanczos_quadrature_iterations.value(),
                             preconditioner=preconditioner, zero_residual=zero_residual)

    def _init_cache_for_constant_diag(self, eye, batch_shape, n, k):
        self._noise = self._noise.narrow(-2, 0, 1)
        self._q_cache, self._r_cache, logdet = _ShiftedQR.apply(self._piv_chol_self, self._noise.sqrt())
        logdet = logdet + (n - k) * self._noise.squeeze(-2).squeeze(-1).log()
        self._precond_logdet_cache = logdet.view(*batch_shape) if len(batch_shape) else logdet.squeeze()

    def _init_cache_for_non_constant_diag(self, eye, batch_shape, n):
        ones = self._noise.new_ones(*self._noise.shape[:-2], 1, 1)
        self._q_cache, self._r_cache, logdet = _ShiftedQR.apply(self._piv_chol_self / self._noise.sqrt(), ones)
        self._q_cache = self._q_cache / self._noise.detach().sqrt()
        logdet = logdet - (1.0 / self._noise).log().sum([-1, -2])
        self._precond_logdet_cache = logdet.view(*batch_shape) if len(batch_shape) else logdet.squeeze()
