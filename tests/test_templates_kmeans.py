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

KKS = (0, 4, 16)  # instance i of the runner: KmeansTraits<float, KKS[i]>

SHIM = THREAD_SHIM + r"""
#include "kmeans.cuh"
using namespace kermac_like;
@@INSTANCES@@

template <class Tr>
void seed(const float* x, const float* w, const double* u, long long* idx, float* centres, int N, int K, int C,
          long long sxm, long long sxk) {
  const int nb = (N + Tr::kBlockM - 1) / Tr::kBlockM;
  std::vector<float> d2(N, -7.0f), cc(C, -7.0f);
  std::vector<int> near(N, -7);
  std::vector<double> bsum(nb, -7.0);
  using TD = KmeansTraits<float, 0>;
  auto update = [&](int j) {
    gridDim = {unsigned(nb), 1, 1};
    kl_run_grid(Tr::kThreads, [&] {
      kmeans_update_kernel<Tr>(x, w, centres, cc.data(), d2.data(), near.data(), bsum.data(), N, K, sxm, sxk, K, j);
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
}

int main(int argc, char** argv) {
  // argv: instance, N, K, C, weighted, column-major, input (x | w | u), idx output, centres output
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
  switch (which) {
@@CASES@@
    default: return 4;
  }
  const int r = kl_write(argv[8], idx);
  return r ? r : kl_write(argv[9], centres);
}
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    assert SAMPLE_BLOCK == 1024  # KmeansTraits::kBlockM
    inst = [f"using T{i} = KmeansTraits<float, {kk}>;" for i, kk in enumerate(KKS)]
    cases = [f"    case {i}: seed<T{i}>(x, w, u.data(), idx.data(), centres.data(), N, K, C, sxm, sxk); break;"
             for i in range(len(KKS))]
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "kmeans_cpu", src)


def _run(runner, tmp_path, which, X, w, u, colmajor=False):
    N, K = X.shape
    C = u.shape[0]
    inp = tmp_path / "in.bin"
    xs = X.T if colmajor else X
    parts = [np.ascontiguousarray(xs, dtype=np.float32).ravel(),
             np.zeros(N, np.float32) if w is None else w.astype(np.float32)]
    with open(inp, "wb") as f:
        f.write(np.concatenate(parts).tobytes())
        f.write(u.astype(np.float64).tobytes())
    oi, oc = tmp_path / "idx.bin", tmp_path / "c.bin"
    subprocess.run([str(runner), str(which), str(N), str(K), str(C), str(int(w is not None)), str(int(colmajor)),
                    str(inp), str(oi), str(oc)], check=True)
    return np.fromfile(oi, dtype=np.int64), np.fromfile(oc, dtype=np.float32).reshape(C, K)


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
