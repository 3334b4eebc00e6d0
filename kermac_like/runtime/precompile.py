"""Bulk compilation of kernels ahead of their first call."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from .. import _debug
from .._args import check_device
from ..descriptor import KernelDescriptor
from ..layout import Layout
from . import cache as kernel_cache, compiler
from .cache import DB_FILENAME, warm
from .specs import (distance_spec, distance_tunings, mma_specs_for, wgmma_prepare_needs, wgmma_prepare_spec,
                    wgmma_traits_spec)
from .specs.matvec import C_BUCKETS
from .specs.matvec_wgmma import carry_spec, matvec_wgmma_spec

__all__ = ["precompile", "specs_for_descriptor", "write_bundle", "first_call_specs", "FIRST_CALLS_FILE"]

# The kernels of the first calls that the install prebuilds (bench/run.py's cold_compile rows on sm_80 and
# sm_90): KernelSpecs as JSON, written by `python3 tests/first_calls.py --write` from what the planners ask
# for, checked against them by tests/test_bundle.py.
FIRST_CALLS_FILE = Path(__file__).resolve().with_name("first_calls.json")
REPORTS_FILENAME = "reports.json"  # beside a bundle: the ptxas report of each kernel it compiled


def specs_for_descriptor(desc: KernelDescriptor) -> list:
    """Every instantiation a call with ``desc`` can reach for row/column-major
    inputs and a row-major output (a column-major ``out`` compiles on demand)."""
    specs = list(dict.fromkeys(
        distance_spec(desc, a, b, Layout.ROW_MAJOR, vec, tuning=tuning)
        for tuning in distance_tunings(desc)
        for a, b in itertools.product(Layout, Layout)
        for vec in (4, 1)
    ))
    specs += mma_specs_for(desc)
    if desc.is_euclidean:  # compiled for sm_90 only (KernelSpec.supports)
        for t in (False, True):
            specs.append(wgmma_traits_spec(desc, Layout.ROW_MAJOR, tf32=t))
            small, norms = wgmma_prepare_needs(desc, tf32=t)
            specs.append(wgmma_prepare_spec(small=small, norms=norms))
        # kernel_matvec with K > 32 (float32, 3xTF32): every column bucket, and the carry
        # between ranges of N
        specs += [matvec_wgmma_spec(desc, kc) for kc in C_BUCKETS] + [carry_spec()]
    specs = list(dict.fromkeys(specs))
    return specs


def precompile(descriptors, device=None, *, arch: str | None = None, processes: int | None = None,
               debug: bool = False) -> dict:
    """Compile (or find in the cache) every kernel the given descriptors need.

    ``descriptors``: one KernelDescriptor or an iterable of them.  The target is
    ``arch`` (e.g. ``"sm_90"``, no GPU needed) or else the architecture of
    ``device`` (default: the current CUDA device).  Many kernels go into one
    NVRTC program, and programs compile in parallel processes.  Returns a summary
    dict (requested, cached, compiled, seconds, ...). Needs NVRTC (the ``cu13`` or ``cu12``
    extra), not a GPU; the example compiles, which takes a while, so it is not run as a test.

    >>> import kermac_like as km
    >>> summary = km.precompile([km.preset("l1"), km.preset("laplace_l2")], arch="sm_90")  # doctest: +SKIP
    >>> summary["requested"] == summary["cached"] + summary["compiled"]                   # doctest: +SKIP
    True
    """
    debug = _debug.resolve(debug)
    if isinstance(descriptors, KernelDescriptor):
        descriptors = [descriptors]
    descriptors = list(descriptors)
    for i, d in enumerate(descriptors):
        if not isinstance(d, KernelDescriptor):
            raise TypeError(f"descriptors[{i}]: expected a KernelDescriptor, got {type(d).__name__}")
    if arch is None:
        import torch

        try:
            dev = check_device("device", "cuda" if device is None else device)
        except ValueError as e:
            raise ValueError(f"{e}; pass arch='sm_80' (or newer) to compile without a GPU") from None
        if dev.type != "cuda":
            raise ValueError(f"device: {str(dev)!r} is not a CUDA device; pass a CUDA device, or arch='sm_80' (or "
                             "newer) to compile without a GPU")
        dev = torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev
        arch = compiler.arch_of_device(dev)
    specs = [s for d in descriptors for s in specs_for_descriptor(d)]
    return compiler.precompile_specs(specs, arch, processes=processes, debug=debug)


def write_bundle(specs, arch: str, directory=None, *, processes: int | None = None, debug: bool = False,
                 progress=None) -> dict:
    """Compile ``specs`` for ``arch`` into a bundle of prebuilt kernels: a kernel-cache file
    in ``directory`` (default: ``kermac_like/prebuilt/`` beside the package, which a wheel
    built afterwards ships) that the launcher reads, read-only, after a miss in the user's
    cache and before compiling (runtime/cache/warm.py ``read_bundled``). Entries already
    there are kept (one bundle may hold several architectures). The file is left in
    rollback-journal mode, world-readable and owner-writable only, so that it can be read
    from a read-only folder. The ptxas report of each kernel compiled goes into
    ``reports.json`` beside it (arch -> name expression -> report: the test suite's shipped build
    takes the bundle's kernels with their reports instead of compiling them again; not package
    data). Returns precompile_specs' summary with the bundle's path."""
    import os
    import sqlite3
    from pathlib import Path

    directory = Path(directory) if directory is not None else warm.package_bundle_dir()
    cache = kernel_cache.KernelCache(directory, max_bytes=1 << 40)  # a bundle is never evicted from
    if cache.in_memory:
        raise OSError(f"bundle: cannot write a kernel file in {directory}")
    reports: dict = {}
    try:
        summary = compiler.precompile_specs(specs, arch, cache=cache, processes=processes, debug=debug,
                                            progress=progress, reports=reports)
    finally:
        cache.close()
    report_file = directory / REPORTS_FILENAME
    try:
        known = json.loads(report_file.read_text())
    except (OSError, ValueError):
        known = {}
    known.setdefault(arch, {}).update(reports)
    report_file.write_text(json.dumps(known))
    os.chmod(report_file, 0o644)
    path = directory / DB_FILENAME
    conn = sqlite3.connect(str(path))
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
        conn.execute("VACUUM")
    finally:
        conn.close()
    for extra in (directory / (DB_FILENAME + ".lock"), Path(f"{path}-wal"), Path(f"{path}-shm")):
        extra.unlink(missing_ok=True)
    os.chmod(directory, 0o755)
    os.chmod(path, 0o644)
    warm._bundle_files.cache_clear()
    summary["bundle"] = str(path)
    return summary


def _spec_from_json(d: dict):
    from .specs import KernelSpec, LaunchShape

    return KernelSpec(header=d["header"], kernel=d["kernel"], traits=d["traits"], launch=LaunchShape(**d["launch"]),
                      arch_suffix=d.get("arch_suffix", ""))


def first_call_specs(arch: str) -> list:
    """The kernels the first calls of bench/run.py's cold_compile rows launch on ``arch`` (sm_80 or
    sm_90; none for another arch): what the install prebuilds into ``kermac_like/prebuilt/``
    (setup.py), so that those calls compile nothing."""
    data = json.loads(FIRST_CALLS_FILE.read_text())
    return [_spec_from_json(d) for d in data["archs"].get(arch, [])]


def write_first_call_list(planned: dict) -> str:
    """Write ``{arch: [KernelSpec, ...]}`` as :data:`FIRST_CALLS_FILE`; returns its path."""
    import dataclasses

    data = {"about": "the kernels of bench/run.py's cold_compile calls per arch; python3 tests/first_calls.py --write",
            "archs": {arch: [dataclasses.asdict(s) for s in specs] for arch, specs in planned.items()}}
    FIRST_CALLS_FILE.write_text(json.dumps(data, indent=1) + "\n")
    return str(FIRST_CALLS_FILE)
