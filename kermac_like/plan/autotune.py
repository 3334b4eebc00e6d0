"""Kernel selection for the distance/kernel-matrix ops: which kernel serves a call.

Candidates (each an exact or documented path of :func:`kermac_like.run_kernel`):

* ``"lowk"``: ``distance_lowk.cuh``, the whole K in shared memory, output-write bound
  (float32, K <= LOWK_GENERIC_MAX_K);
* ``"simt"``: ``distance.cuh``, the K-blocked exact SIMT kernel (float32, any K);
* ``"tensor-core"``: ``distance_mma.cuh`` / ``distance_wgmma.cuh`` (Euclidean and DOT
  descriptors, 3xTF32 or TF32) where torch.cdist would take its matrix product
  (:func:`uses_mm`); that choice is semantic (NaN/inf as in torch), not timed.

The choice depends on a *tuning key*: descriptor, dtype, K bucket, M*N bucket, batch
bucket, output layout, TF32 setting, device and template hash. Without autotuning the
default table below decides (measured on an H200, bench/notes/lowk.md). With autotuning
(``KERMAC_LIKE_AUTOTUNE=1``, ``autotune=True`` on a call, or ``python -m kermac_like tune``)
a key's first call times every candidate on the call's own tensors with CUDA events (one
warm-up, median of ``AUTOTUNE_REPEATS``) and stores the winner with its timings in the
kernel cache's SQLite file (table ``tuning``); later calls of that key, in any process,
use the stored winner (this process keeps it in the plan cache, plan.core.plans, kind
"tuning"). Debug logging shows the key, the choice, where it came from and
the timings.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import threading

import torch

from .. import config
from ..descriptor import InnerOperator, KernelDescriptor, PowerType
from ..layout import Layout, analyse_matrix
from ..runtime import cache as kernel_cache, compiler
from ..runtime.specs import LOWK_GENERIC_MAX_K, LOWK_MAX_K, distance_lowk
from ..torch_path import uses_mm  # torch.cdist's matrix-product rule (re-exported)
from .core import plans

log = logging.getLogger("kermac_like.autotune")

__all__ = ["LOWK", "SIMT", "TENSOR_CORE", "candidates", "default_choice", "tuning_key", "choose",
           "autotune_enabled", "stored", "measure", "forget", "uses_mm", "AUTOTUNE_REPEATS"]

LOWK, SIMT, TENSOR_CORE = "lowk", "simt", "tensor-core"
AUTOTUNE_REPEATS = 5
ENV_AUTOTUNE = config.SETTINGS["autotune"].env

_measuring = threading.Lock()  # one thread looks up or times a key; the choices: plan.core.plans


_override = threading.local()


@contextlib.contextmanager
def override(autotune: bool | None):
    """The public op's ``autotune`` argument for the calls inside (it reaches the planner
    through the torch.library op, whose schema does not carry it)."""
    prev = getattr(_override, "value", None)
    _override.value = autotune if autotune is not None else prev
    try:
        yield
    finally:
        _override.value = prev


def autotune_enabled(autotune: bool | None = None) -> bool:
    """The call's ``autotune`` argument, else the op's (:func:`override`), else
    ``KERMAC_LIKE_AUTOTUNE`` (1/true/yes/on)."""
    if autotune is None:
        autotune = getattr(_override, "value", None)
    if autotune is not None:
        return bool(autotune)
    return config.get("autotune")


def k_bucket(K: int) -> int:
    """K itself up to 8, then the next power of two."""
    return K if K <= 8 else 1 << (K - 1).bit_length()


def size_bucket(n: int) -> int:
    """log2 of n, rounded up (0 for n <= 1)."""
    return max(int(n) - 1, 0).bit_length()


def candidates(desc: KernelDescriptor, dtype: torch.dtype, K: int, compute_mode: str, M: int = 1 << 30,
               N: int = 1 << 30) -> list:
    """The kinds that can serve a call. Euclidean and DOT descriptors take the tensor
    cores exactly where torch.cdist takes its matrix product (:func:`uses_mm`: a choice
    of NaN/inf semantics, so never timed against the exact kernels), the exact kernels
    elsewhere; other descriptors the exact kernels."""
    if desc.is_euclidean and uses_mm(compute_mode, M, N):
        out = [TENSOR_CORE] if dtype in (torch.float32, torch.float16, torch.bfloat16) else []
        if dtype == torch.float32 and K <= LOWK_MAX_K:
            # The exact low-K kernel with the matrix product's NaN/inf (kMmNonFinite;
            # DOT: the same sums either way).
            out.append(LOWK)
        return out
    out = []
    if dtype == torch.float32 and K <= LOWK_GENERIC_MAX_K:
        out.append(LOWK)
    if dtype == torch.float32:
        out.append(SIMT)
    return out


# The default table (no autotuning), from measurements on an H200 at M = N = 20 000 for
# K in {1, 3, 8, 16, 32, 37, 64, 128, 256} (bench/notes/lowk.md): among the exact kernels,
# the low-K kernel up to this K for each descriptor class, the K-blocked SIMT kernel beyond.
# Fractional p: measured at K <= 8 only; up to 16 it is the low-K kernel (the SIMT kernel
# pads K to 32), beyond the SIMT kernel (its compile is 0.35 s; the low-K POW build at
# K = 64 took 1.8 s on a first call).
# p = 1 ("abs") beyond 64 follows specs.distance_lowk.LOWK_CHUNKED_UP_TO (the chunk stream;
# the switch is there, read per call): _lowk_up_to.
LOWK_UP_TO = {"abs": 64, "pow": 16, "square": 64, "dot": 64}
# Where the call mirrors torch.cdist's matrix product (uses_mm): the low-K kernel with the
# product's NaN/inf up to this K, the tensor cores beyond (H200, 20000^2, bench/notes/lowk.md:
# low-K 0.55-0.65 ms against the tensor cores' 0.74-0.82 ms at K <= 8; 0.78 against 0.80 at
# K = 16, 1.83 against 0.89 at K = 37).
LOWK_MM_UP_TO = 8


def _lowk_up_to(cls: str) -> int:
    """The default table's low-K limit for a descriptor class: LOWK_UP_TO, for |x - y|
    raised to where the planner gives the chunk stream (LOWK_CHUNKED_UP_TO)."""
    if cls == "abs":
        return max(LOWK_UP_TO[cls], distance_lowk.LOWK_CHUNKED_UP_TO)
    return LOWK_UP_TO[cls]


def _desc_class(desc: KernelDescriptor) -> str:
    if desc.inner_operator is InnerOperator.DOT:
        return "dot"
    return {PowerType.ABS: "abs", PowerType.SQUARE: "square"}.get(desc.inner_power, "pow")


def default_choice(desc: KernelDescriptor, dtype: torch.dtype, K: int, compute_mode: str, M: int = 1 << 30,
                   N: int = 1 << 30) -> str | None:
    """The default table's kind for a call (None: no kernel applies, the reference path)."""
    cands = candidates(desc, dtype, K, compute_mode, M, N)
    if not cands:
        return None
    if TENSOR_CORE in cands:  # the matrix-product semantics
        return LOWK if LOWK in cands and K <= LOWK_MM_UP_TO else TENSOR_CORE
    if LOWK in cands and K <= _lowk_up_to(_desc_class(desc)):
        return LOWK
    return SIMT if SIMT in cands else cands[0]


