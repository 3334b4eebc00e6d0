"""kernel_topk and knn on the CPU (the blocked path): exact against the float64 oracle
(tests/knn_oracle.py) on fresh random data, ties, NaN, every p, batches, tensor
hyper-parameters, out=, bad input, gradients. GPU tests: tests/test_gpu_knn.py."""

import math

import pytest
import torch

import kermac_like as km
from kermac_like.ops import knn as knn_mod
from knn_oracle import assert_acceptable, assert_exact, oracle_topk

P_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf)
EXACT = "donot_use_mm_for_euclid_dist"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _data(M, N, K, seed, dtype=torch.float32, batch=()):
    g = _gen(seed)
    x = torch.randn(*batch, M, K, generator=g, dtype=torch.float64)
    y = torch.randn(*batch, N, K, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def _poisoned(shape, dtype=torch.float32):
    return torch.full(shape, 12345.0, dtype=dtype), torch.full(shape, -7, dtype=torch.int64)


@pytest.mark.parametrize("p", P_VALUES)
@pytest.mark.parametrize("largest", [False, True])
def test_knn_every_p_exact(p, largest):
    x, y = _data(23, 157, 5, seed=int(10 * (p if p < 10 else 9)) + largest)
    y[9] = y[2]  # exact ties
    y[140] = y[2]
    y[40] = x[3]  # a zero distance
    out = _poisoned((23, 8))
    v, i = km.knn(x, y, 8, p=p, largest=largest, out=out, compute_mode=EXACT)
    assert v is out[0] and i is out[1]
    dense = torch.cdist(x.double(), y.double(), p=p, compute_mode=EXACT)
    assert_exact(v, i, dense, 8, largest)


def test_knn_matrix_product_mode_follows_torch():
    """p = 2 with the default compute mode on more than 25 rows: torch.cdist's product formula."""
    x, y = _data(40, 90, 6, seed=1, dtype=torch.float64)
    v, i = km.knn(x, y, 5)
    assert_exact(v, i, torch.cdist(x, y), 5, False)
    assert_acceptable(v, i, torch.cdist(x, y, compute_mode=EXACT), 5, False, value_rtol=1e-12)


def test_blocks_merge_exactly_with_many_ties(monkeypatch):
    """Small blocks (every merge exercised) on integer points: distances tie everywhere."""
    monkeypatch.setattr(knn_mod, "MIN_BLOCK_COLUMNS", 16)
    g = _gen(3)
    x = torch.randint(0, 3, (37, 2), generator=g).double()
    y = torch.randint(0, 3, (203, 2), generator=g).double()
    for largest in (False, True):
        for k in (1, 5, 16, 40):
            call = knn_mod.prepare_knn(x, y, k, p=1.0, largest=largest)
            v, i = torch.empty(37, k, dtype=torch.float64), torch.empty(37, k, dtype=torch.int64)
            knn_mod.topk_blocked(call, v, i, block_elements=64)
            assert_exact(v, i, torch.cdist(x, y, p=1.0), k, largest)


def test_blocks_stay_within_their_budget(monkeypatch):
    seen = []
    block_values = knn_mod._block_values

    def spy(call, xb, yb, m0, n0, work):
        out = block_values(call, xb, yb, m0, n0, work)
        seen.append(out.numel())
        return out

    monkeypatch.setattr(knn_mod, "_block_values", spy)
    monkeypatch.setattr(knn_mod, "MIN_BLOCK_COLUMNS", 16)
    x, y = _data(50, 300, 3, seed=15, batch=(2,))
    call = knn_mod.prepare_knn(x, y, 5, p=1.0)
    v, i = torch.empty(2, 50, 5), torch.empty(2, 50, 5, dtype=torch.int64)
    knn_mod.topk_blocked(call, v, i, block_elements=1000)
    assert len(seen) > 10 and max(seen) <= 1000
    assert_exact(v, i, torch.cdist(x.double(), y.double(), p=1.0), 5, False)


@pytest.mark.parametrize("largest", [False, True])
def test_nan_rows_ordered_as_torch_topk(largest, monkeypatch):
    monkeypatch.setattr(knn_mod, "MIN_BLOCK_COLUMNS", 16)
    x, y = _data(9, 61, 3, seed=4)
    x[2, 1] = float("nan")  # a row of NaN distances
    y[5, 0] = float("nan")  # a NaN column
    y[33, 2] = float("nan")
    for k in (3, 60):
        call = knn_mod.prepare_knn(x, y, k, p=2.0, largest=largest, compute_mode=EXACT)
        v, i = torch.empty(9, k), torch.empty(9, k, dtype=torch.int64)
        knn_mod.topk_blocked(call, v, i, block_elements=100)
        dense = torch.cdist(x.double(), y.double(), compute_mode=EXACT)
        rows = [r for r in range(9) if r != 2]
        assert_exact(v[rows], i[rows], dense[rows], k, largest)
        # the same values as torch.topk (which orders NaN the same way, ties aside)
        tv = torch.topk(dense, k, largest=largest).values
        assert torch.equal(v.double().isnan(), tv.isnan())
        # a query row with a NaN coordinate (all its distances NaN): torch.topk's own indices of it
        assert torch.equal(i[2], torch.topk(dense[2], k, largest=largest).indices)


def test_batches_broadcast_and_tensor_bandwidth():
    g = _gen(5)
    x = torch.randn(2, 1, 11, 4, generator=g)
    y = torch.randn(3, 47, 4, generator=g)
    bw = torch.tensor([0.5, 1.0, 3.0])
    desc = km.preset("laplace_l2")
    v, i = km.kernel_topk(desc, x, y, 6, bandwidth=bw)
    assert v.shape == i.shape == (2, 3, 11, 6)
    dense = km.run_kernel(desc, x.double(), y.double(), bandwidth=bw.double())
    assert_exact(v, i, dense, 6, True)
    v2, i2 = km.knn(x, y, 4, p=1.0)
    assert_exact(v2, i2, torch.cdist(x.double(), y.double(), p=1.0), 4, False)


@pytest.mark.parametrize("name,kw", [
    ("laplace_l1", dict(bandwidth=1.5)), ("laplace_l2", dict(bandwidth=0.7)), ("gaussian_l2", dict(bandwidth=1.2)),
    ("laplace_p", dict(bandwidth=2.0, p=1.3)), ("dot", {}), ("squared_l2", {}), ("p_norm", dict(p=0.7)),
    ("gaussian_l2", dict(bandwidth=1.0, regularization=0.3, regularization_offset_y=2)),
    ("l2", dict(epsilon=1.4)),
])
def test_kernel_topk_presets(name, kw):
    desc = km.preset(name)
    x, y = _data(19, 83, 6, seed=len(name) + len(kw))
    y[7] = y[1]
    default_largest = name in ("laplace_l1", "laplace_l2", "gaussian_l2", "laplace_p", "dot")
    for largest in (None, not default_largest):
        want_largest = default_largest if largest is None else largest
        out = _poisoned((19, 9))
        v, i = km.kernel_topk(desc, x, y, 9, largest=largest, out=out, **kw)
        dense = km.run_kernel(desc, x.double(), y.double(), **kw)
        assert_exact(v, i, dense, 9, want_largest)


def test_blocks_through_the_package_ops(monkeypatch):
    """The GPU's way of computing blocks (run_kernel / cdist with the regularised diagonal moved
    to each block), here on float64 CPU tensors."""
    monkeypatch.setattr(knn_mod, "_torch_blocks", lambda call: False)
    monkeypatch.setattr(knn_mod, "MIN_BLOCK_COLUMNS", 16)
    x, y = _data(40, 90, 3, seed=16, dtype=torch.float64)
    desc = km.preset("gaussian_l2")
    kw = dict(bandwidth=0.8, regularization=3.0, regularization_offset_x=5, regularization_offset_y=2)
    call = knn_mod.prepare_topk(desc, x, y, 4, **kw)
    v, i = torch.empty(40, 4, dtype=torch.float64), torch.empty(40, 4, dtype=torch.int64)
    knn_mod.topk_blocked(call, v, i, block_elements=300)
    assert_exact(v, i, km.run_kernel(desc, x, y, compute_mode="donot_use_mm_for_euclid_dist", **kw), 4, True)
    call = knn_mod.prepare_knn(x, y, 6, p=math.inf)
    v2, i2 = torch.empty(40, 6, dtype=torch.float64), torch.empty(40, 6, dtype=torch.int64)
    knn_mod.topk_blocked(call, v2, i2, block_elements=300)
    assert_exact(v2, i2, torch.cdist(x, y, p=math.inf), 6, False)


def test_tensor_hyper_parameters_over_batch():
    x, y = _data(7, 30, 3, seed=6, batch=(4,))
    p = torch.tensor([0.8, 1.0, 1.7, 2.5])
    reg = torch.tensor([0.0, 5.0, 0.1, 1.0])
    desc = km.preset("laplace_p")
    v, i = km.kernel_topk(desc, x, y, 5, p=p, bandwidth=1.0, regularization=reg)
    dense = km.run_kernel(desc, x.double(), y.double(), p=p.double(), bandwidth=1.0, regularization=reg.double())
    assert_exact(v, i, dense, 5, True)


def test_float64_and_16bit_inputs():
    for dt in (torch.float64, torch.bfloat16, torch.float16):
        x, y = _data(12, 50, 4, seed=7, dtype=dt)
        v, i = km.knn(x, y, 3)
        assert v.dtype == dt and i.dtype == torch.int64
        assert_exact(v, i, torch.cdist(x.double(), y.double()), 3, False)


def _bad_cases():
    x, y = _data(6, 20, 3, seed=8)
    ok = lambda: _poisoned((6, 4))  # noqa: E731
    return [
        (dict(k=0), ValueError, "^k: expected 1 <= k <= 20"),
        (dict(k=21), ValueError, "^k: expected 1 <= k <= 20"),
        (dict(k=2.0), TypeError, "^k: expected an integer"),
        (dict(y=y[:, :2]), ValueError, "^y: last dimension 2 differs from x's 3"),
        (dict(x=x.expand(2, 6, 3), y=y.expand(3, 20, 3)), ValueError, "^y: batch shape"),
        (dict(y=y.double()), TypeError, "^y: dtype torch.float64 differs"),
        (dict(y=y.to("meta")), ValueError, "^y: device meta differs"),
        (dict(x=x.int()), TypeError, "^x: expected a floating tensor"),
        (dict(largest=1), TypeError, "^largest: expected a bool"),
        (dict(p=-1.0), ValueError, "^p: must be >= 0"),
        (dict(p=torch.tensor(1.0)), TypeError, "^p: knn takes a real number"),
        (dict(compute_mode="mm"), ValueError, "^compute_mode:"),
        (dict(out=ok()[0]), TypeError, "^out: expected a pair"),
        (dict(out=(ok()[0], ok()[1], None)), TypeError, "^out: expected a pair"),
        (dict(out=(torch.zeros(6, 5), ok()[1])), ValueError, r"^out\[0\]: expected shape \(6, 4\)"),
        (dict(out=(ok()[0].double(), ok()[1])), TypeError, r"^out\[0\]: expected dtype torch.float32"),
        (dict(out=(ok()[0], ok()[1].int())), TypeError, r"^out\[1\]: expected dtype torch.int64"),
        (dict(out=(torch.zeros(4, 6).mT, torch.zeros(6, 4, dtype=torch.int64)[:, :1].expand(6, 4))), ValueError,
         r"^out\[1\]: strides \(4, 0\) have no unit-stride"),
    ]


@pytest.mark.parametrize("case", range(18))
def test_bad_input_leaves_out_untouched(case):
    x, y = _data(6, 20, 3, seed=8)
    kw, exc, match = _bad_cases()[case]
    args = dict(x=x, y=y, k=4)
    args.update(kw)
    out = args.pop("out", None)
    keep = _poisoned((6, 4))
    if out is None:
        out = keep
    given = out if isinstance(out, (tuple, list)) else [out]
    snapshot = [t.clone() if isinstance(t, torch.Tensor) else t for t in given]
    with pytest.raises(exc, match=match):
        km.knn(args.pop("x"), args.pop("y"), args.pop("k"), out=out, **args)
    for t, s in zip(given, snapshot):
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, s)


