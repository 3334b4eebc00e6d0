"""CPU-only tests of cuda_templates/distance_lowk.cuh (the low-K kernel).

* NVRTC: representative instantiations compile for sm_80 and sm_90 with the launch
  constants the Python mirror states (render.lowk_spec), 16-byte streaming stores in
  the SASS, and the kernel choice's building blocks (buckets).
* CPU execution of the real kernel through the g++ shim of test_templates_distance
  (each CUDA thread a std::thread): compile-time K (exact and zero-filled), the generic
  run-time-K variant, both input layouts, odd shapes, batch broadcast, tensor
  hyper-parameters, the regularised diagonal and epsilon, against float64.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from cpu_shim import build_cpu_runner

import test_templates_distance as td
from kermac_like.runtime import specs as render
from kermac_like.runtime.compiler import compile_specs
from kermac_like.descriptor import PRESETS
from kermac_like.layout import Layout

ROW, COL = Layout.ROW_MAJOR, Layout.COL_MAJOR

# (descriptor, a layout, b layout, kK): the CPU instances. The output is row-major
# (the launcher computes a column-major out as out^T).
LOWK_INSTANCES = [
    (("Diff", "Abs", "Noop", "None"), "RowMajor", "RowMajor", 3),
    (("Diff", "Square", "Sqrt", "Laplace"), "RowMajor", "ColMajor", 8),
    (("Diff", "Square", "Sqrt", "Gaussian"), "ColMajor", "RowMajor", 40),
    (("Diff", "Pow", "Pow", "None"), "RowMajor", "RowMajor", 5),
    (("Dot", "Noop", "Noop", "None"), "ColMajor", "ColMajor", 16),
    (("Diff", "Abs", "Noop", "Laplace"), "RowMajor", "RowMajor", 0),
    (("Diff", "Square", "Noop", "None"), "ColMajor", "RowMajor", 0),
    # wide tiles (kThreadsN 64: 32 x 512, 32: 64 x 256)
    (("Diff", "Square", "Sqrt", "None"), "RowMajor", "RowMajor", 3, 2, 64),
    (("Diff", "Abs", "Noop", "Gaussian"), "ColMajor", "RowMajor", 0, 2, 32),
    # kMmNonFinite: torch.cdist's matrix-product NaN/inf (test_lowk_cpu_mm_nonfinite)
    (("Diff", "Square", "Sqrt", "None"), "RowMajor", "RowMajor", 3, 2, 32, "true", "true"),
    # kTilesN > 1 (tiles side by side along n, b's next tile through cp.async): K = 37
    # p=1 with 4 tiles; kMmNonFinite with a column-major b; a column-major a, wide tiles
    (("Diff", "Abs", "Noop", "None"), "RowMajor", "RowMajor", 37, 2, 16, "true", "false", 4),
    (("Diff", "Square", "Sqrt", "None"), "RowMajor", "ColMajor", 8, 2, 16, "true", "true", 2),
    (("Diff", "Square", "Sqrt", "Gaussian"), "ColMajor", "RowMajor", 5, 2, 32, "true", "false", 3),
    # kChunksK > 1 (the chunk stream: (tile, chunk) steps through two stages, k >= K
    # zero-filled by the copies): p=1 K = 100 in 4 chunks of 25, 2 tiles (the planner's shape
    # beyond K = 64); column-major operands (the zero-filled column copies), 2 chunks, 3 tiles
    (("Diff", "Abs", "Noop", "None"), "RowMajor", "RowMajor", 100, 2, 16, "true", "false", 2, 4),
    (("Diff", "Square", "Sqrt", "Laplace"), "ColMajor", "ColMajor", 38, 2, 16, "true", "false", 3, 2),
]
MM_IDX = 9
MM_TILES_IDX = 11
CHUNK_IDX = (13, 14)
# run_on_cpu's view of them: (descriptor, a, b, out, kVec)
AS_DISTANCE = [(inst[0], inst[1], inst[2], "RowMajor", 1) for inst in LOWK_INSTANCES]


@pytest.fixture(scope="module")
def lowk_runner(tmp_path_factory):
    src = td.SHIM
    for old, new in (
        ('#include "distance.cuh"', '#include "distance_lowk.cuh"'),
        ("namespace distance_detail {\nalignas(16) float kl_distance_smem[1 << 16];",
         "namespace lowk_detail {\nalignas(16) float kl_lowk_smem[1 << 16];"),
        ("distance_kernel<Tr>(", "distance_lowk_kernel<Tr>("),
        ("#define D(i, ip, op, ep, la, lb, lo, v, ...) DistanceTraits<Inner::i, Power::ip, Power::op, Epilogue::ep, \\\n"
         "    Layout::la, Layout::lb, Layout::lo, v __VA_OPT__(,) __VA_ARGS__>",
         "#define D(i, ip, op, ep, la, lb, kk, ...) DistanceLowKTraits<Inner::i, Power::ip, Power::op, Epilogue::ep, \\\n"
         "    Layout::la, Layout::lb, kk __VA_OPT__(,) __VA_ARGS__>"),
    ):
        assert old in src, old
        src = src.replace(old, new)
    inst, cases = [], []
    for idx, ((i, ip, op, ep), la, lb, kk, *extra) in enumerate(LOWK_INSTANCES):
        tail = "".join(f", {x}" for x in extra)
        inst.append(f"using T{idx} = D({i}, {ip}, {op}, {ep}, {la}, {lb}, {kk}{tail});")
        cases.append(f"    case {idx}: run<T{idx}>(buf, h, hf, gz); break;")
    src = src.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "lowk_cpu", src)


def _run(exe, idx, M, N, K, **kw):
    kk = LOWK_INSTANCES[idx][3]
    assert kk == 0 or K <= kk
    return td.run_on_cpu(exe, idx, M, N, K, instances=AS_DISTANCE, **kw)


def _tol(idx):
    return 2e-6 if LOWK_INSTANCES[idx][0][1] == "Pow" else 1e-6


def _k(idx, default):
    return LOWK_INSTANCES[idx][3] or default


@pytest.mark.parametrize("idx", range(len(LOWK_INSTANCES)))
@pytest.mark.parametrize("M,N", [(1, 1), (7, 129), (130, 5), (257, 531)])
def test_lowk_cpu_odd_shapes(lowk_runner, idx, M, N):
    K = _k(idx, 97)
    got, ref = _run(lowk_runner, idx, M, N, K, pad=(3, 1, 2), seed=M * 1000 + N)
    assert td.rel_fro(got, ref) <= _tol(idx)


@pytest.mark.parametrize("idx", [1, 2, 4, 6, 7, 10, 11, 12, *CHUNK_IDX])
def test_lowk_cpu_k_below_the_compiled_k_is_zero_filled(lowk_runner, idx):
    K = max(1, _k(idx, 37) - 3)
    got, ref = _run(lowk_runner, idx, 70, 90, K, pad=(1, 0, 0), seed=K)
    assert td.rel_fro(got, ref) <= _tol(idx)


@pytest.mark.parametrize("idx", [0, 1, 3, 5, 7, 8, 10, 12, 14])
def test_lowk_cpu_batch_broadcast_diagonal_and_hyper_tensors(lowk_runner, idx):
    # 2 x 1 x 3 batch, b broadcast over mode 0, grid_z smaller than the batch, a tensor
    # regularisation over mode 2 on several diagonals, a tensor bandwidth over mode 0.
    for reg_diag in (-5, 0, 70, -200):
        got, ref = _run(lowk_runner, idx, 150, 140, _k(idx, 40), batch=(2, 1, 3), b_bcast=(0,), pad=(1, 2, 5),
                        lam=0.75, lam_tensor=True, bw_tensor=True, reg_diag=reg_diag, grid_z=2, seed=reg_diag + 300)
        assert td.rel_fro(got, ref) <= _tol(idx), reg_diag


@pytest.mark.parametrize("idx", [0, 2, 3, 4])
def test_lowk_cpu_epsilon_and_scalar_regularisation(lowk_runner, idx):
    got, ref = _run(lowk_runner, idx, 40, 50, _k(idx, 3), eps=1.0, lam=2.0, reg_diag=3, seed=3)
    assert td.rel_fro(got, ref) <= _tol(idx)


@pytest.mark.parametrize("idx", [0, 3, 5, 13])
def test_lowk_cpu_identical_rows_give_exact_zero(lowk_runner, idx):
    got, ref = _run(lowk_runner, idx, 70, 70, _k(idx, 37), seed=5, b_equals_a=True)
    diag = np.diagonal(got, axis1=-2, axis2=-1)
    assert np.array_equal(diag, np.diagonal(ref, axis1=-2, axis2=-1).astype(np.float32)), diag


@pytest.mark.parametrize("idx", [MM_IDX, MM_TILES_IDX])
def test_lowk_cpu_mm_nonfinite(lowk_runner, idx):
    """kMmNonFinite: pairs with an infinite, NaN or overflowing coordinate come out as
    torch.cdist's matrix product has them (|x|^2 + |y|^2 - 2 x.y in IEEE float32: inf - inf
    and inf * 0 give NaN), every other pair as the direct (exact) sum; the flagged rows
    (3, 5, 7 of a; 2, 4 of b) lie in the first row tile of 64, the second has none.
    MM_TILES_IDX (two 128-column tiles per block): b's row 200 is flagged in the second
    tile of the first block (the cp.async copy's flag), rows 260.. of the second block none."""
    tiles = idx == MM_TILES_IDX
    M, N, K, seed = 130, 300 if tiles else 50, 3, 11
    bad = (("a", 3, 0, np.inf), ("a", 5, 1, -np.inf), ("b", 2, 0, np.inf), ("b", 4, 2, np.nan),
           ("a", 7, 1, 3e19), ("a", 9, 0, np.nan)) + ((("b", 200, 1, -np.inf),) if tiles else ())
    got, _ = _run(lowk_runner, idx, M, N, K, seed=seed, nonfinite=bad)
    rng = np.random.default_rng(seed)  # run_on_cpu's data
    a = rng.standard_normal((1, 1, 1, M, K)).astype(np.float32)
    b = rng.standard_normal((1, 1, 1, N, K)).astype(np.float32)
    for which, r, k, v in bad:
        (a if which == "a" else b)[..., r, k] = v
    a, b = a[0, 0, 0], b[0, 0, 0]
    with np.errstate(all="ignore"):
        d2 = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None, :] - np.float32(2) * (a @ b.T)
        want = np.sqrt(np.maximum(d2, np.float32(0)))
        direct = np.sqrt(((a[:, None, :].astype(np.float64) - b[None, :, :]) ** 2).sum(-1))
    got = got.reshape(M, N)
    assert np.array_equal(np.isnan(got), np.isnan(want)), np.argwhere(np.isnan(got) != np.isnan(want))[:5]
    assert np.array_equal(np.isposinf(got), np.isposinf(want))
    assert np.isnan(got[3, 2]) and np.isposinf(got[7, 0])  # inf - inf; an overflowing square
    assert np.isnan(got[5]).any() and np.isposinf(got[5]).any()  # -inf: the sign rule of the product
    if tiles:
        assert not np.isfinite(got[:, 200]).any()  # |y|^2 = inf: +inf or NaN in every row
    fin = np.isfinite(want)
    flagged = np.zeros((M, N), bool)
    flagged[[3, 5, 7, 9], :] = True
    flagged[:, [2, 4, 200] if tiles else [2, 4]] = True
    exact = fin & ~flagged  # the direct sum, also inside the flagged tile
    assert np.abs(got[exact] - direct[exact]).max() <= 1e-6 * direct[exact].max()


