"""What the build backend (kermac_build.py beside this) does beyond setuptools: the first calls' kernels
compiled into a bundle in a process of the target environment. No setuptools here, so that the tests
can import it (tests/test_bundle.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_80", "sm_90")
# The NVRTC, cuda-bindings and cuda-core of the extras ([cu13], [cu12] in pyproject.toml), for a build
# whose target environment has none yet.
CUDA_REQUIRES = {
    "13": ["cuda-core>=0.4", "cuda-bindings>=13,<14", "nvidia-cuda-nvrtc>=13,<14"],
    "12": ["cuda-core>=0.3", "cuda-bindings>=12.8,<13", "nvidia-cuda-nvrtc-cu12>=12.8,<13"],
}
_PROBE = r"""
import importlib.metadata as md, importlib.util, os, re, sys
spec = importlib.util.find_spec("torch")  # found, not imported: this runs before every build
if spec is None:
    print("no-torch"); sys.exit()
try:
    with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
        m = re.search(r"^cuda\b[^=]*=\s*['\"](\d+)", f.read(), re.M)
except OSError:
    m = None
cuda = m.group(1) if m else "13"  # a CPU torch: the [cu13] extra (the README's test command)
def has(name):
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False
nvrtc = any(has(n) for n in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvrtc-cu13"))
ok = nvrtc and all(importlib.util.find_spec(n) is not None for n in ("cuda.core", "cuda.bindings"))
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
    """The target environment's state: ``ready N`` (torch and NVRTC; torch's CUDA major N),
    ``needs N`` (torch without NVRTC), ``no-torch``, or ``failed: ...``."""
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE], env=_target_env(), capture_output=True, text=True,
                           timeout=120)
        return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else \
            f"failed: {p.stderr.strip()[-300:]}"
    except Exception as e:  # noqa: BLE001
        return f"failed: {e}"


def cuda_requires() -> list:
    if not _enabled() or not (sys.platform.startswith("linux") or sys.platform == "win32"):
        return []
    state = _probe()
    if state.startswith("needs "):
        major = state.split()[1]
        return list(CUDA_REQUIRES.get(major, CUDA_REQUIRES["13"]))
    return []


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
