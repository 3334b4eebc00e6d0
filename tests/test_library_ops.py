"""The public ops as torch.library custom ops: opcheck of every op (schema, fake
implementation, autograd registration, AOT dispatch), torch.compile(fullgraph=True) of a
function per op family on CPU, the eager fast path against the dispatcher; on a GPU
(marker gpu): compile on CUDA and CUDA-graph capture after a warm-up call."""

from __future__ import annotations

import pytest
import torch

import kermac_like as km
from kermac_like.config import override
from kermac_like.ops import linalg as _linalg  # noqa: F401  (registers the linalg ops)
from kermac_like.ops import distance as distance_op
from kermac_like.ops import knn as knn_op
from kermac_like.ops import matvec as matvec_op
from kermac_like.testing import library

F64 = torch.float64
MODE = "use_mm_for_euclid_dist_if_necessary"
OPS = torch.ops.kermac_like


def _spd(L: int, n: int, dtype=F64, device="cpu"):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(L, n, n, generator=g, dtype=dtype)
    return (a @ a.mT + n * torch.eye(n, dtype=dtype)).to(device)


def _distance_args(requires_grad: bool):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 5, 3, generator=g, dtype=F64, requires_grad=requires_grad)
    b = torch.randn(4, 3, generator=g, dtype=F64, requires_grad=requires_grad)
    bw = torch.tensor([[1.5], [2.0]], dtype=F64)  # per batch entry, broadcast over a second mode
    desc = library.descriptor_ints(km.PRESETS["laplace_p"])
    return (a, b, desc, 1.3, None, 1.3, None, None, bw, 0.25, None, 1, 1e-6, MODE, False)


def _grad_args():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 3, 7, generator=g, dtype=F64)
    b = torch.randn(5, 3, generator=g, dtype=F64)
    c = torch.randn(1, 3, generator=g, dtype=F64)
    d = torch.randn(2, 5, 7, generator=g, dtype=F64)
    return a, b, c, d


def _op_cases():
    args = _distance_args(True)
    yield "run_kernel", OPS.run_kernel.default, args
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)
    yield "run_kernel_out", OPS.run_kernel_out.default, plain + (torch.empty(2, 2, 5, 4, dtype=F64),)
    a, b, c, d = _grad_args()
    yield "cdist_grad", OPS.cdist_grad.default, (a, b, c, d, None, torch.tensor([1.3, 2.5], dtype=F64), False)
    yield "cdist_grad_out", OPS.cdist_grad_out.default, (a, b, c, d, 1.0, None, False, torch.empty(2, 1, 5, 7, dtype=F64))
    spd, rhs = _spd(2, 4), torch.randn(2, 3, 4, dtype=F64)
    for routine in ("solve_cholesky", "solve_lu"):
        yield routine, getattr(OPS, routine).default, (spd, rhs, False, False)
        yield f"{routine}_inplace", getattr(OPS, f"{routine}_inplace").default, (spd.clone(), rhs.clone(), False, False)
        yield f"{routine}_into", getattr(OPS, f"{routine}_into").default, (spd, rhs.clone(), False, False)
    x = torch.randn(2, 6, 3, dtype=F64, requires_grad=True)
    topk = (x, torch.randn(15, 3, dtype=F64), library.descriptor_ints(km.PRESETS["laplace_p"]), 1.3, None, 1.3, None, None,
            torch.tensor([1.5, 2.0], dtype=F64), 0.25, None, 1, None, 4, True, None, MODE, False)
    yield "kernel_topk", OPS.kernel_topk.default, topk
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in topk)
    yield "kernel_topk_out", OPS.kernel_topk_out.default, plain + (torch.empty(2, 6, 4, dtype=F64),
                                                                    torch.empty(2, 6, 4, dtype=torch.int64))
    yield "knn_inf", OPS.kernel_topk.default, (x, topk[1], [], *(None,) * 8, 0, None, 3, False, float("inf"), MODE,
                                                False)
    lse = (x, torch.randn(15, 3, dtype=F64, requires_grad=True), torch.randn(15, 2, dtype=F64, requires_grad=True),
           library.descriptor_ints(km.PRESETS["laplace_p"]), 1.3, None, 1.3, None, None,
           torch.tensor([1.5, 2.0], dtype=F64), 1e-6, False)
    yield "kernel_logsumexp", OPS.kernel_logsumexp.default, lse
    plain = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in lse)
    yield "kernel_logsumexp_out", OPS.kernel_logsumexp_out.default, plain + (torch.empty(2, 6, 2, dtype=F64),)
    yield "eigh", OPS.eigh.default, (spd[0], False, False)
    yield "eigh_inplace", OPS.eigh_inplace.default, (spd.clone(), False, False)


