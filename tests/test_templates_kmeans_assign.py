"""CPU tests of cuda_templates/kmeans_assign_mma.cuh: the certified tensor-core assignment gives, row
for row, the label and distance bits of the exact float32 path (knn's SIMT arithmetic: k in order,
fma, topk's two partial sums where kAcc == 2), and certifies only rows whose float64 argmin it has.

The kernels run under the host emulation of tests/test_templates_mma.py (g++, one fiber per CUDA
thread, host versions of the PTX primitives: mma.sync's TF32 products summed exactly and rounded once,
cp.async landing at wait_group) with a reference written out plainly in the driver (the exact path's
values for every pair, the first in the order (value bits, index)). Cases: K = 16 (kK 16, one and
three centre tiles), K = 5 (kK 8: a K tail), K = 33 (kK 64: topk's split partial sums, tiles of 32),
N not a multiple of the CTA's points, blob data as the bench's, rows on the bisector of two centres
(near-ties the certificate must refuse), duplicate centres (smallest index), points on a centre, a
single centre. The certificate's bound is tested by removing it (tau = 0): the near-tie rows then
give other labels than the exact path, so the comparison can see a bound that is too small.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mma_emulator

import torch

from kermac_like.plan.kmeans import assign_split, assign_tau, bound_consts, centre_bounds, local_rows
from kermac_like.runtime.specs.kmeans import assign_k_bucket, assign_shape

ROOT = Path(__file__).resolve().parents[1]
KKS = (8, 16, 64)


DRIVER = r'''
using std::max;
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
namespace kermac_like { namespace kmeans_assign_detail {
inline int shfl_xor_int(int v, int m) { return __float_as_int(__shfl_xor_sync(0xffffffffu, __int_as_float(v), m)); }
inline int shfl_int(int v, int src) { return mma_detail::near_shfl(v, src); }  // the prelude's warp primitives
inline unsigned ballot(bool p) { return mma_detail::near_ballot(p); }
}}
// one fiber runs at a time between warp_syncs: plain read-modify-writes are atomic here
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline int atomicMax(int* p, int v) { const int o = *p; if (v > o) *p = v; return o; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
#include "kmeans_assign_mma.cuh"

using namespace kermac_like;
typedef long long i64;
struct AArgs { i64 N, C, K, split; float tau, gu, gl, kap; i64 local; };

template <class Tr>
void run(const AArgs& A, const float* x, const float* c, long long* labels, float* dist, unsigned char* cert,
         const int* rows = nullptr, int n_rows = 0, float* ub = nullptr, float* lb = nullptr, int* rmax = nullptr,
         int* changed = nullptr) {
  const int C = (int)A.C, K = (int)A.K, N = rows ? n_rows : (int)A.N;
  const int cp = (C + Tr::kBlockN - 1) / Tr::kBlockN * Tr::kBlockN;
  std::vector<uint4> cf(size_t(cp) / 8 * Tr::kSteps * 32 + (size_t(cp) * K + 3) / 4);  // fragments, then ct
  std::vector<float> cn(cp, -7.0f);
  float cmax = -7.0f;
  launch_grid<Tr>(1, 1, [&] { kmeans_assign_prep_kernel<Tr>(c, cf.data(), cn.data(), &cmax, C, K, K); });
  launch_grid<Tr>((N + Tr::kBlockM - 1) / Tr::kBlockM, 1, [&] {
    kmeans_assign_mma_kernel<Tr>(x, c, cf.data(), cn.data(), &cmax, labels, dist, cert, N, C, K, K, 1, K, A.tau,
                                 (int)A.split, rows, ub, lb, rmax, changed, A.gu, A.gl);
  });
}

// One pruned step: the filter, the assignment of its work list, then the exact mode's distances.
template <class Tr>
void step(const AArgs& A, const float* x, const float* c, long long* labels, float* ub, float* lb,
          const float* drift, const float* mdl, const float* halfs, const float* rth, int* rmax, int* work,
          int* count, int* changed, float* dist, float* exact) {
  typedef KmeansBoundsTraits B;
  const int N = (int)A.N, K = (int)A.K;
  launch_grid<B>((N + B::kThreads - 1) / B::kThreads, 1, [&] {
    kmeans_bounds_kernel<B>(x, c, labels, ub, lb, drift, mdl, halfs, rth, rmax, work, count, nullptr, N, K, K, 1, K,
                            (int)A.split, A.kap, A.gu);
  });
  run<Tr>(A, x, c, labels, dist, nullptr, work, *count, ub, lb, rmax, changed);
  launch_grid<B>((N + B::kThreads - 1) / B::kThreads, 1, [&] {
    kmeans_bounds_kernel<B>(x, c, labels, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr, exact, N, K, K, 1, K, (int)A.split, 1.0f, 1.0f);
  });
}

// The exact path written out: every pair's value, the first in the order (bits, index).
void reference(const AArgs& A, const float* x, const float* c, long long* labels, float* dist) {
  for (i64 m = 0; m < A.N; ++m) {
    unsigned kv = 0xffffffffu;
    long long kn = -1;
    for (i64 n = 0; n < A.C; ++n) {
      float a[2] = {0.0f, 0.0f};
      for (i64 q = 0; q < A.K; ++q) {
        const float d = x[m * A.K + q] - c[n * A.K + q];
        float& s = a[A.split ? q % 2 : 0];
        s = std::fma(d, d, s);
      }
      const float v = a[0] + a[1];
      unsigned b;
      std::memcpy(&b, &v, 4);
      if (kn < 0 || b < kv) kv = b, kn = n;
    }
    labels[m] = kn;
    float v;
    std::memcpy(&v, &kv, 4);
    dist[m] = std::sqrt(v);
  }
}

typedef void (*Runner)(const AArgs&, const float*, const float*, long long*, float*, unsigned char*, const int*,
                       int, float*, float*, int*, int*);
static const Runner kRunners[] = {&run<KmeansAssignTraits<8>>, &run<KmeansAssignTraits<16>>,
                                  &run<KmeansAssignTraits<64>>};
static const Runner kLocalRunners[] = {&run<KmeansAssignTraits<8, true>>, &run<KmeansAssignTraits<16, true>>,
                                       &run<KmeansAssignTraits<64, true>>};
typedef void (*Stepper)(const AArgs&, const float*, const float*, long long*, float*, float*, const float*,
                        const float*, const float*, const float*, int*, int*, int*, int*, float*, float*);
static const Stepper kSteppers[] = {&step<KmeansAssignTraits<8>>, &step<KmeansAssignTraits<16>>,
                                    &step<KmeansAssignTraits<64>>};

template <class T>
std::vector<T> load(const std::string& path, size_t n) {
  auto b = slurp(path);
  if (b.size() != n * sizeof(T)) fail((path + " has the wrong size").c_str());
  std::vector<T> v(n);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}
template <class T>
void put(FILE* f, const std::vector<T>& v) { std::fwrite(v.data(), sizeof(T), v.size(), f); }

// usage: emu RUNNER DIR [step]
//   (args.bin x.bin c.bin; writes out.bin: labels | dist | cert | ref labels | ref dist | ub | lb | rmax)
//   step: also labels.bin ub.bin lb.bin drift.bin mdl.bin halfs.bin rth.bin (c.bin: the new centres); writes
//   out.bin: labels | ub | lb | rmax | changed | count | work | exact dist | ref labels | ref dist
int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) fail("usage: emu RUNNER DIR [step]");
  const int r = std::atoi(argv[1]);
  const std::string dir = argv[2];
  auto args = slurp(dir + "/args.bin");
  if (args.size() != sizeof(AArgs)) fail("args.bin has the wrong size");
  AArgs A;
  std::memcpy(&A, args.data(), sizeof(AArgs));
  auto xs = slurp(dir + "/x.bin"), cs = slurp(dir + "/c.bin");
  std::vector<float> x(xs.size() / 4 + 4), c(cs.size() / 4 + 4);
  std::memcpy(x.data(), xs.data(), xs.size());
  std::memcpy(c.data(), cs.data(), cs.size());
  std::vector<long long> rl(A.N);
  std::vector<float> rd(A.N);
  reference(A, x.data(), c.data(), rl.data(), rd.data());
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  if (argc == 4 && std::string(argv[3]) == "local") {  // rows.bin (the launch rows), labels.bin (the old labels)
    auto labels = load<long long>(dir + "/labels.bin", A.N);
    const size_t M = slurp(dir + "/rows.bin").size() / 4;
    auto rows = load<int>(dir + "/rows.bin", M);
    std::vector<float> dist(A.N, -5.0f), ub(A.N, -5.0f), lb(A.N, -5.0f);
    std::vector<unsigned char> cert(A.N, 7);
    std::vector<int> rmax(A.C, 0);
    kLocalRunners[r](A, x.data(), c.data(), labels.data(), dist.data(), cert.data(), rows.data(), (int)M, ub.data(),
                lb.data(), rmax.data(), nullptr);
    put(f, labels), put(f, dist), put(f, cert), put(f, rl), put(f, rd), put(f, ub), put(f, lb), put(f, rmax);
  } else if (argc == 3) {
    std::vector<long long> labels(A.N, -5);
    std::vector<float> dist(A.N, -5.0f), ub(A.N, -5.0f), lb(A.N, -5.0f);
    std::vector<unsigned char> cert(A.N, 7);
    std::vector<int> rmax(A.C, 0);
    kRunners[r](A, x.data(), c.data(), labels.data(), dist.data(), cert.data(), nullptr, 0, ub.data(), lb.data(),
                rmax.data(), nullptr);
    put(f, labels), put(f, dist), put(f, cert), put(f, rl), put(f, rd), put(f, ub), put(f, lb), put(f, rmax);
  } else {
    auto labels = load<long long>(dir + "/labels.bin", A.N);
    auto ub = load<float>(dir + "/ub.bin", A.N), lb = load<float>(dir + "/lb.bin", A.N);
    auto drift = load<float>(dir + "/drift.bin", A.C), mdl = load<float>(dir + "/mdl.bin", A.C);
    auto halfs = load<float>(dir + "/halfs.bin", A.C), rth = load<float>(dir + "/rth.bin", A.C);
    std::vector<int> rmax(A.C, 0), work(A.N, -1), count(1, 0), changed(1, 0);
    std::vector<float> dist(A.N, -5.0f), exact(A.N, -5.0f);
    kSteppers[r](A, x.data(), c.data(), labels.data(), ub.data(), lb.data(), drift.data(), mdl.data(), halfs.data(),
                 rth.data(), rmax.data(), work.data(), count.data(), changed.data(), dist.data(), exact.data());
    put(f, labels), put(f, ub), put(f, lb), put(f, rmax), put(f, changed), put(f, count), put(f, work);
    put(f, exact), put(f, rl), put(f, rd);
  }
  std::fclose(f);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return mma_emulator.build(tmp_path_factory, "kmeans_assign_emulator", DRIVER)


def _args(N, K, C, tau=None, local=0):
    gu, gl, kap = bound_consts(K)
    tau = assign_tau(K) if tau is None else tau
    return struct.pack("<4q4fq", N, C, K, assign_split(K), tau, gu, gl, kap, local)


def _read(b, N, C, layout):
    o, out = 0, []
    for dt, n in layout:
        n = {"N": N, "C": C, 1: 1}[n]
        size = np.dtype(dt).itemsize * n
        out.append(np.frombuffer(b[o:o + size], dtype=dt).copy())
        o += size
    assert o == len(b)
    return out


def emulate(exe, x, c, tmp, tau=None, bounds=False):
    """(labels, dist, cert, ref labels, ref dist) of the emulated kernels and the driver's reference;
    ``bounds``: also (ub, lb, rmax) of the assignment."""
    N, K = x.shape
    C = c.shape[0]
    d = Path(tmp)
    d.mkdir(parents=True, exist_ok=True)
    (d / "args.bin").write_bytes(_args(N, K, C, tau))
    (d / "x.bin").write_bytes(np.ascontiguousarray(x, np.float32).tobytes())
    (d / "c.bin").write_bytes(np.ascontiguousarray(c, np.float32).tobytes())
    r = subprocess.run([exe, str(KKS.index(assign_k_bucket(K))), str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = _read((d / "out.bin").read_bytes(), N, C, [(np.int64, "N"), (np.float32, "N"), (np.uint8, "N"),
                                                     (np.int64, "N"), (np.float32, "N"), (np.float32, "N"),
                                                     (np.float32, "N"), (np.int32, "C")])
    return out if bounds else out[:5]


def emulate_step(exe, x, c_new, labels, ub, lb, drift, mdl, halfs, rth, tmp):
    """One pruned step on the emulator: (labels, ub, lb, rmax, changed, count, work, exact dist, ref labels,
    ref dist) with the reference at the new centres."""
    N, K = x.shape
    C = c_new.shape[0]
    d = Path(tmp)
    d.mkdir(parents=True, exist_ok=True)
    (d / "args.bin").write_bytes(_args(N, K, C))
    for name, a, dt in (("x", x, np.float32), ("c", c_new, np.float32), ("labels", labels, np.int64),
                        ("ub", ub, np.float32), ("lb", lb, np.float32), ("drift", drift, np.float32),
                        ("mdl", mdl, np.float32), ("halfs", halfs, np.float32), ("rth", rth, np.float32)):
        (d / f"{name}.bin").write_bytes(np.ascontiguousarray(a, dt).tobytes())
    r = subprocess.run([exe, str(KKS.index(assign_k_bucket(K))), str(d), "step"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return _read((d / "out.bin").read_bytes(), N, C, [(np.int64, "N"), (np.float32, "N"), (np.float32, "N"),
                                                      (np.int32, "C"), (np.int32, 1), (np.int32, 1), (np.int32, "N"),
                                                      (np.float32, "N"), (np.int64, "N"), (np.float32, "N")])


def _data(kind, N, K, C, seed):
    rng = np.random.default_rng(seed)
    if kind in ("blobs", "shifted"):  # bench/run.py's kmeans data; shifted: 8 blobs, 300 x their spread away
        means = 4 * rng.standard_normal((C if kind == "blobs" else 8, K))
        x = means[rng.integers(0, len(means), N)] + rng.standard_normal((N, K))
        c = x[rng.choice(N, C, replace=False)] + 0.1 * rng.standard_normal((C, K))
        if kind == "shifted":
            x, c = x + 1200.0, c + 1200.0
        return x.astype(np.float32), c.astype(np.float32)
    x = rng.standard_normal((N, K)).astype(np.float32)
    c = rng.standard_normal((C, K)).astype(np.float32)
    # near-ties: the first 60 rows on the bisector of a centre and its nearest centre (float64, then
    # rounded: exact gaps of the order of the rounding), rows 60..69 on a centre, 70..79 near a duplicate
    c[41] = c[6]
    c64 = c.astype(np.float64)
    dcc = ((c64[:, None] - c64[None]) ** 2).sum(-1) + np.eye(C) * 1e30
    for i in range(min(60, N)):
        a = i % C
        b = int(np.argmin(dcc[a]))
        x[i] = (0.5 * (c64[a] + c64[b])).astype(np.float32)
    for i in range(60, min(70, N)):
        x[i] = c[(7 * i) % C]
    for i in range(70, min(80, N)):
        x[i] = c[6] + np.float32(1e-3) * rng.standard_normal(K).astype(np.float32)
    return x, c


def _float64_order(x, c):
    d = ((x.astype(np.float64)[:, None] - c.astype(np.float64)[None]) ** 2).sum(-1)
    o = np.argsort(d, axis=1, kind="stable")
    best = o[:, 0]
    gap = d[np.arange(len(x)), o[:, 1]] - d[np.arange(len(x)), best] if c.shape[0] > 1 else np.full(len(x), np.inf)
    return best, gap, d


# blobs far from the origin (shift 300 x the blobs' spread): the certificate's width tau (|x|^2 + |c|^2)
# exceeds most gaps, so most rows go through the rescan (many a warp; the row read or in registers)
SHIFTED = [
    pytest.param("shifted", 300, 16, 130, id="K16-C130-shifted"),
    pytest.param("shifted", 200, 5, 40, id="K5-C40-shifted"),
    pytest.param("shifted", 100, 33, 40, id="K33-C40-shifted"),
]
CASES = [
    pytest.param("ties", 300, 16, 70, id="K16-C70-ties"),
    pytest.param("blobs", 300, 16, 300, id="K16-C300-blobs-3tiles"),
    pytest.param("ties", 200, 5, 70, id="K5-C70-ties"),
    pytest.param("ties", 150, 33, 70, id="K33-C70-ties-split"),
    pytest.param("blobs", 100, 16, 1, id="K16-C1"),
]


@pytest.mark.parametrize("kind, N, K, C", CASES + SHIFTED)
def test_labels_and_distances_are_the_exact_paths(emulator, tmp_path, kind, N, K, C):
    x, c = _data(kind, N, K, C, seed=N + K + C)
    labels, dist, cert, rl, rd = emulate(emulator, x, c, tmp_path)
    assert set(np.unique(cert)) <= {0, 1}, "every row written"
    assert np.array_equal(labels, rl), f"{int((labels != rl).sum())} labels differ from the exact path"
    assert np.array_equal(dist.view(np.int32), rd.view(np.int32)), "distance bits differ from the exact path"
    best, gap, _ = _float64_order(x, c)
    ok = cert == 1
    # certified rows: the float64 argmin, with a positive float64 gap
    assert np.array_equal(labels[ok], best[ok]) and (gap[ok] > 0).all()
    # and never a row whose float64 gap is below the bound's smallest width (2 gamma B, B >= the row's)
    B = (x.astype(np.float64) ** 2).sum(1) + (c.astype(np.float64) ** 2).sum(1).max()
    assert (gap[ok] > 4 * (K + 4) * 2.0 ** -24 * B[ok]).all()
    wide = gap > 1e-5 * B  # labels equal the float64 argmin wherever the gap is not a near-tie
    assert np.array_equal(labels[wide], best[wide])
    if kind == "shifted":
        assert ok.mean() < 0.5, "the rescan is what this case tests"
    elif C > 1:
        assert ok.mean() > 0.5, f"only {ok.mean():.2f} of the rows certified"
    if kind == "ties":
        assert not ok[:60].any() or (gap[:60][ok[:60]] > 0).all()
        assert (labels[70:80] == 6).all() and not ok[70:80].any(), "duplicate centres: the smaller index, uncertified"
        assert (dist[60:70] == 0).all()
    if C == 1:
        assert (labels == 0).all() and ok.all()


def test_a_zero_bound_is_seen(emulator, tmp_path):
    """Without the certificate's width (tau = 0) the near-tie rows certify the MMA's pick, and some of
    them differ from the exact path: the comparison above would fail."""
    x, c = _data("ties", 300, 16, 70, seed=386)
    rng = np.random.default_rng(5)
    # more near-ties: bisector points of random neighbour pairs, slightly perturbed
    c64 = c.astype(np.float64)
    dcc = ((c64[:, None] - c64[None]) ** 2).sum(-1) + np.eye(70) * 1e30
    for i in range(80, 300):
        a = int(rng.integers(70))
        b = int(np.argmin(dcc[a]))
        x[i] = (0.5 * (c64[a] + c64[b]) + 1e-7 * rng.standard_normal(16)).astype(np.float32)
    labels, _, cert, rl, _ = emulate(emulator, x, c, tmp_path / "zero", tau=0.0)
    assert (labels != rl).any(), "tau = 0 went unnoticed"
    labels, _, cert, rl, _ = emulate(emulator, x, c, tmp_path / "tau")
    assert np.array_equal(labels, rl)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_unshipped_bucket_compiles_without_spills(arch):
    """kK = 64 (compiled on first use; kK 8, 16 and 32 are shipped: test_compile.py) without spills."""
    try:
        from kermac_like.runtime.compiler import compile_specs
    except Exception as e:  # pragma: no cover
        pytest.skip(f"no NVRTC: {e}")
    from kermac_like.runtime.specs.kmeans import assign_prep_spec, assign_spec

    _, res = compile_specs([assign_prep_spec(64), assign_spec(64)], arch)
    assert len(res) == 2
    for name, r in res.items():
        assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0 and 0 < r["registers"] <= 128, (name, r)


# -- the pruned iterations' bounds (plan.kmeans.BoundedAssign) -------------------------------------------
def _true_dists(x, c):
    return np.sqrt(((x.astype(np.float64)[:, None] - c.astype(np.float64)[None]) ** 2).sum(-1))


def _check_bounds(x, c, labels, ub, lb):
    """ub >= ||x - c_label|| and lb <= the distance to every other centre, in float64."""
    d = _true_dists(x, c)
    rows = np.arange(len(x))
    assert (ub.astype(np.float64) >= d[rows, labels]).all(), "an upper bound below the distance"
    other = d.copy()
    other[rows, labels] = np.inf
    assert (lb.astype(np.float64) <= other.min(1)).all(), "a lower bound above the second distance"


@pytest.mark.parametrize("kind, N, K, C", [CASES[0], CASES[1], CASES[3], CASES[4], SHIFTED[0]])
def test_assignment_bounds_hold(emulator, tmp_path, kind, N, K, C):
    """The assignment's bounds: valid in real arithmetic, lb from the certified gap or, on rescanned rows,
    from the second smallest exact value (within float32 rounding of the second distance: not 0, so the
    next step's filter can keep the row), rmax the largest ub of each cluster; on blob data lb > ub for
    most rows (bounds that prune)."""
    x, c = _data(kind, N, K, C, seed=N + K + C + 1)
    labels, dist, cert, rl, rd, ub, lb, rmax = emulate(emulator, x, c, tmp_path, bounds=True)
    assert np.array_equal(labels, rl) and np.array_equal(dist.view(np.int32), rd.view(np.int32))
    _check_bounds(x, c, labels, ub, lb)
    assert (ub >= dist).all()
    if C > 1:
        d = _true_dists(x, c)
        d[np.arange(N), labels] = np.inf
        unc = cert == 0
        assert unc.any() or kind == "blobs"
        assert (lb[unc] >= d.min(1)[unc] * (1 - 1e-5)).all(), "a rescanned row's lb is not tight"
    for a in range(C):
        mine = ub[labels == a]
        assert rmax[a] == (mine.max().view(np.int32) if mine.size else 0)
    if kind == "blobs" and C > 1:
        assert (lb > ub).mean() > 0.9


def _step_case(emulator, tmp_path, kind, N, K, C, move, seed):
    x, c = _data(kind, N, K, C, seed=seed)
    labels, _, _, _, _, ub, lb, rmax = emulate(emulator, x, c, tmp_path / "first", bounds=True)
    rng = np.random.default_rng(seed)
    c_new = (c + move * rng.standard_normal(c.shape)).astype(np.float32)
    c_new[3] = x[int(rng.integers(N))]  # a relocated centre: a long drift
    return x, c, c_new, labels, ub, lb, rmax


@pytest.mark.parametrize("kind, N, K, C, move", [("blobs", 300, 16, 70, 0.05), ("blobs", 300, 16, 300, 0.3),
                                                 ("ties", 300, 16, 70, 0.01), ("ties", 150, 33, 70, 0.01),
                                                 ("shifted", 300, 16, 130, 0.01)])
def test_pruned_step_is_the_full_assignment(emulator, tmp_path, kind, N, K, C, move):
    """A step after the centres moved: the filter keeps the points its rule proves, the assignment takes the
    work list; every label and the exact mode's distance bits equal the full assignment's at the new centres,
    the changed count is the number of new labels, and the bounds still hold. Shifted blobs: the rows the
    first assignment rescanned (most) keep their label by the rescan's lb."""
    x, c, c_new, labels0, ub, lb, rmax = _step_case(emulator, tmp_path, kind, N, K, C, move, seed=N + C + K)
    import torch

    _, _, kap = bound_consts(K)
    drift, mdl, halfs, rth = centre_bounds(torch.from_numpy(c), torch.from_numpy(c_new), torch.from_numpy(rmax), kap)
    labels, ub2, lb2, rmax2, changed, count, work, exact, rl, rd = emulate_step(
        emulator, x, c_new, labels0, ub, lb, drift.numpy(), mdl.numpy(), halfs.numpy(), rth.numpy(), tmp_path / "step")
    assert np.array_equal(labels, rl), f"{int((labels != rl).sum())} labels differ from the full assignment"
    assert np.array_equal(exact.view(np.int32), rd.view(np.int32))
    assert int(changed[0]) == int((labels != labels0).sum())
    n = int(count[0])
    assert 0 < n < N, n  # both paths taken
    assert len(set(work[:n].tolist())) == n and (work[n:] == -1).all()
    _check_bounds(x, c_new, labels, ub2, lb2)
    for a in range(C):
        mine = ub2[labels == a]
        assert rmax2[a] == (mine.max().view(np.int32) if mine.size else 0)


def test_stale_bounds_are_seen(emulator, tmp_path):
    """The same step told that nothing moved (drift, mdl = 0): kept points then carry labels the full
    assignment does not give, so the comparison above can see a filter that keeps too much."""
    x, c, c_new, labels0, ub, lb, rmax = _step_case(emulator, tmp_path, "blobs", 300, 16, 70, 1.5, seed=9)
    zero = np.zeros(70, np.float32)
    import torch

    inf = np.full(70, np.inf, np.float32)
    halfs = centre_bounds(torch.from_numpy(c), torch.from_numpy(c_new), torch.from_numpy(rmax), 1.0)[2]
    labels, *_, rl, _ = emulate_step(emulator, x, c_new, labels0, ub, lb, zero, zero, halfs.numpy(), inf,
                                     tmp_path / "stale")
    assert (labels != rl).any(), "stale bounds went unnoticed"


# -- The certificate about a local reference (issue 42, Design 1: bench/notes/kmeans.md) ----------------------


def emulate_local(exe, x, c, old, tmp, tau=None, pad=True):
    """The assignment in local mode: launch rows from plan.kmeans.local_rows (ordered by the old labels
    ``old``, each label from a CTA's start, -1 pads; ``pad=False``: only sorted), labels[] preset to them;
    (labels, dist, cert, ref labels, ref dist, ub, lb, rmax)."""
    N, K = x.shape
    C = c.shape[0]
    d = Path(tmp)
    d.mkdir(parents=True, exist_ok=True)
    (d / "args.bin").write_bytes(_args(N, K, C, tau, local=1))
    (d / "x.bin").write_bytes(np.ascontiguousarray(x, np.float32).tobytes())
    (d / "c.bin").write_bytes(np.ascontiguousarray(c, np.float32).tobytes())
    (d / "labels.bin").write_bytes(np.ascontiguousarray(old, np.int64).tobytes())
    if pad:
        bm = assign_shape(assign_k_bucket(K)).block_m
        rows, M = local_rows(torch.from_numpy(np.asarray(old, np.int64)), None, C, bm)
        rows = rows[:M].numpy()
        assert M >= N and (np.sort(rows[rows >= 0]) == np.arange(N)).all()
        print(f"launch rows {M} for {N} points ({'padded' if M > N or (rows < 0).any() else 'sorted only'})", end="; ")
    else:
        rows = np.argsort(old, kind="stable")
    (d / "rows.bin").write_bytes(rows.astype(np.int32).tobytes())
    r = subprocess.run([exe, str(KKS.index(assign_k_bucket(K))), str(d), "local"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return _read((d / "out.bin").read_bytes(), N, C, [(np.int64, "N"), (np.float32, "N"), (np.uint8, "N"),
                                                      (np.int64, "N"), (np.float32, "N"), (np.float32, "N"),
                                                      (np.float32, "N"), (np.int32, "C")])


def _wide_blobs(N, K, C, seed, shift=0.0, blobs=8):
    """bench/datasets.py's blobs_wide (blobs at 4 x integer corners, as given: far from the origin), the
    centres random rows numbered blob by blob, the old labels the float64 argmin at centres moved a little
    (a previous step). At 10^7 rows a cluster holds ~10^4 rows, so a CTA's rows ordered by label share one
    label; here N / blobs rows a blob, numbered so that a CTA's rows share a blob."""
    rng = np.random.default_rng(seed)
    corners = 4.0 * rng.integers(0, 8, (blobs, K))
    x = rng.standard_normal((N, K)) + corners[np.arange(N) % blobs] + shift
    pick = np.sort(rng.choice(N, C, replace=False))
    pick = pick[np.argsort(pick % blobs, kind="stable")]
    c = x[pick] + 0.05 * rng.standard_normal((C, K))
    x, c = x.astype(np.float32), c.astype(np.float32)
    c_old = c.astype(np.float64) + 0.02 * rng.standard_normal((C, K))
    old = _float64_order(x, c_old.astype(np.float32))[0]
    return x, c, old


@pytest.mark.parametrize("N, K, C, shift, blobs, garbage", [
    (2048, 16, 128, 0.0, 4, False), (1024, 16, 130, 300.0, 4, False), (300, 5, 40, 0.0, 8, False),
    (256, 33, 40, 0.0, 8, False), (1700, 16, 6, 300.0, 3, False), (1300, 5, 5, 0.0, 8, False),
    (700, 16, 40, 0.0, 8, True)],
    ids=["K16-C128-wide", "K16-C130-wide-shifted", "K5-C40-wide", "K33-C40-wide-split", "K16-C6-padded",
         "K5-C5-padded", "K16-C40-random-old-labels"])
def test_local_certificate(emulator, tmp_path, N, K, C, shift, blobs, garbage):
    """Rows and centres about the CTA's reference (its first row's old label's centre), far centres left out:
    labels and distance bits the exact path's on every row, certified rows the float64 argmin, valid bounds;
    and on wide blobs far from the origin the uncertified share falls from most rows (the global scale) to
    a few per cent."""
    x, c, old = _wide_blobs(N, K, C, seed=N + K + C, shift=shift, blobs=blobs)
    if garbage:  # any old labels are valid references (only the certificate's rate depends on them)
        old = np.random.default_rng(3).integers(0, C, N)
    labels, dist, cert, rl, rd, ub, lb, rmax = emulate_local(emulator, x, c, old, tmp_path / "local")
    g_labels, g_dist, g_cert, _, _ = emulate(emulator, x, c, tmp_path / "global")
    assert set(np.unique(cert)) <= {0, 1}, "every row written"
    assert np.array_equal(labels, rl), f"{int((labels != rl).sum())} labels differ from the exact path"
    assert np.array_equal(dist.view(np.int32), rd.view(np.int32)), "distance bits differ from the exact path"
    assert np.array_equal(labels, g_labels) and np.array_equal(dist.view(np.int32), g_dist.view(np.int32))
    best, gap, _ = _float64_order(x, c)
    ok = cert == 1
    assert np.array_equal(labels[ok], best[ok]) and (gap[ok] > 0).all()
    _check_bounds(x, c, labels, ub, lb)
    assert (ub >= dist).all()
    for a in range(C):
        mine = ub[labels == a]
        assert rmax[a] == (mine.max().view(np.int32) if mine.size else 0)
    unc_l, unc_g = 1 - ok.mean(), 1 - (g_cert == 1).mean()
    print(f"uncertified: global {unc_g:.3f} local {unc_l:.3f}")
    if K == 16 and not garbage:
        assert unc_l <= 0.03 and unc_l < 0.25 * unc_g, (unc_g, unc_l)


def test_local_certificate_bound_is_seen(emulator, tmp_path):
    """tau = 0 in local mode on near-ties: other labels than the exact path's (the comparison sees a missing
    bound here too)."""
    x, c = _data("ties", 300, 16, 70, seed=5)
    old = _float64_order(x, c)[0]
    labels, _, _, rl, _, _, _, _ = emulate_local(emulator, x, c, old, tmp_path, tau=0.0)
    assert not np.array_equal(labels, rl)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_local_buckets_compile_without_spills(arch):
    """KmeansAssignTraits<kK, true> (plan_assign(local=True), compiled on first use) for kK 8, 16, 32 without
    spills under the same launch bounds (80 registers up to kK 16, 128 above); kK 64 is not served local."""
    try:
        from kermac_like.runtime.compiler import compile_specs
    except Exception as e:  # pragma: no cover
        pytest.skip(f"no NVRTC: {e}")
    from kermac_like.runtime.specs.kmeans import assign_spec

    _, res = compile_specs([assign_spec(kK, local=True) for kK in (8, 16, 32)], arch)
    assert len(res) == 3
    for name, r in res.items():
        assert r.get("spill_stores", 0) == 0 and r.get("stack", 0) == 0 and 0 < r["registers"] <= 128, (name, r)
