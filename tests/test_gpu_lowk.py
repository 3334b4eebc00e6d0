"""GPU tests of the low-K kernel (distance_lowk.cuh) and of the kernel choice (marker ``gpu``).

Every descriptor and K of the shipped set (and compile-time K above it, and the
run-time-K variant) against float64; odd sizes; row- and column-major out (the latter
launched as out^T); poisoned out; batches with broadcast data and hyper-parameters;
a thousand small problems in one launch; the autotuner's store.
"""

import json

import pytest
import torch

import kermac_like as km
from kermac_like.plan import distance
from kermac_like.layout import analyse_output
from kermac_like.ops.distance import COMPUTE_MODES, prepare_call
from kermac_like.plan import autotune as tuning
from kermac_like.reference import distance_reference

pytestmark = pytest.mark.gpu
ALL = list(km.KernelDescriptor.all())


def rel(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite output (unwritten or overflow)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def hyper(desc, a, b):
    """p for POW powers; a bandwidth at the data's own distance scale (the median
    distance: exponents of order 1, so the float64 comparison measures the kernel, not
    the conditioning of exp at arguments of -20)."""
    kw = {}
    if desc.needs_inner_p or desc.needs_outer_p:
        kw["p"] = 1.3
    if desc.needs_bandwidth:
        plain = km.KernelDescriptor(desc.inner_operator, desc.inner_power, desc.outer_power, km.KernelType.NONE)
        kw["bandwidth"] = reference(plain, a[:64], b, **{k: v for k, v in kw.items()}).median().item()
    return kw


def run_lowk(desc, a, b, out, threads_n=None, tiles_n=None, **kw):
    """run_kernel forced onto the low-K kernel (``threads_n``: its tile shape, ``tiles_n``:
    tiles per block); returns out."""
    call = prepare_call(desc, a, b, **kw)
    analyse_output("out", out, call.out_shape, call.dtype, call.device)
    tune = {k: v for k, v in (("threads_n", threads_n), ("tiles_n", tiles_n)) if v is not None}
    orig = distance.lowk_spec
    with distance.spec_override(lowk_spec=lambda *x, **y: orig(*x, **{**y, **tune})):
        plan = distance._plan_distance_gpu(call, out, COMPUTE_MODES[0], False, distance.Settings.current(),
                                           kind=tuning.LOWK)
        assert plan.family == "distance_lowk"
        res = plan.run()
    assert res is out
    return out


def reference(desc, a, b, **kw):
    reg_diag = kw.pop("regularization_offset_x", 0) - kw.pop("regularization_offset_y", 0)
    p = kw.pop("p", None)
    if p is not None:
        kw.setdefault("inner_p", p if desc.needs_inner_p else None)
        kw.setdefault("outer_p", p if desc.needs_outer_p else None)
    hy = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items() if k != "epsilon"}
    return distance_reference(desc, a.double(), b.double(), reg_diag=reg_diag, epsilon=kw.get("epsilon"), **hy)


KS = [1, 3, 5, 8, 16, 37, 64, 100]


def up_front_specs():
    """The instantiations this module launches (conftest's session fixture compiles those of every GPU module
    in the session once, before the tests; warm_cache then finds them cached)."""
    from kermac_like.layout import Layout
    from kermac_like.runtime.specs import lowk_spec

    R, C = Layout.ROW_MAJOR, Layout.COL_MAJOR
    specs = [lowk_spec(d, R, R, K) for d in ALL for K in KS]
    specs += [lowk_spec(km.preset("laplace_l2"), R, C, K) for K in (3, 37, 100)]
    specs += [lowk_spec(km.preset("laplace_l2"), C, R, K) for K in (3, 37, 100)]
    specs += [lowk_spec(km.preset("laplace_l2"), la, lb, K, threads_n=t) for K in (3, 37, 100) for t in (32, 64)
              for la, lb in ((R, C), (C, R))]
    specs += [lowk_spec(km.preset(p), la, lb, K, tiles_n=t) for p in ("l1", "gaussian_l2") for K in (5, 37)
              for t in (1, 3, 8) for la, lb in ((R, C), (C, R))]
    return specs


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    """Compile the instantiations this module launches up front, in parallel processes."""
    import os

    from kermac_like.runtime.compiler import arch_of_device, precompile_specs
    from shipped_build import up_front_turn

    with up_front_turn():  # under xdist: after the session's compile of every GPU module's kernels
        precompile_specs(up_front_specs(), arch_of_device(torch.device("cuda")), processes=min(16, os.cpu_count() or 1))
    yield


