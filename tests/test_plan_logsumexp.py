"""plan/logsumexp.py on the CPU (tests/conftest.py's as_gpu: the device queries and the kernel
loader stubbed, nothing launched): which calls the fused kernel serves, the column chunks,
the N split and its combination, and argument tuples of the lengths cuda_templates/ABI.md gives."""

import pytest
import torch

import kermac_like as km
from kermac_like.ops.distance import prepare_call
from kermac_like.plan.logsumexp import EXPAND_TOL, expand_params, fused_serves, plan_logsumexp
from kermac_like.runtime.specs.logsumexp import lse_spec


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
    assert len(main.args) == 50 and len(comb.args) == 13
    assert main.grid[1] > 1 and main.args[-3] == main.grid[1] and comb.args[4] == main.grid[1]  # n_split
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


def test_expand_guard_randn_bandwidths_and_far_data():
    """The expanded exponent's bound: randn D = 3 (10^6 points) at bandwidth 1.0 expands, at 1e-3
    and on data far from the origin with a small bandwidth it does not; NaN / inf rows are left out."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10 ** 6, 3, generator=g), torch.randn(10 ** 6, 3, generator=g)
    desc = km.preset("gaussian_l2")
    p = expand_params(desc, x, y, 1.0)
    assert p.shape == (4,) and p[0] == 1.0 and torch.allclose(p[1:], x.mean(0), atol=1e-6)
    assert expand_params(desc, x, y, torch.tensor(1.0))[0] == 1.0  # a tensor bandwidth: the same
    assert expand_params(desc, x, y, 1e-3)[0] == 0.0
    assert expand_params(desc, x[:1000] + 100, y[:1000] + 100, 0.1)[0] == 0.0  # centred: the spread counts
    assert expand_params(desc, x[:1000] * 30, y[:1000] * 30, 1.0)[0] == 0.0  # wide data, bandwidth 1
    x[5, 1], y[7, 0] = float("inf"), float("nan")
    assert expand_params(desc, x, y, 1.0)[0] == 1.0  # non-finite rows and points left out
    assert 0 < EXPAND_TOL <= 1e-5 / 2


def test_expand_launch_argument(as_gpu, settings):
    lw = torch.zeros(1000, 1)
    call = _call(600, 1000, 3, bandwidth=1.0)
    plan = plan_logsumexp(call, lw, torch.empty(600, 1))
    spec = plan.launches[0].kernel.spec
    assert spec == lse_spec(call.desc, torch.float32, 3, 1) and ", 3, 8, 0>" in spec.traits
    assert plan.launches[0].args[-1] == plan.scratch[-1].data_ptr() and plan.scratch[-1].shape == (4,)
    two = plan_logsumexp(call, torch.zeros(1000, 2), torch.empty(600, 2))  # two columns: variant 2, no pointer
    assert two.launches[0].args[-1] == 0 and ", 2, 8, 0>" not in two.launches[0].kernel.spec.traits
    settings(lse_expand=False)  # KERMAC_LIKE_LSE_EXPAND=0: the direct form's kernel
    off = plan_logsumexp(call, lw, torch.empty(600, 1))
    assert off.launches[0].args[-1] == 0 and off.launches[0].kernel.spec == lse_spec(call.desc, torch.float32, 3, 1,
                                                                                     variant=2)
