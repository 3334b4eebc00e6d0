"""Falkon's two products on tensor cores (cuda_templates/falkon_mma.cuh): K(x, z) v and K(z, x) w for
the Gaussian kernel at K <= 32 coordinates, with one kernel value per pair in both (bit for bit), float32
partials of 8 terms and float64 sums (the blocked float64 mode's arithmetic, with the exponent's dot
product on mma.sync in 3xTF32). Used by KernelRidge(solver="nystrom") through
``solvers._kernel.SolverKernel``; KERMAC_LIKE_FALKON_MMA=0 turns it off (kernel_matvec's blocked
float64 mode then, as before).

:class:`FalkonProducts` holds the centres' prepared side (B fragments, b_j, the centre and scale) for a
fit; its ``rows(x, v)`` and ``cols(x, w)`` take any float32 rows x (N, K) of that fit, and
``rows_pv(x, v)`` computes K(x, z) v for several columns with the products k v on tensor cores too
(``falkon_rows_pv_kernel``; GPyTorch's CG products, kermac_like.gpytorch).

Error model: the exponent -s |x - z|^2 comes from the product formula (a_i + b_j + 2 u.w), whose error
grows with |u|^2 + |w|^2, so both sides are centred first, on one point for the fit: the centres'
mean (``FalkonProducts.centre``), subtracted in float32 in the kernels themselves as x's rows and the
centres are loaded (u = r (x - centre), w = r (z - centre); exact for coordinates within a factor of
two of the centre's, Sterbenz). The products are therefore translation invariant (data offset by
1000 x its spread give the values of centred data up to the rounding of the inputs) at no cost per
chunk: no shifted copy of the rows is made, N streamed rows are read once per product as before.
The error is ~2^-24 s (|u|^2 + |w|^2) in the exponent with u, w about the centres' mean: the data's
centred scale, not its distance from the origin.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import numpy as np
import torch

from .. import config
from ..descriptor import PRESETS
from ..runtime import launcher, store
from ..runtime.specs.falkon import (MAX_K, PAD, c_chunk, cols_spec, k_bucket, prep_spec, pv_nq, rows_pv_spec,
                                    rows_spec, vprep_spec)
from .core import _device_index, _gpu_ok

__all__ = ["enabled", "serves", "FalkonProducts"]

log = logging.getLogger("kermac_like.falkon")
_LOG2E = 1.0 / math.log(2.0)


def enabled() -> bool:
    """The setting falkon_mma (KERMAC_LIKE_FALKON_MMA; off: kernel_matvec's blocked float64 mode)."""
    return config.get("falkon_mma")


def serves(desc, hypers: dict, z: torch.Tensor) -> bool:
    """Whether the tensor-core products serve a fit's kernel and centres (whose rows have the data's
    dtype and device): :func:`enabled`, the Gaussian kernel ('gaussian_l2') with a scalar bandwidth as
    its only hyper-parameter, float32 2-D z on a CUDA device of sm_80 or newer, 1 <= K <= 32."""
    if not (enabled() and desc == PRESETS["gaussian_l2"] and set(hypers) == {"bandwidth"}):
        return False
    bw = hypers["bandwidth"]
    if not (isinstance(bw, float) and bw > 0 and math.isfinite(bw)):
        return False
    return (z.dim() == 2 and z.dtype == torch.float32 and 1 <= z.shape[1] <= MAX_K
            and 0 < z.shape[0] < 2 ** 31 - PAD and _gpu_ok(z))


def _split(ctas: int, slots: int, most: int) -> int:
    """Splits of a launch of ``ctas`` CTAs per split (at most ``most``): the fewest that fill at least two
    waves of ``slots`` to within 5 % of whole waves (a launch of 2.09 waves takes as long as one of 3),
    else the best-filled up to four times that many."""
    best, best_eff = 1, 0.0
    s0 = max(1, -(-2 * slots // ctas))
    for s in range(1, min(most, 4 * s0) + 1):
        total = ctas * s
        eff = total / (-(-total // slots) * slots)
        if total >= min(2 * slots, ctas * most) and eff >= 0.95:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


class _PvLaunch(NamedTuple):
    """One column chunk of a kept rows_pv call: the fragment launch and the product launch with their packed
    arguments (pointer slots filled per call), and the buffers they write, which live with it."""

    c0: int
    cc: int
    prep: object
    pgrid: tuple
    pargs: tuple  # v at 0 and amax at 5 filled per call
    kern: object
    grid: tuple
    kargs: tuple  # amax at 9 and the output at 12 filled per call
    dst: torch.Tensor | None  # float64 split sums, or None: the product writes out directly
    vf: torch.Tensor
    blocks: tuple


class FalkonProducts:
    """The centres z (M, K) of a fit, prepared for falkon_rows_kernel / falkon_cols_kernel: the
    centre (the mean of z, float32), the scale r = sqrt(log2(e) / (2 bandwidth^2)) (float32), the
    B fragments of w = r (z - centre) and b_j = -|w_j|^2 (M padded to a multiple of 256).

    ``columns``: the products it will serve, for the kernels fetched (compiled or loaded) up front:
    "falkon" (rows and cols of one column, the regression's) or "pv" (rows_pv's launches of 16 columns).
    GPU memory: 64 kK / 8 bytes a padded centre (fragments, b), plus per product call the v fragments
    (64 bytes a padded centre and 16 columns) and, where the centre range is split, float64 partial
    sums (split x N x C)."""

    def __init__(self, z: torch.Tensor, bandwidth: float, debug: bool = False, columns: str = "falkon"):
        self.debug = debug
        self.device = _device_index(z.device)
        # CTA slots of the device: both kernels run 2 CTAs per SM
        self.slots = torch.cuda.get_device_properties(self.device).multi_processor_count * 2
        self.M, self.K = z.shape
        self.kK = k_bucket(self.K)
        self.Mp = -(-self.M // PAD) * PAD
        zc = z if z.stride(1) == 1 else z.contiguous()
        c = zc.mean(dim=0, dtype=torch.float32)
        self.centre = torch.where(torch.isfinite(c), c, 0.0).contiguous()
        self.scale = float(np.float32(math.sqrt(_LOG2E / (2.0 * bandwidth * bandwidth))))
        S = self.kK // 8
        self.zf = torch.empty(self.Mp // 8 * S * 32 * 4, dtype=torch.int32, device=z.device)
        self.zb = torch.empty(self.Mp, dtype=torch.float32, device=z.device)
        self._pv_plans = {}
        spec = prep_spec(self.K)
        products = ([vprep_spec(self.K, 2), rows_pv_spec(self.K, 2)] if columns == "pv"
                    else [rows_spec(self.K, 1), cols_spec(self.K, 1)])
        store.prefetch([spec, *products], self.device, debug=debug)
        prep = store.get_kernel(spec, self.device, debug=debug)
        entries = max(self.Mp // 8 * S * 32, self.Mp)
        grid = (-(-entries // spec.launch.threads), 1, 1)
        launcher.launch(prep, grid, (zc.data_ptr(), np.int64(zc.stride(0)), np.int32(self.M), np.int32(self.K),
                                     self.centre.data_ptr(), np.float32(self.scale), np.int32(self.Mp),
                                     self.zf.data_ptr(), self.zb.data_ptr()), debug=debug)

    def _row_split(self, N: int, spec) -> tuple:
        """(CTAs of rows, centre-range splits, centre tiles per split) of a rows-kernel launch over N rows."""
        ctas = -(-N // spec.launch.block_m)
        tiles = self.Mp // spec.launch.block_n
        split = _split(ctas, self.slots, tiles) if ctas < 8 * self.slots else 1
        per = -(-tiles // split)
        return ctas, -(-tiles // per), per

    def _x(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype != torch.float32:
            raise ValueError(f"x: expected float32 rows of {self.K} coordinates, got {tuple(x.shape)} {x.dtype}")
        return x if x.stride(1) == 1 else x.contiguous()

    def rows(self, x: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """K(x, z) v: (N, C) float64 for v (M, C) (float64 or float32; rounded to float32 once)."""
        x = self._x(x)
        N, C = x.shape[0], v.shape[1]
        dev = x.device
        if out is None:
            out = torch.empty((N, C), dtype=torch.float64, device=dev)
        if N == 0:
            return out
        vp = torch.zeros((self.Mp, C), dtype=torch.float32, device=dev)
        vp[:self.M] = v
        c0 = 0
        while c0 < C:
            kC = c_chunk(C - c0, self.kK)
            spec = rows_spec(self.K, kC)
            kern = store.get_kernel(spec, self.device, debug=self.debug)
            vc = vp[:, c0:c0 + kC].contiguous()
            ctas, split, per = self._row_split(N, spec)
            if split == 1:
                dst, so, ss = out[:, c0:], out.stride(0), 0
            else:
                dst = torch.empty((split, N, kC), dtype=torch.float64, device=dev)
                so, ss = kC, N * kC
            if self.debug:
                log.debug("falkon rows: N=%d M=%d K=%d columns %d..%d: grid (%d, %d), %d centre tiles per split",
                          N, self.M, self.K, c0, c0 + kC, ctas, split, per)
            launcher.launch(kern, (ctas, split, 1),
                            (x.data_ptr(), np.int64(x.stride(0)), np.int64(N), np.int32(self.K),
                             self.centre.data_ptr(), np.float32(self.scale), self.zf.data_ptr(), self.zb.data_ptr(),
                             vc.data_ptr(), np.int32(self.Mp), dst.data_ptr(), np.int64(so), np.int64(ss),
                             np.int32(per)), debug=self.debug)
            if split > 1:  # the splits added in order (torch's sum over a leading dimension of <= 264)
                out[:, c0:c0 + kC] = dst.sum(dim=0)
            c0 += kC
        return out

    def rows_pv(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """K(x, z) v: (N, C) float64 for float32 v (M, C) (any strides), the products k v on tensor cores
        (falkon_rows_pv_kernel: k and v s_c split into two f16 parts each, s_c a power of two from the
        column's largest |v|, three mma.m16n8k16 per 16 centres, float32 sums of 128 centres added in
        float64, the 2^-12 correction's of 512), in launches of 16 columns (8 for a last chunk of <= 8).
        Each launch first makes v's B fragments (falkon_vprep_kernel: Mp x 64 bytes at 16 columns) from
        the columns' max |v|.

        A CG loop calls this with one x and right-hand sides of one shape: the launches of such a call
        (kernels, grids, splits, the fragment and split buffers, the packed arguments) are kept per
        (x, N, C, v's strides), so a repeat costs the host little more than its launches."""
        x = self._x(x)
        if v.dim() != 2 or v.shape[0] != self.M or v.dtype != torch.float32 or v.device != x.device:
            raise ValueError(f"v: expected float32 ({self.M}, C) on {x.device}, got {tuple(v.shape)} {v.dtype} "
                             f"on {v.device}")
        N, C = x.shape[0], v.shape[1]
        out = torch.empty((N, C), dtype=torch.float64, device=x.device)
        if N == 0 or C == 0:
            return out
        key = (x.data_ptr(), x.stride(0), N, C, v.stride(0), v.stride(1))
        plan = self._pv_plans.get(key)
        if plan is None:
            plan = self._pv_plan(x, v, out)
            if len(self._pv_plans) > 8:
                self._pv_plans.clear()
            self._pv_plans[key] = plan
        amax = torch.linalg.vector_norm(v, ord=float("inf"), dim=0)  # (C,) float32
        vp, ap, op = v.data_ptr(), amax.data_ptr(), out.data_ptr()
        for p in plan:
            pa = (vp + 4 * p.c0 * v.stride(1), *p.pargs[1:5], ap + 4 * p.c0, *p.pargs[6:])
            launcher.launch(p.prep, p.pgrid, pa, debug=self.debug, block=p.blocks[0])
            dst = op + 8 * p.c0 if p.dst is None else p.dst.data_ptr()
            ka = (*p.kargs[:9], ap + 4 * p.c0, *p.kargs[10:12], dst, *p.kargs[13:])
            launcher.launch(p.kern, p.grid, ka, debug=self.debug, block=p.blocks[1])
            if p.dst is not None:  # the splits added in order
                out[:, p.c0:p.c0 + p.cc] = p.dst.sum(dim=0)
        return out

    def _pv_plan(self, x: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> list[_PvLaunch]:
        """The launches of rows_pv for x and a v of this shape and strides (see rows_pv)."""
        N, C = x.shape[0], v.shape[1]
        plan, c0 = [], 0
        while c0 < C:
            nq = pv_nq(C - c0)
            cc = min(8 * nq, C - c0)
            prep = store.get_kernel(vprep_spec(self.K, nq), self.device, debug=self.debug)
            spec = rows_pv_spec(self.K, nq)
            kern = store.get_kernel(spec, self.device, debug=self.debug)
            entries = self.Mp // 16 * nq * 32
            vf = torch.empty(entries * 4, dtype=torch.int32, device=x.device)
            pgrid = (-(-entries // prep.spec.launch.threads), 1, 1)
            pargs = (v.data_ptr(), np.int64(v.stride(0)), np.int64(v.stride(1)), np.int64(self.M), np.int32(cc), 0,
                     np.int32(self.Mp), vf.data_ptr())
            ctas, split, per = self._row_split(N, spec)
            if split == 1:
                dst, so, ss = None, out.stride(0), 0
            else:
                dst = torch.empty((split, N, cc), dtype=torch.float64, device=x.device)
                so, ss = cc, N * cc
            grid = (ctas, split, 1)
            kargs = (x.data_ptr(), np.int64(x.stride(0)), np.int64(N), np.int32(self.K), self.centre.data_ptr(),
                     np.float32(self.scale), self.zf.data_ptr(), self.zb.data_ptr(), vf.data_ptr(), 0,
                     np.int32(self.Mp), np.int32(cc), 0, np.int64(so), np.int64(ss), np.int32(per))
            if self.debug:
                log.debug("falkon rows_pv: N=%d M=%d K=%d columns %d..%d: grid (%d, %d), %d centre tiles per split",
                          N, self.M, self.K, c0, c0 + cc, ctas, split, per)
            arg_block = launcher.ArgBlock
            blocks = (arg_block(prep, pgrid, pargs, (0, 5)) if arg_block.supports(pargs, (0, 5)) else None,
                      arg_block(kern, grid, kargs, (9, 12)) if arg_block.supports(kargs, (9, 12)) else None)
            plan.append(_PvLaunch(c0, cc, prep, pgrid, pargs, kern, grid, kargs, dst, vf, blocks))
            c0 += cc
        return plan

    def cols(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """K(z, x) w: (M, C) float64 for w (N, C) (float64 or float32; rounded to float32 once)."""
        x = self._x(x)
        N, C = x.shape[0], w.shape[1]
        dev = x.device
        if out is None:
            out = torch.empty((self.M, C), dtype=torch.float64, device=dev)
        if N == 0:
            return out.zero_()
        w32 = w.to(torch.float32)  # rounded once (w itself where it is float32)
        if w32.stride(1) != 1:
            w32 = w32.contiguous()
        c0 = 0
        while c0 < C:
            kC = c_chunk(C - c0, self.kK)
            spec = cols_spec(self.K, kC)
            kern = store.get_kernel(spec, self.device, debug=self.debug)
            ctas = self.Mp // spec.launch.block_n
            bm = spec.launch.block_m
            x_tiles = -(-N // bm)
            split = _split(ctas, self.slots, x_tiles)
            per = -(-x_tiles // split) * bm
            split = -(-N // per)
            dst = torch.empty((split, self.M, kC), dtype=torch.float64, device=dev)
            if self.debug:
                log.debug("falkon cols: N=%d M=%d K=%d columns %d..%d: grid (%d, %d), %d rows per split",
                          N, self.M, self.K, c0, c0 + kC, ctas, split, per)
            launcher.launch(kern, (ctas, split, 1),
                            (x.data_ptr(), np.int64(x.stride(0)), np.int64(N), np.int32(self.K),
                             self.centre.data_ptr(), np.float32(self.scale), self.zf.data_ptr(), self.zb.data_ptr(),
                             w32[:, c0:].data_ptr(), np.int64(w32.stride(0)), np.int32(self.M), dst.data_ptr(),
                             np.int64(kC), np.int64(self.M * kC), np.int64(per)), debug=self.debug)
            out[:, c0:c0 + kC] = dst.sum(dim=0) if split > 1 else dst[0]
            c0 += kC
        return out
