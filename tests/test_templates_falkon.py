"""CPU tests of cuda_templates/falkon_mma.cuh: Falkon's two products on tensor cores.

The kernels run under the host emulation of tests/test_templates_mma.py (g++, one fiber per CUDA
thread; mma.sync's TF32 products summed exactly and rounded once, cp.async landing at wait_group).
Checked against float64 sums of exp(-|x - z|^2 / (2 bw^2)) times the float32-rounded vectors:

* K(x, z) v (rows kernel) and K(z, x) w (cols kernel) within the error of the method, for K = 3
  (kK 8, a K tail), 8, 13 (kK 16), 27 (kK 32); kC = 1, 2, 4, 8; N and M not multiples of the tiles;
  the centre range split (rows) and the row range split (cols), whose splits add to the unsplit sums;
* the same kernel value of every pair in both kernels, bit for bit: with unit vectors v = e_j and
  w = e_i each product returns one kernel value exactly (the other terms are exact zeros), so the
  rows kernel's column j and the cols kernel's row i are compared as float64 bit patterns;
* the comparison's sensitivity: with the cols kernel's scale one float32 ulp away, the values differ.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import mma_emulator

from kermac_like.runtime.specs.falkon import PAD, cols_shape, k_bucket, pv_shape, rows_shape

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = ((8, 1), (8, 4), (16, 2), (32, 1), (8, 8))  # (kK, kC) in the driver's table order


DRIVER = r'''
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
namespace kermac_like { namespace falkon_detail {
inline double shfl_xor_double(double v, int m) {
  unsigned long long b;
  std::memcpy(&b, &v, 8);
  const float lo = __uint_as_float((unsigned)b), hi = __uint_as_float((unsigned)(b >> 32));
  const unsigned l2 = __float_as_uint(__shfl_xor_sync(0xffffffffu, lo, m));
  const unsigned h2 = __float_as_uint(__shfl_xor_sync(0xffffffffu, hi, m));
  const unsigned long long r = (unsigned long long)l2 | ((unsigned long long)h2 << 32);
  double d;
  std::memcpy(&d, &r, 8);
  return d;
}
}}
#include "falkon_mma.cuh"

using namespace kermac_like;
typedef long long i64;
struct FArgs { i64 N, M, K, Mp, tiles_per_split, n_split_r, rows_per_split, n_split_c; float scale, scale_c; };

template <int kK, int kC>
void run(const FArgs& A, const float* x, const float* z, const float* centre, const float* v, const float* w,
         double* out_r, double* out_c, float* zb) {
  typedef FalkonRowsTraits<kK, kC> R;
  typedef FalkonColsTraits<kK, kC> C;
  const int S = kK / 8;
  std::vector<uint4> zf(size_t(A.Mp) / 8 * S * 32);
  const i64 entries = std::max<i64>(A.Mp / 8 * S * 32, A.Mp);
  launch_grid<R>((unsigned)((entries + R::kThreads - 1) / R::kThreads), 1, [&] {
    falkon_prep_kernel<R>(z, A.K, (int)A.M, (int)A.K, centre, A.scale, (int)A.Mp, zf.data(), zb);
  });
  launch_grid<R>((unsigned)((A.N + R::kBlockM - 1) / R::kBlockM), (unsigned)A.n_split_r, [&] {
    falkon_rows_kernel<R>(x, A.K, A.N, (int)A.K, centre, A.scale, zf.data(), zb, v, (int)A.Mp, out_r, kC,
                          A.N * kC, (int)A.tiles_per_split);
  });
  launch_grid<C>((unsigned)(A.Mp / C::kBlockN), (unsigned)A.n_split_c, [&] {
    falkon_cols_kernel<C>(x, A.K, A.N, (int)A.K, centre, A.scale_c, zf.data(), zb, w, kC, (int)A.M, out_c, kC,
                          A.M * kC, A.rows_per_split);
  });
}

typedef void (*Runner)(const FArgs&, const float*, const float*, const float*, const float*, const float*, double*,
                       double*, float*);
static const Runner kRunners[] = {&run<8, 1>, &run<8, 4>, &run<16, 2>, &run<32, 1>, &run<8, 8>};

// The several-column rows kernel: v's fragments, then K(x, z) v for C <= 8 kNq columns.
struct PvArgs { i64 N, M, K, Mp, C, tiles_per_split, n_split; float scale; float pad; };

template <int kK, int kNq>
void run_pv(const PvArgs& A, const float* x, const float* z, const float* centre, const float* v, double* out) {
  typedef FalkonRowsTraits<kK, 1> R;
  typedef FalkonRowsPvTraits<kK, kNq> P;
  const int S = kK / 8;
  std::vector<uint4> zf(size_t(A.Mp) / 8 * S * 32), vf(size_t(A.Mp) / 16 * kNq * 32);
  std::vector<float> zb(A.Mp), amax(A.C, 0.0f);
  for (i64 n = 0; n < A.M; ++n)
    for (i64 c = 0; c < A.C; ++c) amax[c] = std::max(amax[c], std::fabs(v[n * (A.C + 3) + c]));
  const i64 entries = std::max<i64>(A.Mp / 8 * S * 32, A.Mp);
  launch_grid<R>((unsigned)((entries + R::kThreads - 1) / R::kThreads), 1, [&] {
    falkon_prep_kernel<R>(z, A.K, (int)A.M, (int)A.K, centre, A.scale, (int)A.Mp, zf.data(), zb.data());
  });
  // v (M, C) row-major with a row stride of C + 3 (a view's strides)
  launch_grid<P>((unsigned)((A.Mp / 16 * kNq * 32 + P::kThreads - 1) / P::kThreads), 1, [&] {
    falkon_vprep_kernel<P>(v, A.C + 3, 1, A.M, (int)A.C, amax.data(), (int)A.Mp, vf.data());
  });
  launch_grid<P>((unsigned)((A.N + P::kBlockM - 1) / P::kBlockM), (unsigned)A.n_split, [&] {
    falkon_rows_pv_kernel<P>(x, A.K, A.N, (int)A.K, centre, A.scale, zf.data(), zb.data(), vf.data(), amax.data(),
                             (int)A.Mp, (int)A.C, out, A.C, A.N * A.C, (int)A.tiles_per_split);
  });
}

typedef void (*PvRunner)(const PvArgs&, const float*, const float*, const float*, const float*, double*);
static const PvRunner kPvRunners[] = {&run_pv<8, 2>, &run_pv<8, 1>, &run_pv<16, 2>, &run_pv<32, 1>};

template <class T>
std::vector<T> load(const std::string& path) {
  auto b = slurp(path);
  std::vector<T> v(b.size() / sizeof(T) + 16);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// usage: emu RUNNER DIR  (args.bin x.bin z.bin centre.bin v.bin w.bin; writes out.bin: rows | cols | zb)
//        emu pv RUNNER DIR  (pv.bin x.bin z.bin centre.bin v.bin; writes out.bin: n_split x N x C doubles)
int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "pv") {
    const std::string dir = argv[3];
    auto args = slurp(dir + "/pv.bin");
    if (args.size() != sizeof(PvArgs)) fail("pv.bin has the wrong size");
    PvArgs A;
    std::memcpy(&A, args.data(), sizeof(PvArgs));
    auto x = load<float>(dir + "/x.bin"), z = load<float>(dir + "/z.bin"), c = load<float>(dir + "/centre.bin");
    auto v = load<float>(dir + "/v.bin");
    std::vector<double> out(size_t(A.n_split) * A.N * A.C, -7.0);
    kPvRunners[std::atoi(argv[2])](A, x.data(), z.data(), c.data(), v.data(), out.data());
    FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
    std::fwrite(out.data(), 8, out.size(), f);
    std::fclose(f);
    return 0;
  }
  if (argc != 3) fail("usage: emu RUNNER DIR");
  const int r = std::atoi(argv[1]);
  const std::string dir = argv[2];
  auto args = slurp(dir + "/args.bin");
  if (args.size() != sizeof(FArgs)) fail("args.bin has the wrong size");
  FArgs A;
  std::memcpy(&A, args.data(), sizeof(FArgs));
  static const int kcs[] = {1, 4, 2, 1, 8};
  const int kC = kcs[r];
  auto x = load<float>(dir + "/x.bin"), z = load<float>(dir + "/z.bin"), c = load<float>(dir + "/centre.bin");
  auto v = load<float>(dir + "/v.bin"), w = load<float>(dir + "/w.bin");
  std::vector<double> out_r(size_t(A.n_split_r) * A.N * kC, -7.0), out_c(size_t(A.n_split_c) * A.M * kC, -7.0);
  std::vector<float> zb(A.Mp, -7.0f);
  kRunners[r](A, x.data(), z.data(), c.data(), v.data(), w.data(), out_r.data(), out_c.data(), zb.data());
  FILE* f = std::fopen((dir + "/out.bin").c_str(), "wb");
  std::fwrite(out_r.data(), 8, out_r.size(), f);
  std::fwrite(out_c.data(), 8, out_c.size(), f);
  std::fwrite(zb.data(), 4, zb.size(), f);
  std::fclose(f);
  return 0;
}
'''


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return mma_emulator.build(tmp_path_factory, "falkon_emulator", DRIVER)


def _scale(bw: float) -> float:
    return float(np.float32(np.sqrt(1.0 / np.log(2.0) / (2.0 * bw * bw))))


def _run(emu, tmp_path, runner, x, z, v, w, *, bw=0.7, rows_split=1, cols_split=1, scale_c=None):
    """The driver's outputs: (rows (N, kC) summed over splits, rows per split, cols (M, kC), cols per split,
    zb, centre) for float32 x (N, K), z (M, K), v (M, kC), w (N, kC)."""
    kK, kC = RUNNERS[runner]
    N, K = x.shape
    M = z.shape[0]
    Mp = -(-M // PAD) * PAD
    centre = z.astype(np.float32).mean(axis=0, dtype=np.float32)
    tiles = Mp // rows_shape(kK, kC).block_n
    per = -(-tiles // rows_split)
    n_split_r = -(-tiles // per)
    bm = cols_shape(kK, kC).block_m
    rper = -(-(-(-N // bm)) // cols_split) * bm
    n_split_c = -(-N // rper)
    scale = _scale(bw)
    d = tmp_path / f"case{runner}"
    d.mkdir(exist_ok=True)
    (d / "args.bin").write_bytes(struct.pack("8q2f", N, M, K, Mp, per, n_split_r, rper, n_split_c, scale,
                                             scale if scale_c is None else scale_c))
    vp = np.zeros((Mp, kC), np.float32)
    vp[:M] = v
    for name, a in (("x", x), ("z", z), ("centre", centre), ("v", vp), ("w", w)):
        (d / f"{name}.bin").write_bytes(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    r = subprocess.run([emu, str(runner), str(d)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    raw = (d / "out.bin").read_bytes()
    nr, nc = n_split_r * N * kC, n_split_c * M * kC
    rows = np.frombuffer(raw[:8 * nr], np.float64).reshape(n_split_r, N, kC)
    cols = np.frombuffer(raw[8 * nr:8 * (nr + nc)], np.float64).reshape(n_split_c, M, kC)
    zb = np.frombuffer(raw[8 * (nr + nc):], np.float32)
    return rows, cols, zb, centre


def _kernel64(x, z, bw):
    d2 = ((x.astype(np.float64)[:, None, :] - z.astype(np.float64)[None, :, :]) ** 2).sum(-1)
    return np.exp(-d2 / (2.0 * bw * bw))


CASES = [  # (runner, N, M, K, rows_split, cols_split)
    (0, 200, 300, 3, 1, 1),
    (0, 130, 700, 8, 3, 2),
    (1, 70, 260, 5, 1, 2),
    (2, 90, 270, 13, 2, 1),
    (3, 40, 100, 27, 1, 1),
    (4, 33, 257, 8, 1, 1),
]


@pytest.mark.parametrize("case", CASES, ids=[f"kK{RUNNERS[c[0]][0]}-kC{RUNNERS[c[0]][1]}-N{c[1]}-M{c[2]}-K{c[3]}"
                                              for c in CASES])
def test_products_against_float64(emulator, tmp_path, case):
    runner, N, M, K, rs, cs = case
    kK, kC = RUNNERS[runner]
    assert k_bucket(K) == kK
    rng = np.random.default_rng(7 + runner)
    bw = 0.7
    x = rng.random((N, K), dtype=np.float32)
    z = x[rng.integers(0, N, M)] if M <= N else rng.random((M, K), dtype=np.float32)  # centres among the rows
    v = rng.standard_normal((M, kC)).astype(np.float32)
    w = rng.standard_normal((N, kC)).astype(np.float32)
    rows, cols, zb, _ = _run(emulator, tmp_path, runner, x, z, v, w, bw=bw, rows_split=rs, cols_split=cs)
    kmat = _kernel64(x, z, bw)
    ref_r = kmat @ v.astype(np.float64)
    ref_c = kmat.T @ w.astype(np.float64)
    scale_r = np.abs(kmat) @ np.abs(v.astype(np.float64))
    scale_c = np.abs(kmat).T @ np.abs(w.astype(np.float64))
    got_r, got_c = rows.sum(axis=0), cols.sum(axis=0)
    # kernel values good to ~1e-6 relative (3xTF32 exponent, ex2), sums to (G + 1) 2^-24
    assert np.all(np.abs(got_r - ref_r) <= 4e-6 * scale_r + 1e-30), np.abs(got_r - ref_r).max()
    assert np.all(np.abs(got_c - ref_c) <= 4e-6 * scale_c + 1e-30), np.abs(got_c - ref_c).max()
    # the padded centres' b is zero; real ones -|r (z - centre)|^2 < 0
    assert np.all(zb[M:] == 0.0) and np.all(zb[:M] < 0.0)


def _unit_products(emulator, tmp_path, runner, x, z, rows_of, cols_of, scale_c=None):
    """K values by unit vectors: the rows kernel's columns j in cols_of (v = e_j), the cols kernel's rows i in
    rows_of (w = e_i)."""
    kK, kC = RUNNERS[runner]
    N, M = x.shape[0], z.shape[0]
    v = np.zeros((M, kC), np.float32)
    w = np.zeros((N, kC), np.float32)
    for c, j in enumerate(cols_of):
        v[j, c] = 1.0
    for c, i in enumerate(rows_of):
        w[i, c] = 1.0
    rows, cols, _, _ = _run(emulator, tmp_path, runner, x, z, v, w, scale_c=scale_c)
    return rows[0], cols[0]


def test_one_kernel_value_per_pair(emulator, tmp_path):
    """K(x, z)[i, j] from the rows kernel (v = e_j) equals K(z, x)[j, i] from the cols kernel (w = e_i), bits."""
    runner = 4  # kC = 8: eight unit vectors a run
    rng = np.random.default_rng(11)
    N, M, K = 70, 90, 8
    x = (rng.random((N, K), dtype=np.float32) * 3.0).astype(np.float32)
    z = np.concatenate([x[:40], rng.random((M - 40, K), dtype=np.float32)])  # centres among the rows, and not
    rows_of = [0, 5, 17, 39, 40, 52, 63, 69]
    cols_of = [0, 5, 17, 39, 41, 60, 77, 89]
    rows, cols = _unit_products(emulator, tmp_path, runner, x, z, rows_of, cols_of)
    for c, j in enumerate(cols_of):
        for cc, i in enumerate(rows_of):
            a, b = rows[i, c], cols[j, cc]
            assert a == b and a > 0, (i, j, a, b)
    # every other term is an exact zero: each output is one kernel value (float32), exactly
    assert np.all(rows.astype(np.float32).astype(np.float64) == rows)
    # sensitivity: a different scale in the cols kernel (one float32 ulp) changes those values
    s = _scale(0.7)
    s2 = float(np.nextafter(np.float32(s), np.float32(1.0)))
    rows2, cols2 = _unit_products(emulator, tmp_path, runner, x, z, rows_of, cols_of, scale_c=s2)
    diff = sum(rows2[i, c] != cols2[j, cc] for c, j in enumerate(cols_of) for cc, i in enumerate(rows_of))
    assert diff > 0


def test_column_chunks_and_cpu_tensors():
    """kC per launch (the largest bucket <= the remaining columns; 4 at kK = 32) and no tensor-core path for
    CPU tensors (the solver keeps kernel_matvec's, i.e. torch's, products there)."""
    import torch

    from kermac_like import preset
    from kermac_like.plan import falkon
    from kermac_like.runtime.specs.falkon import c_chunk

    assert [c_chunk(c, 8) for c in (1, 2, 3, 5, 8, 9, 100)] == [1, 2, 2, 4, 8, 8, 8]
    assert [c_chunk(c, 32) for c in (1, 3, 8, 9)] == [1, 2, 4, 4]
    x = torch.rand(10, 8)
    assert not falkon.serves(preset("gaussian_l2"), {"bandwidth": 1.0}, x[:4])


PV_RUNNERS = ((8, 2), (8, 1), (16, 2), (32, 1))  # (kK, kNq) in the driver's kPvRunners order
PV_CASES = [  # (runner, N, M, K, C, split)
    (0, 300, 700, 8, 11, 1),   # GPyTorch's 1 + 10 probe columns
    (0, 70, 300, 5, 16, 3),    # every column, the centre range split
    (1, 260, 257, 8, 3, 2),    # 8-column tiles, a padded centre block
    (2, 90, 260, 13, 9, 1),
    (3, 40, 130, 27, 8, 1),
]


@pytest.mark.parametrize("case", PV_CASES, ids=[f"kK{PV_RUNNERS[c[0]][0]}-nq{PV_RUNNERS[c[0]][1]}-N{c[1]}-M{c[2]}-K{c[3]}"
                                                f"-C{c[4]}-s{c[5]}" for c in PV_CASES])
def test_rows_pv_against_float64(emulator, tmp_path, case):
    """falkon_rows_pv_kernel (k v on tensor cores in split f16, through falkon_vprep_kernel's fragments of a
    strided v) against float64 sums: each output within 4e-6 of sum |k v| (the exponent's 3xTF32 dot product,
    k and v s_c in two f16 parts each, float32 sums of 128 centres for the main part and of 512 for the
    2^-12 correction) plus 2^-35 sum |v| (k below 2^-26 keeps 2^-36 absolute in f16's subnormals), every
    output written once per split (the -7 poison gone), and the splits adding to the whole."""
    runner, N, M, K, C, split = case
    kK, nq = PV_RUNNERS[runner]
    assert k_bucket(K) == kK and C <= 8 * nq
    rng = np.random.default_rng(100 + runner)
    bw = 0.6
    x = rng.random((N, K), dtype=np.float32) * 2.0 - 1.0
    z = x[rng.integers(0, N, M)] if M <= N else (rng.random((M, K), dtype=np.float32) * 2.0 - 1.0)
    v = rng.standard_normal((M, C)).astype(np.float32) * np.float32(3.0)
    Mp = -(-M // PAD) * PAD
    tiles = Mp // pv_shape(kK, nq).block_n
    per = -(-tiles // split)
    n_split = -(-tiles // per)
    centre = z.mean(axis=0, dtype=np.float32)
    d = tmp_path / "pv"
    d.mkdir()
    (d / "pv.bin").write_bytes(struct.pack("7q2f", N, M, K, Mp, C, per, n_split, _scale(bw), 0.0))
    vs = np.zeros((M, C + 3), np.float32)  # a strided view: row stride C + 3
    vs[:, :C] = v
    for name, a in (("x", x), ("z", z), ("centre", centre), ("v", vs)):
        (d / f"{name}.bin").write_bytes(np.ascontiguousarray(a, dtype=np.float32).tobytes())
    r = subprocess.run([emulator, "pv", str(runner), str(d)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = np.frombuffer((d / "out.bin").read_bytes(), np.float64).reshape(n_split, N, C)
    assert np.all(out != -7.0)
    kmat = _kernel64(x, z, bw)
    ref = kmat @ v.astype(np.float64)
    scale = np.abs(kmat) @ np.abs(v.astype(np.float64))
    got = out.sum(axis=0)
    err = np.abs(got - ref) / (scale + 2.0 ** -35 / 4e-6 * np.abs(v.astype(np.float64)).sum(axis=0))
    assert err.max() <= 4e-6, err.max()
    # and well inside it on average (a wrong fragment layout gives errors of order 1)
    assert np.sqrt((err ** 2).mean()) <= 2e-6, np.sqrt((err ** 2).mean())
