"""The kernel descriptor: an immutable description of one fused distance/kernel function.

A descriptor says *what* is computed for every pair of rows (x, y)::

    acc = sum_k inner_power(inner_operator(x_k, y_k))     # |x-y|, (x-y)^2, |x-y|^p, or x*y
    d   = outer_power(acc)                                # acc, sqrt(acc), acc^(1/p)
    out = kernel_type(d)                                  # d, exp(-d/bw), exp(-d^2/(2 bw^2))

It never says *how* (layouts, alignment, tensor cores): that is chosen per call.
Its canonical serialisation (:meth:`KernelDescriptor.cpp_args`) is used both in
the C++ name expression and, through it, in the persistent cache key.
"""

from __future__ import annotations

import enum
import itertools
import types
from dataclasses import dataclass

__all__ = [
    "InnerOperator",
    "PowerType",
    "KernelType",
    "KernelDescriptor",
    "PRESETS",
    "preset",
]


class InnerOperator(enum.IntEnum):
    """How two coordinates meet: their difference or their product."""

    DIFF = 0
    DOT = 1

    @property
    def cpp(self) -> str:
        return f"kermac_like::Inner::{self.name.capitalize()}"


class PowerType(enum.IntEnum):
    """A power applied elementwise (inner) or to the sum (outer)."""

    NOOP = 0
    ABS = 1
    SQUARE = 2
    SQRT = 3
    POW = 4

    @property
    def cpp(self) -> str:
        return f"kermac_like::Power::{self.name.capitalize()}"


class KernelType(enum.IntEnum):
    """The epilogue turning a distance d into a kernel value."""

    NONE = 0
    LAPLACE = 1  # exp(-d / bandwidth)
    GAUSSIAN = 2  # exp(-d^2 / (2 bandwidth^2))

    @property
    def cpp(self) -> str:
        return f"kermac_like::Epilogue::{self.name.capitalize()}"


_INNER_POWERS = (PowerType.NOOP, PowerType.ABS, PowerType.SQUARE, PowerType.POW)
_OUTER_POWERS = (PowerType.NOOP, PowerType.SQRT, PowerType.POW)


def _coerce(value, enum_type, argname):
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        try:
            return enum_type[value.upper()]
        except KeyError:
            pass
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return enum_type(value)
        except ValueError:
            pass
    valid = ", ".join(m.name for m in enum_type)
    raise ValueError(f"{argname}: {value!r} is not a {enum_type.__name__} (valid: {valid})")


