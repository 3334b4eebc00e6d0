"""bench/datasets.py's data families (issue 42) and the robustness workload's error measures of
bench/run.py, on the CPU at small sizes."""

import math
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is no package: its modules import as bench.<name> from the checkout
    sys.path.insert(0, str(ROOT))

from bench import datasets  # noqa: E402

SYNTHETIC = [f for f in datasets.FAMILIES if f not in datasets.SKLEARN]
needs_sklearn = pytest.mark.skipif("digits" not in datasets.available(), reason="needs scikit-learn")
ALL = SYNTHETIC + [pytest.param(f, marks=needs_sklearn) for f in datasets.SKLEARN]


@pytest.mark.parametrize("name", ALL)
def test_family_shape_dtype_finite_deterministic(name):
    x = datasets.make(name, 300, 6, seed=3)
    assert x.shape == (300, 6) and x.dtype == torch.float32 and x.is_contiguous()
    assert torch.isfinite(x).all()
    assert torch.equal(x, datasets.make(name, 300, 6, seed=3))  # the same bits
    assert not torch.equal(x, datasets.make(name, 300, 6, seed=4))
    x64 = datasets.make(name, 300, 6, seed=3, dtype=torch.float64)
    assert x64.dtype == torch.float64 and torch.isfinite(x64).all()
    for n, d in ((1, 1), (1, 5), (7, 1), (2, 9)):  # any n >= 1, d >= 1
        for dtype in (torch.float32, torch.float16):
            t = datasets.make(name, n, d, seed=1, dtype=dtype)
            assert t.shape == (n, d) and t.dtype == dtype and torch.isfinite(t).all(), (n, d, dtype)
    for near in (False, True):
        q, p = datasets.pair(name, 5, 40, 3, seed=2, near=near)
        assert q.shape == (5, 3) and p.shape == (40, 3) and torch.isfinite(q).all() and torch.isfinite(p).all()
        q2, p2 = datasets.pair(name, 5, 40, 3, seed=2, near=near)
        assert torch.equal(q, q2) and torch.equal(p, p2)


