"""KMeans' CPU Lloyd steps (cluster._lloyd._NearestCpu, segment_sums' CPU branch): the labels and squared
distances of knn(X, centres, 1) in its float64 direct mode and the update's float64 sums, bitwise."""

import numpy as np
import pytest
import torch

from kermac_like.testing import kmeans_lloyd
from kermac_like.cluster import KMeans
from kermac_like.ops.knn import knn

DIRECT = "donot_use_mm_for_euclid_dist"


def _knn(X, c):
    v, i = knn(X, c, 1, compute_mode=DIRECT)
    return i[:, 0], v[:, 0].to(torch.float64).square()


def _cases(seed=0):
    g = torch.Generator().manual_seed(seed)
    blobs = (4 * torch.randn(12, 6, generator=g))[torch.randint(0, 12, (3000,), generator=g)]
    blobs += torch.randn(3000, 6, generator=g)
    yield "blobs16", blobs, blobs[:16].clone()  # centre-major block
    yield "blobs40", blobs + 100.0, blobs[:40].clone() + 100.0  # row-major, far from the origin
    ints = torch.randint(0, 3, (2000, 3), generator=g).float()
    yield "ties", ints, torch.randint(0, 3, (20, 3), generator=g).float() + 0.5  # equidistant centres
    dup = torch.randn(500, 4, generator=g)
    c = dup[:30].clone()
    c[1::2] = c[0::2]  # duplicate centres: the first index wins
    yield "duplicates", dup, c
    yield "one", blobs, blobs[:1].clone()
    yield "huge", blobs * 1e19, blobs[:5].clone() * 1e19  # |x|^2 overflows float32: every row exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nearest_is_knn(dtype, monkeypatch):
    for name, X, c in _cases():
        X, c = X.to(dtype), c.to(dtype)
        want_l, want_d2 = _knn(X, c)
        for block in (kmeans_lloyd.ASSIGN_BLOCK_ELEMENTS, 4099):  # one block; many, the last partial
            monkeypatch.setattr(kmeans_lloyd, "ASSIGN_BLOCK_ELEMENTS", block)
            near = kmeans_lloyd._NearestCpu(X)
            lab = near.labels(c)
            assert torch.equal(lab, want_l), (name, block)
            assert torch.equal(near.d2(c, lab), want_d2), (name, block)


def test_nearest_under_reduced_matmul_precision():
    """A float32 product torch may take in bfloat16/TF32: the product runs in float64 instead."""
    _, X, c = next(iter(_cases()))
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        near = kmeans_lloyd._NearestCpu(X)
        assert near.work == torch.float64
        assert torch.equal(near.labels(c), _knn(X, c)[0])
    finally:
        torch.set_float32_matmul_precision(old)


def _sorted_sums(X, labels, w, C):
    """The sort-and-segment_reduce oracle (segment_sums' CUDA layout) on the CPU."""
    keys, perm = torch.sort(labels, stable=True)
    lengths = torch.bincount(labels, minlength=C)
    xb = X[perm].double()
    if w is not None:
        wb = w[perm].double()
        xb = xb * wb[:, None]
        ws = torch.segment_reduce(wb, "sum", lengths=lengths)
    else:
        ws = lengths.double()
    return torch.segment_reduce(xb, "sum", lengths=lengths, axis=0), ws


@pytest.mark.parametrize("weighted", [False, True])
def test_segment_sums_cpu_is_the_ordered_sum(weighted):
    g = torch.Generator().manual_seed(1)
    X = torch.randn(5000, 7, generator=g) * 1e3
    labels = torch.randint(0, 23, (5000,), generator=g)
    labels[labels == 5] = 6  # an empty cluster
    w = torch.rand(5000, generator=g) if weighted else None
    want = _sorted_sums(X, labels, w, 23)
    for x64 in (None, X.double()):
        got = kmeans_lloyd.segment_sums(X, labels, w, 23, x64)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fit_leaves_float64_data_alone():
    X = torch.randn(400, 3, dtype=torch.float64)
    keep = X.clone()
    KMeans(5, random_state=0, n_init=1).fit(X)
    assert torch.equal(X, keep)


def test_fit_float32_numpy_matches_sklearn_labels():
    from sklearn.cluster import KMeans as SkKMeans

    rng = np.random.RandomState(2)
    X = (4 * rng.randn(8, 5)[rng.randint(0, 8, 2000)] + rng.randn(2000, 5)).astype(np.float32)
    init = X[:8].copy()
    ours = KMeans(8, init=init, n_init=1).fit(X)
    ref = SkKMeans(8, init=init, n_init=1, algorithm="lloyd").fit(X)
    assert np.array_equal(ours.labels_, ref.labels_) and ours.n_iter_ == ref.n_iter_
    assert np.allclose(ours.cluster_centers_, ref.cluster_centers_, rtol=1e-5, atol=1e-5)


def test_fit_leaves_the_thread_count_alone(monkeypatch):
    """A CPU fit does not call torch.set_num_threads (a change of the thread count leaves torch 2.13's
    batched CPU LU broken for the rest of the process: tests/test_linalg.py)."""
    import numpy as np
    import torch

    from kermac_like.cluster import KMeans

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    X = np.random.RandomState(0).randn(2000, 6).astype(np.float32)
    KMeans(8, n_init=1, random_state=0).fit(X)
    assert calls == []