def test_kernel_topk_bad_input():
    x, y = _data(6, 20, 3, seed=9)
    out = _poisoned((6, 2))
    with pytest.raises(TypeError, match="^descriptor: expected a KernelDescriptor"):
        km.kernel_topk("laplace_l2", x, y, 2, bandwidth=1.0, out=out)
    with pytest.raises(ValueError, match="^bandwidth: "):
        km.kernel_topk(km.preset("laplace_l2"), x, y, 2, out=out)
    with pytest.raises(ValueError, match="^bandwidth: batch shape"):
        km.kernel_topk(km.preset("laplace_l2"), x.expand(2, 6, 3), y, 2, bandwidth=torch.ones(3))
    bw = torch.ones((), requires_grad=True)
    with pytest.raises(NotImplementedError, match="^bandwidth: gradients"):
        km.kernel_topk(km.preset("laplace_l2"), x, y, 2, bandwidth=bw, out=out)
    assert (out[0] == 12345.0).all() and (out[1] == -7).all()


# -- autograd -------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1.0, 1.5, 2.0, math.inf])
def test_gradcheck_values(p):
    x, y = _data(5, 17, 3, seed=10, dtype=torch.float64)
    x.requires_grad_(True)
    y.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: km.knn(a, b, 3, p=p, compute_mode=EXACT)[0], (x, y))


