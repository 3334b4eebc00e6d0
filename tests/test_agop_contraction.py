"""The AGOP's gradients without written n x B intermediates (issue 45, bench/notes/rfm.md "AGOP v2"):
kernel_matvec's data-input contraction (cuda_templates/matvec_grad.cuh) with 2-8 lanes a row beyond
K = 32 and the N range split over gridDim.y, executed on the CPU through the thread shim against
the float64 reference on shifted, positive and clustered data with duplicate and near pairs; the
RFM's use of it (kermac_like.rfm.gradient_blocks(contraction=True)) against the existing path and
autograd in float64; the RFM instantiations compiled for sm_80 and sm_90 (registers, spills).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kermac_like as km
from kermac_like.ops import matvec_backward as mg
from kermac_like.rfm import agop_sum, function_gradients, resolve_rfm_kernel
from kermac_like.testing import rfm_agop
from kermac_like.runtime.specs.matvec_grad import lane_widths, matvec_grad_spec

from cpu_shim import FLOAT_RUNNER_MAIN, MATVEC_GRAD_PRELUDE, THREAD_SHIM, build_cpu_runner, run_float_runner

F64 = torch.float64
RFM_KERNELS = [("laplace_l2", 1.0, 2.0), ("laplace_l2", 0.7, 2.0), ("product_laplace", 1.0, 2.0),
               ("product_laplace", 0.8, 2.0), ("lpq", 1.0, 1.5), ("lpq", 0.8, 1.3), ("gaussian", 1.0, 2.0),
               ("laplace_l2", 2.0, 2.0)]


def data(family: str, n: int, m: int, D: int, seed: int):
    """Centres u (n, D), points v (m, D): a fifth of v are centres (self pairs, r = 0), a tenth
    centres moved by 1e-4 of the spread (near pairs)."""
    g = torch.Generator().manual_seed(seed)
    if family == "shifted":
        u = torch.randn(n, D, generator=g, dtype=F64) + 100.0
        w = torch.randn(m, D, generator=g, dtype=F64) + 100.0
    elif family == "positive":
        u = torch.rand(n, D, generator=g, dtype=F64) * 3.0
        w = torch.rand(m, D, generator=g, dtype=F64) * 3.0
    else:  # clustered: 4 tight blobs far apart
        c = torch.randn(4, D, generator=g, dtype=F64) * 20.0
        u = c[torch.arange(n) % 4] + 0.05 * torch.randn(n, D, generator=g, dtype=F64)
        w = c[torch.arange(m) % 4] + 0.05 * torch.randn(m, D, generator=g, dtype=F64)
    k = m // 5
    w[:k] = u[:k]
    w[k:k + m // 10] = u[k:k + m // 10] + 1e-4 * torch.randn(m // 10, D, generator=g, dtype=F64)
    return u, w


# -- the RFM's use of the contraction (float64, CPU: the blocked reference) ---------------------------
@pytest.mark.parametrize("name,q,p", RFM_KERNELS)
@pytest.mark.parametrize("family", ["shifted", "positive", "clustered"])
def test_contraction_gradients_equal_the_existing_path_and_autograd(name, q, p, family):
    u, v = data(family, 120, 60, 5, 3)
    coef = torch.randn(120, 2, generator=torch.Generator().manual_seed(4), dtype=F64)
    kern = resolve_rfm_kernel(name, q, p)
    bw = 3.0 if family != "clustered" else 0.5
    got = function_gradients(kern, bw, u, coef, v, contraction=True)
    old = function_gradients(kern, bw, u, coef, v, contraction=False)
    assert float((got - old).norm() / old.norm()) < 1e-9
    # autograd of the kernel sum (self pairs: no contribution, as psi(0) = 0)
    vv = v.clone().requires_grad_(True)
    same = (v[:, None, :] - u[None, :, :]).abs().sum(-1) == 0
    d = torch.where(same[..., None], 1.0, vv[:, None, :] - u[None, :, :])  # (|d|^p of p < 1: no 0 x inf)
    r = d.abs().pow(kern.p).sum(-1).pow(1 / kern.p)
    k = torch.where(same, torch.ones_like(r), torch.exp(-(r / kern.length(bw)) ** kern.q))
    f = k @ coef
    ref = torch.stack([torch.autograd.grad(f[:, o].sum(), vv, retain_graph=True)[0] for o in range(2)])
    assert float((got - ref).norm() / ref.norm()) < 1e-9
    a = agop_sum(kern, bw, u, coef, v, contraction=True)
    b = torch.einsum("omd,ome->de", ref, ref)
    assert float((a - b).norm() / b.norm()) < 1e-9


def test_contraction_hypers_split_a_shared_p():
    assert rfm_agop.contraction_hypers(resolve_rfm_kernel("lpq", 1.0, 1.5), 2.0) == {"inner_p": 1.5, "outer_p": 1.5,
                                                                            "bandwidth": 2.0}
    h = rfm_agop.contraction_hypers(resolve_rfm_kernel("lpq", 0.8, 1.3), 2.0)
    assert h["inner_p"] == 1.3 and abs(h["outer_p"] - 1.3 / 0.8) < 1e-15 and abs(h["bandwidth"] - 2.0 ** 0.8) < 1e-12
    assert rfm_agop.contraction_hypers(resolve_rfm_kernel("laplace_l2", 1.0, 2.0), 2.0) == {"inner_p": None, "outer_p": None,
                                                                                   "bandwidth": 2.0}


# -- widths and spec -----------------------------------------------------------------------------------
def test_lane_widths_and_spec_mirror():
    assert lane_widths(3, 1) == (3, 1, 1) and lane_widths(32, 1) == (32, 1, 1) and lane_widths(5, 3) == (8, 4, 1)
    assert lane_widths(20, 1) == (20, 1, 1) and lane_widths(17, 2) == (20, 2, 1)
    assert lane_widths(50, 1) == (28, 1, 2) and lane_widths(100, 1) == (28, 1, 4)
    assert lane_widths(33, 1) == (20, 1, 2) and lane_widths(256, 3) == (32, 4, 8)
    assert lane_widths(257, 1) is None and lane_widths(50, 33) is None
    s = matvec_grad_spec(km.PRESETS["laplace_l2"], 28, 1, False, lanes=2)
    assert s.launch.block_m == 64 and s.launch.block_n == 128 and s.launch.smem_bytes == 128 * 57 * 4
    assert s.traits.endswith(", 28, 1, false, 1, 2>")  # unrolled once at several lanes (UNROLL_WIDE)
    s8 = matvec_grad_spec(km.PRESETS["laplace_l2"], 32, 1, False, lanes=8)
    assert s8.launch.block_m == 16 and s8.launch.block_n == 32 and s8.launch.smem_bytes <= 48 * 1024
    # lanes = 1 renders as before (the shipped instantiations' names and cache keys unchanged)
    assert matvec_grad_spec(km.PRESETS["laplace_l2"], 3, 1, False).traits.endswith(", 3, 1, false>")
    with pytest.raises(ValueError, match="lanes"):
        matvec_grad_spec(km.PRESETS["laplace_l2"], 28, 1, False, lanes=3)
    with pytest.raises(ValueError, match="kk/kc"):
        matvec_grad_spec(km.PRESETS["laplace_l2"], 26, 1, False, lanes=2)
    with pytest.raises(ValueError, match="kk/kc"):
        matvec_grad_spec(km.PRESETS["laplace_l2"], 5, 1, False)


# -- the template on the CPU (thread shim: shuffles through a shared array, every grid dimension) -------
SHIM = THREAD_SHIM + MATVEC_GRAD_PRELUDE + r"""
#define T(ip, op, ep, kk, kc, lanes) MatvecGradTraits<Power::ip, Power::op, Epilogue::ep, kk, kc, false, 1, lanes>
@@INSTANCES@@

