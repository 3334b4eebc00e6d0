"""The backward of kernel_matvec (kermac_like/matvec_grad.py, cuda_templates/matvec_grad.cuh).

CPU (CI):
* the blocked reference contraction against torch autograd through the dense
  float64 kernel matrix, for every DIFF descriptor (with and without epsilon,
  tensor hyper-parameters over a batch), and with tiny blocks (bounded memory);
* ``torch.autograd.gradcheck`` of kernel_matvec in float64 (the reference path)
  for every descriptor, x, y and v together;
* the real CUDA kernel executed on the CPU (g++ and a thread-per-CUDA-thread
  shim) against the float64 reference: padding of K and C, partial tiles,
  broadcast batch operands, a per-batch hyper-parameter table, epsilon;
* NVRTC compiles for sm_80 and sm_90: no spills on the small-K instances;
* errors: tensor hyper-parameters that require grad, double backward.

GPU (marker ``gpu``): fused kernel vs float64 within 1e-5 relative, memory
bound, determinism.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from cpu_shim import FLOAT_RUNNER_MAIN, MATVEC_GRAD_PRELUDE, THREAD_SHIM, build_cpu_runner, run_float_runner
import torch

import kermac_like as km
from kermac_like.ops import matvec as ops_matvec
from kermac_like.ops import matvec_backward as mg
from kermac_like.descriptor import InnerOperator, KernelDescriptor, KernelType, PowerType
from kermac_like.reference import distance_reference

DIFF_DESCRIPTORS = [d for d in KernelDescriptor.all() if d.inner_operator is InnerOperator.DIFF]
ALL_DESCRIPTORS = list(KernelDescriptor.all())


def hyper_for(desc, *, p=1.3, bandwidth=0.9):
    h = {}
    if desc.needs_inner_p:
        h["inner_p"] = p
    if desc.needs_outer_p:
        h["outer_p"] = p + 0.4
    if desc.needs_bandwidth:
        h["bandwidth"] = bandwidth
    return h


def oracle_contraction(desc, a, b, ga, vb, **h):
    """sum_n phi psi (ga . vb) through torch autograd of the dense float64 matrix:
    d/da of sum_{m,n,c} ga[m,c] K[m,n] vb[n,c]."""
    a = a.detach().clone().requires_grad_(True)
    kw = {k: v for k, v in h.items() if k in ("inner_p", "outer_p", "bandwidth")}
    Kmat = distance_reference(desc, a, b, epsilon=h.get("epsilon"), **kw)
    loss = (ga * (Kmat @ vb)).sum()
    (grad,) = torch.autograd.grad(loss, a)
    return grad


def rel(got, ref):
    return (got.double() - ref.double()).norm().item() / max(ref.double().norm().item(), 1e-300)


# ------------------------------------------------------------- the reference contraction
@pytest.mark.parametrize("desc", DIFF_DESCRIPTORS, ids=lambda d: d.short_name())
def test_reference_contraction_matches_autograd_of_the_dense_matrix(desc):
    g = torch.Generator().manual_seed(1)
    M, N, K, C = 7, 9, 3, 2
    a = torch.randn(M, K, generator=g, dtype=torch.float64)
    b = torch.randn(N, K, generator=g, dtype=torch.float64)
    ga = torch.randn(M, C, generator=g, dtype=torch.float64)
    vb = torch.randn(N, C, generator=g, dtype=torch.float64)
    h = hyper_for(desc)
    for eps in (None, 0.8):
        ref = oracle_contraction(desc, a, b, ga, vb, epsilon=eps, **h)
        got = mg.diff_contraction_reference(desc, a, b, ga, vb, epsilon=eps, **h)
        assert rel(got, ref) < 1e-12, (desc, eps)
        # the y-side: the same contraction with the roles exchanged
        b2 = b.clone().requires_grad_(True)
        kw = {k: v for k, v in h.items()}
        Kmat = distance_reference(desc, a, b2, epsilon=eps, **kw)
        (refb,) = torch.autograd.grad((ga * (Kmat @ vb)).sum(), b2)
        gotb = mg.diff_contraction_reference(desc, b, a, vb, ga, epsilon=eps, **h)
        assert rel(gotb, refb) < 1e-12, (desc, eps)


def test_reference_contraction_batches_tensor_hypers_and_small_blocks(monkeypatch):
    desc = KernelDescriptor("diff", "pow", "pow", "laplace")
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 1, 11, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3, 13, 4, generator=g, dtype=torch.float64)
    ga = torch.randn(2, 3, 11, 2, generator=g, dtype=torch.float64)
    vb = torch.randn(13, 2, generator=g, dtype=torch.float64)
    h = dict(inner_p=torch.tensor([1.2, 1.7, 2.5], dtype=torch.float64),
             outer_p=torch.tensor([1.5, 2.0, 1.1], dtype=torch.float64), bandwidth=1.3)
    full = mg.diff_contraction_reference(desc, a, b, ga, vb, **h)
    assert full.shape == (2, 3, 11, 4)
    for i, j in itertools.product(range(2), range(3)):
        hj = dict(inner_p=h["inner_p"][j].item(), outer_p=h["outer_p"][j].item(), bandwidth=1.3)
        ref = oracle_contraction(desc, a[i, 0], b[j], ga[i, j], vb, **hj)
        assert rel(full[i, j], ref) < 1e-12
    monkeypatch.setattr(mg, "BLOCK_ELEMENTS", 40)  # pieces of a few rows and columns
    small = mg.diff_contraction_reference(desc, a, b, ga, vb, **h)
    assert rel(small, full) < 1e-13


def test_reference_contraction_memory_is_bounded(monkeypatch):
    # The largest temporary is (rows of a) x (rows of b) x K within BLOCK_ELEMENTS * K:
    # count it through the einsum that consumes the pieces.
    seen = []
    real = torch.einsum

    def spy(eq, *ops):
        seen.append(max(o.numel() for o in ops))
        return real(eq, *ops)

    monkeypatch.setattr(mg, "BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(torch, "einsum", spy)
    desc = km.PRESETS["gaussian_l2"]
    a, b = torch.randn(300, 3, dtype=torch.float64), torch.randn(200, 3, dtype=torch.float64)
    ga, vb = torch.randn(300, 1, dtype=torch.float64), torch.randn(200, 1, dtype=torch.float64)
    mg.diff_contraction_reference(desc, a, b, ga, vb, bandwidth=1.0)
    assert seen and max(seen) <= 64 * 3
    assert len(seen) >= (300 * 200) // 64  # many pieces: no M x N temporary


# ------------------------------------------------------------- gradcheck of the op
def _gradcheck_case(desc, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(6, 2, generator=g, dtype=torch.float64, requires_grad=True)
    return x, y, v


@pytest.mark.parametrize("desc", ALL_DESCRIPTORS, ids=lambda d: d.short_name())
def test_gradcheck_kernel_matvec_every_descriptor(desc):
    x, y, v = _gradcheck_case(desc, 3)
    h = hyper_for(desc, p=1.6)
    h.update(regularization=0.3, regularization_offset_x=1)
    if desc.inner_operator is InnerOperator.DOT:
        h["epsilon"] = None

    def f(x, y, v):
        return km.kernel_matvec(desc, x, y, v, **h)

    assert torch.autograd.gradcheck(f, (x, y, v), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_with_epsilon_vector_v_and_broadcast_batch():
    desc = km.PRESETS["laplace_l2"]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    bw = torch.tensor([0.7, 1.4], dtype=torch.float64)

    def f(x, y, v):
        return km.kernel_matvec(desc, x, y, v, bandwidth=bw, epsilon=0.5)

    assert torch.autograd.gradcheck(f, (x, y, v), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_dot_with_epsilon_backward_matches_autograd_of_the_dense_matrix():
    desc = km.PRESETS["dot"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(8, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 3, generator=g, dtype=torch.float64)
    out = km.kernel_matvec(desc, x, y, v, epsilon=0.2)
    got = torch.autograd.grad((out * w).sum(), (x, y, v))
    dense = distance_reference(desc, x, y, epsilon=0.2) @ v
    ref = torch.autograd.grad((dense * w).sum(), (x, y, v))
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-12


def test_hyper_parameter_gradients_are_refused_by_name():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 3, dtype=torch.float64)
    v = torch.randn(5, dtype=torch.float64)
    bw = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="bandwidth"):
        km.kernel_matvec(km.PRESETS["gaussian_l2"], x, y, v, bandwidth=bw).sum().backward()


def test_double_backward_is_refused():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 3, dtype=torch.float64)
    v = torch.randn(5, dtype=torch.float64)
    out = km.kernel_matvec(km.PRESETS["gaussian_l2"], x, y, v, bandwidth=1.0)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


# ------------------------------------------------------------- CUDA kernel on the CPU
SHIM = THREAD_SHIM + MATVEC_GRAD_PRELUDE + r"""
#define T(ip, op, ep, kk, kc, e) MatvecGradTraits<Power::ip, Power::op, Epilogue::ep, kk, kc, e>
@@INSTANCES@@