def tol(desc):
    return 2e-6 if desc.needs_inner_p else 5e-7


@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
@pytest.mark.parametrize("K", KS)
def test_every_descriptor_and_k(desc, K):
    M, N = 257, 131
    a, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    kw = hyper(desc, a, b)
    out = torch.full((M, N), float("nan"), device="cuda")
    run_lowk(desc, a, b, out, **kw)
    assert rel(out, reference(desc, a, b, **kw)) <= tol(desc), (desc, K)


@pytest.mark.parametrize("K", [3, 37, 100])
@pytest.mark.parametrize("col_out", [False, True])
@pytest.mark.parametrize("threads_n", [16, 32, 64])
def test_odd_sizes_layouts_and_poison(K, col_out, threads_n):
    desc = km.preset("laplace_l2")
    for M, N in [(1, 1), (1, 1000), (7, 129), (127, 127), (129, 7), (1000, 1), (1000, 1000), (127, 1000)]:
        a = torch.randn(M, K, device="cuda")
        b = torch.randn(K, N, device="cuda").t()  # column-major b
        out = torch.full((N, M), float("nan"), device="cuda").t() if col_out else \
            torch.full((M, N), float("nan"), device="cuda")
        # bandwidth at the distance scale sqrt(2K): exp of O(1) arguments (well conditioned)
        kw = dict(bandwidth=(2.0 * K) ** 0.5, regularization=0.5, regularization_offset_x=3, epsilon=0.2)
        run_lowk(desc, a, b, out, threads_n=threads_n, **kw)
        assert rel(out, reference(desc, a, b, **kw)) <= 5e-7, (M, N, K, col_out)


@pytest.mark.parametrize("name", ["l1", "gaussian_l2"])
@pytest.mark.parametrize("K", [5, 37])
@pytest.mark.parametrize("tiles_n", [1, 3, 8])
def test_tiles_per_block(name, K, tiles_n):
    """kTilesN tiles along n per block (b's next tile copied while the current one is
    computed): partial last tiles, a block whose later tiles lie past N, both layouts of a
    and b, the regularised diagonal crossing tiles, poisoned out."""
    desc = km.preset(name)
    for M, N in [(1, 1), (129, 130), (200, 1000), (1000, 257), (130, 129 * 8 + 3)]:
        a = torch.randn(M, K, device="cuda")
        b = torch.randn(K, N, device="cuda").t()  # column-major b
        kw = dict(regularization=0.5, regularization_offset_y=2)
        if desc.needs_bandwidth:
            kw["bandwidth"] = (2.0 * K) ** 0.5
        out = torch.full((M, N), float("nan"), device="cuda")
        run_lowk(desc, a, b, out, tiles_n=tiles_n, **kw)
        assert rel(out, reference(desc, a, b, **kw)) <= 5e-7, (M, N)
        out_t = torch.full((N, M), float("nan"), device="cuda").t()  # column-major out: kernel(b, a)^T
        run_lowk(desc, a.t().contiguous().t(), b, out_t, tiles_n=tiles_n, **kw)
        assert rel(out_t, reference(desc, a, b, **kw)) <= 5e-7, (M, N, "col out")


def test_unaligned_out_takes_scalar_stores():
    a, b = torch.randn(300, 3, device="cuda"), torch.randn(301, 3, device="cuda")
    big = torch.full((300 * 302 + 1,), float("nan"), device="cuda")
    out = big[1:].view(300, 302)[:, :301]  # base 4 bytes off 16, ld 302
    run_lowk(km.preset("l1"), a, b, out)
    assert rel(out, torch.cdist(a.double(), b.double(), 1.0)) <= 5e-7
    assert torch.isnan(big[0]) and torch.isnan(big[1:].view(300, 302)[:, 301]).all()


