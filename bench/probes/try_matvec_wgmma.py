"""kernel_matvec on Hopper (cuda_templates/matvec_wgmma.cuh, plan.matvec_wgmma._plan_matvec_wgmma): one
GPU call that checks and times the fused tensor-core matvec.

1. compile lines: NVRTC seconds, registers and spills of the instantiations used below;
2. correctness vs float64 (scaled error |out - ref| / (|K| @ |v|), PASS below 2e-5): every
   Euclidean descriptor and DOT at odd M/N/K with C = 1, 5, 16, then x is y (exact self
   distance) with a regularised diagonal crossing tiles, batches with broadcast v and
   bandwidth tensors, few rows (split N range, bitwise repeatable), the N range in several
   launches (carry), epsilon, 2e6 positive terms, NaN rows;
3. timing (CUDA events, median of --reps after one warm-up, fresh randn data per call) of
   the Gaussian (bw 16) at D = --d, N = M = --n, C = 1 and 16: the fused kernel against
   plan.matvec_blocked (run_kernel tiles times v), with the relative Frobenius error vs
   float64 on 256 sampled rows and the peak extra GPU memory of the call.

    python bench/probes/try_matvec_wgmma.py [--n 200000] [--d 256] [--reps 3] [--only compile,correct,time]

Each case catches its own exceptions (reported as FAIL with the message); a short table
comes last. About 1-2 minutes on an H200 (most of it compiling).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kermac_like as km  # noqa: E402
from kermac_like import matvec as mv  # noqa: E402
from kermac_like import plan as P  # noqa: E402
from kermac_like.plan import matvec_wgmma as PW  # noqa: E402
from kermac_like.runtime.specs import matvec_wgmma as mw  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from try_matvec import timed  # noqa: E402  (CUDA-event medians on fresh inputs)

EUCLID = ("l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot")
TOL = 2e-5
ROWS = []  # (section, case, status, detail)
ONLY = set()


def record(section, case, ok, detail):
    ROWS.append((section, case, "PASS" if ok else "FAIL", detail))
    print(f"[{section}] {case}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)


def guarded(section, case):
    def wrap(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (the probe reports and goes on)
            record(section, case, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            traceback.print_exc(limit=3)
        return fn
    return wrap


def hypers(desc, bw=1.0):
    return {"bandwidth": bw} if desc.needs_bandwidth else {}


def dense64(desc, x, y, bandwidth=None, regularization=None, reg_diag=0, epsilon=None):
    x, y = x.double(), y.double()
    if desc.inner_operator is km.InnerOperator.DOT:
        acc = x @ y.mT
    else:
        d = torch.cdist(x, y, compute_mode="donot_use_mm_for_euclid_dist")
        acc = d if desc.outer_power is km.PowerType.SQRT else d * d
    if epsilon is not None:
        acc = torch.where(acc < epsilon, torch.zeros_like(acc), acc)
    bw = bandwidth
    if isinstance(bw, torch.Tensor):
        bw = bw.double().reshape(*bw.shape, 1, 1)
    if desc.kernel_type is km.KernelType.LAPLACE:
        acc = torch.exp(-acc / bw)
    elif desc.kernel_type is km.KernelType.GAUSSIAN:
        acc = torch.exp(-acc * acc / (2 * bw * bw))
    if regularization is not None:
        M, N = acc.shape[-2:]
        mask = (torch.arange(N, device=x.device) - torch.arange(M, device=x.device).unsqueeze(-1)) == reg_diag
        lam = regularization
        if isinstance(lam, torch.Tensor):
            lam = lam.double().reshape(*lam.shape, 1, 1)
        acc = acc + torch.where(mask, lam * torch.ones((), dtype=torch.float64, device=x.device),
                                torch.zeros((), dtype=torch.float64, device=x.device))
    return acc


def scaled_error(desc, x, y, v, out, **h):
    reg = h.pop("regularization", None)
    ox, oy = h.pop("regularization_offset_x", 0), h.pop("regularization_offset_y", 0)
    kd = dense64(desc, x, y, regularization=reg, reg_diag=ox - oy, **h)
    vm = v.double().unsqueeze(-1) if v.dim() == 1 else v.double()
    ref, scale = kd @ vm, kd.abs() @ vm.abs()
    o = out.double().unsqueeze(-1) if v.dim() == 1 else out.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - ref).abs() / scale.clamp_min(1e-300)).max().item()


def check(section, case, desc, x, y, v, **h):
    @guarded(section, case)
    def _():
        out = km.kernel_matvec(desc, x, y, v, **h)
        call = mv.prepare_matvec(desc, x, y, v, **h)
        fam = P.plan_matvec(call, torch.empty(call.out_shape, device="cuda"), False).family
        err = scaled_error(desc, x, y, v, out, **dict(h))
        record(section, case, err < TOL and fam == "matvec_wgmma", f"scaled error {err:.2e} ({fam})")


# ---------------------------------------------------------------------- 1. compile
def compile_section():
    from kermac_like.runtime.compiler import arch_of_device, compile_specs, precompile_specs

    specs = [mw.matvec_wgmma_spec(km.preset(n), kc) for n in EUCLID for kc in (1, 2, 4, 8, 16)]
    specs.append(mw.carry_spec())
    for spec in (mw.matvec_wgmma_spec(km.preset("gaussian_l2"), 1), mw.matvec_wgmma_spec(km.preset("gaussian_l2"), 16)):
        @guarded("compile", spec.traits)
        def _():
            t0 = time.perf_counter()
            _, res = compile_specs([spec], "sm_90")
            r = next(iter(res.values()))
            record("compile", spec.traits.split("<", 1)[1][:-1], True,
                   f"{time.perf_counter() - t0:.1f} s, {r.get('registers')} regs, spills {r.get('spill_stores')}/"
                   f"{r.get('spill_loads')} B")

    @guarded("compile", "precompile")
    def _():
        from kermac_like.runtime.specs import wgmma_prepare_spec, wgmma_traits_spec, Layout
        from kermac_like.runtime.specs.matvec import combine_spec

        extra = [wgmma_prepare_spec(small=s, norms=n) for s in (True, False) for n in (True, False)]
        extra += [wgmma_traits_spec(km.preset("gaussian_l2"), Layout.ROW_MAJOR), combine_spec(torch.float32)]
        t0 = time.perf_counter()
        s = precompile_specs(specs + extra, arch_of_device(0), processes=min(16, os.cpu_count() or 1))
        record("compile", "precompile", True, f"{s['compiled']} kernels in {time.perf_counter() - t0:.1f} s")


# -------------------------------------------------------------------- 2. correctness
def correct_section():
    g = torch.Generator(device="cuda").manual_seed(0)

    def rn(*s, scale=1.0):
        return torch.randn(*s, device="cuda", generator=g) * scale

    for name in EUCLID if "sweep" in ONLY else ():
        d = km.preset(name)
        for M, N, K in ((1, 1, 33), (127, 129, 37), (300, 1000, 256), (1000, 7, 40), (257, 513, 64)):
            for C in (1, 5, 16):
                s = 1.0 / math.sqrt(K)
                check("sweep", f"{name} M={M} N={N} K={K} C={C}", d, rn(M, K, scale=s), rn(N, K, scale=s), rn(N, C),
                      **hypers(d, 0.8))
    gauss, lap = km.preset("gaussian_l2"), km.preset("laplace_l2")
    # x is y: the exact zero self distance, a regularised diagonal crossing tiles
    x = rn(700, 48, scale=0.3)
    v = rn(700, 3)
    for d in (gauss, lap, km.preset("l2")):
        check("self", f"{d.short_name()} x is y, regularised +5", d, x, x, v, regularization=0.7,
              regularization_offset_x=5, **hypers(d, 0.5))

    @guarded("self", "diagonal exactly k(0)")
    def _():
        xs = 10 + rn(300, 64)  # large norms: a rounded expansion would not give 0
        v1 = torch.zeros(300, 1, device="cuda")
        v1[123] = 1
        out = km.kernel_matvec(gauss, xs, xs, v1, bandwidth=1e-3)  # only the diagonal survives
        record("self", "diagonal exactly k(0)", bool(out[123, 0] == 1.0), f"out[123] = {out[123, 0].item()!r}")

    # batches: broadcast v, a bandwidth tensor, a host loop (4 batch modes)
    xb, yb, vb = rn(2, 3, 130, 40, scale=0.2), rn(1, 3, 300, 40, scale=0.2), rn(300, 5)
    check("batch", "gaussian (2,3) batch, v broadcast, bw tensor", gauss, xb, yb, vb,
          bandwidth=torch.tensor([[0.7], [1.3]], device="cuda").expand(2, 3).contiguous(), regularization=0.25)
    x4, y4, v4 = rn(2, 1, 3, 2, 70, 36, scale=0.2), rn(1, 2, 3, 1, 90, 36, scale=0.2), rn(2, 2, 1, 2, 90, 2)
    check("batch", "laplace 4 batch modes (host loop)", lap, x4, y4, v4, bandwidth=0.9)
    check("batch", "dot strided views", km.preset("dot"), rn(64, 80)[:, ::2], rn(90, 40).t().contiguous().t(),
          rn(90, 3).t().contiguous().t())

    # few rows: the N range split over CTAs; bitwise repeatable
    @guarded("split", "gaussian M=33 N=300000 K=64 C=4, repeat")
    def _():
        xs, ys, vs = rn(33, 64, scale=0.15), rn(300000, 64, scale=0.15), rn(300000, 4)
        ys[:33] = xs
        h = dict(bandwidth=0.6, regularization=torch.tensor([2.0], device="cuda"), regularization_offset_x=5)
        a, b = km.kernel_matvec(gauss, xs, ys, vs, **h), km.kernel_matvec(gauss, xs, ys, vs, **h)
        call = mv.prepare_matvec(gauss, xs, ys, vs, **h)
        ref = mv.matvec_reference(mv.prepare_matvec(gauss, xs.double(), ys.double(), vs.double(),
                                                    bandwidth=0.6, regularization=2.0, regularization_offset_x=5))
        scale = mv.matvec_reference(mv.prepare_matvec(gauss, xs.double(), ys.double(), vs.double().abs(),
                                                      bandwidth=0.6, regularization=2.0, regularization_offset_x=5))
        err = ((a.double() - ref).abs() / scale).max().item()
        fam = P.plan_matvec(call, torch.empty(call.out_shape, device="cuda"), False)
        nl = sum(1 for k, *_ in fam.launches if "combine" in k.spec.kernel or "carry" in k.spec.kernel)
        record("split", "gaussian M=33 N=300000 K=64 C=4, repeat", torch.equal(a, b) and err < TOL and nl > 0,
               f"bitwise equal {torch.equal(a, b)}, scaled error {err:.2e}, {nl} combine/carry launches")

    # the N range in several launches (prepared y bounded), with and without splits
    old = PW.MATVEC_WGMMA_BLOCK_BYTES
    try:
        PW.MATVEC_WGMMA_BLOCK_BYTES = 3 * 256 * 48 * 4 * 2 + 3 * 1024
        xs, ys, vs = rn(600, 48, scale=0.2), rn(2000, 48, scale=0.2), rn(2000, 20)
        check("ranges", "gaussian 3-tile ranges, C=20, regularised", gauss, xs, ys, vs, bandwidth=0.9,
              regularization=0.5, regularization_offset_y=700)
        check("ranges", "l2 x is y in ranges", km.preset("l2"), ys, ys, vs[:, :1])
        PW.MATVEC_WGMMA_BLOCK_BYTES = 40 * 256 * 48 * 4 * 2 + 40 * 1024
        xs, ys, vs = rn(20, 48, scale=0.2), rn(30000, 48, scale=0.2), rn(30000, 2)
        check("ranges", "laplace few rows: splits and carry", lap, xs, ys, vs, bandwidth=0.9)
    finally:
        PW.MATVEC_WGMMA_BLOCK_BYTES = old

    check("epsilon", "laplace epsilon cut", lap, x[:100], torch.cat([x[:30], rn(200, 48) + 1]), rn(230, 2),
          bandwidth=0.9, epsilon=0.1)

    @guarded("accuracy", "2e6 positive terms")
    def _():
        xs = torch.rand(16, 64, device="cuda", generator=g)
        ys = torch.rand(2_000_000, 64, device="cuda", generator=g)
        vs = torch.rand(2_000_000, 1, device="cuda", generator=g)
        out = km.kernel_matvec(gauss, xs, ys, vs, bandwidth=10.0)
        ref = mv.matvec_reference(mv.prepare_matvec(gauss, xs.double(), ys.double(), vs.double(), bandwidth=10.0))
        rel = ((out.double() - ref).abs() / ref.abs()).max().item()
        record("accuracy", "2e6 positive terms", rel <= 1e-5, f"relative error {rel:.2e}")

    @guarded("nonfinite", "NaN row of x, inf in v")
    def _():
        xs, ys, vs = rn(6, 40), rn(300, 40), rn(300, 2)
        xs[1, 0] = float("nan")
        vs[9, 1] = float("inf")
        out = km.kernel_matvec(gauss, xs, ys, vs, bandwidth=4.0)
        ref = dense64(gauss, xs, ys, bandwidth=4.0) @ vs.double()
        ok = torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
        fin = ref.isfinite()
        ok = ok and torch.allclose(out.double()[fin], ref[fin], rtol=1e-5, atol=1e-5)
        record("nonfinite", "NaN row of x, inf in v", ok, f"nan {out.isnan().sum().item()} / {ref.isnan().sum().item()}")


# ------------------------------------------------------------------------ 3. timing
def time_section(n, d, reps):
    gauss = km.preset("gaussian_l2")
    bw = 16.0

    def fused(x, y, v):
        return km.kernel_matvec(gauss, x, y, v, bandwidth=bw)

    def blocked(x, y, v):
        call = mv.prepare_matvec(gauss, x, y, v, bandwidth=bw)
        out = torch.empty(call.out_shape, device="cuda")
        return P.matvec_blocked(call, out)

    for C in (1, 16):
        def make():
            return (torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda"),
                    torch.randn(n, C, device="cuda"))

        for label, fn in (("fused wgmma", fused), ("matvec_blocked", blocked)):
            @guarded("time", f"{label} C={C}")
            def _():
                ms_, (x, y, v), out = timed(fn, make, reps)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                fn(x, y, v)
                torch.cuda.synchronize()
                extra = (torch.cuda.max_memory_allocated() - base) / 2**20
                idx = torch.randperm(n, device="cuda")[:256]
                ref = mv.matvec_reference(mv.prepare_matvec(gauss, x[idx].double(), y.double(), v.double(),
                                                            bandwidth=bw))
                err = ((out[idx].double() - ref).norm() / ref.norm()).item()
                record("time", f"{label} C={C}", True, f"{ms_:.1f} ms, error {err:.1e}, peak extra {extra:.0f} MB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="compile,correct,time")
    a = ap.parse_args()
    only = set(a.only.split(","))
    ONLY.update(only | ({"sweep"} if "correct" in only else set()))
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), torch.__version__, flush=True)
    t0 = time.perf_counter()
    if "compile" in only:
        compile_section()
    if "correct" in only or "rest" in only:
        correct_section()
    if "time" in only:
        time_section(a.n, a.d, a.reps)
    print(f"\n== summary ({time.perf_counter() - t0:.0f} s) ==")
    fails = [r for r in ROWS if r[2] == "FAIL"]
    print(f"{len(ROWS) - len(fails)} passed, {len(fails)} failed")
    for sec, case, st, det in ROWS:
        if st == "FAIL" or sec in ("time", "compile"):
            print(f"| {sec} | {case} | {st} | {det} |")


if __name__ == "__main__":
    main()
