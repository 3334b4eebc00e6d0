"""(sm_90) Does compute-sanitizer's racecheck understand an mbarrier hand-off of a shared-memory
buffer? The smallest form of distance_wgmma_kernel's stage reuse, correct by the PTX memory
model: warp 0 reads buf (ld.shared, or ldmatrix as the wgmma consumers do), then arrives on
an mbarrier with release semantics; warp 1 waits on the same mbarrier phase with acquire
semantics, then overwrites buf (cp.async, as the loader does, or st.shared). Reference
mode: the same hand-off through a named barrier (bar.arrive / bar.sync).

    compute-sanitizer --tool racecheck --report-api-errors no python3 bench/probes/racecheck_mbarrier.py MODE
    MODE: mbar-cpasync | mbar-ldsm-cpasync | mbar-st | named-cpasync | warp-ldsm-cpasync

warp-ldsm-cpasync is the kernels' own release: every lane reads (ldmatrix), __syncwarp, then one
lane arrives for the warp (mbarrier count 1). Ordered by the PTX memory model (bar.warp.sync
orders the lanes' accesses before lane 0's release arrival, which is cumulative).

Each run checks its own result (warp 0 saw the old values, the new ones landed) and prints
"MODE: ok"; racecheck's RACECHECK SUMMARY line says whether the tool reported the hand-off.
If the mbarrier modes are reported and the named-barrier mode is not, the report on
distance_wgmma_kernel is the tool not modelling mbarrier ordering, not a race of ours.
"""

import argparse

import torch

try:
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
except ImportError:  # cuda-core < 0.4
    from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch

MODES = {"mbar-cpasync": 0, "mbar-ldsm-cpasync": 1, "mbar-st": 2, "named-cpasync": 3, "warp-ldsm-cpasync": 4}

SOURCE = r"""
extern "C" __global__ void handoff(const float* __restrict__ g, float* __restrict__ out, int mode) {
  __shared__ __align__(16) float buf[32];
  __shared__ __align__(8) unsigned long long bar;
  const int tid = threadIdx.x, lane = tid & 31;
  const unsigned bar_a = (unsigned)__cvta_generic_to_shared(&bar);
  const unsigned buf_a = (unsigned)__cvta_generic_to_shared(buf);
  const unsigned count = mode == 4 ? 1u : 32u;  // mode 4: one arrival per warp, after __syncwarp
  if (tid == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar_a), "r"(count) : "memory");
  if (tid < 32) buf[tid] = float(tid);
  __syncthreads();
  if (tid < 32) {  // consumer: read the buffer, then hand it back
    float r;
    if (mode == 1 || mode == 4) {  // ldmatrix: lanes 0..7 give the 8 rows of 16 bytes; lane l gets row l/4, word l%4
      unsigned v;
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                   : "=r"(v) : "r"(buf_a + 16u * (lane & 7)) : "memory");
      r = __uint_as_float(v);
    } else {
      r = buf[lane];
    }
    out[lane] = r;
    if (mode == 3) {
      asm volatile("bar.arrive 1, 64;\n" ::: "memory");
    } else if (mode == 4) {  // distance_wgmma_kernel's release: the warp's reads, then lane 0 for the warp
      __syncwarp();
      if (lane == 0) asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar_a) : "memory");
    } else
      asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar_a) : "memory");
  } else {  // producer: wait for the hand-off, then overwrite the buffer
    if (mode == 3) {
      asm volatile("bar.sync 1, 64;\n" ::: "memory");
    } else {
      unsigned done = 0;
      while (!done)
        asm volatile("{ .reg .pred p;\n"
                     "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], 0;\n"
                     "selp.u32 %0, 1, 0, p; }\n"
                     : "=r"(done) : "r"(bar_a) : "memory");
    }
    if (mode == 2) {
      buf[lane] = g[lane];
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(buf_a + 4u * lane), "l"(g + lane) : "memory");
      asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
  }
  __syncthreads();
  if (tid < 32) out[32 + tid] = buf[tid];
}
"""


def main(mode_name: str) -> None:
    mode = MODES[mode_name]
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    major, minor = torch.cuda.get_device_capability()
    obj = Program(SOURCE, "c++", ProgramOptions(arch=f"sm_{major}{minor}", std="c++17")).compile("cubin")
    kernel = obj.get_kernel("handoff")
    g = torch.arange(100, 132, dtype=torch.float32, device="cuda")
    out = torch.full((64,), float("nan"), device="cuda")
    stream = dev.create_stream()
    launch(stream, LaunchConfig(grid=(1, 1, 1), block=(64, 1, 1)), kernel, g.data_ptr(), out.data_ptr(),
           mode)
    stream.sync()
    got = out.cpu()
    old = torch.arange(32, dtype=torch.float32)  # ldmatrix too: lane l gets word l % 4 of row l / 4 = element l
    ok = torch.equal(got[:32], old) and torch.equal(got[32:], g.cpu())
    print(f"{mode_name}: {'ok' if ok else 'WRONG ' + str(got.tolist())}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=tuple(MODES), default="mbar-cpasync")
    main(parser.parse_args().mode)
