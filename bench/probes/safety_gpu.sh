#!/usr/bin/env bash
# One GPU call for the NaN / sanitizer / linalg work: GPU tests, the linalg first-call
# probe, compute-sanitizer over every family, timings of the touched kernels against a
# baseline checkout. Run from this checkout's root; BASE= a baseline checkout (optional).
set -uo pipefail
OUT=${OUT:-/tmp/safety_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KERMAC_LIKE_CACHE_DIR=${KERMAC_LIKE_CACHE_DIR:-/tmp/klcache}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/nvmath_python-*.whl .whl/sqlalchemy-*.whl || exit 1
  SITE=/tmp/site:
fi
export PYTHONPATH=${SITE:-}$PWD
STEPS=${STEPS:-tests linalg sanitize timing}
for step in $STEPS; do
  case $step in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider ${TESTS:-tests/test_nonfinite.py} \
             2>&1 | tee "$OUT/pytest.log" | tail -n 40 ;;
    linalg) for m in ${LINALG_MODES:-cold warm}; do timeout 60 python3 bench/probes/linalg_first_call.py $m ${LINALG_STEPS:-} 2>&1 | tee -a "$OUT/linalg.log"; done ;;
    sanitize) timeout ${SAN_TIMEOUT:-400} bash bench/sanitize.sh "$OUT/san" ${FAMILIES:-} 2>&1 | tail -n 40
              for f in "$OUT"/san/*.log; do python3 bench/probes/sanitize_filter.py "$f" -v | head -40 > "$f.ours"; done
              tar czf "$OUT/san.tgz" -C "$OUT" san && rm -rf "$OUT/san" ;;
    timing) for i in ${ROUNDS:-1 2}; do
              [ -n "${BASE:-}" ] && (cd "$BASE" && PYTHONPATH=${SITE:-}$BASE timeout 100 python3 "$OLDPWD/bench/probes/safety_timing.py" base 5) 2>&1 | grep TIMING | tee -a "$OUT/timing.log"
              timeout 100 python3 bench/probes/safety_timing.py new 5 2>&1 | grep TIMING | tee -a "$OUT/timing.log"
              [ -n "${VARIANT:-}" ] && (cd "$VARIANT" && PYTHONPATH=${SITE:-}$VARIANT timeout 100 python3 "$OLDPWD/bench/probes/safety_timing.py" variant 5) 2>&1 | grep TIMING | tee -a "$OUT/timing.log"
            done ;;
  esac
done
echo "== done"; grep -E "passed|failed" "$OUT/pytest.log" 2>/dev/null | tail -1
