"""kernel_logsumexp on CUDA tensors (marker ``gpu``; skipped without CUDA): float32 against
float64, the underflowing bandwidth, bitwise reproducibility, a 10^5-point call."""

import pytest
import torch

import kermac_like as km

pytestmark = pytest.mark.gpu


def test_float32_against_float64_including_underflow():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(300, 3, generator=g), torch.randn(4000, 3, generator=g)
    lw = torch.randn(4000, 2, generator=g)
    for bw in (1.0, 1e-3):
        got = km.kernel_logsumexp(km.preset("gaussian_l2"), x.cuda(), y.cuda(), lw.cuda(), bandwidth=bw).double().cpu()
        d2 = ((x.double()[:, None] - y.double()[None]) ** 2).sum(-1)
        want = torch.logsumexp(-d2[..., None] / (2 * bw * bw) + lw.double()[None], dim=1)
        assert ((got - want).abs() / want.abs().clamp_min(1)).max() < 1e-5


def test_bitwise_reproducible_and_large():
    x, y = torch.randn(100000, 3, device="cuda"), torch.randn(100000, 3, device="cuda")
    a = km.kernel_logsumexp(km.preset("laplace_l2"), x, y, bandwidth=0.1)
    b = km.kernel_logsumexp(km.preset("laplace_l2"), x, y, bandwidth=0.1)
    assert torch.equal(a, b) and torch.isfinite(a).all()


def _blocked(desc, x, y, lw, **hyp):
    """The blocked path in float64 (the oracle of the fused kernel)."""
    return km.kernel_logsumexp(desc, x.double(), y.double(), lw.double(), **hyp)


def test_fused_kernel_serves_and_matches_float64():
    from kermac_like.ops.distance import prepare_call
    from kermac_like.plan.logsumexp import fused_serves

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 700, 3, generator=g).cuda(), torch.randn(2, 5000, 3, generator=g).cuda()
    lw = torch.randn(2, 5000, 11, generator=g).cuda()  # column chunks of 8 and 3
    lw[:, :, 0] = -float("inf")
    call = prepare_call(km.preset("gaussian_l2"), x, y, bandwidth=0.3, names=("x", "y"))
    assert fused_serves(call, lw)
    for desc, bw in (("gaussian_l2", 0.3), ("gaussian_l2", 1e-3), ("laplace_l2", 1e-3), ("laplace_l1", 0.5)):
        got = km.kernel_logsumexp(km.preset(desc), x, y, lw, bandwidth=bw).double()
        want = _blocked(km.preset(desc), x, y, lw, bandwidth=bw)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)) and (got[~fin] == want[~fin]).all()
        err = ((got - want).abs() / want.abs().clamp_min(1))[fin]
        assert err.max() < 1e-5, (desc, bw, err.max().item())
    for dt in (torch.float16, torch.bfloat16):  # 16-bit inputs, float32 sums, rounded once
        xh, yh, lh = x.to(dt), y.to(dt), lw[..., 1:].to(dt)
        got = km.kernel_logsumexp(km.preset("gaussian_l2"), xh, yh, lh, bandwidth=0.3)
        want = _blocked(km.preset("gaussian_l2"), xh, yh, lh, bandwidth=0.3)
        assert got.dtype == dt and torch.allclose(got.double(), want.to(dt).double(), rtol=1e-2, atol=1e-2)


def test_fused_split_ranges_bitwise_reproducible():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(50, 3, generator=g).cuda(), torch.randn(300000, 3, generator=g).cuda()  # few rows: N splits
    lw = torch.randn(300000, generator=g).cuda()
    a = km.kernel_logsumexp(km.preset("gaussian_l2"), x, y, lw, bandwidth=1e-3)
    b = km.kernel_logsumexp(km.preset("gaussian_l2"), x, y, lw, bandwidth=1e-3)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    want = _blocked(km.preset("gaussian_l2"), x, y, lw, bandwidth=1e-3)
    assert ((a.double() - want).abs() / want.abs().clamp_min(1)).max() < 1e-5


def test_fused_million_points_smoke():
    x, y = torch.rand(10 ** 6, 3, device="cuda"), torch.rand(10 ** 6, 3, device="cuda")
    out = km.kernel_logsumexp(km.preset("gaussian_l2"), x, y, bandwidth=1e-3)
    torch.cuda.synchronize()
    assert out.shape == (10 ** 6,) and torch.isfinite(out).all()
    # the nearest point dominates at this bandwidth: out >= -phi(nearest) and <= log N
    assert (out <= torch.log(torch.tensor(1e6))).all()


def test_expanded_exponent_against_float64():
    """kVariant 3 (the expanded exponent) where the planner's bound allows it: randn D = 3 and 8 at
    bandwidths 1.0 and 3.0 (Gaussian of l2, Laplace of squared l2), an infinite row, a NaN point,
    -inf weights; the same bits twice; KERMAC_LIKE_LSE_EXPAND's direct kernel beside it."""
    import dataclasses

    from kermac_like.descriptor import KernelType
    from kermac_like.config import override
    from kermac_like.plan.logsumexp import expand_params

    g = torch.Generator().manual_seed(3)
    lap2 = dataclasses.replace(km.preset("squared_l2"), kernel_type=KernelType.LAPLACE)
    for K in (3, 8):
        x, y = torch.randn(3000, K, generator=g).cuda(), torch.randn(200000, K, generator=g).cuda()
        lw = torch.randn(200000, generator=g).cuda()
        lw[::7] = -float("inf")
        x[1700, 0] = float("inf")
        y[123, 1] = float("nan")
        for desc, bw in ((km.preset("gaussian_l2"), 1.0), (km.preset("gaussian_l2"), 3.0), (lap2, 3.0)):
            assert expand_params(desc, x, y, bw)[0].item() == 1.0
            got = km.kernel_logsumexp(desc, x, y, lw, bandwidth=bw)
            again = km.kernel_logsumexp(desc, x, y, lw, bandwidth=bw)
            assert torch.equal(got.view(torch.int32), again.view(torch.int32))
            want = _blocked(desc, x, y, lw, bandwidth=bw)
            assert torch.isnan(want).all() and torch.isnan(got).all()  # the NaN point
            y2 = y.clone()
            y2[123, 1] = 0.0
            got = km.kernel_logsumexp(desc, x, y2, lw, bandwidth=bw).double()
            want = _blocked(desc, x, y2, lw, bandwidth=bw)
            fin = torch.isfinite(want)
            assert not fin[1700] and torch.equal(fin, torch.isfinite(got)) and fin.sum() == 2999
            err = ((got - want).abs() / want.abs().clamp_min(1))[fin].max().item()
            assert err < 1e-5, (K, desc, bw, err)
            with override(lse_expand=False):
                direct = km.kernel_logsumexp(desc, x, y2, lw, bandwidth=bw).double()
            assert ((direct - want).abs() / want.abs().clamp_min(1))[fin].max() < 1e-5
