"""The host emulation of the mma.sync templates, shared by the tests that run a kernel of
cuda_templates/ under it (tests/test_templates_topk_mma.py, _kmeans_assign.py, _falkon.py):
test_templates_mma.py's emulator source up to its driver (host primitives, fibers,
distance_mma.cuh), and the g++ build of a driver on it."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "cuda_templates"


def prelude() -> str:
    """test_templates_mma.py's EMULATOR_SOURCE up to its driver, read without importing that module."""
    tree = ast.parse((ROOT / "tests" / "test_templates_mma.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EMULATOR_SOURCE" for t in node.targets):
            src = ast.literal_eval(node.value)
            break
    else:  # pragma: no cover
        raise AssertionError("EMULATOR_SOURCE not found in test_templates_mma.py")
    marker = "// ------------------------------------------------------------------ driver"
    assert marker in src
    return src[:src.index(marker)]


def build(tmp_path_factory, name: str, driver: str) -> str:
    """The executable of prelude() + driver (g++ -O1, the templates on the include path); skips the
    caller without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not installed")
    d = tmp_path_factory.mktemp(name)
    (d / "emu.cpp").write_text(prelude() + driver)
    exe = d / "emu"
    r = subprocess.run([gxx, "-std=c++17", "-O1", "-I", str(TEMPLATES), str(d / "emu.cpp"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return str(exe)