template <class Tr>
void run(std::vector<float>& buf, const long long* h, const float* hf) {
  // h: M N K C split n_per | offsets of a b g v out
  float* base = buf.data();
  const int M = h[0], N = h[1], K = h[2], C = h[3];
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), unsigned(h[4]), 1u};
  kl_run_grid(Tr::kThreads, [&] {
    matvec_grad_kernel<Tr>(base + h[16], base + h[17], base + h[18], base + h[19], base + h[20], M, N, K, C, 1,
                           0, 0, 0, 0, nullptr, 0, hf[0], hf[1], hf[2], 0.0f, int(h[5]));
  });
}

""" + FLOAT_RUNNER_MAIN

# (rfm kernel, K, split): the RFM descriptors at 2, 4 and 8 lanes a row (K 50 -> 2 x 28, 40 -> 2 x 20,
# 100 -> 4 x 28, 200 -> 8 x 28) and at one lane (K = 20), with and without an N split.
CPU_CASES = [
    (("laplace_l2", 1.0, 2.0), 50, 1),
    (("laplace_l2", 1.0, 2.0), 100, 3),
    (("product_laplace", 1.0, 2.0), 40, 2),
    (("product_laplace", 0.8, 2.0), 50, 1),
    (("lpq", 0.8, 1.3), 50, 2),
    (("gaussian", 1.0, 2.0), 200, 2),
    (("laplace_l2", 0.7, 2.0), 20, 3),
]


def _case_spec(case):
    (name, q, p), K, _ = case
    kern = resolve_rfm_kernel(name, q, p)
    kk, kc, lanes = lane_widths(K, 1)
    return kern, kern.solver_kernel(1.0).desc, kk, kc, lanes


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    cap = lambda p: p.name.capitalize()  # noqa: E731
    inst, cases = [], []
    for i, case in enumerate(CPU_CASES):
        _, desc, kk, kc, lanes = _case_spec(case)
        inst.append(f"using I{i} = T({cap(desc.inner_power)}, {cap(desc.outer_power)}, {cap(desc.kernel_type)}, "
                    f"{kk}, {kc}, {lanes});")
        cases.append(f"    case {i}: run<I{i}>(buf, h, hf); break;")
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "agop_contraction_cpu", src)


def _run_on_cpu(exe, tmp_path, idx, a, b, ga, vb, *, q, r, bw, split, n_per):
    M, K = a.shape
    N, C = vb.shape
    out = np.full((split, M, K), np.nan, dtype=np.float32)  # poisoned: every element must be written
    return run_float_runner(exe, tmp_path, idx, (a, b, ga, vb, out), [M, N, K, C, split, n_per], (q, r, bw, 0.0), 4)


@pytest.mark.parametrize("idx", range(len(CPU_CASES)))
def test_lanes_and_split_on_cpu_match_float64(runner, tmp_path, idx):
    case = CPU_CASES[idx]
    kern, desc, kk, kc, lanes = _case_spec(case)
    K, split = case[1], case[2]
    family = ("shifted", "positive", "clustered")[idx % 3]
    u, v = data(family, 300, 90, K, idx)
    coef = torch.randn(300, 1, generator=torch.Generator().manual_seed(idx), dtype=F64)
    bw = {"shifted": 3.0, "positive": 2.0, "clustered": 0.5}[family] * (K / 10) ** 0.5
    hyp = rfm_agop.contraction_hypers(kern, bw)
    qk = mg._q_of(desc, hyp["inner_p"])
    block_n = matvec_grad_spec(desc, kk, kc, False, lanes=lanes).launch.block_n
    n_per = -(-(-(-300 // block_n)) // split) * block_n
    split_run = -(-300 // n_per)
    f32 = lambda t: t.float().numpy()  # noqa: E731
    got = _run_on_cpu(runner, tmp_path, idx, f32(v), f32(u), np.ones((90, 1), np.float32), f32(coef),
                      q=qk, r=hyp["outer_p"] or 1.0, bw=hyp["bandwidth"], split=split_run, n_per=n_per)
    assert np.isfinite(got).all()
    total = torch.from_numpy(got.astype(np.float64)).sum(0)
    # float64 reference of the float32-rounded inputs: the kernel's own error, not the data's rounding
    r64 = lambda t: t.float().double()  # noqa: E731
    ref = mg.diff_contraction_reference(desc, r64(v), r64(u), torch.ones(90, 1, dtype=F64), r64(coef), **hyp)
    err = float((total - ref).norm() / ref.norm())
    assert err < 2e-5, (case, family, err)
    # row by row (self and near pairs among them): every gradient not negligible within 1e-3 of its own norm
    rows = ref.norm(dim=1) > 1e-3 * ref.norm(dim=1).max()
    assert float(((total - ref).norm(dim=1)[rows] / ref.norm(dim=1)[rows]).max()) < 1e-3


# -- NVRTC: the RFM's instantiations (registers, spills) -------------------------------------------------
def _rfm_specs():
    specs = []
    for name, q, p in [("laplace_l2", 1.0, 2.0), ("product_laplace", 1.0, 2.0), ("lpq", 1.0, 1.5),
                       ("gaussian", 1.0, 2.0)]:
        desc = resolve_rfm_kernel(name, q, p).solver_kernel(1.0).desc
        for K in (20, 50, 100):
            kk, kc, lanes = lane_widths(K, 1)
            specs.append(matvec_grad_spec(desc, kk, kc, False, lanes=lanes))
    return specs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_rfm_instantiations_compile_without_spills(arch):
    from kermac_like.runtime.compiler import compile_specs

    try:
        _, res = compile_specs(_rfm_specs(), arch)
    except ImportError as e:  # pragma: no cover - depends on the installed cuda.core
        pytest.skip(f"cuda.core unavailable: {e}")
    # sm_90 (the H200 / H100 target): no spills, 168 registers (three CTAs an SM); sm_80: ptxas keeps
    # 168 too and spills 8 bytes for the l1 kernel (outside the pair loop: its SASS has no local loads there)
    for name, r in res.items():
        limit = 0 if arch == "sm_90" else 16
        assert r.get("spill_stores", 0) <= limit and r.get("spill_loads", 0) <= limit, (name, r)
        assert r["registers"] <= 168, (name, r)


def test_fused_serves_only_gpu_float32_up_to_256_coordinates():
    assert mg.fused_serves(torch.zeros(3, 50)) is False  # a CPU tensor: the blocked reference
    assert mg.fused_serves(torch.zeros(3, 50, dtype=F64)) is False


# -- GPU (marked): the fused AGOP and kernel_matvec's backward beyond K = 32 against float64 -------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("name,q,p", RFM_KERNELS)
@pytest.mark.parametrize("family,D", [("shifted", 50), ("positive", 100), ("clustered", 24), ("clustered", 200)])
def test_gpu_fused_agop_matches_float64(name, q, p, family, D):
    u, v = data(family, 2000, 700, D, D)
    coef = torch.randn(2000, 2, generator=torch.Generator().manual_seed(1), dtype=F64) / 40
    u, v, coef = (t.float().double() for t in (u, v, coef))  # the float64 reference of the rounded inputs
    kern = resolve_rfm_kernel(name, q, p)
    bw = {"shifted": 3.0, "positive": 2.0, "clustered": 0.5}[family] * (D / 10) ** 0.5
    want = agop_sum(kern, bw, u, coef, v)
    dev = torch.device("cuda")
    got = agop_sum(kern, bw, u.float().to(dev), coef.float().to(dev), v.float().to(dev))
    assert mg.fused_serves(u.float().to(dev))
    assert float((got.cpu() - want).norm() / want.norm()) < 1e-4


@gpu
@needs_cuda
@pytest.mark.parametrize("desc_name", ["laplace_l2", "gaussian_l2", "laplace_l1"])
def test_gpu_matvec_backward_beyond_32_coordinates(desc_name):
    desc = km.PRESETS[desc_name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(900, 70, device="cuda", generator=g) + 5.0
    y = torch.randn(1300, 70, device="cuda", generator=g) + 5.0
    v = torch.randn(1300, 3, device="cuda", generator=g)
    w = torch.randn(900, 3, device="cuda", generator=g)

    def grads(x, y, v):
        x, y, v = (t.clone().requires_grad_(True) for t in (x, y, v))
        out = km.kernel_matvec(desc, x, y, v, bandwidth=8.0)
        return torch.autograd.grad((out * w.to(out.dtype)).sum(), (x, y, v))

    got = grads(x, y, v)
    ref = grads(x.double(), y.double(), v.double())
    for a, b in zip(got, ref):
        assert float((a.double() - b).norm() / b.norm()) < 1e-5


# -- the launch as planned on a GPU, the kernel stood in for by the reference per split ------------------
class _Kernel:
    def __init__(self, spec):
        self.spec = spec


def test_fused_contraction_launch_splits_and_arguments(monkeypatch):
    """diff_contraction's fused launch on CPU tensors planned as on a 132-SM GPU: the stand-in kernel reads
    the ABI's arguments (pointers mapped back to the operands), sums its split's rows [s n_per, (s + 1)
    n_per) of b by the float64 reference into out + s L M K; the op's result must be the whole sum."""
    import ctypes

    from kermac_like.runtime import launcher, store

    real_flat = mg._flat_operand
    launches, ptr_of = [], {}

    def fake_flat(t, batch, L):  # the launch's float32 operand; its float64 twin for the stand-in's sums
        f64, s = real_flat(t.double(), batch, L)
        f32 = f64.float()
        ptr_of[f32.data_ptr()] = f64
        return f32, s

    monkeypatch.setattr(mg, "_flat_operand", fake_flat)
    monkeypatch.setattr(mg, "_gpu_ok", lambda t: True)
    monkeypatch.setattr(mg, "_sm_count", lambda d: 132)
    monkeypatch.setattr(mg, "_blocks_per_sm", lambda k: 3)
    monkeypatch.setattr(store, "get_kernel", lambda spec, device, debug=False: _Kernel(spec))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def launch(kernel, grid, args, debug=False):
        launches.append((kernel.spec, grid, args))
        a, b, g, v = (ptr_of[p] for p in args[:4])
        M, N, K, C, L = (int(x) for x in args[5:10])
        q, r, bw = (float(x) for x in args[16:19])
        n_per = int(args[20])
        assert len(args) == 21 and L == 1 and grid[0] == -(-M // kernel.spec.launch.block_m)
        h = {"inner_p": q if desc.needs_inner_p else None, "outer_p": r if desc.needs_outer_p else None,
             "bandwidth": bw}
        for s in range(grid[1]):
            lo, hi = s * n_per, min(N, (s + 1) * n_per)
            part = mg.diff_contraction_reference(desc, a, b[lo:hi], g, v[lo:hi], **h).float().contiguous()
            ctypes.memmove(args[4] + s * L * M * K * 4, part.data_ptr(), M * K * 4)

    monkeypatch.setattr(launcher, "launch", launch)
    kern = resolve_rfm_kernel("lpq", 0.8, 1.3)
    desc = kern.solver_kernel(1.0).desc
    hyp = rfm_agop.contraction_hypers(kern, 3.0)
    u, v = data("shifted", 3000, 200, 50, 7)
    coef = torch.randn(3000, 1, generator=torch.Generator().manual_seed(2), dtype=F64)
    got = mg.diff_contraction(desc, v.float(), u.float(), torch.ones(200, 1), coef.float(), **hyp)
    spec, grid, args = launches[-1]
    # 200 rows at 64 a CTA: 4 CTAs for 396 slots, so the 3000 rows of b split (whole tiles of 128)
    assert spec.traits.endswith(", 28, 1, false, 1, 2>") and grid[1] > 1 and int(args[20]) % 128 == 0
    assert (grid[1] - 1) * int(args[20]) < 3000 <= grid[1] * int(args[20])
    ref = mg.diff_contraction_reference(desc, v.float().double(), u.float().double(), torch.ones(200, 1, dtype=F64),
                                        coef.float().double(), **hyp)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
