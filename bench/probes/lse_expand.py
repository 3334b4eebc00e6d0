"""kernel_logsumexp's expanded exponent (LseTraits kVariant 3) against the direct form and
kernel_matvec at the bench row's size, one GPU, one process (bench/notes/logsumexp.md).

    python3 bench/probes/lse_expand.py [--reps 5] [--n 1000000]

Gaussian, D = 3, C = 1, M = N = --n, bandwidth 1.0: kernel_matvec, kernel_logsumexp as shipped
(the expanded exponent where plan/logsumexp.py's bound allows it) and with KERMAC_LIKE_LSE_EXPAND=0
(the variant 2 kernel); CUDA-event median of --reps calls after one warm-up, fresh randn data per
call. Then each logsumexp's error against float64 (first 256 rows, all N points) at bandwidths 1.0
and 1e-3, relative to max(1, |value|) (target <= 1e-5), whether two calls give the same bits, and
the guard's flag. The table comes last. ~30 s on an H100.
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path[:0] = [".", "bench"]
import kermac_like as km  # noqa: E402
from _timing import time_calls  # noqa: E402
from kermac_like import config  # noqa: E402
from kermac_like.plan import logsumexp as plan_lse  # noqa: E402

DESC = km.preset("gaussian_l2")


def time_fn(fn, make, reps):
    """Median ms of ``reps`` calls on fresh inputs after one warm-up (bench/_timing.py)."""
    return time_calls(fn, make, torch.device("cuda"), repeats=reps, warmup=1).median_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=10 ** 6)
    args = ap.parse_args()
    dev, n, K = torch.device("cuda"), args.n, 3
    def make(weights=torch.randn):
        return torch.randn(n, K, device=dev), torch.randn(n, K, device=dev), weights(n, 1, device=dev)

    mv = time_fn(lambda x, y, v: km.kernel_matvec(DESC, x, y, v, bandwidth=1.0), lambda: make(torch.rand), args.reps)
    rows = [("kernel_matvec", mv, None)]
    g = torch.Generator(device=dev).manual_seed(7)
    x, y, w = torch.randn(256, K, device=dev, generator=g), torch.randn(n, K, device=dev, generator=g), \
        torch.randn(n, 1, device=dev, generator=g)
    refs = {bw: km.kernel_logsumexp(DESC, x.double(), y.double(), w.double(), bandwidth=bw) for bw in (1.0, 1e-3)}
    for label, expand in (("logsumexp shipped", True), ("logsumexp EXPAND=0", False)):
        with config.override(lse_expand=expand):
            ms = time_fn(lambda a, b, c: km.kernel_logsumexp(DESC, a, b, c, bandwidth=1.0), make, args.reps)
            got_again = {bw: (km.kernel_logsumexp(DESC, x, y, w, bandwidth=bw),
                              km.kernel_logsumexp(DESC, x, y, w, bandwidth=bw)) for bw in (1.0, 1e-3)}
        checks = []
        for bw in (1.0, 1e-3):
            got, again = got_again[bw]
            same = torch.equal(got.view(torch.int32), again.view(torch.int32))
            err = ((got.double() - refs[bw]).abs() / refs[bw].abs().clamp_min(1)).max().item()
            flag = plan_lse.expand_params(DESC, x, y, bw)[0].item() if expand else 0.0
            checks.append((bw, err, same, flag))
        rows.append((label, ms, checks))
        print(label, ms, checks, flush=True)
    print(f"\ndevice {torch.cuda.get_device_name()}, M = N = {n:.0e}, D = 3, C = 1, bandwidth 1.0 (timed)")
    print(f"{'kernel':<20} {'ms':>8} {'/matvec':>8}  {'err bw 1.0':>10} {'err bw 1e-3':>11} {'bits':>5} "
          f"{'expanded':>9}")
    for label, ms, checks in rows:
        if checks is None:
            print(f"{label:<20} {ms:8.1f} {1.0:8.2f}")
            continue
        (b1, e1, s1, f1), (b2, e2, s2, f2) = checks
        flag = f"{int(f1)}/{int(f2)}"
        ok = "" if max(e1, e2) <= 1e-5 and s1 and s2 else "  <-- FAILS"
        print(f"{label:<20} {ms:8.1f} {ms / mv:8.2f}  {e1:10.2e} {e2:11.2e} {'same' if s1 and s2 else 'DIFF':>5} "
              f"{flag:>9}{ok}")


if __name__ == "__main__":
    main()
