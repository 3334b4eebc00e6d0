"""The cdist_grad rule: a validated cdist_grad call -> the plan of the SIMT or tensor-core
gradient kernel (cuda_templates/cdist_grad.cuh, cdist_grad_mma.cuh), or the reference path."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ..layout import batch_strides, plan_batch
from ..reference import cdist_grad_reference
from ..runtime import store
from ..runtime.specs import grad_kernel_spec
from .core import Launch, Plan, Settings, _device_index, _reference_plan

__all__ = ["plan_cdist_grad"]

log_grad = logging.getLogger("kermac_like.grad")


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads every operand along a unit-stride last mode."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return t.contiguous()
    return t


def plan_cdist_grad(call, out, debug: bool, settings: Settings | None = None) -> Plan:
    """The plan of a validated cdist_grad call (a calls.GradCall: ``p`` a float or a float tensor
    over the batch; ``out`` None or checked)."""
    a, b, c, d, p, batch = call
    K, M, N, O = call.sizes
    gpu = a.is_cuda and torch.cuda.get_device_capability(a.device) >= (8, 0) and a.dtype == torch.float32
    if not gpu or 0 in (K, M, N, O) or math.prod(batch) == 0:
        if debug:
            log_grad.debug("cdist_grad: reference path (%s, %s)", a.device, a.dtype)

        def reference():
            res = cdist_grad_reference(a, b, c, d, p)
            if out is None:
                return res
            out.copy_(res)
            return out

        return _reference_plan(reference, debug)
    settings = settings or Settings.current()
    if out is None:
        out = torch.empty((*batch, O, N, M), dtype=a.dtype, device=a.device)
    ops = {"a": _unit_last(a), "b": _unit_last(b), "c": _unit_last(c), "d": _unit_last(d), "out": out}
    if isinstance(p, torch.Tensor):
        ops["p"] = p.float() if p.dtype != torch.float32 else p
        kind = "pow"
    else:
        kind = "abs" if p == 1 else "square" if p == 2 else "pow"
    strides = {}
    for k, t in ops.items():
        nb = t.dim() if k == "p" else t.dim() - (3 if k == "out" else 2)
        strides[k] = batch_strides(batch, tuple(t.shape[:nb]), tuple(t.stride()[:nb]))
    bplan = plan_batch(batch, strides, max_modes=1)
    lds = {
        "a": ops["a"].stride(-2), "b": ops["b"].stride(-2), "c": ops["c"].stride(-2), "d": ops["d"].stride(-2),
        "ldo_o": out.stride(-3), "ldo_n": out.stride(-2),
    }
    # kVec = 4 (16-byte a/d/out accesses) needs a, d, out 16-byte aligned with
    # M, their leading dimensions and batch strides multiples of 4; b and c are
    # copied 4 bytes at a time and have no requirement (nor has K).
    vec_ops = ("a", "d", "out")
    vec_strides = [lds[k] for k in ("a", "d", "ldo_o", "ldo_n")] + [
        s for k in vec_ops for s in bplan.strides[k][0] + bplan.strides[k][1]
    ]
    vec = 4 if (
        M % 4 == 0
        and all(ops[k].data_ptr() % 16 == 0 for k in vec_ops)
        and all(s % 4 == 0 for s in vec_strides)
    ) else 1
    # Tensor-core contraction (3xTF32) where it measured faster; KERMAC_LIKE_GRAD_MMA=0 keeps SIMT.
    use_mma = settings.grad_mma
    sm90 = torch.cuda.get_device_capability(a.device) == (9, 0)
    spec = grad_kernel_spec(kind, vec, tensor_cores=use_mma, sm90=sm90)
    family = "cdist_grad_mma" if spec.kernel == "kermac_like::cdist_grad_mma_kernel" else "cdist_grad"
    kernel = store.get_kernel(spec, _device_index(a.device), debug=debug)
    L = bplan.count
    grid = (math.ceil(M / spec.launch.block_m), math.ceil(N / spec.launch.block_n), min(L, 65535))
    if debug:
        log_grad.debug("cdist_grad: kind=%s vec=%d mma=%s K=%d M=%d N=%d O=%d batch=%s", kind, vec, use_mma, K, M,
                       N, O, batch)
    offsets = {k: list(bplan.outer_offsets(k)) for k in ops}
    bs = {k: bplan.strides[k][1][0] for k in ops}
    launches = []
    for i in range(len(offsets["a"])):

        def ptr(k):
            t = ops[k]
            return t.data_ptr() + offsets[k][i] * t.element_size()

        args = [
            ptr("a"), ptr("b"), ptr("c"), ptr("d"), ptr("out"),
            np.int32(M), np.int32(N), np.int32(K), np.int32(O),
            np.int64(lds["a"]), np.int64(lds["b"]), np.int64(lds["c"]), np.int64(lds["d"]),
            np.int64(lds["ldo_o"]), np.int64(lds["ldo_n"]),
            np.int32(L), np.int64(bs["a"]), np.int64(bs["b"]), np.int64(bs["c"]), np.int64(bs["d"]), np.int64(bs["out"]),
        ]
        if "p" in ops:
            args += [ptr("p"), np.int64(bs["p"]), np.float32(0.0)]
        else:
            args += [0, np.int64(0), np.float32(p)]
        launches.append(Launch(kernel, grid, tuple(args)))
    return Plan(family, spec, tuple(launches), out, scratch=(ops,), debug=debug)
