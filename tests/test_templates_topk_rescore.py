"""CPU execution of cuda_templates/topk_rescore.cuh (the fused rescoring of the tensor-core
top-k, plan.topk.FUSED_RESCORE) behind the thread shim (tests/cpu_shim.py), against the torch
path it replaces: plan.topk.merged_candidates (the planner's torch.topk over the lists) and
rescore(). Candidate lists are made as topk_mma_kernel leaves them: per list, the kSel first
keys (order bits of an approximate value, index) of its points, sorted, all-ones pads, top bit
flipped. Same indices and certificates; values within a few float32 ulps of torch's sum
(another summation order), bitwise on integer data (exact sums, full of ties)."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from cpu_shim import THREAD_SHIM, build_cpu_runner

from kermac_like.plan.topk import candidate_bound, merged_candidates, rescore

# (inner, largest): instance i of the runner
INSTANCES = [("Diff", False), ("Diff", True), ("Dot", False), ("Dot", True)]

SHIM = THREAD_SHIM + r"""
inline void __syncwarp(unsigned = 0xffffffffu) { __syncthreads(); }  // the kernel's loops are block-uniform
#undef __shared__
#define __shared__
#include "topk_rescore.cuh"
namespace kermac_like {
alignas(16) unsigned char kl_topk_smem[1 << 14];
}
using namespace kermac_like;
@@INSTANCES@@

template <class Tr>
void run(const long long* scratch, const float* x, const float* y, const float* xn, const float* yn, float* values,
         long long* indices, unsigned char* ok, int M, int N, int K, int k, int sel, int lists, float bound_k, int root) {
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), 1, 1};
  kl_run_grid(Tr::kThreads, [&] {
    topk_rescore_kernel<Tr>(scratch, x, y, xn, yn, values, indices, ok, M, N, K, k, sel, lists, K, K, k, 1, k, 1,
                            bound_k, root);
  });
}

int main(int argc, char** argv) {
  // argv: instance, M, N, K, k, sel, lists, root, bound_k, floats (x | y | xnorm | ynorm), keys, output
  const int which = std::atoi(argv[1]), M = std::atoi(argv[2]), N = std::atoi(argv[3]), K = std::atoi(argv[4]);
  const int k = std::atoi(argv[5]), sel = std::atoi(argv[6]), lists = std::atoi(argv[7]), root = std::atoi(argv[8]);
  const float bound_k = std::strtof(argv[9], nullptr);
  std::vector<float> in(size_t(M + N) * K + M + 1);
  std::vector<long long> keys(size_t(lists) * M * sel);
  FILE* f = std::fopen(argv[10], "rb");
  if (std::fread(in.data(), 4, in.size(), f) != in.size()) return 3;
  std::fclose(f);
  f = std::fopen(argv[11], "rb");
  if (std::fread(keys.data(), 8, keys.size(), f) != keys.size()) return 3;
  std::fclose(f);
  const float* x = in.data();
  const float* y = x + size_t(M) * K;
  const float* xn = y + size_t(N) * K;
  std::vector<float> values(size_t(M) * k, -7.0f);
  std::vector<long long> indices(size_t(M) * k, -7);
  std::vector<unsigned char> ok(M, 7);
  switch (which) {
@@CASES@@
    default: return 4;
  }
  std::vector<double> out(values.begin(), values.end());
  for (long long i : indices) out.push_back(double(i));
  for (unsigned char o : ok) out.push_back(double(o));
  return kl_write(argv[12], out);
}
"""


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    inst = [f"using T{i} = TopkRescoreTraits<Inner::{d}, {str(lg).lower()}>;" for i, (d, lg) in enumerate(INSTANCES)]
    cases = [f"    case {i}: run<T{i}>(keys.data(), x, y, xn, xn + M, values.data(), indices.data(), ok.data(), M, N, "
             "K, k, sel, lists, bound_k, root); break;" for i in range(len(INSTANCES))]
    src = SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
    return build_cpu_runner(tmp_path_factory, "topk_rescore_cpu", src)


def _order_bits(v: torch.Tensor, dot: bool, largest: bool) -> torch.Tensor:
    """topk.cuh's order_bits (float32 -> uint32 in int64)."""
    b = v.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if dot:
        b = (v.float() + 0.0).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        b = torch.where(v.isnan(), torch.full_like(b, 0x7FFFFFFF), b)
        b = torch.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)
    else:
        b = torch.where(v.isnan(), torch.full_like(b, 0x7FFFFFFF), b)  # the GPU's canonical NaN
    return b ^ 0xFFFFFFFF if largest else b


