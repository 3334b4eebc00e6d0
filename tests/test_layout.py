import pytest
import torch

from kermac_like.layout import (
    Layout,
    analyse_matrix,
    analyse_output,
    batch_strides,
    broadcast_batch_shape,
    plan_batch,
)


def test_row_and_column_major():
    x = torch.randn(5, 7)
    v = analyse_matrix("x", x)
    assert (v.layout, v.ld, v.copied) == (Layout.ROW_MAJOR, 7, False)
    v = analyse_matrix("x", x.T)
    assert (v.layout, v.ld, v.copied) == (Layout.COL_MAJOR, 7, False)
    big = torch.randn(10, 12)
    v = analyse_matrix("x", big[2:7, 1:8])
    assert (v.layout, v.ld, v.rows, v.cols) == (Layout.ROW_MAJOR, 12, 5, 7)
    v = analyse_matrix("x", big.T[1:8, 2:7])
    assert (v.layout, v.ld) == (Layout.COL_MAJOR, 12)


def test_unsupported_layout_is_copied_or_rejected():
    x = torch.randn(6, 8)[::2, ::2]
    v = analyse_matrix("x", x)
    assert v.copied and v.tensor.is_contiguous() and torch.equal(v.tensor, x)
    with pytest.raises(ValueError, match="x:"):
        analyse_matrix("x", x, copy_ok=False)


def test_prefer_forces_layout():
    x = torch.randn(5, 7).T
    v = analyse_matrix("x", x, prefer=Layout.ROW_MAJOR)
    assert v.layout is Layout.ROW_MAJOR and v.copied and torch.equal(v.tensor, x)


def test_vector_ok():
    x = torch.randn(8, 16)
    assert analyse_matrix("x", x).vector_ok()
    assert not analyse_matrix("x", x[:, 1:]).vector_ok()  # misaligned pointer and extent 15
    assert not analyse_matrix("x", torch.randn(8, 6)).vector_ok()


def test_output_checks():
    out = torch.empty(3, 4)
    analyse_output("out", out, (3, 4), torch.float32, out.device)
    with pytest.raises(ValueError, match="out: expected shape"):
        analyse_output("out", out, (4, 3), torch.float32, out.device)
    with pytest.raises(TypeError, match="out: expected dtype"):
        analyse_output("out", out, (3, 4), torch.float64, out.device)
    with pytest.raises(ValueError, match="overlapping"):
        analyse_output("out", torch.empty(1, 3, 4).expand(2, 3, 4), (2, 3, 4), torch.float32, out.device)
    with pytest.raises(ValueError, match="out:"):
        analyse_output("out", torch.empty(6, 8)[::2, ::2], (3, 4), torch.float32, out.device)


def test_broadcast_batch_shape():
    assert broadcast_batch_shape({"a": (3, 1), "b": (4,), "p": ()}) == (3, 4)
    with pytest.raises(ValueError, match="b: batch shape"):
        broadcast_batch_shape({"a": (3,), "b": (4,)})


def test_plan_merges_and_loops():
    batch = (2, 3, 4, 5, 6)
    a = torch.empty(2, 3, 4, 5, 6, 7, 8)
    strides = {"a": batch_strides(batch, a.shape[:-2], a.stride()[:-2])}
    plan = plan_batch(batch, strides)
    assert plan.modes == (1, 1, 720) and plan.outer == ()
    b = torch.empty(2, 1, 4, 1, 6, 7, 8)
    strides["b"] = batch_strides(batch, b.shape[:-2], b.stride()[:-2])
    plan = plan_batch(batch, strides)
    assert plan.count * len(list(plan.outer_offsets("a"))) == 720
    # every (operand offset) pair visited equals the direct enumeration
    seen = set()
    for oa, ob in zip(plan.outer_offsets("a"), plan.outer_offsets("b")):
        n0, n1, n2 = plan.modes
        sa, sb = plan.strides["a"][1], plan.strides["b"][1]
        for i0 in range(n0):
            for i1 in range(n1):
                for i2 in range(n2):
                    seen.add((oa + i0 * sa[0] + i1 * sa[1] + i2 * sa[2], ob + i0 * sb[0] + i1 * sb[1] + i2 * sb[2]))
    direct = set()
    import itertools

    for idx in itertools.product(*(range(n) for n in batch)):
        direct.add((
            sum(i * s for i, s in zip(idx, a.stride()[:-2])),
            sum(i * s for i, s in zip(idx, [s if n > 1 else 0 for n, s in zip(b.shape[:-2], b.stride()[:-2])])),
        ))
    assert seen == direct
