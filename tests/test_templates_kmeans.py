"""CPU execution of cuda_templates/kmeans.cuh: the real k-means++ kernels (kmeans_update_kernel,
kmeans_draw_kernel) compiled with g++ behind the thread shim (tests/cpu_shim.py) and run for a
whole seeding against cluster.kmeans_plusplus (the torch path) with the same uniforms: the same
indices and centres. Integer data (every distance and sum exact, so every tie is the same tie),
Gaussian data, weights, a zero-weight case (fewer weighted points than centres: the degenerate
draws), K = 3 and 16 (kK buckets) and 40 (the runtime loop), N not a multiple of the 1024-point
block and a column-major x. (Bitwise repeats: tests/test_gpu_cluster.py.)"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from cpu_shim import THREAD_SHIM, build_cpu_runner

from kermac_like.cluster import SAMPLE_BLOCK, kmeans_plusplus

# instance i of the runner: KmeansTraits<float, kK, screen> = KKS[i]
KKS = ((0, False), (4, False), (16, False), (0, True), (4, True), (16, True))

SHIM = THREAD_SHIM + r"""
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
#include "kmeans.cuh"
using namespace kermac_like;
@@INSTANCES@@

// The whole seeding; the final state (d2 | near | bsum, and with the screen eb | xs) as bytes.
template <class Tr>
void seed(const float* x, const float* w, const double* u, long long* idx, float* centres, int N, int K, int C,
          long long sxm, long long sxk, std::vector<char>& state) {
  const int nb = (N + Tr::kBlockM - 1) / Tr::kBlockM;
  std::vector<float> d2(N, -7.0f), cc(C, -7.0f), eb(Tr::kScreen ? nb : 0, -7.0f);
  std::vector<int> near(N, -7);
  std::vector<double> bsum(nb, -7.0);
  const size_t kw = kmeans_detail::screen_row<Tr>(K) / 2;
  std::vector<unsigned> xs(Tr::kScreen ? size_t(N) * kw : 0, 0xdeadbeefu);  // (16-byte aligned by operator new)
  using TD = KmeansTraits<float, 0>;
  auto update = [&](int j) {
    gridDim = {unsigned(nb), 1, 1};
    kl_run_grid(Tr::kThreads, [&] {
      kmeans_update_kernel<Tr>(x, w, centres, cc.data(), d2.data(), near.data(), bsum.data(),
                               Tr::kScreen ? xs.data() : nullptr, Tr::kScreen ? eb.data() : nullptr, N, K, sxm, sxk,
                               K, j);
    });
  };
  update(-1);
  for (int j = 0; j < C; ++j) {
    gridDim = {1, 1, 1};
    kl_run_grid(TD::kThreads, [&] {
      kmeans_draw_kernel<TD>(x, w, d2.data(), bsum.data(), u, idx, centres, cc.data(), N, K, sxm, sxk, K, nb, j);
    });
    if (j + 1 < C) update(j);
  }
  auto put = [&](const void* p, size_t n) { state.insert(state.end(), (const char*)p, (const char*)p + n); };
  put(d2.data(), 4 * d2.size());
  put(near.data(), 4 * near.size());
  put(bsum.data(), 8 * bsum.size());
  put(eb.data(), 4 * eb.size());
  put(xs.data(), 4 * xs.size());
}

