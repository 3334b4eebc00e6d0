"""CPU emulation of the 3xTF32 expansion (split x = big + small, big*big + big*small + small*big
with exact products), against float64 and torch's fp32 product path: which part of the tensor-core
cdist's error comes from the split and the norms, and which from the tensor cores' accumulation
(bench/notes/data_zoo.md)."""
import torch
torch.manual_seed(0)
def rna(x):
    i = x.view(torch.int32)
    return ((i + 0x1000) & ~0x1fff).view(torch.float32)
M, N, K = 2048, 2048, 64
for off in (0.0,):
  for fam in ("gauss", "relu"):
    x = torch.randn(M, K); y = torch.randn(N, K)
    if fam == "relu": x = x.clamp_min(0); y = y.clamp_min(0); s = torch.zeros(K)
    ref = torch.cdist(x.double(), y.double())
    xb = rna(x); xs = rna(x - xb); yb = rna(y); ys = rna(y - yb)
    # products exact in double, accumulated in float32 sequentially per k-step of 8 (approx: fp32 matmul of split parts)
    dot = (xb.double() @ yb.double().T + xb.double() @ ys.double().T + xs.double() @ yb.double().T).float()
    for name, na, nb in (("raw", (x*x).sum(1), (y*y).sum(1)),
                         ("split", ((xb+xs)*(xb+xs)).sum(1), ((yb+ys)*(yb+ys)).sum(1))):
        d = (na[:, None] + nb[None, :] - 2 * dot).clamp_min(0).sqrt()
        nz = ref > 0
        print(fam, name, float(((d.double() - ref).abs() / ref)[nz].max()))
    t = torch.cdist(x, y, compute_mode="use_mm_for_euclid_dist")
    print(fam, "torch-cpu-fp32", float(((t.double() - ref).abs() / ref)[ref > 0].max()))
