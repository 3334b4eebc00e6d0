"""CPU execution of cuda_templates/centring.cuh (plan.shift: the reference point and the shifted
copies of a 2-D float32 pair on a GPU) behind the thread shim (tests/cpu_shim.py), launched as
plan.shift launches them, against the torch steps they replace (kermac_like.centring's
pair_reference and shifted_pair): the same reference point and copies, bit for bit, on data with
non-finite values, ties, a lattice, an empty operand, column-major views and samples of a strided
row subset. And the routing: plan.shift takes 2-D float32 pairs on a GPU only, and asks the kernel
store for its three kernels (the install's first-call bundle holds them)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from cpu_shim import THREAD_SHIM, build_cpu_runner

from kermac_like import centring, config
from kermac_like.plan import shift
from kermac_like.runtime.specs.centring import CENTRING_COLS, CENTRING_SAMPLE, CENTRING_WARPS, centring_specs

SHIM = THREAD_SHIM + r"""
#include "centring.cuh"
using namespace kermac_like;
using Tr = CentringTraits;

int main(int argc, char** argv) {
  // argv: x_rows y_rows(-1: y is x) K Kp x_ldr x_ldc y_ldr y_ldc x_rpc x_chunks y_rpc y_chunks x_step y_step
  //       shift_blocks input output
  long long a[15];
  for (int i = 0; i < 15; ++i) a[i] = std::atoll(argv[1 + i]);
  const long long x_rows = a[0], y_rows_in = a[1], x_ldr = a[4], x_ldc = a[5], y_ldr = a[6], y_ldc = a[7];
  const int K = int(a[2]), Kp = int(a[3]), x_chunks = int(a[9]), y_chunks = int(a[11]), blocks = int(a[14]);
  const bool same = y_rows_in < 0;
  const long long y_rows = same ? 0 : y_rows_in;
  // inputs: x's buffer (x_rows * K floats, addressed through the strides), then y's
  std::vector<float> in(size_t(x_rows + y_rows) * K + 1);
  FILE* f = std::fopen(argv[16], "rb");
  if (std::fread(in.data(), 4, in.size() - 1, f) != in.size() - 1) return 3;
  std::fclose(f);
  const float* x = in.data();
  const float* y = same ? nullptr : x + size_t(x_rows) * K;
  const int chunks = x_chunks + y_chunks;
  std::vector<int> flags(size_t(chunks > 0 ? chunks : 1) * K, -7);
  std::vector<float> s(K, -7.f), xs(size_t(x_rows) * Kp + 1, -7.f), ys(size_t(y_rows) * Kp + 1, -7.f);
  if (chunks > 0) {
    gridDim = {unsigned(chunks), unsigned((K + Tr::kCols - 1) / Tr::kCols), 1};
    kl_run_grid(Tr::kThreads, [&] {
      centring_flags_kernel<Tr>(x, x_rows, x_ldr, x_ldc, a[8], x_chunks, y, y_rows, y_ldr, y_ldc, a[10], K,
                                flags.data());
    });
  }
  gridDim = {unsigned(K), 1, 1};
  kl_run_grid(Tr::kThreads, [&] {
    centring_point_kernel<Tr>(x, x_rows, x_ldr, x_ldc, a[12], y, y_rows, y_ldr, y_ldc, a[13], K, flags.data(), chunks,
                              s.data());
  });
  if (x_rows + y_rows > 0) {
    gridDim = {unsigned(blocks), 1, 1};
    kl_run_grid(Tr::kThreads, [&] {
      centring_shift_kernel<Tr>(x, x_rows, x_ldr, x_ldc, xs.data(), y, y_rows, y_ldr, y_ldc,
                                same ? nullptr : ys.data(), K, Kp, s.data());
    });
  }
  std::vector<float> out(s);
  out.insert(out.end(), xs.begin(), xs.end() - 1);
  out.insert(out.end(), ys.begin(), ys.end() - 1);
  return kl_write(argv[17], out);
}
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return build_cpu_runner(tmp_path_factory, "centring", SHIM)


