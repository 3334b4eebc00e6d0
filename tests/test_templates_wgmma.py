"""Tests of cuda_templates/distance_wgmma.cuh, the Hopper (sm_90a, wgmma) distance kernel.

CPU (CI):
  * NVRTC compiles a representative set for sm_90a through the package's own
    renderer (so the Python mirror of the launch constants is checked too): no
    spills, no local memory, HGMMA.64x256x8.F32.TF32 in the SASS (6 per k-tile
    for Tf32x3, 2 for Tf32), cp.async copies, no wgmma serialisation warning.
  * Plain sm_90 rejects the kernel (wgmma needs sm_90a); impossible
    combinations fail with their static_assert message.
  * Models of what cannot run here: the shared-memory layout written by the
    copies vs the layout the wgmma descriptor reads (64-byte swizzle, K-major),
    and the pipeline schedule (no stage or small tile is overwritten while a
    wgmma may still read it; every read finds its data landed).
  * The selection in kermac_like.distance uses it on sm_90 unless KERMAC_LIKE_WGMMA=0.
GPU (marker gpu, sm_90 only): the float64 checks of bench/try_wgmma.py; marker
slow as well: the two bench workloads.
"""
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from kermac_like.descriptor import PRESETS
from kermac_like.layout import Layout
from kermac_like.render import WGMMA_LAUNCH, render_source, wgmma_traits_spec

try:
    from cuda.core import Program, ProgramOptions
except ImportError:  # cuda.core < 0.4
    from cuda.core.experimental import Program, ProgramOptions

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "cuda_templates"
NS = "kermac_like::"

# Representative set: p=2, squared, Laplace, Gaussian, DOT, both output layouts, plain TF32.
SPECS = [
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR),
    wgmma_traits_spec(PRESETS["squared_l2"], Layout.COL_MAJOR),
    wgmma_traits_spec(PRESETS["laplace_l2"], Layout.ROW_MAJOR),
    wgmma_traits_spec(PRESETS["gaussian_l2"], Layout.COL_MAJOR),
    wgmma_traits_spec(PRESETS["dot"], Layout.ROW_MAJOR),
    wgmma_traits_spec(PRESETS["l2"], Layout.ROW_MAJOR, tf32=True),
]


class _Log:
    text = ""

    def write(self, s):
        self.text += s


