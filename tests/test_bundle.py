"""Bundles of prebuilt kernels and the kernel store's find-or-compile path (no GPU: the arch is
a string; one small kernel is compiled with NVRTC)."""

from __future__ import annotations

import os

import pytest
import torch

from kermac_like.runtime import store
from kermac_like.runtime.cache import warm
from kermac_like.runtime.cache import store as kc
from kermac_like.runtime.compiler import kernel_key
from kermac_like.runtime.precompile import write_bundle
from kermac_like.runtime.specs.matvec import combine_spec

ARCH = "sm_80"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(warm.ENV_BUNDLE, str(tmp_path / "bundle"))
    monkeypatch.setattr(warm, "package_bundle_dir", lambda: tmp_path / "no-package-bundle")
    warm._bundle_files.cache_clear()
    kc.reset_cache()
    yield tmp_path
    warm._bundle_files.cache_clear()
    kc.reset_cache()


@pytest.fixture(scope="module")
def spec():
    return combine_spec(torch.float32)  # a small kernel: well under a second of NVRTC


def test_bundle_is_read_before_compiling(isolated, spec, monkeypatch):
    summary = write_bundle([spec], ARCH, isolated / "bundle", processes=1)
    path = isolated / "bundle" / kc.DB_FILENAME
    assert summary["compiled"] == 1 and summary["bundle"] == str(path)
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert not (isolated / "bundle" / (kc.DB_FILENAME + "-wal")).exists()
    key = kernel_key(spec, ARCH)
    cubin, lowered, sha = warm.read_bundled(key)
    assert lowered and len(cubin) > 1000
    assert warm.read_kernel_status(key) == (None, True)  # the user's cache has no file yet
    monkeypatch.setattr(store, "compile_specs", lambda *a, **k: pytest.fail("compiled despite the bundle"))
    found, source = store._find_or_compile(spec, ARCH, key, False)
    assert source == "bundle" and found == (cubin, lowered, sha)


def test_bundle_writable_by_others_is_ignored(isolated, spec):
    write_bundle([spec], ARCH, isolated / "bundle", processes=1)
    path = isolated / "bundle" / kc.DB_FILENAME
    os.chmod(path, 0o666)
    warm._bundle_files.cache_clear()
    assert warm.read_bundled(kernel_key(spec, ARCH)) is None


def test_miss_compiles_and_stores(isolated, spec):
    key = kernel_key(spec, ARCH)
    found, source = store._find_or_compile(spec, ARCH, key, False)
    assert source == "compiled"
    assert warm.read_kernel(key) == found  # stored in the user's cache
    assert warm.read_kernel_status(key) == (found, False)
    assert warm.read_kernel_status("0" * 64) == (None, True)  # a sound file without the row
    again, source = store._find_or_compile(spec, ARCH, key, False)
    assert source == "cache" and again == found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cold_calls_take_only_shipped_kernels():
    """Every first call that bench/run.py's cold_compile rows time (issue 26's list) launches only
    instantiations of the shipped set, so that a bundle of `precompile --all` serves it without
    compiling (a topk_mma version outside the set once cost the knn K = 128 row 1.2 s)."""
    import sys
    from pathlib import Path

    from kermac_like.runtime.specs import shipped_specs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        from run import COLD_CALLS
    finally:
        sys.path.pop(0)
    import kermac_like as km  # noqa: F401  (the calls' namespace)

    shipped = set(shipped_specs())
    dev = torch.device("cuda")
    for name, code in COLD_CALLS.items():
        store.clear_loaded()  # each call loads its kernels again (from the cache)
        setup, timed = code.split("@ ")
        scope = {"torch": torch, "km": km, "dev": dev}
        exec(setup, scope)
        exec(timed, scope)
        torch.cuda.synchronize()
        used = {spec for (_, spec) in store._loaded}
        assert used, name
        missing = [s.name_expression for s in used if s not in shipped]
        assert not missing, f"{name}: not in the shipped set: {missing}"
