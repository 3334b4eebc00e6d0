"""CPU execution of cuda_templates/matvec.cuh's expanded (Gaussian) kernel: the template is
compiled with g++ behind a thin shim (each CUDA thread a std::thread, __syncthreads a barrier,
warp shuffles through a shared array) and run on odd shapes against float64, for the shipped
loop and the tuned variants (kUnrollJ, kPolyPairs, kPrefetch; bench/probes/matvec_d3_candidates.py):
partial last tiles (padded trips), split N ranges (the `part` output), rows that are too far
from the tile's centre to fold a_m out of the loop, and a NaN point. The float64 mode
(TOut = double): v read as float64, float64 products and sums (exact integer sums that float32
partials would round), split sums float64 through matvec_combine_kernel. The blocked float64 mode
(kF32Group): the float64 mode within its error bound, the same kernel values bit for bit.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from cpu_shim import THREAD_SHIM, build_cpu_runner


SHIM = THREAD_SHIM + r"""
#include "matvec.cuh"

using namespace kermac_like;
#define G(...) MatvecTraits<Inner::Diff, Power::Square, Power::Sqrt, Epilogue::Gaussian, float, 4, 1, true, __VA_ARGS__>
// The dot product (kK = 4, one column) in the float64 mode: exact integer terms.
using DotWide = MatvecTraits<Inner::Dot, Power::Noop, Power::Noop, Epilogue::None, float, 4, 1, false, 0, 0, -1,
                             false, double>;
@@INSTANCES@@

template <class Tr>
void run(const float* x, const float* y, const typename Tr::TVIn* v, typename Tr::TOut* out, typename Tr::TPart* part,
         int M, int N, int n_split, int per, const float* centre = nullptr) {
  gridDim = {unsigned((M + Tr::kBlockM - 1) / Tr::kBlockM), unsigned(n_split), 1};
  kl_run_grid(Tr::kThreads, [&] {
    matvec_kernel<Tr>(x, y, v, out, part, M, N, 3, 1, 3, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                      0, 0, nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, 0.f, nullptr, 0, 0, 0, 1.0f, nullptr, 0, 0, 0, 0.f,
                      0, 0.f, n_split, per, centre);
  });
}

