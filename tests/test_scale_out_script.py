"""bench/scale_out.py (issue 47): the rank counts, falkon's size decision from free memory, the example's
data shards (the one-process rows in rank order), the table's checks; and, marked slow, the whole
script on gloo CPU processes at tiny sizes:

    python -m pytest tests/test_scale_out_script.py -m slow
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from bench import scale_out  # noqa: E402


def test_rank_counts():
    assert scale_out.rank_counts("8", 0) == [1, 2, 4, 8]
    assert scale_out.rank_counts("", 4) == [1, 2, 4]
    assert scale_out.rank_counts("6", 0) == [1, 2, 4, 6]
    assert scale_out.rank_counts("1", 0) == [1]
    assert scale_out.rank_counts("8,1", 0) == [1, 8]
    with pytest.raises(ValueError, match="--ranks"):
        scale_out.rank_counts("0,2", 0)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_example_shards_are_the_one_process_rows(world):
    """make_data's shards concatenated in rank order are the one-process rows (so KernelRidge samples
    the same centres at any number of ranks), and falkon_rows_per_rank is the largest shard."""
    from large_scale_krr import make_data

    n = 1000
    x1, y1 = make_data(n, 8)
    parts = [make_data(n, 8, rank=r, world=world) for r in range(world)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x1) and torch.equal(torch.cat([p[1] for p in parts]), y1)
    assert scale_out.falkon_rows_per_rank(n, world) == max(p[0].shape[0] for p in parts)


def test_falkon_size_decision():
    cfg = dict(scale_out.FULL)
    gb = 1e9
    # an H200's free memory: 10^9 at every rank count
    plan, why = scale_out.plan_falkon(cfg, [1, 2, 4, 8], "cuda", mem_per_rank=140 * gb)
    assert plan == {1: 10**9, 2: 10**9, 4: 10**9, 8: 10**9}
    # 40 GB a rank: one rank's 10^9 (36 GB of X and y + 3.2 GB of factors + slack) does not fit, two ranks' does
    plan, why = scale_out.plan_falkon(cfg, [1, 2, 4], "cuda", mem_per_rank=40 * gb)
    assert plan == {1: 10**8, 2: 10**9, 4: 10**9}
    assert any("1 rank(s): N = 1e+09" in w and "does not fit" in w for w in why), why
    # CPU processes (--tiny): no CUDA slack; host memory shared by the ranks
    assert scale_out.plan_falkon(dict(scale_out.TINY), [8], "cpu", mem_per_rank=2.7 * gb)[0] == {8: 20_000}
    # nothing fits: said, not run
    plan, why = scale_out.plan_falkon(cfg, [1], "cuda", mem_per_rank=1 * gb)
    assert plan == {} and "not run" in why[-1]


def _run(workload, n, ranks, seconds, **kw):
    return dict(workload=workload, n=n, ranks=ranks, rc=0, seconds=seconds, peak_gb=[1.0] * ranks, log="-", **kw)


def test_table_speedup_efficiency_and_checks():
    runs = [
        _run("falkon", 10**8, 1, 40.0, r2=0.95, pred=[1.0, 2.0]),
        _run("falkon", 10**9, 2, 200.0, r2=0.9504, pred=[1.0, 2.0]),
        _run("falkon", 10**9, 4, 100.0, r2=0.9504, pred=[1.0, 2.0]),
        _run("falkon", 10**9, 8, 80.0, r2=0.9480, pred=[1.0, 2.0]),  # R^2 off by 0.002: fails
        _run("cg", 10**6, 1, 8.0, r2=0.9, pred=[1.0, 2.0]),
        _run("cg", 10**6, 2, 4.0, r2=0.9, pred=[1.0, 2.0005]),  # 2e-4 < 1e-3: holds
        _run("cg", 10**6, 4, 2.5, r2=0.9, pred=[1.0, 2.1]),  # 4e-2: fails
        _run("knn", 10**7, 1, 10.0, sample_idx=[[1, 2], [3, 4]], sample_dist=[[0.5, 0.6], [0.1, 0.2]]),
        _run("knn", 10**7, 2, 5.0, sample_idx=[[1, 2], [3, 4]], sample_dist=[[0.5, 0.6], [0.1, 0.2]]),
        _run("knn", 10**7, 4, 3.0, sample_idx=[[1, 2], [4, 3]], sample_dist=[[0.5, 0.6], [0.1, 0.1]]),
        dict(workload="knn", n=10**7, ranks=8, rc=124, log="knn.log"),
    ]
    rows, ok = scale_out.table(runs, pred_rtol=1e-3)
    assert not ok
    by = {(r["workload"], r["n"], r["ranks"]): r for r in rows}
    f2, f4, f8 = by["falkon", 10**9, 2], by["falkon", 10**9, 4], by["falkon", 10**9, 8]
    assert f2["base_ranks"] == 2 and f2["speedup"] == 1.0 and f2["ok"]  # R^2 against the 10^8 run's
    assert f4["speedup"] == 2.0 and f4["efficiency"] == 1.0 and f4["ok"]
    assert f8["efficiency"] == pytest.approx(2.5 * 2 / 8) and not f8["ok"]
    assert by["cg", 10**6, 2]["ok"] and not by["cg", 10**6, 4]["ok"]
    assert by["knn", 10**7, 2]["ok"] and not by["knn", 10**7, 4]["ok"]
    assert by["knn", 10**7, 4]["check"].startswith("indices identical on 2 rows: 0.5000")
    assert not by["knn", 10**7, 8]["ok"] and "rc 124" in by["knn", 10**7, 8]["check"]
    text = scale_out.format_table(rows, "peak GB")
    assert text.count("\n") == len(rows) + 1 and "FAIL" in text


@pytest.mark.slow
def test_script_on_gloo_processes(tmp_path):
    """The whole script at 1 and 2 ranks on CPU processes (gloo), tiny sizes: every run passes its check."""
    out = tmp_path / "scale_out.json"
    env = dict(os.environ)
    env.pop("KERMAC_LIKE_DEBUG", None)
    p = subprocess.run(["bash", str(ROOT / "bench" / "scale_out.sh"), "--device", "cpu", "--tiny", "--ranks", "2",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.loads(out.read_text())
    assert {(r["workload"], r["ranks"]) for r in rec["table"]} == {(w, r) for w in scale_out.WORKLOADS for r in (1, 2)}
    assert all(r["ok"] for r in rec["table"]), rec["table"]
    two = [r for r in rec["runs"] if r["ranks"] == 2]
    assert all(r["backend"] == "gloo" and len(r["per_rank"]) == 2 for r in two)
    assert "all checks hold" in p.stdout and "| workload | N | ranks |" in p.stdout
