#!/usr/bin/env bash
# Strong scaling of the multi-GPU paths (Falkon at 10^9, sharded knn_d128 at 10^7, KernelRidge cg at
# 10^6) at 1, 2, 4, ..., G ranks in one call, one table: the options are bench/scale_out.py's (--help).
#
#   bench/scale_out.sh --out "$OUT/scale_out.json"          # every visible GPU (NCCL)
#   bench/scale_out.sh --device cpu --tiny --ranks 4         # gloo on CPU processes, tiny sizes
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (NVLS), on every rank
exec "${PYTHON:-python3}" bench/scale_out.py "$@"