# ------------------------------------------------------------------ NVRTC, SASS
def test_buckets():
    assert [render.lowk_bucket(k) for k in (0, 1, 3, 8, 9, 37, 64)] == [1, 1, 3, 8, 9, 37, 64]
    # beyond LOWK_MAX_K: the chunk stream's kK (whole chunks of <= 32) up to LOWK_CHUNKED_UP_TO, then 0 (run-time K)
    from kermac_like.runtime.specs.distance_lowk import LOWK_CHUNKED_UP_TO

    assert LOWK_CHUNKED_UP_TO == 128
    assert [render.lowk_bucket(k) for k in (65, 100, 128, 129, 256)] == [66, 100, 128, 0, 0]
    # kTilesN tiles per block (the grid's block_n): LOWK_TILES_N at compile-time K, 1 at run time
    s = render.lowk_spec(PRESETS["l1"], ROW, ROW, 37, tiles_n=4)
    assert s.traits.endswith(", 37, 2, 16, true, false, 4>") and s.launch.block_n == 512
    s = render.lowk_spec(PRESETS["l1"], ROW, ROW, 37)
    assert s.traits.endswith(f", 37, 2, 16, true, false, {render.LOWK_TILES_N}>")
    assert s.launch.block_n == 128 * render.LOWK_TILES_N
    assert render.lowk_spec(PRESETS["l1"], ROW, ROW, 200).traits.endswith(", 0>")
    assert render.lowk_spec(PRESETS["l1"], ROW, ROW, 37, tiles_n=1).traits.endswith(", 37>")
    with pytest.raises(ValueError):
        render.lowk_spec(PRESETS["l1"], ROW, ROW, 200, tiles_n=2)


