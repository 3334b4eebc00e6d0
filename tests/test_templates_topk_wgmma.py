"""CPU tests of cuda_templates/topk_wgmma.cuh (topk_mma version 6: warp-specialised wgmma, sm_90a).

The kernel runs under the host emulation of tests/test_templates_mma.py (g++, one fiber per CUDA
thread; cp.async copies land at wait_group) with host versions of what it uses of
distance_wgmma.cuh's PTX: mbarriers (phase parity; a wait that never completes is a deadlock
the scheduler reports), named barriers, setmaxnreg (nothing), the proxy fence (nothing) and
wgmma.m64n256k8 TF32 with A from registers and B through its shared-memory descriptor (the 64-byte
swizzle of the stage, decoded from the descriptor's start address): the warpgroup's A fragments
are exchanged, every thread forms its 128 accumulators from the fragment layout of the PTX ISA.
The emulated products are exact and each k8 step's sum is rounded once (as the mma.sync
emulation does), taken in the data-column order of mma.sync's k slots (0 2 4 6 1 3 5 7), so
that version 6 must meet version 5 bit for bit here: same TF32 operands (x rounded in registers,
y rounded in the stage by the loader), same norms (v5's chunk order), same values, and each
row's merged kSel first candidates the same keys (v6's four lists per row are another partition
of the points: columns 2 t, 2 t + 1 mod 8 instead of 64-column quarters). Whether the GPU's
wgmma sums a k8 step as mma.sync does is not claimed: bench/probes/topk_probe.py --only mma6
checks the GPU's lists and the whole call against float64.
Also: NVRTC compiles version 6 for sm_90a without spills; the planner's rule for version 6.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mma_emulator

from test_templates_topk_mma import DRIVER as V5_DRIVER
from test_templates_topk_mma import _nearest_among_candidates

ROOT = Path(__file__).resolve().parents[1]

# (Inner, largest, kSel): runner 2 i runs version 5 of config i, 2 i + 1 version 6.
CONFIGS = [
    ("Diff", "false", 24),
    ("Dot", "true", 8),
    ("Dot", "false", 16),
    ("Diff", "true", 8),
]

HOST_WGMMA = r'''
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
#include "wgmma_prepare.cuh"
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
namespace kermac_like {
namespace wgmma_detail {
struct MBar { unsigned expected = 0, arrived = 0, phase = 0; };
inline std::map<unsigned, MBar>& mbars() { static std::map<unsigned, MBar> m; return m; }
inline void mbar_init(unsigned addr, unsigned count) { mbars()[addr] = MBar{count, 0, 0}; }
inline void mbar_arrive(unsigned addr) {
  auto it = mbars().find(addr);
  if (it == mbars().end()) fail("arrive on an uninitialised mbarrier");
  ++emu::progress;
  if (++it->second.arrived == it->second.expected) { it->second.arrived = 0; ++it->second.phase; }
}
inline void mbar_wait(unsigned addr, unsigned parity) {
  for (;;) {
    auto it = mbars().find(addr);
    if (it == mbars().end()) fail("wait on an uninitialised mbarrier");
    if ((it->second.phase & 1u) != parity) break;
    emu::yield();
  }
  ++emu::progress;
}
inline void fence_mbarrier_init_cluster() {}
inline void fence_proxy_async() {}
template <int kRegs> inline void regs_increase() {}
template <int kRegs> inline void regs_decrease() {}
inline emu::Barrier& named_bar(int id) { static emu::Barrier b[16]; return b[id]; }
template <int kId, int kThreads> inline void named_barrier() { named_bar(kId).wait(kThreads); }
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int kPending> inline void wgmma_wait() {}
inline unsigned long long make_desc(unsigned smem_addr) { return smem_addr; }
// Not used by topk_wgmma_kernel (declared for distance_wgmma.cuh's templates).
inline void mbar_arrive_expect_tx(unsigned, unsigned) { fail("not emulated"); }
inline void mbar_arrive_cluster(unsigned, unsigned) { fail("not emulated"); }
inline void bulk_copy_multicast(unsigned, const void*, unsigned, unsigned, unsigned short) { fail("not emulated"); }
inline unsigned cluster_ctarank() { return 0; }
inline unsigned cluster_id_x() { return 0; }
inline unsigned cluster_count_x() { return 1; }
inline void cluster_sync() { fail("not emulated"); }
inline void cp_async_mbar_arrive(unsigned) { fail("not emulated"); }
inline void cp_async_wait_all() { fail("not emulated"); }
inline void a_fragment_offsets(int, int, unsigned (&)[2]) { fail("not emulated"); }
template <bool kSplit, bool kDiff, int kTileABytes, int kTileBBytes>
inline void consume_k_tile(float (&)[128], unsigned (&)[2][2][4], float (&)[2], unsigned, const unsigned (&)[2], int) {
  fail("not emulated");
}
template <bool kSplit, bool kDiff>
inline void load_a_k_tile(unsigned (&)[2][2][4], float (&)[2], unsigned, const unsigned (&)[2]) { fail("not emulated"); }
template <bool kSplit, int kTileABytes, int kTileBBytes>
inline void chunk_k_tile(float (&)[64], const unsigned (&)[2][2][4], unsigned, bool) { fail("not emulated"); }
template <bool kSplit, int kTileBBytes>
inline void half_k_tile(float (&)[64], const unsigned (&)[2][2][4], unsigned, bool) { fail("not emulated"); }

// D (64 x 256) += A (64 x 8, registers of the warpgroup) B (256 x 8, the stage at the descriptor)^T.
inline unsigned wg_a[384][4];
inline emu::Barrier wg_bar[3];
inline void wgmma_m64n256k8_tf32_rs(float (&d)[128], const unsigned (&a)[4], unsigned long long desc) {
  const int tid = emu::cur->tid.x, wg = tid / 128, w = (tid / 32) % 4, l = tid % 32, g = l / 4, t = l % 4;
  for (int r = 0; r < 4; ++r) wg_a[tid][r] = a[r];
  wg_bar[wg].wait(128);
  const unsigned start = (unsigned)desc;
  const unsigned s = (start % 64) / 32, tile = start - 32 * s;
  if (tile % 1024 != 0) fail("wgmma B tile not 1 KiB aligned");
  static const int kOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // mma.sync's k slots in data columns
  float res[128];
  for (int j = 0; j < 32; ++j)
    for (int h = 0; h < 2; ++h)
      for (int e = 0; e < 2; ++e) {
        const int row = 16 * w + g + 8 * h, col = 8 * j + 2 * t + e;
        double sum = d[4 * j + 2 * h + e];
        for (int q = 0; q < 8; ++q) {
          const int k = kOrder[q];
          const unsigned av = wg_a[wg * 128 + (row / 16) * 32 + (row % 8) * 4 + k % 4][(row % 16 >= 8) + 2 * (k >= 4)];
          unsigned bv;
          std::memcpy(&bv, kermac_like::smem + tile + swizzled(col, 2 * s + k / 4) + (k % 4) * 4, 4);
          sum += mma_detail::tf32_value(av) * mma_detail::tf32_value(bv);
        }
        res[4 * j + 2 * h + e] = (float)sum;
      }
  wg_bar[wg].wait(128);
  for (int i = 0; i < 128; ++i) d[i] = res[i];
}
}  // namespace wgmma_detail
}  // namespace kermac_like
#include "topk_wgmma.cuh"

struct WgmmaCall {
  static void reset() { kermac_like::wgmma_detail::mbars().clear(); }
  template <class Traits>
  static void go(const TArgs& A, const float* x, const float* y, long long* s) {
    topk_wgmma_kernel<Traits>(x, y, s, (int)A.M, (int)A.N, (int)A.K, A.ld, A.ld, 1, 1, 1, 0, 0, 0, 0, 0, 0,
                              (int)A.n_split, (int)A.per);
  }
};

template <class Traits>
void run6(const TArgs& A, const float* x, const float* y, long long* scratch) {
  if (A.batch != 1) fail("version 6: one batch entry");
  launch<Traits, WgmmaCall>(A, x, y, scratch);
}
'''


def _driver() -> str:
    head, tail = V5_DRIVER.split("typedef void (*Runner)")
    runners = []
    for inner, largest, sel in CONFIGS:
        runners.append(f"    &run<TopkMmaTraits<Inner::{inner}, Precision::Tf32, {largest}, {sel}, 5>>")
        runners.append(f"    &run6<TopkWgmmaTraits<Inner::{inner}, {largest}, {sel}>>")
    return (head + HOST_WGMMA + "typedef void (*Runner)" + tail).replace("@@RUNNERS@@", ",\n".join(runners))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return mma_emulator.build(tmp_path_factory, "topk_wgmma_emulator", "#include <map>\n" + _driver())


def emulate(exe, runner, x, y, n_split, tmp):
    M, K = x.shape
    N = y.shape[0]
    ld = -(-K // 4) * 4
    xp = np.zeros((M, ld), np.float32)
    yp = np.zeros((N, ld), np.float32)
    xp[:, :K], yp[:, :K] = x, y
    n_tiles = -(-N // 256)
    per = -(-n_tiles // n_split)
    assert -(-n_tiles // per) == n_split
    d = Path(tmp)
    d.mkdir(parents=True, exist_ok=True)
    (d / "args.bin").write_bytes(struct.pack("<7q", M, N, ld, ld, 1, n_split, per))
    (d / "x.bin").write_bytes(xp.tobytes())
    (d / "y.bin").write_bytes(yp.tobytes())
    r = subprocess.run([exe, str(runner), str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.frombuffer((d / "scratch.bin").read_bytes(), dtype=np.int64).copy()


def _merged(lists, sel):
    """Each row's kSel first keys over its lists (lists, M, kSel) -> (M, kSel)."""
    rows = lists.transpose(1, 0, 2).reshape(lists.shape[1], -1)
    return np.sort(rows, axis=1)[:, :sel]


