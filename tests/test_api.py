"""Argument checking (every op), out= semantics and autograd, on the CPU path."""

import math

import pytest
import torch

import kermac_like as km

F64 = torch.float64


def _poisoned(shape, dtype=torch.float32):
    return torch.full(shape, 12345.0, dtype=dtype)


def _untouched(out):
    return bool((out == 12345.0).all())


BAD_CDIST = [
    (lambda x, y, o: km.cdist(x.int(), y, out=o), TypeError, "x1"),
    (lambda x, y, o: km.cdist(x, y.double(), out=o), TypeError, "x2"),
    (lambda x, y, o: km.cdist(x, y[:, :2], out=o), ValueError, "x2"),
    (lambda x, y, o: km.cdist(x, y, -1.0, out=o), ValueError, "p"),
    (lambda x, y, o: km.cdist(x, y, float("nan"), out=o), ValueError, "p"),
    (lambda x, y, o: km.cdist(x, y, "2", out=o), TypeError, "p"),
    (lambda x, y, o: km.cdist(x[0], y, out=o), ValueError, "x1"),
    (lambda x, y, o: km.cdist([1.0], y, out=o), TypeError, "x1"),
    (lambda x, y, o: km.cdist(x, y, compute_mode="fast", out=o), ValueError, "compute_mode"),
]


@pytest.mark.parametrize("case", range(len(BAD_CDIST)))
def test_cdist_bad_input(case):
    fn, exc, name = BAD_CDIST[case]
    x, y = torch.randn(4, 3), torch.randn(5, 3)
    out = _poisoned((4, 5))
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn(x, y, out)
    assert _untouched(out)


def test_cdist_bad_out():
    x, y = torch.randn(4, 3), torch.randn(5, 3)
    for out, exc in [(_poisoned((5, 4)), ValueError), (_poisoned((4, 5), F64), TypeError), ("no", TypeError)]:
        with pytest.raises(exc, match="^out"):
            km.cdist(x, y, out=out)


BAD_RUN = [
    (dict(descriptor="l2"), TypeError, "descriptor"),
    (dict(descriptor=km.PRESETS["laplace_l2"]), ValueError, "bandwidth"),
    (dict(descriptor=km.PRESETS["laplace_l2"], bandwidth=0.0), ValueError, "bandwidth"),
    (dict(descriptor=km.PRESETS["laplace_l2"], bandwidth=-1.0), ValueError, "bandwidth"),
    (dict(descriptor=km.PRESETS["p_norm"]), ValueError, "p"),
    (dict(descriptor=km.PRESETS["p_norm"], p=-2.0), ValueError, "p"),
    (dict(descriptor=km.PRESETS["p_norm"], p=2.0, outer_p=0.0), ValueError, "outer_p"),
    (dict(descriptor=km.PRESETS["l1"], epsilon=-1.0), ValueError, "epsilon"),
    (dict(descriptor=km.PRESETS["l1"], regularization_offset_x=0.5), TypeError, "regularization_offset_x"),
    (dict(descriptor=km.PRESETS["l1"], regularization="a"), TypeError, "regularization"),
    (dict(descriptor=km.PRESETS["laplace_l2"], bandwidth=torch.ones(3)), ValueError, "bandwidth"),
    (dict(descriptor=km.PRESETS["laplace_l2"], bandwidth=torch.ones(2, dtype=torch.int32)), TypeError, "bandwidth"),
]


@pytest.mark.parametrize("case", range(len(BAD_RUN)))
def test_run_kernel_bad_input(case):
    kw, exc, name = BAD_RUN[case]
    kw = dict(kw)
    desc = kw.pop("descriptor")
    a, b = torch.randn(2, 4, 3), torch.randn(5, 3)
    out = _poisoned((2, 4, 5))
    with pytest.raises(exc, match=rf"^{name}\b"):
        km.run_kernel(desc, a, b, out=out, **kw)
    assert _untouched(out)


BAD_GRAD = [
    (lambda a, b, c, d, o: km.cdist_grad(a, b[:, :2], c, d, out=o), ValueError, "b"),
    (lambda a, b, c, d, o: km.cdist_grad(a, b, c[:, :2], d, out=o), ValueError, "c"),
    (lambda a, b, c, d, o: km.cdist_grad(a, b, c, d.T, out=o), ValueError, "d"),
    (lambda a, b, c, d, o: km.cdist_grad(a, b, c, d.double(), out=o), TypeError, "d"),
    (lambda a, b, c, d, o: km.cdist_grad(a, b, c, d, p=-1.0, out=o), ValueError, "p"),
    (lambda a, b, c, d, o: km.cdist_grad(a, b, c, d, out=o[:, :, :2]), ValueError, "out"),
]


