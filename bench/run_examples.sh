#!/usr/bin/env bash
# Every example at its default (GPU) size; one line per example, logs under $OUT.
#   bash bench/run_examples.sh [extra args for every example, e.g. --quick]
set -uo pipefail
OUT=${OUT:-/tmp/kermac_like_out}; mkdir -p "$OUT/examples"
fail=0
for ex in cdist cdist_grad build_a_kernel broadcast_kernel linalg kernel_regression rfm kernel_matvec; do
  t0=$(date +%s%N)
  python3 "examples/$ex.py" "$@" > "$OUT/examples/$ex.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  [ $rc -ne 0 ] && fail=1
  printf '%-18s rc=%d %6d ms  %s\n' "$ex" "$rc" $(( (t1 - t0) / 1000000 )) "$(tail -n 1 "$OUT/examples/$ex.log" | cut -c1-150)"
done
exit $fail
