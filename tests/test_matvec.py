"""kernel_matvec: the torch path (CPU) against a float64 dense oracle (every descriptor),
argument errors, the torch path's memory bound, the split rule, compilation of the
shipped instantiations (sm_80, sm_90, one NVRTC program each) with their SASS facts; on a
GPU (marker ``gpu``) the fused kernel against float64 for every descriptor, odd sizes,
batches, broadcast hyper-parameters, regularisation offsets, poisoned outputs,
float16/bfloat16, determinism, memory, the 2e6-term accuracy and NaN/inf propagation."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kermac_like as km
from kermac_like import matvec as mv
from kermac_like import plan, reference, torch_path
from kermac_like.plan import matvec as plan_matvec_mod
from kermac_like.plan import matvec_wgmma as plan_wgmma_mod
from kermac_like.runtime.specs import matvec as ms
from kermac_like.runtime.specs import matvec_wgmma as mw
from kermac_like.descriptor import InnerOperator as I
from kermac_like.descriptor import KernelType as E
from kermac_like.descriptor import PowerType as P

F64 = torch.float64
DIRECT = "donot_use_mm_for_euclid_dist"
ALL = list(km.KernelDescriptor.all())
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the oracle: the dense kernel matrix in float64, written from the definitions ----------
def _bcast(h, dtype, device):
    if isinstance(h, torch.Tensor):
        return h.to(dtype=dtype, device=device).reshape(*h.shape, 1, 1)
    return h


def dense_kernel(desc, x, y, *, p=None, bandwidth=None, regularization=None, reg_diag=0, epsilon=None):
    x, y = x.to(F64), y.to(F64)
    p_, bw = _bcast(p, F64, x.device), _bcast(bandwidth, F64, x.device)
    if desc.inner_operator is I.DOT:
        acc = x @ y.transpose(-1, -2)
    else:
        d = (x.unsqueeze(-2) - y.unsqueeze(-3)).abs()
        if desc.inner_power is P.ABS:
            acc = d.sum(-1)
        elif desc.inner_power is P.SQUARE:
            acc = (d * d).sum(-1)
        else:
            pe = p_.unsqueeze(-1) if isinstance(p_, torch.Tensor) else p_
            acc = (d ** pe).sum(-1)
    if desc.outer_power is P.SQRT:
        acc = acc.sqrt()
    elif desc.outer_power is P.POW:
        acc = acc ** (1.0 / p_)
    if epsilon is not None:
        acc = torch.where(acc < epsilon, torch.zeros_like(acc), acc)
    if desc.kernel_type is E.LAPLACE:
        acc = torch.exp(-acc / bw)
    elif desc.kernel_type is E.GAUSSIAN:
        acc = torch.exp(-acc * acc / (2 * bw * bw))
    if regularization is not None:
        M, N = acc.shape[-2:]
        mask = (torch.arange(N, device=x.device) - torch.arange(M, device=x.device).unsqueeze(-1)) == reg_diag
        acc = acc + torch.where(mask, _bcast(regularization, F64, x.device), torch.zeros((), dtype=F64,
                                                                                          device=x.device))
    return acc


def oracle(desc, x, y, v, **h):
    """(K @ v, |K| @ |v|) in float64; the second scales the error of a sum with cancellation."""
    kd = dense_kernel(desc, x, y, **h)
    vm = v.to(F64)
    vm = vm.unsqueeze(-1) if v.dim() == 1 else vm
    r, s = kd @ vm, kd.abs() @ vm.abs()
    if v.dim() == 1:
        r, s = r.squeeze(-1), s.squeeze(-1)
    return r, s


def scaled_error(out, ref, scale):
    out = out.to(F64)
    assert torch.isfinite(out).all(), "non-finite output (unwritten element?)"
    return ((out - ref).abs() / scale.clamp_min(1e-300)).max().item()


def _hypers(desc, L, device, tensor=True):
    h = {}
    if desc.needs_inner_p or desc.needs_outer_p:
        h["p"] = torch.tensor([1.3, 2.5][:L], device=device, dtype=F64) if tensor else 1.7
    if desc.needs_bandwidth:
        h["bandwidth"] = torch.tensor([1.1, 2.3][:L], device=device, dtype=F64) if tensor else 1.5
    return h


# -- CPU: the torch path -----------------------------------------------------------------
@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
def test_reference_every_descriptor(desc):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 17, 5, dtype=F64, generator=g)
    y = torch.randn(1, 23, 5, dtype=F64, generator=g)
    v = torch.randn(23, 3, dtype=F64, generator=g)
    h = _hypers(desc, 2, "cpu")
    h.update(regularization=torch.tensor([0.5, -0.25], dtype=F64), regularization_offset_x=3,
             regularization_offset_y=1)
    out = km.kernel_matvec(desc, x, y, v, **h)
    hh = {k: h[k] for k in ("p", "bandwidth") if k in h}
    ref, scale = oracle(desc, x, y, v, regularization=h["regularization"], reg_diag=2, **hh)
    assert out.shape == (2, 17, 3) and out.dtype == F64
    assert scaled_error(out, ref, scale) < 1e-12


def test_reference_vector_epsilon_and_blocks(monkeypatch):
    """1-D v, an epsilon cut, and row/column blocks smaller than the problem (5 x 7: the torch
    path's and the oracle's)."""
    monkeypatch.setattr(reference, "matvec_blocks", lambda batch, M, N: (5, 7))
    monkeypatch.setattr(torch_path, "CPU_BLOCK_ELEMENTS", 35)
    monkeypatch.setattr(torch_path, "MATVEC_COLUMNS", 7)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, 3, dtype=F64, generator=g)
    y = torch.cat([x[:6], torch.randn(25, 3, dtype=F64, generator=g)])
    v = torch.randn(31, dtype=F64, generator=g)
    d = km.preset("laplace_l2")
    out = km.kernel_matvec(d, x, y, v, bandwidth=0.9, epsilon=1e-3, regularization=2.0, regularization_offset_y=4)
    ref, scale = oracle(d, x, y, v, bandwidth=0.9, epsilon=1e-3, regularization=2.0, reg_diag=-4)
    assert out.shape == (19,)
    assert scaled_error(out, ref, scale) < 1e-12
    call = mv.prepare_matvec(d, x, y, v, bandwidth=0.9, epsilon=1e-3, regularization=2.0, regularization_offset_y=4)
    assert scaled_error(mv.matvec_reference(call), ref, scale) < 1e-12


def test_reference_half_precision_accumulates_in_float32():
    g = torch.Generator().manual_seed(3)
    for dt in (torch.float16, torch.bfloat16):
        x = torch.randn(40, 3, generator=g).to(dt)
        y = torch.randn(3000, 3, generator=g).to(dt)
        v = torch.rand(3000, 2, generator=g).to(dt)
        out = km.kernel_matvec(km.preset("gaussian_l2"), x, y, v, bandwidth=1.0)
        ref, scale = oracle(km.preset("gaussian_l2"), x, y, v, bandwidth=1.0)
        assert out.dtype == dt
        # float32 accumulation: only the final rounding to dt remains
        assert scaled_error(out, ref, scale) < (1e-2 if dt == torch.bfloat16 else 1.5e-3)


def test_float64_out_of_float32_inputs_cpu():
    """A float64 out of float32 (and bfloat16) inputs: the torch path sums the float32 kernel
    values of the direct form (run_kernel's with compute_mode="donot_use_mm_for_euclid_dist") in
    float64, unrounded (a long coherent sum: it differs from the float32 output, which is its
    rounding up to the float32 sums); matvec_blocked (the K > 32 Euclidean path) too."""
    g = torch.Generator().manual_seed(21)
    desc = km.preset("gaussian_l2")
    x = torch.randn(7, 3, generator=g)
    y = torch.randn(20000, 3, generator=g)
    v = torch.rand(20000, 2, generator=g)
    out = torch.full((7, 2), float("nan"), dtype=F64)
    assert km.kernel_matvec(desc, x, y, v, bandwidth=1.5, out=out) is out
    kd = km.run_kernel(desc, x, y, bandwidth=1.5, compute_mode=DIRECT)  # float32 kernel values
    exact = kd.double() @ v.double()
    assert ((out - exact).abs() / exact).max() < 1e-12
    out32 = km.kernel_matvec(desc, x, y, v, bandwidth=1.5)
    assert out32.dtype == torch.float32 and (out32.double() != out).all()
    # a vector v, float16 inputs, regularisation
    vv = torch.rand(20000, generator=g)
    o1 = torch.empty(7, dtype=F64)
    km.kernel_matvec(desc, x, y, vv, bandwidth=1.5, regularization=0.25, out=o1)
    kr = km.run_kernel(desc, x, y, bandwidth=1.5, regularization=0.25, compute_mode=DIRECT)
    assert ((o1 - kr.double() @ vv.double()).abs()).max() < 1e-9
    xb, yb, vb = (t.to(torch.bfloat16) for t in (x, y, v))
    ob = torch.empty(7, 2, dtype=F64)
    km.kernel_matvec(desc, xb, yb, vb, bandwidth=1.5, out=ob)
    kb = km.run_kernel(desc, xb.float(), yb.float(), bandwidth=1.5, compute_mode=DIRECT)
    assert ((ob - kb.double() @ vb.double()).abs() / ob).max() < 1e-12
    # matvec_blocked (float32 tiles of the tensor-core distance kernel on a GPU), float64 sums
    xk, yk, vk = torch.randn(9, 40, generator=g), torch.randn(300, 40, generator=g), torch.rand(300, 3, generator=g)
    call = mv.prepare_matvec(desc, xk, yk, vk, bandwidth=8.0)
    ob = torch.full(call.out_shape, float("nan"), dtype=F64)
    plan.matvec_blocked(call, ob, compute_mode=DIRECT, tile_elements=600)
    kk = km.run_kernel(desc, xk, yk, bandwidth=8.0, compute_mode=DIRECT)
    assert ((ob - kk.double() @ vk.double()).abs() / ob).max() < 1e-12


def test_float64_out_specs_and_split_budget():
    g = km.preset("gaussian_l2")
    f32, f64 = torch.float32, torch.float64
    # the float64 mode takes the symmetric expanded exponent (kK = K + 1 rounded up, no tuning
    # knobs) where the float32 mode expands; the direct form under an epsilon cut
    assert ms.matvec_spec(g, f32, 3, 1, out_dtype=f64).traits.endswith("float, 4, 1, true, 0, 0, -1, false, double>")
    assert ms.matvec_spec(g, f32, 8, 1, out_dtype=f64).traits.endswith("float, 9, 1, true, 0, 0, -1, false, double>")
    assert ms.matvec_spec(g, f32, 8, 1, epsilon=0.1, out_dtype=f64).traits.endswith(
        "float, 8, 1, false, 0, 0, -1, false, double>")
    assert ms.matvec_spec(km.preset("l1"), torch.float16, 40, 3, out_dtype=f64).traits.endswith(
        "float16, 0, 4, false, 0, 0, -1, false, double>")
    assert ms.matvec_spec(g, f32, 3, 1, out_dtype=f32) == ms.matvec_spec(g, f32, 3, 1)  # the default TOut
    assert ms.combine_spec(f32, f64).traits == "kermac_like::MatvecCombineTraits<float, double>"
    assert (ms.part_bytes(f32), ms.part_bytes(f32, f64)) == (4, 8)
    with pytest.raises(ValueError, match="^out: dtype torch.float16"):
        ms.matvec_spec(g, f32, 3, 1, out_dtype=torch.float16)
    shipped = [s.traits for s in ms.shipped()]
    # D = 3 and D = 8 matvec kernels, the same blocked (kF32Group = 8), the combination
    assert sum("double" in t for t in shipped) == 5
    assert sum(t.endswith("double, 8>") for t in shipped) == 2


def test_blocked_float64_mode_specs():
    """The blocked float64 mode (f32_partials) is the float64 mode's expanded instantiation with
    kF32Group = F32_GROUP appended; where the float64 mode takes the direct form (an epsilon cut, a
    descriptor without the expanded exponent) or the output is not float64, the flag changes nothing."""
    g = km.preset("gaussian_l2")
    f32, f64 = torch.float32, torch.float64
    assert ms.F32_GROUP == 8
    for d, kk in ((3, 4), (8, 9)):
        blk = ms.matvec_spec(g, f32, d, 1, out_dtype=f64, f32_partials=True)
        assert blk.traits.endswith(f"float, {kk}, 1, true, 0, 0, -1, false, double, 8>")
        assert blk.launch == ms.matvec_spec(g, f32, d, 1, out_dtype=f64).launch  # same rows and tiles
    assert ms.matvec_spec(g, f32, 8, 1, epsilon=0.1, out_dtype=f64, f32_partials=True) == ms.matvec_spec(
        g, f32, 8, 1, epsilon=0.1, out_dtype=f64)
    assert ms.matvec_spec(km.preset("l1"), f32, 8, 1, out_dtype=f64, f32_partials=True) == ms.matvec_spec(
        km.preset("l1"), f32, 8, 1, out_dtype=f64)
    assert ms.matvec_spec(g, f32, 8, 1, f32_partials=True) == ms.matvec_spec(g, f32, 8, 1)
    with pytest.raises(ValueError, match="f32_group"):
        ms.matvec_traits_spec(g, f32, 9, 1, expand=True, f32_group=8)  # not the float64 mode


def test_solver_products_select_the_blocked_instantiation(as_gpu, monkeypatch):
    """SolverKernel.matvec(..., f32_partials=True) of float32 data and a float64 v plans the
    blocked float64 mode's kernel (planned as on sm_90, not run); without the flag, and through the
    public kernel_matvec, the float64 mode's."""
    from kermac_like import testing
    from kermac_like.runtime import launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: None)  # planned, not run
    kernel = testing.solver_kernel.resolve_kernel("gaussian_l2", 1.5, None)
    x, z = torch.randn(5000, 8), torch.randn(300, 8)
    v = torch.randn(300, 1, dtype=torch.float64)
    with testing.record_plans() as plans:
        kernel.matvec(x, z, v, f32_partials=True)
        kernel.matvec(z, x, torch.randn(5000, 1, dtype=torch.float64), f32_partials=True)
        kernel.matvec(x, z, v)
        km.kernel_matvec(km.preset("gaussian_l2"), x, z, v, bandwidth=1.5)
    planned = [p.kernels[0].traits for p in plans]
    assert [t.endswith("false, double, 8>") for t in planned] == [True, True, False, False]
    assert all(t.endswith("false, double>") for t in planned[2:])


