"""knn's groups about centres (issue 42, ops/knn.py `_mma_rows`): per family and setting knn_groups,
the call's time (CUDA events, median after warm-up), the rows left to the fused SIMT fallback, and the
grouping's own cost (anchors, assignment, centres), on bench/datasets.py pairs as bench/run.py's
robustness knn rows draw them (queries near y's rows).

    python3 bench/probes/knn_groups_probe.py [--n 100000] [--d 128] [--k 10] [--families a,b] [--reps 5]
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import kermac_like as km  # noqa: E402
from _timing import time_calls  # noqa: E402
from bench import datasets  # noqa: E402
from kermac_like import testing  # noqa: E402
from kermac_like.centring import pair_reference  # noqa: E402
from kermac_like.ops import knn as knn_mod  # noqa: E402


def timed(fn, reps):
    """Median ms of ``reps`` calls of fn() after two untimed ones (bench/_timing.py)."""
    return time_calls(lambda: fn(), tuple, torch.device("cuda"), repeats=reps, warmup=2).median_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--families", default="gaussian,blobs_wide,blobs_tight,onehot,relu")
    args = ap.parse_args()
    recomputed = []
    real = knn_mod.recompute_rows
    knn_mod.recompute_rows = lambda call, v, i, rows, *a: recomputed.append(int(rows.numel())) or real(call, v, i, rows, *a)
    print("| family | knn_groups | ms | rows to the fallback | grouping alone (ms) | ratio |")
    print("|---|---|---|---|---|---|")
    for name in args.families.split(","):
        x, y = datasets.pair(name, args.n, args.n, args.d, near=True, device="cuda")
        s = pair_reference(x, y)

        def grouping():
            rows, ratio = knn_mod.sample_groups(x, s)
            knn_mod.row_groups(x, s, x[rows])
            return float(ratio)

        g_ms = timed(grouping, args.reps)
        ratio = grouping()
        for mode in ("off", "on", "auto"):
            with testing.override(knn_groups=mode):
                ms = timed(lambda: km.knn(x, y, args.k), args.reps)
                recomputed.clear()
                km.knn(x, y, args.k)
                torch.cuda.synchronize()
            print(f"| {name} | {mode} | {ms:.2f} | {sum(recomputed)} | {g_ms:.2f} | {ratio:.3g} |", flush=True)


if __name__ == "__main__":
    main()
