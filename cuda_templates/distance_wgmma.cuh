// Hopper (sm_90a) tensor-core distance kernel, persistent and warp-specialised:
// the distance_mma_kernel contract (p=2 distances, Laplace-l2 / Gaussian
// kernels, DOT) on wgmma with A in registers.
//
//   ||x - y||^2 = ||x||^2 + ||y||^2 - 2 x.y
//
// The flat ABI of distance_mma_kernel (cuda_templates/ABI.md) plus five trailing
// arguments written by wgmma_prepare_b_kernel (below), which the caller launches
// first on the same stream; same limits: float32 data, Precision::Tf32x3
// (fp32-grade, three TF32 products) or Precision::Tf32; a and b RowMajor with
// 16-byte aligned bases, rows and batch offsets; K free (tail zero-filled); out
// RowMajor or ColMajor, element alignment only; exact zero self-distance diagonal
// when a == b and lda == ldb. Compile for "sm_90a" (wgmma and setmaxnreg exist on
// no other target). Launch: kThreads threads, a 1-D grid of at most (number of
// SMs) blocks; each block walks the output tiles blockIdx.x, blockIdx.x +
// gridDim.x, ... of all batch entries.
//
// Roles (bench/NOTES_wgmma.md has the design notes, bench/NOTES.md the measurements):
//   * before the kernel, wgmma_prepare_b_kernel: B small = b - trunc(b) (3xTF32; the
//     tensor cores read fp32 as TF32 by truncation, so b itself is the big half) and
//     the squared row norms of b, once per row of b rather than once per output tile.
//   * warpgroup 0, the loader (128 threads): cp.async copies of the 128 x 16 (a),
//     256 x 16 (b) and 256 x 16 (B small) k-tiles into a ring of kStages stages;
//     cp.async.mbarrier.arrive signals "landed" without the loader ever waiting
//     for its copies.
//   * warpgroups 1 and 2, the consumers (rows 0-63 and 64-127 of the tile): per
//     k-tile, wait for the stage, ldmatrix of the raw a fragment and the a side of
//     the 3xTF32 split in registers (big = rna(a), small = rna(a - big)), squared
//     row norms of a from the same registers; small_a*b, big_a*small_b, big_a*b
//     per k8 step as wgmma.m64n256k8 with A from registers and B from shared
//     memory. One k-tile of wgmma stays in flight; mbarrier "empty" gives a stage
//     back to the loader when its wgmma has completed. Then the fused epilogue
//     from the accumulators (b norms from the prepared array), while the loader
//     fills the next tile's stages.
#pragma once

#include "distance_mma.cuh"
#include "wgmma_prepare.cuh"

namespace kermac_like {

namespace wgmma_detail {

using kermac_like::SameType;
using mma_detail::tf32_rna;

#ifndef KERMAC_LIKE_MMA_HOST_EMULATION

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format" of
// wgmma): start address >> 4 in bits 0-13, leading-dimension byte offset >> 4
// in bits 16-29 (unused for swizzled K-major tiles; 1 by convention), stride
// byte offset >> 4 in bits 32-45 (8 rows x 64 bytes = 512 between 8-row
// groups), base offset 0 (tiles 512-byte aligned; the k-step offset of 32
// bytes inside the swizzle row is added to the start address), swizzle mode
// in bits 62-63 (2 = 64-byte swizzle).
__device__ __forceinline__ unsigned long long make_desc(unsigned smem_addr) {
  return (unsigned long long)((smem_addr & 0x3ffffu) >> 4) | (1ull << 16) | ((512ull >> 4) << 32) |
         (2ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to
// the async proxy (wgmma operand reads) after this fence and a barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}


// D (64 x 256, f32) += A (64 x 8, tf32, registers) * B (256 x 8, tf32, K-major,
// descriptor)^T. A fragment (PTX ISA "Register Fragments" of wgmma .m64nNk8,
// .tf32 A): warp w of the warpgroup, g = lane / 4, t = lane % 4:
//   a0 (row 16w+g, k t)  a1 (row 16w+g+8, k t)  a2 (row 16w+g, k t+4)  a3 (row 16w+g+8, k t+4).
__device__ __forceinline__ void wgmma_m64n256k8_tf32_rs(float (&d)[128], const unsigned (&a)[4],
                                                      unsigned long long desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, {%128, %129, %130, %131}, %132, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

// D (64 x 128, f32) = A (64 x 8, tf32, registers) * B (128 x 8, tf32, K-major, descriptor)^T
// + (scale_d ? D : 0): the chunked consumers' form (distance_wgmma_kernel with kChunked), whose
// first wgmma of each k-tile starts a fresh partial sum. Fragments as wgmma_m64n256k8_tf32_rs's.
__device__ __forceinline__ void wgmma_m64n128k8_tf32_rs(float (&d)[64], const unsigned (&a)[4],
                                                      unsigned long long desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// The same with N = 192 (96 accumulators): the 128 x 192 chunked tiles (kChunkN 192).
__device__ __forceinline__ void wgmma_m64n192k8_tf32_rs(float (&d)[96], const unsigned (&a)[4],
                                                      unsigned long long desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n192k8.f32.tf32.tf32 "
      "{"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
      "}, {%96, %97, %98, %99}, %100, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}
// The chunked consumers' wgmma by the width of their partial sum.
__device__ __forceinline__ void wgmma_part_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long desc_b,
                                              int scale_d) {
  wgmma_m64n128k8_tf32_rs(d, a, desc_b, scale_d);
}
__device__ __forceinline__ void wgmma_part_rs(float (&d)[96], const unsigned (&a)[4], unsigned long long desc_b,
                                              int scale_d) {
  wgmma_m64n192k8_tf32_rs(d, a, desc_b, scale_d);
}

// Four 8 x 16-byte matrices from shared memory: lanes 8 i .. 8 i + 7 give the
// row addresses of matrix i, and lane l receives 32-bit word l % 4 of row l / 4
// of matrix i in register i (ldmatrix .b16 moves 32-bit words intact).
__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// mbarrier (shared::cta), phase-parity waits.
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
// Returns once the phase with this parity has completed (a fresh barrier is in
// phase 0, so waiting for parity 1 returns at once).
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
}

// Arrive and add `bytes` to the transaction count the current phase waits for
// (bytes written by bulk copies that signal this barrier, from any CTA of the cluster).
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned addr, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes)
               : "memory");
}
// Arrive on the mbarrier at the same shared-memory offset in CTA `rank` of the cluster.
// Release at CTA scope (no GPU-wide memory barrier): the arrival only says "my reads
// of this stage are done" (wgmma.wait_group returned), nothing is published through it.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned addr, unsigned rank) {
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(addr),
      "r"(rank)
      : "memory");
}
// `bytes` (a multiple of 16) from global memory to the same shared-memory offset in
// every CTA of `cta_mask`; each destination's mbarrier at offset `mbar` receives
// complete_tx of the bytes. 16-byte aligned source and destination.
__device__ __forceinline__ void bulk_copy_multicast(unsigned dst, const void* src, unsigned bytes, unsigned mbar,
                                                    unsigned short cta_mask) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(mbar), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_id_x() {
  unsigned r;
  asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_count_x() {
  unsigned r;
  asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(r));
  return r;
}
// Every thread of every CTA of the cluster (release / acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void fence_mbarrier_init_cluster() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Arrive on the mbarrier once every cp.async issued so far by this thread has
// landed (the arrival is counted in the barrier's expected count: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Barrier of the kThreads threads of one role (id 1..15; 0 is __syncthreads).
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

