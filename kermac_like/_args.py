"""Argument checks shared by the ops: one place, one wording."""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# Elements of one block of all_finite: isfinite on CUDA allocates ~7 bytes an element (|t| and
# boolean temporaries), so a block costs ~30 MB whatever the tensor's size (the whole of a
# 10^6 x 128 float32 tensor at once: 854 MB, bench/notes/knn.md).
FINITE_BLOCK = 1 << 22


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on t's device: no NaN/inf in ``t``, checked in blocks of FINITE_BLOCK
    elements along the first dimension (the temporaries of one block only), no host
    synchronisation."""
    if not t.numel():
        return torch.ones((), dtype=torch.bool, device=t.device)
    t2 = t.reshape(t.shape[0], -1) if t.dim() else t.reshape(1, 1)
    rows = max(1, FINITE_BLOCK // max(1, t2.shape[1]))
    if rows >= t2.shape[0]:
        return torch.isfinite(t2).all()
    return torch.stack([torch.isfinite(t2[i:i + rows]).all() for i in range(0, t2.shape[0], rows)]).all()


def all_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in ``t`` (finite_flag, one host synchronisation)."""
    return bool(finite_flag(t))


def check_tensor(name: str, t, *, min_dim: int = 2) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating tensor (float32, float64, float16, bfloat16), got {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{name}: expected at least {min_dim} dimensions, got shape {tuple(t.shape)}")
    return t


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name}: dtype {t.dtype} differs from {ref_name}'s {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name}: device {t.device} differs from {ref_name}'s {ref.device}")


def check_scalar_or_tensor(name: str, x, device: torch.device, *, positive: bool = False, nonnegative: bool = False,
                           allow_inf: bool = False):
    """A hyper-parameter: a real number, or a floating tensor over batch modes on ``device``.

    Python numbers are checked for their sign here; tensor values are not
    inspected (that would synchronise the host) and are documented as the
    caller's responsibility.
    """
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        if not (x.is_floating_point()):
            raise TypeError(f"{name}: expected a floating tensor, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name}: tensor is on {x.device}, the data is on {device}")
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a real number or a tensor, got {type(x).__name__}")
    x = float(x)
    if math.isnan(x):
        raise ValueError(f"{name}: must not be NaN")
    if math.isinf(x) and not allow_inf:
        raise ValueError(f"{name}: must be finite, got {x}")
    if positive and not x > 0:
        raise ValueError(f"{name}: must be > 0, got {x}")
    if nonnegative and not x >= 0:
        raise ValueError(f"{name}: must be >= 0, got {x}")
    return x


def check_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__}")
    return int(x)


def check_device(name: str, device) -> torch.device:
    """``device`` (a torch.device, a str such as "cuda:1", or a CUDA ordinal) as a torch.device.

    A CUDA device that this process cannot use is a ValueError naming ``name``: on a torch
    built without CUDA, one line saying so (instead of torch's AssertionError from deep inside
    the first CUDA call), and likewise where no CUDA device is visible or the ordinal is past
    the last one."""
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"{name}: {device!r} is not a torch device ({e})") from None
    elif isinstance(device, numbers.Integral) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"{name}: a CUDA ordinal is >= 0, got {device}")
        dev = torch.device("cuda", int(device))
    else:
        raise TypeError(f"{name}: expected a torch.device, a str or a CUDA ordinal, got {type(device).__name__}")
    if dev.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise ValueError(f"{name}: {str(dev)!r} asked for, but this torch ({torch.__version__}) has no CUDA "
                             "(a CPU-only build of torch)")
        if not torch.cuda.is_available():
            raise ValueError(f"{name}: {str(dev)!r} asked for, but torch sees no CUDA device "
                             "(torch.cuda.is_available() is False)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}: {str(dev)!r} asked for, but only {torch.cuda.device_count()} CUDA "
                             "device(s) are visible")
    return dev