def test_tiles_per_block_keep_the_gpu_filled():
    wave = 2 * 132  # two blocks per SM on an H100/H200
    assert render.lowk_tiles_n(37, 20000, 20000, 1, wave) == 8  # 157 x 20 blocks: 12 waves
    assert render.lowk_tiles_n(64, 8000, 8000, 1, wave) == render.LOWK_TILES_N  # 8 tiles: 504 blocks
    assert render.lowk_tiles_n(37, 4000, 20000, 1, wave) == 4  # 32 x 40 blocks with 4 tiles
    assert render.lowk_tiles_n(16, 256, 256, 1000, wave) == 8  # a batch fills the GPU too
    assert render.lowk_tiles_n(37, 100, 100, 1, wave) == render.LOWK_TILES_N
    assert render.lowk_tiles_n(8, 20000, 20000, 1, wave) == render.LOWK_TILES_N  # K <= 8: 2 tiles
    assert render.lowk_tiles_n(100, 20000, 20000, 1, wave) == 8  # the chunk stream: as compile-time K
    assert render.lowk_tiles_n(200, 20000, 20000, 1, wave) == 1  # run-time K: one tile


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_chunk_stream_compiles_without_spills_in_the_k_loop(arch):
    """The chunk stream at the planner's K = 100 shape (4 chunks of 25, 8 tiles): two blocks per
    SM (128 registers), its mirrored launch (compile_specs' static_asserts), at most two spilled
    words (NVRTC 13.5: 8 B on sm_80 and sm_90 at K = 65..256, outside the k loop)."""
    s = render.lowk_spec(PRESETS["l1"], ROW, ROW, 100, tiles_n=8, chunks=4)
    assert s.traits.endswith(", 100, 2, 16, true, false, 8, 4>") and s.launch.smem_bytes == 2 * (25 * 132 + 26 * 132) * 4
    _, resources = compile_specs([s], arch)
    r = resources[s.name_expression]
    assert r["registers"] <= 128 and r["spill_stores"] <= 8, r


