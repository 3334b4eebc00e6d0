"""The shipped set compiled once per architecture per test session (no GPU needed): conftest's
session fixture ``shipped``. Each architecture is built into its own cache dir by a background
process (``python tests/shipped_build.py ARCH DIR``, niced, started when the session starts), so
the build overlaps the tests that do not need it; conftest runs the tests that do last.
tests/test_compile.py checks that build (counts, spills, a second precompile compiles nothing);
the SASS and ptxas-report tests read their shipped kernels from it instead of compiling them again.
The dirs are only read after the build: a test that needs kernels outside the shipped set
compiles them itself (``ShippedBuild.kernels`` does). Under pytest-xdist the workers share the
dirs: the first build of an architecture is the one all of them read (a file lock).

The kernels the install prebuilt (kermac_like/prebuilt/, the first calls' kernels: _build/kermac_build.py)
are not compiled again: the build takes them, with the ptxas reports the install kept beside them, from
that bundle where its keys are the ones this package computes (the same templates, options and NVRTC),
and compiles the rest; its summary counts them as cached and says how many in ``from_bundle``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = "build.json"  # the precompile summary and the ptxas reports, written last


@contextlib.contextmanager
def exclusive(path):
    """An exclusive lock on the file ``path`` for the with-block: pytest-xdist workers (and the
    build processes) sharing a directory take turns."""
    import fcntl

    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def up_front_turn(block: bool = True):
    """The turn at the GPU modules' up-front compile (conftest's session fixture, the modules' own fixtures) of
    pytest-xdist workers that share a kernel cache dir: yields True while this process holds it. ``block``
    False: yields False at once when another worker holds it (conftest's fixture: one worker compiles every
    module's kernels while the others start on their tests; a module's fixture waits for its turn and then
    finds its kernels cached). Outside xdist, or with no cache dir set: yields True."""
    import fcntl

    cache_dir = os.environ.get("KERMAC_LIKE_CACHE_DIR")
    if not cache_dir or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield True
        return
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, ".test-up-front.lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


class ShippedBuild:
    def __init__(self, base: Path):
        self.base = Path(base)
        self._procs = {}  # arch -> (background process, its stderr file)
        self._builds = {}  # arch -> (cache dir, summary, {name expression: ptxas report})
        self._sass = {}  # (module sha256, dump function) -> SASS text

    def start(self, arch: str) -> None:
        """Start the background build of ``arch`` (a no-op once started)."""
        if arch in self._procs or arch in self._builds:
            return
        d = self.base / arch
        d.mkdir(parents=True, exist_ok=True)
        import kermac_like

        env = dict(os.environ)
        env.pop("KERMAC_LIKE_CACHE_DIR", None)  # the script passes its cache explicitly
        pkg_root = str(Path(kermac_like.__file__).resolve().parents[1])  # the kermac_like under test
        env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
        err = open(d / f"stderr-{os.getpid()}.txt", "w")
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), arch, str(d)], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=lambda: os.nice(10))
        self._procs[arch] = (proc, err)

    def build(self, arch: str):
        """(cache dir, precompile summary, ptxas reports) of the shipped set for ``arch``; waits
        for the background build."""
        if arch not in self._builds:
            self.start(arch)
            proc, err = self._procs.pop(arch)
            rc = proc.wait()
            err.close()
            d = self.base / arch
            if rc != 0:
                raise RuntimeError(f"the shipped build for {arch} failed ({rc}):\n"
                                   + Path(err.name).read_text()[-8000:])
            data = json.loads((d / RESULT).read_text())
            self._builds[arch] = (d / "cache", data["summary"], data["reports"])
        return self._builds[arch]

    def stop(self) -> None:
        """End the background builds nobody waited for (the session ends)."""
        for proc, err in self._procs.values():
            proc.kill()
            proc.wait()
            err.close()
        self._procs.clear()

    def kernels(self, specs, arch: str) -> dict:
        """{spec: (cubin of its module, lowered name, ptxas report)}: the shipped specs from the session's
        build, the others compiled here in one program per arch suffix (arch: the base architecture)."""
        from kermac_like.runtime.cache import KernelCache
        from kermac_like.runtime.compiler import compile_specs, kernel_key

        d, _, reports = self.build(arch)
        specs = list(dict.fromkeys(specs))
        out, rest = {}, []
        with KernelCache(d) as cache:
            found = cache.get_many([kernel_key(s, arch) for s in specs])
        for s in specs:
            k = found.get(kernel_key(s, arch))
            if k is None:
                rest.append(s)
            else:
                out[s] = (k.cubin, k.lowered_name, reports[s.name_expression])
        for suffix in sorted({s.arch_suffix for s in rest}):
            group = [s for s in rest if s.arch_suffix == suffix]
            record, resources = compile_specs(group, arch)
            lowered = {e: lo for _, e, lo in record.kernels}
            for s in group:
                out[s] = (record.cubin, lowered[s.name_expression], resources[s.name_expression])
        return out

    def sass(self, cubin: bytes, dump) -> str:
        """``dump(cubin)`` (a test's cuobjdump wrapper), once per module and wrapper."""
        key = (hashlib.sha256(cubin).hexdigest(), dump.__module__, dump.__qualname__)
        if key not in self._sass:
            self._sass[key] = dump(cubin)
        return self._sass[key]


def seed_from_bundle(cache, specs, arch: str) -> dict:
    """Put the kernels of ``specs`` that the package's bundle holds for ``arch`` (with their ptxas
    reports) into ``cache``; returns {name expression: ptxas report} of those put."""
    import sqlite3

    from kermac_like.runtime.cache import warm
    from kermac_like.runtime.cache.schema import ModuleRecord
    from kermac_like.runtime.compiler import kernel_key
    from kermac_like.runtime.precompile import REPORTS_FILENAME

    folder = warm.package_bundle_dir()
    db, report_file = folder / warm.DB_FILENAME, folder / REPORTS_FILENAME
    if not db.is_file() or not report_file.is_file():
        return {}
    try:
        known = json.loads(report_file.read_text()).get(arch, {})
        conn = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
        try:
            rows = conn.execute(
                "SELECT k.key, k.name_expression, k.lowered_name, m.module_sha256, m.cubin, m.compile_seconds, "
                "m.nvrtc_version, m.options, k.arch FROM kernels AS k JOIN modules AS m ON m.module_sha256 = k.module_sha256 "
                "WHERE k.arch IN (?, ?)", (arch, arch + "a")).fetchall()
        finally:
            conn.close()
    except (OSError, ValueError, sqlite3.Error):
        return {}
    wanted = {kernel_key(s, arch): s.name_expression for s in specs if s.supports(arch)}
    modules, seeded = {}, {}
    arch_of = {row[0]: row[-1] for row in rows}
    for key, expr, lowered, sha, cubin, seconds, nvrtc, options, _ in rows:
        if wanted.get(key) == expr and expr in known:
            modules.setdefault(sha, (bytes(cubin), seconds, nvrtc, options, []))[4].append((key, expr, lowered))
            seeded[expr] = known[expr]
    for cubin, seconds, nvrtc, options, kernels in modules.values():
        cache.put(ModuleRecord(cubin=cubin, arch=arch_of[kernels[0][0]], compile_seconds=seconds, nvrtc_version=nvrtc, options=options,
                               kernels=tuple(kernels)))
    return seeded


def canonical_programs(specs, arch: str, group_size: int = 8) -> list:
    """The NVRTC programs of the shipped set as precompile_specs makes them with nothing cached:
    per arch suffix, runs of ``group_size`` kernels in shipped order. A kernel's registers and
    spills can depend on the other kernels of its program (a few bytes, notes/jit.md), so the
    build keeps these programs whatever the install's bundle already holds: a program loses the
    bundle's kernels and keeps its other members, never gains others."""
    specs = [s for s in dict.fromkeys(specs) if s.supports(arch)]
    out = []
    for suffix in sorted({s.arch_suffix for s in specs}):
        same = [s for s in specs if s.arch_suffix == suffix]
        out += [tuple(same[i:i + group_size]) for i in range(0, len(same), group_size)]
    return out


def compile_programs(programs, arch: str, cache, reports: dict, processes: int = 2) -> dict:
    """Compile each program's kernels that ``cache`` lacks (one program each, ``processes`` at a
    time, in threads of this process: NVRTC runs without the GIL, as in the install's build, so no
    spawned worker imports torch and the package again) into ``cache``; precompile_specs' summary, the
    ptxas reports added to ``reports``."""
    import concurrent.futures as cf
    import time

    from kermac_like.runtime.compiler import compile_specs, kernel_key

    t0 = time.perf_counter()
    keys = {s: kernel_key(s, arch) for g in programs for s in g}
    present = cache.contains(list(keys.values()))
    todo = [tuple(s for s in g if keys[s] not in present) for g in programs]
    todo = [g for g in todo if g]
    spills = {}
    with cf.ThreadPoolExecutor(max_workers=max(1, min(processes, len(todo)))) as ex:
        for record, resources in ex.map(lambda g: compile_specs(g, arch), todo):
            cache.put(record)
            reports.update(resources)
            for expr, res in resources.items():
                if res.get("spill_stores") or res.get("spill_loads"):
                    spills[expr] = (res.get("spill_stores", 0), res.get("spill_loads", 0))
    n = len(keys)
    compiled = sum(len(g) for g in todo)
    return dict(arch=arch, requested=n, cached=n - compiled, compiled=compiled, programs=len(todo),
                processes=min(processes, len(todo)), seconds=time.perf_counter() - t0, spills=dict(sorted(spills.items())))


def _main(arch: str, d: str) -> int:
    """Build the shipped set for ``arch`` into ``d``/cache and write ``d``/build.json, unless a
    process before this one did (pytest-xdist workers share ``d``)."""
    from kermac_like.runtime.cache import KernelCache
    from kermac_like.runtime.specs import shipped_specs

    d = Path(d)
    with exclusive(d / "lock"):
        if (d / RESULT).exists():
            return 0
        specs = shipped_specs()
        with KernelCache(d / "cache") as cache:
            reports = seed_from_bundle(cache, specs, arch)
            summary = compile_programs(canonical_programs(specs, arch), arch, cache, reports)
        summary["from_bundle"] = summary["cached"]
        for expr, res in reports.items():  # the bundle's kernels' spills too
            if res.get("spill_stores") or res.get("spill_loads"):
                summary["spills"].setdefault(expr, (res.get("spill_stores", 0), res.get("spill_loads", 0)))
        tmp = d / (RESULT + ".tmp")
        tmp.write_text(json.dumps({"summary": summary, "reports": reports}))
        tmp.replace(d / RESULT)
    return 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:3]))
