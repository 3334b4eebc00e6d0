"""Issue 42 on CUDA tensors: data as it comes (bench/datasets.py's families) through cdist p = 2
on tensor cores, the Laplace / Gaussian l2 kernel matrices and knn (tensor-core candidates, the
fused SIMT selection, the blocked path at k > 16): every distance within 1e-5 relative of float64
computed from the given float32 inputs or, on the tensor cores, within the expansion's documented
bound (ops.distance.cdist; tightly clustered and low-rank data), kernel values alike, knn values
within 1e-5 (rescored exactly), exact zeros at duplicates, index sets as float64's up to ties within 1e-5 (tests/knn_oracle.py), and
the same answers for the data shifted by a common offset. Skipped without a GPU of compute
capability 8.0+."""

import pathlib
import sys

import pytest
import torch

import kermac_like as km
from kermac_like.centring import reference_point
from knn_oracle import assert_acceptable

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from bench import datasets  # noqa: E402

pytestmark = pytest.mark.gpu

EXACT = "donot_use_mm_for_euclid_dist"
FAMILIES = [f for f in datasets.FAMILIES if f not in datasets.SKLEARN]


def _pair(name, M, N, K, seed=0):
    """x (M, K) near rows of y (N, K), and y with two exact duplicates of x's rows appended."""
    x, y = datasets.pair(name, M, N, K, seed=seed, near=True, device="cuda")
    return x, torch.cat([y, x[3:4], x[7:8]])


def _dense(x, y):
    return torch.cdist(x.double(), y.double(), compute_mode=EXACT)


def _allowed(x, y, d):
    """The documented relative error of each tensor-core distance (ops.distance.cdist): 1e-5, or
    K 2^-24 (|x - s|^2 + |y - s|^2) / (2 d^2) for a pair above the near-pair share with s the
    reference point, the expansion's bound (tightly clustered or low-rank data)."""
    s = reference_point(y, x).double()
    nx, ny = (x.double() - s).square().sum(-1), (y.double() - s).square().sum(-1)
    model = x.shape[-1] * 2.0 ** -24 * (nx[:, None] + ny[None, :]) / (2 * d.square().clamp_min(1e-300))
    return model.clamp_min(1e-5)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("K", [64, 256])
def test_cdist_p2_on_every_family(name, K):
    x, y = _pair(name, 300, 700, K)
    ref = _dense(x, y)
    for offset in (0.0, 1000.0):  # and shifted far from the origin: the same float32-grade values
        xs, ys = (x, y) if offset == 0 else (x + offset, y + offset)
        want = ref if offset == 0 else _dense(xs, ys)
        out = torch.full((300, y.shape[0]), float("nan"), device="cuda")
        km.cdist(xs, ys, out=out)
        err = (out.double() - want).abs() / want.clamp_min(1e-30)
        over = (err / _allowed(xs, ys, want))[want > 0]
        assert float(over.max()) <= 1, (name, offset, float(err[want > 0].max()), float(over.max()))
        assert (out[want == 0] == 0).all() and out[3, -2] == 0 and out[7, -1] == 0