@pytest.mark.parametrize("col_out", [False, True])
def test_batches_broadcast_hyperparameters(col_out):
    desc = km.preset("gaussian_l2")
    K = 5
    a = torch.randn(3, 1, 70, K, device="cuda")
    b = torch.randn(1, 4, 90, K, device="cuda")
    bw = torch.rand(3, 1, device="cuda") + 0.5
    lam = torch.rand(4, device="cuda")
    shape = (3, 4, 70, 90)
    out = torch.full((3, 4, 90, 70), float("nan"), device="cuda").transpose(-1, -2) if col_out else \
        torch.full(shape, float("nan"), device="cuda")
    kw = dict(bandwidth=bw, regularization=lam, regularization_offset_y=-2)
    run_lowk(desc, a, b, out, **kw)
    assert rel(out, reference(desc, a, b, **kw)) <= 5e-7


def test_thousand_small_problems_one_launch():
    L, M, N, K = 1000, 256, 256, 3
    a, b = torch.randn(L, M, K, device="cuda"), torch.randn(L, N, K, device="cuda")
    bw = torch.linspace(0.5, 4.0, L, device="cuda")
    out = torch.full((L, M, N), float("nan"), device="cuda")
    km.run_kernel(km.preset("laplace_l2"), a, b, bandwidth=bw, out=out, compute_mode="donot_use_mm_for_euclid_dist")
    assert rel(out, reference(km.preset("laplace_l2"), a, b, bandwidth=bw)) <= 5e-7


def test_default_choice_is_low_k_and_exact_for_cdist_p2(caplog):
    x, y = torch.randn(500, 3, device="cuda"), torch.randn(400, 3, device="cuda")
    with caplog.at_level("DEBUG", logger="kermac_like"):
        out = km.cdist(x, y, compute_mode="donot_use_mm_for_euclid_dist", debug=True)
    assert "low-K path" in caplog.text and "default table" in caplog.text
    assert rel(out, torch.cdist(x.double(), y.double())) <= 5e-7


def test_autotune_times_stores_and_reuses(tmp_path, monkeypatch, caplog):
    from kermac_like.runtime.cache import reset_cache

    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path))
    reset_cache()
    tuning.forget()
    x, y = torch.randn(2000, 100, device="cuda"), torch.randn(1500, 100, device="cuda")
    with caplog.at_level("DEBUG", logger="kermac_like"):
        out = km.cdist(x, y, p=1.0, autotune=True, debug=True)
    assert "measured now" in caplog.text
    assert rel(out, torch.cdist(x.double(), y.double(), p=1.0)) <= 5e-7
    import sqlite3

    from kermac_like.runtime.cache import DB_FILENAME

    rows = sqlite3.connect(str(tmp_path / DB_FILENAME)).execute("SELECT key, choice, timings FROM tuning").fetchall()
    assert len(rows) == 1
    key, choice, timings = rows[0]
    timings = json.loads(timings)
    assert set(timings) == {"lowk", "simt"} and choice == min(timings, key=timings.get)
    tuning.forget()  # a new process: the stored winner, no timing
    caplog.clear()
    with caplog.at_level("DEBUG", logger="kermac_like"):
        km.cdist(x, y, p=1.0, autotune=True, debug=True)
    assert "(stored;" in caplog.text and "measured now" not in caplog.text
    reset_cache()


@pytest.mark.parametrize("K", [13, 37])  # (K <= 8 takes the low-K kernel: autotune.LOWK_MM_UP_TO)
def test_tensor_cores_at_unaligned_k_pad_the_inputs(K, caplog):
    x, y = torch.randn(700, K, device="cuda"), torch.randn(600, K, device="cuda")
    out = torch.full((700, 600), float("nan"), device="cuda")
    with caplog.at_level("DEBUG", logger="kermac_like"):
        km.cdist(x, y, out=out, compute_mode="use_mm_for_euclid_dist", debug=True)
    assert "tensor-core path" in caplog.text
    assert rel(out, torch.cdist(x.double(), y.double())) <= 1e-5