_CASES = list(_op_cases())


@pytest.mark.parametrize("name,op,args", _CASES, ids=[c[0] for c in _CASES])
def test_opcheck(name, op, args):
    torch.library.opcheck(op, args)


def test_descriptor_round_trip():
    for desc in km.KernelDescriptor.all():
        assert library.descriptor_from_ints(library.descriptor_ints(desc)) == desc


# -- torch.compile(fullgraph=True) on CPU: one small function per op family ------------------
# backend "aot_eager": dynamo + fake tensors + AOT autograd, without inductor's C++ build.
def test_compile_fullgraph_distance_forward_backward():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 4, generator=g, dtype=F64)
    y = torch.randn(5, 4, generator=g, dtype=F64)
    bw = torch.tensor([[1.5], [2.5]], dtype=F64)

    def f(x, y):
        k = km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=bw, regularization=0.1)
        return torch.exp(-km.cdist(x, y, p=1.0) / 2).sum(-1) + k.sum(-1)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = f(xr, y), compiled(xc, y)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    want.sum().backward()
    got.sum().backward()
    assert torch.allclose(xc.grad, xr.grad, rtol=1e-12, atol=1e-12)
    out = torch.full((2, 6, 5), float("nan"), dtype=F64)
    torch.compile(lambda x, y, o: km.cdist(x, y, 1.7, out=o), fullgraph=True, backend="aot_eager")(x, y, out)
    assert torch.allclose(out, torch.cdist(x, y, 1.7), rtol=1e-12)


def test_compile_fullgraph_topk_forward_backward():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6, 3, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(15, 3, generator=g, dtype=F64)
    bw = torch.tensor([1.5, 2.0], dtype=F64)

    def f(a, b):
        v, i = km.knn(a, b, 3, p=1.5)
        w, _ = km.kernel_topk(km.PRESETS["gaussian_l2"], a, b, 2, bandwidth=bw)
        return v.sum() + w.sum(), i

    (s1, i1), (s2, i2) = torch.compile(f, fullgraph=True, backend="aot_eager")(x, y), f(x, y)
    g1, = torch.autograd.grad(s1, x)
    g2, = torch.autograd.grad(s2, x)
    assert torch.equal(i1, i2) and torch.allclose(s1, s2, rtol=1e-14)
    assert torch.allclose(g1, g2, rtol=1e-12, atol=1e-12)


def test_compile_fullgraph_logsumexp_forward_backward():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 6, 3, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(15, 3, generator=g, dtype=F64)
    lw = torch.randn(15, generator=g, dtype=F64, requires_grad=True)
    bw = torch.tensor([1.5, 2.0], dtype=F64)

    def f(a, w):
        return km.kernel_logsumexp(km.PRESETS["gaussian_l2"], a, y, w, bandwidth=bw)

    got, want = torch.compile(f, fullgraph=True, backend="aot_eager")(x, lw), f(x, lw)
    g1 = torch.autograd.grad(got.sum(), (x, lw))
    g2 = torch.autograd.grad(want.sum(), (x, lw))
    ref = torch.logsumexp(-torch.cdist(x, y).square() / (2 * bw.view(2, 1, 1) ** 2) + lw, -1)
    assert got.shape == (2, 6) and torch.allclose(got, ref, rtol=1e-12)
    assert torch.allclose(got, want, rtol=1e-14)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(g1, g2))
    out = torch.full((2, 6), float("nan"), dtype=F64)
    torch.compile(lambda a, o: km.kernel_logsumexp(km.PRESETS["gaussian_l2"], a, y, bandwidth=bw, out=o),
                  fullgraph=True, backend="aot_eager")(x.detach(), out)
    assert torch.allclose(out, torch.logsumexp(-torch.cdist(x, y).square() / (2 * bw.view(2, 1, 1) ** 2), -1),
                          rtol=1e-12)