# Below a few units in the last place of float32 (2^-22), max relative errors compare rounding
# noise, not accuracy: the comparison with torch.cdist starts there.
ULPS = 2.0 ** -22


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("K", [64, 1024])
@pytest.mark.parametrize("wgmma", ["on", "off"])
def test_cdist_p2_never_less_accurate_than_torch(name, K, wgmma):
    """cdist p = 2 on the tensor cores (wgmma on sm_90; mma.sync with wgmma off and on sm_80),
    against torch.cdist's own float32 matrix-product mode on the same input: the max relative error
    over the pairs (float64 of the given inputs as the truth) at most torch's, or float32 rounding
    noise (ULPS). The products' partial sums (wgmma_chunked; the mma.sync kernel's per k8 step) keep
    the tensor cores' truncating accumulation from adding up over K."""
    if wgmma == "off" and torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("the sm_90 mma.sync build keeps one running sum (wgmma off: an A/B setting; "
                    "plan.distance._few_tiles sends K > 32 to the wgmma kernel)")
    x, y = _pair(name, 600, 1100, K, seed=1)
    want = _dense(x, y)
    with km.config.override(wgmma=wgmma):
        out = torch.full((600, y.shape[0]), float("nan"), device="cuda")
        km.cdist(x, y, out=out)
    ours = ((out.double() - want).abs() / want)[want > 0].max()
    theirs = ((torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist").double() - want).abs() / want)[want > 0].max()
    assert float(ours) <= max(float(theirs), ULPS), (name, K, wgmma, float(ours), float(theirs))
    assert out[3, -2] == 0 and out[7, -1] == 0


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="the wgmma kernel's tiles (sm_90)")
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("K", [64, 1024])
@pytest.mark.parametrize("tile", [192, 256])
def test_cdist_p2_wide_tiles_never_less_accurate_than_torch(name, K, tile):
    """The wgmma kernel's wide tiles with partial sums (setting wgmma_tile 192: 128 x 192; 256: 128 x
    256 by column halves): torch.cdist's accuracy as test_cdist_p2_never_less_accurate_than_torch asks
    of the default tiles; N = 1102 puts 192-column tiles across the 256-row prepared blocks and one
    past the last of them."""
    x, y = _pair(name, 600, 1100, K, seed=1)
    want = _dense(x, y)
    with km.config.override(wgmma="on", wgmma_tile=tile):
        out = torch.full((600, y.shape[0]), float("nan"), device="cuda")
        km.cdist(x, y, out=out)
    ours = ((out.double() - want).abs() / want)[want > 0].max()
    theirs = ((torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist").double() - want).abs() / want)[want > 0].max()
    assert float(ours) <= max(float(theirs), ULPS), (name, K, tile, float(ours), float(theirs))
    assert out[3, -2] == 0 and out[7, -1] == 0


@pytest.mark.skipif(not _sm90(), reason="the wgmma kernel's tiles (sm_90)")
@pytest.mark.parametrize("name", ["gaussian", "blobs_wide"])
@pytest.mark.parametrize("tile", [192, 256])
def test_wide_tiles_sum_as_the_narrow_ones(name, tile):
    """The same partial sums (the k-tiles of each, their order, the float32 additions) in the wide
    tiles and in 128 x 128 tiles: the same bits, unless the tensor cores order a product's terms by
    the width of the wgmma (192; 256 issues the 128 x 128 tiles' m64n128k8 itself: the same bits
    expected there whatever the hardware's order)."""
    x, y = _pair(name, 600, 1100, 1024, seed=2)
    outs = []
    for t in (128, tile):
        with km.config.override(wgmma="on", wgmma_tile=t):
            outs.append(km.cdist(x, y))
    assert torch.equal(outs[0], outs[1]), float((outs[0] - outs[1]).abs().max())


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("kernel", ["laplace_l2", "gaussian_l2"])
def test_kernel_matrices_on_every_family(name, kernel):
    x, y = _pair(name, 257, 513, 96)
    d = _dense(x, y)
    bw = float(d.median())  # a bandwidth of the data's scale
    want = torch.exp(-d / bw) if kernel == "laplace_l2" else torch.exp(-d.square() / (2 * bw * bw))
    got = km.run_kernel(km.preset(kernel), x, y, bandwidth=bw)
    err = (got.double() - want).abs() / want.clamp_min(1e-5)
    # a distance error e (relative) moves the value by |dk/dd| d e: Laplace k d / bw, Gaussian k d^2 / bw^2
    slope = d / bw if kernel == "laplace_l2" else d.square() / (bw * bw)
    allowed = torch.maximum(torch.full_like(d, 1e-5), want * slope * _allowed(x, y, d) / want.clamp_min(1e-5))
    assert float((err / allowed).max()) <= 1, (name, kernel, float(err.max()))
    assert got[3, -2] == 1 and got[7, -1] == 1


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("K,k,p", [(128, 10, 2.0), (128, 40, 2.0), (8, 10, 2.0), (64, 10, 1.0)])
def test_knn_on_every_family(name, K, k, p):
    """K = 128, k = 10: the tensor-core candidates; k = 40: the blocked path; K = 8 and p = 1: the
    fused SIMT selection. Shifted by 1000 x the spread: values and index sets still float64's."""
    x, y = _pair(name, 400, 3000, K)
    for offset in (0.0, 1000.0):
        xs, ys = (x, y) if offset == 0 else (x + offset, y + offset)
        dense = torch.cdist(xs.double(), ys.double(), p=p, compute_mode=EXACT)
        v, i = km.knn(xs, ys, k, p=p)
        assert_acceptable(v, i, dense, k, False)
        assert v[3, 0] == 0 and v[7, 0] == 0  # the duplicates, exactly


@pytest.mark.parametrize("name", ["blobs_wide", "blobs_tight", "onehot", "student_t"])
def test_knn_uncertified_rows_take_the_fused_selection(monkeypatch, name):
    """K = 128, k = 10 on the families whose rows the TF32 bound leaves uncertified (clusters far
    from the reference point, ties, heavy tails): those rows are recomputed by the fused SIMT
    selection (K <= 128), never by the blocked path, with float64's values and index sets."""
    from kermac_like.ops import knn as knn_mod

    blocked, simt = [], []
    real_blocked, real_plan = knn_mod.topk_blocked, knn_mod.plan_topk
    monkeypatch.setattr(knn_mod, "topk_blocked", lambda call, *a, **kw: blocked.append(call.M) or real_blocked(call, *a, **kw))

    def spy(call, *a, fallback=False, **kw):
        if fallback:
            simt.append(call.M)
        return real_plan(call, *a, fallback=fallback, **kw)

    monkeypatch.setattr(knn_mod, "plan_topk", spy)
    x, y = _pair(name, 600, 5000, 128)
    v, i = km.knn(x, y, 10)
    assert not blocked, blocked
    if name == "onehot":  # 75 % duplicate rows: near-ties at the k-th value, never certified
        assert simt and simt[0] > 0
    assert_acceptable(v, i, _dense(x, y), 10, False)
    assert v[3, 0] == 0 and v[7, 0] == 0


def test_knn_shifted_rows_are_certified_on_tensor_cores(monkeypatch):
    """Features shifted by +3 (all positive) at K = 128: the tensor-core candidates certify every
    row as on centred data (no row takes the blocked path; before the shift by a reference point
    every row did)."""
    from kermac_like.ops import knn as knn_mod

    calls = []
    real = knn_mod.topk_blocked
    monkeypatch.setattr(knn_mod, "topk_blocked", lambda call, *a, **kw: calls.append(call.M) or real(call, *a, **kw))
    y = datasets.make("gaussian", 4096, 128, seed=5, device="cuda") + 3
    x = y[:512] + 1e-2 * datasets.make("gaussian", 512, 128, seed=6, device="cuda")
    v, i = km.knn(x, y, 10)
    assert not calls, calls
    assert_acceptable(v, i, _dense(x, y), 10, False)


@pytest.mark.parametrize("name", ["blobs_wide", "gaussian", "blobs_tight", "onehot"])
@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_knn_groups_about_anchors(monkeypatch, name, offset, settings):
    """The setting knn_groups on: the tensor-core candidates of each group of rows about an anchor
    row near them (ops.knn's groups), on every kind of data and far from the origin: values and
    index sets float64's, the duplicates at exactly 0. On wide blobs the groups certify nearly
    every row, where about one reference point nearly none are (the trial that turns grouping on)."""
    from kermac_like.ops import knn as knn_mod

    recomputed = []
    real = knn_mod.recompute_rows
    monkeypatch.setattr(knn_mod, "recompute_rows",
                        lambda call, v, i, rows, *a: recomputed.append(int(rows.numel())) or real(call, v, i, rows, *a))
    x, y = _pair(name, 1500, 6000, 128)
    x, y = x + offset, y + offset
    dense = _dense(x, y)
    for mode in ("off", "on"):
        settings(knn_groups=mode)
        v, i = km.knn(x, y, 10)
        assert_acceptable(v, i, dense, 10, False)
        assert v[3, 0] == 0 and v[7, 0] == 0
    if name == "blobs_wide":
        off, on = recomputed
        assert off > 0.5 * x.shape[0] and on < 0.05 * x.shape[0], recomputed


def test_knn_groups_auto_takes_groups_on_blobs(settings):
    """auto: the call about the data's reference point first; where more than GROUP_SHARE of the rows
    fail and a sample says groups about anchors resolve clusters (GROUP_RATIO), those rows again in
    groups: wide blobs run several plans, centred Gaussians one."""
    from kermac_like import testing
    from kermac_like.ops import knn as knn_mod

    settings(knn_groups="auto")
    for name, grouped in (("blobs_wide", True), ("gaussian", False)):
        x, y = datasets.pair(name, knn_mod.GROUP_MIN_ROWS, 4000, 128, seed=1, near=True, device="cuda")
        with testing.record_plans() as plans:
            v, i = km.knn(x, y, 10)
        assert_acceptable(v, i, _dense(x, y), 10, False)
        assert (plans.families.count("topk_mma") > 1) == grouped, (name, plans.families)


@pytest.mark.parametrize("name", ["onehot", "pixels"])
def test_knn_of_integer_data_against_itself_is_exact(monkeypatch, name):
    """Small integers (one-hot codes, counts) queried against themselves: the tensor-core candidates'
    values are exact (plan.topk.exact_products), so every row is certified, ties at the k-th value
    included (no row recomputed), with float64's values and the smaller index first among ties."""
    from kermac_like.ops import knn as knn_mod

    recomputed = []
    real = knn_mod.recompute_rows
    monkeypatch.setattr(knn_mod, "recompute_rows",
                        lambda call, v, i, rows, *a: recomputed.append(int(rows.numel())) or real(call, v, i, rows, *a))
    y = datasets.make(name, 3000, 128, seed=4, device="cuda")
    if name == "pixels":
        y = (y / 32).floor()  # 0..7: within exact_products' range at K = 128
    v, i = km.knn(y, y, 10)
    dense = _dense(y, y)
    assert_acceptable(v, i, dense, 10, False)
    ref = torch.sort(dense, dim=1, stable=True)  # (value, index) order, float64: ties by index
    assert torch.equal(i, ref.indices[:, :10])
    assert torch.equal(v, ref.values[:, :10].float())  # sqrt of an exact integer, rounded once
    assert recomputed == [0], recomputed
