#!/usr/bin/env bash
# One call on the GPU machine: environment report, GPU tests, benchmarks, short table last.
#   bash bench/gpu_check.sh [all|tests|examples|bench] [extra pytest args...]
# Expects the wheels of ../shared/wheels-py312 copied into .whl/ (git-ignored, carried).
# Writes logs and JSON under $OUT (the device tool brings them back).
set -uo pipefail
mode=${1:-all}; shift || true
OUT=${OUT:-/tmp/kermac_like_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/nvmath_python-*.whl .whl/sqlalchemy-*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export KERMAC_LIKE_CACHE_DIR=${KERMAC_LIKE_CACHE_DIR:-/tmp/kermac_like_cache}
export KERMAC_LIKE_TEST_KEEP_CACHE=1
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, importlib
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for m in ("cuda.core", "cuda.bindings", "nvmath", "sqlalchemy"):
    try:
        mod = importlib.import_module(m); print(m, getattr(mod, "__version__", "?"))
    except Exception as e:
        print(m, "MISSING", e)
from kermac_like.runtime.compiler import nvrtc_version; print("nvrtc", nvrtc_version())
PY
status=0
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  python3 -m pytest -q -m "gpu and not slow" -rfE --tb=short -p no:cacheprovider "$@" tests 2>&1 | tee "$OUT/pytest.log" | tail -n 60
  status=${PIPESTATUS[0]}
fi
if [ "$mode" = all ] || [ "$mode" = examples ]; then
  bash bench/run_examples.sh 2>&1 | tee "$OUT/examples.txt"
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  python3 bench/run.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 40
fi
echo "== pytest exit: $status"
grep -E "passed|failed" "$OUT/pytest.log" 2>/dev/null | tail -1
exit 0