def _run(runner, tmp_path, x: torch.Tensor, y: torch.Tensor | None, Kp: int):
    """(s, xs, ys) from the kernels with plan.shift's launch parameters; y None: y is x."""
    K = x.shape[1]
    x_rpc, x_chunks = shift._chunks(x.shape[0])
    y_rows = 0 if y is None else y.shape[0]
    y_rpc, y_chunks = shift._chunks(y_rows)
    rows = x.shape[0] + y_rows
    blocks = min(-(-rows // CENTRING_WARPS), shift._MAX_SHIFT_BLOCKS) if rows else 0

    def buffer(t):  # the tensor's memory as its strides address it (row- or column-major)
        return (t if t.stride(1) == 1 else t.t()).contiguous().reshape(-1)

    yb = torch.empty(0) if y is None else buffer(y)
    y_strides = (0, 0) if y is None else y.stride()
    args = [x.shape[0], -1 if y is None else y_rows, K, Kp, *x.stride(), *y_strides, x_rpc, x_chunks, y_rpc, y_chunks,
            shift._step(x.shape[0]), shift._step(y_rows), blocks]
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    torch.cat([buffer(x), yb]).numpy().astype(np.float32).tofile(inp)
    res = subprocess.run([str(runner), *map(str, args), str(inp), str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = torch.from_numpy(np.fromfile(out, dtype=np.float32))
    s, xs = got[:K], got[K:K + x.shape[0] * Kp].reshape(-1, Kp)
    ys = xs if y is None else got[K + x.shape[0] * Kp:].reshape(-1, Kp)
    return s, xs, ys


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _cases():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(300, 5, generator=g) * 3 + 1000
    y = torch.randn(200, 5, generator=g) * 3 + 1000
    y[17, 2] = float("inf")
    x[250, 4] = float("nan")  # beyond the first chunk: the flags of every chunk count
    yield "offset data, inf and NaN columns", x, y, 8
    big = torch.randn(2500, 40, generator=g) + torch.linspace(-50, 50, 40)
    yield "x is y, sampled every 3rd row, two column groups, padded", big, None, 48
    lattice = torch.randint(0, 4, (1100, 3), generator=g).float()
    lattice[5, 0] = -0.0
    yield "a lattice: ties everywhere, -0 among them", lattice, torch.randint(0, 4, (1300, 3), generator=g).float(), 4
    yield "an empty x", torch.empty(0, 6), torch.randn(10, 6, generator=g) - 7, 8
    col = (torch.randn(6, 333, generator=g) + 5).t()  # column-major: ldr 1, ldc 333
    yield "column-major views", col, (torch.randn(6, 129, generator=g) - 3).t(), 8
    one = torch.full((50, 2), float("-inf"))
    one[:, 1] = 2.5
    yield "a column of infinities only", one, None, 4


@pytest.mark.parametrize("name, x, y, Kp", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_kernels_match_the_torch_steps(runner, tmp_path, name, x, y, Kp):
    s, xs, ys = _run(runner, tmp_path, x, y, Kp)
    other = x if y is None else y
    _same(s, centring.pair_reference(x, other))
    want_x, want_y, _ = centring.shifted_pair(x, other, pad_to=Kp)
    _same(xs, want_x)
    _same(ys, want_y)


def test_the_sample_is_the_torch_steps_sample():
    assert CENTRING_SAMPLE == centring.REFERENCE_ROWS
    for rows in (1, 1023, 1024, 1025, 2500, 10**7):
        step = shift._step(rows)
        assert len(range(0, rows, step)) <= CENTRING_SAMPLE and step == max(1, -(-rows // centring.REFERENCE_ROWS))
        rpc, chunks = shift._chunks(rows)
        assert chunks * rpc >= rows > (chunks - 1) * rpc and chunks <= shift._MAX_CHUNKS
    assert CENTRING_COLS == 32


def test_routing_asks_the_store_for_the_kernels_on_a_gpu_only(as_gpu, monkeypatch):
    """plan.shift takes 2-D float32 pairs planned as on a GPU (the kernels asked for; on CPU tensors
    the values come from torch's steps, equal to the kernels' by the test above), not float64,
    batched or 16-bit pairs, nor with the setting off."""
    from kermac_like.runtime import store

    asked = []
    monkeypatch.setattr(store, "get_kernel", lambda spec, device, debug=False: asked.append(spec))
    x, y = torch.randn(30, 4) + 100, torch.randn(20, 4) + 100
    xs, ys = shift.shifted_pair(x, y, pad_to=8)
    assert asked == list(centring_specs())
    _same(xs, centring.shifted_pair(x, y, pad_to=8)[0])
    asked.clear()
    for a, b in ((x.double(), y.double()), (x[None], y[None]), (x.half(), y.half())):
        shift.shifted_pair(a, b)
    with config.override(centring_kernels=False):
        shift.shifted_pair(x, y)
    assert not asked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name, x, y, Kp", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_gpu_kernels_match_the_torch_steps(name, x, y, Kp):
    """On a GPU: plan.shift's kernels against centring's torch steps on the same device, bit for bit."""
    x = x.cuda()
    other = x if y is None else y.cuda()
    with config.override(centring_kernels=True):
        assert shift.serves(x, other)
        xs, ys = shift.shifted_pair(x, other, pad_to=Kp)
    want_x, want_y, _ = centring.shifted_pair(x, other, pad_to=Kp)
    _same(xs, want_x)
    _same(ys, want_y)
    assert (xs is ys) == (y is None)
