"""One-shot tuning run for the two SIMT kernel families (distance.cuh, cdist_grad.cuh).

Run once on the GPU machine from the repository root (PYTHONPATH = repo root):

    python3 bench/probes/try_simt.py            # ~1.5-2.5 min on an H200
    python3 bench/probes/try_simt.py --quick    # smaller sizes, a smoke test

For every variant (a traits tuning, see VARIANTS below): compile (registers and
spills from ptxas), check a small odd-size case against float64 with a
poisoned output (padding must stay NaN), then time the full workload with CUDA
events (median of REPS calls after one warm-up, fresh random data per variant)
while a background thread samples the SM clock and power (NVML or nvidia-smi).
A variant that fails to compile, to launch or to match is reported, not fatal.
The last lines are the table: variant, workload, ms, rel err, regs, spill
bytes, SM MHz, W.

Workloads: cdist p = 1, 2 (exact SIMT path, the `donot_use_mm_for_euclid_dist`
semantics), 1.3 at 30000 x 30000 x 1024; cdist_grad p = 1, 2, 1.3 at L = 2,
K = M = 10000, N = 768, O = 16; plus torch's two-matmul formulation of
cdist_grad p = 2 (fp32, TF32 off) as the same-run reference.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import torch

from kermac_like.runtime.compiler import arch_of_device, compile_specs
from kermac_like.descriptor import PRESETS
from kermac_like.layout import Layout
from kermac_like.runtime.launcher import get_kernel, launch
from kermac_like.runtime.specs import DISTANCE_TUNING, GRAD_TUNING, distance_spec, grad_spec

# (label, tuning, workloads it runs on).  Distance tuning = (kPolyPer64,
# kBlockK, kMinBlocksPerSm); grad tuning = (kSignFma, kMinBlocksPerSM).
DIST_VARIANTS = [
    ("base", DISTANCE_TUNING, ("p1", "p2", "p1.3")),
    ("bk64", (41, 64, 1), ("p1", "p2", "p1.3")),        # half the barriers per k
    ("2blk_bk16", (41, 16, 2), ("p1", "p2")),           # 16 warps/SM, totals in smem
    ("poly36", (36, 32, 1), ("p1.3",)),                 # MUFU-bound side of the balance
    ("poly48", (48, 32, 1), ("p1.3",)),                 # issue-bound side: MUFU pipe ~85 %
    ("2blk_poly44", (44, 16, 2), ("p1.3",)),            # (41 spills 2 words/tile at 128 regs)
    ("2blk_poly48", (48, 16, 2), ("p1.3",)),
]
GRAD_VARIANTS = [
    ("base", GRAD_TUNING, ("p1", "p2", "p1.3")),
    ("signfma", (1, 2), ("p1",)),                       # p = 1 sign on the FMA pipe
]
DIST_P = {"p1": ("l1", 1.0), "p2": ("l2", 2.0), "p1.3": ("p_norm", 1.3)}
GRAD_P = {"p1": ("abs", 1.0), "p2": ("square", 2.0), "p1.3": ("pow", 1.3)}

ROWS: list = []


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------ clock monitor
class ClockMonitor:
    """Samples the SM clock (MHz) and power (W) while active."""

    def __init__(self, device: int):
        self.device = device
        self.samples: list = []
        self._stop = threading.Event()
        self._thread = None
        self._nvml = None
        try:
            import pynvml  # type: ignore

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(device))
        except Exception:
            self._nvml = None

    def _sample(self):
        if self._nvml is not None:
            nv, h = self._nvml
            clk = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            pw = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            return float(clk), float(pw)
        out = subprocess.run(
            ["nvidia-smi", "-i", str(self.device), "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip().split(",")
        return float(out[0]), float(out[1])

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self._sample())
            except Exception:
                return
            time.sleep(0.02)

    def __enter__(self):
        self.samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)

    def summary(self):
        # drop the first samples (clocks ramp up during the warm-up)
        s = self.samples[len(self.samples) // 4:] or self.samples
        if not s:
            return "n/a", "n/a"
        return f"{statistics.median(x[0] for x in s):.0f}", f"{statistics.median(x[1] for x in s):.0f}"


# ---------------------------------------------------------------------- helpers
def compile_and_load(spec, device, arch):
    """(LoadedKernel, ptxas resources) — compiled here to read registers/spills."""
    from kermac_like.runtime.cache import get_cache

    record, resources = compile_specs([spec], arch)
    get_cache().put(record)
    res = resources.get(spec.name_expression, {})
    return get_kernel(spec, device), res


def time_calls(fn, reps: int, make_inputs, mon: ClockMonitor | None):
    """Median ms of `reps` timed calls after one warm-up; fresh inputs first."""
    inputs = make_inputs()
    fn(*inputs)  # warm-up
    torch.cuda.synchronize()
    times = []
    ctx = mon if mon is not None else _Null()
    with ctx:
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(*inputs)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    return statistics.median(times), times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def rel_fro(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.double()
    return float(torch.linalg.norm(got - ref) / max(float(torch.linalg.norm(ref)), 1e-300))


def record(variant, workload, ms, err, res, clk=("n/a", "n/a"), note=""):
    regs = res.get("registers", "?") if res else "?"
    spill = (res.get("spill_stores", 0) or 0) + (res.get("spill_loads", 0) or 0) if res else "?"
    ROWS.append((variant, workload, ms, err, regs, spill, clk[0], clk[1], note))


# --------------------------------------------------------------------- distance
def dist_args(a, b, out, M, N, K, ldo, p):
    z = np.int64(0)
    args = [a.data_ptr(), b.data_ptr(), out.data_ptr(), np.int32(M), np.int32(N), np.int32(K),
            np.int64(a.stride(0)), np.int64(b.stride(0)), np.int64(ldo),
            np.int32(1), np.int32(1), np.int32(1), *([z] * 9)]
    for v in (p, p, 0.0, 0.0):  # inner_p, outer_p, bandwidth, regularization (scalars)
        args += [0, z, z, z, np.float32(v)]
    args += [z, np.float32(-np.inf)]  # reg_diag, epsilon (cut disabled)
    return tuple(args)


def dist_ref(a, b, p):
    return torch.cdist(a.double(), b.double(), p=p)


def run_distance(device, arch, full, reps, mon):
    M = N = 30000 if full else 4096
    K = 1024 if full else 512
    for label, tuning, works in DIST_VARIANTS:
        for w in works:
            preset, p = DIST_P[w]
            name = f"dist/{label}"
            res = None
            try:
                spec = distance_spec(PRESETS[preset], Layout.ROW_MAJOR, Layout.ROW_MAJOR, Layout.ROW_MAJOR, 1,
                                     tuning=tuning)
                kern, res = compile_and_load(spec, device, arch)
            except Exception as exc:  # compile failure: report and go on
                record(name, f"cdist {w}", float("nan"), float("nan"), res, note=f"COMPILE FAIL: {str(exc).splitlines()[0][:80]}")
                continue
            bm, bn = spec.launch.block_m, spec.launch.block_n
            try:
                # correctness: odd sizes, K past two 256-k partial sums, padded poisoned output
                m, n, k = 257, 131, 601
                g = torch.Generator(device="cuda").manual_seed(1)
                a = torch.randn(m, k, device="cuda", generator=g)
                b = torch.randn(n, k, device="cuda", generator=g)
                if w == "p1.3":
                    b[:3] = a[:3]  # identical rows: exact zeros on both exp2 pipes
                ldo = n + 3
                buf = torch.full((m, ldo), float("nan"), device="cuda")
                launch(kern, (math.ceil(m / bm), math.ceil(n / bn), 1), dist_args(a, b, buf, m, n, k, ldo, p))
                torch.cuda.synchronize()
                got = buf[:, :n]
                err = rel_fro(got, dist_ref(a, b, p))
                note = ""
                if not torch.isnan(buf[:, n:]).all():
                    note = "WROTE PADDING"
                elif torch.isnan(got).any():
                    note = "NaN OUTPUT"
                elif err > 1e-5:
                    note = "WRONG?"  # still timed: the error is in the table
                if w == "p1.3" and note != "WRONG?" and bool((got.diagonal()[:3] != 0).any()):
                    note = "NONZERO SELF-DISTANCE"
                if note and note != "WRONG?":
                    record(name, f"cdist {w}", float("nan"), err, res, note=note)
                    continue
                out = torch.empty(M, N, device="cuda")

                def make():
                    return (torch.rand(M, K, device="cuda"), torch.rand(N, K, device="cuda"))

                def fn(x, y):
                    launch(kern, (math.ceil(M / bm), math.ceil(N / bn), 1), dist_args(x, y, out, M, N, K, N, p))

                ms, _ = time_calls(fn, reps, make, mon)
                record(name, f"cdist {w}", ms, err, res, mon.summary() if mon else ("n/a", "n/a"), note)
                log(f"{name:24s} cdist {w:5s} {ms:9.2f} ms  err {err:.1e}  regs {res.get('registers')}")

            except Exception as exc:
                record(name, f"cdist {w}", float("nan"), float("nan"), res, note=f"RUN FAIL: {str(exc).splitlines()[0][:80]}")
                traceback.print_exc()
                if "illegal" in str(exc).lower() or "launch failure" in str(exc).lower():
                    raise SystemExit("sticky CUDA error: the context is lost; rerun without this variant")


# ------------------------------------------------------------------- cdist_grad
def grad_args(a, b, c, d, out, L, K, M, N, O, p):
    return (
        a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), out.data_ptr(),
        np.int32(M), np.int32(N), np.int32(K), np.int32(O),
        np.int64(a.stride(-2)), np.int64(b.stride(-2)), np.int64(c.stride(-2)), np.int64(d.stride(-2)),
        np.int64(out.stride(-3)), np.int64(out.stride(-2)),
        np.int32(L), np.int64(a.stride(0)), np.int64(b.stride(0)), np.int64(c.stride(0)), np.int64(d.stride(0)),
        np.int64(out.stride(0)),
        0, np.int64(0), np.float32(p),
    )


def grad_ref(a, b, c, d, p):
    a, b, c, d = (t.double() for t in (a, b, c, d))
    diff = d[:, :, :, None] - b[:, :, None, :]  # (L, N, M, K)
    w = torch.sign(diff) * diff.abs().pow(p - 1) if p != 1 else torch.sign(diff)
    w = torch.where(diff == 0, torch.zeros_like(w), w)
    return torch.einsum("lok,lkm,lnmk->lonm", c, a, w)


def run_grad(device, arch, full, reps, mon):
    L, K, M, N, O = (2, 10000, 10000, 768, 16) if full else (2, 2048, 2048, 256, 16)
    for label, tuning, works in GRAD_VARIANTS:
        for w in works:
            kind, p = GRAD_P[w]
            name = f"grad/{label}"
            res = None
            try:
                spec = grad_spec(kind, 4, tuning=tuning)
                kern, res = compile_and_load(spec, device, arch)
            except Exception as exc:
                record(name, f"grad {w}", float("nan"), float("nan"), res, note=f"COMPILE FAIL: {str(exc).splitlines()[0][:80]}")
                continue
            bm, bn = spec.launch.block_m, spec.launch.block_n
            try:
                l, k, m, n, o = 2, 301, 68, 19, 16
                g = torch.Generator(device="cuda").manual_seed(2)
                a = torch.randn(l, k, m, device="cuda", generator=g)
                b = torch.randn(l, n, k, device="cuda", generator=g)
                c = torch.randn(l, o, k, device="cuda", generator=g)
                d = torch.randn(l, n, m, device="cuda", generator=g)
                d[:, :, :5] = b[:, :, :5]  # ties: sgn(0) = 0
                buf = torch.full((l, o, n, m + 4), float("nan"), device="cuda")
                got = buf[..., :m]
                launch(kern, (math.ceil(m / bm), math.ceil(n / bn), l), grad_args(a, b, c, d, got, l, k, m, n, o, p))
                torch.cuda.synchronize()
                err = rel_fro(got, grad_ref(a, b, c, d, p))
                note = ""
                if not torch.isnan(buf[..., m:]).all():
                    note = "WROTE PADDING"
                elif torch.isnan(got).any():
                    note = "NaN OUTPUT"
                elif err > 1e-5:
                    note = "WRONG?"  # still timed: the error is in the table
                if note and note != "WRONG?":
                    record(name, f"grad {w}", float("nan"), err, res, note=note)
                    continue
                out = torch.empty(L, O, N, M, device="cuda")

                def make():
                    return (torch.rand(L, K, M, device="cuda"), torch.rand(L, N, K, device="cuda"),
                            torch.randn(L, O, K, device="cuda"), torch.rand(L, N, M, device="cuda"))

                def fn(x, y, z, v):
                    launch(kern, (math.ceil(M / bm), math.ceil(N / bn), L), grad_args(x, y, z, v, out, L, K, M, N, O, p))

                ms, _ = time_calls(fn, reps, make, mon)
                record(name, f"grad {w}", ms, err, res, mon.summary() if mon else ("n/a", "n/a"), note)
                log(f"{name:24s} grad {w:5s} {ms:9.2f} ms  err {err:.1e}  regs {res.get('registers')}")

            except Exception as exc:
                record(name, f"grad {w}", float("nan"), float("nan"), res, note=f"RUN FAIL: {str(exc).splitlines()[0][:80]}")
                traceback.print_exc()
                if "illegal" in str(exc).lower() or "launch failure" in str(exc).lower():
                    raise SystemExit("sticky CUDA error: the context is lost; rerun without this variant")

    # torch reference for p = 2: out = d * (c @ a) - ((c x b) @ a), fp32 matmuls (TF32 off)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False

        def make():
            return (torch.rand(L, K, M, device="cuda"), torch.rand(L, N, K, device="cuda"),
                    torch.randn(L, O, K, device="cuda"), torch.rand(L, N, M, device="cuda"))

        def fn(a, b, c, d):
            ca = torch.bmm(c, a)  # (L, O, M)
            cb = (c[:, :, None, :] * b[:, None, :, :]).reshape(L, O * N, K)
            x = torch.bmm(cb, a).view(L, O, N, M)
            return d[:, None] * ca[:, :, None, :] - x

        ms, _ = time_calls(fn, reps, make, mon)
        record("torch/two-matmul", "grad p2", ms, float("nan"), None, mon.summary() if mon else ("n/a", "n/a"))
        log(f"torch two-matmul grad p2 {ms:9.2f} ms")
    except Exception as exc:
        record("torch/two-matmul", "grad p2", float("nan"), float("nan"), None, note=f"FAIL: {exc}"[:80])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--only", choices=("distance", "grad"), default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("try_simt.py needs a CUDA device")
    device = torch.cuda.current_device()
    arch = arch_of_device(device)
    log(f"device {torch.cuda.get_device_name(device)} ({arch}), torch {torch.__version__}")
    mon = ClockMonitor(device)
    t0 = time.perf_counter()
    if args.only in (None, "distance"):
        run_distance(device, arch, not args.quick, args.reps, mon)
    if args.only in (None, "grad"):
        run_grad(device, arch, not args.quick, args.reps, mon)
    log(f"\ntotal {time.perf_counter() - t0:.0f} s; medians of {args.reps} after a warm-up"
        f"{' (QUICK sizes)' if args.quick else ''}")
    log(f"{'variant':22s} {'workload':11s} {'ms':>9s} {'rel err':>9s} {'regs':>5s} {'spill':>5s} {'MHz':>5s} {'W':>4s}  note")
    for v, wl, ms, err, regs, spill, clk, pw, note in ROWS:
        log(f"{v:22s} {wl:11s} {ms:9.2f} {err:9.1e} {str(regs):>5s} {str(spill):>5s} {clk:>5s} {pw:>4s}  {note}")


if __name__ == "__main__":
    main()
