"""KernelRidge(solver="nystrom") at scale, CPU parts (issue 28): centre sampling without a
permutation of N, the row-chunk plan and the streamed fit (max_gpu_bytes forces it on a CPU
device) against the in-memory fit, the per-iteration debug log, and, in one pair of gloo
processes, a sharded fit against one process (same centres, same predictions), the bytes the
collectives move (independent of N) and bad input raised on every rank."""

import logging
import os
import pickle
import re
import warnings

import numpy as np
import pytest
import torch
from gloo_spawn import spawn_workers

from kermac_like.solvers import KernelRidge
from kermac_like.testing import solver_nystrom, solver_rows


def data(n, n_test=50, d=3, targets=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n + n_test, d, dtype=torch.float64, generator=g) * 2 - 1
    f = torch.stack([torch.sin(2 * x[:, 0] + t) * torch.cos(x[:, 1:].sum(1)) for t in range(targets)], 1)
    y = f + 0.1 * torch.randn(f.shape, dtype=torch.float64, generator=g)
    return x[:n].to(dtype), y[:n].to(dtype), x[n:].to(dtype)


KW = dict(bandwidth=1.0, alpha=0.5, solver="nystrom", n_centers=60, tol=1e-9, random_state=3)
FIXED = solver_nystrom.build_bytes(60) + 8 * 60 * (3 + 4 * 2)  # the preconditioner's part of max_gpu_bytes (m = 60, D = 3, C = 2)
STREAM = FIXED + 40000  # 1000 rows of 40 bytes: ~750 resident rows, the rest streamed


def test_sample_indices_o_m_and_deterministic():
    a = solver_nystrom.sample_indices(10**12, 1000, 7)  # no 10^12-element permutation
    assert a.shape == (1000,) and a.dtype == torch.int64
    assert bool((a[1:] > a[:-1]).all()) and int(a[0]) >= 0 and int(a[-1]) < 10**12  # sorted, distinct
    assert torch.equal(a, solver_nystrom.sample_indices(10**12, 1000, 7)) and not torch.equal(a, solver_nystrom.sample_indices(10**12, 1000, 8))
    small = solver_nystrom.sample_indices(50, 50, 1)
    assert torch.equal(small, torch.arange(50))


def test_plan_rows():
    # on the device without a budget: all resident, one chunk
    assert solver_rows.plan_rows(1000, 40, 48, None, True) == (1000, 1000, 0)
    # host data, fits the budget: all copied once
    assert solver_rows.plan_rows(1000, 40, 48, 10**6, False)[0] == 1000
    # does not fit: a resident prefix and two stream buffers, everything within the budget
    res, work, slot = solver_rows.plan_rows(1000, 40, 48, 20000, False)
    assert 0 < res < 1000 and slot >= 1 and res * 40 + slot * (2 * 40 + 48) <= 20000
    with pytest.raises(ValueError, match="^max_gpu_bytes"):
        solver_rows.plan_rows(1000, 40, 48, 100, False)


def test_row_source_chunks_cover_rows_in_order():
    x, y, _ = data(1000)
    src = solver_rows.RowSource(x, y, "cpu", budget=15000, c=2)
    assert src.mode == "resident+stream" and src.slot_rows < 1000
    seen = []
    for s, xc, yc in src.chunks():
        assert torch.equal(xc, x[s:s + xc.shape[0]]) and torch.equal(yc, y[s:s + yc.shape[0]])
        seen.append((s, xc.shape[0]))
    assert seen[0][0] == 0 and sum(r for _, r in seen) == 1000
    assert all(a + r == b for (a, r), (b, _) in zip(seen, seen[1:]))


def test_row_source_pure_stream():
    x, y, _ = data(300)
    src = solver_rows.RowSource(x, y, "cpu", budget=4000, c=2)
    src.n_res = 0  # every row through the two buffers
    got = [(s, xc.clone(), yc.clone()) for s, xc, yc in src.chunks()]
    assert len(got) > 2 and torch.equal(torch.cat([g[1] for g in got]), x) and torch.equal(torch.cat([g[2] for g in got]), y)


def test_streamed_fit_equals_in_memory():
    x, y, xt = data(1000)
    ref = KernelRidge("gaussian_l2", **KW).fit(x, y)
    assert ref.data_mode_ == "memory"
    m = KernelRidge("gaussian_l2", max_gpu_bytes=STREAM, **KW).fit(x.numpy(), y.numpy())  # numpy: host data
    assert m.data_mode_ == "resident+stream"
    assert isinstance(m.centers_, np.ndarray) and np.array_equal(m.centers_, ref.centers_.numpy())  # numpy fit
    p_ref = ref.predict(xt)
    p = m.predict(xt.numpy())  # predict streams X too (max_gpu_bytes)
    assert isinstance(p, np.ndarray)
    err = np.abs(p - p_ref.numpy()).max() / p_ref.abs().max().item()
    assert err < 1e-9, err
    assert abs(m.n_iter_ - ref.n_iter_) <= 2  # the order of the float64 sums differs


