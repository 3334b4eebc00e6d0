"""The compiler: template instantiations -> cubin with NVRTC (through ``cuda.core``).

A :class:`KernelSpec` names one instantiation (a kernel template applied to a
traits type) and carries the launch constants the Python side mirrors.  The
compiler renders a tiny stub (the family's header and one ``static_assert`` per
mirrored constant), compiles any number of specs in one NVRTC program, and
hands a :class:`~kermac_like.runtime.cache.ModuleRecord` to the cache.  It never
needs a GPU: the architecture is a string such as ``"sm_90"``.

The cache key of a spec is a full sha256 over everything that changes the
cubin: package version, the hash of every shipped ``.cuh``, the exact NVRTC
options, the architecture, the NVRTC version and the name expression.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import importlib.util
import io
import logging
import multiprocessing
import os
import re
import time
from pathlib import Path

from .. import config
from .._version import __version__
from . import cache as kernel_cache
from .specs import KernelSpec, LaunchShape, render_source  # noqa: F401  (re-exported)

log = logging.getLogger("kermac_like.compiler")

__all__ = [
    "LaunchShape",
    "KernelSpec",
    "CompileError",
    "template_dir",
    "template_hash",
    "nvrtc_version",
    "loaded_nvrtc_version",
    "arch_of_device",
    "compile_specs",
    "precompile_specs",
    "kernel_key",
]

MIN_CAPABILITY = (8, 0)


class CompileError(RuntimeError):
    """NVRTC rejected a program; carries its log, options and name expressions."""

    def __init__(self, message: str, *, log_text: str, options: tuple, name_expressions: tuple):
        self.log = log_text
        self.options = options
        self.name_expressions = name_expressions
        exprs = "\n  ".join(name_expressions)
        self.message = message
        super().__init__(
            f"{message}\noptions: {' '.join(options)}\nname expressions:\n  {exprs}\nNVRTC log:\n{log_text}"
        )

    def __reduce__(self):  # crosses process boundaries in parallel precompile
        return (functools.partial(CompileError, log_text=self.log, options=self.options,
                                  name_expressions=self.name_expressions), (self.message,))


# -- sources and environment -------------------------------------------------------
@functools.lru_cache(maxsize=None)
def template_dir() -> Path:
    """Folder of the shipped ``.cuh`` templates: package data when installed,
    the repository's ``cuda_templates/`` in a source checkout."""
    # The checkout the imported package lives in comes first: an editable install's finder
    # would otherwise map kermac_like.cuda_templates to the installed checkout's folder even
    # when another checkout (a worktree on PYTHONPATH) was imported.
    p = Path(__file__).resolve().parents[2] / "cuda_templates"
    if (p / "common.cuh").is_file():
        return p
    try:
        spec = importlib.util.find_spec("kermac_like.cuda_templates")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            p = Path(loc)
            if (p / "common.cuh").is_file():
                return p
    raise FileNotFoundError("kermac_like: cannot find the cuda_templates folder (broken installation?)")


@functools.lru_cache(maxsize=None)
def template_hash() -> str:
    h = hashlib.sha256()
    for f in sorted(template_dir().glob("*.cuh")):
        h.update(f.name.encode())
        h.update(b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


# NVRTC's wheels (CUDA 13, CUDA 12): the library cuda.pathfinder loads first when installed.
_NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12")
# What brings the CUDA path's packages (pyproject.toml's extras, one per CUDA toolkit).
CUDA_EXTRA = "pip install 'kermac_like[cu13]' (CUDA 13) or 'kermac_like[cu12]' (CUDA 12)"


@functools.lru_cache(maxsize=None)
def require_cuda_packages() -> None:
    """cuda-core and cuda-bindings, or one ImportError naming the extra that brings them (the
    plain install has neither and runs the CPU path). Every kernel key passes here
    (:func:`nvrtc_version`, which checks NVRTC itself), so every CUDA call and precompile
    does, once per process when they are there."""
    import importlib

    missing = []
    for dist, module in (("cuda-core", "cuda.core"), ("cuda-bindings", "cuda.bindings")):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(dist)
    if missing:
        raise _missing(" and ".join(missing))


def _missing(what: str) -> ImportError:
    return ImportError(f"kermac_like: the CUDA path needs {what}, which the plain install leaves out (it runs "
                       f"CPU tensors only); install the extra of your CUDA toolkit: {CUDA_EXTRA}")


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> str:
    """NVRTC's "major.minor" (part of every kernel key): from the NVRTC wheel's metadata
    when one is installed, so that a warm start, which compiles nothing, does not load the
    library (its dlopen took 75-105 ms of a warm first call on the 2-core CI machine,
    bench/notes/jit.md); else from NVRTC itself. A compile checks the two agree. Without
    the CUDA extra's packages: an ImportError naming it (:func:`require_cuda_packages`)."""
    import importlib.metadata as md

    require_cuda_packages()
    for dist in _NVRTC_WHEELS:
        try:
            m = re.match(r"(\d+)\.(\d+)", md.version(dist))
        except md.PackageNotFoundError:
            continue
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    try:
        return loaded_nvrtc_version()
    except Exception as e:  # no NVRTC library where cuda.pathfinder looks
        raise _missing(f"NVRTC ({type(e).__name__}: {e})") from e


@functools.lru_cache(maxsize=None)
def loaded_nvrtc_version() -> str:
    """The version the loaded NVRTC library reports (loads it)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:  # older cuda-python layout
        from cuda import nvrtc  # type: ignore
    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


def arch_of_device(device) -> str:
    """``"sm_XY"`` of a CUDA device; ValueError below sm_80."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise ValueError(
            f"device: {torch.cuda.get_device_name(device)} is sm_{major}{minor}; kermac_like kernels need sm_80 or newer"
        )
    return f"sm_{major}{minor}"


