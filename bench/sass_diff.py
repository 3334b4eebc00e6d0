"""SASS of every shipped instantiation, to show that a change left the kernels alone.

    python3 bench/sass_diff.py snapshot --arch sm_80 --out /tmp/before   # no GPU needed
    python3 bench/sass_diff.py compare /tmp/before/sm_80.json /tmp/after/sm_80.json

``snapshot`` compiles ``shipped_specs()`` for one architecture with the package's own
compiler (the groups of ``precompile --all``, in parallel processes) and stores, per name
expression, the SASS of its function as ``cuobjdump -sass`` prints it. ``compare`` reports
kernels that appear on one side only and kernels whose SASS differs (exit status 1 then).
It runs against whichever layout of the package is on ``sys.path``, so a snapshot of the
old code and one of the new compare directly.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _package():
    """(shipped_specs, compile_specs) of the layout on sys.path."""
    try:
        from kermac_like.runtime.compiler import compile_specs
        from kermac_like.runtime.specs import shipped_specs
    except ImportError:  # the layout before kermac_like/runtime existed
        from kermac_like.compiler import compile_specs
        from kermac_like.render import shipped_specs
    return shipped_specs, compile_specs


def _cuobjdump() -> str:
    exe = shutil.which("cuobjdump")
    if exe:
        return exe
    import nvidia

    for root in nvidia.__path__:
        for p in Path(root).glob("*/bin/cuobjdump"):
            return str(p)
    raise FileNotFoundError("cuobjdump: install nvidia-cuda-cuobjdump (the [test] extra)")


_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")


def sass_by_function(cubin: bytes) -> dict:
    """{lowered name: SASS text} of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    out, cur = {}, None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            cur = m.group(1)
            out[cur] = []
            continue
        if cur is not None:
            out[cur].append(line.rstrip())
    return {k: "\n".join(v).strip() for k, v in out.items()}


def _compile_group(args):
    specs, arch = args
    _, compile_specs = _package()
    record, _ = compile_specs(specs, arch)
    sass = sass_by_function(record.cubin)
    return {expr: sass[lowered] for _key, expr, lowered in record.kernels}


def snapshot(arch: str, jobs: int) -> dict:
    shipped_specs, _ = _package()
    specs = [s for s in shipped_specs() if s.supports(arch)]
    groups = []
    for suffix in sorted({s.arch_suffix for s in specs}):
        same = [s for s in specs if s.arch_suffix == suffix]
        groups += [tuple(same[i : i + 8]) for i in range(0, len(same), 8)]
    result = {}
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as ex:
        for part in ex.map(_compile_group, [(g, arch) for g in groups]):
            result.update(part)
    return dict(sorted(result.items()))


def compare(a: dict, b: dict) -> int:
    only_a = sorted(set(a) - set(b))
    only_b = sorted(set(b) - set(a))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    for k in only_a:
        print(f"only in the first:  {k}")
    for k in only_b:
        print(f"only in the second: {k}")
    for k in differ:
        print(f"SASS differs:       {k}")
    same = len(set(a) & set(b)) - len(differ)
    print(f"{same} kernels identical, {len(differ)} differ, {len(only_a)} + {len(only_b)} on one side only")
    return 1 if (only_a or only_b or differ) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("--arch", required=True, action="append", help="sm_80, sm_90 (repeatable)")
    s.add_argument("--out", required=True, type=Path)
    s.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    c = sub.add_parser("compare")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "snapshot":
        args.out.mkdir(parents=True, exist_ok=True)
        for arch in args.arch:
            data = snapshot(arch, args.jobs)
            (args.out / f"{arch}.json").write_text(json.dumps(data, indent=0))
            print(f"{arch}: {len(data)} kernels -> {args.out / (arch + '.json')}")
        return 0
    return compare(json.loads(args.first.read_text()), json.loads(args.second.read_text()))


if __name__ == "__main__":
    sys.exit(main())
