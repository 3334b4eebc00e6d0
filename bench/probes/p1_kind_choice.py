"""Issue #16: with the SIMT kernel's k-major copies, where should cdist p=1 switch from the low-K
kernel to the SIMT kernel (autotune.LOWK_UP_TO["abs"] = 64 today)? Times both kinds through the
autotuner (autotune=True, debug log) at M = N = 20 000 for K in 33..64.

    python3 bench/probes/p1_kind_choice.py        (GPU; table last)
"""
import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KERMAC_LIKE_CACHE_DIR", tempfile.mkdtemp())  # no stored winners
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kermac_like as km  # noqa: E402
from log_capture import captured  # noqa: E402

msgs = captured("kermac_like", logging.DEBUG)
rows = []
out = torch.empty(20000, 20000, device="cuda")
for K in (33, 40, 48, 56, 64):
    x, y = torch.randn(20000, K, device="cuda"), torch.randn(20000, K, device="cuda")
    msgs.clear()
    km.cdist(x, y, p=1.0, out=out, autotune=True, debug=True)
    line = [m for m in msgs if m.startswith("autotune")]
    rows.append((K, line[-1] if line else "(no autotune line)"))
    print(K, rows[-1][1], flush=True)
print("== p1_kind_choice")
for K, line in rows:
    print(K, line)
