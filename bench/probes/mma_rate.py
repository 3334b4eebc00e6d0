"""Throughput of mma.sync on this GPU, to size a tensor-core pair loop (bench/notes/matvec.md,
"Several columns on tensor cores"): independent chains of mma.sync.m16n8k8 TF32 and m16n8k16 F16
per warp, alone and interleaved with the per-pair SIMT work of a P V loop (4 ex2 + 4 FADD + 4 cvt
+ 4 FSUB a lane per 9 TF32 MMAs), timed with CUDA events (median of 5).

    python3 bench/probes/mma_rate.py
"""
import statistics

import torch

from _raw import LaunchConfig, compile_probe, launch

SOURCE = r"""
template <int kMode, int kChains>
__global__ void rate(float* out, int iters, float seed) {
  float acc[kChains][4];
  unsigned a[4], b[2];
  for (int c = 0; c < kChains; ++c) for (int r = 0; r < 4; ++r) acc[c][r] = 0.f;
  for (int r = 0; r < 4; ++r) a[r] = __float_as_uint(seed + threadIdx.x + r);
  b[0] = __float_as_uint(seed * 2.f); b[1] = __float_as_uint(seed * 3.f);
  float p[4] = {seed, seed * 0.5f, seed * 0.25f, seed * 0.125f};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if (kMode == 2) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
      } else {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(acc[c][0]), "+f"(acc[c][1]), "+f"(acc[c][2]), "+f"(acc[c][3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
      }
    }
    if (kMode == 1) {  // the SIMT share of a P V block: 4 pairs a lane
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float t = p[r] + acc[r % kChains][r];
        float e;
        asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(t));
        unsigned h;
        asm volatile("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(e));
        p[r] = e - __uint_as_float(h);
        a[r] = h;
      }
    }
  }
  float s = 0.f;
  for (int c = 0; c < kChains; ++c) for (int r = 0; r < 4; ++r) s += acc[c][r];
  s += p[0] + p[1] + p[2] + p[3];
  if (s == 1.2345f) out[threadIdx.x] = s;
}
"""

NAMES = [("tf32 x6", "rate<0, 6>", 6, 2048), ("tf32 x9", "rate<0, 9>", 9, 2048),
         ("tf32 x9 + simt", "rate<1, 9>", 9, 2048), ("f16 k16 x6", "rate<2, 6>", 6, 4096)]


def main() -> None:
    obj, sms, stream = compile_probe(SOURCE, [n for _, n, _, _ in NAMES])
    out = torch.zeros(1024, device="cuda")
    iters = 4096
    for label, name, chains, flop in NAMES:
        kernel = obj.get_kernel(name)
        for warps in (4, 8):
            cfg = LaunchConfig(grid=(sms * 2, 1, 1), block=(32 * warps, 1, 1))
            ts = []
            for _ in range(6):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(torch.cuda.current_stream())
                launch(stream, cfg, kernel, out.data_ptr(), iters, 1.0)
                e.record(torch.cuda.current_stream())
                e.synchronize()
                ts.append(s.elapsed_time(e))
            ms = statistics.median(ts[1:])
            n = sms * 2 * warps * iters * chains
            print(f"{label:16s} warps/CTA {warps}: {ms:.3f} ms, {n / ms / 1e9:.2f} T mma/s, "
                  f"{n * flop / ms / 1e9:.1f} TFLOP/s, {n / ms / 1e9 / sms * 1e3:.2f} G mma/s per SM")


if __name__ == "__main__":
    main()
