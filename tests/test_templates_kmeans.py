"""CPU execution of cuda_templates/kmeans.cuh: the real k-means++ kernels (kmeans_update_kernel,
kmeans_gap_kernel, kmeans_draw_kernel) compiled with g++ behind the thread shim (tests/cpu_shim.py)
and run for a whole seeding, round after round as plan.kmeans.Seeding launches them, against
cluster._kmeans_plusplus.kmeans_plusplus (the torch path, the same algorithm) with the same uniforms: the same
indices and centres. Integer data (every distance and sum exact, so every tie is the same tie),
Gaussian data, weights, a zero-weight case (fewer weighted points than centres: the degenerate
draws), far blobs (rejected proposals end rounds early), K = 3 and 16 (kK buckets) and 40 (the
runtime loop), N not a multiple of the 1024-point block and a column-major x. Lloyd's segmented
sum against cluster._lloyd.segment_sums. (Bitwise repeats: tests/test_gpu_cluster.py.)"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from cpu_shim import THREAD_SHIM, build_cpu_runner

from kermac_like.testing import kmeans_seeding

SAMPLE_BLOCK, SEED_ROUND, SEED_TRIALS = kmeans_seeding.SAMPLE_BLOCK, kmeans_seeding.SEED_ROUND, kmeans_seeding.SEED_TRIALS
kmeans_plusplus, seed_uniforms = kmeans_seeding.kmeans_plusplus, kmeans_seeding.seed_uniforms

# instance i of the runner: KmeansTraits<float, kK> with kK = KKS[i]
KKS = (0, 4, 16)

SHIM = THREAD_SHIM + r"""
#include "kmeans.cuh"
using namespace kermac_like;
@@INSTANCES@@
constexpr int kTrials = @@TRIALS@@;

// The whole seeding as plan.kmeans.Seeding runs it; the state (rounds (int) | d2 | near | bsum) as bytes.
template <class Tr>
void seed(const float* x, const float* w, const double* u, long long* idx, float* centres, int N, int K, int C,
          long long sxm, long long sxk, std::vector<char>& state) {
  const int nb = (N + Tr::kBlockM - 1) / Tr::kBlockM;
  std::vector<float> d2(N, -7.0f), gap(C, -7.0f);
  std::vector<int> near(N, -7), count(1, -7);
  std::vector<double> bsum(nb, -7.0), cum(nb, -7.0);
  using TD = KmeansTraits<float, 0>;
  auto update = [&](int s, int e) {
    gridDim = {unsigned(nb), 1, 1};
    kl_run_grid(Tr::kThreads, [&] {
      kmeans_update_kernel<Tr>(x, w, centres, gap.data(), d2.data(), near.data(), bsum.data(), N, K, sxm, sxk, K, s, e);
    });
  };
  auto draw = [&](int s) {
    gridDim = {1, 1, 1};
    kl_run_grid(TD::kThreads, [&] {
      kmeans_draw_kernel<TD>(x, w, d2.data(), bsum.data(), cum.data(), u, idx, centres, count.data(), N, K, sxm, sxk,
                             K, nb, C, s, kTrials);
    });
    return count[0];
  };
  update(-1, 0);
  int s = 0, e = draw(0), rounds = 1;
  while (e < C) {
    if (s > 0) {
      gridDim = {unsigned((s + TD::kThreads - 1) / TD::kThreads), 1, 1};
      kl_run_grid(TD::kThreads, [&] { kmeans_gap_kernel<TD>(centres, gap.data(), K, K, s, e); });
    }
    update(s, e);
    s = e;
    e = draw(s);
    ++rounds;
  }
  auto put = [&](const void* p, size_t n) { state.insert(state.end(), (const char*)p, (const char*)p + n); };
  put(&rounds, 4);
  put(d2.data(), 4 * d2.size());
  put(near.data(), 4 * near.size());
  put(bsum.data(), 8 * bsum.size());
}

