"""Tests of cuda_templates/matvec_wgmma.cuh, the Hopper (sm_90a) fused kernel_matvec, without
a GPU (its float64 checks on a GPU: tests/test_matvec.py, marker gpu, and
bench/probes/try_matvec_wgmma.py).

  * NVRTC compiles the shipped set for sm_90a through the package's renderer (so the Python
    mirror of the launch constants is checked): HGMMA with A from registers (12 per two
    k-tiles), cp.async signalling an mbarrier, the b multicast, setmaxnreg, no local memory
    in the k-loop; plain sm_90 rejects it; impossible combinations fail with their message;
    the mirror of every (precision, descriptor kind, column bucket) agrees with the traits.
  * Models of what cannot run here: the prepared v layout (plan.matvec_wgmma._prepare_v) against the
    kernel's v_offset, and the per-tile reduce-scatter of the quad's partial sums (every
    column of every row reaches exactly one writing lane); the epilogue-buffer ring
    (no buffer rewritten while read, no deadlock).
  * The planner with the device stubbed: Euclidean/DOT float32 K > 32 calls take
    matvec_wgmma on sm_90 (prepare + kernel, the flat argument list of the kernel's
    signature), matvec_blocked on sm_80 or with KERMAC_LIKE_WGMMA=0; N ranges (carry modes,
    offsets of the regularised and self diagonals), splits, column chunks, x is y.
"""

from __future__ import annotations

import io
import importlib.util
import random
import re
from pathlib import Path

import pytest
import torch

import kermac_like as km
from kermac_like import matvec as mv
from kermac_like import plan as P
from kermac_like.plan import matvec_wgmma as PW
from kermac_like.descriptor import PRESETS
from kermac_like.runtime.specs import matvec_wgmma as mw
from kermac_like.runtime.specs import render_source

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "cuda_templates"
NS = "kermac_like::"
EUCLID = ("l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot")

try:
    from cuda.core import Program, ProgramOptions
except ImportError:  # cuda.core < 0.4
    from cuda.core.experimental import Program, ProgramOptions


