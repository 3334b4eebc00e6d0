"""The estimators' results on fixed data, saved, so that two checkouts can be compared bit for bit (a
refactoring that must change no result: KMeans' centres, labels and inertia; KernelRidge's three solvers;
the neighbours; the GPyTorch operator's products, where gpytorch is installed).

    cd CHECKOUT_A && PYTHONPATH=. python bench/probes/same_results.py /tmp/a.pt cuda 200000
    cd CHECKOUT_B && PYTHONPATH=. python bench/probes/same_results.py /tmp/b.pt cuda 200000
    python bench/probes/same_results.py --compare /tmp/a.pt /tmp/b.pt
"""

import sys

import torch

if sys.argv[1] == "--compare":
    a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
    same = {k: (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]) for k in a}
    print(same, "\nall bitwise equal" if all(same.values()) and a.keys() == b.keys() else "\nDIFFERENT")
    sys.exit(0 if all(same.values()) else 1)

import kermac_like  # noqa: E402
from kermac_like.cluster import KMeans  # noqa: E402
from kermac_like.neighbors import KNeighborsRegressor, NearestNeighbors  # noqa: E402
from kermac_like.solvers import KernelRidge  # noqa: E402

dev, n = sys.argv[2], int(sys.argv[3])
print("kermac_like from", kermac_like.__file__)
g = torch.Generator(device=dev).manual_seed(0)
X = torch.randn(n, 16, device=dev, generator=g) + 3.0
km = KMeans(64, random_state=0, max_iter=20).fit(X)
out = dict(centres=km.cluster_centers_.cpu(), labels=km.labels_.cpu(), n_iter=km.n_iter_, inertia=km.inertia_)
Xr = torch.randn(n // 10, 8, device=dev, generator=g)
y = Xr.sin().sum(1)
for solver in ("nystrom", "cg", "cholesky"):
    kr = KernelRidge("gaussian_l2", bandwidth=2.0, alpha=1e-3, solver=solver, random_state=0).fit(Xr, y)
    out[solver] = kr.predict(Xr[:500]).cpu()
d, i = NearestNeighbors(n_neighbors=5).fit(X[: n // 4]).kneighbors(X[:500])
out.update(knn_d=d.cpu(), knn_i=i.cpu(), knn_reg=KNeighborsRegressor(3, weights="distance").fit(Xr, y).predict(Xr[:300]).cpu())
try:
    from kermac_like.gpytorch import KermacKernelLinearOperator
except ImportError:
    pass
else:
    with torch.no_grad():
        op = KermacKernelLinearOperator(Xr, Xr, kernel="rbf")
        out["gp_products"] = (op @ torch.randn(Xr.shape[0], 11, device=dev, generator=g)).cpu()
torch.save(out, sys.argv[1])
