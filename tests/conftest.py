import contextlib
import os

# OpenMP's idle threads sleep instead of spinning (set before torch loads libgomp; the test processes and every
# process they start inherit it). The suite keeps every core busy (the shipped build beside the tests, the
# example runs and gloo ranks two at a time), and with the default active wait torch's idle worker threads spin
# on the cores the others need: on this 2-core machine tests/test_sklearn.py + test_rfm.py took 73-75 CPU-s
# with it and 14-15 CPU-s without, the three gloo pair checks 80 and 17 CPU-s. Threads and numerics unchanged.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# The low-K first-call tier (plan._first_call_tier) runs a stand-in kernel while the one a
# call asked for compiles: tests that look at which kernel ran or whether a plan was kept
# need the compile to finish first, so the suite runs without it (test_jit_tier.py turns it on).
os.environ.setdefault("KERMAC_LIKE_JIT_TIER", "0")


def cuda_ok() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


# Exhaustive sweeps (the CPU-shim runs of a template over every odd shape, every data family): the
# default run keeps every n-th case of each (spread over the sweep, first included); the others are
# marked slow and run with `python3 -m pytest -m slow` (README.md). Before: 60 + 65 + 44 + 40 + 5 + 8
# cases, the larger part of the CPU suite's template execution time.
SWEEPS = {
    "tests/test_templates_lowk.py::test_lowk_cpu_odd_shapes": 3,
    "tests/test_templates_logsumexp.py::test_lse_kernel_cpu": 3,
    "tests/test_templates_distance.py::test_cpu_execution_odd_shapes": 3,
    "tests/test_templates_topk.py::test_topk_kernel_cpu": 3,
    "tests/test_templates_kmeans.py::test_seeding_same_as_torch": 2,
    "tests/test_templates_topk_rescore.py::test_random_data_matches_rescore": 2,
    "tests/test_templates_topk_rescore.py::test_integer_ties_and_pads_are_exact": 2,
}


def _mark_sweeps_slow(items) -> None:
    seen: dict = {}
    for item in items:
        name = item.nodeid.split("[", 1)[0]
        every = SWEEPS.get(name)
        if every is None or "[" not in item.nodeid:
            continue
        i = seen[name] = seen.get(name, -1) + 1
        if i % every:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before -m's selection, which then sees the marks added here