template <class Tr>
void run(std::vector<float>& buf, const long long* h, const float* hf) {
  // h: M N K C L a_bs b_bs g_bs v_bs hyp_on hyp_bs | offsets of a b g v out hyp
  float* base = buf.data();
  const int M = h[0], N = h[1], K = h[2], C = h[3], L = h[4];
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), 1u, unsigned(L < 3 ? L : 3)};
  kl_run_grid(Tr::kThreads, [&] {
    matvec_grad_kernel<Tr>(base + h[16], base + h[17], base + h[18], base + h[19], base + h[20], M, N, K, C, L,
                           h[5], h[6], h[7], h[8], h[9] ? base + h[21] : nullptr, h[10], hf[0], hf[1], hf[2], hf[3],
                           N);  // one split: n_per = N
  });
}

""" + FLOAT_RUNNER_MAIN

# (descriptor, kK, kC, epsilon): every inner power, outer power and epilogue; padding of
# K (3 in 4, 5 in 8) and C (3 in 4); the small-K instance of the D = 3 benchmark.
CPU_INSTANCES = [
    (KernelDescriptor("diff", "square", "sqrt", "gaussian"), 3, 1, False),
    (KernelDescriptor("diff", "square", "sqrt", "laplace"), 4, 4, True),
    (KernelDescriptor("diff", "abs", "noop", "none"), 8, 1, False),
    (KernelDescriptor("diff", "abs", "noop", "laplace"), 3, 2, True),
    (KernelDescriptor("diff", "pow", "pow", "none"), 4, 2, False),
    (KernelDescriptor("diff", "pow", "noop", "gaussian"), 3, 4, True),
    (KernelDescriptor("diff", "square", "noop", "gaussian"), 2, 1, False),
    (KernelDescriptor("diff", "pow", "pow", "laplace"), 8, 4, True),
    (KernelDescriptor("diff", "square", "pow", "gaussian"), 3, 1, True),
    (KernelDescriptor("diff", "abs", "sqrt", "none"), 1, 1, False),
]


def _traits_args(desc, kk, kc, eps):
    cap = lambda p: p.name.capitalize()  # noqa: E731
    return f"T({cap(desc.inner_power)}, {cap(desc.outer_power)}, {cap(desc.kernel_type)}, {kk}, {kc}, " \
           f"{'true' if eps else 'false'})"


@pytest.fixture(scope="module")
def cpu_runner(tmp_path_factory):
    inst = [f"using I{i} = {_traits_args(*c)};" for i, c in enumerate(CPU_INSTANCES)]
    cases = [f"    case {i}: run<I{i}>(buf, h, hf); break;" for i in range(len(CPU_INSTANCES))]
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "matvec_grad_cpu", src)


def run_kernel_on_cpu(exe, tmp_path, idx, a, b, ga, vb, *, q=1.0, r=1.0, bw=1.0, eps=0.0, table=None):
    """a (La, M, K), b (Lb, N, K), ga (Lg, M, C), vb (Lv, N, C) with La.. in {1, L}; returns (L, M, K)."""
    L = max(t.shape[0] for t in (a, b, ga, vb))
    M, K = a.shape[1:]
    N, C = vb.shape[1], ga.shape[2]
    out = np.full((L, M, K), np.nan, dtype=np.float32)  # poisoned: every element must be written
    hyp = np.zeros(3, np.float32) if table is None else np.asarray(table, np.float32)
    bstride = lambda t, rows, cols: 0 if t.shape[0] == 1 else rows * cols  # noqa: E731
    head = [M, N, K, C, L, bstride(a, M, K), bstride(b, N, K), bstride(ga, M, C), bstride(vb, N, C),
            table is not None, 0 if table is None or len(table) == 3 else 3]
    return run_float_runner(exe, tmp_path, idx, (a, b, ga, vb, out, hyp), head, (q, r, bw, eps), 4)


@pytest.mark.parametrize("idx", range(len(CPU_INSTANCES)))
def test_cuda_kernel_executed_on_cpu_matches_the_float64_reference(cpu_runner, tmp_path, idx):
    desc, kk, kc, eps_on = CPU_INSTANCES[idx]
    rng = np.random.default_rng(idx)
    K = {1: 1, 2: 2, 3: 3, 4: 3, 8: 5}[kk]
    C = {1: 1, 2: 2, 4: 3}[kc]
    M, N = 700, 300  # two row blocks at kRows = 4 (kBlockM 512), a partial b tile
    L = 2
    a = rng.standard_normal((L, M, K)).astype(np.float32)
    b = rng.standard_normal((1, N, K)).astype(np.float32)  # broadcast over the batch
    ga = rng.standard_normal((L, M, C)).astype(np.float32)
    vb = rng.standard_normal((1, N, C)).astype(np.float32)
    q = 1.4 if desc.inner_power is PowerType.POW else {PowerType.ABS: 1.0, PowerType.SQUARE: 2.0}[desc.inner_power]
    r, bw = 1.7, 1.1
    eps = 0.6 if eps_on else 0.0
    table = None
    if idx % 3 == 1:  # per-batch (q, r, bw)
        table = [q, r, bw, q * 1.1 if desc.inner_power is PowerType.POW else q, r * 0.8, bw * 1.5]
    got = run_kernel_on_cpu(cpu_runner, tmp_path, idx, a, b, ga, vb, q=q, r=r, bw=bw, eps=eps, table=table)
    for l in range(L):
        ql, rl, bwl = (table[3 * l: 3 * l + 3] if table else (q, r, bw))
        h = {}
        if desc.needs_inner_p:
            h["inner_p"] = ql
        if desc.needs_outer_p:
            h["outer_p"] = rl
        if desc.needs_bandwidth:
            h["bandwidth"] = bwl
        t = lambda z: torch.from_numpy(z).double()  # noqa: E731
        ref = mg.diff_contraction_reference(desc, t(a[l]), t(b[0]), t(ga[l]), t(vb[0]),
                                            epsilon=eps if eps_on else None, **h)
        assert np.isfinite(got[l]).all()
        assert rel(torch.from_numpy(got[l]), ref) < 2e-5, (desc, l)


# ------------------------------------------------------------- NVRTC
def _compile(specs, arch):
    from kermac_like.runtime.compiler import compile_specs

    try:
        return compile_specs(specs, arch)
    except ImportError as e:  # pragma: no cover - depends on the installed cuda.core
        pytest.skip(f"cuda.core unavailable: {e}")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_instantiations_compile_without_spills(arch):
    specs = [
        mg.matvec_grad_spec(km.PRESETS["gaussian_l2"], 3, 1, False),
        mg.matvec_grad_spec(km.PRESETS["laplace_l1"], 8, 4, True),
        mg.matvec_grad_spec(km.PRESETS["p_norm"], 16, 1, False),
        mg.matvec_grad_spec(KernelDescriptor("diff", "square", "pow", "gaussian"), 32, 32, True),
    ]
    specs.append(mg.matvec_grad_spec(km.PRESETS["gaussian_l2"], 3, 1, False, unroll=1))
    _, res = _compile(specs, arch)
    assert len(res) == 5
    # the D = 3 instance of the benchmark: no spills; the others at most a few bytes
    for spec in (specs[0], specs[-1]):
        r = res[spec.name_expression]
        assert r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0, (spec.traits, r)
    for spec in specs:
        assert res[spec.name_expression].get("spill_stores", 0) <= 16, (spec.traits, res[spec.name_expression])


def test_spec_mirror_and_widths():
    assert mg.fused_widths(3, 1) == (3, 1)
    assert mg.fused_widths(5, 3) == (8, 4)
    assert mg.fused_widths(33, 1) is None and mg.fused_widths(3, 33) is None
    s = mg.matvec_grad_spec(km.PRESETS["gaussian_l2"], 3, 1, False)
    assert s.launch.block_m == 512 and s.launch.smem_bytes == 128 * 4 * 4
    assert "static_assert" in s.asserts()
    with pytest.raises(ValueError, match="descriptor"):
        mg.matvec_grad_spec(km.PRESETS["dot"], 3, 1, False)


# ------------------------------------------------------------- GPU
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_case(desc, M, N, K, C, seed, *, batch=(), dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*batch, M, K, device="cuda", generator=g).to(dtype)
    y = torch.randn(N, K, device="cuda", generator=g).to(dtype)
    v = torch.randn(*batch, N, C, device="cuda", generator=g).to(dtype)
    w = torch.randn(*batch, M, C, device="cuda", generator=g).to(torch.float64)
    return x, y, v, w


def _grads(desc, x, y, v, w, **h):
    x, y, v = (t.detach().clone().requires_grad_(True) for t in (x, y, v))
    out = km.kernel_matvec(desc, x, y, v, **h)
    return torch.autograd.grad((out.double() * w).sum(), (x, y, v))


GPU_SHAPES = [(129, 1000, 3, 1), (7, 127, 5, 3), (1000, 129, 16, 16), (1, 300, 32, 2), (64, 70, 40, 3)]
GPU_CASES = [(d, GPU_SHAPES[0]) for d in DIFF_DESCRIPTORS + [km.PRESETS["dot"]]] + [
    (d, s) for d in (km.PRESETS["gaussian_l2"], km.PRESETS["laplace_l1"], km.PRESETS["p_norm"], km.PRESETS["dot"],
                     KernelDescriptor("diff", "square", "noop", "laplace"))
    for s in GPU_SHAPES[1:]
]


def up_front_specs():
    """The fused instantiations the GPU tests reach (conftest's session fixture compiles those of every GPU
    module in the session once, before the tests; gpu_kernels then finds them)."""
    specs = []
    for desc, (M, N, K, C) in GPU_CASES:
        w = mg.fused_widths(K, C)
        if desc.inner_operator is InnerOperator.DIFF and w is not None:
            specs.append(mg.matvec_grad_spec(desc, *w, False))
    specs.append(mg.matvec_grad_spec(KernelDescriptor("diff", "pow", "pow", "laplace"), 4, 2, True))
    specs.append(mg.matvec_grad_spec(km.PRESETS["gaussian_l2"], 4, 2, False))
    return specs


@pytest.fixture(scope="module")
def gpu_kernels():
    """Compile the fused instantiations these tests reach in a few parallel NVRTC programs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from kermac_like.runtime.compiler import arch_of_device, precompile_specs
    from shipped_build import up_front_turn

    with up_front_turn():  # under xdist: after the session's compile of every GPU module's kernels
        return precompile_specs(up_front_specs(), arch_of_device(torch.device("cuda")))


