"""Tests of cuda_templates/distance_wgmma.cuh, the Hopper (sm_90a, wgmma) distance kernel.

CPU (CI):
  * NVRTC compiles a representative set for sm_90a through the package's own
    renderer (so the Python mirror of the launch constants is checked too): no
    spills, no local memory, HGMMA.64x256x8.F32.TF32 with A from registers in the
    SASS (6 per k-tile for Tf32x3, 2 for Tf32; the k-loop is unrolled twice),
    cp.async copies that signal an mbarrier, setmaxnreg, and no wgmma serialisation
    warning for the 3xTF32 builds.
  * Plain sm_90 rejects the kernel (wgmma needs sm_90a); impossible
    combinations fail with their static_assert message.
  * Models of what cannot run here: the shared-memory layout written by the
    copies vs the layout the wgmma descriptor reads (64-byte swizzle, K-major),
    the ldmatrix addresses vs the wgmma A-fragment layout, the mbarrier
    protocol (no stage is rewritten while a reader may still use it, every read
    finds its data landed, no wait can deadlock), and the batch-entry indexing of
    the prepared b (B small, norms) written by wgmma_prepare_b_kernel.
  * The selection in kermac_like.plan.distance uses it on sm_90 unless KERMAC_LIKE_WGMMA=0.
GPU (marker gpu, sm_90 only): the float64 checks of bench/probes/try_wgmma.py; marker
slow as well: the two bench workloads.
"""
import io
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from kermac_like.descriptor import PRESETS
from kermac_like.layout import Layout
from kermac_like.runtime.specs import (
    WGMMA_LAUNCH,
    WGMMA_PREPARE_LAUNCH,
    WGMMA_PREPARE_TILE,
    render_source,
    wgmma_prepare_needs,
    wgmma_prepare_spec,
    wgmma_traits_spec,
)

try:
    from cuda.core import Program, ProgramOptions
except ImportError:  # cuda.core < 0.4
    from cuda.core.experimental import Program, ProgramOptions

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "cuda_templates"
NS = "kermac_like::"

# Representative set: p=2, squared, Laplace, Gaussian (3xTF32 distances: chunked, the default),
# DOT, both output layouts, plain TF32, and p=2 with one running sum or partial sums of one k-tile
# (setting wgmma_chunk 0 and 1).
SPECS = [
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, chunk=2),
    wgmma_traits_spec(PRESETS["squared_l2"], Layout.COL_MAJOR, chunk=2),
    wgmma_traits_spec(PRESETS["laplace_l2"], Layout.ROW_MAJOR, chunk=2),
    wgmma_traits_spec(PRESETS["gaussian_l2"], Layout.COL_MAJOR, chunk=2),
    wgmma_traits_spec(PRESETS["dot"], Layout.ROW_MAJOR),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, tf32=True),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, chunk=1),
]
# The 128 x 192 tiles and the 128 x 256 tiles summed column half by column half, with partial sums
# (setting wgmma_tile 192 and 256; not shipped while the default is 128).
WIDE = [
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, chunk=2, tile=192),
    wgmma_traits_spec(PRESETS["laplace_l2"], Layout.ROW_MAJOR, chunk=2, tile=192),
    wgmma_traits_spec(PRESETS["squared_l2"], Layout.COL_MAJOR, chunk=2, tile=192),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, chunk=1, tile=192),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, chunk=2, tile=256),
    wgmma_traits_spec(PRESETS["laplace_l2"], Layout.ROW_MAJOR, chunk=2, tile=256),
    wgmma_traits_spec(PRESETS["gaussian_l2"], Layout.COL_MAJOR, chunk=2, tile=256),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, chunk=1, tile=256),
]


