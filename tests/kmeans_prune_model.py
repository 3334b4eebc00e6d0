"""A float64 model of the pruned Lloyd iterations (plan.kmeans.BoundedAssign) and of the tensor-core
certificate (kmeans_assign_mma.cuh), for predicting on the CPU, per data family, the points each pruned step
sends to the assignment kernel and the share of its rows the certificate leaves to the exact rescan, for the
shipped rules and for proposed ones (issue 42; bench/notes/kmeans.md, "Issue 42, round 2").

Real arithmetic throughout (no float32 rounding: kap = 1, the certificate's error taken as tau B exactly), so
it predicts the rules' pruning, not their last-bit behaviour. Rules modelled per step:

  hamerly   the shipped filter: ub += drift[a]; lb = min(lb - mdl[a], rth[a] - ub); keep if ub < max(lb,
            halfs[a]), else ub exact and again; the rest to the kernel (all C centres); the kernel's lb: the
            certified gap (d2^2 - tau B) or the rescan's second distance.
  yinyang   G groups of centres (k-means on the first centres, fixed for the run), a lower bound per group
            (each moved by its group's largest drift); keep as above with lb = min over groups; else the row
            evaluates only the groups whose bound is below ub (and its own centre). Costs reported: rows to
            the kernel, row x centre evaluations (per row), and the MMA work of a warp-level skip (rows sorted
            by label, 32 a warp, the union of the warp's open groups, groups padded to multiples of 8).

Certificates (per row of the kernel, B as the kernel forms it):
  global    B = X_w + cmax: X_w the largest ||x||^2 of the warp's 32 rows (work-list order), cmax the largest
            ||c||^2 (the data about the fit's reference point).
  local     rows sorted by their old label; per warp a reference r = the current centre of its first row's
            label; X' = max ||x - r||^2 over the warp; centres with ||c - r||^2 > 9 X' are provably not any
            row's nearest (d >= (3 - 1) sqrt X' > sqrt X' >= ||x - r|| >= d_best, r being a centre) and are
            left out (lb there >= 2 sqrt X' - ||x - r||); B' = X' + max ||c - r||^2 over the others.

Run: PYTHONPATH=. python3 tests/kmeans_prune_model.py [-n 40000] [--clusters 1024] [--groups 64]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

TAU16 = 0.00011995435488643125  # plan.kmeans.assign_tau(16)


def families(n, d, C, seed):
    """The probe's families (bench/probes/kmeans_zoo_probe.py), float64, about the fit's reference point."""
    from kermac_like.testing import kmeans_estimator

    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    randint = lambda hi, *s: torch.randint(0, hi, s, generator=g)  # noqa: E731
    means = 4 * randn(C, d)
    bench = means[randint(C, n)] + randn(n, d)
    out = {"bench": bench}
    centres = 4.0 * randint(8, 8, d).float()
    wide = randn(n, d) + centres[randint(8, n)]
    out["blobs_wide"] = wide
    out["blobs_centred"] = wide - wide.mean(0)
    out["shifted100"] = bench + 100.0 * float(bench.std(0).mean())
    out["relu"] = randn(n, d).clamp_min_(0)
    u = n - n // 10
    px = randint(256, u, d).float().masked_fill_(torch.rand(u, d, generator=g) < 0.7, 0.0)
    out["pixels"] = px[torch.cat([torch.arange(u), randint(u, n - u)])[torch.randperm(n, generator=g)]]
    for k, X in out.items():
        out[k] = (X - kmeans_estimator._reference(X)).double()
    return out


def seeding(X, C, seed):
    from kermac_like.testing import kmeans_seeding

    c, _ = kmeans_seeding.kmeans_plusplus(X.float(), C, None, torch.Generator().manual_seed(seed))
    return c.double().numpy()


def sqd(X, c, rows=8192):
    """(N, C) squared distances, float64, by blocks (direct differences' accuracy is not needed here)."""
    cn = (c * c).sum(1)
    out = np.empty((X.shape[0], c.shape[0]))
    for b in range(0, X.shape[0], rows):
        x = X[b:b + rows]
        out[b:b + rows] = np.maximum((x * x).sum(1)[:, None] + cn[None, :] - 2.0 * x @ c.T, 0.0)
    return out


def two_smallest(D):
    p = np.partition(D, 1, axis=1)[:, :2]
    return np.sort(p, 1)


def group_min(D, perm, starts):
    """(rows, G): per group the smallest entry (columns permuted by group, groups starting at ``starts``)."""
    return np.minimum.reduceat(D[:, perm], starts, axis=1)


def groups_of(c, G, seed=0):
    """Centre groups: a few Lloyd steps on the centres from G of them (fixed for the run)."""
    rng = np.random.default_rng(seed)
    m = c[rng.choice(c.shape[0], G, replace=False)]
    for _ in range(5):
        lab = sqd(c, m).argmin(1)
        for g in range(G):
            if (lab == g).any():
                m[g] = c[lab == g].mean(0)
    g = sqd(c, m).argmin(1)
    return np.unique(g, return_inverse=True)[1].ravel()  # non-empty groups 0..G'-1


def label_warps(labels):
    """Index arrays of warps of <= 32 rows, rows sorted by label, a warp within one label (see certified)."""
    order = np.argsort(labels, kind="stable")
    sl = labels[order]
    starts = np.flatnonzero(np.r_[True, sl[1:] != sl[:-1], True])
    for s0, s1 in zip(starts[:-1], starts[1:]):
        for w in range(s0, s1, 32):
            yield order[w:min(w + 32, s1)]


def certified(X, rows, labels_old, d2sorted, c, tau, mode):
    """Bool per row in ``rows``: the certificate holds (gap of squared distances > tau B)."""
    gap = d2sorted[:, 1] - d2sorted[:, 0]
    ok = np.zeros(len(rows), dtype=bool)
    if mode == "global":
        xn = (X[rows] ** 2).sum(1)
        cmax = (c * c).sum(1).max()
        for w in range(0, len(rows), 32):
            B = xn[w:w + 32].max() + cmax
            ok[w:w + 32] = gap[w:w + 32] > tau * B
        return ok
    # warps within one label's rows (at 10^7 points ~10^4 a cluster, a warp straddles two clusters ~1 time in
    # 300; at the model's size every warp would)
    for idx in label_warps(labels_old[rows]):
        r = c[labels_old[rows[idx[0]]]]
        Xp = ((X[rows[idx]] - r) ** 2).sum(1).max()
        cc = ((c - r) ** 2).sum(1)
        B = Xp + cc[cc <= 9.0 * Xp].max()
        ok[idx] = gap[idx] > tau * 1.05 * B  # 1.05: the rounding of x - r and c - r (notes)
    return ok


def certified_cta(X, rows, labels_old, d2sorted, c, tau, bm=256):
    """The certificate as implemented (kmeans_assign_mma.cuh KmeansAssignTraits<kK, true>, plan.kmeans.local_rows):
    rows ordered by old label, each label's rows from a CTA's start (CTAs of ``bm`` rows, one label each), r =
    the CTA's label's centre, X'_cta = the CTA's largest ||x - r||^2, centres with ||c - r||^2 > 9 X'_cta left
    out, B' = X'_warp (32 rows) + the largest kept ||c - r||^2, tau x 1.01."""
    gap = d2sorted[:, 1] - d2sorted[:, 0]
    ok = np.zeros(len(rows), dtype=bool)
    lab = labels_old[rows]
    order = np.argsort(lab, kind="stable")
    sl = lab[order]
    starts = np.flatnonzero(np.r_[True, sl[1:] != sl[:-1], True])
    for s0, s1 in zip(starts[:-1], starts[1:]):
        r = c[sl[s0]]
        cc = ((c - r) ** 2).sum(1)
        for b0 in range(s0, s1, bm):
            idx = order[b0:min(b0 + bm, s1)]
            xn = ((X[rows[idx]] - r) ** 2).sum(1)
            Xc = xn.max()
            kmax = cc[cc <= 9.0 * Xc].max()
            for w in range(0, len(idx), 32):
                B = xn[w:w + 32].max() + kmax
                ok[idx[w:w + 32]] = gap[idx[w:w + 32]] > tau * 1.01 * B
    return ok


def first_only(X, c0, tau=TAU16, bm=256):
    """The first assignment's uncertified shares: global, per-warp local (the round-2 model), as implemented
    (certified_cta) with the exact labels as the old ones and with the labels at c0 of all but the last 128
    centres (the seeding's state before its last round: the hint plan.kmeans.BoundedAssign.first gets)."""
    D = sqd(X, c0)
    lab = D.argmin(1)
    srt = two_smallest(D)
    allrows = np.arange(X.shape[0])
    hint = D[:, :max(1, c0.shape[0] - 128)].argmin(1)
    return {"global": 1 - certified(X, allrows, lab, srt, c0, tau, "global").mean(),
            "local_warp": 1 - certified(X, allrows, lab, srt, c0, tau, "local").mean(),
            "cta_exact": 1 - certified_cta(X, allrows, lab, srt, c0, tau, bm).mean(),
            "cta_hint": 1 - certified_cta(X, allrows, hint, srt, c0, tau, bm).mean()}


def simulate(X, c0, iters=20, G=64, tau=TAU16):
    N, C = X.shape[0], c0.shape[0]
    grp = groups_of(c0, G)
    G = int(grp.max()) + 1
    gsize = np.bincount(grp, minlength=G)
    gpad = -(-gsize // 8) * 8
    c = c0.copy()
    D = sqd(X, c)
    lab = D.argmin(1)
    srt = two_smallest(D)
    allrows = np.arange(N)
    res = {"uncert_first_global": 1 - certified(X, allrows, lab, srt, c, tau, "global").mean(),
           "uncert_first_local": 1 - certified(X, allrows, lab, srt, c, tau, "local").mean()}
    okg = certified(X, allrows, lab, srt, c, tau, "global")
    dist = np.sqrt(D[allrows, lab])
    # Hamerly state
    ub = dist.copy()
    lb = np.sqrt(np.maximum(np.where(okg, srt[:, 1] - tau * ((X ** 2).sum(1).max() + (c * c).sum(1).max()),
                                     srt[:, 1]), 0))
    # Yinyang state: per group the smallest distance excluding the label (less tau B where certified)
    Dx = D.copy()
    Dx[allrows, lab] = np.inf
    perm = np.argsort(grp, kind="stable")
    starts = np.r_[0, np.cumsum(gsize)[:-1]]
    assert (gsize > 0).all()
    gmin = group_min(Dx, perm, starts)
    ylab, yub = lab.copy(), dist.copy()
    ylb = np.sqrt(np.maximum(gmin - 0.0, 0))
    hstats = {k: [] for k in ("work", "uncert_global", "uncert_local")}
    ystats = {k: [] for k in ("work", "evals", "warp_evals")}
    hlab = lab.copy()
    for it in range(iters):
        # Lloyd's update (empty clusters keep their centre in the model)
        cnt = np.bincount(lab, minlength=C)
        s = np.zeros_like(c)
        np.add.at(s, lab, X)
        new = np.where(cnt[:, None] > 0, s / np.maximum(cnt, 1)[:, None], c)
        drift = np.sqrt(((new - c) ** 2).sum(1))
        cc = np.sqrt(sqd(new, new))
        np.fill_diagonal(cc, np.inf)
        halfs = cc.min(1) / 2
        D = sqd(X, new)
        srt = two_smallest(D)
        truelab = D.argmin(1)
        # -- Hamerly (shipped) --
        rmax = np.zeros(C)
        np.maximum.at(rmax, hlab, ub)
        r = 2 * (rmax + drift)
        mdl = np.where(cc < r[:, None], drift[None, :], 0).max(1)
        a = hlab
        u = ub + drift[a]
        near = lb - mdl[a]
        l = np.minimum(near, r[a] - u)
        keep = u < np.maximum(l, halfs[a])
        ue = np.sqrt(D[allrows, a])
        u = np.where(keep, u, ue)
        l = np.minimum(near, r[a] - u)
        keep = u < np.maximum(l, halfs[a])
        rows = allrows[~keep]
        okg = certified(X, rows, a, srt[rows], new, tau, "global")
        okl = certified(X, rows, a, srt[rows], new, tau, "local")
        hstats["work"].append(len(rows) / N)
        hstats["uncert_global"].append(1 - okg.mean() if len(rows) else 0.0)
        hstats["uncert_local"].append(1 - okl.mean() if len(rows) else 0.0)
        ub = np.where(keep, u, ue)
        lb = np.where(keep, l, lb)
        xr = X[rows]
        Bg = (xr ** 2).sum(1).max() + (new * new).sum(1).max() if len(rows) else 0
        ub[rows] = np.sqrt(srt[rows, 0])
        lb[rows] = np.sqrt(np.maximum(np.where(okg, srt[rows, 1] - tau * Bg, srt[rows, 1]), 0))
        hlab = np.where(keep, hlab, truelab)
        # -- Yinyang --
        gdrift = np.zeros(G)
        np.maximum.at(gdrift, grp, drift)
        a = ylab
        u = yub + drift[a]
        ylb = np.maximum(ylb - gdrift[None, :], 0)
        l = ylb.min(1)
        keep = u < np.maximum(l, halfs[a])
        ue = np.sqrt(D[allrows, a])
        u = np.where(keep, u, ue)
        keep = u < np.maximum(l, halfs[a])
        rows = allrows[~keep]
        open_ = ylb[rows] < u[rows, None]  # groups to evaluate
        open_[np.arange(len(rows)), grp[a[rows]]] = True  # the own group (its other centres)
        ystats["work"].append(len(rows) / N)
        ystats["evals"].append((open_ * gsize[None, :]).sum() / (N * C))
        we = 0
        for idx in label_warps(a[rows]):
            we += 32 * (open_[idx].any(0) * gpad).sum()
        ystats["warp_evals"].append(we / (N * C))
        # the evaluated rows: new label among the open groups' centres (the closed ones are >= ub >= own)
        Dr = np.where(open_[:, grp], D[rows], np.inf)
        nl = Dr.argmin(1)
        Dr[np.arange(len(rows)), nl] = np.inf
        gm = group_min(Dr, perm, starts) if len(rows) else np.zeros((0, G))
        oldg = grp[a[rows]]
        newlb = np.where(open_, np.sqrt(gm), ylb[rows])
        ch = nl != a[rows]
        # an old label in a closed group (never: its group is always open) -> nothing to fold
        ylb[rows] = newlb
        ylab = np.where(keep, ylab, 0)
        ylab[rows] = nl
        yub = np.where(keep, u, 0)
        yub[rows] = np.sqrt(D[rows, nl])
        del oldg, ch
        res.setdefault("label_mismatch", 0)
        res["label_mismatch"] += int((ylab != hlab).sum())
        c, lab = new, truelab
    res.update({k: np.array(v) for k, v in hstats.items()})
    res.update({"y_" + k: np.array(v) for k, v in ystats.items()})
    res["G"], res["bytes_per_point"] = G, 4 * G
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=40000)
    ap.add_argument("-d", type=int, default=16)
    ap.add_argument("--clusters", type=int, default=1024)
    ap.add_argument("--groups", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", default=None)
    ap.add_argument("--first-only", action="store_true", help="the first assignment's uncertified shares only")
    a = ap.parse_args()
    for name, X in families(a.n, a.d, a.clusters, 0).items():
        if a.only and name not in a.only.split(","):
            continue
        t0 = time.time()
        c0 = seeding(X, a.clusters, 0)
        if a.first_only:
            r = first_only(X.numpy(), c0)
            print(f"{name:14s} first uncertified: " + ", ".join(f"{k} {v:.4f}" for k, v in r.items()) +
                  f"  ({time.time() - t0:.0f} s)", flush=True)
            continue
        r = simulate(X.numpy(), c0, a.iters, a.groups)
        wl = r["work"]
        print(f"{name:14s} first uncert global {r['uncert_first_global']:.3f} local {r['uncert_first_local']:.3f} | "
              f"hamerly work {wl.sum():.2f} N (first 3: {', '.join(f'{v:.2f}' for v in wl[:3])}), rescans global "
              f"{(wl * r['uncert_global']).sum():.3f} N local {(wl * r['uncert_local']).sum():.3f} N | yinyang "
              f"G={r['G']} rows {r['y_work'].sum():.2f} N, evals {r['y_evals'].sum():.2f} NC, warp-skip MMA "
              f"{r['y_warp_evals'].sum():.2f} NC  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
