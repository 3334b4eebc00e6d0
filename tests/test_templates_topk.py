"""CPU execution of cuda_templates/topk.cuh: the real selection kernel compiled with g++ behind
the thread shim (tests/cpu_shim.py) and run against a float64 oracle. Small integer
coordinates make every float32 sum exact, so the data is full of exact ties and the (value,
index) order is checked to the last entry: rows of the block that are past M, partial tiles,
buffers that fill and merge many times (k beyond the buffer), split N ranges merged by
topk_combine_kernel, a NaN row and a NaN point (NaN above +inf: last for the smallest, first
for the largest), descending selection of kernel values and signed dot products."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from cpu_shim import THREAD_SHIM, build_cpu_runner

# (descriptor template arguments, kK, largest, kSel): instance i of the runner. kSel 0: lists in
# memory with shared-memory buffers (every k); kSel 32: register lists (k <= 32).
INSTANCES = [
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::None", 3, "false", 0),    # l2 (deferred sqrt)
    ("Inner::Diff, Power::Abs, Power::Noop, Epilogue::None", 5, "false", 0),       # l1
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Laplace", 3, "true", 0),  # laplace_l2 kernel values
    ("Inner::Dot, Power::Noop, Power::Noop, Epilogue::None", 12, "true", 0),       # dot, kRows = 2
    ("Inner::Dot, Power::Noop, Power::Noop, Epilogue::None", 12, "false", 0),
    ("Inner::Diff, Power::Abs, Power::Noop, Epilogue::None", 48, "false", 0),      # kRows = 1, two partial sums
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::None", 3, "false", 8),
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Laplace", 3, "true", 32),
    ("Inner::Dot, Power::Noop, Power::Noop, Epilogue::None", 12, "true", 12),
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::None", 128, "false", 12),  # the wide bucket (fallback)
]

SHIM = THREAD_SHIM + r"""
#undef __shared__
#define __shared__
#include "topk.cuh"
namespace kermac_like {
alignas(16) unsigned char kl_topk_smem[1 << 17];
}
using namespace kermac_like;
@@INSTANCES@@

template <class Tr>
void run(const float* x, const float* y, float* values, long long* keys, int M, int N, int K, int k, int n_split,
         int per) {
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), unsigned(n_split), 1};
  if (per == 0) per = ((N + Tr::kBlockN - 1) / Tr::kBlockN + n_split - 1) / n_split;  // the planner's cover
  kl_run_grid(Tr::kThreads, [&] {
    topk_kernel<Tr>(x, y, n_split == 1 ? values : nullptr, keys, M, N, K, k, K, 1, K, 1, k, 1, k, 1, 1, 1, 1, 0, 0, 0, 0,
                    0, 0, 0, 0, 0, 0, 0, 0, nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, 10.0f,
                    n_split, per);
  });
}

template <class Tr>
void combine(const long long* scratch, float* values, long long* indices, int M, int k, int n_split) {
  gridDim = {1, 1, 1};
  blockDim = {1, 1, 1};
  blockIdx = {0, 0, 0};
  threadIdx = {0, 0, 0};
  topk_combine_kernel<Tr>(scratch, values, indices, M, k, n_split, k, 1, k, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, nullptr, 0,
                          0, 0, 0.f);
}

