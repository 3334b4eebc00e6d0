"""Checks of cuda_templates/cdist_grad_mma.cuh (cdist_grad on tensor cores, 3xTF32).

CPU:
* ``MmaGradModel``: a NumPy model of the kernel's index arithmetic (grid
  remap, batch loop, o-chunks, cp.async slots and zero fill, the k-slot
  permutation of the fragments, the m16n8k8 fragment layouts, the chunked
  accumulation and the predicated stores) in float64, against the oracle of
  test_templates_grad.py, on edge sizes; every output written exactly once.
* NVRTC compiles of the shipped instantiations through
  ``kermac_like.runtime.compiler.compile_specs`` (the mirror static_asserts) for sm_80
  and sm_90: no spills; HMMA in the SASS.
GPU (marker gpu, skips without CUDA): the public ``cdist_grad`` with
the default selection (tensor cores for p = 1, 2) against the float64 reference.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from test_templates_grad import _find_cuobjdump, _opcode, _sass_functions, factor

try:
    from cuda.core import Program  # noqa: F401
    HAVE_NVRTC = True
except ImportError:  # pragma: no cover
    try:
        from cuda.core.experimental import Program  # noqa: F401
        HAVE_NVRTC = True
    except ImportError:
        HAVE_NVRTC = False


class T:  # mirror of CdistGradMmaTraits (checked by the compile stub)
    threads, warps_m, warps_n, warp_m, tiles_n = 256, 4, 2, 8, 8
    block_m, block_n, block_k, o_chunk = 32, 16, 32, 16


def cdiv(x, y):
    return -(-x // y)


def tf32_rna(x):
    """cvt.rna.tf32.f32 on float32 values (returned as float64)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return u.view(np.float32).astype(np.float64)


def tf32_trunc(x):
    u = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
    return u.view(np.float32).astype(np.float64)


def mma(acc, A, B):
    """acc (16, 8) += A (16, 8 slots) @ B (8 slots, 8); operands as the MMA reads them."""
    acc += tf32_trunc(A) @ tf32_trunc(B)


