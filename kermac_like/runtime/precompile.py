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
from .specs import (KernelSpec, LaunchShape, distance_spec, distance_tunings, mma_specs_for, wgmma_prepare_needs,
                    wgmma_prepare_spec, wgmma_specs_for)
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
        specs += wgmma_specs_for(desc)
        for t in (False, True):
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


def write_bundle(specs, arch, directory=None, *, processes: int | None = None, debug: bool = False,
                 progress=None, threads: int | None = None) -> dict:
    """Compile ``specs`` for ``arch`` into a bundle of prebuilt kernels: a kernel-cache file
    in ``directory`` (default: ``kermac_like/prebuilt/`` beside the package, which a wheel
    built afterwards ships) that the launcher reads, read-only, after a miss in the user's
    cache and before compiling (runtime/cache/warm.py ``read_bundled``). Entries already
    there are kept (one bundle may hold several architectures). The file is left in
    rollback-journal mode, world-readable and owner-writable only, so that it can be read
    from a read-only folder. The ptxas report of each kernel compiled goes into
    ``reports.json`` beside it (arch -> name expression -> report: the test suite's shipped build
    takes the bundle's kernels with their reports instead of compiling them again; not package
    data). Returns precompile_specs' summary with the bundle's path.

    ``arch`` may be a list of architectures, ``specs`` then a function of the arch (the
    install's build: runtime/first_calls.json for sm_80 and sm_90), or ``threads`` given: the
    programs of all of them then compile in this process's threads, ``threads`` at a time
    (default: the cores; NVRTC runs without the GIL), instead of parallel processes that each
    import the package first; the summary is then a list, one per arch."""
    import os
    import sqlite3

    directory = Path(directory) if directory is not None else warm.package_bundle_dir()
    cache = kernel_cache.KernelCache(directory, max_bytes=1 << 40)  # a bundle is never evicted from
    if cache.in_memory:
        raise OSError(f"bundle: cannot write a kernel file in {directory}")
    reports: dict = {}
    threaded = threads is not None or not isinstance(arch, str)
    try:
        if not threaded:
            summary = compiler.precompile_specs(specs, arch, cache=cache, processes=processes, debug=debug,
                                                progress=progress, reports=reports.setdefault(arch, {}))
        else:
            archs = [arch] if isinstance(arch, str) else list(arch)
            summary = _compile_threaded({a: list(specs(a) if callable(specs) else specs) for a in archs}, cache,
                                        threads, reports, debug=debug, progress=progress)
    finally:
        cache.close()
    report_file = directory / REPORTS_FILENAME
    try:
        known = json.loads(report_file.read_text())
    except (OSError, ValueError):
        known = {}
    for a, got in reports.items():
        known.setdefault(a, {}).update(got)
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
    for one in summary if isinstance(summary, list) else [summary]:
        one["bundle"] = str(path)
    return summary


def _compile_threaded(specs_by_arch: dict, cache, threads: int | None, reports: dict, *, debug: bool = False,
                      progress=None, group_size: int = 4) -> list:
    """precompile_specs for several architectures at once, the programs (``group_size`` kernels
    each) in threads of this process; fills ``reports`` (arch -> name expression -> ptxas report)."""
    import concurrent.futures as cf
    import os
    import time

    t0 = time.perf_counter()
    groups, per_arch = [], {}
    for arch, specs in specs_by_arch.items():
        specs = [s for s in dict.fromkeys(specs) if s.supports(arch)]
        keys = {compiler.kernel_key(s, arch): s for s in specs}
        present = cache.contains(list(keys))
        todo = [s for k, s in keys.items() if k not in present]
        per_arch[arch] = dict(arch=arch, requested=len(specs), cached=len(present), compiled=len(todo), programs=0,
                              processes=1, seconds=0.0, spills={})
        reports.setdefault(arch, {})
        for suffix in sorted({s.arch_suffix for s in todo}):
            same = [s for s in todo if s.arch_suffix == suffix]
            for i in range(0, len(same), group_size):
                groups.append((arch, tuple(same[i:i + group_size])))
                per_arch[arch]["programs"] += 1
    # the largest programs first (wgmma builds are the slowest), so the last thread to finish is short
    groups.sort(key=lambda g: (-sum(2 if s.arch_suffix else 1 for s in g[1]), g[0]))
    workers = max(1, min(len(groups), threads or os.cpu_count() or 1))
    done, total = 0, sum(len(g) for _, g in groups)
    with cf.ThreadPoolExecutor(max_workers=workers) as ex:
        futures = {ex.submit(compiler.compile_specs, g, arch, debug=debug): arch for arch, g in groups}
        for fut in cf.as_completed(futures):
            arch = futures[fut]
            record, resources = fut.result()
            cache.put(record)
            reports[arch].update(resources)
            for expr, res in resources.items():
                if res.get("spill_stores") or res.get("spill_loads"):
                    per_arch[arch]["spills"][expr] = (res.get("spill_stores", 0), res.get("spill_loads", 0))
            done += len(record.kernels)
            if progress:
                progress(done, total)
    seconds = time.perf_counter() - t0
    for one in per_arch.values():
        one.update(processes=workers if one["programs"] else 0, seconds=seconds,
                   spills=dict(sorted(one["spills"].items())))
    return list(per_arch.values())


def _spec_from_json(d: dict):
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
