"""The planner of the fused k-means++ seeding: cuda_templates/kmeans.cuh.

:class:`Seeding` ``(X, n_clusters, weights, u, debug)`` holds the state of a fused seeding and
the launches of each of its rounds; :func:`seed_plusplus` runs it and returns ``(centres, idx)``
of :func:`kermac_like.cluster.kmeans_plusplus` from the pre-drawn uniforms ``u``
((n_clusters, 2 TRIALS + 1) float64: cluster.seed_uniforms), or None when the fused kernels do
not serve the call (the torch path then runs, the same algorithm). They serve CUDA tensors on
sm_80 and newer in float32 (float16 / bfloat16 upcast here; float64 keeps the torch path) with
fewer than 2^31 - 2^10 points.

Launches, in stream order: kmeans_update_kernel with s = -1 (the block sums of the weights) and
the first round's kmeans_draw_kernel (centre 0); then per round, after reading the count of
centres drawn (one host synchronisation a round): kmeans_gap_kernel (from the second round),
kmeans_update_kernel over every point for the round's centres, and the next round's draw. A
round draws up to ROUND = 128 centres by rejection from the state at its start (exact D^2
sampling, cuda_templates/kmeans.cuh), so a seeding of C centres takes about C / 128 rounds plus
one per centre whose TRIALS = 8 proposals were all rejected. The same data and u give bitwise
the same centres (fixed-order sums, no atomics). Memory: 8 bytes a point (d2, near) and 16 bytes
per 1024 points, freed when the seeding returns.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from .. import config
from ..runtime import launcher, store
from ..runtime.specs.kmeans import (ASSIGN_MAX_K, BLOCK_M, BOUNDS_LAUNCH, ROUND, SEGSUM_ROWS, THREADS, TRIALS,
                                    assign_k_bucket, assign_prep_spec, assign_spec, bounds_spec, draw_spec, gap_spec,
                                    segsum_combine_spec, segsum_spec, update_spec)
from ..runtime.specs.topk import k_bucket, rows_per_thread, sel_bucket
from .core import Launch, Plan, _device_index, _gpu_ok

log = logging.getLogger("kermac_like.kmeans")

__all__ = ["Seeding", "seed_plusplus", "fused_serves", "segsum_serves", "plan_segment_sums",
           "segment_sums_fused", "assign_serves", "assign_tau", "assign_split",
           "plan_assign", "assign_mma", "ASSIGN_UP_TO", "BOUNDS_MAX_C", "bound_consts", "centre_bounds",
           "bounds_serve", "BoundedAssign", "local_rows"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The settings kmeans_fused and kmeans_segsum off (KERMAC_LIKE_KMEANS_FUSED=0, _SEGSUM=0) send CUDA
# seedings (cluster._kmeans_plusplus_torch) and Lloyd's update (sort + segment_reduce) to torch.
# Lloyd's assignment (CUDA, float32, K <= ASSIGN_UP_TO) on the tensor-core kernel
# (cuda_templates/kmeans_assign_mma.cuh: the same labels and distances as knn's, bitwise);
# the setting kmeans_assign_mma off (KERMAC_LIKE_KMEANS_ASSIGN_MMA=0) turns it off. Measured on an H100 at N = 10^7
# (bench/probes/kmeans_assign_probe.py, bench/notes/kmeans.md): D = 16, 1024 centres 13.9 -> 8.7 ms;
# D = 8 1.3-1.5x faster; D = 32 no faster (C = 1024, 4096) or slower (C = 256): K <= 16 only.
ASSIGN_UP_TO = 16
# The pruned iterations' assignments with the certificate about a local reference (issue 42, Design 1:
# kmeans_assign_mma.cuh KmeansAssignTraits<kK, true>; rows ordered by their old labels, each CTA's rows and
# centres measured from the centre of its first row's label, far centres left out): the same labels and
# distances bitwise, far fewer rows to the exact rescan on data whose clusters are small against their
# distance from the reference point. Measured on an H200 (bench/notes/kmeans.md, "Issue 42, round 4"; 10^7 x 16,
# 1024 clusters, 20 iterations): wide blobs 412 -> 227 ms, but ReLU 216 -> 305, pixels 191 -> 275 and the bench
# data 127 -> 141 ms (the rows' order by label costs more than the rescan it saves where the global certificate
# holds). So the setting kmeans_local is "auto": the first assignment's certificate decides, the local one
# where it leaves more than LOCAL_SHARE of the rows to the rescan (wide blobs 0.45, pixels 0.008).
LOCAL_SHARE = 0.05


def fused_serves(X: torch.Tensor) -> bool:
    """Whether the fused kernels serve a seeding of X (N, K) (else: the torch path)."""
    return (config.get("kmeans_fused") and X.dim() == 2 and X.dtype in _DTYPES and 0 < X.shape[0] < 2 ** 31 - BLOCK_M
            and X.shape[1] > 0 and _gpu_ok(X))


class Seeding:
    """A fused k-means++ seeding of X (N, K) with ``n_clusters`` centres from the uniforms ``u``
    ((n_clusters, 2 TRIALS + 1) float64): its state on X's device and the launches of its rounds
    (:meth:`start`, :meth:`round`); :meth:`run` executes them. Built only where
    :func:`fused_serves` holds."""

    def __init__(self, X: torch.Tensor, n_clusters: int, weights: torch.Tensor | None, u: torch.Tensor,
                 debug: bool = False):
        device = _device_index(X.device)
        dev = X.device
        N, K = X.shape
        C = int(n_clusters)
        if u.shape != (C, 2 * TRIALS + 1):
            raise ValueError(f"u: expected shape ({C}, {2 * TRIALS + 1}), got {tuple(u.shape)}")
        self.N, self.K, self.C, self.debug = N, K, C, debug
        self.x = X if X.dtype == torch.float32 else X.float()
        self.w = None if weights is None else weights.to(device=dev, dtype=torch.float32).contiguous()
        self.wp = 0 if self.w is None else self.w.data_ptr()  # (0: unit weights)
        self.u = u.to(device=dev, dtype=torch.float64).contiguous()
        self.nb = nb = -(-N // BLOCK_M)
        self.centres = torch.empty((C, K), dtype=torch.float32, device=dev)
        self.idx = torch.empty(C, dtype=torch.int64, device=dev)
        self.d2 = torch.empty(N, dtype=torch.float32, device=dev)
        self.near = torch.empty(N, dtype=torch.int32, device=dev)
        self.bsum = torch.empty(nb, dtype=torch.float64, device=dev)
        self.cum = torch.empty(nb, dtype=torch.float64, device=dev)
        self.gap = torch.empty(C, dtype=torch.float32, device=dev)
        self.count = torch.zeros(1, dtype=torch.int32, device=dev)
        specs = [update_spec(K), gap_spec(), draw_spec()]
        store.prefetch(specs, device, debug=debug)  # compiled side by side on a first call
        self.upd, self.gapk, self.draw = (store.get_kernel(sp, device, debug=debug) for sp in specs)
        sxm, sxk = (np.int64(st) for st in self.x.stride())
        self._common = (np.int32(N), np.int32(K), sxm, sxk, np.int64(K))
        if debug:
            log.debug("kmeans++ seeding: N=%d K=%d clusters=%d weighted=%s: rounds of up to %d centres, %d "
                      "proposals a centre, update grid (%d, 1, 1)", N, K, C, self.w is not None, ROUND, TRIALS, nb)

    def _update(self, s: int, e: int) -> Launch:
        return Launch(self.upd, (self.nb, 1, 1),
                      (self.x.data_ptr(), self.wp, self.centres.data_ptr(), self.gap.data_ptr(), self.d2.data_ptr(),
                       self.near.data_ptr(), self.bsum.data_ptr()) + self._common + (np.int32(s), np.int32(e)))

    def _draw(self, s: int) -> Launch:
        return Launch(self.draw, (1, 1, 1),
                      (self.x.data_ptr(), self.wp, self.d2.data_ptr(), self.bsum.data_ptr(), self.cum.data_ptr(),
                       self.u.data_ptr(), self.idx.data_ptr(), self.centres.data_ptr(), self.count.data_ptr())
                      + self._common + (np.int32(self.nb), np.int32(self.C), np.int32(s), np.int32(TRIALS)))

    def start(self) -> list:
        """The first launches: the block sums of the weights, the draw of centre 0."""
        return [self._update(-1, 0), self._draw(0)]

    def round(self, s: int, e: int) -> list:
        """The launches after a round that drew centres [s, e): their gaps to the earlier centres
        (s > 0), their fold into the state, the next round's draw (from e)."""
        out = []
        if s > 0:
            out.append(Launch(self.gapk, (-(-s // THREADS), 1, 1),
                              (self.centres.data_ptr(), self.gap.data_ptr(), np.int32(self.K), np.int64(self.K),
                               np.int32(s), np.int32(e))))
        return out + [self._update(s, e), self._draw(e)]

    def run(self) -> tuple:
        """(centres (C, K) float32, idx (C,) int64): the launches round after round, one host
        synchronisation a round (the count of centres drawn)."""
        def go(launches):
            for ln in launches:
                launcher.launch(ln.kernel, ln.grid, ln.args, debug=self.debug)
            return int(self.count.item())

        s, e, rounds = 0, go(self.start()), 1
        while e < self.C:
            s, e = e, go(self.round(s, e))
            rounds += 1
        self.last = s  # the last round's centres [s, C) are drawn, not folded into (d2, near)
        if self.debug:
            log.debug("kmeans++ seeding: %d centres in %d rounds", self.C, rounds)
        self.rounds = rounds
        return self.centres, self.idx


def seed_plusplus(X: torch.Tensor, n_clusters: int, weights: torch.Tensor | None, u: torch.Tensor,
                  debug: bool = False, hint: list | None = None):
    """(centres (C, K) in X's dtype, indices (C,) int64) of the fused seeding, or None when it
    does not serve X. ``hint`` (a list) gets every point's nearest centre (N,) int32 after one more
    update launch (the last round's fold: the first Lloyd assignment's row order, plan.kmeans.BoundedAssign)."""
    if not fused_serves(X):
        return None
    seeding = Seeding(X, n_clusters, weights, u, debug)
    centres, idx = seeding.run()
    if hint is not None:  # fold the last round too (its gaps and the update, no draw): near is the nearest
        for ln in seeding.round(seeding.last, n_clusters)[:-1]:
            launcher.launch(ln.kernel, ln.grid, ln.args, debug=debug)
        hint.append(seeding.near)
    if X.dtype != torch.float32:  # the rows themselves, in X's dtype
        centres = X.index_select(0, idx)
    return centres, idx


# -- Lloyd's update ------------------------------------------------------------------------------
def segsum_serves(X: torch.Tensor, n_clusters: int) -> bool:
    """Whether the fused segmented sum serves Lloyd's update of X (float32 on sm_80+)."""
    N, K = X.shape
    return (config.get("kmeans_segsum") and X.dtype == torch.float32 and 0 < N < 2 ** 31 and K > 0
            and n_clusters * (K + 1) < 2 ** 31 and N // SEGSUM_ROWS + n_clusters < 2 ** 31 and _gpu_ok(X))


def plan_segment_sums(X: torch.Tensor, perm: torch.Tensor, bounds: torch.Tensor, weights: torch.Tensor | None,
                      n_clusters: int, debug: bool = False):
    """The plan of the segmented sum from a stable sort of the labels (``perm`` (N,) int64) and
    the clusters' row ranges in it (``bounds`` (C + 1,) int64): its run returns (sums (C, K)
    float64, weight per cluster (C,) float64). None when the kernels do not serve X."""
    if not segsum_serves(X, n_clusters):
        return None
    device = _device_index(X.device)
    dev = X.device
    N, K = X.shape
    C = int(n_clusters)
    w = None if weights is None else weights.to(device=dev, dtype=torch.float32).contiguous()
    perm = perm.to(torch.int64).contiguous()
    bounds = bounds.to(torch.int64).contiguous()
    items = torch.zeros(C + 1, dtype=torch.int64, device=dev)
    torch.cumsum((bounds.diff() + (SEGSUM_ROWS - 1)) // SEGSUM_ROWS, 0, out=items[1:])
    n_items = -(-N // SEGSUM_ROWS) + C  # at least every cluster's item count (no host synchronisation)
    part = torch.empty(n_items * (K + 1), dtype=torch.float64, device=dev)
    out = torch.empty(C * (K + 1), dtype=torch.float64, device=dev)
    store.prefetch([segsum_spec(), segsum_combine_spec()], device, debug=debug)
    main = store.get_kernel(segsum_spec(), device, debug=debug)
    comb = store.get_kernel(segsum_combine_spec(), device, debug=debug)
    sxm, sxk = (np.int64(t) for t in X.stride())
    args = (X.data_ptr(), 0 if w is None else w.data_ptr(), perm.data_ptr(), bounds.data_ptr(), items.data_ptr(),
            part.data_ptr(), np.int32(K), np.int32(C), sxm, sxk, np.int32(SEGSUM_ROWS))
    cgrid = (max(1, min(-(-(C * (K + 1)) // comb.spec.launch.threads), 1024)), 1, 1)
    cargs = (part.data_ptr(), items.data_ptr(), out.data_ptr(), out.data_ptr() + C * K * 8, np.int32(K), np.int32(C))
    if debug:
        log.debug("kmeans segment sums: N=%d K=%d clusters=%d weighted=%s: grid (%d, 1, 1)", N, K, C, w is not None,
                  n_items)
    launches = (Launch(main, (n_items, 1, 1), args), Launch(comb, cgrid, cargs))
    return Plan("kmeans_segsum", main.spec, launches, out, scratch=(w, perm, bounds, items, part), debug=debug)


def segment_sums_fused(X: torch.Tensor, perm: torch.Tensor, bounds: torch.Tensor, weights: torch.Tensor | None,
                       n_clusters: int, debug: bool = False):
    """(sums (C, K) float64, weight per cluster (C,) float64) by the fused kernels, or None."""
    plan = plan_segment_sums(X, perm, bounds, weights, n_clusters, debug)
    if plan is None:
        return None
    out = plan.run()
    C, K = int(n_clusters), X.shape[1]
    return out[:C * K].view(C, K), out[C * K:]


# -- Lloyd's assignment on tensor cores ------------------------------------------------------------
_U = 2.0 ** -24  # unit roundoff of float32
# The MMA model of the certificate: one mma.sync m16n8k8 (8 exact TF32 products and the accumulator)
# is within RHO u (|accumulator| + sum |products|) of the exact sum (measured hardware truncates the
# aligned sum to about 24 bits: <= 9 terms x 2u; RHO = 32 leaves a factor of ~2).
_RHO = 32.0


def assign_tau(K: int) -> float:
    """The certificate's constant: a row is certified when (second - best) > tau B with B = X + cmax
    (bench/notes/kmeans.md, "The assignment on mma.sync (session 13)"): 1.25 (2 E + 2 Q + 4 gamma) with,
    in units of u B, E = (K + 3) (the norms and the shift) + 16 (the split) + 3 (kK / 8) RHO 3.1 (the
    MMAs), Q = 2^(5 - 23) / u x 2.1 (the key's 5 low bits), gamma = 1.01 (K + 4) (the exact path)."""
    kK = assign_k_bucket(K)
    e = (K + 3) + 16 + 3 * (kK // 8) * _RHO * 3.1
    q = 2.0 ** (5 - 23) / _U * 2.1
    gamma = 1.01 * (K + 4)
    tau = 1.25 * (2 * e + 2 * q + 4 * gamma) * _U
    return float(np.nextafter(np.float32(tau), np.float32(1)))  # rounded up to a float32


def assign_split(K: int) -> int:
    """1 where knn's SIMT kernel sums a distance in two interleaved partial sums (TopkTraits::kAcc == 2
    for k = 1: one row per thread and kK >= 8), else 0: the kernel's exact path mirrors it."""
    kK = k_bucket(K)
    return int(rows_per_thread(kK, sel_bucket(1)) == 1 and kK >= 8)


def assign_serves(X: torch.Tensor, centres: torch.Tensor) -> bool:
    """Whether the tensor-core assignment serves X (N, K) against centres (C, K): kmeans_assign_mma, float32
    CUDA tensors on sm_80+, 1 <= K <= 64."""
    if not (config.get("kmeans_assign_mma") and X.dim() == 2 and centres.dim() == 2 and X.dtype == torch.float32
            and centres.dtype == torch.float32):
        return False
    N, K = X.shape
    C = centres.shape[0]
    return (0 < N < 2 ** 31 - 512 and 0 < C < 2 ** 31 - 256 and 1 <= K <= ASSIGN_MAX_K and centres.shape[1] == K
            and centres.device == X.device and _gpu_ok(X))


class _Bounds(NamedTuple):
    """The pruned iteration's outputs of an assignment (BoundedAssign): bounds (N,) f32, the clusters'
    largest ub (C,) i32 (float bits), the changed-label count (1,) i32 or None."""
    ub: torch.Tensor
    lb: torch.Tensor
    rmax: torch.Tensor
    changed: torch.Tensor | None = None


def plan_assign(X: torch.Tensor, centres: torch.Tensor, debug: bool = False, certificates: bool = False,
                rows: torch.Tensor | None = None, n_rows: int | None = None, labels: torch.Tensor | None = None,
                dist: torch.Tensor | None = None, bounds: _Bounds | None = None, local: bool = False):
    """The plan of one assignment: its run returns (labels (N,) int64, dist (N,) float32, cert (N,) uint8
    or None): knn(X, centres, 1, direct differences)'s indices and values, bitwise. Two launches: the
    centres' split (one CTA), then kmeans_assign_mma_kernel. None when the kernel does not serve.

    For the pruned iterations (BoundedAssign): ``rows`` (int32) assigns only the points rows[:n_rows],
    writing into the given ``labels`` / ``dist`` at those points; ``bounds`` adds their distance bounds.
    ``local`` (kK <= 32): ``labels`` holds every assigned point's old label in [0, C) (any such label is
    valid; the certificate is tight where the rows come ordered by it) and the kernel certifies about each
    CTA's reference centre (KmeansAssignTraits<kK, true>)."""
    if not assign_serves(X, centres):
        return None
    device = _device_index(X.device)
    dev = X.device
    N, K = X.shape
    C = centres.shape[0]
    c = centres if centres.stride(1) == 1 else centres.contiguous()
    local = bool(local) and labels is not None and assign_k_bucket(K) <= 32  # kK 64 local: spills (ptxas)
    spec, pspec = assign_spec(K, local), assign_prep_spec(K)
    kK, bn = assign_k_bucket(K), spec.launch.block_n
    cp = -(-C // bn) * bn
    # (cp / 8, kK / 8, 32) uint4 B fragments, then (cp / 32, K, 32) f32 centres for the rescan's coalesced reads
    cf = torch.empty(cp * (kK * 2 + K), dtype=torch.float32, device=dev)
    cn = torch.empty(cp, dtype=torch.float32, device=dev)
    cmax = torch.empty(1, dtype=torch.float32, device=dev)
    labels = torch.empty(N, dtype=torch.int64, device=dev) if labels is None else labels
    dist = torch.empty(N, dtype=torch.float32, device=dev) if dist is None else dist
    cert = torch.empty(N, dtype=torch.uint8, device=dev) if certificates else None
    store.prefetch([pspec, spec], device, debug=debug)
    prep = store.get_kernel(pspec, device, debug=debug)
    main = store.get_kernel(spec, device, debug=debug)
    sxm, sxk = (np.int64(t) for t in X.stride())
    ldc = np.int64(c.stride(0))
    pargs = (c.data_ptr(), cf.data_ptr(), cn.data_ptr(), cmax.data_ptr(), np.int32(C), np.int32(K), ldc)
    M = N if rows is None else int(n_rows)
    gu, gl, _ = bound_consts(K)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    b = bounds or _Bounds(None, None, None)
    grid = (-(-M // spec.launch.block_m), 1, 1)
    args = (X.data_ptr(), c.data_ptr(), cf.data_ptr(), cn.data_ptr(), cmax.data_ptr(), labels.data_ptr(),
            dist.data_ptr(), ptr(cert), np.int32(M), np.int32(C), np.int32(K), sxm, sxk, ldc,
            np.float32(assign_tau(K)), np.int32(assign_split(K)), ptr(rows), ptr(b.ub), ptr(b.lb), ptr(b.rmax),
            ptr(b.changed), np.float32(gu), np.float32(gl))
    if debug:
        log.debug("kmeans assignment on tensor cores: N=%d K=%d (kK %d) clusters=%d local=%s: grid %s", M, K, kK, C,
                  local, grid)
    launches = (Launch(prep, (1, 1, 1), pargs),) + ((Launch(main, grid, args),) if M > 0 else ())
    return Plan("kmeans_assign", spec, launches, (labels, dist, cert), scratch=(c, cf, cn, cmax), debug=debug)


def assign_mma(X: torch.Tensor, centres: torch.Tensor, debug: bool = False):
    """(labels (N,) int64, dist (N,) float32) of the tensor-core assignment where it is the faster
    one (K <= ASSIGN_UP_TO), or None (knn's SIMT argmin then)."""
    if X.dim() != 2 or X.shape[1] > ASSIGN_UP_TO:
        return None
    plan = plan_assign(X, centres, debug)
    if plan is None:
        return None
    labels, dist, _ = plan.run()
    return labels, dist


# -- Lloyd's iterations with distance bounds (cuda_templates/kmeans_assign_mma.cuh kmeans_bounds_kernel) --
# The setting kmeans_bounds off (KERMAC_LIKE_KMEANS_BOUNDS=0) assigns every point in every iteration
# instead (the same labels, bitwise).
# The centre statistics are C x C (float64, in row blocks): up to this many centres.
BOUNDS_MAX_C = 8192
BOUNDS_THREADS = BOUNDS_LAUNCH.threads


def bound_consts(K: int) -> tuple:
    """(gu, gl, kap) as float32 values: gu >= 1 / (1 - gamma), gl <= 1 / (1 + gamma), kap >= 1 + 4 gamma, with
    gamma = 1.01 (K + 4) u the exact path's relative error (assign_tau's gamma): kmeans_assign_mma.cuh's
    upper_of, lower_sq_of and keeps_label."""
    gamma = 1.01 * (K + 4) * _U
    f32 = np.float32
    gu = np.nextafter(f32(1.0 / (1.0 - gamma)), f32(2))
    gl = np.nextafter(f32(1.0 - 2.0 * gamma), f32(0))
    kap = np.nextafter(f32(1.0 + 4.0 * gamma), f32(2))
    return float(gu), float(gl), float(kap)


def _up32(t: torch.Tensor) -> torch.Tensor:
    """float64 t >= 0 -> a float32 >= it (the round-to-nearest error is below 2^-24 relative or 2^-150)."""
    return t.mul(1.0 + 2.0 ** -22).add_(2.0 ** -149).float()


def _down32(t: torch.Tensor) -> torch.Tensor:
    """float64 t >= 0 -> a float32 in [0, t]."""
    return t.mul(1.0 - 2.0 ** -22).sub_(2.0 ** -149).float().clamp_(min=0.0)


def centre_bounds(old: torch.Tensor, new: torch.Tensor, rmax: torch.Tensor, kap: float) -> tuple:
    """(drift, mdl, halfs, rth), (C,) float32 each, for the filter after the centres moved from ``old`` to
    ``new`` ((C, K) float32): drift[n] >= ||new_n - old_n||; halfs[a] <= min_{n != a} ||new_n - new_a|| / 2;
    the neighbourhood of a: the centres n != a within r_a = 2 kap (rmax[a] + drift[a]) (1 + 1e-4) + 2^-50 of
    new_a (rmax: the float bits of the cluster's largest ub before the move); rth[a] <= r_a <= the distance of
    every other centre, mdl[a] >= the largest drift in the neighbourhood. For the cluster's points
    (ub <= r_a / (2 kap)) the far centres are farther than ub kap, so only the near ones' drift lowers lb (the
    kernel's lb takes both parts, so it is a lower bound whatever r_a is). Float64 direct differences
    (relative error ~1e-15, inside the 1e-12 margins), rounded outward to float32; a few dozen small
    launches per step (their host time is most of the cost: ~0.3 ms at C = 1024), no synchronisation."""
    n = new.double()
    C, K = n.shape
    drift = torch.linalg.vector_norm(n - old.double(), dim=1).mul_(1.0 + 1e-12)
    r = (rmax.view(torch.float32).double() + drift).mul_((1.0 + 1e-4) * 2.0 * kap).add_(2.0 ** -50)
    r2 = r.square()
    halfs = torch.empty(C, dtype=torch.float64, device=n.device)
    mdl = torch.empty(C, dtype=torch.float64, device=n.device)
    B = max(1, min(C, 2 ** 24 // (C * K)))
    for a0 in range(0, C, B):
        a1 = min(C, a0 + B)
        cc = (n[a0:a1, None, :] - n[None, :, :]).square_().sum(2)  # (b, C) squared, direct differences
        cc.diagonal(offset=a0).fill_(float("inf"))
        torch.amin(cc, 1, out=halfs[a0:a1])
        torch.amax((cc < r2[a0:a1, None]) * drift, 1, out=mdl[a0:a1])  # drift >= 0: 0 outside
    return (_up32(drift), _up32(mdl), _down32(halfs.sqrt_().mul_(0.5 * (1.0 - 1e-12))),
            _down32(r.mul_(1.0 - 1e-11)))


def bounds_serve(X: torch.Tensor, n_clusters: int) -> bool:
    """Whether Lloyd's iterations on X (N, K) run pruned (BoundedAssign): kmeans_bounds, the tensor-core assignment
    serves (K <= ASSIGN_UP_TO) and 2 <= n_clusters <= BOUNDS_MAX_C."""
    return (config.get("kmeans_bounds") and X.dim() == 2 and X.shape[1] <= ASSIGN_UP_TO and 2 <= n_clusters <= BOUNDS_MAX_C
            and assign_serves(X, X[:1]))


def local_rows(keys: torch.Tensor, src: torch.Tensor | None, n_clusters: int, block_m: int) -> tuple:
    """(rows (M,) int32, M): the launch rows of a local-certificate assignment (plan_assign(local=True)):
    the points ``src`` (or 0..n-1) ordered by ``keys`` (their old labels in [0, C), stable), each label's rows
    starting at a CTA (a multiple of ``block_m``; the gaps padded with -1, which the kernel skips), so that a
    CTA's reference centre is its rows' own; without the padding (rows only sorted) where it would more than
    double the launch. One host synchronisation (M)."""
    n = keys.shape[0]
    dev = keys.device
    k = keys.int()
    order = torch.sort(k, stable=True).indices
    sk = k[order]
    rows = (order if src is None else src[order]).int()
    cnt = torch.bincount(sk, minlength=n_clusters)
    pc = (cnt + block_m - 1) // block_m * block_m
    M = int(pc.sum())
    if M > 2 * n:
        return rows, n
    start = torch.cumsum(cnt, 0) - cnt
    pstart = torch.cumsum(pc, 0) - pc
    pos = pstart[sk] + (torch.arange(n, device=dev) - start[sk])
    out = torch.full((M,), -1, dtype=torch.int32, device=dev)
    out[pos] = rows
    return out, M


class BoundedAssign:
    """Lloyd's assignments over the iterations of one run, pruned by Hamerly's bounds (an upper bound on
    each point's distance to its centre, a lower bound on the distance to every other centre), tightened by
    Elkan's half distance to the nearest other centre and by per-cluster neighbourhoods for the drift.

    ``first(centres)`` assigns every point (kmeans_assign_mma_kernel, with the bounds); each ``step(centres)``
    moves the bounds by the centres' drift (kmeans_bounds_kernel), keeps the label of every point the rule
    proves (kmeans_assign_mma.cuh keeps_label: every other centre's exact-path value is strictly larger) and
    assigns the rest (the same kernel on the work list). The labels are those of a full assignment, bitwise;
    ``exact_d2()`` gives the full assignment's squared distances (one pass over X where the last step pruned).
    Device memory: 24 bytes a point (labels, ub, lb, dist, work list) + O(C^2 / blocks) of centre statistics.
    One host synchronisation per step (the work list's length)."""

    def __init__(self, X: torch.Tensor, n_clusters: int, debug: bool = False):
        N, K = X.shape
        dev = X.device
        self.X, self.debug = X, debug
        self.consts = bound_consts(K)  # (gu, gl, kap)
        self.labels = torch.empty(N, dtype=torch.int64, device=dev)
        self.dist = torch.empty(N, dtype=torch.float32, device=dev)
        self.ub = torch.empty(N, dtype=torch.float32, device=dev)
        self.lb = torch.empty(N, dtype=torch.float32, device=dev)
        self.work = torch.empty(N, dtype=torch.int32, device=dev)
        self.rmax = torch.zeros(n_clusters, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(2, dtype=torch.int32, device=dev)  # the work list's length, labels changed
        self.centres = None
        self.fresh = False  # dist holds every point's distance
        self.assigned = 0  # points the last call sent to the tensor-core kernel
        self.local = False  # the pruned steps' certificate about each CTA's reference centre (first() decides)

    def _filter(self, stats=None):
        """One kmeans_bounds_kernel launch over every point at self.centres: the filter with ``stats``
        (centre_bounds' four (C,) tensors), else the exact mode into self.dist."""
        X, c = self.X, self.centres
        N, K = X.shape
        gu, _, kap = self.consts
        ptrs = (0,) * 9 + (self.dist.data_ptr(),)
        if stats is not None:
            ptrs = tuple(t.data_ptr() for t in (self.ub, self.lb, *stats, self.rmax, self.work, self.counters)) + (0,)
        sxm, sxk = (np.int64(t) for t in X.stride())
        args = (X.data_ptr(), c.data_ptr(), self.labels.data_ptr(), *ptrs, np.int32(N), np.int32(K), sxm, sxk,
                np.int64(c.stride(0)), np.int32(assign_split(K)), np.float32(kap), np.float32(gu))
        kernel = store.get_kernel(bounds_spec(), _device_index(X.device), debug=self.debug)
        launcher.launch(kernel, (-(-N // BOUNDS_THREADS), 1, 1), args, debug=self.debug)

    def first(self, centres: torch.Tensor, hint: torch.Tensor | None = None) -> torch.Tensor:
        """The full assignment; ``hint`` (N,) int: each point's nearest centre index as far as known (the
        seeding's), which orders the rows for the local certificate (kmeans_local); any values are valid."""
        self.rmax.zero_()
        N, K = self.X.shape
        C = centres.shape[0]
        mode = config.get("kmeans_local")
        can = assign_k_bucket(K) <= 32
        local = mode == "on" and can and hint is not None and hint.shape == (N,)
        rows, M = None, N
        if local:
            h = hint.int().clamp(0, C - 1)
            self.labels.copy_(h)
            rows, M = local_rows(h, None, C, assign_spec(K, True).launch.block_m)
        probe = mode == "auto" and can  # the global certificate's share of uncertified rows decides
        _, _, cert = plan_assign(self.X, centres, self.debug, labels=self.labels, dist=self.dist, rows=rows, n_rows=M,
                                 bounds=_Bounds(self.ub, self.lb, self.rmax), local=local, certificates=probe).run()
        if probe:  # (one host synchronisation)
            share = 1.0 - int(cert.sum(dtype=torch.int64).item()) / max(1, N)
            local = share > LOCAL_SHARE
            if self.debug:
                log.debug("kmeans: %.4f of the rows uncertified about the reference point: %s certificate", share,
                          "the local" if local else "the global")
        self.local = local
        self.centres, self.fresh, self.assigned = centres, True, self.X.shape[0]
        return self.labels

    def step(self, centres: torch.Tensor) -> tuple:
        """(labels, changed): the assignment to ``centres`` and the number of points whose label changed."""
        X = self.X
        c = centres if centres.stride(1) == 1 else centres.contiguous()
        stats = centre_bounds(self.centres, c, self.rmax, self.consts[2])
        self.rmax.zero_()
        self.counters.zero_()
        self.centres, self.fresh = c, False
        self._filter(stats)
        n = int(self.counters[0].item())
        if n:
            local = self.local
            rows, M = self.work, n
            if local:  # the work list by old label, each label's rows from a CTA's start
                w = self.work[:n]
                rows, M = local_rows(self.labels[w.long()], w, c.shape[0], assign_spec(X.shape[1], True).launch.block_m)
            plan_assign(X, c, self.debug, rows=rows, n_rows=M, labels=self.labels, dist=self.dist,
                        bounds=_Bounds(self.ub, self.lb, self.rmax, self.counters[1:]), local=local).run()
        if self.debug:
            log.debug("kmeans pruned assignment: %d of %d points assigned", n, X.shape[0])
        self.assigned = n
        return self.labels, int(self.counters[1].item())

    def exact_d2(self) -> torch.Tensor:
        """(N,) float64: every point's squared distance to its label's centre, the full assignment's bits."""
        if not self.fresh:
            self._filter()
            self.fresh = True
        return self.dist.to(torch.float64).square_()
