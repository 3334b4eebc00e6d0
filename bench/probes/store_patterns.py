"""How fast can a kernel write a 20000 x 20000 float32 matrix in the low-K kernel's tile order?
Write-only kernels (no loads; an optional chain of FMAs per output stands in for the
arithmetic of K) against out.fill_ on the same buffer, one GPU run.

    python3 bench/probes/store_patterns.py [--reps 10] [--size 20000] [--json out.json]
    python3 bench/probes/store_patterns.py --compile-only [--arch sm_90]   (no GPU: NVRTC only)

Why: at K <= 8 the low-K kernel takes 1.2-1.35x the write floor on the H100 and took
1.3-1.56x on the H200 (v3; bench/notes/lowk.md), where even K = 1 stays ~0.5 ms against a
0.36-0.38 ms floor. Issue #16 asks for <= 1.5x on the H200. Three questions:

1. Does the tile order itself cost? The `tile` kernels store exactly as distance_lowk.cuh does:
   256 threads; each thread stores 8 rows x two float4 (columns tn*4 and TN/2 + tn*4); a warp
   covers 2 rows x 256 B (kThreadsN 16, 128 x 128 tiles), 1 row x 512 B (32: 64 x 256) or 1
   row x 1 KB (64: 32 x 512); kTilesN tiles per block along n; two blocks per SM.
   Against `linear` (grid-stride float4 stores, fill_'s pattern).
2. Do the evict-first stores help or hurt? `cs` = st.global.cs (shipped), `wb` = plain st.global.
3. Does a bulk copy engine store do better? `bulk`: the tile goes to shared memory (STS.128),
   then one cp.async.bulk.global.shared::cta per tile row (sm_90 only; the TMA unit writes
   the rows while the warps compute the next tile).

`alu` = dependent FMAs per output before its store: 0 (pure store), 6 (about K = 3 p=1's
arithmetic) and 20 (about K = 8 Laplace with its epilogue). The question there is how much
arithmetic hides under the stores. The table lists ms, the ratio to fill_, and GB/s.
Every kernel's output is checked (a sampled comparison against the formula).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SOURCE = r"""
template <bool kCs>
__device__ __forceinline__ void store4(float* p, float x, float y, float z, float w) {
  if (kCs)
    asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
  else
    asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

// The value of output (m, n): (m & 511) + (n & 511), exact in float32, one FADD per output from
// a per-row and a per-column part; then kAlu FMAs that leave it unchanged (v * 1 + 0 with
// operands the compiler cannot see: `one`, `zero`).
template <int kAlu>
__device__ __forceinline__ float value(float row_part, float col_part, float one, float zero) {
  float v = row_part + col_part;
  #pragma unroll
  for (int k = 0; k < kAlu; ++k) v = fmaf(v, one, zero);
  return v;
}

// A thread's 8 x 8 outputs: rows r0 .. r0 + 7, columns c0 + {0..3} and TN / 2 + c0 + {0..3}.
template <int kAlu, int TN>
__device__ __forceinline__ void thread_values(float (&acc)[8][8], int r0, int c0, float one, float zero) {
  float colv[8];
  #pragma unroll
  for (int j = 0; j < 8; ++j) colv[j] = float((c0 + (j / 4) * (TN / 2) + (j % 4)) & 511);
  #pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float rowv = float((r0 + i) & 511);
    #pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = value<kAlu>(rowv, colv[j], one, zero);
  }
}

template <bool kCs>
__global__ void __launch_bounds__(256) linear_store(float* __restrict__ out, int M, int N, float one, float zero) {
  // Block after block along whole rows (each row 4 N contiguous bytes, a warp 512 B per store).
  for (int m = blockIdx.x; m < M; m += gridDim.x) {
    const float r = float(m & 511);
    for (int c = 4 * threadIdx.x; c < N; c += 4 * blockDim.x)  // N % 4 == 0
      store4<kCs>(out + (long)m * N + c, r + float(c & 511), r + float((c + 1) & 511), r + float((c + 2) & 511),
                  r + float((c + 3) & 511));
  }
}

