"""GPyTorch's CG products at gp_step's size (issue 29): K(x, x) V for x (N, 8) / lengthscale, V (N, C) with
C = 11 (GPyTorch's probe vectors + 1), Gaussian kernel at bandwidth 1: kernel_matvec (float32, the
operator's SIMT product) against plan.falkon's tensor-core rows kernel (kC chunks of C, FFMA sums) and its
several-column rows kernel (rows_pv: k v on tensor cores too, 16-column launches), time (CUDA events, median of 7 after a warm-up) and the error of each against float64 arithmetic
on 256 rows (relative 2-norm).

    PYTHONPATH=. python3 bench/probes/gp_products_probe.py [N ...]
"""
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import kermac_like as km  # noqa: E402
from _timing import event_ms  # noqa: E402
from kermac_like.descriptor import preset  # noqa: E402
from kermac_like.plan.falkon import FalkonProducts  # noqa: E402


def ms(fn, reps=7):
    fn()
    return statistics.median(event_ms(fn)[0] for _ in range(reps))


g = torch.Generator(device="cuda").manual_seed(0)
for N in [int(float(a)) for a in sys.argv[1:]] or [50_000, 100_000]:
    x = (torch.rand(N, 8, device="cuda", generator=g) * 2 - 1) / 0.4
    for C in (1, 2, 4, 8, 11, 16, 32):
        v = torch.randn(N, C, device="cuda", generator=g)
        ref = torch.exp(-torch.cdist(x[:256].double(), x.double()).square() / 2) @ v.double()
        err = lambda o: float((o[:256].double() - ref).norm() / ref.norm())  # noqa: E731
        desc = preset("gaussian_l2")
        t_mv = ms(lambda: km.kernel_matvec(desc, x, x, v, bandwidth=1.0))
        e_mv = err(km.kernel_matvec(desc, x, x, v, bandwidth=1.0))
        t_prep = ms(lambda: FalkonProducts(x, 1.0))
        fp = FalkonProducts(x, 1.0)
        t_fr = ms(lambda: fp.rows(x, v))
        e_fr = err(fp.rows(x, v))
        fpv = FalkonProducts(x, 1.0, columns="pv")
        t_pv = ms(lambda: fpv.rows_pv(x, v))
        e_pv = err(fpv.rows_pv(x, v))
        print(f"N={N} C={C:2d}: kernel_matvec {t_mv:7.3f} ms (err {e_mv:.1e}) | falkon rows {t_fr:7.3f} ms "
              f"(err {e_fr:.1e}) + prep {t_prep:.3f} ms | rows_pv {t_pv:7.3f} ms (err {e_pv:.1e}) | "
              f"kernel_matvec / rows_pv {t_mv / t_pv:.2f}x", flush=True)
