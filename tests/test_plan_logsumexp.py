"""plan/logsumexp.py on the CPU (tests/conftest.py's as_gpu: the device queries and the kernel
loader stubbed, nothing launched): which calls the fused kernel serves, the column chunks,
the N split and its combination, and argument tuples of the lengths cuda_templates/ABI.md gives."""

import pytest
import torch

import kermac_like as km
from kermac_like.ops.distance import prepare_call
from kermac_like.plan import logsumexp as plan_lse
from kermac_like.plan.logsumexp import fused_serves, plan_logsumexp
from kermac_like.runtime.specs.logsumexp import lse_spec


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch):
    monkeypatch.setattr(plan_lse, "FUSED", True)  # on unless KERMAC_LIKE_LSE_FUSED=0 is set


def _call(M, N, K, desc="gaussian_l2", dtype=torch.float32, **hyp):
    x, y = torch.randn(M, K, dtype=dtype), torch.randn(N, K, dtype=dtype)
    return prepare_call(km.preset(desc), x, y, bandwidth=hyp.pop("bandwidth", 0.5), names=("x", "y"), **hyp)


def test_serves_only_gpu_float32_and_16_bit_low_k():
    call = _call(10, 20, 3)
    assert not fused_serves(call, torch.zeros(20, 1))  # CPU tensors: the blocked path


def test_column_chunks_split_and_combine(as_gpu):
    M, N, C = 1000, 100000, 11
    call = _call(M, N, 3)
    lw, out = torch.zeros(N, C), torch.empty(M, C)
    plan = plan_logsumexp(call, lw, out)
    assert plan.family == "logsumexp"
    names = [l.kernel.spec.kernel for l in plan.launches]
    assert names == ["kermac_like::lse_kernel", "kermac_like::lse_combine_kernel"] * 2  # columns 0..8, 8..11
    assert [l.kernel.spec for l in plan.launches[::2]] == [lse_spec(call.desc, torch.float32, 3, 8),
                                                          lse_spec(call.desc, torch.float32, 3, 3)]
    main, comb = plan.launches[0], plan.launches[1]
    assert len(main.args) == 49 and len(comb.args) == 13
    assert main.grid[1] > 1 and main.args[-2] == main.grid[1] and comb.args[4] == main.grid[1]  # n_split
    assert plan.launches[2].args[3] == out.data_ptr() + 8 * 4  # the second chunk's columns
    assert plan.launches[2].args[8] == 3  # C of the chunk


def test_many_rows_one_range_and_blocked_beyond(as_gpu):
    call = _call(2_000_000, 1000, 3)
    plan = plan_logsumexp(call, torch.zeros(1000, 1), torch.empty(2_000_000, 1))
    assert len(plan.launches) == 1 and plan.launches[0].grid[1] == 1
    assert plan_logsumexp(_call(10, 20, 65), torch.zeros(20, 1), torch.empty(10, 1)) is None  # K > 64
    assert plan_logsumexp(_call(10, 20, 3, dtype=torch.float64), torch.zeros(20, 1, dtype=torch.float64),
                          torch.empty(10, 1, dtype=torch.float64)) is None
    assert plan_logsumexp(_call(10, 20, 3, epsilon=0.1), torch.zeros(20, 1), torch.empty(10, 1)) is None
