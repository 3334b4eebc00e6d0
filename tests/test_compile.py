"""Compiler, renderer and CLI without a GPU: every shipped instantiation compiles
to cubin for sm_80 and sm_90, a second precompile compiles nothing, errors carry
NVRTC's log."""

import json

import pytest

import kermac_like as km
from kermac_like.runtime import compiler
from kermac_like.runtime import specs as render
from kermac_like.runtime.specs import KernelSpec, LaunchShape


class _Cli:
    """``python -m kermac_like ARGS`` on the kernel cache in ``cache_dir``, run in this process (its
    main, the cache opened anew from the file before and after: what a new process would find; a new
    process's own key computation is test_bundle.py's warm-first-call child's): (exit status, stdout,
    stderr). A process per command cost ~2.5 CPU-s of imports each."""

    def __init__(self, monkeypatch, capsys):
        self.monkeypatch, self.capsys = monkeypatch, capsys

    def __call__(self, *args, cache_dir):
        import kermac_like.__main__ as cli
        from kermac_like.runtime import cache as kernel_cache

        self.monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(cache_dir))
        kernel_cache.reset_cache()
        try:
            rc = cli.main(list(args))
        except SystemExit as e:
            rc = e.code
        finally:
            kernel_cache.reset_cache()
        out, err = self.capsys.readouterr()
        return rc, out, err


@pytest.fixture
def run_cli(monkeypatch, capsys):
    return _Cli(monkeypatch, capsys)


