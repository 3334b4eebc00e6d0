import os

import pytest
import torch


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
