"""The first-call tier of the low-K kernels (plan.distance._first_call_tier): a call whose specialised
kernel is not at hand runs the run-time-K variant while it compiles. CPU only: the
planner's device queries and the loader are stubbed (conftest.as_gpu)."""

from __future__ import annotations

import torch

import kermac_like as km
from kermac_like.plan import distance as P
from kermac_like.ops.distance import COMPUTE_MODES, prepare_call
from kermac_like.runtime import launcher, store
from kermac_like.layout import Layout
from kermac_like.runtime.specs import LOWK_MAX_K, lowk_spec


def _plan(a, p):
    call = prepare_call(km.preset("p_norm"), a, a, p=p)
    out = torch.empty(call.out_shape)
    return P._plan_distance_gpu(call, out, COMPUTE_MODES[0], False, P.Settings.current())


def test_first_call_runs_the_generic_kernel_while_the_specialised_one_compiles(as_gpu, monkeypatch, settings):
    settings(jit_tier=True)  # (off in the rest of the suite: conftest.py)
    ready, fetched = set(), []
    monkeypatch.setattr(store, "available", lambda spec, device: spec in ready)
    monkeypatch.setattr(store, "prefetch", lambda specs, device, debug=False: fetched.extend(specs))
    a = torch.randn(300, 5)
    # neither kernel at hand: the specialised one, compiled now (nothing to serve meanwhile)
    plan = _plan(a, 1.7)
    assert plan.family == "distance_lowk" and ", 5, " in plan.spec.traits and not fetched
    P.clear_templates()
    # the generic one is at hand (a bundle): it serves the call, the specialised one compiles aside
    generic = lowk_spec(km.preset("p_norm"), Layout.ROW_MAJOR, Layout.ROW_MAJOR, LOWK_MAX_K + 1, chunks=0)  # kK = 0
    ready.add(generic)
    plan = _plan(a, 1.7)
    assert plan.spec == generic
    assert len(fetched) == 1 and ", 5, " in fetched[0].traits
    assert not P.plans.count("templates")  # not kept: a later call takes the specialised kernel once it is ready
    ready.add(fetched[0])
    plan = _plan(a, 1.7)
    assert plan.spec == fetched[0] and P.plans.count("templates")


def test_tier_off(as_gpu, monkeypatch, settings):
    settings(jit_tier=False)
    monkeypatch.setattr(store, "available", lambda spec, device: "0>" in spec.traits)
    plan = _plan(torch.randn(300, 5), 1.7)
    assert ", 5, " in plan.spec.traits
