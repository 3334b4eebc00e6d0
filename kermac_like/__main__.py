"""Command line: ``python -m kermac_like cache info|clear|precompile`` (and ``precompile`` alone), ``tune``, ``config``.

    python -m kermac_like tune --preset laplace_l2 -K 3 -K 37 -M 20000 -N 20000   # time, store winners
    python -m kermac_like tune --list                                            # stored winners
    python -m kermac_like cache info
    python -m kermac_like cache clear
    python -m kermac_like precompile --arch sm_80 --all          # no GPU needed
    python -m kermac_like precompile --preset laplace_l2 --preset l1   # for the current GPU
    python -m kermac_like precompile --all --arch sm_90 --bundle   # prebuilt kernels: kermac_like/prebuilt/
    python -m kermac_like precompile --first-calls --arch sm_80 --arch sm_90 --bundle   # what the install builds
    python -m kermac_like config                                 # the effective settings
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from . import _debug
from .config import describe
from .descriptor import PRESETS, preset
from .ops.distance import run_kernel
from .plan import autotune as tuning
from .runtime.cache import get_cache
from .runtime import compiler
from .runtime.precompile import first_call_specs, specs_for_descriptor, write_bundle
from .runtime.specs import FAMILIES, shipped_specs


def _cmd_info(args) -> int:
    info = dict(get_cache().info())
    info["templates"] = str(compiler.template_dir())
    info["template_hash"] = compiler.template_hash()
    try:
        info["nvrtc"] = compiler.nvrtc_version()
    except Exception as e:  # NVRTC missing is worth reporting, not crashing on
        info["nvrtc"] = f"unavailable: {e}"
    print(json.dumps(info, indent=2, default=str))
    return 0


def _cmd_clear(args) -> int:
    n = get_cache().clear()
    print(f"removed {n} kernel(s) from {get_cache().path or 'the in-memory cache'}")
    return 0


def _cmd_precompile(args) -> int:
    debug = _debug.resolve(args.debug)
    if args.all:
        chosen = lambda arch: shipped_specs(args.family or None)  # noqa: E731
    elif args.first_calls:
        chosen = first_call_specs
    elif args.preset:
        chosen = lambda arch: [s for name in args.preset for s in specs_for_descriptor(preset(name))]  # noqa: E731
    else:
        raise UsageError("give --all, --first-calls or at least one --preset NAME")
    archs = list(dict.fromkeys(args.arch or ()))
    if not archs:
        if not torch.cuda.is_available():
            why = "no CUDA device is visible" if torch.backends.cuda.is_built() else "this torch has no CUDA"
            raise UsageError(f"--arch: not given, and there is no GPU to take it from ({why}); pass e.g. --arch sm_80")
        archs = [compiler.arch_of_device(torch.device("cuda", torch.cuda.current_device()))]
    counter = sys.stderr.isatty() and not debug  # the debug log has a line per compile instead

    def progress(done, total):
        if counter:
            print(f"\r  compiled {done}/{total}", end="", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    if args.bundle is not None and len(archs) > 1:
        # one process for all: the programs of every arch in threads (no worker process imports)
        summaries = write_bundle(chosen, archs, args.bundle or None, threads=args.jobs, debug=debug,
                                 progress=progress)
        if counter:
            print(file=sys.stderr)
    else:
        summaries = []
        for arch in archs:
            specs = chosen(arch)
            if args.bundle is not None:
                        summaries.append(write_bundle(specs, arch, args.bundle or None, processes=args.jobs, debug=debug,
                                              progress=progress))
            else:
                summaries.append(compiler.precompile_specs(specs, arch, processes=args.jobs, debug=debug, progress=progress))
            if counter:
                print(file=sys.stderr)
    for summary in summaries:
        summary["wall_seconds"] = round(time.perf_counter() - t0, 3)
        summary["seconds"] = round(summary["seconds"], 3)
        print(json.dumps(summary) if args.json else precompile_text(summary), flush=True)
    return 0


SPILLS_SHOWN = 5  # spilling kernels the text summary names (--json lists every one)


def precompile_text(summary: dict) -> str:
    """precompile's summary for a person: counts, seconds, the bundle, the kernels that spill."""
    s = summary
    lines = [f"{s['arch']}: {s['requested']} kernel(s) requested, {s['cached']} already cached, {s['compiled']} "
             f"compiled ({s['programs']} NVRTC program(s) in {s['processes']} process(es)) in {s['seconds']:.1f} s"
             f" ({s.get('wall_seconds', s['seconds']):.1f} s in all)"]
    if s.get("bundle"):
        lines.append(f"bundle: {s['bundle']}")
    spills = s.get("spills") or {}
    if spills:
        lines.append(f"{len(spills)} compiled kernel(s) spill registers (bytes stored / loaded):")
        for expr, (stores, loads) in list(spills.items())[:SPILLS_SHOWN]:
            lines.append(f"  {stores} / {loads}  {expr}")
        if len(spills) > SPILLS_SHOWN:
            lines.append(f"  and {len(spills) - SPILLS_SHOWN} more (--json lists them all)")
    return "\n".join(lines)


