"""CPU-only tests of cuda_templates/distance.cuh and math.cuh.

Three kinds:
  * NVRTC compile checks (no GPU needed): instantiations compile to cubin for
    sm_80 and sm_90 without register spills; impossible combinations fail with
    a static_assert naming the problem; the traits' launch constants; SASS
    properties read with cuobjdump (no MUFU in the main loop for p = 1, 2;
    16-byte async copies in the vector variant).
  * CPU execution of the real kernel: the template is compiled with g++ behind
    a thin shim (each CUDA thread is a std::thread, __syncthreads a barrier,
    cp.async a synchronous copy), then run on odd shapes, strided views, batch
    broadcast and the regularised diagonal, and compared with a float64
    reference.  This checks the tiling, edge predication, zero fill, loaders,
    the stage ring, the epilogue and the stores, not GPU-specific timing.
  * An emulation in numpy of the FMA-pipe exp2 (math.cuh) for accuracy and
    edge values.

The full shipped set is compiled only with `-m slow`.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from cpu_shim import build_cpu_runner

TEMPLATES = Path(__file__).resolve().parent.parent / "cuda_templates"
NS = "kermac_like::"

# (inner, inner power, outer power, epilogue) of the presets and of cdist.
DESCRIPTORS = {
    "l1": ("Diff", "Abs", "Noop", "None"),
    "l2": ("Diff", "Square", "Sqrt", "None"),
    "l2_squared": ("Diff", "Square", "Noop", "None"),
    "p_norm": ("Diff", "Pow", "Pow", "None"),
    "p_norm_skip_root": ("Diff", "Pow", "Noop", "None"),
    "laplace_l1": ("Diff", "Abs", "Noop", "Laplace"),
    "laplace_l2": ("Diff", "Square", "Sqrt", "Laplace"),
    "gaussian_l2": ("Diff", "Square", "Sqrt", "Gaussian"),
    "laplace_p": ("Diff", "Pow", "Pow", "Laplace"),
    "gaussian_p": ("Diff", "Pow", "Pow", "Gaussian"),
    "dot": ("Dot", "Noop", "Noop", "None"),
}

# Launch constants the Python mirror must hold (checked by a static_assert stub).
EXPECTED_LAUNCH = {"kThreads": 256, "kBlockM": 128, "kBlockN": 128, "kSmemBytes": 68640}


def traits_name(inner, inner_pow, outer_pow, epilogue, la="RowMajor", lb="RowMajor", lo="RowMajor", vec=1):
    return (
        f"{NS}DistanceTraits<{NS}Inner::{inner}, {NS}Power::{inner_pow}, {NS}Power::{outer_pow}, "
        f"{NS}Epilogue::{epilogue}, {NS}Layout::{la}, {NS}Layout::{lb}, {NS}Layout::{lo}, {vec}>"
    )


def kernel_name(*args, **kw):
    return f"{NS}distance_kernel<{traits_name(*args, **kw)}>"


# ---------------------------------------------------------------- NVRTC side
def _cuda_core():
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:  # cuda.core < 0.4
        from cuda.core.experimental import Program, ProgramOptions
    return Program, ProgramOptions


def nvrtc_compile(source: str, names: list[str], arch: str):
    """Compile `source` to cubin; returns (cubin bytes, ptxas log, seconds).

    Raises RuntimeError carrying NVRTC's log on failure."""
    try:
        Program, ProgramOptions = _cuda_core()
    except ImportError as exc:  # pragma: no cover - environment without cuda.core
        pytest.skip(f"cuda.core unavailable: {exc}")
    opts = ProgramOptions(std="c++17", arch=arch, include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        obj = Program(source, "c++", opts).compile("cubin", name_expressions=names, logs=log)
    except Exception as exc:  # NVRTCError: message holds the compile log
        raise RuntimeError(f"NVRTC failed for {names} ({arch}):\n{exc}\n{log.getvalue()}") from exc
    return bytes(obj.code), log.getvalue(), time.perf_counter() - t0


def _stub(names: list[str]) -> str:
    return '#include "distance.cuh"\n'


def ptxas_usage(log: str) -> list[tuple[int, int, int]]:
    """(registers, spill stores, spill loads) per compiled entry."""
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return [(r, int(s), int(l)) for r, (s, l) in zip(regs, spills)]


def cuobjdump_path():
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cu12", "cuda_cuobjdump"):
                cand = Path(root) / sub / "bin" / "cuobjdump"
                if cand.exists():
                    return str(cand)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def sass_of(cubin: bytes) -> str:
    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(a, 16), ins) for a, ins in _INSTR.findall(sass)]