int main(int argc, char** argv) {
  // argv: instance, M, N, n_split, tiles per split, input file (x | y | v), output file (out | part)
  const int which = std::atoi(argv[1]), M = std::atoi(argv[2]), N = std::atoi(argv[3]);
  const int n_split = std::atoi(argv[4]), per = std::atoi(argv[5]);
  std::vector<float> in(3 * M + 4 * N);
  FILE* f = std::fopen(argv[6], "rb");
  if (std::fread(in.data(), 4, in.size(), f) != in.size()) return 3;
  std::fclose(f);
  std::vector<float> out(M + n_split * M, 0.f);
  const float *x = in.data(), *y = x + 3 * M, *v = y + 3 * N;
  if (which >= 100) {  // float64 mode: v as N doubles after the floats; out (M) | part (n_split M) | combined (M)
    std::vector<double> vd(N);
    f = std::fopen(argv[6], "rb");
    std::fseek(f, long(4 * in.size()), SEEK_SET);
    if (std::fread(vd.data(), 8, vd.size(), f) != vd.size()) return 3;
    std::fclose(f);
    std::vector<double> o(2 * M + n_split * M, 0.0);
    double* part = n_split > 1 ? o.data() + M : nullptr;
    // The symmetric expanded form's centre, as plan.matvec forms it: the means of x and y averaged.
    float centre[3];
    for (int k = 0; k < 3; ++k) {
      double mx = 0.0, my = 0.0;
      for (int m = 0; m < M; ++m) mx += x[3 * m + k];
      for (int n = 0; n < N; ++n) my += y[3 * n + k];
      const double c = (mx / M + my / N) * 0.5;
      centre[k] = std::isfinite(c) ? float(c) : 0.0f;
    }
    switch (which) {
@@DCASES@@
      case 199: run<DotWide>(x, y, vd.data(), o.data(), part, M, N, n_split, per); break;
      default: return 4;
    }
    if (n_split > 1) {  // one thread walks the combination's grid-stride loop
      gridDim = {1, 1, 1};
      blockDim = {1, 1, 1};
      blockIdx = {0, 0, 0};
      threadIdx = {0, 0, 0};
      matvec_combine_kernel<MatvecCombineTraits<float, double>>(part, vd.data(), o.data() + M + n_split * M, M, N, 1, 1,
                                                                1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, nullptr, 0, 0,
                                                                0, 0.f, 0, n_split);
    }
    return kl_write(argv[7], o);
  }
  switch (which) {
@@CASES@@
    default: return 4;
  }
  return kl_write(argv[7], out);
}
"""

# (kPolyRows, kUnrollJ, kPolyPairs, kPrefetch): the shipped loop and the tuned variants.
VARIANTS = [
    (0, 0, -1, "false"),  # shipped
    (1, 0, -1, "false"),  # one polynomial row (shipped as the FMA-pipe exponential)
    (0, 4, 3, "false"),   # trips of 4 points, 3 polynomial pairs, default staging
    (0, 0, -1, "true"),   # register prefetch, trips of 2
    (0, 4, 4, "true"),
    (0, 8, 0, "true"),
]
# TOut = double (case 100 + i): the symmetric expanded form (no tuning knobs).
DOUBLE_VARIANTS = [(0, 0, -1, "false")]
# The blocked float64 mode (case 110 + i): kF32Group, points of a float32 partial (8: the shipped one).
BLOCKED_GROUPS = [8, 16, 32]
BLOCKED = {g: 110 + i for i, g in enumerate(BLOCKED_GROUPS)}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    inst = [f"using T{i} = G({p}{'' if u == 0 and q == -1 and pf == 'false' else f', {u}, {q}, {pf}'});"
            for i, (p, u, q, pf) in enumerate(VARIANTS)]
    cases = [f"    case {i}: run<T{i}>(x, y, v, out.data(), n_split > 1 ? out.data() + M : nullptr, M, N, n_split, per); "
             "break;" for i in range(len(VARIANTS))]
    inst += [f"using D{i} = G({p}, {u}, {q}, {pf}, double);" for i, (p, u, q, pf) in enumerate(DOUBLE_VARIANTS)]
    dcases = [f"      case {100 + i}: run<D{i}>(x, y, vd.data(), o.data(), part, M, N, n_split, per, centre); break;"
              for i in range(len(DOUBLE_VARIANTS))]
    inst += [f"using B{i} = G(0, 0, -1, false, double, {g});" for i, g in enumerate(BLOCKED_GROUPS)]
    dcases += [f"      case {110 + i}: run<B{i}>(x, y, vd.data(), o.data(), part, M, N, n_split, per, centre); break;"
               for i in range(len(BLOCKED_GROUPS))]
    src = (SHIM.replace("@@INSTANCES@@", "\n".join(inst)).replace("@@CASES@@", "\n".join(cases))
           .replace("@@DCASES@@", "\n".join(dcases)))
    exe = build_cpu_runner(tmp_path_factory, "matvec_cpu", src)
    return exe, exe.parent


def _reference(x, y, v):
    d2 = ((x[:, None, :].astype(np.float64) - y[None, :, :].astype(np.float64)) ** 2).sum(-1)
    return np.exp(-0.5 * d2) @ v.astype(np.float64)


@pytest.mark.parametrize("which", range(len(VARIANTS)))
@pytest.mark.parametrize("case", ["fold", "split_far_nan"])
def test_expanded_variants_cpu(runner, which, case, tmp_path):
    exe, _ = runner
    rng = np.random.default_rng(which + 10 * len(case))
    M, N = 301, 701  # one row tile; 3 y tiles, the last of 189 points (a partial trip)
    x = rng.standard_normal((M, 3)).astype(np.float32)
    y = rng.standard_normal((N, 3)).astype(np.float32)
    v = rng.random((N, 1)).astype(np.float32)
    n_split, per = 1, 3
    if case == "split_far_nan":
        n_split, per = 2, 2  # tiles 0-1 and 2
        x[7] = 12.0  # s |x - centre|^2 > kFoldMax: a_m stays in the loop (no fold)
        y[600] = np.nan  # a NaN point: every row NaN
    inp = tmp_path / "in.bin"
    np.concatenate([x.ravel(), y.ravel(), v.ravel()]).astype(np.float32).tofile(inp)
    outp = tmp_path / "out.bin"
    subprocess.run([str(exe), str(which), str(M), str(N), str(n_split), str(per), str(inp), str(outp)], check=True)
    raw = np.fromfile(outp, dtype=np.float32)
    if n_split == 1:
        got = raw[:M].astype(np.float64)
        ref = _reference(x, y, v)[:, 0]
        assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6
        assert (np.abs(got - ref) / np.abs(ref)).max() < 2e-6
    else:
        part = raw[M:].reshape(n_split, M).astype(np.float64)
        assert np.isnan(part[1]).all()  # y[600] lies in tile 2 (split 1)
        ref0 = _reference(x, y[:512], v[:512])[:, 0]
        ok = ref0 > 1e-30
        assert (np.abs(part[0][ok] - ref0[ok]) / ref0[ok]).max() < 2e-6


def _inputs(path, x, y, v32, v64=None):
    """The runner's input file: x | y | v as float32, then (float64 mode) v as float64."""
    parts = [np.concatenate([x.ravel(), y.ravel(), v32.ravel()]).astype(np.float32).tobytes()]
    if v64 is not None:
        parts.append(np.asarray(v64, dtype=np.float64).ravel().tobytes())
    path.write_bytes(b"".join(parts))


