"""Small calls of every kernel family, for compute-sanitizer (bench/sanitize.sh).

    python3 bench/probes/sanitize_calls.py --list          # the family names
    python3 bench/probes/sanitize_calls.py simt wgmma      # run some families
    python3 bench/probes/sanitize_calls.py --warm          # compile everything (no sanitizer)

One family is one entry of FAMILIES: a function making a few calls at odd sizes with
a batch of 2 (ragged tiles, K tails, both output layouts where the family has them),
and the environment it needs. The output is checked against the float64 reference,
so that a run under the sanitizer also shows the calls did their work.
"""

from __future__ import annotations

import os
import sys

import torch

import kermac_like as km
from kermac_like.reference import cdist_grad_reference, distance_reference

SIZES = (2, 131, 97, 37)  # batch, M, N, K: odd, ragged against every tile shape
TC_SIZES = (2, 131, 97, 40)  # the tensor-core kernels take rows of whole 16-byte chunks


def _data(seed=0, dtype=torch.float32, sizes=SIZES):
    L, M, N, K = sizes
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(L, M, K, device="cuda", generator=g).to(dtype),
            torch.randn(L, N, K, device="cuda", generator=g).to(dtype))


def _check(out, desc, a, b, tol, p=None, **kw):
    ref = distance_reference(desc, a.double(), b.double(), inner_p=p, outer_p=p, **kw)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < tol, f"{desc!r}: relative error {err:.2e}"


def _distance(descs, mode, dtypes=(torch.float32,), tol=1e-4):
    for dtype in dtypes:
        a, b = _data(dtype=dtype, sizes=SIZES if mode.startswith("donot") else TC_SIZES)
        for name in descs:
            desc = km.PRESETS[name]
            kw = {"bandwidth": 7.0} if desc.needs_bandwidth else {}
            if desc.needs_inner_p:
                kw["p"] = 1.3
            for out_t in (False, True):  # row-major and column-major output
                out = torch.empty(2, 97, 131, device="cuda", dtype=dtype).mT if out_t else None
                assert desc.is_euclidean or mode.startswith("donot")
                res = km.run_kernel(desc, a, b, out=out, compute_mode=mode, regularization=0.5, **kw)
                _check(res, desc, a, b, tol, regularization=0.5, **kw)
        # K = 264: more k-tiles than pipeline stages (every ring wraps), one descriptor
        a2, b2 = _data(seed=3, dtype=dtype, sizes=(2, 131, 300, 264))
        desc = km.PRESETS["l2"]
        _check(km.run_kernel(desc, a2, b2, compute_mode=mode), desc, a2, b2, tol)
        # transposed (column-major) operands, both alignments: the SIMT loaders
        if mode.startswith("donot"):
            at = a.mT.contiguous().mT
            bt = torch.empty(2, 37, 98, device="cuda")[..., 1:].mT  # unaligned column-major
            bt.copy_(b)
            res = km.run_kernel(km.PRESETS["l1"], at, bt, compute_mode=mode)
            _check(res, km.PRESETS["l1"], a, b, tol)


def simt():
    _distance(["l1", "l2", "p_norm", "laplace_l2", "gaussian_l2", "dot"], "donot_use_mm_for_euclid_dist")


def mma():
    _distance(["l2", "squared_l2", "laplace_l2", "gaussian_l2", "dot"], "use_mm_for_euclid_dist",
              dtypes=(torch.float32, torch.float16), tol=2e-2)


def wgmma():
    if torch.cuda.get_device_capability() != (9, 0):
        print("wgmma: not an sm_90 device, skipped")
        return
    _distance(["l2", "laplace_l2", "gaussian_l2", "dot"], "use_mm_for_euclid_dist")


def _grad():
    L, K, M, N, O = 2, 45, 37, 21, 5
    g = torch.Generator(device="cuda").manual_seed(1)
    a, b = torch.randn(L, K, M, device="cuda", generator=g), torch.randn(L, N, K, device="cuda", generator=g)
    c, d = torch.randn(L, O, K, device="cuda", generator=g), torch.randn(L, N, M, device="cuda", generator=g)
    a4 = torch.randn(L, K, 40, device="cuda", generator=g)  # M % 4 == 0: the 16-byte variant
    d4 = torch.randn(L, N, 40, device="cuda", generator=g)
    for p in (1.0, 2.0, 1.3):
        for aa, dd in ((a, d), (a4, d4)):
            out = km.cdist_grad(aa, b, c, dd, p=p)
            ref = cdist_grad_reference(aa.double(), b.double(), c.double(), dd.double(), p)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-4, f"cdist_grad p={p}: relative error {err:.2e}"


def grad_simt():
    _grad()


def grad_mma():
    _grad()


def linalg():
    # cuSOLVER's own kernels only (the sanitizer's reports in them are filtered out):
    # present so that the filter itself is exercised.
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2, 33, 33, device="cuda", generator=g)
    a = x @ x.mT + 33 * torch.eye(33, device="cuda")
    b = torch.randn(2, 3, 33, device="cuda", generator=g)  # rows are right-hand sides
    km.linalg.solve_cholesky(a, b)
    km.linalg.solve_lu(a, b)
    km.linalg.eigh(a)
    torch.cuda.synchronize()


# name -> (function, environment)
FAMILIES = {
    "simt": (simt, {}),
    "mma": (mma, {"KERMAC_LIKE_WGMMA": "0"}),
    "wgmma": (wgmma, {}),
    "grad_simt": (grad_simt, {"KERMAC_LIKE_GRAD_MMA": "0"}),
    "grad_mma": (grad_mma, {"KERMAC_LIKE_GRAD_MMA": "1"}),
    "linalg": (linalg, {}),
}


def main(argv):
    if argv == ["--list"]:
        print(" ".join(FAMILIES))
        return
    names = list(FAMILIES) if not argv or argv == ["--warm"] else argv
    for name in names:
        fn, env = FAMILIES[name]
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            fn()
            torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


if __name__ == "__main__":
    main(sys.argv[1:])