// distance_lowk.cuh's thread-to-output map and store order.
template <int kThreadsN, int kTilesN, bool kCs, int kAlu>
__global__ void __launch_bounds__(256, 2) tile_store(float* __restrict__ out, int M, int N, float one, float zero) {
  constexpr int kThreadsM = 256 / kThreadsN, BM = kThreadsM * 8, TN = kThreadsN * 8;
  const int tid = threadIdx.x, tn = tid % kThreadsN, tm = tid / kThreadsN;
  const int m0 = blockIdx.y * BM;
  for (int t = 0; t < kTilesN; ++t) {
    const int n0 = (blockIdx.x * kTilesN + t) * TN;
    if (n0 >= N) break;
    float acc[8][8];
    thread_values<kAlu, TN>(acc, m0 + tm * 8, n0 + tn * 4, one, zero);
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int m = m0 + tm * 8 + i;
      if (m >= M) break;
      float* row = out + (long)m * N;
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = n0 + h * (TN / 2) + tn * 4;
        if (c + 3 < N) {
          store4<kCs>(row + c, acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
        } else {
          for (int e = 0; e < 4; ++e)
            if (c + e < N) row[c + e] = acc[i][4 * h + e];
        }
      }
    }
  }
}

// 128 x 128 tiles staged in shared memory, each row written by one bulk copy (sm_90).
template <int kTilesN, int kAlu>
__global__ void __launch_bounds__(256, 2) tile_bulk(float* __restrict__ out, int M, int N, float one, float zero) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kThreadsN = 16, BM = 128, TN = 128, S = TN + 4;  // padded rows, 16-byte aligned
  extern __shared__ float4 smem4[];
  float* sm = reinterpret_cast<float*>(smem4);
  const int tid = threadIdx.x, tn = tid % kThreadsN, tm = tid / kThreadsN;
  const int m0 = blockIdx.y * BM;
  const unsigned sbase = (unsigned)__cvta_generic_to_shared(sm);
  for (int t = 0; t < kTilesN; ++t) {
    const int n0 = (blockIdx.x * kTilesN + t) * TN;
    if (n0 >= N) break;
    float acc[8][8];
    thread_values<kAlu, TN>(acc, m0 + tm * 8, n0 + tn * 4, one, zero);
    // The previous tile's bulk copies must have read shared memory before it is overwritten.
    if (tid < BM) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < 8; ++i)
      #pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float4*>(sm + (tm * 8 + i) * S + h * (TN / 2) + tn * 4) =
            make_float4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy writes -> bulk copy
    __syncthreads();
    if (tid < BM && m0 + tid < M) {
      const int cols = N - n0 < TN ? N - n0 : TN;  // N % 4 == 0: whole 16-byte chunks
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(out + (long)(m0 + tid) * N + n0), "r"(sbase + 4u * tid * S), "r"(4 * cols) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
  if (tid < BM) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}