// The screen on single points: argv bound, M, K, input (x (M, K) | c (M, K) | d2 (M,)), output per point
// (skip, exact dn, e_i, s) as floats; each point's bound e_i its own (the tightest E).
template <class Tr>
int bound(int M, int K, const char* in, const char* outp) {
  using namespace kmeans_detail;
  std::vector<float> x(size_t(M) * K), c(size_t(M) * K), d2(M), out;
  FILE* f = std::fopen(in, "rb");
  if (std::fread(x.data(), 4, x.size(), f) != x.size() || std::fread(c.data(), 4, c.size(), f) != c.size() ||
      std::fread(d2.data(), 4, d2.size(), f) != d2.size())
    return 3;
  std::fclose(f);
  alignas(16) unsigned xw[1024];
  for (int m = 0; m < M; ++m) {
    const float* xi = x.data() + size_t(m) * K;
    const float* cj = c.data() + size_t(m) * K;
    float c_reg[Tr::kK > 0 ? Tr::kK : 1];
    if constexpr (Tr::kK > 0)
      for (int q = 0; q < Tr::kK; ++q) c_reg[q] = q < K ? cj[q] : 0.0f;
    const float e = encode_row<Tr>(xi, 1, K, xw);
    const float s = screen_dist<Tr>(xw, c_reg, cj, K);
    out.push_back(screen_skips(s, e, screen_slack(K), d2[m]) ? 1.0f : 0.0f);
    out.push_back(sq_dist<Tr>(xi, 1, c_reg, cj, K));
    out.push_back(e);
    out.push_back(s);
  }
  return kl_write(outp, out);
}

// One draw (centre j) from given d2 and block sums: argv draw, N, K, j, input (x | d2 | bsum | u | centres[:j]),
// output (idx[j] as double | centres[j] | cc[:j]).
int draw_only(char** argv) {
  using TD = KmeansTraits<float, 0>;
  const int N = std::atoi(argv[2]), K = std::atoi(argv[3]), j = std::atoi(argv[4]);
  const int nb = (N + TD::kBlockM - 1) / TD::kBlockM;
  std::vector<float> x(size_t(N) * K), d2(N), centres(size_t(j + 1) * K), cc(j + 1, -7.0f);
  std::vector<double> bsum(nb), u(j + 1);
  std::vector<long long> idx(j + 1, -7);
  FILE* f = std::fopen(argv[5], "rb");
  if (std::fread(x.data(), 4, x.size(), f) != x.size() || std::fread(d2.data(), 4, N, f) != size_t(N) ||
      std::fread(bsum.data(), 8, nb, f) != size_t(nb) || std::fread(&u[j], 8, 1, f) != 1 ||
      std::fread(centres.data(), 4, size_t(j) * K, f) != size_t(j) * K)
    return 3;
  std::fclose(f);
  gridDim = {1, 1, 1};
  kl_run_grid(TD::kThreads, [&] {
    kmeans_draw_kernel<TD>(x.data(), nullptr, d2.data(), bsum.data(), u.data(), idx.data(), centres.data(), cc.data(),
                           N, K, K, 1, K, nb, j);
  });
  std::vector<double> out;
  out.push_back(double(idx[j]));
  for (int q = 0; q < K; ++q) out.push_back(centres[size_t(j) * K + q]);
  for (int a = 0; a < j; ++a) out.push_back(cc[a]);
  return kl_write(argv[6], out);
}

// Lloyd's segmented sum: argv segsum, N, K, C, weighted, rows per item, input (x | w | perm | bounds | items),
// output (sums (C, K) | wsum (C,)).
int segsum(char** argv) {
  using TS = KmeansTraits<float, 0>;
  const int N = std::atoi(argv[2]), K = std::atoi(argv[3]), C = std::atoi(argv[4]), rows = std::atoi(argv[6]);
  const bool weighted = std::atoi(argv[5]) != 0;
  const int n_items = (N + rows - 1) / rows + C;
  std::vector<float> x(size_t(N) * K), w(N);
  std::vector<long long> perm(N), bounds(C + 1), items(C + 1);
  FILE* f = std::fopen(argv[7], "rb");
  if (std::fread(x.data(), 4, x.size(), f) != x.size() || std::fread(w.data(), 4, N, f) != size_t(N) ||
      std::fread(perm.data(), 8, N, f) != size_t(N) || std::fread(bounds.data(), 8, C + 1, f) != size_t(C + 1) ||
      std::fread(items.data(), 8, C + 1, f) != size_t(C + 1))
    return 3;
  std::fclose(f);
  std::vector<double> part(size_t(n_items) * (K + 1), -7.0), out(size_t(C) * (K + 1), -7.0);
  gridDim = {unsigned(n_items), 1, 1};
  blockDim = {unsigned(TS::kThreads), 1, 1};
  kl_run_grid(TS::kThreads, [&] {
    kmeans_segsum_kernel<TS>(x.data(), weighted ? w.data() : nullptr, perm.data(), bounds.data(), items.data(),
                             part.data(), K, C, K, 1, rows);
  });
  gridDim = {2, 1, 1};
  kl_run_grid(TS::kThreads, [&] {
    kmeans_segsum_combine_kernel<TS>(part.data(), items.data(), out.data(), out.data() + size_t(C) * K, K, C);
  });
  return kl_write(argv[8], out);
}

