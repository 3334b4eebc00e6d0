"""What every planner rule shares: the plan itself (:class:`Settings`, :class:`Launch`,
:class:`Plan`), the plan cache (:data:`plans`), the reference plan, the device queries, the
distance ABI's hyper-parameters and the N-split rule of both kernel_matvec rules."""

from __future__ import annotations

import functools
import itertools
import math
import threading
from typing import Callable, NamedTuple

import torch

from .. import config
from ..layout import batch_strides, plan_batch
from ..runtime import launcher

__all__ = ["HYPERS", "Settings", "Launch", "Plan", "PlanCache", "plans", "choose_split", "MATVEC_SCRATCH_BYTES"]

# torch's cuBLAS flags (allow_tf32), held once: the attribute path costs ~0.4 us per read.
MATMUL = torch.backends.cuda.matmul

# The hyper-parameters of the distance ABI, in argument order.
HYPERS = ("inner_p", "outer_p", "bandwidth", "regularization")


# -- what a plan is ------------------------------------------------------------------------
class Settings(NamedTuple):
    """Global switches a plan depends on, read once per call.

    ``tf32``: torch's ``allow_tf32`` matmul flag (plain TF32 instead of 3xTF32; the
    wgmma kernel and its b preparation must agree, hence read once); ``wgmma``: the setting
    wgmma (``KERMAC_LIKE_WGMMA``) not "off"; ``wgmma_always``: it is "always" (also the calls
    of a few output tiles, which otherwise take the one-launch mma.sync kernel:
    :func:`.distance._few_tiles`); ``grad_mma``: the setting grad_mma; ``distance_tune``: the
    setting distance_tune (:class:`.distance.Tune`; None: the shipped spec functions and limits);
    ``wgmma_chunk``: the setting wgmma_chunk (k-tiles per partial sum of the wgmma distance kernel,
    0: none); ``wgmma_tile``: the setting wgmma_tile (that kernel's tile columns with partial sums)."""

    tf32: bool
    wgmma: bool
    grad_mma: bool
    wgmma_always: bool = False
    distance_tune: object = None
    wgmma_chunk: int = 2
    wgmma_tile: int = 256

    @staticmethod
    def current() -> "Settings":
        wgmma = config.get("wgmma")
        return Settings(bool(MATMUL.allow_tf32), wgmma != "off", config.get("grad_mma"), wgmma == "always",
                        config.get("distance_tune"), config.get("wgmma_chunk"), config.get("wgmma_tile"))


class Launch(NamedTuple):
    kernel: object  # runtime.loader.LoadedKernel
    grid: tuple
    args: tuple
    block: object = None  # runtime.launcher.ArgBlock of a cached template's launch


# The lists of the open kermac_like.testing.record_plans() scopes: Plan.run appends itself to
# each (one truth test of an empty list when none is open).
_recorders: list = []


class Plan(NamedTuple):
    family: str
    spec: object  # KernelSpec of the main kernel, None for the reference path
    launches: tuple  # of Launch, in stream order
    out: torch.Tensor | None
    scratch: tuple = ()
    reference: Callable | None = None
    debug: bool = False

    def run(self):
        """Execute the plan; returns the result (``out``, or the reference's result)."""
        if _recorders:  # kermac_like.testing.record_plans
            for seen in _recorders:
                seen.append(self)
        if self.reference is not None:
            return self.reference()
        for k, grid, args, block in self.launches:
            launcher.launch(k, grid, args, debug=self.debug, block=block)
        return self.out