@dataclass(frozen=True)
class KernelDescriptor:
    """Immutable description of a fused distance/kernel function.

    Fields accept the enums, their names (case-insensitive) or their values.
    Impossible combinations raise ``ValueError`` at construction.

    >>> import torch, kermac_like as km
    >>> d = km.KernelDescriptor("diff", "abs", "noop", "laplace")   # exp(-sum |x - y| / bandwidth)
    >>> d
    KernelDescriptor(DIFF, ABS, NOOP, LAPLACE)
    >>> d == km.preset("laplace_l1")
    True
    >>> x = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    >>> km.run_kernel(d, x, x, bandwidth=2.0)
    tensor([[1.0000, 0.3679],
            [0.3679, 1.0000]])
    """

    inner_operator: InnerOperator
    inner_power: PowerType
    outer_power: PowerType
    kernel_type: KernelType = KernelType.NONE

    def __post_init__(self):
        object.__setattr__(self, "inner_operator", _coerce(self.inner_operator, InnerOperator, "inner_operator"))
        object.__setattr__(self, "inner_power", _coerce(self.inner_power, PowerType, "inner_power"))
        object.__setattr__(self, "outer_power", _coerce(self.outer_power, PowerType, "outer_power"))
        object.__setattr__(self, "kernel_type", _coerce(self.kernel_type, KernelType, "kernel_type"))
        if self.inner_power not in _INNER_POWERS:
            raise ValueError(
                f"inner_power: {self.inner_power.name} is not an inner power "
                f"(valid: {', '.join(p.name for p in _INNER_POWERS)})"
            )
        if self.outer_power not in _OUTER_POWERS:
            raise ValueError(
                f"outer_power: {self.outer_power.name} is not an outer power "
                f"(valid: {', '.join(p.name for p in _OUTER_POWERS)})"
            )
        if self.inner_operator is InnerOperator.DIFF and self.inner_power is PowerType.NOOP:
            raise ValueError(
                "inner_power: DIFF needs ABS, SQUARE or POW (a signed sum of differences is not a distance)"
            )
        if self.inner_operator is InnerOperator.DOT:
            if self.inner_power is not PowerType.NOOP or self.outer_power is not PowerType.NOOP:
                raise ValueError("inner_power/outer_power: DOT takes NOOP inner and outer powers")
            if self.kernel_type is not KernelType.NONE:
                raise ValueError("kernel_type: DOT takes no LAPLACE/GAUSSIAN epilogue (it is not a distance)")

    # -- what the descriptor needs at call time ---------------------------------
    @property
    def fused_ok(self) -> bool:
        """Whether the fused CUDA templates compute this descriptor (the planner's routing
        predicate): True for every descriptor of the four enums; the formula kernels
        (kermac_like/formula.py) reach the templates only through epilogue functors."""
        return True

    @property
    def param_names(self) -> tuple:
        """The names of the descriptor's own hyper-parameters beyond run_kernel's (none here)."""
        return ()

    @property
    def needs_inner_p(self) -> bool:
        return self.inner_power is PowerType.POW

    @property
    def needs_outer_p(self) -> bool:
        return self.outer_power is PowerType.POW

    @property
    def needs_bandwidth(self) -> bool:
        return self.kernel_type is not KernelType.NONE

    @property
    def is_distance(self) -> bool:
        return self.inner_operator is InnerOperator.DIFF

    @property
    def is_euclidean(self) -> bool:
        """True when the sum is a squared Euclidean distance or a dot product:
        a matrix product in disguise, eligible for the tensor-core path."""
        if self.inner_operator is InnerOperator.DOT:
            return True
        return self.inner_power is PowerType.SQUARE and self.outer_power in (PowerType.NOOP, PowerType.SQRT)

    def cpp_args(self) -> str:
        """Canonical C++ template arguments (inner, inner power, outer power, epilogue)."""
        return ", ".join(
            (self.inner_operator.cpp, self.inner_power.cpp, self.outer_power.cpp, self.kernel_type.cpp)
        )

    def short_name(self) -> str:
        return (
            f"{self.inner_operator.name.lower()}-{self.inner_power.name.lower()}-"
            f"{self.outer_power.name.lower()}-{self.kernel_type.name.lower()}"
        )

    def __repr__(self) -> str:
        return (
            f"KernelDescriptor({self.inner_operator.name}, {self.inner_power.name}, "
            f"{self.outer_power.name}, {self.kernel_type.name})"
        )

    @classmethod
    def all(cls) -> "tuple[KernelDescriptor, ...]":
        """Every valid descriptor (28: 27 DIFF combinations and DOT)."""
        found = []
        for combo in itertools.product(InnerOperator, PowerType, PowerType, KernelType):
            try:
                found.append(cls(*combo))
            except ValueError:
                pass
        return tuple(found)

    # -- presets (frozen instances: safe to share) ----------------------------------
    @classmethod
    def l1(cls) -> "KernelDescriptor":
        return PRESETS["l1"]

    @classmethod
    def l2(cls) -> "KernelDescriptor":
        return PRESETS["l2"]

    @classmethod
    def squared_l2(cls) -> "KernelDescriptor":
        return PRESETS["squared_l2"]

    @classmethod
    def p_norm(cls) -> "KernelDescriptor":
        return PRESETS["p_norm"]

    @classmethod
    def laplace_l1(cls) -> "KernelDescriptor":
        return PRESETS["laplace_l1"]

    @classmethod
    def laplace_l2(cls) -> "KernelDescriptor":
        return PRESETS["laplace_l2"]

    @classmethod
    def laplace_p(cls) -> "KernelDescriptor":
        return PRESETS["laplace_p"]

    @classmethod
    def gaussian_l2(cls) -> "KernelDescriptor":
        return PRESETS["gaussian_l2"]

    @classmethod
    def dot(cls) -> "KernelDescriptor":
        return PRESETS["dot"]


_D, _I = InnerOperator, PowerType
PRESETS: "types.MappingProxyType[str, KernelDescriptor]" = types.MappingProxyType({
    "l1": KernelDescriptor(_D.DIFF, _I.ABS, _I.NOOP, KernelType.NONE),
    "l2": KernelDescriptor(_D.DIFF, _I.SQUARE, _I.SQRT, KernelType.NONE),
    "squared_l2": KernelDescriptor(_D.DIFF, _I.SQUARE, _I.NOOP, KernelType.NONE),
    "p_norm": KernelDescriptor(_D.DIFF, _I.POW, _I.POW, KernelType.NONE),
    "p_norm_skip_root": KernelDescriptor(_D.DIFF, _I.POW, _I.NOOP, KernelType.NONE),
    "laplace_l1": KernelDescriptor(_D.DIFF, _I.ABS, _I.NOOP, KernelType.LAPLACE),
    "laplace_l2": KernelDescriptor(_D.DIFF, _I.SQUARE, _I.SQRT, KernelType.LAPLACE),
    "laplace_p": KernelDescriptor(_D.DIFF, _I.POW, _I.POW, KernelType.LAPLACE),
    "gaussian_l2": KernelDescriptor(_D.DIFF, _I.SQUARE, _I.SQRT, KernelType.GAUSSIAN),
    "dot": KernelDescriptor(_D.DOT, _I.NOOP, _I.NOOP, KernelType.NONE),
})
del _D, _I
# Error model. DIFF descriptors depend on x - y alone: every path is accurate relative to the
# data's centred scale whatever its offset (the product-formula paths shift the data by a
# reference point: kermac_like/centring.py). DOT (<x, y>) is not translation invariant: its
# float32 sums (3xTF32 on tensor cores) are within about K 2^-23 |x| |y| of the exact dot
# product, relative to the norms from the origin, so nearly orthogonal rows far from the origin
# lose relative accuracy as any float32 matrix product does.


def preset(name: str) -> KernelDescriptor:
    """The preset descriptor called ``name`` (see ``PRESETS``).

    >>> import kermac_like as km
    >>> km.preset("gaussian_l2")
    KernelDescriptor(DIFF, SQUARE, SQRT, GAUSSIAN)
    >>> sorted(km.PRESETS)[:4]
    ['dot', 'gaussian_l2', 'l1', 'l2']
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"name: unknown preset {name!r} (valid: {', '.join(PRESETS)})") from None
