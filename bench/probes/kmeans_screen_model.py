"""The cost model's inputs for the seeding's bf16 screen (bench/notes/kmeans.md, "The bf16
screen"), on the CPU: k-means++ (D^2 sampling, 1024 centres) on the bench's data (1024 clusters
around 4 x randn means, D = 16) or plain Gaussian data, at a smaller N; per centre the share of
points that pass the triangle test (read a row today), that are improved, and that the screen
cannot settle (bf16 copy with a per-1024-point-block bound; int8 per-block affine and the norm
bound |‖x‖ - ‖c‖| for comparison), averaged over the centres.

    PYTHONPATH=. python3 bench/probes/kmeans_screen_model.py 200000 blobs   # ~5 min on 2 cores

Run 2026-11-26 (N = 2 x 10^5, blobs): triangle 0.447, improved 0.0065, bf16 screen fails 0.0067,
int8 0.0071, norm bound 0.447 (it prunes nothing); block bound E: bf16 0.057 (mean), int8 0.16.
"""
import sys
import time

import torch
torch.manual_seed(0)
N, D, C = int(sys.argv[1]), 16, 1024
kind = sys.argv[2]
g = torch.Generator().manual_seed(1)
if kind == "blobs":
    means = 4 * torch.randn(C, D, generator=g)
    X = means[torch.randint(0, C, (N,), generator=g)] + torch.randn(N, D, generator=g)
else:
    X = torch.randn(N, D, generator=g)
B = 1024
nb = (N + B - 1) // B
# bf16 copy and per-block error bound
Xb = X.to(torch.bfloat16).float()
e = (X - Xb).norm(dim=1)
Eb = torch.zeros(nb * B); Eb[:N] = e; Eb = Eb.view(nb, B).amax(1).repeat_interleave(B)[:N]
# int8 per-block affine per dim
pad = torch.zeros(nb * B, D); pad[:N] = X
blk = pad.view(nb, B, D)
lo = blk.amin(1, keepdim=True); hi = blk.amax(1, keepdim=True)
step = (hi - lo) / 255
q = ((blk - lo) / step).round().clamp(0, 255)
Xq = (q * step + lo).view(-1, D)[:N]
eq = (X - Xq).norm(dim=1)
Eq = torch.zeros(nb * B); Eq[:N] = eq; Eq = Eq.view(nb, B).amax(1).repeat_interleave(B)[:N]
xn = X.norm(dim=1)
t0 = time.time()
idx = [int(torch.randint(0, N, (1,), generator=g))]
c = X[idx[0]]
d2 = (X - c).square().sum(1)
near = torch.zeros(N, dtype=torch.long)
cent = [c]
tri = imp = fb = fq = fn = 0.0
rows = []
for j in range(1, C):
    i = int(torch.multinomial(d2, 1, generator=g))
    c = X[i]
    Cm = torch.stack(cent)
    cca = (Cm - c).square().sum(1)
    cand = cca[near] < 4 * d2 * (1 + 1e-6)
    dn = (X - c).square().sum(1)
    a_b = (Xb - c).norm(dim=1); lb_b = (a_b - Eb).clamp(min=0).square()
    a_q = (Xq - c).norm(dim=1); lb_q = (a_q - Eq).clamp(min=0).square()
    lb_n = (xn - c.norm()).square()
    better = cand & (dn < d2)
    nt = cand.float().mean().item()
    ni = better.float().mean().item()
    nfb = (cand & ~(lb_b * (1 - 1e-5) >= d2)).float().mean().item()
    nfq = (cand & ~(lb_q * (1 - 1e-5) >= d2)).float().mean().item()
    nfn = (cand & ~(lb_n >= d2)).float().mean().item()
    tri += nt; imp += ni; fb += nfb; fq += nfq; fn += nfn
    if j in (1, 2, 4, 16, 64, 256, 512, 768, 1023):
        rows.append((j, nt, ni, nfb, nfq, nfn))
    d2 = torch.where(better, dn, d2)
    near = torch.where(better, torch.tensor(j), near)
    cent.append(c)
n = C - 1
print(kind, N, "time", time.time() - t0)
print("mean over centres: tri-pass %.4f improved %.5f bf16-fail %.5f int8-fail %.5f norm-fail %.4f" % (tri/n, imp/n, fb/n, fq/n, fn/n))
print("E bf16 mean/max %.4g %.4g; E int8 mean/max %.4g %.4g; d2 mean final %.4g" % (Eb.mean(), Eb.max(), Eq.mean(), Eq.max(), d2.mean()))
for r in rows: print("j=%4d tri %.4f imp %.5f bf16fail %.5f int8fail %.5f normfail %.4f" % r)
