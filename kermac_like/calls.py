"""The validated calls of the ops, one frozen value per family, made once by the op's ``prepare_*``
(ops/) and read by the plan rules (plan/) and the torch paths:

* :class:`DistanceCall`: run_kernel and cdist (and the kernel-matrix part of every other family);
* :class:`MatvecCall`: kernel_matvec (with :func:`check_rhs`, its right-hand side's checks);
* :class:`TopkCall`: kernel_topk and knn;
* :class:`GradCall`: cdist_grad.

Each has ``of``-style constructors or is built by its op after the checks (ops/distance.py
``prepare_call``, ops/matvec.py ``prepare_matvec``, ops/knn.py ``prepare_topk``/``prepare_knn``);
none validates on its own. COMPUTE_MODES: torch.cdist's compute modes, which the calls carry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

from ._args import check_same, check_tensor
from .descriptor import InnerOperator, KernelDescriptor, KernelType
from .layout import broadcast_batch_shape, broadcast_shapes

__all__ = ["COMPUTE_MODES", "DistanceCall", "MatvecCall", "TopkCall", "GradCall", "WIDE_OUT_INPUTS", "check_rhs",
           "values_are_distances"]

COMPUTE_MODES = (
    "use_mm_for_euclid_dist_if_necessary",
    "use_mm_for_euclid_dist",
    "donot_use_mm_for_euclid_dist",
)


def _batch(hypers: dict, *operands) -> tuple:
    """The broadcast batch of the operands (their modes before the last two) and the tensor
    hyper-parameters (layout.broadcast_shapes: torch's imports SymPy on its first call)."""
    return broadcast_shapes(*(t.shape[:-2] for t in operands),
                            *(h.shape for h in hypers.values() if isinstance(h, torch.Tensor)))


class DistanceCall(NamedTuple):
    """A validated run_kernel call (everything the planner needs); ``_replace`` makes a changed copy."""

    desc: KernelDescriptor
    a: torch.Tensor
    b: torch.Tensor
    hypers: dict  # name -> float | Tensor | None
    reg_diag: int
    epsilon: float | None
    batch: tuple
    M: int
    N: int
    K: int
    autotune: bool | None = None  # measure the kernel choice (None: plan.autotune's setting)

    @classmethod
    def of(cls, desc: KernelDescriptor, a, b, hypers: dict, reg_diag: int, epsilon) -> "DistanceCall":
        """A call from already-checked arguments (the batch: a, b and tensor hyper-parameters broadcast)."""
        return cls(desc, a, b, hypers, reg_diag, epsilon, _batch(hypers, a, b), a.shape[-2], b.shape[-2], a.shape[-1])

    out_shape = property(lambda self: (*self.batch, self.M, self.N))
    device = property(lambda self: self.a.device)
    dtype = property(lambda self: self.a.dtype)


# Input dtypes whose kernel_matvec has a float64 mode: a float64 ``out`` and/or a float64 ``v``
# (float64 products and sums of the kernel values, stored unrounded).
WIDE_OUT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _XYCall:
    """What MatvecCall and TopkCall share: the kernel matrix of x (M rows) and y (N rows) as
    run_kernel's call has it (its device and dtype: x's)."""

    desc: Optional[KernelDescriptor]
    x: torch.Tensor
    y: torch.Tensor
    hypers: dict  # inner_p/outer_p/bandwidth/regularization -> float | Tensor | None
    reg_diag: int  # entry (m, n) is regularised where n - m == reg_diag
    epsilon: float | None
    batch: tuple
    M: int
    N: int
    K: int

    device = property(lambda self: self.x.device)
    dtype = property(lambda self: self.x.dtype)


@dataclass(frozen=True)
class MatvecCall(_XYCall):
    """A validated kernel_matvec call. ``v`` is always a matrix ``(..., N, C)`` (a 1-D
    right-hand side was given a trailing mode of 1 and ``vector`` is set)."""

    v: torch.Tensor
    C: int
    vector: bool
    # The blocked float64 mode (internal; Falkon's products): with a float64 out of float32/16-bit
    # data and the expanded form, v rounded to float32 once and float32 partials of a few points
    # added into the float64 sums (specs.matvec.F32_GROUP); elsewhere ignored.
    f32_partials: bool = False

    @classmethod
    def of(cls, desc, x, y, v, hypers: dict, reg_diag: int, epsilon) -> "MatvecCall":
        """A call from the op's arguments (checked once by kernel_matvec; its backward's alike)."""
        vector = v.dim() == 1
        vm = v.unsqueeze(-1) if vector else v
        return cls(desc, x, y, hypers, reg_diag, epsilon, _batch(hypers, x, y, vm), x.shape[-2], y.shape[-2],
                   x.shape[-1], vm, vm.shape[-1], vector)

    @property
    def out_shape(self) -> tuple:
        return (*self.batch, self.M) if self.vector else (*self.batch, self.M, self.C)

    @property
    def wide_v(self) -> bool:
        """v is float64 while x and y are float32/16-bit (the float64 mode; out is float64)."""
        return self.v.dtype == torch.float64 and self.x.dtype != torch.float64

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype of the result when no ``out`` is given: float64 for a float64 v, else x's."""
        return torch.float64 if self.wide_v else self.dtype

    def with_v(self, v: torch.Tensor) -> "MatvecCall":
        """The same kernel matrix applied to another right-hand side ``(..., N, C')`` or ``(N,)``."""
        return _with_v(self, "v", v)

    def transposed(self, v: torch.Tensor) -> "MatvecCall":
        """K^T @ v: x and y swapped (every descriptor is symmetric), the regularised
        diagonal mirrored, ``v`` ``(..., M, C')`` or ``(M,)``."""
        t = replace(self, x=self.y, y=self.x, M=self.N, N=self.M, reg_diag=-self.reg_diag)
        return _with_v(t, "v", v)


def check_rhs(name: str, v, x: torch.Tensor, N: int):
    """(matrix view (..., N, C), vector?) of a right-hand side of kernel_matvec, checked (TypeError/ValueError
    naming it)."""
    if not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(v).__name__}")
    check_tensor(name, v, min_dim=1)
    if not (v.dtype == torch.float64 and x.dtype in WIDE_OUT_INPUTS):  # else the float64 mode
        check_same(name, v, "x", x)
    elif v.device != x.device:
        raise ValueError(f"{name}: device {v.device} differs from x's {x.device}")
    vector = v.dim() == 1
    vm = v.unsqueeze(-1) if vector else v
    if vm.shape[-2] != N:
        raise ValueError(f"{name}: expected {N} rows (the points of y), got shape {tuple(v.shape)}")
    return vm, vector


