#!/usr/bin/env bash
# Stall reasons of the two p = 1 kernels issue #16 still misses (bench/probes/profile_p1.py):
# kernel-wide stall ratios, then the per-instruction source page (SASS, warp-state samples) as CSV.
#   OUT=dir bash bench/probes/ncu_p1.sh [lowk simt]     (GPU machine; ncu.tgz under $OUT)
set -u
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
D=${OUT:-/tmp}/ncu; mkdir -p "$D"
for which in ${*:-lowk simt}; do
  "$NCU" --clock-control none --kernel-name regex:"distance_(lowk_)?kernel" --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters --section InstructionStats \
    --metrics regex:'^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
    --import-source no -o "$D/$which" -f python3 bench/probes/profile_p1.py "$which" > "$D/$which.log" 2>&1
  "$NCU" -i "$D/$which.ncu-rep" --print-details all > "$D/${which}_details.txt" 2>&1
  "$NCU" -i "$D/$which.ncu-rep" --page raw --csv > "$D/${which}_raw.csv" 2>&1
  "$NCU" -i "$D/$which.ncu-rep" --page source --print-source sass --csv > "$D/${which}_sass.csv" 2>&1
  grep -E "stalled_.*ratio|Issued Warp|Eligible|Active Warps" "$D/${which}_details.txt" | head -60
  wc -c "$D"/"$which"*
done
rm -f "$D"/*.ncu-rep.bak
tar czf "${OUT:-/tmp}/ncu.tgz" -C "${OUT:-/tmp}" ncu && rm -rf "$D"
