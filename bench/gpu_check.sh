#!/usr/bin/env bash
# One call on the GPU machine: environment report, then the steps asked for, short table last.
#   bash bench/gpu_check.sh [STEP[,STEP...]] [extra pytest args...]   (test paths given: only those run)
# Steps: tests (GPU tests), examples, bench (bench/run.py), timing (bench/probes/safety_timing.py,
# TIMING_CASES selects; against .gl/before too), host (host overhead per call;
# against the package in .gl/before too when that folder is carried), krr (Falkon at
# N = 10^6), linalg (first calls with and without linalg.warmup), sanitize (bench/sanitize.sh
# over $SAN_FAMILIES with $TOOLS), extra (the command lines in $EXTRA); all = tests,examples,bench.
# Expects the wheels of ../shared/wheels-py312 copied into .whl/ (git-ignored, carried).
# Writes logs and JSON under $OUT (the device tool brings them back). STEP_TIMEOUT (s) caps
# each step so that a slow one cannot take the others' time.
set -uo pipefail
steps=${1:-all}; shift || true
[ "$steps" = all ] && steps=tests,examples,bench
OUT=${OUT:-/tmp/kermac_like_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/nvmath_python-*.whl .whl/sqlalchemy-*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# Byte-compiled first, as pip install leaves a package: the timed rows then measure an installed
# package, not Python compiling sources on a first import (9 of a warm first call's 29 ms, jit.md).
python3 -m compileall -q kermac_like > /dev/null || echo "compileall failed: rows include compiling sources"
export KERMAC_LIKE_CACHE_DIR=${KERMAC_LIKE_CACHE_DIR:-/tmp/kermac_like_cache}
export KERMAC_LIKE_TEST_KEEP_CACHE=1
T=${STEP_TIMEOUT:-600}
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
summary=()
has() { [[ ",$steps," == *",$1,"* ]]; }
if has tests; then
  # Test paths among the pytest arguments (tests/test_x.py, tests/test_x.py::name) replace the
  # whole tests folder; otherwise it runs with the other arguments (-k ...).
  where=tests
  xdist=
  for a in "$@"; do [[ "$a" == tests/* ]] && where=; done
  # The whole suite: the shipped kernels compiled first for this GPU, in parallel processes (one NVRTC
  # compile each, ~25 s on 16 cores, instead of a compile per worker that meets them), then the tests in
  # GPU_WORKERS xdist workers where pytest-xdist is installed (default 8: the kernels the tests
  # instantiate beyond the shipped set compile in the workers), unless -n is given.
  if [ -n "$where" ] && [[ " $* " != *" -n "* ]] && python3 -c "import xdist" 2>/dev/null; then
    xdist="-n ${GPU_WORKERS:-8}"
    t0=$(date +%s)
    timeout "$T" python3 -m kermac_like precompile --all > "$OUT/precompile.txt" 2>&1 || echo "precompile failed: see precompile.txt"
    summary+=("precompile: $(( $(date +%s) - t0 )) s, $(tail -1 "$OUT/precompile.txt")")
  fi
  # --durations=40 unless given; each test's result line (-rA under xdist's -v) stamped with the seconds since the
  # start into pytest_times.log, so that a run cut by the step's timeout still says where its time went
  dur="--durations=40"; [[ " $* " == *" --durations"* ]] && dur=
  timeout "$T" python3 -m pytest -v -m "gpu and not slow" -rfE --tb=short -p no:cacheprovider $dur $xdist "$@" $where 2>&1 \
    | python3 -u -c '
import sys, time
t0 = time.time()
with open(sys.argv[1], "w") as stamped:
    for line in sys.stdin:
        stamped.write(f"{time.time() - t0:7.1f} {line}")
        if not any(w in line for w in (" PASSED ", " SKIPPED ", " XFAIL ", " XPASS ")):
            sys.stdout.write(line)
' "$OUT/pytest_times.log" | tee "$OUT/pytest.log" | tail -n 60
  status=${PIPESTATUS[0]}
  summary+=("tests: $(grep -E "passed|failed" "$OUT/pytest.log" | tail -1)")
fi
if has examples; then
  timeout "$T" bash bench/run_examples.sh 2>&1 | tee "$OUT/examples.txt"
fi
if has bench; then
  timeout "$T" python3 bench/run.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 40
fi
if has host; then
  timeout "$T" python3 bench/host_overhead.py --label after > "$OUT/host_after.json"
  if [ -d .gl/before/kermac_like ]; then
    PYTHONPATH=/tmp/site:$PWD/.gl/before KERMAC_LIKE_CACHE_DIR=/tmp/kermac_like_cache_before \
      timeout "$T" python3 bench/host_overhead.py --label before > "$OUT/host_before.json"
  fi
  summary+=("host: $(python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("host_*.json")):
    try:
        r = json.loads(f.read_text())
    except ValueError:
        continue
    u = r["us_per_call"]
    rows.append(f'{r["label"]}: cdist_p2 {u.get("cdist_p2")} out {u.get("cdist_p2_out")} p1 {u.get("cdist_p1")} '
                f'laplace {u.get("laplace_l2_bw_tensor")} k20 {u.get("cdist_p2_k20")} torch {u.get("torch_cdist_p2")} us')
print(" | ".join(rows))
PY
)")
fi
if has timing; then  # bench/probes/safety_timing.py: this tree, and .gl/before when carried, in alternation
  for round in 1 2; do
    timeout "$T" python3 bench/probes/safety_timing.py after 5 2>&1 | grep TIMING | tee -a "$OUT/timing.txt"
    if [ -d .gl/before/kermac_like ]; then
      PYTHONPATH=/tmp/site:$PWD/.gl/before KERMAC_LIKE_CACHE_DIR=/tmp/kermac_like_cache_before \
        timeout "$T" python3 bench/probes/safety_timing.py before 5 2>&1 | grep TIMING | tee -a "$OUT/timing.txt"
    fi
  done
  summary+=("timing (ms): $(tr '\n' ' ' < "$OUT/timing.txt")")
fi
if has krr; then
  timeout "$T" python3 examples/large_scale_krr.py --solver nystrom --repeats 1 ${KRR_ARGS:-} 2>&1 \
    | tee "$OUT/krr_nystrom.log" | tail -n 12
  summary+=("krr nystrom: $(grep -E "fit:|residual" "$OUT/krr_nystrom.log" | tail -2 | tr '\n' ' ')")
fi
if has linalg; then
  for mode in cold warm; do
    timeout "$T" python3 -c "import tests.test_linalg as t, subprocess, sys; \
r = subprocess.run([sys.executable, '-c', t._FIRST_CALL_CHILD, '$mode'], capture_output=True, text=True); \
print('$mode', r.stdout.strip()[-200:], r.stderr.strip()[-400:])" 2>&1 | tee -a "$OUT/linalg_first_call.txt"
  done
  summary+=("linalg first calls (1 = returned before the sleep ended; chol, lu, eigh per shape): $(tr '\n' ' ' < "$OUT/linalg_first_call.txt")")
fi
if has sanitize; then
  TOOLS=${TOOLS:-memcheck racecheck synccheck initcheck} timeout "$T" bash bench/sanitize.sh "$OUT/sanitize" \
    ${SAN_FAMILIES:-} > "$OUT/sanitize.log" 2>&1
  summary+=("sanitize: see below")
  # One archive: the device tool brings back only a few files per call.
  tar czf "$OUT/sanitize.tgz" -C "$OUT" sanitize && cp "$OUT/sanitize/summary.txt" "$OUT/sanitize_summary.txt" \
    && rm -rf "$OUT/sanitize"
fi
if has extra; then  # $EXTRA: any further command lines (probes), output in extra.log
  timeout "$T" bash -c "${EXTRA:-true}" 2>&1 | tee "$OUT/extra.log" | tail -n 60
fi
echo "== summary"
for line in "${summary[@]}"; do echo "$line"; done
[ -f "$OUT/sanitize_summary.txt" ] && cat "$OUT/sanitize_summary.txt"
echo "== pytest exit: $status"
exit 0