// Register budget per warpgroup role (sum over the block <= 64K registers).
template <int kRegs>
__device__ __forceinline__ void regs_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// The ldmatrix addresses of a consumer lane (warp cwarp of the two consumer warpgroups) in
// a stage, for its two k8 steps: matrix i = lane / 8 is (rows +8 if i odd, chunk +1 if i >= 2)
// of the warp's 16 rows 64 (cwarp / 4) + 16 (cwarp % 4) ...
__device__ __forceinline__ void a_fragment_offsets(int lane, int cwarp, unsigned (&ld_off)[2]) {
  const int i = lane >> 3;
  const int row = (cwarp >> 2) * 64 + (cwarp & 3) * 16 + (lane & 7) + 8 * (i & 1);
#pragma unroll
  for (int s = 0; s < 2; ++s) ld_off[s] = swizzled(row, 2 * s + (i >> 1));
}

// The a side of one k-tile of a consumer warpgroup, after its stage has landed: ldmatrix of the
// raw a fragment from the stage at `st`, the squared row norms of a (kDiff) and its 3xTF32 split
// (big = rna(a), small = rna(a - big)) or TF32 rounding in `frag` ([k8 step][big, small][4]).
template <bool kSplit, bool kDiff>
__device__ __forceinline__ void load_a_k_tile(unsigned (&frag)[2][2][4], float (&na)[2], unsigned st,
                                              const unsigned (&ld_off)[2]) {
  // The k-tile's squares in fresh sums, then added to the rows' norms: one sequential sum over
  // K / 4 values per thread lost ~4e-7 of the norm at K = 1024 (half of the chunked kernel's
  // distance error on centred data, bench/notes/data_zoo.md, session 22).
  float sq[2] = {0.f, 0.f};
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    unsigned raw[4];
    ldmatrix_x4(st + ld_off[s], raw);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float x = __uint_as_float(raw[v]);
      if constexpr (kDiff) sq[v & 1] = fmaf(x, x, sq[v & 1]);
      if constexpr (kSplit) {
        mma_detail::split_tf32x3(raw[v], frag[s][0][v], frag[s][1][v]);
      } else {
        frag[s][0][v] = tf32_rna(raw[v]);
      }
    }
  }
  if constexpr (kDiff) {
    na[0] += sq[0];
    na[1] += sq[1];
  }
  // Every fragment register is written before the first wgmma of the k-tile
  // (ptxas serialises wgmma whose inputs are defined between them).
#pragma unroll
  for (int s = 0; s < 2; ++s) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      asm volatile("" : "+r"(frag[s][0][v]));
      if constexpr (kSplit) asm volatile("" : "+r"(frag[s][1][v]));
    }
  }
}

// One k-tile of a consumer warpgroup (distance_wgmma_kernel and matvec_wgmma_kernel):
// load_a_k_tile, then small_a*b, big_a*small_b, big_a*b per k8 step as wgmma.m64n256k8 (A
// from registers, B from the stage) and the commit. The fragment registers of a wgmma must
// stay untouched until it completes, so the callers keep one k-tile in flight with two
// fragment buffers (even and odd k-tiles).
// `diag_k`: the k-tile count, read only by the KERMAC_LIKE_WGMMA_DIAG_NO_MMA diagnostic.
template <bool kSplit, bool kDiff, int kTileABytes, int kTileBBytes>
__device__ __forceinline__ void consume_k_tile(float (&acc)[128], unsigned (&frag)[2][2][4], float (&na)[2],
                                               unsigned st, const unsigned (&ld_off)[2], int diag_k) {
  (void)diag_k;
  load_a_k_tile<kSplit, kDiff>(frag, na, st, ld_off);
  wgmma_fence();
#ifdef KERMAC_LIKE_WGMMA_DIAG_NO_MMA  // diagnostic: the pipeline without tensor-core work
  if (diag_k < 0)
#endif
#pragma unroll
  for (int s = 0; s < 2; ++s) {  // two k8 steps: 32 bytes into each 64-byte row
    const unsigned long long b_raw = make_desc(st + kTileABytes + s * 32);
    if constexpr (kSplit) {
      const unsigned long long b_lo = make_desc(st + kTileABytes + kTileBBytes + s * 32);
      wgmma_m64n256k8_tf32_rs(acc, frag[s][1], b_raw);  // least significant terms first
      wgmma_m64n256k8_tf32_rs(acc, frag[s][0], b_lo);
    }
    wgmma_m64n256k8_tf32_rs(acc, frag[s][0], b_raw);
  }
  wgmma_commit();
}

