"""torch.distributed plumbing of the estimators (KernelRidge, the neighbours, RFM): who holds which
rows, and the few collectives that combine them.

Each rank of an initialised process group holds its own rows of the training set (its shard).
KernelRidge's cg and cholesky exchange the N x D point set and N x C vectors (all_gather), m x m
blocks and CG scalars (all_reduce); nystrom only the m centre rows and m x C blocks (all_reduce)
and validation metadata (objects), never X or y; the neighbours their (M x k) candidates. Without a
process group (or with a group of one) every method is a local no-op, so the single-process path
runs the same code.

Collectives run on the group's device: CUDA tensors for NCCL, CPU tensors for
gloo; tensors on the other kind of device are moved for the call and moved
back.
"""

from __future__ import annotations

import torch

__all__ = ["Comm"]


class Comm:
    """The process group of one fit/predict call (None: the default group)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if active else 0
        self.size = dist.get_world_size(group) if active else 1
        self.active = active and self.size > 1
        self.device = None
        if self.active:
            backend = str(dist.get_backend(group)).lower()
            if "nccl" in backend:
                self.device = torch.device("cuda", torch.cuda.current_device())
            else:
                self.device = torch.device("cpu")

    # -- moving tensors to the group's device -------------------------------------------
    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    # -- collectives (identity without a group) --------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max/min) of ``t`` over the ranks; in place when ``t`` is on the group's device."""
        if not self.active:
            return t
        ops = {"sum": self.dist.ReduceOp.SUM, "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        w = self._to(t)
        self.dist.all_reduce(w, op=ops[op], group=self.group)
        if w is not t:
            t.copy_(w)
        return t

    def all_gather_padded(self, t: torch.Tensor, n_max: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of every rank, each rank's block padded with zeros to ``n_max`` rows:
        a (size * n_max, ...) tensor whose rows [r * n_max, r * n_max + n_r) are rank r's."""
        if not self.active:
            return t
        n = t.shape[0]
        src = t
        if n != n_max or src.device != self.device or not src.is_contiguous():
            src = torch.zeros((n_max, *t.shape[1:]), dtype=t.dtype, device=self.device)
            src[:n] = t
        if out is None or out.device != self.device:
            dst = torch.empty((self.size * n_max, *t.shape[1:]), dtype=t.dtype, device=self.device)
        else:
            dst = out
        if self.device.type == "cuda":
            self.dist.all_gather_into_tensor(dst, src, group=self.group)
        else:
            self.dist.all_gather(list(dst.chunk(self.size)), src, group=self.group)
        if out is not None and dst is not out:
            out.copy_(dst)
            return out
        return dst if t.device == self.device else dst.to(t.device)

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        if not self.active:
            return [obj]
        objs = [None] * self.size
        self.dist.all_gather_object(objs, obj, group=self.group)
        return objs

    def raise_collectively(self, error, meta=None) -> list:
        """Every rank's ``meta``, in rank order, once every rank has run its checks: ``error`` (None or
        (exception type, message), this rank's failure) of any rank is raised on every rank, naming the rank
        under a process group, so that nobody is left waiting in a collective another rank never enters."""
        everyone = self.all_gather_object((error, meta))
        for r, (err, _) in enumerate(everyone):
            if err is not None:
                raise err[0](err[1] + (f" (on rank {r})" if self.active else ""))
        return [m for _, m in everyone]

    def broadcast_object(self, obj, src: int = 0):
        if not self.active:
            return obj
        box = [obj]
        self.dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]
