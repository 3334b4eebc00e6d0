"""GPU tests of the ops against a float64 oracle (marker ``gpu``; skipped without CUDA).

Fresh random data on every run; outputs poisoned with NaN before each call so
an unwritten element fails; relative Frobenius error vs float64.
"""

import itertools
import os

import pytest
import torch

import kermac_like as km
from kermac_like import PowerType as P
from kermac_like.reference import cdist_grad_reference, distance_reference

pytestmark = pytest.mark.gpu
F64 = torch.float64
EXACT = "donot_use_mm_for_euclid_dist"


def rel(x, ref):
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite output (unwritten or overflow)"
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def tol(p):
    return 1e-6 if p in (1, 2) else 2e-6


def poisoned(shape, **kw):
    return torch.full(shape, float("nan"), device="cuda", **kw)


ALL = list(km.KernelDescriptor.all())


def up_front_specs():
    """What this module compiles up front: every descriptor's instantiations (conftest's session fixture
    compiles those of every GPU module in the session once, before the tests; warm_cache then finds them)."""
    from kermac_like.runtime.precompile import specs_for_descriptor

    return [s for d in ALL for s in specs_for_descriptor(d)]


@pytest.fixture(scope="module", autouse=True)
def warm_cache():
    """Compile what this module needs up front, in parallel processes."""
    from shipped_build import up_front_turn

    with up_front_turn():  # under xdist: after the session's compile of every GPU module's kernels
        km.precompile(ALL, processes=min(16, os.cpu_count() or 1))
    yield


