"""cdist_grad on tensor cores (cdist_grad_mma.cuh) beside the SIMT kernel and torch.einsum.

    PYTHONPATH=. python3 bench/probes/try_grad_mma.py

1. correctness sweep of the mma kernel (KERMAC_LIKE_GRAD_MMA=1) against the float64
   reference: p in {1, 1.3, 2, 3}, O in {1, 3, 16, 33}, odd sizes, batch broadcast,
   p tensor, NaN-poisoned out;
2. each tuning variant of VARIANTS (CdistGradMmaTraits knobs) on 3 odd-size cases, p = 1, 2;
3. timing of L=2, K=10000, M=10000, N=768, O=16 for p = 2, 1: SIMT, every variant (two
   blocks per SM) and torch.einsum of the p = 2 identity; median of 5
   CUDA-event timings after a warm-up, fresh random data per call; an error check of
   each kernel on a slice of its last output against float64.
Each case catches its own failure; the table comes last.  Budget: < 3 minutes on an H200.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KERMAC_LIKE_CACHE_DIR", tempfile.mkdtemp(prefix="kermac_like_try_grad_mma_"))

import torch  # noqa: E402

import kermac_like as km  # noqa: E402
from kermac_like.plan import cdist_grad as grad_mod  # noqa: E402  (the planner picks the grad spec)
from kermac_like.reference import cdist_grad_reference  # noqa: E402
from kermac_like.runtime.specs import GRAD_MMA_KINDS, grad_mma_spec, grad_spec  # noqa: E402

ORIG_SPEC = grad_mod.grad_kernel_spec


def set_mma(on: bool):
    os.environ["KERMAC_LIKE_GRAD_MMA"] = "1" if on else "0"


def correctness():
    rows = []
    set_mma(True)
    cases = [  # p, O, K, M, N, L, p_tensor
        (1.0, 1, 127, 129, 7, 1, False),
        (1.3, 3, 1000, 127, 129, 2, False),
        (2.0, 16, 129, 1000, 127, 2, False),
        (3.0, 33, 7, 1, 129, 1, False),
        (2.0, 33, 1, 7, 1, 3, False),
        (1.0, 16, 1000, 128, 33, 2, False),
        (0.5, 3, 129, 7, 127, 1, False),
        (1.3, 16, 1000, 1000, 7, 3, True),
        (2.0, 16, 4000, 256, 32, 2, False),
    ]
    g = torch.Generator(device="cuda").manual_seed(7)
    for p, O, K, M, N, L, pt in cases:
        name = f"p={p} O={O} K={K} M={M} N={N} L={L}{' ptensor' if pt else ''}"
        try:
            r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
            a, b, c, d = r(L, K, M), r(1, N, K), r(L, O, K), r(L, N, M)
            d[..., : min(M, K)] = b[..., : min(M, K)]
            pv = torch.tensor([p, 1.0, 2.0][:L], device="cuda") if pt else p
            out = torch.full((L, O, N, M), float("nan"), device="cuda")
            km.cdist_grad(a, b, c, d, p=pv, out=out)
            ref = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(),
                                       pv.double() if pt else p)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            tol = 2e-6 if (not pt and p in (1.0, 2.0)) else 1e-5
            ok = bool(torch.isfinite(out).all()) and err <= tol
            rows.append((name, "ok" if ok else "FAIL", f"{err:.2e}"))
        except Exception as e:  # noqa: BLE001
            rows.append((name, "ERROR", repr(e)[:120]))
            traceback.print_exc()
    return rows


def timed(fn, make, reps=5):
    fn(*make())
    torch.cuda.synchronize()
    ts, out, args = [], None, None
    for _ in range(reps):
        out = args = None
        args = make()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn(*args)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts), args, out


def slice_err(args, out, p):
    a, b, c, d = args
    sl, ms = slice(0, 32), slice(0, 2048)  # 32 n x 2048 m of entry 0, all K and O
    ref = cdist_grad_reference(a[:1, :, ms].double(), b[:1, sl].double(), c[:1].double(), d[:1, sl, ms].double(), p)
    got = out[:1, :, sl, ms].double()
    return ((got - ref).norm() / ref.norm()).item()


# Tuning variants of CdistGradMmaTraits (grad_mma_spec keywords; all two blocks per SM).
# SASS (sm_90, p = 2) issue slots per HMMA in the k loop incl. loader/flush: base 7.4,
# f128 7.0, u4f128 6.5, tw 6.9, tw-u4f128 5.8, bk64-u4f128 6.5.
VARIANTS = [
    ("base", {}),
    ("f128", dict(flush_k=128)),
    ("u4f128", dict(unroll_k=4, flush_k=128)),
    ("tw", dict(trunc_w=True)),
    ("tw-u4f128", dict(trunc_w=True, unroll_k=4, flush_k=128)),
    ("bk64-u4f128", dict(block_k=64, unroll_k=4, flush_k=128)),
]


def use_variant(kw):
    """Route km.cdist_grad's tensor-core p = 1 / p = 2 path to the variant ``kw``."""
    def spec(kind, vec, *, tensor_cores=True):
        if tensor_cores and kind in GRAD_MMA_KINDS:
            return grad_mma_spec(kind, vec, min_blocks=2, **kw)
        return grad_spec(kind, vec)
    grad_mod.grad_kernel_spec = spec


