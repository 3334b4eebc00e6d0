"""Where a cold first call's time goes, per kernel family, without a GPU (issue 26).

    python3 bench/probes/compile_profile.py [--arch sm_90 --arch sm_80] [--repeats 2] [--json out.json]
    python3 bench/probes/compile_profile.py --list            # the specs of each call only

1. The specs each call of the issue's list compiles, found by planning the call with CPU
   tensors as if on a GPU of the arch (device queries and the kernel loader stubbed, as
   tests/conftest.py's ``as_gpu`` does; cdist_grad's planner tests ``a.is_cuda`` itself, so
   its spec comes from ``grad_kernel_spec`` with the planner's arguments).
2. Per spec, each compile in a fresh process (nothing of NVRTC loaded or cached): the
   compiler's own ``compile_specs`` with NVRTC's ``-time`` table, which splits NVRTC into
   the C++ front end (headers and template instantiation), the NVVM optimizer (LLVM IR ->
   optimised IR -> PTX) and the PTX translation (ptxas, PTX -> SASS); "python" is the
   rest of compile_specs' wall time (program setup, symbol mapping, log parsing). ptxas's
   resource report (registers, spills) of each kernel.
3. The header share: a program that includes the same headers and instantiates nothing.
4. Process-level costs: loading NVRTC (the first program of a process against the
   second), ``import kermac_like`` (wall time in fresh processes, and ``-X importtime``'s
   largest modules), and the warm path's host work in a new process (kernel key,
   SQLite lookup; module load needs a GPU and is left out).

Timings are wall seconds on this machine (2 cores shared with other work: medians of
``--repeats`` fresh processes). NVRTC's version is printed: the GPU host's may differ.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (name, code building the call with CPU tensors; `km` is kermac_like)
CALLS = (
    ("cdist p=1 K=8", "a = torch.randn(3000, 8); km.cdist(a, a, p=1.0)"),
    ("cdist p=1.7 K=8", "a = torch.randn(3000, 8); km.cdist(a, a, p=1.7)"),
    ("cdist p=2 K=8", "a = torch.randn(3000, 8); km.cdist(a, a, p=2.0)"),
    ("cdist p=1 K=64", "a = torch.randn(3000, 64); km.cdist(a, a, p=1.0)"),
    ("cdist p=1.7 K=64", "a = torch.randn(3000, 64); km.cdist(a, a, p=1.7)"),
    ("cdist p=2 K=64", "a = torch.randn(3000, 64); km.cdist(a, a, p=2.0)"),
    ("cdist p=1.7 64x8 (the issue's)", "a = torch.randn(64, 8); km.cdist(a, a, p=1.7)"),
    ("run_kernel laplace_l2 1024x1024x64",
     "x = torch.randn(1024, 64); km.run_kernel(km.preset('laplace_l2'), x, x, bandwidth=1.0)"),
    ("kernel_matvec gaussian D=3",
     "x = torch.randn(4096, 3); km.kernel_matvec(km.preset('gaussian_l2'), x, x, torch.randn(4096, 1), bandwidth=1.0)"),
    ("kernel_matvec gaussian D=256",
     "x = torch.randn(4096, 256); km.kernel_matvec(km.preset('gaussian_l2'), x, x, torch.randn(4096, 1), bandwidth=1.0)"),
    ("cdist_grad p=2", None),  # grad_kernel_spec("square", 4, sm90=...): see the module docstring
)

SMEM_PER_SM = {"sm_80": 167936, "sm_90": 233472}


class _Stub:
    def __init__(self, spec):
        self.spec, self.device = spec, 0


def specs_of_calls(arch: str) -> dict:
    """{call name: [KernelSpec, ...] in the order the call loads them} on ``arch``."""
    import torch

    import kermac_like as km
    from kermac_like import plan as P
    from kermac_like.runtime import launcher
    from kermac_like.runtime.specs import grad_kernel_spec

    cap = (int(arch[3]), int(arch[4:]))
    seen: list = []
    saved = {k: getattr(P, k) for k in ("_gpu_ok", "_device_index", "_sm_count", "_smem_per_sm", "_wgmma_enabled")}
    saved_l = {k: getattr(launcher, k) for k in ("get_kernel", "max_active_clusters", "launch", "prefetch")}
    saved_cap = torch.cuda.get_device_capability
    P._gpu_ok = lambda t: True
    P._device_index = lambda d: 0
    P._sm_count = lambda d: 132
    P._smem_per_sm = lambda d: SMEM_PER_SM.get(arch, 0)
    P._wgmma_enabled = lambda device, settings=None: (settings or P.Settings.current()).wgmma and cap == (9, 0)
    torch.cuda.get_device_capability = lambda d=None: cap
    launcher.get_kernel = lambda spec, device, debug=False: (seen.append(spec), _Stub(spec))[1]
    launcher.max_active_clusters = lambda k: 66
    launcher.launch = lambda *a, **k: None
    launcher.prefetch = lambda specs, device, debug=False: None
    out = {}
    try:
        for name, code in CALLS:
            seen.clear()
            P.clear_templates()
            torch.manual_seed(0)
            if code is None:  # cdist_grad p=2, float32, 16-byte aligned operands: kVec 4
                seen.append(grad_kernel_spec("square", 4, tensor_cores=True, sm90=cap == (9, 0)))
            else:
                exec(code, {"torch": torch, "km": km})
            out[name] = [s for s in dict.fromkeys(seen) if s.supports(arch)]
    finally:
        for k, v in saved.items():
            setattr(P, k, v)
        for k, v in saved_l.items():
            setattr(launcher, k, v)
        torch.cuda.get_device_capability = saved_cap
        P.clear_templates()
    return out


# -- one compile in a fresh process ----------------------------------------------------------------
CHILD = r"""
import dataclasses, json, pickle, sys, time
t_start = time.perf_counter()
from kermac_like.runtime import compiler
from kermac_like.runtime.specs import KernelSpec, LaunchShape, render_source
req = json.loads(sys.argv[1])
arch, mode, csv = req["arch"], req["mode"], req["csv"]
orig = compiler._program_options
compiler._program_options = lambda a: dataclasses.replace(orig(a), time=csv)
res = {}
if mode == "fill":  # the launcher's miss path: compiled and stored in the cache
    from kermac_like.runtime import launcher
    d = req["specs"][0]
    spec = KernelSpec(d["header"], d["kernel"], d["traits"], LaunchShape(**d["launch"]), d["arch_suffix"])
    launcher._find_or_compile(spec, arch, compiler.kernel_key(spec, arch), False)