@pytest.mark.parametrize("which", range(len(DOUBLE_VARIANTS)))
def test_float64_output_cpu(runner, which, tmp_path):
    """TOut = double, the float64 mode: v read as float64, float64 products and sums: within
    float32's rounding of the float32-output twin (whose expanded form centres on the CTA's
    rows instead of the symmetric centre), not rounded to float32
    (test_float64_mode_sums_exactly_cpu shows v and the sums exact); with a split N range the float64 partial sums reach matvec_combine_kernel unrounded (its
    result is their sum in split order)."""
    exe, _ = runner
    f32_twin = VARIANTS.index(DOUBLE_VARIANTS[which])
    rng = np.random.default_rng(40 + which)
    M, N = 301, 1789  # 7 y tiles of 256, the last partial
    x = rng.standard_normal((M, 3)).astype(np.float32)
    y = (0.5 * rng.standard_normal((N, 3))).astype(np.float32)
    v64 = rng.random((N, 1)) + 1.0  # positive terms: a coherent sum; not float32 values
    v32 = v64.astype(np.float32)
    inp = tmp_path / "in.bin"
    _inputs(inp, x, y, v32, v64)

    def go(w, n_split, per, dtype):
        outp = tmp_path / f"out{w}_{n_split}.bin"
        subprocess.run([str(exe), str(w), str(M), str(N), str(n_split), str(per), str(inp), str(outp)], check=True)
        return np.fromfile(outp, dtype=dtype)

    out32 = go(f32_twin, 1, 7, np.float32)[:M].astype(np.float64)
    raw = go(100 + which, 1, 7, np.float64)
    out64 = raw[:M]
    ref = _reference(x, y, v64)[:, 0]
    assert (np.abs(out64 - out32) / out64).max() < 2e-6  # the twin's kernel values (CTA-centred) and float32 sums
    assert (out64 != out64.astype(np.float32).astype(np.float64)).mean() > 0.9  # not rounded to float32
    assert (np.abs(out64 - ref) / ref).max() < 2e-6
    # split: tiles 0-3 and 4-6; part and the combination stay in float64
    raw = go(100 + which, 2, 4, np.float64)
    part = raw[M:3 * M].reshape(2, M)
    combined = raw[3 * M:]
    assert np.array_equal(combined, part[0] + part[1])
    assert (np.abs(combined - out64) / out64).max() < 1e-14  # float64 association only
    assert (combined != combined.astype(np.float32).astype(np.float64)).mean() > 0.9


def test_float64_mode_sums_exactly_cpu(runner, tmp_path):
    """The float64 mode with the dot product on integers: every term k * v is an integer
    below 2^40 and the sum cancels (alternating signs of 2^30-sized v), so float64 products and
    sums give the exact integer, where float32 tile partials (the float32 mode) could not."""
    exe, _ = runner
    rng = np.random.default_rng(77)
    M, N = 300, 1500
    x = rng.integers(-8, 9, (M, 3)).astype(np.float32)
    y = rng.integers(-8, 9, (N, 3)).astype(np.float32)
    v = (rng.integers(1 << 29, 1 << 30, N) * np.where(np.arange(N) % 2, -1, 1) + rng.integers(-3, 4, N))
    inp, outp = tmp_path / "in.bin", tmp_path / "out.bin"
    _inputs(inp, x, y, np.zeros(N, np.float32), v)
    for n_split, per in ((1, 6), (3, 2)):
        subprocess.run([str(exe), "199", str(M), str(N), str(n_split), str(per), str(inp), str(outp)], check=True)
        raw = np.fromfile(outp, dtype=np.float64)
        got = raw[:M] if n_split == 1 else raw[M + n_split * M:]
        exact = x.astype(np.int64) @ y.astype(np.int64).T @ v.astype(np.int64)
        assert np.array_equal(got, exact.astype(np.float64)), n_split