def opcode(ins: str) -> str:
    toks = ins.split()
    if toks[0].startswith("@"):
        toks = toks[1:]
    return toks[0]


def sass_loops(instrs):
    """(start, end) address ranges of loops: backward branches."""
    loops = []
    for addr, ins in instrs:
        if opcode(ins) == "BRA":
            m = re.search(r"(0x[0-9a-f]+)\s*$", ins)
            if m and int(m.group(1), 16) < addr:
                loops.append((int(m.group(1), 16), addr))
    return loops


def main_loop(instrs):
    """Opcode list of the k-loop: of the loops with at least 64 FP
    instructions, the one with the highest FP density (the enclosing tile
    loop has the same FP work plus the loads; the epilogue loop has little)."""
    best, key = None, None
    for lo, hi in sass_loops(instrs):
        body = [opcode(i) for a, i in instrs if lo <= a <= hi]
        fp = sum(o.startswith(("FADD", "FFMA")) for o in body)
        if fp >= 64 and (key is None or fp / len(body) > key):
            best, key = body, fp / len(body)
    assert best is not None, "no FP loop found"
    return best


# ---------------------------------------------------------- compile tests
REPRESENTATIVE = [
    kernel_name(*DESCRIPTORS["l1"], vec=1),
    kernel_name(*DESCRIPTORS["l2"], la="ColMajor", lb="ColMajor", lo="ColMajor", vec=4),
    kernel_name(*DESCRIPTORS["p_norm"], la="RowMajor", lb="ColMajor", vec=4),
    kernel_name(*DESCRIPTORS["gaussian_l2"], la="ColMajor", lb="RowMajor", lo="ColMajor", vec=1),
    kernel_name(*DESCRIPTORS["dot"], la="ColMajor", lb="ColMajor", vec=1),
]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_representative_instantiations_compile_without_spills(arch):
    cubin, log, secs = nvrtc_compile(_stub(REPRESENTATIVE), REPRESENTATIVE, arch)
    usage = ptxas_usage(log)
    assert len(usage) == len(REPRESENTATIVE), log
    for name, (regs, st, ld) in zip(REPRESENTATIVE, usage):
        assert st == 0 and ld == 0, f"{name} spills on {arch}: {log}"
        assert regs <= 255
    assert len(cubin) > 0


def test_launch_constants_match_the_python_mirror():
    t = traits_name(*DESCRIPTORS["l1"])
    checks = "".join(
        f'static_assert({t}::{k} == {v}, "{k} mirror");\n' for k, v in EXPECTED_LAUNCH.items()
    )
    checks += f"static_assert(sizeof({t}::T) == 4, \"T is float\");\n"
    src = '#include "distance.cuh"\n' + checks
    name = kernel_name(*DESCRIPTORS["l1"])
    nvrtc_compile(src, [name], "sm_80")