def test_round_trip_on_current_stream():
    from kermac_like.runtime.store import clear_loaded, get_kernel
    from kermac_like.runtime.specs import distance_spec
    from kermac_like.layout import Layout

    x, y = torch.randn(300, 64, device="cuda"), torch.randn(200, 64, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(10_000_000)  # ours must queue behind this on s
        out = km.cdist(x, y, 1.0)
    s.synchronize()
    assert rel(out, torch.cdist(x.double(), y.double(), 1.0)) < 1e-6
    clear_loaded()
    spec = distance_spec(km.PRESETS["l1"], Layout.ROW_MAJOR, Layout.ROW_MAJOR, Layout.ROW_MAJOR, 4)
    assert get_kernel(spec, torch.cuda.current_device()).source == "cache"
    assert get_kernel(spec, torch.cuda.current_device()).source == "cache"  # now from memory, same object


SIZES = [(1, 1), (1, 1000), (7, 129), (127, 127), (129, 7), (1000, 1), (1000, 1000), (127, 1000), (129, 129)]


@pytest.mark.parametrize("p", [0.5, 1.0, 1.3, 2.0, 3.0])
@pytest.mark.parametrize("K", [1, 3, 64, 1023])
def test_cdist_exact_sizes(p, K):
    for M, N in SIZES:
        x, y = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
        out = poisoned((M, N))
        km.cdist(x, y, p, out=out, compute_mode=EXACT)
        ref = torch.cdist(x.double(), y.double(), p)
        assert rel(out, ref) <= tol(p), (M, N, K, p)


@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
def test_every_descriptor(desc):
    M, N = 129, 127
    for K in (64, 63):  # vector and unaligned variants
        a, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
        kw = dict(p=1.3, bandwidth=5.0, regularization=0.75, regularization_offset_x=2, epsilon=1e-3)
        out = poisoned((M, N))
        km.run_kernel(desc, a, b, out=out, compute_mode=EXACT, **kw)
        ref = distance_reference(desc, a.double(), b.double(), inner_p=1.3 if desc.needs_inner_p else None,
                                 outer_p=1.3 if desc.needs_outer_p else None,
                                 bandwidth=5.0 if desc.needs_bandwidth else None, regularization=0.75,
                                 reg_diag=2, epsilon=1e-3)
        frac = desc.inner_power is P.POW or desc.outer_power is P.POW
        assert rel(out, ref) <= (2e-6 if frac else 1e-6), K


@pytest.mark.parametrize("name", ["l1", "p_norm", "laplace_l2", "dot"])
@pytest.mark.parametrize("ta, tb, tout", list(itertools.product([False, True], repeat=3)))
def test_layouts_and_views(name, ta, tb, tout):
    desc = km.PRESETS[name]
    M, N, K = 130, 67, 36
    a = torch.randn(K, M, device="cuda").T if ta else torch.randn(M, K + 3, device="cuda")[:, 1 : K + 1]
    b = torch.randn(K, N, device="cuda").T if tb else torch.randn(N, K, device="cuda")
    out = poisoned((N, M)).T if tout else poisoned((M, N))
    kw = dict(p=1.3, bandwidth=3.0)
    km.run_kernel(desc, a, b, out=out, compute_mode=EXACT, **{k: v for k, v in kw.items() if k != "p" or desc.needs_inner_p})
    ref = distance_reference(desc, a.double(), b.double(), inner_p=1.3 if desc.needs_inner_p else None,
                             outer_p=1.3 if desc.needs_outer_p else None,
                             bandwidth=3.0 if desc.needs_bandwidth else None)
    assert rel(out, ref) <= 2e-6


def test_broadcast_data_and_hyperparameters():
    desc = km.PRESETS["laplace_p"]
    a = torch.randn(2, 1, 100, 40, device="cuda")
    b = torch.randn(3, 90, 40, device="cuda")
    bw = torch.tensor([1.0, 4.0, 9.0], device="cuda")  # over the last batch mode (3)
    p = torch.tensor([[1.2], [2.0]], device="cuda")  # (2, 1)
    lam = torch.tensor(0.5, device="cuda")
    out = poisoned((2, 3, 100, 90))
    km.run_kernel(desc, a, b, out=out, p=p, bandwidth=bw, regularization=lam)
    for i, j in itertools.product(range(2), range(3)):
        ref = distance_reference(desc, a[i, 0].double(), b[j].double(), inner_p=p[i, 0].item(), outer_p=p[i, 0].item(),
                                 bandwidth=bw[j].item(), regularization=0.5)
        assert rel(out[i, j], ref) <= 2e-6, (i, j)


def test_many_batch_modes_host_loop():
    x = torch.randn(2, 3, 1, 2, 1, 20, 8, device="cuda")
    y = torch.randn(1, 3, 2, 1, 2, 30, 8, device="cuda")[..., ::1, :]
    out = km.cdist(x, y, 1.0)
    assert rel(out, torch.cdist(x.double(), y.double(), 1.0)) <= 1e-6


def test_allocates_only_the_output():
    x, y = torch.randn(513, 128, device="cuda"), torch.randn(257, 128, device="cuda")
    km.cdist(x, y, 1.3)  # warm: kernel loaded
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = km.cdist(x, y, 1.3)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= out.numel() * 4 + 512
    out2 = poisoned((513, 257))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    km.cdist(x, y, 1.3, out=out2)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == base


def test_large_batch_grid_z():
    x, y = torch.randn(70000, 3, 2, device="cuda"), torch.randn(70000, 2, 2, device="cuda")
    out = km.cdist(x, y, 1.0)
    assert rel(out, torch.cdist(x.double(), y.double(), 1.0)) <= 1e-6


@pytest.mark.parametrize("p", [1.0, 1.3, 2.0])
def test_cdist_backward_matches_torch(p):
    x = torch.randn(2, 120, 33, device="cuda", dtype=torch.float32, requires_grad=True)
    y = torch.randn(1, 90, 33, device="cuda", dtype=torch.float32, requires_grad=True)
    w = torch.randn(2, 120, 90, device="cuda")
    ours = torch.autograd.grad((km.cdist(x, y, p, compute_mode=EXACT) * w).sum(), (x, y))
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    theirs = torch.autograd.grad((torch.cdist(xd, yd, p) * w.double()).sum(), (xd, yd))
    for u, v in zip(ours, theirs):
        assert rel(u, v) <= 2e-5


# -- cdist_grad -------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1.0, 1.3, 2.0, 3.0])
@pytest.mark.parametrize("O", [1, 3, 16, 33])
def test_cdist_grad(p, O):
    for K, M, N in [(1, 1, 1), (7, 129, 3), (127, 64, 33), (129, 1000, 7), (1000, 128, 16)]:
        a = torch.randn(K, M, device="cuda")
        b = torch.randn(N, K, device="cuda")
        c = torch.randn(O, K, device="cuda")
        d = torch.randn(N, M, device="cuda")
        out = poisoned((O, N, M))
        km.cdist_grad(a, b, c, d, p=p, out=out)
        ref = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(), p)
        assert rel(out, ref) <= 2e-6, (K, M, N, O, p)


def test_cdist_grad_batched_broadcast_views():
    L, K, M, N, O = 3, 200, 96, 20, 5
    a = torch.randn(L, K, M + 4, device="cuda")[..., 2 : M + 2]  # view, unaligned
    b = torch.randn(1, N, K, device="cuda")
    c = torch.randn(L, O, K, device="cuda")
    d = torch.randn(N, M, device="cuda")
    p = torch.tensor([1.0, 1.5, 2.0], device="cuda")
    out = poisoned((L, O, N, M))
    km.cdist_grad(a, b, c, d, p=p, out=out)
    ref = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(), p.double())
    assert rel(out, ref) <= 2e-6


