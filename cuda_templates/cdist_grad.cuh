// cdist_grad: the contraction behind the gradient of a p-norm kernel.
//
//   out[l][o,n,m] = sum_k c[l][o,k] * a[l][k,m] * sgn(d[l][n,m] - b[l][n,k])
//                                              * |d[l][n,m] - b[l][n,k]|^(p-1)
//
// a (K,M), b (N,K), c (O,K), d (N,M), out (O,N,M); fp32 in, fp32 accumulation.
// In a Recursive Feature Machine a is the kernel matrix, b the data, c the
// coefficients and d the points where the gradient is taken.
//
// Seen as a GEMM, out[o,(n,m)] = sum_k c[o,k] * W[k,(n,m)] where the K x (N*M)
// operand W[k,(n,m)] = a[k,m] * sgn(diff) * |diff|^(p-1) is generated on the
// fly.  Generating W is the expensive part for fractional p (two MUFU per
// element), so every W element is generated exactly once per o-chunk and then
// used for all the o of the chunk.  Two stages per k step:
//   1. WeightGen      W for the thread's (n,m) pairs, in registers;
//   2. SimtContraction acc[o][pair] += c[o,k] * W[pair], a register-blocked
//                      outer product (a tensor-core stage can replace it:
//                      it only consumes W values and a row c[:,k]).
//
// Factor conventions (sgn(0) = 0 dominates every power):
//   Power::Abs    (p == 1): sgn(diff).  Compared exactly (no subtraction), so
//                 it is exact for every finite input; NaN contributes 0.
//   Power::Square (p == 2): diff.
//   Power::Pow    (any p):  sgn(diff) * 2^((p-1) * log2|diff|) with the
//                 approximate MUFU log2/exp2 (relative error ~2^-22 per
//                 factor).  diff == 0 gives 0 for every p, also p <= 1 where
//                 |0|^(p-1) would be 1 or inf.  Flush-to-zero: |diff| below
//                 2^-126 (denormal) counts as 0 and factors below 2^-126
//                 flush to 0.  p must be finite (the launcher checks).
//
// Only NVRTC built-ins are used (no <cuda_runtime.h>).
#pragma once

#include "common.cuh"

namespace kermac_like {

// ---------------------------------------------------------------------------
// Traits: every launch constant derives from the two template parameters.
// ---------------------------------------------------------------------------
// kSignFma_ (Power::Abs only; default 0): 1 generates sgn(d - b) * a on the
// FMA pipe (FADD, FFMA.SAT, FFMA, no predicates) instead of with compares and
// selects on the ALU pipe; see WeightGen<Power::Abs>.  kMinBlocksPerSM_: the
// occupancy the registers are budgeted for (2: up to 255 registers).
template <Power kPower_, int kVec_, int kSignFma_ = 0, int kMinBlocksPerSM_ = 2>
struct CdistGradTraits {
  static_assert(kPower_ == Power::Abs || kPower_ == Power::Square || kPower_ == Power::Pow,
                "CdistGradTraits: the power must be Power::Abs (p == 1), Power::Square "
                "(p == 2) or Power::Pow (any other p); Noop and Sqrt have no gradient path");
  static_assert(kVec_ == 1 || kVec_ == 4,
                "CdistGradTraits: kVec must be 1 (any alignment) or 4 (16-byte vectors)");

  static_assert(kSignFma_ == 0 || kSignFma_ == 1, "CdistGradTraits: kSignFma must be 0 or 1");
  static_assert(kMinBlocksPerSM_ >= 1 && kMinBlocksPerSM_ <= 4, "CdistGradTraits: kMinBlocksPerSM in 1..4");

  static constexpr Power kPower = kPower_;
  static constexpr int kVec = kVec_;
  static constexpr bool kSignFma = kSignFma_ == 1;

