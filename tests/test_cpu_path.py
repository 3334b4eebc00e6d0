"""The torch path (kermac_like/torch_path.py: CPU tensors, float64) against the reference
(kermac_like/reference.py, the direct-difference oracle): every descriptor in both compute
modes with broadcast batches and tensor hyper-parameters, row blocks, output layouts,
16-bit inputs, K = 0, kernel_matvec's blocks and float64 mode, autograd; and a loose speed
guard against the torch way (ours at most 2x torch's time, best of several runs), so that a
return to the direct-difference path (10-70x) shows."""

from __future__ import annotations

import time

import pytest
import torch

import kermac_like as km
from kermac_like import torch_path
from kermac_like.reference import distance_reference

F64 = torch.float64
DIRECT, MM, DEFAULT = "donot_use_mm_for_euclid_dist", "use_mm_for_euclid_dist", "use_mm_for_euclid_dist_if_necessary"
ALL = list(km.KernelDescriptor.all())


def rel(got, want):
    """Largest difference relative to the largest |want|, after equal NaN and inf positions."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = torch.isfinite(want)
    if not fin.any():
        return 0.0
    return ((got[fin] - want[fin]).abs().max() / want[fin].abs().max().clamp_min(1e-300)).item()


def _hypers(desc, tensors: bool):
    """Hyper-parameters of desc: floats, or tensors over a batch mode of 3."""
    t = (lambda *v: torch.tensor(v, dtype=F64)) if tensors else (lambda *v: v[0])
    h = {"regularization": t(0.5, -0.25, 2.0), "regularization_offset_x": 3, "regularization_offset_y": 1}
    if desc.needs_inner_p:
        h["inner_p"] = t(1.3, 0.7, 2.5)
    if desc.needs_outer_p:
        h["outer_p"] = t(1.9, 1.1, 3.0)
    if desc.needs_bandwidth:
        h["bandwidth"] = t(1.2, 0.8, 4.0)
    return h


def _oracle(desc, a, b, epsilon=None, **h):
    h = dict(h)
    diag = h.pop("regularization_offset_x") - h.pop("regularization_offset_y")
    return distance_reference(desc, a, b, reg_diag=diag, epsilon=epsilon, **h)


@pytest.mark.parametrize("desc", ALL, ids=lambda d: d.short_name())
def test_every_descriptor_matches_the_oracle(desc):
    """(2, 1, 31, 5) x (3, 27, 5): more than 25 rows, so that SQUARE inner powers take the matrix
    product in the default mode; floats and per-batch tensors; an epsilon cut."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 1, 31, 5, generator=g, dtype=F64)
    b = torch.randn(3, 27, 5, generator=g, dtype=F64)
    b[:, :4] = a[0, 0, :4]  # pairs at distance 0
    for tensors in (False, True):
        h = _hypers(desc, tensors)
        want = _oracle(desc, a, b, epsilon=0.05, **h)
        for mode in (DIRECT, DEFAULT):
            got = km.run_kernel(desc, a, b, epsilon=0.05, compute_mode=mode, **h)
            assert got.shape == (2, 3, 31, 27)
            assert rel(got, want) < 1e-10, (tensors, mode)


def test_row_blocks_of_a_tensor_inner_p(monkeypatch):
    """A per-batch inner_p goes through a (rows, N, K) temporary in row blocks: 3 rows here."""
    monkeypatch.setattr(torch_path, "CPU_BLOCK_ELEMENTS", 3 * 2 * 11 * 4)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 13, 4, generator=g, dtype=F64), torch.randn(11, 4, generator=g, dtype=F64)
    p = torch.tensor([0.8, 2.7], dtype=F64)
    desc = km.PRESETS["laplace_p"]
    for out in (None, torch.full((2, 13, 16), float("nan"), dtype=F64)[..., :11]):  # rows 16 apart
        got = km.run_kernel(desc, a, b, p=p, bandwidth=1.5, regularization=0.3, out=out)
        assert out is None or got is out
        assert rel(got, distance_reference(desc, a, b, inner_p=p, outer_p=p, bandwidth=1.5, regularization=0.3)) < 1e-12