@pytest.mark.parametrize("group", BLOCKED_GROUPS)
def test_blocked_float64_mode_cpu(runner, group, tmp_path):
    """The blocked float64 mode (v staged in float32, float32 partials of `group` points, float64
    totals) against the float64 mode, which has the same kernel values k bit for bit: the
    difference is v's rounding and the group sums, at most (group + 1) u sum_n |k v| with u = 2^-24
    (recursive FFMA sums of `group` terms: gamma_group; v: u), whatever N; positive and
    sign-changing v, a partial last tile (padded group). Split N ranges: the groups are the same
    (tiles start at multiples of kBlockN), so split and unsplit agree to float64 association."""
    exe, _ = runner
    u = 2.0 ** -24
    rng = np.random.default_rng(60 + group)
    M, N = 301, 1789  # 7 y tiles of 256, the last of 253 points (not whole groups)
    x = rng.standard_normal((M, 3)).astype(np.float32)
    y = (0.5 * rng.standard_normal((N, 3))).astype(np.float32)

    def go(w, v64, n_split, per, tag):
        inp, outp = tmp_path / f"in{tag}.bin", tmp_path / f"out{tag}_{w}_{n_split}.bin"
        _inputs(inp, x, y, v64.astype(np.float32), v64)
        subprocess.run([str(exe), str(w), str(M), str(N), str(n_split), str(per), str(inp), str(outp)], check=True)
        raw = np.fromfile(outp, dtype=np.float64)
        return raw[:M] if n_split == 1 else (raw[M:M + n_split * M].reshape(n_split, M), raw[M + n_split * M:])

    stats = []
    for tag, v64 in (("pos", rng.random(N) + 1.0), ("mixed", rng.standard_normal(N))):
        f64 = go(100, v64, 1, 7, tag)
        mag = go(100, np.abs(v64), 1, 7, tag + "abs")  # sum |k v| (k > 0)
        blk = go(BLOCKED[group], v64, 1, 7, tag)
        err = np.abs(blk - f64) / mag
        stats.append(f"{tag}: max {err.max() / u:.2f} u, rms {np.sqrt((err ** 2).mean()) / u:.2f} u")
        assert err.max() <= (group + 1) * u
        assert (blk != blk.astype(np.float32).astype(np.float64)).mean() > 0.9  # the totals are float64
        if tag == "pos":
            ref = _reference(x, y, v64[:, None])[:, 0]
            assert (np.abs(blk - ref) / ref).max() < 2e-6
        part, combined = go(BLOCKED[group], v64, 2, 4, tag)  # tiles 0-3 and 4-6
        assert np.array_equal(combined, part[0] + part[1])
        assert (np.abs(combined - blk) / mag).max() < 1e-14
    print(f"blocked float64 mode, {group} points a partial, |blocked - float64 mode| / sum |k v|:", "; ".join(stats))


@pytest.mark.parametrize("which", [100, BLOCKED[8]])
def test_float64_mode_kernel_values_are_transposes_cpu(runner, which, tmp_path):
    """The float64 mode's symmetric expanded form: k(x_i, y_j) from K(x, y) e_j equals k(y_j, x_i)
    from K(y, x) e_i bit for bit (one-hot v: the output is one kernel value, exactly), with the
    centre of both calls the same by construction; and the values are within float32 rounding
    of the float64 kernel. Rows over several y tiles and an infinite row (k = 0 on both sides; a
    NaN point would make every sum NaN, even with a zero weight). The blocked float64 mode (110)
    gives the same bits (k times an exact 1 in float32, added to zeros)."""
    exe, _ = runner
    rng = np.random.default_rng(5)
    M, N = 301, 701
    x = rng.standard_normal((M, 3)).astype(np.float32)
    y = (0.7 * rng.standard_normal((N, 3)) + 0.3).astype(np.float32)
    x[11] = np.inf
    I, J = [0, 5, 11, 200, 300], [3, 257, 650, 700, 511]

    def column(a, b, j, tag):
        n = b.shape[0]
        v = np.zeros(n)
        v[j] = 1.0
        inp, outp = tmp_path / f"in{tag}.bin", tmp_path / f"out{tag}.bin"
        _inputs(inp, a, b, np.zeros(n, np.float32), v)
        subprocess.run([str(exe), str(w), str(a.shape[0]), str(n), "1", "3", str(inp), str(outp)], check=True)
        return np.fromfile(outp, dtype=np.float64)[:a.shape[0]]

    w = which
    kxy = {j: column(x, y, j, f"xy{j}") for j in J}
    kyx = {i: column(y, x, i, f"yx{i}") for i in I}
    for i in I:
        for j in J:
            a, b = kxy[j][i], kyx[i][j]
            assert a == b, (i, j, a, b)
    if which != 100:
        w = 100
        assert all(np.array_equal(kxy[j], column(x, y, j, f"xy{j}f64")) for j in J)
    d2 = ((x[:, None, :].astype(np.float64) - y[None, J, :].astype(np.float64)) ** 2).sum(-1)
    ref = np.exp(-0.5 * d2)
    got = np.stack([kxy[j] for j in J], 1)
    assert (got[11] == 0).all()
    ok = np.ones_like(ref, bool)
    ok[11] = False
    assert (np.abs(got - ref)[ok] / ref[ok]).max() < 2e-6