def pytest_collection_modifyitems(config, items):
    _mark_sweeps_slow(items)
    # The tests that read the session's shipped build (fixture ``shipped``) last: the build runs in
    # the background meanwhile.
    later = [item for item in items if "shipped" in getattr(item, "fixturenames", ())]
    if later:
        items[:] = [item for item in items if "shipped" not in getattr(item, "fixturenames", ())] + later
    # Tests marked slow (many processes, whole sweeps) run only where the marker expression names
    # them: python3 -m pytest -m slow (the GPU suite's "gpu and not slow" leaves them out as before).
    if "slow" not in (config.option.markexpr or ""):
        slow = pytest.mark.skip(reason="slow: run with python3 -m pytest -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
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
        # pytest-xdist workers share one cache directory: one worker compiles while the others wait
        # on the lock and then find every kernel cached (not four compiles of the set at once).
        from shipped_build import exclusive, up_front_turn

        cache_dir = d or os.environ.get("KERMAC_LIKE_CACHE_DIR")
        turns = contextlib.nullcontext()
        if cache_dir and os.environ.get("PYTEST_XDIST_WORKER"):
            os.makedirs(cache_dir, exist_ok=True)
            turns = exclusive(os.path.join(cache_dir, ".test-precompile.lock"))
        arch = arch_of_device(torch.device("cuda", torch.cuda.current_device()))
        with turns:
            summary = precompile_specs(shipped_specs(), arch)
        # Then the instantiations outside the shipped set that the session's GPU modules compile up front (their
        # module-level up_front_specs()), all in one precompile by one worker: under pytest-xdist every worker
        # that drew a test of such a module ran the module's own up-front precompile (a pool of processes each) at
        # about the same moment as the others, each compiling the same kernels. The other workers start on their
        # tests meanwhile; a module's fixture waits for the turn (up_front_turn) and then finds its kernels cached.
        # (xdist workers with a cache dir each, KERMAC_LIKE_TEST_KEEP_CACHE unset: each module's own, as before)
        more = {}
        shared = d is None or not os.environ.get("PYTEST_XDIST_WORKER")
        with up_front_turn(block=False) as mine:
            extra = _up_front_specs(request.session.items) if mine and shared else []
            if extra:
                more = precompile_specs(extra, arch, processes=min(16, os.cpu_count() or 1))
        print(f"\n[conftest] shipped kernels: {summary.get('compiled')} compiled, {summary.get('cached')} cached; "
              f"the GPU modules' up-front kernels: {more.get('compiled', 0)} compiled, {more.get('cached', 0)} cached, "
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


def _up_front_specs(items) -> list:
    """The specs that the modules of the selected GPU tests compile up front (a module's ``up_front_specs()``),
    in module order, without repeats."""
    specs, seen = [], set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen or "gpu" not in item.keywords:
            continue
        seen.add(module.__name__)
        fn = getattr(module, "up_front_specs", None)
        if callable(fn):
            specs += fn()
    return list(dict.fromkeys(specs))


# The ShippedBuild that pytest_configure started before collection (a run of the whole suite), or None.
_early_build = None


def _whole_suite(config) -> bool:
    """Whether this run is the README's command (or the whole suite with options): no test paths or
    node ids, no -k, one process (not pytest-xdist), not only collecting."""
    args = config.invocation_params.args
    positional = [a for a in args if not str(a).startswith("-")]
    flags = {str(a).split("=", 1)[0] for a in args if str(a).startswith("-")}
    option_values = {"-m", "-k", "-n", "-p", "--numprocesses", "--durations", "--basetemp", "--rootdir", "-c", "-o",
                     "--maxfail", "--tb", "-W", "--deselect", "--ignore", "--timeout"}
    if any(f in flags for f in ("-k", "-n", "--numprocesses", "--co", "--collect-only")):
        return False
    # a positional right after an option that takes a value is that option's value, not a path
    values = {str(b) for a, b in zip(args, args[1:]) if str(a) in option_values}
    return not [a for a in positional if str(a) not in values] and not os.environ.get("PYTEST_XDIST_WORKER")


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin's: the session's base temp dir
def pytest_configure(config):
    """A run of the whole suite starts the shipped build (both architectures) before collection,
    which takes one core for ~10-20 s: the build fills the other (the build is the larger part of
    the suite's CPU work). Other runs start it with their first test, where one reads it."""
    global _early_build
    if not _whole_suite(config) or os.environ.get("KERMAC_LIKE_TEST_EARLY_BUILD", "1") == "0":
        return
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return
    from shipped_build import ShippedBuild

    _early_build = ShippedBuild(factory.getbasetemp() / "shipped")
    for arch in SHIPPED_ARCHS:
        _early_build.start(arch)


def pytest_unconfigure(config):
    """The early build ends with the session (whether or not a test read it)."""
    global _early_build
    if _early_build is not None:
        _early_build.stop()
        _early_build = None


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    """The session's ShippedBuild (tests/shipped_build.py): the shipped set of each architecture
    compiled once, in the background. Its dirs lie below the session's base temp dir (under
    pytest-xdist: the one the workers share), whatever the kernel cache."""
    from shipped_build import ShippedBuild

    if _early_build is not None:
        yield _early_build
        return
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    build = ShippedBuild(base / "shipped")
    yield build
    build.stop()


@pytest.fixture(scope="session", autouse=True)
def _shipped_in_background(request):
    """Sessions with tests that read the shipped build start it (both architectures) before the first
    test; pytest_collection_modifyitems runs those tests last, so the build overlaps the others."""
    if any("shipped" in getattr(item, "fixturenames", ()) for item in request.session.items):
        build = request.getfixturevalue("shipped")
        for arch in SHIPPED_ARCHS:
            build.start(arch)
    yield


SHIPPED_ARCHS = ("sm_80", "sm_90")


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


@pytest.fixture
def settings():
    """``settings(name=value, ...)``: kermac_like.config.override(...) until the test ends (calls
    nest: a later call for the same name wins, and the teardown restores each in turn)."""
    from kermac_like.config import override

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(override(**values))


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
    from kermac_like.runtime import launcher, store

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
    monkeypatch.setattr(store, "get_kernel", lambda spec, device, debug=False: _StubKernel(spec))
    monkeypatch.setattr(store, "prefetch", lambda specs, device, debug=False: None)
    monkeypatch.setattr(store, "available", lambda spec, device: True)
    monkeypatch.setattr(launcher, "max_active_clusters", lambda k: 66)
    stub("_wgmma_enabled", lambda device, settings=None: (settings or P.Settings.current()).wgmma and cap[0] == (9, 0))
    monkeypatch.setenv("KERMAC_LIKE_WGMMA", "always")
    P.clear_templates()
    yield cap
    P.clear_templates()
