"""Bundles of prebuilt kernels and the kernel store's find-or-compile path (no GPU: the arch is
a string; one small kernel is compiled with NVRTC)."""

from __future__ import annotations

import os

import pytest
import torch

from kermac_like.runtime import store
from kermac_like.runtime.cache import warm
from kermac_like.runtime.cache import store as kc
from kermac_like.runtime import compiler
from kermac_like.runtime.compiler import kernel_key
from kermac_like.runtime.precompile import first_call_specs, write_bundle
from kermac_like.runtime.specs import shipped_specs
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
        # ... and only kernels of the install's prebuilt set (runtime/precompile.first_call_specs), so that
        # the installed package serves it without NVRTC
        arch = compiler.arch_of_device(dev)
        first = set(first_call_specs(arch))
        if arch in ("sm_80", "sm_90"):
            outside = [s.name_expression for s in used if s not in first]
            assert not outside, f"{name}: not in first_calls.json for {arch}: {outside}"


def test_first_call_list_is_what_the_planners_take():
    """runtime/first_calls.json (the kernels the install prebuilds) lists what the cold_compile calls
    launch on sm_80 and sm_90 today, planned on CPU tensors with the devices' answers stood in for
    (tests/first_calls.py; `python3 tests/first_calls.py --write` rewrites the list after a planner
    change)."""
    from first_calls import ARCHS, first_call_specs_planned

    shipped = set(shipped_specs())
    for arch in ARCHS:
        planned = first_call_specs_planned(arch)
        assert planned and set(planned) <= shipped, arch
        assert first_call_specs(arch) == planned, (
            f"{arch}: runtime/first_calls.json is stale; run python3 tests/first_calls.py --write")


@pytest.mark.skipif(not os.environ.get("CI") and not (warm.package_bundle_dir() / kc.DB_FILENAME).exists(),
                    reason="no bundle from the install (KERMAC_LIKE_PREBUILD=0, or installed before the build hook)")
def test_install_prebuilt_the_first_calls():
    """The install (_build/kermac_build.py) left every first call's kernel, for sm_80 and sm_90, in
    kermac_like/prebuilt/ under the key this package computes: read from there, not compiled (in CI
    the README's install command has run just before)."""
    warm._bundle_files.cache_clear()
    assert (warm.package_bundle_dir() / kc.DB_FILENAME).is_file(), "the install wrote no bundle"
    for arch in ("sm_80", "sm_90"):
        specs = first_call_specs(arch)
        missing = [s.name_expression for s in specs if warm.read_bundled(kernel_key(s, arch)) is None]
        assert not missing, f"{arch}: not prebuilt: {missing}"


