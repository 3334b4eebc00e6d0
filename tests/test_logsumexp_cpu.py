"""kernel_logsumexp's CPU float32 path (ops/logsumexp.py _forward_cpu_product: the matrix product about the
reference point, near pairs recomputed by direct differences, torch.logsumexp in row blocks) against float64,
on the data families (centred, offset by 1000, positive, integer with ties, clustered, anisotropic): never
less accurate than torch.logsumexp over torch.cdist in float32 beyond the output's own rounding; the path
taken, weights per column over blocks of points, non-finite inputs, gradients."""

import logging

import pytest
import torch

import kermac_like as km
from kermac_like.ops import logsumexp as lse_mod


def _torch_way(x, y, w, bw, kind):
    d = torch.cdist(x, y)
    t = d.square() / (-2 * bw * bw) if kind == "gaussian" else d / -bw
    return torch.logsumexp(t + w, dim=1)


def _family(name, M, K, g):
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if name == "centred":
        return r(M, K), r(M, K)
    if name == "offset":
        return r(M, K) + 1000, r(M, K) + 1000
    if name == "positive":
        return torch.rand(M, K, generator=g), torch.rand(M, K, generator=g)
    if name == "ties":
        return (torch.randint(0, 5, (M, K), generator=g).float(), torch.randint(0, 5, (M, K), generator=g).float())
    if name == "clustered":
        c = 10 * r(8, K)
        return (c[torch.randint(0, 8, (M,), generator=g)] + 0.01 * r(M, K),
                c[torch.randint(0, 8, (M,), generator=g)] + 0.01 * r(M, K))
    scale = torch.logspace(-2, 2, K)  # anisotropic
    return r(M, K) * scale, r(M, K) * scale


@pytest.mark.parametrize("kind", ["gaussian", "laplace"])
@pytest.mark.parametrize("family", ["centred", "offset", "positive", "ties", "clustered", "anisotropic"])
@pytest.mark.parametrize("K", [3, 40])
def test_as_accurate_as_torch_on_every_family(kind, family, K):
    g = torch.Generator().manual_seed(K)
    x, y = _family(family, 700, K, g)
    w = torch.randn(700, generator=g)
    spread = torch.cdist(x[:100], y[:100]).median().item()
    desc = km.preset(f"{kind}_l2")
    for rel in (0.05, 1.0, 20.0):
        bw = spread * rel
        ref = km.kernel_logsumexp(desc, x.double(), y.double(), w.double(), bandwidth=bw)
        scale = ref.abs().clamp_min(1)
        ours = ((km.kernel_logsumexp(desc, x, y, w, bandwidth=bw).double() - ref).abs() / scale).max().item()
        theirs = ((_torch_way(x, y, w, bw, kind).double() - ref).abs() / scale).max().item()
        # Both round the same float32 exponents -phi + w (|phi| up to ~10^3 at the smallest bandwidth) and the
        # output: beyond that shared rounding (a few percent of it, one ulp of the result) never less accurate
        assert ours <= 1.05 * theirs + 2 ** -23, (rel, ours, theirs)
        if family in ("offset", "clustered"):  # where torch's product formula loses the small distances
            assert ours < 1e-4, (rel, ours)
            assert ours < theirs or theirs < 1e-6, (rel, ours, theirs)


def test_the_cpu_float32_path_is_taken(caplog):
    x, y = torch.randn(50, 3), torch.randn(60, 3)
    with caplog.at_level(logging.DEBUG, logger="kermac_like.logsumexp"):
        km.kernel_logsumexp(km.preset("gaussian_l2"), x, y, bandwidth=1.0, debug=True)
    assert any("CPU float32 path" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kermac_like.logsumexp"):  # p = 1: the float64 blocks
        km.kernel_logsumexp(km.preset("laplace_l1"), x, y, bandwidth=1.0, debug=True)
    assert not any("CPU float32 path" in r.getMessage() for r in caplog.records)


def test_columns_over_several_blocks_of_points():
    """C columns of weights where one row of all N points passes BLOCK_ELEMENTS: blocks of points combined by
    logaddexp, against float64."""
    g = torch.Generator().manual_seed(5)
    C = 1024
    N = 2 * lse_mod.BLOCK_ELEMENTS // C + 37  # three blocks of points, the last one short
    x, y, lw = torch.randn(3, 4, generator=g), torch.randn(N, 4, generator=g), torch.randn(N, C, generator=g)
    got = km.kernel_logsumexp(km.preset("laplace_l2"), x, y, lw, bandwidth=0.7)
    want = km.kernel_logsumexp(km.preset("laplace_l2"), x.double(), y.double(), lw.double(), bandwidth=0.7)
    assert got.shape == (3, C)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_duplicates_weights_of_minus_infinity_and_non_finite_points():
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(40, 3, generator=g) + 500, torch.randn(90, 3, generator=g) + 500
    y[:40] = x  # exact duplicates: distance 0, recomputed by direct differences
    w = torch.randn(90, generator=g)
    w[::3] = -float("inf")  # zero weights
    desc = km.preset("gaussian_l2")
    want = km.kernel_logsumexp(desc, x.double(), y.double(), w.double(), bandwidth=1e-2)
    torch.testing.assert_close(km.kernel_logsumexp(desc, x, y, w, bandwidth=1e-2).double(), want, rtol=1e-6, atol=0)
    allzero = torch.full((90,), -float("inf"))
    assert (km.kernel_logsumexp(desc, x, y, allzero, bandwidth=1.0) == -float("inf")).all()
    # an infinite coordinate: the float64 direct differences (exp(-inf) = 0 there, no NaN)
    yi = y.clone()
    yi[5, 1] = float("inf")
    got = km.kernel_logsumexp(desc, x, yi, w, bandwidth=1.0)
    assert torch.isfinite(got).all()
    want = km.kernel_logsumexp(desc, x.double(), yi.double(), w.double(), bandwidth=1.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    xn = x.clone()
    xn[3, 0] = float("nan")
    got = km.kernel_logsumexp(desc, xn, y, w, bandwidth=1.0)
    assert got[3].isnan() and torch.isfinite(got[torch.arange(40) != 3]).all()


def test_gradients_through_the_cpu_float32_path():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(30, 3, generator=g) + 100, torch.randn(50, 3, generator=g) + 100
    w = torch.randn(50, 2, generator=g)
    desc = km.preset("gaussian_l2")
    grads = []
    for dt in (torch.float32, torch.float64):
        args = [t.detach().to(dt).requires_grad_() for t in (x, y, w)]
        km.kernel_logsumexp(desc, *args, bandwidth=0.8).sum().backward()
        grads.append([a.grad.double() for a in args])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