@gpu
@needs_cuda
@pytest.mark.parametrize("desc,shape", GPU_CASES, ids=lambda c: c.short_name() if hasattr(c, "short_name") else str(c))
def test_gpu_gradients_match_float64(gpu_kernels, desc, shape):
    M, N, K, C = shape
    x, y, v, w = _gpu_case(desc, M, N, K, C, seed=M + K)
    h = hyper_for(desc, p=1.3, bandwidth=float(K) ** 0.5)
    got = _grads(desc, x, y, v, w, **h)
    ref = _grads(desc, x.double(), y.double(), v.double(), w, **h)
    for name, a, b in zip("xyv", got, ref):
        assert a.dtype == torch.float32
        assert rel(a, b) < 1e-5, (name, rel(a, b))


@gpu
@needs_cuda
def test_gpu_batched_tensor_hypers_epsilon_half_inputs(gpu_kernels):
    desc = KernelDescriptor("diff", "pow", "pow", "laplace")
    x, y, v, w = _gpu_case(desc, 300, 400, 4, 2, seed=9, batch=(3,))
    h = dict(inner_p=torch.tensor([1.2, 1.7, 2.5], device="cuda"), outer_p=torch.tensor([1.5, 2.0, 1.1], device="cuda"),
             bandwidth=1.5, epsilon=0.3)
    got = _grads(desc, x, y, v, w, **h)
    ref = _grads(desc, x.double(), y.double(), v.double(), w,
                 **{k: (t.double() if isinstance(t, torch.Tensor) else t) for k, t in h.items()})
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-5
    xh, yh, vh = x.half(), y.half(), v.half()
    got = _grads(km.PRESETS["gaussian_l2"], xh, yh, vh, w, bandwidth=2.0)
    ref = _grads(km.PRESETS["gaussian_l2"], xh.double(), yh.double(), vh.double(), w, bandwidth=2.0)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float16 and rel(a, b) < 2e-3