def compile_cubin(source, names, arch):
    log = _Log()
    options = ProgramOptions(arch=arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    obj = Program(source, "c++", options).compile("cubin", name_expressions=names, logs=log)
    return bytes(obj.code), log.text


def _sass(cubin):
    """SASS text per function, or skip when cuobjdump/nvdisasm are missing."""
    mma_tests = importlib.util.spec_from_file_location("_mma_tests", ROOT / "tests" / "test_templates_mma.py")
    mod = importlib.util.module_from_spec(mma_tests)
    mma_tests.loader.exec_module(mod)
    return mod.sass_functions(mod.sass_of(cubin))


# ---------------------------------------------------------------- compile tests


def test_compiles_for_sm90a_with_hgmma_and_no_spills():
    assert all(s.arch_suffix == "a" for s in SPECS)
    cubin, log = compile_cubin(render_source(SPECS), [s.name_expression for s in SPECS], "sm_90a")
    usage = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert len(usage) == len(SPECS) and all(u == ("0", "0", "0") for u in usage), log
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    assert len(regs) == len(SPECS) and max(regs) <= 255, log
    assert "serializ" not in log.lower(), log  # ptxas: "wgmma.mma_async instructions are serialized"
    functions = _sass(cubin)
    assert len(functions) == len(SPECS)
    counts = []
    for name, text in functions.items():
        assert "LDL" not in text and "STL" not in text, f"local memory in {name}"
        assert "LDGSTS" in text, f"no cp.async in {name}"
        assert not re.search(r"\bHMMA\b", text), f"mma.sync left in {name}"
        counts.append(len(re.findall(r"HGMMA\.64x256x8\.F32\.TF32", text)))
    assert sorted(counts) == [2] + [6] * 5, counts  # 2 k-steps x 3 products (Tf32x3) or x 1 (Tf32)
    print(f"sm_90a: registers {regs}")


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
    source = f'#include "distance_wgmma.cuh"\nstatic_assert({traits}::kThreads == 256, "x");\n'
    with pytest.raises(Exception) as info:
        compile_cubin(source, [], "sm_90a")
    assert message in str(info.value)


def test_python_mirror_matches_the_traits_arithmetic():
    stage, norms, slack = (128 + 256) * 64, (128 + 256) * 4, 1024
    assert WGMMA_LAUNCH[False].smem_bytes == (6 + 3) * stage + norms + slack
    assert WGMMA_LAUNCH[True].smem_bytes == 6 * stage + norms + slack
    assert WGMMA_LAUNCH[False].smem_bytes <= 227 * 1024


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


def test_copy_writes_of_a_warp_are_contiguous():
    # Thread tid copies logical chunk tid % 4 of row tid // 4: a warp covers 8 rows = 512
    # contiguous bytes (conflict-free), and the split pass reads chunks tid + 256 u linearly.
    for warp in range(8):
        offs = sorted(swizzled(t // 4, t % 4) for t in range(32 * warp, 32 * warp + 32))
        assert offs == list(range(512 * warp, 512 * warp + 512, 16))


@pytest.mark.parametrize("num_k_tiles", [1, 2, 3, 4, 5, 6, 7, 13, 64])
def test_pipeline_schedule_has_no_hazards(num_k_tiles):
    """Replays the kernel's schedule (kStages = 6 raw/big stages, 3 small tiles, copies
    4 k-tiles ahead, cp.async.wait_group<2> and wgmma.wait_group<1>) with the weakest
    guarantees: at the barrier of iteration kt only what the waits promise is done."""
    S, SMALL, T = 6, 3, num_k_tiles
    stage = {}  # stage -> tile whose data it holds
    small = {}
    landed, wg_done, split_done = set(), set(), set()
    issued_loads = []  # commit groups in order (None = empty)

    def load(j):
        s = j % S
        # Overwriting stage s: its previous tile must be split and its wgmma complete.
        prev = stage.get(s)
        assert prev is None or (prev in split_done and prev in wg_done), (j, prev)
        stage[s] = j

    def split(j):
        assert j in landed, f"split({j}) before its copy landed"
        assert stage[j % S] == j
        prev = small.get(j % SMALL)
        assert prev is None or prev in wg_done, (j, prev)
        small[j % SMALL] = j
        split_done.add(j)

    for j in range(S - 2):
        if j < T:
            load(j)
        issued_loads.append(j if j < T else None)
    landed.update(x for x in issued_loads[: len(issued_loads) - (S - 3)] if x is not None)
    split(0)
    pending_wg = []
    for kt in range(T):
        # cp.async.wait_group<S-4>: all but the newest S-4 groups landed (any thread).
        landed.update(x for x in issued_loads[: len(issued_loads) - (S - 4)] if x is not None)
        # barrier: every warpgroup's wgmma.wait_group<1> of iteration kt-1 is behind us.
        if kt + 1 < T:
            assert kt + 1 in landed
        assert kt in split_done and stage[kt % S] == kt and small[kt % SMALL] == kt
        pending_wg.append(kt)  # wgmma(kt) issued, reads stage kt % S and small kt % SMALL
        if kt + 1 < T:
            split(kt + 1)
        j = kt + S - 2
        if j < T:
            load(j)
        issued_loads.append(j if j < T else None)
        # wgmma.wait_group<1>: all but the newest group complete.
        while len(pending_wg) > 1:
            wg_done.add(pending_wg.pop(0))
    assert split_done == set(range(T))


def test_selection_default_and_opt_out(monkeypatch):
    from kermac_like import distance

    monkeypatch.delenv("KERMAC_LIKE_WGMMA", raising=False)
    assert distance._wgmma_enabled(torch.device("cpu")) is False  # CPU tensors: never
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0")
    assert distance._wgmma_enabled(torch.device("cuda", 0)) is False  # opted out, no device query


# ----------------------------------------------------------------------- GPU


def _try_module():
    spec = importlib.util.spec_from_file_location("try_wgmma", ROOT / "bench" / "try_wgmma.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU (H100/H200)")


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
@pytest.mark.parametrize("case", range(18))
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