def _cmd_tune(args) -> int:
    if args.list:
        rows = get_cache().tuning_rows()
        print(json.dumps([dict(key=k, choice=c, timings=json.loads(t), device=d) for k, c, t, d in rows], indent=2))
        return 0
    if not torch.cuda.is_available():
        print("tune: no CUDA device here (the autotuner times kernels on the GPU)", file=sys.stderr)
        return 2
    names = args.preset or ["l1", "l2", "laplace_l2", "gaussian_l2"]
    dev = torch.device("cuda", torch.cuda.current_device())
    batch = tuple(args.batch or ())
    report = []
    for name in names:
        desc = preset(name)
        for K in args.K or [1, 3, 8, 16, 32, 64, 128, 256]:
            a = torch.randn(*batch, args.M, K, device=dev)
            b = torch.randn(*batch, args.N, K, device=dev)
            kw = {}
            if desc.needs_inner_p or desc.needs_outer_p:
                kw["p"] = args.p
            if desc.needs_bandwidth:
                kw["bandwidth"] = (2.0 * K) ** 0.5
            tuning.forget()
            out = torch.empty(*batch, args.M, args.N, device=dev)
            if args.col_out:
                out = out.transpose(-1, -2).contiguous().transpose(-1, -2)
            run_kernel(desc, a, b, out=out, autotune=True, debug=args.debug, **kw)
            torch.cuda.synchronize(dev)
            call_key = [r for r in get_cache().tuning_rows() if r[0].startswith(repr(desc) + "|")]
            report += [dict(preset=name, K=K, key=k, choice=c, timings=json.loads(t)) for k, c, t, _ in call_key
                       if f"|K{tuning.k_bucket(K)}|" in k]
    print(json.dumps(report, indent=2))
    return 0


def _cmd_config(args) -> int:
    rows = describe()
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    width = max(len(r["env"]) for r in rows)
    for r in rows:
        print(f"{r['env']:<{width}}  {r['value']!r:<14} {r['source']:<8} {r['doc']}")
    return 0


class UsageError(ValueError):
    """A command line that cannot run as given (exit status 2, like argparse's own errors)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE`` on stderr and exit status 2 (the
    usage comes with -h), for unknown subcommands, options and choices alike."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (-h for help)\n")


def _prog() -> str:
    """``kermac-like`` when run through the entry point, else ``python -m kermac_like``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "kermac-like" if name.startswith("kermac-like") else "python -m kermac_like"


def _arch(text: str) -> str:
    try:
        return compiler._check_arch(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None


def main(argv=None) -> int:
    prog = _prog()
    ap = _Parser(prog=prog, description=__doc__.splitlines()[0].replace("python -m kermac_like", prog))
    ap.add_argument("--debug", dest="traceback", action="store_true",
                    help="on an error, show the traceback (the subcommands' -d/--debug do too)")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    def add_precompile(p):
        p.add_argument("--arch", type=_arch, action="append",
                       help="target such as sm_80 or sm_90, repeatable (default: the current GPU's)")
        p.add_argument("--all", action="store_true", help="every shipped template instantiation")
        p.add_argument("--first-calls", action="store_true",
                       help="the kernels of the first calls that the install prebuilds (bench/run.py's cold_compile "
                            "rows; sm_80 and sm_90)")
        p.add_argument("--family", action="append", choices=list(FAMILIES),
                       help="with --all: only this kernel family (repeatable)")
        p.add_argument("--preset", action="append", choices=list(PRESETS), help="descriptor preset name (repeatable)")
        p.add_argument("--json", action="store_true", help="print the whole summary as JSON (every spilling kernel)")
        p.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile processes (default: cores)")
        p.add_argument("-d", "--debug", action="store_true", help="log compile times and resource usage")
        p.add_argument("--bundle", nargs="?", const="", default=None, metavar="DIR",
                       help="write the kernels into a bundle of prebuilt kernels instead of the cache: DIR, or "
                            "kermac_like/prebuilt/ (shipped by a wheel built afterwards); the package reads "
                            "bundles from $KERMAC_LIKE_BUNDLE and kermac_like/prebuilt/")
        p.set_defaults(func=_cmd_precompile)

    cache = sub.add_parser("cache", help="inspect or manage the persistent kernel cache")
    csub = cache.add_subparsers(dest="cache_cmd", required=True)
    csub.add_parser("info", help="where the cache is and what it holds").set_defaults(func=_cmd_info)
    csub.add_parser("clear", help="remove every cached kernel").set_defaults(func=_cmd_clear)
    add_precompile(csub.add_parser("precompile", help="compile kernels into the cache"))
    add_precompile(sub.add_parser("precompile", help="compile kernels into the cache"))
    tune = sub.add_parser("tune", help="time the candidate kernels of distance calls and store the winners")
    tune.add_argument("--preset", action="append", choices=list(PRESETS),
                      help="descriptor preset (repeatable; default l1, l2, laplace_l2, gaussian_l2)")
    tune.add_argument("-K", type=int, action="append", help="dimension (repeatable; default 1 3 8 16 32 64 128 256)")
    tune.add_argument("-M", type=int, default=20000)
    tune.add_argument("-N", type=int, default=20000)
    tune.add_argument("--batch", type=int, action="append", help="leading batch extent (repeatable)")
    tune.add_argument("--p", type=float, default=1.5, help="p of POW presets")
    tune.add_argument("--col-out", action="store_true", help="column-major output")
    tune.add_argument("--list", action="store_true", help="print the stored winners and exit")
    tune.add_argument("-d", "--debug", action="store_true", help="log every candidate's timing")
    tune.set_defaults(func=_cmd_tune)
    config = sub.add_parser("config", help="the effective settings (KERMAC_LIKE_* variables): value, source, meaning")
    config.add_argument("--json", action="store_true", help="as JSON, with each setting's accepted values")
    config.set_defaults(func=_cmd_config)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:  # one line for a person; the traceback with --debug or -d
        if args.traceback or getattr(args, "debug", False):
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        usage = isinstance(e, UsageError)
        print(f"{ap.prog} {args.cmd}: error: {message} ({'-h for help' if usage else '--debug for the traceback'})",
              file=sys.stderr)
        return 2 if usage else 1


if __name__ == "__main__":
    sys.exit(main())