@gpu
@needs_cuda
def test_gpu_backward_memory_is_linear_and_deterministic():
    desc = km.PRESETS["gaussian_l2"]
    M = N = 200_000
    x = torch.randn(M, 3, device="cuda")
    y = torch.randn(N, 3, device="cuda")
    v = torch.randn(N, device="cuda")
    g = torch.randn(M, device="cuda")
    from kermac_like.matvec import prepare_matvec

    call = prepare_matvec(desc, x, y, v, bandwidth=0.5)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gx, gy, gv = ops_matvec.gradients(call, g)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # outputs (M*3 + N*3 + N floats) plus O((M + N)(C + K)) scratch; never M x N (160 GB)
    assert extra <= 4 * (M + N) * (3 + 1) * 4 + (64 << 20), extra
    gx2, gy2, gv2 = ops_matvec.gradients(call, g)
    assert torch.equal(gx, gx2) and torch.equal(gy, gy2) and torch.equal(gv, gv2)


def test_contraction_op_passes_opcheck_and_matches_the_function():
    desc = KernelDescriptor("diff", "pow", "pow", "gaussian")
    g = torch.Generator().manual_seed(7)
    a = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)
    b = torch.randn(6, 3, generator=g, dtype=torch.float64)
    ga = torch.randn(2, 5, 2, generator=g, dtype=torch.float64)
    vb = torch.randn(6, 2, generator=g, dtype=torch.float64)
    p = torch.tensor([1.3, 1.8], dtype=torch.float64)
    args = (a, b, ga, vb, [0, 4, 4, 2], None, p, 1.5, None, 0.9, None, 0.2, False)
    torch.library.opcheck(torch.ops.kermac_like.matvec_grad_contraction.default, args)
    got = mg.contraction(desc, a, b, ga, vb, inner_p=p, outer_p=1.5, bandwidth=0.9, epsilon=0.2)
    ref = mg.diff_contraction_reference(desc, a, b, ga, vb, inner_p=p, outer_p=1.5, bandwidth=0.9, epsilon=0.2)
    assert got.shape == (2, 5, 3) and torch.equal(got, ref)


