"""Timing and accuracy of the kernel_matvec backward on the GPU (bench/notes/matvec_grad.md).

    python3 bench/probes/matvec_grad_timing.py [--n 1000000] [--repeats 5] [--json out.json]

Gaussian-l2, D = 3, N = M = n, C = 1 (KeOps benchmark (a) and its gradient):
* the forward kernel_matvec, the backward w.r.t. x alone (the fused contraction,
  unroll 1 and 2), and the whole backward (x, y, v) through torch.autograd;
* CUDA events, medians after one warm-up, fresh random data per call;
* accuracy of dL/dx on sampled rows against the float64 blocked reference;
* peak extra GPU memory of the x-gradient at this size.
Also the x-gradient of Laplace-l1 and p-norm (p = 1.5) at n / 5 for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kermac_like as km  # noqa: E402
from kermac_like.ops import matvec_backward as mg  # noqa: E402
from kermac_like.runtime.specs import matvec_grad as specs  # noqa: E402


def cuda_ms(fn, make, repeats):
    times = []
    for i in range(repeats + 1):
        args = make()
        if not torch.cuda.is_available():  # --dry-run on a CPU: checks the script, times nothing
            fn(*args)
            times.append(0.0)
            continue
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        out = fn(*args)
        e.record()
        e.synchronize()
        if i:
            times.append(s.elapsed_time(e))
        del out, args
    return statistics.median(times[-repeats:]), times[-repeats:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (checks the script)")
    a = ap.parse_args()
    n, dev = a.n, torch.device("cpu" if a.dry_run else "cuda")
    if a.dry_run:
        torch.cuda.synchronize = lambda *_: None
        torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *_: 0
        torch.cuda.reset_peak_memory_stats = lambda *_: None
        torch.cuda.get_device_name = lambda *_: "cpu (dry run)"
    desc, bw = km.PRESETS["gaussian_l2"], 0.5
    rows = {}

    def make():
        x = torch.rand(n, 3, device=dev)
        y = torch.rand(n, 3, device=dev)
        v = torch.randn(n, 1, device=dev)
        g = torch.randn(n, 1, device=dev)
        return x, y, v, g

    fwd = lambda x, y, v, g: km.kernel_matvec(desc, x, y, v, bandwidth=bw)  # noqa: E731
    rows["forward"] = cuda_ms(fwd, make, a.repeats)
    for unroll in (2, 1):
        specs.UNROLL = unroll
        gx = lambda x, y, v, g: mg.diff_contraction(desc, x, y, g, v, bandwidth=bw)  # noqa: E731
        rows[f"grad_x unroll={unroll}"] = cuda_ms(gx, make, a.repeats)
    specs.UNROLL = 2

    def full(x, y, v, g):
        x, y, v = (t.requires_grad_(True) for t in (x, y, v))
        out = km.kernel_matvec(desc, x, y, v, bandwidth=bw)
        return torch.autograd.grad(out, (x, y, v), g)

    rows["forward + backward x,y,v"] = cuda_ms(full, make, max(1, a.repeats - 2))

    # accuracy on sampled rows and memory
    x, y, v, g = make()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = mg.diff_contraction(desc, x, y, g, v, bandwidth=bw)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    idx = torch.randperm(n, device=dev)[:256]
    ref = mg.diff_contraction_reference(desc, x[idx].double(), y.double(), g[idx].double(), v.double(), bandwidth=bw)
    err = (got[idx].double() - ref).norm(dim=1) / ref.norm(dim=1)
    fro = ((got[idx].double() - ref).norm() / ref.norm()).item()
    rep = torch.equal(got, mg.diff_contraction(desc, x, y, g, v, bandwidth=bw))

    other = {}
    m = n // 5
    for name, d, h in (("laplace_l1", km.PRESETS["laplace_l1"], dict(bandwidth=1.0)),
                       ("p_norm p=1.5", km.PRESETS["p_norm"], dict(inner_p=1.5, outer_p=1.5))):
        mk = lambda: (torch.rand(m, 3, device=dev), torch.rand(m, 3, device=dev), torch.randn(m, 1, device=dev),  # noqa: E731
                      torch.randn(m, 1, device=dev))
        other[name] = cuda_ms(lambda x, y, v, g: mg.diff_contraction(d, x, y, g, v, **h), mk, 3)[0]

    f = rows["forward"][0]
    print(f"\n== kernel_matvec backward, Gaussian-l2 D=3 N=M={n} C=1 ({torch.cuda.get_device_name(0)})")
    print(f"{'what':32s} {'median ms':>10s} {'x forward':>10s}")
    for k, (med, _) in rows.items():
        print(f"{k:32s} {med:10.2f} {med / max(f, 1e-9):10.2f}")
    print(f"grad_x rel error (256 rows): max {err.max().item():.2e} median {err.median().item():.2e} fro {fro:.2e}")
    print(f"grad_x peak extra memory: {peak / 2**20:.1f} MiB; bitwise reproducible: {rep}")
    for k, t in other.items():
        print(f"grad_x {k} N=M={m}: {t:.2f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(
            n=n, device=torch.cuda.get_device_name(0), times_ms={k: v[1] for k, v in rows.items()},
            medians_ms={k: v[0] for k, v in rows.items()}, rel_err_max=err.max().item(), rel_err_fro=fro,
            peak_extra_bytes=peak, reproducible=rep, other_ms=other), indent=1))


if __name__ == "__main__":
    main()