@pytest.mark.parametrize(
    "args, message",
    [
        (("Dot", "Abs", "Noop", "None"), "Inner::Dot requires inner power Power::Noop"),
        (("Dot", "Noop", "Sqrt", "None"), "Inner::Dot requires outer power Power::Noop"),
        (("Dot", "Noop", "Noop", "Laplace"), "Inner::Dot requires Epilogue::None"),
        (("Diff", "Noop", "Noop", "None"), "Inner::Diff requires an inner power"),
        (("Diff", "Sqrt", "Noop", "None"), "inner power Power::Sqrt is not supported"),
        (("Diff", "Abs", "Square", "None"), "outer power must be Noop, Sqrt or Pow"),
        (("Diff", "Abs", "Abs", "None"), "outer power must be Noop, Sqrt or Pow"),
    ],
)
def test_impossible_combinations_fail_with_a_named_static_assert(args, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        nvrtc_compile(_stub([]), [kernel_name(*args)], "sm_80")


def test_bad_vector_width_is_rejected():
    with pytest.raises(RuntimeError, match="kVec must be 1 or 4"):
        nvrtc_compile(_stub([]), [kernel_name(*DESCRIPTORS["l1"], vec=2)], "sm_80")


@pytest.fixture(scope="module")
def sm90_sass():
    names = {
        "l1": kernel_name(*DESCRIPTORS["l1"], vec=4),
        "l2": kernel_name(*DESCRIPTORS["laplace_l2"], la="ColMajor", lb="ColMajor", vec=4),
        "pow": kernel_name(*DESCRIPTORS["p_norm"], vec=4),
    }
    out = {}
    for key, name in names.items():
        cubin, _, _ = nvrtc_compile(_stub([name]), [name], "sm_90")
        out[key] = sass_instructions(sass_of(cubin))
    return out


def test_p1_p2_main_loop_has_no_mufu_and_is_almost_all_fp(sm90_sass):
    for key, fp_ops in (("l1", {"FADD"}), ("l2", {"FADD", "FFMA"})):
        body = main_loop(sm90_sass[key])
        ops = [o.split(".")[0] for o in body]
        assert "MUFU" not in ops, key
        fp = sum(o in fp_ops for o in ops)
        lds = sum(o == "LDS" for o in ops)
        # 8 k-steps x 8x8 elements x 2 FP instructions, 4 LDS.128 per k-step.
        assert fp == 8 * 64 * 2, (key, fp)
        assert lds == 8 * 4 and all(o.startswith("LDS.128") for o in body if o.startswith("LDS")), key
        assert len(body) - fp - lds <= 8, (key, len(body))
        # MUFU outside the main loop: only the epilogue (sqrt/exp), a handful.
        mufu_total = sum(opcode(i).startswith("MUFU") for _, i in sm90_sass[key])
        assert mufu_total < 200


def test_fractional_p_balances_mufu_and_fma_pipes(sm90_sass):
    body = [o.split(".")[0] for o in main_loop(sm90_sass["pow"])]
    mufu = body.count("MUFU")
    elements = 2 * 64  # kUnrollK k-steps x 8x8 elements
    assert mufu == elements + (64 - 41) * 2  # one LG2 each; EX2 for the 23/64 not on the FMA pipe
    # issue slots per warp-element vs MUFU clocks (8 per warp-wide MUFU): balanced within 5%.
    issue = len(body) / elements
    mufu_clk = 8 * mufu / elements
    assert abs(issue - mufu_clk) / mufu_clk < 0.05, (issue, mufu_clk)
    # The log2 clamp of the FMA-pipe elements keeps NaN (max.NaN / min.NaN): one
    # FMNMX.NAN each, no plain FMNMX, which would turn |NaN|^p into 0.
    full = main_loop(sm90_sass["pow"])
    clamps = [o for o in full if o.startswith("FMNMX")]
    assert len(clamps) == 2 * 2 * 41 and all(o.startswith("FMNMX.NAN") for o in clamps), set(clamps)


def test_vector_variant_uses_16_byte_async_copies(sm90_sass):
    ops = [opcode(i) for _, i in sm90_sass["l2"]]
    assert any(o.startswith("LDGSTS.E.BYPASS.128") for o in ops)
    # k-contiguous operands are transposed with 4-byte copies (see distance.cuh).
    ops1 = [opcode(i) for _, i in sm90_sass["l1"]]
    assert any(o == "LDGSTS.E" for o in ops1)
    # The epilogue stores one float per lane, 32 consecutive floats per warp
    # (staged through shared memory), in one loop (the compiler may unswitch
    # it on epsilon / regularisation: at most 4 copies).
    assert 1 <= sum(o.startswith("STG") for o in ops1) <= 4


def shipped_names():
    names = []
    for d in DESCRIPTORS.values():
        for la in ("RowMajor", "ColMajor"):
            for lb in ("RowMajor", "ColMajor"):
                for lo in ("RowMajor", "ColMajor"):
                    for vec in (1, 4):
                        if vec == 4 and la == lb == "RowMajor":
                            continue  # same code as vec == 1 (see NOTES: kVec only changes ColMajor loads)
                        names.append(kernel_name(*d, la=la, lb=lb, lo=lo, vec=vec))
    return names


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KERMAC_LIKE_FULL_COMPILE"),
                    reason="the whole layout/vector cartesian product (~90 s per arch on 2 cores); the shipped "
                           "set is compiled by tests/test_compile.py. Set KERMAC_LIKE_FULL_COMPILE=1 to run it.")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_all_shipped_instantiations_compile(arch):
    names = shipped_names()
    t0 = time.perf_counter()
    _, log, _ = nvrtc_compile(_stub(names), names, arch)
    usage = ptxas_usage(log)
    assert len(usage) == len(names)
    assert all(st == 0 and ld == 0 for _, st, ld in usage), log
    print(f"{arch}: {len(names)} instantiations in {time.perf_counter() - t0:.1f} s")


# ------------------------------------------------- FMA-pipe exp2 emulation
def _f32(x):
    return np.float32(x)


def _fma32(a, b, c):
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))  # exact product, one rounding


def _coeffs():
    text = (TEMPLATES / "math.cuh").read_text()
    c = {k: float(v) for k, v in re.findall(r"constexpr float (kExp2C\d|kExp2Magic) = ([0-9.e+-]+)f;", text)}
    return [c[f"kExp2C{i}"] for i in range(1, 6)], c["kExp2Magic"]