def _lists(approx: torch.Tensor, lists: int, sel: int, dot: bool, largest: bool) -> torch.Tensor:
    """topk_mma_kernel's scratch (lists, M, sel) for approximate values (M, N): point n in list
    n % lists (distinct points per list, as the (split, quarter) ranges), the kSel first keys of
    each, sorted, all-ones pads, top bit flipped."""
    M, N = approx.shape
    n = torch.arange(N)
    keys = (_order_bits(approx, dot, largest) << 32) | n  # as uint64 bit patterns in int64
    out = torch.full((lists, M, sel), (1 << 63) - 1, dtype=torch.int64)  # pads: all ones, flipped
    for j in range(lists):
        kj = keys[:, n % lists == j] ^ (-(1 << 63))  # flipped: int64 order is the key order
        kj = torch.sort(kj, dim=1).values[:, :sel]
        out[j, :, :kj.shape[1]] = kj
    return out


def _run(runner, tmp_path, which, x, y, scratch, k, sel, root=False):
    M, K = x.shape
    N = y.shape[0]
    xn = torch.linalg.vector_norm(x, dim=1)
    yn = torch.linalg.vector_norm(y, dim=1).max()
    fin, kin, outp = tmp_path / "in.bin", tmp_path / "keys.bin", tmp_path / "out.bin"
    torch.cat([x.ravel(), y.ravel(), xn, yn[None]]).numpy().tofile(fin)
    scratch.numpy().tofile(kin)
    bound_k = np.float32(K * 2.0 ** -22)
    subprocess.run([str(runner), str(which), str(M), str(N), str(K), str(k), str(sel), str(scratch.shape[0]),
                    str(int(root)), repr(float(bound_k)), str(fin), str(kin), str(outp)], check=True)
    raw = torch.from_numpy(np.fromfile(outp, dtype=np.float64))
    v = raw[:M * k].view(M, k).float()
    i = raw[M * k:2 * M * k].view(M, k).long()
    ok = raw[2 * M * k:].bool()
    return v, i, ok, yn


def _oracle(x, y, scratch, k, sel, yn, dot, largest, root=False):
    idx, pad, last = merged_candidates(scratch, sel, y.shape[0], dot, largest)
    v, i, ok = rescore(x, y, idx, pad, last, yn, k, dot=dot, largest=largest)
    return (v.sqrt() if root else v), i, ok


def _approx(x, y, dot, seed, scale=0.9):
    """Approximate values as the TF32 candidates: the float32 values perturbed by up to
    ``scale`` of each pair's candidate_bound."""
    g = torch.Generator().manual_seed(seed)
    exact = x @ y.T if dot else (x[:, None, :] - y[None, :, :]).square().sum(-1)
    if scale == 0:
        return exact
    b = candidate_bound(torch.linalg.vector_norm(x, dim=1)[:, None], torch.linalg.vector_norm(y, dim=1)[None, :], exact,
                        x.shape[1], dot)  # each pair's bound: its own point's norm, as the TF32 products err
    approx = exact + scale * b * (2 * torch.rand(exact.shape, generator=g) - 1)
    return approx if dot else approx.clamp_min(0)  # the kernel's max(., 0)


@pytest.mark.parametrize("which", range(len(INSTANCES)))
def test_random_data_matches_rescore(runner, tmp_path, which):
    """K = 132 (a second column chunk, lanes idle in it), two splits (8 lists), rows past the
    block, a NaN row; clustered data, some rows of thin margins (both certificates)."""
    inner, largest = INSTANCES[which]
    dot = inner == "Dot"
    g = torch.Generator().manual_seed(which)
    M, N, K, k, sel = 42, 500, 132, 10, 24
    centres = torch.randn(6, K, generator=g)
    spread = torch.where(torch.arange(M) % 2 == 0, 1.0, 0.02)[:, None]  # thin margins on odd rows
    x = centres[torch.randint(0, 6, (M,), generator=g)] + spread * torch.randn(M, K, generator=g)
    y = centres[torch.randint(0, 6, (N,), generator=g)] + 0.3 * torch.randn(N, K, generator=g)
    x[7] = float("nan")
    approx = _approx(x, y, dot, which)
    scratch = _lists(approx, 8, sel, dot, largest)
    root = which == 0  # l2: the square root of the selected values
    v, i, ok, yn = _run(runner, tmp_path, which, x, y, scratch, k, sel, root)
    rv, ri, rok = _oracle(x, y, scratch, k, sel, yn, dot, largest, root)
    assert torch.equal(i, ri)
    assert torch.equal(ok, rok) and ok.any() and not ok.all()
    torch.testing.assert_close(v, rv, rtol=2e-6, atol=1e-6, equal_nan=True)
    assert v[7].isnan().all()