def test_gradcheck_kernel_and_batches():
    x, y = _data(4, 13, 3, seed=11, dtype=torch.float64, batch=(2,))
    x = x[:1].clone().requires_grad_(True)  # broadcast over the batch of y
    y.requires_grad_(True)
    bw = torch.tensor([0.8, 2.0], dtype=torch.float64)
    desc = km.preset("gaussian_l2")
    assert torch.autograd.gradcheck(lambda a, b: km.kernel_topk(desc, a, b, 4, bandwidth=bw)[0], (x, y))
    dot = km.preset("dot")
    assert torch.autograd.gradcheck(lambda a, b: km.kernel_topk(dot, a, b, 2)[0], (x, y))


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, math.inf])
def test_gradient_equals_cdist_autograd_with_zero_distance(p):
    """At the selected pairs the gradient is torch.cdist's (p = 2: this package's cdist,
    which gives a zero-distance pair weight 0 like torch.cdist)."""
    x, y = _data(6, 25, 4, seed=12, dtype=torch.float64)
    y[3] = x[0]  # x[0]'s nearest point at distance 0
    y[8, :2] = x[1, :2]  # equal coordinates (sgn(0) = 0)
    xa, ya = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    v, i = km.knn(xa, ya, 4, p=p, compute_mode=EXACT)
    g = torch.randn(v.shape, generator=_gen(1), dtype=torch.float64)
    gx, gy = torch.autograd.grad(v, (xa, ya), g)
    xb, yb = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
    ref = km.cdist(xb, yb, p=p, compute_mode=EXACT).gather(-1, i)
    rx, ry = torch.autograd.grad(ref, (xb, yb), g)
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gy, ry, rtol=1e-12, atol=1e-12)