def tuning_key(call, out: torch.Tensor, compute_mode: str, tf32: bool) -> str:
    """The problem class of a call on its device (see the module docstring)."""
    dev = call.device
    cap = torch.cuda.get_device_capability(dev)
    name = torch.cuda.get_device_name(dev)
    L = 1
    for n in call.batch:
        L *= n
    out_layout = analyse_matrix("out", out, copy_ok=False).layout
    tc = "mm" if compute_mode == "use_mm_for_euclid_dist" else "nomm" if compute_mode.startswith("donot") else "auto"
    parts = (repr(call.desc), str(call.dtype).replace("torch.", ""), f"K{k_bucket(call.K)}",
             f"MN{size_bucket(call.M * call.N)}", f"L{size_bucket(L)}",
             "colout" if out_layout is Layout.COL_MAJOR else "rowout", tc, "tf32" if tf32 else "fp32",
             f"{name} sm_{cap[0]}{cap[1]}", compiler.template_hash()[:16])
    return "|".join(parts)


def stored(key: str):
    """(choice, timings dict) the autotuner stored for ``key``, or None."""
    row = kernel_cache.get_cache().get_tuning(key)
    if row is None:
        return None
    try:
        return row[0], json.loads(row[1])
    except ValueError:
        return None


def _time_kind(run, kind: str, device, repeats: int) -> float:
    stream = torch.cuda.current_stream(device)
    run(kind)  # warm-up: compiles or loads the kernel, touches the data
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        run(kind)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(key: str, cands: list, run, device, *, repeats: int = AUTOTUNE_REPEATS, debug: bool = False):
    """Time ``run(kind)`` for every candidate; store and return (winner, timings)."""
    timings = {}
    for kind in cands:
        try:
            timings[kind] = round(_time_kind(run, kind, device, repeats), 5)
        except Exception as e:  # a candidate that cannot run here (e.g. no sm_90a) is not a winner
            log.debug("autotune %s: candidate %s failed: %s: %s", key, kind, type(e).__name__, e)
    if not timings:
        raise RuntimeError(f"autotune: no candidate of {cands} ran for {key}")
    winner = min(timings, key=timings.get)
    kernel_cache.get_cache().put_tuning(key, winner, json.dumps(timings, sort_keys=True),
                                        torch.cuda.get_device_name(device))
    if debug:
        log.debug("autotune %s: %s (%s)", key, winner,
                  ", ".join(f"{k} {v:.4g} ms" for k, v in sorted(timings.items(), key=lambda kv: kv[1])))
    return winner, timings


def choose(call, out: torch.Tensor, compute_mode: str, tf32: bool, run, *, autotune_flag: bool | None = None,
           debug: bool = False) -> str | None:
    """The kind that serves ``call`` (None: the reference path). ``run(kind)`` launches the
    call with that kind on the current stream (used only when autotuning)."""
    cands = candidates(call.desc, call.dtype, call.K, compute_mode, call.M, call.N)
    default = default_choice(call.desc, call.dtype, call.K, compute_mode, call.M, call.N)
    if len(cands) <= 1 or not autotune_enabled(autotune_flag) or torch.cuda.is_current_stream_capturing():
        if debug:
            log.debug("kernel choice %r K=%d: %s (default table; candidates %s)", call.desc, call.K, default, cands)
        return default
    key = tuning_key(call, out, compute_mode, tf32)
    hit = plans.get(key)
    if hit is not None:
        return hit
    with _measuring:
        hit = plans.get(key)
        if hit is not None:
            return hit
        found = stored(key)
        if found is not None and found[0] in cands:
            choice, timings = found
            source = "stored"
        else:
            choice, timings = measure(key, cands, run, call.device, debug=debug)
            source = "measured now"
        plans.put(key, choice, "tuning")
    if debug:
        log.debug("kernel choice %s: %s (%s; %s)", key, choice, source,
                  ", ".join(f"{k} {v:.4g} ms" for k, v in timings.items()))
    return choice


def forget() -> None:
    """Drop this process's memo of choices (the stored ones stay)."""
    plans.clear("tuning")
