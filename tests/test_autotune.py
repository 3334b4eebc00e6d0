"""The kernel choice without a GPU: candidates, the default table, buckets, the autotuner's
decision logic with fake timings, and its SQLite store (round trip, concurrent writers,
the CLI listing)."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import kermac_like as km
from kermac_like.plan import autotune as tuning
from kermac_like.runtime.cache import KernelCache

IF = "use_mm_for_euclid_dist_if_necessary"
MM = "use_mm_for_euclid_dist"
NO = "donot_use_mm_for_euclid_dist"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_candidates_follow_dtype_k_and_compute_mode():
    l1, l2, dot = km.preset("l1"), km.preset("l2"), km.preset("dot")
    f32, f16 = torch.float32, torch.float16
    assert tuning.candidates(l1, f32, 3, IF) == ["lowk", "simt"]
    assert tuning.candidates(l1, f32, 1024, IF) == ["simt"]
    # Euclidean/DOT: where torch.cdist takes its matrix product (NaN/inf semantics), the
    # tensor cores and (float32, K <= 64) the low-K kernel with the product's NaN/inf; the
    # exact kernels elsewhere
    assert tuning.candidates(l2, f32, 3, IF) == ["tensor-core", "lowk"]
    assert tuning.candidates(l2, f32, 65, IF) == ["tensor-core"]
    assert tuning.candidates(l2, f32, 3, IF, 20, 25) == ["lowk", "simt"]
    assert tuning.candidates(l2, f32, 3, IF, 26, 3) == ["tensor-core", "lowk"]
    assert tuning.candidates(l2, f32, 3, NO) == ["lowk", "simt"]
    assert tuning.candidates(l2, f32, 3, MM, 2, 2) == ["tensor-core", "lowk"]
    assert tuning.default_choice(l2, f32, 8, IF) == "lowk"  # tuning.LOWK_MM_UP_TO
    assert tuning.default_choice(l2, f32, 9, IF) == "tensor-core"
    assert tuning.candidates(dot, f16, 3, IF) == ["tensor-core"]
    assert tuning.candidates(dot, f16, 3, NO) == []
    assert tuning.candidates(l1, f16, 3, IF) == []
    assert tuning.default_choice(l1, f16, 3, IF) is None


def test_default_table():
    f32 = torch.float32
    for name in ("l1", "l2", "laplace_l2", "gaussian_l2", "p_norm", "dot"):
        for K in (1, 3, 8):
            assert tuning.default_choice(km.preset(name), f32, K, NO) == "lowk", (name, K)
    for K in (9, 37, 64):
        assert tuning.default_choice(km.preset("l1"), f32, K, IF) == "lowk"
        assert tuning.default_choice(km.preset("p_norm"), f32, K, IF) == ("lowk" if K <= 16 else "simt")
        assert tuning.default_choice(km.preset("laplace_l2"), f32, K, IF) == "tensor-core"
        assert tuning.default_choice(km.preset("laplace_l2"), f32, K, NO) == "lowk"
        assert tuning.default_choice(km.preset("laplace_l2"), f32, K, IF, 25, 25) == "lowk"
    assert tuning.default_choice(km.preset("l2"), f32, 1024, IF) == "tensor-core"
    assert tuning.default_choice(km.preset("l1"), f32, 1024, IF) == "simt"
    assert tuning.default_choice(km.preset("l2"), f32, 1024, NO) == "simt"
    assert tuning.default_choice(km.preset("l2"), f32, 37, NO) == "lowk"  # exact asked for: no tensor cores
    assert tuning.default_choice(km.preset("l2"), f32, 200, NO) == "simt"


def test_buckets():
    assert [tuning.k_bucket(k) for k in (1, 5, 8, 9, 16, 17, 37, 1000)] == [1, 5, 8, 16, 16, 32, 64, 1024]
    assert [tuning.size_bucket(n) for n in (0, 1, 2, 3, 4, 5, 4 * 10**8)] == [0, 0, 1, 2, 2, 3, 29]


def test_autotune_flag(monkeypatch):
    monkeypatch.delenv(tuning.ENV_AUTOTUNE, raising=False)
    assert not tuning.autotune_enabled()
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "1")
    assert tuning.autotune_enabled() and not tuning.autotune_enabled(False)
    with pytest.raises(TypeError, match="autotune"):
        km.cdist(torch.randn(3, 2), torch.randn(4, 2), autotune="yes")


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """choose() on a CPU: a fixed tuning key, fake per-kind timings, a private cache."""
    from kermac_like.runtime.cache import reset_cache

    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path))
    reset_cache()
    tuning.forget()
    monkeypatch.setattr(tuning, "tuning_key", lambda call, out, mode, tf32: f"key-{call.K}")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "fake")
    timed = []
    fake_ms = {"lowk": 2.0, "tensor-core": 1.0, "simt": 3.0}

    def time_kind(run, kind, device, repeats):
        timed.append(kind)
        run(kind)
        return fake_ms[kind]

    monkeypatch.setattr(tuning, "_time_kind", time_kind)
    yield timed
    tuning.forget()
    reset_cache()


def _call(K, name="l1"):
    return SimpleNamespace(desc=km.preset(name), dtype=torch.float32, K=K, M=1000, N=1000, device=torch.device("cpu"))


def test_choose_default_without_autotune(fake_gpu):
    ran = []
    assert tuning.choose(_call(3), None, IF, False, ran.append, autotune_flag=False) == "lowk"
    assert ran == [] and fake_gpu == []


def test_choose_measures_stores_and_reuses(fake_gpu):
    ran = []
    assert tuning.choose(_call(100), None, IF, False, ran.append, autotune_flag=True) == "lowk"
    assert fake_gpu == ["lowk", "simt"] and ran[-1] == "simt"  # the default table says simt at K = 100
    assert tuning.choose(_call(100), None, IF, False, ran.append, autotune_flag=True) == "lowk"
    n = len(fake_gpu)
    tuning.forget()  # as in a new process: read from the store, no timing
    assert tuning.choose(_call(100), None, IF, False, ran.append, autotune_flag=True) == "lowk"
    assert len(fake_gpu) == n
    choice, timings = tuning.stored("key-100")
    assert choice == "lowk" and timings == {"lowk": 2.0, "simt": 3.0}


def test_choose_single_candidate_is_not_timed(fake_gpu):
    assert tuning.choose(_call(1000), None, IF, False, lambda k: None, autotune_flag=True) == "simt"
    assert tuning.choose(_call(100, "l2"), None, IF, False, lambda k: None, autotune_flag=True) == "tensor-core"
    assert fake_gpu == []


def _writer(args):
    directory, worker, n = args
    cache = KernelCache(directory)
    for i in range(n):
        cache.put_tuning(f"shared-{i % 3}", f"w{worker}", json.dumps({"lowk": worker + i / 10}), "fake")
        cache.put_tuning(f"own-{worker}-{i}", "lowk", json.dumps({"lowk": 1.0, "simt": 2.0}), "fake")
    cache.close()
    return worker


def test_tuning_store_concurrent_processes(tmp_path):
    workers, n = 3, 10
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        assert sorted(pool.map(_writer, [(str(tmp_path), w, n) for w in range(workers)])) == list(range(workers))
    cache = KernelCache(tmp_path)
    rows = cache.tuning_rows()
    keys = [r[0] for r in rows]
    assert len(keys) == len(set(keys)) == 3 + workers * n
    for key, choice, timings, device in rows:
        json.loads(timings)  # complete rows only
        assert device == "fake" and (choice == "lowk" or key.startswith("shared-"))
    assert cache.get_tuning("own-2-7") == ("lowk", json.dumps({"lowk": 1.0, "simt": 2.0}))
    r = subprocess.run([sys.executable, "-m", "kermac_like", "tune", "--list"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, KERMAC_LIKE_CACHE_DIR=str(tmp_path)))
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 3 + workers * n
    cache.close()
