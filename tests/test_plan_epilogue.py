"""The rules' routing of formula kernels to the epilogue functors (plan.matvec.formula_fused,
plan.distance._formula_tensor_core_plan). CPU only: the planner's device queries and the loader
are stubbed (conftest.as_gpu); the kernels are never run (on a GPU: tests/test_gpu_epilogue.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kermac_like as km
from kermac_like.ops.distance import COMPUTE_MODES, prepare_call
from kermac_like.ops.matvec import prepare_matvec
from kermac_like.plan import distance as PD
from kermac_like.plan import matvec as PM


@pytest.fixture(autouse=True)
def _fused(settings):
    """The routing of the fused formula paths (the setting formula_fused, on by default)."""
    settings(formula_fused=True)

pytest.importorskip("sympy")


def _floats(plan):
    return [float(a) for ln in plan.launches for a in ln.args if isinstance(a, np.float32)]


@pytest.mark.parametrize("cap, family", [((9, 0), "distance_wgmma"), ((8, 0), "distance_mma")])
def test_run_kernel_of_a_functor_takes_the_tensor_cores(as_gpu, cap, family):
    as_gpu[0] = cap
    a = torch.randn(300, 100)
    call = prepare_call(km.rational_quadratic(), a, a, bandwidth=2.0, params={"alpha": 0.5})
    plan = PD.plan_distance(call, None, COMPUTE_MODES[0], False)
    assert plan.family == family
    # (the wgmma kernel's partial sums of two k-tiles at K = 64: the traits' kChunkTiles after the functor)
    tile = km.config.get("wgmma_tile")  # the partial sums' k-tiles (2) and tile columns (where not 128)
    wide = f", 2{'' if tile == 128 else f', {tile}'}" if family == "distance_wgmma" else ""
    assert f"kermac_like::epilogue::RationalQuadratic{wide}>" in plan.spec.traits
    assert "Epilogue::None" in plan.spec.traits and "Power::Noop" in plan.spec.traits
    assert 2.0 in _floats(plan) and 0.5 in _floats(plan)  # p0 = bandwidth, p1 = alpha (the inner_p slot)


def test_run_kernel_of_a_user_expression_carries_its_functor(as_gpu):
    d = km.kernel_expression("(1 + sqrt(5*r)/h + 5*r/(3*h**2))*exp(-sqrt(5*r)/h)", params=("h",))
    a = torch.randn(200, 80)
    plan = PD.plan_distance(prepare_call(d, a, a, params={"h": 1.5}), None, COMPUTE_MODES[0], False)
    assert plan.family == "distance_wgmma" and "kermac_like::formula::F" in plan.spec.traits
    assert plan.spec.prelude.startswith("namespace kermac_like")


@pytest.mark.parametrize("K", [3, 64])
@pytest.mark.parametrize("cap", [(9, 0), (8, 0)])
def test_run_kernel_of_a_functor_at_low_k_takes_the_exact_low_k_kernel(as_gpu, cap, K):
    """Up to FORMULA_LOWK_UP_TO coordinates: the low-K kernel of the exact squared distances with the
    functor (the tensor cores' expansion rounds r2 to eps (|x|^2 + |y|^2): anisotropic data missed 1e-5)."""
    as_gpu[0] = cap
    d = km.kernel_expression("(1 + sqrt(5*r)/h + 5*r/(3*h**2))*exp(-sqrt(5*r)/h)", params=("h",))
    a = torch.randn(300, K)
    for desc, params in ((km.rational_quadratic(), {"alpha": 0.5}), (d, {"h": 2.0})):
        kw = {"bandwidth": 2.0} if "h" not in params else {}
        plan = PD.plan_distance(prepare_call(desc, a, a, params=params, **kw), None, COMPUTE_MODES[0], False)
        assert plan.family == "distance_lowk", plan.family
        assert "DistanceLowKTraits" in plan.spec.traits and "Epilogue::None" in plan.spec.traits
        assert ("RationalQuadratic>" in plan.spec.traits) or ("kermac_like::formula::F" in plan.spec.traits)
        assert 2.0 in _floats(plan)


@pytest.mark.parametrize("desc, kw", [(km.periodic(1.0), {"bandwidth": 1.0}),
                                      (km.powered_exponential(1.5, p=1.0), {"bandwidth": 1.0}),
                                      (km.matern(2.5), {"bandwidth": 1.0, "epsilon": 1e-3})])
def test_other_formula_calls_take_the_torch_path(as_gpu, desc, kw):
    a = torch.randn(100, 16)
    eps = kw.pop("epsilon", None)
    plan = PD.plan_distance(prepare_call(desc, a, a, epsilon=eps, **kw), None, COMPUTE_MODES[0], False)
    assert plan.family == "reference"


def test_kernel_matvec_of_a_functor_takes_the_fused_kernel(as_gpu):
    x = torch.randn(1000, 3)
    v = torch.randn(1000, 1)
    call = prepare_matvec(km.matern(2.5), x, x, v, bandwidth=0.7)
    plan = PM.plan_matvec(call, torch.empty(1000, 1), False)
    assert plan.family == "matvec"
    assert ", 4, 1, true, 0, 4, 8, true, float, 0, kermac_like::epilogue::Matern52>" in plan.spec.traits
    assert any(abs(f - 0.7) < 1e-7 for f in _floats(plan))
    wide = PM.plan_matvec(call, torch.empty(1000, 1, dtype=torch.float64), False)  # a float64 out: torch path
    assert wide.family == "reference"


def test_kernel_matvec_of_a_functor_at_many_coordinates_takes_tensor_core_tiles(as_gpu):
    x = torch.randn(500, 100)
    call = prepare_matvec(km.matern(2.5), x, x, torch.randn(500, 2), bandwidth=3.0)
    assert PM.plan_matvec(call, torch.empty(500, 2), False).family == "matvec_blocked"
    # up to plan.distance.FORMULA_LOWK_UP_TO the fused SIMT kernel's direct differences (chunked)
    x = torch.randn(500, 64)
    call = prepare_matvec(km.matern(2.5), x, x, torch.randn(500, 2), bandwidth=3.0)
    plan = PM.plan_matvec(call, torch.empty(500, 2), False)
    assert plan.family == "matvec" and ", 0, 2, false, 0, 0, -1, false," in plan.spec.traits


def test_formula_fused_setting(as_gpu, settings):
    """formula_fused on (the default since session 23) routes a formula kernel that a functor serves to
    the fused kernels; off: the formula's torch path."""
    from kermac_like import config

    assert config.SETTINGS["formula_fused"].default is True
    call = prepare_matvec(km.matern(2.5), torch.randn(40, 3), torch.randn(50, 3), torch.randn(50, 1), bandwidth=1.0)
    assert PM.formula_fused(call, torch.empty(0))
    settings(formula_fused=False)
    assert not PM.formula_fused(call, torch.empty(0))


def test_logsumexp_of_a_functor_plans_the_fused_kernel_with_it(as_gpu):
    """plan_logsumexp with a positive formula's functor (ops.logsumexp._formula_fused: the squared_l2
    proxy with the functor's slots): lse_kernel's functor instantiation (kVariant 0), p0 = bandwidth and
    p1 = alpha in the bandwidth and inner_p arguments; a non-positive formula is refused by name first."""
    from kermac_like.plan.logsumexp import plan_logsumexp
    from kermac_like.runtime.specs import epilogue

    desc = km.rational_quadratic()
    x = torch.randn(300, 3)
    call = prepare_call(desc, x, x, bandwidth=2.0, params={"alpha": 0.5})
    proxy = call._replace(desc=km.preset("squared_l2"), hypers=epilogue.slot_hypers(desc, call.hypers))
    lw = torch.zeros(300, 1)
    plan = plan_logsumexp(proxy, lw, torch.empty(300, 1), False, functor=epilogue.functor(desc))
    assert plan.family == "logsumexp"
    assert plan.spec.traits.endswith(", 3, 1, 0, 0, 0, kermac_like::epilogue::RationalQuadratic>")
    assert 2.0 in _floats(plan) and 0.5 in _floats(plan)
    with pytest.raises(ValueError, match="descriptor: .* not a positive kernel"):
        km.kernel_logsumexp(km.polynomial(2), x, x)
