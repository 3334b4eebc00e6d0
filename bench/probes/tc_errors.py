"""Relative error vs float64 of the tensor-core path (the default kernel on this GPU) for
every Euclidean preset, on random data and on clustered data with near-duplicate
points, in 3xTF32 (default) and plain TF32 (torch.backends.cuda.matmul.allow_tf32).

    python bench/probes/tc_errors.py        # a GPU; prints one table
"""
import torch

import kermac_like as km
from kermac_like.reference import distance_reference


def clustered(n, k, centers=10, spread=1e-3):
    c = torch.randn(centers, k, device="cuda") * 3
    return c[torch.randint(0, centers, (n,), device="cuda")] + spread * torch.randn(n, k, device="cuda")


def main():
    torch.manual_seed(0)
    M, N, K, bw = 2000, 1777, 512, 20.0
    data = {"random": (torch.randn(M, K, device="cuda"), torch.randn(N, K, device="cuda")),
            "clustered": (clustered(M, K), clustered(N, K))}
    print(f"{torch.cuda.get_device_name()}: M={M} N={N} K={K}, relative Frobenius error vs float64")
    print(f"{'preset':<12} {'data':<10} {'3xTF32':>9} {'TF32':>9}")
    for name in ("l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot"):
        desc = km.PRESETS[name]
        kw = {"bandwidth": bw} if desc.needs_bandwidth else {}
        for label, (a, b) in data.items():
            ref = distance_reference(desc, a.double(), b.double(), **kw)
            errs = []
            for tf32 in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                out = torch.full((M, N), float("nan"), device="cuda")
                km.run_kernel(desc, a, b, out=out, **kw)
                errs.append(((out.double() - ref).norm() / ref.norm()).item())
            torch.backends.cuda.matmul.allow_tf32 = False
            print(f"{name:<12} {label:<10} {errs[0]:9.2e} {errs[1]:9.2e}")


if __name__ == "__main__":
    main()