@pytest.mark.parametrize("which", range(len(INSTANCES)))
def test_integer_ties_and_pads_are_exact(runner, tmp_path, which):
    """Small integer coordinates (every float32 sum exact): duplicate points tie and are ordered
    by index, values bitwise, a NaN point; then N < kSel: lists shorter than kSel (pads), all certified."""
    inner, largest = INSTANCES[which]
    dot = inner == "Dot"
    g = torch.Generator().manual_seed(10 + which)
    M, N, K, sel = 25, 300, 96, 16
    x = torch.randint(-3, 4, (M, K), generator=g).float()
    y = torch.randint(-3, 4, (N, K), generator=g).float()
    y[100:110] = y[3]
    x[:5] = y[3]
    y[250, 0] = float("nan")  # a NaN point: first for the largest, last otherwise; max |y| NaN certifies nothing
    approx = _approx(x, y, dot, which, scale=0.0)
    for k, lists in ((8, 4), (1, 12)):
        scratch = _lists(approx, lists, sel, dot, largest)
        v, i, ok, yn = _run(runner, tmp_path, which, x, y, scratch, k, sel)
        rv, ri, rok = _oracle(x, y, scratch, k, sel, yn, dot, largest)
        assert torch.equal(i, ri) and torch.equal(ok, rok)
        torch.testing.assert_close(v, rv, rtol=0, atol=0, equal_nan=True)
    if not largest and not dot:
        assert (i[:5, 0] == 3).all()  # the first of the ties
    if largest:
        assert (i[:, 0] == 250).all()
    assert not ok.any()
    # pads: 10 points in 4 lists of up to 3, kSel 12
    x2, y2 = x[:9], y[:10]
    approx = _approx(x2, y2, dot, which, scale=0.0)
    scratch = _lists(approx, 4, 12, dot, largest)
    assert (scratch == (-1 ^ -(1 << 63))).any()
    v, i, ok, yn = _run(runner, tmp_path, which, x2, y2, scratch, 4, 12)
    rv, ri, rok = _oracle(x2, y2, scratch, 4, 12, yn, dot, largest)
    assert torch.equal(i, ri) and torch.equal(ok, rok) and torch.equal(v, rv) and ok.all()