def test_indices_not_differentiable_and_out_joins_graph():
    x, y = _data(5, 12, 3, seed=13, dtype=torch.float64)
    x.requires_grad_(True)
    v, i = km.knn(x, y, 2)
    assert v.requires_grad and not i.requires_grad and i.dtype == torch.int64
    out = (torch.empty(5, 2, dtype=torch.float64), torch.empty(5, 2, dtype=torch.int64))
    v2, i2 = km.knn(x, y, 2, out=out)
    assert v2 is out[0] and v2.requires_grad and torch.equal(i2, i)
    v2.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_oracle_helpers_reject_wrong_answers():
    dense = torch.tensor([[3.0, 1.0, 2.0, 1.0 + 1e-9, 5.0]], dtype=torch.float64)
    v, i = oracle_topk(dense, 2, False)
    assert i.tolist() == [[1, 3]]
    assert_acceptable(v, torch.tensor([[3, 1]]), dense, 2, False)  # within the gap tolerance
    with pytest.raises(AssertionError):
        assert_exact(v, torch.tensor([[3, 1]]), dense, 2, False)
    with pytest.raises(AssertionError):
        assert_acceptable(v, torch.tensor([[1, 2]]), dense, 2, False)



@pytest.mark.parametrize("largest", [False, True])
def test_blocked_matrix_product_selection_is_rescored_exactly(monkeypatch, largest):
    """knn p = 2 on the GPU's blocked path (blocks from the matrix-product cdist, float32) returns
    the distances of direct differences at the indices it selects: on data at an offset of 10 with
    an exact duplicate pair, the duplicate gives exactly 0, every value is float64's rounded to
    float32, in the (value, index) order. Without the rescoring the values are off by far more
    (the check can fail). (On a GPU the blocks' cdist is shifted by a reference point as well,
    so that the selection follows the centred scale: tests/test_gpu_zoo.py.)"""
    monkeypatch.setattr(knn_mod, "_torch_blocks", lambda call: False)
    monkeypatch.setattr(knn_mod, "_work_dtype", lambda call: call.dtype)  # float32 blocks, as on a GPU
    monkeypatch.setattr(knn_mod, "MIN_BLOCK_COLUMNS", 16)
    monkeypatch.setattr(knn_mod, "RESCORE_ELEMENTS", 64)  # several rescoring chunks
    x, y = _data(40, 90, 5, seed=21)
    x, y = x + 10, y + 10
    y[17] = x[3]
    k = 20
    call = knn_mod.prepare_knn(x, y, k, largest=largest)
    v, i = _poisoned((40, k))
    knn_mod.topk_blocked(call, v, i, block_elements=300)
    ref = torch.cdist(x.double(), y.double(), compute_mode=EXACT)
    assert torch.equal(v, ref.gather(1, i).float())
    a, b = (v[:, 1:], v[:, :-1]) if largest else (v[:, :-1], v[:, 1:])
    assert bool(((a < b) | ((a == b) & (i[:, :-1] < i[:, 1:]))).all())  # the (value, index) order
    if not largest:
        assert v[3, 0].item() == 0.0 and i[3, 0].item() == 17
    monkeypatch.setattr(knn_mod, "_rescores", lambda call: False)
    v2, i2 = _poisoned((40, k))
    knn_mod.topk_blocked(call, v2, i2, block_elements=300)
    assert (v2.double() - ref.gather(1, i2)).abs().max() > 1e-5  # float32 rounding: 2.4e-7 here