"""

BULK_SMEM = 128 * (128 + 4) * 4


def variants():
    """(label, name expression, grid function (M, N, sms), dynamic shared memory, needs sm_90)."""
    out = []
    for cs in (True, False):
        c = "true" if cs else "false"
        out.append((f"linear {'cs' if cs else 'wb'}", f"linear_store<{c}>", lambda M, N, sms: (sms * 8, 1), 0, False))
    for tn, tiles, cs, alu in [(16, 2, True, 0), (16, 2, False, 0), (32, 2, True, 0), (64, 2, True, 0), (16, 1, True, 0),
                               (16, 4, True, 0), (16, 2, True, 6), (16, 2, True, 20), (32, 2, True, 6),
                               (16, 2, False, 20)]:
        bm, tw = 256 // tn * 8, tn * 8
        out.append((f"tile {bm}x{tw} x{tiles} {'cs' if cs else 'wb'} alu{alu}",
                    f"tile_store<{tn}, {tiles}, {'true' if cs else 'false'}, {alu}>",
                    lambda M, N, sms, bm=bm, w=tw * tiles: (-(-N // w), -(-M // bm)), 0, False))
    for tiles, alu in [(2, 0), (4, 0), (2, 6), (2, 20)]:
        out.append((f"bulk 128x128 x{tiles} alu{alu}", f"tile_bulk<{tiles}, {alu}>",
                    lambda M, N, sms, w=128 * tiles: (-(-N // w), -(-M // 128)), BULK_SMEM, True))
    return out


def compile_all(arch: str):
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError:
        from cuda.core.experimental import Program, ProgramOptions  # type: ignore
    exprs = [v[1] for v in variants() if arch.startswith("sm_9") or not v[4]]
    obj = Program(SOURCE, "c++", ProgramOptions(arch=arch, std="c++17")).compile("cubin", name_expressions=exprs)
    return obj, exprs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--size", type=int, default=20000, help="M = N (a multiple of 4)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args()
    if args.compile_only:
        _, exprs = compile_all(args.arch)
        print(f"compiled {len(exprs)} kernels for {args.arch}")
        return
    import numpy as np
    import torch

    from bench._timing import time_calls
    from kermac_like.runtime.launcher import _make_current, _set_dynamic_smem, _stream_for

    try:
        from cuda.core import LaunchConfig, launch
    except ImportError:
        from cuda.core.experimental import LaunchConfig, launch  # type: ignore
    if not torch.cuda.is_available():
        sys.exit("store_patterns.py needs a CUDA device (or --compile-only)")
    dev_t = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(dev_t)
    arch = f"sm_{major}{minor}"
    _make_current(dev_t.index)
    stream = _stream_for(dev_t.index)  # torch's current stream (the timing events are recorded there)
    obj, exprs = compile_all(arch)
    sms = torch.cuda.get_device_properties(dev_t).multi_processor_count
    M = N = args.size
    assert N % 4 == 0
    out = torch.empty(M, N, device=dev_t)
    # cuda.core passes a Python int as intptr_t and a float as double: the int and float
    # parameters go as numpy scalars of their C types.
    Mi, Ni, one, zero = np.int32(M), np.int32(N), np.float32(1.0), np.float32(0.0)
    mm = torch.arange(M, device=dev_t).view(-1, 1)
    nn = torch.arange(N, device=dev_t).view(1, -1)
    rows = torch.randint(0, M, (64,), device=dev_t)
    want = ((mm[rows] & 511) + (nn & 511)).float()

    results = []
    fill = time_calls(lambda: out.fill_(1.0), lambda: (), dev_t, repeats=args.reps, warmup=2)
    results.append(dict(variant="out.fill_", ms=fill.median_ms))
    print(f"device {torch.cuda.get_device_name(dev_t)}; fill_ {fill.median_ms:.4f} ms", flush=True)
    for label, expr, grid_of, smem, _ in variants():
        if expr not in exprs:
            continue
        k = obj.get_kernel(expr)
        if smem > 48 * 1024:
            _set_dynamic_smem(k, dev_t.index, smem)
        cfg = LaunchConfig(grid=grid_of(M, N, sms), block=(256, 1, 1), shmem_size=smem)
        fn = lambda: launch(stream, cfg, k, out.data_ptr(), Mi, Ni, one, zero)  # noqa: E731
        out.fill_(float("nan"))
        t = time_calls(fn, lambda: (), dev_t, repeats=args.reps, warmup=2)
        ok = bool(torch.equal(out[rows], want)) and not torch.isnan(out).any().item()
        results.append(dict(variant=label, ms=t.median_ms, spread=[min(t.times_ms), max(t.times_ms)], ok=ok))
        print(json.dumps(results[-1]), flush=True)
    fill2 = time_calls(lambda: out.fill_(1.0), lambda: (), dev_t, repeats=args.reps, warmup=2)
    results.append(dict(variant="out.fill_ (end)", ms=fill2.median_ms))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    floor = statistics.mean([fill.median_ms, fill2.median_ms])
    gb = M * N * 4 / 1e9
    print(f"\n{'variant':34s} {'ms':>8s} {'x fill':>7s} {'GB/s':>7s}  check")
    for r in results:
        print(f"{r['variant']:34s} {r['ms']:8.4f} {r['ms'] / floor:7.3f} {gb / (r['ms'] / 1e3):7.0f}  "
              f"{'' if 'ok' not in r else ('ok' if r['ok'] else 'WRONG')}")


if __name__ == "__main__":
    main()
