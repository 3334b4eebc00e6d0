"""CPU tests of cuda_templates/topk_mma.cuh: topk_mma_pipelined_kernel (TopkMmaTraits' kVersion 3
and 4) leaves exactly topk_mma_kernel's (version 2) candidate lists, bit for bit.

Both kernels run under the host emulation of tests/test_templates_mma.py (g++, one fiber per
CUDA thread, host versions of distance_mma.cuh's PTX primitives: cp.async copies land at
wait_group, so a wrong commit-group count reads stale or poisoned stages; mma.sync's TF32
products summed exactly and rounded once, the same for both kernels). The emulation is not the
GPU's arithmetic, so what is compared is v2 against v3 on the same emulator: every accumulator
must see the same MMAs in the same order, the same norms and values, and every (row, quarter)
list the same keys (v4: filtered in registers, inserted lane by lane; v5: the x tile resident). Cases: several y tiles per CTA (the ring runs on across tiles), a CTA with
one tile (no prefetch), split N ranges, ragged M / N / K (K tails of 1..3 k-tiles: fewer k-tiles
than the prefetch depth), a batch of two entries (x norms summed again per entry), Diff / Dot,
largest, Tf32 / Tf32x3, kSel 8 / 16 / 24, integer data full of exact ties, a NaN row and NaN
points.
Also: NVRTC compiles both kernels for sm_80 and sm_90 without spills (skipped without NVRTC).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mma_emulator

ROOT = Path(__file__).resolve().parents[1]

# (Inner, Precision, largest, kSel): runner 4 i + v - 2 runs version v (2, 3, 4, 5) of config i.
CONFIGS = [
    ("Diff", "Tf32", "false", 24),
    ("Dot", "Tf32", "true", 8),
    ("Diff", "Tf32x3", "false", 16),
    ("Dot", "Tf32", "false", 16),
    ("Diff", "Tf32", "true", 8),
]


DRIVER = r'''
struct float4 { float x, y, z, w; };
#define __host__
#define __noinline__ __attribute__((noinline))
#define blockDim (emu::grid_dim)  // (topk.cuh's combine kernel, not run here)
// v4's warp primitives: every lane of the warp calls them together (the loops are warp-uniform)
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline bool __any_sync(unsigned, bool p) {
  auto& w = emu::warps[emu::warp()];
  w.u[emu::lane()][7] = p;
  emu::warp_sync();
  bool any = false;
  for (int l = 0; l < 32; ++l) any |= w.u[l][7] != 0;
  emu::warp_sync();
  return any;
}
inline void __trap() { fail("__trap"); }
#include "topk_mma.cuh"

using namespace kermac_like;
typedef long long i64;

struct TArgs { i64 M, N, K, ld, batch, n_split, per; };

// One emulated launch: the grid's blocks one after another, each block's threads as fibers
// running Call::go<Traits> (the kernel), shared memory poisoned first; Call::reset clears any
// per-block emulator state of the kernel (the wgmma driver's mbarriers).
template <class Traits, class Call>
void launch(const TArgs& A, const float* x, const float* y, long long* scratch) {
  emu::smem_limit = Traits::kSmemBytes;
  emu::grid_dim = {(unsigned)((A.M + 127) / 128), (unsigned)A.n_split, 1};
  emu::nthreads = Traits::kThreads;
  static std::vector<emu::Fiber> fib(Traits::kThreads);
  emu::fibers = fib.data();
  struct Launch { const TArgs* A; const float *x, *y; long long* s; };
  static Launch L;
  L = {&A, x, y, scratch};
  for (unsigned by = 0; by < emu::grid_dim.y; ++by)
    for (unsigned bx = 0; bx < emu::grid_dim.x; ++bx) {
      emu::block_idx = {bx, by, 0};
      std::memset(kermac_like::smem, 0xff, sizeof(kermac_like::smem));  // NaN poison
      emu::copies.clear();
      Call::reset();
      static auto body = []() {
        Call::template go<Traits>(*L.A, L.x, L.y, L.s);
        emu::cur->done = true;
        ++emu::progress;
      };
      static auto tramp = +[]() { body(); };
      run_block(fib, Traits::kThreads, tramp);
      for (int i = 0; i < Traits::kThreads; ++i)
        if (!fib[i].pending.empty()) fail("cp.async copies issued and never committed");
    }
}

struct MmaCall {
  static void reset() {}
  template <class Traits>
  static void go(const TArgs& A, const float* x, const float* y, long long* s) {
    const i64 xbs = A.batch > 1 ? A.M * A.ld : 0, ybs = A.batch > 1 ? A.N * A.ld : 0;
    if constexpr (Traits::kPipelined)
      topk_mma_pipelined_kernel<Traits>(x, y, s, (int)A.M, (int)A.N, (int)A.K, A.ld, A.ld, (int)A.batch,
                                        (int)A.batch, 1, 0, xbs, 0, 0, ybs, 0, (int)A.n_split, (int)A.per);
    else
      topk_mma_kernel<Traits>(x, y, s, (int)A.M, (int)A.N, (int)A.K, A.ld, A.ld, (int)A.batch,
                              (int)A.batch, 1, 0, xbs, 0, 0, ybs, 0, (int)A.n_split, (int)A.per);
  }
};

template <class Traits>
void run(const TArgs& A, const float* x, const float* y, long long* scratch) {
  launch<Traits, MmaCall>(A, x, y, scratch);
}

typedef void (*Runner)(const TArgs&, const float*, const float*, long long*);
static const Runner kRunners[] = {
@@RUNNERS@@
};

// usage: emu RUNNER DIR (DIR: args.bin x.bin y.bin; writes scratch.bin)
int main(int argc, char** argv) {
  if (argc != 3) fail("usage: emu RUNNER DIR");
  const int r = std::atoi(argv[1]);
  const std::string dir = argv[2];
  auto args = slurp(dir + "/args.bin");
  if (args.size() != sizeof(TArgs)) fail("args.bin has the wrong size");
  TArgs A;
  std::memcpy(&A, args.data(), sizeof(TArgs));
  auto xs = slurp(dir + "/x.bin"), ys = slurp(dir + "/y.bin");
  std::vector<float> x(xs.size() / 4 + 4), y(ys.size() / 4 + 4);  // (vectors of floats: 16-byte aligned)
  std::memcpy(x.data(), xs.data(), xs.size());
  std::memcpy(y.data(), ys.data(), ys.size());
  if (r < 0 || r >= (int)(sizeof(kRunners) / sizeof(kRunners[0]))) fail("bad runner");
  // room for kSel <= 24, the rest poisoned: writes beyond kSel per row show up
  std::vector<long long> scratch((size_t)(4 * A.n_split * A.batch * A.M * 24), 0x5555555555555555ll);
  kRunners[r](A, x.data(), y.data(), scratch.data());
  FILE* f = std::fopen((dir + "/scratch.bin").c_str(), "wb");
  std::fwrite(scratch.data(), 8, scratch.size(), f);
  std::fclose(f);
  return 0;
}
'''


VERSIONS = (2, 3, 4, 5)  # 5: K <= 128 only (the resident x tile)


def _traits(inner, prec, largest, sel, version):
    return f"TopkMmaTraits<Inner::{inner}, Precision::{prec}, {largest}, {sel}, {version}>"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    runners = ",\n".join(f"    &run<{_traits(*c, v)}>" for c in CONFIGS for v in VERSIONS)
    return mma_emulator.build(tmp_path_factory, "topk_mma_emulator", DRIVER.replace("@@RUNNERS@@", runners))


def emulate(exe, runner, x, y, n_split=1, tmp=None):
    """x (batch, M, K), y (batch, N, K) float32 -> scratch (4 n_split, batch, M, 24) int64 as the
    kernel leaves it (entries past kSel untouched)."""
    batch, M, K = x.shape
    N = y.shape[1]
    ld = -(-K // 4) * 4
    xp = np.zeros((batch, M, ld), np.float32)
    yp = np.zeros((batch, N, ld), np.float32)
    xp[..., :K], yp[..., :K] = x, y
    n_tiles = -(-N // 256)
    per = -(-n_tiles // n_split)
    assert -(-n_tiles // per) == n_split, "the planner's cover: every split non-empty"
    d = Path(tmp)
    d.mkdir(parents=True, exist_ok=True)
    (d / "args.bin").write_bytes(struct.pack("<7q", M, N, K, ld, batch, n_split, per))
    (d / "x.bin").write_bytes(xp.tobytes())
    (d / "y.bin").write_bytes(yp.tobytes())
    r = subprocess.run([exe, str(runner), str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.frombuffer((d / "scratch.bin").read_bytes(), dtype=np.int64).copy()


def _both(exe, cfg_index, x, y, tmp_path, n_split=1):
    sel = CONFIGS[cfg_index][3]
    batch, M, _ = x.shape
    out = []
    for v in VERSIONS:
        if v == 5 and x.shape[2] > 128:
            continue
        s = emulate(exe, len(VERSIONS) * cfg_index + v - 2, x, y, n_split, tmp_path / f"v{v}")
        used = 4 * n_split * batch * M * sel
        assert (s[used:] == 0x5555555555555555).all(), "writes beyond the scratch"
        out.append(s[:used].reshape(4 * n_split, batch, M, sel))
    return out


def _nearest_among_candidates(lists, x, y, dot, largest):
    """Fraction of rows whose float64 best point is among their candidates (sanity: the lists are
    real candidate lists, not merely equal)."""
    keys = lists ^ np.int64(-(1 << 63))
    idx = (keys & 0xFFFFFFFF).transpose(1, 0, 2).reshape(x.shape[0], -1)
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    v = xd @ yd.T if dot else ((xd[:, None, :] - yd[None, :, :]) ** 2).sum(-1)
    best = v.argmax(1) if largest else v.argmin(1)
    return np.mean([b in set(r.tolist()) for b, r in zip(best, idx)])


CASES = [
    # (config, batch, M, N, K, n_split, integer data)
    pytest.param(0, 1, 130, 700, 132, 1, False, id="diff-tf32-sel24-3tiles-K132"),
    pytest.param(0, 1, 64, 700, 37, 2, False, id="diff-tf32-sel24-split2-K37"),
    pytest.param(1, 2, 40, 520, 20, 1, False, id="dot-largest-sel8-batch2-K20"),
    pytest.param(2, 1, 70, 530, 8, 1, True, id="diff-tf32x3-sel16-int-ties-K8"),
    pytest.param(3, 1, 33, 300, 69, 1, True, id="dot-smallest-sel16-int-ties-K69"),
    pytest.param(4, 1, 20, 600, 33, 1, False, id="diff-largest-sel8-nan-K33"),
    pytest.param(1, 1, 20, 600, 33, 1, False, id="dot-largest-sel8-nan-K33"),
]


@pytest.mark.parametrize("cfg, batch, M, N, K, n_split, integer", CASES)
def test_pipelined_lists_equal_v2(emulator, tmp_path, cfg, batch, M, N, K, n_split, integer):
    """Versions 3, 4 and 5 (K <= 128) leave version 2's scratch, bit for bit."""
    rng = np.random.default_rng(cfg * 100 + K)
    if integer:
        x = rng.integers(-3, 4, (batch, M, K)).astype(np.float32)
        y = rng.integers(-3, 4, (batch, N, K)).astype(np.float32)
    else:
        x = rng.standard_normal((batch, M, K)).astype(np.float32)
        y = rng.standard_normal((batch, N, K)).astype(np.float32)
    nan = K == 33  # the NaN cases: a NaN row and two NaN points
    if nan:
        x[0, 3, 5] = np.nan
        y[0, 7, 1] = np.nan
        y[0, 300, 0] = np.nan
    v2, *later = _both(emulator, cfg, x, y, tmp_path, n_split)
    assert len(later) == (3 if K <= 128 else 2)
    for v, s in zip(VERSIONS[1:], later):
        assert np.array_equal(v2, s), f"version {v}: {int((v2 != s).sum())} keys differ"
    filled = (v2 ^ np.int64(-(1 << 63))) != -1  # (lists past N stay empty: all ones)
    assert filled.sum(axis=(0, 3)).min() >= CONFIGS[cfg][3], "every row has kSel candidates"
    inner, _, largest, sel = CONFIGS[cfg]
    if not integer and not nan:
        for b in range(batch):
            frac = _nearest_among_candidates(v2[:, b], x[b], y[b], inner == "Dot", largest == "true")
            assert frac >= 0.95, frac


