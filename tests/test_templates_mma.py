"""Tests of cuda_templates/distance_mma.cuh, the tensor-core distance kernel.

CPU (CI):
  * NVRTC compiles a representative set of instantiations to cubin for sm_80
    and sm_90: no register spills, no local memory, and cuobjdump's SASS holds
    tensor-core instructions (HMMA).
  * Impossible combinations fail with their static_assert message.
  * A host emulation runs the kernel body itself on the CPU (g++, one fiber
    per CUDA thread, host versions of the header's few PTX primitives) and
    compares it with a float64 oracle: fragment layouts, shared-memory
    swizzle, cp.async zero-fill and pipeline waits, norms, epilogue, batch
    loop, hyper-parameters, output layouts and alignment paths.
GPU (marker gpu): the same oracle on the device, accuracy of Tf32x3 / Tf32 /
16-bit on random and clustered data, and (marker slow as well) the timings of
the two bench workloads.
"""
import io
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch

try:
    from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
except ImportError:  # cuda.core < 0.4
    from cuda.core.experimental import Device, LaunchConfig, Program, ProgramOptions, launch

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "cuda_templates"
NS = "kermac_like::"

# Mirror of DistanceMmaTraits' launch constants.
THREADS, BLOCK_M, BLOCK_N, SMEM_BYTES = 256, 128, 256, 99840

DTYPE_NAME = {torch.float32: "float", torch.float16: NS + "float16", torch.bfloat16: NS + "bfloat16"}


def traits(inner, outer, epilogue, out_layout, precision, dtype):
    return (
        f"{NS}DistanceMmaTraits<{NS}Inner::{inner}, {NS}Power::{outer}, {NS}Epilogue::{epilogue}, "
        f"{NS}Layout::RowMajor, {NS}Layout::RowMajor, {NS}Layout::{out_layout}, "
        f"{NS}Precision::{precision}, {DTYPE_NAME[dtype]}>"
    )


def kernel_name(*cfg):
    return f"{NS}distance_mma_kernel<{traits(*cfg)}>"


def stub(*cfgs):
    """The instantiation stub the launcher renders: include + constant checks."""
    lines = ['#include "distance_mma.cuh"']
    for cfg in cfgs:
        t = traits(*cfg)
        lines.append(
            f"static_assert({t}::kThreads == {THREADS} && {t}::kBlockM == {BLOCK_M} && "
            f"{t}::kBlockN == {BLOCK_N} && {t}::kSmemBytes == {SMEM_BYTES}, \"mirror\");"
        )
    return "\n".join(lines) + "\n"


