"""The planner: one place that decides how a validated call runs.

A rule per op turns (descriptor, tensors, hyper-parameters, device, settings) into an
immutable :class:`Plan`:

* ``family``: which kernel family serves the call ("distance", "distance_lowk", "distance_mma",
  "distance_wgmma", "cdist_grad", "cdist_grad_mma", "matvec", "matvec_wgmma",
  "matvec_blocked") or "reference" (the torch path: CPU tensors, float64, GPUs before
  sm_80, shapes the kernels do not take);
* ``spec``: the main template instantiation (:mod:`kermac_like.runtime.specs`);
* ``launches``: every kernel launch in stream order, each with its grid and its
  argument tuple (the flat ABI of ``cuda_templates/ABI.md``): preparation steps
  (the wgmma b layout) come right before the launch that reads them, and batch modes
  that do not fold into the kernel's three repeat the pair once per host-loop entry;
* ``scratch``: temporary tensors the launches read (kept alive by the plan);
* ``reference``: the callable of the reference path (family "reference").

The op executes the plan top to bottom with :meth:`Plan.run`. Settings that steer the
choice are read once per call into :class:`Settings`.

One module per rule, over a shared core:

* :mod:`.core`: Settings, Launch, Plan, the plan cache every family keeps its reusable work
  in (``plans``: bounded, least recently used out), the reference plan, the device queries,
  the distance ABI's hyper-parameters (HYPERS) and the N-split rule of kernel_matvec;
* :mod:`.autotune`: which distance kernel serves a call (the default table, or timed once
  per problem class and stored);
* :mod:`.distance`: run_kernel and cdist (SIMT, low-K, mma.sync, wgmma with its b
  preparation), its plan templates (in the plan cache, per call signature and per eager
  call key), and spec_override;
* :mod:`.cdist_grad`: cdist_grad (SIMT and tensor-core gradient kernels);
* :mod:`.matvec`: kernel_matvec (fused SIMT kernel, tensor-core tiles times v);
* :mod:`.matvec_wgmma`: kernel_matvec on Hopper (matvec_wgmma_kernel);
* :mod:`.topk`: the fused top-k selection;
* :mod:`.logsumexp`: kernel_logsumexp's fused forward.

A new kernel family is one template, one spec module (runtime/specs) and one rule module
here. The names below are re-exported for the ops; tests and probes reach the planner's
caches and overrides through :mod:`kermac_like.testing`.
"""

from .core import MATVEC_SCRATCH_BYTES, Launch, Plan, Settings, choose_split
from .distance import WGMMA_BLOCK_K, b_entries, clear_templates, plan_distance, run_by_call_key, run_distance
from .cdist_grad import plan_cdist_grad
from .matvec_wgmma import MATVEC_WGMMA_BLOCK_BYTES
from .matvec import matvec_blocked, plan_matvec
from .topk import plan_topk

__all__ = ["Settings", "Launch", "Plan", "plan_distance", "run_distance", "plan_cdist_grad", "b_entries",
           "plan_matvec", "choose_split", "MATVEC_SCRATCH_BYTES", "MATVEC_WGMMA_BLOCK_BYTES", "plan_topk"]