class PlanCache:
    """The one cache of what planning made, for every family: bounded, least recently used out.

    A key is computed once per call from the call and the settings it read (a family's own
    tuple, so families never share one); each entry carries its ``kind`` ("templates": a
    plan without its data, "calls": a template by the public op's call key, "tuning": an
    autotuned kernel choice). A hit is one dict lookup and a counter (no lock, no I/O); a
    put past ``size`` entries drops the least recently used quarter."""

    def __init__(self, size: int):
        self.size = size
        self._entries: dict = {}  # key -> [value, kind, last use]
        self._clock = itertools.count()
        self._lock = threading.Lock()

    def get(self, key):
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry[2] = next(self._clock)
        return entry[0]

    def put(self, key, value, kind: str):
        """Keep ``value`` under ``key``; returns it."""
        with self._lock:
            if len(self._entries) >= self.size:
                by_use = sorted(self._entries, key=lambda k: self._entries[k][2])
                for k in by_use[: max(1, self.size // 4)]:
                    del self._entries[k]
            self._entries[key] = [value, kind, next(self._clock)]
        return value

    def clear(self, *kinds: str) -> None:
        """Forget the entries of these kinds (none named: every entry)."""
        with self._lock:
            for k in [k for k, entry in self._entries.items() if not kinds or entry[1] in kinds]:
                del self._entries[k]

    def count(self, kind: str) -> int:
        return sum(1 for entry in list(self._entries.values()) if entry[1] == kind)


plans = PlanCache(2048)


def _reference_plan(fn: Callable, debug: bool) -> Plan:
    return Plan("reference", None, (), None, reference=fn, debug=debug)


def _gpu_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (8, 0)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _smem_per_sm(device: int) -> int:
    """Shared memory of one SM in bytes; 0 where torch does not report it."""
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", 0) or 0)


@functools.lru_cache(maxsize=None)
def _smem_per_block_optin(device: int) -> int:
    """Shared memory one block may opt in to, in bytes; 0 where torch does not report it."""
    return int(getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0) or 0)


_occupancy: dict = {}


def _blocks_per_sm(kernel) -> int:
    key = (kernel.device, kernel.spec)
    n = _occupancy.get(key)
    if n is None:
        try:
            launch = kernel.spec.launch  # its dynamic shared memory too (0 for kernel_matvec)
            n = int(kernel.function.occupancy.max_active_blocks_per_multiprocessor(launch.threads, launch.smem_bytes))
        except Exception:  # older cuda.core: the kernel's launch bound
            n = 2
        _occupancy[key] = n = max(1, n)
    return n


def _wgmma_enabled(device, settings: Settings | None = None) -> bool:
    """The sm_90a (wgmma) kernel serves float32 tensor-core calls on sm_90 devices
    (cdist p=2 at 30000^2 x 1024 on an H200: 28.4 ms with mma.sync, 16.4 ms; same error);
    ``KERMAC_LIKE_WGMMA=0`` keeps them on the mma.sync kernel."""
    if settings is None:
        settings = Settings.current()
    if not settings.wgmma or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


# -- shared by the kernel_matvec rules (matvec, matvec_wgmma) ------------------------------------
# Largest split-N scratch (partial sums: float32, float64 for a float64 out) one kernel_matvec
# call allocates on the GPU.
MATVEC_SCRATCH_BYTES = 32 << 20


def choose_split(m_tiles: int, n_tiles: int, slots: int, max_split: int) -> int:
    """Splits of kernel_matvec's N range: the fewest (at most ``max_split``, each split at
    least 4 y tiles) whose CTA count fills the last wave of ``slots`` concurrent CTAs to
    >= 97%, else the best fill. Depends on shapes and the device only (results are
    bitwise reproducible)."""
    limit = max(1, min(max_split, n_tiles // 4))
    if m_tiles >= 16 * slots:
        return 1
    best, best_eff = 1, -1.0
    for s in range(1, limit + 1):
        items = m_tiles * s
        waves = items / slots
        eff = waves / math.ceil(waves)  # fill of the last wave
        if items < 2 * slots:  # a GPU not yet twice full: more splits help regardless
            eff *= items / (2 * slots)
        if eff > best_eff * 1.01:
            best, best_eff = s, eff
        if eff >= 0.97:
            break
    return best


def batch_plan(call, tensors: dict, *, extra_strides: dict | None = None, skip=()) -> tuple:
    """A fused kernel's batch set-up: the call's hyper-parameters (tensors as float32; those named
    in ``skip`` left out), the batch strides of ``tensors`` (then ``extra_strides``, then the tensor
    hyper-parameters, which join ``tensors``) and their batch plan: (hypers, strides, plan)."""
    hypers = {k: (h.float() if isinstance(h, torch.Tensor) and h.dtype != torch.float32 else h)
              for k, h in call.hypers.items() if k not in skip}
    strides = {k: batch_strides(call.batch, t.shape[:-2], t.stride()[:-2]) for k, t in tensors.items()}
    strides.update(extra_strides or {})
    _add_hyper_tensors(call, hypers, tensors, strides)
    return hypers, strides, plan_batch(call.batch, strides)


def _add_hyper_tensors(call, hypers: dict, tensors: dict, strides: dict) -> None:
    """The tensor hyper-parameters of a matvec call join its tensors, with their batch strides."""
    for k, h in hypers.items():
        if isinstance(h, torch.Tensor):
            tensors[k] = h
            strides[k] = batch_strides(call.batch, tuple(h.shape), tuple(h.stride()))
