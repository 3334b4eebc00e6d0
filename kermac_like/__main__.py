"""Command line: ``python -m kermac_like cache info|clear|precompile`` (and ``precompile`` alone).

    python -m kermac_like cache info
    python -m kermac_like cache clear
    python -m kermac_like precompile --arch sm_80 --all          # no GPU needed
    python -m kermac_like precompile --preset laplace_l2 --preset l1   # for the current GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _cmd_info(args) -> int:
    from .runtime.cache import get_cache
    from .runtime.compiler import nvrtc_version, template_dir, template_hash

    info = dict(get_cache().info())
    info["templates"] = str(template_dir())
    info["template_hash"] = template_hash()
    try:
        info["nvrtc"] = nvrtc_version()
    except Exception as e:  # NVRTC missing is worth reporting, not crashing on
        info["nvrtc"] = f"unavailable: {e}"
    print(json.dumps(info, indent=2, default=str))
    return 0


def _cmd_clear(args) -> int:
    from .runtime.cache import get_cache

    n = get_cache().clear()
    print(f"removed {n} kernel(s) from {get_cache().path or 'the in-memory cache'}")
    return 0


def _cmd_precompile(args) -> int:
    from . import _debug
    from .descriptor import preset
    from .runtime.compiler import precompile_specs
    from .runtime.precompile import specs_for_descriptor
    from .runtime.specs import shipped_specs

    debug = _debug.resolve(args.debug)
    if args.all:
        specs = shipped_specs(args.family or None)
    elif args.preset:
        specs = [s for name in args.preset for s in specs_for_descriptor(preset(name))]
    else:
        print("precompile: give --all or at least one --preset NAME", file=sys.stderr)
        return 2
    arch = args.arch
    if arch is None:
        import torch

        from .runtime.compiler import arch_of_device

        if not torch.cuda.is_available():
            print("precompile: no CUDA device here; pass --arch (e.g. --arch sm_80)", file=sys.stderr)
            return 2
        arch = arch_of_device(torch.device("cuda", torch.cuda.current_device()))
    t0 = time.perf_counter()

    def progress(done, total):
        if sys.stderr.isatty():
            print(f"\r  compiled {done}/{total}", end="", file=sys.stderr, flush=True)

    summary = precompile_specs(specs, arch, processes=args.jobs, debug=debug, progress=progress)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary["wall_seconds"] = round(time.perf_counter() - t0, 3)
    summary["seconds"] = round(summary["seconds"], 3)
    print(json.dumps(summary))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kermac_like", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add_precompile(p):
        p.add_argument("--arch", help="target such as sm_80 or sm_90 (default: the current GPU's)")
        p.add_argument("--all", action="store_true", help="every shipped template instantiation")
        p.add_argument("--family", action="append", help="with --all: only this kernel family (repeatable)")
        p.add_argument("--preset", action="append", help="descriptor preset name (repeatable)")
        p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile processes (default: cores)")
        p.add_argument("-d", "--debug", action="store_true", help="log compile times and resource usage")
        p.set_defaults(func=_cmd_precompile)

    cache = sub.add_parser("cache", help="inspect or manage the persistent kernel cache")
    csub = cache.add_subparsers(dest="cache_cmd", required=True)
    csub.add_parser("info", help="where the cache is and what it holds").set_defaults(func=_cmd_info)
    csub.add_parser("clear", help="remove every cached kernel").set_defaults(func=_cmd_clear)
    add_precompile(csub.add_parser("precompile", help="compile kernels into the cache"))
    add_precompile(sub.add_parser("precompile", help="compile kernels into the cache"))
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