def test_contraction_op_traces_under_torch_compile():
    desc = km.PRESETS["laplace_l2"]
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(7, 3, generator=g), torch.randn(9, 3, generator=g)
    ga, vb = torch.randn(7, 2, generator=g), torch.randn(9, 2, generator=g)

    def f(a, b, ga, vb):
        return mg.contraction(desc, a, b, ga, vb, bandwidth=1.3) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(a, b, ga, vb), f(a, b, ga, vb), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("idx", [0, 3, 4])
def test_cuda_kernel_on_cpu_propagates_nan_like_the_dense_backward(cpu_runner, tmp_path, idx):
    desc, kk, kc, eps_on = CPU_INSTANCES[idx]
    rng = np.random.default_rng(50 + idx)
    K, C = min(kk, 3), min(kc, 2)
    a = rng.standard_normal((1, 300, K)).astype(np.float32)
    b = rng.standard_normal((1, 200, K)).astype(np.float32)
    ga = rng.standard_normal((1, 300, C)).astype(np.float32)
    vb = rng.standard_normal((1, 200, C)).astype(np.float32)
    a[0, 5, K - 1] = np.nan
    got = run_kernel_on_cpu(cpu_runner, tmp_path, idx, a, b, ga, vb, q=1.4, r=1.7, bw=1.1, eps=0.6 if eps_on else 0.0)
    assert np.isnan(got[0, 5]).all()
    assert np.isfinite(np.delete(got[0], 5, axis=0)).all()


