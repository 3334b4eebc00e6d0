"""CPU results against torch.cdist and element-by-element formulas (every descriptor), the
reference (the tests' oracle) itself, the gradient contraction."""

import itertools
import math

import pytest
import torch

import kermac_like as km
from kermac_like import InnerOperator as I
from kermac_like import KernelType as T
from kermac_like import PowerType as P
from kermac_like.reference import cdist_grad_reference

F64 = torch.float64


def rel(x, y):
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("p", [0, 0.5, 1, 1.3, 2, 3, math.inf])
@pytest.mark.parametrize("shapes", [((7, 5), (9, 5)), ((3, 7, 5), (1, 9, 5)), ((2, 1, 4, 3), (5, 6, 3)), ((1, 3), (4, 3))])
def test_cdist_matches_torch(p, shapes):
    g = torch.Generator().manual_seed(hash((p, shapes)) % 2**31)
    x1 = torch.randn(*shapes[0], generator=g, dtype=F64)
    x2 = torch.randn(*shapes[1], generator=g, dtype=F64)
    ours = km.cdist(x1, x2, p)
    ref = torch.cdist(x1, x2, p)
    assert ours.shape == ref.shape
    assert rel(ours, ref) < 1e-12


@pytest.mark.parametrize("p", [0.5, 1, 1.3, 2, 3])
def test_cdist_skip_epilogue(p):
    x1, x2 = torch.randn(6, 4, dtype=F64), torch.randn(5, 4, dtype=F64)
    ours = km.cdist(x1, x2, p, skip_epilogue=True)
    assert rel(ours, torch.cdist(x1, x2, p) ** p) < 1e-12


def test_reference_is_row_blocked(monkeypatch):
    import kermac_like.reference as ref

    monkeypatch.setattr(ref, "BLOCK_ELEMENTS", 50)
    x1, x2 = torch.randn(37, 6, dtype=F64), torch.randn(11, 6, dtype=F64)
    assert rel(ref.cdist_reference(x1, x2, 1.3), torch.cdist(x1, x2, 1.3)) < 1e-12
    desc = km.PRESETS["laplace_p"]
    assert rel(ref.distance_reference(desc, x1, x2, inner_p=1.3, outer_p=1.3, bandwidth=2.0),
               torch.exp(-torch.cdist(x1, x2, 1.3) / 2.0)) < 1e-12


def _direct(desc, a, b, ip, op, bw, lam, diag, eps):
    """Element-by-element formula (loops): the independent oracle."""
    M, N = a.shape[0], b.shape[0]
    out = torch.empty(M, N, dtype=F64)
    for m in range(M):
        for n in range(N):
            if desc.inner_operator is I.DOT:
                acc = float((a[m] * b[n]).sum())
            else:
                t = (a[m] - b[n]).abs()
                acc = float({P.ABS: t, P.SQUARE: t * t, P.POW: t**ip}[desc.inner_power].sum())
            if desc.outer_power is P.NOOP:
                d = acc
            elif desc.outer_power is P.SQRT:
                d = math.sqrt(acc)
            else:
                d = acc ** (1 / op)
            if eps is not None and d < eps:
                d = 0.0
            y = {T.NONE: d, T.LAPLACE: math.exp(-d / bw), T.GAUSSIAN: math.exp(-d * d / (2 * bw * bw))}[desc.kernel_type]
            if lam is not None and n - m == diag:
                y += lam
            out[m, n] = y
    return out


ALL = list(km.KernelDescriptor.all())


def test_descriptor_count():
    # DIFF: 3 inner x 3 outer x 3 epilogues; DOT: 1
    assert len(ALL) == 28


@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
def test_run_kernel_every_descriptor(desc):
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(6, 3, generator=g, dtype=F64), torch.randn(5, 3, generator=g, dtype=F64)
    kw = dict(p=1.7, bandwidth=1.3, regularization=0.25, regularization_offset_x=1, regularization_offset_y=0, epsilon=0.05)
    ours = km.run_kernel(desc, a, b, **kw)
    direct = _direct(desc, a, b, 1.7, 1.7, 1.3, 0.25, 1, 0.05)
    assert rel(ours, direct) < 1e-12


