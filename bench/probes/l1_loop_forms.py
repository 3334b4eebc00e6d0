"""Issue rate of p = 1 pair loops (issue 26 item 3: the SIMT hot loop issues ~0.82 instructions per scheduler-cycle
and 1.2x Kermac needs ~0.88-0.90). An 8 x 8 tile of |a - b| sums a thread, a and b from shared memory by LDS.128
every k (the shipped loop's shape), 2 CTAs of 8 warps per SM (4 warps a scheduler), in these forms a pair-k:

    A   d = a - b; acc += |d|            FADD + FADD.|.|       (the shipped form)
    B   m = max(a, b); acc += m          FMNMX (ALU) + FADD    (sum |a - b| = 2 sum max - sum a - sum b)
    C   A for 5 of 8 columns, B for 3    (FMA and ALU pipes both fed)
    D   A for 6 of 8 columns, B for 2

Cycles from clock64 per CTA (SM clock), so the rate is instructions a scheduler-cycle whatever the clock.

    python3 bench/probes/l1_loop_forms.py
"""
import statistics

import numpy as np
import torch

from _raw import LaunchConfig, compile_probe, launch

SOURCE = r"""
template <int kMaxCols>
__global__ void __launch_bounds__(256, 2) loop(const float* __restrict__ src, float* out, long long* cycles, int iters) {
  __shared__ __align__(16) float sa[16][8 * 32 + 4];
  __shared__ __align__(16) float sb[16][8 * 8 + 4];
  for (int e = threadIdx.x; e < 16 * 256; e += 256) sa[e / 256][e % 256] = src[e];
  for (int e = threadIdx.x; e < 16 * 64; e += 256) sb[e / 64][e % 64] = src[e + 7];
  __syncthreads();
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  const int ti = threadIdx.x & 31, tj = (threadIdx.x >> 5) & 7;
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    const int k = it & 15;
    const float4 a0 = *reinterpret_cast<const float4*>(&sa[k][ti * 8]);
    const float4 a1 = *reinterpret_cast<const float4*>(&sa[k][ti * 8 + 4]);
    const float4 b0 = *reinterpret_cast<const float4*>(&sb[k][tj * 8]);
    const float4 b1 = *reinterpret_cast<const float4*>(&sb[k][tj * 8 + 4]);
    const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < 8 - kMaxCols) acc[i][j] += fabsf(a[i] - b[j]);
        else acc[i][j] += fmaxf(a[i], b[j]);
      }
  }
  long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) s += acc[i][j];
  if (s == 1.2345f) out[threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
"""

FORMS = [("A  sub + add|.|", "loop<0>"), ("B  max + add", "loop<8>"), ("C  5 A + 3 B", "loop<3>"),
         ("D  6 A + 2 B", "loop<2>")]


def main() -> None:
    obj, sms, stream = compile_probe(SOURCE, [n for _, n in FORMS])
    src = torch.rand(64 * 256 + 64, device="cuda")
    out = torch.zeros(1024, device="cuda")
    cyc = torch.zeros(sms * 2, dtype=torch.int64, device="cuda")
    iters = 8192
    for label, name in FORMS:
        kernel = obj.get_kernel(name)
        cfg = LaunchConfig(grid=(sms * 2, 1, 1), block=(256, 1, 1))
        ts, rates = [], []
        for _ in range(6):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(torch.cuda.current_stream())
            launch(stream, cfg, kernel, src.data_ptr(), out.data_ptr(), cyc.data_ptr(), np.int32(iters))
            e.record(torch.cuda.current_stream())
            e.synchronize()
            ts.append(s.elapsed_time(e))
            # a scheduler runs 4 warps (2 CTAs x 8 warps / 4); each issues 128 FP + 4 LDS a k
            rates.append(4 * iters * 132 / float(cyc.double().median()))
        ms = statistics.median(ts[1:])
        pairs_k = sms * 2 * 256 * 64 * iters
        print(f"L1FORM {label:18s} {ms:.3f} ms, {pairs_k / ms / 1e9:.1f} T pair-k/s, "
              f"{statistics.median(rates[1:]):.3f} instructions a scheduler-cycle (of 1)", flush=True)


if __name__ == "__main__":
    main()