def test_streamed_fit_bad_input():
    x, y, _ = data(1000)
    bad = x.clone()
    bad[990, 1] = float("inf")  # found in the first pass, in a streamed chunk
    m = KernelRidge("gaussian_l2", max_gpu_bytes=STREAM, **KW)
    with pytest.raises(ValueError, match=r"^X: contains NaN or infinity$"):
        m.fit(bad, y)
    assert not hasattr(m, "dual_coef_") and not hasattr(m, "centers_")
    with pytest.raises(ValueError, match="^max_gpu_bytes: 1000 bytes do not hold the preconditioner of 60 centres"):
        KernelRidge("gaussian_l2", max_gpu_bytes=1000, **KW).fit(x, y)
    with pytest.raises(ValueError, match="^max_gpu_bytes: expected"):
        KernelRidge("gaussian_l2", max_gpu_bytes=-1, **KW).fit(x, y)


def test_debug_log_has_residual_and_seconds(caplog):
    x, y, _ = data(300)
    caplog.set_level(logging.DEBUG, logger="kermac_like.solvers")
    KernelRidge("gaussian_l2", **KW).fit(x, y)
    lines = [r.getMessage() for r in caplog.records if "nystrom iteration" in r.getMessage()]
    assert lines and re.search(r"nystrom iteration 1: relative residual \S+, \d+\.\d+ s \(\d+\.\d+ s in all\)",
                               lines[0]), lines[:2]


def test_new_params_are_sklearn_params():
    m = KernelRidge("gaussian_l2", bandwidth=1.0, device="cpu", max_gpu_bytes=1 << 30)
    p = m.get_params()
    assert p["device"] == "cpu" and p["max_gpu_bytes"] == 1 << 30


# -- two gloo processes ---------------------------------------------------------------------------

class Tally:
    """Bytes through the torch.distributed collectives the solver calls (tensors and pickled objects)."""

    def __init__(self, dist):
        self.tensor = self.objects = 0
        self.calls = []
        for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter",
                     "all_to_all", "send", "recv", "gather", "scatter"):
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))
        for name in ("all_gather_object", "broadcast_object_list"):
            setattr(dist, name, self._wrap_obj(name, getattr(dist, name)))

    def _wrap(self, name, fn):
        def f(t, *a, **k):
            ts = t if isinstance(t, (list, tuple)) else [t]
            if name in ("all_gather", "all_gather_into_tensor"):  # count what this rank sends
                ts = [a[0]]
            self.tensor += sum(x.numel() * x.element_size() for x in ts)
            self.calls.append(name)
            return fn(t, *a, **k)
        return f

    def _wrap_obj(self, name, fn):
        def f(objs, obj=None, *a, **k):
            self.objects += len(pickle.dumps(obj if name == "all_gather_object" else objs))
            self.calls.append(name)
            return fn(objs, obj, *a, **k) if obj is not None else fn(objs, *a, **k)
        return f

    def reset(self):
        self.tensor = self.objects = 0
        self.calls = []


M_BYTES = dict(m=40, c=2, d=3, max_iter=6)


