"""knn_d128 with y sharded over GPUs (issue 25, item 6): M = N = 10^6, D = 128, k = 10.

    torchrun --nproc_per_node=2 bench/probes/knn_multi_gpu.py      # NCCL, one GPU per rank
    python3 bench/probes/knn_multi_gpu.py                          # the one-GPU time, same script

Every rank makes the same x and its own shard of y (contiguous blocks
of y in rank order, generated per block from a fixed seed, so the shards concatenated are the
one-process y), then NearestNeighbors(n_neighbors=10).fit(shard).kneighbors(x): each rank
searches its shard and the (M x k) candidates are all_gathered and merged. Time: barrier,
CUDA events around the collective call, median of the repeats after a warm-up. Check: rank 0
compares the first and the last ERR_ROWS rows with a one-process search of the whole y (values and indices), and
prints the peak extra GPU memory of the collective call.
"""
import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from kermac_like import knn  # noqa: E402
from kermac_like.neighbors import NearestNeighbors  # noqa: E402

M = N = int(os.environ.get("KNN_N", 1_000_000))
D, K, REPS, ERR_ROWS, BLOCK = 128, 10, int(os.environ.get("KNN_REPS", 3)), 256, 50_000


def y_rows(lo, hi, device):
    """Rows lo..hi of the global y, the same whatever the shard boundaries."""
    parts = []
    for b in range(lo // BLOCK, -(-hi // BLOCK)):
        g = torch.Generator(device=device).manual_seed(1000 + b)
        blk = torch.randn(BLOCK, D, device=device, generator=g)
        s, e = max(lo, b * BLOCK) - b * BLOCK, min(hi, (b + 1) * BLOCK) - b * BLOCK
        parts.append(blk[s:e])
    return torch.cat(parts)


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl")
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(M, D, device=dev, generator=torch.Generator(device=dev).manual_seed(7))
    lo, hi = rank * N // world, (rank + 1) * N // world
    shard = y_rows(lo, hi, dev)
    nn = NearestNeighbors(n_neighbors=K).fit(shard)
    times = []
    for r in range(REPS + 1):
        if world > 1:
            dist.barrier()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dv, iv = nn.kneighbors(x)
        b.record()
        torch.cuda.synchronize()
        if r:
            times.append(a.elapsed_time(b))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    med = statistics.median(times)
    if rank == 0:
        y = y_rows(0, N, dev) if world > 1 else shard
        # the first and the last rows (the last ones lie in the short last launch of the
        # tensor-core path)
        rows = torch.cat([torch.arange(ERR_ROWS), torch.arange(M - ERR_ROWS, M)]).to(dev)
        rv, ri = knn(x[rows], y, K)
        d64 = torch.cdist(x[rows].double(), y.double())
        want = d64.gather(1, ri)
        got = d64.gather(1, iv[rows])
        err = float(((dv[rows].double() - want).abs() / want).max())
        same = float((iv[rows] == ri).float().mean())
        gap_ok = bool(((got - want).abs() / want <= 1e-5).all())
        print(f"KNN_MULTI world={world} M=N={M} D={D} k={K}: median {med:.1f} ms over {REPS} "
              f"(all {[round(t, 1) for t in times]}); indices equal to one process on {2 * ERR_ROWS} rows (first and last): "
              f"{same:.4f}; distances of returned pairs within 1e-5 of the one-process ones: {gap_ok}; "
              f"value err vs float64 {err:.2e}; peak extra GPU memory on rank 0 {peak:.0f} MB; "
              f"{torch.cuda.get_device_name()}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="environment: KNN_N (M = N, default 10^6), KNN_REPS (default 3)")
    parser.parse_args()
    main()