@pytest.mark.filterwarnings("ignore:KernelRidge")  # five iterations: not converged
def test_falkon_asks_for_blocked_products(monkeypatch):
    """Falkon's products ask for the blocked float64 mode (the CPU path computes them as the
    float64 mode)."""
    from kermac_like.solvers import KernelRidge
    from kermac_like.testing import solver_kernel as _kernel

    flags = []
    real = _kernel.SolverKernel.matvec

    def recording(self, a, b, v, out=None, *, f32_partials=False):
        flags.append(f32_partials)
        return real(self, a, b, v, out, f32_partials=f32_partials)

    monkeypatch.setattr(_kernel.SolverKernel, "matvec", recording)
    g = torch.Generator().manual_seed(3)
    x = torch.rand(400, 3, generator=g)
    y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(400, generator=g)
    KernelRidge("gaussian_l2", bandwidth=0.5, alpha=1e-2, solver="nystrom", n_centers=50, random_state=0,
                max_iter=5).fit(x, y)
    assert flags and set(flags) == {True}


@pytest.mark.parametrize("name", ["gaussian_l2", "dot", "laplace_l2"])
def test_blocked_tiles_times_v(name):
    """The large-K Euclidean path (kernel tiles through run_kernel's plan, times v) with
    tiles much smaller than the problem, batches, tensor bandwidths, regularisation."""
    g = torch.Generator().manual_seed(6)
    d = km.preset(name)
    x = torch.randn(2, 37, 40, dtype=F64, generator=g)
    y = torch.randn(1, 53, 40, dtype=F64, generator=g)
    v = torch.randn(53, 3, dtype=F64, generator=g)
    h = dict(bandwidth=torch.tensor([5.0, 7.0], dtype=F64)) if d.needs_bandwidth else {}
    call = mv.prepare_matvec(d, x, y, v, regularization=0.5, regularization_offset_x=2, **h)
    out = torch.full(call.out_shape, float("nan"), dtype=F64)
    plan.matvec_blocked(call, out, tile_elements=200)
    ref, scale = oracle(d, x, y, v, regularization=0.5, reg_diag=2, **h)
    assert scaled_error(out, ref, scale) < 1e-12


