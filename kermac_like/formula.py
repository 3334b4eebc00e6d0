"""Kernels beyond the fused menu: built-in kernels and user-written kernel expressions, as
descriptors.

A :class:`FormulaDescriptor` is a :class:`~kermac_like.descriptor.KernelDescriptor` (immutable,
hashable, accepted wherever a descriptor is) that says what is computed for a pair of rows::

    r   = sum_k inner(x_k - y_k)   (or inner(x_k, y_k))   an inner term of its own, or
    r   = the base fields' value: |x - y|_p, |x - y|^2 or <x, y>
    out = epilogue(r; bandwidth, alpha, q, period, c, ... named hyper-parameters)

Built-in kernels (functions of this module, re-exported by the package)::

    matern(nu=1.5 | 2.5)              (1 + s) e^-s, (1 + s + s^2/3) e^-s,  s = sqrt(2 nu) |x - y| / h
    rational_quadratic(alpha=None)    (1 + |x - y|^2 / (2 alpha h^2))^-alpha
    powered_exponential(q=None, p=2)  exp(-(|x - y|_p / h)^q), 0 < q <= 2, any p > 0
    cauchy()                          1 / (1 + |x - y|^2 / h^2)
    inverse_multiquadric()            1 / sqrt(1 + |x - y|^2 / h^2)
    additive(profile="laplace" | "powered_exponential", q=None)
                                      sum_k exp(-|x_k - y_k| / h)  or  sum_k exp(-(|x_k - y_k| / h)^q)
    periodic(period=None)             exp(-2 sum_k sin^2(pi |x_k - y_k| / P) / h^2)
    polynomial(degree, c=1.0)         (<x, y> + c)^degree  (a DOT descriptor)
    kernel_expression(epilogue, inner="(x - y)**2", params=...)   user-written (SymPy-parsed)

h is run_kernel's ``bandwidth``; the other hyper-parameters are keyword arguments of the ops
(``run_kernel(desc, x, y, bandwidth=1.0, alpha=0.5)``), floats or tensors over batch modes like
``bandwidth``; a value given to the constructor is the default. Out of range (alpha <= 0, q outside
(0, 2], period <= 0, bandwidth <= 0; degree not a positive integer): ValueError/TypeError naming
the argument, at construction or at the call.

Kernels of the l2 distance (Matérn 3/2 and 5/2, rational quadratic, Cauchy, inverse multiquadric,
powered exponential of p = 2, user expressions of the squared distance with at most three
hyper-parameters) run on a GPU (sm_80+, float32 / 16-bit data) through the fused templates, which
take the kernel as an epilogue functor (cuda_templates/epilogue.cuh; a user's formula rendered by
SymPy's C printer, kermac_like/runtime/specs/epilogue.py): kernel_matvec (the SIMT kernel, forward
and the gradients for x, y and v), run_kernel (the exact low-K kernel up to K = 64, the tensor-core
distance kernels beyond) and kernel_logsumexp of a positive kernel (without gradients), where the setting
formula_fused is on (the default). Everything else (the other kernels, float64, the CPU, epsilon cuts,
gradients of hyper-parameters, kernel_topk) takes the torch path (kermac_like/formula_path.py), on any device, in blocks of
bounded memory; :attr:`FormulaDescriptor.fused_ok` stays False (no op schema carries a formula).
``matern(0.5)`` is the fused ``laplace_l2`` preset itself. Identity: the canonical form
(:meth:`FormulaDescriptor.canonical`) of the kernel's formulas and hyper-parameters; a rendered
functor is named by the sha256 of it and of its text, so that the cache key follows both.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, field

import torch

from . import expression
from .descriptor import PRESETS, InnerOperator, KernelDescriptor, KernelType, PowerType, _coerce

__all__ = ["FormulaDescriptor", "matern", "rational_quadratic", "powered_exponential", "cauchy",
           "inverse_multiquadric", "additive", "periodic", "polynomial", "kernel_expression", "RESERVED_NAMES"]

# Keyword arguments of the ops: not available as hyper-parameter names.
RESERVED_NAMES = frozenset({
    "out", "p", "inner_p", "outer_p", "regularization", "regularization_offset_x", "regularization_offset_y",
    "epsilon", "compute_mode", "autotune", "debug", "descriptor", "a", "b", "x", "y", "v", "k", "largest",
    "log_weights", "t", "r", "pi", "params", "positive", "inner", "epilogue", "name", *expression.ALLOWED_FUNCTIONS})

# Range of the built-in hyper-parameters (floats are checked; tensors are not inspected, as bandwidth).
_RANGES = {
    "bandwidth": ("> 0", lambda v: v > 0),
    "alpha": ("> 0", lambda v: v > 0),
    "q": ("in (0, 2]", lambda v: 0 < v <= 2),
    "period": ("> 0", lambda v: v > 0),
}

# The built-in families: (inner term in t, epilogue in r) as formulas of the grammar (their C++ and
# derivatives come from expression.py; their torch forms are below), the parameters, positivity.
_BUILTINS = {
    "matern32": ("", "(1 + sqrt(3)*r/bandwidth)*exp(-sqrt(3)*r/bandwidth)", ("bandwidth",)),
    "matern52": ("", "(1 + sqrt(5)*r/bandwidth + 5*r**2/(3*bandwidth**2))*exp(-sqrt(5)*r/bandwidth)",
                 ("bandwidth",)),
    "rational_quadratic": ("", "(1 + r/(2*alpha*bandwidth**2))**(-alpha)", ("alpha", "bandwidth")),
    "powered_exponential": ("", "exp(-(r/bandwidth)**q)", ("bandwidth", "q")),
    "cauchy": ("", "1/(1 + r/bandwidth**2)", ("bandwidth",)),
    "inverse_multiquadric": ("", "1/sqrt(1 + r/bandwidth**2)", ("bandwidth",)),
    "additive_laplace": ("exp(-abs(t)/bandwidth)", "r", ("bandwidth",)),
    "additive_powered_exponential": ("exp(-(abs(t)/bandwidth)**q)", "r", ("bandwidth", "q")),
    "periodic": ("sin(pi*t/period)**2", "exp(-2*r/bandwidth**2)", ("bandwidth", "period")),
    "polynomial": ("", "(r + c)**{degree}", ("c",)),
}
_NOT_POSITIVE = ("polynomial",)


@dataclass(frozen=True, repr=False)
class FormulaDescriptor(KernelDescriptor):
    """A kernel beyond the descriptor's enums: a built-in family or a user-written expression
    (see the module docstring). Build it with the module's functions, not directly.

    The base fields say how ``r`` is reduced when the kernel has no inner term of its own
    (``inner == ""``): DIFF SQUARE NOOP (|x - y|^2), DIFF SQUARE SQRT (|x - y|), DIFF ABS NOOP
    (|x - y|_1), DIFF POW POW (|x - y|_p, ``norm_p``), DOT (<x, y>). With an inner term they are
    DIFF NOOP NOOP (an inner term in x - y: translation invariant) or DOT NOOP NOOP (in x and y).

    >>> import kermac_like as km
    >>> d = km.rational_quadratic(alpha=2.0)
    >>> d.fused_ok, d.param_names, d.positive
    (False, ('alpha', 'bandwidth'), True)
    >>> d == km.rational_quadratic(alpha=2.0), d == km.rational_quadratic(alpha=1.0)
    (True, False)
    >>> d.cuda_source()["epilogue"]
    'powf(1 + (1.0F/2.0F)*r/(alpha*powf(bandwidth, 2)), -alpha)'
    """

    family: str = "expression"
    inner: str = ""  # the inner term in t = x_k - y_k (or x, y); "": the base fields' sum
    epilogue: str = "r"  # the epilogue in r and the parameters
    params: tuple = ()  # ((name, default float or None), ...), sorted by name
    norm_p: float = 0.0  # p of a DIFF POW POW base (fixed by the descriptor), else 0
    degree: int = 0  # the polynomial's
    positive: bool = True  # values > 0 for every pair (kernel_logsumexp takes only these)
    source: tuple = field(default=(), compare=False)  # the texts as written (positions in errors)
    # Internal: the kernel's derivative dk/d(r2) in place of k (the fused backward's kernel: its
    # epilogue functor's dk_dr2, cuda_templates/epilogue.cuh); never built by the public functions.
    derivative: bool = False

    def __post_init__(self):
        object.__setattr__(self, "inner_operator", _coerce(self.inner_operator, InnerOperator, "inner_operator"))
        object.__setattr__(self, "inner_power", _coerce(self.inner_power, PowerType, "inner_power"))
        object.__setattr__(self, "outer_power", _coerce(self.outer_power, PowerType, "outer_power"))
        object.__setattr__(self, "kernel_type", _coerce(self.kernel_type, KernelType, "kernel_type"))
        if self.kernel_type is not KernelType.NONE:
            raise ValueError("kernel_type: a formula's epilogue replaces the kernel type (NONE)")

    # -- what the descriptor needs at call time ---------------------------------
    @property
    def fused_ok(self) -> bool:
        """False: no op schema carries a formula kernel (the rules serve those an epilogue functor
        serves on the fused kernels themselves: kermac_like/runtime/specs/epilogue.py)."""
        return False

    @property
    def needs_inner_p(self) -> bool:
        return False  # a p-norm's p is the descriptor's own (norm_p)

    @property
    def needs_outer_p(self) -> bool:
        return False

    @property
    def needs_bandwidth(self) -> bool:
        return any(n == "bandwidth" for n, _ in self.params)

    @property
    def param_names(self) -> tuple:
        return tuple(n for n, _ in self.params)

    @property
    def is_euclidean(self) -> bool:
        return False  # no tensor-core path: not a fused kernel

    @property
    def has_inner(self) -> bool:
        """The kernel sums an inner term of its own (additive, periodic, user-written inner)."""
        return bool(self.inner)

    @property
    def shift_invariant(self) -> bool:
        return self.inner_operator is InnerOperator.DIFF

    def canonical(self) -> str:
        """The canonical form: family, inner term, epilogue, base, p, degree, parameters and
        their defaults. Equal kernels (the same formulas up to SymPy's canonicalisation) have
        the same form."""
        params = ",".join(f"{n}={'' if d is None else repr(float(d))}" for n, d in self.params)
        return (f"{self.family}|inner={self.inner}|epilogue={self.epilogue}|base={self.inner_operator.name},"
                f"{self.inner_power.name},{self.outer_power.name}|p={self.norm_p!r}|degree={self.degree}|"
                f"params={params}" + ("|derivative=dk/dr2" if self.derivative else ""))

    def key(self) -> str:
        """sha256 of :meth:`canonical` (full, never truncated)."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def cpp_args(self) -> str:
        """The C++ template arguments of a fused instantiation: the base fields and the formula's
        functor, named by the full hash of the canonical form."""
        return ", ".join((self.inner_operator.cpp, self.inner_power.cpp, self.outer_power.cpp,
                          f"kermac_like::formula::F{self.key()}"))

    def short_name(self) -> str:
        return f"formula-{self.family}-{self.key()[:16]}"

    def __repr__(self) -> str:
        if self.family != "expression":
            extra = {"powered_exponential": f", p={self.norm_p:g}" if self.norm_p else "",
                     "polynomial": f", degree={self.degree}"}.get(self.family, "")
            defaults = "".join(f", {n}={d:g}" for n, d in self.params if d is not None)
            return f"FormulaDescriptor({self.family}{extra}{defaults})"
        inner = self.inner or {(InnerOperator.DOT, PowerType.NOOP): "x*y", (InnerOperator.DIFF, PowerType.ABS): "abs(t)"
                               }.get((self.inner_operator, self.inner_power), "t**2")
        root = ", sqrt" if self.outer_power is PowerType.SQRT else ""
        return f"FormulaDescriptor(inner={inner!r}{root}, epilogue={self.epilogue!r}, params={dict(self.params)})"

    # -- the formulas as SymPy expressions (SymPy imported here) ---------------------------
    def sympy_inner(self):
        """The inner term as a SymPy expression (in t, or x and y); None without one."""
        if not self.inner:
            return None
        return expression.parse(self.inner, expression.VARIABLES["inner"], self.param_names, "inner")

    def sympy_epilogue(self):
        return expression.parse(self.epilogue, expression.VARIABLES["epilogue"], self.param_names, "epilogue")

    def cuda_source(self, *, double: bool = False) -> dict:
        """{"inner": C++ expression or None, "epilogue": C++ expression} (SymPy's C printer)."""
        inner = self.sympy_inner()
        return {"inner": None if inner is None else expression.cuda_source(inner, double=double),
                "epilogue": expression.cuda_source(self.sympy_epilogue(), double=double)}

    def derivatives(self) -> dict:
        """The symbolic derivatives (SymPy expressions): {"epilogue/r", "epilogue/<param>", and with an
        inner term "inner/t" (or "inner/x", "inner/y") and "inner/<param>"}."""
        epi = self.sympy_epilogue()
        out = {f"epilogue/{n}": expression.derivative(epi, n) for n in ("r", *self.param_names)}
        inner = self.sympy_inner()
        if inner is not None:
            for n in ("t", "x", "y", *self.param_names):
                if any(str(s) == n for s in inner.free_symbols):
                    out[f"inner/{n}"] = expression.derivative(inner, n)
        return out


# -- hyper-parameters ----------------------------------------------------------------------
def _check_value(name: str, value, *, allow_none: bool = True):
    """A constructor's default: None, or a real number in range (ValueError/TypeError naming it)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {v}")
    rng = _RANGES.get(name)
    if rng is not None and not rng[1](v):
        raise ValueError(f"{name}: must be {rng[0]}, got {v:g}")
    return v


def check_params(desc: FormulaDescriptor, given: dict, device: torch.device) -> dict:
    """The values of ``desc``'s hyper-parameters for one call: ``given`` (keyword arguments of the
    op: floats or floating tensors over batch modes on ``device``), else the descriptor's
    defaults. An unknown name: TypeError naming it; a missing value: ValueError naming it (and its
    position in the expression); a float out of range: ValueError naming it."""
    names = desc.param_names
    for name in given:
        if name not in names:
            valid = ", ".join(names) or "none"
            raise TypeError(f"{name}: not a hyper-parameter of {desc!r} (its hyper-parameters: {valid})")
    out = {}
    for name, default in desc.params:
        v = given.get(name)
        if v is None:
            v = default
        if v is None:
            raise ValueError(f"{name}: {desc!r} needs a value for {name}{_position(desc, name)}")
        if isinstance(v, torch.Tensor):
            if not v.is_floating_point():
                raise TypeError(f"{name}: expected a floating tensor, got {v.dtype}")
            if v.device != device:
                raise ValueError(f"{name}: tensor is on {v.device}, the data is on {device}")
        else:
            v = _check_value(name, v, allow_none=False)
        out[name] = v
    return out


def _position(desc: FormulaDescriptor, name: str) -> str:
    for part, text in zip(("inner", "epilogue"), desc.source or (desc.inner, desc.epilogue)):
        if text:
            pos = expression.position_of(text, name)
            if pos >= 0:
                return f" (used at position {pos} of the {part} {text!r})"
    return ""


# -- the built-in kernels ------------------------------------------------------------------------
_L2 = (InnerOperator.DIFF, PowerType.SQUARE, PowerType.SQRT)
_SQ = (InnerOperator.DIFF, PowerType.SQUARE, PowerType.NOOP)


def _builtin(family: str, base: tuple, defaults: dict, **fields) -> FormulaDescriptor:
    inner, epilogue, names = _BUILTINS[family]
    params = tuple(sorted((n, _check_value(n, defaults.get(n))) for n in names))
    return FormulaDescriptor(*base, KernelType.NONE, family=family, inner=inner,
                             epilogue=epilogue.format(degree=fields.get("degree", 0)), params=params,
                             positive=family not in _NOT_POSITIVE, **fields)


def matern(nu: float = 2.5, *, bandwidth=None) -> KernelDescriptor:
    """The Matérn kernel of smoothness ``nu`` (1/2, 3/2 or 5/2) of the l2 distance scaled by the
    bandwidth h: nu = 1/2 exp(-d/h) (the fused ``laplace_l2`` preset), nu = 3/2
    (1 + sqrt(3) d/h) exp(-sqrt(3) d/h), nu = 5/2 (1 + sqrt(5) d/h + 5 d^2/(3 h^2)) exp(-sqrt(5) d/h).

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0], [1.0]])
    >>> km.run_kernel(km.matern(2.5), x, x, bandwidth=1.0)
    tensor([[1.0000, 0.5240],
            [0.5240, 1.0000]])
    """
    if isinstance(nu, bool) or not isinstance(nu, numbers.Real):
        raise TypeError(f"nu: expected 0.5, 1.5 or 2.5, got {type(nu).__name__}")
    if nu == 0.5:
        if bandwidth is not None:
            raise ValueError("bandwidth: matern(0.5) is the fused laplace_l2 preset; pass bandwidth to the op")
        return PRESETS["laplace_l2"]
    if nu not in (1.5, 2.5):
        raise ValueError(f"nu: expected 0.5, 1.5 or 2.5, got {nu!r}")
    return _builtin("matern32" if nu == 1.5 else "matern52", _L2, {"bandwidth": bandwidth})


def rational_quadratic(alpha=None, *, bandwidth=None) -> FormulaDescriptor:
    """(1 + |x - y|^2 / (2 alpha h^2))^-alpha, alpha > 0 (given here as the default, or to the op).

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0], [2.0]])
    >>> km.run_kernel(km.rational_quadratic(), x, x, bandwidth=1.0, alpha=0.5)
    tensor([[1.0000, 0.4472],
            [0.4472, 1.0000]])
    """
    return _builtin("rational_quadratic", _SQ, {"alpha": alpha, "bandwidth": bandwidth})


def powered_exponential(q=None, *, p: float = 2.0, bandwidth=None) -> FormulaDescriptor:
    """exp(-(|x - y|_p / h)^q) for 0 < q <= 2 over the p-norm distance (any p > 0; xRFM's "lpq").

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    >>> km.run_kernel(km.powered_exponential(1.5, p=1.0), x, x, bandwidth=2.0)    # exp(-(2/2)^1.5)
    tensor([[1.0000, 0.3679],
            [0.3679, 1.0000]])
    """
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p: expected a real number > 0, got {type(p).__name__}")
    p = float(p)
    if not (p > 0 and math.isfinite(p)):
        raise ValueError(f"p: must be > 0 and finite, got {p:g}")
    if p == 1.0:
        base, norm_p = (InnerOperator.DIFF, PowerType.ABS, PowerType.NOOP), 0.0
    elif p == 2.0:
        base, norm_p = _L2, 0.0
    else:
        base, norm_p = (InnerOperator.DIFF, PowerType.POW, PowerType.POW), p
    return _builtin("powered_exponential", base, {"q": q, "bandwidth": bandwidth}, norm_p=norm_p)


def cauchy(*, bandwidth=None) -> FormulaDescriptor:
    """The Cauchy kernel 1 / (1 + |x - y|^2 / h^2).

    >>> import torch, kermac_like as km
    >>> km.run_kernel(km.cauchy(), torch.tensor([[0.0], [2.0]]), torch.tensor([[0.0]]), bandwidth=2.0)
    tensor([[1.0000],
            [0.5000]])
    """
    return _builtin("cauchy", _SQ, {"bandwidth": bandwidth})


def inverse_multiquadric(*, bandwidth=None) -> FormulaDescriptor:
    """The inverse multiquadric 1 / sqrt(1 + |x - y|^2 / h^2).

    >>> import torch, kermac_like as km
    >>> km.run_kernel(km.inverse_multiquadric(), torch.tensor([[0.0], [3.0]]), torch.tensor([[0.0]]), bandwidth=1.0)
    tensor([[1.0000],
            [0.3162]])
    """
    return _builtin("inverse_multiquadric", _SQ, {"bandwidth": bandwidth})


def additive(profile: str = "laplace", *, q=None, bandwidth=None) -> FormulaDescriptor:
    """The additive kernel sum_k kappa(|x_k - y_k|) with the profile kappa(t) = exp(-t/h)
    ("laplace") or exp(-(t/h)^q) ("powered_exponential", 0 < q <= 2); not normalised by K.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    >>> km.run_kernel(km.additive(), x, x, bandwidth=1.0)          # e^0 + e^-1, e^0 + e^0
    tensor([[2.0000, 1.3679],
            [1.3679, 2.0000]])
    """
    if profile == "laplace":
        if q is not None:
            raise ValueError("q: the laplace profile takes no q (use profile='powered_exponential')")
        return _builtin("additive_laplace", (InnerOperator.DIFF, PowerType.NOOP, PowerType.NOOP),
                        {"bandwidth": bandwidth})
    if profile == "powered_exponential":
        return _builtin("additive_powered_exponential", (InnerOperator.DIFF, PowerType.NOOP, PowerType.NOOP),
                        {"q": q, "bandwidth": bandwidth})
    raise ValueError(f"profile: expected 'laplace' or 'powered_exponential', got {profile!r}")


def periodic(period=None, *, bandwidth=None) -> FormulaDescriptor:
    """The periodic kernel exp(-2 sum_k sin^2(pi |x_k - y_k| / P) / h^2), P > 0.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[0.0], [0.5], [1.0]])
    >>> km.run_kernel(km.periodic(1.0), x, x, bandwidth=1.0)[0]     # period 1: x = 1 is x = 0 again
    tensor([1.0000, 0.1353, 1.0000])
    """
    return _builtin("periodic", (InnerOperator.DIFF, PowerType.NOOP, PowerType.NOOP),
                    {"period": period, "bandwidth": bandwidth})


def polynomial(degree: int, *, c=1.0) -> FormulaDescriptor:
    """The polynomial kernel (<x, y> + c)^degree (a DOT descriptor; not positive: kernel_logsumexp
    refuses it), degree a positive integer.

    Error model (DOT descriptors are not translation invariant): the float32 sum s = <x, y> + c
    errs by about K 2^-24 (sum_k |x_k y_k| + |c|), so a value errs by degree |s|^(degree-1) times
    that, relative to the terms' scale (sum_k |x_k y_k| + |c|)^degree, not to the value: where
    <x, y> nearly cancels c the value's relative error grows without bound.

    >>> import torch, kermac_like as km
    >>> x = torch.tensor([[1.0, 2.0]])
    >>> km.run_kernel(km.polynomial(2), x, x)                       # (5 + 1)^2
    tensor([[36.]])
    """
    if isinstance(degree, bool) or not isinstance(degree, numbers.Integral):
        raise TypeError(f"degree: expected a positive integer, got {type(degree).__name__}")
    if degree < 1:
        raise ValueError(f"degree: must be a positive integer, got {degree}")
    return _builtin("polynomial", (InnerOperator.DOT, PowerType.NOOP, PowerType.NOOP), {"c": c},
                    degree=int(degree))


# -- user-written kernels ---------------------------------------------------------------------
def kernel_expression(epilogue: str, *, inner: str = "(x - y)**2", params=(), positive: bool | None = None
                      ) -> FormulaDescriptor:
    """A kernel written as two formulas (SymPy-parsed; ``pip install kermac_like[expressions]``):

    * ``inner``: the term of one coordinate pair, summed over the coordinates into ``r``: in
      ``t`` (= x_k - y_k) or ``x`` and ``y`` (= x_k, y_k); default ``"(x - y)**2"`` (r is the
      squared l2 distance). ``"abs(x - y)"`` (l1) and ``"x*y"`` (dot product) are recognised too:
      those three take the package's distance and matrix-product paths; any other term is summed
      by direct differences. A term in x - y alone (also written with x and y) is translation
      invariant.
    * ``epilogue``: the kernel value in ``r`` and the parameters, e.g.
      ``"(1 + sqrt(5*r) + 5*r/3) * exp(-sqrt(5*r))"`` (Matérn 5/2 of the squared distance).
    * ``params``: the hyper-parameters' names, a sequence (no defaults) or a mapping name ->
      default (a float, or None for none); the ops take their values as keyword arguments, floats
      or tensors over batch modes. ``bandwidth`` is the ops' bandwidth argument. Names: Python
      identifiers other than the variables, the functions, ``pi`` and the ops' own arguments.
    * ``positive``: whether the kernel's values are > 0 (kernel_logsumexp takes only those);
      None: as SymPy proves it of the epilogue for r >= 0 and positive parameters.

    Grammar: numbers, names, + - * / ** ^, parentheses, exp log sqrt abs sin cos min max,
    where(cond, a, b) with comparisons < <= > >=, pi (kermac_like/expression.py). A formula outside
    it, an undeclared name, a declared parameter it does not use: ValueError naming it and its
    position. The descriptor is canonical: formulas SymPy writes alike (``"r*2"``, ``"2*r"``) give
    equal descriptors with equal hashes.

    >>> import torch, kermac_like as km
    >>> d = km.kernel_expression("exp(-r / (2*ell**2))", params={"ell": 1.0})    # the Gaussian
    >>> x = torch.tensor([[0.0], [1.0]])
    >>> km.run_kernel(d, x, x)
    tensor([[1.0000, 0.6065],
            [0.6065, 1.0000]])
    >>> km.run_kernel(d, x, x, ell=2.0)[0, 1]
    tensor(0.8825)
    """
    if isinstance(params, dict):
        declared = {n: v for n, v in params.items()}
    elif isinstance(params, (list, tuple)):
        declared = {n: None for n in params}
    else:
        raise TypeError(f"params: expected a sequence of names or a mapping name -> default, got "
                        f"{type(params).__name__}")
    for n in declared:
        if not isinstance(n, str) or not n.isidentifier():
            raise ValueError(f"params: {n!r} is not a name")
        if n in RESERVED_NAMES or n in expression.VARIABLES["inner"] + expression.VARIABLES["epilogue"]:
            raise ValueError(f"params: {n!r} is reserved (a variable, a function or an argument of the ops)")
    defaults = {n: _check_value(n, v) for n, v in declared.items()}
    if not isinstance(inner, str):
        raise TypeError(f"inner: expected a str expression, got {type(inner).__name__}")
    sympy = expression.sympy_module()
    names = tuple(declared)
    inner_expr = expression.parse(inner, expression.VARIABLES["inner"], names, "inner")
    epi_expr = expression.parse(epilogue, expression.VARIABLES["epilogue"], names, "epilogue")
    inner_vars = {str(s) for s in inner_expr.free_symbols}
    used = inner_vars | {str(s) for s in epi_expr.free_symbols}
    for n in names:
        if n not in used:
            raise ValueError(f"params: {n!r} is declared but used in neither expression")
    t, x, y = (sympy.Symbol(n, real=True) for n in ("t", "x", "y"))
    if "t" in inner_vars and inner_vars & {"x", "y"}:
        inner_expr = inner_expr.xreplace({t: x - y})
    base, inner_text = _base_of(inner_expr, sympy, t, x, y)
    if positive is None:
        positive = expression.is_positive(epi_expr, "r")
    elif not isinstance(positive, bool):
        raise TypeError(f"positive: expected a bool or None, got {type(positive).__name__}")
    return FormulaDescriptor(*base, KernelType.NONE, family="expression", inner=inner_text,
                             epilogue=expression.canonical_text(epi_expr), params=tuple(sorted(defaults.items())),
                             positive=positive, source=(inner, epilogue))


def _base_of(e, sympy, t, x, y) -> tuple:
    """(base fields, canonical inner text or "" where the base fields sum it) of an inner term."""
    in_t = e.xreplace({x: y + t}) if e.has(x) or e.has(y) else e
    if not in_t.has(y):  # a function of the difference: canonical in t
        in_t = sympy.expand(in_t) if in_t.is_polynomial(t) else in_t
        if sympy.expand(in_t - t ** 2) == 0:
            return _SQ, ""
        if (in_t - sympy.Abs(t)) == 0:
            return (InnerOperator.DIFF, PowerType.ABS, PowerType.NOOP), ""
        return (InnerOperator.DIFF, PowerType.NOOP, PowerType.NOOP), expression.canonical_text(in_t)
    if sympy.expand(e - x * y) == 0:
        return (InnerOperator.DOT, PowerType.NOOP, PowerType.NOOP), ""
    return (InnerOperator.DOT, PowerType.NOOP, PowerType.NOOP), expression.canonical_text(e)