def _worker(rank, port, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out = {}
        x, y, xt = data(1500)
        rows = slice(0, 700) if rank == 0 else slice(700, None)  # uneven shards (700, 800)
        xr, yr = x[rows], y[rows]
        m = KernelRidge("gaussian_l2", **KW).fit(xr, yr)
        out["pred"], out["centers"] = m.predict(xt).numpy(), m.centers_.numpy()
        # rank 1 streams its shard (max_gpu_bytes is per rank), rank 0 holds it in memory
        ms = KernelRidge("gaussian_l2", max_gpu_bytes=FIXED + 32000 if rank else None, **KW).fit(xr, yr)
        out["pred_stream"], out["mode"] = ms.predict(xt).numpy(), ms.data_mode_

        # bytes through the collectives: a fit of 6 iterations at two N, every call counted
        tally = Tally(dist)
        mb = M_BYTES
        for n_local in (100, 2000):
            xb, yb, _ = data(n_local, 1, d=mb["d"], targets=mb["c"], seed=10 + rank)
            tally.reset()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ConvergenceWarning of max_iter
                KernelRidge("gaussian_l2", bandwidth=0.7, alpha=0.05, solver="nystrom", n_centers=mb["m"],
                            tol=1e-30, max_iter=mb["max_iter"], random_state=0).fit(xb, yb)
            out[f"bytes_{n_local}"] = (tally.tensor, tally.objects, list(tally.calls))

        # bad input: every rank raises the same error, nothing fitted
        def attempt(case):
            from kermac_like.testing import solver_rows as _rows

            allocate = _rows.RowSource.allocate
            try:
                return attempt_with(case)
            finally:  # (the process serves the next file's checks too: tests/gloo_spawn.py)
                _rows.RowSource.allocate = allocate

        def attempt_with(case):
            X, Y, kw = xr, yr, dict(KW)
            if case == "kernel" and rank == 1:
                kw["bandwidth"] = 0.9
            elif case == "features" and rank == 1:
                X = xr[:, :2]
            elif case == "dtype" and rank == 1:
                X, Y = xr.float(), yr.float()
            elif case == "nan_stream" and rank == 1:  # streamed: found in the first pass on the device
                Y = yr.clone()
                Y[5, 1] = float("nan")
                kw["max_gpu_bytes"] = FIXED + 32000
            elif case == "host_memory":
                kw["max_gpu_bytes"] = FIXED + 32000
                if rank == 1:
                    from kermac_like.testing import solver_rows as _rows

                    def fail(self):
                        raise _rows.HostMemoryError("not enough host memory for the chunk buffers: simulated")
                    _rows.RowSource.allocate = fail
            est = KernelRidge("gaussian_l2", **kw)
            try:
                est.fit(X, Y)
                return "no error"
            except (ValueError, MemoryError) as e:
                return f"{type(e).__name__}: {e}" + (" FITTED" if hasattr(est, "dual_coef_") else "")

        for case in BAD:
            out[case] = attempt(case)
        q.put((rank, out))
    except Exception as e:  # noqa: BLE001  (reported to the parent)
        import traceback

        q.put((rank, repr(e) + traceback.format_exc()))
    finally:
        dist.destroy_process_group()


BAD = {
    "kernel": r"^ValueError: bandwidth: rank 1 passes bandwidth=0.9, rank 0 passes bandwidth=1.0",
    "features": r"^ValueError: X: rank 1 passes features 2, rank 0 passes 3",
    "dtype": r"^ValueError: X: rank 1 passes dtype 'torch.float32'",
    "nan_stream": r"^ValueError: y: contains NaN or infinity \(on rank 1\)$",
    "host_memory": r"^HostMemoryError: not enough host memory for the chunk buffers: simulated \(on rank 1\)$",
}


def test_two_gloo_ranks_sharded_nystrom():
    results = spawn_workers(_worker)
    assert all(isinstance(r, dict) for r in results.values()), results
    x, y, xt = data(1500)
    one = KernelRidge("gaussian_l2", **KW).fit(x, y)  # the concatenation of the shards in rank order
    ref = one.predict(xt).numpy()
    scale = np.abs(ref).max()
    for rank in (0, 1):
        r = results[rank]
        # the same centres (the same global rows) as one process, the same estimator within tol
        assert np.array_equal(r["centers"], one.centers_.numpy())
        assert np.abs(r["pred"] - ref).max() < 1e-8 * scale
        assert np.abs(r["pred_stream"] - ref).max() < 1e-8 * scale
    assert results[0]["mode"] == "memory" and results[1]["mode"] == "resident+stream"

    # communication: independent of N, O(m D + iterations m C) tensor bytes per rank
    mb = M_BYTES
    for rank in (0, 1):
        small, big = results[rank]["bytes_100"], results[rank]["bytes_2000"]
        assert small[0] == big[0] and small[2] == big[2], (small, big)
        tensor_bytes, object_bytes, calls = big
        passes = mb["max_iter"] + 1 + 1 + 1  # b, one per iteration, a check at 10 (none), the final true residual
        bound = 8 * mb["m"] * mb["d"] + 8 * mb["m"] * mb["c"] * (passes + 1)
        assert tensor_bytes <= bound, (tensor_bytes, bound, calls)
        assert object_bytes < 4096, object_bytes  # validation metadata and the seed: O(ranks)
        assert "all_gather_into_tensor" not in calls and "all_gather" not in calls  # X, y never gathered

    for case, pattern in BAD.items():
        for rank in (0, 1):
            assert re.search(pattern, results[rank][case]), (case, rank, results[rank][case])