def _check_arch(arch: str) -> str:
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m or int(m.group(1)) < 80:
        raise ValueError(f"arch: {arch!r} is not a supported architecture (sm_80 or newer, e.g. 'sm_80', 'sm_90')")
    return arch


def _options(arch: str) -> tuple:
    """The exact NVRTC options (as text, for the key and for error messages)."""
    base = ("-std=c++17", f"-arch={arch}", f"-I{template_dir()}", "-Xptxas=-v")
    return base + ("-lineinfo",) if config.get("lineinfo") else base  # (source lines: its own keys)


_keys: dict = {}  # (spec, arch, lineinfo, template hash, NVRTC version) -> key


def kernel_key(spec: KernelSpec, arch: str) -> str:
    memo = (spec, arch, config.get("lineinfo"), template_hash(), nvrtc_version())
    key = _keys.get(memo)
    if key is None:
        full_arch = arch + spec.arch_suffix
        h = hashlib.sha256()
        opts = " ".join(o for o in _options(full_arch) if not o.startswith("-I"))  # paths differ between machines
        for part in (__version__, memo[3], opts, full_arch, memo[4], spec.name_expression):
            h.update(part.encode())
            h.update(b"\0")
        key = _keys[memo] = h.hexdigest()
    return key


# -- compiling -----------------------------------------------------------------------
# (patterns compiled on first use, by re's own cache: a warm start compiles nothing)
_RES_ENTRY = r"Compiling entry function '([^']+)'"
_RES_ADVISORY = r"in the function '([^']+)'"
_RES_SPILL = r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"