int main(int argc, char** argv) {
  if (std::strcmp(argv[1], "draw") == 0) return draw_only(argv);
  if (std::strcmp(argv[1], "bound") == 0) {
    const int M = std::atoi(argv[2]), K = std::atoi(argv[3]);
    return K <= 16 ? bound<KmeansTraits<float, 16, true>>(M, K, argv[4], argv[5])
                   : bound<KmeansTraits<float, 0, true>>(M, K, argv[4], argv[5]);
  }
  if (std::strcmp(argv[1], "segsum") == 0) return segsum(argv);
  // argv: instance, N, K, C, weighted, column-major, input (x | w | u), idx output, centres output, state output
  const int which = std::atoi(argv[1]), N = std::atoi(argv[2]), K = std::atoi(argv[3]), C = std::atoi(argv[4]);
  const bool weighted = std::atoi(argv[5]) != 0, colmajor = std::atoi(argv[6]) != 0;
  std::vector<float> xw(size_t(N) * K + N);
  std::vector<double> u(C);
  FILE* f = std::fopen(argv[7], "rb");
  if (std::fread(xw.data(), 4, xw.size(), f) != xw.size() || std::fread(u.data(), 8, C, f) != size_t(C)) return 3;
  std::fclose(f);
  const float* x = xw.data();
  const float* w = weighted ? x + size_t(N) * K : nullptr;
  const long long sxm = colmajor ? 1 : K, sxk = colmajor ? N : 1;
  std::vector<long long> idx(C, -7);
  std::vector<float> centres(size_t(C) * K, -7.0f);
  std::vector<char> state;
  switch (which) {
@@CASES@@
    default: return 4;
  }
  int r = kl_write(argv[8], idx);
  r = r ? r : kl_write(argv[9], centres);
  return r ? r : kl_write(argv[10], state);
}
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    assert SAMPLE_BLOCK == 1024  # KmeansTraits::kBlockM
    inst = [f"using T{i} = KmeansTraits<float, {kk}, {str(sc).lower()}>;" for i, (kk, sc) in enumerate(KKS)]
    cases = [f"    case {i}: seed<T{i}>(x, w, u.data(), idx.data(), centres.data(), N, K, C, sxm, sxk, state); break;"
             for i in range(len(KKS))]
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "kmeans_cpu", src)


