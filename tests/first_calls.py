"""The kernels that bench/run.py's cold_compile calls (COLD_CALLS: issue 26's first calls) launch
on an sm_80 and an sm_90 GPU, found without a GPU: each call runs on CPU tensors with the planners'
device queries answered as those GPUs would (A100: 108 SMs, 164 KiB shared memory per SM; H200: 132
SMs, 228 KiB), the kernel loader recording the specs it is asked for and the launches left out.

The install's prebuilt kernels are these (runtime/precompile.py ``first_call_specs``, from the list
this writes: kermac_like/runtime/first_calls.json); tests/test_bundle.py checks that the list is
what the planners ask for today, and on a GPU that the calls launch nothing else.

    python3 tests/first_calls.py            # print the specs per architecture
    python3 tests/first_calls.py --write    # rewrite kermac_like/runtime/first_calls.json
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = {"sm_80": (8, 0), "sm_90": (9, 0)}
# (SMs, shared memory per SM, opt-in shared memory per block) of the GPUs each arch stands for
DEVICE = {(8, 0): (108, 167936, 166912), (9, 0): (132, 233472, 232448)}


class _Loaded:
    """What the planners keep of a loaded kernel."""

    def __init__(self, spec):
        self.spec, self.device, self.source = spec, 0, "stub"


def cold_calls() -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from run import COLD_CALLS
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return dict(COLD_CALLS)


@contextlib.contextmanager
def _as_gpu(cap: tuple, seen: list):
    """The planners' device queries answered as a GPU of capability ``cap`` would, the loader
    recording every spec asked for (``seen``), launches left out."""
    import torch

    from kermac_like import plan as P
    from kermac_like.config import override
    from kermac_like.ops import distance as ops_distance
    from kermac_like.plan import core
    from kermac_like.runtime import launcher, store

    sms, smem, optin = DEVICE[cap]
    modules = [P] + [importlib.import_module(f"{P.__name__}.{m.name}") for m in pkgutil.iter_modules(P.__path__)]
    saved = []

    def put(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def stub(name, fn):
        for module in modules:
            if hasattr(module, name):
                put(module, name, fn)

    def wgmma(device, settings=None):
        return bool((settings or core.Settings.current()).wgmma) and cap == (9, 0)

    stub("_gpu_ok", lambda t: True)
    stub("_device_index", lambda d: 0)
    stub("_sm_count", lambda d: sms)
    stub("_smem_per_sm", lambda d: smem)
    stub("_smem_per_block_optin", lambda d: optin)
    stub("_smem_optin", lambda device: optin)
    stub("_sm90", lambda device: cap == (9, 0))
    stub("_wgmma_enabled", wgmma)
    stub("_blocks_per_sm", lambda kernel: 1)
    put(torch.cuda, "get_device_capability", lambda d=None: cap)
    put(ops_distance, "_cpu_cdist", lambda *a, **k: None)

    def get_kernel(spec, device, debug=False):
        seen.append(spec)
        return _Loaded(spec)

    put(store, "get_kernel", get_kernel)
    put(store, "prefetch", lambda specs, device, debug=False: seen.extend(specs))
    put(store, "available", lambda spec, device: True)
    put(launcher, "max_active_clusters", lambda kernel: sms // 2)
    put(launcher, "launch", lambda *a, **k: None)
    P.clear_templates()
    try:
        with override(jit_tier=False):
            yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        P.clear_templates()


def specs_of_calls(arch: str, calls: dict | None = None) -> dict:
    """{call name: [KernelSpec, ...]} of ``calls`` (default: COLD_CALLS) planned for ``arch``."""
    import torch

    import kermac_like as km
    from kermac_like.plan.core import Settings
    from kermac_like.runtime.specs import grad_kernel_spec

    cap = ARCHS[arch]
    out = {}
    for name, code in (calls or cold_calls()).items():
        seen: list = []
        setup, timed = code.split("@ ")
        scope = {"torch": torch, "km": km, "dev": torch.device("cpu")}
        exec(setup, scope)
        if timed.strip().startswith("km.cdist_grad("):
            # plan_cdist_grad asks a.is_cuda itself: its spec as the planner picks it (M a multiple of
            # 4, 16-byte aligned tensors: kVec 4)
            p = 2.0 if "p=2.0" in timed else None
            kind = {2.0: "square"}[p]
            with _as_gpu(cap, seen):
                seen.append(grad_kernel_spec(kind, 4, tensor_cores=Settings.current().grad_mma, sm90=cap == (9, 0)))
        else:
            with _as_gpu(cap, seen):
                exec(timed, scope)
        out[name] = [s for s in dict.fromkeys(seen) if s.supports(arch)]
    return out


def first_call_specs_planned(arch: str) -> list:
    """Every spec the cold calls take on ``arch``, once, in call order; the product formula's shift
    (plan.shift, centring.cuh: its three kernels, asked for by several calls) last, so that the other
    kernels' NVRTC programs of the install's bundle (4 kernels a program, in this order) stay as they were."""
    specs = list(dict.fromkeys(s for specs in specs_of_calls(arch).values() for s in specs))
    return sorted(specs, key=lambda s: s.header == "centring.cuh")


def main(argv) -> int:
    os.environ.setdefault("KERMAC_LIKE_JIT_TIER", "0")
    sys.path.insert(0, str(ROOT))
    from kermac_like.runtime.precompile import write_first_call_list

    planned = {arch: first_call_specs_planned(arch) for arch in ARCHS}
    if "--write" in argv:
        print(write_first_call_list(planned))
    else:
        for arch, specs in planned.items():
            print(arch, len(specs))
            for s in specs:
                print("   ", s.name_expression)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
