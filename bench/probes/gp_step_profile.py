"""Where one gp_step (ExactGP MLL + backward, ScaleKernel(RBF), D = 8, float32, GPyTorch's
defaults, max_cholesky_size 0) spends its time and memory at N (argv[1], default 10^6):

* every kernel_matvec call the operator makes (columns, grad or not, dtype, CUDA-event ms);
* the forward (loss) and backward seconds, peak extra memory after each;
* kernel_matvec alone at this N with C = 1 and C = 11 (forward, and forward + backward), so
  that the step's time can be split into products x rate.

    python bench/probes/gp_step_profile.py [N]
"""
import collections
import sys
import time

import gpytorch
import torch

import kermac_like as km
import kermac_like.gpytorch._operator as op
from kermac_like.gpytorch import RBFKernel, ScaledExactGP

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 1_000_000
D = 8
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = dev.type == "cuda"


class Ev:
    """CUDA event, or perf_counter on a CPU (a sanity run of this probe)."""

    def __init__(self):
        self.e = torch.cuda.Event(enable_timing=True) if CUDA else None

    def record(self):
        self.t = time.perf_counter()
        if CUDA:
            self.e.record()

    def synchronize(self):
        if CUDA:
            self.e.synchronize()

    def elapsed_time(self, end):
        return self.e.elapsed_time(end.e) if CUDA else (end.t - self.t) * 1e3


def sync():
    if CUDA:
        torch.cuda.synchronize()


def mem():
    return torch.cuda.memory_allocated() if CUDA else 0


def peak():
    return torch.cuda.max_memory_allocated() if CUDA else 0


def reset():
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
g = torch.Generator(device=dev).manual_seed(0)
x = torch.rand(N, D, device=dev, generator=g) * 2 - 1
y = torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(N, device=dev, generator=g)

calls = []
_orig = op.kernel_matvec


def counted(desc, a, b, rhs, **kw):
    grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or rhs.requires_grad)
    s, e = Ev(), Ev()
    s.record()
    out = _orig(desc, a, b, rhs, **kw)
    e.record()
    e.synchronize()
    calls.append((tuple(rhs.shape), str(rhs.dtype), grad, s.elapsed_time(e)))
    return out


op.kernel_matvec = counted


def step(n_small=None):
    xx, yy = (x, y) if n_small is None else (x[:n_small], y[:n_small])
    lik = gpytorch.likelihoods.GaussianLikelihood().to(dev)
    model = ScaledExactGP(xx, yy, lik, RBFKernel()).to(dev)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(lik, model)
    model.train()
    lik.train()
    torch.manual_seed(0)
    with gpytorch.settings.max_cholesky_size(0):
        sync()
        base = mem()
        reset()
        t0 = time.perf_counter()
        loss = -mll(model(xx), yy)
        sync()
        t1 = time.perf_counter()
        peak_f = (peak() - base) / 2**20
        loss.backward()
        sync()
        t2 = time.perf_counter()
        peak_b = (peak() - base) / 2**20
    return t1 - t0, t2 - t1, peak_f, peak_b, float(loss)


step(4096)  # compile
calls.clear()
if len(sys.argv) > 2 and sys.argv[2] == "pieces":  # seconds of each backward piece (synchronised)
    import inspect

    import linear_operator.functions._inv_quad_logdet as fiql
    import linear_operator.functions._pivoted_cholesky as fpc
    import linear_operator.operators as lo_ops
    import kermac_like.ops.matvec_backward as mb

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            t = time.perf_counter()
            r = fn(*a, **k)
            sync()
            if time.perf_counter() - t > 0.005:
                print(f"    {name}: {time.perf_counter() - t:.3f} s", flush=True)
            return r
        return wrapper

    # linear_operator's (no longer reached by our operator) and ours (kermac_like.gpytorch._operator)
    for name, fn in (("PivotedCholesky", fpc.PivotedCholesky), ("Kermac._PivotedCholesky", op._PivotedCholesky),
                     ("Kermac._ShiftedQR", op._ShiftedQR)):
        for meth in ("forward", "backward"):
            setattr(fn, meth, staticmethod(timed(f"{name}.{meth}", getattr(fn, meth))))
    fiql.InvQuadLogdet.backward = staticmethod(timed("InvQuadLogdet.backward", fiql.InvQuadLogdet.backward))
    mb.diff_contraction = timed("matvec_backward.diff_contraction", mb.diff_contraction)
    for cname, cls in inspect.getmembers(lo_ops, inspect.isclass):
        for meth in ("_bilinear_derivative", "_get_indices"):
            if meth in cls.__dict__:
                setattr(cls, meth, timed(f"{cname}.{meth}", cls.__dict__[meth]))
    op.KermacKernelLinearOperator._get_indices = timed("Kermac._get_indices", op.KermacKernelLinearOperator._get_indices)
    res = step()
    print(f"N={N}: forward {res[0]:.2f} s (peak extra {res[2]:.0f} MB), backward {res[1]:.2f} s (peak extra "
          f"{res[3]:.0f} MB); kernel_matvec calls: {len(calls)}, {sum(c[3] for c in calls) / 1e3:.2f} s")
    sys.exit(0)
if len(sys.argv) > 2 and sys.argv[2] == "profile":  # torch.profiler tables of one step, then stop
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=acts, profile_memory=True) as prof:
        res = step()
    print(f"N={N}: forward {res[0]:.2f} s (peak extra {res[2]:.0f} MB), backward {res[1]:.2f} s (peak extra "
          f"{res[3]:.0f} MB); kernel_matvec calls: {len(calls)}, {sum(c[3] for c in calls) / 1e3:.2f} s")
    key = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cuda_memory_usage" if CUDA else "self_cpu_memory_usage",
                                    row_limit=12, max_name_column_width=70))
    sys.exit(0)
tf, tb, pf, pb, loss = step()
print(f"N={N}: forward {tf:.2f} s (peak extra {pf:.0f} MB), backward {tb:.2f} s (peak extra {pb:.0f} MB), loss {loss:.6f}")
agg = collections.defaultdict(lambda: [0, 0.0])
for shape, dt, grad, ms in calls:
    a = agg[(shape, dt, grad)]
    a[0] += 1
    a[1] += ms
for (shape, dt, grad), (n, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"  kernel_matvec rhs {shape} {dt} grad={grad}: {n} calls, {ms / 1e3:.2f} s ({ms / n:.1f} ms each)")
print(f"  all kernel_matvec calls: {sum(c[3] for c in calls) / 1e3:.2f} s of {tf + tb:.2f} s")

# kernel_matvec alone at this N
desc = km.preset("gaussian_l2")
xs = x / 0.7
for C in (1, 11, 12):
    v = torch.randn(N, C, device=dev)
    for _ in range(2):
        s, e = Ev(), Ev()
        s.record()
        _orig(desc, xs, xs, v, bandwidth=1.0)
        e.record()
        e.synchronize()
    fwd = s.elapsed_time(e)
    xg = xs.clone().requires_grad_(True)
    w = torch.randn(N, C, device=dev)
    sync()
    base = mem()
    reset()
    s.record()
    (w * _orig(desc, xg, xg, v, bandwidth=1.0)).sum().backward()
    e.record()
    e.synchronize()
    fb = s.elapsed_time(e)
    extra = (peak() - base) / 2**20
    print(f"kernel_matvec N={N} D={D} C={C}: forward {fwd:.1f} ms ({N * N / fwd / 1e9:.2f}e12 pairs/s), "
          f"forward+backward (x1 = x2, grad) {fb:.1f} ms, peak extra {extra:.0f} MB")
