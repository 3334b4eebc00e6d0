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
import sys
from pathlib import Path

from setuptools import build_meta as _meta
from setuptools.build_meta import *  # noqa: F401,F403  (PEP 517 / 660 hooks)
from setuptools.command.build_py import build_py as _build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kermac_prebuild import ROOT, cuda_requires, prebuild  # noqa: E402


def get_requires_for_build_wheel(config_settings=None):
    return _meta.get_requires_for_build_wheel(config_settings) + cuda_requires()


def get_requires_for_build_editable(config_settings=None):
    return _meta.get_requires_for_build_editable(config_settings) + cuda_requires()


class BuildPy(_build_py):
    """setuptools' build_py, then the prebuilt kernels: into the wheel's ``kermac_like/prebuilt/``, or
    for an editable install into the source tree's (the package is imported from there)."""

    def run(self):
        super().run()
        if self.editable_mode:
            prebuild(ROOT / "kermac_like" / "prebuilt")
        else:
            target = Path(self.build_lib) / "kermac_like" / "prebuilt"
            prebuild(target)
            (target / "reports.json").unlink(missing_ok=True)  # the tests' (ptxas reports), not the wheel's
