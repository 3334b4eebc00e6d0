"""Specs of the cdist_grad kernels: SIMT (cuda_templates/cdist_grad.cuh) and
tensor-core mma.sync 3xTF32 (cdist_grad_mma.cuh)."""

from __future__ import annotations

from .kernel_spec import KernelSpec, LaunchShape

# Mirror of kermac_like::CdistGradTraits (cuda_templates/cdist_grad.cuh).
GRAD_LAUNCH = LaunchShape(threads=128, block_m=64, block_n=16, smem_bytes=0)
_GRAD_KINDS = {"abs": "kermac_like::Power::Abs", "square": "kermac_like::Power::Square", "pow": "kermac_like::Power::Pow"}


GRAD_TUNING = (0, 2)  # defaults of (kSignFma, kMinBlocksPerSM)


# Measured on an H200 (bench/notes/history.md, v2): the sign of p = 1 on the FMA pipe,
# 129 -> 118 ms on the bench case.
ABS_GRAD_TUNING = (1, 2)


def grad_spec(kind: str, vec: int, *, tuning: tuple | None = None) -> KernelSpec:
    """``kind``: "abs" (p == 1), "square" (p == 2) or "pow" (any p).
    ``tuning``: (kSignFma, kMinBlocksPerSM); the defaults render no extra
    template arguments (the launch shape does not depend on them)."""
    if tuning is None:
        tuning = ABS_GRAD_TUNING if kind == "abs" else GRAD_TUNING
    tuning = tuple(tuning)
    extra = "" if tuning == GRAD_TUNING else ", " + ", ".join(str(int(v)) for v in tuning)
    traits = f"kermac_like::CdistGradTraits<{_GRAD_KINDS[kind]}, {vec}{extra}>"
    return KernelSpec("cdist_grad.cuh", "kermac_like::cdist_grad_kernel", traits, GRAD_LAUNCH)


def shipped():
    for kind in _GRAD_KINDS:
        for vec in (4, 1):
            yield grad_spec(kind, vec)


# Mirror of kermac_like::CdistGradMmaTraits (cuda_templates/cdist_grad_mma.cuh): same
# argument list and launch contract as cdist_grad_kernel, a 32 (m) x 16 (n) pair tile.
GRAD_MMA_LAUNCH = LaunchShape(threads=256, block_m=32, block_n=16, smem_bytes=0)
GRAD_MMA_MIN_BLOCKS = 1  # default of kMinBlocksPerSM (renders no extra argument)


def grad_mma_spec(kind: str, vec: int, *, min_blocks: int = GRAD_MMA_MIN_BLOCKS, flush_k: int = 32,
                  block_k: int = 32, unroll_k: int = 1, trunc_w: bool = False) -> KernelSpec:
    """``kind``: "abs" (p == 1), "square" (p == 2) or "pow" (any p); ``vec`` 4 or 1
    (the kVec contract of :func:`grad_spec`). ``min_blocks`` (1 or 2): register budget.
    Tuning knobs of CdistGradMmaTraits (defaults = the v3 kernel, rendered without extra
    arguments): ``flush_k`` k per fresh accumulator set (32/64/128, a multiple of
    ``block_k``), ``block_k`` k per pipeline stage (32 or 64), ``unroll_k`` MMA steps per
    unrolled body (1/2/4), ``trunc_w`` split W by truncation. The launch shape depends on
    none of them."""
    args = [int(min_blocks), int(flush_k), int(block_k), int(unroll_k), int(bool(trunc_w))]
    defaults = [GRAD_MMA_MIN_BLOCKS, 32, 32, 1, 0]
    while args and args[-1] == defaults[len(args) - 1]:
        args.pop()
    extra = "".join(f", {x}" for x in args)
    traits = f"kermac_like::CdistGradMmaTraits<{_GRAD_KINDS[kind]}, {vec}{extra}>"
    return KernelSpec("cdist_grad_mma.cuh", "kermac_like::cdist_grad_mma_kernel", traits, GRAD_MMA_LAUNCH)


# Measured on an H200 at L=2 K=10000 M=10000 N=768 O=16 (bench/notes/history.md, v3 and v3.1):
# the tensor-core contraction beats the SIMT kernel for p = 1 and p = 2; on sm_90 the
# tuned build (two blocks per SM, truncating W split, 4-step unroll, flush every 128 k)
# runs p = 2 in 86.4 ms and p = 1 in 94.4 ms (SIMT 108 / 117.5; error 1.0e-6). Its
# two-block builds spill on sm_80, where the one-block build is used. Fractional p stays
# on the SIMT kernel (137.9 ms; the two-block tensor-core build spills there).
GRAD_MMA_KINDS = ("abs", "square")
GRAD_MMA_SM90 = dict(min_blocks=2, trunc_w=True, unroll_k=4, flush_k=128)


def grad_kernel_spec(kind: str, vec: int, *, tensor_cores: bool = True, sm90: bool = False) -> KernelSpec:
    """The cdist_grad instantiation a call uses on a device (``sm90``: compute capability 9.0)."""
    if tensor_cores and kind in GRAD_MMA_KINDS:
        return grad_mma_spec(kind, vec, **(GRAD_MMA_SM90 if sm90 else {}))
    return grad_spec(kind, vec)


def shipped_mma():
    for kind in GRAD_MMA_KINDS:
        for vec in (4, 1):
            yield grad_mma_spec(kind, vec)  # sm_80-class GPUs
            yield grad_mma_spec(kind, vec, **GRAD_MMA_SM90)  # Hopper

