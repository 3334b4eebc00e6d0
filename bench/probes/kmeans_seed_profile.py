"""Where k-means++ seeding's time goes (issue 27): torch.profiler over kermac_like.cluster.kmeans_plusplus at
the bench's size (N = 10^7, D = 16, 1024 centres, blob data), CUDA time per kernel (update, draw, others).

    PYTHONPATH=. python3 bench/probes/kmeans_seed_profile.py
"""
import torch
from torch.profiler import ProfilerActivity, profile

from kermac_like.cluster import kmeans_plusplus

N, D, C = 10_000_000, 16, 1024
g = torch.Generator(device="cuda").manual_seed(0)
means = 4 * torch.randn(C, D, device="cuda", generator=g)
X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, D, device="cuda", generator=g)
kmeans_plusplus(X, C, None, torch.Generator(device="cuda").manual_seed(0))
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    kmeans_plusplus(X, C, None, torch.Generator(device="cuda").manual_seed(0))
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