@pytest.fixture(scope="module")
def lowk_sm90():
    specs = [render.lowk_spec(PRESETS["l1"], ROW, ROW, 3), render.lowk_spec(PRESETS["laplace_l2"], ROW, COL, 37),
             render.lowk_spec(PRESETS["gaussian_l2"], COL, ROW, 200),  # run-time K (the generic variant)
             render.lowk_spec(PRESETS["l1"], ROW, ROW, 37, tiles_n=1)]  # the single-tile path at compile-time K
    record, resources = compile_specs(specs, "sm_90")
    return specs, record, resources


def test_lowk_compiles_with_its_mirrored_launch_and_at_most_a_few_spilled_words(lowk_sm90):
    # compile_specs' stub static_asserts kThreads/kBlockM/kBlockN/kSmemBytes against the mirror.
    specs, _, resources = lowk_sm90
    for s in specs:
        r = resources[s.name_expression]
        assert r["registers"] <= 128, r  # two blocks per SM
        assert r["spill_stores"] <= 32, r  # a few words around the loads/epilogue, none in the k loop


def test_lowk_sass_streams_16_byte_stores(lowk_sm90):
    _, record, _ = lowk_sm90
    tool = td.cuobjdump_path()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "lowk.cubin"
        path.write_bytes(record.cubin)
        sass = subprocess.run([tool, "-sass", str(path)], check=True, capture_output=True, text=True).stdout
    assert "STG.E.EF.128" in sass or "STG.E.128.EF" in sass or ".EF.128" in sass, "no 16-byte evict-first stores"
