"""The host path of a warm call on a machine without a GPU: the planner and the kernel store
with the device queries stubbed and launches dropped (tests/conftest.py's as_gpu), so that a
change of the runtime or the plan cache can be timed where there is no GPU.

    PYTHONPATH=. python bench/probes/host_path_cpu.py    # JSON: microseconds per call (best of 7)

Cases: eager calls replayed by their call key (cdist p=2, a bandwidth tensor), a cached plan
(plan_distance), and a hit in the kernel store's process cache (get_kernel). Not the GPU's
numbers (bench/host_overhead.py), but the same Python on the same path.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time

import torch

import kermac_like as km
from kermac_like import plan as P
from kermac_like.runtime import launcher


class _Stub:
    def __init__(self, spec):
        self.spec, self.device = spec, 0


def _stub_gpu():
    modules = [P] + [importlib.import_module(f"{P.__name__}.{m.name}") for m in pkgutil.iter_modules(P.__path__)]
    for name, fn in (("_gpu_ok", lambda t: True), ("_device_index", lambda d: 0), ("_sm_count", lambda d: 132),
                     ("_smem_per_sm", lambda d: 233472),
                     ("_wgmma_enabled", lambda device, settings=None: True)):
        for module in modules:
            if hasattr(module, name):
                setattr(module, name, fn)
    torch.cuda.get_device_capability = lambda d=None: (9, 0)
    try:
        from kermac_like.runtime import store
    except ImportError:
        store = None
    for module in (launcher, store):
        if module is None:
            continue
        for name, fn in (("get_kernel", lambda spec, device, debug=False: _Stub(spec)),
                         ("prefetch", lambda specs, device, debug=False: None),
                         ("available", lambda spec, device: True), ("max_active_clusters", lambda k: 66),
                         ("launch", lambda *a, **k: None)):
            if hasattr(module, name):
                setattr(module, name, fn)


def _time(fn, calls=2000, repeats=9) -> float:
    for _ in range(50):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return round(min(out), 3)  # the least disturbed run (a shared machine)


def main() -> None:
    res = {}
    # The kernel store's hit, before the stubs: a prefilled process cache.
    try:
        from kermac_like.runtime import store as kstore
        loaded, get = kstore._loaded, kstore.get_kernel
    except (ImportError, AttributeError):
        loaded, get = launcher._functions, launcher.get_kernel
    from kermac_like.runtime.specs.kmeans import segsum_spec

    spec = segsum_spec()
    loaded[(0, spec)] = _Stub(spec)
    res["get_kernel_hit"] = _time(lambda: get(spec, 0), calls=20000)
    loaded.clear()
    _stub_gpu()
    import os

    os.environ["KERMAC_LIKE_WGMMA"] = "always"
    x, y = torch.randn(256, 8), torch.randn(256, 8)
    out = torch.empty(256, 256)
    bw = torch.tensor([2.0])
    res["cdist_p2_out"] = _time(lambda: km.cdist(x, y, out=out))
    res["laplace_l2_bw_tensor"] = _time(lambda: km.run_kernel(km.PRESETS["laplace_l2"], x, y, bandwidth=bw))
    from kermac_like.ops.distance import COMPUTE_MODES, prepare_call

    call = prepare_call(km.PRESETS["l2"], x, y)
    res["part_plan_p2_cached"] = _time(lambda: P.plan_distance(call, out, COMPUTE_MODES[0], False))
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