@pytest.mark.parametrize("name", ["l2", "squared_l2", "gaussian_l2", "l1", "laplace_p", "dot"])
def test_outputs_of_any_layout_and_hyper_parameters_widening_the_batch(name):
    """Column-major and batch-widened outputs, transposed inputs: the same values as the fresh result."""
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(3)
    a = torch.randn(5, 40, generator=g).T  # (40, 5), not contiguous
    b = torch.randn(33, 5, generator=g)
    h = {"p": 1.5} if desc.needs_inner_p else {}
    if desc.needs_bandwidth:
        h["bandwidth"] = torch.tensor([0.7, 1.9])
    h["regularization"] = torch.tensor([0.25, 0.5])
    fresh = km.run_kernel(desc, a, b, **h)
    assert fresh.shape == (2, 40, 33)
    out = torch.full((2, 33, 40), float("nan")).mT
    assert km.run_kernel(desc, a, b, out=out, **h) is out
    assert torch.equal(out, fresh)
    want = _oracle(desc, a.double(), b.double(), **{k: (v.double() if isinstance(v, torch.Tensor) else v)
                                                    for k, v in h.items() if k != "p"},
                   **({"inner_p": 1.5, "outer_p": 1.5} if "p" in h else {}), regularization_offset_x=0,
                   regularization_offset_y=0)
    assert rel(fresh, want) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["l2", "laplace_l1", "p_norm", "gaussian_l2"])
def test_16_bit_inputs_compute_in_float32_and_round_once(dtype, name):
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(30, 6, generator=g).to(dtype), torch.randn(28, 6, generator=g).to(dtype)
    h = {"p": 1.5} if desc.needs_inner_p else {}
    h.update({"bandwidth": 2.0} if desc.needs_bandwidth else {})
    want = km.run_kernel(desc, a.float(), b.float(), **h).to(dtype)
    got = km.run_kernel(desc, a, b, **h)
    assert got.dtype == dtype and torch.equal(got, want)
    out = torch.empty(28, 30, dtype=dtype).T
    assert torch.equal(km.run_kernel(desc, a, b, out=out, **h), want)


@pytest.mark.parametrize("desc", [km.PRESETS[n] for n in ("l2", "laplace_l1", "p_norm", "dot")],
                         ids=lambda d: d.short_name())
def test_k_zero(desc):
    a, b = torch.randn(30, 0, dtype=F64), torch.randn(27, 0, dtype=F64)
    p, bw = (1.5 if desc.needs_inner_p else None), (2.0 if desc.needs_bandwidth else None)
    assert rel(km.run_kernel(desc, a, b, p=p, bandwidth=bw, regularization=0.5),
               distance_reference(desc, a, b, inner_p=p, outer_p=p, bandwidth=bw, regularization=0.5)) == 0


@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l2", "l1", "p_norm", "dot"])
def test_matvec_blocks_match_the_dense_product(monkeypatch, name):
    """Row and column blocks (4 x 7) smaller than the problem, a batch from v, tensor
    hyper-parameters, a regularised diagonal off the main one, a 1-D v."""
    monkeypatch.setattr(torch_path, "CPU_BLOCK_ELEMENTS", 2 * 4 * 7)
    monkeypatch.setattr(torch_path, "MATVEC_COLUMNS", 7)
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, 30, 4, generator=g, dtype=F64), torch.randn(29, 4, generator=g, dtype=F64)
    v = torch.randn(3, 1, 29, 2, generator=g, dtype=F64)
    h = {"p": torch.tensor([1.3, 2.2], dtype=F64)} if desc.needs_inner_p else {}
    h.update({"bandwidth": torch.tensor([0.9, 1.7], dtype=F64)} if desc.needs_bandwidth else {})
    h.update(regularization=0.75, regularization_offset_x=2, regularization_offset_y=5)
    dense = km.run_kernel(desc, x, y, **h)
    got = km.kernel_matvec(desc, x, y, v, **h)
    assert got.shape == (3, 2, 30, 2)
    assert rel(got, dense @ v) < 1e-12
    assert rel(km.kernel_matvec(desc, x, y, v[0, 0, :, 1], **h), dense @ v[0, 0, :, 1]) < 1e-12