def _with_v(call: MatvecCall, name: str, v) -> MatvecCall:
    vm, vector = check_rhs(name, v, call.x, call.N)
    shapes = {"x": tuple(call.x.shape[:-2]), "y": tuple(call.y.shape[:-2]), name: tuple(vm.shape[:-2]),
              "batch": call.batch}
    batch = broadcast_batch_shape(shapes)
    return replace(call, v=vm, vector=vector, C=vm.shape[-1], batch=batch)


@dataclass(frozen=True)
class TopkCall(_XYCall):
    """A validated kernel_topk / knn call.

    ``desc`` is None only for knn with p = 0 or p = inf (torch.cdist's counting and maximum
    norms, which no descriptor expresses; such calls never reach the fused planner). ``p`` is
    knn's p (None for kernel_topk): the blocked path then computes torch.cdist's distances
    under ``compute_mode`` (its matrix product for p = 2 where torch takes it).
    """

    k: int
    largest: bool
    distance: bool  # values are distances (no epilogue, DIFF inner): largest defaults to False
    p: float | None = None
    compute_mode: str = COMPUTE_MODES[0]
    reference: Optional[torch.Tensor] = None  # (K,) the tensor-core candidates' shift (None: the data's)

    @classmethod
    def of(cls, desc, x, y, k: int, largest: bool, hypers: dict, reg_diag: int, epsilon, p=None,
           compute_mode: str = COMPUTE_MODES[0]) -> "TopkCall":
        """A call from already-checked arguments (the op's: kernel_topk or knn checked them once)."""
        return cls(desc, x, y, hypers, reg_diag, epsilon, _batch(hypers, x, y), x.shape[-2], y.shape[-2], x.shape[-1],
                   k, largest, values_are_distances(desc), p, compute_mode)

    @property
    def out_shape(self) -> tuple:
        return (*self.batch, self.M, self.k)

    def distance_call(self) -> DistanceCall:
        """The run_kernel call whose rows are searched (not for p = 0 / inf)."""
        return DistanceCall(self.desc, self.x, self.y, self.hypers, self.reg_diag, self.epsilon, self.batch,
                            self.M, self.N, self.K)


class GradCall(NamedTuple):
    """A validated cdist_grad call: a (..., K, M), b (..., N, K), c (..., O, K), d (..., N, M), ``p`` a
    number or a tensor over the batch, ``batch`` their broadcast batch."""

    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor
    d: torch.Tensor
    p: object
    batch: tuple

    @classmethod
    def of(cls, a, b, c, d, p) -> "GradCall":
        """A call from already-checked arguments (the op's: cdist_grad checked them once)."""
        return cls(a, b, c, d, p, _batch({"p": p}, a, b, c, d))

    sizes = property(lambda self: (self.a.shape[-2], self.a.shape[-1], self.b.shape[-2], self.c.shape[-2]))  # K M N O
    out_shape = property(lambda self: (*self.batch, self.c.shape[-2], self.b.shape[-2], self.a.shape[-1]))


def values_are_distances(desc) -> bool:
    """Whether a top-k call's values are distances (DIFF inner operator, no epilogue; None: knn's p = 0
    or inf), so that largest defaults to False; a formula kernel's are kernel values."""
    return desc is None or (desc.inner_operator is InnerOperator.DIFF and desc.fused_ok
                            and desc.kernel_type is KernelType.NONE)