def exp2_fma_emulated(x, y):
    """numpy transcription of math::exp2_fma_split, vectorised (float32 semantics)."""
    (c1, c2, c3, c4, c5), magic = _coeffs()
    x = np.asarray(x, np.float32)
    y = np.asarray(y, np.float32)
    prod = x.astype(np.float64) * y.astype(np.float64)
    j = (prod + magic).astype(np.float32)
    n = (j.astype(np.float64) - magic).astype(np.float32)
    f = (prod - n.astype(np.float64)).astype(np.float32)
    q = _fma32(_f32(c5), f, _f32(c4))
    for c in (c3, c2, c1, 1.0):
        q = _fma32(q, f, _f32(c))
    bits = (j.view(np.uint32).astype(np.uint64) << np.uint64(23)) & np.uint64(0xFFFFFFFF)
    scale = bits.astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (q.astype(np.float64) * scale.astype(np.float64)).astype(np.float32)


def test_fma_exp2_is_accurate_over_the_normal_range():
    t = np.linspace(-126.0, 127.4, 2_000_001).astype(np.float32)
    got = exp2_fma_emulated(t, np.ones_like(t)).astype(np.float64)
    ref = np.exp2(t.astype(np.float64))
    rel = np.abs(got - ref) / ref
    assert rel.max() < 2.0e-7, rel.max()


def test_fma_pow_edges():
    p = np.float32(1.3)
    lo, hi = np.float32(-127.0) / p, np.float32(128.0) / p
    # |d| == 0: log2 = -inf, clamped to lo -> exactly 0.
    assert exp2_fma_emulated(p, np.clip(np.float32(-np.inf), lo, hi)) == 0.0
    # Overflow -> +inf, never a wrapped exponent.
    assert np.isinf(exp2_fma_emulated(p, hi))
    # Tiny results underflow to 0 or a small non-negative value, never negative/NaN.
    lg = np.linspace(lo, lo + 2.0, 10001).astype(np.float32)
    v = exp2_fma_emulated(np.full_like(lg, p), lg)
    assert np.all(v >= 0) and np.all(np.isfinite(v))
    # |d|^p accuracy through log2 in float32 (MUFU lg2 is ~2^-22 absolute).
    d = np.abs(np.random.default_rng(0).standard_normal(100_000)).astype(np.float32) + np.float32(1e-3)
    lg2 = np.log2(d.astype(np.float64)).astype(np.float32)
    got = exp2_fma_emulated(np.full_like(lg2, p), lg2).astype(np.float64)
    ref = d.astype(np.float64) ** np.float64(p)
    assert (np.abs(got - ref) / ref).max() < 1e-6  # float32 rounding of log2|d| dominates


# ------------------------------------------------- CPU execution of the kernel
SHIM = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct kl_dim3 { unsigned x, y, z; };
thread_local kl_dim3 threadIdx, blockIdx;
kl_dim3 gridDim, blockDim;
static std::barrier<>* kl_barrier;
inline void __syncthreads() { kl_barrier->arrive_and_wait(); }
static std::atomic<int> kl_or_flag{0};
// Barrier that returns whether any thread passed a nonzero p (set, meet, read, meet, reset, meet).
inline int __syncthreads_or(int p) {
  if (p) kl_or_flag.store(1);
  kl_barrier->arrive_and_wait();
  const int r = kl_or_flag.load();
  kl_barrier->arrive_and_wait();
  kl_or_flag.store(0);
  kl_barrier->arrive_and_wait();
  return r;
}
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

#include "distance.cuh"

namespace kermac_like { namespace distance_detail {
alignas(16) float kl_distance_smem[1 << 16];
} }

using namespace kermac_like;
template <class Tr> using K = void (*)(const float*, const float*, float*, int, int, int, long long,
    long long, long long, int, int, int, long long, long long, long long, long long, long long,
    long long, long long, long long, long long, const float*, long long, long long, long long, float,
    const float*, long long, long long, long long, float, const float*, long long, long long,
    long long, float, const float*, long long, long long, long long, float, long long, float);

#define D(i, ip, op, ep, la, lb, lo, v, ...) DistanceTraits<Inner::i, Power::ip, Power::op, Epilogue::ep, \
    Layout::la, Layout::lb, Layout::lo, v __VA_OPT__(,) __VA_ARGS__>
@@INSTANCES@@