  // Thread tile: kPairN x kPairM (n, m) pairs (m consecutive) times an
  // o-chunk of at most kOChunk outputs, all in registers.
  static constexpr int kPairN = 2;
  static constexpr int kPairM = 4;
  static constexpr int kThreadsN = 8;
  static constexpr int kThreadsM = 16;
  static constexpr int kThreads = kThreadsN * kThreadsM;  // 128
  static constexpr int kBlockN = kThreadsN * kPairN;      // 16
  static constexpr int kBlockM = kThreadsM * kPairM;      // 64
  static constexpr int kBlockK = 32;                      // k per pipeline stage
  static constexpr int kUnrollK = 2;                      // k steps per unrolled body
  static constexpr int kStages = 3;                       // cp.async ring depth
  // Register o-chunks (W is regenerated per chunk): kOChunk x 8 accumulators
  // per thread is the register budget; a last chunk of at most kONarrow
  // outputs runs a narrow instance (see run_tile).
  static constexpr int kOChunk = 16;
  static constexpr int kONarrow = 4;
  static constexpr int kMinBlocksPerSM = kMinBlocksPerSM_;
  static constexpr int kSmemBytes = 0;  // static shared memory only

  // Shared-memory pitches (floats).  b and c are stored transposed, k-major,
  // so one broadcast vector load per k reads a whole row; the +4 makes the
  // transposing 4-byte writes conflict-free (8 k x 4 rows per warp hit 32
  // distinct banks) and keeps rows 16-byte aligned.
  static constexpr int kPitchA = kBlockM;       // a_s[k][m]
  static constexpr int kPitchB = kBlockN + 4;   // b_s[k][n]
  static constexpr int kPitchC = kOChunk + 4;   // c_s[k][o]