@pytest.mark.parametrize("case", range(len(BAD_GRAD)))
def test_cdist_grad_bad_input(case):
    fn, exc, name = BAD_GRAD[case]
    K, M, N, O = 3, 4, 5, 2
    a, b, c, d = torch.randn(K, M), torch.randn(N, K), torch.randn(O, K), torch.randn(N, M)
    out = _poisoned((O, N, M))
    with pytest.raises(exc, match=rf"^{name}\b"):
        fn(a, b, c, d, out)
    assert _untouched(out)


def test_out_is_returned_and_written():
    x, y = torch.randn(4, 3), torch.randn(5, 3)
    out = _poisoned((4, 5))
    assert km.cdist(x, y, 1.0, out=out) is out
    assert torch.allclose(out, torch.cdist(x, y, 1.0), atol=1e-5)


# -- autograd --------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.7, 1.0, 1.3, 2.0, 3.0])
def test_cdist_backward_matches_torch(p):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 4, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(1, 5, 4, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(2, 6, 5, generator=g, dtype=F64)
    ours = torch.autograd.grad((km.cdist(x, y, p) * w).sum(), (x, y))
    theirs = torch.autograd.grad((torch.cdist(x, y, p) * w).sum(), (x, y))
    for u, v in zip(ours, theirs):
        assert torch.allclose(u, v, rtol=1e-10, atol=1e-12)


def test_cdist_backward_zero_distance():
    x = torch.randn(4, 3, dtype=F64, requires_grad=True)
    (gx,) = torch.autograd.grad(km.cdist(x, x.detach()).sum(), (x,))
    (tx,) = torch.autograd.grad(torch.cdist(x, x.detach()).sum(), (x,))
    assert torch.isfinite(gx).all() and torch.allclose(gx, tx)


@pytest.mark.parametrize("name", ["l1", "l2", "squared_l2", "p_norm", "laplace_l1", "laplace_l2", "laplace_p", "gaussian_l2", "dot"])
def test_run_kernel_gradcheck(name):
    g = torch.Generator().manual_seed(5)
    a = torch.randn(2, 5, 3, generator=g, dtype=F64, requires_grad=True)
    b = torch.randn(4, 3, generator=g, dtype=F64, requires_grad=True)

    def f(a, b):
        return km.run_kernel(km.PRESETS[name], a, b, p=1.6, bandwidth=1.7, regularization=0.3)

    assert torch.autograd.gradcheck(f, (a, b))


def test_gradcheck_batched_p_tensor_and_epsilon():
    a = torch.randn(2, 4, 3, dtype=F64, requires_grad=True)
    b = torch.randn(2, 5, 3, dtype=F64, requires_grad=True)
    p = torch.tensor([1.5, 2.5], dtype=F64)

    def f(a, b):
        return km.run_kernel(km.PRESETS["laplace_p"], a, b, p=p, bandwidth=2.0, epsilon=1e-3)

    assert torch.autograd.gradcheck(f, (a, b))


def test_double_backward_and_hyper_grad_raise():
    a = torch.randn(4, 3, dtype=F64, requires_grad=True)
    b = torch.randn(5, 3, dtype=F64)
    y = km.cdist(a, b, 1.5)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(y.sum(), (a,), create_graph=True)
    bw = torch.tensor([1.0], dtype=F64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="bandwidth"):
        km.run_kernel(km.PRESETS["laplace_l2"], a, b, bandwidth=bw)


def test_inf_and_zero_p_autograd_through_torch():
    x = torch.randn(4, 3, dtype=F64, requires_grad=True)
    y = torch.randn(5, 3, dtype=F64)
    (g,) = torch.autograd.grad(km.cdist(x, y, math.inf).sum(), (x,))
    (t,) = torch.autograd.grad(torch.cdist(x, y, math.inf).sum(), (x,))
    assert torch.allclose(g, t)


def test_all_finite_checks_every_block():
    """_args.all_finite: blocks of FINITE_BLOCK elements along the first dimension, a NaN or inf in
    any block (the first, a middle one, the last partial one) found, empty and 0-d tensors."""
    from kermac_like.testing import args as _args

    old = _args.FINITE_BLOCK
    try:
        _args.FINITE_BLOCK = 12  # 4 rows of 3 a block: 10 rows -> 3 blocks, the last partial
        x = torch.randn(10, 3)
        assert _args.all_finite(x)
        for r, v in ((0, float("nan")), (5, float("inf")), (9, -float("inf"))):
            y = x.clone()
            y[r, 1] = v
            assert not _args.all_finite(y)
        assert _args.all_finite(torch.empty(0, 3)) and _args.all_finite(torch.tensor(1.0))
        assert not _args.all_finite(torch.tensor(float("nan")))
        assert not _args.all_finite(torch.randn(10, 2, 2).index_fill_(0, torch.tensor([7]), float("nan")))
    finally:
        _args.FINITE_BLOCK = old
