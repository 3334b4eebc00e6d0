"""One GPU run that says whether the sm_90a (wgmma) distance kernel is right and how fast.

    python bench/probes/try_wgmma.py            # on the H200 (or any sm_90 GPU); < 2 minutes

(a) correctness of cuda_templates/distance_wgmma.cuh against float64 on NaN-poisoned
    outputs: odd M/N/K, K tails, broadcast batch walked by one grid layer, per-batch
    bandwidth/regularisation tensors, every epilogue, DOT, squared distances, row- and
    column-major out with padding that must stay untouched, epsilon, the exact zero
    self-distance diagonal, and (KERMAC_LIKE_WGMMA=1) the package path through cdist;
(b) CUDA-event timings (median of 10 after warm-up) of the two bench workloads for the
    wgmma kernel beside the existing mma.sync kernel, with the accuracy of each run on
    a slice of rows vs float64.

Every case is caught and reported on its own line; the summary table comes last.
Self-contained: torch, cuda.core (>= 0.3), cuda.bindings and the repository's
cuda_templates/ (the package itself only for the package-path check).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

try:
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
except ImportError:  # cuda.core < 0.4
    from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "cuda_templates"
NS = "kermac_like::"
T0 = time.perf_counter()
DEVICE = "cuda"


# ------------------------------------------------------------------ kernels
class Variant:
    """One kernel family: header, kernel template, traits template, arch, launch shape."""

    def __init__(self, name, header, kernel, traits, arch, block, smem, prefix="", threads=256, persistent=False,
                 extra="", prepared=False, cluster=1):
        self.name, self.header, self.kernel, self.traits = name, header, kernel, traits
        self.arch, self.block, self.smem, self.prefix = arch, block, smem, prefix
        self.threads, self.persistent, self.extra = threads, persistent, extra
        self.prepared = prepared  # takes wgmma_prepare_b_kernel's b blocks and norms (launched first)
        self.cluster = cluster  # CTAs per cluster of a prepared (wgmma) variant

    def traits_of(self, cfg):
        inner, outer, epi, out, prec = cfg
        return (f"{NS}{self.traits}<{NS}Inner::{inner}, {NS}Power::{outer}, {NS}Epilogue::{epi}, "
                f"{NS}Layout::RowMajor, {NS}Layout::RowMajor, {NS}Layout::{out}, {NS}Precision::{prec}, float"
                f"{self.extra}>")

    def smem_of(self, cfg):
        return self.smem(cfg) if callable(self.smem) else self.smem


WGMMA_SMEM = {"Tf32x3": 211024, "Tf32": 205952}  # (unchanged by the cluster launch)  # mirror of DistanceWgmmaTraits::kSmemBytes


def wgmma_variant(name, prefix="", cluster=2):
    return Variant(name, "distance_wgmma.cuh", "distance_wgmma_kernel", "DistanceWgmmaTraits", "sm_90a", (128, 256),
                   lambda cfg: WGMMA_SMEM[cfg[4]], prefix=prefix, threads=384, persistent=True, prepared=True,
                   cluster=cluster)


VARIANTS = {
    "wgmma": wgmma_variant("wgmma"),
    # Diagnostics (not correct programs): no output writes; no global loads; no tensor work.
    "wgmma-nostore": wgmma_variant("wgmma-nostore", "#define KERMAC_LIKE_WGMMA_DIAG_NO_STORE 1\n"),
    "wgmma-noload": wgmma_variant("wgmma-noload", "#define KERMAC_LIKE_WGMMA_DIAG_NO_LOAD 1\n"),
    "wgmma-nomma": wgmma_variant("wgmma-nomma", "#define KERMAC_LIKE_WGMMA_DIAG_NO_MMA 1\n"),
    # Probes: the general epilogue on every tile; other M-tile group sizes.
    "wgmma-nofast": wgmma_variant("wgmma-nofast", "#define KERMAC_LIKE_WGMMA_NO_FAST_EPILOGUE 1\n"),
    "wgmma-g8": wgmma_variant("wgmma-g8", "#define KERMAC_LIKE_WGMMA_GROUP_M 8\n"),
    "wgmma-g32": wgmma_variant("wgmma-g32", "#define KERMAC_LIKE_WGMMA_GROUP_M 32\n"),
    "wgmma-lockstep": wgmma_variant("wgmma-lockstep", "#define KERMAC_LIKE_WGMMA_LOCKSTEP 1\n"),
    "wgmma-fx1": wgmma_variant("wgmma-fx1", "#define KERMAC_LIKE_WGMMA_FMA_EXP 1\n"),
    "wgmma-fx2": wgmma_variant("wgmma-fx2", "#define KERMAC_LIKE_WGMMA_FMA_EXP 2\n"),
    "wgmma-fx3": wgmma_variant("wgmma-fx3", "#define KERMAC_LIKE_WGMMA_FMA_EXP 3\n"),
    "wgmma-cs": wgmma_variant("wgmma-cs", "#define KERMAC_LIKE_WGMMA_STREAM_STORE 1\n"),
    "wgmma-fence": wgmma_variant("wgmma-fence", "#define KERMAC_LIKE_WGMMA_PROXY_FENCE 1\n"),
    "wgmma-c1": wgmma_variant("wgmma-c1", "#define KERMAC_LIKE_WGMMA_CLUSTER 1\n", cluster=1),
    "wgmma-c4": wgmma_variant("wgmma-c4", "#define KERMAC_LIKE_WGMMA_CLUSTER 4\n", cluster=4),
    "mma": Variant("mma", "distance_mma.cuh", "distance_mma_kernel", "DistanceMmaTraits", "sm_90", (128, 256), 99840),
}
DIAGNOSTIC = {"wgmma-nostore", "wgmma-noload", "wgmma-nomma"}
_COMPILED = {}


class _Log:
    text = ""

    def write(self, s):
        self.text += s


def compiled(variant: Variant, cfg):
    """(kernel, smem, ptxas summary) compiled for the variant's arch; cached."""
    key = (variant.name, cfg)
    if key in _COMPILED:
        return _COMPILED[key]
    t = variant.traits_of(cfg)
    name = f"{NS}{variant.kernel}<{t}>"
    smem = variant.smem_of(cfg)
    src = (variant.prefix + f'#include "{variant.header}"\n'
           f'static_assert({t}::kSmemBytes == {smem}, "smem mirror");\n')
    log = _Log()
    t0 = time.perf_counter()
    opts = ProgramOptions(arch=variant.arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    obj = Program(src, "c++", opts).compile("cubin", name_expressions=[name], logs=log)
    seconds = time.perf_counter() - t0
    kernel = obj.get_kernel(name)
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
    if isinstance(handle, driver.CUkernel):
        (err,) = driver.cuKernelSetAttribute(attr, smem, handle, driver.CUdevice(DEV.device_id))
    else:
        (err,) = driver.cuFuncSetAttribute(handle, attr, smem)
    if int(err) != 0:
        raise RuntimeError(f"cannot raise the dynamic smem limit to {smem}: {err}")
    import re

    regs = re.findall(r"Used (\d+) registers", log.text)
    spill = re.findall(r"(\d+) bytes spill stores", log.text)
    summary = f"{regs[-1] if regs else '?'} regs, spill {spill[-1] if spill else '?'} B, compile {seconds:.1f} s"
    _COMPILED[key] = (kernel, smem, summary)
    return _COMPILED[key]


def compiled_prepare(small, norms):
    """wgmma_prepare_b_kernel<WgmmaPrepareTraits<small, norms>> (256 threads, a warp per row)."""
    key = ("prepare", small, norms)
    if key not in _COMPILED:
        name = f"{NS}wgmma_prepare_b_kernel<{NS}WgmmaPrepareTraits<{str(small).lower()}, {str(norms).lower()}>>"
        opts = ProgramOptions(arch="sm_90a", std="c++17", include_path=[str(TEMPLATES)])
        obj = Program('#include "wgmma_prepare.cuh"\n', "c++", opts).compile("cubin", name_expressions=[name])
        _COMPILED[key] = obj.get_kernel(name)
    return _COMPILED[key]


def prepare(cfg, b, keep):
    """Launch the b preparation of a wgmma call on b (Lb, N, K) (entries: Lb, stride 0
    when Lb == 1 broadcasts) and return the kernel's extra arguments; the buffers go
    into `keep` (alive until the launches that read them are done)."""
    small, norms = cfg[4] == "Tf32x3", cfg[0] == "Diff"
    Lb, N, K = b.shape
    i64 = np.int64
    n_pad, k_pad = -(-N // 256) * 256, -(-K // 16) * 16
    rows = Lb * n_pad
    blocks = torch.empty(rows * k_pad * (2 if small else 1), device=DEVICE)
    nb = torch.empty(rows if norms else 1, device=DEVICE)
    keep += [blocks, nb]
    args = (b.data_ptr(), np.int32(N), np.int32(K), i64(b.stride(1)), np.int32(Lb), np.int32(1), i64(0),
            i64(b.stride(0)), i64(0), i64(rows), blocks.data_ptr(), nb.data_ptr() if norms else 0, np.int32(n_pad))
    config = LaunchConfig(grid=(-(-rows // 8), 1, 1), block=(256, 1, 1), shmem_size=0)
    kernel = compiled_prepare(small, norms)

    def go():
        launch(STREAM, config, kernel, *args)

    extra = [blocks.data_ptr(), nb.data_ptr() if norms else 0, i64(0), i64(1 if Lb > 1 else 0), i64(0)]
    return go, extra


def run(variant, cfg, a, b, out, *, bw=1.0, lam=0.0, reg_diag=0, eps=0.0, bw_t=None, lam_t=None, grid_z=None,
        timing=0):
    """Launch on a (La, M, K), b (Lb, N, K) (rows 16-byte aligned, La/Lb 1 = broadcast) into
    out (batch, M, N) (RowMajor: stride(2) == 1; ColMajor: stride(1) == 1).
    Returns the median milliseconds of `timing` launches (after one warm-up), else None."""
    kernel, smem, _ = compiled(variant, cfg)
    La, M, K = a.shape
    Lb, N, _ = b.shape
    batch = out.shape[0]
    assert a.stride(-1) == 1 and b.stride(-1) == 1
    ldo = out.stride(1) if cfg[3] == "RowMajor" else out.stride(2)
    i32, i64, f32 = np.int32, np.int64, np.float32

    def hp(t, value):
        if t is None:
            return [0, i64(0), i64(0), i64(0), f32(value)]
        return [t.data_ptr(), i64(0), i64(t.stride(0) if t.shape[0] > 1 else 0), i64(0), f32(value)]

    args = [a.data_ptr(), b.data_ptr(), out.data_ptr(), i32(M), i32(N), i32(K),
            i64(a.stride(1)), i64(b.stride(1)), i64(ldo), i32(batch), i32(batch), i32(1),
            i64(0), i64(a.stride(0) if La > 1 else 0), i64(0),
            i64(0), i64(b.stride(0) if Lb > 1 else 0), i64(0),
            i64(0), i64(out.stride(0) if batch > 1 else 0), i64(0),
            *hp(None, 0.0), *hp(None, 0.0), *hp(bw_t, bw), *hp(lam_t, lam), i64(reg_diag), f32(eps)]
    keep = []
    pre = None
    if variant.prepared:  # the op = b preparation + the distance kernel, timed together
        pre, extra = prepare(cfg, b, keep)
        args += extra
    args += [0, 0, i32(0), *(i64(0),) * 10]  # no operands as given (ABI.md): near pairs from a and b
    bm, bn = variant.block
    grid = (-(-M // bm), -(-N // bn), min(grid_z or batch, 65535))
    if variant.prepared:  # grid counts clusters of vertically adjacent tiles
        units = -(-grid[0] // variant.cluster) * grid[1] * batch
        config = LaunchConfig(grid=(1, 1, 1), cluster=(variant.cluster, 1, 1), block=(variant.threads, 1, 1),
                              shmem_size=smem)
        fit = kernel.occupancy.max_active_clusters(config, stream=STREAM)
        if timing:
            print(f"  {variant.name}: {fit} clusters of {variant.cluster} fit at once", flush=True)
        config = LaunchConfig(grid=(min(units, grid_z or fit, fit), 1, 1), cluster=(variant.cluster, 1, 1),
                              block=(variant.threads, 1, 1), shmem_size=smem)
    else:
        if variant.persistent:
            tiles = grid[0] * grid[1] * batch
            grid = (min(tiles, SMS if not grid_z else grid_z), 1, 1)
        config = LaunchConfig(grid=grid, block=(variant.threads, 1, 1), shmem_size=smem)

    def op():
        if pre is not None:
            pre()
        launch(STREAM, config, kernel, *args)

    torch.cuda.synchronize()
    op()
    STREAM.sync()
    if not timing:
        return None
    for _ in range(2):
        op()
    times = []
    for _ in range(timing):  # STREAM is torch's current stream: the events time exactly the launches
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        op()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return sorted(times)[len(times) // 2]


def torch_stream():
    """torch's current stream as a cuda.core Stream (so torch events time our launches)."""
    handle = torch.cuda.current_stream().cuda_stream
    try:
        from cuda.core import Stream
    except ImportError:
        from cuda.core.experimental import Stream
    if hasattr(Stream, "from_handle"):
        return Stream.from_handle(handle)

    class _Proto:  # cuda.core < 0.4: wrap through the __cuda_stream__ protocol
        def __cuda_stream__(self, _h=handle):
            return (0, _h)

    return DEV.create_stream(_Proto())


# ------------------------------------------------------------------ oracle
def reference(cfg, a, b, bw, lam, reg_diag, eps):
    """ABI semantics in float64 on a's device. a (L, M, K), b (L, N, K); bw, lam (L,).
    The norm expansion in float64 is exact to ~1e-16 of the norms, far below every
    tolerance here, and needs no (L, M, N, K) temporary. tests/test_templates_mma.py
    uses this oracle (and rel_error, padded, bandwidth_for) too."""
    inner, outer, epilogue = cfg[:3]
    a, b = a.double(), b.double()
    dot = a @ b.transpose(-1, -2)
    if inner == "Dot":
        d = dot
    else:
        d = ((a * a).sum(-1)[..., :, None] + (b * b).sum(-1)[..., None, :] - 2 * dot).clamp_min(0)
        if outer == "Sqrt":
            d = d.sqrt()
    if eps > 0:
        d = torch.where(d < eps, torch.zeros_like(d), d)
    bw = bw.to(d).reshape(-1, 1, 1)
    if epilogue == "Laplace":
        y = torch.exp(-d / bw)
    elif epilogue == "Gaussian":
        y = torch.exp(-d * d / (2 * bw * bw))
    else:
        y = d
    m = torch.arange(y.shape[-2], device=y.device).reshape(-1, 1)
    n = torch.arange(y.shape[-1], device=y.device).reshape(1, -1)
    return y + (n - m == reg_diag).to(y) * lam.to(y).reshape(-1, 1, 1)


def rel_error(y, ref):
    y, ref = y.double().cpu(), ref.double().cpu()
    return ((y - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def padded(x, align=4):
    """x (L, R, K) as a view whose row stride is K rounded up to `align` elements."""
    L, R, K = x.shape
    buf = torch.zeros(L, R, -(-K // align) * align, dtype=x.dtype, device=x.device)
    buf[..., :K] = x
    return buf[..., :K]


SENTINEL = 12345.0


def poisoned_out(cfg, batch, M, N, pad=3):
    """NaN-poisoned output (batch, M, N) with `pad` extra columns (rows for ColMajor)
    holding SENTINEL; returns (view, storage)."""
    if cfg[3] == "RowMajor":
        store = torch.full((batch, M, N + pad), float("nan"), device=DEVICE)
        store[..., N:] = SENTINEL
        return store[..., :N], store
    store = torch.full((batch, N + pad, M), float("nan"), device=DEVICE)
    store[:, N:, :] = SENTINEL
    return store[:, :N, :].transpose(1, 2), store


def bandwidth_for(cfg, K):
    """A bandwidth near the typical distance of standard normal data, so the
    epilogue's exponentials are neither 0 nor 1."""
    return math.sqrt(2.0 * K) if cfg[1] == "Sqrt" else 2.0 * K


TOL = {"Tf32x3": 1e-5, "Tf32": 3e-3}
RESULTS = []  # (section, name, ok, detail)


def record(section, name, ok, detail):
    RESULTS.append((section, name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {section}: {name}: {detail}", flush=True)


def correctness_case(variant, cfg, shape, *, batch_a=1, batch_b=2, lam=0.25, reg_diag=1, eps=0.0,
                     per_batch_hyper=False, grid_z=1, seed=0, near_dup=False):
    """near_dup: rows of b[0] copy rows of a[0] + 1e-4 noise, so that with epsilon = 0.5
    the distances are either ~1e-3 (cut to 0) or ~sqrt(2K) (kept), far from the cut."""
    M, N, K = shape
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    a0 = torch.randn(batch_a, M, K, device=DEVICE, generator=g)
    b0 = torch.randn(batch_b, N, K, device=DEVICE, generator=g)
    if near_dup:
        r = min(M, N)
        b0[0, :r] = a0[0, :r] + 1e-4 * torch.randn(r, K, device=DEVICE, generator=g)
    a, b = padded(a0), padded(b0)
    batch = max(batch_a, batch_b)
    out, store = poisoned_out(cfg, batch, M, N)
    bw = bandwidth_for(cfg, K)
    bw_v = torch.full((batch,), bw, device=DEVICE)
    lam_v = torch.full((batch,), lam, device=DEVICE)
    kw = {}
    if per_batch_hyper:
        bw_v = bw * (1.0 + 0.5 * torch.arange(batch, device=DEVICE, dtype=torch.float32))
        lam_v = lam * (1.0 + torch.arange(batch, device=DEVICE, dtype=torch.float32))
        kw = dict(bw_t=bw_v, lam_t=lam_v, bw=0.0, lam=0.0)
    else:
        kw = dict(bw=bw, lam=lam)
    run(variant, cfg, a, b, out, reg_diag=reg_diag, eps=eps, grid_z=grid_z, **kw)
    ref = reference(cfg, a.expand(batch, -1, -1), b.expand(batch, -1, -1), bw_v, lam_v, reg_diag, eps)
    nan = int(torch.isnan(out).sum())
    pad_ok = bool((store[..., N:] == SENTINEL).all()) if cfg[3] == "RowMajor" else bool(
        (store[:, N:, :] == SENTINEL).all())
    err = rel_error(out, ref)
    bad = int(((out.double() - ref).abs() > 1e-3 * ref.abs().clamp_min(1e-3)).sum())
    ok = nan == 0 and pad_ok and err <= TOL[cfg[4]]
    return ok, (f"rel err {err:.2e}, NaN left {nan}, entries off by > 1e-3: {bad}/{out.numel()}, "
                f"padding {'kept' if pad_ok else 'OVERWRITTEN'}")


CASES = [
    # (cfg, shape, extra). The first three localise a descriptor/layout error (bench/notes/wgmma.md).
    (("Dot", "Noop", "None", "RowMajor", "Tf32x3"), (64, 256, 4), {"lam": 0.0, "batch_b": 1}),
    (("Dot", "Noop", "None", "RowMajor", "Tf32x3"), (64, 256, 8), {"lam": 0.0, "batch_b": 1}),
    (("Dot", "Noop", "None", "RowMajor", "Tf32x3"), (128, 256, 16), {"lam": 0.0, "batch_b": 1}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (1, 1, 1), {}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (7, 5, 3), {}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (127, 129, 100), {}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (129, 1000, 257), {}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (300, 260, 1000), {"grid_z": 2}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (333, 517, 131), {"batch_a": 3, "batch_b": 1, "eps": 0.5, "near_dup": True}),
    (("Diff", "Noop", "None", "ColMajor", "Tf32x3"), (200, 300, 77), {}),
    (("Diff", "Sqrt", "Laplace", "RowMajor", "Tf32x3"), (257, 511, 256), {"per_batch_hyper": True}),
    (("Diff", "Sqrt", "Gaussian", "ColMajor", "Tf32x3"), (130, 260, 64), {"per_batch_hyper": True}),
    (("Diff", "Noop", "Gaussian", "RowMajor", "Tf32x3"), (64, 700, 33), {}),
    (("Diff", "Noop", "Laplace", "ColMajor", "Tf32x3"), (90, 90, 20), {"reg_diag": -3}),
    (("Dot", "Noop", "None", "RowMajor", "Tf32x3"), (129, 257, 100), {}),
    (("Dot", "Noop", "None", "ColMajor", "Tf32x3"), (65, 300, 1024), {}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32x3"), (1000, 1300, 200), {"grid_z": 0, "batch_a": 2}),
    (("Diff", "Sqrt", "Laplace", "RowMajor", "Tf32x3"), (2000, 700, 64), {"grid_z": 0, "per_batch_hyper": True}),
    # many tiles, the regularised diagonal far off the main one: fast-path tiles beside crossed ones
    (("Diff", "Sqrt", "Laplace", "RowMajor", "Tf32x3"), (700, 1100, 96), {"grid_z": 0, "reg_diag": -300,
                                                                           "per_batch_hyper": True}),
    (("Diff", "Noop", "None", "ColMajor", "Tf32x3"), (600, 1000, 64), {"grid_z": 0, "reg_diag": 400}),
    (("Diff", "Sqrt", "None", "RowMajor", "Tf32"), (300, 260, 1000), {}),
    (("Diff", "Sqrt", "Laplace", "ColMajor", "Tf32"), (129, 513, 40), {}),
]


def correctness(variant_name):
    v = VARIANTS[variant_name]
    for cfg, shape, extra in CASES:
        name = f"{'/'.join(cfg)} {shape} {extra or ''}".strip()
        try:
            ok, detail = correctness_case(v, cfg, shape, **extra)
            record(f"correct[{variant_name}]", name, ok, detail)
        except Exception as e:  # noqa: BLE001
            record(f"correct[{variant_name}]", name, False, f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
    # Self distances: the diagonal is exactly 0 (far from the origin, where the norm
    # expansion would otherwise leave noise), in every block that meets it.
    try:
        cfg = ("Diff", "Sqrt", "None", "RowMajor", "Tf32x3")
        x = padded(10 + torch.randn(1, 1000, 300, device=DEVICE))
        out = torch.full((1, 1000, 1000), float("nan"), device=DEVICE)
        run(v, cfg, x, x, out)
        diag = torch.diagonal(out[0])
        ok = bool((diag == 0).all()) and not torch.isnan(out).any()
        err = rel_error(out, reference(cfg, x, x, torch.ones(1), torch.zeros(1), 0, 0.0))
        record(f"correct[{variant_name}]", "self-distance diagonal == 0 (1000x1000x300, +10)", ok,
               f"max |diag| {diag.abs().max().item():.3e}, rel err {err:.2e}")
    except Exception as e:  # noqa: BLE001
        record(f"correct[{variant_name}]", "self-distance", False, f"{type(e).__name__}: {e}"[:300])


def package_path():
    """cdist / run_kernel through kermac_like with KERMAC_LIKE_WGMMA=1."""
    os.environ["KERMAC_LIKE_WGMMA"] = "1"
    sys.path.insert(0, str(ROOT))
    try:
        import kermac_like
        from kermac_like.plan import distance as plan_mod
        from kermac_like.ops import distance as dist_mod

        enabled = plan_mod._wgmma_enabled(torch.device("cuda"))
        x1 = torch.randn(1000, 256, device=DEVICE)
        x2 = torch.randn(700, 256, device=DEVICE)
        y = kermac_like.cdist(x1, x2)
        err = rel_error(y, torch.cdist(x1.double(), x2.double()))
        call = dist_mod.prepare_call(kermac_like.PRESETS["l2"], x1, x2)
        chosen = plan_mod._select(call, torch.empty(call.out_shape, device=DEVICE), {}, dist_mod.COMPUTE_MODES[0],
                                  plan_mod.Settings.current())
        kname = chosen[0].kernel if chosen else "reference"
        record("package", "cdist p=2 1000x700x256 (KERMAC_LIKE_WGMMA=1)", err <= 1e-5 and "wgmma" in kname,
               f"rel err {err:.2e}, kernel {kname}, enabled={enabled}")
        xb = torch.randn(2, 300, 64, device=DEVICE)
        yb = kermac_like.run_kernel(kermac_like.PRESETS["laplace_l2"], xb, xb, bandwidth=8.0, regularization=0.5)
        refb = torch.exp(-torch.cdist(xb.double(), xb.double()) / 8.0) + 0.5 * torch.eye(300, device=DEVICE)
        errb = rel_error(yb, refb)
        record("package", "run_kernel laplace batch 2x300x64 + regularisation", errb <= 1e-5,
               f"rel err {errb:.2e}")
    except Exception as e:  # noqa: BLE001
        record("package", "KERMAC_LIKE_WGMMA=1 path", False, f"{type(e).__name__}: {e}"[:400])
        traceback.print_exc()
    finally:
        os.environ.pop("KERMAC_LIKE_WGMMA", None)


# ------------------------------------------------------------------ timing
WORKLOADS = [
    ("cdist p=2", ("Diff", "Sqrt", "None", "RowMajor"), 30000, 30000, 1024, 15.0),
    ("Laplace-l2", ("Diff", "Sqrt", "Laplace", "RowMajor"), 50000, 50000, 256, 12.0),
]
TIMED = [("wgmma", "Tf32x3"), ("wgmma-nostore", "Tf32x3"), ("wgmma-noload", "Tf32x3"), ("wgmma", "Tf32")]
for _only in [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]:
    TIMED = [(v, "Tf32x3") for v in _only.split(",") if v]
for _extra in [a.split("=", 1)[1] for a in sys.argv if a.startswith("--also=")]:
    TIMED += [(v, "Tf32x3") for v in _extra.split(",") if v]
if "--mma" in sys.argv:
    TIMED += [("mma", "Tf32x3"), ("mma", "Tf32")]
TIMINGS = []  # (workload, variant, precision, ms, tflops, err, target)


def timing():
    for label, head, M, N, K, target in WORKLOADS:
        try:
            x1 = torch.randn(1, M, K, device=DEVICE)
            x2 = torch.randn(1, N, K, device=DEVICE)
            out = torch.empty(1, M, N, device=DEVICE)
            bw = math.sqrt(K)
            rows = 256
            ref = reference(head + ("Tf32x3",), x1[:, :rows], x2, torch.full((1,), bw), torch.zeros(1), 0, 0.0)
        except Exception as e:  # noqa: BLE001
            record("timing", label, False, f"setup failed: {type(e).__name__}: {e}"[:300])
            continue
        for vname, prec in TIMED:
            cfg = head + (prec,)
            try:
                out[:, :rows].fill_(float("nan"))
                ms = run(VARIANTS[vname], cfg, x1, x2, out, bw=bw, timing=10)
                products = 3 if prec == "Tf32x3" else 1
                tflops = products * 2.0 * M * N * K / (ms * 1e-3) / 1e12
                err = rel_error(out[:, :rows], ref)
                TIMINGS.append((label, vname, prec, ms, tflops, err, target))
                print(f"timing {label} {vname} {prec}: {ms:.2f} ms, {tflops:.0f} TFLOP/s, err {err:.2e} "
                      f"[{compiled(VARIANTS[vname], cfg)[2]}]", flush=True)
            except Exception as e:  # noqa: BLE001
                record("timing", f"{label} {vname} {prec}", False, f"{type(e).__name__}: {e}"[:300])
                traceback.print_exc()
        try:  # cuBLAS ceilings on the same shapes: one TF32 product, and bf16
            for name, dt, tf32 in (("torch mm TF32", torch.float32, True), ("torch mm bf16", torch.bfloat16, False)):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                p1, p2 = x1[0].to(dt), x2[0].to(dt)
                o = torch.empty(M, N, device=DEVICE, dtype=dt)
                times = []
                for i in range(8):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    torch.mm(p1, p2.t(), out=o)
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1))
                ms = sorted(times[2:])[len(times[2:]) // 2]
                TIMINGS.append((label, name, "-", ms, 2.0 * M * N * K / (ms * 1e-3) / 1e12, float("nan"), target))
                del p1, p2, o
            torch.backends.cuda.matmul.allow_tf32 = False
        except Exception as e:  # noqa: BLE001
            record("timing", f"{label} torch mm", False, f"{type(e).__name__}: {e}"[:300])
        del x1, x2, out, ref
        torch.cuda.empty_cache()


def main():
    global DEV, STREAM, SMS
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    cap = torch.cuda.get_device_capability()
    print(f"device: {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}", flush=True)
    SMS = torch.cuda.get_device_properties(0).multi_processor_count
    DEV = Device(torch.cuda.current_device())
    DEV.set_current()
    STREAM = torch_stream()
    if cap != (9, 0):
        print("not an sm_90 device: only the mma.sync variant can run; wgmma rows are skipped")
        for k in [k for k in VARIANTS if k != "mma"]:
            VARIANTS.pop(k)
    for cfg in sorted({c for c, _, _ in CASES}):
        for vname in VARIANTS:
            if vname != "wgmma":
                continue
            try:
                print(f"compiled {vname} {'/'.join(cfg)}: {compiled(VARIANTS[vname], cfg)[2]}", flush=True)
            except Exception as e:  # noqa: BLE001
                record("compile", f"{vname} {'/'.join(cfg)}", False, f"{type(e).__name__}: {e}"[:600])
    if "wgmma" in VARIANTS and "--no-correct" not in sys.argv:
        correctness("wgmma")
        package_path()
    for _extra in [a.split("=", 1)[1] for a in sys.argv if a.startswith("--correct=")]:
        for vname in _extra.split(","):
            if vname in VARIANTS:
                correctness(vname)
    if "--check-mma" in sys.argv:
        correctness("mma")
    if "--no-timing" not in sys.argv:
        timing()

    return summary()


def summary():
    print("\n==================== summary ====================")
    fails = [r for r in RESULTS if not r[2]]
    print(f"checks: {len(RESULTS) - len(fails)} passed, {len(fails)} failed")
    for sec, name, _, detail in fails:
        print(f"  FAIL {sec}: {name}: {detail}")
    print(f"{'workload':<12} {'kernel':<14} {'prec':<7} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9} {'target':>7}")
    for label, vname, prec, ms, tflops, err, target in TIMINGS:
        flag = "ok" if (prec == "Tf32x3" and ms <= target) else ""
        print(f"{label:<12} {vname:<14} {prec:<7} {ms:8.2f} {tflops:8.0f} {err:9.2e} {target:6.0f}  {flag}")
    print(f"(TFLOP/s counts the TF32 products: 3 per multiply-add for Tf32x3; total {time.perf_counter() - T0:.0f} s)")
    return 0 if not fails else 1


DEV = STREAM = None
SMS = 132

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", help="comma-separated variants timed instead of the default set")
    parser.add_argument("--also", action="append", help="comma-separated variants timed beside the default set")
    parser.add_argument("--mma", action="store_true", help="also time the mma.sync kernel")
    parser.add_argument("--correct", action="append", help="comma-separated variants also checked for correctness")
    parser.add_argument("--no-correct", action="store_true", help="skip the correctness cases")
    parser.parse_args()  # (the options are read from sys.argv where the module sets up its tables)
    sys.exit(main())