  static_assert(kPairM == 4, "the m quad of a thread is one float4 of a, d and out");
  static_assert(kPairN == 2, "the n pair of a thread is one float2 of b_s");
  static_assert(kBlockK % 8 == 0, "the transposing copies walk k in groups of 8");
  static_assert(kBlockK % kUnrollK == 0, "the unrolled body must tile the chunk");
  static_assert((kBlockK * kBlockM / kVec) % kThreads == 0,
                "a tile must split evenly over threads");
  static_assert((kBlockK * kBlockN) % kThreads == 0, "b tile must split evenly over threads");
  static_assert(kStages >= 2, "the cp.async ring needs at least two stages");
  static_assert(kONarrow % 4 == 0 && kOChunk % kONarrow == 0, "o-chunks are float4 rows of c_s");
  static_assert(kPitchA % 4 == 0 && kPitchB % 4 == 0 && kPitchC % 4 == 0,
                "shared rows must stay 16-byte aligned");
};

namespace grad_detail {

// ---------------------------------------------------------------------------
// Math and copy helpers (candidates for math.cuh: lg2_ftz, ex2_ftz, xor_sign).
// ---------------------------------------------------------------------------

// One MUFU.LG2; denormal input counts as 0 (-> -inf).
__device__ __forceinline__ float lg2_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One MUFU.EX2; denormal results flush to 0.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// x with its sign flipped where s is negative (sign bit set): one LOP3.
__device__ __forceinline__ float xor_sign(float x, float s) {
  return __int_as_float(__float_as_int(x) ^ (__float_as_int(s) & 0x80000000));
}

// threadIdx.x, read so that the compiler cannot reuse an earlier read: the
// epilogue recomputes its coordinates instead of keeping them (and values
// derived from them) live through the k loop, where every register counts.
__device__ __forceinline__ int tid_fresh() {
  int tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Asynchronous global -> shared copies (common.cuh) to a shared-memory
// pointer; valid == false zero-fills the destination and reads nothing (src
// must still be a mapped address).
__device__ __forceinline__ void cp_async_4(float* dst, const float* src, bool valid) {
  async_copy::cp_async_4(smem_u32(dst), src, valid ? 4 : 0);
}

__device__ __forceinline__ void cp_async_16(float* dst, const float* src, bool valid) {
  async_copy::cp_async_16(smem_u32(dst), src, valid ? 16 : 0);
}

using async_copy::cp_async_commit;
using async_copy::cp_async_wait;

// ---------------------------------------------------------------------------
// Shared storage: one ring of kStages k-chunks.
// ---------------------------------------------------------------------------
template <class Traits>
struct CdistGradSmem {
  static constexpr int S = Traits::kStages, BK = Traits::kBlockK;
  alignas(16) float a[S][BK][Traits::kPitchA];  // (S,BK,BM) a[k0+k, m0+m]
  alignas(16) float b[S][BK][Traits::kPitchB];  // (S,BK,BN) b[n0+n, k0+k]
  alignas(16) float c[S][BK][Traits::kPitchC];  // (S,BK,OC) c[o0+o, k0+k]
};

// One batch entry's operands, already offset by the batch strides.
struct GradTile {
  const float* a;  // (K,M) lda
  const float* b;  // (N,K) ldb
  const float* c;  // (O,K) ldc
  const float* d;  // (N,M) ldd
  float* out;      // (O,N,M) ldo_o, ldo_n
  // Source of zero-filling copies: any mapped address.  The kernel's own a
  // argument, batch-invariant, so it stays in a uniform register.
  const float* safe;
  i64 lda, ldb, ldc, ldd, ldo_o, ldo_n;
  int M, N, K, O;
  int m0, n0;      // block tile origin
};

// The batch loop of both cdist_grad kernels (SIMT and tensor-core), from their flat
// arguments: one GradTile per batch entry and the exponent q = p - 1 of its factor.
// n-tiles are walked fastest: the blocks resident together share one m-tile, so each
// a[k-chunk, m-tile] (a is the large operand) is fetched from DRAM about once and
// served to every n-tile from L2.  The remap is a bijection of the grid.
template <int kBlockM, int kBlockN, class RunTile>
__device__ __forceinline__ void for_each_batch_tile(
    const float* a, const float* b, const float* c, const float* d, float* out, int M, int N, int K,
    int O, i64 lda, i64 ldb, i64 ldc, i64 ldd, i64 ldo_o, i64 ldo_n, int batch, i64 a_bs, i64 b_bs,
    i64 c_bs, i64 d_bs, i64 o_bs, const float* p_ptr, i64 p_bs, float p, RunTile&& run) {
  const long long bid = static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int n_tile = static_cast<int>(bid % gridDim.y);
  const int m_tile = static_cast<int>(bid / gridDim.y);

  for (int l = blockIdx.z; l < batch; l += gridDim.z) {
    GradTile t;
    t.a = a + l * a_bs;
    t.b = b + l * b_bs;
    t.c = c + l * c_bs;
    t.d = d + l * d_bs;
    t.out = out + l * o_bs;
    t.safe = a;
    t.lda = lda;
    t.ldb = ldb;
    t.ldc = ldc;
    t.ldd = ldd;
    t.ldo_o = ldo_o;
    t.ldo_n = ldo_n;
    t.M = M;
    t.N = N;
    t.K = K;
    t.O = O;
    t.m0 = m_tile * kBlockM;
    t.n0 = n_tile * kBlockN;
    run(t, (p_ptr != nullptr ? p_ptr[l * p_bs] : p) - 1.0f);
  }
}

// ---------------------------------------------------------------------------
// Stage 0: the cp.async producer.  Each thread owns fixed (row, column)
// slots of the a, b and c chunk tiles; only the k origin moves, so the state
// is three pointers that advance by one chunk per call.  Out-of-range
// elements are zero-filled: padded k contribute exactly 0 (a = 0 and c = 0)
// and padded n, m, o are never stored.
// ---------------------------------------------------------------------------
template <class Traits, int OC>
struct ChunkLoader {
  static constexpr int BK = Traits::kBlockK, BM = Traits::kBlockM, BN = Traits::kBlockN;
  static constexpr int T = Traits::kThreads;
  // a (BK, BM): copies of kVec floats, m fastest over threads.
  static constexpr int kAPerRow = BM / Traits::kVec;
  static constexpr int kACopies = BK * kAPerRow / T;
  static constexpr int kARowStep = T / kAPerRow;  // k rows between a thread's copies
  // b (BK, BN) and c (BK, OC), transposed: a warp walks 8 k of 4 rows, so
  // global reads are 32-byte runs and shared writes hit 32 banks.
  static constexpr int kBCopies = BK * BN / T;
  static constexpr int kBRowStep = T / BN;  // k between a thread's b copies
  static constexpr int kCElems = BK * OC;
  static constexpr int kCCopies = (kCElems + T - 1) / T;
  static constexpr int kCRowStep = T / OC;  // (used only when kCCopies > 1)
  static_assert(T % kAPerRow == 0, "a row split");
  static_assert(T % (8 * BN) == 0 && (kCElems >= T ? kCElems % T == 0 : T % kCElems == 0),
                "b/c walk: whole groups of 8 k per pass");

  const float* a;  // a[k0 + ka, m0 + ma]
  const float* b;  // b[n0 + nb, k0 + kb]
  const float* c;  // c[o0 + oc, k0 + kc]
  int ka, ma, nb, kb, oc, kc;
  bool a_ok, b_ok, c_ok;  // column / row in range (m < M, n < N, o < O)
  bool c_active;          // this thread copies c at all (OC * BK < kThreads)

  __device__ __forceinline__ void init(const GradTile& t, int o0, int tid) {
    ka = tid / kAPerRow;
    ma = (tid % kAPerRow) * Traits::kVec;
    nb = (tid / 8) % BN;
    kb = (tid / (8 * BN)) * 8 + tid % 8;
    oc = (tid / 8) % OC;
    kc = (tid / (8 * OC)) * 8 + tid % 8;
    // kVec == 4: M % 4 == 0, so a quad of m is all in or all out.
    a_ok = t.m0 + ma < t.M;
    b_ok = t.n0 + nb < t.N;
    c_active = kCElems >= T || tid < kCElems;
    c_ok = c_active && o0 + oc < t.O;
    a = a_ok ? t.a + ka * t.lda + t.m0 + ma : t.safe;
    b = b_ok ? t.b + (t.n0 + nb) * t.ldb + kb : t.safe;
    c = c_ok ? t.c + (o0 + oc) * t.ldc + kc : t.safe;
  }

  // Copies chunk [k0, k0 + BK) into ring slot `slot`, then advances.
  __device__ __forceinline__ void load(CdistGradSmem<Traits>& s, int slot, int k0,
                                       const GradTile& t) {
#pragma unroll
    for (int i = 0; i < kACopies; ++i) {
      const int k = ka + i * kARowStep;
      const bool ok = a_ok && k0 + k < t.K;
      const float* src = ok ? a + i * kARowStep * t.lda : t.safe;
      if constexpr (Traits::kVec == 4) {
        cp_async_16(&s.a[slot][k][ma], src, ok);
      } else {
        cp_async_4(&s.a[slot][k][ma], src, ok);
      }
    }
#pragma unroll
    for (int i = 0; i < kBCopies; ++i) {
      const int k = kb + i * kBRowStep;
      const bool ok = b_ok && k0 + k < t.K;
      cp_async_4(&s.b[slot][k][nb], ok ? b + i * kBRowStep : t.safe, ok);
    }
#pragma unroll
    for (int i = 0; i < kCCopies; ++i) {
      const int k = kc + i * kCRowStep;
      const bool ok = c_ok && k0 + k < t.K;
      if (c_active) cp_async_4(&s.c[slot][k][oc], ok ? c + i * kCRowStep : t.safe, ok);
    }
    a += BK * t.lda;
    b += BK;
    c += BK;
  }
};

// ---------------------------------------------------------------------------
// Stage 1: the weight W = a * sgn(d - b) * |d - b|^(p-1) for one element.
// kZeroSafe (Pow only) zeroes diff == 0 explicitly; it is needed when
// p - 1 <= 0, where 2^((p-1) * log2 0) is 1 (p == 1), inf (p < 1) or NaN.
// ---------------------------------------------------------------------------
template <Power kPower, bool kZeroSafe, bool kSignFma = false>
struct WeightGen;

template <bool kZeroSafe, bool kSignFma>
struct WeightGen<Power::Abs, kZeroSafe, kSignFma> {
  float q;  // unused
  __device__ __forceinline__ float operator()(float a, float b, float d) const {
    if constexpr (kSignFma) {
      // u = sat(0.5 + (d - b) 2^127) is exactly 0, 1/2 or 1 (d < b, d == b,
      // d > b) whenever |d - b| >= 2^-128, and 2a u - a is then exactly -a, 0
      // or a: FADD, FFMA.SAT, FFMA (a + a is shared by the n of a thread).
      // Differences below 2^-128 give a fraction of +-a; NaN gives -a.
      const float u = __saturatef(fmaf(d - b, 1.7014118346046923e38f, 0.5f));
      return fmaf(a + a, u, -a);
    } else {
      // Two compares and two selects; exact, sgn(0) = 0.
      return d > b ? a : (d < b ? -a : 0.0f);
    }
  }
};

template <bool kZeroSafe, bool kSignFma>
struct WeightGen<Power::Square, kZeroSafe, kSignFma> {
  float q;  // unused
  __device__ __forceinline__ float operator()(float a, float b, float d) const {
    return a * (d - b);
  }
};

template <bool kZeroSafe, bool kSignFma>
struct WeightGen<Power::Pow, kZeroSafe, kSignFma> {
  float q;  // p - 1
  __device__ __forceinline__ float operator()(float a, float b, float d) const {
    const float diff = d - b;
    // p > 1: log2 0 = -inf -> 2^-inf = 0 gives sgn(0) = 0 for free.
    const float mag = ex2_ftz(q * lg2_ftz(fabsf(diff)));
    const float w = mag * xor_sign(a, diff);
    if constexpr (kZeroSafe) {
      return diff != 0.0f ? w : 0.0f;
    } else {
      return w;
    }
  }
};

// ---------------------------------------------------------------------------
// Stage 2: SIMT contraction, acc[o][i][j] += c[o0+o, k] * W[i][j].
// acc (OC, kPairN, kPairM) per thread.  Swap this struct for a tensor-core
// stage: it sees only the W registers and the k-th row of c_s.
// ---------------------------------------------------------------------------
template <class Traits, int OC>
struct SimtContraction {
  static_assert(OC % 4 == 0 && OC <= Traits::kOChunk, "o-chunk: a multiple of 4 up to kOChunk");
  float acc[OC][Traits::kPairN][Traits::kPairM];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int o = 0; o < OC; ++o)
#pragma unroll
      for (int i = 0; i < Traits::kPairN; ++i)
#pragma unroll
        for (int j = 0; j < Traits::kPairM; ++j) acc[o][i][j] = 0.0f;
  }

