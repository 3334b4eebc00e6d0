"""CPU execution of cuda_templates/logsumexp.cuh: the real kernel compiled with g++ behind the
thread shim (tests/cpu_shim.py) and run against a float64 oracle: rows past M, partial tiles,
split N ranges combined by lse_combine_kernel, column chunks below kC, bandwidths at which
float32 exp(-phi) underflows for every pair, a NaN point (its rows' columns NaN), -inf log
weights (a column of zero weights: -inf) and the same bits for the same split count. The expanded
exponent (kVariant 3) with the planner's flag and centre (plan/logsumexp.py expand_params) where its
bound allows it, forced on at larger ones, with an infinite row (that CTA's direct loop)."""

from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest
import torch
from cpu_shim import THREAD_SHIM, build_cpu_runner

from kermac_like.descriptor import PRESETS, KernelType
from kermac_like.plan.logsumexp import expand_params

# (descriptor template arguments, kK, kC[, kVariant, kUnrollJ, kRows]): instance i of the runner.
INSTANCES = [
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 3, 1),   # squared: phi from the sum
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Laplace", 3, 4),    # kRows = 4
    ("Inner::Diff, Power::Abs, Power::Noop, Epilogue::Laplace", 16, 8),      # kRows = 1
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 48, 2),  # kBlockN = 128
    # The lazy-reference variants (bench/notes/logsumexp.md): the fold with the weight in y's slot,
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 3, 1, 2, 8, 4),
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 3, 1, 1, 4, 4),  # no fold
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Laplace", 3, 4, 1, 0, 0),   # columns, sqrt
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 16, 1, 2, 4, 0),  # float4 weights
    ("Inner::Diff, Power::Abs, Power::Noop, Epilogue::Laplace", 16, 8, 2, 0, 0),     # kVariant 2, no fold
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 3, 1, 2, 8, 8),  # kBlockM = 1024
    # The expanded exponent: the weight in y's slot (K = 3), in the weight array (K = 8), Laplace of d^2.
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 3, 1, 3, 8, 4),
    ("Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian", 8, 1, 3, 4, 0),
    ("Inner::Diff, Power::Square, Power::Noop, Epilogue::Laplace", 3, 1, 3, 4, 0),
]
EXPANDED = [i for i, t in enumerate(INSTANCES) if len(t) > 3 and t[3] == 3]

