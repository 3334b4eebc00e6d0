"""The tensor-core top-k's exact rescoring and its certificate (kermac_like/plan/topk.py,
rescore), on the CPU: candidate lists made as topk_mma_kernel makes them (the sel first keys of
approximate values) from values perturbed by up to 0.9 of each pair's candidate_bound (its own
point's norm, as the TF32 products err). Whenever a row is
certified its k best are exactly the float32 direct-difference selection; rows whose margin is
too thin are reported, never returned wrong."""

import torch

from kermac_like.plan.topk import candidate_bound, rescore


def _case(dot: bool, largest: bool, seed: int, M=60, N=700, K=96, k=5, sel=16, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(8, K, generator=g)
    x = centres[torch.randint(0, 8, (M,), generator=g)] + spread * torch.randn(M, K, generator=g)
    y = centres[torch.randint(0, 8, (N,), generator=g)] + spread * torch.randn(N, K, generator=g)
    # float32, formed as rescore forms them (products or squared differences summed over K)
    exact = (x[:, None, :] * y[None, :, :]).sum(-1) if dot else (x[:, None, :] - y[None, :, :]).square().sum(-1)
    y[:N // 50] *= 40  # a few far points (a heavy tail): the bound's window leaves them out
    exact = (x[:, None, :] * y[None, :, :]).sum(-1) if dot else (x[:, None, :] - y[None, :, :]).square().sum(-1)
    yn = torch.linalg.vector_norm(y, dim=1)
    ynorm = yn.max()
    xn = torch.linalg.vector_norm(x, dim=1)
    b = candidate_bound(xn[:, None], yn[None, :], exact, K, dot)  # each pair's TF32 error bound
    approx = exact + 0.9 * b * (2 * torch.rand(M, N, generator=g) - 1)
    order = torch.sort(approx, dim=1, descending=largest, stable=True).indices  # ties by index
    idx = order[:, :sel]
    last = approx.gather(1, idx[:, -1:]).squeeze(1)
    pad = torch.zeros_like(idx, dtype=torch.bool)
    v, i, ok = rescore(x, y, idx, pad, last, ynorm, k, dot=dot, largest=largest)
    want = torch.sort(exact, dim=1, descending=largest, stable=True).indices[:, :k]
    return v, i, ok, want, exact


def test_certified_rows_are_exact():
    seen_ok = seen_bad = 0
    for dot in (False, True):
        for largest in (False, True):
            for seed, spread in ((0, 1.0), (1, 0.05), (2, 0.01)):
                v, i, ok, want, exact = _case(dot, largest, seed, spread=spread)
                assert torch.equal(i[ok], want[ok])
                assert torch.equal(v[ok], exact.gather(1, want)[ok])
                seen_ok += int(ok.sum())
                seen_bad += int((~ok).sum())
    assert seen_ok > 0 and seen_bad > 0  # both outcomes exercised (tight clusters: thin margins)


def test_padded_lists_are_certified():
    """Fewer points than candidates (N < kSel): every point is a candidate, nothing to certify."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 70, generator=g), torch.randn(6, 70, generator=g)
    idx = torch.cat([torch.arange(6).expand(4, 6), torch.full((4, 2), 5)], 1)
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[:, 6:] = True
    v, i, ok = rescore(x, y, idx, pad, torch.zeros(4), torch.tensor(1.0), 3, dot=False, largest=False)
    want = torch.cdist(x, y, compute_mode="donot_use_mm_for_euclid_dist").topk(3, largest=False).indices
    assert ok.all() and torch.equal(i, want)


def test_window_certifies_rows_a_far_point_would_not():
    """Squared distances, smallest first: a far point (norm 1000 x the others') widens the bound
    of every row when the bound takes the largest norm; the window |x| + sqrt(kth) leaves it out,
    so the rows certify, and their k best are still the float32 selection."""
    g = torch.Generator().manual_seed(7)
    M, N, K, k, sel = 30, 400, 64, 5, 16
    y = torch.randn(N, K, generator=g)
    y[-1] *= 1000.0
    x = y[:M] + 0.3 * torch.randn(M, K, generator=g)
    exact = (x[:, None, :] - y[None, :, :]).square().sum(-1)
    yn = torch.linalg.vector_norm(y, dim=1)
    xn = torch.linalg.vector_norm(x, dim=1)
    approx = exact + 0.9 * candidate_bound(xn[:, None], yn[None, :], exact, K, False) * (
        2 * torch.rand(M, N, generator=g) - 1)
    idx = torch.sort(approx, dim=1, stable=True).indices[:, :sel]
    last = approx.gather(1, idx[:, -1:]).squeeze(1)
    pad = torch.zeros_like(idx, dtype=torch.bool)
    v, i, ok = rescore(x, y, idx, pad, last, yn.max(), k, dot=False, largest=False)
    want = torch.sort(exact, dim=1, stable=True).indices[:, :k]
    assert torch.equal(i[ok], want[ok])
    wide = candidate_bound(xn, yn.max(), last, K, False)  # without the window
    assert int(ok.sum()) >= M - 2 and not bool((v[:, -1] < last - wide).any())
