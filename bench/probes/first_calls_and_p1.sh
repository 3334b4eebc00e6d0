#!/usr/bin/env bash
# One device step (gpu_check.sh's EXTRA): issue 26's first-call rows with a bundle, then cdist p = 1
# at moderate K for ours and Kermac 0.1.4 (each in its own process, same GPU).
#   EXTRA="bash bench/probes/first_calls_and_p1.sh" bash bench/gpu_check.sh extra
# P1_K (default 37,100,128,200) picks the K of the p = 1 rows; SKIP_COLD=1 skips the first-call rows.
set -uo pipefail
OUT=${OUT:-/tmp/kermac_like_out}
if [ "${SKIP_COLD:-0}" != 1 ]; then
  t0=$(date +%s.%N)
  python3 -m kermac_like precompile --all --arch "sm_$(python3 -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}")')" \
    --bundle /tmp/bundle 2>&1 | tail -n 3
  echo "precompile --all: $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
  KERMAC_LIKE_BUNDLE=/tmp/bundle python3 bench/run.py --only cold_compile --only warm_process --out "$OUT/bench_first_calls" 2>&1 | tail -n 25
fi
if ls .whl/kermac-anchor/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/kermac-site .whl/kermac-anchor/*.whl
  PYTHONPATH=/tmp/kermac-site:/tmp/site python3 bench/probes/p1_vs_kermac.py kermac "${P1_K:-37,100,128,200}" 2>&1 | grep -E "^P1|Error|error" | tail -n 12
fi
python3 bench/probes/p1_vs_kermac.py ours "${P1_K:-37,100,128,200}" 2>&1 | grep -E "^P1|Error|error" | tail -n 12
