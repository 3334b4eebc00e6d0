"""eigh with and without host worker threads (L=10, N=5000, float32), CUDA-event medians."""

import statistics
import time

import torch

from kermac_like import linalg


def spd(L, n):
    x = torch.randn(L, n, 8, device="cuda")
    k = torch.exp(-torch.cdist(x, x))
    return k + 1e-2 * torch.eye(n, device="cuda")


def timed(fn, reps=3):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        h0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - h0) * 1e3
        e.record()
        torch.cuda.synchronize()
        ts.append((s.elapsed_time(e), host))
    return statistics.median(t for t, _ in ts), statistics.median(h for _, h in ts)


def main():
    a = spd(10, 5000)
    for threads in (False, True):
        linalg.EIGH_HOST_THREADS = threads
        linalg.eigh(a)
        torch.cuda.synchronize()
        gpu, host = timed(lambda: linalg.eigh(a))
        print(f"eigh L=10 N=5000 host_threads={threads}: {gpu:.0f} ms (host returns after {host:.0f} ms)")
    w, v, info = linalg.eigh(a)
    err = ((a @ v - v * w.unsqueeze(-2)).norm() / a.norm()).item()
    print(f"eigh reconstruction error {err:.2e}, info {info.tolist()}")


if __name__ == "__main__":
    main()