CASES = [
    # (config, M, N, K, n_split, data)
    pytest.param(0, 130, 700, 128, 1, "normal", id="diff-sel24-3tiles-K128-ragged-M"),
    pytest.param(0, 64, 700, 37, 2, "normal", id="diff-sel24-split2-K37"),
    pytest.param(1, 40, 520, 20, 1, "normal", id="dot-largest-sel8-K20"),
    pytest.param(2, 33, 300, 69, 1, "int", id="dot-smallest-sel16-int-ties-K69"),
    pytest.param(3, 20, 600, 33, 1, "nan", id="diff-largest-sel8-nan-K33"),
    pytest.param(0, 20, 600, 8, 1, "nan", id="diff-sel24-nan-K8"),
]


@pytest.mark.parametrize("cfg, M, N, K, n_split, data", CASES)
def test_v6_candidates_equal_v5(emulator, tmp_path, cfg, M, N, K, n_split, data):
    """Version 6 leaves each row the same kSel first candidates as version 5 (emulated arithmetic),
    sorted lists, and nothing written beyond the scratch."""
    rng = np.random.default_rng(cfg * 100 + K)
    if data == "int":
        x = rng.integers(-3, 4, (M, K)).astype(np.float32)
        y = rng.integers(-3, 4, (N, K)).astype(np.float32)
    else:
        x = rng.standard_normal((M, K)).astype(np.float32)
        y = rng.standard_normal((N, K)).astype(np.float32)
    if data == "nan":
        x[3, 5] = np.nan
        y[7, 1] = np.nan
        y[300, 0] = np.nan
    inner, largest, sel = CONFIGS[cfg]
    used = 4 * n_split * M * sel
    out = []
    for v in (5, 6):
        s = emulate(emulator, 2 * cfg + (v - 5), x, y, n_split, tmp_path / f"v{v}")
        assert (s[used:] == 0x5555555555555555).all(), f"version {v}: writes beyond the scratch"
        out.append(s[:used].reshape(4 * n_split, M, sel))
    v5, v6 = out
    assert (np.diff(v6, axis=2) >= 0).all(), "version 6's lists are sorted"
    m5, m6 = _merged(v5, sel), _merged(v6, sel)
    assert np.array_equal(m5, m6), f"{int((m5 != m6).any(1).sum())} of {M} rows differ"
    if data == "normal":
        frac = _nearest_among_candidates(v6, x, y, inner == "Dot", largest == "true")
        assert frac >= 0.95, frac