# -- tensor-core path -----------------------------------------------------------------------
def _clustered(n, k, centers=10, spread=1e-3):
    c = torch.randn(centers, k, device="cuda") * 3
    return c[torch.randint(0, centers, (n,), device="cuda")] + spread * torch.randn(n, k, device="cuda")


@pytest.mark.parametrize("name", ["l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot"])
@pytest.mark.parametrize("data", ["random", "clustered"])
def test_tensor_core_path_error(name, data):
    desc = km.PRESETS[name]
    M, N, K = 1000, 777, 256
    if data == "random":
        a, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    else:
        a, b = _clustered(M, K), _clustered(N, K)
    bw = 20.0
    out = poisoned((M, N))
    km.run_kernel(desc, a, b, out=out, bandwidth=bw if desc.needs_bandwidth else None, debug=True)
    ref = distance_reference(desc, a.double(), b.double(), bandwidth=bw if desc.needs_bandwidth else None)
    e = rel(out, ref)
    print(f"tensor-core {name} {data}: rel err {e:.3e}")
    assert e <= 1e-5


@pytest.mark.parametrize("K", [5, 13, 37, 128])
def test_self_distance_is_zero(K):
    """K(x, x) on the tensor cores: the exact zero diagonal, also where K is zero-padded to
    whole 16-byte rows (one padded copy serves as a and b), for the full path and a repeat
    (K = 5: the low-K kernel with the matrix product's NaN/inf, autotune.LOWK_MM_UP_TO)."""
    for _ in range(2):
        x = torch.randn(500, K, device="cuda")
        d = km.cdist(x, x)
        assert (d.diagonal() == 0).all()
        assert (d >= 0).all()
        k = km.run_kernel(km.PRESETS["laplace_l2"], x, x, bandwidth=2.0)
        assert (k.diagonal() == 1).all()


@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("name", ["l2", "laplace_l2", "dot"])
def test_tensor_core_batches_broadcast_and_host_loop(name, tf32, monkeypatch, caplog, set_tf32):
    """Broadcast batches, views with padded rows and a K tail, and more batch modes than
    the kernel takes (host loop): on sm_90 the b preparation (B small, norms) is indexed
    per entry of b and shared by the host-loop launches."""
    set_tf32(tf32)
    desc = km.PRESETS[name]
    kw = {"bandwidth": 30.0} if desc.needs_bandwidth else {}
    a = torch.randn(2, 3, 1, 2, 300, 48, device="cuda")[..., :45]  # rows 16-byte aligned, K = 45
    b = torch.randn(1, 3, 2, 1, 520, 48, device="cuda")[..., :45]
    out = poisoned((2, 3, 2, 2, 300, 520))
    with caplog.at_level("DEBUG", logger="kermac_like"):  # K = 45: asked for, else the low-K kernel serves it
        km.run_kernel(desc, a, b, out=out, compute_mode="use_mm_for_euclid_dist", debug=True, **kw)
    assert "tensor-core path" in caplog.text
    ref = distance_reference(desc, a.double(), b.double(), **kw)
    assert rel(out, ref) <= (3e-3 if tf32 else 1e-5)


# -- repeated eager calls: served by their call key (plan.distance.run_by_call_key, ArgBlock launches) --
@pytest.mark.parametrize("K", [5, 8, 37, 200])
def test_repeated_calls_served_by_call_key(K):
    """The first call takes the full path and keeps its template under the call's key;
    the next calls (new data, same layout) are served from it, their arguments patched
    into the launch's argument block. Every call's output is checked (poisoned first)."""
    from kermac_like.plan import distance as PL

    PL.clear_templates()
    g = torch.Generator(device="cuda").manual_seed(K)
    for p, mode, out_t in itertools.product((1.0, 2.0, 1.3), ("use_mm_for_euclid_dist_if_necessary", EXACT),
                                             (False, True)):
        for rep in range(3):
            x = torch.randn(2, 70, K, device="cuda", generator=g)
            y = torch.randn(2, 50, K, device="cuda", generator=g)
            out = poisoned((2, 50, 70)).mT if out_t else poisoned((2, 70, 50))
            res = km.cdist(x, y, p, out=out, compute_mode=mode)
            assert res is out
            e = rel(out, torch.cdist(x.double(), y.double(), p))
            assert e < 1e-5, (p, mode, out_t, rep, e)
            fresh = km.cdist(x, y, p, compute_mode=mode)  # out allocated by the call
            assert rel(fresh, torch.cdist(x.double(), y.double(), p)) < 1e-5
    lap = km.PRESETS["laplace_l2"]
    for rep in range(3):
        x = torch.randn(90, K, device="cuda", generator=g)
        res = km.run_kernel(lap, x, x, bandwidth=3.0, regularization=0.5, regularization_offset_x=2)
        ref = distance_reference(lap, x.double(), x.double(), bandwidth=3.0, regularization=0.5, reg_diag=2)
        assert rel(res, ref) < 1e-5, rep
    assert PL.plans.count("calls")


