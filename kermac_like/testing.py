"""What tests and benchmark probes need of the package beyond its public API, in one place.

    from kermac_like import testing

    with testing.record_plans() as plans:      # which plan each call took
        km.cdist(x, y)
    assert plans.families == ["distance_wgmma"]

    with testing.override(wgmma="off"):        # force a path or a tier (a setting)
        ...
    testing.wait_for_compiles()                # kernels compiling in the background
    testing.clear_caches()                     # start cold (disk=True: the kernel cache too)

* :func:`record_plans`: the plans run inside a ``with`` block, in order (:class:`PlanRecord`:
  family, main kernel spec, every launch's kernel spec), taken where every plan runs
  (:meth:`kermac_like.plan.core.Plan.run`); outside a block the hook costs one test of an
  empty list per plan. KMeans' and Falkon's plans launch on their own and are not recorded.
* :func:`override`: :func:`kermac_like.config.override`, every setting that chooses a path or a
  tier (``wgmma``, ``grad_mma``, ``jit_tier``, ``autotune``, ``kmeans_*``, ``lse_expand``,
  ``falkon_mma``, ``gp_*``; ``python -m kermac_like config`` lists them);
  :func:`spec_override`: fields of the distance rule's :class:`~kermac_like.plan.distance.Tune`
  (spec functions and size limits that have no setting of their own) replaced inside a block,
  as an override of the setting ``distance_tune``.
* :func:`wait_for_compiles`, :func:`clear_caches`, :func:`plan_cache_info`: the background
  compiles, the in-process caches (loaded kernels, plan templates, autotune choices, the open
  kernel-cache connection, bundle lists) and the on-disk kernel cache.

The rest of this module names the package's private modules that tests check on their own
(the solvers' building blocks, KMeans' algorithms, the torch.library encodings, the GPyTorch operator's parts):
tests import them from here, not by their private paths, so that moving a module changes this
table and not the tests. ``import kermac_like`` does not import this module.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import NamedTuple

from . import _args as args
from .cluster import _kmeans as kmeans_estimator, _kmeans_plusplus as kmeans_seeding, _lloyd as kmeans_lloyd
from .config import override
from .ops import _library as library
from .plan import core as _plan_core
from .plan.distance import Tune, spec_override
from .rfm import _agop as rfm_agop
from .runtime import cache as _cache
from .runtime import store as _store
from .runtime.cache import warm as _warm
from .solvers import _cg as solver_cg
from .solvers import _kernel as solver_kernel
from .solvers import _nystrom as solver_nystrom
from .solvers import _rows as solver_rows

__all__ = ["PlanRecord", "PlanLog", "record_plans", "override", "Tune", "spec_override", "wait_for_compiles",
           "clear_caches", "plan_cache_info",
           # private modules checked on their own (and gp_cg, gp_operator, gp_products: lazily)
           "args", "library", "solver_cg", "solver_kernel", "solver_nystrom", "solver_rows", "kmeans_estimator",
           "kmeans_seeding", "kmeans_lloyd", "rfm_agop"]

# GPyTorch's are optional: imported on first use (kermac_like.testing.gp_operator).
_OPTIONAL = {"gp_cg": "kermac_like.gpytorch._cg", "gp_operator": "kermac_like.gpytorch._operator",
             "gp_products": "kermac_like.gpytorch._products"}


def __getattr__(name):
    module = _OPTIONAL.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(module)


# -- which plan a call took ----------------------------------------------------------------------
class PlanRecord(NamedTuple):
    """One plan that ran: ``family`` ("distance_wgmma", "matvec", "reference", ...; see
    :mod:`kermac_like.plan`), ``spec`` (the main kernel's KernelSpec, None for the reference
    path) and ``kernels`` (the KernelSpec of each launch, in stream order)."""

    family: str
    spec: object
    kernels: tuple

    @property
    def name(self) -> str:
        """The main kernel's name without its namespace ("distance_kernel"), or the family."""
        return self.family if self.spec is None else self.spec.kernel.rpartition("::")[2]


class PlanLog(list):
    """The :class:`PlanRecord` of each plan run inside :func:`record_plans`, in order. A plan's
    tensors are not kept."""

    def append(self, plan) -> None:
        super().append(PlanRecord(plan.family, plan.spec, tuple(ln.kernel.spec for ln in plan.launches)))

    @property
    def families(self) -> list:
        return [r.family for r in self]

    @property
    def names(self) -> list:
        return [r.name for r in self]


@contextlib.contextmanager
def record_plans():
    """``with record_plans() as plans:`` every plan run inside the block (any thread), as a
    :class:`PlanLog`; blocks nest, each sees the plans of its own span."""
    log = PlanLog()
    _plan_core._recorders.append(log)
    try:
        yield log
    finally:
        _plan_core._recorders.remove(log)


# -- compiles and caches ----------------------------------------------------------------------
def wait_for_compiles() -> int:
    """Wait for every kernel being found or compiled in a worker thread (the low-K first-call
    tier and prefetches start them); returns how many there were. Call it before timing, or
    before asserting which kernel a call took."""
    return _store.wait_pending()


def clear_caches(*, disk: bool = False) -> None:
    """Forget what this process holds: loaded kernels, the plan cache (templates, call keys,
    autotune's choices), the open kernel cache (reopened on next use, at the current
    ``cache_dir``), the bundle lists and, where it is loaded, the GPyTorch operator's captured
    graphs. ``disk=True`` also empties the kernel cache on disk (the current ``cache_dir``;
    bundles are read-only and stay). Waits for background compiles first."""
    _store.wait_pending()
    _store.clear_loaded()
    _plan_core.plans.clear()
    _warm._bundle_files.cache_clear()
    if disk:
        _cache.get_cache().clear()
    _cache.reset_cache()
    gp = sys.modules.get(_OPTIONAL["gp_operator"])
    if gp is not None:
        gp._PIVOT_GRAPHS.clear()


def plan_cache_info() -> dict:
    """What the plan cache (:data:`kermac_like.plan.core.plans`) holds: ``templates`` (plan
    templates kept per call signature) and ``calls`` (eager calls replayed by their call key)."""
    return {kind: _plan_core.plans.count(kind) for kind in ("templates", "calls")}