def parse_ptxas_log(text: str) -> dict:
    """{lowered name: {"registers", "smem", "stack", "spill_stores", "spill_loads"}}, plus
    "advisories" (ptxas' messages that name the function, e.g. serialised wgmma) where any."""
    out, cur = {}, None
    for line in text.splitlines():
        m = re.search(_RES_ADVISORY, line)
        if m:  # printed before the function's "Compiling entry function" line
            out.setdefault(m.group(1), {}).setdefault("advisories", []).append(line.split(":", 1)[-1].strip())
            continue
        m = re.search(_RES_ENTRY, line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(_RES_SPILL, line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return out


def _program_options(arch: str):
    try:
        from cuda.core import ProgramOptions
    except ImportError:  # cuda-core < 0.4
        from cuda.core.experimental import ProgramOptions  # type: ignore
    return ProgramOptions(std="c++17", arch=arch, include_path=[str(template_dir())], ptxas_options=["-v"],
                          lineinfo=config.get("lineinfo"))


@functools.lru_cache(maxsize=None)
def _check_nvrtc_version() -> None:
    """Once per process, after NVRTC ran: warn when the library that ran is not the
    version the kernel keys name (a wheel installed beside another NVRTC that was loaded
    first); the cubins stay valid, but the keys then mislabel them."""
    loaded = loaded_nvrtc_version()
    if loaded != nvrtc_version():
        log.warning("NVRTC %s was loaded, but kernel keys name %s (the installed wheel's version)", loaded,
                    nvrtc_version())


def _compile_group(specs: tuple, arch: str):
    """Compile ``specs`` into one cubin. Returns (cubin, {expr: lowered}, seconds, log)."""
    try:
        from cuda.core import Program
    except ImportError:
        from cuda.core.experimental import Program  # type: ignore
    exprs = tuple(s.name_expression for s in specs)
    source = render_source(specs)
    logs = io.StringIO()
    t0 = time.perf_counter()
    try:
        prog = Program(source, code_type="c++", options=_program_options(arch))
        obj = prog.compile("cubin", name_expressions=exprs, logs=logs)
    except Exception as e:  # NVRTC errors surface as various exception types
        raise CompileError(f"NVRTC failed to compile {len(exprs)} kernel(s) for {arch}: {e}",
                           log_text=logs.getvalue() or str(e), options=_options(arch), name_expressions=exprs) from None
    seconds = time.perf_counter() - t0
    _check_nvrtc_version()
    raw = obj.symbol_mapping if hasattr(obj, "symbol_mapping") else obj._sym_map
    mapping = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in dict(raw).items()}
    missing = [e for e in exprs if e not in mapping]
    if missing:
        raise CompileError("NVRTC produced no symbol for some name expressions", log_text=logs.getvalue(),
                           options=_options(arch), name_expressions=tuple(missing))
    return bytes(obj.code), mapping, seconds, logs.getvalue()


def compile_specs(specs, arch: str, *, debug: bool = False):
    """Compile ``specs`` (all with the same ``arch_suffix``) in one program.

    Returns ``(ModuleRecord, resources)`` where resources maps each name
    expression to its ptxas report (registers, smem, spills).
    """
    specs = tuple(specs)
    suffixes = {s.arch_suffix for s in specs}
    if len(suffixes) != 1:
        raise ValueError("specs: one program compiles for one architecture variant")
    full_arch = _check_arch(arch) + suffixes.pop()
    cubin, mapping, seconds, text = _compile_group(specs, full_arch)
    res_by_lowered = parse_ptxas_log(text)
    resources = {e: res_by_lowered.get(mapping[e], {}) for e in mapping}
    for expr, res in resources.items():
        if res.get("spill_stores") or res.get("spill_loads"):
            # Some shipped builds trade a few spilled bytes for occupancy (measured faster,
            # bench/notes/history.md), so this is a record, not a warning.
            log.info("%s spills registers on %s: %s", expr, full_arch, res)
    if debug:
        log.debug("compiled %d kernel(s) for %s in %.2f s", len(specs), full_arch, seconds)
        for expr, res in resources.items():
            log.debug("  %s: %s", expr, res)
    # Looked up after NVRTC: the record's module imports SQLAlchemy on its first use (the cache
    # package loads it lazily), which the launcher imports in another thread meanwhile
    # (launcher._open_cache_in_background).
    record = kernel_cache.ModuleRecord(
        cubin=cubin,
        arch=full_arch,
        compile_seconds=seconds,
        nvrtc_version=loaded_nvrtc_version(),  # the library that built it
        options=" ".join(o for o in _options(full_arch) if not o.startswith("-I")),
        kernels=tuple((kernel_key(s, arch), s.name_expression, mapping[s.name_expression]) for s in specs),
    )
    return record, resources


def precompile_specs(specs, arch: str, *, cache=None, processes: int | None = None, group_size: int = 8,
                     debug: bool = False, progress=None, reports: dict | None = None) -> dict:
    """Compile every spec not yet in the cache, many per program, groups in
    parallel processes when there is more than one group and more than one core.

    Returns a summary: requested, compiled, already cached, seconds, programs, and the
    compiled kernels that spill registers (name expression -> spill store and load bytes).
    ``reports``, when given, receives every compiled kernel's ptxas report (name expression ->
    compile_specs' resources entry).
    """
    _check_arch(arch)
    cache = cache if cache is not None else kernel_cache.get_cache()
    specs = [s for s in dict.fromkeys(specs) if s.supports(arch)]
    keys = {kernel_key(s, arch): s for s in specs}
    present = cache.contains(list(keys))
    todo = [s for k, s in keys.items() if k not in present]
    groups = []
    for suffix in sorted({s.arch_suffix for s in todo}):
        same = [s for s in todo if s.arch_suffix == suffix]
        groups += [tuple(same[i : i + group_size]) for i in range(0, len(same), group_size)]
    t0 = time.perf_counter()
    if processes is None:
        processes = min(len(groups), os.cpu_count() or 1)
    processes = max(1, processes)
    done = 0
    spills = {}  # name expression -> (spill store bytes, spill load bytes), for the kernels that spill

    def record_built(record, resources):
        nonlocal done
        cache.put(record)
        done += len(record.kernels)
        if reports is not None:
            reports.update(resources)
        for expr, res in resources.items():
            if res.get("spill_stores") or res.get("spill_loads"):
                spills[expr] = (res.get("spill_stores", 0), res.get("spill_loads", 0))
        if progress:
            progress(done, len(todo))

    if processes > 1 and len(groups) > 1:
        ctx = multiprocessing.get_context("spawn")
        with cf.ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as ex:
            for record, resources in ex.map(compile_specs, groups, [arch] * len(groups)):
                record_built(record, resources)
    else:
        for g in groups:
            record_built(*compile_specs(g, arch, debug=debug))
    seconds = time.perf_counter() - t0
    summary = dict(
        arch=arch, requested=len(specs), cached=len(present), compiled=len(todo),
        programs=len(groups), processes=processes if len(groups) > 1 else min(1, len(groups)), seconds=seconds,
        spills=dict(sorted(spills.items())),
    )
    if debug:
        log.debug("precompile %s", summary)
    return summary