# ------------------------------------------------------------------------------ NVRTC


# (version 6 is shipped: test_compile.py's precompile of the shipped set checks it compiles without spills)


# ---------------------------------------------------------------------------- planner


def test_planner_version6_rule(monkeypatch, settings):
    """MMA_VERSION = 6 takes version 6 on sm_90 devices for K <= 128 (its spec: topk_wgmma_kernel,
    384 threads, sm_90a), version 5 elsewhere, version 4 beyond K = 128; Tf32x3 has no version 6."""
    import torch

    from kermac_like.ops.knn import prepare_knn
    from kermac_like.plan import topk as P
    from kermac_like.runtime.specs.topk import mma_smem, topk_mma_spec

    settings(topk_mma_version=6)
    monkeypatch.setattr(P, "_smem_optin", lambda device: 232448)
    narrow = prepare_knn(torch.randn(40, 128), torch.randn(90, 128), 10)
    wide = prepare_knn(torch.randn(40, 132), torch.randn(90, 132), 10)
    monkeypatch.setattr(P, "_sm90", lambda device: True)
    assert P.mma_version(narrow) == 6 and P.mma_version(wide) == 4
    monkeypatch.setattr(P, "_sm90", lambda device: False)
    assert P.mma_version(narrow) == 5
    spec = topk_mma_spec(False, False, 10, version=6)
    assert spec.kernel.endswith("topk_wgmma_kernel") and spec.arch_suffix == "a"
    assert spec.launch.threads == 384 and spec.launch.smem_bytes == mma_smem(24, 6) <= 232448
    with pytest.raises(ValueError):
        topk_mma_spec(False, False, 10, "Tf32x3", version=6)