def test_transposed_and_with_v():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, 4, dtype=F64, generator=g)
    y = torch.randn(13, 4, dtype=F64, generator=g)
    v = torch.randn(13, 2, dtype=F64, generator=g)
    w = torch.randn(11, 5, dtype=F64, generator=g)
    d = km.preset("gaussian_l2")
    call = mv.prepare_matvec(d, x, y, v, bandwidth=1.2, regularization=0.7, regularization_offset_x=2)
    kd = dense_kernel(d, x, y, bandwidth=1.2, regularization=0.7, reg_diag=2)
    t = call.transposed(w)
    assert (t.M, t.N, t.C, t.reg_diag) == (13, 11, 5, -2)
    assert torch.allclose(mv.matvec_forward(t), kd.T @ w, rtol=1e-12, atol=1e-12)
    assert torch.allclose(mv.matvec_forward(call.with_v(v[:, 0])), kd @ v[:, 0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="^v: expected 11 rows"):
        call.transposed(v)


def test_reference_blocks_are_bounded():
    """The kernel block of every batch entry stays within BLOCK_ELEMENTS."""
    for batch, M, N in (((), 10**6, 10**6), ((7, 3), 50000, 123457), ((), 5, 10**7)):
        x = torch.empty(*batch, M, 3, device="meta")
        y = torch.empty(N, 3, device="meta")
        v = torch.empty(N, 2, device="meta")
        call = mv.prepare_matvec(km.preset("l2"), x, y, v)
        mb, nb = reference.matvec_blocks(call.batch, call.M, call.N)
        assert mb * nb * max(1, math.prod(batch)) <= max(reference.BLOCK_ELEMENTS, nb * math.prod(batch))
        assert mb >= 1 and nb >= 1


def test_reference_memory_bound_subprocess():
    """6000 x 6000 Gaussian matvec on the CPU with blocks of 2^20 elements: the dense
    float32 matrix would take 144 MB; the reference path's peak resident memory grows by
    a few blocks (tiles of 2^20 elements at most)."""
    code = textwrap.dedent("""
        import resource, torch, kermac_like as km
        from kermac_like import reference
        from kermac_like import torch_path
        torch_path.CPU_BLOCK_ELEMENTS = 1 << 20
        torch.set_num_threads(1)
        x = torch.rand(6000, 3); v = torch.rand(6000, 1)
        km.kernel_matvec(km.preset("gaussian_l2"), x[:64], x, v, bandwidth=0.5)  # imports, warm-up
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = km.kernel_matvec(km.preset("gaussian_l2"), x, x, v, bandwidth=0.5)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) / 1024.0)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    grown_mb = float(r.stdout.strip().splitlines()[-1])
    assert grown_mb < 60, f"torch path grew the resident set by {grown_mb:.0f} MB"


# -- CPU: argument errors ----------------------------------------------------------------------
def _args():
    g = torch.Generator().manual_seed(5)
    return torch.randn(6, 3, generator=g), torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda a: a.update(y=torch.randn(8, 4)), ValueError, "^y: last dimension"),
    (lambda a: a.update(v=torch.randn(7, 2)), ValueError, "^v: expected 8 rows"),
    (lambda a: a.update(v=torch.randn(8, 2, dtype=torch.float16)), TypeError, "^v: dtype"),
    (lambda a: a.update(v=torch.randn(8, 2, dtype=F64), out=torch.full((6, 2), float("nan"))), TypeError,
     "^out: expected dtype torch.float64 \\(v is"),
    (lambda a: a.update(v=torch.randn(8, 2, dtype=F64).requires_grad_()), ValueError,
     "^v: a float64 v with torch.float32 x and y"),
    (lambda a: a.update(v=[1.0] * 8), TypeError, "^v: expected a torch.Tensor"),
    (lambda a: a.update(y=torch.ones(8, 3, dtype=torch.int32)), TypeError, "^y: expected a floating"),
    (lambda a: a.update(x=torch.randn(2, 6, 3), v=torch.randn(3, 8, 2)), ValueError, "^v: batch shape"),
    (lambda a: a.update(bandwidth=torch.ones(3), x=torch.randn(2, 6, 3)), ValueError, "^bandwidth: batch shape"),
    (lambda a: a.update(bandwidth=None), ValueError, "^bandwidth"),
    (lambda a: a.update(bandwidth=-1.0), ValueError, "^bandwidth: must be > 0"),
    (lambda a: a.update(regularization_offset_x=1.5), TypeError, "^regularization_offset_x"),
    (lambda a: a.update(desc="gaussian"), TypeError, "^descriptor"),
    (lambda a: a.update(out=torch.full((6, 3), float("nan"))), ValueError, "^out: expected shape"),
    (lambda a: a.update(out=torch.full((6, 2), float("nan"), dtype=torch.float16)), TypeError,
     "^out: expected dtype torch.float32 or torch.float64"),
    (lambda a: a.update(out=torch.full((6, 2), float("nan"), dtype=F64), v=torch.randn(8, 2).requires_grad_()),
     ValueError, "^out: a torch.float64 out of torch.float32 inputs takes no part in autograd"),
    (lambda a: a.update(out=torch.full((6, 1), float("nan")).expand(6, 2)), ValueError, "^out: has overlapping"),
])
def test_argument_errors_name_the_argument_and_leave_out_untouched(mutate, exc, match):
    x, y, v = _args()
    a = dict(desc=km.preset("gaussian_l2"), x=x, y=y, v=v, bandwidth=1.0, out=None)
    mutate(a)
    out = a.pop("out")
    keep = None if out is None else out.clone()
    with pytest.raises(exc, match=match):
        km.kernel_matvec(a.pop("desc"), a.pop("x"), a.pop("y"), a.pop("v"), out=out, **a)
    if out is not None:
        assert torch.equal(out.isnan(), keep.isnan())


def test_argument_errors_leave_a_valid_out_untouched():
    x, y, v = _args()
    out = torch.full((6, 2), float("nan"))
    with pytest.raises(ValueError, match="^y: last dimension"):
        km.kernel_matvec(km.preset("l2"), x, torch.randn(8, 5), v, out=out)
    assert out.isnan().all()


# -- CPU: the split rule ----------------------------------------------------------------------
def test_choose_split():
    # plenty of row tiles: no split; few: the N range is split, each split >= 4 tiles
    assert plan.choose_split(10**5, 4000, 264, 100) == 1
    assert plan.choose_split(1, 4000, 264, 10**6) >= 264
    assert plan.choose_split(1, 8, 264, 10**6) == 2
    assert plan.choose_split(3, 4000, 264, 1) == 1
    # D = 3, N = M = 10^6 (489 row tiles of 2048, 3907 y tiles of 256) on 132 SMs x 2: the
    # last wave fills to >= 97%
    s = plan.choose_split(489, 3907, 264, 16)
    w = 489 * s / 264
    assert w / math.ceil(w) >= 0.97 and s <= 16


# -- CPU: compilation and SASS ------------------------------------------------------------------
def test_spec_selection():
    g = km.preset("gaussian_l2")
    f32 = torch.float32
    assert "float, 4, 1, true, 0, 4, 4, true>" in ms.matvec_spec(g, f32, 3, 1).traits  # expanded, tuned (D <= 3, C = 1)
    assert "float, 8, 1, true, 0>" in ms.matvec_spec(g, f32, 7, 1).traits  # expanded, untuned
    assert "float, 4, 16, true, 0>" in ms.matvec_spec(g, f32, 3, 16).traits
    # D = 8 expanded: 9 slots; 11 columns (GPyTorch's 1 + 10 probes): kC = 12, two rows per thread
    spec = ms.matvec_spec(g, f32, 8, 11)
    assert "float, 9, 12, true, 0>" in spec.traits and spec.launch.block_m == 2 * ms.THREADS
    assert ms.c_bucket(11) == 16 and ms.simt_c_bucket(11) == 12  # the tensor-core kernel keeps 16
    assert "float, 3, 1>" in ms.matvec_spec(g, f32, 3, 1, epsilon=0.1).traits  # a cut needs the distance
    assert "float, 0, 4>" in ms.matvec_spec(km.preset("l1"), f32, 33, 3).traits
    assert ms.matvec_spec(g, torch.float16, 40, 20).traits.endswith("kermac_like::float16, 0, 16>")
    assert ms.expandable(km.KernelDescriptor("diff", "square", "noop", "laplace"))
    assert not ms.expandable(km.preset("laplace_l2"))


def test_expanded_kernel_sass(shipped):
    """The Gaussian's D = 3 kernels (shipped: read from the session's shipped build, conftest
    ``shipped``, which test_compile.py checks for spills on both architectures): MUFU.EX2 for the
    pair loop's exponentials, no local memory; the untuned loop 16 per trip, the tuned one
    (4 points x 8 rows) 28 of 32 (4 on the FMA pipe), the variant with one FMA-pipe row 14 of 16."""
    from tests.test_templates_distance import sass_instructions, sass_loops, sass_of

    g = km.preset("gaussian_l2")
    cases = ((ms.matvec_spec(g, torch.float32, 3, 1), 28, 0),
             (ms.matvec_traits_spec(g, torch.float32, 4, 1, expand=True), 16, 0),
             (ms.matvec_traits_spec(g, torch.float32, 4, 1, expand=True, poly_rows=1), 14, 2))
    shipped_set = set(ms.shipped())
    assert all(spec in shipped_set for spec, _, _ in cases)
    build = shipped.kernels([spec for spec, _, _ in cases], "sm_90")
    for spec, mufu, shl in cases:
        cubin, lowered, _ = build[spec]
        sass = shipped.sass(cubin, sass_of)
        start = sass.index(f"Function : {lowered}")
        nxt = sass.find("Function : ", start + 10)
        body = sass_instructions(sass[start: nxt if nxt > 0 else len(sass)])
        ops = [ins.split()[0] if not ins.startswith("@") else ins.split()[1] for _, ins in body]
        assert not any(o.startswith(("LDL", "STL")) for o in ops)
        # the folded pair loop (two points of eight rows per trip): its MUFU.EX2 count
        loops = [(lo, hi) for lo, hi in sass_loops(body)]
        counts = [sum(1 for a, i in body if lo <= a <= hi and "MUFU.EX2" in i) for lo, hi in loops]
        assert mufu in counts, (spec.traits, counts)


# -- GPU: the fused kernel against float64 ---------------------------------------------------------
def up_front_specs():
    """Every instantiation the GPU tests reach (compiled up front, in parallel: conftest's session fixture
    compiles those of every GPU module in the session once, before the tests; gpu_warm then finds them)."""
    f32 = torch.float32
    out = []
    for d in ALL:
        out += [ms.matvec_spec(d, f32, 5, 3), ms.matvec_spec(d, f32, 40, 1), ms.matvec_spec(d, f32, 5, 3, epsilon=0.1)]
    for d in (km.preset("gaussian_l2"), km.preset("l1"), km.preset("dot")):
        for K in (1, 3, 17, 300):
            for C in (1, 5, 16):
                out.append(ms.matvec_spec(d, f32, K, C))
        out.append(ms.matvec_spec(d, f32, 8, 11))
    for dt in (torch.float16, torch.bfloat16):
        for d in (km.preset("gaussian_l2"), km.preset("laplace_l1")):
            out.append(ms.matvec_spec(d, dt, 3, 2))
        out.append(ms.combine_spec(dt))
    out += [ms.matvec_spec(km.preset("gaussian_l2"), f32, 3, 4), ms.matvec_spec(km.preset("laplace_l2"), f32, 3, 1),
            ms.combine_spec(f32)]
    # float64 out (test_gpu_float64_out_two_million_positive_terms)
    out += [ms.matvec_spec(km.preset("dot"), f32, 1, 1, out_dtype=torch.float64),
            ms.matvec_spec(km.preset("gaussian_l2"), f32, 3, 1, out_dtype=torch.float64),
            ms.combine_spec(f32, torch.float64)]
    # the blocked float64 mode against the float64 mode at D = 8 (test_gpu_blocked_float64_mode)
    out += [ms.matvec_spec(km.preset("gaussian_l2"), f32, 8, 1, out_dtype=torch.float64, f32_partials=b)
            for b in (False, True)]
    # Hopper (sm_90 only; KernelSpec.supports drops them elsewhere): the fused tensor-core
    # kernel of Euclidean/DOT float32 calls with K > 32, its b preparation, the carry kernel.
    from kermac_like.runtime.specs import wgmma_prepare_spec

    out += [mw.matvec_wgmma_spec(km.preset(n), kc) for n in EUCLID_NAMES for kc in ms.C_BUCKETS]
    out += [mw.carry_spec()] + [wgmma_prepare_spec(small=True, norms=n) for n in (True, False)]
    return out


EUCLID_NAMES = ("l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot")


@pytest.fixture(scope="module")
def gpu_warm():
    from kermac_like.runtime.compiler import arch_of_device, precompile_specs
    from shipped_build import up_front_turn

    with up_front_turn():  # under xdist: after the session's compile of every GPU module's kernels
        precompile_specs(up_front_specs(), arch_of_device(0), processes=min(16, os.cpu_count() or 1))
    yield


def _gpu_data(*shapes, dtype=torch.float32, positive=False):
    f = torch.rand if positive else torch.randn
    return [f(*s, device="cuda", dtype=dtype) for s in shapes]


def _poisoned(shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def _tol(desc, K=5, epsilon=None):
    """Scaled-error bound of a GPU result: fp32-grade sums (2e-6) for the direct form; the
    Gaussian's expanded exponent rounds with s (|x - c|^2 + |y - c|^2) instead of s |x - y|^2
    (~1e-5 on unsorted randn data); powers and long l1 sums under an exponential amplify the
    fp32 rounding of the distance by the exponent's size."""
    if ms.expandable(desc) and not (epsilon or 0) > 0 and K + 1 <= 32:
        return 3e-5
    if desc.inner_power is P.POW or desc.outer_power is P.POW or K > 32:
        return 2e-5
    if desc.kernel_type.name == "GAUSSIAN" and desc.inner_power is P.SQUARE and desc.outer_power is P.NOOP:
        # the Gaussian of a squared distance: exponent ~ d^2, so the relative error of the
        # result is ~2 x exponent x the distance's rounding (2.4e-6 seen on an H200)
        return 2e-5
    return 2e-6


def _check(desc, x, y, v, out, tol, **h):
    hh = dict(h)
    ox, oy = hh.pop("regularization_offset_x", 0), hh.pop("regularization_offset_y", 0)
    if "p" in hh:
        pass
    ref, scale = oracle(desc, x, y, v, reg_diag=ox - oy, **hh)
    err = scaled_error(out, ref, scale)
    assert err < tol, f"{desc!r}: scaled error {err:.2e}"
    return err


@pytest.mark.gpu
@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
def test_gpu_every_descriptor(gpu_warm, desc):
    x, y, v = _gpu_data((2, 127, 5), (1, 129, 5), (129, 3))
    h = _hypers(desc, 2, "cuda")
    h = {k: t.float() for k, t in h.items()}
    h.update(regularization=torch.tensor([0.5, -0.25], device="cuda"), regularization_offset_x=3,
             regularization_offset_y=1)
    out = _poisoned((2, 127, 3))
    res = km.kernel_matvec(desc, x, y, v, out=out, **h)
    assert res is out
    _check(desc, x, y, v, out, _tol(desc, 5), **h)
    # the chunked strategy (K = 40), a scalar hyper-parameter, no regularisation
    x, y, v = _gpu_data((33, 40), (1000, 40), (1000, 1))
    hs = _hypers(desc, 1, "cuda", tensor=False)
    out = km.kernel_matvec(desc, x * 0.3, y * 0.3, v, **hs)
    _check(desc, x * 0.3, y * 0.3, v, out, _tol(desc, 40), **hs)


@pytest.mark.gpu
@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
def test_gpu_epsilon_cut(gpu_warm, desc):
    """y contains x's rows (distance 0 < epsilon): the cut's semantics; others are far."""
    x, = _gpu_data((50, 5))
    y = torch.cat([x[:20], torch.randn(80, 5, device="cuda") + 3.0])
    v, = _gpu_data((100, 3))
    hs = _hypers(desc, 1, "cuda", tensor=False)
    out = km.kernel_matvec(desc, x, y, v, epsilon=0.1, **hs)
    _check(desc, x, y, v, out, _tol(desc, 5, 0.1), epsilon=0.1, **hs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gaussian_l2", "l1", "dot"])
def test_gpu_odd_sizes_k_and_columns(gpu_warm, name):
    desc = km.preset(name)
    hs = _hypers(desc, 1, "cuda", tensor=False)
    for M, N, K, C in [(1, 1, 1, 1), (7, 1000, 3, 5), (127, 129, 17, 16), (129, 127, 300, 1), (1000, 7, 3, 20),
                       (1000, 1000, 3, 1), (5, 3000, 1, 5), (1000, 1500, 8, 11)]:
        x, y = _gpu_data((M, K), (N, K))
        scale = 1.0 / math.sqrt(K)  # distances of order 1 (no underflowing exponentials)
        x, y = x * scale, y * scale
        v, = _gpu_data((N, C))
        out = _poisoned((M, C))
        km.kernel_matvec(desc, x, y, v, out=out, **hs)
        _check(desc, x, y, v, out, _tol(desc, K), **hs)
    vv, = _gpu_data((1000,))
    x, y = _gpu_data((129, 3), (1000, 3))
    out = km.kernel_matvec(desc, x, y, vv, **hs)
    assert out.shape == (129,)
    _check(desc, x, y, vv, out, _tol(desc, 3), **hs)


@pytest.mark.gpu
def test_gpu_views_broadcast_and_host_loop(gpu_warm):
    desc = km.preset("gaussian_l2")
    # transposed x, strided y, expanded (zero-stride) batch, column-major out
    xt, = _gpu_data((3, 2, 129))
    x = xt.transpose(-1, -2)                       # (3, 129, 2)... last mode strided
    x = torch.cat([x, x[..., :1]], -1)              # (3, 129, 3)
    ybig, = _gpu_data((1000, 6))
    y = ybig[:, ::2]                                # (1000, 3), stride (6, 2)
    v, = _gpu_data((1, 1000, 4))
    v = v.expand(3, 1000, 4)
    out = _poisoned((3, 4, 129)).transpose(-1, -2)
    bw = torch.tensor([[0.7], [1.3], [2.0]], device="cuda").reshape(3)
    km.kernel_matvec(desc, x, y, v, out=out, bandwidth=bw, regularization=1.5, regularization_offset_y=2)
    _check(desc, x, y, v, out, _tol(desc, 3), bandwidth=bw, regularization=1.5, regularization_offset_y=2)
    # four batch modes that do not merge: a host loop over the outermost
    x, y, v = _gpu_data((2, 1, 3, 1, 9, 3), (1, 2, 1, 2, 11, 3), (2, 2, 3, 2, 11, 2))
    out = km.kernel_matvec(desc, x, y, v, bandwidth=0.9)
    assert out.shape == (2, 2, 3, 2, 9, 2)
    _check(desc, x, y, v, out, _tol(desc, 3), bandwidth=0.9)
    # more batch entries than grid.z holds
    x, y, v = _gpu_data((70000, 2, 3), (70000, 3, 3), (3, 1))
    out = km.kernel_matvec(desc, x, y, v, bandwidth=0.9)
    _check(desc, x, y, v, out, _tol(desc, 3), bandwidth=0.9)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_gpu_half_inputs_accumulate_in_float32(gpu_warm, dt):
    for name, hs in (("gaussian_l2", dict(bandwidth=1.0)), ("laplace_l1", dict(bandwidth=2.0))):
        desc = km.preset(name)
        x, y, v = _gpu_data((129, 3), (20000, 3), (20000, 2), dtype=dt)
        v = v.abs()
        out = _poisoned((129, 2), dtype=dt)
        km.kernel_matvec(desc, x, y, v, out=out, **hs)
        # against the float64 sum of the same (rounded) inputs: only the output rounding remains
        _check(desc, x, y, v, out, 8e-3 if dt == torch.bfloat16 else 1e-3, **hs)
        # split N (few rows): the combination kernel rounds once too
        out = km.kernel_matvec(desc, x[:5], y, v, **hs)
        _check(desc, x[:5], y, v, out, 8e-3 if dt == torch.bfloat16 else 1e-3, **hs)


@pytest.mark.gpu
def test_gpu_split_is_deterministic_and_regularised(gpu_warm):
    """Few rows, many points: the N range is split; two runs are bitwise equal, and the
    combination adds the regularised diagonal."""
    desc = km.preset("gaussian_l2")
    x, y, v = _gpu_data((33, 3), (300000, 3), (300000, 4))
    y[:33] = x
    h = dict(bandwidth=0.5, regularization=torch.tensor([2.0], device="cuda"), regularization_offset_x=5)
    a = km.kernel_matvec(desc, x, y, v, **h)
    b = km.kernel_matvec(desc, x, y, v, **h)
    assert torch.equal(a, b)
    _check(desc, x, y, v, a, _tol(desc, 3), **h)
    l2 = km.preset("laplace_l2")
    a = km.kernel_matvec(l2, x, y, v, bandwidth=0.5)
    b = km.kernel_matvec(l2, x, y, v, bandwidth=0.5)
    assert torch.equal(a, b)
    _check(l2, x, y, v, a, _tol(l2, 3), bandwidth=0.5)


def _extra_memory_of_second_call(fn) -> int:
    """Peak GPU memory a call allocates beyond what is live before it, measured on its second
    run (the first loads kernels and fills caches)."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_gpu_memory_is_linear(gpu_warm):
    desc = km.preset("gaussian_l2")
    for M, N in ((200000, 200000), (64, 2_000_000)):
        x, y, v = _gpu_data((M, 3), (N, 3), (N, 4))
        out = torch.empty(M, 4, device="cuda")
        extra = _extra_memory_of_second_call(lambda: km.kernel_matvec(desc, x, y, v, bandwidth=1.0, out=out))
        assert extra <= mv.SCRATCH_BYTES + (1 << 20), f"M={M} N={N}: {extra / 2**20:.1f} MB extra"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l1"])
def test_gpu_two_million_positive_terms(gpu_warm, name):
    """2e6 positive terms per output: relative error <= 1e-5 against float64 (the tile
    partials go into float64 totals, so the error does not grow with N)."""
    desc = km.preset(name)
    x, = _gpu_data((16, 3))
    y, v = _gpu_data((2_000_000, 3), (2_000_000, 1), positive=True)
    out = km.kernel_matvec(desc, x, y, v, bandwidth=10.0)
    call = mv.prepare_matvec(desc, x.double(), y.double(), v.double(), bandwidth=10.0)
    ref = mv.matvec_reference(call)
    rel_err = ((out.double() - ref).abs() / ref.abs()).max().item()
    assert rel_err <= 1e-5, rel_err
    # the same through the unsplit path (many rows)
    x2 = torch.cat([x, torch.randn(4000, 3, device="cuda")])
    out2 = km.kernel_matvec(desc, x2, y, v, bandwidth=10.0)
    rel2 = ((out2[:16].double() - ref).abs() / ref.abs()).max().item()
    assert rel2 <= 1e-5, rel2


@pytest.mark.gpu
def test_gpu_float64_out_two_million_positive_terms(gpu_warm, monkeypatch):
    """A float64 out: 1 row x 2e6 positive terms. Exactly representable terms (DOT of integers,
    exact float32 tile partials): the float64 out is the float64 sum to 1e-9 relative (in fact
    exactly), where the float32 out rounds it; split (1 row: the N range in many splits, float64
    part) and unsplit (no split scratch allowed) runs agree. Gaussian on random data: split and
    unsplit float64 outs agree to 1e-12, the float32 out of the unsplit run is their rounding."""
    n = 2_000_000
    g = torch.Generator(device="cuda").manual_seed(17)
    x = torch.ones(1, 1, device="cuda")
    y = torch.randint(1, 5, (n, 1), device="cuda", generator=g).float()
    v = torch.randint(1, 17, (n, 1), device="cuda", generator=g).float()
    exact = float((y.double() * v.double()).sum())  # ~4e7 > 2^24: float32 cannot hold it
    dot = km.preset("dot")
    split64 = torch.empty(1, 1, dtype=F64, device="cuda")
    km.kernel_matvec(dot, x, y, v, out=split64)
    assert abs(split64.item() - exact) <= 1e-9 * exact
    gauss = km.preset("gaussian_l2")
    xg, = _gpu_data((1, 3))
    yg, vg = _gpu_data((n, 3), (n, 1), positive=True)
    gsplit = torch.empty(1, 1, dtype=F64, device="cuda")
    km.kernel_matvec(gauss, xg, yg, vg, bandwidth=1.0, out=gsplit)
    monkeypatch.setattr(plan_matvec_mod, "MATVEC_SCRATCH_BYTES", 0)  # max_split = 1: one CTA walks all of N
    unsplit64 = torch.empty(1, 1, dtype=F64, device="cuda")
    km.kernel_matvec(dot, x, y, v, out=unsplit64)
    assert unsplit64.item() == split64.item()
    out32 = km.kernel_matvec(dot, x, y, v)  # the same float64 total, rounded once
    assert out32.item() == float(torch.tensor(exact, dtype=F64).float())
    gunsplit = torch.empty(1, 1, dtype=F64, device="cuda")
    km.kernel_matvec(gauss, xg, yg, vg, bandwidth=1.0, out=gunsplit)
    assert abs(gunsplit.item() - gsplit.item()) <= 1e-12 * gsplit.item()
    g32 = km.kernel_matvec(gauss, xg, yg, vg, bandwidth=1.0)  # float32 tile partials: within their rounding
    assert abs(g32.item() - gunsplit.item()) <= 3e-7 * gunsplit.item()
    call = mv.prepare_matvec(gauss, xg.double(), yg.double(), vg.double(), bandwidth=1.0)
    ref = mv.matvec_reference(call).item()
    assert abs(gunsplit.item() - ref) <= 1e-5 * ref


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l2"])
def test_gpu_float64_mode_kernel_values_are_transposes(gpu_warm, name):
    """The float64 mode computes k symmetrically (the direct form, or the expanded one centred on
    the same vector for both operands): K(x, y) read off with one-hot float64
    columns of v is bitwise the transpose of K(y, x) (Falkon's K_nZ and K_Zn products must be
    transposes, or its CG stalls), and within float32 rounding of the float64 kernel."""
    desc = km.preset(name)
    torch.manual_seed(20261126)
    x, y = _gpu_data((300, 8), (200, 8))
    kxy = km.kernel_matvec(desc, x, y, torch.eye(200, dtype=F64, device="cuda"), bandwidth=2.0)
    kyx = km.kernel_matvec(desc, y, x, torch.eye(300, dtype=F64, device="cuda"), bandwidth=2.0)
    assert torch.equal(kxy, kyx.T)
    assert torch.equal(kxy, kxy.float().double())  # float32 kernel values, times exact ones
    ref = reference.distance_reference(desc, x.double(), y.double(), bandwidth=2.0)
    # float32 kernel values: the exponent's rounding (~|t| u with |t| up to ~10 here, relative to the
    # centred norms in the expanded form) and ex2's 2 ulp; the largest seen over unseeded runs: 2.0e-6
    assert ((kxy - ref).abs() / ref).max() < 3e-6


@pytest.mark.gpu
def test_gpu_blocked_float64_mode(gpu_warm):
    """The blocked float64 mode (Falkon's products: float32 partials of F32_GROUP points) against the
    float64 mode at 2e5 x 2e4, D = 8, both products (K(x, z) v one CTA row tile per 1024 rows, K(z, x) u
    over split N ranges): within (F32_GROUP + 1) 2^-24 K |w| of it (the CPU shim's bound; the same
    kernel values), not equal to it, and the kernel values K(x, z) bitwise the transpose of K(z, x)."""
    from dataclasses import replace

    g = km.preset("gaussian_l2")
    gen = torch.Generator(device="cuda").manual_seed(28)
    x = torch.rand(200_000, 8, device="cuda", generator=gen) * 2 - 1
    z = x[torch.randperm(200_000, device="cuda", generator=gen)[:20_000]].contiguous()
    bound = (ms.F32_GROUP + 1) * 2.0 ** -24
    for a, b in ((x, z), (z, x)):
        w = torch.randn(b.shape[0], 1, dtype=F64, device="cuda", generator=gen)
        call = mv.prepare_matvec(g, a, b, w, bandwidth=1.5)
        f64 = mv.matvec_forward(call)
        blk = mv.matvec_forward(replace(call, f32_partials=True))
        mag = mv.matvec_forward(call.with_v(w.abs()))
        err = ((blk - f64).abs() / mag).max().item()
        assert err <= bound, (err, bound)
        assert not torch.equal(blk, f64)
    cols = torch.zeros(20_000, 3, dtype=F64, device="cuda")
    cols[[0, 9_999, 19_999], [0, 1, 2]] = 1.0
    rows = torch.zeros(200_000, 3, dtype=F64, device="cuda")
    rows[[5, 100_000, 199_999], [0, 1, 2]] = 1.0
    call = replace(mv.prepare_matvec(g, x, z, cols, bandwidth=1.5), f32_partials=True)
    kxz = mv.matvec_forward(call)  # (200000, 3): columns 0, 9999, 19999 of K(x, z)
    kzx = mv.matvec_forward(call.transposed(rows))  # (20000, 3): columns 5, 100000, 199999 of K(z, x)
    assert torch.equal(kxz[[5, 100_000, 199_999]], kzx[[0, 9_999, 19_999]].T)


@pytest.mark.gpu
@pytest.mark.parametrize("name,M,N,K", [("dot", 5, 300_000, 3), ("dot", 3000, 20_000, 3), ("l1", 7, 50_000, 40),
                                        ("l1", 2500, 9_000, 40)])
def test_gpu_float64_v_sums_exactly(gpu_warm, name, M, N, K):
    """The float64 mode on the GPU: float32 integer data (exact kernel values), float64 v of
    alternating 2^29..2^30 integers (not float32 values; a cancelling sum): every output is the
    exact integer sum (split and unsplit N ranges; the registers strategy at K = 3 and the
    chunked one at K = 40), and the float32 mode, given the same v in float32, is not."""
    g = torch.Generator(device="cuda").manual_seed(M + K)
    x = torch.randint(-8, 9, (M, K), device="cuda", generator=g).float()
    y = torch.randint(-8, 9, (N, K), device="cuda", generator=g).float()
    sign = torch.where(torch.arange(N, device="cuda") % 2 == 0, 1, -1)[:, None]
    v = (torch.randint(1 << 29, 1 << 30, (N, 2), device="cuda", generator=g) * sign
         + torch.randint(-3, 4, (N, 2), device="cuda", generator=g)).double()
    desc = km.preset(name)
    out = torch.full((M, 2), float("nan"), dtype=F64, device="cuda")
    assert km.kernel_matvec(desc, x, y, v, out=out) is out
    k = (x.double().cpu() @ y.double().cpu().T) if name == "dot" else torch.cdist(x.double().cpu(), y.double().cpu(), p=1)
    exact = (k.long() @ v.cpu().long()).double()
    assert torch.equal(out.cpu(), exact)
    assert torch.equal(km.kernel_matvec(desc, x, y, v).cpu(), exact)  # float64 result without out=
    out32 = km.kernel_matvec(desc, x, y, v.float())
    assert not torch.equal(out32.double().cpu(), exact)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l2", "l1"])
def test_gpu_nan_and_inf_propagate_like_the_dense_product(gpu_warm, name):
    desc = km.preset(name)
    hs = _hypers(desc, 1, "cuda", tensor=False)
    x, y, v = _gpu_data((6, 3), (300, 3), (300, 2))
    x[1, 0] = float("nan")
    x[2, 1] = float("inf")
    y[5, 2] = float("-inf")
    y[7, 0] = float("nan")
    v[9, 1] = float("inf")
    out = km.kernel_matvec(desc, x, y, v, **hs)
    ref = dense_kernel(desc, x, y, **hs) @ v.double()
    assert torch.equal(out.isnan(), ref.isnan()), (out, ref)
    assert torch.equal(out.isinf(), ref.isinf()), (out, ref)
    fin = ref.isfinite()
    assert torch.allclose(out.double()[fin], ref[fin], rtol=1e-5, atol=1e-5)


# -- GPU (sm_90): the fused tensor-core kernel of Euclidean/DOT calls with K > 32 ------------------
sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                          reason="needs an sm_90 GPU (H100/H200)")


def _family(desc, x, y, v, **h):
    call = mv.prepare_matvec(desc, x, y, v, **h)
    return plan.plan_matvec(call, torch.empty(call.out_shape, device=x.device, dtype=x.dtype), False).family


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("name", EUCLID_NAMES)
def test_gpu_wgmma_odd_sizes_and_columns(gpu_warm, name):
    desc = km.preset(name)
    hs = _hypers(desc, 1, "cuda", tensor=False)
    for M, N, K, C in [(1, 1, 33, 1), (127, 129, 37, 5), (300, 1000, 256, 16), (1000, 7, 40, 20),
                       (257, 513, 64, 2), (129, 300, 100, 8)]:
        x, y = (t / math.sqrt(K) for t in _gpu_data((M, K), (N, K)))
        v, = _gpu_data((N, C))
        assert _family(desc, x, y, v, **hs) == "matvec_wgmma"
        out = _poisoned((M, C))
        km.kernel_matvec(desc, x, y, v, out=out, **hs)
        _check(desc, x, y, v, out, _tol(desc, K), **hs)


@pytest.mark.gpu
@sm90
def test_gpu_wgmma_self_distance_and_regularised_diagonal(gpu_warm):
    """x is y: the diagonal's distance is exactly 0 (the kernel sets the dot product from
    the two norms there); a regularised diagonal offset by 5 crosses row and column tiles."""
    x, v = _gpu_data((700, 48), (700, 3))
    x = x * 0.3
    for name in ("gaussian_l2", "laplace_l2", "l2"):
        desc = km.preset(name)
        hs = _hypers(desc, 1, "cuda", tensor=False)
        h = dict(regularization=0.7, regularization_offset_x=5, **hs)
        out = km.kernel_matvec(desc, x, x, v, **h)
        _check(desc, x, x, v, out, _tol(desc, 48), **h)
    xs = 10 + torch.randn(300, 64, device="cuda")  # large norms: an expanded distance would not cancel to 0
    e = torch.zeros(300, 1, device="cuda")
    e[123] = 1.0
    out = km.kernel_matvec(km.preset("gaussian_l2"), xs, xs, e, bandwidth=1e-3)
    assert out[123, 0].item() == 1.0


@pytest.mark.gpu
@sm90
def test_gpu_wgmma_batches_views_and_host_loop(gpu_warm):
    desc = km.preset("gaussian_l2")
    x, y, v = _gpu_data((2, 3, 130, 40), (1, 3, 300, 40), (300, 5))
    x, y = x * 0.2, y * 0.2
    bw = torch.tensor([[0.7], [1.3]], device="cuda").expand(2, 3)
    out = _poisoned((2, 3, 5, 130)).transpose(-1, -2)  # column-major out
    km.kernel_matvec(desc, x, y, v, out=out, bandwidth=bw, regularization=0.25, regularization_offset_y=2)
    _check(desc, x, y, v, out, 2e-5, bandwidth=bw, regularization=0.25, regularization_offset_y=2)
    x, y, v = _gpu_data((2, 1, 3, 2, 70, 36), (1, 2, 3, 1, 90, 36), (2, 2, 1, 2, 90, 2))
    lap = km.preset("laplace_l2")
    out = km.kernel_matvec(lap, x * 0.2, y * 0.2, v, bandwidth=0.9)
    _check(lap, x * 0.2, y * 0.2, v, out, 2e-5, bandwidth=0.9)
    xs, ys, vs = _gpu_data((64, 80), (90, 40), (90, 3))
    xv, yv, vv = xs[:, ::2], ys.t().contiguous().t(), vs.t().contiguous().t()  # strided, column-major
    dot = km.preset("dot")
    assert _family(dot, xv, yv, vv) == "matvec_wgmma"
    out = km.kernel_matvec(dot, xv, yv, vv)
    _check(dot, xv, yv, vv, out, 2e-5)


@pytest.mark.gpu
@sm90
def test_gpu_wgmma_ranges_splits_and_determinism(gpu_warm, monkeypatch):
    """y prepared in ranges of a few tiles (float64 carry between launches), with and
    without split N ranges (combination in split order): bitwise repeatable, regularised."""
    desc = km.preset("gaussian_l2")
    monkeypatch.setattr(plan_wgmma_mod, "MATVEC_WGMMA_BLOCK_BYTES", 3 * 256 * (48 * 4 * 2 + 4))
    x, y, v = _gpu_data((600, 48), (2000, 48), (2000, 20))
    x, y = x * 0.2, y * 0.2
    h = dict(bandwidth=0.9, regularization=0.5, regularization_offset_y=700)
    a, b = km.kernel_matvec(desc, x, y, v, **h), km.kernel_matvec(desc, x, y, v, **h)
    assert torch.equal(a, b)
    _check(desc, x, y, v, a, 2e-5, **h)
    monkeypatch.setattr(plan_wgmma_mod, "MATVEC_WGMMA_BLOCK_BYTES", 40 * 256 * (48 * 4 * 2 + 4))
    x, y, v = _gpu_data((20, 48), (30000, 48), (30000, 2))
    x, y = x * 0.2, y * 0.2
    y[:20] = x
    lap = km.preset("laplace_l2")
    h = dict(bandwidth=0.9, regularization=torch.tensor([2.0], device="cuda"), regularization_offset_x=5)
    a, b = km.kernel_matvec(lap, x, y, v, **h), km.kernel_matvec(lap, x, y, v, **h)
    assert torch.equal(a, b)
    _check(lap, x, y, v, a, 2e-5, **h)
    monkeypatch.setattr(plan_wgmma_mod, "MATVEC_WGMMA_BLOCK_BYTES", 64 << 20)
    a, b = km.kernel_matvec(lap, x, y, v, **h), km.kernel_matvec(lap, x, y, v, **h)  # one range, split
    assert torch.equal(a, b)
    _check(lap, x, y, v, a, 2e-5, **h)


@pytest.mark.gpu
@sm90
def test_gpu_wgmma_memory_is_bounded(gpu_warm):
    """No M x N tile: beyond inputs and output, x and y shifted by their reference point (one
    copy of each, plan.matvec.shifted_pair), the prepared y of one range
    (MATVEC_WGMMA_BLOCK_BYTES), v's tiles, the float64 carry (M x C) and small buffers."""
    desc = km.preset("gaussian_l2")
    M = N = 60000
    x, y, v = _gpu_data((M, 256), (N, 256), (N, 4))
    out = torch.empty(M, 4, device="cuda")
    extra = _extra_memory_of_second_call(lambda: km.kernel_matvec(desc, x, y, v, bandwidth=16.0, out=out))
    bound = (M + N) * 256 * 4 + plan_wgmma_mod.MATVEC_WGMMA_BLOCK_BYTES + N * 4 * 4 + M * 4 * 8 + (4 << 20)
    assert extra <= bound, f"{extra / 2**20:.1f} MB extra"


# -- CPU: the custom ops -------------------------------------------------------------------------
def _op_case(vector=False):
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 6, 3, dtype=F64, generator=g)
    y = torch.randn(8, 3, dtype=F64, generator=g)
    v = torch.randn(8, dtype=F64, generator=g) if vector else torch.randn(8, 2, dtype=F64, generator=g)
    bw = torch.tensor([0.9, 1.4], dtype=F64)
    desc = km.preset("gaussian_l2")
    call = mv.prepare_matvec(desc, x, y, v, bandwidth=bw, regularization=0.3, regularization_offset_x=1)
    from kermac_like.ops import matvec as ops_matvec

    return desc, x, y, v, bw, ops_matvec._op_args(call, v)


@pytest.mark.parametrize("vector", [False, True])
def test_custom_ops_opcheck(vector):
    _, _, _, _, _, args = _op_case(vector)
    torch.library.opcheck(torch.ops.kermac_like.kernel_matvec.default, (*args, False))
    out = torch.full((2, 6) if vector else (2, 6, 2), float("nan"), dtype=F64)
    torch.library.opcheck(torch.ops.kermac_like.kernel_matvec_out.default, (*args, False, out))


def test_custom_op_float64_out_of_float32_inputs():
    """kernel_matvec_out honours a float64 out of float32 inputs (opcheck, eager, compiled)."""
    desc, x, y, v, bw, _ = _op_case()
    x, y, v, bw = x.float(), y.float(), v.float(), bw.float()
    call = mv.prepare_matvec(desc, x, y, v, bandwidth=bw, regularization=0.3, regularization_offset_x=1)
    from kermac_like.ops import matvec as ops_matvec

    out = torch.full((2, 6, 2), float("nan"), dtype=F64)
    torch.library.opcheck(torch.ops.kermac_like.kernel_matvec_out.default, (*ops_matvec._op_args(call, v), False, out))

    def f(x, y, v, out):
        return km.kernel_matvec(desc, x, y, v, bandwidth=bw, regularization=0.3, regularization_offset_x=1, out=out)

    ref = f(x, y, v, torch.empty(2, 6, 2, dtype=F64))
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, y, v, torch.empty(2, 6, 2, dtype=F64))
    assert got.dtype == F64 and torch.equal(got, ref)
    assert (ref.float().double() != ref).any()  # not rounded to float32


