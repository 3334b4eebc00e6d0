"""The planner without a GPU: kernel plans of CPU tensors with the device queries and the
kernel loader stubbed (the kernels are not run). A repeated call is served from the
template cache and must launch exactly what a fresh plan launches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kermac_like as km
from kermac_like import config
from kermac_like.centring import reference_point
from kermac_like.plan import distance as P
from kermac_like.plan.core import plans as plan_cache
from kermac_like.ops.distance import COMPUTE_MODES, prepare_call
from kermac_like.runtime import launcher, store
from kermac_like.runtime.specs import LOWK_TILES_N


def _normalised(plan):
    """Launches with scratch pointers named (each plan allocates its own scratch, and its
    own zero-padded copies of a and b where K is not a whole number of 16-byte rows)."""
    names = {t.data_ptr(): f"scratch{j}" for j, t in enumerate(plan.scratch[:-1])}
    names.update({t.data_ptr(): k for k, t in plan.scratch[-1].items() if k in ("a", "b")})
    return [(k.spec, grid, tuple(names.get(a, a) if isinstance(a, int) else a for a in args))
            for k, grid, args, *_ in plan.launches]


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    yield "l2 row-major", "l2", r(70, 20), r(50, 20), {}
    yield "l2 low K, the matrix product's NaN/inf", "l2", r(70, 8), r(50, 8), {}
    yield "l1 column-major views", "l1", r(8, 70).mT, r(8, 52).mT, {}
    yield "laplace batch, bandwidth tensor", "laplace_l2", r(2, 3, 40, 16), r(3, 30, 16), {
        "bandwidth": torch.tensor([[1.0], [2.0]]) + torch.zeros(2, 3), "regularization": 0.5}
    yield "p-norm, five batch modes (host loop)", "p_norm", r(2, 1, 2, 3, 2, 9, 4), r(2, 2, 1, 3, 2, 7, 4), {"p": 1.3}
    yield "gaussian, epsilon, offsets", "gaussian_l2", r(33, 5), r(29, 5), {"bandwidth": 2.0, "epsilon": 1e-3,
                                                                          "regularization_offset_x": 3}
    yield "dot, broadcast b", "dot", r(4, 32, 12), r(28, 12), {}


@pytest.mark.parametrize("cap", [(9, 0), (8, 0)], ids=["sm_90", "sm_80"])
@pytest.mark.parametrize("name,preset,a,b,kw", list(_cases()), ids=[c[0] for c in _cases()])
def test_cached_plan_launches_what_a_fresh_plan_launches(as_gpu, cap, name, preset, a, b, kw):
    as_gpu[0] = cap
    mode = COMPUTE_MODES[0]
    call = prepare_call(km.PRESETS[preset], a, b, **kw)
    out = torch.empty(call.out_shape)
    first = P.plan_distance(call, out, mode, False)
    assert first.family != "reference" and first.launches
    assert plan_cache.count("templates") == 1
    second = P.plan_distance(call, out, mode, False)  # from the template
    fresh = P.plan_distance(call, out, mode, True)  # debug: planned from scratch, no cache
    assert _normalised(second) == _normalised(first) == _normalised(fresh)
    # New tensors of the same layout: the template serves them with their own pointers.
    a2, b2, out2 = a.clone().as_strided(a.shape, a.stride()), b + 1, torch.empty_like(out)
    if a2.data_ptr() % 16 != a.data_ptr() % 16 or b2.data_ptr() % 16 != b.data_ptr() % 16:
        pytest.skip("the allocator gave a different alignment")
    call2 = prepare_call(km.PRESETS[preset], a2, b2, **kw)
    cached = P.plan_distance(call2, out2, mode, False)
    assert plan_cache.count("templates") == 1
    assert _normalised(cached) == _normalised(P.plan_distance(call2, out2, mode, True))
    if cap == (9, 0) and preset in ("l2", "dot", "laplace_l2") and call.K > 8:  # rows 16-byte aligned
        assert first.family == "distance_wgmma" and len(first.scratch) > 1
    if call.K <= 8 and preset == "l2":  # autotune.LOWK_MM_UP_TO
        # kMmNonFinite, then kTilesN (LOWK_TILES_N tiles per block)
        assert first.family == "distance_lowk" and first.spec.traits.endswith(f", true, {LOWK_TILES_N}>")
    pointers = {t.data_ptr() for t in (a2, b2, out2)}
    assert pointers & {x for _, _, args, *_ in cached.launches for x in args if isinstance(x, int)}


def test_few_output_tiles_take_the_one_launch_kernel(as_gpu, monkeypatch):
    """By default, float32 tensor-core calls of at most P._FEW_TILES wgmma tiles (and K up
    to P._FEW_TILES_MAX_K; K up to 32 for 3xTF32 distances, whose longer sums take the wgmma
    kernel's partial sums) run mma.sync in one launch; larger ones the wgmma kernel after
    its b preparation (two launches); KERMAC_LIKE_WGMMA=always takes wgmma for all."""
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "1")
    mode = COMPUTE_MODES[0]

    def family(M, N, K, batch=()):
        call = prepare_call(km.PRESETS["l2"], torch.randn(*batch, M, K), torch.randn(*batch, N, K))
        plan = P.plan_distance(call, torch.empty(call.out_shape), mode, False)
        return plan.family, len(plan.launches)

    assert family(256, 256, 20) == ("distance_mma", 1)
    assert family(4 * 128, 2 * 256, 20) == ("distance_mma", 1)  # 8 tiles
    assert family(4 * 128 + 1, 2 * 256, 20)[0] == "distance_wgmma"  # 10 tiles
    assert family(256, 256, 20, batch=(5,))[0] == "distance_wgmma"  # 10 tiles over the batch
    assert family(256, 256, P._FEW_TILES_MAX_K + 4)[0] == "distance_wgmma"
    assert family(256, 256, 32) == ("distance_mma", 1) and family(256, 256, 33)[0] == "distance_wgmma"
    assert family(1000, 700, 20) == ("distance_wgmma", 2)
    assert family(256, 256, 8) == ("distance_lowk", 1)  # K <= 8: autotune.LOWK_MM_UP_TO
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "always")
    assert family(256, 256, 20) == ("distance_wgmma", 2)


def test_copies_and_converted_hyper_parameters_are_not_cached(as_gpu):
    x = torch.randn(40, 6)[:, ::2]  # no unit-stride mode: copied by every call
    call = prepare_call(km.PRESETS["l1"], x, torch.randn(30, 3))
    P.plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[0], False)
    bw = torch.tensor([2.0], dtype=torch.float64)  # converted to float32 by every call
    call = prepare_call(km.PRESETS["laplace_l1"], torch.randn(40, 3), torch.randn(30, 3), bandwidth=bw)
    P.plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[0], False)
    assert not plan_cache.count("templates")


def test_settings_are_part_of_the_key(as_gpu, monkeypatch, set_tf32):
    call = prepare_call(km.PRESETS["l2"], torch.randn(64, 20), torch.randn(40, 20))
    out = torch.empty(call.out_shape)
    assert P.plan_distance(call, out, COMPUTE_MODES[0], False).family == "distance_wgmma"
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0")
    assert P.plan_distance(call, out, COMPUTE_MODES[0], False).family == "distance_mma"
    assert P.plan_distance(call, out, "donot_use_mm_for_euclid_dist", False).family == "distance_lowk"  # K = 20
    set_tf32(True)
    tf32 = P.plan_distance(call, out, COMPUTE_MODES[0], False)
    assert "Precision::Tf32>" in tf32.spec.traits or "Precision::Tf32," in tf32.spec.traits
    assert plan_cache.count("templates") == 4
    assert np.float32(-np.inf) in tf32.launches[-1].args  # no epsilon: the cut is off


@pytest.mark.parametrize("cap", [(9, 0), (8, 0)], ids=["sm_90", "sm_80"])
def test_arg_blocks_hold_the_launch_arguments(as_gpu, cap):
    """A cached template's launches carry ArgBlocks: every argument in its 8-byte slot
    (the launch's own value, narrower types at the slot's start), params[i] pointing at
    slot i, the pointers written by fill()."""
    import ctypes
    import struct

    from kermac_like.runtime.launcher import ArgBlock

    as_gpu[0] = cap
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 70, 8, generator=g), torch.randn(50, 8, generator=g)
    bw = torch.tensor([1.5, 2.5]).view(2, 1, 1)
    call = prepare_call(km.PRESETS["laplace_l2"], a, b, bandwidth=bw, regularization=0.25, epsilon=1e-4)
    out = torch.empty(call.out_shape)
    plans = [P.plan_distance(call, out, COMPUTE_MODES[0], False) for _ in range(2)]
    assert plan_cache.count("templates") == 1
    for plan in plans:
        for k, grid, args, block in plan.launches:
            assert isinstance(block, ArgBlock) and block.kernel is k and block.grid == tuple(grid)
            block.fill(args)
            base = ctypes.addressof(block.slots)
            assert [block.params[i] for i in range(len(args))] == [base + 8 * i for i in range(len(args))]
            for i, v in enumerate(args):
                got = struct.unpack_from(launcher._slot_format(v), block.slots, 8 * i)[0]
                assert got == v or (np.isnan(v) and np.isnan(got)), (i, v, got)
            assert ArgBlock.supports(args, block.positions)
    assert not ArgBlock.supports((np.int32(1), 1.5), ())  # a Python float: left to cuda.core
    fresh = P.plan_distance(call, out, COMPUTE_MODES[0], True)  # debug: planned for one call
    assert all(launch.block is None for launch in fresh.launches)


@pytest.fixture
def recorded(as_gpu, monkeypatch):
    """The launches of each public call, pointers named after the tensors they address."""
    calls = []
    monkeypatch.setattr(launcher, "launch", lambda k, grid, args, debug=False, block=None: calls[-1].append(
        (k.spec, tuple(grid), args, block)))
    return calls


def _named(launches, tensors):
    names = {t.data_ptr(): n for n, t in tensors.items()}
    seen = {}
    out = []
    for spec, grid, args, _ in launches:
        a = []
        for v in args:
            if isinstance(v, int) and v > 4096:  # a pointer
                v = names.get(v) or seen.setdefault(v, f"scratch{len(seen)}")
            a.append(v)
        out.append((spec, grid, tuple(a)))
    return out


def test_repeated_eager_calls_are_served_by_their_call_key(recorded, monkeypatch):
    from kermac_like.ops import distance as D

    validated = []
    full = D.prepare_call
    monkeypatch.setattr(D, "prepare_call", lambda *a, **k: validated.append(1) or full(*a, **k))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(70, 8, generator=g), torch.randn(50, 8, generator=g)
    out = torch.empty(70, 50)
    cases = [
        ("cdist", lambda x, y, o: km.cdist(x, y, out=o)),
        ("cdist p=1", lambda x, y, o: km.cdist(x, y, 1.0, out=o)),
        ("run_kernel laplace", lambda x, y, o: km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=2.0,
                                                            regularization=0.5, out=o)),
    ]
    for name, fn in cases:
        P.clear_templates()
        recorded.append([])
        fn(x, y, out)  # full path: validates, plans, keeps the template under the call's key
        assert plan_cache.count("calls") == 1, name
        x2, y2, out2 = x + 1, y - 1, torch.empty_like(out)  # new data, same layout
        recorded.append([])
        validated.clear()
        fn(x2, y2, out2)
        assert not validated, name  # served by the key: neither validated nor planned again
        first = _named(recorded[-2], {"x": x, "y": y, "out": out})
        served = _named(recorded[-1], {"x": x2, "y": y2, "out": out2})
        assert first and served == first, name
        assert plan_cache.count("calls") == 1 and plan_cache.count("templates") == 1, name
    # Hyper-parameter tensors: the served call reads this call's tensors.
    P.clear_templates()
    for rep in range(2):
        pt, rt = torch.tensor(1.5 + rep), torch.tensor(0.25 + rep)
        recorded.append([])
        validated.clear()
        km.run_kernel(km.PRESETS["p_norm"], x, y, p=pt, regularization=rt, out=out)
        assert bool(validated) == (rep == 0)
        named = _named(recorded[-1], {"x": x, "y": y, "out": out, "p": pt, "reg": rt})
        args = named[-1][2]
        assert "p" in args and "reg" in args and not any(str(v).startswith("scratch") for v in args)
    assert plan_cache.count("calls") == 1
    # What the key holds changes the path: another p, another out layout, a setting.
    P.clear_templates()
    recorded.append([])
    km.cdist(x, y, out=out)
    km.cdist(x, y, 3.0, out=out)
    km.cdist(x, y, out=torch.empty(50, 70).mT)
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0")
    km.cdist(x, y, out=out)
    assert plan_cache.count("calls") == 4
    # Bad input after a warm call still gets its error, and out is left untouched.
    poison = torch.full_like(out, 7.0)
    with pytest.raises(ValueError, match="x2"):
        km.cdist(x, torch.randn(50, 9), out=poison)
    with pytest.raises(TypeError, match="out"):
        km.cdist(x, y, out=poison.double())
    with pytest.raises(ValueError, match="p"):
        km.cdist(x, y, -1.0, out=poison)
    assert (poison == 7.0).all()


def test_call_key_is_not_used_where_the_full_path_must_run(recorded, monkeypatch):
    x, y = torch.randn(70, 100), torch.randn(50, 100)  # K > 64: the tensor cores alone
    recorded.append([])
    km.cdist(x, y, debug=True)  # debug: every decision logged, nothing kept
    # a float64 hyper-parameter tensor (converted to float32 by every call)
    km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=torch.tensor([2.0], dtype=torch.float64))
    km.cdist(x, y, autotune=False)
    monkeypatch.setenv("KERMAC_LIKE_AUTOTUNE", "1")
    km.cdist(x, y)  # one candidate (tensor cores): no timing, but an autotuned key is not kept
    assert not plan_cache.count("calls")


@pytest.mark.parametrize("cap", [(9, 0), (8, 0)], ids=["sm_90", "sm_80"])
def test_self_distance_keeps_one_operand_when_padded(as_gpu, cap):
    """K = 13 (not whole 16-byte rows): the tensor-core kernels read zero-padded copies;
    for K(x, x) both operands must be the one copy, so that the kernels see a == b and
    write the exact zero self-distance diagonal (distance_mma.cuh, distance_wgmma.cuh)."""
    as_gpu[0] = cap
    x = torch.randn(2, 40, 13)
    for rep in range(2):  # the full plan, then its template
        call = prepare_call(km.PRESETS["laplace_l2"], x, x, bandwidth=2.0)
        plan = P.plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[0], False)
        tensors = plan.scratch[-1]
        assert tensors["a"] is tensors["b"] and tensors["a"].shape[-1] == 16
        main = plan.launches[-1].args
        assert main[0] == main[1] == tensors["a"].data_ptr()
    y = x.clone()  # equal values, other memory: two copies
    call = prepare_call(km.PRESETS["laplace_l2"], x, y, bandwidth=2.0)
    plan = P.plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[0], False)
    assert plan.scratch[-1]["a"] is not plan.scratch[-1]["b"]


@pytest.mark.parametrize("cap", [(9, 0), (8, 0)], ids=["sm_90", "sm_80"])
def test_simt_calls_read_kmajor_copies_of_row_major_operands(as_gpu, settings, cap):
    """Large SIMT calls read m-contiguous copies of k-contiguous operands (16-byte cp.async in
    place of 4-byte transposing copies): the spec takes column-major inputs with kVec 4, the
    copies hold the operands' values with 16-byte aligned columns, K(x, x) copies x once, the
    template makes the copies anew for each call, and a small call reads its operands as they are."""
    as_gpu[0] = cap
    settings(distance_tune=P.Tune(kmajor_min_out=1000, kmajor_min_rows=32, kmajor_max_share=1 / 8))
    mode = COMPUTE_MODES[0]
    x, y = torch.randn(70, 160), torch.randn(50, 160)  # K = 160: the SIMT kernel for p = 1 (beyond the low-K stream)
    call = prepare_call(km.PRESETS["l1"], x, y)
    out = torch.empty(call.out_shape)
    first = P.plan_distance(call, out, mode, False)
    assert first.family == "distance"
    tuning = ", 41, 16, 2" if cap == (9, 0) else ""  # the moderate-K tuning where two blocks fit an SM
    assert first.spec.traits.count("Layout::ColMajor") == 2 and first.spec.traits.endswith(f"Layout::RowMajor, 4{tuning}>")
    ta, tb = first.scratch[-1]["a"], first.scratch[-1]["b"]
    for t, src in ((ta, x), (tb, y)):
        assert t.stride(-2) == 1 and t.stride(-1) % 4 == 0 and t.data_ptr() % 16 == 0 and torch.equal(t, src)
    assert first.launches[-1].args[0] == ta.data_ptr() and first.launches[-1].args[6] == ta.stride(-1)
    second = P.plan_distance(prepare_call(km.PRESETS["l1"], x + 1, y), out, mode, False)  # from the template
    assert plan_cache.count("templates") == 1 and torch.equal(second.scratch[-1]["a"], x + 1)
    assert _normalised(second) == _normalised(first) == _normalised(P.plan_distance(call, out, mode, True))
    same = P.plan_distance(prepare_call(km.PRESETS["l1"], x, x), torch.empty(70, 70), mode, False)
    assert same.scratch[-1]["a"] is same.scratch[-1]["b"]
    small = P.plan_distance(prepare_call(km.PRESETS["l1"], x[:20], y), torch.empty(20, 50), mode, False)
    assert small.spec.traits.count("Layout::RowMajor") == 3 and small.scratch[-1]["a"].data_ptr() == x.data_ptr()
    # Copies of more than a quarter of the output's elements are not made (70 x 50 out, K = 160).
    settings(distance_tune=P.Tune(kmajor_min_out=1000, kmajor_min_rows=32))
    big_k = P.plan_distance(call, out, mode, True)
    assert big_k.spec.traits.count("Layout::RowMajor") == 3


@pytest.mark.parametrize("cap,fits", [((9, 0), True), ((8, 0), False), ((8, 6), False)])
def test_moderate_k_tuning_where_two_blocks_fit(as_gpu, cap, fits):
    """The SIMT kernel's tuning: for |x - y| and (x - y)^2 sums with 64 < K <= 384, two blocks
    per SM with 16-wide k steps where two such blocks fit one SM's shared memory (sm_90, not
    sm_80 or sm_86); beyond 384, fractional p and dot products keep their tunings."""
    from kermac_like.runtime.specs import MODERATE_K_MAX, distance_launch

    as_gpu[0] = cap
    assert (2 * (distance_launch(16, 2).smem_bytes + 1024) <= P._smem_per_sm(0)) is fits
    mode = "donot_use_mm_for_euclid_dist"  # the exact kernels for the Euclidean presets too

    def traits(name, K, **kw):
        call = prepare_call(km.PRESETS[name], torch.randn(70, K), torch.randn(50, K), **kw)
        plan = P.plan_distance(call, torch.empty(call.out_shape), mode, False)
        assert plan.family == "distance"
        return plan.spec.traits

    from kermac_like.runtime.specs.distance_lowk import LOWK_CHUNKED_UP_TO

    for name in ("l1", "l2", "laplace_l2", "gaussian_l2"):
        kw = {"bandwidth": 2.0} if name.endswith("_l2") and name != "l2" else {}
        # (p = 1 up to LOWK_CHUNKED_UP_TO takes the low-K chunk stream: test_chunk_stream_switch)
        lowest = LOWK_CHUNKED_UP_TO + 1 if name == "l1" else 65
        for K in (lowest, 200, MODERATE_K_MAX):
            assert traits(name, K, **kw).endswith(", 1, 41, 16, 2>" if fits else ", 1>"), (name, K)
        assert traits(name, MODERATE_K_MAX + 1, **kw).endswith(", 1>")
    assert traits("p_norm", 100, p=1.5).endswith(", 48, 16, 2>")  # its own tuning at every K
    assert traits("dot", 100).endswith(", 1>")


@pytest.mark.parametrize("shape", [(48, 5), (2, 3, 50, 7), (1, 1)])
def test_kmajor_copy(shape):
    """plan.distance._kmajor: the values of t, m-contiguous, every column 16-byte aligned (rows padded
    to a multiple of 4 where needed); an already m-contiguous aligned operand is used as is."""
    t = torch.randn(*shape)
    c = P._kmajor(t)
    assert torch.equal(c, t) and c.stride(-2) == 1 and c.stride(-1) % 4 == 0 and c.data_ptr() % 16 == 0
    assert P._kmajor(c) is c


def test_spec_override_keeps_its_templates_apart(as_gpu):
    """plan.distance.spec_override: a replaced spec function gets its own templates (the template
    key holds every call property but the spec), the original ones come back after the
    block, and an unknown name is refused."""
    mode = COMPUTE_MODES[0]
    a, b = torch.randn(300, 37), torch.randn(2000, 37)
    call = prepare_call(km.PRESETS["l1"], a, b)
    out = torch.empty(call.out_shape)
    shipped = P.plan_distance(call, out, mode, False)
    assert shipped.family == "distance_lowk"
    orig = P.lowk_spec
    one_tile = lambda *x, **y: orig(*x, **{**y, "tiles_n": 1})  # noqa: E731
    with P.spec_override(lowk_spec=one_tile):
        inside = P.plan_distance(call, out, mode, False)
        assert inside.spec.traits.endswith(", 37>") and inside.spec != shipped.spec
        assert P.plan_distance(call, out, mode, False).spec == inside.spec  # its own template, reused
        with P.spec_override(lowk_tiles_n=lambda *x: 4):  # nested: both replacements
            assert P.plan_distance(call, out, mode, False).spec == inside.spec  # lowk_spec still forces 1
    assert config.get("distance_tune") is None
    assert P.plan_distance(call, out, mode, False).spec == shipped.spec
    with P.spec_override(lowk_tiles_n=lambda *x: 4):
        assert P.plan_distance(call, out, mode, False).spec.traits.endswith(", 4>")
    with pytest.raises(ValueError, match="no_such_name.*lowk_spec, lowk_tiles_n"):
        with P.spec_override(no_such_name=1):
            pass


def test_chunk_stream_switch(as_gpu, monkeypatch, settings):
    """specs.distance_lowk.LOWK_CHUNKED_UP_TO (the switch; LOWK_MAX_K: off): cdist p=1 at
    64 < K <= it plans the low-K chunk stream (kChunksK = ceil(K / 32), kK rounded up to whole
    chunks), beyond it and with the switch off the SIMT kernel; the matrix-product mode and
    the other descriptor classes keep their kernels; the first-call tier serves a call
    whose stream kernel is not at hand with the generic variant."""
    from kermac_like.plan import autotune
    from kermac_like.runtime.specs import distance_lowk as DL

    mode = COMPUTE_MODES[0]

    def plan(name, K, rows=70, **kw):
        call = prepare_call(km.PRESETS[name], torch.randn(rows, K), torch.randn(rows - 20, K), **kw)
        return P.plan_distance(call, torch.empty(call.out_shape), mode, False)

    # shipped: the stream up to 128 (ahead of the SIMT kernel at K = 100 and 128 on an H100), SIMT beyond
    assert DL.LOWK_CHUNKED_UP_TO == 128
    assert plan("l1", 100).family == "distance_lowk" and plan("l1", 129).family == "distance"
    assert DL.lowk_chunks(128) == 4 and DL.lowk_chunks(129) == 0
    assert autotune.default_choice(km.preset("l1"), torch.float32, 100, mode) != "simt"
    assert autotune.default_choice(km.preset("l1"), torch.float32, 129, mode) == "simt"
    monkeypatch.setattr(DL, "LOWK_CHUNKED_UP_TO", DL.LOWK_MAX_K)  # off
    P.clear_templates()
    assert plan("l1", 100).family == "distance"
    assert DL.lowk_chunks(100) == 0 and autotune.default_choice(km.preset("l1"), torch.float32, 100, mode) == "simt"
    monkeypatch.setattr(DL, "LOWK_CHUNKED_UP_TO", 256)
    P.clear_templates()
    assert [DL.lowk_chunks(k) for k in (37, 64, 65, 100, 128, 200, 256, 257)] == [1, 1, 3, 4, 4, 7, 8, 0]
    assert [DL.lowk_bucket(k) for k in (65, 100, 128, 200, 256, 257)] == [66, 100, 128, 203, 256, 0]
    for K, tail in ((65, ", 66, 2, 16, true, false, 2, 3>"), (100, ", 100, 2, 16, true, false, 2, 4>"),
                    (200, ", 203, 2, 16, true, false, 2, 7>")):
        p = plan("l1", K)
        assert p.family == "distance_lowk" and p.spec.traits.endswith(tail), (K, p.spec.traits)
        assert p.spec.launch.smem_bytes <= 2 * (32 * 132 + 33 * 132) * 4  # two blocks per SM, sm_80 too
    assert DL.lowk_tiles_n(100, 20000, 20000, 1, 2 * 132) == 8  # 157 x 20 blocks of 8 tiles
    assert plan("l1", 257).family == "distance"
    assert plan("l2", 100).family != "distance_lowk"  # the matrix-product mode: tensor cores
    assert plan("p_norm", 100, p=1.5).family == "distance"  # LOWK_UP_TO["pow"]
    # the first call of a stream kernel not yet compiled: the generic variant serves it
    settings(jit_tier=True)
    monkeypatch.setattr(store, "available", lambda spec, device: spec.traits.endswith(", 0>"))
    P.clear_templates()
    assert plan("l1", 100).spec.traits.endswith(", 0>")


@pytest.mark.parametrize("cap", [(9, 0), (8, 0)], ids=["sm_90", "sm_80"])
@pytest.mark.parametrize("K", [16, 13])
def test_tensor_core_operands_are_centred(as_gpu, cap, K):
    """Float32 DIFF calls on tensor cores read a and b shifted by the reference point (per
    column, the median of b's rows), zero-padded where K needs it, the full plan and its template
    alike; K(x, x) still reads one copy; a column holding an infinity is not shifted;
    DOT calls and 16-bit data read their operands unshifted."""
    as_gpu[0] = cap
    x, y = torch.randn(40, K) + 1000, torch.randn(30, K) + 1000
    y[3, 2] = float("inf")
    s = torch.cat([y, x]).nanmedian(0).values  # one of the data's values per column;
    s[2] = 0  # not in column 2, which holds an inf (torch's inf * 0 = NaN kept)
    for rep in range(2):
        call = prepare_call(km.PRESETS["l2"], x, y)
        plan = P.plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[1], False)
        a, b = plan.scratch[-1]["a"], plan.scratch[-1]["b"]
        assert a.shape[-1] == b.shape[-1] == 16
        assert torch.equal(a[:, :K], x - s) and torch.equal(reference_point(y, x), s) and not a[:, K:].any()
        assert b[3, 2] == float("inf") and abs(float(b[:, [0, 1, 3]].mean())) < 1 and torch.equal(b[:, 2], y[:, 2])
        main = plan.launches[-1].args
        assert main[0] == a.data_ptr()
        # the near pairs' direct differences read the operands as given (ABI.md: a0, b0, k0, strides)
        assert list(main[-13:-6]) == [x.data_ptr(), y.data_ptr(), K, K, 1, K, 1]
    same = P.plan_distance(prepare_call(km.PRESETS["l2"], x, x), torch.empty(40, 40), COMPUTE_MODES[1], False)
    assert same.scratch[-1]["a"] is same.scratch[-1]["b"] and abs(float(same.scratch[-1]["a"].mean())) < 1
    dot = P.plan_distance(prepare_call(km.PRESETS["dot"], x, y), torch.empty(40, 30), COMPUTE_MODES[1], False)
    assert float(dot.scratch[-1]["a"][:, :K].mean()) > 900 and dot.launches[-1].args[-13] == 0
    half = P.plan_distance(prepare_call(km.PRESETS["l2"], x.half(), y.half()), torch.empty(40, 30).half(),
                           COMPUTE_MODES[1], False)
    assert float(half.scratch[-1]["a"][:, :K].float().mean()) > 900