# ------------------------------------------------------------------------------ NVRTC


def _nvrtc():
    try:
        from kermac_like.runtime.compiler import compile_specs
    except Exception as e:  # pragma: no cover
        pytest.skip(f"no NVRTC: {e}")
    return compile_specs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_pipelined_compiles_without_spills(arch):
    compile_specs = _nvrtc()
    from kermac_like.runtime.specs.topk import topk_mma_spec

    # version 3 (not shipped; versions 4 and 5 are, and test_compile.py's precompile of the shipped set
    # checks that none of them spills)
    specs = [topk_mma_spec(dot, dot, 10, version=3) for dot in (False, True)]
    try:
        _, res = compile_specs(specs, arch)
    except Exception as e:
        if "nvrtc" in str(e).lower() and "not found" in str(e).lower():  # pragma: no cover
            pytest.skip(str(e))
        raise
    assert len(res) == 2
    for name, r in res.items():
        assert r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0 and r.get("stack", 0) == 0, (name, r)
        assert 0 < r["registers"] <= 255, (name, r)


# ---------------------------------------------------------------------------- planner


@pytest.mark.parametrize("version", [2, 3, 4, 5])
def test_planner_selects_the_version(monkeypatch, version, settings):
    """plan.topk.MMA_VERSION (env KERMAC_LIKE_TOPK_MMA_VERSION) picks topk_mma_pipelined_kernel
    for 3 and 4, with the same arguments and grid as topk_mma_kernel (the launch is stood in for)."""
    import torch

    from kermac_like.ops.knn import prepare_knn
    from kermac_like.plan import topk as P
    from kermac_like.runtime import launcher, store

    x, y = torch.randn(140, 128), torch.randn(900, 128)
    call = prepare_knn(x, y, 10)
    monkeypatch.setattr(P, "_device_index", lambda device: 0)
    monkeypatch.setattr(P, "_sm_count", lambda device: 1)
    monkeypatch.setattr(P, "_blocks_per_sm", lambda kernel: 1)
    monkeypatch.setattr(store, "get_kernel", lambda spec, device, debug=False: spec)
    settings(topk_mma_version=version)
    seen = []

    class Stop(Exception):
        pass

    def fake_launch(spec, grid, args, debug=False):
        seen.append((spec, grid, len(args)))
        raise Stop

    monkeypatch.setattr(launcher, "launch", fake_launch)
    with pytest.raises(Stop):
        P._run_mma(call, torch.empty(140, 10), torch.empty(140, 10, dtype=torch.int64), False)
    (spec, grid, nargs), = seen
    assert spec.kernel.endswith("topk_mma_pipelined_kernel" if version > 2 else "topk_mma_kernel")
    assert grid[0] == 1 and grid[2] == 1 and nargs == 19
    assert spec.launch.smem_bytes == 99840 + {2: 0, 3: 16384, 4: 24576, 5: 32768}[version] + 128 * 4 * 24 * 8
    assert (", %d>" % version in spec.traits) == (version > 2)