SHIM = THREAD_SHIM + r"""
#undef __shared__
#define __shared__
#include "logsumexp.cuh"
namespace kermac_like {
alignas(16) unsigned char kl_lse_smem[1 << 17];
}
using namespace kermac_like;
@@INSTANCES@@

template <class Tr>
void run(const float* x, const float* y, const float* lw, float* out, float* scratch, int M, int N, int K, int C,
         int n_split, int per, float bw, const float* expand) {
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), unsigned(n_split), 1};
  if (per * n_split * Tr::kBlockN < N) per = ((N + Tr::kBlockN - 1) / Tr::kBlockN + n_split - 1) / n_split;
  kl_run_grid(Tr::kThreads, [&] {
    lse_kernel<Tr>(x, y, lw, out, scratch, M, N, K, C, K, 1, K, 1, C, 1, C, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                   0, 0, 0, nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, bw, n_split, per, expand);
  });
  if (n_split > 1) {
    gridDim = {1, 1, 1};
    blockDim = {1, 1, 1};
    blockIdx = {0, 0, 0};
    threadIdx = {0, 0, 0};
    lse_combine_kernel<Tr>(scratch, out, M, C, n_split, C, 1, 1, 1, 1, 0, 0, 0);
  }
}

int main(int argc, char** argv) {
  // argv: instance, M, N, K, C, n_split, tiles per split, bandwidth, input (x | y | lw | [flag, centre]),
  // output, 1: pass [flag, centre] as `expand` (else null)
  const int which = std::atoi(argv[1]), M = std::atoi(argv[2]), N = std::atoi(argv[3]), K = std::atoi(argv[4]);
  const int C = std::atoi(argv[5]), n_split = std::atoi(argv[6]), per = std::atoi(argv[7]);
  const float bw = float(std::atof(argv[8]));
  const bool has_expand = std::atoi(argv[11]) != 0;
  std::vector<float> in(size_t(M + N) * K + size_t(N) * C + (has_expand ? 1 + K : 0));
  FILE* f = std::fopen(argv[9], "rb");
  if (std::fread(in.data(), 4, in.size(), f) != in.size()) return 3;
  std::fclose(f);
  std::vector<float> out(size_t(M) * C, -7.0f), scratch(size_t(n_split) * M * 16, -7.0f);
  const float *x = in.data(), *y = x + size_t(M) * K, *lw = y + size_t(N) * K;
  const float* expand = has_expand ? lw + size_t(N) * C : nullptr;
  switch (which) {
@@CASES@@
    default: return 4;
  }
  return kl_write(argv[10], out);
}
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    inst = [f"using T{i} = LseTraits<{t[0]}, float, {', '.join(map(str, t[1:]))}>;" for i, t in enumerate(INSTANCES)]
    cases = [f"    case {i}: run<T{i}>(x, y, lw, out.data(), scratch.data(), M, N, K, C, n_split, per, bw, expand); "
             "break;"
             for i in range(len(INSTANCES))]
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "lse_cpu", src)


def _phi(which: int, x, y, bw: float):
    x, y = x.astype(np.float64), y.astype(np.float64)
    desc = INSTANCES[which][0]
    diff = x[:, None, :] - y[None, :, :]
    d2 = (diff ** 2).sum(-1)
    d = np.abs(diff).sum(-1) if "Abs" in desc else d2 if "Noop" in desc else np.sqrt(d2)
    return d / bw if "Laplace" in desc else d * d / (2 * bw * bw)


def _desc(which: int):
    """The descriptor of an expanded instance (the Gaussian of l2, the Laplace of squared l2)."""
    g = PRESETS["gaussian_l2"]
    return g if "Gaussian" in INSTANCES[which][0] else dataclasses.replace(PRESETS["squared_l2"],
                                                                           kernel_type=KernelType.LAPLACE)


def _oracle(which: int, x, y, lw, bw: float):
    t = -_phi(which, x, y, bw)[:, :, None] + lw.astype(np.float64)[None, :, :]  # (M, N, C)
    with np.errstate(invalid="ignore", divide="ignore"):
        mx = np.max(np.where(np.isnan(t), -np.inf, t), axis=1)
        safe = np.where(np.isfinite(mx), mx, 0)
        return np.log(np.exp(t - safe[:, None, :]).sum(1)) + safe


def _run(runner, tmp_path, which, x, y, lw, n_split, per, bw, expand=None):
    M, K = x.shape
    N, C = lw.shape
    inp = tmp_path / "in.bin"
    extra = [] if expand is None else [np.asarray(expand, dtype=np.float32)]
    np.concatenate([x.ravel(), y.ravel(), lw.ravel(), *extra]).astype(np.float32).tofile(inp)
    outp = tmp_path / "out.bin"
    subprocess.run([str(runner), str(which), str(M), str(N), str(K), str(C), str(n_split), str(per), repr(bw),
                    str(inp), str(outp), str(int(expand is not None))], check=True)
    return np.fromfile(outp, dtype=np.float32).reshape(M, C)


@pytest.mark.parametrize("which", range(len(INSTANCES)))
@pytest.mark.parametrize("bw,n_split,per", [(1.0, 1, 8), (1e-3, 1, 8), (0.5, 3, 0), (1e-3, 2, 1), (3e3, 2, 1)])
def test_lse_kernel_cpu(runner, which, bw, n_split, per, tmp_path):
    _, kK, kC = INSTANCES[which][:3]
    K = kK - 1 if kK > 3 else kK  # padded coordinates zero-filled
    C = max(1, kC - 1)  # a column chunk below kC
    rng = np.random.default_rng(10 * which + n_split)
    M, N = 70 if kK > 8 else 530, 301  # rows past the block; the last y tile partial
    scale = 0.1 if bw < 0.01 else 1.0  # phi of order 1e2..1e4 at bandwidth 1e-3
    x = (rng.standard_normal((M, K)) * scale).astype(np.float32)
    y = (rng.standard_normal((N, K)) * scale).astype(np.float32)
    lw = (rng.standard_normal((N, C)) * 3).astype(np.float32)
    if bw == 3e3:
        y[17, 0] = np.nan  # a NaN point: every row NaN in every column
    if C > 1:
        lw[:, 0] = -np.inf  # every weight zero: -inf
        lw[40, 1] = 50.0  # one term dominating
    else:
        lw[::5, 0] = -np.inf  # some zero weights
    expand = None
    if which in EXPANDED:  # the planner's flag and centre (the NaN point and infinite row left out)
        y[30, 1] = np.inf  # an infinite point: terms -inf
        x[3, 0] = np.inf  # an infinite row: its CTA keeps the direct loop, the second CTA expands
        expand = expand_params(_desc(which), torch.from_numpy(x), torch.from_numpy(y), bw).numpy()
        if bw == 0.5:  # bound ~4e-6, at the tolerance: expanded, forced
            expand[0] = 1.0
        assert expand[0] == (bw >= 0.5)  # bounds ~1e-6 / bw^2 (Gaussian), ~2e-6 / bw (Laplace of d^2)
    got = _run(runner, tmp_path, which, x, y, lw, n_split, per, bw, expand)
    ref = _oracle(which, x, y, lw, bw)
    if not np.isnan(y).any():
        assert np.isfinite(ref[:, 1:]).all()
    if bw < 0.01 and "Noop" not in INSTANCES[which][0]:  # float32 exp(-phi) is 0 for nearly every pair
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            assert (np.exp(-_phi(which, x, y, bw).astype(np.float32)) == 0).mean() > 0.9
        assert np.isfinite(got[:, 1:]).all() or np.isnan(y).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    tol = 1e-5 * np.maximum(1, np.abs(np.nan_to_num(ref, neginf=0)))
    with np.errstate(invalid="ignore"):  # -inf - -inf
        ok = np.isnan(ref) | (got == ref) | (np.abs(got - ref) <= tol)
    assert ok.all(), (np.abs(got - ref) / tol)[~ok][:10]
    again = _run(runner, tmp_path, which, x, y, lw, n_split, per, bw, expand)
    np.testing.assert_array_equal(got.view(np.uint32), again.view(np.uint32))  # the same bits