class MmaGradModel:
    def __init__(self, power):
        self.power = power

    def gen(self, a, b, d, q):
        a, b, d = (np.float32(x) for x in (a, b, d))
        with np.errstate(all="ignore"):
            if self.power == "Abs":
                w = np.where(d > b, a, np.where(d < b, -a, 0.0))
            elif self.power == "Square":
                w = a * (d - b)
            else:
                diff = d - b
                w = np.where(diff == 0, 0.0, np.sign(diff) * np.abs(diff) ** q * a)
        return np.float32(w)

    def launch(self, A, B, C, D, M, N, K, O, batch, bs, q, gz=None):
        """A (La,K,M), B (Lb,N,K), C (Lc,O,K), D (Ld,N,M); bs: batch strides in entries (0/1)."""
        gx, gy = cdiv(M, T.block_m), cdiv(N, T.block_n)
        gz = min(batch, 65535) if gz is None else gz
        out = np.full((batch, O, N, M), np.nan)
        self.writes = np.zeros(out.shape, np.int64)
        for bz, by, bx in itertools.product(range(gz), range(gy), range(gx)):
            bid = by * gx + bx
            n_tile, m_tile = bid % gy, bid // gy
            for l in range(bz, batch, gz):
                ops = [X[l * s] for X, s in zip((A, B, C, D), bs)]
                self.tile(*ops, out[l], self.writes[l], M, N, K, O, m_tile * T.block_m,
                          n_tile * T.block_n, q[l])
        return out

    def tile(self, a, b, c, d, out, writes, M, N, K, O, m0, n0, q):
        BK, J = T.block_k, T.tiles_n
        g, t = np.arange(32) // 4, np.arange(32) % 4
        for o0 in range(0, O, T.o_chunk):
            for warp in range(T.threads // 32):
                wm, wn = warp % T.warps_m, warp // T.warps_m
                m_lane = m0 + wm * T.warp_m + g  # (32,) pair m of lane g
                acc = np.zeros((J, 16, 8))
                for k0 in range(0, K, BK):
                    # zero-filled chunk tiles, as the loader writes them
                    def get(X, r, cc, R, Cn):
                        return X[r, cc] if r < R and cc < Cn else 0.0
                    part = np.zeros((J, 16, 8))
                    for ks in range(BK // 8):
                        kb = k0 + ks * 8
                        # fragments: slot s <-> data column kb + (2s if s < 4 else 2(s-4)+1)
                        col = [kb + 2 * s for s in range(4)] + [kb + 2 * s + 1 for s in range(4)]
                        Afull = np.array([[get(c, o0 + r, col[s], O, K) for s in range(8)]
                                          for r in range(16)], np.float32)
                        big = tf32_rna(Afull)
                        small = (Afull.astype(np.float64) - big).astype(np.float32)
                        for j in range(J):
                            n = n0 + wn * J + j
                            W = np.zeros((8, 8), np.float32)  # (slot, column g)
                            for lane in range(32):
                                gg, tt = g[lane], t[lane]
                                m = m_lane[lane]
                                dv = get(d, n, m, N, M)
                                for s, kk in ((tt, col[tt]), (tt + 4, col[tt + 4])):
                                    W[s, gg] = self.gen(get(a, kk, m, K, M), get(b, n, kk, N, K), dv, q)
                            wb = tf32_rna(W)
                            ws = (W.astype(np.float64) - wb).astype(np.float32)
                            mma(part[j], small, wb)
                            mma(part[j], big, ws)
                            mma(part[j], big, wb)
                    acc += part
                # stores: lane (g, t) holds rows g, g+8 and columns 2t, 2t+1
                for j, lane, h, e in itertools.product(range(J), range(32), range(2), range(2)):
                    o = o0 + g[lane] + 8 * h
                    n = n0 + wn * J + j
                    m = m0 + wm * T.warp_m + 2 * t[lane] + e
                    if o < O and n < N and m < M:
                        out[o, n, m] = acc[j, g[lane] + 8 * h, 2 * t[lane] + e]
                        writes[o, n, m] += 1


def oracle(a, b, c, d, q):
    outs = []
    for l in range(a.shape[0]):
        diff = d[l][:, :, None] - b[l][:, None, :]
        w = factor(diff, q[l]) * a[l].T[None, :, :]
        outs.append(np.einsum("ok,nmk->onm", c[l], w))
    return np.stack(outs)


MODEL_CASES = [  # power, L, M, N, K, O, p
    ("Square", 1, 33, 17, 40, 17, 2.0),
    ("Abs", 1, 7, 3, 9, 1, 1.0),
    ("Pow", 2, 5, 19, 33, 3, 1.3),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_index_model_matches_oracle(case):
    power, L, M, N, K, O, p = case
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    a, b, c, d = f(L, K, M), f(1, N, K), f(L, O, K), f(L, N, M)
    d[..., : min(M, K)] = b[..., : min(M, K)]  # ties
    q = np.full(L, p - 1.0)
    model = MmaGradModel(power)
    got = model.launch(a, b, c, d, M, N, K, O, L, (1, 0, 1, 1), q, gz=1)
    assert (model.writes == 1).all()
    ref = oracle(*(x.astype(np.float64) for x in (a, np.repeat(b, L, 0), c, d)), q)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < 2e-6, err


# ------------------------------------------------------------------ NVRTC / SASS
def _specs(min_blocks=1):
    from kermac_like.runtime.specs import grad_mma_spec

    return [grad_mma_spec(k, v, min_blocks=min_blocks) for k in ("abs", "square", "pow") for v in (4, 1)]


_CACHE = {}


def _compiled(arch):
    if arch not in _CACHE:
        from kermac_like.runtime.compiler import compile_specs

        _CACHE[arch] = compile_specs(_specs(), arch)
    return _CACHE[arch]


@pytest.mark.skipif(not HAVE_NVRTC, reason="cuda.core not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_without_spills(arch):
    _, resources = _compiled(arch)
    assert len(resources) == 6
    for expr, r in resources.items():
        assert r.get("spill_stores", 0) == 0 and r.get("spill_loads", 0) == 0, (expr, r)
        assert r.get("stack", 0) == 0, (expr, r)
        assert r["smem"] <= 48 * 1024, (expr, r)


@pytest.mark.skipif(not HAVE_NVRTC or _find_cuobjdump() is None, reason="needs NVRTC and cuobjdump")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_sass_has_hmma(arch, tmp_path):
    record, _ = _compiled(arch)
    funcs = _sass_functions(record.cubin, tmp_path)
    lowered = {k[1]: k[2] for k in record.kernels}
    for spec in _specs():
        ops = Counter(_opcode(i) for _, i in funcs[lowered[spec.name_expression]])
        assert sum(v for k, v in ops.items() if k.startswith("HMMA")) >= 3, spec.traits
        assert ops["LDL"] == ops["STL"] == 0
        mufu = ops["MUFU.LG2"] + ops["MUFU.EX2"]
        assert (mufu > 0) == ("Power::Pow" in spec.traits), spec.traits


@pytest.mark.skipif(not HAVE_NVRTC, reason="cuda.core not installed")
def test_invalid_traits_fail_with_a_named_reason():
    from kermac_like.runtime.compiler import CompileError, compile_specs
    from kermac_like.runtime.specs import GRAD_MMA_LAUNCH, KernelSpec

    spec = KernelSpec("cdist_grad_mma.cuh", "kermac_like::cdist_grad_mma_kernel",
                      "kermac_like::CdistGradMmaTraits<kermac_like::Power::Abs, 2>", GRAD_MMA_LAUNCH)
    with pytest.raises(CompileError) as err:
        compile_specs([spec], "sm_90")
    assert "kVec must be 1" in str(err.value)


def test_family_is_registered():
    from kermac_like.runtime.specs import FAMILIES, GRAD_MMA_LAUNCH, grad_mma_spec

    specs = list(FAMILIES["cdist_grad_mma"]())  # p = 1 and p = 2: sm_80-class and tuned sm_90 builds
    assert len(specs) == 8 and all(s.launch == GRAD_MMA_LAUNCH for s in specs)
    assert sum(s.traits.endswith(", 2, 128, 32, 4, 1>") for s in specs) == 4
    assert grad_mma_spec("abs", 4).name_expression.endswith("Power::Abs, 4>>")
    assert grad_mma_spec("abs", 4, min_blocks=2).name_expression.endswith("Power::Abs, 4, 2>>")


# ------------------------------------------------------------------ GPU
def _cuda_ok():
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    except Exception:
        return False


GPU_CASES = [  # p, O, K, M, N, L
    (1.0, 1, 127, 129, 7, 1),
    (1.3, 3, 1000, 127, 129, 2),
    (2.0, 16, 129, 1000, 127, 2),
    (3.0, 33, 7, 1, 129, 1),
    (2.0, 33, 1, 7, 1, 3),
    (1.0, 16, 1000, 128, 33, 2),
    (0.5, 3, 129, 7, 127, 1),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ok(), reason="needs a CUDA GPU with sm_80+")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("p_tensor", [False, True])
def test_public_api_matches_reference(case, p_tensor, monkeypatch):
    import torch

    import kermac_like as km
    from kermac_like.reference import cdist_grad_reference

    monkeypatch.setenv("KERMAC_LIKE_GRAD_MMA", "1")
    p, O, K, M, N, L = case
    g = torch.Generator(device="cuda").manual_seed(1234)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    a, b, c, d = r(L, K, M), r(1, N, K), r(L, O, K), r(L, N, M)  # b broadcast
    d[..., : min(M, K)] = b[..., : min(M, K)]  # exact ties
    pv = torch.full((L,), p, device="cuda") if p_tensor else p
    out = torch.full((L, O, N, M), float("nan"), device="cuda")
    km.cdist_grad(a, b, c, d, p=pv, out=out)
    ref = cdist_grad_reference(a.double(), b.double(), c.double(), d.double(),
                               pv.double() if p_tensor else p)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = 2e-6 if p in (1.0, 2.0) else 1e-5  # Pow: MUFU lg2/ex2 (~2^-22 per factor)
    assert torch.isfinite(out).all() and err <= tol, err
