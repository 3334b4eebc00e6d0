"""Every kernel kind on the low-K sweep (the data behind plan/autotune.py's default table).

    python bench/probes/lowk_candidates.py [--quick] [--json out.json]

For cdist p=1, p=2, laplace_l2, gaussian_l2 at M = N = 20 000 and K in the sweep: the
low-K kernel (compile-time bucket and the run-time-K variant, 2 blocks per SM; 1 and 3
blocks at K = 3 and 37), the K-blocked SIMT kernel and the tensor-core kernel, out= given,
CUDA events (median of fresh-input calls, bench/_timing.py), the write floor (out.fill_)
in the same run; then cdist p=1 at 30000^2 x 1024 (SIMT tunings, the run-time-K low-K
kernel with its error) and 1000 problems of 256 x 256 (one launch).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kermac_like as km  # noqa: E402
from bench._timing import time_calls  # noqa: E402
from kermac_like.plan import distance  # noqa: E402
from kermac_like.ops.distance import COMPUTE_MODES, prepare_call  # noqa: E402
from kermac_like.plan import autotune as tuning  # noqa: E402
from kermac_like.runtime import specs as render  # noqa: E402

OPS = {"cdist_p1": ("l1", {}), "cdist_p2": ("l2", {}), "laplace_l2": ("laplace_l2", {"bw": 1}),
       "gaussian_l2": ("gaussian_l2", {"bw": 1})}


def launcher(desc, kw, out, kind, *, generic=False, min_blocks=None, tuning_=None, threads_n=None, mufu=True,
             spec_kw=None):
    """``spec_kw``: further keywords of render.lowk_spec (tiles_n, ...)."""
    orig_lowk, orig_simt = distance.lowk_spec, distance.distance_spec
    # Made once: the plan keeps templates under these replacements (plan.distance.spec_override).
    repl = {"lowk_generic_max_k": 1 << 20}
    if generic or min_blocks or threads_n or not mufu or spec_kw:
        repl["lowk_spec"] = lambda d, la, lb, K, mm_nonfinite=False, tiles_n=None: orig_lowk(
            d, la, lb, render.LOWK_MAX_K + 1 if generic else K,
            min_blocks=min_blocks or render.LOWK_MIN_BLOCKS, threads_n=threads_n, mufu_epilogue=mufu,
            mm_nonfinite=mm_nonfinite and not generic,
            **{"tiles_n": None if generic else tiles_n, **(spec_kw or {})})
    if tuning_:
        repl["distance_spec"] = lambda *x, **y: orig_simt(*x, tuning=tuning_)

    def fn(a, b):
        with distance.spec_override(**repl):
            call = prepare_call(desc, a, b, **kw)
            distance._plan_distance_gpu(call, out, COMPUTE_MODES[0], False, distance.Settings.current(), kind).run()
        return out
    return fn


def VARIANTS(K):
    """lowk: the default spec (tile by K, MUFU epilogue); lowk_ieee: IEEE sqrtf/expf epilogue."""
    v = [("lowk", dict(kind=tuning.LOWK)), ("lowk_ieee", dict(kind=tuning.LOWK, mufu=False)),
         ("lowk_tn16", dict(kind=tuning.LOWK, threads_n=16)), ("lowk_tn32", dict(kind=tuning.LOWK, threads_n=32)),
         ("simt", dict(kind=tuning.SIMT))]
    if K > 8:
        v.insert(1, ("lowk_generic", dict(kind=tuning.LOWK, generic=True)))
    return v


def precompile(ks):
    """Every low-K instantiation the sweep launches, in parallel processes."""
    import os

    from kermac_like.runtime.compiler import arch_of_device, precompile_specs
    from kermac_like.layout import Layout

    R = Layout.ROW_MAJOR
    specs = []
    for pname, _ in OPS.values():
        d = km.preset(pname)
        for K in ks:
            for t in (16, 32):
                specs.append(render.lowk_spec(d, R, R, K, threads_n=t))
            specs.append(render.lowk_spec(d, R, R, K, mufu_epilogue=False))
        specs.append(render.lowk_spec(d, R, R, 1000))
        specs.append(render.distance_spec(d, R, R, R, 1))
    print(precompile_specs(specs, arch_of_device(torch.device("cuda")), processes=os.cpu_count()), flush=True)


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 8, 16, 32, 37, 64, 128])
    ap.add_argument("--k1024", action="store_true", help="also cdist p=1 at 30000^2 x 1024")
    args = ap.parse_args()
    dev = torch.device("cuda")
    M = N = 2000 if args.quick else 20000
    ks = tuple(args.ks)
    precompile(ks)
    out = torch.empty(M, N, device=dev)
    floor = time_calls(lambda o: o.fill_(1.0), lambda: (out,), dev, repeats=args.reps, warmup=2).median_ms
    print(f"write floor {M}x{N}: {floor:.4f} ms", flush=True)
    res = {"floor_ms": floor, "rows": []}
    for K in ks:
        make = lambda K=K: (torch.randn(M, K, device=dev), torch.randn(N, K, device=dev))  # noqa: E731
        for op, (pname, extra) in OPS.items():
            desc = km.preset(pname)
            kw = {"bandwidth": math.sqrt(2.0 * K)} if extra else {}
            variants = VARIANTS(K)
            if desc.is_euclidean:
                variants.append(("tensor_core", dict(kind=tuning.TENSOR_CORE)))
            row = {"op": op, "K": K}
            for name, v in variants:
                fn = launcher(desc, kw, out, **v)
                t = time_calls(fn, make, dev, repeats=args.reps, warmup=2, keep_last=True)
                a, b = t.last_inputs
                ref = distance.distance_reference(desc, a[:256].double(), b.double(),
                                                  bandwidth=kw.get("bandwidth"))
                row[name] = round(t.median_ms, 4)
                row[name + "_err"] = float(f"{rel(out[:256], ref):.2e}")
            tt = time_calls(lambda a, b: torch.cdist(a, b, p=1.0 if op == "cdist_p1" else 2.0), make, dev,
                            repeats=2 if op == "cdist_p1" else args.reps, warmup=1)
            row["torch"] = round(tt.median_ms, 4)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    del out
    if args.k1024:  # cdist p=1 at 30000^2 x 1024: the SIMT kernel (default and kBlockK 64), the run-time-K low-K kernel
        M2 = 3000 if args.quick else 30000
        out = torch.empty(M2, M2, device=dev)
        make = lambda: (torch.randn(M2, 1024, device=dev), torch.randn(M2, 1024, device=dev))  # noqa: E731
        big = {}
        for name, v in [("simt", dict(kind=tuning.SIMT)), ("simt_bk64", dict(kind=tuning.SIMT, tuning_=(41, 64, 1))),
                        ("lowk_generic", dict(kind=tuning.LOWK, generic=True))]:
            fn = launcher(km.preset("l1"), {}, out, **v)
            t = time_calls(fn, make, dev, repeats=5, warmup=1, keep_last=True)
            a, b = t.last_inputs
            err = rel(out[:128], torch.cdist(a[:128].double(), b.double(), 1.0))
            big[name] = (round(t.median_ms, 3), float(f"{err:.2e}"))
            print(f"K=1024 p=1 {M2}^2 {name}: {t.median_ms:.2f} ms err {err:.2e}", flush=True)
        res["k1024_p1"] = big
        del out
    # 1000 problems of 256 x 256, K = 3, one bandwidth each
    L = 1000
    bw = torch.linspace(0.5, 4.0, L, device=dev)
    bout = torch.empty(L, 256, 256, device=dev)
    bfloor = time_calls(lambda o: o.fill_(1.0), lambda: (bout,), dev, repeats=args.reps, warmup=2).median_ms
    make = lambda: (torch.randn(L, 256, 3, device=dev), torch.randn(L, 256, 3, device=dev))  # noqa: E731
    t = time_calls(lambda a, b: km.run_kernel(km.preset("laplace_l2"), a, b, bandwidth=bw, out=bout), make, dev,
                   repeats=args.reps, warmup=2)
    tt = time_calls(lambda a, b: torch.cdist(a, b).div_(-bw[:, None, None]).exp_(), make, dev, repeats=args.reps,
                    warmup=2)
    res["batch"] = {"ours": t.median_ms, "torch": tt.median_ms, "floor": bfloor}
    print(f"batch 1000x256x256x3 laplace: ours {t.median_ms:.4f} torch {tt.median_ms:.4f} floor {bfloor:.4f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))
    # short table last
    cols = ["lowk", "lowk_ieee", "lowk_tn16", "lowk_tn32", "lowk_generic", "simt", "tensor_core", "torch"]
    print("\n| op | K | " + " | ".join(cols) + " |")
    for r in res["rows"]:
        print(f"| {r['op']} | {r['K']} | " + " | ".join(f"{r[k]:.3f}" if k in r else "-" for k in cols) + " |")
    print(f"floor {floor:.4f} ms")


if __name__ == "__main__":
    main()