def test_call_key_served_call_in_a_cuda_graph():
    """A call served by its key is captured like any other (after the warm-up calls) and
    replays on new data."""
    x = torch.randn(64, 8, device="cuda")
    y = torch.randn(48, 8, device="cuda")
    out = torch.empty(64, 48, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            km.cdist(x, y, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        km.cdist(x, y, out=out)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, torch.cdist(x.double(), y.double())) < 1e-5


@pytest.mark.parametrize("p", [1.0, 1.3])
def test_simt_kmajor_copies_change_nothing_but_speed(p, caplog):
    """Large SIMT calls read k-major copies of row-major operands (plan.distance._kmajor): the same bits
    as the kernel reading the operands themselves, odd sizes included, the copies the only
    memory beside the output, and K(x, x) still exactly zero on the diagonal."""
    import logging

    from kermac_like.plan import distance as P

    # K = 160: beyond the low-K chunk stream that takes p = 1 up to K = 128 (LOWK_CHUNKED_UP_TO)
    M, N, K = 2100, 2051, 160
    x, y = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
    out = poisoned((M, N))
    with P.spec_override(kmajor_min_out=1 << 22):  # this size (4.3e6 outputs) takes the copies
        with caplog.at_level(logging.DEBUG, logger="kermac_like"):
            km.cdist(x, y, p, out=out, debug=True)
        assert any("k-major copies" in r.getMessage() for r in caplog.records)
        assert rel(out, torch.cdist(x.double(), y.double(), p)) < tol(p)
        km.cdist(x, y, p, out=out)  # a plain call first: the peak below is a steady call's (session 15's suite
        torch.cuda.synchronize()    # saw 0.5 MB more once, in the first plain call after the debug one)
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        km.cdist(x, y, p, out=out)
        torch.cuda.synchronize()
        copies = (-(-M // 4) * 4 + -(-N // 4) * 4) * K * 4
        assert torch.cuda.max_memory_allocated() - before <= copies + 4096
        self_d = km.cdist(x, x, p)
        assert torch.all(self_d.diagonal() == 0)
        assert rel(self_d, torch.cdist(x.double(), x.double(), p)) < tol(p)
    with P.spec_override(kmajor_min_out=1 << 62):
        plain = poisoned((M, N))
        km.cdist(x, y, p, out=plain)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("name", ["l1", "l2", "laplace_l2"])
def test_moderate_k_tuning(name):
    """64 < K <= 384 runs the SIMT kernel with two blocks per SM and 16-wide k steps where two
    fit an SM (plan/distance.py, runtime/specs/distance.py; on sm_90 it must apply): odd K and sizes
    across the tile edges, a column-major out, and a call large enough for the k-major
    copies, against float64."""
    from kermac_like.plan import distance as P
    from kermac_like.runtime.specs import MODERATE_K_TUNING, default_distance_tuning

    desc, dev = km.PRESETS[name], torch.cuda.current_device()
    applies = default_distance_tuning(desc, 100, P._smem_per_sm(dev)) == MODERATE_K_TUNING
    if torch.cuda.get_device_capability(dev) == (9, 0):
        assert applies, P._smem_per_sm(dev)
    kw = {"bandwidth": 7.0} if desc.needs_bandwidth else {}
    for M, N, K, col_out in [(129, 127, 65, False), (300, 200, 77, True), (1000, 129, 100, False),
                             (257, 255, 384, False), (6000, 5800, 130, False)]:
        a, b = torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")
        out = poisoned((N, M)).T if col_out else poisoned((M, N))
        km.run_kernel(desc, a, b, out=out, compute_mode=EXACT, **kw)
        rows = slice(0, 64) if M > 1000 else slice(None)
        ref = distance_reference(desc, a[rows].double(), b.double(), bandwidth=kw.get("bandwidth"))
        assert torch.isfinite(out).all(), (M, N, K)
        assert rel(out[rows], ref) <= 1e-6, (M, N, K, applies)
