"""Checks the operator's tensor-core CG products inside a real gp_step (N = argv[1], default 2 x 10^4):
every rows_pv call of the step against kernel_matvec on the same x and v (relative difference, v's
strides and columns), and the step's loss and time with KERMAC_LIKE_GP_TC=1 and =0.

    python3 bench/probes/gp_tc_check.py [N]
"""
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import _gp  # noqa: E402
import kermac_like as km  # noqa: E402
from kermac_like.gpytorch import RBFKernel  # noqa: E402
from kermac_like.plan.falkon import FalkonProducts  # noqa: E402

N = int(float(sys.argv[1])) if len(sys.argv) > 1 else 20_000
x, y = _gp.data(N)
records = []
real = FalkonProducts.rows_pv


def checked(self, xx, v):
    if os.environ.get("PV_NOCACHE") == "1":
        self._pv_plans.clear()
    vin = v.clone()
    out = real(self, xx, v)
    if len(records) < 3:
        print("  call", len(records), "v finite", bool(torch.isfinite(vin).all()), "v changed", not torch.equal(vin, v),
              "out nan", int(torch.isnan(out).sum()), "x", tuple(xx.shape), xx.stride(), xx.data_ptr() % 4096,
              "z is x", self._z_for_check.data_ptr() == xx.data_ptr(), flush=True)
    z = self._z_for_check
    ref = km.kernel_matvec(km.preset("gaussian_l2"), xx, z, v.contiguous(), bandwidth=1.0).double()
    records.append((tuple(v.shape), tuple(v.stride()), float((out - ref).norm() / ref.norm())))
    return out


real_init = FalkonProducts.__init__


def init(self, z, *a, **k):
    real_init(self, z, *a, **k)
    self._z_for_check = z


def step():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = _gp.step(RBFKernel, x, y)
    torch.cuda.synchronize()
    return float(loss), time.perf_counter() - t0


for flag in ("0", "1", "1"):
    os.environ["KERMAC_LIKE_GP_TC"] = flag
    print(f"KERMAC_LIKE_GP_TC={flag}: loss, seconds", step(), flush=True)
FalkonProducts.rows_pv = checked
FalkonProducts.__init__ = init
print("checked step", step())
print(f"{len(records)} rows_pv calls; worst relative difference {max(r[2] for r in records):.2e}")
for r in records[:6] + [r for r in records if r[2] > 1e-5][:10]:
    print("  shape", r[0], "strides", r[1], f"rel {r[2]:.2e}")