  // c_row: c_s[k][0..OC), 16-byte aligned, same address for every thread.
  __device__ __forceinline__ void step(const float* c_row,
                                       const float (&w)[Traits::kPairN][Traits::kPairM]) {
#pragma unroll
    for (int og = 0; og < OC / 4; ++og) {
      const float4 cv = *reinterpret_cast<const float4*>(c_row + og * 4);
      const float cs[4] = {cv.x, cv.y, cv.z, cv.w};
#pragma unroll
      for (int o = 0; o < 4; ++o)
#pragma unroll
        for (int i = 0; i < Traits::kPairN; ++i)
#pragma unroll
          for (int j = 0; j < Traits::kPairM; ++j)
            acc[og * 4 + o][i][j] = fmaf(cs[o], w[i][j], acc[og * 4 + o][i][j]);
    }
  }

  // out[o0+o, n, m] for the thread's pairs (n = n0 + ty*2 + i, m = m0 + tx*4 + j).
  __device__ __forceinline__ void store(const GradTile& t, int o0, int tx, int ty) const {
#pragma unroll
    for (int o = 0; o < OC; ++o) {
      if (o0 + o >= t.O) break;
#pragma unroll
      for (int i = 0; i < Traits::kPairN; ++i) {
        const int n = t.n0 + ty * Traits::kPairN + i;
        const int m = t.m0 + tx * Traits::kPairM;
        if (n >= t.N || m >= t.M) continue;
        float* row = t.out + (o0 + o) * t.ldo_o + n * t.ldo_n;
        if constexpr (Traits::kVec == 4) {
          *reinterpret_cast<float4*>(row + m) =
              make_float4(acc[o][i][0], acc[o][i][1], acc[o][i][2], acc[o][i][3]);
        } else {
#pragma unroll
          for (int j = 0; j < Traits::kPairM; ++j)
            if (m + j < t.M) row[m + j] = acc[o][i][j];
        }
      }
    }
  }
};

// d for the thread's pairs; out-of-range pairs read 0 (never stored).
template <class Traits>
__device__ __forceinline__ void load_d(const GradTile& t, int tx, int ty,
                                       float (&dv)[Traits::kPairN][Traits::kPairM]) {
#pragma unroll
  for (int i = 0; i < Traits::kPairN; ++i) {
    const int n = t.n0 + ty * Traits::kPairN + i;
    const int m = t.m0 + tx * Traits::kPairM;
    const float* row = t.d + n * t.ldd;
    if constexpr (Traits::kVec == 4) {
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (n < t.N && m < t.M) v = *reinterpret_cast<const float4*>(row + m);
      dv[i][0] = v.x;
      dv[i][1] = v.y;
      dv[i][2] = v.z;
      dv[i][3] = v.w;
    } else {
#pragma unroll
      for (int j = 0; j < Traits::kPairM; ++j)
        dv[i][j] = (n < t.N && m + j < t.M) ? row[m + j] : 0.0f;
    }
  }
}

// ---------------------------------------------------------------------------
// One (n,m) tile, one o-chunk [o0, o0+OC): the whole k loop through the ring.
// ---------------------------------------------------------------------------
template <class Traits, int OC, class Gen>
__device__ __forceinline__ void run_o_chunk(CdistGradSmem<Traits>& s, const GradTile& t, int o0,
                                            const float (&dv)[Traits::kPairN][Traits::kPairM],
                                            const Gen& gen) {
  constexpr int BK = Traits::kBlockK, S = Traits::kStages;
  const int tid = threadIdx.x;
  const int tx = tid % Traits::kThreadsM;  // m quad
  const int ty = tid / Traits::kThreadsM;  // n pair
  const int num_k = ceil_div(t.K, BK);

  SimtContraction<Traits, OC> mma;
  mma.clear();
  ChunkLoader<Traits, OC> loader;
  loader.init(t, o0, tid);

  // The previous o-chunk / tile may still be reading the ring.
  __syncthreads();
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < num_k) loader.load(s, st, st * BK, t);
    cp_async_commit();
  }

  int slot = 0;  // ring slot of chunk kc
  int fill = S - 1;  // ring slot of chunk kc + S - 1
  for (int kc = 0; kc < num_k; ++kc) {
    cp_async_wait<S - 2>();  // chunk kc has landed (this thread's copies) ...
    __syncthreads();         // ... and everyone's; chunk kc - 1 is consumed
    if (kc + S - 1 < num_k) loader.load(s, fill, (kc + S - 1) * BK, t);
    cp_async_commit();  // possibly empty: keeps the group count uniform

    constexpr int U = Traits::kUnrollK;
    const float* sa = &s.a[slot][0][tx * Traits::kPairM];  // (BK, 4)   a[k, m quad]
    const float* sb = &s.b[slot][0][ty * Traits::kPairN];  // (BK, 2)   b[n pair, k]
    const float* sc = &s.c[slot][0][0];                    // (BK, OC)  c[o, k]
    const float* const sc_end = sc + BK * Traits::kPitchC;
    // Partial unroll: a longer body buys ~1% of loop overhead (about 7
    // instructions per kUnrollK k steps) and costs code size, compile time
    // and the last registers (kUnrollK = 4 spills); see kUnrollK.
#pragma unroll 1
    for (; sc != sc_end; sa += U * Traits::kPitchA, sb += U * Traits::kPitchB,
                         sc += U * Traits::kPitchC) {
#pragma unroll
      for (int kk = 0; kk < U; ++kk) {
        const float4 av = *reinterpret_cast<const float4*>(sa + kk * Traits::kPitchA);
        const float2 bv = *reinterpret_cast<const float2*>(sb + kk * Traits::kPitchB);
        const float as[4] = {av.x, av.y, av.z, av.w};
        const float bs[2] = {bv.x, bv.y};
        float w[Traits::kPairN][Traits::kPairM];  // W[k, (n pair) x (m quad)]
#pragma unroll
        for (int i = 0; i < Traits::kPairN; ++i)
#pragma unroll
          for (int j = 0; j < Traits::kPairM; ++j) w[i][j] = gen(as[j], bs[i], dv[i][j]);
        mma.step(sc + kk * Traits::kPitchC, w);
      }
    }
    slot = slot + 1 == S ? 0 : slot + 1;
    fill = fill + 1 == S ? 0 : fill + 1;
  }
  cp_async_wait<0>();  // only empty groups remain; leave none behind

  const int tid_out = tid_fresh();
  mma.store(t, o0, tid_out % Traits::kThreadsM, tid_out / Traits::kThreadsM);
}