def _build_hook():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "_build" / "kermac_prebuild.py"
    spec = importlib.util.spec_from_file_location("kermac_build_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_without_kernels_still_succeeds(tmp_path, monkeypatch, capsys):
    """The build hook never fails a build: turned off, without an interpreter to compile in, or with
    a compile that fails (an architecture NVRTC is not asked for here, standing in for a machine
    without NVRTC), it says why on stderr and writes no bundle."""
    hook = _build_hook()
    monkeypatch.setenv("KERMAC_LIKE_PREBUILD", "0")
    assert hook.prebuild(tmp_path / "off") is False
    assert "KERMAC_LIKE_PREBUILD=0" in capsys.readouterr().err
    assert hook.cuda_requires() == []  # nor asks pip for NVRTC
    monkeypatch.setenv("KERMAC_LIKE_PREBUILD", "1")
    monkeypatch.setattr(hook.sys, "executable", str(tmp_path / "no-such-python"))
    assert hook.prebuild(tmp_path / "no-python") is False
    assert "no prebuilt kernels" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("KERMAC_LIKE_PREBUILD_ARCHS", "sm_75")
    assert hook.prebuild(tmp_path / "sm75") is False
    err = capsys.readouterr().err
    assert "no prebuilt kernels" in err and "first call" in err
    assert not (tmp_path / "sm75" / kc.DB_FILENAME).exists()


# A warm first call of bench/run.py's warm_process row (run_kernel laplace_l2, 1024 x 1024 x 64) in a new
# process, on the CPU with the device queries answered as an H200's, the kernels from a bundle of the
# install's layout (the first calls' kernels, 4 a module; the cubins stand-ins: the loader is stubbed) and
# the launches recorded. What it may do (bench/notes/jit.md, "The warm first call again"): find every
# kernel in the bundle (no compile, no SQLAlchemy), hash each module's cubin once, and run no torch
# kernel, only allocations: a torch kernel's first launch on a GPU loads its module from torch's
# fatbinary (plan.shift's reference point by torch's steps cost ~150 ms of this call on an H200).
_WARM_CHILD = r"""
import json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import kermac_like as km
from kermac_like.runtime import compiler, launcher, loader, store
from kermac_like.runtime.cache import warm
from kermac_like.plan import core, shift, distance
from kermac_like.ops import distance as ops_distance
import conftest_stubs  # noqa: F401  (written beside this script: the H200's answers)

store.prepare_thread is None or store.prepare_thread.join(30)
launches, dispatched = [], []
launcher.launch = lambda k, grid, args, debug=False, block=None: launches.append(k.spec.kernel.split("::")[-1])
loader.load = lambda spec, device, found, key, source: loader.LoadedKernel(spec, device, None, key, source)
store.compile_specs = lambda *a, **k: sys.exit("compiled")
shift._on_device = lambda x: True  # the GPU path of the shift: its allocations and launches


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dispatched.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


inner = ops_distance.run_distance
def counted(*a, **k):
    with Count():
        return inner(*a, **k)
ops_distance.run_distance = counted
x = torch.randn(1024, 64)
hashes = warm.hash_count
km.run_kernel(km.preset("laplace_l2"), x, x, bandwidth=8.0)
print(json.dumps(dict(launches=launches, dispatched=sorted(set(dispatched)), hashes=warm.hash_count - hashes,
                      sources=sorted({k.source for k in store._loaded.values()}),
                      module_shas=len({warm.read_bundled(k.key)[2] for k in store._loaded.values()}),
                      sqlalchemy="sqlalchemy" in sys.modules)))
"""

_STUBS = r"""
import importlib, pkgutil, torch
from kermac_like import plan as P
from kermac_like.plan import core
from kermac_like.runtime import launcher, store
modules = [P] + [importlib.import_module(f"{P.__name__}.{m.name}") for m in pkgutil.iter_modules(P.__path__)]
def stub(name, fn):
    for m in modules:
        if hasattr(m, name):
            setattr(m, name, fn)
stub("_gpu_ok", lambda t: True)
stub("_device_index", lambda d: 0)
stub("_sm_count", lambda d: 132)
stub("_smem_per_sm", lambda d: 233472)
stub("_smem_per_block_optin", lambda d: 232448)
stub("_blocks_per_sm", lambda kernel: 1)
stub("_wgmma_enabled", lambda device, settings=None: bool((settings or core.Settings.current()).wgmma))
torch.cuda.get_device_capability = lambda d=None: (9, 0)
store.arch_of_device = lambda d: "sm_90"
launcher.max_active_clusters = lambda kernel: 66
"""


def test_warm_first_call_finds_hashes_once_and_runs_no_torch_kernel(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from kermac_like.runtime.cache.schema import ModuleRecord

    specs = first_call_specs("sm_90")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with kc.KernelCache(bundle) as c:  # the install's layout: 4 kernels a module, each module its own bytes
        for i in range(0, len(specs), 4):
            group = specs[i:i + 4]
            c.put(ModuleRecord(os.urandom(4096 + i), "sm_90", 0.1, compiler.nvrtc_version(), "-arch=sm_90",
                               tuple((kernel_key(s, "sm_90"), s.name_expression, f"_Z{i + j}") for j, s in enumerate(group))))
    os.chmod(bundle, 0o755)
    os.chmod(bundle / kc.DB_FILENAME, 0o644)
    (tmp_path / "conftest_stubs.py").write_text(_STUBS)
    (tmp_path / "cache").mkdir(mode=0o700)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=str(tmp_path / "cache"), KERMAC_LIKE_BUNDLE=str(bundle),
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]), KERMAC_LIKE_JIT_TIER="0")
    res = subprocess.run([sys.executable, "-c", _WARM_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:] + res.stdout[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["launches"] == ["centring_flags_kernel", "centring_point_kernel", "centring_shift_kernel",
                               "wgmma_prepare_b_kernel", "distance_wgmma_kernel"], got
    assert got["sources"] == ["bundle"] and not got["sqlalchemy"], got
    assert got["hashes"] == got["module_shas"] <= 2, got  # one sha256 per module, not per kernel
    assert set(got["dispatched"]) <= {"empty", "empty_strided"}, got  # allocations only: no torch kernel