def test_run_kernel_batched_hyperparameters():
    desc = km.PRESETS["laplace_p"]
    a = torch.randn(3, 6, 4, dtype=F64)  # B=3
    b = torch.randn(5, 4, dtype=F64)
    bw = torch.tensor([0.5, 1.0], dtype=F64).reshape(2, 1)  # (L=2, 1) -> (2, 3)
    p = torch.tensor([1.2, 2.5, 3.0], dtype=F64)  # broadcasts over B
    lam = torch.tensor([0.1, 0.2], dtype=F64).reshape(2, 1)
    out = km.run_kernel(desc, a, b, p=p, bandwidth=bw, regularization=lam, regularization_offset_y=1)
    assert out.shape == (2, 3, 6, 5)
    for l, bb in itertools.product(range(2), range(3)):
        ref = _direct(desc, a[bb], b, p[bb].item(), p[bb].item(), bw[l, 0].item(), lam[l, 0].item(), -1, None)
        assert rel(out[l, bb], ref) < 1e-12


def test_inner_outer_p_override():
    a, b = torch.randn(4, 3, dtype=F64), torch.randn(5, 3, dtype=F64)
    out = km.run_kernel(km.PRESETS["p_norm"], a, b, inner_p=3.0, outer_p=1.5)
    ref = ((a[:, None] - b[None]).abs() ** 3).sum(-1) ** (1 / 1.5)
    assert rel(out, ref) < 1e-12


def test_out_any_layout_written():
    a, b = torch.randn(4, 3, dtype=F64), torch.randn(5, 3, dtype=F64)
    out = torch.full((5, 4), float("nan"), dtype=F64).T  # column-major (4, 5)
    r = km.run_kernel(km.PRESETS["l1"], a, b, out=out)
    assert r is out and not torch.isnan(out).any()
    assert rel(out, torch.cdist(a, b, 1)) < 1e-12


# -- cdist_grad reference ------------------------------------------------------------------
def _grad_direct(a, b, c, d, p):
    K, M = a.shape
    N, O = b.shape[0], c.shape[0]
    out = torch.zeros(O, N, M, dtype=F64)
    for o, n, m, k in itertools.product(range(O), range(N), range(M), range(K)):
        t = float(d[n, m] - b[n, k])
        f = 0.0 if t == 0 else math.copysign(abs(t) ** (p - 1), t)
        out[o, n, m] += float(c[o, k] * a[k, m]) * f
    return out


@pytest.mark.parametrize("p", [1.0, 1.3, 2.0, 3.0])
def test_cdist_grad_reference_direct_sum(p):
    g = torch.Generator().manual_seed(3)
    K, M, N, O = 4, 3, 5, 2
    a, b = torch.randn(K, M, generator=g, dtype=F64), torch.randn(N, K, generator=g, dtype=F64)
    c, d = torch.randn(O, K, generator=g, dtype=F64), torch.randn(N, M, generator=g, dtype=F64)
    assert rel(km.cdist_grad(a, b, c, d, p=p), _grad_direct(a, b, c, d, p)) < 1e-12
    # batched with broadcast and a per-batch p tensor
    a2 = torch.stack([a, 2 * a])
    pt = torch.tensor([p, p + 0.5], dtype=F64)
    out = km.cdist_grad(a2, b, c, d, p=pt)
    assert out.shape == (2, O, N, M)
    assert rel(out[1], _grad_direct(2 * a, b, c, d, p + 0.5)) < 1e-12


def test_cdist_grad_reference_p2_einsum_identity():
    L, K, M, N, O = 2, 6, 5, 4, 3
    a, b = torch.randn(L, K, M, dtype=F64), torch.randn(L, N, K, dtype=F64)
    c, d = torch.randn(L, O, K, dtype=F64), torch.randn(L, N, M, dtype=F64)
    ident = torch.einsum("lok,lkm,lnm->lonm", c, a, d) - torch.einsum("lok,lkm,lnk->lonm", c, a, b)
    assert rel(km.cdist_grad(a, b, c, d, p=2.0), ident) < 1e-12


def test_cdist_grad_reference_blocked(monkeypatch):
    import kermac_like.reference as ref

    monkeypatch.setattr(ref, "BLOCK_ELEMENTS", 7)
    K, M, N, O = 9, 3, 2, 2
    a, b = torch.randn(K, M, dtype=F64), torch.randn(N, K, dtype=F64)
    c, d = torch.randn(O, K, dtype=F64), torch.randn(N, M, dtype=F64)
    assert rel(cdist_grad_reference(a, b, c, d, 1.3), _grad_direct(a, b, c, d, 1.3)) < 1e-12