template <class Tr>
void run(std::vector<float>& buf, const long long* h, const float* hf, int gz) {
  // buffers: a | b | out | inner_p | outer_p | bw | reg  (offsets in h[32..38])
  float* base = buf.data();
  auto ptr = [&](int i) -> const float* { return h[40 + i] ? base + h[32 + i] : nullptr; };
  const int M = h[0], N = h[1], Kd = h[2];
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), unsigned((N + Tr::kBlockN - 1) / Tr::kBlockN), unsigned(gz)};
  std::barrier<> bar(Tr::kThreads);
  kl_barrier = &bar;
  std::vector<std::thread> pool;
  for (int t = 0; t < Tr::kThreads; ++t) {
    pool.emplace_back([&, t] {
      threadIdx = {unsigned(t), 0, 0};
      for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
          for (unsigned x = 0; x < gridDim.x; ++x) {
            blockIdx = {x, y, z};
            distance_kernel<Tr>(base + h[32], base + h[33], base + h[34], M, N, Kd, h[3], h[4], h[5],
                                int(h[6]), int(h[7]), int(h[8]), h[9], h[10], h[11], h[12], h[13], h[14],
                                h[15], h[16], h[17], ptr(3), h[18], h[19], h[20], hf[0], ptr(4), h[21],
                                h[22], h[23], hf[1], ptr(5), h[24], h[25], h[26], hf[2], ptr(6), h[27],
                                h[28], h[29], hf[3], h[30], hf[4]);
            kl_barrier->arrive_and_wait();
          }
    });
  }
  for (auto& th : pool) th.join();
}