def compile_cubin(source, names, arch):
    log = io.StringIO()
    options = ProgramOptions(arch=arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    obj = Program(source, "c++", options).compile("cubin", name_expressions=names, logs=log)
    return bytes(obj.code), log.getvalue()


_MMA = []


def _mma():
    """tests/test_templates_mma.py (its SASS helpers), loaded once."""
    if not _MMA:
        mma_tests = importlib.util.spec_from_file_location("_mma_tests", ROOT / "tests" / "test_templates_mma.py")
        mod = importlib.util.module_from_spec(mma_tests)
        mma_tests.loader.exec_module(mod)
        _MMA.append(mod)
    return _MMA[0]


def _sass(cubin):
    """SASS text per function, or skip when cuobjdump/nvdisasm are missing."""
    mod = _mma()
    return mod.sass_functions(mod.sass_of(cubin))


def built(shipped, specs, arch="sm_90"):
    """{spec: (SASS text, ptxas report)}: the shipped specs from the session's shipped build
    (conftest ``shipped``), the others compiled here."""
    mod = _mma()
    return {s: (mod.sass_functions(shipped.sass(cubin, mod.sass_of))[lowered], report)
            for s, (cubin, lowered, report) in shipped.kernels(specs, arch).items()}


# ---------------------------------------------------------------- compile tests


def test_compiles_for_sm90a_with_hgmma_and_no_spills(shipped):
    assert all(s.arch_suffix == "a" for s in SPECS)
    build = built(shipped, SPECS)
    assert len(build) == len(SPECS)
    reports = [r for _, r in build.values()]
    assert all(r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in reports), reports
    regs = [r["registers"] for r in reports]
    assert max(regs) <= 255, reports
    # ptxas: "wgmma.mma_async instructions are serialized ... in the function <name>": the
    # 3xTF32 builds keep two k-tiles of wgmma in flight; the plain TF32 build is serialised
    # by ptxas (still faster than the previous design: bench/notes/wgmma.md).
    serialised = [s.name_expression for s, (_, r) in build.items() if any("serialized" in a for a in r.get("advisories", ()))]
    assert all("Tf32x3" not in f for f in serialised), serialised
    assert len(serialised) <= 1, serialised
    functions = {s.name_expression: text for s, (text, _) in build.items()}
    counts = []
    for name, text in functions.items():
        assert "LDL" not in text and "STL" not in text, f"local memory in {name}"
        assert "LDGSTS" in text and "ARRIVES.LDGSTSBAR" in text, f"no cp.async -> mbarrier in {name}"
        assert "UBLKCP.S.G.MULTICAST" in text and "UCGABAR_WAIT" in text, f"no b multicast / cluster sync in {name}"
        assert "USETMAXREG" in text and "LDSM" in text, name
        assert not re.search(r"\bHMMA\b", text), f"mma.sync left in {name}"
        # A from registers: "HGMMA.64x256x8.F32.TF32 R24, R152, gdesc[...]" (64x128 chunked)
        width = 128 if re.search(r", [12]>>$", name) else 256
        hgmma = re.findall(rf"HGMMA\.64x{width}x8\.F32\.TF32 R\d+, (\S+),", text)
        assert hgmma and all(a.startswith("R") for a in hgmma), (name, hgmma[:3])
        counts.append(len(hgmma))
    assert sorted(counts) == [4] + [12] * 7, counts  # 2 k-tiles x 2 k-steps x 3 products (Tf32x3) or 1 (Tf32)
    print(f"sm_90a: registers {regs}")


def test_wide_tiles_keep_the_k_loop_in_registers(shipped):
    """The 128 x 192 tiles (setting wgmma_tile 192: HGMMA.64x192x8, 12 per two k-tiles) and the
    128 x 256 tiles summed by column halves (256: HGMMA.64x128x8, 12 per half of a chunk of two
    k-tiles), A from registers, setmaxnreg 240 for the consumers (96 + 96, or 128 + 64, accumulators
    and 32 fragment registers) and 24 for the loader, and no local memory from the first HGMMA to
    the k-loop's last wait. ptxas spills a few values of the epilogue (192) and of the loader (at most
    SPILL_WIDE bytes; bench/notes/data_zoo.md, session 23)."""
    build = built(shipped, WIDE)
    assert len(build) == len(WIDE)
    for spec, (text, report) in build.items():
        name = spec.name_expression
        assert report["spill_stores"] <= SPILL_WIDE and report["stack"] <= SPILL_WIDE, (name, report)
        assert not any("serialized" in a for a in report.get("advisories", ())), (name, report)
        width = 192 if ", 192>" in spec.traits else 128
        hgmma = re.findall(rf"HGMMA\.64x{width}x8\.F32\.TF32 R\d+, (\S+),", text)
        want = 12 if width == 192 else 24 if ", 2, 256>" in spec.traits else 12
        assert len(hgmma) == want and all(a.startswith("R") for a in hgmma), (name, len(hgmma), hgmma[:3])
        assert "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in text and "USETMAXREG.DEALLOC.CTAPOOL 0x18" in text, name
        # the k-loop: from the target of the first backward branch after the last HGMMA that jumps
        # above the first HGMMA, to that branch (the partial sums' additions included)
        code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
        first = min(a for a, t in code if "HGMMA" in t)
        last_mma = max(a for a, t in code if "HGMMA" in t)
        back = next((a, int(m.group(1), 16)) for a, t in code if a > last_mma
                    for m in [re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", t)] if m and m.group(1)
                    and int(m.group(1), 16) < first)
        loop = [t for a, t in code if back[1] <= a <= back[0]]
        assert any("HGMMA" in t for t in loop), (name, back)
        assert not any("LDL" in t or "STL" in t for t in loop), f"local memory in the k-loop of {name}"
        assert "UBLKCP.S.G.MULTICAST" in text and "LDSM" in text, name


SPILL_WIDE = 256


def test_plain_sm90_rejects_wgmma():
    spec = SPECS[0]
    with pytest.raises(Exception):
        compile_cubin(render_source([spec]), [spec.name_expression], "sm_90")


def _traits(inner, outer, epilogue, a="RowMajor", precision="Tf32x3", T="float"):
    return (f"{NS}DistanceWgmmaTraits<{NS}Inner::{inner}, {NS}Power::{outer}, {NS}Epilogue::{epilogue}, "
            f"{NS}Layout::{a}, {NS}Layout::RowMajor, {NS}Layout::RowMajor, {NS}Precision::{precision}, {T}>")


@pytest.mark.parametrize(
    "traits, message",
    [
        (_traits("Dot", "Sqrt", "None"), "Inner::Dot takes outer power Noop"),
        (_traits("Diff", "Abs", "None"), "outer power Noop"),
        (_traits("Diff", "Sqrt", "None", a="ColMajor"), "a and b must be RowMajor"),
        (_traits("Diff", "Sqrt", "None", precision="Native16", T=f"{NS}float16"), "only T = float"),
    ],
)
def test_impossible_combinations_fail_with_their_message(traits, message):
    source = f'#include "distance_wgmma.cuh"\nstatic_assert({traits}::kThreads == 384, "x");\n'
    with pytest.raises(Exception) as info:
        compile_cubin(source, [], "sm_90a")
    assert message in str(info.value)


def test_python_mirror_matches_the_traits_arithmetic():
    # (tf32, chunked): stages, bytes of a stage (a, b, B small, norms; 1 KiB multiples), tile width
    for key, stages, stage, n in (((False, 256), 5, (128 + 2 * 256) * 64 + 1024, 256),
                                  ((True, 256), 8, (128 + 256) * 64 + 1024, 256),
                                  ((False, 128), 8, (128 + 2 * 128) * 64 + 1024, 128),
                                  ((False, 192), 6, (128 + 2 * 192) * 64 + 1024, 192)):
        shape = WGMMA_LAUNCH[key]
        assert shape.smem_bytes == stages * stage + 2 * stages * 8 + 1024
        assert shape.smem_bytes <= 227 * 1024 and shape.threads == 384 and shape.persistent
        assert shape.block_m == 128 and shape.block_n == n
    # the traits' own arithmetic agrees (compiled: kSmemBytes and kBlockN per variant)
    checks = "".join(
        f"static_assert({s.traits}::kSmemBytes == {s.launch.smem_bytes} && {s.traits}::kBlockN == {s.launch.block_n}, "
        f"\"mirror {i}\");\n" for i, s in enumerate(SPECS + WIDE))
    compile_cubin(f'#include "distance_wgmma.cuh"\n' + checks, [], "sm_90a")
    assert WGMMA_PREPARE_LAUNCH.threads == 256 and WGMMA_PREPARE_LAUNCH.block_m == 8  # a warp per row


def test_prepare_kernels_compile_vectorised_without_spills(shipped):
    """wgmma_prepare_b_kernel, every combination the package launches (shipped: read from the
    session's shipped build): 16-byte loads of b and stores of the blocks, no local memory; its
    tile constants are the kernel's and the package's (WGMMA_BLOCK_K)."""
    from kermac_like.plan import WGMMA_BLOCK_K

    specs = [wgmma_prepare_spec(small=s, norms=n) for s in (True, False) for n in (True, False)]
    check = (f"static_assert({specs[0].traits}::kTileK == {WGMMA_BLOCK_K} && "
             f"{specs[0].traits}::kTileN == {WGMMA_PREPARE_TILE}, \"prepared tiles\");\n")
    compile_cubin(render_source(specs) + check, [], "sm_90a")  # the mirrors and the tile constants
    build = built(shipped, specs)
    reports = [r for _, r in build.values()]
    assert len(reports) == 4 and all(r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0
                                     for r in reports), reports
    functions = {s.name_expression: text for s, (text, _) in build.items()}
    assert len(functions) == 4
    for name, text in functions.items():
        assert "LDG.E.128" in text and "STG.E.128" in text, name


def test_chunk_choice():
    """Partial sums for 3xTF32 distances whose K spans more than one partial sum; one running sum
    (the 128 x 256 kernel) for DOT, plain TF32 and K <= 16 chunk; the setting's 0 turns them off."""
    from kermac_like.runtime.specs import wgmma_chunk

    l2, dot = PRESETS["l2"], PRESETS["dot"]
    assert wgmma_chunk(l2, tf32=False, chunk=2, K=1024) == 2 and wgmma_chunk(l2, tf32=False, chunk=1, K=17) == 1
    assert wgmma_chunk(l2, tf32=False, chunk=2, K=32) == 0 and wgmma_chunk(l2, tf32=False, chunk=2, K=33) == 2
    assert wgmma_chunk(l2, tf32=True, chunk=2, K=1024) == 0 and wgmma_chunk(dot, tf32=False, chunk=2, K=1024) == 0
    assert wgmma_chunk(l2, tf32=False, chunk=0, K=1024) == 0
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR, chunk=2).launch == WGMMA_LAUNCH[False, 128]
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR).launch == WGMMA_LAUNCH[False, 256]
    # the setting wgmma_tile: 128 x 192 tiles with partial sums only (one running sum stays 128 x 256)
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR, chunk=2, tile=192).launch == WGMMA_LAUNCH[False, 192]
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR, chunk=2, tile=192).traits.endswith(", 2, 192>")
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR, tile=192) == wgmma_traits_spec(l2, Layout.ROW_MAJOR)
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR, chunk=2, tile=256).launch == WGMMA_LAUNCH[False, 256]
    assert wgmma_traits_spec(l2, Layout.ROW_MAJOR, chunk=2, tile=256).traits.endswith(", 2, 256>")
    with pytest.raises(ValueError):
        wgmma_traits_spec(l2, Layout.ROW_MAJOR, chunk=2, tile=64)