// The chunked consumers' k-tile (kChunked: 64 x 128 per warpgroup): the k-tile's products into
// the partial sum `part`, a fresh one where `fresh` (the first wgmma's scale-d is 0), the small terms of both k8 steps
// before the big ones, then the commit; the caller adds `part` to its running sum in float32
// (round to nearest) once the wgmma has completed. The tensor cores' accumulation truncates, so
// one running sum over K loses about 0.35 K 2^-24 of its magnitude, always in the same direction
// (bench/notes/data_zoo.md); a partial sum per k-tile loses that over 6 additions only, and the
// sums of partial sums round to nearest: about torch's float32 GEMM error, or less.
template <bool kSplit, int kTileABytes, int kTileBBytes, int kAcc>
__device__ __forceinline__ void chunk_k_tile(float (&part)[kAcc], const unsigned (&frag)[2][2][4], unsigned st,
                                             bool fresh) {
  wgmma_fence();
  int scale_d = fresh ? 0 : 1;
  if constexpr (kSplit) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      wgmma_part_rs(part, frag[s][1], make_desc(st + kTileABytes + s * 32), scale_d);
      scale_d = 1;
      wgmma_part_rs(part, frag[s][0], make_desc(st + kTileABytes + kTileBBytes + s * 32), 1);
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    wgmma_part_rs(part, frag[s][0], make_desc(st + kTileABytes + s * 32), scale_d);
    scale_d = 1;
  }
  wgmma_commit();
}

// The rotating consumers' products (kRotate: 128 x 256 tiles, one 64 x 128 partial sum): one k-tile's
// products on the 128 columns of the B tile at `b` (its raw half; B small kTileBBytes further) into
// `part`, in chunk_k_tile's order, the first wgmma's scale-d 0 where `fresh`; no fence, no commit
// (the caller issues a chunk's k-tiles of one column half as one commit group).
template <bool kSplit, int kTileBBytes>
__device__ __forceinline__ void half_k_tile(float (&part)[64], const unsigned (&frag)[2][2][4], unsigned b,
                                            bool fresh) {
  int scale_d = fresh ? 0 : 1;
  if constexpr (kSplit) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      wgmma_m64n128k8_tf32_rs(part, frag[s][1], make_desc(b + s * 32), scale_d);
      scale_d = 1;
      wgmma_m64n128k8_tf32_rs(part, frag[s][0], make_desc(b + kTileBBytes + s * 32), 1);
    }
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    wgmma_m64n128k8_tf32_rs(part, frag[s][0], make_desc(b + s * 32), scale_d);
    scale_d = 1;
  }
}

#endif  // KERMAC_LIKE_MMA_HOST_EMULATION

}  // namespace wgmma_detail

// ------------------------------------------------------------------- traits

template <Inner kInner_, Power kOuter_, Epilogue kEpilogue_, Layout kLayoutA_, Layout kLayoutB_,
          Layout kLayoutO_, Precision kPrecision_, class T_, int kStagesArg = 0, class Epi_ = void,
          int kChunkTiles_ = 0, int kChunkN_ = 0>
struct DistanceWgmmaTraits : mma_detail::TensorCoreDistance<kInner_, kOuter_, kEpilogue_, kLayoutA_, kLayoutB_,
                                                            kLayoutO_, kPrecision_, T_, Epi_> {
  // (T_ and kPrecision_ below: the base's members are not visible by plain name here)
  static_assert(wgmma_detail::SameType<T_, float>::value &&
                    (kPrecision_ == Precision::Tf32x3 || kPrecision_ == Precision::Tf32),
                "DistanceWgmmaTraits: only T = float with Precision Tf32x3 or Tf32 (16-bit data: use "
                "DistanceMmaTraits)");

  static constexpr bool kSplit = kPrecision_ == Precision::Tf32x3;
  // kChunkTiles > 0 (chunked): 128 x 128 tiles (64 x 128 per consumer warpgroup), the products of
  // each kChunkTiles k-tiles summed in a fresh partial sum and added to the running sum in float32
  // (chunk_k_tile): about torch's float32 GEMM error where one running sum on the tensor cores
  // (kChunkTiles 0, 128 x 256 tiles) is 2-4x above it.
  static constexpr int kChunkTiles = kChunkTiles_;
  static constexpr bool kChunked = kChunkTiles > 0;
  static_assert(kChunkTiles >= 0 && kChunkTiles <= 2, "DistanceWgmmaTraits: kChunkTiles 0, 1 or 2");
  static_assert(!kChunked || kSplit, "DistanceWgmmaTraits: chunked only with Precision::Tf32x3");
  // kChunkN (chunked only): the tile's columns, 128 (0: the default), 192 or 256. 128 x 192 tiles
  // (64 x 192 per consumer warpgroup: 96 + 96 accumulators) split a k-tile of a once per 192
  // output columns rather than 128: 2/3 of the 128 x 128 tiles' a-side work per product; their
  // b rows straddle the 256-row prepared blocks. 128 x 256 tiles (kRotate: 128 running sums,
  // one 64 x 128 partial sum) sum a chunk's products column half by column half with the same
  // a fragments (two k-tiles' fragments held, no fragments loaded ahead): the a-side work per
  // product of one running sum (bench/notes/data_zoo.md, session 23).
  static constexpr int kChunkN = kChunked ? (kChunkN_ > 0 ? kChunkN_ : 128) : 0;
  static_assert(kChunkN_ == 0 || (kChunked && (kChunkN_ == 128 || kChunkN_ == 192 || kChunkN_ == 256)),
                "DistanceWgmmaTraits: kChunkN 128, 192 or 256, chunked only");
  static constexpr bool kRotate = kChunkN == 256;
  static constexpr int kProducerThreads = 128;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kProducerThreads + kConsumerThreads;  // 3 warpgroups
  // setmaxnreg: 56 * 128 + 224 * 256 = 64512 = 168 * 384, the launch allocation; the wide tiles'
  // consumers hold 96 + 96 (192) or 128 + 64 (256) accumulators and 32 fragment registers:
  // 24 * 128 + 240 * 256 (at 40 / 232 they spill in the k-loop; the loader spills 2-4 values at 24).
  static constexpr bool kWide = kChunkN == 192 || kRotate;  // 24 / 240 registers
  static constexpr int kProducerRegs = kWide ? 24 : 56;
  static constexpr int kConsumerRegs = kWide ? 240 : 224;
  static_assert(kProducerRegs * kProducerThreads + kConsumerRegs * kConsumerThreads == 168 * kThreads,
                "DistanceWgmmaTraits: setmaxnreg within the launch allocation");
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kChunked ? kChunkN : 256;
  static constexpr int kAcc = kBlockN / 2;  // accumulators per consumer thread (64 x kBlockN per warpgroup)
  static constexpr int kPrepTileN = 256;    // rows of one prepared b block (WgmmaPrepareTraits::kTileN)
  static constexpr int kRowBytes = 64;  // one k-tile of a row: 16 floats, two k8 steps
  static constexpr int kBlockK = kRowBytes / 4;
  static constexpr int kTileABytes = kBlockM * kRowBytes;  // 8 KiB
  static constexpr int kTileBBytes = kBlockN * kRowBytes;  // 16 KiB (8 KiB chunked)
  // A raw, B raw (= B big), B small (3xTF32 only), and the tile's kBlockN b norms (copied
  // with the tile's last k-tile; that stage is held until the epilogue is done); stages
  // rounded up to the swizzle's 1 KiB.
  static constexpr int kNormBytes = kBlockN * 4;
  static constexpr int kNormOffset = kTileABytes + kTileBBytes * (kSplit ? 2 : 1);
  static constexpr int kStageBytes = (kNormOffset + kNormBytes + 1023) / 1024 * 1024;
  static constexpr int kBBlockBytes = kTileBBytes * (kSplit ? 2 : 1);  // the b bytes of one stage
  // One prepared block (kPrepTileN rows: raw, then small): a tile of kBlockN rows reads its rows
  // of each half, kRawBytes at (n0 % kPrepTileN) * kRowBytes of the raw and of the small half.
  static constexpr int kPrepBlockBytes = kPrepTileN * kRowBytes * (kSplit ? 2 : 1);
  // kBlockN | kPrepTileN: a tile lies inside one prepared block; else (192) a tile's rows start at a
  // multiple of 64 of a block and may run into the next block's first rows (two copies a half).
  static constexpr bool kStraddle = kPrepTileN % kBlockN != 0;
  static_assert(kBlockN % 64 == 0 && kBlockN <= kPrepTileN, "DistanceWgmmaTraits: tiles of whole 64-row pieces");
#ifdef KERMAC_LIKE_WGMMA_CLUSTER  // bench/try_wgmma.py probe
  static constexpr int kClusterM = KERMAC_LIKE_WGMMA_CLUSTER;
#else
  static constexpr int kClusterM = 2;  // CTAs per cluster: M-tile pairs share each b block (multicast)
#endif
  static constexpr int kStages =
      kStagesArg > 0 ? kStagesArg : (kSplit && kBlockN == 256 ? 5 : kBlockN == 192 ? 6 : 8);
  static constexpr int kBarrierBytes = 2 * kStages * 8;    // full[], empty[]
  static constexpr int kAlignSlack = 1024;                 // the kernel aligns its base to 1 KiB
  static constexpr int kSmemBytes = kStages * kStageBytes + kBarrierBytes + kAlignSlack;
#ifdef KERMAC_LIKE_WGMMA_GROUP_M  // bench/try_wgmma.py probe
  static constexpr int kGroupM = KERMAC_LIKE_WGMMA_GROUP_M;
#else
  static constexpr int kGroupM = 16;  // M tiles that sweep N together (L2 reuse)
#endif
  static constexpr bool kPersistent = true;
#ifdef KERMAC_LIKE_WGMMA_FMA_EXP  // bench/try_wgmma.py probe
  static constexpr int kFmaExp = KERMAC_LIKE_WGMMA_FMA_EXP;
#else
  static constexpr int kFmaExp = 0;  // of every 4 epilogue entries, how many exponentials run on the FMA pipe
#endif
  static_assert(kStages >= 3, "DistanceWgmmaTraits: at least 3 stages");
  static_assert(kStageBytes % 1024 == 0, "DistanceWgmmaTraits: stages keep the 1 KiB alignment of the swizzle");
  static_assert(kSmemBytes <= 227 * 1024, "DistanceWgmmaTraits: shared memory above 227 KiB");
};