def test_version5_falls_back_beyond_k128(monkeypatch, emulator, tmp_path, settings):
    """Version 5 keeps x in shared memory for K <= 128: the planner takes version 4 beyond, and
    the kernel traps if called beyond (never silently wrong lists)."""
    import torch

    from kermac_like.ops.knn import prepare_knn
    from kermac_like.plan import topk as P
    from kermac_like.runtime import launcher, store

    monkeypatch.setattr(P, "_device_index", lambda device: 0)
    monkeypatch.setattr(P, "_sm_count", lambda device: 1)
    monkeypatch.setattr(P, "_blocks_per_sm", lambda kernel: 1)
    monkeypatch.setattr(store, "get_kernel", lambda spec, device, debug=False: spec)
    settings(topk_mma_version=5)
    seen = []

    class Stop(Exception):
        pass

    def fake_launch(spec, grid, args, debug=False):
        seen.append(spec.traits)
        raise Stop

    monkeypatch.setattr(launcher, "launch", fake_launch)
    for K, want in ((128, ", 5>"), (125, ", 5>"), (129, ", 4>"), (200, ", 4>")):
        call = prepare_knn(torch.randn(50, K), torch.randn(300, K), 10)
        with pytest.raises(Stop):
            P._run_mma(call, torch.empty(50, 10), torch.empty(50, 10, dtype=torch.int64), False)
        assert seen[-1].endswith(want), (K, seen[-1])
    x = np.ones((1, 8, 132), np.float32)
    with pytest.raises(AssertionError, match="__trap"):
        emulate(emulator, len(VERSIONS) * 0 + 3, x, x, 1, tmp_path / "trap")


def test_version_fits_the_device_shared_memory(monkeypatch, settings):
    """The planner takes the highest version up to MMA_VERSION whose shared memory fits the
    device's opt-in limit per block, and no tensor-core path where none fits (an A100's 163 KiB
    at kSel 24): those calls take the blocked path."""
    import torch

    from kermac_like.ops.knn import prepare_knn
    from kermac_like.plan import topk as P

    call = prepare_knn(torch.randn(40, 128), torch.randn(90, 128), 10)  # kSel 24
    settings(topk_mma_version=5)
    for optin, want in ((232448, 5), (226000, 4), (220000, 3), (200 * 1024, 2), (163 * 1024, None)):
        monkeypatch.setattr(P, "_smem_optin", lambda device, _o=optin: _o)
        assert P.mma_version(call) == want, optin
    wide = prepare_knn(torch.randn(40, 256), torch.randn(90, 256), 10)  # K > 128: version 4 at most
    monkeypatch.setattr(P, "_smem_optin", lambda device: 232448)
    assert P.mma_version(wide) == 4