// One exact draw (centre s, the first of a round) from given d2 and block sums: argv draw, N, K, s,
// input (x | d2 | bsum | u row s | centres[:s]), output (idx[s] as double | centres[s] | count).
int draw_only(char** argv) {
  using TD = KmeansTraits<float, 0>;
  const int N = std::atoi(argv[2]), K = std::atoi(argv[3]), s = std::atoi(argv[4]);
  const int nb = (N + TD::kBlockM - 1) / TD::kBlockM, ut = 2 * kTrials + 1;
  std::vector<float> x(size_t(N) * K), d2(N), centres(size_t(s + 1) * K);
  std::vector<double> bsum(nb), cum(nb, -7.0), u(size_t(s + 1) * ut);
  std::vector<long long> idx(s + 1, -7);
  std::vector<int> count(1, -7);
  FILE* f = std::fopen(argv[5], "rb");
  if (std::fread(x.data(), 4, x.size(), f) != x.size() || std::fread(d2.data(), 4, N, f) != size_t(N) ||
      std::fread(bsum.data(), 8, nb, f) != size_t(nb) || std::fread(&u[size_t(s) * ut], 8, ut, f) != size_t(ut) ||
      std::fread(centres.data(), 4, size_t(s) * K, f) != size_t(s) * K)
    return 3;
  std::fclose(f);
  gridDim = {1, 1, 1};
  kl_run_grid(TD::kThreads, [&] {
    kmeans_draw_kernel<TD>(x.data(), nullptr, d2.data(), bsum.data(), cum.data(), u.data(), idx.data(), centres.data(),
                           count.data(), N, K, K, 1, K, nb, s + 1, s, kTrials);
  });
  std::vector<double> out;
  out.push_back(double(idx[s]));
  for (int q = 0; q < K; ++q) out.push_back(centres[size_t(s) * K + q]);
  out.push_back(double(count[0]));
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
  if (std::strcmp(argv[1], "segsum") == 0) return segsum(argv);
  // argv: instance, N, K, C, weighted, column-major, input (x | w | u), idx output, centres output, state output
  const int which = std::atoi(argv[1]), N = std::atoi(argv[2]), K = std::atoi(argv[3]), C = std::atoi(argv[4]);
  const bool weighted = std::atoi(argv[5]) != 0, colmajor = std::atoi(argv[6]) != 0;
  std::vector<float> xw(size_t(N) * K + N);
  std::vector<double> u(size_t(C) * (2 * kTrials + 1));
  FILE* f = std::fopen(argv[7], "rb");
  if (std::fread(xw.data(), 4, xw.size(), f) != xw.size() || std::fread(u.data(), 8, u.size(), f) != u.size()) return 3;
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
    assert SEED_ROUND == 128  # KmeansTraits::kBlockN
    inst = [f"using T{i} = KmeansTraits<float, {kk}>;" for i, kk in enumerate(KKS)]
    cases = [f"    case {i}: seed<T{i}>(x, w, u.data(), idx.data(), centres.data(), N, K, C, sxm, sxk, state); break;"
             for i in range(len(KKS))]
    src = (SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
           .replace("@@TRIALS@@", str(SEED_TRIALS)))
    return build_cpu_runner(tmp_path_factory, "kmeans_cpu", src)


def _run(runner, tmp_path, which, X, w, u, colmajor=False):
    """(indices, centres, state) of the runner's seeding; state: rounds, d2, near, bsum."""
    N, K = X.shape
    C = u.shape[0]
    inp = tmp_path / "in.bin"
    xs = X.T if colmajor else X
    parts = [np.ascontiguousarray(xs, dtype=np.float32).ravel(),
             np.zeros(N, np.float32) if w is None else w.astype(np.float32)]
    with open(inp, "wb") as f:
        f.write(np.concatenate(parts).tobytes())
        f.write(np.ascontiguousarray(u, dtype=np.float64).tobytes())
    oi, oc, os_ = tmp_path / "idx.bin", tmp_path / "c.bin", tmp_path / "state.bin"
    subprocess.run([str(runner), str(which), str(N), str(K), str(C), str(int(w is not None)), str(int(colmajor)),
                    str(inp), str(oi), str(oc), str(os_)], check=True)
    out = np.fromfile(oi, dtype=np.int64), np.fromfile(oc, dtype=np.float32).reshape(C, K)
    raw, nb = np.fromfile(os_, dtype=np.uint8), -(-N // SAMPLE_BLOCK)
    st, at = {"rounds": int(raw[:4].view(np.int32)[0])}, 4
    for name, dt, n in (("d2", np.float32, N), ("near", np.int32, N), ("bsum", np.float64, nb)):
        st[name] = raw[at:at + n * np.dtype(dt).itemsize].view(dt)
        at += n * np.dtype(dt).itemsize
    return out + (st,)


def _torch_seed(X, w, C, seed):
    u = seed_uniforms(C, torch.Generator().manual_seed(seed), "cpu")
    c, idx = kmeans_plusplus(torch.from_numpy(X), C, None if w is None else torch.from_numpy(w),
                             torch.Generator().manual_seed(seed))
    return u.numpy(), c.numpy(), idx.numpy()


def _data(case):
    rng = np.random.default_rng(len(case) * 7 + ord(case[-1]))
    C, w, which, colmajor = 10, None, 0, False  # (each launch runs 256 std::threads: about 25 ms on the shim)
    if case == "int_d3":  # exact arithmetic: duplicate points, equal distances, the same ties
        X = rng.integers(-3, 4, size=(2500, 3)).astype(np.float32)
        which = 1
    elif case == "gauss_d16_w":
        X = rng.standard_normal((2100, 16)).astype(np.float32)
        w = rng.uniform(0.0, 2.0, 2100).astype(np.float32)
        w[::7] = 0.0
        which = 2
    elif case == "int_d16_zero_w":  # 5 weighted points, 8 centres: three degenerate draws (N - 1)
        X = rng.integers(-2, 3, size=(1500, 16)).astype(np.float32)
        w = np.zeros(1500, np.float32)
        w[[3, 700, 1030, 1031, 1499]] = [1.0, 2.0, 0.5, 3.0, 1.0]
        which, C = 2, 8
    elif case == "int_blobs_d3":  # far blobs, integer offsets: proposals rejected, rounds ended early
        means = rng.integers(-3, 4, size=(12, 3)) * 1000
        X = (means[rng.integers(0, 12, 3000)] + rng.integers(-2, 3, size=(3000, 3))).astype(np.float32)
        which, C = 1, 16
    else:  # the runtime K loop, a column-major x
        X = (rng.standard_normal((1100, 40)) * 3).astype(np.float32)
        colmajor = True
    return X, w, C, which, colmajor


@pytest.mark.parametrize("case", ["int_d3", "gauss_d16_w", "int_d16_zero_w", "int_blobs_d3", "gauss_d40_colmajor"])
def test_seeding_same_as_torch(runner, tmp_path, case):
    X, w, C, which, colmajor = _data(case)
    u, c_ref, idx_ref = _torch_seed(X, w, C, 5)
    idx, c, st = _run(runner, tmp_path, which, X, w, u, colmajor)
    np.testing.assert_array_equal(idx, idx_ref)
    np.testing.assert_array_equal(c, c_ref)
    # the state covers the centres folded in (all but the last round's): d2 is each point's
    # smallest squared distance to them and near one that attains it
    folded = np.unique(st["near"])
    assert set(folded.tolist()) <= set(range(C))
    k = int(folded.max()) + 1
    D = ((X[:, None, :].astype(np.float64) - c[None, :k].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_allclose(st["d2"], D.min(1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(D[np.arange(len(X)), st["near"]], D.min(1), rtol=1e-5, atol=1e-6)
    if case == "int_d16_zero_w":
        assert set(idx[:5].tolist()) == {3, 700, 1030, 1031, 1499} and (idx[5:] == 1499).all()
    if case == "int_blobs_d3":
        assert st["rounds"] >= 4, st["rounds"]  # rounds ended by rejected proposals (else 2)
    elif case != "int_d16_zero_w":
        assert st["rounds"] == 2  # centre 0, then the rest in one round


def _sampler_draw(p, bsum, u):
    """cluster._kmeans_plusplus._Sampler.draw in numpy on the given block sums (exact for integer data)."""
    cum = np.cumsum(bsum)
    r = u * cum[-1]
    b = min(int(np.searchsorted(cum, r, side="right")), len(bsum) - 1)
    inner = np.cumsum(p[b * SAMPLE_BLOCK:(b + 1) * SAMPLE_BLOCK].astype(np.float64))
    i = min(int(np.searchsorted(inner, r - (cum[b] - bsum[b]), side="right")), SAMPLE_BLOCK - 1)
    return min(b * SAMPLE_BLOCK + i, len(p) - 1)


@pytest.mark.parametrize("u", [0.3, 0.999999, "zero", "tail"])
def test_draw_many_blocks(runner, tmp_path, u):
    """kmeans_draw_kernel's exact draw (the first of a round) on 1900 blocks (7 or 8 per thread:
    the chunked cumulative sums): the right-searchsorted block and point, the clamps (every p
    zero: N - 1; zero blocks at the end), the centre row, the count (one centre, as C = s + 1)."""
    rng = np.random.default_rng(3)
    N, K, s = 1900 * SAMPLE_BLOCK - 77, 3, 5
    X = rng.integers(-9, 10, size=(N, K)).astype(np.float32)
    d2 = rng.integers(0, 50, size=N).astype(np.float32)
    d2[rng.random(N) < 0.3] = 0
    if u == "zero":
        d2[:] = 0
    if u == "tail":
        d2[-5 * SAMPLE_BLOCK:] = 0
    uu = {"zero": 0.5, "tail": 0.99999999}.get(u, u)
    row = np.full(2 * SEED_TRIALS + 1, 0.77)
    row[SEED_TRIALS] = uu  # the exact draw's uniform
    pad = np.zeros(1900 * SAMPLE_BLOCK, np.float64)
    pad[:N] = d2
    bsum = pad.reshape(1900, SAMPLE_BLOCK).sum(1)
    cent = rng.integers(-9, 10, size=(s, K)).astype(np.float32)
    inp = tmp_path / "in.bin"
    with open(inp, "wb") as f:
        f.write(X.tobytes() + d2.tobytes() + bsum.tobytes() + row.tobytes() + cent.tobytes())
    outp = tmp_path / "out.bin"
    subprocess.run([str(runner), "draw", str(N), str(K), str(s), str(inp), str(outp)], check=True)
    out = np.fromfile(outp, dtype=np.float64)
    want = _sampler_draw(d2, bsum, uu)
    assert int(out[0]) == want
    if u == "zero":
        assert want == N - 1
    np.testing.assert_array_equal(out[1:1 + K], X[want])
    assert out[1 + K] == s + 1


@pytest.mark.parametrize("K,weighted,integer", [(3, False, True), (16, True, True), (16, True, False), (300, False, False)])
def test_segment_sums(runner, tmp_path, K, weighted, integer):
    """Lloyd's update: kmeans_segsum_kernel and its combination against cluster._lloyd.segment_sums
    (the torch path): the sums and weights per cluster, exact for integer data; an empty
    cluster, one cluster of several items (128 rows per item here), K > 256 (dimension chunks)."""
    from kermac_like.testing import kmeans_lloyd

    segment_sums = kmeans_lloyd.segment_sums

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