// ------------------------------------------------------------------- kernel
// The flat ABI plus what wgmma_prepare_b_kernel wrote: b_blocks (the shared-memory
// image of b, and of B small for 3xTF32) and b_norm (Inner::Diff), indexed by the
// entry e = l0 bc0 + l1 bc1 + l2 bc2 of batch entry (l0, l1, l2) (bc_i = 0 where b
// broadcasts). Launched in clusters of kClusterM CTAs: the pair takes vertically
// adjacent tiles (same n0), loads its a rows itself and multicasts each b block to both.
template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    distance_wgmma_kernel(const float* __restrict__ a, const float* __restrict__ b,
                             float* __restrict__ out, int M, int N, int K, long long lda, long long ldb,
                             long long ldo, int batch, int batch_n1, int batch_n2, long long a_bs0,
                             long long a_bs1, long long a_bs2, long long b_bs0, long long b_bs1,
                             long long b_bs2, long long o_bs0, long long o_bs1, long long o_bs2,
                             const float* inner_p_ptr, long long inner_p_bs0, long long inner_p_bs1,
                             long long inner_p_bs2, float inner_p, const float* outer_p_ptr,
                             long long outer_p_bs0, long long outer_p_bs1, long long outer_p_bs2,
                             float outer_p, const float* bw_ptr, long long bw_bs0, long long bw_bs1,
                             long long bw_bs2, float bandwidth, const float* reg_ptr, long long reg_bs0,
                             long long reg_bs1, long long reg_bs2, float regularization,
                             long long reg_diag, float epsilon, const float* __restrict__ b_blocks,
                             const float* __restrict__ b_norm, long long bc0, long long bc1, long long bc2,
                             const float* __restrict__ a0 = nullptr, const float* __restrict__ b0 = nullptr,
                             int k0 = 0, long long a0_sm = 0, long long a0_sk = 0, long long b0_sm = 0,
                             long long b0_sk = 0, long long a0_bs0 = 0, long long a0_bs1 = 0,
                             long long a0_bs2 = 0, long long b0_bs0 = 0, long long b0_bs1 = 0,
                             long long b0_bs2 = 0) {
  using namespace mma_detail;
  using namespace wgmma_detail;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages, kStageBytes = Traits::kStageBytes;
  constexpr int kRowBytes = Traits::kRowBytes, kBlockK = Traits::kBlockK;
  constexpr int kTileABytes = Traits::kTileABytes, kTileBBytes = Traits::kTileBBytes;
  constexpr int kBBlockBytes = Traits::kBBlockBytes;
  constexpr int kCluster = Traits::kClusterM;
  constexpr bool kSplit = Traits::kSplit;
  constexpr bool kDiff = Traits::kInner == Inner::Diff;
  constexpr int kRowsPerPass = Traits::kProducerThreads / 4;  // 32 rows, 4 chunks each
  constexpr int kPassesA = kBlockM / kRowsPerPass;            // 4
  using Prepared = WgmmaPrepareTraits<kSplit, kDiff>;
  static_assert(Prepared::kTileN == Traits::kPrepTileN && Prepared::kTileK == kBlockK &&
                    Prepared::kBlockFloats * 4 == Traits::kPrepBlockBytes,
                "distance_wgmma_kernel: the prepared b blocks are this kernel's b tiles");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw_base = smem_u32(smem_raw);
  const unsigned base = (raw_base + 1023u) & ~1023u;  // the swizzle follows address bits
  // [kStages x (A raw, B raw, B small, b norms)][full[kStages]][empty[kStages]]
  const unsigned bar_full = base + kStages * kStageBytes;
  const unsigned bar_empty = bar_full + 8 * kStages;
  // Every CTA of the cluster computes the same `base` (same kernel, same dynamic
  // shared memory), so the offsets that multicasts and remote arrivals use agree.

  const int tid = threadIdx.x;
  const unsigned rank = cluster_ctarank();
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, Traits::kProducerThreads + 1);  // a copies + the expect_tx arrival
      mbar_init(bar_empty + 8 * s, kCluster * Traits::kConsumerThreads / 32);  // consumer warps of the cluster
    }
    fence_mbarrier_init_cluster();
  }
  cluster_sync();  // barriers initialised in every CTA before any remote use

  const int tiles_m = ceil_div(M, kBlockM), tiles_n = ceil_div(N, kBlockN);
  const int pairs_m = ceil_div(tiles_m, kCluster);
  const long long per_batch = (long long)pairs_m * tiles_n;
  const long long total = per_batch * batch;
  const int num_k_tiles = ceil_div(K, kBlockK);
  const int prep_tiles_n = ceil_div(N, Traits::kPrepTileN);  // the prepared blocks per entry
  const long long n_pad = (long long)prep_tiles_n * Traits::kPrepTileN;
  const BatchShape shape{batch_n1, batch_n2};
  const BatchStride a_stride{a_bs0, a_bs1, a_bs2}, b_stride{b_bs0, b_bs1, b_bs2},
      o_stride{o_bs0, o_bs1, o_bs2}, b_entry{bc0, bc1, bc2};
  (void)inner_p_ptr, (void)inner_p_bs0, (void)inner_p_bs1, (void)inner_p_bs2, (void)inner_p;
  (void)outer_p_ptr, (void)outer_p_bs0, (void)outer_p_bs1, (void)outer_p_bs2, (void)outer_p;
  const long long first = cluster_id_x(), step = cluster_count_x();

  // Cluster tile t: batch entry, this CTA's tile origin, grouped so that kGroupM
  // consecutive M-tile pairs sweep N together.
  auto tile_of = [&](long long t, int& l0, int& l1, int& l2, int& m0, int& n0) {
    const int l = (int)(t / per_batch);
    const int linear = (int)(t - (long long)l * per_batch);
    const int group_size = Traits::kGroupM * tiles_n;
    const int first_m = (linear / group_size) * Traits::kGroupM;
    const int rows_in_group = min(pairs_m - first_m, Traits::kGroupM);
    const int in_group = linear % group_size;
    m0 = ((first_m + in_group % rows_in_group) * kCluster + (int)rank) * kBlockM;
    n0 = (in_group / rows_in_group) * kBlockN;
    shape.split(l, l0, l1, l2);
  };

  if (tid < Traits::kProducerThreads) {
    // ================================================================== loader
    regs_decrease<Traits::kProducerRegs>();
    // Thread tid copies chunk tid % 4 of a rows tid / 4 + 32 u (same swizzle for all u);
    // thread 0 also issues this CTA's share of the b block (multicast to the cluster).
    const int chunk = tid & 3, prow = tid >> 2;
    const unsigned dst = swizzled(prow, chunk);
    constexpr unsigned short kMask = (1u << kCluster) - 1u;
    constexpr unsigned kShare = kBBlockBytes / kCluster;
    int stage = 0;
    unsigned phase = 0;
    for (long long t = first; t < total; t += step) {
      int l0, l1, l2, m0, n0;
      tile_of(t, l0, l1, l2, m0, n0);
      const float* a_row = a + a_stride.offset(l0, l1, l2) + (long long)(m0 + prow) * lda + chunk * 4;
      const long long entry = b_entry.offset(l0, l1, l2);
      // This tile's rows of its prepared block: raw at `blocks`, small at `blocks + kPrepTileN rows`.
      const unsigned char* blocks = reinterpret_cast<const unsigned char*>(b_blocks) +
                                    (entry * prep_tiles_n + n0 / Traits::kPrepTileN) * num_k_tiles *
                                        (long long)Traits::kPrepBlockBytes +
                                    (n0 % Traits::kPrepTileN) * kRowBytes;
      const int a_rows = M - m0 - prow;  // pass u is valid if 32 u < a_rows
      // kStraddle (192-row tiles): the first r1 rows from this block (from row n0 % kPrepTileN),
      // the other kBlockN - r1 from the next block's first rows where it exists (n_pad: past it
      // the rows are not copied, and those stage rows keep older b rows, which reach only output
      // columns past N: a wgmma column reads only its own b row); the norms likewise.
      int r1 = kBlockN, rows_b = kBlockN;
      if constexpr (Traits::kStraddle) {
        r1 = min(kBlockN, Traits::kPrepTileN - n0 % Traits::kPrepTileN);
        rows_b = r1 < kBlockN && n0 / Traits::kPrepTileN + 1 < prep_tiles_n ? kBlockN : r1;
      }
      const unsigned b_bytes = Traits::kStraddle ? (unsigned)(rows_b * kRowBytes * (kSplit ? 2 : 1)) : kBBlockBytes;
      const unsigned norm_bytes =
          Traits::kStraddle ? (unsigned)min(kBlockN, (int)(n_pad - n0)) * 4u : (unsigned)Traits::kNormBytes;
      for (int kt = 0; kt < num_k_tiles; ++kt) {
        mbar_wait(bar_empty + 8 * stage, phase ^ 1u);  // free in every CTA of the cluster
        const unsigned st = base + stage * kStageBytes;
        const bool last = kt == num_k_tiles - 1;
        if (tid == 0) {
#ifndef KERMAC_LIKE_WGMMA_DIAG_NO_LOAD
          mbar_arrive_expect_tx(bar_full + 8 * stage, b_bytes + (kDiff && last ? norm_bytes : 0u));
          const unsigned char* src = blocks + kt * (long long)Traits::kPrepBlockBytes;
          if constexpr (Traits::kStraddle) {
            // rows [0, r1) then [r1, rows_b) of the raw half, the same of the small half; each CTA
            // multicasts its 1 / kCluster of every piece (64-row pieces: 2 KiB shares).
            const unsigned char* next = src + (long long)num_k_tiles * Traits::kPrepBlockBytes -
                                        (n0 % Traits::kPrepTileN) * kRowBytes;
#pragma unroll
            for (int h = 0; h < (kSplit ? 2 : 1); ++h) {
              const unsigned dst_b = st + kTileABytes + h * kTileBBytes;
              const long long half = (long long)h * Traits::kPrepTileN * kRowBytes;
              const unsigned share1 = (unsigned)(r1 * kRowBytes / kCluster);
              bulk_copy_multicast(dst_b + rank * share1, src + half + rank * share1, share1, bar_full + 8 * stage,
                                  kMask);
              if (rows_b > r1) {
                const unsigned share2 = (unsigned)((rows_b - r1) * kRowBytes / kCluster);
                bulk_copy_multicast(dst_b + r1 * kRowBytes + rank * share2, next + half + rank * share2, share2,
                                    bar_full + 8 * stage, kMask);
              }
            }
          } else if constexpr (kBlockN == Traits::kPrepTileN) {  // raw and small contiguous: one copy
            bulk_copy_multicast(st + kTileABytes + rank * kShare, src + rank * kShare, kShare, bar_full + 8 * stage,
                                kMask);
          } else {  // this tile's rows of the raw half, then of the small half
            constexpr unsigned kHalfShare = kTileBBytes / kCluster;
            bulk_copy_multicast(st + kTileABytes + rank * kHalfShare, src + rank * kHalfShare, kHalfShare,
                                bar_full + 8 * stage, kMask);
            if constexpr (kSplit)
              bulk_copy_multicast(st + kTileABytes + kTileBBytes + rank * kHalfShare,
                                  src + Traits::kPrepTileN * kRowBytes + rank * kHalfShare, kHalfShare,
                                  bar_full + 8 * stage, kMask);
          }
#else
          (void)blocks;
          mbar_arrive_expect_tx(bar_full + 8 * stage, kDiff && last ? norm_bytes : 0u);
#endif
          // The tile's b norms (the array is padded to n_pad: whole tiles, but for 192-row tiles
          // at its end) with its last k-tile, into the stage the consumers hold through the epilogue.
          if (kDiff && last && rank == 0)
            bulk_copy_multicast(st + Traits::kNormOffset, b_norm + entry * n_pad + n0, norm_bytes,
                                bar_full + 8 * stage, kMask);
        }
        const int k_left = K - kt * kBlockK - chunk * 4;
        const int bytes = k_left <= 0 ? 0 : (k_left >= 4 ? 16 : k_left * 4);
#ifdef KERMAC_LIKE_WGMMA_DIAG_NO_LOAD  // bench/try_wgmma.py diagnostic: the kernel without global loads
        if (kt < 0) {
#endif
#pragma unroll
        for (int u = 0; u < kPassesA; ++u) {
          const bool ok = u * kRowsPerPass < a_rows && bytes > 0;
          cp_async_16(st + dst + u * kRowsPerPass * kRowBytes, ok ? a_row + u * kRowsPerPass * lda + kt * kBlockK : a,
                      ok ? bytes : 0);
        }
#ifdef KERMAC_LIKE_WGMMA_DIAG_NO_LOAD
        }
#endif
        cp_async_mbar_arrive(bar_full + 8 * stage);
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      }
    }
    cp_async_wait_all();
  } else {
    // ================================================================ consumers
    regs_increase<Traits::kConsumerRegs>();
    const int ctid = tid - Traits::kProducerThreads;
    const int lane = ctid & 31, cwarp = ctid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int wg = cwarp >> 2;  // rows 64 wg .. 64 wg + 63 of the tile
    unsigned ld_off[2];
    a_fragment_offsets(lane, cwarp, ld_off);
    int stage = 0;
    unsigned phase = 0;
    // A stage goes back to the loaders of every CTA of the cluster (they all write it):
    // lane r arrives on CTA r's barrier, on this CTA's own through its shared::cta
    // address. compute-sanitizer's racecheck reports the consumers' ldmatrix reads of a
    // stage against the loader's next cp.async writes into it (K = 264, where the ring
    // wraps; with the local or the mapa form of the own arrival alike). Not a race: every
    // warp arrives after its reads of the stage fed a wgmma that wait_group has retired,
    // and the loader writes only after empty[s] completed its phase, which takes all 16
    // arrivals of the round (8 of this CTA's warps); no arrival of the next round can come
    // first, since the peer's next-round arrivals need its full[s], which needs this
    // loader's multicast after this wait. The lanes' reads are ordered before the one
    // arriving lane's release by __syncwarp (bar.warp.sync orders memory among its threads;
    // the release is cumulative); racecheck does not carry other lanes' accesses through
    // __syncwarp and reports exactly this hand-off in a 40-line kernel while every-lane
    // arrivals are clean (bench/probes/racecheck_mbarrier.py, bench/notes/sanitizer.md).
    auto release = [&](int s) {
      __syncwarp();
      if (lane == (int)rank) {
        mbar_arrive(bar_empty + 8 * s);
      } else if (lane < kCluster) {
        mbar_arrive_cluster(bar_empty + 8 * s, (unsigned)lane);
      }
    };

    const HyperParam bw_param{bw_ptr, {bw_bs0, bw_bs1, bw_bs2}, bandwidth};
    const HyperParam reg_param{reg_ptr, {reg_bs0, reg_bs1, reg_bs2}, regularization};
    const bool reg_on = reg_ptr != nullptr || regularization != 0.f;

    constexpr int kAcc = Traits::kAcc;
    float acc[kAcc];
    for (long long t = first; t < total; t += step) {
      int l0, l1, l2, m0, n0;
      tile_of(t, l0, l1, l2, m0, n0);
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
      float na[2] = {0.f, 0.f};

      int prev_stage = -1;
      auto advance = [&]() {
        prev_stage = stage;
        if (++stage == kStages) {
          stage = 0;
          phase ^= 1u;
        }
      };
      unsigned frag_even[2][2][4], frag_odd[2][2][4];
      if constexpr (Traits::kRotate) {
        // A chunk (kChunkTiles k-tiles; the last may have one): both k-tiles' a fragments
        // loaded and split, then per column half h the chunk's products into the one partial sum
        // (a fresh one), wait, added to running sums 64 h .. 64 h + 63 (the accumulators of
        // columns 128 h ..: fragment j of the 64 x 256 layout is j % 16 of half j / 16). No
        // fragments are loaded while this warpgroup's wgmma run: the other warpgroup's fill the
        // tensor cores meanwhile. Stages go back after the chunk; the tile's last stage (b
        // norms) after the epilogue.
        constexpr unsigned kHalfB = 128 * kRowBytes;
        float part[64];
        for (int kt = 0; kt < num_k_tiles; kt += Traits::kChunkTiles) {
          const bool two = Traits::kChunkTiles == 2 && kt + 1 < num_k_tiles;
          mbar_wait(bar_full + 8 * stage, phase);
          const unsigned st0 = base + stage * kStageBytes;
          const int s0 = stage;
          load_a_k_tile<kSplit, kDiff>(frag_even, na, st0, ld_off);
          advance();
          unsigned st1 = st0;
          if (two) {
            mbar_wait(bar_full + 8 * stage, phase);
            st1 = base + stage * kStageBytes;
            load_a_k_tile<kSplit, kDiff>(frag_odd, na, st1, ld_off);
            advance();
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            wgmma_fence();
            half_k_tile<kSplit, kTileBBytes>(part, frag_even, st0 + kTileABytes + h * kHalfB, true);
            if (two) half_k_tile<kSplit, kTileBBytes>(part, frag_odd, st1 + kTileABytes + h * kHalfB, false);
            wgmma_commit();
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[64 * h + i] += part[i];
          }
          if (kt + Traits::kChunkTiles < num_k_tiles) {
            release(s0);
            if (two) release(prev_stage);
          } else if (two) {
            release(s0);  // prev_stage (the last k-tile's, b norms) after the epilogue
          }
        }
      } else if constexpr (Traits::kChunked) {
        // The products of each kChunkTiles k-tiles in a fresh partial sum (chunk_k_tile); while a
        // k-tile's wgmma runs, the next k-tile's a fragments are loaded and split (two fragment
        // buffers, even and odd k-tiles). A chunk's first k-tile waits for the previous chunk,
        // adds it to the running sum and starts the next; a later k-tile of the chunk adds to
        // its partial sum and waits only for the previous k-tile (to give its stage back).
        float part[kAcc];
        auto k_tile = [&](int kt, unsigned (&frag)[2][2][4], const bool fresh) {
          mbar_wait(bar_full + 8 * stage, phase);
          const unsigned st = base + stage * kStageBytes;
          load_a_k_tile<kSplit, kDiff>(frag, na, st, ld_off);
          if (fresh && kt > 0) {
            wgmma_wait<0>();
            release(prev_stage);
#pragma unroll
            for (int i = 0; i < kAcc; ++i) acc[i] += part[i];
          }
          chunk_k_tile<kSplit, kTileABytes, kTileBBytes, kAcc>(part, frag, st, fresh);
          if (!fresh) {
            wgmma_wait<1>();
            release(prev_stage);
          }
          advance();
        };
        for (int kt = 0; kt < num_k_tiles; kt += 2) {
          k_tile(kt, frag_even, true);
          if (kt + 1 < num_k_tiles) k_tile(kt + 1, frag_odd, Traits::kChunkTiles == 1);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < kAcc; ++i) acc[i] += part[i];
      } else {
        // One k-tile (consume_k_tile), one k-tile of wgmma in flight: two fragment
        // buffers, used by even and odd k-tiles (distinct registers in the unrolled loop).
        auto k_tile = [&](int kt, unsigned (&frag)[2][2][4]) {
          mbar_wait(bar_full + 8 * stage, phase);
          // No proxy fence: a (cp.async, generic proxy) is read by ldmatrix (generic), b (bulk
          // copy, async proxy) by wgmma (async proxy); the mbarrier orders both.
#ifdef KERMAC_LIKE_WGMMA_PROXY_FENCE  // bench/try_wgmma.py probe: what the fence would cost
          fence_proxy_async();
#endif
          consume_k_tile<kSplit, kDiff, kTileABytes, kTileBBytes>(acc, frag, na, base + stage * kStageBytes, ld_off,
                                                                  num_k_tiles);
          wgmma_wait<1>();  // the previous k-tile's wgmma is done: release its stage
          if (kt > 0) release(prev_stage);
          advance();
#ifdef KERMAC_LIKE_WGMMA_LOCKSTEP  // bench/try_wgmma.py probe: the consumer warps in lockstep per k-tile
          named_barrier<1, Traits::kConsumerThreads>();
#endif
        };
        for (int kt = 0; kt < num_k_tiles; kt += 2) {
          k_tile(kt, frag_even);
          if (kt + 1 < num_k_tiles) k_tile(kt + 1, frag_odd);
        }
      }
      wgmma_wait<0>();
      // The last k-tile's stage holds the tile's b norms: released after the epilogue.
      const float* norm_b = reinterpret_cast<const float*>(smem_raw + (base - raw_base) +
                                                           prev_stage * kStageBytes + Traits::kNormOffset);

      // ---------------------------------------------------------- epilogue
      const float* a_l = a + a_stride.offset(l0, l1, l2);
      const float* b_l = b + b_stride.offset(l0, l1, l2);
      float* out_l = out + o_stride.offset(l0, l1, l2);

      const EntryEpilogue<Traits> finish(
          bw_param.at(l0, l1, l2), reg_on ? reg_param.at(l0, l1, l2) : 0.f, epsilon,
          Traits::kFunctor ? HyperParam{inner_p_ptr, {inner_p_bs0, inner_p_bs1, inner_p_bs2}, inner_p}.at(l0, l1, l2)
                           : 0.f,
          Traits::kFunctor ? HyperParam{outer_p_ptr, {outer_p_bs0, outer_p_bs1, outer_p_bs2}, outer_p}.at(l0, l1, l2)
                           : 0.f);
      const bool vec_out = Traits::kLayoutO == Layout::RowMajor &&
                           ((unsigned long long)out_l % 8) == 0 && (ldo % 2) == 0;

      // Accumulator h (0: row0, 1: row0 + 8), columns 8 j + 2 t4 + e.
      const int row0 = wg * 64 + (cwarp & 3) * 16 + g, col0 = 2 * t4;
      int reg_col[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kDiff) {  // the quad (t4 = 0..3) holds the 16 k of each row
          na[h] += __shfl_xor_sync(0xffffffffu, na[h], 1);
          na[h] += __shfl_xor_sync(0xffffffffu, na[h], 2);
        }
        const long long c = (long long)(m0 + row0 + h * 8) + reg_diag - n0;
        reg_col[h] = reg_on && c >= 0 && c < kBlockN ? (int)c : -1;
      }

      if (kDiff && a_l == b_l && lda == ldb && m0 < n0 + kBlockN && n0 < m0 + kBlockM) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          const int col = col0 + j * 8;
          if constexpr (Traits::kWide) {  // the norm read where the diagonal is (ptxas held all 48 beside 96 sums)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int diag = m0 + row0 + h * 8 - n0;  // tile-local column of m == n
              if (diag == col) acc[4 * j + 2 * h] = 0.5f * (na[h] + norm_b[col]);
              if (diag == col + 1) acc[4 * j + 2 * h + 1] = 0.5f * (na[h] + norm_b[col + 1]);
            }
          } else {
            const float2 nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int diag = m0 + row0 + h * 8 - n0;  // tile-local column of m == n
              if (diag == col) acc[4 * j + 2 * h] = 0.5f * (na[h] + nb.x);
              if (diag == col + 1) acc[4 * j + 2 * h + 1] = 0.5f * (na[h] + nb.y);
            }
          }
        }
      }

      // Fast path for tiles that lie inside the output, with epsilon off and the
      // regularised diagonal not crossing them (all of them but a thin border):
      // no bounds or diagonal tests per element (tile-uniform branch).
      const bool fast = m0 + kBlockM <= M && n0 + kBlockN <= N && !(epsilon > 0.f) &&
                        (Traits::kLayoutO == Layout::ColMajor || vec_out) &&
                        (!reg_on || (long long)m0 + reg_diag >= n0 + kBlockN ||
                         (long long)m0 + kBlockM - 1 + reg_diag < n0);
      // Near pairs (distance_mma.cuh): bit j of near_mask when one of the four entries of column
      // pair j (rows h = 0, 1) is near; the four are rewritten after the tile (one register).
      constexpr bool kNear = kDiff && kSplit;
      unsigned near_mask = 0u;
      if constexpr (kNear) {  // before the write (not inside it: its registers are the tight ones)
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          const float2 nb = *reinterpret_cast<const float2*>(norm_b + col0 + j * 8);
#pragma unroll
          for (int h = 0; h < 2; ++h)
            near_mask |= (unsigned)(near_pair(acc[4 * j + 2 * h], na[h], nb.x) |
                                    near_pair(acc[4 * j + 2 * h + 1], na[h], nb.y)) << j;
        }
      }
      // kFast is a constant in each of the two calls below (inlined, folded).
      auto write_tile = [&](const bool kFast) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
          const int col = col0 + j * 8;
          const int n = n0 + col;
          if (!kFast && n >= N) continue;
          float2 nb = make_float2(0.f, 0.f);
          if constexpr (kDiff) nb = *reinterpret_cast<const float2*>(norm_b + col);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int m = m0 + row0 + h * 8;
            if (!kFast && m >= M) continue;
            // Entries 2 h + e < kFmaExp of each (j) take their exponential on the FMA pipe.
            const float y0 = finish(acc[4 * j + 2 * h], na[h], nb.x, reg_col[h] == col, kFast,
                                    2 * h < Traits::kFmaExp);
            const float y1 = finish(acc[4 * j + 2 * h + 1], na[h], nb.y, reg_col[h] == col + 1, kFast,
                                    2 * h + 1 < Traits::kFmaExp);