def compile_cubin(cfgs, arch, extra_source=""):
    """Compile the kernels of cfgs in one NVRTC program; returns (cubin, ptxas log, seconds)."""

    log = io.StringIO()
    options = ProgramOptions(arch=arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    t0 = time.perf_counter()
    program = Program(stub(*cfgs) + extra_source, "c++", options)
    obj = program.compile("cubin", name_expressions=[kernel_name(*c) for c in cfgs], logs=log)
    return obj, log.getvalue(), time.perf_counter() - t0


# Representative shipped set: p=2 distance, squared distance, Laplace-l2,
# Gaussian, DOT, plain TF32 and both 16-bit types; both output layouts.
SHIPPED = [
    ("Diff", "Sqrt", "None", "RowMajor", "Tf32x3", torch.float32),
    ("Diff", "Noop", "None", "ColMajor", "Tf32x3", torch.float32),
    ("Diff", "Sqrt", "Laplace", "RowMajor", "Tf32x3", torch.float32),
    ("Diff", "Sqrt", "Gaussian", "ColMajor", "Tf32x3", torch.float32),
    ("Dot", "Noop", "None", "RowMajor", "Tf32x3", torch.float32),
    ("Diff", "Sqrt", "None", "RowMajor", "Tf32", torch.float32),
    ("Diff", "Sqrt", "None", "RowMajor", "Native16", torch.float16),
    ("Diff", "Sqrt", "Laplace", "ColMajor", "Native16", torch.bfloat16),
]


def _cuobjdump():
    """cuobjdump with nvdisasm beside it (--dump-sass needs both), or None."""
    candidates = [shutil.which("cuobjdump")]
    try:
        import nvidia

        for base in nvidia.__path__:
            candidates.append(os.path.join(base, "cu13", "bin", "cuobjdump"))
            candidates.append(os.path.join(base, "cuda_cuobjdump", "bin", "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c):
            here = os.path.dirname(c)
            if shutil.which("nvdisasm") or os.path.isfile(os.path.join(here, "nvdisasm")):
                return c
    return None


def sass_of(cubin_bytes):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump and nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin_bytes)
        env = dict(os.environ)
        env["PATH"] = os.path.dirname(tool) + os.pathsep + env.get("PATH", "")
        r = subprocess.run([tool, "--dump-sass", path], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def sass_functions(sass):
    """{mangled name: SASS text} from cuobjdump --dump-sass output."""
    parts = re.split(r"^\s*Function : (\S+)\s*$", sass, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# ---------------------------------------------------------------- compile tests


def representative_build(shipped, cfgs, arch, sass, functions_of):
    """{kernel name: (SASS text, ptxas report)} of ``cfgs`` for ``arch``: the shipped ones from the
    session's shipped build (conftest ``shipped``), the others compiled here. The stub of every cfg
    (its mirror's static_asserts) compiles in that program too, even where none is left to build.
    ``sass(cubin)``: the SASS dump, ``functions_of(sass)``: {lowered name: SASS text}."""
    from kermac_like.runtime.compiler import parse_ptxas_log
    from kermac_like.runtime.specs import shipped_specs

    by_name = {s.name_expression: s for s in shipped_specs() if s.supports(arch)}
    names = [kernel_name(*c) for c in cfgs]
    own = [c for c, n in zip(cfgs, names) if n not in by_name]
    out = {}
    built = shipped.kernels([by_name[n] for n in names if n in by_name], arch)
    for spec, (cubin, lowered, report) in built.items():
        out[spec.name_expression] = (functions_of(shipped.sass(cubin, sass))[lowered], report)

    log = io.StringIO()
    options = ProgramOptions(arch=arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    obj = Program(stub(*cfgs), "c++", options).compile("cubin", name_expressions=[kernel_name(*c) for c in own],
                                                       logs=log)
    if own:
        reports = parse_ptxas_log(log.getvalue())
        functions = functions_of(sass(bytes(obj.code)))
        mapping = dict(obj.symbol_mapping if hasattr(obj, "symbol_mapping") else obj._sym_map)
        for c in own:
            lowered = mapping[kernel_name(*c)]
            lowered = lowered.decode() if isinstance(lowered, bytes) else lowered
            out[kernel_name(*c)] = (functions[lowered], reports[lowered])
    return out


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_without_spills_and_uses_tensor_cores(shipped, arch):
    built = representative_build(shipped, SHIPPED, arch, sass_of, sass_functions)
    assert len(built) == len(SHIPPED)
    reports = [r for _, r in built.values()]
    assert all(r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in reports), reports
    regs = [r["registers"] for r in reports]
    assert max(regs) <= 255, reports
    functions = {name: text for name, (text, _) in built.items()}
    for name, text in functions.items():
        hmma = re.findall(r"\bHMMA\.(\w+)", text)
        assert hmma, f"no HMMA in {name}"
        assert "LDL" not in text and "STL" not in text, f"local memory in {name}"
        assert "LDGSTS" in text, f"no cp.async in {name}"
        # The epilogue's clamp at 0 keeps NaN: FMNMX.NAN only (a plain FMNMX turns NaN into 0).
        assert not re.search(r"\bFMNMX(?!\.NAN)\b", text), f"a NaN-dropping FMNMX in {name}"
    tf32 = [t for n, t in functions.items() if "HMMA.1688.F32.TF32" in t]
    f16 = [t for n, t in functions.items() if "HMMA.16816.F32" in t]
    assert len(tf32) == 6 and len(f16) == 2
    print(f"{arch}: {len(SHIPPED)} kernels, registers {regs}")


@pytest.mark.parametrize(
    "cfg, message",
    [
        (("Dot", "Sqrt", "None", "RowMajor", "Tf32x3", torch.float32), "Inner::Dot takes outer power Noop"),
        (("Dot", "Noop", "Laplace", "RowMajor", "Tf32x3", torch.float32), "Inner::Dot takes outer power Noop"),
        (("Diff", "Abs", "None", "RowMajor", "Tf32x3", torch.float32), "outer power Noop"),
        (("Diff", "Sqrt", "None", "RowMajor", "Native16", torch.float32), "Native16 takes"),
        (("Diff", "Sqrt", "None", "RowMajor", "Tf32", torch.float16), "Tf32x3/Tf32 take T = float"),
    ],
)
def test_impossible_combinations_fail_with_their_message(cfg, message):
    with pytest.raises(Exception) as info:
        compile_cubin([cfg], "sm_80")
    assert message in str(info.value)


def test_column_major_operands_are_rejected():
    name = (
        f"{NS}distance_mma_kernel<{NS}DistanceMmaTraits<{NS}Inner::Diff, {NS}Power::Sqrt, "
        f"{NS}Epilogue::None, {NS}Layout::ColMajor, {NS}Layout::RowMajor, {NS}Layout::RowMajor, "
        f"{NS}Precision::Tf32x3, float>>"
    )
    options = ProgramOptions(arch="sm_80", std="c++17", include_path=[str(TEMPLATES)])
    with pytest.raises(Exception) as info:
        Program('#include "distance_mma.cuh"\n', "c++", options).compile("cubin", name_expressions=[name])
    assert "a and b must be RowMajor" in str(info.value)


# ------------------------------------------------------------ float64 oracle


def _load_probe():
    """bench/probes/try_wgmma.py, the GPU probe: its float64 oracle is the one used here."""
    spec = importlib.util.spec_from_file_location("try_wgmma", ROOT / "bench" / "probes" / "try_wgmma.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_PROBE = _load_probe()
reference, bandwidth_for, rel_error, padded = _PROBE.reference, _PROBE.bandwidth_for, _PROBE.rel_error, _PROBE.padded


TOLERANCE = {"Tf32x3": 1e-5, "Tf32": 3e-3, "Native16": 1e-2}


# -------------------------------------------------------------- host emulation

EMULATED = [
    ("Diff", "Sqrt", "None", "RowMajor", "Tf32x3", torch.float32),
    ("Diff", "Noop", "Gaussian", "ColMajor", "Tf32x3", torch.float32),
    ("Diff", "Sqrt", "Laplace", "RowMajor", "Tf32", torch.float32),
    ("Dot", "Noop", "None", "ColMajor", "Tf32x3", torch.float32),
    ("Diff", "Sqrt", "Gaussian", "RowMajor", "Native16", torch.float16),
    ("Diff", "Noop", "Laplace", "ColMajor", "Native16", torch.bfloat16),
    ("Dot", "Noop", "None", "RowMajor", "Native16", torch.float16),
]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not installed")
    d = tmp_path_factory.mktemp("mma_emulator")
    runners = ",\n".join(
        "    &run<" + traits(*cfg).replace(NS, "") + ">" for cfg in EMULATED
    )
    (d / "emu.cpp").write_text(EMULATOR_SOURCE.replace("@@RUNNERS@@", runners))
    exe = d / "emu"
    r = subprocess.run(
        [gxx, "-std=c++17", "-O1", "-I", str(TEMPLATES), str(d / "emu.cpp"), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return str(exe)


def emulate(exe, cfg, a, b, *, ldo_pad=0, out_offset=0, bw=None, lam=0.0, reg_diag=0, eps=0.0,
            per_batch=False, grid_z=None, same=False, deferred=True):
    """Run the kernel in the emulator. a (La, M, K), b (Lb, N, K) with La, Lb in
    {1, batch}; batch mode 1 carries the batch (n1 = batch, n2 = 1).
    Returns (y (batch, M, N), reference, untouched padding is intact)."""
    dtype = cfg[5]
    La, M, K = a.shape
    Lb, N, _ = b.shape
    batch = max(La, Lb)
    esize = torch.empty(0, dtype=dtype).element_size()
    ld = -(-K // (16 // esize)) * (16 // esize)
    ap, bp = padded(a.to(dtype), 16 // esize), padded(b.to(dtype), 16 // esize)
    a_flat = ap.as_strided((La * M * ld,), (1,))  # the whole padded buffer
    b_flat = bp.as_strided((Lb * N * ld,), (1,))
    a_bs = 0 if La == 1 else M * ld
    b_bs = 0 if Lb == 1 else N * ld
    if cfg[3] == "RowMajor":
        ldo = N + ldo_pad
        o_bs = M * ldo
    else:
        ldo = M + ldo_pad
        o_bs = N * ldo
    out = torch.full((batch * o_bs,), float("nan"), dtype=dtype)
    bw = bandwidth_for(cfg, K) if bw is None else bw
    bw_t = torch.linspace(bw, 2 * bw, batch) if per_batch else torch.full((batch,), float(bw))
    lam_t = torch.linspace(lam, 2 * lam + 1, batch) if per_batch else torch.full((batch,), float(lam))
    ints = [M, N, K, ld, ld, ldo, batch, batch, 1,
            0, a_bs, 0, 0, b_bs, 0, 0, o_bs, 0,
            0, int(per_batch), 0, 0, int(per_batch), 0,
            reg_diag, -(-M // BLOCK_M), -(-N // BLOCK_N), grid_z or batch,
            int(per_batch), int(per_batch), int(same)]
    floats = [bw, lam, eps]
    with tempfile.TemporaryDirectory() as d:
        Path(d, "args.bin").write_bytes(struct.pack(f"<{len(ints)}q{len(floats)}d", *ints, *floats))

        def put(name, t, offset=0):
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            Path(d, name).write_bytes(struct.pack("<q", offset) + raw)

        put("a.bin", a_flat)
        put("b.bin", b_flat)
        put("out.bin", out, out_offset * esize)
        put("bw.bin", bw_t)
        put("reg.bin", lam_t)
        r = subprocess.run([exe, str(EMULATED.index(cfg)), str(int(deferred)), d],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        res = torch.frombuffer(bytearray(Path(d, "result.bin").read_bytes()), dtype=dtype)
    if cfg[3] == "RowMajor":
        y = torch.as_strided(res, (batch, M, N), (o_bs, ldo, 1))
    else:
        y = torch.as_strided(res, (batch, M, N), (o_bs, 1, ldo))
    written = torch.zeros_like(res, dtype=torch.bool)
    torch.as_strided(written, y.shape, y.stride()).fill_(True)
    untouched = bool(torch.isnan(res[~written].float()).all())
    ref = reference(cfg, a.to(dtype).expand(batch, -1, -1), b.to(dtype).expand(batch, -1, -1),
                    bw_t, lam_t, reg_diag, eps)
    return y, ref, untouched


@pytest.mark.parametrize("cfg", EMULATED, ids=lambda c: "-".join(map(str, c[:5])) + "-" + str(c[5])[6:])
def test_emulated_kernel_matches_float64(emulator, cfg):
    # 2 x 2 block tiles with ragged edges, a K tail, a broadcast batch of 2
    # walked by one grid layer, per-batch bandwidth and regularisation.
    g = torch.Generator().manual_seed(1)
    K = 37 if cfg[5] == torch.float32 else 45
    a = torch.randn(1, 130, K, generator=g)
    b = torch.randn(2, 260, K, generator=g)
    y, ref, untouched = emulate(emulator, cfg, a, b, lam=0.5, reg_diag=1, per_batch=True, grid_z=1)
    assert untouched
    assert not torch.isnan(y).any()
    assert rel_error(y, ref) <= TOLERANCE[cfg[4]]


@pytest.mark.parametrize("deferred", [True, False], ids=["copies-at-wait", "copies-at-issue"])
def test_emulated_pipeline_wraps_the_stages(emulator, deferred):
    # 10 k-tiles through 4 stages; odd tiny M, N.
    g = torch.Generator().manual_seed(2)
    cfg = EMULATED[0]
    a, b = torch.randn(1, 7, 150, generator=g), torch.randn(1, 5, 150, generator=g)
    y, ref, untouched = emulate(emulator, cfg, a, b, deferred=deferred)
    assert untouched and rel_error(y, ref) <= 1e-5


def test_emulated_single_element(emulator):
    cfg = EMULATED[0]
    a, b = torch.tensor([[[3.0]]]), torch.tensor([[[-1.0]]])
    y, ref, untouched = emulate(emulator, cfg, a, b)
    assert untouched and y.item() == 4.0


def test_emulated_self_distance_is_exactly_zero(emulator):
    # b aliases a (same pointer, same ld): the diagonal must be exactly 0, in
    # every block it crosses (3 x 2 blocks here), plus lambda where regularised.
    g = torch.Generator().manual_seed(3)
    cfg = EMULATED[0]
    a = 10 + torch.randn(1, 300, 32, generator=g)  # far from the origin: large cancellation
    y, ref, untouched = emulate(emulator, cfg, a, a, same=True)
    assert untouched
    assert (torch.diagonal(y[0]) == 0).all()
    assert rel_error(y, ref) <= 1e-5
    y, _, _ = emulate(emulator, cfg, a[:, :140], a[:, :140], same=True, lam=1.5, reg_diag=0)
    assert (torch.diagonal(y[0]) == 1.5).all()


@pytest.mark.parametrize("cfg", EMULATED[:2], ids=lambda c: "-".join(map(str, c[:5])))
def test_emulated_near_pairs_take_direct_differences(emulator, cfg):
    """Exact duplicates in other memory give exactly 0 and near duplicates their float32-grade
    distance (the near pairs' rewrite, distance_mma.cuh), every entry of a ragged tile; without
    the rewrite (KERMAC_LIKE_NEAR_SHARE 0) the distance configuration fails both checks."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(1, 150, 64, generator=g)
    b = torch.cat([torch.randn(1, 100, 64, generator=g), a[:, :40], a[:, 40:70] + 1e-3 * torch.randn(1, 30, 64, generator=g)], 1)
    y, ref, untouched = emulate(emulator, cfg, a, b, bw=2.0 if cfg[2] != "None" else None)
    assert untouched
    dup = y[0, torch.arange(40), 100 + torch.arange(40)]
    assert (dup == (0.0 if cfg[2] == "None" else 1.0)).all(), dup
    near = y[0, 40 + torch.arange(30), 140 + torch.arange(30)].double()
    want = ref[0, 40 + torch.arange(30), 140 + torch.arange(30)]
    assert ((near - want).abs() <= 1e-6 * want.abs().clamp_min(1e-30) + (0 if cfg[2] == "None" else 1e-7)).all()
    assert rel_error(y, ref) <= 1e-5


def test_emulated_epsilon_and_shifted_regularisation(emulator):
    g = torch.Generator().manual_seed(4)
    cfg = EMULATED[0]
    a = torch.randn(1, 40, 20, generator=g)
    b = torch.cat([a[:, :10] + 1e-4, torch.randn(1, 30, 20, generator=g)], 1)  # 10 near-duplicates
    y, ref, _ = emulate(emulator, cfg, a, b, eps=0.05, lam=2.0, reg_diag=-3)
    assert (torch.diagonal(y[0])[:10] == 0).all()
    assert rel_error(y, ref) <= 1e-5


def test_emulated_unaligned_output_takes_the_scalar_path(emulator):
    g = torch.Generator().manual_seed(5)
    for cfg in (EMULATED[0], EMULATED[4]):
        a, b = torch.randn(1, 33, 24, generator=g), torch.randn(1, 45, 24, generator=g)
        y, ref, untouched = emulate(emulator, cfg, a, b, ldo_pad=3, out_offset=1)
        assert untouched and rel_error(y, ref) <= TOLERANCE[cfg[4]]


def nonfinite_operands(M=40, N=30, K=20, seed=6):
    """Random a (1, M, K), b (1, N, K) with a NaN (a row 3), infinities of both signs
    against random-signed coordinates (a rows 5, 6), and the same +inf on both sides
    (a row 5, b row 2: inf - inf)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(1, M, K, generator=g), torch.randn(1, N, K, generator=g)
    a[0, 3, 1] = float("nan")
    a[0, 5, 0] = float("inf")
    a[0, 6, 2] = -float("inf")
    b[0, 2, 0] = float("inf")
    return a, b


def assert_same_nonfinite(y, ref, tol):
    y, ref = y.double(), ref.double()
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), (torch.isnan(y) != torch.isnan(ref)).nonzero()[:5]
    assert torch.equal(torch.isposinf(y), torch.isposinf(ref))
    assert torch.equal(torch.isneginf(y), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert rel_error(y[fin], ref[fin]) <= tol


@pytest.mark.parametrize("cfg", [c for c in EMULATED if c[0] == "Diff"],
                         ids=lambda c: "-".join(map(str, c[:5])) + "-" + str(c[5])[6:])
def test_emulated_nan_and_inf_like_torch_matrix_product(emulator, cfg):
    # The oracle is torch's matrix-product formula in float64 (IEEE products: inf * 0 and
    # inf - inf are NaN, inf against an opposite-signed coordinate is +inf), as in
    # torch.cdist(compute_mode="use_mm_for_euclid_dist"), except that this kernel's 3xTF32
    # split may make +inf NaN (distance_mma.cuh); NaN must never be clamped away.
    a, b = nonfinite_operands()
    y, ref, untouched = emulate(emulator, cfg, a, b, lam=0.5, reg_diag=1)
    assert untouched
    assert torch.isnan(ref[0, 3]).all() and torch.isnan(ref[0, 5]).any()
    if cfg[2] == "None":
        assert torch.isinf(ref[0, 5]).any() and torch.isinf(ref[0, :, 2]).any()
    if cfg[4] == "Tf32x3":  # this kernel's split may turn torch's +inf into NaN (inf * 0)
        y, ref = y.double(), ref.double()
        may = torch.isinf(a).any(-1)[..., :, None] | torch.isinf(b).any(-1)[..., None, :]
        assert (~(torch.isnan(y) & ~torch.isnan(ref)) | may).all() and (torch.isnan(y) | ~torch.isnan(ref)).all()
        keep = ~torch.isnan(y)
        assert torch.equal(torch.isinf(y[keep]), torch.isinf(ref[keep]))
        fin = keep & torch.isfinite(ref)
        assert rel_error(y[fin], ref[fin]) <= TOLERANCE[cfg[4]]
    else:
        assert_same_nonfinite(y, ref, TOLERANCE[cfg[4]])


# ----------------------------------------------------------------------- GPU


def _gpu():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


gpu = pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU of compute capability 8.0 or newer")
_KERNELS = {}


def _kernel(cfg):
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    key = (cfg, arch)
    if key not in _KERNELS:
        dev = Device(torch.cuda.current_device())
        dev.set_current()
        obj, _, _ = compile_cubin([cfg], arch)
        kernel = obj.get_kernel(kernel_name(*cfg))
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        handle = kernel.handle if hasattr(kernel, "handle") else kernel._handle
        if isinstance(handle, driver.CUkernel):
            (err,) = driver.cuKernelSetAttribute(attr, SMEM_BYTES, handle, driver.CUdevice(dev.device_id))
        else:
            (err,) = driver.cuFuncSetAttribute(handle, attr, SMEM_BYTES)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        _KERNELS[key] = (dev, dev.create_stream(), kernel)
    return _KERNELS[key]


def gpu_run(cfg, a, b, out, *, bw=1.0, lam=0.0, reg_diag=0, eps=0.0, bw_t=None, lam_t=None,
            grid_z=None, repeat=1):
    """Launch on CUDA tensors a (La, M, K), b (Lb, N, K) (rows 16-byte aligned)
    into out (batch, M, N) laid out as cfg says; returns seconds per launch."""
    import numpy as np

    dev, stream, kernel = _kernel(cfg)
    La, M, K = a.shape
    Lb, N, _ = b.shape
    batch = out.shape[0]
    assert a.stride(-1) == 1 and b.stride(-1) == 1
    ldo = out.stride(1) if cfg[3] == "RowMajor" else out.stride(2)
    i32, i64, f32 = np.int32, np.int64, np.float32

    def hp(t, value):
        return [t.data_ptr(), i64(0), i64(t.stride(0) if t.shape[0] > 1 else 0), i64(0), f32(value)] \
            if t is not None else [0, i64(0), i64(0), i64(0), f32(value)]

    args = [a.data_ptr(), b.data_ptr(), out.data_ptr(), i32(M), i32(N), i32(K),
            i64(a.stride(1)), i64(b.stride(1)), i64(ldo), i32(batch), i32(batch), i32(1),
            i64(0), i64(a.stride(0) if La > 1 else 0), i64(0),
            i64(0), i64(b.stride(0) if Lb > 1 else 0), i64(0),
            i64(0), i64(out.stride(0) if batch > 1 else 0), i64(0),
            *hp(None, 0.0), *hp(None, 0.0), *hp(bw_t, bw), *hp(lam_t, lam), i64(reg_diag), f32(eps),
            0, 0, i32(0), *(i64(0),) * 10]  # no operands as given (ABI.md): near pairs from a and b
    grid = (-(-M // BLOCK_M), -(-N // BLOCK_N), min(grid_z or batch, 65535))
    config = LaunchConfig(grid=grid, block=(THREADS, 1, 1), shmem_size=SMEM_BYTES)
    torch.cuda.synchronize()
    launch(stream, config, kernel, *args)  # warm-up / the result
    stream.sync()
    if repeat <= 1:
        return None
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        launch(stream, config, kernel, *args)
        stream.sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def gpu_case(cfg, a, b, **kw):
    """a, b on the GPU (any rows); returns (y, float64 reference)."""
    dtype = cfg[5]
    align = 16 // torch.empty(0, dtype=dtype).element_size()
    ap, bp = padded(a.to(dtype), align), padded(b.to(dtype), align)
    batch, M, N = max(a.shape[0], b.shape[0]), a.shape[1], b.shape[1]
    if cfg[3] == "RowMajor":
        out = torch.full((batch, M, N), float("nan"), dtype=dtype, device="cuda")
    else:
        out = torch.full((batch, N, M), float("nan"), dtype=dtype, device="cuda").transpose(1, 2)
    bw = kw.pop("bw", bandwidth_for(cfg, a.shape[2]))
    lam, reg_diag, eps = kw.pop("lam", 0.0), kw.pop("reg_diag", 0), kw.pop("eps", 0.0)
    gpu_run(cfg, ap, bp, out, bw=bw, lam=lam, reg_diag=reg_diag, eps=eps, **kw)
    ref = reference(cfg, ap.expand(batch, -1, -1), bp.expand(batch, -1, -1),
                    torch.full((batch,), float(bw)), torch.full((batch,), float(lam)), reg_diag, eps)
    return out, ref


GPU_CFGS = list(dict.fromkeys(EMULATED + SHIPPED))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CFGS, ids=lambda c: "-".join(map(str, c[:5])) + "-" + str(c[5])[6:])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 5, 3), (127, 129, 100), (129, 1000, 257), (300, 260, 1000)])
def test_gpu_matches_float64(cfg, shape):
    M, N, K = shape
    # Seeded: with Tf32 products, the error of one pair is relative to |a| |b| (the
    # cancellation in |a|^2 + |b|^2 - 2 a.b), so at (1, 1, 1) an unlucky random draw
    # exceeded the Frobenius tolerance meant for many pairs (6.7e-3 once on an H200).
    g = torch.Generator(device="cuda").manual_seed(M * 1_000_003 + N * 1009 + K)
    a = torch.randn(1, M, K, device="cuda", generator=g)
    b = torch.randn(2, N, K, device="cuda", generator=g)
    y, ref = gpu_case(cfg, a, b, lam=0.25, reg_diag=1, grid_z=1)
    assert not torch.isnan(y).any()
    assert rel_error(y, ref) <= TOLERANCE[cfg[4]]


@gpu
@pytest.mark.gpu
def test_gpu_self_distance_is_exactly_zero():
    cfg = SHIPPED[0]
    x = padded(10 + torch.randn(1, 1000, 300, device="cuda"), 4)
    out = torch.empty(1, 1000, 1000, device="cuda")
    gpu_run(cfg, x, x, out)
    assert (torch.diagonal(out[0]) == 0).all()


def clustered(n, k, *, clusters=50, spread=1e-3, center_scale=1.0, generator=None, device="cuda"):
    """Tight clusters around random centres, with exact and near duplicates."""
    centres = center_scale * torch.randn(clusters, k, generator=generator)
    labels = torch.randint(0, clusters, (n,), generator=generator)
    x = centres[labels] + spread * torch.randn(n, k, generator=generator)
    x[1::7] = x[0::7][: x[1::7].shape[0]]  # exact duplicates
    x[2::7] = x[0::7][: x[2::7].shape[0]] + 1e-6 * torch.randn_like(x[2::7])  # near duplicates
    return x.to(device)


@gpu
@pytest.mark.gpu
def test_gpu_accuracy_of_each_precision():
    """Relative Frobenius error of cdist p=2 vs float64; Tf32x3 must be <= 1e-5."""
    g = torch.Generator().manual_seed(7)
    data = {
        "random": (torch.randn(3000, 1024, generator=g).cuda(), torch.randn(2000, 1024, generator=g).cuda()),
        "clustered": (clustered(3000, 1024, generator=g), clustered(2000, 1024, generator=g)),
        "clustered-far": (clustered(3000, 1024, center_scale=10.0, generator=g),
                          clustered(2000, 1024, center_scale=10.0, generator=g)),
    }
    report = {}
    for name, (x1, x2) in data.items():
        ref = torch.cdist(x1.double(), x2.double())
        for prec, dtype in (("Tf32x3", torch.float32), ("Tf32", torch.float32),
                            ("Native16", torch.float16), ("Native16", torch.bfloat16)):
            cfg = ("Diff", "Sqrt", "None", "RowMajor", prec, dtype)
            align = 16 // torch.empty(0, dtype=dtype).element_size()
            out = torch.empty(1, x1.shape[0], x2.shape[0], dtype=dtype, device="cuda")
            gpu_run(cfg, padded(x1[None].to(dtype), align), padded(x2[None].to(dtype), align), out)
            exact = ref if dtype == torch.float32 else torch.cdist(x1.to(dtype).double(), x2.to(dtype).double())
            report[(name, prec, str(dtype))] = rel_error(out[0], exact)
    torch_err = {name: rel_error(torch.cdist(x1, x2), torch.cdist(x1.double(), x2.double()))
                 for name, (x1, x2) in data.items()}
    for key, err in report.items():
        print(f"accuracy {key}: {err:.3e}")
    print("torch.cdist float32:", {k: f"{v:.3e}" for k, v in torch_err.items()})
    assert report[("random", "Tf32x3", "torch.float32")] <= 1e-5
    assert report[("clustered", "Tf32x3", "torch.float32")] <= 1e-5


@gpu
@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_bench_workloads():
    """Timings of the two bench rows (printed; the targets are 15 ms and 12 ms)."""
    rows = [
        ("cdist p=2 30000x30000x1024", ("Diff", "Sqrt", "None", "RowMajor"), 30000, 30000, 1024),
        ("Laplace-l2 50000x50000x256", ("Diff", "Sqrt", "Laplace", "RowMajor"), 50000, 50000, 256),
    ]
    for label, head, M, N, K in rows:
        x1 = torch.randn(1, M, K, device="cuda")
        x2 = torch.randn(1, N, K, device="cuda")
        out = torch.empty(1, M, N, device="cuda")
        for prec in ("Tf32x3", "Tf32"):
            seconds = gpu_run(head + (prec, torch.float32), x1, x2, out, bw=float(K) ** 0.5, repeat=5)
            products = 3 if prec == "Tf32x3" else 1
            tflops = products * 2.0 * M * N * K / seconds / 1e12
            print(f"bench {label} {prec}: {seconds * 1e3:.2f} ms, {tflops:.0f} TFLOP/s of TF32 products")
        del out
        torch.cuda.empty_cache()


# C++ of the host emulation; @@RUNNERS@@ becomes the table of EMULATED traits.
EMULATOR_SOURCE = r'''#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#define __device__
#define __forceinline__ inline
#define __noinline__
#define __global__
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
#define KERMAC_LIKE_MMA_HOST_EMULATION 1

struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::min;

static void fail(const char* what) {
  std::fprintf(stderr, "EMULATION FAILURE: %s\n", what);
  std::exit(3);
}

namespace emu {
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  Dim3 tid;
  bool done = false;
  std::deque<std::vector<int>> groups;  // committed cp.async groups (indices into copies)
  std::vector<int> pending;             // issued, not yet committed
};
struct Copy { unsigned dst; const unsigned char* src; int bytes; };

Dim3 block_idx, grid_dim;
int nthreads = 0;
Fiber* fibers = nullptr;
Fiber* cur = nullptr;
ucontext_t sched;
long progress = 0;
bool deferred = true;         // cp.async completes at wait_group (true) or at issue
unsigned smem_limit = 0;
std::vector<Copy> copies;

inline int lane() { return cur->tid.x & 31; }
inline int warp() { return cur->tid.x >> 5; }
inline void yield() { swapcontext(&cur->ctx, &sched); }

struct Barrier {
  int count = 0;
  long gen = 0;
  void wait(int n) {
    long g = gen;
    ++progress;
    if (++count == n) { count = 0; ++gen; return; }
    while (gen == g) yield();
  }
};
Barrier block_bar;
struct Warp {
  Barrier bar;
  unsigned u[32][8];
  float f[32][4];
} warps[32];
inline void warp_sync() { warps[warp()].bar.wait(32); }
}  // namespace emu

#define threadIdx (emu::cur->tid)
#define blockIdx (emu::block_idx)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::block_bar.wait(emu::nthreads); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  auto& w = emu::warps[emu::warp()];
  const int l = emu::lane();
  w.f[l][0] = v;
  emu::warp_sync();
  const float r = w.f[l ^ mask][0];
  emu::warp_sync();
  return r;
}

namespace kermac_like {
alignas(128) unsigned char smem[1 << 18];
}

// ------------------------------------------------- host versions of the PTX primitives
namespace kermac_like {
struct float16;
struct bfloat16;
namespace mma_detail {

inline unsigned smem_u32(const void* p) {
  return (unsigned)((const unsigned char*)p - kermac_like::smem);
}
inline void run_copy(const emu::Copy& c) {
  unsigned char* d = kermac_like::smem + c.dst;
  if (c.bytes > 0) std::memcpy(d, c.src, c.bytes);
  std::memset(d + c.bytes, 0, 16 - c.bytes);
}
inline void cp_async_16(unsigned dst, const void* src, int bytes) {
  if (bytes < 0 || bytes > 16) fail("cp.async byte count outside [0, 16]");
  if (dst % 16 != 0) fail("cp.async shared destination not 16-byte aligned");
  if (dst + 16 > emu::smem_limit) fail("cp.async writes beyond kSmemBytes");
  if (bytes > 0 && (reinterpret_cast<uintptr_t>(src) % 16) != 0)
    fail("cp.async global source not 16-byte aligned");
  emu::Copy c{dst, (const unsigned char*)src, bytes};
  if (!emu::deferred) { run_copy(c); return; }
  emu::copies.push_back(c);
  emu::cur->pending.push_back((int)emu::copies.size() - 1);
}
inline void cp_async_commit() {
  emu::cur->groups.push_back(emu::cur->pending);
  emu::cur->pending.clear();
}
template <int kPending>
inline void cp_async_wait() {
  auto& g = emu::cur->groups;
  while ((int)g.size() > kPending) {
    for (int i : g.front()) run_copy(emu::copies[i]);
    g.pop_front();
  }
}

// Tensor cores read .tf32 operands as their top 19 bits; products are exact,
// the sum is taken here in double and rounded once.
inline double tf32_value(unsigned u) { return (double)__uint_as_float(u & 0xffffe000u); }

inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  auto& w = emu::warps[emu::warp()];
  const int l = emu::lane(), g = l >> 2, t = l & 3;
  for (int r = 0; r < 4; ++r) w.u[l][r] = a[r];
  w.u[l][4] = b0;
  w.u[l][5] = b1;
  emu::warp_sync();
  float res[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double s = d[e];
    for (int k = 0; k < 8; ++k) {
      const double av = tf32_value(w.u[(row % 8) * 4 + k % 4][(row >= 8) + 2 * (k >= 4)]);
      const double bv = tf32_value(w.u[col * 4 + k % 4][4 + (k >= 4)]);
      s += av * bv;
    }
    res[e] = (float)s;
  }
  emu::warp_sync();
  for (int e = 0; e < 4; ++e) d[e] = res[e];
}

inline float half_bits_to_float(unsigned short h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return (float)v;
}
inline unsigned short float_to_half_bits(float x) {
  _Float16 v = (_Float16)x;
  unsigned short h;
  std::memcpy(&h, &v, 2);
  return h;
}
inline unsigned short float_to_bf16_bits(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}

template <class T>
struct Convert16;
template <>
struct Convert16<float16> {
  static float lo(unsigned w) { return half_bits_to_float((unsigned short)(w & 0xffffu)); }
  static float hi(unsigned w) { return half_bits_to_float((unsigned short)(w >> 16)); }
  static unsigned short one(float x) { return float_to_half_bits(x); }
  static unsigned two(float lo_x, float hi_x) {
    return (unsigned)float_to_half_bits(lo_x) | ((unsigned)float_to_half_bits(hi_x) << 16);
  }
};
template <>
struct Convert16<bfloat16> {
  static float lo(unsigned w) { return __uint_as_float(w << 16); }
  static float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
  static unsigned short one(float x) { return float_to_bf16_bits(x); }
  static unsigned two(float lo_x, float hi_x) {
    return (unsigned)float_to_bf16_bits(lo_x) | ((unsigned)float_to_bf16_bits(hi_x) << 16);
  }
};

template <class T>
struct Mma16 {
  static void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    auto& w = emu::warps[emu::warp()];
    const int l = emu::lane(), g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) w.u[l][r] = a[r];
    w.u[l][4] = b0;
    w.u[l][5] = b1;
    emu::warp_sync();
    auto elem = [](unsigned word, int k) {
      return (double)(k % 2 ? Convert16<T>::hi(word) : Convert16<T>::lo(word));
    };
    float res[4];
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
      double s = d[e];
      for (int k = 0; k < 16; ++k) {
        const double av = elem(w.u[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k);
        const double bv = elem(w.u[col * 4 + (k % 8) / 2][4 + (k >= 8)], k);
        s += av * bv;
      }
      res[e] = (float)s;
    }
    emu::warp_sync();
    for (int e = 0; e < 4; ++e) d[e] = res[e];
  }
};

inline float sqrt_approx(float x) { return std::sqrt(x); }
inline float exp2_approx(float x) { return std::exp2(x); }

// the warp's near-pair rewrite (distance_mma.cuh)
inline unsigned near_ballot(bool p) {
  auto& w = emu::warps[emu::warp()];
  w.u[emu::lane()][6] = p;
  emu::warp_sync();
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (w.u[l][6] != 0u ? 1u : 0u) << l;
  emu::warp_sync();
  return r;
}
inline int near_shfl(int v, int src) {
  auto& w = emu::warps[emu::warp()];
  w.u[emu::lane()][5] = (unsigned)v;
  emu::warp_sync();
  const int r = (int)w.u[src][5];
  emu::warp_sync();
  return r;
}
inline double near_sum(double v) {
  static double parts[32][32];
  const int wp = emu::warp(), l = emu::lane();
  parts[wp][l] = v;
  emu::warp_sync();
  double r = 0.0;  // the tree of shfl_xor 16, 8, 4, 2, 1
  double t[32];
  for (int i = 0; i < 32; ++i) t[i] = parts[wp][i];
  for (int o = 16; o > 0; o >>= 1)
    for (int i = 0; i < 32; ++i) if (i < (i ^ o)) { const double a = t[i] + t[i ^ o]; t[i] = a; t[i ^ o] = a; }
  r = t[l];
  emu::warp_sync();
  return r;
}

}  // namespace mma_detail
}  // namespace kermac_like

#include "distance_mma.cuh"

// One block: thread i is fiber i running tramp (which marks its fiber done at the end), the fibers
// scheduled round-robin until every one is done; a round in which none progressed is a deadlock.
inline void run_block(std::vector<emu::Fiber>& fib, int threads, void (*tramp)()) {
  for (int i = 0; i < threads; ++i) {
    auto& f = fib[i];
    f.stack.resize(1 << 18);
    f.tid = {(unsigned)i, 0, 0};
    f.done = false;
    f.groups.clear();
    f.pending.clear();
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &emu::sched;
    makecontext(&f.ctx, tramp, 0);
  }
  for (;;) {
    bool all_done = true;
    const long before = emu::progress;
    for (int i = 0; i < threads; ++i) {
      if (fib[i].done) continue;
      all_done = false;
      emu::cur = &fib[i];
      swapcontext(&emu::sched, &fib[i].ctx);
    }
    if (all_done) break;
    if (emu::progress == before) fail("deadlock: no thread progressed (divergent barrier?)");
  }
}

// A whole file's bytes (the drivers' inputs).
static std::vector<unsigned char> slurp(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("cannot open input");
  std::fseek(f, 0, SEEK_END);
  long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<unsigned char> v(n);
  if (n && std::fread(v.data(), 1, n, f) != (size_t)n) fail("short read");
  std::fclose(f);
  return v;
}

// A grid of gx x gy CTAs of Tr::kThreads fibers, each running f (a lambda calling the kernel), one
// CTA after another; shared memory poisoned with NaN before each. For the other emulated templates'
// drivers (tests/mma_emulator.py).
template <class Tr, class F>
void launch_grid(unsigned gx, unsigned gy, F f) {
  emu::smem_limit = Tr::kSmemBytes;
  emu::grid_dim = {gx, gy, 1};
  emu::nthreads = Tr::kThreads;
  static std::vector<emu::Fiber> fib(Tr::kThreads);
  emu::fibers = fib.data();
  static F* body;
  body = &f;
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      emu::block_idx = {bx, by, 0};
      std::memset(kermac_like::smem, 0xff, sizeof(kermac_like::smem));  // NaN poison
      emu::copies.clear();
      static auto tramp = +[]() {
        (*body)();
        emu::cur->done = true;
        ++emu::progress;
      };
      run_block(fib, Tr::kThreads, tramp);
    }
}

// ------------------------------------------------------------------ driver
using namespace kermac_like;
typedef long long i64;

// Every scalar travels as an i64 (floats as doubles) in this order.
struct Args {
  i64 M, N, K, lda, ldb, ldo, batch, n1, n2;
  i64 abs_[3], bbs[3], obs[3], bw_bs[3], reg_bs[3];
  i64 reg_diag, gx, gy, gz, use_bw_ptr, use_reg_ptr, b_is_a;
  double bandwidth, regularization, epsilon;
};
template <class Traits>
void run(const Args& A, const void* a, const void* b, void* out, const float* bwp, const float* regp) {
  using T = typename Traits::T;
  emu::smem_limit = Traits::kSmemBytes;
  emu::grid_dim = {(unsigned)A.gx, (unsigned)A.gy, (unsigned)A.gz};
  emu::nthreads = Traits::kThreads;
  static std::vector<emu::Fiber> fib(Traits::kThreads);
  emu::fibers = fib.data();
  for (unsigned bz = 0; bz < (unsigned)A.gz; ++bz)
    for (unsigned by = 0; by < (unsigned)A.gy; ++by)
      for (unsigned bx = 0; bx < (unsigned)A.gx; ++bx) {
        emu::block_idx = {bx, by, bz};
        std::memset(kermac_like::smem, 0xff, sizeof(kermac_like::smem));  // NaN poison
        emu::copies.clear();
        struct Launch {
          const Args* A; const void *a, *b; void* out; const float *bwp, *regp;
        };
        static Launch L;
        L = {&A, a, b, out, bwp, regp};
        static auto body = []() {
          const Args& A = *L.A;
          distance_mma_kernel<Traits>(
              (const T*)L.a, (const T*)L.b, (T*)L.out, (int)A.M, (int)A.N, (int)A.K, A.lda, A.ldb,
              A.ldo, (int)A.batch, (int)A.n1, (int)A.n2, A.abs_[0], A.abs_[1], A.abs_[2], A.bbs[0], A.bbs[1], A.bbs[2], A.obs[0],
              A.obs[1], A.obs[2], nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, 0.f, L.bwp, A.bw_bs[0],
              A.bw_bs[1], A.bw_bs[2], (float)A.bandwidth, L.regp, A.reg_bs[0], A.reg_bs[1], A.reg_bs[2],
              (float)A.regularization, A.reg_diag, (float)A.epsilon);
          emu::cur->done = true;
          ++emu::progress;
        };
        static auto tramp = +[]() { body(); };
        run_block(fib, Traits::kThreads, tramp);
      }
}

typedef void (*Runner)(const Args&, const void*, const void*, void*, const float*, const float*);
static const Runner kRunners[] = {
@@RUNNERS@@
};

// usage: emu CFG DEFERRED DIR  (DIR holds args.bin a.bin b.bin out.bin bw.bin reg.bin)
int main(int argc, char** argv) {
  if (argc != 4) fail("usage: emu CFG DEFERRED DIR");
  const int cfg = std::atoi(argv[1]);
  emu::deferred = std::atoi(argv[2]) != 0;
  std::string dir = argv[3];
  auto args = slurp(dir + "/args.bin");
  if (args.size() != sizeof(Args)) fail("args.bin has the wrong size");
  Args A;
  std::memcpy(&A, args.data(), sizeof(Args));
  // Each array goes to 256-byte aligned memory plus the byte offset that its
  // file names in its first 8 bytes (for the alignment tests).
  auto place = [&](const char* name, std::vector<unsigned char>& store) -> unsigned char* {
    auto raw = slurp(dir + "/" + name);
    i64 offset;
    std::memcpy(&offset, raw.data(), 8);
    store.assign(raw.size() - 8 + offset + 512, 0);
    unsigned char* base = store.data();
    base += (256 - reinterpret_cast<uintptr_t>(base) % 256) % 256;
    std::memcpy(base + offset, raw.data() + 8, raw.size() - 8);
    return base + offset;
  };
  std::vector<unsigned char> sa, sb, so, sbw, sreg;
  unsigned char* a = place("a.bin", sa);
  unsigned char* b = place("b.bin", sb);
  unsigned char* out = place("out.bin", so);
  unsigned char* bw = place("bw.bin", sbw);
  unsigned char* reg = place("reg.bin", sreg);
  if (cfg < 0 || cfg >= (int)(sizeof(kRunners) / sizeof(kRunners[0]))) fail("bad config");
  kRunners[cfg](A, a, A.b_is_a ? a : b, out, A.use_bw_ptr ? (const float*)bw : nullptr,
                A.use_reg_ptr ? (const float*)reg : nullptr);
  auto raw = slurp(dir + "/out.bin");
  FILE* f = std::fopen((dir + "/result.bin").c_str(), "wb");
  std::fwrite(out, 1, raw.size() - 8, f);
  std::fclose(f);
  return 0;
}
'''