def _run(runner, tmp_path, which, X, w, u, colmajor=False, state=False):
    """(indices, centres) of the runner's seeding; with ``state`` also its final state (a dict)."""
    N, K = X.shape
    C = u.shape[0]
    inp = tmp_path / "in.bin"
    xs = X.T if colmajor else X
    parts = [np.ascontiguousarray(xs, dtype=np.float32).ravel(),
             np.zeros(N, np.float32) if w is None else w.astype(np.float32)]
    with open(inp, "wb") as f:
        f.write(np.concatenate(parts).tobytes())
        f.write(u.astype(np.float64).tobytes())
    oi, oc, os_ = tmp_path / "idx.bin", tmp_path / "c.bin", tmp_path / "state.bin"
    subprocess.run([str(runner), str(which), str(N), str(K), str(C), str(int(w is not None)), str(int(colmajor)),
                    str(inp), str(oi), str(oc), str(os_)], check=True)
    out = np.fromfile(oi, dtype=np.int64), np.fromfile(oc, dtype=np.float32).reshape(C, K)
    if not state:
        return out
    raw, nb = np.fromfile(os_, dtype=np.uint8), -(-N // SAMPLE_BLOCK)
    st, at = {}, 0
    for name, dt, n in (("d2", np.float32, N), ("near", np.int32, N), ("bsum", np.float64, nb)):
        st[name] = raw[at:at + n * np.dtype(dt).itemsize].view(dt)
        at += n * np.dtype(dt).itemsize
    if KKS[which][1]:  # the screen's bounds and copy
        st["eb"] = raw[at:at + 4 * nb].view(np.float32)
        st["xs"] = raw[at + 4 * nb:].view(np.uint32)
    return out + (st,)


def _torch_seed(X, w, C, seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(C, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).numpy()
    c, idx = kmeans_plusplus(torch.from_numpy(X), C, None if w is None else torch.from_numpy(w), g)
    return u, c.numpy(), idx.numpy()


@pytest.mark.parametrize("case", ["int_d3", "gauss_d16_w", "int_d16_zero_w", "gauss_d40_colmajor"])
def test_seeding_same_as_torch(runner, tmp_path, case):
    rng = np.random.default_rng(len(case) * 7 + ord(case[-1]))
    C = 10  # (each launch runs 256 std::threads: about 25 ms on the shim)
    if case == "int_d3":  # exact arithmetic: duplicate points, equal distances, the same ties
        X = rng.integers(-3, 4, size=(2500, 3)).astype(np.float32)
        w, which, colmajor = None, 1, False
    elif case == "gauss_d16_w":
        X = rng.standard_normal((2100, 16)).astype(np.float32)
        w = rng.uniform(0.0, 2.0, 2100).astype(np.float32)
        w[::7] = 0.0
        which, colmajor = 2, False
    elif case == "int_d16_zero_w":  # 5 weighted points, 8 centres: three degenerate draws (N - 1)
        X = rng.integers(-2, 3, size=(1500, 16)).astype(np.float32)
        w = np.zeros(1500, np.float32)
        w[[3, 700, 1030, 1031, 1499]] = [1.0, 2.0, 0.5, 3.0, 1.0]
        which, colmajor, C = 2, False, 8
    else:  # the runtime K loop, a column-major x
        X = (rng.standard_normal((1100, 40)) * 3).astype(np.float32)
        w, which, colmajor = None, 0, True
    u, c_ref, idx_ref = _torch_seed(X, w, C, 5)
    idx, c = _run(runner, tmp_path, which, X, w, u, colmajor)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_array_equal(c, c_ref)
    if case == "int_d16_zero_w":
        assert set(idx[:5].tolist()) == {3, 700, 1030, 1031, 1499} and (idx[5:] == 1499).all()


def _sampler_draw(p, bsum, u):
    """cluster._Sampler.draw in numpy on the given block sums (exact for integer data)."""
    cum = np.cumsum(bsum)
    r = u * cum[-1]
    b = min(int(np.searchsorted(cum, r, side="right")), len(bsum) - 1)
    inner = np.cumsum(p[b * SAMPLE_BLOCK:(b + 1) * SAMPLE_BLOCK].astype(np.float64))
    i = min(int(np.searchsorted(inner, r - (cum[b] - bsum[b]), side="right")), SAMPLE_BLOCK - 1)
    return min(b * SAMPLE_BLOCK + i, len(p) - 1)


@pytest.mark.parametrize("u", [0.3, 0.999999, "zero", "tail"])
def test_draw_many_blocks(runner, tmp_path, u):
    """kmeans_draw_kernel alone on 1900 blocks (7 or 8 per thread: the batched chunk loops):
    the right-searchsorted block and point, the clamps (every p zero: N - 1; zero blocks at the
    end), the centre row and its squared distances to the earlier centres."""
    rng = np.random.default_rng(3)
    N, K, j = 1900 * SAMPLE_BLOCK - 77, 3, 5
    X = rng.integers(-9, 10, size=(N, K)).astype(np.float32)
    d2 = rng.integers(0, 50, size=N).astype(np.float32)
    d2[rng.random(N) < 0.3] = 0
    if u == "zero":
        d2[:] = 0
    if u == "tail":
        d2[-5 * SAMPLE_BLOCK:] = 0
    uu = {"zero": 0.5, "tail": 0.99999999}.get(u, u)
    pad = np.zeros(1900 * SAMPLE_BLOCK, np.float64)
    pad[:N] = d2
    bsum = pad.reshape(1900, SAMPLE_BLOCK).sum(1)
    cent = rng.integers(-9, 10, size=(j, K)).astype(np.float32)
    inp = tmp_path / "in.bin"
    with open(inp, "wb") as f:
        f.write(X.tobytes() + d2.tobytes() + bsum.tobytes() + np.float64(uu).tobytes() + cent.tobytes())
    outp = tmp_path / "out.bin"
    subprocess.run([str(runner), "draw", str(N), str(K), str(j), str(inp), str(outp)], check=True)
    out = np.fromfile(outp, dtype=np.float64)
    want = _sampler_draw(d2, bsum, uu)
    assert int(out[0]) == want
    if u == "zero":
        assert want == N - 1
    np.testing.assert_array_equal(out[1:1 + K], X[want])
    np.testing.assert_array_equal(out[1 + K:], ((cent - X[want]) ** 2).sum(1))


@pytest.mark.parametrize("K,weighted,integer", [(3, False, True), (16, True, True), (16, True, False), (300, False, False)])
def test_segment_sums(runner, tmp_path, K, weighted, integer):
    """Lloyd's update: kmeans_segsum_kernel and its combination against cluster.segment_sums
    (the torch path): the sums and weights per cluster, exact for integer data; an empty
    cluster, one cluster of several items (128 rows per item here), K > 256 (dimension chunks)."""
    from kermac_like.cluster import segment_sums

    rng = np.random.default_rng(K)
    N, C, rows = 1000, 9, 128
    X = (rng.integers(-50, 51, size=(N, K)) if integer else rng.standard_normal((N, K))).astype(np.float32)
    labels = rng.choice([0, 1, 2, 4, 5, 6, 7, 8], size=N, p=[0.6] + [0.4 / 7] * 7)  # 3 empty, 0 large
    w = (rng.integers(0, 9, N) / 4 if integer else rng.uniform(0, 2, N)).astype(np.float32)
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(C + 1))
    items = np.zeros(C + 1, np.int64)
    items[1:] = np.cumsum((np.diff(bounds) + rows - 1) // rows)
    inp = tmp_path / "in.bin"
    with open(inp, "wb") as f:
        f.write(X.tobytes() + w.tobytes() + order.astype(np.int64).tobytes() + bounds.astype(np.int64).tobytes()
                + items.tobytes())
    outp = tmp_path / "out.bin"
    subprocess.run([str(runner), "segsum", str(N), str(K), str(C), str(int(weighted)), str(rows), str(inp),
                    str(outp)], check=True)
    out = np.fromfile(outp, dtype=np.float64)
    sums, wsum = out[:C * K].reshape(C, K), out[C * K:]
    ref_s, ref_w = segment_sums(torch.from_numpy(X), torch.from_numpy(labels), torch.from_numpy(w) if weighted else None,
                                C)
    if integer:
        np.testing.assert_array_equal(sums, ref_s.numpy())
        np.testing.assert_array_equal(wsum, ref_w.numpy())
    else:
        np.testing.assert_allclose(sums, ref_s.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(wsum, ref_w.numpy(), rtol=1e-12)
    assert (sums[3] == 0).all() and wsum[3] == 0


def _bf16_bits(X: np.ndarray) -> np.ndarray:
    """torch's round-to-nearest-even bf16 of X as uint16 bits."""
    return torch.from_numpy(np.ascontiguousarray(X)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _screen_data(case: str):
    rng = np.random.default_rng(sum(map(ord, case)))
    if case == "blobs_d2":  # kK = 4 (rows of 2 bf16 + 2 zeros: 8-byte loads), well separated clusters
        means = 40 * rng.standard_normal((12, 2))
        X = means[rng.integers(0, 12, 3000)] + rng.standard_normal((3000, 2))
        return X.astype(np.float32), None, 12, False
    if case == "gauss_d16_w":  # kK = 16, weights (zeros among them), N not a multiple of 1024
        X = rng.standard_normal((2100, 16)).astype(np.float32)
        w = rng.uniform(0.0, 2.0, 2100).astype(np.float32)
        w[::7] = 0.0
        return X, w, 10, False
    if case == "blobs_d16_dups":  # duplicated rows (d2 = 0 after their twin is drawn) and ties
        means = 4 * rng.standard_normal((16, 16))
        X = (means[rng.integers(0, 16, 2500)] + rng.standard_normal((2500, 16))).astype(np.float32)
        X[1::3] = X[0:-1:3][: len(X[1::3])]
        X[2000:] = X[5]
        return X, None, 14, False
    # int_d33: the runtime loop (kK = 0, rows of 40 bf16), a column-major x, integer data
    # (exact in bf16 too: e_i ~ 2^-50, every tie the same tie), duplicates
    X = rng.integers(-3, 4, size=(1100, 33)).astype(np.float32)
    X[500:600] = X[0]
    return X, None, 10, True


@pytest.mark.parametrize("case", ["blobs_d2", "gauss_d16_w", "blobs_d16_dups", "int_d33"])
def test_screened_seeding_bitwise_same(runner, tmp_path, case):
    """The bf16 screen (KmeansTraits<.., true>) against the unscreened kernel on the same data
    and uniforms: the same indices, centres, final d2 / near / block sums, bit for bit; and
    the copy is X in bf16 (torch's rounding) with zeros past K, the block bounds at least the
    block's largest ||x - copy|| and within 1e-5 of it."""
    X, w, C, colmajor = _screen_data(case)
    N, K = X.shape
    kk = {2: 4, 16: 16, 33: 0}[K]
    plain, screened = KKS.index((kk, False)), KKS.index((kk, True))
    u = torch.rand(C, dtype=torch.float64, generator=torch.Generator().manual_seed(11)).numpy()
    idx0, c0, s0 = _run(runner, tmp_path, plain, X, w, u, colmajor, state=True)
    idx1, c1, s1 = _run(runner, tmp_path, screened, X, w, u, colmajor, state=True)
    np.testing.assert_array_equal(idx1, idx0)
    np.testing.assert_array_equal(c1.view(np.int32), c0.view(np.int32))
    for name in ("d2", "near", "bsum"):
        np.testing.assert_array_equal(s1[name].view(np.uint8), s0[name].view(np.uint8), err_msg=name)
    row = kk or -(-K // 8) * 8
    xs = s1["xs"].view(np.uint16).reshape(N, row)
    np.testing.assert_array_equal(xs[:, :K], _bf16_bits(X))
    assert (xs[:, K:] == 0).all()
    xt = torch.from_numpy(X).to(torch.bfloat16).double().numpy()
    err = np.zeros(-(-N // SAMPLE_BLOCK) * SAMPLE_BLOCK)
    err[:N] = np.sqrt(((X.astype(np.float64) - xt) ** 2).sum(1))
    emax = err.reshape(-1, SAMPLE_BLOCK).max(1)
    assert (s1["eb"] >= emax).all()
    np.testing.assert_allclose(s1["eb"], emax, rtol=1e-5, atol=1e-14)


def _bound(runner, tmp_path, x, c, d2):
    M, K = x.shape
    inp, outp = tmp_path / "b.bin", tmp_path / "bo.bin"
    with open(inp, "wb") as f:
        f.write(x.astype(np.float32).tobytes() + c.astype(np.float32).tobytes() + d2.astype(np.float32).tobytes())
    subprocess.run([str(runner), "bound", str(M), str(K), str(inp), str(outp)], check=True)
    out = np.fromfile(outp, dtype=np.float32).reshape(M, 4)
    return out[:, 0] > 0, out[:, 1]


@pytest.mark.parametrize("K", [5, 16, 33])
def test_screen_bound_is_sound_at_its_edge(runner, tmp_path, K):
    """screen_skips against the exact dn (sq_dist) where the bound is tight: each point's own
    e_i as the block bound, the centre on the ray from the bf16 copy through the point (so
    ||x - c|| = ||copy - c|| - ||x - copy||), d2 at the exact dn and one ulp either side: a
    skip never happens where dn < d2 (the state would change), and does happen a little below
    (the screen is not vacuous). Magnitudes from subnormal to overflow (x beyond bf16's range:
    e = inf, no skip; squares overflowing: dn = inf), integer data (copy exact, e ~ 2^-50)."""
    rng = np.random.default_rng(K)
    rows = []
    for scale in (1.0, 3.0, 1e-3, 1e-19, 1e-41, 1e17, 3e19, 3.39e38):
        with np.errstate(over="ignore", invalid="ignore"):  # (the last scale: inf among x and c)
            x = (rng.standard_normal((300, K)) * scale).astype(np.float32)
            xt = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
            tau = rng.uniform(1.05, 60.0, (300, 1)).astype(np.float32)
            c_ray = (xt + tau * (x - xt)).astype(np.float32)  # (x - copy) direction: the tight case
            c_far = (x + scale * rng.standard_normal((300, K))).astype(np.float32)
        rows += [(x, c_ray, True), (x, c_far, False)]
    xi = rng.integers(-9, 10, (300, K)).astype(np.float32)
    rows.append((xi, xi + rng.integers(-3, 4, (300, K)).astype(np.float32), True))
    x = np.concatenate([r[0] for r in rows])
    c = np.concatenate([r[1] for r in rows])
    ray = np.concatenate([np.full(len(r[0]), r[2]) for r in rows])
    _, dn = _bound(runner, tmp_path, x, c, np.zeros(len(x), np.float32))
    # below: where the bound is tight (the ray, exact copies) 1e-4 under dn; elsewhere 5 %
    # (the screen's band is ~2 e / ||x - c||, e up to 2^-9 ||x||)
    below = np.where(ray, 1 - 1e-4, 0.95)
    cases = {"at": dn, "up": np.nextafter(dn, np.float32(np.inf)), "down": np.nextafter(dn, np.float32(0)),
             "below": (dn.astype(np.float64) * below).astype(np.float32)}
    skips = {}
    for name, d2 in cases.items():
        skip, dn2 = _bound(runner, tmp_path, x, c, d2)
        np.testing.assert_array_equal(dn2.view(np.int32), dn.view(np.int32))
        bad = skip & (dn < d2)
        assert not bad.any(), f"{name}: skipped a point that changes: x {x[bad][:2]}, c {c[bad][:2]}"
        skips[name] = skip
    assert not skips["up"][np.isfinite(dn) & (dn > 0)].any()
    x_fin = np.isfinite(x).all(1) & (np.abs(x).max(1) < 3e38)
    normal = x_fin & np.isfinite(dn) & (dn > 1e-30) & (dn < 1e37)
    assert skips["below"][normal].mean() > 0.95, skips["below"][normal].mean()
    beyond = ~np.isfinite(x).all(1) | (np.abs(x.astype(np.float64)).max(1) > 3.3962e38)  # bf16: inf
    assert beyond.any() and not skips["below"][beyond].any()  # e = inf or NaN: never a skip
