"""Building the g++ runners of the CPU execution tests: a template's kernels compiled as plain
C++ behind a thread shim (shared memory as statics, one thread per std::thread)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).resolve().parent.parent / "cuda_templates"

# Put before every runner's source: the runners write their results with kl_write.
PRELUDE = r"""
#include <cstdio>
#include <vector>
// The runner's output file: the elements of v as they lie in memory; the exit status of main.
template <class V>
int kl_write(const char* path, const std::vector<V>& v) {
  FILE* f = std::fopen(path, "wb");
  if (f == nullptr) return 5;
  const bool ok = std::fwrite(v.data(), sizeof(V), v.size(), f) == v.size();
  return std::fclose(f) == 0 && ok ? 0 : 6;
}
"""


def build_cpu_runner(tmp_path_factory, name: str, source: str) -> Path:
    """Compile ``source`` (a runner's C++, after PRELUDE) into an executable in a fresh temporary folder;
    skip the test module without a C++ compiler, fail with the compiler's output on error."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler for the CPU execution tests")
    d = tmp_path_factory.mktemp(name)
    (d / "runner.cpp").write_text(PRELUDE + source)
    exe = d / "runner"
    cmd = [cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", f"-I{TEMPLATES}", "-o", str(exe),
           str(d / "runner.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"g++ failed:\n{res.stderr[-6000:]}")
    return exe