def test_gaussian_is_the_benchmarks_randn():
    """The data bench/run.py drew before --data: torch.randn from its generator, x then y."""
    g = torch.Generator().manual_seed(7)
    want = [torch.randn(33, 5, generator=g), torch.randn(17, 5, generator=g), torch.randn(4, 5, generator=g)]
    g = torch.Generator().manual_seed(7)
    x, y = datasets.pair("gaussian", 33, 17, 5, generator=g)
    z = datasets.make("gaussian", 4, 5, generator=g)
    assert torch.equal(x, want[0]) and torch.equal(y, want[1]) and torch.equal(z, want[2])
    seeded = torch.randn(8, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(datasets.make("gaussian", 8, 3, seed=5), seeded)


@pytest.mark.parametrize("offset", [10, 100, 1000])
def test_shifted_mean_is_the_offset(offset):
    x = datasets.make(f"shifted{offset}", 2000, 4).double()
    assert (x.mean(0) - offset).abs().max() < 0.2
    assert (x.std(0) - 1).abs().max() < 0.1


def test_non_negative_families():
    relu, uni = datasets.make("relu", 2000, 5), datasets.make("uniform", 2000, 5)
    assert relu.min() == 0 and 0.45 < (relu == 0).double().mean() < 0.55
    assert uni.min() >= 0 and uni.max() < 1 and abs(uni.double().mean() - 0.5) < 0.02


def test_pixels_zeros_ties_duplicates():
    x = datasets.make("pixels", 500, 32)
    assert x.min() >= 0 and x.max() <= 255 and torch.equal(x, x.round())
    assert (x == 0).double().mean() > 0.6
    assert torch.unique(x, dim=0).shape[0] <= 455  # 10 % of the rows repeat others


def test_onehot_binary_rows_with_duplicates():
    d = 42  # 10 groups of 4 columns and one of 2, one 1 in each: 4^10 * 2 codes
    x = datasets.make("onehot", 400, d)
    assert set(x.unique().tolist()) == {0.0, 1.0}
    assert torch.equal(x.sum(1), torch.full((400,), float(math.ceil(d / 4))))
    assert torch.equal(x[:, 40:].sum(1), torch.ones(400))
    assert torch.unique(x, dim=0).shape[0] <= 100  # 3 in 4 rows repeat others


def test_anisotropic_column_scales():
    std = datasets.make("anisotropic", 2000, 8).double().std(0)
    assert std.max() / std.min() > 1e4


def test_lowrank_rank():
    x = datasets.make("lowrank", 200, 20, dtype=torch.float64)
    assert torch.linalg.matrix_rank(x).item() <= 4
    assert torch.linalg.matrix_rank(datasets.make("gaussian", 200, 20, dtype=torch.float64)).item() == 20


def test_blobs():
    tight = datasets.make("blobs_tight", 2000, 3, dtype=torch.float64)
    d = torch.cdist(tight, tight).fill_diagonal_(float("inf"))
    assert d.min(1).values.median() < 1e-2 * d[d.isfinite()].median()  # neighbours within a blob
    wide = datasets.make("blobs_wide", 4000, 3, dtype=torch.float64)
    assert wide.std(0).min() > 2  # unit-spread blobs, centres 4 apart per coordinate


def test_student_t_heavy_tails():
    x = datasets.make("student_t", 2000, 4)
    assert x.abs().max() > 30 and x.abs().median() < 1.5  # gaussian's largest of 8000 is ~4.5


@needs_sklearn
def test_sklearn_rows_and_columns():
    from sklearn.datasets import load_wine

    data = torch.from_numpy(load_wine().data).float()
    assert datasets.native_shape("wine") == tuple(data.shape) and datasets.native_shape("relu") is None
    x = datasets.make("wine", 178, 13)  # the set (no two rows equal), rows in a random order
    assert torch.equal(torch.unique(x, dim=0), torch.unique(data, dim=0)) and not torch.equal(x, data)
    big = datasets.make("wine", 400, 30)  # rows: 2 passes and 44 rows, columns tiled
    assert torch.equal(big[:, 13:26], big[:, :13]) and torch.equal(big[:, 26:], big[:, :4])
    counts = torch.unique(big, dim=0, return_counts=True)[1]
    assert counts.shape[0] == 178 and counts.min() == 2 and counts.max() == 3
    assert torch.equal(datasets.make("wine", 9, 2), datasets.make("wine", 9, 13)[:, :2])


def test_near_pair():
    x, y = datasets.pair("shifted100", 50, 200, 8, near=True)
    nearest = torch.cdist(x.double(), y.double()).min(1).values
    assert nearest.max() < 1e-2 and nearest.min() > 0  # perturbed points of y
    x, y = datasets.pair("shifted100", 50, 200, 8)  # drawn apart
    assert torch.cdist(x.double(), y.double()).min(1).values.min() > 0.5


@pytest.mark.parametrize("call, arg", [
    (lambda: datasets.make("nope", 3, 2), "name"),
    (lambda: datasets.make(None, 3, 2), "name"),
    (lambda: datasets.make("relu", 0, 2), "n"),
    (lambda: datasets.make("relu", 2.0, 2), "n"),
    (lambda: datasets.make("relu", True, 2), "n"),
    (lambda: datasets.make("relu", 3, -1), "d"),
    (lambda: datasets.make("relu", 3, False), "d"),
    (lambda: datasets.make("relu", 3, 2, dtype=torch.int32), "dtype"),
    (lambda: datasets.pair("relu", 0, 3, 2), "m"),
    (lambda: datasets.pair("relu", 2, "3", 2), "n"),
    (lambda: datasets.native_shape("nope"), "name"),
])
def test_bad_arguments(call, arg):
    with pytest.raises(ValueError, match=rf"^{arg}: "):
        call()


def test_robustness_error_measures():
    """bench/run.py's max_rel and knn_quality: floors, and indices matched up to ties."""
    from bench.run import TINY, knn_quality, max_rel

    ref = torch.tensor([[0.0, 2.0, 1e-7]], dtype=torch.float64)
    assert max_rel(torch.tensor([[0.0, 2.0, 0.0]]), ref, 1e-5) == pytest.approx(1e-2)
    assert max_rel(torch.tensor([[1e-30, 2.0, 1e-7]]), ref, TINY) > 1e7  # a zero distance that is not 0
    d64 = torch.tensor([[0.5, 1.0, 1.0, 3.0], [2.0, 0.0, 1.0, 1.0 + 1e-7]], dtype=torch.float64)
    v = d64.gather(1, torch.tensor([[0, 2], [1, 3]])).float()
    err, recall, match = knn_quality(v, torch.tensor([[0, 2], [1, 3]]), d64, 2)  # tie-mates of float64's picks
    assert err < 1e-7 and recall == 0.5 and match == 1.0
    assert knn_quality(v, torch.tensor([[0, 3], [1, 2]]), d64, 2)[2] == 0.5  # 3.0 is no tie of 1.0
    assert knn_quality(v, torch.tensor([[0, 0], [1, 2]]), d64, 2)[2] == 0.5  # the same point twice


def test_robust_sizes():
    from bench.run import FULL, robust_sizes

    s = robust_sizes(FULL["robustness"], "relu", 0.01)
    assert s["knn_d3"] == (1, 1000, 1000, 3, 10, 2.0) and s["cdist"] == (300, 300, 1024)
    assert s["kmeans"] == (10000, 16, 256, 20) and s["falkon"] == (1000, 8, 1000)
    tiny = robust_sizes(FULL["robustness"], "relu", 1e-9)
    assert tiny["knn_d3"][1:5] == (1, 1, 3, 1) and tiny["kmeans"][:3] == (1, 16, 1)
    if "wine" in datasets.available():
        w = robust_sizes(FULL["robustness"], "wine", 0.01)  # a set's own size, whatever the scale
        assert w["knn_d128"] == (1, 178, 178, 13, 10, 2.0) and w["kmeans"] == (178, 13, 11, 20)
        assert w["falkon"] == (178, 13, 89)
