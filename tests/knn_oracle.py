"""The oracle of the k-nearest-neighbour tests and issue 25's acceptance rule, in one place.

* :func:`oracle_topk`: the top-k of a dense float64 matrix in the package's order, (value,
  index) lexicographically with NaN above every number (torch.sort's stable order).
* :func:`assert_exact`: a result equal to the oracle (the CPU path selects in float64).
* :func:`assert_acceptable`: the rule for the fused GPU kernels, which compute in float32:
  every returned value within ``value_rtol`` of the float64 value of its pair, values in order,
  and each row's index set equal to the oracle's except where the float64 gap between the
  k-th and the (k+1)-th value is below ``gap_rtol`` (relative), where any indices whose
  float64 values lie within that tolerance of the k-th value are accepted.
"""

from __future__ import annotations

import torch


def oracle_topk(dense: torch.Tensor, k: int, largest: bool) -> tuple:
    """(values, indices) of the k best entries of each row of ``dense`` (..., M, N)."""
    s = torch.sort(dense, dim=-1, descending=largest, stable=True)
    return s.values[..., :k], s.indices[..., :k]


def assert_exact(values, indices, dense: torch.Tensor, k: int, largest: bool) -> None:
    """Indices equal to the oracle's, values equal to the oracle's rounded to values' dtype."""
    ov, oi = oracle_topk(dense, k, largest)
    assert values.shape == indices.shape == ov.shape, (values.shape, ov.shape)
    assert indices.dtype == torch.int64
    bad = (indices.cpu() != oi.cpu())
    assert not bad.any(), f"{int(bad.any(-1).sum())} rows select other indices; first: " \
        f"{indices.cpu()[bad.any(-1)][:1].tolist()} vs {oi.cpu()[bad.any(-1)][:1].tolist()}"
    want = ov.to(values.dtype).cpu()
    assert torch.equal(values.cpu().isnan(), want.isnan())
    assert torch.equal(values.cpu().nan_to_num(), want.nan_to_num()), (values - want).abs().max()


def assert_acceptable(values, indices, dense: torch.Tensor, k: int, largest: bool, *, value_rtol: float = 1e-5,
                      gap_rtol: float = 1e-5, value_atol: float = 0.0) -> None:
    """Issue 25's acceptance rule (see the module docstring); ``dense`` the float64 matrix."""
    dense = dense.double().cpu()
    values, indices = values.cpu(), indices.cpu()
    N = dense.shape[-1]
    assert values.shape == indices.shape == (*dense.shape[:-1], k), (values.shape, dense.shape, k)
    assert indices.dtype == torch.int64 and bool(((indices >= 0) & (indices < N)).all())
    picked = dense.gather(-1, indices)
    v64 = values.double()
    close = torch.isclose(v64, picked, rtol=value_rtol, atol=value_atol, equal_nan=True)
    assert bool(close.all()), f"values off their pairs' float64 values by up to " \
        f"{((v64 - picked).abs() / picked.abs()).nan_to_num().max():.3g} relative"
    # each row's indices distinct and its values best-first (within the value tolerance)
    assert bool((indices.sort(-1).values.diff(dim=-1) != 0).all()), "repeated indices in a row"
    step = picked.diff(dim=-1)
    tol = value_rtol * picked.abs()[..., 1:] + value_atol
    ordered = (step >= -tol) if not largest else (step <= tol)
    ordered |= picked[..., 1:].isnan()  # NaN last (smallest) / NaN first then numbers (largest)
    if largest:
        ordered |= picked[..., :-1].isnan()
    assert bool(ordered.all()), "values out of order"
    s = torch.sort(dense, dim=-1, descending=largest, stable=True)
    kth = s.values[..., k - 1]
    same = (indices.sort(-1).values == s.indices[..., :k].sort(-1).values).all(-1)
    if k < N:
        nxt = s.values[..., k]
        near = (nxt - kth).abs() <= gap_rtol * torch.maximum(kth.abs(), nxt.abs())
        # in an ambiguous row every pick lies within the tolerance of the k-th value or better
        bound = kth.unsqueeze(-1) + gap_rtol * kth.abs().unsqueeze(-1) * (1 if not largest else -1)
        inside = (picked <= bound) if not largest else (picked >= bound)
        same |= near & inside.all(-1)
    assert bool(same.all()), f"{int((~same).sum())} rows select other neighbours than float64 " \
        "where the k-th gap is above the tolerance"