elif mode == "trivial":  # the headers alone, then the same again in this process (NVRTC loaded)
    from cuda.core import Program
    src = "".join(f'#include "{h}"\n' for h in req["headers"]) + "extern \"C\" __global__ void kl_trivial() {}\n"
    for run in ("first", "second"):
        t0 = time.perf_counter()
        Program(src, code_type="c++", options=compiler._program_options(arch)).compile("cubin")
        res[run] = time.perf_counter() - t0
else:
    specs = [KernelSpec(d["header"], d["kernel"], d["traits"], LaunchShape(**d["launch"]), d["arch_suffix"])
             for d in req["specs"]]
    t0, c0 = time.perf_counter(), time.process_time()
    record, resources = compiler.compile_specs(specs, arch)
    res["wall"], res["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    res["nvrtc"] = record.compile_seconds
    res["resources"] = resources
    res["cubin_bytes"] = len(record.cubin)
res["phases"] = {}
for line in open(csv).read().splitlines():  # (no header line when the file exists)
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 4 and parts[2].isdigit():
        res["phases"][parts[1]] = res["phases"].get(parts[1], 0.0) + float(parts[2]) / 1e3
print("RESULT " + json.dumps(res))
"""

PHASES = (("CUDA C++ Frontend", "front end"), ("NVVM Optimizer", "NVVM opt"), ("PTX Translation", "ptxas"))


def _spec_dict(s) -> dict:
    import dataclasses

    return dict(header=s.header, kernel=s.kernel, traits=s.traits, launch=dataclasses.asdict(s.launch),
                arch_suffix=s.arch_suffix)


def child(req: dict, cache: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".csv", delete=False) as f:
        req = dict(req, csv=f.name)
    env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(req)], env=env, capture_output=True, text=True)
    os.unlink(req["csv"])
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"child failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(line[0][7:])


def time_spec(spec, arch: str, repeats: int, cache: str) -> dict:
    runs = [child({"arch": arch, "mode": "spec", "specs": [_spec_dict(spec)]}, cache) for _ in range(repeats)]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {"wall": med([r["wall"] for r in runs]), "nvrtc": med([r["nvrtc"] for r in runs]),
           "cpu": med([r["cpu"] for r in runs]),
           "walls": [round(r["wall"], 3) for r in runs]}
    for key, short in PHASES:
        out[short] = med([r["phases"].get(key, 0.0) for r in runs])
    out["python"] = out["wall"] - sum(out[s] for _, s in PHASES)
    out["resources"] = next(iter(runs[0]["resources"].values()), {})
    out["cubin_bytes"] = runs[0]["cubin_bytes"]
    return out


def time_headers(headers, arch: str, repeats: int, cache: str) -> dict:
    runs = [child({"arch": arch, "mode": "trivial", "headers": sorted(headers)}, cache) for _ in range(repeats)]
    return {"first": statistics.median(r["first"] for r in runs), "second": statistics.median(r["second"] for r in runs),
            "front end": statistics.median(r["phases"].get("CUDA C++ Frontend", 0.0) / 2 for r in runs)}


# -- process-level costs ---------------------------------------------------------------------------
def import_times(repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
            "import kermac_like; t2 = time.perf_counter(); print('RESULT', t1 - t0, t2 - t1)")
    walls = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        walls.append([float(x) for x in r.stdout.split("RESULT")[1].split()])
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch; import kermac_like"], env=env,
                       capture_output=True, text=True)
    rows = []
    for line in r.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us, cum_us, name = (p.strip() for p in line[len("import time:"):].split("|"))
            if self_us.isdigit():
                rows.append((int(cum_us), int(self_us), name.strip()))
    own = [x for x in rows if x[2].split(".")[0] in ("kermac_like", "cuda", "numpy") and "." not in x[2].strip()]
    top = sorted((x for x in rows if x[2].startswith(("kermac_like", "cuda"))), reverse=True)[:8]
    return {"torch": statistics.median(w[0] for w in walls), "kermac_like": statistics.median(w[1] for w in walls),
            "importtime_top": [(n, round(c / 1e3, 1)) for c, _, n in top], "roots": [(n, c / 1e3) for c, _, n in own]}


WARM_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import kermac_like
from kermac_like.runtime import compiler
from kermac_like.runtime.cache.warm import read_kernel
from kermac_like.runtime.specs import KernelSpec, LaunchShape
t1 = time.perf_counter()
d = json.loads(sys.argv[1])
spec = KernelSpec(d["header"], d["kernel"], d["traits"], LaunchShape(**d["launch"]), d["arch_suffix"])
t2 = time.perf_counter(); key = compiler.kernel_key(spec, d["arch"]); t3 = time.perf_counter()
hit = read_kernel(key); t4 = time.perf_counter()
assert hit is not None, "no cache entry"
t5 = time.perf_counter(); compiler.kernel_key(spec, d["arch"]); t6 = time.perf_counter()
print("RESULT " + json.dumps({"import": t1 - t0, "first key": t3 - t2, "lookup": t4 - t3, "second key": t6 - t5}))
"""


def warm_path(spec, arch: str, repeats: int, cache: str) -> dict:
    child({"arch": arch, "mode": "fill", "specs": [_spec_dict(spec)]}, cache)
    d = dict(_spec_dict(spec), arch=arch)
    env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
    runs = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", WARM_CHILD, json.dumps(d)], env=env, capture_output=True, text=True)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            raise RuntimeError(r.stderr[-3000:])
        runs.append(json.loads(line[0][7:]))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def short(spec) -> str:
    t = spec.traits.replace("kermac_like::", "").replace("Inner::", "").replace("Power::", "")
    t = t.replace("Epilogue::", "").replace("Layout::", "").replace("Precision::", "")
    return f"{spec.header}: {t}{' (sm_90a)' if spec.arch_suffix else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="sm_90 (default) and/or sm_80")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--list", action="store_true", help="print the specs of each call and stop")
    ap.add_argument("--only", action="append", help="calls whose name contains this text")
    ap.add_argument("--no-process", action="store_true", help="skip the import / NVRTC load / warm path timings")
    ap.add_argument("--process-only", action="store_true", help="only the import and warm path timings")
    ap.add_argument("--json")
    args = ap.parse_args()
    archs = args.arch or ["sm_90"]
    from kermac_like.runtime.compiler import nvrtc_version

    print(f"NVRTC {nvrtc_version()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    report = {"nvrtc": nvrtc_version(), "calls": {}, "specs": {}}
    cache = tempfile.mkdtemp(prefix="kl-compile-profile-")
    for arch in ([] if args.process_only else archs):
        calls = specs_of_calls(arch)
        if args.only:
            calls = {k: v for k, v in calls.items() if any(o in k for o in args.only)}
        timed = {}
        print(f"\n== {arch}")
        for name, specs in calls.items():
            print(f"{name}:")
            total = 0.0
            for s in specs:
                if args.list:
                    print(f"   {short(s)}")
                    continue
                if s not in timed:
                    timed[s] = time_spec(s, arch, args.repeats, cache)
                t = timed[s]
                total += t["wall"]
                r = t["resources"]
                spill = f", spills {r.get('spill_stores', 0)}/{r.get('spill_loads', 0)} B" if r.get("spill_stores") or \
                    r.get("spill_loads") else ""
                print(f"   {t['wall']:6.2f} s (cpu {t['cpu']:.2f}) = front end {t['front end']:.2f} + NVVM {t['NVVM opt']:.2f} + ptxas "
                      f"{t['ptxas']:.2f} + python {t['python']:.2f} (runs {t['walls']}; {r.get('registers')} regs"
                      f"{spill}; cubin {t['cubin_bytes'] // 1024} KiB)  {short(s)}")
            if not args.list:
                print(f"   {total:6.2f} s in all (one after another, as get_kernel compiles them)")
            report["calls"].setdefault(arch, {})[name] = [s.name_expression for s in specs]
        for s, t in timed.items():
            report["specs"][f"{arch} {s.name_expression}"] = t
        if args.list:
            continue
        headers = sorted({s.header for specs in calls.values() for s in specs})
        print("\nheaders alone (a program that includes one header and instantiates nothing):")
        for h in headers:
            t = time_headers([h], arch, args.repeats, cache)
            report.setdefault("headers", {})[f"{arch} {h}"] = t
            print(f"   {h}: first program of a process {t['first']:.3f} s, second {t['second']:.3f} s "
                  f"(front end {t['front end']:.3f} s)")
    if not args.list and not args.no_process:
        imp = import_times(max(3, args.repeats))
        report["import"] = imp
        print(f"\nimport torch {imp['torch']:.3f} s, then import kermac_like {imp['kermac_like']:.3f} s (fresh processes)")
        print("  -X importtime, cumulative ms:", ", ".join(f"{n} {c}" for n, c in imp["importtime_top"]))
        from kermac_like.runtime.specs import lowk_spec
        from kermac_like.descriptor import preset
        from kermac_like.layout import Layout

        spec = lowk_spec(preset("l1"), Layout.ROW_MAJOR, Layout.ROW_MAJOR, 3)
        w = warm_path(spec, archs[0], max(3, args.repeats), cache)
        report["warm"] = w
        print(f"warm cache, new process: import {w['import']:.3f} s; kernel key {w['first key'] * 1e3:.1f} ms "
              f"(template hash included; next {w['second key'] * 1e3:.2f} ms), SQLite lookup "
              f"{w['lookup'] * 1e3:.1f} ms")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
