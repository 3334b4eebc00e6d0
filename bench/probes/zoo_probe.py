"""Issue 42's questions on one GPU, one JSON line a measurement: the error of cdist p = 2,
run_kernel (Laplace / Gaussian l2) and knn against float64 of the given float32 inputs on data as
it comes (offsets, all-positive, integer with duplicates, tight blobs), and the time of the calls
the issue names, centred and shifted. Run it once per package version (PYTHONPATH) with --label.

    python3 bench/probes/zoo_probe.py --label after [--only err,time,knn] [--small]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import kermac_like as km  # noqa: E402
from _timing import time_calls  # noqa: E402


def emit(label, **row):
    print(json.dumps({"label": label, **row}), flush=True)


def family(name, n, d, g, dev):
    """Small stand-ins of bench/datasets.py's families (this probe predates it)."""
    r = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    if name.startswith("offset"):
        return r(n, d) + float(name[6:])
    if name == "relu":
        return r(n, d).clamp_min(0)
    if name == "uniform":
        return torch.rand(n, d, generator=g, device=dev)
    if name == "pixels":
        v = torch.randint(0, 256, (n, d), generator=g, device=dev).float()
        v[torch.rand(n, d, generator=g, device=dev) < 0.7] = 0
        v[n // 2:n // 2 + n // 8] = v[:n // 8]  # duplicate rows
        return v
    if name == "onehot":
        return torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=g, device=dev), d).float()
    if name == "blobs_tight":
        c = r(64, d) * 10 + 50
        return c[torch.randint(0, 64, (n,), generator=g, device=dev)] + 1e-3 * r(n, d)
    raise ValueError(name)


def rel_err(v, ref, floor=0.0):
    if v.numel() == 0:
        return 0.0
    return float(((v.double() - ref).abs() / ref.abs().clamp_min(floor if floor else 1e-300)).max())


def errors(label, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    fams = ["offset0", "offset10", "offset100", "offset1000", "relu", "uniform", "pixels", "onehot", "blobs_tight"]
    for fam in fams:
        x = family(fam, 4096, 64, g, dev)
        y = torch.cat([family(fam, 2047, 64, g, dev), x[5:6]])  # an exact duplicate of x[5]
        ref = torch.cdist(x.double(), y.double(), compute_mode="donot_use_mm_for_euclid_dist")
        ours = km.cdist(x, y)
        theirs = torch.cdist(x, y)
        nz = ref > 0
        emit(label, what="cdist_p2_err", family=fam, ours=rel_err(ours[nz], ref[nz]), torch=rel_err(theirs[nz], ref[nz]),
             ours_dup=float(ours[5, -1]), torch_dup=float(theirs[5, -1]),
             ours_bad=int(((ours.double() - ref).abs() > 1e-5 * ref).sum()),
             torch_bad=int(((theirs.double() - ref).abs() > 1e-5 * ref).sum()))
        for kern, bw in (("laplace_l2", 10.0), ("gaussian_l2", 10.0)):
            kv = km.run_kernel(km.preset(kern), x, y, bandwidth=bw)
            kref = torch.exp(-ref / bw) if kern == "laplace_l2" else torch.exp(-ref.square() / (2 * bw * bw))
            emit(label, what="kernel_err", kernel=kern, family=fam,
                 ours=float(((kv.double() - kref).abs() / kref.clamp_min(1e-5)).max()))
        for k in (10, 17, 64):
            v, i = km.knn(x[:513], y, k)
            d = ref[:513].gather(1, i)
            want = torch.sort(ref[:513], dim=1, stable=True).indices[:, :k]
            same = sum(len(set(a) & set(b)) for a, b in zip(i.tolist(), want.tolist())) / want.numel()
            emit(label, what="knn_err", family=fam, k=k, err=rel_err(v[d > 0], d[d > 0]), dup=float(v[5, 0]),
                 dup_idx=int(i[5, 0]), recall=same)


def timings(label, dev, small):
    g = torch.Generator(device=dev).manual_seed(1)
    n = 8192 if small else 30000
    for off in (0.0, 100.0):
        t = time_calls(lambda a, b: km.cdist(a, b), lambda: (torch.randn(n, 1024, generator=g, device=dev) + off,
                                                              torch.randn(n, 1024, generator=g, device=dev) + off),
                       dev, repeats=5, warmup=2)
        emit(label, what="cdist_p2_time", n=n, offset=off, ms=t.median_ms)
    m = 20000 if small else 200000
    for off in (0.0, 3.0):
        def make():
            y = torch.randn(m, 128, generator=g, device=dev) + off
            return y + 0.01 * torch.randn(m, 128, generator=g, device=dev), y
        t = time_calls(lambda a, b: km.knn(a, b, 10), make, dev, repeats=3, warmup=1, keep_last=True)
        (x, y), (v, i) = t.last_inputs, t.last_output
        ref = torch.cdist(x[:256].double(), y.double(), compute_mode="donot_use_mm_for_euclid_dist")
        want = torch.sort(ref, dim=1, stable=True).indices[:, :10]
        same = float((torch.sort(i[:256], 1).values == torch.sort(want, 1).values).float().mean())
        emit(label, what="knn_d128_time", m=m, offset=off, ms=t.median_ms, err=rel_err(v[:256], ref.gather(1, i[:256])),
             recall=same)
    # KMeans 10^7 x 16 x 1024 on the bench's means and on 8 wide blobs
    from kermac_like.cluster import KMeans

    N = 10**6 if small else 10**7
    means = torch.randn(1024, 16, generator=g, device=dev) * 10
    datas = {"bench": means[torch.randint(0, 1024, (N,), generator=g, device=dev)] + torch.randn(N, 16, generator=g, device=dev),
             "blobs8": torch.randn(N, 16, generator=g, device=dev) + 4 * torch.randint(0, 8, (N, 16), generator=g, device=dev).float()}
    datas["blobs8_centred"] = datas["blobs8"] - datas["blobs8"].mean(0)
    for name, X in datas.items():
        KMeans(1024, max_iter=20, tol=0, random_state=0).fit(X)
        times = []
        for _ in range(2):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            KMeans(1024, max_iter=20, tol=0, random_state=0).fit(X)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        emit(label, what="kmeans_time", data=name, N=N, ms=min(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="run")
    ap.add_argument("--only", default="err,time")
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    if "err" in a.only:
        errors(a.label, dev)
    if "time" in a.only:
        timings(a.label, dev, a.small)


if __name__ == "__main__":
    main()
