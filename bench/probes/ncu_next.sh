#!/usr/bin/env bash
# Nsight Compute on the two kernels whose limiter the notes could not name (session 13):
#   f64:    matvec_kernel in kernel_matvec's float64 mode, K(x, z) v with 2e6 rows x 20 000 centres, D = 8
#           (Falkon's products at N = 10^9: 1.4e12 pairs/s against ~2.1e12 for the MUFU bound; issue 28)
#   assign: kmeans_assign_mma_kernel, N = 10^7, D = 16, 1024 centres (8.7 ms against a predicted 5; issue 27)
#   seed:   kmeans_update_kernel (k-means++ with the bf16 screen), the 500th centre of the bench's seeding
#           (131 us a centre against ~80 us of bytes; session 14)
#   pv:     falkon_rows_pv_kernel, GPyTorch's CG product at N = 5 x 10^4, D = 8, C = 11 (issue 29, session 18)
# Per kernel: speed of light, pipe utilisation, warp states and stall ratios, instruction mix, as text.
#   OUT=dir bash bench/probes/ncu_next.sh [f64 assign]     (GPU machine; ncu_next.tgz under $OUT)
set -u
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
D=${OUT:-/tmp}/ncu_next; mkdir -p "$D"
f64='
import torch, kermac_like as km
g = km.preset("gaussian_l2"); dev = "cuda"
x = torch.rand(2_000_000, 8, device=dev) * 2 - 1; z = x[:20000].contiguous()
v = torch.randn(20000, 1, device=dev, dtype=torch.float64); o = torch.empty(2_000_000, 1, device=dev, dtype=torch.float64)
for _ in range(2): km.kernel_matvec(g, x, z, v, out=o, bandwidth=1.5)
torch.cuda.synchronize()'
assign='
import torch
from kermac_like.cluster import _assign
g = torch.Generator(device="cuda").manual_seed(0)
means = 4 * torch.randn(1024, 16, device="cuda", generator=g)
X = means[torch.randint(0, 1024, (10_000_000,), device="cuda", generator=g)] + torch.randn(10_000_000, 16, device="cuda", generator=g)
c = X[:1024].clone()
for _ in range(2): _assign(X, c, False)
torch.cuda.synchronize()'
seed='
import torch
from kermac_like.cluster import kmeans_plusplus
g = torch.Generator(device="cuda").manual_seed(0)
means = 4 * torch.randn(1024, 16, device="cuda", generator=g)
X = means[torch.randint(0, 1024, (10_000_000,), device="cuda", generator=g)] + torch.randn(10_000_000, 16, device="cuda", generator=g)
kmeans_plusplus(X, 1024, None, torch.Generator(device="cuda").manual_seed(0))
torch.cuda.synchronize()'
pv='
import torch
from kermac_like.plan.falkon import FalkonProducts
g = torch.Generator(device="cuda").manual_seed(0)
x = (torch.rand(50_000, 8, device="cuda", generator=g) * 2 - 1) / 0.4
v = torch.randn(50_000, 11, device="cuda", generator=g)
fp = FalkonProducts(x, 1.0, columns="pv")
for _ in range(2): fp.rows_pv(x, v)
torch.cuda.synchronize()'
for which in ${*:-f64 assign}; do
  skip=1
  case $which in
    f64) code=$f64; name='regex:^matvec_kernel' ;;
    assign) code=$assign; name='regex:kmeans_assign_mma_kernel' ;;
    seed) code=$seed; name='regex:kmeans_update_kernel'; skip=500 ;;
    pv) code=$pv; name='regex:falkon_rows_pv_kernel' ;;
  esac
  echo "$code" > "$D/$which.py"
  timeout 240 "$NCU" --clock-control none --kernel-name "$name" --launch-skip "$skip" --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section Occupancy --section LaunchStats \
    --metrics regex:'^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$',regex:'^sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active$' \
    -o "$D/$which" -f python3 "$D/$which.py" > "$D/$which.log" 2>&1
  "$NCU" -i "$D/$which.ncu-rep" --print-details all > "$D/${which}_details.txt" 2>&1
  "$NCU" -i "$D/$which.ncu-rep" --page raw --csv > "$D/${which}_raw.csv" 2>&1
  echo "== $which"; tail -3 "$D/$which.log"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc|Executed Ipc|Registers Per|Achieved Occupancy|No Eligible|Eligible Warps" "$D/${which}_details.txt" | head -20
  python3 - "$D/${which}_raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) >= 3:
    h, units, v = rows[0], rows[1], rows[2]
    pipes = [(h[i], v[i]) for i in range(len(h)) if h[i].startswith("sm__inst_executed_pipe_") and "pct_of_peak" in h[i]]
    stalls = [(h[i], v[i]) for i in range(len(h)) if "issue_stalled" in h[i] and h[i].endswith("ratio")]
    def num(s):
        try: return float(s.replace(",", ""))
        except ValueError: return 0.0
    print("pipes (% of peak):", ", ".join(f"{n.split('pipe_')[1].split('.')[0]} {v}" for n, v in sorted(pipes, key=lambda t: -num(t[1]))[:8]))
    print("stalls (per issue):", ", ".join(f"{n.split('stalled_')[1].split('_per')[0]} {v}" for n, v in sorted(stalls, key=lambda t: -num(t[1]))[:8]))
PY
done
rm -f "$D"/*.ncu-rep
tar czf "${OUT:-/tmp}/ncu_next.tgz" -C "${OUT:-/tmp}" ncu_next && rm -rf "$D"
