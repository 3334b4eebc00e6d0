"""The distance/kernel-matrix ops: :func:`run_kernel` and :func:`cdist`.

Data flow of one call: validate every argument (nothing is written before
all checks pass) -> the planner (:mod:`kermac_like.plan`) chooses a path (exact
SIMT kernel, tensor-core kernel, or the torch path (torch_path.py: torch.cdist's kernels and
matrix product) for CPU tensors, float64, pre-sm_80 GPUs; torch.cdist itself for p in
{0, inf}), describes operand layouts, folds the broadcast
batch and gets the compiled functions (memory, cache, or NVRTC) -> the plan runs
on the current torch stream. Gradients: :mod:`kermac_like.ops.distance_backward`.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import Tensor

from .. import _debug, config, formula, formula_path
from .._args import check_int, check_same, check_scalar_or_tensor, check_tensor
from ..descriptor import PRESETS, KernelDescriptor
from ..layout import analyse_output, broadcast_batch_shape
from ..calls import COMPUTE_MODES, DistanceCall
from ..plan import run_by_call_key, run_distance
from ..plan import core as plan_core
from . import distance_backward
from ..plan.autotune import override as autotune_override
from ._library import (check_no_hyper_grad, descriptor_from_ints, descriptor_ints, direct_call, join_hypers,
                       register_autograd, split_hyper)

log = logging.getLogger("kermac_like.distance")

__all__ = ["run_kernel", "cdist", "COMPUTE_MODES", "fused_device"]


def check_data(a, b, names=("a", "b")) -> None:
    """The operands of a kernel-matrix call: tensors of one floating dtype and device with one K
    (TypeError/ValueError naming the argument)."""
    na, nb = names
    check_tensor(na, a)
    check_tensor(nb, b)
    check_same(nb, b, na, a)
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"{nb}: last dimension {b.shape[-1]} differs from {na}'s {a.shape[-1]} (the contracted K mode)")


def prepare_call(descriptor, a, b, *, p=None, inner_p=None, outer_p=None, bandwidth=None, regularization=None,
                 regularization_offset_x=0, regularization_offset_y=0, epsilon=None, names=("a", "b"),
                 extra_shapes=None, params=None, data_checked=False, autotune=None) -> DistanceCall:
    """Validate a run_kernel call; raises TypeError/ValueError naming the argument. ``names``:
    the operands' names in the calling op's terms (kernel_matvec's and knn's x and y);
    ``extra_shapes``: batch shapes of that op's other operands ({name: shape}), which must
    broadcast with the data and the hyper-parameters (the call's batch includes them);
    ``params``: the descriptor's own hyper-parameters (a formula kernel's alpha, q, period, c or
    expression parameters: kermac_like/formula.py), which join the call's hypers by name;
    ``data_checked``: the calling op ran :func:`check_data` already (before checks of its own
    operands that read the data's shapes), so it is not run twice; ``autotune``: run_kernel's."""
    if not isinstance(descriptor, KernelDescriptor):
        raise TypeError(f"descriptor: expected a KernelDescriptor, got {type(descriptor).__name__}")
    if not data_checked:
        check_data(a, b, names)
    dev = a.device
    p = check_scalar_or_tensor("p", p, dev, nonnegative=True)
    inner_p = check_scalar_or_tensor("inner_p", inner_p, dev, nonnegative=True)
    outer_p = check_scalar_or_tensor("outer_p", outer_p, dev, positive=True)
    bandwidth = check_scalar_or_tensor("bandwidth", bandwidth, dev, positive=True)
    regularization = check_scalar_or_tensor("regularization", regularization, dev)
    epsilon = check_scalar_or_tensor("epsilon", epsilon, dev, nonnegative=True)
    if isinstance(epsilon, torch.Tensor):
        raise TypeError("epsilon: expected a real number")
    ox = check_int("regularization_offset_x", regularization_offset_x)
    oy = check_int("regularization_offset_y", regularization_offset_y)
    inner_p = inner_p if inner_p is not None else p
    outer_p = outer_p if outer_p is not None else p
    own = {}
    if not descriptor.fused_ok:  # a formula kernel: its own hyper-parameters, bandwidth among them
        for name, v in (("p", p), ("inner_p", inner_p), ("outer_p", outer_p)):
            if v is not None:
                raise TypeError(f"{name}: {descriptor!r} takes no {name} (a p-norm's p is the descriptor's own)")
        given = dict(params or {})
        if bandwidth is not None:
            given["bandwidth"] = bandwidth
        own = formula.check_params(descriptor, given, dev)
        bandwidth = own.pop("bandwidth", None)
    elif params:
        name = next(iter(params))
        raise TypeError(f"{name}: an unexpected keyword argument ({descriptor!r} has no hyper-parameter {name!r})")
    if descriptor.needs_inner_p:
        if inner_p is None:
            raise ValueError(f"p: {descriptor!r} has a POW inner power; pass p or inner_p")
        if isinstance(inner_p, float) and inner_p == 0:
            raise ValueError("inner_p: must be > 0 for a POW inner power (cdist(p=0) counts non-zeros instead)")
    else:
        inner_p = None
    if descriptor.needs_outer_p:
        if outer_p is None:
            raise ValueError(f"p: {descriptor!r} has a POW outer power; pass p or outer_p")
        if isinstance(outer_p, float) and outer_p == 0:
            raise ValueError("outer_p: must be > 0 (the outer power is x^(1/outer_p))")
    else:
        outer_p = None
    if descriptor.needs_bandwidth and descriptor.fused_ok:
        if bandwidth is None:
            raise ValueError(f"bandwidth: {descriptor!r} has a {descriptor.kernel_type.name} epilogue; pass bandwidth")
    elif descriptor.fused_ok:
        bandwidth = None
    hypers = dict(inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth, regularization=regularization, **own)
    shapes = {names[0]: tuple(a.shape[:-2]), names[1]: tuple(b.shape[:-2]), **(extra_shapes or {})}
    shapes.update({k: tuple(v.shape) for k, v in hypers.items() if isinstance(v, torch.Tensor)})
    batch = broadcast_batch_shape(shapes)
    if autotune is not None and not isinstance(autotune, bool):
        raise TypeError(f"autotune: expected a bool or None, got {type(autotune).__name__}")
    return DistanceCall(descriptor, a, b, hypers, ox - oy, epsilon, batch, a.shape[-2], b.shape[-2], a.shape[-1],
                        autotune)


# -- the ops: kermac_like::run_kernel and kermac_like::run_kernel_out --------------------------
def _call_of(a, b, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
             regularization, regularization_tensor, reg_diag, epsilon) -> DistanceCall:
    hypers = join_hypers(inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                         regularization, regularization_tensor)
    return DistanceCall.of(descriptor_from_ints(descriptor), a, b, hypers, reg_diag, epsilon)


def _run_kernel_impl(a: Tensor, b: Tensor, descriptor: list[int], inner_p: Optional[float],
                   inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
                   bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor], regularization: Optional[float],
                   regularization_tensor: Optional[Tensor], reg_diag: int, epsilon: Optional[float],
                   compute_mode: str, debug: bool) -> Tensor:
    call = _call_of(a, b, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                    regularization, regularization_tensor, reg_diag, epsilon)
    return run_distance(call, None, compute_mode, debug)


_run_kernel_op = torch.library.custom_op("kermac_like::run_kernel", _run_kernel_impl, mutates_args=())


@torch.library.custom_op("kermac_like::run_kernel_out", mutates_args=("out",))
def _run_kernel_out_op(a: Tensor, b: Tensor, descriptor: list[int], inner_p: Optional[float],
                       inner_p_tensor: Optional[Tensor], outer_p: Optional[float], outer_p_tensor: Optional[Tensor],
                       bandwidth: Optional[float], bandwidth_tensor: Optional[Tensor],
                       regularization: Optional[float], regularization_tensor: Optional[Tensor], reg_diag: int,
                       epsilon: Optional[float], compute_mode: str, debug: bool, out: Tensor) -> None:
    call = _call_of(a, b, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth, bandwidth_tensor,
                    regularization, regularization_tensor, reg_diag, epsilon)
    run_distance(call, out, compute_mode, debug)


@_run_kernel_op.register_fake
def _run_kernel_fake(a, b, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
                     bandwidth_tensor, regularization, regularization_tensor, reg_diag, epsilon, compute_mode, debug):
    hypers = (inner_p_tensor, outer_p_tensor, bandwidth_tensor, regularization_tensor)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], *(t.shape for t in hypers if t is not None))
    return a.new_empty((*batch, a.shape[-2], b.shape[-2]))


@_run_kernel_out_op.register_fake
def _run_kernel_out_fake(*args):
    return None


_RUN_KERNEL_GRAD = register_autograd(_run_kernel_op, _run_kernel_impl, distance_backward.backward,
                                     distance_backward.setup_context)
_RUN_KERNEL = torch.ops.kermac_like.run_kernel.default
_RUN_KERNEL_OUT = torch.ops.kermac_like.run_kernel_out.default


def _op_args(call: DistanceCall) -> tuple:
    """The op's arguments of a validated call, up to compute_mode and debug."""
    hp = call.hypers
    return (call.a, call.b, descriptor_ints(call.desc), *split_hyper(hp["inner_p"]), *split_hyper(hp["outer_p"]),
            *split_hyper(hp["bandwidth"]), *split_hyper(hp["regularization"]), call.reg_diag, call.epsilon)


_NUMBER_TYPES = (float, int, type(None))
_TORCH_CDIST_DTYPES = (torch.float32, torch.float64)


def fused_device(t) -> bool:
    """Whether the fused GPU kernels may serve a call on tensor ``t`` (a CUDA device of sm_80 or
    later; else the torch path): plan.core's device rule for the estimators, looked up at call time
    so that tests can stand a CPU in for a GPU."""
    return isinstance(t, torch.Tensor) and plan_core._gpu_ok(t)


def _call_key(op: tuple, values: tuple, a, b, out, compute_mode):
    """The key of an eager call under which plan.distance.run_by_call_key finds its template:
    ``op`` (the op's name and fixed arguments), ``values`` (its scalar arguments: plain
    numbers, None, or float32 tensors by shape, strides and device), the operands' shapes, strides, 16-byte alignments,
    dtypes and devices, ``out``'s, the compute mode and the switches a plan reads (plan.core.Settings,
    the same snapshot the plan's own key holds, and the settings autotune and debug); None for a call that takes the full path
    every time (tensor subclasses, hyper-parameter tensors of another dtype). The key's
    second entry is ``values`` itself (the same tuple) when they are all plain numbers."""
    if torch.compiler.is_compiling() or type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        return None
    if out is None:
        o = None
    elif type(out) is torch.Tensor:
        o = (out.shape, out.stride(), out.dtype, out.device)
    else:
        return None
    if not all(type(v) in _NUMBER_TYPES for v in values):
        parts = []
        for v in values:
            if type(v) in _NUMBER_TYPES:
                parts.append(v)
            elif type(v) is torch.Tensor and v.dtype == torch.float32:
                parts.append(("tensor", v.shape, v.stride(), v.device))
            else:
                return None
        values = tuple(parts)
    return (op, values, a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16, b.shape, b.stride(), b.dtype, b.device,
            b.data_ptr() % 16, o, compute_mode, plan_core.Settings.current(), config.get("autotune"),
            config.get("debug"))


def _run_cached(key, a, b, out, hypers: dict | None = None):
    """The result of a call served by its key's template, or None (take the full path)."""
    if key is None or not direct_call(a, b, out, *(hypers.values() if hypers else ())):
        return None
    return run_by_call_key(key, a, b, out, hypers)


def _check_out(out, shape, dtype, device):
    if out is not None:
        analyse_output("out", out, shape, dtype, device)


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


# -- public API ----------------------------------------------------------------------------
def run_kernel(descriptor: KernelDescriptor, a: torch.Tensor, b: torch.Tensor, *, out=None, p=None, inner_p=None,
               outer_p=None, bandwidth=None, regularization=None, regularization_offset_x: int = 0,
               regularization_offset_y: int = 0, epsilon=None, compute_mode: str = COMPUTE_MODES[0],
               autotune: bool | None = None, debug: bool = False, **params) -> torch.Tensor:
    """Fused kernel matrix ``out[..., m, n] = kernel(a[..., m, :], b[..., n, :])``.

    ``a`` is ``(..., M, K)``, ``b`` is ``(..., N, K)``; leading modes broadcast.
    ``p`` sets both ``inner_p`` and ``outer_p`` (for POW powers); ``bandwidth``
    is required by LAPLACE/GAUSSIAN epilogues; ``regularization`` adds lambda where
    ``m + regularization_offset_x == n + regularization_offset_y``; ``epsilon``
    zeroes distances below it.  Hyper-parameters are floats or tensors over batch
    modes (broadcasting with the data batch; their values are not inspected).
    ``out`` (any row- or column-major layout of the right shape) is written in
    place and returned; it is left untouched when an argument is rejected.
    ``autotune``: time the candidate kernels once per problem class and keep the
    fastest (stored in the kernel cache); None follows ``KERMAC_LIKE_AUTOTUNE``
    (kermac_like/plan/autotune.py).
    ``**params``: the hyper-parameters of a formula kernel (kermac_like/formula.py: alpha, q,
    period, c, an expression's names), floats or tensors over batch modes like ``bandwidth``;
    formula kernels of the l2 distance run on a GPU through the fused kernels with their epilogue
    functor (setting formula_fused, on by default: the exact low-K kernel up to K = 64, the tensor
    cores beyond) where nothing needs a gradient; the others, and every differentiable call, on the
    torch path (differentiable with respect to a, b and every tensor hyper-parameter through
    torch's autograd of their formulas).

    >>> import torch, kermac_like as km
    >>> a = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    >>> b = torch.tensor([[0.0, 0.0], [1.0, 1.0], [3.0, 0.0]])
    >>> km.run_kernel(km.preset("gaussian_l2"), a, b, bandwidth=2.0)    # exp(-|a - b|^2 / 8)
    tensor([[1.0000, 0.7788, 0.3247],
            [0.0439, 0.1969, 0.1353]])
    >>> km.run_kernel(km.preset("laplace_l2"), a, a, bandwidth=5.0, regularization=0.5)
    tensor([[1.5000, 0.3679],
            [0.3679, 1.5000]])
    """
    key = None
    if not debug and autotune is None and type(descriptor) is KernelDescriptor and not params:
        hp = (p, inner_p, outer_p, bandwidth, regularization, regularization_offset_x, regularization_offset_y, epsilon)
        key = _call_key(("run_kernel", descriptor), hp, a, b, out, compute_mode)
        if key is not None:
            hypers = None
            if key[1] is not hp:  # _call_key described tensors in hp: the template reads them by name
                # (prepare_call's rule: p stands for the inner and outer p not given)
                hypers = {k: v for k, v in (("inner_p", p if inner_p is None else inner_p),
                                            ("outer_p", p if outer_p is None else outer_p),
                                            ("bandwidth", bandwidth), ("regularization", regularization))
                          if type(v) is torch.Tensor}
            res = _run_cached(key, a, b, out, hypers)
            if res is not None:
                return res
    return _run_kernel(descriptor, a, b, out=out, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                       regularization=regularization, regularization_offset_x=regularization_offset_x,
                       regularization_offset_y=regularization_offset_y, epsilon=epsilon, compute_mode=compute_mode,
                       autotune=autotune, debug=debug, call_key=key, params=params)


def _run_kernel(descriptor, a, b, *, out, p, inner_p, outer_p, bandwidth, regularization, regularization_offset_x,
                regularization_offset_y, epsilon, compute_mode, autotune, debug, call_key, params=None,
                data_checked=False):
    """run_kernel after its call-key lookup missed (``call_key``: that key, or None; ``data_checked``: cdist
    checked a and b)."""
    debug = _debug.resolve(debug)
    if compute_mode not in COMPUTE_MODES:
        raise ValueError(f"compute_mode: {compute_mode!r} is not one of {COMPUTE_MODES}")
    call = prepare_call(descriptor, a, b, p=p, inner_p=inner_p, outer_p=outer_p, bandwidth=bandwidth,
                        regularization=regularization, regularization_offset_x=regularization_offset_x,
                        regularization_offset_y=regularization_offset_y, epsilon=epsilon, params=params,
                        data_checked=data_checked, autotune=autotune)
    _check_out(out, call.out_shape, call.dtype, call.device)
    hyper_tensors = [v for v in call.hypers.values() if isinstance(v, torch.Tensor)]
    grad = _needs_grad(call.a, call.b, *hyper_tensors)
    if not call.desc.fused_ok:  # a formula kernel: the torch path, autograd through its torch formulas
        if not grad:
            return run_distance(call, out, compute_mode, debug)
        work = torch.float32 if call.dtype in (torch.float16, torch.bfloat16) else call.dtype
        # direct differences unless the matrix product is asked for: torch.cdist's backward of the product
        # form is not 0 at coincident points (the square root of a rounding residue)
        mode = compute_mode if compute_mode == COMPUTE_MODES[1] else COMPUTE_MODES[2]
        res = formula_path.values(call.desc, call.a.to(work), call.b.to(work), call.hypers, diag=call.reg_diag,
                                  epsilon=call.epsilon, compute_mode=mode)
        res = res.expand(call.out_shape).to(call.dtype)
        return res if out is None else out.copy_(res)
    if grad:
        check_no_hyper_grad(call.hypers, "run_kernel")
    elif direct_call(call.a, call.b, out, *hyper_tensors):
        # The ops' implementation, without the dispatcher (and the template kept under the
        # call's key, unless debug decided differently than the key assumed).
        return run_distance(call, out, compute_mode, debug, call_key=None if debug else call_key)
    with autotune_override(autotune):  # the op's schema does not carry it
        if grad:  # (an eager call without the dispatcher, as above: ops/_library.py)
            res = _RUN_KERNEL_GRAD(call.a, call.b, out, *hyper_tensors)(*_op_args(call), compute_mode, debug)
            # out= variants carry no autograd: compute, then copy into out (out joins the graph)
            return res if out is None else out.copy_(res)
        if out is None:
            return _RUN_KERNEL(*_op_args(call), compute_mode, debug)
        _RUN_KERNEL_OUT(*_op_args(call), compute_mode, debug, out)
    return out


def _cdist_by_torch(x1, x2, p: float, out):
    """p = 0 or inf: torch.cdist itself, so that NaN and inf behave exactly as there
    (torch's p = inf maximum skips NaN on the CPU, p = 0 counts |NaN| as NaN); 16-bit
    inputs, which torch.cdist does not take on every device, through float32 (exact:
    p = 0 counts, p = inf picks one |difference|)."""
    if x1.dtype in (torch.float32, torch.float64):
        res = torch.cdist(x1, x2, p=p)
    else:
        res = torch.cdist(x1.float(), x2.float(), p=p).to(x1.dtype)
    if out is None:
        return res
    return out.copy_(res)


_VF_COMPUTE_MODES = {COMPUTE_MODES[0]: None, COMPUTE_MODES[1]: 1, COMPUTE_MODES[2]: 2}  # torch.functional.cdist's


def _cpu_cdist(x1, x2, p, compute_mode):
    """torch.cdist's own kernel (``torch._VF.cdist``, what torch.cdist calls: bitwise its result)
    for the plain CPU call (float32/float64 matrices or equal batch shapes, a number p >= 0, no
    autograd, dispatch mode or compile), without the argument checks and planning of the general
    path or torch.cdist's own Python wrapper; None for anything else (the general path then checks
    and names the argument)."""
    if (type(x1) is not torch.Tensor or type(x2) is not torch.Tensor or x1.device.type != "cpu"
            or x2.device.type != "cpu" or x1.dtype not in _TORCH_CDIST_DTYPES or x2.dtype != x1.dtype
            or type(p) not in (float, int) or not p >= 0 or compute_mode not in _VF_COMPUTE_MODES):
        return None
    s1, s2 = x1.shape, x2.shape
    if len(s1) < 2 or s1[-1] != s2[-1] or s1[:-2] != s2[:-2] or _debug.env_debug() or not direct_call(x1, x2):
        return None
    return torch._VF.cdist(x1, x2, p, _VF_COMPUTE_MODES[compute_mode])


def cdist(x1: torch.Tensor, x2: torch.Tensor, p: float = 2.0, *, out=None, skip_epilogue: bool = False,
          compute_mode: str = COMPUTE_MODES[0], autotune: bool | None = None, debug: bool = False) -> torch.Tensor:
    """Drop-in for ``torch.cdist``: p-norm distances between the rows of x1 (..., M, K)
    and x2 (..., N, K), batch modes broadcast, any ``p >= 0`` or ``inf``.

    ``skip_epilogue=True`` returns ``sum |x - y|^p`` without the ``1/p`` root.
    p = 1 and p = 2 use pow-free kernels; p = 2 runs on tensor cores (3xTF32,
    fp32-grade) where torch.cdist takes its matrix-product path (``compute_mode``
    "use_mm_for_euclid_dist", or the default with more than 25 rows in x1 or x2) and on
    the exact kernel otherwise, so that NaN and inf come out as in torch.cdist
    (tests/test_nonfinite.py); on sm_90 the tensor-core path takes temporary GPU memory
    of about x2's size (twice for 3xTF32) for x2 in the kernel's tile layout.
    Accuracy on any data: the tensor-core path reads float32 x1 and x2 shifted by a reference
    point near the data (kermac_like/centring.py: one copy of each), so its error follows the
    data's centred scale, not its distance from the origin (about 1e-6 relative at any offset),
    and pairs whose expansion is below 2^-10 of their shifted squared norms are recomputed from
    direct differences of the given inputs (exact duplicates give exactly 0). Between those, a
    pair's relative error is up to about K 2^-24 (|x1 - s|^2 + |x2 - s|^2) / (2 d^2): on tightly
    clustered or low-rank data far from its reference point, up to 1e-3
    (bench/notes/data_zoo.md); ``compute_mode="donot_use_mm_for_euclid_dist"`` takes the exact
    kernels.
    p = 0 and p = inf call torch.cdist; CPU tensors, float64 inputs, and float16/bfloat16
    inputs off the tensor-core path take the torch path (on the inputs' device:
    kermac_like/torch_path.py, torch.cdist's kernels and its matrix product under the same
    ``compute_mode`` rule, so NaN and inf as from torch.cdist; 16-bit inputs in float32).
    The exact paths include a low-K kernel (up to K = 64 for p = 1, 2 and the Euclidean
    kernels, K = 16 for fractional p: the default table of kermac_like/plan/autotune.py);
    ``autotune`` as in :func:`run_kernel`.

    Returns ``(..., M, N)`` (written into ``out`` when given). Inputs: float32, float64,
    float16 or bfloat16 on one device. Bad arguments (p < 0, a K that differs, a non-floating
    tensor, ``out``'s shape) raise ValueError / TypeError naming the argument, before anything
    is written to ``out``.

    >>> import torch, kermac_like as km
    >>> x1 = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    >>> x2 = torch.tensor([[0.0, 0.0], [1.0, 1.0], [3.0, 0.0]])
    >>> km.cdist(x1, x2)
    tensor([[0.0000, 1.4142, 3.0000],
            [5.0000, 3.6056, 4.0000]])
    >>> km.cdist(x1, x2, p=1.0)
    tensor([[0., 2., 3.],
            [7., 5., 4.]])
    >>> torch.equal(km.cdist(x1, x2), torch.cdist(x1, x2))
    True
    """
    if out is None and not skip_epilogue and not debug and autotune is None:
        res = _cpu_cdist(x1, x2, p, compute_mode)
        if res is not None:
            return res
    key = None
    if (not debug and autotune is None and type(p) in _NUMBER_TYPES and p is not None
            and fused_device(x1)):  # the call-key templates are GPU plans
        key = _call_key(("cdist", bool(skip_epilogue)), (p,), x1, x2, out, compute_mode)
        res = _run_cached(key, x1, x2, out)
        if res is not None:
            return res
    debug = _debug.resolve(debug)
    check_data(x1, x2, ("x1", "x2"))
    p = check_scalar_or_tensor("p", p, x1.device, nonnegative=True, allow_inf=True)
    if isinstance(p, torch.Tensor):
        raise TypeError("p: cdist takes a real number (use run_kernel for per-batch p)")
    if compute_mode not in COMPUTE_MODES:
        raise ValueError(f"compute_mode: {compute_mode!r} is not one of {COMPUTE_MODES}")
    if (out is None and not skip_epilogue and not debug and autotune is None and x1.dtype in _TORCH_CDIST_DTYPES
            and not fused_device(x1) and direct_call(x1, x2)):
        # On the CPU the torch path of cdist is torch.cdist itself (torch_path.py, bitwise): a
        # small call should not pay the planning for it.
        broadcast_batch_shape({"x1": tuple(x1.shape[:-2]), "x2": tuple(x2.shape[:-2])})
        return torch.cdist(x1, x2, p=p, compute_mode=compute_mode)
    if p == 0 or math.isinf(p):
        batch = broadcast_batch_shape({"x1": tuple(x1.shape[:-2]), "x2": tuple(x2.shape[:-2])})
        _check_out(out, (*batch, x1.shape[-2], x2.shape[-2]), x1.dtype, x1.device)
        if debug:
            log.debug("cdist p=%s: reference path", p)
        if _needs_grad(x1, x2):
            return torch.cdist(x1, x2, p=p)
        return _cdist_by_torch(x1, x2, p, out)
    if p == 1:
        desc, kw = PRESETS["l1"], {}
    elif p == 2:
        desc, kw = (PRESETS["squared_l2"] if skip_epilogue else PRESETS["l2"]), {}
    else:
        desc, kw = (PRESETS["p_norm_skip_root"] if skip_epilogue else PRESETS["p_norm"]), {"p": p}
    return _run_kernel(desc, x1, x2, out=out, p=kw.get("p"), inner_p=None, outer_p=None, bandwidth=None,
                       regularization=None, regularization_offset_x=0, regularization_offset_y=0, epsilon=None,
                       compute_mode=compute_mode, autotune=autotune, debug=debug, call_key=key, data_checked=True)
