"""CPU checks of cuda_templates/cdist_grad.cuh (the cdist_grad contraction).

Three layers, none needs a GPU:

* ``GradModel``: a NumPy model of the kernel's index arithmetic for whole
  launches (grid remap, batch loop, o-chunk choice, cp.async ring slots,
  loader copy slots, zero fill, thread tiles, predicated stores) on flat
  buffers with the kernel's strides.  It runs against a float64 oracle on the
  edge sizes, checks that every output is written exactly once and that
  nothing else in ``out`` is touched.  It mirrors the C++ constants; the
  compile test static_asserts that the header agrees.
* NVRTC compiles of the six instantiations (3 powers x kVec 1/4) for sm_80
  and sm_90: no register spills, static shared memory within 48 KiB.
* SASS (cuobjdump): no MUFU.LG2/EX2 for p = 1 and p = 2, and an instruction
  budget for the hot loop of every instantiation.

A direct launch of the kernel against the oracle (marker ``gpu``) closes the
file; it skips without CUDA.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

try:  # recent cuda.core exports at top level; older releases under .experimental
    from cuda.core import Program, ProgramOptions
except ImportError:  # pragma: no cover - depends on the installed cuda.core
    try:
        from cuda.core.experimental import Program, ProgramOptions
    except ImportError:
        Program = ProgramOptions = None

TEMPLATES = Path(__file__).resolve().parents[1] / "cuda_templates"
POWERS = ("Abs", "Square", "Pow")
VECS = (1, 4)
ARCHS = ("sm_80", "sm_90")


def name_expression(power: str, vec: int) -> str:
    return (
        "kermac_like::cdist_grad_kernel<kermac_like::CdistGradTraits<"
        f"kermac_like::Power::{power}, {vec}>>"
    )


# --------------------------------------------------------------------------
# Python mirror of CdistGradTraits (checked against the header at compile).
# --------------------------------------------------------------------------
class T:
    threads = 128
    threads_m = 16
    threads_n = 8
    pair_m = 4
    pair_n = 2
    block_m = 64
    block_n = 16
    block_k = 32
    stages = 3
    o_chunk = 16
    o_narrow = 4
    pitch_a = 64
    pitch_b = 20
    pitch_c = 20
    smem_bytes = 0  # dynamic


# --------------------------------------------------------------------------
# float64 oracle
# --------------------------------------------------------------------------
def factor(diff: np.ndarray, q: float) -> np.ndarray:
    """sgn(diff) * |diff|^q with sgn(0) = 0 dominating every q."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mag = np.abs(diff) ** q
        return np.where(diff == 0, 0.0, np.sign(diff) * mag)


def oracle(a, b, c, d, q):
    """a (L,K,M), b (L,N,K), c (L,O,K), d (L,N,M), q (L,) -> out (L,O,N,M)."""
    outs = []
    for l in range(a.shape[0]):
        diff = d[l][:, :, None] - b[l][:, None, :]  # (N, M, K)
        w = factor(diff, q[l]) * a[l].T[None, :, :]  # (N, M, K)
        outs.append(np.einsum("ok,nmk->onm", c[l], w))
    return np.stack(outs)