def variant_correctness():
    """Every variant on odd sizes (K past several flush periods, ragged tiles), p = 1, 2."""
    rows = []
    set_mma(True)
    cases = [(2.0, 16, 1000, 1000, 33, 2), (1.0, 33, 777, 131, 19, 1), (2.0, 3, 10000, 67, 5, 1)]
    g = torch.Generator(device="cuda").manual_seed(11)
    for label, kw in VARIANTS:
        for p, O, K, M, N, L in cases:
            name = f"{label} p={p} O={O} K={K} M={M} N={N} L={L}"
            try:
                use_variant(kw)
                r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
                a, b, c, d = r(L, K, M), r(L, N, K), r(L, O, K), r(L, N, M)
                d[..., : min(M, K)] = b[..., : min(M, K)]
                out = torch.full((L, O, N, M), float("nan"), device="cuda")
                km.cdist_grad(a, b, c, d, p=p, out=out)
                ref = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(), p)
                err = ((out.double() - ref).norm() / ref.norm()).item()
                ok = bool(torch.isfinite(out).all()) and err <= 2e-6
                rows.append((name, "ok" if ok else "FAIL", f"{err:.2e}"))
            except Exception as e:  # noqa: BLE001
                rows.append((name, "ERROR", repr(e)[:120]))
                traceback.print_exc()
            finally:
                grad_mod.grad_kernel_spec = ORIG_SPEC
    return rows


def timing():
    L, K, M, N, O = 2, 10000, 10000, 768, 16
    rows = []

    def make():
        return (torch.randn(L, K, M, device="cuda"), torch.randn(L, N, K, device="cuda"),
                torch.randn(L, O, K, device="cuda"), torch.randn(L, N, M, device="cuda"))

    for p in (2.0, 1.0):
        for label, kw in [("simt", None)] + VARIANTS:
            name = f"p={p} {label}"
            try:
                set_mma(kw is not None)
                if kw is not None:
                    use_variant(kw)
                t0 = time.perf_counter()
                ms, args, out = timed(lambda a, b, c, d: km.cdist_grad(a, b, c, d, p=p), make)
                err = slice_err(args, out, p)
                rows.append((name, f"{ms:.1f} ms", f"err {err:.2e}", f"({time.perf_counter() - t0:.0f} s)"))
            except Exception as e:  # noqa: BLE001
                rows.append((name, "ERROR", repr(e)[:120], ""))
                traceback.print_exc()
            finally:
                grad_mod.grad_kernel_spec = ORIG_SPEC
            print(*rows[-1], flush=True)
            torch.cuda.empty_cache()
    try:
        def ein(c_, a_, b_, d_):
            return torch.einsum("lok,lkm,lnm->lonm", c_, a_, d_) - torch.einsum("lok,lnk,lkm->lonm", c_, b_, a_)

        ms, args, out = timed(lambda a, b, c, d: ein(c, a, b, d), make)
        rows.append(("p=2 torch.einsum identity", f"{ms:.1f} ms", f"err {slice_err(args, out, 2.0):.2e}", ""))
    except Exception as e:  # noqa: BLE001
        rows.append(("p=2 torch.einsum identity", "ERROR", repr(e)[:120], ""))
    print(*rows[-1], flush=True)
    return rows


def main():
    t0 = time.perf_counter()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    corr = correctness()
    for r in corr:
        print(*r, flush=True)
    vcorr = variant_correctness()
    for r in vcorr:
        print(*r, flush=True)
    tim = timing()
    print("\n== correctness (mma kernel, rel. error vs float64) ==")
    for r in corr:
        print(f"  {r[0]:48s} {r[1]:6s} {r[2]}")
    print("== correctness of the tuning variants (tol 2e-6) ==")
    for r in vcorr:
        print(f"  {r[0]:56s} {r[1]:6s} {r[2]}")
    print("== timing L=2 K=10000 M=10000 N=768 O=16 (median of 5) ==")
    for r in tim:
        print(f"  {r[0]:32s} {r[1]:>10s}  {r[2]} {r[3]}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
