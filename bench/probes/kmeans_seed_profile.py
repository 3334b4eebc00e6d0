"""Where k-means++ seeding's time goes (issue 27): the bench's size (N = 10^7, D = 16, 1024 centres, blob
data; or N D C from argv). Prints the seeding's time (CUDA events, median of 5 after a warm-up), its rounds,
then torch.profiler's CUDA time per kernel (update, gap, draw, others).

    PYTHONPATH=. python3 bench/probes/kmeans_seed_profile.py [N D C]
"""
import pathlib
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _timing import event_ms  # noqa: E402
from kermac_like.cluster import kmeans_plusplus, seed_uniforms  # noqa: E402
from kermac_like.plan.kmeans import Seeding  # noqa: E402

N, D, C = (int(float(a)) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (10_000_000, 16, 1024)
g = torch.Generator(device="cuda").manual_seed(0)
means = 4 * torch.randn(C, D, device="cuda", generator=g)
X = means[torch.randint(0, C, (N,), device="cuda", generator=g)] + torch.randn(N, D, device="cuda", generator=g)
run = lambda: kmeans_plusplus(X, C, None, torch.Generator(device="cuda").manual_seed(0))  # noqa: E731
run()
times = [event_ms(run)[0] for _ in range(5)]
sd = Seeding(X, C, None, seed_uniforms(C, torch.Generator(device="cuda").manual_seed(0), "cuda"))
sd.run()
print(f"kmeans++ N={N} D={D} C={C}: {statistics.median(times):.2f} ms (median of 5; {sorted(times)}), "
      f"{sd.rounds} rounds")
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    run()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
