"""Where a warm first call's ~150 ms went: torch's shift steps and the warm_process call, first and second time.

bench/notes/jit.md, "The warm first call again". Each row in new processes on a GPU, after CUDA's context and a
first tensor (both torch's cost, outside the clock).

* torch's shift steps: the torch ops the product formula's shift took on a GPU before plan.shift
  (kermac_like/centring.py's reference_point and shifted_pair: amax, amin, isfinite, isinf, masked_fill,
  nanmedian, nan_to_num, sub, ...) on a 1024 x 64 float32 tensor, first and second time in the process;
  again with CUDA_MODULE_LOADING=EAGER (every module loaded with the context: the first time costs no
  more than the second if the first launches' module loads are the cost);
* bench/run.py's warm_process call (run_kernel laplace_l2 1024 x 1024 x 64, kernels from the bundle)
  with the setting centring_kernels on (the shift by centring.cuh's three kernels) and off (torch's
  steps), first and second call.

    python3 bench/probes/first_call_shift.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
import torch
cfg = json.loads(sys.argv[1])
dev = torch.device("cuda")
import kermac_like as km
x = torch.randn(1024, 64, device=dev)
torch.cuda.synchronize()


def torch_steps(x):
    # centring.shifted_pair(x, x)'s torch ops (reference_point of x, then x - s)
    ok = torch.isfinite(x.amax(dim=0)) & torch.isfinite(x.amin(dim=0))
    sample = x.masked_fill(torch.isinf(x), float("nan"))
    s = torch.nanmedian(sample, dim=0).values.nan_to_num_(nan=0.0).masked_fill_(~ok, 0.0)
    return torch.sub(x, s)


def laplace(x):
    return km.run_kernel(km.preset("laplace_l2"), x, x, bandwidth=8.0)


fn = torch_steps if cfg["what"] == "torch" else laplace
out = []
for _ in range(2):
    t0 = time.perf_counter()
    fn(x)
    torch.cuda.synchronize()
    out.append((time.perf_counter() - t0) * 1e3)
print("RESULT " + json.dumps(out))
"""

ROWS = [
    ("torch's shift steps", "torch", {}),
    ("torch's shift steps, CUDA_MODULE_LOADING=EAGER", "torch", {"CUDA_MODULE_LOADING": "EAGER"}),
    ("warm first call, centring_kernels on", "laplace", {"KERMAC_LIKE_CENTRING_KERNELS": "1"}),
    ("warm first call, centring_kernels off", "laplace", {"KERMAC_LIKE_CENTRING_KERNELS": "0"}),
]


def run(what: str, extra: dict, cache: str):
    env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=cache, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(dict(what=what))], env=env, capture_output=True,
                       text=True, timeout=600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child failed (exit {p.returncode}): {p.stderr.strip()[-2000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="new processes per row (medians)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print("| what | first (ms) | second (ms) |\n|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kermac_like_probe_") as tmp:
        for name, what, extra in ROWS:
            got = [run(what, extra, os.path.join(tmp, "cache")) for _ in range(args.runs)]
            print(f"| {name} | {med([g[0] for g in got]):.2f} | {med([g[1] for g in got]):.3f} |")


if __name__ == "__main__":
    main()