def test_exact_products_admits_small_integers_only():
    """plan.topk.exact_products: the tensor-core candidates' values are exact (every row certified,
    ties included) only for integer coordinates of magnitude m <= 2^11 with 4 K m^2 <= 2^24."""
    from kermac_like.plan.topk import exact_products

    onehot = (torch.rand(50, 128) < 0.25).float()
    assert bool(exact_products(onehot, onehot[:7], 128))
    assert bool(exact_products(onehot - 1, 3 * onehot, 128))  # 4 * 128 * 9 <= 2^24
    assert not bool(exact_products(onehot + 0.5, onehot, 128))  # not integers
    assert not bool(exact_products(onehot * 255, onehot, 128))  # 4 * 128 * 255^2 > 2^24
    assert not bool(exact_products(onehot * 4096, onehot, 1))  # beyond TF32's 11 bits
    bad = onehot.clone()
    bad[3, 5] = float("nan")
    assert not bool(exact_products(onehot, bad, 128))
    bad[3, 5] = float("inf")
    assert not bool(exact_products(bad, onehot, 128))


def test_sample_groups_cover_separated_blobs():
    """ops.knn.sample_groups: the farthest-point traversal puts one of its first 8 anchors in each of
    8 well-separated blobs (rows shuffled), never picks a row with a non-finite coordinate, and its
    ratio says the groups resolve the blobs (far below GROUP_RATIO) but not centred noise (near 1);
    row_groups then puts each blob in groups of its own, their centres near the rows."""
    from kermac_like.centring import reference_point
    from kermac_like.ops.knn import GROUP_RATIO, row_groups, sample_groups

    g = torch.Generator().manual_seed(3)
    centres = 40.0 * torch.randn(8, 16, generator=g)
    label = torch.randint(0, 8, (5000,), generator=g)
    x = centres[label] + torch.randn(5000, 16, generator=g)
    x[11, 2] = float("nan")
    x[12, 0] = float("inf")
    s = reference_point(x)
    rows, ratio = sample_groups(x, s, 8)
    assert sorted(label[rows].tolist()) == list(range(8))
    assert bool(torch.isfinite(x[rows]).all())
    assert float(ratio) < 0.1 * GROUP_RATIO
    rows, ratio = sample_groups(x, s)
    group, cent = row_groups(x, s, x[rows])
    fin = torch.isfinite(x).all(1)
    for gg in group[fin].unique():
        assert label[fin & (group == gg)].unique().numel() == 1
    assert (cent[group[fin]] - x[fin]).norm(dim=1).max() < 10
    noise = torch.randn(6000, 32, generator=g)
    assert float(sample_groups(noise, reference_point(noise))[1]) > 2 * GROUP_RATIO