int main(int argc, char** argv) {
  // argv: instance, M, N, K, k, n_split, tiles per split, input file (x | y), output file (values | indices)
  const int which = std::atoi(argv[1]), M = std::atoi(argv[2]), N = std::atoi(argv[3]), K = std::atoi(argv[4]);
  const int k = std::atoi(argv[5]), n_split = std::atoi(argv[6]), per = std::atoi(argv[7]);
  std::vector<float> in(size_t(M + N) * K);
  FILE* f = std::fopen(argv[8], "rb");
  if (std::fread(in.data(), 4, in.size(), f) != in.size()) return 3;
  std::fclose(f);
  std::vector<float> values(size_t(M) * k, -7.0f);
  std::vector<long long> indices(size_t(M) * k, -7), scratch(size_t(n_split) * M * k, -7);
  long long* keys = n_split == 1 ? indices.data() : scratch.data();
  switch (which) {
@@CASES@@
    default: return 4;
  }
  std::vector<double> out(values.begin(), values.end());
  for (long long i : indices) out.push_back(double(i));
  return kl_write(argv[9], out);
}
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    inst = [f"using T{i} = TopkTraits<{d}, float, {kk}, {lg}, {sel}>;" for i, (d, kk, lg, sel) in enumerate(INSTANCES)]
    cases = [f"    case {i}: run<T{i}>(in.data(), in.data() + size_t(M) * K, values.data(), keys, M, N, K, k, n_split, "
             f"per); if (n_split > 1) combine<T{i}>(scratch.data(), values.data(), indices.data(), M, k, n_split); "
             "break;" for i in range(len(INSTANCES))]
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "topk_cpu", src)


def _values(which: int, x, y):
    x, y = x.astype(np.float64), y.astype(np.float64)
    desc = INSTANCES[which][0]
    with np.errstate(invalid="ignore"):
        if "Dot" in desc:
            return x @ y.T
        diff = x[:, None, :] - y[None, :, :]
        if "Abs" in desc:
            return np.abs(diff).sum(-1)
        d = np.sqrt((diff ** 2).sum(-1))
        return np.exp(-d / 10.0) if "Laplace" in desc else d


def _oracle(vals, k: int, largest: bool):
    """torch.topk's selection in the total order (value, index), NaN above +inf."""
    idx = np.arange(vals.shape[1])
    order = []
    for row in vals:
        nan = np.isnan(row)
        v = np.where(nan, 0.0, row)
        o = np.lexsort((idx, -v, ~nan)) if largest else np.lexsort((idx, v, nan))
        order.append(o[:k])
    order = np.array(order)
    return np.take_along_axis(vals, order, 1), order


@pytest.mark.parametrize("which", range(len(INSTANCES)))
@pytest.mark.parametrize("k,n_split,per", [(1, 1, 8), (7, 1, 8), (40, 1, 8), (7, 3, 0)])
def test_topk_kernel_cpu(runner, which, k, n_split, per, tmp_path):
    _, K, largest, sel = INSTANCES[which]
    if sel:
        k = min(k, sel)  # register lists: k <= kSel (k < kSel leaves leading zeros)
    K = K - 1 if K > 3 else K  # padded coordinates (K < kK) zero-filled
    rng = np.random.default_rng(100 * which + k + n_split)
    M, N = 130 if K < 32 else 70, 701  # rows past the block; y tiles of 128 or 256, the last one partial, its last trip too
    x = rng.integers(-3, 4, (M, K)).astype(np.float32)
    y = rng.integers(-3, 4, (N, K)).astype(np.float32)
    y[500:520] = y[3]  # exact duplicates: ties ordered by index
    x[5] = np.nan  # a NaN row: every value NaN, the first k points in index order
    y[11, 0] = np.nan  # a NaN point: last for the smallest, first for the largest
    inp = tmp_path / "in.bin"
    np.concatenate([x.ravel(), y.ravel()]).tofile(inp)
    outp = tmp_path / "out.bin"
    subprocess.run([str(runner), str(which), str(M), str(N), str(K), str(k), str(n_split), str(per), str(inp),
                    str(outp)], check=True)
    raw = np.fromfile(outp, dtype=np.float64)
    got_v, got_i = raw[:M * k].reshape(M, k), raw[M * k:].reshape(M, k).astype(np.int64)
    ref_v, ref_i = _oracle(_values(which, x, y), k, largest == "true")
    np.testing.assert_array_equal(got_i, ref_i)
    np.testing.assert_allclose(got_v, ref_v, rtol=2e-7, atol=0, equal_nan=True)
