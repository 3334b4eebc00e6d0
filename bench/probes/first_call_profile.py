"""Where a first call's time goes (issue 26): one of bench/run.py's COLD_CALLS in a new process,
its first call under cProfile, the top entries by cumulative time, and the kernels' sources.

    python3 bench/probes/first_call_profile.py "cdist_grad p=2 K=64 M=N=1024 O=16"       # empty cache
    python3 bench/probes/first_call_profile.py --warm "run_kernel laplace_l2 1024x1024x64"  # cache filled first
    KERMAC_LIKE_BUNDLE=DIR python3 bench/probes/first_call_profile.py "..."              # with a bundle

Each measurement runs in its own process with its own cache directory (a temporary one unless
KERMAC_LIKE_CACHE_DIR is set); --warm runs the call once in another process first, so that the
profiled process finds its kernels in the cache (bench/run.py's warm_process row).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

CHILD = r"""
import cProfile, io, json, pstats, sys, time
import torch
cfg = json.loads(sys.argv[1])
dev = torch.device(cfg["device"])
setup, timed = cfg["call"].split("@ ")
t0 = time.perf_counter()
import kermac_like as km
imp = (time.perf_counter() - t0) * 1e3
exec(setup)
if dev.type == "cuda":
    torch.cuda.synchronize(dev)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
exec(timed)
if dev.type == "cuda":
    torch.cuda.synchronize(dev)
prof.disable()
first = (time.perf_counter() - t0) * 1e3
t0 = time.perf_counter()
exec(timed)
if dev.type == "cuda":
    torch.cuda.synchronize(dev)
second = (time.perf_counter() - t0) * 1e3
from kermac_like.runtime import launcher
sources = {}
for k in launcher._functions.values():
    sources[k.source] = sources.get(k.source, 0) + 1
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(cfg["top"])
print(f"import {imp:.0f} ms; first call {first:.1f} ms; second call {second:.2f} ms; kernels {sources}")
print(s.getvalue())
"""


def main():
    from run import COLD_CALLS  # noqa: E402  (bench/run.py)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("call", nargs="?", default="run_kernel laplace_l2 1024x1024x64", choices=sorted(COLD_CALLS))
    ap.add_argument("--warm", action="store_true", help="fill the cache in another process first")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    cfg = json.dumps(dict(device=args.device, call=COLD_CALLS[args.call], top=args.top))
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        env.setdefault("KERMAC_LIKE_CACHE_DIR", tmp)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        if args.warm:
            subprocess.run([sys.executable, "-c", CHILD, cfg], env=env, check=True, capture_output=True)
        p = subprocess.run([sys.executable, "-c", CHILD, cfg], env=env, capture_output=True, text=True)
        print(f"== {args.call} ({'warm cache' if args.warm else 'empty cache'}"
              f"{', bundle ' + env['KERMAC_LIKE_BUNDLE'] if env.get('KERMAC_LIKE_BUNDLE') else ''})")
        print(p.stdout)
        if p.returncode:
            print(p.stderr[-3000:])
            sys.exit(p.returncode)


if __name__ == "__main__":
    main()
