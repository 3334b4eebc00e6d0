"""kernel_logsumexp on the CPU against float64 torch.logsumexp of the dense matrix: every
epilogue kind, weights per column, batches with tensor bandwidths, bandwidths so small that the
kernel underflows, gradcheck (a zero-distance pair included), out= and bad input."""

import pytest
import torch

import kermac_like as km

F64 = torch.float64


def dense(desc, x, y, lw, **kw):
    k = km.run_kernel(desc, x.double(), y.double(), compute_mode="donot_use_mm_for_euclid_dist",
                      **{n: (v.double() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()})
    return torch.logsumexp(torch.log(k).unsqueeze(-1) + lw.double().unsqueeze(-3), dim=-2)


@pytest.mark.parametrize("name,p", [("laplace_l2", None), ("gaussian_l2", None), ("laplace_l1", None),
                                    ("laplace_p", 1.5)])
def test_matches_the_dense_float64(name, p):
    g = torch.Generator().manual_seed(1)
    x, y, lw = torch.randn(23, 4, generator=g), torch.randn(310, 4, generator=g), torch.randn(310, 3, generator=g)
    kw = dict(bandwidth=0.8) | ({"p": p} if p else {})
    got = km.kernel_logsumexp(km.preset(name), x, y, lw, **kw)
    assert got.dtype == torch.float32 and got.shape == (23, 3)
    torch.testing.assert_close(got.double(), dense(km.preset(name), x, y, lw, **kw), rtol=1e-6, atol=1e-6)
    vec = km.kernel_logsumexp(km.preset(name), x, y, lw[:, 0], **kw)  # (N,) weights: (M,) out
    torch.testing.assert_close(vec, got[:, 0], rtol=1e-6, atol=1e-6)


def test_underflowing_kernel_stays_finite():
    """bandwidth 1e-3: exp(-phi) is 0 in float32 for every pair; the log-sum is not."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(40, 3, generator=g), torch.randn(500, 3, generator=g)
    assert (km.run_kernel(km.preset("gaussian_l2"), x, y, bandwidth=1e-3) == 0).float().mean() > 0.99
    got = km.kernel_logsumexp(km.preset("gaussian_l2"), x, y, bandwidth=1e-3).double()
    d2 = ((x.double()[:, None] - y.double()[None]) ** 2).sum(-1)
    want = torch.logsumexp(-d2 / 2e-6, dim=1)
    assert torch.isfinite(got).all()
    assert ((got - want).abs() / want.abs().clamp_min(1)).max() < 1e-5


def test_batches_broadcast_with_tensor_bandwidths():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 1, 9, 3, generator=g, dtype=F64), torch.randn(3, 40, 3, generator=g, dtype=F64)
    lw = torch.randn(40, 2, generator=g, dtype=F64)
    bw = torch.rand(2, 3, generator=g, dtype=F64) + 0.5
    got = km.kernel_logsumexp(km.preset("laplace_l2"), x, y, lw, bandwidth=bw)
    assert got.shape == (2, 3, 9, 2)
    torch.testing.assert_close(got, dense(km.preset("laplace_l2"), x, y, lw, bandwidth=bw), rtol=1e-12, atol=1e-12)


def test_gradcheck_including_a_zero_distance_pair():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, generator=g, dtype=F64)
    y = torch.randn(6, 3, generator=g, dtype=F64)
    y[2] = x[1]  # a pair at distance 0: zero gradient there, as cdist's autograd
    lw = torch.randn(6, 2, generator=g, dtype=F64)
    for name in ("laplace_l2", "gaussian_l2"):
        d = km.preset(name)
        args = (x.clone().requires_grad_(), y.clone().requires_grad_(), lw.clone().requires_grad_())
        if name == "gaussian_l2":
            assert torch.autograd.gradcheck(lambda a, b, c: km.kernel_logsumexp(d, a, b, c, bandwidth=0.9), args)
        else:  # |x - y| is not differentiable at 0: check the other entries and the finite zero-pair value
            out = km.kernel_logsumexp(d, *args, bandwidth=0.9)
            out.sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in args)
    shifted = (x + 0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: km.kernel_logsumexp(km.preset("laplace_l2"), a, y, lw, bandwidth=0.9),
                                    (shifted,))


def test_out_and_bad_input_leave_out_untouched():
    x, y = torch.randn(4, 3), torch.randn(7, 3)
    out = torch.full((4,), 7.0)
    assert km.kernel_logsumexp(km.preset("laplace_l2"), x, y, bandwidth=1.0, out=out) is out
    torch.testing.assert_close(out, km.kernel_logsumexp(km.preset("laplace_l2"), x, y, bandwidth=1.0))
    sentinel = torch.full((4,), 7.0)
    bad = [
        (ValueError, "descriptor", dict(descriptor=km.preset("l2"))),
        (ValueError, "log_weights", dict(log_weights=torch.randn(6))),
        (TypeError, "log_weights", dict(log_weights=torch.randn(7, dtype=F64))),
        (ValueError, "bandwidth", dict(bandwidth=-1.0)),
        (ValueError, "out", dict(out=torch.empty(5))),
    ]
    for err, name, kw in bad:
        kw = dict(dict(descriptor=km.preset("laplace_l2"), bandwidth=1.0, out=sentinel), **kw)
        desc = kw.pop("descriptor")
        with pytest.raises(err, match=name):
            km.kernel_logsumexp(desc, x, y, **kw)
        assert (sentinel == 7.0).all()
