"""Where the first call of a new process goes (warm kernel cache): one stage at a time.

    python3 bench/probes/try_first_call.py            # GPU machine; prints a breakdown in ms
"""

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
T = {}
def mark(name, t0):
    T[name] = round((time.perf_counter() - t0) * 1e3, 2)
t0 = time.perf_counter(); import torch; mark("import torch", t0)
x = torch.randn(1000, 64, device="cuda"); y = torch.randn(900, 64, device="cuda"); torch.cuda.synchronize()
t0 = time.perf_counter(); import kermac_like as km; mark("import kermac_like", t0)
stages = sys.argv[1] == "stages"
if stages:
    t0 = time.perf_counter(); import cuda.core; mark("import cuda.core", t0)
    t0 = time.perf_counter(); import sqlalchemy; mark("import sqlalchemy", t0)
    t0 = time.perf_counter(); from kermac_like.runtime.cache import get_cache; get_cache(); mark("open cache", t0)
    t0 = time.perf_counter(); from kermac_like.runtime.compiler import nvrtc_version; nvrtc_version(); mark("nvrtc version", t0)
    t0 = time.perf_counter(); torch.cuda.get_device_capability(0); mark("capability", t0)
t0 = time.perf_counter(); out = km.cdist(x, y, 1.0); torch.cuda.synchronize(); mark("first cdist", t0)
t0 = time.perf_counter(); out = km.cdist(x, y, 1.0); torch.cuda.synchronize(); mark("second cdist", t0)
t0 = time.perf_counter(); out = km.cdist(x, y, 2.0); torch.cuda.synchronize(); mark("first cdist p=2 (same process)", t0)
print("RESULT " + json.dumps(T))
"""


def run(mode, cache):
    env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=cache)
    r = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    if not line:
        print(r.stdout, r.stderr)
        return {}
    return json.loads(line[0][7:])


def main():
    cache = tempfile.mkdtemp(prefix="kl-first-")
    run("plain", cache)  # fills the cache
    for mode in ("plain", "plain", "stages"):
        print(mode, json.dumps(run(mode, cache)))


if __name__ == "__main__":
    main()