def test_prepare_needs():
    assert wgmma_prepare_needs(PRESETS["l2"], tf32=False) == (True, True)
    assert wgmma_prepare_needs(PRESETS["laplace_l2"], tf32=True) == (False, True)
    assert wgmma_prepare_needs(PRESETS["dot"], tf32=False) == (True, False)
    assert wgmma_prepare_needs(PRESETS["dot"], tf32=True) == (False, False)


@pytest.mark.parametrize("a_batch, b_batch", [
    ((), ()), ((3,), ()), ((3,), (3,)), ((2, 1, 4), (3, 1)), ((2, 3, 4), (1, 3, 4)), ((1, 5), (2, 1)),
    ((2, 3, 2, 2), (2, 1, 2, 1)),
])
def test_b_entries_address_every_entry_of_b_once(a_batch, b_batch):
    """kermac_like.plan.b_entries: for every batch entry of the folded kernel modes,
    the prepared entry e = l . c, decoded the way wgmma_prepare_b_kernel decodes it, is
    b's element offset for that batch entry; and the entries cover b itself exactly."""
    import itertools

    from kermac_like.plan import b_entries
    from kermac_like.layout import batch_strides, broadcast_batch_shape, plan_batch

    a = torch.empty(*a_batch, 5, 4)
    b = torch.empty(*b_batch, 6, 4)
    batch = broadcast_batch_shape({"a": tuple(a_batch), "b": tuple(b_batch)})
    strides = {k: batch_strides(batch, t.shape[:-2], t.stride()[:-2]) for k, t in (("a", a), ("b", b))}
    plan = plan_batch(batch, strides)
    sb = plan.strides["b"][1]
    ext, c = b_entries(plan.modes, sb)
    seen = set()
    for outer in plan.outer_offsets("b"):
        for l0, l1, l2 in itertools.product(*(range(n) for n in plan.modes)):
            e = l0 * c[0] + l1 * c[1] + l2 * c[2]
            assert 0 <= e < ext[0] * ext[1] * ext[2]
            q = e // ext[2]
            decoded = (q // ext[1]) * sb[0] + (q % ext[1]) * sb[1] + (e % ext[2]) * sb[2]
            assert decoded == l0 * sb[0] + l1 * sb[1] + l2 * sb[2], (l0, l1, l2)
            seen.add(outer + decoded)
    # the prepared entries (over all host-loop launches) are b's own batch entries
    own = {sum(i * s for i, s in zip(idx, b.stride()[:-2])) for idx in itertools.product(*(range(n) for n in b_batch))}
    assert seen == own


# ------------------------------------------------------------------ models


def swizzled(r, c):
    """distance_wgmma.cuh: byte offset of logical 16-byte chunk c of row r in a tile."""
    return r * 64 + ((c ^ ((r >> 1) & 3)) << 4)


def descriptor_address(start, r, k):
    """Byte address wgmma reads for element (row r, k) of a K-major tf32 operand with the
    64-byte swizzle: canonical layout (8-row groups SBO = 512 bytes apart, 64-byte rows),
    then address bits 4-5 XOR bits 7-8 (absolute address, pattern repeats every 512 bytes)."""
    linear = start + (r // 8) * 512 + (r % 8) * 64 + k * 4
    return linear ^ (((linear >> 7) & 3) << 4)


@pytest.mark.parametrize("rows", [64, 256])
def test_copy_layout_is_what_the_descriptor_reads(rows):
    """Every data column k of a 16-float k-tile: written by the copies where the wgmma of
    k-step k // 8 (start address + 32 bytes per step) reads its element k % 8."""
    for tile_base in (0, 8192, 1024 * 37, 4096):  # 512-byte aligned bases (stages, A of warpgroup 1, B)
        seen = set()
        for r in range(rows):
            for col in range(16):
                written = tile_base + swizzled(r, col // 4) + (col % 4) * 4
                s, kk = divmod(col, 8)
                read = descriptor_address(tile_base + 32 * s, r, kk)
                assert written == read, (tile_base, r, col)
                seen.add(written)
        assert len(seen) == rows * 16  # a bijection onto the tile
        assert min(seen) == tile_base and max(seen) == tile_base + rows * 64 - 4


@pytest.mark.parametrize("block_n", [128, 192, 256])
def test_b_copies_of_a_tile_cover_its_columns(block_n):
    """The loader's bulk copies of one stage (distance_wgmma_kernel, kStraddle for 192-row tiles),
    replayed: for every tile n0 of N columns, each CTA of the pair multicasts its share of every
    piece; the stage's rows r < rows_b receive b row n0 + r of the k-tile (raw half and small half,
    read from the 256-row prepared blocks), every column n < N of the tile is among them, nothing is
    read past the prepared buffer (n_pad rows), each share is a multiple of 16 bytes, and the bytes
    that land in a CTA are what its full barrier expects (b_bytes, and norm_bytes with the norms)."""
    prep, row_bytes, cluster, k_tiles, entries = WGMMA_PREPARE_TILE, 64, 2, 3, 2
    straddle = prep % block_n != 0
    for N in list(range(1, 1100, 37)) + [191, 192, 193, 255, 256, 257, 383, 384, 385, 511, 512, 513, 768]:
        prep_tiles_n = -(-N // prep)
        n_pad = prep_tiles_n * prep
        block_bytes = prep * row_bytes * 2  # raw, then small
        buffer_bytes = entries * prep_tiles_n * k_tiles * block_bytes
        for entry in range(entries):
            for n0 in range(0, N, block_n):
                off = n0 % prep
                blocks = (entry * prep_tiles_n + n0 // prep) * k_tiles * block_bytes + off * row_bytes
                r1, rows_b = block_n, block_n
                if straddle:
                    r1 = min(block_n, prep - off)
                    rows_b = block_n if r1 < block_n and n0 // prep + 1 < prep_tiles_n else r1
                b_bytes = rows_b * row_bytes * 2
                norm_bytes = min(block_n, n_pad - n0) * 4 if straddle else block_n * 4
                assert rows_b >= min(block_n, N - n0) and norm_bytes >= 4 * min(block_n, N - n0)
                assert entry * n_pad + n0 + norm_bytes // 4 <= entries * n_pad
                for kt in range(k_tiles):
                    src = blocks + kt * block_bytes
                    landed = {}  # stage byte offset (0: the raw tile) -> prepared-buffer byte offset
                    for rank in range(cluster):
                        pieces = [(0, src, r1)]
                        if rows_b > r1:
                            pieces.append((r1, src + k_tiles * block_bytes - off * row_bytes, rows_b - r1))
                        for h in range(2):
                            for dst_row, s, rows in pieces:
                                share = rows * row_bytes // cluster
                                assert share % 16 == 0
                                d = h * block_n * row_bytes + dst_row * row_bytes + rank * share
                                g = s + h * prep * row_bytes + rank * share
                                assert 0 <= g and g + share <= buffer_bytes
                                for i in range(0, share, 16):
                                    assert d + i not in landed
                                    landed[d + i] = g + i
                    assert 16 * len(landed) == b_bytes
                    for h in range(2):
                        for r in range(rows_b):
                            n = n0 + r
                            want = ((entry * prep_tiles_n + n // prep) * k_tiles + kt) * block_bytes + \
                                h * prep * row_bytes + (n % prep) * row_bytes
                            assert landed[h * block_n * row_bytes + r * row_bytes] == want, (N, n0, kt, h, r)


def test_copy_writes_of_a_warp_are_contiguous():
    # Loader thread tid copies chunk tid % 4 of row tid // 4 (+ 32 u) of a, b and B small:
    # a warp covers 8 rows = 512 contiguous bytes.
    for warp in range(8):
        offs = sorted(swizzled(t // 4, t % 4) for t in range(32 * warp, 32 * warp + 32))
        assert offs == list(range(512 * warp, 512 * warp + 512, 16))


def test_ldmatrix_gives_the_wgmma_a_fragment():
    """Lane l of warp w (of a consumer warpgroup) passes the address of row
    16 w + l % 8 + 8 ((l // 8) % 2), chunk 2 s + l // 16 to ldmatrix.x4; register i of
    lane l' then holds 32-bit word l' % 4 of row l' // 4 of matrix i, which must be the
    wgmma .tf32 A fragment: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
    of the k8 step s, with g = l' // 4, t = l' % 4."""
    for w in range(4):
        for s in range(2):
            rows = {}
            for lane in range(32):
                i = lane >> 3
                rows[(i, lane & 7)] = (16 * w + (lane & 7) + 8 * (i & 1), 2 * s + (i >> 1))
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i, (dm, dk) in enumerate(((0, 0), (8, 0), (0, 4), (8, 4))):
                    row, chunk = rows[(i, g)]
                    k = 4 * chunk + t  # word t of the 16-byte chunk
                    assert (row, k) == (16 * w + g + dm, 8 * s + t + dk), (w, s, lane, i)
                    # and the swizzled address is the one the copies wrote (row, k)
                    assert swizzled(row, chunk) + 4 * t == swizzled(row, k // 4) + 4 * (k % 4)


@pytest.mark.parametrize("stages", [3, 5, 8])
@pytest.mark.parametrize("tiles, k_tiles", [(1, 1), (3, 1), (2, 5), (4, 7), (2, 64)])
def test_mbarrier_protocol_has_no_hazards(stages, tiles, k_tiles):
    """Random interleavings of the kernel's three roles, each a program over the same
    stage/phase counters, with mbarrier semantics: full[s] (128 loader arrivals, one per
    thread when its copies of a, b and B small land), empty[s] (8 consumer-warp arrivals).
    Checks that a stage is loaded only when its previous k-tile was released, that
    consumers read (ldmatrix, wgmma) only landed data of the right k-tile, that the
    wgmma of k-tile j+1 and the still running one of k-tile j use different stages, that every k-tile is
    released exactly once (the first k-tile of a tile releases nothing: the previous
    tile's last stage went back after its wgmma.wait_group<0>), and that nothing
    deadlocks."""
    import random

    S = stages
    total = tiles * k_tiles
    rng = random.Random(stages * 1000 + tiles * 10 + k_tiles)
    holder = {s: None for s in range(S)}  # k-tile whose data the stage holds
    released = set()
    # Completed phases per barrier. A consumer's wait for the j-th use of full[s] needs
    # j + 1 completed phases; the loader's j-th reuse of a stage waits for j completed
    # phases of empty[s] (the parity waits of the kernel, a fresh barrier passing parity 1).
    full_phases = {s: 0 for s in range(S)}
    empty_phases = {s: 0 for s in range(S)}
    loader = {"q": 0}
    consumer = {"q": 0, "inflight": []}
    loads_landed = set()

    def loader_step():
        q = loader["q"]
        if q >= total:
            return False
        s, use = q % S, q // S
        if empty_phases[s] < use:  # previous user of the stage not released
            return False
        assert holder[s] is None or holder[s] in released, (q, holder[s])
        holder[s] = q
        loader["q"] += 1
        return True

    pending_land = []

    def land_step():
        if not pending_land:
            return False
        q = pending_land.pop(rng.randrange(len(pending_land)))
        loads_landed.add(q)
        s = q % S
        # full[s] completes when all 128 threads' copies of this k-tile landed (modelled as one).
        full_phases[s] += 1
        assert full_phases[s] == q // S + 1
        return True

    def consumer_step():
        c = consumer
        q = c["q"]
        if q >= total:
            return False
        kt = q % k_tiles
        s = q % S
        if full_phases[s] < q // S + 1:
            return False
        assert holder[s] == q and q in loads_landed
        # k-tile q (ldmatrix, wgmma) follows the full wait; wgmma(q-1), still in
        # flight, reads stage (q-1) % S, which must be another stage.
        if c["inflight"]:
            assert c["inflight"][-1] % S != s
        c["inflight"].append(q)
        # wgmma.wait_group<1>: all but the newest complete; release k-tile q-1 unless
        # q is the first k-tile of its tile (the previous tile's last was released after
        # its epilogue).
        while len(c["inflight"]) > 1:
            done = c["inflight"].pop(0)
            if kt != 0:
                release(done)
        if kt == k_tiles - 1:  # wait<0>, the epilogue (b norms from this stage), then release
            release(c["inflight"].pop(0))
        c["q"] += 1
        return True

    def release(q):
        s = q % S
        assert holder[s] == q
        released.add(q)
        empty_phases[s] += 1

    steps = 0
    while loader["q"] < total or pending_land or consumer["q"] < total:
        moved = False
        order = [0, 1, 2]
        rng.shuffle(order)
        for who in order:
            if who == 0:
                q0 = loader["q"]
                if loader_step():
                    pending_land.append(q0)
                    moved = True
            elif who == 1:
                moved |= land_step()
            else:
                moved |= consumer_step()
        assert moved, "deadlock"
        steps += 1
        assert steps < 100000
    assert released == set(range(total))


@pytest.mark.parametrize("stages", [3, 5])
@pytest.mark.parametrize("tiles, k_tiles", [(1, 1), (3, 2), (2, 3), (3, 5), (2, 16)])
@pytest.mark.parametrize("chunk", [1, 2])
def test_column_halves_protocol_has_no_hazards(stages, tiles, k_tiles, chunk):
    """The 128 x 256 partial-sum consumers (kRotate), replayed against the loader as in
    test_mbarrier_protocol_has_no_hazards: per chunk of ``chunk`` k-tiles they wait for each stage
    in turn, read them (ldmatrix, then both column halves' wgmma, each retired by wait_group 0
    before the additions), and give the chunk's stages back, but the tile's last k-tile's, which
    the epilogue reads (b norms) and gives back after it. Every k-tile is read only once landed,
    released exactly once, never rewritten while held, and nothing deadlocks."""
    import random

    S, total = stages, tiles * k_tiles
    rng = random.Random(stages * 1000 + tiles * 100 + k_tiles * 10 + chunk)
    holder = {s: None for s in range(S)}
    held, released, landed, pending = set(), set(), set(), []
    full_phases = {s: 0 for s in range(S)}
    empty_phases = {s: 0 for s in range(S)}
    loader = {"q": 0}
    # the consumer's program: ("wait", q) per k-tile of a chunk, then ("chunk", [q...]) (both halves'
    # wgmma and additions, then the releases), and after the tile's last chunk ("epilogue", q)
    program = []
    for t in range(tiles):
        for kt in range(0, k_tiles, chunk):
            qs = [t * k_tiles + j for j in range(kt, min(kt + chunk, k_tiles))]
            program += [("wait", q) for q in qs] + [("chunk", qs)]
        program.append(("epilogue", t * k_tiles + k_tiles - 1))
    pc = {"i": 0}

    def release(q):
        s = q % S
        assert holder[s] == q and q in held and q not in released
        held.discard(q)
        released.add(q)
        empty_phases[s] += 1

    def loader_step():
        q = loader["q"]
        if q >= total:
            return False
        s, use = q % S, q // S
        if empty_phases[s] < use:
            return False
        assert holder[s] is None or holder[s] in released, (q, holder[s])
        holder[s] = q
        loader["q"] += 1
        pending.append(q)
        return True

    def land_step():
        if not pending:
            return False
        q = pending.pop(rng.randrange(len(pending)))
        landed.add(q)
        full_phases[q % S] += 1
        assert full_phases[q % S] == q // S + 1
        return True

    def consumer_step():
        if pc["i"] >= len(program):
            return False
        op, arg = program[pc["i"]]
        if op == "wait":
            s = arg % S
            if full_phases[s] < arg // S + 1:
                return False
            assert holder[s] == arg and arg in landed
            held.add(arg)
        elif op == "chunk":
            for q in arg:  # read by both halves (wait_group 0 after each)
                assert q in held and holder[q % S] == q
            last_of_tile = arg[-1] % k_tiles == k_tiles - 1
            for q in (arg[:-1] if last_of_tile else arg):
                release(q)
        else:  # the epilogue reads the last stage's b norms, then gives it back
            assert arg in held and holder[arg % S] == arg
            release(arg)
        pc["i"] += 1
        return True

    steps = 0
    while loader["q"] < total or pending or pc["i"] < len(program):
        moved = False
        order = [0, 1, 2]
        rng.shuffle(order)
        for who in order:
            moved |= (loader_step, land_step, consumer_step)[who]()
        assert moved, "deadlock"
        steps += 1
        assert steps < 100000
    assert released == set(range(total)) and not held


# The epilogue's tile-uniform fast path (distance_wgmma.cuh), as written in the kernel.
FAST_TILE_CONDITION = """(!reg_on || (long long)m0 + reg_diag >= n0 + kBlockN ||
                         (long long)m0 + kBlockM - 1 + reg_diag < n0)"""


def test_fast_epilogue_tiles_hold_no_regularised_entry():
    """The kernel skips the per-element bounds and diagonal tests on tiles inside the
    output that the regularised diagonal n - m == reg_diag does not cross: brute force
    over tile origins and diagonals says the condition is exactly 'no entry of the tile
    is regularised'."""
    import random

    text = (TEMPLATES / "distance_wgmma.cuh").read_text()
    assert " ".join(FAST_TILE_CONDITION.split()) in " ".join(text.split())
    bm, bn = 128, 256
    rng = random.Random(7)
    for _ in range(3000):
        m0, n0 = bm * rng.randrange(0, 12), bn * rng.randrange(0, 6)
        reg_diag = rng.randrange(-3 * bn, 3 * bn) if rng.random() < 0.8 else rng.choice([0, -m0, n0 - m0])
        fast = m0 + reg_diag >= n0 + bn or m0 + bm - 1 + reg_diag < n0
        crossed = any(n0 <= m + reg_diag < n0 + bn for m in range(m0, m0 + bm))
        assert fast == (not crossed), (m0, n0, reg_diag)


def test_selection_default_and_opt_out(monkeypatch):
    from kermac_like.plan import core

    monkeypatch.delenv("KERMAC_LIKE_WGMMA", raising=False)
    assert core._wgmma_enabled(torch.device("cpu")) is False  # CPU tensors: never
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0")
    assert core._wgmma_enabled(torch.device("cuda", 0)) is False  # opted out, no device query


# ----------------------------------------------------------------------- GPU


def _try_module():
    spec = importlib.util.spec_from_file_location("try_wgmma", ROOT / "bench" / "probes" / "try_wgmma.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (H100/H200)")
_CASES = _try_module().CASES  # every float64 case of the probe, in both precisions


@pytest.fixture(scope="module")
def tw():
    mod = _try_module()
    try:
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device
    mod.DEV = Device(torch.cuda.current_device())
    mod.DEV.set_current()
    mod.STREAM = mod.torch_stream()
    return mod


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_CASES)), ids=lambda i: "/".join(_CASES[i][0]) + f"-{i}")
def test_gpu_matches_float64(tw, case):
    cfg, shape, extra = tw.CASES[case]
    ok, detail = tw.correctness_case(tw.VARIANTS["wgmma"], cfg, shape, **extra)
    assert ok, detail


@sm90
@pytest.mark.gpu
def test_gpu_self_distance_is_exactly_zero(tw):
    cfg = ("Diff", "Sqrt", "None", "RowMajor", "Tf32x3")
    x = tw.padded(10 + torch.randn(1, 1000, 300, device="cuda"))
    out = torch.full((1, 1000, 1000), float("nan"), device="cuda")
    tw.run(tw.VARIANTS["wgmma"], cfg, x, x, out)
    assert (torch.diagonal(out[0]) == 0).all()


@sm90
@pytest.mark.gpu
def test_gpu_package_path(monkeypatch):
    import kermac_like

    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "1")
    x1 = torch.randn(1000, 256, device="cuda")
    x2 = torch.randn(700, 256, device="cuda")
    y = kermac_like.cdist(x1, x2)
    ref = torch.cdist(x1.double(), x2.double())
    assert ((y.double() - ref).norm() / ref.norm()).item() <= 1e-5


@sm90
@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_bench_workloads(tw):
    tw.timing()
    for row in tw.TIMINGS:
        print(row)
    assert tw.TIMINGS