int main(int argc, char** argv) {
  // argv: instance index, input file (64 int64 header, 8 float header, floats), output file
  const int which = std::atoi(argv[1]);
  FILE* f = std::fopen(argv[2], "rb");
  long long h[64];
  float hf[8];
  if (std::fread(h, 8, 64, f) != 64 || std::fread(hf, 4, 8, f) != 8) return 2;
  std::vector<float> buf(h[63]);
  if (std::fread(buf.data(), 4, buf.size(), f) != buf.size()) return 3;
  std::fclose(f);
  const int gz = int(h[31]);
  switch (which) {
@@CASES@@
    default: return 4;
  }
  return kl_write(argv[3], buf);
}
"""

# Instances run on the CPU: every loader (RowMajor, ColMajor x kVec 4/1), both
# output layouts, every inner operator, outer power and epilogue.
CPU_INSTANCES = [
    (("Diff", "Abs", "Noop", "None"), "RowMajor", "RowMajor", "RowMajor", 4),
    (("Diff", "Square", "Sqrt", "Laplace"), "ColMajor", "ColMajor", "ColMajor", 4),
    (("Diff", "Pow", "Pow", "None"), "RowMajor", "ColMajor", "RowMajor", 1),
    (("Dot", "Noop", "Noop", "None"), "ColMajor", "RowMajor", "ColMajor", 1),
    (("Diff", "Square", "Sqrt", "Gaussian"), "RowMajor", "RowMajor", "ColMajor", 1),
    (("Diff", "Pow", "Noop", "Laplace"), "ColMajor", "ColMajor", "RowMajor", 4),
    (("Diff", "Abs", "Noop", "None"), "ColMajor", "RowMajor", "RowMajor", 1),
    (("Diff", "Square", "Noop", "None"), "RowMajor", "ColMajor", "ColMajor", 4),
    # tuned variants (bench/probes/try_simt.py): totals in shared memory with the
    # compact row loader, kBlockK 16 and 64, other FMA-pipe shares.
    (("Diff", "Abs", "Noop", "None"), "RowMajor", "RowMajor", "RowMajor", 1),
    (("Diff", "Pow", "Pow", "None"), "ColMajor", "RowMajor", "ColMajor", 4),
    (("Diff", "Square", "Sqrt", "None"), "RowMajor", "ColMajor", "RowMajor", 1),
]
# Extra template arguments (kPolyPer64, kBlockK, kMinBlocksPerSm) by instance index.
CPU_TUNING = {8: (41, 16, 2), 9: (48, 16, 2), 10: (36, 64, 1)}


@pytest.fixture(scope="module")
def cpu_runner(tmp_path_factory):
    inst, cases = [], []
    for idx, ((i, ip, op, ep), la, lb, lo, v) in enumerate(CPU_INSTANCES):
        extra = "".join(f", {t}" for t in CPU_TUNING.get(idx, ()))
        inst.append(f"using T{idx} = D({i}, {ip}, {op}, {ep}, {la}, {lb}, {lo}, {v}{extra});")
        cases.append(f"    case {idx}: run<T{idx}>(buf, h, hf, gz); break;")
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "distance_cpu", src)


def _layout_buffer(x, layout, pad, rng):
    """Place (B0,B1,B2,R,C) x into a flat float32 buffer with the given layout.

    Returns (flat, ld, batch strides) with ld = contiguous extent + pad."""
    b0, b1, b2, r, c = x.shape
    inner = c if layout == "RowMajor" else r
    ld = inner + pad
    outer = r if layout == "RowMajor" else c
    mat = outer * ld
    flat = rng.standard_normal(b0 * b1 * b2 * mat).astype(np.float32) * 100  # poison padding
    bs = (b1 * b2 * mat, b2 * mat, mat)
    for i0 in range(b0):
        for i1 in range(b1):
            for i2 in range(b2):
                off = i0 * bs[0] + i1 * bs[1] + i2 * bs[2]
                view = flat[off : off + mat].reshape(outer, ld)[:, :inner]
                view[...] = x[i0, i1, i2] if layout == "RowMajor" else x[i0, i1, i2].T
    return flat, ld, bs


def _distance(desc, a, b, inner_p, outer_p):
    """Float64 distance before the epsilon cut and the epilogue."""
    inner, ip, op, ep = desc
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    if inner == "Dot":
        return np.einsum("...mk,...nk->...mn", a64, b64)
    d = np.abs(a64[..., :, None, :] - b64[..., None, :, :])
    p = inner_p[..., None, None, None]
    acc = {"Abs": d, "Square": d * d, "Pow": d**p}[ip].sum(-1)
    if op == "Sqrt":
        acc = np.sqrt(acc)
    elif op == "Pow":
        acc = acc ** (1.0 / outer_p[..., None, None])
    return acc


def _reference(desc, dist, bw, lam, reg_diag, eps):
    ep = desc[3]
    acc = np.where(dist < eps, 0.0, dist) if eps > 0 else dist  # eps <= 0: no cut (dot may be < 0)
    w = bw[..., None, None]
    if ep == "Laplace":
        acc = np.exp(-acc / w)
    elif ep == "Gaussian":
        acc = np.exp(-(acc * acc) / (2 * w * w))
    M, N = acc.shape[-2:]
    m, n = np.meshgrid(np.arange(M), np.arange(N), indexing="ij")
    return acc + np.where(n - m == reg_diag, 1.0, 0.0) * lam[..., None, None]


def run_on_cpu(exe, idx, M, N, K, *, batch=(1, 1, 1), b_bcast=(), pad=(0, 0, 0), inner_p=1.3,
               outer_p=None, bw=None, lam=0.0, lam_tensor=False, bw_tensor=False, reg_diag=0,
               eps=0.0, grid_z=None, seed=0, b_equals_a=False, nonfinite=(), instances=None):
    """``nonfinite``: (operand "a" or "b", row, k, value) entries written into the data;
    ``instances``: the instance list ``idx`` indexes (default CPU_INSTANCES)."""
    desc, la, lb, lo, vec = (CPU_INSTANCES if instances is None else instances)[idx]
    rng = np.random.default_rng(seed)
    bb = tuple(1 if i in b_bcast else e for i, e in enumerate(batch))
    a = rng.standard_normal((*batch, M, K)).astype(np.float32)
    b = a.copy() if b_equals_a else rng.standard_normal((*bb, N, K)).astype(np.float32)
    for which, r, k, v in nonfinite:
        (a if which == "a" else b)[..., r, k] = v
    if vec == 4:  # the launcher's contract for kVec == 4: 16-byte aligned, ld % 4 == 0
        ext = (K if la == "RowMajor" else M, K if lb == "RowMajor" else N)
        pad = (pad[0] + (-(ext[0] + pad[0])) % 4, pad[1] + (-(ext[1] + pad[1])) % 4, pad[2])
    fa, lda, a_bs = _layout_buffer(a, la, pad[0], rng)
    fb, ldb, b_bs = _layout_buffer(b, lb, pad[1], rng)
    b_bs = tuple(0 if i in b_bcast else s for i, s in enumerate(b_bs))
    o_inner = N if lo == "RowMajor" else M
    ldo = o_inner + pad[2]
    o_mat = (M if lo == "RowMajor" else N) * ldo
    nb = int(np.prod(batch))
    fo = np.full(nb * o_mat, np.nan, np.float32)  # poison: must stay where nothing is written
    o_bs = (batch[1] * batch[2] * o_mat, batch[2] * o_mat, o_mat)
    outer_p = inner_p if outer_p is None else outer_p
    b_full = np.broadcast_to(b, (*batch, N, K))
    dist = _distance(desc, a, b_full, np.full(batch, inner_p), np.full(batch, outer_p))
    if bw is None:  # the data's own scale, as users pick it (exp of O(1) arguments)
        bw = float(np.nanmedian(np.where(np.isinf(dist), np.nan, dist))) or 1.0
    bw_arr = (bw * (1 + np.arange(batch[0]))).astype(np.float32) if bw_tensor else np.array([bw], np.float32)
    lam_arr = (lam * (1 + np.arange(batch[2]))).astype(np.float32) if lam_tensor else np.array([lam], np.float32)
    p_arr = np.array([inner_p], np.float32)
    parts = [fa, fb, fo, p_arr, p_arr, bw_arr, lam_arr]
    offs = np.cumsum([0] + [len(x) + (-len(x)) % 4 for x in parts])
    flat = np.zeros(offs[-1], np.float32)
    for o, x in zip(offs, parts):
        flat[o : o + len(x)] = x
    h = np.zeros(64, np.int64)
    h[0:9] = [M, N, K, lda, ldb, ldo, nb, batch[1], batch[2]]
    h[9:18] = [*a_bs, *b_bs, *o_bs]
    h[18:21] = 0  # inner_p: scalar
    h[21:24] = 0
    h[24:27] = (1, 0, 0) if bw_tensor else (0, 0, 0)
    h[27:30] = (0, 0, 1) if lam_tensor else (0, 0, 0)
    h[30] = reg_diag
    h[31] = grid_z or min(nb, 65535)
    h[32:39] = offs[:7]
    h[40:47] = [1, 1, 1, 0, 0, int(bw_tensor), int(lam_tensor)]
    h[63] = len(flat)
    hf = np.array([inner_p, outer_p, bw, lam, eps, 0, 0, 0], np.float32)
    d = Path(tempfile.mkdtemp())
    (d / "in.bin").write_bytes(h.tobytes() + hf.tobytes() + flat.tobytes())
    res = subprocess.run([str(exe), str(idx), str(d / "in.bin"), str(d / "out.bin")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out_flat = np.fromfile(d / "out.bin", np.float32)[offs[2] : offs[2] + len(fo)]
    shutil.rmtree(d)
    got = np.empty((*batch, M, N), np.float32)
    written = np.zeros(len(fo), bool)
    for i0 in range(batch[0]):
        for i1 in range(batch[1]):
            for i2 in range(batch[2]):
                off = i0 * o_bs[0] + i1 * o_bs[1] + i2 * o_bs[2]
                view = out_flat[off : off + o_mat].reshape(-1, ldo)[:, :o_inner]
                got[i0, i1, i2] = view if lo == "RowMajor" else view.T
                written[off : off + o_mat].reshape(-1, ldo)[:, :o_inner] = True
    assert np.all(np.isnan(out_flat[~written])), "kernel wrote outside the output view"
    bw_ref = np.broadcast_to(bw_arr.reshape(-1, 1, 1) if bw_tensor else bw_arr.reshape(1, 1, 1), batch)
    lam_ref = np.broadcast_to(lam_arr.reshape(1, 1, -1) if lam_tensor else lam_arr.reshape(1, 1, 1), batch)
    ref = _reference(desc, dist, bw_ref, lam_ref, reg_diag, eps)
    return got, ref


def rel_fro(got, ref):
    assert np.all(np.isfinite(got)), "non-finite output"
    return float(np.linalg.norm((got - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


def tol(idx):
    desc = CPU_INSTANCES[idx][0]
    return 2e-6 if desc[1] == "Pow" else 1e-6


@pytest.mark.parametrize("idx", range(len(CPU_INSTANCES)))
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (7, 129, 33), (129, 7, 64), (127, 130, 97)])
def test_cpu_execution_odd_shapes(cpu_runner, idx, M, N, K):
    got, ref = run_on_cpu(cpu_runner, idx, M, N, K, pad=(3, 1, 2), seed=M * 1000 + N + K)
    assert rel_fro(got, ref) <= tol(idx)


@pytest.mark.parametrize("idx", [0, 1, 2, 3])
def test_cpu_execution_batch_broadcast_and_diagonal(cpu_runner, idx):
    # 2 x 1 x 3 batch, b broadcast over mode 0, grid_z smaller than the batch
    # (exercises the batch loop), a tensor regularisation over mode 2 on a
    # negative diagonal, a tensor bandwidth over mode 0.
    for reg_diag in (-5, 0, 70):
        got, ref = run_on_cpu(cpu_runner, idx, 130, 140, 40, batch=(2, 1, 3), b_bcast=(0,), pad=(1, 2, 5),
                              lam=0.75, lam_tensor=True, bw_tensor=True, reg_diag=reg_diag, grid_z=2, seed=reg_diag + 7)
        assert rel_fro(got, ref) <= tol(idx), reg_diag


@pytest.mark.parametrize("idx", [0, 2, 3, 4])
def test_cpu_execution_epsilon_and_scalar_regularisation(cpu_runner, idx):
    # epsilon large enough to zero some distances; regularisation offset beyond every tile.
    got, ref = run_on_cpu(cpu_runner, idx, 40, 50, 3, eps=1.0, lam=2.0, reg_diag=3, seed=3)
    assert rel_fro(got, ref) <= tol(idx)
    got, ref = run_on_cpu(cpu_runner, idx, 40, 50, 3, lam=2.0, reg_diag=10**12, seed=4)
    assert rel_fro(got, ref) <= tol(idx)


@pytest.mark.parametrize("idx", [0, 1, 2, 3])
def test_cpu_execution_long_k_accuracy(cpu_runner, idx):
    # K spans several partial-sum chunks (256 k each) and ends in a partial tile.
    got, ref = run_on_cpu(cpu_runner, idx, 33, 65, 1000, seed=11)
    assert rel_fro(got, ref) <= tol(idx)


@pytest.mark.parametrize("idx", [0, 2, 5])
def test_cpu_execution_identical_rows_give_exact_zero(cpu_runner, idx):
    # |0|^p must be exactly 0 on both exp2 pipes (and for the zero-filled k
    # tail): a point's distance to itself is 0, not a denormal residue.
    got, ref = run_on_cpu(cpu_runner, idx, 70, 70, 37, seed=5, b_equals_a=True)
    diag = np.diagonal(got, axis1=-2, axis2=-1)
    expected = np.diagonal(ref, axis1=-2, axis2=-1)
    assert np.array_equal(diag, expected.astype(np.float32)), diag
    assert rel_fro(got, ref) <= tol(idx)


# ------------------------------------------------------ tuned variants (try_simt)
def test_tuned_variants_compile_without_spills_and_mirror_their_launch():
    """The tunings bench/probes/try_simt.py times: the Python mirror (static_assert
    stub, including kSmemBytes) holds and ptxas spills nothing on sm_90."""
    from kermac_like.runtime.compiler import compile_specs
    from kermac_like.descriptor import PRESETS
    from kermac_like.layout import Layout
    from kermac_like.runtime.specs import DISTANCE_LAUNCH, distance_spec

    assert DISTANCE_LAUNCH.smem_bytes == EXPECTED_LAUNCH["kSmemBytes"]
    row = Layout.ROW_MAJOR
    specs = [
        distance_spec(PRESETS["l1"], row, row, row, 1, tuning=(41, 16, 2)),
        distance_spec(PRESETS["l2"], row, row, row, 1, tuning=(41, 64, 1)),
        distance_spec(PRESETS["p_norm"], row, row, row, 1, tuning=(48, 16, 2)),
    ]
    assert specs[0].launch.smem_bytes == 100384 and specs[1].launch.smem_bytes == 136224
    # the defaults render the shipped name (no extra template arguments)
    assert distance_spec(PRESETS["l1"], row, row, row, 1).name_expression.endswith("RowMajor, 1>>")
    _, resources = compile_specs(specs, "sm_90")
    for expr, res in resources.items():
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (expr, res)
    assert resources[specs[0].name_expression]["registers"] <= 128


# NaN and inf (tests/test_nonfinite.py has the op-level tests): the kernel's own arithmetic
# against numpy's on the same float64 formula, NaN and inf positions equal and finite
# values close. Row 3 of a holds a NaN, row 5 of a and row 2 of b +inf in the same
# coordinate (inf - inf = NaN there), row 6 of a -inf.
NONFINITE = (("a", 3, 1, np.nan), ("a", 5, 0, np.inf), ("b", 2, 0, np.inf), ("a", 6, 2, -np.inf))


@pytest.mark.parametrize("idx", [0, 1, 2, 4, 5, 9])
def test_cpu_execution_nan_and_inf_like_numpy(cpu_runner, idx):
    got, ref = run_on_cpu(cpu_runner, idx, 13, 11, 37, inner_p=1.3, bw=2.0, lam=0.5, reg_diag=1, eps=1e-3,
                          nonfinite=NONFINITE)
    assert np.isnan(ref).any() and (np.isinf(ref) | (ref == 0)).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=2e-5, atol=1e-6)
