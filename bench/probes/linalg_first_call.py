"""Which step of linalg's first call synchronises the host? One fresh process per step:
the steps before it run (and the device is synchronised), then torch.cuda._sleep keeps
the GPU busy for about 1 s and the step is timed on the host. A step that waits for the
GPU takes about as long as the sleep.

    python3 bench/probes/linalg_first_call.py [cold|warm] [STEP,STEP,...]   # GPU machine
"""

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch
upto = int(sys.argv[1]); warm = sys.argv[2] == "warm"
dev = torch.device("cuda")
a = torch.randn(64, 64, device=dev); a = a @ a.T + 64 * torch.eye(64, device=dev); b = torch.randn(4, 64, device=dev)
torch.cuda.synchronize()
cycles = int(1.0 * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # ~1 s
import kermac_like as km
if warm:
    for n in (4, 64):  # the routines once on other sizes beforehand
        for f in (km.linalg.solve_cholesky, km.linalg.solve_lu):
            m = torch.eye(n, device=dev) * 2; f(m, torch.ones(1, n, device=dev))
        km.linalg.eigh(torch.eye(n, device=dev))
    torch.cuda.synchronize()
state = {}
def s_import():
    from nvmath.bindings import cusolverDn; state["cs"] = cusolverDn
def s_params(): state["p"] = state["cs"].create_params()
def s_handle(): state["h"] = state["cs"].create()
def s_stream_driver():
    from cuda.bindings import driver
    err, state["ds"] = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
def s_stream(): state["s"] = torch.cuda.Stream(device=dev)
def s_set_stream(): state["cs"].set_stream(state["h"], state["s"].cuda_stream)
def s_empty(): state["w"] = torch.empty(1 << 24, dtype=torch.uint8, device=dev)
def s_solve(): km.linalg.solve_cholesky(a, b)
def s_solve2(): km.linalg.solve_cholesky(a, b)
def s_lu(): km.linalg.solve_lu(a, b)
def s_eigh(): km.linalg.eigh(a)
steps = [s_import, s_params, s_handle, s_stream_driver, s_stream, s_set_stream, s_empty, s_solve, s_solve2, s_lu, s_eigh]
for f in steps[:upto]:
    f()
torch.cuda.synchronize()
torch.cuda._sleep(cycles)
t0 = time.perf_counter(); steps[upto](); t = time.perf_counter() - t0
t1 = time.perf_counter(); torch.cuda.synchronize(); rest = time.perf_counter() - t1
print("RESULT " + json.dumps({"step": steps[upto].__name__, "host_ms": round(t * 1e3, 1), "then_sync_ms": round(rest * 1e3, 1)}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("cold", "warm"), default="cold")
    parser.add_argument("steps", nargs="?", default="0,1,2,3,4,5,6,7,8,9,10", help="comma-separated steps (default: all)")
    args = parser.parse_args()
    mode, which = args.mode, [int(i) for i in args.steps.split(",")]
    for i in which:
        r = subprocess.run([sys.executable, "-c", CHILD, str(i), mode], capture_output=True, text=True)
        line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        print(mode, line[0][7:] if line else (r.stdout + r.stderr)[-800:], flush=True)


if __name__ == "__main__":
    main()