# Spilled bytes (ptxas "spill stores") the shipped kernels of a template may have, per kernel template,
# as compiled by NVRTC 13.5 for sm_80 and sm_90 on 2026-11-26 (session 12); every other template: none.
# The largest of each (bench/notes/jit.md, "Spills of the shipped set"): a record of the state, so that a
# change that makes a kernel spill more, or a new family that spills at all, fails here.
SPILL_ALLOWANCE = {
    "distance_kernel": 68,  # SIMT distance, sm_90 two-block builds: outside the k loop (notes/history.md)
    "distance_lowk_kernel": 48,  # a few words around the loads / epilogue, none in the k loop (notes/lowk.md)
    "cdist_grad_mma_kernel": 32,
    "lse_kernel": 28,  # log2f's slow path in the epilogue (notes/logsumexp.md)
    "matvec_wgmma_kernel": 396,  # kC = 16: the loop state; 1.03-1.83x faster than chunks of 8 (notes/jit.md)
    "topk_kernel": 8,
    # the l1 (Abs) gradient at 3 coordinates, sm_80: 4 bytes outside the pair loop (session 22, the AGOP's
    # lanes per row; bench/notes/rfm.md)
    "matvec_grad_kernel": 4,
    # 128 x 256 tiles with partial sums column half by column half (wgmma_tile 256), sm_90a: the loader at 24
    # registers keeps 3 values in local memory (16 bytes, read once a k-tile); 17.4 against 19.1 ms of the
    # 128 x 128 tiles at cdist p = 2 30000^2 x 1024 on an H200 (bench/notes/data_zoo.md, session 23)
    "distance_wgmma_kernel": 16,
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_precompile_all_then_nothing(shipped, arch, run_cli):
    """Every shipped instantiation compiles for the architecture (the one compile of the shipped set
    in the CPU suite: conftest's session build ``shipped``, which the SASS tests read too; the
    per-family tests compile only what is not shipped), no kernel spills beyond its template's
    SPILL_ALLOWANCE, and a second precompile (the CLI, a new process) compiles nothing. The kernels
    the install prebuilt (kermac_like/prebuilt/) come from that bundle with their ptxas reports
    instead of a second compile (tests/shipped_build.py)."""
    d, first, reports = shipped.build(arch)
    n = len([s for s in render.shipped_specs() if s.supports(arch)])
    assert first["requested"] == n and first["compiled"] + first["cached"] == n, first
    assert first["cached"] == first["from_bundle"], first
    assert len(reports) == n, f"{arch}: ptxas reports of {len(reports)} of {n} kernels"
    over = {expr: st for expr, (st, _) in first["spills"].items()
            if st > SPILL_ALLOWANCE.get(expr.split("<", 1)[0].rsplit("::", 1)[-1], 0)}
    assert not over, f"{arch}: shipped kernels spill beyond their allowance: {over}"
    rc, out, err = run_cli("precompile", "--arch", arch, "--all", "--json", cache_dir=d)
    assert rc == 0, err
    second = json.loads(out.strip().splitlines()[-1])
    assert second["compiled"] == 0 and second["cached"] == n, second
    rc, out, _ = run_cli("cache", "info", cache_dir=d)
    assert rc == 0 and json.loads(out)["n_kernels"] == n
    print(f"{arch}: {n} kernels in {first['programs']} programs, {first['seconds']:.1f} s "
          f"({first['seconds'] / max(1, n):.2f} s per kernel, {first['processes']} processes)")


def test_cli_clear_and_info(shipped, tmp_path, run_cli):
    """The CLI's precompile of a preset (on a copy of the session's shipped sm_80 build: what the
    preset reaches beyond the shipped set compiles), then cache clear and info (an unknown
    architecture's one-line error: test_cli.py)."""
    import shutil

    from kermac_like.runtime.precompile import specs_for_descriptor

    d = tmp_path / "cache"
    shutil.copytree(shipped.build("sm_80")[0], d)
    reach = [s for s in specs_for_descriptor(km.PRESETS["dot"]) if s.supports("sm_80")]
    beyond = [s for s in reach if s not in set(render.shipped_specs())]
    rc, out, err = run_cli("precompile", "--arch", "sm_80", "--preset", "dot", "--json", cache_dir=d)
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert 0 < summary["compiled"] == len(beyond) and summary["cached"] == len(reach) - len(beyond), summary
    rc, out, _ = run_cli("cache", "clear", cache_dir=d)
    assert rc == 0 and "removed" in out
    rc, out, _ = run_cli("cache", "info", cache_dir=d)
    assert rc == 0 and json.loads(out)["n_kernels"] == 0


def test_compile_error_carries_log():
    bad = KernelSpec("common.cuh", "kermac_like::no_such_kernel", "int", LaunchShape(1, 1, 1))
    with pytest.raises(compiler.CompileError) as ei:
        compiler.compile_specs([bad], "sm_80")
    msg = str(ei.value)
    assert "no_such_kernel" in msg and "-arch=sm_80" in msg and ei.value.log


def test_stale_mirror_fails_to_compile():
    spec = render.distance_spec(km.PRESETS["l1"], *([render.Layout.ROW_MAJOR] * 3), 4)
    stale = KernelSpec(spec.header, spec.kernel, spec.traits, LaunchShape(spec.launch.threads + 32, spec.launch.block_m,
                                                                          spec.launch.block_n, spec.launch.smem_bytes))
    with pytest.raises(compiler.CompileError, match="stale"):
        compiler.compile_specs([stale], "sm_80")


def test_key_changes_with_what_matters(monkeypatch):
    spec = render.distance_spec(km.PRESETS["l1"], *([render.Layout.ROW_MAJOR] * 3), 4)
    k80, k90 = compiler.kernel_key(spec, "sm_80"), compiler.kernel_key(spec, "sm_90")
    assert k80 != k90 and len(k80) == 64
    other = render.distance_spec(km.PRESETS["l2"], *([render.Layout.ROW_MAJOR] * 3), 4)
    assert compiler.kernel_key(other, "sm_80") != k80
    monkeypatch.setenv("KERMAC_LIKE_LINEINFO", "1")  # -lineinfo: the same code, its own key
    assert "-lineinfo" in compiler._options("sm_80") and compiler._program_options("sm_80").lineinfo
    assert compiler.kernel_key(spec, "sm_80") != k80
    monkeypatch.setenv("KERMAC_LIKE_LINEINFO", "0")
    assert compiler.kernel_key(spec, "sm_80") == k80
    monkeypatch.setattr(compiler, "template_hash", lambda: "edited")
    assert compiler.kernel_key(spec, "sm_80") != k80


def test_invalid_arch():
    with pytest.raises(ValueError, match="arch"):
        compiler.precompile_specs([], "sm_75")


def test_templates_found_and_hashed():
    d = compiler.template_dir()
    assert (d / "common.cuh").is_file() and (d / "distance.cuh").is_file()
    assert len(compiler.template_hash()) == 64


def test_precompile_api_needs_device_or_arch(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(ValueError, match="device"):
        km.precompile(km.PRESETS["l1"])
    with pytest.raises(TypeError, match=r"descriptors\[0\]"):
        km.precompile(["l1"], arch="sm_80")


def test_no_generic_lambdas_in_templates():
    """NVRTC 13.0 (the one CUDA 13.0 installs) treats a generic lambda in device code as a
    host function and fails to compile; NVRTC 13.5 accepts it. Lambda parameters are typed."""
    import re

    bad = []
    for path in sorted(compiler.template_dir().glob("*.cuh")):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            m = re.search(r"\[[&=]?\]\s*\(", line)
            if m and re.search(r"\bauto\b", line[m.end():].split("{")[0]):
                bad.append(f"{path.name}:{no}: {line.strip()}")
    assert not bad, "generic lambdas: " + "; ".join(bad)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kmeans_family_compiles_without_spills(shipped, arch):
    """The k-means kernels (cuda_templates/kmeans.cuh: seeding and update; kmeans_assign_mma.cuh: the
    tensor-core assignment and the pruned iterations' filter): every shipped instantiation compiles (in the
    session's shipped build), its mirror checked, with no local-memory spills."""
    specs = list(render.FAMILIES["kmeans"]())
    assert {s.kernel for s in specs} == {"kermac_like::kmeans_update_kernel", "kermac_like::kmeans_draw_kernel",
                                         "kermac_like::kmeans_gap_kernel", "kermac_like::kmeans_segsum_kernel", "kermac_like::kmeans_segsum_combine_kernel",
                                         "kermac_like::kmeans_assign_prep_kernel",
                                         "kermac_like::kmeans_assign_mma_kernel", "kermac_like::kmeans_bounds_kernel"}
    resources = {s: r for s, (_, _, r) in shipped.kernels(specs, arch).items()}
    assert len(resources) == len(specs)
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in resources.values()), resources


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_topk_rescore_compiles_without_spills(shipped, arch):
    """The fused rescoring of the tensor-core top-k (cuda_templates/topk_rescore.cuh, shipped for
    plan.topk.FUSED_RESCORE): its four instantiations (Diff / Dot x order) compile (in the
    session's shipped build), mirror checked, with no local-memory spills."""
    specs = [s for s in render.FAMILIES["topk"]() if s.kernel == "kermac_like::topk_rescore_kernel"]
    assert len(specs) == 4
    resources = {s: r for s, (_, _, r) in shipped.kernels(specs, arch).items()}
    assert len(resources) == len(specs)
    assert all(r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0 for r in resources.values()), \
        resources

