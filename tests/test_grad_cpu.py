"""cdist_grad's CPU path for p = 2 (ops/grad.py _cpu_p2: two matrix products about a per-feature
reference point) against the direct formula in float64, on centred and far-from-origin data."""

import math

import pytest
import torch

import kermac_like as km
from kermac_like.ops import grad as grad_mod
from kermac_like.reference import cdist_grad_reference


def _operands(L, K, M, N, O, offset=0.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(*L, K, M, generator=g, dtype=dtype)
    b = torch.randn(*L, N, K, generator=g, dtype=dtype) + offset
    c = torch.randn(*L, O, K, generator=g, dtype=dtype)
    d = torch.randn(*L, N, M, generator=g, dtype=dtype) + offset
    return a, b, c, d


def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("offset", [0.0, 1000.0])
@pytest.mark.parametrize("L", [(), (2,)])
def test_p2_cpu_path_accurate(L, offset):
    a, b, c, d = _operands(L, 300, 40, 6, 3, offset)
    assert grad_mod._cpu_p2_serves(a, 2.0)
    want = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(), 2.0)
    direct = cdist_grad_reference(a, b, c, d, 2.0)  # the float32 direct formula, as before
    got = km.cdist_grad(a, b, c, d, p=2.0)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert _rel(got, want) <= max(2 * _rel(direct, want), 1e-6)
    if offset:  # the products about the reference point: without it the offset's cancellation shows
        assert bool(grad_mod._row_reference(b).any())


def test_p2_cpu_path_float64_out_and_broadcast():
    a, b, c, d = _operands((2,), 50, 30, 5, 4, dtype=torch.float64)
    want = cdist_grad_reference(a, b[0], c, d, 2.0)
    out = torch.full((2, 4, 5, 30), math.nan, dtype=torch.float64)
    assert km.cdist_grad(a, b[0], c, d, p=2.0, out=out) is out
    assert _rel(out, want) < 1e-13


@pytest.mark.parametrize("where", ["a", "b", "c", "d"])
def test_p2_nonfinite_takes_the_direct_formula(where, monkeypatch):
    ops = dict(zip("abcd", _operands((), 20, 7, 3, 2)))
    ops[where].view(-1)[5] = math.inf
    ops["d"][1, 3] = math.nan
    a, b, c, d = (ops[k] for k in "abcd")
    calls = []
    fast = grad_mod._cpu_p2
    monkeypatch.setattr(grad_mod, "_cpu_p2", lambda *t: calls.append(1) or fast(*t))
    got = km.cdist_grad(a, b, c, d, p=2.0)
    assert calls  # tried, its non-finite result discarded
    want = cdist_grad_reference(a, b, c, d, 2.0)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = torch.isfinite(want)
    assert torch.equal(got[fin], want[fin])


def test_p_other_than_2_unchanged():
    a, b, c, d = _operands((), 30, 9, 4, 2)
    assert not grad_mod._cpu_p2_serves(a, 1.3)
    assert torch.equal(km.cdist_grad(a, b, c, d, p=1.3), cdist_grad_reference(a, b, c, d, 1.3))