def compile_cubin(source, names, arch="sm_90a"):
    log = io.StringIO()
    options = ProgramOptions(arch=arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    obj = Program(source, "c++", options).compile("cubin", name_expressions=names, logs=log)
    return bytes(obj.code), log.getvalue()


def _module(name):
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / "tests" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sass(cubin):
    mma = _module("test_templates_mma")
    return mma.sass_functions(mma.sass_of(cubin))


# ---------------------------------------------------------------- compile tests
SHIPPED = [s for s in mw.shipped() if s.kernel.endswith("matvec_wgmma_kernel")]


def test_shipped_compile_for_sm90a_with_hgmma(shipped):
    """The shipped kernels as the session's shipped build compiled them (conftest ``shipped``:
    render_source's stub, so the Python mirror is checked)."""
    assert len(SHIPPED) == len(mw.SHIPPED_PRESETS) * len(mw.SHIPPED_C)
    assert all(s.arch_suffix == "a" for s in mw.shipped())
    mma = _module("test_templates_mma")
    build = shipped.kernels(SHIPPED, "sm_90")
    assert len(build) == len(SHIPPED)
    for spec, (_, _, report) in build.items():
        assert report["registers"] <= 255, report
        assert not any("serialized" in a for a in report.get("advisories", ())), report  # the k-tile of wgmma in flight
        if spec.traits.endswith(", 1>"):  # one column: no spills at all
            assert report["stack"] == 0 and report["spill_stores"] == 0 and report["spill_loads"] == 0, report
    for spec, (cubin, lowered, _) in build.items():
        text = mma.sass_functions(shipped.sass(cubin, mma.sass_of))[lowered]
        ops = re.findall(r"/\*[0-9a-f]+\*/\s+([^;]*);", text)
        hgmma = [i for i, o in enumerate(ops) if o.startswith("HGMMA.64x256x8.F32.TF32")]
        assert len(hgmma) == 12, spec.traits  # 2 k-tiles x 2 k8 steps x 3 products
        assert all(re.match(r"HGMMA\S* R\d+, R\d+,", ops[i]) for i in hgmma), "A from registers"
        # The k-loop (first to last HGMMA) touches no local memory (the few spilled
        # registers of the wider column buckets live around the per-tile epilogue).
        assert not any(re.match(r"(LDL|STL)", o) for o in ops[hgmma[0]: hgmma[-1] + 1]), spec.traits
        assert "LDGSTS" in text and "ARRIVES.LDGSTSBAR" in text
        assert "UBLKCP.S.G.MULTICAST" in text and "USETMAXREG" in text and "LDSM" in text
        assert not re.search(r"\bHMMA\b", text)
        assert "MUFU.EX2" in text


def test_carry_kernel_compiles(shipped):
    spec = mw.carry_spec()
    (_, _, report), = shipped.kernels([spec], "sm_90").values()
    assert report["stack"] == 0 and report["spill_stores"] == 0, report


def test_plain_sm90_rejects_it():
    spec = SHIPPED[0]
    with pytest.raises(Exception):
        compile_cubin(render_source([spec]), [spec.name_expression], "sm_90")


def _traits(inner, outer, epilogue, kc, precision="Tf32x3"):
    return (f"{NS}MatvecWgmmaTraits<{NS}Inner::{inner}, {NS}Power::{outer}, {NS}Epilogue::{epilogue}, {kc}, "
            f"{NS}Precision::{precision}>")


@pytest.mark.parametrize("traits, message", [
    (_traits("Diff", "Sqrt", "Gaussian", 3), "kC is 1, 2, 4, 8 or 16"),
    (_traits("Diff", "Sqrt", "Gaussian", 1, "Native16"), "Precision Tf32x3 or Tf32"),
    (_traits("Dot", "Sqrt", "None", 1), "Inner::Dot takes outer power Noop"),
])
def test_impossible_combinations_fail_with_their_message(traits, message):
    source = f'#include "matvec_wgmma.cuh"\nstatic_assert({traits}::kThreads == 384, "x");\n'
    with pytest.raises(Exception) as info:
        compile_cubin(source, [])
    assert message in str(info.value)


def test_python_mirror_matches_the_traits():
    """Every (precision, descriptor kind, column bucket): the mirrored shared memory (and
    the rest of LaunchShape) is what the traits compute; checked by the compile stub's
    static_asserts (traits only, no kernel instantiated)."""
    specs = [mw.matvec_wgmma_spec(PRESETS[n], kc, tf32=t) for n in ("gaussian_l2", "dot")
             for kc in (1, 2, 4, 8, 16) for t in (False, True)]
    for s in specs:
        assert s.launch.smem_bytes <= 227 * 1024 and s.launch.threads == 384 and s.launch.cluster == 2
    # two epilogue buffers except where they do not fit beside the ring (3xTF32 with 16 columns)
    assert mw.epi_buffers(False, True, 16) == 1 and mw.epi_buffers(False, True, 8) == 2
    assert mw.epi_buffers(True, True, 16) == 1 and mw.epi_buffers(True, True, 8) == 2
    compile_cubin(render_source(specs), [])


# ------------------------------------------------------------------- models
def v_offset(kc, j, t, e, c):
    """matvec_wgmma_detail::v_offset, as written in the header."""
    if kc == 1:
        return 8 * j + 2 * t + e
    f = e * kc + c
    return j * 8 * kc + ((f >> 2) * 4 + t) * 4 + (f & 3)


def test_v_offset_model_is_the_header():
    text = " ".join((TEMPLATES / "matvec_wgmma.cuh").read_text().split())
    assert "if (kC == 1) return 8 * j + 2 * t + e;" in text
    assert "const int f = e * kC + c; return j * 8 * kC + ((f >> 2) * 4 + t) * 4 + (f & 3);" in text


@pytest.mark.parametrize("kc, cc", [(1, 1), (2, 2), (4, 3), (8, 5), (16, 16)])
def test_prepared_v_is_what_the_kernel_reads(kc, cc):
    """plan.matvec_wgmma._prepare_v: element (n, c) of the column chunk at v_offset within its tile, zero
    past N and past the chunk's columns; each quad lane's float4 chunks of a step are 16-byte
    aligned and the four lanes' chunks contiguous (one 64-byte read per quarter warp)."""
    N, tiles = 600, 3
    v = torch.randn(2, N, 20)
    vp = PW._prepare_v(v, 2, cc, kc, tiles)
    assert vp.shape == (2, tiles * 256 * kc) and vp.is_contiguous()
    seen = set()
    for tile in range(tiles):
        for j in range(32):
            for t in range(4):
                for e in range(2):
                    n = tile * 256 + 8 * j + 2 * t + e
                    for c in range(kc):
                        off = v_offset(kc, j, t, e, c)
                        seen.add(off)
                        want = v[:, n, 2 + c] if (n < N and c < cc) else torch.zeros(2)
                        assert torch.equal(vp[:, tile * 256 * kc + off], want), (tile, j, t, e, c)
            if kc >= 2:
                for q in range(kc // 2):  # float4 chunk q of step j: lanes t = 0..3 side by side
                    offs = [v_offset(kc, j, t, (4 * q) // kc, (4 * q) % kc) for t in range(4)]
                    assert all(o % 4 == 0 for o in offs) and offs == list(range(offs[0], offs[0] + 16, 4))
    assert seen == set(range(256 * kc))


def _reduce_scatter(kc, p):
    """The kernel's per-tile reduction, step by step: p[lane][h][c] (lane = t4 of a quad)
    -> (values kept per lane, their columns). Mirrors the C++ of matvec_wgmma_kernel."""
    steps = 2 if kc >= 4 else (1 if kc == 2 else 0)
    group = 8 if kc > 8 else kc
    q = [[list(p[t][h]) for h in range(2)] for t in range(4)]
    kept = [[[0.0] * (kc >> steps) for _ in range(2)] for _ in range(4)]
    for grp in range(kc // group):
        g = [[q[t][h][grp * group:(grp + 1) * group] for h in range(2)] for t in range(4)]
        if group == kc:
            if steps >= 1:
                half = kc // 2
                new = [[None] * 2 for _ in range(4)]
                for t in range(4):
                    b1 = (t >> 1) & 1
                    for h in range(2):
                        send = [g[t][h][i] if b1 else g[t][h][i + half] for i in range(half)]
                        new[t][h] = send
                for t in range(4):
                    b1 = (t >> 1) & 1
                    for h in range(2):
                        keep = [g[t][h][i + half] if b1 else g[t][h][i] for i in range(half)]
                        g[t][h][:half] = [k + s for k, s in zip(keep, new[t ^ 2][h])]
            if steps >= 2:
                quarter = kc // 4
                new = [[None] * 2 for _ in range(4)]
                for t in range(4):
                    b0 = t & 1
                    for h in range(2):
                        new[t][h] = [g[t][h][i] if b0 else g[t][h][i + quarter] for i in range(quarter)]
                g2 = [[list(g[t][h]) for h in range(2)] for t in range(4)]
                for t in range(4):
                    b0 = t & 1
                    for h in range(2):
                        keep = [g[t][h][i + quarter] if b0 else g[t][h][i] for i in range(quarter)]
                        g2[t][h][:quarter] = [k + s for k, s in zip(keep, new[t ^ 1][h])]
                g = g2
            for t in range(4):
                for h in range(2):
                    for i in range(kc >> steps):
                        kept[t][h][i] += g[t][h][i]
        else:
            half = group // 2
            r = [[None] * 2 for _ in range(4)]
            for t in range(4):
                b0 = t & 1
                for h in range(2):
                    keep = [g[t][h][i + half] if b0 else g[t][h][i] for i in range(half)]
                    send = [g[t ^ 1][h][i] if (t ^ 1) & 1 else g[t ^ 1][h][i + half] for i in range(half)]
                    r[t][h] = [k + s for k, s in zip(keep, send)]
            for t in range(4):
                b1 = (t >> 1) & 1
                for h in range(2):
                    for i in range(half):
                        total = r[t][h][i] + r[t ^ 2][h][i]
                        if b1 == grp:
                            kept[t][h][i] += total
    # end of the item: the remaining xor levels on the totals
    if steps == 0:
        kept = [[[sum(kept[u][h][0] for u in range(4))] for h in range(2)] for t in range(4)]
    elif steps == 1:
        kept = [[[kept[t][h][0] + kept[t ^ 1][h][0]] for h in range(2)] for t in range(4)]
    cols = {}
    for t in range(4):
        b1, b0 = (t >> 1) & 1, t & 1
        writer = steps == 2 or (not b0 if steps == 1 else t == 0)
        if not writer:
            continue
        cbase = (b1 * (kc // 2) if steps >= 1 else 0) + (b0 * (kc // 4) if steps >= 2 else 0)
        for i in range(kc >> steps):
            cols.setdefault(cbase + i, []).append((t, i))
    return kept, cols


@pytest.mark.parametrize("kc", [1, 2, 4, 8, 16])
def test_quad_reduce_scatter_gives_every_column_to_one_writer(kc):
    rng = random.Random(kc)
    p = [[[rng.randrange(-1000, 1000) for _ in range(kc)] for _ in range(2)] for _ in range(4)]
    kept, cols = _reduce_scatter(kc, p)
    assert sorted(cols) == list(range(kc)) and all(len(w) == 1 for w in cols.values())
    for c, [(t, i)] in cols.items():
        for h in range(2):
            assert kept[t][h][i] == sum(p[u][h][c] for u in range(4)), (kc, c, h)


def test_reduce_scatter_model_follows_the_kernel():
    """The model above replays these lines of the kernel (kept in sync by text)."""
    text = " ".join((TEMPLATES / "matvec_wgmma.cuh").read_text().split())
    for line in ("const float send = upper ? q[h][i] : q[h][i + kHalf];",  # halve_across_pair
                 "const float keep = upper ? q[h][i + kHalf] : q[h][i];",
                 "q[h][i] = keep + __shfl_xor_sync(0xffffffffu, send, kLane);",
                 "halve_across_pair<kC / 2, 2>(q1, b1);",
                 "halve_across_pair<kC / 4, 1>(q1, b0);",
                 "r += __shfl_xor_sync(0xffffffffu, r, 2); if (b1 == (grp == 1)) total_h[h][i] += (double)r;",
                 "const bool writer = Traits::kSteps == 2 || (Traits::kSteps == 1 ? !b0 : t4 == 0);"):
        assert line in text, line


@pytest.mark.parametrize("bufs", [1, 2])
@pytest.mark.parametrize("stages, k_tiles, tiles", [(5, 3, 7), (5, 16, 4), (4, 1, 9), (5, 6, 5)])
def test_epilogue_ring_has_no_hazards(bufs, stages, k_tiles, tiles):
    """Random interleavings of the loader (stage ring; at a tile's last k-tile it waits for
    the epilogue buffer's empty phase, then copies norms and v into it) and the consumers
    (k-tiles, then the epilogue reads the buffer and releases it): a buffer is rewritten
    only after its previous tile's epilogue released it, the epilogue reads its own tile's
    data, nothing deadlocks."""
    rng = random.Random(stages * 100 + k_tiles * 10 + tiles + bufs)
    total = tiles * k_tiles
    stage_free = {s: 0 for s in range(stages)}  # completed releases per stage
    buf_holder = {b: None for b in range(bufs)}
    buf_released = {b: 0 for b in range(bufs)}
    landed = set()
    buf_landed = set()
    loader, consumer = {"q": 0}, {"q": 0, "epi": False}
    moved = True
    steps = 0
    while consumer["q"] < total or consumer["epi"]:
        order = [0, 1, 2]
        rng.shuffle(order)
        moved = False
        for who in order:
            if who == 0 and loader["q"] < total:
                q = loader["q"]
                s, use = q % stages, q // stages
                if stage_free[s] < use:
                    continue
                if q % k_tiles == k_tiles - 1:  # the tile's epilogue buffer
                    t = q // k_tiles
                    b, buse = t % bufs, t // bufs
                    if buf_released[b] < buse:
                        continue
                    assert buf_holder[b] is None or buf_holder[b] < t
                    buf_holder[b] = t
                    buf_landed.add(t)
                landed.add(q)
                loader["q"] += 1
                moved = True
            elif who == 1 and consumer["epi"]:
                t = consumer["q"] // k_tiles - 1
                b = t % bufs
                if t not in buf_landed:
                    continue
                assert buf_holder[b] == t
                buf_released[b] += 1
                consumer["epi"] = False
                moved = True
            elif who == 2 and not consumer["epi"] and consumer["q"] < total:
                q = consumer["q"]
                if q not in landed:
                    continue
                stage_free[q % stages] += 1  # released after its wgmma (in order)
                consumer["q"] += 1
                consumer["epi"] = consumer["q"] % k_tiles == 0
                moved = True
        assert moved, "deadlock"
        steps += 1
        assert steps < 100000
    assert sum(buf_released.values()) == tiles


# ------------------------------------------------------------------- planner
def _plan(desc, x, y, v, **h):
    call = mv.prepare_matvec(desc, x, y, v, **h)
    return P.plan_matvec(call, torch.empty(call.out_shape, dtype=x.dtype), False)


def _kernel_launches(plan):
    return [(k.spec, g, a) for k, g, a, *_ in plan.launches if k.spec.kernel.endswith("matvec_wgmma_kernel")]


SIGNATURE = _module("test_abi")._signature("matvec_wgmma_kernel")
ARG = {name: i for i, name in enumerate(SIGNATURE)}


def test_routing(as_gpu, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, y, v = torch.randn(50, 40, generator=g), torch.randn(70, 40, generator=g), torch.randn(70, 3, generator=g)
    for name in EUCLID:
        d = km.preset(name)
        h = {"bandwidth": 1.0} if d.needs_bandwidth else {}
        assert _plan(d, x, y, v, **h).family == "matvec_wgmma"
        assert _plan(d, x[:, :32], y[:, :32], v, **h).family == "matvec"  # K <= 32: the SIMT kernel
        assert _plan(d, x.half(), y.half(), v.half(), **h).family == "matvec"  # 16-bit: the SIMT kernel
    assert _plan(km.preset("laplace_l1"), x, y, v, bandwidth=1.0).family == "matvec"
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "0")
    assert _plan(km.preset("gaussian_l2"), x, y, v, bandwidth=1.0).family == "matvec_blocked"
    monkeypatch.delenv("KERMAC_LIKE_WGMMA")
    as_gpu[0] = (8, 0)
    assert _plan(km.preset("gaussian_l2"), x, y, v, bandwidth=1.0).family == "matvec_blocked"


def test_launch_arguments_follow_the_signature(as_gpu):
    g = torch.Generator().manual_seed(1)
    x, y, v = torch.randn(2, 300, 40, generator=g), torch.randn(2, 1000, 40, generator=g), torch.randn(1000, 20,
                                                                                                       generator=g)
    plan = _plan(km.preset("gaussian_l2"), x, y, v, bandwidth=torch.tensor([1.0, 2.0]), regularization=0.5,
                 regularization_offset_x=3)
    names = [k.spec.kernel for k, *_ in plan.launches]
    assert names == ["kermac_like::wgmma_prepare_b_kernel"] + ["kermac_like::matvec_wgmma_kernel"] * 2
    mains = _kernel_launches(plan)
    assert [s.traits.split(", ")[-1] for s, _, _ in mains] == ["16>", "4>"]  # C = 20: chunks of 16 and 4
    for spec, grid, args in mains:
        assert len(args) == len(SIGNATURE)
        assert grid == (min(66, 2 * 2), 1, 1)  # 2 pairs of row tiles x 2 batch entries
        assert int(args[ARG["M"]]) == 300 and int(args[ARG["N"]]) == 1000 and int(args[ARG["K"]]) == 40
        assert int(args[ARG["batch"]]) == 2 and int(args[ARG["reg_diag"]]) == 3 and int(args[ARG["self_on"]]) == 0
        assert int(args[ARG["n_split"]]) == 1 and int(args[ARG["carry_mode"]]) == 0 and args[ARG["carry"]] == 0
        assert args[ARG["bw_ptr"]] != 0 and float(args[ARG["regularization"]]) == 0.5
        assert isinstance(args[ARG["b_blocks"]], int) and args[ARG["b_blocks"]] != 0
    assert [int(a[ARG["C"]]) for _, _, a in mains] == [16, 4]


def test_ranges_carry_and_diagonal_offsets(as_gpu, monkeypatch):
    """y prepared in ranges of 3 tiles: carry modes 2 (first), 3, 1 (last); the regularised
    and self diagonals shift with each range's first row; v read from the range's tile."""
    per = 3 * 256 * (48 * 4 * 2 + 4)
    monkeypatch.setattr(PW, "MATVEC_WGMMA_BLOCK_BYTES", per)
    y = torch.randn(2000, 48)
    v = torch.randn(2000, 2)
    plan = _plan(km.preset("gaussian_l2"), y, y, v, bandwidth=1.0, regularization=0.5, regularization_offset_y=7)
    mains = _kernel_launches(plan)
    assert len(mains) == 3  # 8 tiles in ranges of 3, 3, 2
    assert [int(a[ARG["carry_mode"]]) for _, _, a in mains] == [2, 3, 1]
    assert [int(a[ARG["N"]]) for _, _, a in mains] == [768, 768, 2000 - 1536]
    assert [int(a[ARG["reg_diag"]]) for _, _, a in mains] == [-7, -7 - 768, -7 - 1536]
    assert [int(a[ARG["self_diag"]]) for _, _, a in mains] == [0, -768, -1536]
    assert all(int(a[ARG["self_on"]]) == 1 for _, _, a in mains)
    carry = {a[ARG["carry"]] for _, _, a in mains}
    assert len(carry) == 1 and 0 not in carry
    v0 = mains[0][2][ARG["v_blocks"]]
    assert [a[ARG["v_blocks"]] - v0 for _, _, a in mains] == [0, 3 * 256 * 2 * 4, 6 * 256 * 2 * 4]
    preps = [a for k, _, a, *_ in plan.launches if k.spec.kernel.endswith("prepare_b_kernel")]
    assert [int(a[1]) for a in preps] == [768, 768, 2000 - 1536]  # N of each prepared range


def test_few_rows_split_then_combine_or_carry(as_gpu, monkeypatch):
    x, y, v = torch.randn(20, 40), torch.randn(30000, 40), torch.randn(30000, 1)
    plan = _plan(km.preset("laplace_l2"), x, y, v, bandwidth=1.0)
    names = [k.spec.kernel.split("::")[1] for k, *_ in plan.launches]
    assert names == ["wgmma_prepare_b_kernel", "matvec_wgmma_kernel", "matvec_combine_kernel"]
    (_, grid, args), = _kernel_launches(plan)
    split = int(args[ARG["n_split"]])
    assert split > 1 and args[ARG["part"]] != 0 and grid[0] == min(66, split)
    assert split * int(args[ARG["tiles_per_split"]]) >= -(-30000 // 256)
    monkeypatch.setattr(PW, "MATVEC_WGMMA_BLOCK_BYTES", 40 * 256 * (48 * 4 * 2 + 4))
    plan = _plan(km.preset("laplace_l2"), x, y, v, bandwidth=1.0)
    names = [k.spec.kernel.split("::")[1] for k, *_ in plan.launches]
    assert "matvec_combine_kernel" not in names and names.count("matvec_carry_kernel") == names.count(
        "matvec_wgmma_kernel") > 1
    modes = [int(a[-1]) for k, _, a, *_ in plan.launches if k.spec.kernel.endswith("carry_kernel")]
    assert modes[0] == 2 and modes[-1] == 1 and all(m == 3 for m in modes[1:-1])


def test_unaligned_rows_are_copied_and_keep_x_is_y(as_gpu):
    x = torch.randn(64, 37)  # K = 37: rows of 148 bytes
    plan = _plan(km.preset("l2"), x, x, torch.randn(64, 1))
    (_, _, args), = _kernel_launches(plan)
    assert int(args[ARG["self_on"]]) == 1 and int(args[ARG["ldx"]]) == 40 and int(args[ARG["K"]]) == 37
    plan = _plan(km.preset("dot"), torch.randn(64, 80)[:, ::2], torch.randn(40, 50).t(), torch.randn(50, 2))
    (_, _, args), = _kernel_launches(plan)
    assert int(args[ARG["self_on"]]) == 0 and int(args[ARG["ldx"]]) == 40
    assert args[ARG["x"]] % 16 == 0
