"""The warm first call's lookup up to the module load, on any machine (issue 26): NVRTC
compiles two small kernels into a temporary cache, then each of --runs new processes
imports kermac_like and times what a warm first call does before it loads a cubin: the
launcher's import, the kernel keys and the cache reads (launcher._find_or_compile, the
same function get_kernel calls), once in this thread and once through launcher.prefetch
(the run_kernel path). --root times another checkout (a before / after pair).

    python3 bench/probes/warm_lookup.py [--runs 10] [--arch sm_90] [--root CHECKOUT]

Prints the median and the minimum of each piece in ms (the minimum is the steadier number
on a loaded machine), and the import of kermac_like apart.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import kermac_like
t1 = time.perf_counter()
from kermac_like.runtime.specs.matvec import combine_spec
from kermac_like.runtime.specs.distance_wgmma import wgmma_prepare_spec
import torch
arch, threaded = sys.argv[1], sys.argv[2] == "1"
specs = [combine_spec(torch.float32), wgmma_prepare_spec(small=True, norms=True)]
t2 = time.perf_counter()
from kermac_like.runtime import launcher
from kermac_like.runtime.compiler import kernel_key
t3 = time.perf_counter()
keys = [kernel_key(s, arch) for s in specs]
t4 = time.perf_counter()
if threaded:  # launcher.prefetch (the run_kernel path), the caller waiting for each (get_kernel's wait)
    launcher.arch_of_device = lambda device: arch  # (no GPU needed up to the module load)
    launcher.prefetch(specs, 0)
    found = [launcher._pending[(arch, s)].result() for s in specs]
else:
    found = [launcher._find_or_compile(s, arch, k, False) for s, k in zip(specs, keys)]
t5 = time.perf_counter()
assert all(src == "cache" for _, src in found), found
ms = lambda a, b: (b - a) * 1e3
print(json.dumps(dict(import_kermac_like=ms(t0, t1), import_launcher=ms(t2, t3), keys=ms(t3, t4), lookup=ms(t4, t5),
                      total=ms(t2, t5), package=kermac_like.__file__, lazy_modules=sorted(m for m in sys.modules if m.startswith("kermac_like.runtime")))))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose kermac_like is timed (default: this one)")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    with tempfile.TemporaryDirectory() as tmp:
        env["KERMAC_LIKE_CACHE_DIR"] = tmp
        fill = ("import sys, torch\n"
                "from kermac_like.runtime.specs.matvec import combine_spec\n"
                "from kermac_like.runtime.specs.distance_wgmma import wgmma_prepare_spec\n"
                "from kermac_like.runtime.compiler import precompile_specs\n"
                "print(precompile_specs([combine_spec(torch.float32)], sys.argv[1], processes=1))\n"
                "print(precompile_specs([wgmma_prepare_spec(small=True, norms=True)], sys.argv[1], processes=1))\n")
        # (run in the cache folder: ``python -c`` puts the working directory first on sys.path)
        subprocess.run([sys.executable, "-c", fill, args.arch], env=env, check=True, stdout=subprocess.DEVNULL, cwd=tmp)
        for threaded in ("0", "1"):
            rows = []
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, "-c", CHILD, args.arch, threaded], env=env, check=True,
                                     capture_output=True, text=True, cwd=tmp).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"{'prefetch' if threaded == '1' else 'get_kernel path'} ({args.runs} processes), ms median / min:")
            for name in ("import_kermac_like", "import_launcher", "keys", "lookup", "total"):
                vals = [r[name] for r in rows]
                print(f"  {name:20s} {statistics.median(vals):8.2f} {min(vals):8.2f}")
        print("package:", rows[-1]["package"])
        print("kermac_like.runtime modules loaded:", " ".join(rows[-1]["lazy_modules"]))


if __name__ == "__main__":
    main()