#ifdef KERMAC_LIKE_WGMMA_DIAG_NO_STORE  // bench/try_wgmma.py diagnostic: what the writes cost
            if (y0 == y0 && y1 == y1) continue;
#endif
            if constexpr (Traits::kLayoutO == Layout::RowMajor) {
              float* p = out_l + (long long)m * ldo + n;
              if (kFast || (n + 1 < N && vec_out)) {
#ifdef KERMAC_LIKE_WGMMA_STREAM_STORE  // bench/try_wgmma.py probe: evict-first output stores
                __stcs(reinterpret_cast<float2*>(p), make_float2(y0, y1));
#else
                store_two<float>(p, y0, y1);
#endif
              } else {
                p[0] = y0;
                if (n + 1 < N) p[1] = y1;
              }
            } else {
              float* p = out_l + (long long)n * ldo + m;
              p[0] = y0;
              if (kFast || n + 1 < N) p[ldo] = y1;
            }
          }
        }
      };
#ifdef KERMAC_LIKE_WGMMA_NO_FAST_EPILOGUE  // bench/try_wgmma.py: the general epilogue everywhere
      write_tile(false);
#else
      if (fast) {
        write_tile(true);
      } else {
        write_tile(false);
      }
#endif
      if constexpr (kNear) {  // the near pairs' column pairs rewritten from their direct differences
        const NearOperands near_ops{a0,    b0,    k0, a0_sm, a0_sk, b0_sm,
                                    b0_sk, {a0_bs0, a0_bs1, a0_bs2}, {b0_bs0, b0_bs1, b0_bs2}};
        auto pair_origin = [&](int j, int& r, int& c) {  // column pair j of rows row0, row0 + 8
          r = m0 + row0;
          c = n0 + col0 + j * 8;
        };
        NearEntries<decltype(pair_origin)> next{near_mask, M, N, pair_origin};
        auto store = [&](int m, int n, float d2) {
          const float y = finish.of_sq_distance(d2, reg_on && (long long)m + reg_diag == n);
          if constexpr (Traits::kLayoutO == Layout::RowMajor) {
            out_l[(long long)m * ldo + n] = y;
          } else {
            out_l[(long long)n * ldo + m] = y;
          }
        };
        rewrite_near_pairs(near_ops, l0, l1, l2, a_l, lda, b_l, ldb, K, lane, next, store);
      }
      release(prev_stage);  // the tile's last stage (b norms read)
    }
  }
  cluster_sync();  // no CTA leaves while a peer may still multicast into it or arrive on its barriers
}

}  // namespace kermac_like