def test_planner_wiring_on_the_cpu(runner, tmp_path, monkeypatch, settings):
    """plan.topk._run_mma end to end on CPU tensors with FUSED_RESCORE off and on: the launches
    are stood in for (topk_mma_kernel: the lists of exact values written at its pointer and
    packed layout; topk_rescore_kernel: this runner, reading and writing the planner's pointers
    and strides), 128 rows a launch (a short last one), strided outputs. Same indices and
    certificates as the torch path; the uncertified rows it returns go to the blocked path either
    way (ops.knn.recompute_rows)."""
    import ctypes

    from kermac_like.ops.knn import prepare_knn, recompute_rows
    from kermac_like.plan import topk as P
    from kermac_like.runtime import launcher, store

    g = torch.Generator().manual_seed(5)
    M, N, K, k = 140, 900, 128, 10
    centres = torch.randn(4, K, generator=g)
    x = centres[torch.randint(0, 4, (M,), generator=g)] + torch.randn(M, K, generator=g)
    y = centres[torch.randint(0, 4, (N,), generator=g)] + torch.randn(N, K, generator=g)
    x[17] = float("nan")
    call = prepare_knn(x, y, k)
    monkeypatch.setattr(P, "_device_index", lambda device: 0)
    monkeypatch.setattr(P, "_sm_count", lambda device: 1)  # 128 rows a launch: 128, 12
    monkeypatch.setattr(P, "_blocks_per_sm", lambda kernel: 1)
    monkeypatch.setattr(store, "get_kernel", lambda spec, device, debug=False: spec)
    settings(topk_mma_version=2)  # the stand-in below answers topk_mma_kernel (every version: same ABI)

    def read(ptr, count, dtype):
        return torch.frombuffer(bytearray(ctypes.string_at(ptr, count * dtype.itemsize)), dtype=dtype)

    def write(ptr, t):
        t = t.contiguous()
        ctypes.memmove(ptr, t.data_ptr(), t.numel() * t.element_size())

    launches = []
    base = [None]

    def fake_launch(spec, grid, args, debug=False):
        launches.append(spec.kernel.split("::")[-1])
        if spec.kernel.endswith("topk_mma_kernel"):
            xp, _, sp, rr, n, kp = args[:6]
            split, per = int(args[-2]), int(args[-1])
            assert int(n) == N and int(kp) == K and split == 1 and grid == (-(-int(rr) // 128), 1, 1)
            if base[0] is None:  # the first launch of a call reads row 0 (of the shifted copy)
                base[0] = xp
            r0 = (xp - base[0]) // (K * 4)
            approx = (x[r0:r0 + int(rr), None, :] - y[None]).square().sum(-1)
            write(sp, _lists(approx, 4 * split, P.mma_sel(k), False, False))
            return
        assert spec == P.topk_rescore_spec(False, False) and len(args) == 22
        sp, xp, yp, xnp, ynp, vp, ip, op, rr, n, kp, kk, sel, lists = args[:14]
        ldx, ldy, svm, svj, sim, sij, bound_k, root = args[14:]
        rr, sel, lists, kk = int(rr), int(sel), int(lists), int(kk)
        assert grid == (-(-rr // 4), 1, 1) and int(ldx) == int(ldy) == K and int(root) == 1
        assert bound_k.dtype == np.float32 and float(bound_k) == K * 2.0 ** -22
        xs = read(xp, rr * K, torch.float32).view(rr, K)
        fin, kin, outp = tmp_path / "in.bin", tmp_path / "keys.bin", tmp_path / "out.bin"
        torch.cat([xs.ravel(), y.ravel(), read(xnp, rr, torch.float32), read(ynp, 1, torch.float32)]).numpy().tofile(fin)
        read(sp, lists * rr * sel, torch.int64).numpy().tofile(kin)
        subprocess.run([str(runner), "0", str(rr), str(N), str(K), str(kk), str(sel), str(lists), "1",
                        repr(float(bound_k)), str(fin), str(kin), str(outp)], check=True)
        raw = torch.from_numpy(np.fromfile(outp, dtype=np.float64))
        v, i, ok = raw[:rr * kk].view(rr, kk).float(), raw[rr * kk:2 * rr * kk].view(rr, kk).long(), raw[2 * rr * kk:]
        for r in range(rr):
            for j in range(kk):
                write(vp + (r * int(svm) + j * int(svj)) * 4, v[r, j])
                write(ip + (r * int(sim) + j * int(sij)) * 8, i[r, j])
        write(op, ok.to(torch.uint8))
        certified.append(int(ok.sum()))

    monkeypatch.setattr(launcher, "launch", fake_launch)
    certified = []
    out = {}
    for fused in (False, True):
        settings(topk_fused_rescore=fused)
        base[0] = None
        v = torch.full((k, M), -7.0).t()  # strided outputs
        i = torch.full((M, 2 * k), -7, dtype=torch.int64)[:, ::2]
        recompute_rows(call, v, i, P._run_mma(call, v, i, False).nonzero().squeeze(1))
        out[fused] = v, i
    assert launches == ["topk_mma_kernel"] * 2 + ["topk_mma_kernel", "topk_rescore_kernel"] * 2
    assert 0 < sum(certified) < M
    want = torch.sort((x.double()[:, None] - y.double()[None]).square().sum(-1), dim=1, stable=True).indices[:, :k]
    keep = torch.arange(M) != 17
    assert torch.equal(out[True][1], out[False][1]) and torch.equal(out[True][1][keep], want[keep])
    torch.testing.assert_close(out[True][0], out[False][0], rtol=2e-6, atol=0, equal_nan=True)
