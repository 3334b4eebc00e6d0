"""KernelOperator: the lazy kernel matrix against run_kernel's dense matrix (CPU, float64)."""

from __future__ import annotations

import pytest
import torch

import kermac_like as km
from kermac_like import KernelDescriptor, KernelOperator

DESCRIPTORS = list(KernelDescriptor.all())


def hyper_for(desc):
    h = {}
    if desc.needs_inner_p:
        h["inner_p"] = 1.4
    if desc.needs_outer_p:
        h["outer_p"] = 1.9
    if desc.needs_bandwidth:
        h["bandwidth"] = 1.2
    return h


def data(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def close(a, b, tol=1e-12):
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.numel() == 0:
        return
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("desc", DESCRIPTORS, ids=lambda d: d.short_name())
def test_products_transpose_and_diagonal_match_the_dense_matrix(desc):
    x, y = data(6, 3, seed=1), data(8, 3, seed=2)
    h = hyper_for(desc)
    op = KernelOperator(desc, x, y, regularization=0.5, regularization_offset_x=2, epsilon=0.3, **h)
    dense = km.run_kernel(desc, x, y, regularization=0.5, regularization_offset_x=2, epsilon=0.3, **h)
    assert op.shape == dense.shape == (6, 8) and op.dtype == torch.float64 and op.device == x.device
    close(op.to_dense(), dense)
    v, V = data(8, seed=3), data(8, 4, seed=4)
    close(op @ v, dense @ v)
    close(op.matmul(V), dense @ V)
    u, U = data(6, seed=5), data(3, 6, seed=6)
    close(u @ op, u @ dense)
    close(U @ op, U @ dense)
    close(op.T.to_dense(), dense.T)
    close(op.T @ data(6, 2, seed=7), dense.T @ data(6, 2, seed=7))
    for off in (-3, -1, 0, 1, 2, 5, 9, -7):
        close(op.diagonal(off), torch.diagonal(dense, off))
        close(op.T.diagonal(off), torch.diagonal(dense.T, off))


def test_diagonal_of_x_with_itself_is_the_epilogue_at_zero_plus_lambda():
    x = data(5, 4, seed=8)
    g = KernelOperator(km.PRESETS["gaussian_l2"], x, x, bandwidth=0.7, regularization=0.25)
    close(g.diagonal(), torch.full((5,), 1.25, dtype=torch.float64))
    l1 = KernelOperator(km.PRESETS["l1"], x, x, regularization=0.25, regularization_offset_y=1)
    close(l1.diagonal(), torch.zeros(5, dtype=torch.float64))  # the regularised entries are at offset -1
    close(l1.diagonal(-1), torch.diagonal(l1.to_dense(), -1))


def test_batches_and_tensor_hyper_parameters_broadcast():
    desc = km.PRESETS["laplace_p"]
    x, y = data(2, 1, 5, 3, seed=9), data(3, 7, 3, seed=10)
    p = torch.tensor([1.2, 1.7, 2.4], dtype=torch.float64)
    bw = torch.tensor([0.8, 1.1, 1.6], dtype=torch.float64)
    lam = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    op = KernelOperator(desc, x, y, p=p, bandwidth=bw, regularization=lam)
    dense = km.run_kernel(desc, x, y, p=p, bandwidth=bw, regularization=lam)
    assert op.shape == dense.shape == (2, 3, 5, 7) and op.batch_shape == (2, 3) and op.ndim == 4
    close(op.to_dense(), dense)
    V = data(3, 7, 2, seed=11)
    close(op @ V, dense @ V)
    close(op @ data(7, seed=12), dense @ data(7, seed=12))
    close(op.diagonal(), torch.diagonal(dense, 0, -2, -1))
    close(op.T.to_dense(), dense.mT)


def test_products_are_differentiable():
    desc = km.PRESETS["gaussian_l2"]
    x = data(5, 3, seed=13).requires_grad_(True)
    y = data(6, 3, seed=14).requires_grad_(True)
    v = data(6, 2, seed=15).requires_grad_(True)
    gx, gy, gv = torch.autograd.grad((KernelOperator(desc, x, y, bandwidth=1.1) @ v).square().sum(), (x, y, v))
    rx, ry, rv = torch.autograd.grad((km.run_kernel(desc, x, y, bandwidth=1.1) @ v).square().sum(), (x, y, v))
    close(gx, rx, 1e-10)
    close(gy, ry, 1e-10)
    close(gv, rv, 1e-10)


def test_validation_names_the_argument():
    desc = km.PRESETS["gaussian_l2"]
    x, y = data(4, 3), data(5, 3)
    with pytest.raises(ValueError, match="^y: last dimension"):
        KernelOperator(desc, x, data(5, 2))
    with pytest.raises(TypeError, match="^y: dtype"):
        KernelOperator(desc, x, y.float())
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        KernelOperator(desc, [1.0], y)
    with pytest.raises(ValueError, match="^bandwidth"):
        KernelOperator(desc, x, y)
    with pytest.raises(ValueError, match="^bandwidth: must be > 0"):
        KernelOperator(desc, x, y, bandwidth=-1.0)
    with pytest.raises(TypeError, match="^descriptor"):
        KernelOperator("gaussian", x, y, bandwidth=1.0)
    with pytest.raises(TypeError, match="^offset"):
        KernelOperator(desc, x, y, bandwidth=1.0).diagonal(0.5)
    op = KernelOperator(desc, x, y, bandwidth=1.0)
    with pytest.raises(ValueError, match="^v"):
        op @ data(4, 2)  # N mismatch: kernel_matvec names v
    assert "KernelOperator(" in repr(op) and "bandwidth=1.0" in repr(op)


def test_float32_operator_keeps_its_dtype():
    x, y = data(4, 3).float(), data(5, 3).float()
    op = KernelOperator(km.PRESETS["laplace_l2"], x, y, bandwidth=1.0)
    assert op.dtype == torch.float32 and op.diagonal().dtype == torch.float32
    close(op.diagonal().double(), torch.diagonal(op.to_dense()).double(), 1e-6)