def test_compile_fullgraph_cdist_grad():
    a, b, c, d = _grad_args()
    out = torch.full((2, 1, 5, 7), float("nan"), dtype=F64)
    f = torch.compile(lambda a, b, c, d, o: km.cdist_grad(a, b, c, d, p=1.3, out=o) * 2, fullgraph=True,
                      backend="aot_eager")
    got = f(a, b, c, d, out)
    want = km.cdist_grad(a, b, c, d, p=1.3)
    assert torch.allclose(out, want) and torch.allclose(got, 2 * want)


def test_compile_fullgraph_linalg():
    a, b = _spd(2, 5), torch.randn(2, 3, 5, dtype=F64)

    def f(a, b):
        x, finfo, _ = km.linalg.solve_cholesky(a, b)
        w, v, info = km.linalg.eigh(a)
        return x, w, finfo + info

    x, w, info = torch.compile(f, fullgraph=True, backend="aot_eager")(a, b)
    assert torch.allclose(a @ x.mT, b.mT) and torch.allclose(w, torch.linalg.eigvalsh(a)) and not info.any()


# -- the eager fast path ------------------------------------------------------------------------
def test_eager_calls_skip_the_dispatcher_only_when_it_has_nothing_to_do(monkeypatch, settings):
    x, y = torch.randn(6, 3), torch.randn(5, 3)

    def refuse(*args):
        raise AssertionError("dispatcher used")

    monkeypatch.setattr(distance_op, "_RUN_KERNEL", refuse)
    monkeypatch.setattr(distance_op, "_RUN_KERNEL_OUT", refuse)
    direct = km.cdist(x, y, 1.5)  # plain tensors, no grad: the implementation itself
    km.cdist(x, y, 1.5, out=torch.empty(6, 5))
    km.cdist(x.requires_grad_(), y, 1.5).sum().backward()  # autograd: the eager Function, backward included
    x.requires_grad_(False)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(AssertionError, match="dispatcher"), FakeTensorMode() as mode:  # a dispatch mode
        km.cdist(mode.from_tensor(x), mode.from_tensor(y), 1.5)
    monkeypatch.undo()
    settings(direct_eager=False)
    via_dispatcher = km.cdist(x, y, 1.5)
    assert torch.equal(direct, via_dispatcher)


def _differentiable_calls():
    """(name, function of x, y, v giving a scalar) of every differentiable public op."""
    lap, gau = km.preset("laplace_l2"), km.preset("gaussian_l2")
    return [
        ("cdist", lambda x, y, v: km.cdist(x, y, 1.5).sum()),
        ("cdist_p2", lambda x, y, v: (km.cdist(x, y) * v[:, 0]).sum()),
        ("run_kernel", lambda x, y, v: (km.run_kernel(lap, x, y, bandwidth=2.0, regularization=0.5) * v[:, 0]).sum()),
        ("kernel_matvec", lambda x, y, v: km.kernel_matvec(gau, x, y, v, bandwidth=1.5).square().sum()),
        ("knn", lambda x, y, v: km.knn(x, y, 3)[0].square().sum()),
        ("kernel_topk", lambda x, y, v: km.kernel_topk(gau, x, y, 2, bandwidth=1.0)[0].sum()),
        ("kernel_logsumexp", lambda x, y, v: km.kernel_logsumexp(gau, x, y, v[:, 0], bandwidth=2.0).sum()),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_eager_autograd_matches_the_dispatcher(monkeypatch, dtype):
    """A differentiable eager call records the op's own setup_context and backward in a plain
    autograd.Function (ops/_library.register_autograd): values and gradients bitwise those
    of the op through the dispatcher, which never runs meanwhile."""
    g = torch.Generator().manual_seed(5)
    x, y, v = (torch.randn(n, 3, generator=g, dtype=dtype) for n in (9, 7, 7))

    def run(f):
        xs = [t.clone().requires_grad_() for t in (x, y, v)]
        out = f(*xs)
        out.backward()
        return out.detach(), [t.grad for t in xs]

    def refuse(*args):
        raise AssertionError("dispatcher used")

    for name, f in _differentiable_calls():
        with monkeypatch.context() as m:
            for mod, attr in ((distance_op, "_RUN_KERNEL"), (matvec_op, "_MATVEC"), (knn_op, "_TOPK")):
                m.setattr(mod, attr, refuse)
            eager = run(f)
        with override(direct_eager=False):
            via_dispatcher = run(f)
        assert torch.equal(eager[0], via_dispatcher[0]), name
        for a, b in zip(eager[1], via_dispatcher[1]):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


def test_first_differentiable_calls_do_not_import_dynamo():
    """torch.library's custom-op kernel imports torch._dynamo (and sympy) on its first call,
    seconds; an eager differentiable call of every public op, forward and backward, imports
    neither (one fresh process for all)."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys, torch
import kermac_like as km
sys.path.insert(0, sys.argv[1])
from test_library_ops import _differentiable_calls
before = {m for m in ("torch._dynamo", "sympy") if m in sys.modules}
for name, f in _differentiable_calls():
    x, y, v = (torch.randn(n, 3, requires_grad=True) for n in (9, 7, 7))
    f(x, y, v).backward()
    assert x.grad is not None and y.grad is not None, name
    new = [m for m in ("torch._dynamo", "sympy") if m in sys.modules and m not in before]
    assert not new, (name, new)
print("ok")
"""
    here = Path(__file__).resolve().parent
    res = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, cwd=here.parent)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


