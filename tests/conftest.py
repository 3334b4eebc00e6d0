import os

import pytest
import torch

# The low-K first-call tier (plan._first_call_tier) runs a stand-in kernel while the one a
# call asked for compiles: tests that look at which kernel ran or whether a plan was kept
# need the compile to finish first, so the suite runs without it (test_jit_tier.py turns it on).
os.environ.setdefault("KERMAC_LIKE_JIT_TIER", "0")


def cuda_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def pytest_collection_modifyitems(config, items):
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability 8.0 or newer")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _session_cache_dir(tmp_path_factory) -> str | None:
    """The kernel cache dir of this session (None: the forced KERMAC_LIKE_CACHE_DIR)."""
    if os.environ.get("KERMAC_LIKE_TEST_KEEP_CACHE"):
        return None
    return str(tmp_path_factory.getbasetemp() / "kernel-cache")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Every test session uses its own kernel cache dir unless one is forced."""
    d = _session_cache_dir(tmp_path_factory)
    if d is not None:
        monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", d)
    yield


@pytest.fixture(scope="session", autouse=True)
def _compile_shipped_once(request, tmp_path_factory):
    """GPU sessions: every shipped kernel for this GPU compiled once, up front, in parallel
    processes (many kernels per NVRTC program) into the session's cache, instead of one at a
    time in whichever test first needs it. Tests then find them in the cache; instantiations
    outside the shipped set still compile on demand. KERMAC_LIKE_TEST_PRECOMPILE=0 turns it off."""
    if (os.environ.get("KERMAC_LIKE_TEST_PRECOMPILE", "1") == "0" or not cuda_ok()
            or not any("gpu" in item.keywords for item in request.session.items)):
        yield
        return
    import time

    from kermac_like.runtime.compiler import arch_of_device, precompile_specs
    from kermac_like.runtime.specs import shipped_specs

    d = _session_cache_dir(tmp_path_factory)
    saved = os.environ.get("KERMAC_LIKE_CACHE_DIR")
    if d is not None:
        os.environ["KERMAC_LIKE_CACHE_DIR"] = d
    try:
        from kermac_like.runtime import cache as _cache

        t0 = time.perf_counter()
        summary = precompile_specs(shipped_specs(), arch_of_device(torch.device("cuda", torch.cuda.current_device())))
        print(f"\n[conftest] shipped kernels: {summary.get('compiled')} compiled, {summary.get('cached')} cached, "
              f"{time.perf_counter() - t0:.1f} s")
        reset = getattr(_cache, "reset_cache", None)
        if reset is not None:
            reset()
    finally:
        if d is not None:
            if saved is None:
                os.environ.pop("KERMAC_LIKE_CACHE_DIR", None)
            else:
                os.environ["KERMAC_LIKE_CACHE_DIR"] = saved
    yield


class ShippedBuild:
    """The shipped set compiled once per architecture per test session (no GPU needed), each
    architecture into its own cache dir: tests/test_compile.py checks that build (counts, spills, a
    second precompile compiles nothing); the SASS and ptxas-report tests read their shipped kernels
    from it instead of compiling them again. The dirs are only read after the build: a test that
    needs kernels outside the shipped set compiles them itself (``kernels`` does)."""

    def __init__(self, base):
        self.base = base
        self._builds = {}  # arch -> (cache dir, summary, {name expression: ptxas report})
        self._sass = {}  # (module sha256, tool) -> SASS text

    def build(self, arch: str):
        """(cache dir, precompile summary, ptxas reports) of the shipped set for ``arch``."""
        if arch not in self._builds:
            from kermac_like.runtime.cache import KernelCache
            from kermac_like.runtime.compiler import precompile_specs
            from kermac_like.runtime.specs import shipped_specs

            d = self.base / arch
            d.mkdir(parents=True, exist_ok=True)
            reports = {}
            with KernelCache(d) as cache:
                summary = precompile_specs(shipped_specs(), arch, cache=cache, reports=reports)
            print(f"\n[conftest] shipped set for {arch}: {summary['compiled']} kernels, {summary['seconds']:.1f} s")
            self._builds[arch] = (d, summary, reports)
        return self._builds[arch]

    def kernels(self, specs, arch: str) -> dict:
        """{spec: (cubin of its module, lowered name, ptxas report)}: the shipped specs from the session's
        build, the others compiled here in one program (arch: the base architecture, e.g. sm_90)."""
        from kermac_like.runtime.cache import KernelCache
        from kermac_like.runtime.compiler import compile_specs, kernel_key

        d, _, reports = self.build(arch)
        specs = list(dict.fromkeys(specs))
        out, rest = {}, []
        with KernelCache(d) as cache:
            found = cache.get_many([kernel_key(s, arch) for s in specs])
        for s in specs:
            k = found.get(kernel_key(s, arch))
            if k is None:
                rest.append(s)
            else:
                out[s] = (k.cubin, k.lowered_name, reports[s.name_expression])
        for suffix in sorted({s.arch_suffix for s in rest}):
            group = [s for s in rest if s.arch_suffix == suffix]
            record, resources = compile_specs(group, arch)
            lowered = {e: lo for _, e, lo in record.kernels}
            for s in group:
                out[s] = (record.cubin, lowered[s.name_expression], resources[s.name_expression])
        return out

    def sass(self, cubin: bytes, dump) -> str:
        """``dump(cubin)`` (a test's cuobjdump wrapper), once per module and wrapper."""
        import hashlib

        key = (hashlib.sha256(cubin).hexdigest(), dump.__module__, dump.__qualname__)
        if key not in self._sass:
            self._sass[key] = dump(cubin)
        return self._sass[key]


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    """The session's ShippedBuild (below the session's base temp dir, whatever the kernel cache)."""
    return ShippedBuild(tmp_path_factory.getbasetemp() / "shipped")


@pytest.fixture
def set_tf32():
    """``set_tf32(flag)`` sets torch.backends.cuda.matmul.allow_tf32 for the test and the
    teardown restores it (monkeypatch cannot: in recent torch the flag is not a plain
    attribute of the module object, and pytest's undo then deletes it and fails)."""
    saved = torch.backends.cuda.matmul.allow_tf32

    def set_(flag: bool) -> None:
        torch.backends.cuda.matmul.allow_tf32 = flag

    yield set_
    torch.backends.cuda.matmul.allow_tf32 = saved


class _StubKernel:
    """What the planner keeps of a loaded kernel when nothing is launched."""

    def __init__(self, spec):
        self.spec, self.device = spec, 0


@pytest.fixture
def as_gpu(monkeypatch):
    """CPU tensors planned as if on a GPU of compute capability ``cap[0]`` (default sm_90,
    132 SMs): the device queries and the kernel loader are stubbed, the kernels are never
    run; KERMAC_LIKE_WGMMA=always (the wgmma kernels also for calls of a few tiles)."""
    import importlib
    import pkgutil

    from kermac_like import plan as P
    from kermac_like.runtime import launcher

    modules = [P] + [importlib.import_module(f"{P.__name__}.{m.name}") for m in pkgutil.iter_modules(P.__path__)]

    def stub(name, fn):
        """``name`` replaced in every planner module that looks it up (each rule imports the
        device queries from plan.core by name)."""
        for module in modules:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fn)

    cap = [(9, 0)]
    stub("_gpu_ok", lambda t: True)
    stub("_device_index", lambda d: 0)
    stub("_sm_count", lambda d: 132)
    # shared memory per SM of the capability (bytes; the CUDA programming guide's table)
    stub("_smem_per_sm", lambda d: {(8, 0): 167936, (8, 6): 102400, (8, 9): 102400, (9, 0): 233472}.get(cap[0], 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap[0])
    monkeypatch.setattr(launcher, "get_kernel", lambda spec, device, debug=False: _StubKernel(spec))
    monkeypatch.setattr(launcher, "prefetch", lambda specs, device, debug=False: None)
    monkeypatch.setattr(launcher, "available", lambda spec, device: True)
    monkeypatch.setattr(launcher, "max_active_clusters", lambda k: 66)
    stub("_wgmma_enabled", lambda device, settings=None: (settings or P.Settings.current()).wgmma and cap[0] == (9, 0))
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "always")
    P.clear_templates()
    yield cap
    P.clear_templates()
