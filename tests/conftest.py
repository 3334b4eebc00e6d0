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


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Every test session uses its own kernel cache dir unless one is forced."""
    if not os.environ.get("KERMAC_LIKE_TEST_KEEP_CACHE"):
        d = tmp_path_factory.getbasetemp() / "kernel-cache"
        monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(d))
    yield


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
    from kermac_like import plan as P
    from kermac_like.plan import cdist_grad, core, distance, kmeans, logsumexp, matvec, matvec_wgmma
    from kermac_like.runtime import launcher

    def stub(name, fn):
        """``name`` replaced in every planner module that looks it up (each rule imports the
        device queries from plan.core by name)."""
        for module in (P, core, distance, cdist_grad, matvec, matvec_wgmma, logsumexp, kmeans):
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