// One (n,m) tile of one batch entry: d once, then the o-chunks.  A chunk is
// kOChunk wide, or kONarrow when at most kONarrow outputs remain (O = 1..4
// costs 4 FMA per element, not 16; O = 17..20 is 16 + 4).  Each chunk
// regenerates W, so wider is better as long as the FMAs are not wasted.
template <class Traits>
__device__ __forceinline__ void run_tile(CdistGradSmem<Traits>& s, const GradTile& t, float q) {
  constexpr int kWide = Traits::kOChunk, kNarrow = Traits::kONarrow;
  const int tid = threadIdx.x;
  float dv[Traits::kPairN][Traits::kPairM];  // d[n pair, m quad]
  load_d<Traits>(t, tid % Traits::kThreadsM, tid / Traits::kThreadsM, dv);
  // q is uniform per batch entry.  Pow with p > 1 skips the zero fix (2 of
  // ~25 instructions per element); p <= 1 (and NaN p) takes the fixed
  // generator, compiled for the wide chunk only to bound code size and
  // compile time (narrow O then wastes FMAs, never correctness).
  const bool fast = Traits::kPower != Power::Pow || q > 0.0f;
  using FastGen = WeightGen<Traits::kPower, false, Traits::kSignFma>;
  for (int o0 = 0; o0 < t.O;) {
    if (fast && t.O - o0 <= kNarrow) {
      run_o_chunk<Traits, kNarrow>(s, t, o0, dv, FastGen{q});
      o0 += kNarrow;
    } else {
      if (fast) {
        run_o_chunk<Traits, kWide>(s, t, o0, dv, FastGen{q});
      } else if constexpr (Traits::kPower == Power::Pow) {
        run_o_chunk<Traits, kWide>(s, t, o0, dv, WeightGen<Power::Pow, true>{q});
      }
      o0 += kWide;
    }
  }
}

}  // namespace grad_detail