@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l1", "p_norm", "l2"])
def test_nan_inputs_give_nan_gradients_where_they_reach(name):
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    x[2, 1] = float("nan")
    x.requires_grad_(True)
    y = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 2, generator=g, dtype=torch.float64, requires_grad=True)
    h = hyper_for(desc, p=1.5, bandwidth=1.0)
    gx, gy, gv = torch.autograd.grad(km.kernel_matvec(desc, x, y, v, **h).sum(), (x, y, v))
    assert gx[2].isnan().all() and not gx[[0, 1, 3, 4, 5]].isnan().any()
    assert gy.isnan().all() and gv.isnan().all()  # every y_n and v_n meets x_2


# ------------------------------------------------------------- registration (register_autograd)
from typing import Optional  # noqa: E402

from kermac_like.matvec import matvec_forward, prepare_matvec  # noqa: E402
from kermac_like.testing import library  # noqa: E402


def _test_call(x, y, v, descriptor, ip, ipt, op, opt, bw, bwt, rg, rgt, reg_diag, epsilon):
    return prepare_matvec(library.descriptor_from_ints(descriptor), x, y, v, inner_p=library.join_hyper(ip, ipt),
                          outer_p=library.join_hyper(op, opt), bandwidth=library.join_hyper(bw, bwt),
                          regularization=library.join_hyper(rg, rgt), regularization_offset_x=reg_diag, epsilon=epsilon)


