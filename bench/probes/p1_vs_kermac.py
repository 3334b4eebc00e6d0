"""cdist p = 1 at M = N = 20 000 for several K: ours or Kermac 0.1.4, one process each.

Kermac needs cuda-core 0.4.2 first on its path, so each package runs in its own process
(same GPU, same device call); run both and compare the medians:

    python3 bench/probes/p1_vs_kermac.py ours 8,37,64,100,128,200,256
    PYTHONPATH=/tmp/kermac-site:/tmp/site python3 bench/probes/p1_vs_kermac.py kermac 8,37,64,100,128,200,256

CUDA events, fresh random inputs per call, `out` given (both packages), 3 warm-up calls (ours: then the kernels
compiling aside awaited, as bench/_timing does) then the median of 15. Prints one line per K: `P1 who K ms`.
"""
import argparse
import statistics

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("who", choices=("ours", "kermac"))
    parser.add_argument("Ks", help="comma-separated K")
    parser.add_argument("size", nargs="?", type=int, default=20000, help="M = N (default 20000)")
    args = parser.parse_args()
    who, Ks, M = args.who, [int(k) for k in args.Ks.split(",")], args.size
    N = M
    if who == "ours":
        import kermac_like as km

        def call(x, y, out):
            return km.cdist(x, y, p=1.0, out=out)
    else:
        import kermac

        def call(x, y, out):
            return kermac.cdist(x, y, p=1.0, out=out)
    dev = torch.device("cuda")
    out = torch.empty(M, N, device=dev)
    for K in Ks:
        times = []
        for i in range(18):
            x = torch.randn(M, K, device=dev)
            y = torch.randn(N, K, device=dev)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            s.record()
            call(x, y, out)
            e.record()
            torch.cuda.synchronize()
            if i == 2 and who == "ours":  # a kernel compiling aside (the first-call tier): wait for it
                from kermac_like import testing
                testing.wait_for_compiles()
            if i >= 3:
                times.append(s.elapsed_time(e))
        ref = torch.cdist(x[:64].double(), y.double(), p=1.0)
        err = ((out[:64].double() - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
        print(f"P1 {who} K={K} {statistics.median(times):.3f} ms (min {min(times):.3f}) err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