def test_custom_op_float64_v_of_float32_inputs():
    """A float64 v with float32 x and y (the float64 mode): a float64 result without out=
    (fake shapes and dtype for torch.compile), opcheck of both ops, and the torch path's
    value: the float32 kernel values (run_kernel's direct form) times the float64 v, summed in float64."""
    desc, x, y, v, bw, _ = _op_case()
    x, y, bw = x.float(), y.float(), bw.float()
    call = mv.prepare_matvec(desc, x, y, v, bandwidth=bw, regularization=0.3, regularization_offset_x=1)
    assert call.wide_v and call.out_dtype == F64
    from kermac_like.ops import matvec as ops_matvec

    torch.library.opcheck(torch.ops.kermac_like.kernel_matvec.default, (*ops_matvec._op_args(call, v), False))
    out = torch.full((2, 6, 2), float("nan"), dtype=F64)
    torch.library.opcheck(torch.ops.kermac_like.kernel_matvec_out.default, (*ops_matvec._op_args(call, v), False, out))

    def f(x, y, v):
        return km.kernel_matvec(desc, x, y, v, bandwidth=bw, regularization=0.3, regularization_offset_x=1)

    ref = f(x, y, v)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, y, v)
    assert ref.dtype == got.dtype == F64 and torch.equal(got, ref)
    kd = km.run_kernel(desc, x, y, bandwidth=bw, regularization=0.3, regularization_offset_x=1, compute_mode=DIRECT)
    assert torch.allclose(ref, kd.double() @ v, rtol=1e-13, atol=1e-13)
    assert not torch.allclose(ref, kd.double() @ v.float().double(), rtol=1e-13, atol=1e-13)  # v not rounded


def test_custom_op_traces_and_differentiates():
    desc, x, y, v, bw, _ = _op_case()
    f = lambda x, y, v: km.kernel_matvec(desc, x, y, v, bandwidth=bw, regularization=0.3,  # noqa: E731
                                         regularization_offset_x=1)
    ref = f(x, y, v)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, y, v)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    xs, ys, vs = (t.clone().requires_grad_() for t in (x, y, v))
    assert torch.autograd.gradcheck(f, (xs, ys, vs))
    # out= under autograd: the functional op, copied into out
    out = torch.empty_like(ref)
    res = km.kernel_matvec(desc, xs, ys, vs, bandwidth=bw, out=out)
    assert res is out and out.grad_fn is not None