# An op with the schema of the registration comment in ops/matvec.py, under a test namespace.
@torch.library.custom_op("kermac_like_test::kernel_matvec", mutates_args=())
def _test_matvec_op(x: torch.Tensor, y: torch.Tensor, v: torch.Tensor, descriptor: list[int],
                    inner_p: Optional[float], inner_p_tensor: Optional[torch.Tensor], outer_p: Optional[float],
                    outer_p_tensor: Optional[torch.Tensor], bandwidth: Optional[float],
                    bandwidth_tensor: Optional[torch.Tensor], regularization: Optional[float],
                    regularization_tensor: Optional[torch.Tensor], reg_diag: int, epsilon: Optional[float],
                    debug: bool) -> torch.Tensor:
    call = _test_call(x, y, v, descriptor, inner_p, inner_p_tensor, outer_p, outer_p_tensor, bandwidth,
                      bandwidth_tensor, regularization, regularization_tensor, reg_diag, epsilon)
    return matvec_forward(call, debug=debug)


@_test_matvec_op.register_fake
def _(x, y, v, descriptor, *rest):
    call = _test_call(x, y, v, descriptor, *rest[:-1])
    return x.new_empty(call.out_shape)


_test_matvec_op.register_autograd(ops_matvec.backward, setup_context=ops_matvec.setup_context)


def _op_args(desc, x, y, v, *, reg_diag=0, epsilon=None, **h):
    hp = [h.get(k) for k in ("inner_p", "outer_p", "bandwidth", "regularization")]
    return (x, y, v, library.descriptor_ints(desc), *[a for k in hp for a in library.split_hyper(k)], reg_diag, epsilon, False)


@pytest.mark.parametrize("name,vec", [("laplace_p", False), ("gaussian_l2", True), ("dot", False)])
def test_registered_backward_gradchecks_and_traces(name, vec):
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*((6,) if vec else (6, 2)), generator=g, dtype=torch.float64, requires_grad=True)
    h = hyper_for(desc, p=1.6)
    h["regularization"] = 0.4

    def f(x, y, v):
        return torch.ops.kermac_like_test.kernel_matvec.default(*_op_args(desc, x, y, v, reg_diag=1, **h))

    assert torch.autograd.gradcheck(f, (x, y, v), eps=1e-6, atol=1e-6, rtol=1e-5)
    w = torch.randn(5, *(() if vec else (2,)), generator=g, dtype=torch.float64)
    ref = torch.autograd.grad((f(x, y, v) * w).sum(), (x, y, v))
    compiled = torch.compile(lambda x, y, v: (f(x, y, v) * w).sum(), fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, y, v), (x, y, v))
    for a, b in zip(got, ref):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(f(x, y, v).sum(), x, create_graph=True)
