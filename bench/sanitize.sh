#!/usr/bin/env bash
# compute-sanitizer over small calls of every kernel family (bench/probes/sanitize_calls.py):
# memcheck, racecheck, synccheck and initcheck, one process per (tool, family).
#
#   bash bench/sanitize.sh [LOGDIR] [FAMILY ...]        # GPU machine (TOOLS="racecheck" for some tools)
#
# Reports inside kernels that are not ours (cuBLAS, cuSOLVER, torch) are counted apart
# and do not fail the run; any report in a kermac_like kernel does (exit status 1).
# --report-api-errors no: cuda-bindings probes driver entry points (cuGetProcAddress)
# and the failed probes would be reported as API errors of this process.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
LOGDIR="${1:-/tmp/kl-sanitize}"; shift || true
SAN="${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}"
PY="${PYTHON:-python3}"
# Kernels compiled with -lineinfo (own cache key): reports name the template's source lines.
export KERMAC_LIKE_LINEINFO="${KERMAC_LIKE_LINEINFO:-1}"
mkdir -p "$LOGDIR"
FAMILIES="${*:-$($PY "$HERE/probes/sanitize_calls.py" --list)}"
$PY "$HERE/probes/sanitize_calls.py" --warm > "$LOGDIR/warm.log" 2>&1 || { cat "$LOGDIR/warm.log"; exit 2; }
status=0
printf '%-10s %-10s %6s %8s %8s %s\n' tool family exit ours foreign summary | tee "$LOGDIR/summary.txt"
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  for fam in $FAMILIES; do
    log="$LOGDIR/$tool-$fam.log"
    "$SAN" --tool "$tool" --report-api-errors no --print-limit 100000 \
      $PY "$HERE/probes/sanitize_calls.py" "$fam" > "$log" 2>&1
    rc=$?
    read -r ours foreign summary < <($PY "$HERE/probes/sanitize_filter.py" "$log")
    printf '%-10s %-10s %6s %8s %8s %s\n' "$tool" "$fam" "$rc" "$ours" "$foreign" "$summary" | tee -a "$LOGDIR/summary.txt"
    if [ "$ours" != "0" ] || ! grep -q "^$fam: ok" "$log"; then status=1; fi
  done
done
exit $status
