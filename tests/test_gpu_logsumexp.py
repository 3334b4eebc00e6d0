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
