"""The package's build backend: setuptools' own, plus the prebuilt kernels of the first calls.

A wheel (``pip install .``, ``python -m build``) and an editable install (``pip install -e .``,
PEP 660) both run setuptools' ``build_py``; ours then compiles, with NVRTC (no GPU needed), the
kernels that bench/run.py's cold_compile calls launch on sm_80 and sm_90
(``python -m kermac_like precompile --first-calls --arch sm_80 --arch sm_90 --bundle DIR``,
runtime/precompile.py ``first_call_specs``) into a bundle that the launcher reads before compiling
(runtime/cache/warm.py): ``kermac_like/prebuilt/`` in the wheel, or in the source tree for an
editable install (the folder the editable package is imported from). A first call of those kernels
then loads a cubin instead of running NVRTC (bench/notes/jit.md, "Prebuilt at install").

The compile runs in a new process of the interpreter that runs the build, with the environment the
package is being installed into (torch, NVRTC) and this source tree on its path, not pip's isolated
build environment; where that environment has no NVRTC yet (a first ``pip install ".[cu13]"``
installs it with the package), :func:`get_requires_for_build_wheel` asks pip for NVRTC and cuda-core
in the build environment and the compile takes them from there. The bundle's keys hold the NVRTC
version, so a bundle built by another NVRTC than the one the package later loads is never read (its
kernels then compile on first use). Whatever fails (no torch, no NVRTC, a platform without its
wheels, a compile error) leaves the build as it was, with a message, and no bundle.

KERMAC_LIKE_PREBUILD=0 turns it off; KERMAC_LIKE_PREBUILD_ARCHS="sm_90" (space- or comma-separated)
picks the architectures (default sm_80 and sm_90).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F401,F403  (PEP 517 / 660 hooks)
from setuptools.command.build_py import build_py as _build_py

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90")
# The NVRTC, cuda-bindings and cuda-core of the extras ([cu13], [cu12] in pyproject.toml), for a build
# whose target environment has none yet.
CUDA_REQUIRES = {
    "13": ["cuda-core>=0.4", "cuda-bindings>=13,<14", "nvidia-cuda-nvrtc>=13,<14"],
    "12": ["cuda-core>=0.3", "cuda-bindings>=12.8,<13", "nvidia-cuda-nvrtc-cu12>=12.8,<13"],
}
_PROBE = r"""
import importlib.util, sys
if importlib.util.find_spec("torch") is None:
    print("no-torch"); sys.exit()
import torch
cuda = (torch.version.cuda or "13").split(".")[0]
ok = all(importlib.util.find_spec(m) is not None for m in ("cuda.core", "cuda.bindings"))
try:
    from cuda.bindings import nvrtc
    ok = ok and nvrtc.nvrtcVersion()[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
except Exception:
    ok = False
print(("ready " if ok else "needs ") + cuda)
"""


def _say(message: str) -> None:
    print(f"kermac_like build: {message}", file=sys.stderr, flush=True)


def _enabled() -> bool:
    return os.environ.get("KERMAC_LIKE_PREBUILD", "1").strip().lower() not in ("0", "false", "no", "off")


def _target_env(extra_paths=()) -> dict:
    """The environment of the compile: the target environment's interpreter as it starts outside
    pip's isolated build (no PYTHONPATH of pip's, user site allowed), this source tree first on its
    path, ``extra_paths`` (the build environment's packages) last."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *extra_paths])
    return env


def _probe() -> str:
    """"ready N" (the target environment has torch and a working NVRTC; torch's CUDA major N),
    "needs N" (torch without NVRTC), "no-torch", or "failed: ..."."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], env=_target_env(), capture_output=True, text=True,
                           timeout=120)
        return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else \
            f"failed: {p.stderr.strip()[-300:]}"
    except Exception as e:  # noqa: BLE001
        return f"failed: {e}"


def _cuda_requires() -> list:
    if not _enabled() or not (sys.platform.startswith("linux") or sys.platform == "win32"):
        return []
    state = _probe()
    if state.startswith("needs "):
        major = state.split()[1]
        return list(CUDA_REQUIRES.get(major, CUDA_REQUIRES["13"]))
    return []


def get_requires_for_build_wheel(config_settings=None):
    return _meta.get_requires_for_build_wheel(config_settings) + _cuda_requires()


def get_requires_for_build_editable(config_settings=None):
    return _meta.get_requires_for_build_editable(config_settings) + _cuda_requires()


def _build_env_paths() -> list:
    """The isolated build environment's package folders that hold what get_requires asked for (the
    compile reads NVRTC from there when the target environment has none)."""
    out = []
    for p in sys.path:
        if p and os.path.isdir(os.path.join(p, "cuda")) and not os.path.samefile(p, ROOT):
            out.append(p)
    return out


def prebuild(directory: Path) -> bool:
    """Compile the first calls' kernels into the bundle in ``directory``; False (with a message)
    where that cannot be done here."""
    if not _enabled():
        _say("KERMAC_LIKE_PREBUILD=0: no prebuilt kernels")
        return False
    archs = os.environ.get("KERMAC_LIKE_PREBUILD_ARCHS", " ".join(ARCHS)).replace(",", " ").split()
    cmd = [sys.executable, "-m", "kermac_like", "precompile", "--first-calls", "--bundle", str(directory)]
    for arch in archs:
        cmd += ["--arch", arch]
    t0 = time.perf_counter()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        p = subprocess.run(cmd, env=_target_env(_build_env_paths()), capture_output=True, text=True, timeout=1200)
    except Exception as e:  # noqa: BLE001
        _say(f"no prebuilt kernels ({type(e).__name__}: {e}); each kernel compiles on its first call")
        return False
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or ["no message"])[-1]
        _say(f"no prebuilt kernels ({why}); each kernel compiles on its first call (python -m kermac_like "
             "precompile --first-calls --bundle builds them later)")
        return False
    _say(f"prebuilt kernels for {', '.join(archs)} in {directory} ({time.perf_counter() - t0:.1f} s)")
    for line in p.stdout.strip().splitlines():
        if line.startswith("sm_") or line.startswith("bundle:"):
            _say("  " + line)
    return True


class BuildPy(_build_py):
    """setuptools' build_py, then the prebuilt kernels: into the wheel's ``kermac_like/prebuilt/``, or
    for an editable install into the source tree's (the package is imported from there)."""

    def run(self):
        super().run()
        if self.editable_mode:
            prebuild(ROOT / "kermac_like" / "prebuilt")
        else:
            prebuild(Path(self.build_lib) / "kermac_like" / "prebuilt")