# -- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_compile_fullgraph():
    x = torch.randn(300, 40, device="cuda")
    y = torch.randn(200, 40, device="cuda")
    bw = torch.tensor([2.0, 3.0], device="cuda").reshape(2, 1, 1)

    def f(x, y):
        k = km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=bw.squeeze(-1), regularization=0.5)
        return torch.exp(-km.cdist(x, y, p=1.0) / 2).sum(1) + k.sum(-1) + km.cdist(x, y).sum(1)

    compiled = torch.compile(f, fullgraph=True)
    xr, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = f(xr, y), compiled(xc, y)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-4, atol=1e-4)
    a, b, c, d = (torch.randn(2, 64, 96, device="cuda"), torch.randn(2, 80, 64, device="cuda"),
                  torch.randn(2, 4, 64, device="cuda"), torch.randn(2, 80, 96, device="cuda"))
    g = torch.compile(lambda a, b, c, d: km.cdist_grad(a, b, c, d, p=1.0).sum(1), fullgraph=True)
    torch.testing.assert_close(g(a, b, c, d), km.cdist_grad(a, b, c, d, p=1.0).sum(1))


def _graph_case(name):
    g = torch.Generator(device="cuda").manual_seed(7)
    if name.startswith("cdist_p"):
        p = {"cdist_p1": 1.0, "cdist_p2": 2.0, "cdist_p1.3": 1.3}[name]
        x, y = torch.randn(2, 300, 64, device="cuda", generator=g), torch.randn(200, 64, device="cuda", generator=g)
        out = torch.empty(2, 300, 200, device="cuda")
        return (x, y), out, lambda x, y, o: km.cdist(x, y, p, out=o)
    if name == "laplace_bw_tensor":
        x, y = torch.randn(2, 300, 64, device="cuda", generator=g), torch.randn(2, 200, 64, device="cuda", generator=g)
        bw = torch.tensor([4.0, 6.0], device="cuda")
        out = torch.empty(2, 300, 200, device="cuda")
        return (x, y), out, lambda x, y, o: km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=bw, out=o)
    if name == "cdist_grad":
        ops = (torch.randn(2, 64, 96, device="cuda", generator=g), torch.randn(80, 64, device="cuda", generator=g),
               torch.randn(4, 64, device="cuda", generator=g), torch.randn(2, 80, 96, device="cuda", generator=g))
        out = torch.empty(2, 4, 80, 96, device="cuda")
        return ops, out, lambda a, b, c, d, o: km.cdist_grad(a, b, c, d, p=2.0, out=o)
    raise KeyError(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cdist_p1", "cdist_p2", "cdist_p1.3", "laplace_bw_tensor", "cdist_grad"])
def test_gpu_cuda_graph_capture_after_warm_up(name):
    inputs, out, fn = _graph_case(name)
    fn(*inputs, out)  # warm-up: compiles or loads the kernels, sizes nothing inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode "global": a sync or cudaMalloc fails the capture
        fn(*inputs, out)
    for t in inputs:  # new data in the captured buffers, poisoned output: the replay must do the work
        t.copy_(torch.randn_like(t))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.empty_like(out)
    fn(*inputs, want)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_opcheck():
    g = torch.Generator(device="cuda").manual_seed(9)
    a = torch.randn(2, 70, 32, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(50, 32, device="cuda", generator=g, requires_grad=True)
    for name in ("l2", "l1", "laplace_l2"):  # tensor cores (wgmma on sm_90), SIMT, fused epilogue
        args = (a, b, library.descriptor_ints(km.PRESETS[name]), None, None, None, None, 3.0, None, None, None, 0, None,
                MODE, False)
        torch.library.opcheck(OPS.run_kernel.default, args)
    ga, gb, gc, gd = (torch.randn(2, 32, 48, device="cuda", generator=g), torch.randn(40, 32, device="cuda", generator=g),
                      torch.randn(3, 32, device="cuda", generator=g), torch.randn(2, 40, 48, device="cuda", generator=g))
    torch.library.opcheck(OPS.cdist_grad.default, (ga, gb, gc, gd, 2.0, None, False))
    spd = _spd(2, 16, torch.float32, "cuda")
    torch.library.opcheck(OPS.solve_cholesky.default, (spd, torch.randn(2, 3, 16, device="cuda"), False, False))
    torch.library.opcheck(OPS.eigh.default, (spd, False, False))
    lw = torch.randn(50, 2, device="cuda", generator=g, requires_grad=True)
    for name in ("gaussian_l2", "laplace_l1"):  # the fused logsumexp kernel (K = 32)
        torch.library.opcheck(OPS.kernel_logsumexp.default, (a, b, lw, library.descriptor_ints(km.PRESETS[name]), None,
                                                             None, None, None, 3.0, None, None, False))


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_linalg():
    a, b = _spd(3, 64, torch.float32, "cuda"), torch.randn(3, 4, 64, device="cuda")
    x, finfo, _ = km.linalg.solve_cholesky(a, b)  # warm-up: handles, streams, workspace sizes
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        xg, fg, sg = km.linalg.solve_cholesky(a, b)
    b.copy_(torch.randn_like(b))
    xg.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _, _ = km.linalg.solve_cholesky(a, b)
    torch.testing.assert_close(xg, want)
    assert not fg.any() and not sg.any()


@pytest.mark.parametrize("path", ["direct", "dispatcher", "autograd"])
def test_each_op_checks_its_data_once(monkeypatch, path):
    """Issue 43 item 2 (validation once): a public call checks its data tensors once, on every route
    (the implementation called directly, the torch.library op through the dispatcher, autograd): the
    ops rebuild the call from the op's checked arguments. (A plain
    CPU cdist is torch.cdist's own kernel, whose checks are torch's.)"""
    import sys

    seen = []
    for name in ("kermac_like.ops.distance", "kermac_like.ops.matvec", "kermac_like.ops.knn",
                 "kermac_like.ops.logsumexp", "kermac_like.calls"):
        module = sys.modules[name]
        if hasattr(module, "check_tensor"):
            real = module.check_tensor
            monkeypatch.setattr(module, "check_tensor", lambda n, t, *a, _r=real, **k: seen.append(n) or _r(n, t, *a, **k))
    g = torch.Generator().manual_seed(4)
    x, y, v = (torch.randn(*s, generator=g, requires_grad=path == "autograd") for s in ((9, 3), (7, 3), (7, 2)))
    gauss = km.preset("gaussian_l2")
    calls = {"cdist": lambda: km.cdist(x, y, 1.5), "run_kernel": lambda: km.run_kernel(gauss, x, y, bandwidth=1.0),
             "kernel_matvec": lambda: km.kernel_matvec(gauss, x, y, v, bandwidth=1.0),
             "kernel_topk": lambda: km.kernel_topk(gauss, x, y, 2, bandwidth=1.0)[0],
             "knn": lambda: km.knn(x, y, 2, p=1.5)[0], "kernel_logsumexp": lambda: km.kernel_logsumexp(gauss, x, y, bandwidth=1.0)}
    with override(direct_eager=path == "direct"):
        for op, fn in calls.items():
            seen.clear()
            res = fn()
            assert len(seen) == len(set(seen)) and (seen or op == "cdist"), (op, seen)
            if path == "autograd":  # (a backward may call the public ops anew, e.g. K^T g: calls of their own)
                res.sum().backward()