@pytest.mark.parametrize("name", ["gaussian_l2", "laplace_l1"])
def test_matvec_float64_mode_reads_kernel_values_that_are_transposes(name):
    """The float64 mode (float32 x, y; float64 v): K(x, y), read off with one-hot columns, is
    bitwise the transpose of K(y, x) and run_kernel's float32 values of the direct form."""
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(45, 8, generator=g), torch.randn(38, 8, generator=g)
    kxy = km.kernel_matvec(desc, x, y, torch.eye(38, dtype=F64), bandwidth=2.0)
    kyx = km.kernel_matvec(desc, y, x, torch.eye(45, dtype=F64), bandwidth=2.0)
    assert kxy.dtype == F64 and torch.equal(kxy, kyx.T)
    assert torch.equal(kxy, km.run_kernel(desc, x, y, bandwidth=2.0, compute_mode=DIRECT).double())


@pytest.mark.parametrize("name,mode", [("laplace_l2", DEFAULT), ("gaussian_l2", DIRECT), ("p_norm", DEFAULT),
                                       ("dot", DEFAULT)])
def test_autograd(name, mode):
    """26 rows: the matrix product in the default mode; the backward's own contraction."""
    desc = km.PRESETS[name]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(26, 2, generator=g, dtype=F64).requires_grad_()
    y = torch.randn(3, 2, generator=g, dtype=F64).requires_grad_()
    h = {"p": 1.5} if desc.needs_inner_p else {}
    h.update({"bandwidth": 1.5} if desc.needs_bandwidth else {})
    assert torch.autograd.gradcheck(lambda a, b: km.run_kernel(desc, a, b, compute_mode=mode, **h), (x, y))
    if mode == DEFAULT:
        v = torch.randn(3, 2, generator=g, dtype=F64).requires_grad_()
        assert torch.autograd.gradcheck(lambda a, b, w: km.kernel_matvec(desc, a, b, w, **h), (x, y, v))


# -- the speed guard ---------------------------------------------------------------------------------
def _best_ratio(ours, theirs, repeats=5):
    """min(ours) / min(theirs) over interleaved runs (after one warm-up of each)."""
    ours()
    theirs()
    t_ours, t_theirs = [], []
    for _ in range(repeats):
        for fn, ts in ((ours, t_ours), (theirs, t_theirs)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return min(t_ours) / min(t_theirs)


def test_speed_guard_against_the_torch_way():
    """Within 2x of the torch way at a mid size (the target is 1.25x, bench/cpu_ratios.py); the
    direct-difference path was 10-70x."""
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(1000, 32, generator=g), torch.randn(1200, 32, generator=g)
    v = torch.randn(1200, 4, generator=g)
    lap = km.PRESETS["laplace_l2"]
    cases = {
        "cdist p=2": (lambda: km.cdist(x, y), lambda: torch.cdist(x, y)),
        "cdist p=1": (lambda: km.cdist(x, y, 1.0), lambda: torch.cdist(x, y, 1.0)),
        "laplace_l2": (lambda: km.run_kernel(lap, x, y, bandwidth=4.0), lambda: torch.exp(torch.cdist(x, y) / -4.0)),
        "kernel_matvec": (lambda: km.kernel_matvec(lap, x, y, v, bandwidth=4.0),
                          lambda: torch.exp(torch.cdist(x, y) / -4.0) @ v),
    }
    slow = {}
    for name, (ours, theirs) in cases.items():
        r = _best_ratio(ours, theirs)
        if r > 2.0:  # one more try: a loaded machine
            r = min(r, _best_ratio(ours, theirs, repeats=9))
        if r > 2.0:
            slow[name] = round(r, 2)
    assert not slow, f"slower than 2x the torch way: {slow}"