# --------------------------------------------------------------------------
# Index model of one launch
# --------------------------------------------------------------------------
def cdiv(x, y):
    return -(-x // y)


class GradModel:
    """Runs the kernel's index arithmetic on flat float64 buffers.

    Arguments follow the kernel ABI: buffers stand for the pointers, offsets
    are element offsets (the base pointer of each tensor), strides in
    elements.  ``gz`` overrides gridDim.z to exercise the batch loop.
    """

    def __init__(self, power: str, vec: int):
        self.power, self.vec = power, vec

    # The weight generator, float64, with the same special-value paths.
    def gen(self, a, b, d, q, zero_safe):
        if self.power == "Abs":
            return np.where(d > b, a, np.where(d < b, -a, 0.0))
        if self.power == "Square":
            return a * (d - b)
        diff = d - b
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            mag = np.exp2(q * np.log2(np.abs(diff)))
            w = mag * np.where(np.signbit(diff), -a, a)
        if zero_safe:
            w = np.where(diff != 0, w, 0.0)
        return w

    def launch(self, bufs, offs, M, N, K, O, lda, ldb, ldc, ldd, ldo_o, ldo_n,
               batch, bs, p_arr, p_bs, p, gz=None):
        A, B, C, D, OUT = bufs
        gx, gy = cdiv(M, T.block_m), cdiv(N, T.block_n)
        gz = min(batch, 65535) if gz is None else gz
        self.writes = np.zeros(OUT.shape, np.int64)
        for bz, by, bx in itertools.product(range(gz), range(gy), range(gx)):
            bid = by * gx + bx
            n_tile, m_tile = bid % gy, bid // gy
            for l in range(bz, batch, gz):
                t = dict(
                    a=offs[0] + l * bs[0], b=offs[1] + l * bs[1], c=offs[2] + l * bs[2],
                    d=offs[3] + l * bs[3], out=offs[4] + l * bs[4],
                    lda=lda, ldb=ldb, ldc=ldc, ldd=ldd, ldo_o=ldo_o, ldo_n=ldo_n,
                    M=M, N=N, K=K, O=O, m0=m_tile * T.block_m, n0=n_tile * T.block_n)
                q = (p_arr[l * p_bs] if p_arr is not None else p) - 1.0
                self.run_tile(A, B, C, D, OUT, t, q)

    def run_tile(self, A, B, C, D, OUT, t, q):
        tid = np.arange(T.threads)
        tx, ty = tid % T.threads_m, tid // T.threads_m
        i_ = np.arange(T.pair_n)[None, :, None]
        j_ = np.arange(T.pair_m)[None, None, :]
        n = t["n0"] + ty[:, None, None] * T.pair_n + i_  # (T, 2, 1)
        m = t["m0"] + tx[:, None, None] * T.pair_m + j_  # (T, 1, 4)
        if self.vec == 4:  # one float4 per (thread, i): all in or all out
            ok = (n < t["N"]) & (m - j_ < t["M"])
        else:
            ok = (n < t["N"]) & (m < t["M"])
        dv = np.where(ok, D[np.where(ok, t["d"] + n * t["ldd"] + m, 0)], 0.0)  # (T, 2, 4)
        fast = self.power != "Pow" or q > 0
        o0 = 0
        while o0 < t["O"]:
            if fast and t["O"] - o0 <= T.o_narrow:  # narrow chunk: fast generator only
                OC, zero_safe = T.o_narrow, False
            else:
                OC, zero_safe = T.o_chunk, not fast
            acc = self.run_o_chunk(A, B, C, t, o0, OC, dv, q, zero_safe)
            self.store(OUT, t, o0, OC, acc, n, m)
            o0 += OC

    def run_o_chunk(self, A, B, C, t, o0, OC, dv, q, zero_safe):
        BK, S = T.block_k, T.stages
        tid = np.arange(T.threads)
        tx, ty = tid % T.threads_m, tid // T.threads_m
        num_k = cdiv(t["K"], BK)
        ring = [None] * S
        acc = np.zeros((T.threads, OC, T.pair_n, T.pair_m))
        for st in range(S - 1):
            if st < num_k:
                ring[st] = (st, self.load_chunk(A, B, C, t, o0, OC, st * BK))
        slot, fill = 0, S - 1
        for kc in range(num_k):
            chunk, (sa, sb, sc) = ring[slot]
            assert chunk == kc, "ring slot holds the wrong chunk"
            if kc + S - 1 < num_k:
                ring[fill] = (kc + S - 1, self.load_chunk(A, B, C, t, o0, OC, (kc + S - 1) * BK))
            av = sa[:, tx[:, None] * T.pair_m + np.arange(T.pair_m)]  # (BK, T, 4)
            bv = sb[:, ty[:, None] * T.pair_n + np.arange(T.pair_n)]  # (BK, T, 2)
            w = self.gen(av[:, :, None, :], bv[:, :, :, None], dv[None], q, zero_safe)  # (BK,T,2,4)
            acc += np.einsum("ko,ktij->toij", sc[:, :OC], w)
            slot = 0 if slot + 1 == S else slot + 1
            fill = 0 if fill + 1 == S else fill + 1
        return acc

    def load_chunk(self, A, B, C, t, o0, OC, k0):
        """One ring slot, copied by the ChunkLoader slots; checks coverage."""
        BK, BN, BM, TH, V = T.block_k, T.block_n, T.block_m, T.threads, self.vec
        sa = np.full((BK, T.pitch_a), np.nan)
        sb = np.full((BK, T.pitch_b), np.nan)
        sc = np.full((BK, T.pitch_c), np.nan)
        cover_a, cover_b, cover_c = (np.zeros(x.shape, np.int64) for x in (sa, sb, sc))
        safe = 0  # any in-range offset of a; never read when not ok
        for tid in range(TH):
            # a: (BK, BM), copies of V floats, m fastest
            per_row = BM // V
            ka, ma = tid // per_row, (tid % per_row) * V
            a_ok = t["m0"] + ma < t["M"]
            for i in range(BK * per_row // TH):
                k = ka + i * (TH // per_row)
                ok = a_ok and k0 + k < t["K"]
                src = t["a"] + (k0 + k) * t["lda"] + t["m0"] + ma if ok else safe
                sa[k, ma:ma + V] = A[src:src + V] if ok else 0.0
                cover_a[k, ma:ma + V] += 1
            # b: transposed, 8 k x 4 rows per warp
            nb, kb = (tid // 8) % BN, (tid // (8 * BN)) * 8 + tid % 8
            for i in range(BK * BN // TH):
                k = kb + i * (TH // BN)
                ok = t["n0"] + nb < t["N"] and k0 + k < t["K"]
                sb[k, nb] = B[t["b"] + (t["n0"] + nb) * t["ldb"] + k0 + k] if ok else 0.0
                cover_b[k, nb] += 1
            # c: o-chunk rows, transposed
            ocs, kcs = (tid // 8) % OC, (tid // (8 * OC)) * 8 + tid % 8
            active = BK * OC >= TH or tid < BK * OC
            for i in range(cdiv(BK * OC, TH)):
                if not active:
                    continue
                k = kcs + i * (TH // OC)
                ok = o0 + ocs < t["O"] and k0 + k < t["K"]
                sc[k, ocs] = C[t["c"] + (o0 + ocs) * t["ldc"] + k0 + k] if ok else 0.0
                cover_c[k, ocs] += 1
        assert (cover_a[:, :BM] == 1).all() and (cover_a[:, BM:] == 0).all()
        assert (cover_b[:, :BN] == 1).all() and (cover_b[:, BN:] == 0).all()
        assert (cover_c[:, :OC] == 1).all() and (cover_c[:, OC:] == 0).all()
        return sa, sb, sc

    def store(self, OUT, t, o0, OC, acc, n, m):
        for o in range(OC):
            if o0 + o >= t["O"]:
                break
            if self.vec == 4:
                ok = (n < t["N"]) & (m - np.arange(T.pair_m)[None, None, :] < t["M"])
            else:
                ok = (n < t["N"]) & (m < t["M"])
            ok = np.broadcast_to(ok, acc.shape[:1] + acc.shape[2:])
            idx = t["out"] + (o0 + o) * t["ldo_o"] + n * t["ldo_n"] + m
            idx = np.broadcast_to(idx, ok.shape)[ok]
            OUT[idx] = acc[:, o][ok]
            np.add.at(self.writes, idx, 1)


def make_case(rng, L, M, N, K, O, *, broadcast=(), vec=1, ties=False):
    """Random tensors in flat buffers, with padded leading dimensions.

    broadcast: operands ('a', 'b', 'c', 'd') stored once (batch stride 0).
    vec: 4 keeps offsets and strides multiples of 4 (the kVec = 4 contract).
    ties: d[n, m] = b[n, m % K] exactly, so sgn(0) = 0 matters.
    Returns per-batch views (L, rows, cols), buffers, offsets, leading dims,
    batch strides, a NaN-poisoned out buffer and its two strides.
    """
    pad, off = (4, 4) if vec == 4 else (3, 3)
    shapes = dict(a=(K, M), b=(N, K), c=(O, K), d=(N, M))
    bufs, offs, lds, bss = {}, {}, {}, {}
    for name, (rows, cols) in shapes.items():
        ld = cols + pad
        copies = 1 if name in broadcast else L
        bss[name] = 0 if name in broadcast else rows * ld + pad
        bufs[name] = rng.standard_normal(off + copies * (rows * ld + pad))
        offs[name], lds[name] = off, ld

    def element(name, l, r, col):
        return offs[name] + l * bss[name] + r * lds[name] + col

    if ties:
        for l, n, m in itertools.product(range(L), range(N), range(M)):
            bufs["d"][element("d", l, n, m)] = bufs["b"][element("b", l, n, m % K)]
    views = {
        name: np.stack([
            np.array([[bufs[name][element(name, l, r, col)] for col in range(cols)]
                      for r in range(rows)]).reshape(rows, cols)
            for l in range(L)])
        for name, (rows, cols) in shapes.items()}
    ldo_n = M + pad
    ldo_o = N * ldo_n + pad
    out = np.full(L * O * ldo_o + pad, np.nan)
    return views, bufs, offs, lds, bss, out, ldo_o, ldo_n


MODEL_CASES = [
    # power, vec, L, M, N, K, O, p
    ("Abs", 1, 1, 1, 1, 1, 1, 1.0),
    ("Square", 1, 1, 3, 7, 33, 3, 2.0),
    ("Pow", 1, 1, 127, 3, 7, 1, 1.3),
    ("Abs", 1, 2, 129, 33, 3, 16, 1.0),
    ("Square", 1, 1, 7, 129, 127, 33, 2.0),
    ("Pow", 1, 1, 33, 17, 129, 7, 0.5),
    ("Pow", 1, 1, 1000, 1, 3, 5, 3.0),
    ("Square", 1, 1, 1, 1000, 1, 1, 2.0),
    ("Abs", 1, 1, 3, 2, 1000, 2, 1.0),
    ("Square", 4, 1, 4, 1, 4, 1, 2.0),
    ("Abs", 4, 1, 128, 7, 36, 9, 1.0),
    ("Pow", 4, 2, 132, 33, 128, 16, 1.3),
    ("Pow", 4, 1, 1000, 3, 12, 33, 1.0),
    ("Square", 4, 1, 68, 17, 1000, 4, 2.0),
]


def _run_model(power, vec, L, M, N, K, O, p, *, p_tensor=None, p_bs=0, gz=None,
               broadcast=(), ties=False, seed=0):
    assert vec == 1 or (M % 4 == 0 and K % 4 == 0), "kVec = 4 contract"
    rng = np.random.default_rng(seed)
    views, bufs, offs, lds, bss, out, ldo_o, ldo_n = make_case(
        rng, L, M, N, K, O, broadcast=broadcast, vec=vec, ties=ties)
    model = GradModel(power, vec)
    names = ("a", "b", "c", "d")
    model.launch(
        [bufs[x] for x in names] + [out], [offs[x] for x in names] + [0],
        M, N, K, O, lds["a"], lds["b"], lds["c"], lds["d"], ldo_o, ldo_n,
        L, [bss[x] for x in names] + [O * ldo_o], p_tensor, p_bs, p, gz=gz)
    q = np.array([(p_tensor[l * p_bs] if p_tensor is not None else p) - 1.0 for l in range(L)])
    ref = oracle(views["a"], views["b"], views["c"], views["d"], q)
    # Read the model's output back through the strides; check coverage.
    idx = (np.arange(L)[:, None, None, None] * O * ldo_o
           + np.arange(O)[None, :, None, None] * ldo_o
           + np.arange(N)[None, None, :, None] * ldo_n
           + np.arange(M)[None, None, None, :])
    got = out[idx]
    assert (model.writes[idx] == 1).all(), "an output was written zero or several times"
    outside = np.ones(out.shape, bool)
    outside[idx.ravel()] = False
    assert (model.writes[outside] == 0).all() and np.isnan(out[outside]).all(), "wrote outside"
    scale = np.abs(ref).max() + 1e-300
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9 * scale)


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_index_model_matches_oracle(case):
    _run_model(*case)


def test_index_model_batch_loop_broadcast_and_p_tensor():
    # 3 batch entries over gridDim.z = 2 (the stride loop), broadcast a and
    # d, one p per entry covering the fast (p > 1) and zero-safe (p <= 1)
    # generators, exact ties so sgn(0) = 0 matters.
    p_tensor = np.array([1.3, 0.5, 1.0])
    _run_model("Pow", 1, 3, 70, 18, 40, 3, 0.0, p_tensor=p_tensor, p_bs=1, gz=2,
               broadcast=("a", "d"), ties=True)
    _run_model("Pow", 4, 3, 68, 17, 40, 20, 0.0, p_tensor=np.array([2.5]), p_bs=0, gz=1,
               broadcast=("b", "c"), ties=True)


@pytest.mark.parametrize("power", POWERS)
def test_index_model_ties(power):
    _run_model(power, 1, 2, 65, 17, 33, 2, {"Abs": 1.0, "Square": 2.0, "Pow": 0.5}[power],
               ties=True, broadcast=("c",))


# --------------------------------------------------------------------------
# NVRTC compile, ptxas resources, SASS
# --------------------------------------------------------------------------
class _Log:
    def __init__(self):
        self.parts = []

    def write(self, text):
        self.parts.append(text)

    def text(self):
        return "".join(self.parts)


def _compile(names, arch, extra_source=""):
    options = ProgramOptions(
        arch=arch, std="c++17", include_path=[str(TEMPLATES)], ptxas_options=["-v"])
    source = '#include "cdist_grad.cuh"\n' + extra_source
    log = _Log()
    start = time.perf_counter()
    obj = Program(source, "c++", options).compile("cubin", name_expressions=list(names), logs=log)
    return obj, log.text(), time.perf_counter() - start


def _ptxas_resources(log):
    """{mangled name: {'regs', 'spill_st', 'spill_ld', 'smem', 'stack'}} from ptxas -v."""
    res, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            cur = res.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            cur.update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return res


def _mangled(obj, name):
    mapping = getattr(obj, "symbol_mapping", None) or getattr(obj, "_sym_map", None) or {}
    return mapping[name] if isinstance(mapping[name], str) else mapping[name].decode()


def _find_cuobjdump():
    try:
        import nvidia

        root = Path(nvidia.__path__[0])
        for cand in (root / "cu13" / "bin" / "cuobjdump",
                     root / "cuda_cuobjdump" / "bin" / "cuobjdump"):
            if cand.exists():
                return str(cand)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def _sass_functions(cubin: bytes, tmp_path: Path):
    path = tmp_path / f"k{abs(hash(cubin))}.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([_find_cuobjdump(), "--dump-sass", str(path)], check=True,
                          capture_output=True, text=True).stdout
    funcs, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return funcs


def _opcode(ins):
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0]


def _hot_loop(instrs):
    """Innermost loop (backward branch, no loop inside) with the most FFMA,
    the shortest one on a tie (Pow: the fast generator, not the p <= 1 one).

    Returns (opcode counts, instruction count) of its body.
    """
    loops = []
    for addr, ins in instrs:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    innermost = [(lo, hi) for lo, hi in loops
                 if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops)]
    best = None
    for lo, hi in innermost:
        body = [i for a, i in instrs if lo <= a <= hi]
        counts = Counter(_opcode(i) for i in body)
        if best is None or (counts["FFMA"], -len(body)) > (best[0]["FFMA"], -best[1]):
            best = (counts, len(body))
    return best


_CACHE: dict = {}


def _compiled(arch):
    """All six instantiations in one program per arch (compiled once)."""
    if arch not in _CACHE:
        names = [name_expression(p, v) for p in POWERS for v in VECS]
        checks = "".join(
            f"using Tr{i} = kermac_like::CdistGradTraits<kermac_like::Power::{p}, {v}>;\n"
            f"static_assert(Tr{i}::kThreads == {T.threads} && Tr{i}::kBlockM == {T.block_m} && "
            f"Tr{i}::kBlockN == {T.block_n} && Tr{i}::kSmemBytes == {T.smem_bytes} && "
            f"Tr{i}::kBlockK == {T.block_k} && Tr{i}::kStages == {T.stages} && "
            f"Tr{i}::kOChunk == {T.o_chunk} && Tr{i}::kONarrow == {T.o_narrow} && "
            f"Tr{i}::kPairM == {T.pair_m} && "
            f"Tr{i}::kPairN == {T.pair_n} && Tr{i}::kThreadsM == {T.threads_m} && "
            f"Tr{i}::kPitchA == {T.pitch_a} && Tr{i}::kPitchB == {T.pitch_b} && "
            f"Tr{i}::kPitchC == {T.pitch_c}, \"Python mirror out of date\");\n"
            for i, (p, v) in enumerate(itertools.product(POWERS, VECS)))
        obj, log, seconds = _compile(names, arch, checks)
        _CACHE[arch] = (obj, log, seconds, {n: _mangled(obj, n) for n in names})
    return _CACHE[arch]


needs_nvrtc = pytest.mark.skipif(Program is None, reason="cuda.core not installed")
needs_cuobjdump = pytest.mark.skipif(_find_cuobjdump() is None, reason="cuobjdump not found")


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(arch):
    obj, log, seconds, mangled = _compiled(arch)
    res = _ptxas_resources(log)
    for name, sym in mangled.items():
        r = res[sym]
        assert r["spill_st"] == 0 and r["spill_ld"] == 0 and r["stack"] == 0, (name, r)
        assert r["regs"] <= 255, (name, r)
        assert r["smem"] <= 48 * 1024, (name, r)  # static shared memory only


@needs_nvrtc
@pytest.mark.parametrize("bad, message", [
    ("kermac_like::Power::Sqrt, 4", "no gradient path"),
    ("kermac_like::Power::Abs, 2", "kVec must be 1"),
])
def test_invalid_traits_fail_with_a_named_reason(bad, message):
    expr = f"kermac_like::cdist_grad_kernel<kermac_like::CdistGradTraits<{bad}>>"
    with pytest.raises(Exception) as err:
        _compile([expr], "sm_90")
    assert message in str(err.value) or message in repr(err.value.args)


# Budgets: issue slots per (n,m) pair and k step in the hot loop (o-chunk 16:
# 16 FFMA are the floor).  Measured with NVRTC 13: Abs 20.7, Square 19.2,
# Pow 23.4; the margin absorbs compiler drift, a regression (spilled loop,
# lost vector loads, extra select) does not fit.
HOT_BUDGET = {"Abs": 21.5, "Square": 20.0, "Pow": 24.5}


@needs_nvrtc
@needs_cuobjdump
@pytest.mark.parametrize("arch", ARCHS)
def test_sass(arch, tmp_path):
    obj, _, _, mangled = _compiled(arch)
    funcs = _sass_functions(bytes(obj.code), tmp_path)
    for (power, vec) in itertools.product(POWERS, VECS):
        instrs = funcs[mangled[name_expression(power, vec)]]
        ops = Counter(_opcode(i) for _, i in instrs)
        mufu = ops["MUFU.LG2"] + ops["MUFU.EX2"]
        assert ops["LDL"] == ops["STL"] == 0
        if power in ("Abs", "Square"):
            assert mufu == 0, (power, vec, "p = 1 / p = 2 must not use MUFU.LG2/EX2")
        else:
            assert ops["MUFU.LG2"] > 0 and ops["MUFU.EX2"] > 0
        counts, length = _hot_loop(instrs)
        k_steps = counts["FFMA"] // (T.o_chunk * T.pair_n * T.pair_m)
        per_pair_k = length / (k_steps * T.pair_n * T.pair_m)
        assert k_steps >= 1 and per_pair_k <= HOT_BUDGET[power], (power, vec, per_pair_k, counts)
        if power == "Pow":  # hot loop = fast generator: 2 MUFU per element, no zero fix
            assert counts["MUFU.LG2"] == counts["MUFU.EX2"] == k_steps * T.pair_n * T.pair_m
            assert counts["FSEL"] == 0


# --------------------------------------------------------------------------
# GPU: launch the template directly (the launch contract), compare with the
# float64 oracle.  Skips cleanly without CUDA.
# --------------------------------------------------------------------------
def _cuda_available():
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    except Exception:
        return False


GPU_CASES = [
    # power, vec, L, M, N, K, O, p
    ("Abs", 1, 1, 129, 7, 127, 1, 1.0),
    ("Square", 4, 2, 1000, 33, 128, 16, 2.0),
    ("Pow", 1, 1, 127, 33, 1000, 33, 1.3),
    ("Pow", 4, 1, 132, 129, 36, 3, 0.5),
    ("Abs", 4, 1, 4, 1, 4, 7, 1.0),
    ("Pow", 1, 3, 33, 17, 7, 9, None),  # p tensor (1.3, 1.0, 3.0)
]


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA GPU with sm_80+")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_oracle_on_gpu(case):
    import torch

    try:
        from cuda.core import Device, LaunchConfig, launch
    except ImportError:
        from cuda.core.experimental import Device, LaunchConfig, launch

    power, vec, L, M, N, K, O, p = case
    major, minor = torch.cuda.get_device_capability()
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    obj, _, _ = _compile([name_expression(power, vec)], f"sm_{major}{minor}")
    kernel = obj.get_kernel(name_expression(power, vec))

    g = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    cuda = dict(device="cuda", dtype=torch.float32)
    a = torch.randn(L, K, M, generator=g, **cuda)
    b = torch.randn(1, N, K, generator=g, **cuda)  # broadcast over the batch
    c = torch.randn(L, O, K, generator=g, **cuda)
    d = torch.randn(L, N, M, generator=g, **cuda)
    d[..., : min(M, K)] = b[..., : min(M, K)]  # exact ties: sgn(0) = 0
    out = torch.full((L, O, N, M), float("nan"), **cuda)
    p_vals = torch.tensor([1.3, 1.0, 3.0][:L], **cuda) if p is None else None
    q = (p_vals.double().cpu().numpy() if p is None else np.full(L, p)) - 1.0

    i32, i64, f32 = np.int32, np.int64, np.float32
    ptr = lambda t: np.uint64(t.data_ptr()) if t is not None else np.uint64(0)  # noqa: E731
    args = (ptr(a), ptr(b), ptr(c), ptr(d), ptr(out), i32(M), i32(N), i32(K), i32(O),
            i64(a.stride(1)), i64(b.stride(1)), i64(c.stride(1)), i64(d.stride(1)),
            i64(out.stride(1)), i64(out.stride(2)), i32(L),
            i64(a.stride(0)), i64(0), i64(c.stride(0)), i64(d.stride(0)), i64(out.stride(0)),
            ptr(p_vals), i64(1), f32(0.0 if p is None else p))
    config = LaunchConfig(grid=(cdiv(M, T.block_m), cdiv(N, T.block_n), min(L, 65535)),
                          block=(T.threads, 1, 1), shmem_size=T.smem_bytes)
    torch.cuda.synchronize()
    stream = dev.default_stream
    launch(stream, config, kernel, *args)
    stream.sync()

    ref = oracle(a.double().cpu().numpy(), b.double().cpu().numpy().repeat(L, 0),
                 c.double().cpu().numpy(), d.double().cpu().numpy(), q)
    got = out.double().cpu().numpy()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    tol = 1e-5 if power == "Pow" else 5e-6  # fp32 sums over K <= 1000 (+ MUFU for Pow)
    assert np.isfinite(got).all() and err < tol, err


# ------------------------------------------------------ tuned variants (try_simt)
def test_sign_fma_formula_is_exact_above_2_pow_minus_128():
    """WeightGen<Abs> with kSignFma: u = sat(0.5 + (d - b) 2^127), W = 2a u - a."""
    rng = np.random.default_rng(0)
    d = rng.standard_normal(4096).astype(np.float32)
    b = d.copy()
    b[::3] = rng.standard_normal(b[::3].size).astype(np.float32)  # ties elsewhere
    b[1::7] = np.nextafter(d[1::7], np.float32(np.inf))  # one ulp apart
    a = rng.standard_normal(4096).astype(np.float32)
    diff = (d - b).astype(np.float32)
    # fma in float64 is exact here (diff * 2^127 + 0.5 then one rounding to float32)
    with np.errstate(over="ignore"):  # |diff| >= 2: the product overflows to inf, sat gives 1
        u = np.clip((diff.astype(np.float64) * 2.0**127 + 0.5).astype(np.float32), 0, 1)
    assert set(np.unique(u)) <= {0.0, 0.5, 1.0}
    w = ((a + a).astype(np.float64) * u - a).astype(np.float32)
    np.testing.assert_array_equal(w, np.where(d > b, a, np.where(d < b, -a, 0)).astype(np.float32))


def test_sign_fma_variant_compiles_pow_free_without_spills():
    from kermac_like.runtime.compiler import compile_specs
    from kermac_like.runtime.specs import GRAD_LAUNCH, grad_spec

    spec = grad_spec("abs", 4, tuning=(1, 2))
    assert spec.launch == GRAD_LAUNCH and spec.name_expression.endswith("Power::Abs, 4, 1, 2>>")
    assert grad_spec("abs", 4).name_expression.endswith("Power::Abs, 4, 1, 2>>")  # p = 1 ships the FMA sign
    assert grad_spec("abs", 4, tuning=(0, 2)).name_expression.endswith("Power::Abs, 4>>")
    for arch in ("sm_80", "sm_90"):
        _, resources = compile_specs([spec], arch)
        res = resources[spec.name_expression]
        assert res.get("spill_stores", 0) == 0 and res.get("spill_loads", 0) == 0, (arch, res)
