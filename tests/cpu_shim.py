"""Building the g++ runners of the CPU execution tests: a template's kernels compiled as plain
C++ behind a thread shim (shared memory as statics, one thread per std::thread)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parent.parent / "cuda_templates"

# Put before every runner's source: the runners write their results with kl_write.
PRELUDE = r"""
#include <cstdio>
#include <vector>
// The runner's output file: the elements of v as they lie in memory; the exit status of main.
template <class V>
int kl_write(const char* path, const std::vector<V>& v) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr) return 5;
  const bool ok = std::fwrite(v.data(), sizeof(V), v.size(), f) == v.size();
  return std::fclose(f) == 0 && ok ? 0 : 6;
}
"""

# A block of CUDA threads on the CPU: each CUDA thread a std::thread, __syncthreads a barrier, warp
# shuffles through a shared array, the intrinsics the templates use; `__shared__` arrays inside a
# kernel become statics (one per program: blocks run one after another).
THREAD_SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

struct kl_dim3 { unsigned x, y, z; };
thread_local kl_dim3 threadIdx, blockIdx;
kl_dim3 gridDim, blockDim;
static std::barrier<>* kl_barrier;
static float kl_lane[256];
static int kl_and;
inline void __syncthreads() { kl_barrier->arrive_and_wait(); }
// Every block of gridDim (x fastest, then y, then z) by `threads` threads: body() is the kernel
// call of one thread; blocks run one after another.
template <class F>
void kl_run_grid(int threads, F body) {
  std::barrier<> bar(threads);
  kl_barrier = &bar;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      threadIdx = {unsigned(t), 0, 0};
      for (unsigned sz = 0; sz < gridDim.z; ++sz)
        for (unsigned sy = 0; sy < gridDim.y; ++sy)
          for (unsigned sx = 0; sx < gridDim.x; ++sx) {
            blockIdx = {sx, sy, sz};
            body();
            kl_barrier->arrive_and_wait();
          }
    });
  }
  for (auto& th : pool) th.join();
}
inline int __syncthreads_and(int p) {
  kl_barrier->arrive_and_wait();
  if (threadIdx.x == 0) kl_and = 1;
  kl_barrier->arrive_and_wait();
  if (!p) kl_and = 0;
  kl_barrier->arrive_and_wait();
  const int r = kl_and;
  kl_barrier->arrive_and_wait();
  return r;
}
// Every thread of the block calls the shuffles together (the kernel's centre reduction).
inline float __shfl_xor_sync(unsigned, float v, int o) {
  kl_lane[threadIdx.x] = v;
  kl_barrier->arrive_and_wait();
  const float r = kl_lane[threadIdx.x ^ o];
  kl_barrier->arrive_and_wait();
  return r;
}
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
using std::min;
#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __restrict__
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
"""


# matvec_grad.cuh behind THREAD_SHIM (its dynamic shared memory a static array of 64 KB).
MATVEC_GRAD_PRELUDE = r"""
#undef __shared__
#define __shared__
#include "matvec_grad.cuh"
namespace kermac_like { namespace matvec_grad_detail {
alignas(16) float kl_matvec_grad_smem[1 << 14];
} }
using namespace kermac_like;
"""

# The main() of a runner whose input file is 32 int64 (h), 4 float32 (hf), then h[31] float32 (buf), and
# whose source defines `template <class Tr> void run(std::vector<float>& buf, const long long* h,
# const float* hf)` and puts its `case i: run<Ii>(buf, h, hf); break;` lines at @@CASES@@; it writes
# buf back (run_float_runner reads it).
FLOAT_RUNNER_MAIN = r"""
int main(int argc, char** argv) {
  const int which = std::atoi(argv[1]);
  FILE* f = std::fopen(argv[2], "rb");
  long long h[32];
  float hf[4];
  if (std::fread(h, 8, 32, f) != 32 || std::fread(hf, 4, 4, f) != 4) return 2;
  std::vector<float> buf(h[31]);
  if (std::fread(buf.data(), 4, buf.size(), f) != buf.size()) return 3;
  std::fclose(f);
  switch (which) {
@@CASES@@
    default: return 4;
  }
  return kl_write(argv[3], buf);
}
"""


def run_float_runner(exe, tmp_path, idx: int, arrays, head, floats, out_index: int):
    """Run case ``idx`` of a FLOAT_RUNNER_MAIN runner: ``arrays`` laid out in one float32 buffer, each
    followed by a guard of 7 x 1e30 (nothing outside the operands may be touched), h[:len(head)] =
    head, h[16 + i] = the offset of arrays[i], h[31] = the buffer's size, hf = floats (4). Returns
    arrays[out_index] as written by the kernel (its shape), after checking that every other element of
    the buffer, guards included, is unchanged."""
    import numpy as np

    parts, offs, pos = [], [], 0
    guard = np.full(7, 1e30, np.float32)
    for arr in arrays:
        flat = np.ascontiguousarray(arr, dtype=np.float32).ravel()
        offs.append(pos)
        parts += [flat, guard]
        pos += flat.size + guard.size
    buf = np.concatenate(parts)
    h = np.zeros(32, np.int64)
    h[:len(head)] = head
    h[16:16 + len(arrays)] = offs
    h[31] = buf.size
    f = tmp_path / f"in{idx}.bin"
    with open(f, "wb") as fh:
        fh.write(h.tobytes())
        fh.write(np.asarray(floats, np.float32).tobytes())
        fh.write(buf.tobytes())
    res = subprocess.run([str(exe), str(idx), str(f), str(tmp_path / f"out{idx}.bin")], capture_output=True)
    assert res.returncode == 0, res.stderr
    got = np.fromfile(tmp_path / f"out{idx}.bin", dtype=np.float32)
    out = arrays[out_index]
    span = np.arange(offs[out_index], offs[out_index] + out.size)
    np.testing.assert_array_equal(np.delete(got, span), np.delete(buf, span))
    return got[span].reshape(out.shape)


def build_cpu_runner(tmp_path_factory, name: str, source: str) -> Path:
    """Compile ``source`` (a runner's C++, after PRELUDE) into an executable in a fresh temporary folder;
    skip the test module without a C++ compiler, fail with the compiler's output on error."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the CPU execution tests")
    d = tmp_path_factory.mktemp(name)
    (d / "runner.cpp").write_text(PRELUDE + source)
    exe = d / "runner"
    cmd = [cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", f"-I{TEMPLATES}", "-o", str(exe),
           str(d / "runner.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"g++ failed:\n{res.stderr[-6000:]}")
    return exe