// ---------------------------------------------------------------------------
// Kernel.  Launch: block (kThreads), grid (ceil(M/kBlockM), ceil(N/kBlockN),
// min(batch, 65535)), dynamic smem kSmemBytes.  Strides in elements; the last
// mode of every tensor is unit-stride; batch strides 0 broadcast.
// ---------------------------------------------------------------------------
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSM)
cdist_grad_kernel(const float* __restrict__ a, const float* __restrict__ b,
                  const float* __restrict__ c, const float* __restrict__ d,
                  float* __restrict__ out,
                  int M, int N, int K, int O,
                  long long lda,                       // a[k,m] at a + k*lda + m
                  long long ldb,                       // b[n,k] at b + n*ldb + k
                  long long ldc,                       // c[o,k] at c + o*ldc + k
                  long long ldd,                       // d[n,m] at d + n*ldd + m
                  long long ldo_o, long long ldo_n,    // out[o,n,m] at out + o*ldo_o + n*ldo_n + m
                  int batch, long long a_bs, long long b_bs, long long c_bs, long long d_bs,
                  long long o_bs,
                  const float* p_ptr, long long p_bs, float p) {  // p_ptr == nullptr -> scalar p
  using namespace grad_detail;
  __shared__ CdistGradSmem<Traits> smem;

  for_each_batch_tile<Traits::kBlockM, Traits::kBlockN>(
      a, b, c, d, out, M, N, K, O, lda, ldb, ldc, ldd, ldo_o, ldo_n, batch, a_bs, b_bs, c_bs, d_bs,
      o_bs, p_ptr, p_bs, p, [&](const GradTile& t, float q) { run_tile<Traits>(smem, t, q); });
}

}  // namespace kermac_like
