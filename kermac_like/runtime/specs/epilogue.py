"""Epilogue functors (cuda_templates/epilogue.cuh) of the formula kernels: which functor serves a
:class:`~kermac_like.formula.FormulaDescriptor`, where its hyper-parameters travel, and the
rendered functor struct of a user expression.

A mainloop that sums (x_k - y_k)^2 (the matvec template's direct and expanded forms, the l2
tensor-core paths) serves every kernel whose value is a function of the l2 distance: the built-in
families as functors of the header (:data:`BUILTIN`), a user expression (``kernel_expression``
over the squared distance) as a tiny struct rendered here by SymPy's C printer into the
instantiation stub (:func:`functor`; the kernel bodies stay in the headers). The struct is named
``kermac_like::formula::F<sha256 of the canonical form and of RENDERER>``, so the name expression,
and with it the cache key, changes with the formula, its hyper-parameter names, and this renderer.

Hyper-parameters: the flat ABI's bandwidth, inner_p and outer_p slots (a formula's base fields use
no p) carry the functor's p0, p1, p2: the bandwidth first where the kernel has one, then the
others in name order (:func:`slot_names`); each a float or a tensor over the batch modes, as the
bandwidth always was.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from dataclasses import replace

from ... import expression
from ...descriptor import InnerOperator, PowerType
from ...formula import FormulaDescriptor

__all__ = ["BUILTIN", "RENDERER", "SLOTS", "served", "slot_names", "slot_hypers", "functor", "render",
           "has_exponential", "smooth_at_zero", "derivative"]

# The built-in families' functors (epilogue.cuh), by FormulaDescriptor.family.
BUILTIN = {
    "matern32": "kermac_like::epilogue::Matern32",
    "matern52": "kermac_like::epilogue::Matern52",
    "rational_quadratic": "kermac_like::epilogue::RationalQuadratic",
    "cauchy": "kermac_like::epilogue::Cauchy",
    "inverse_multiquadric": "kermac_like::epilogue::InverseMultiquadric",
    "powered_exponential": "kermac_like::epilogue::PoweredExponential",
}
# Functors without an exponential (kFma changes nothing: no pair takes the FMA-pipe exp2).
_NO_EXP = ("cauchy", "inverse_multiquadric")
# The ABI slots of p0, p1, p2.
SLOTS = ("bandwidth", "inner_p", "outer_p")
# The renderer's version: part of a rendered functor's name (and so of its cache key).
RENDERER = "epilogue-functor-1"

# SymPy's single-precision C functions -> the rendered functors' helpers (epilogue.cuh, namespace
# kermac_like::formula); pi and e as float literals (M_PI and M_E are double, and undefined in NVRTC).
_FUNCTIONS = {"expf": "kl_exp", "logf": "kl_log", "sqrtf": "kl_sqrt", "powf": "kl_pow"}
_CONSTANTS = {name: f"{value!r}F" for name, value in (
    ("M_E", math.e), ("M_LOG2E", 1 / math.log(2)), ("M_LOG10E", 1 / math.log(10)), ("M_LN2", math.log(2)),
    ("M_LN10", math.log(10)), ("M_PI", math.pi), ("M_PI_2", math.pi / 2), ("M_PI_4", math.pi / 4),
    ("M_1_PI", 1 / math.pi), ("M_2_PI", 2 / math.pi), ("M_2_SQRTPI", 2 / math.sqrt(math.pi)),
    ("M_SQRT2", math.sqrt(2)), ("M_SQRT1_2", math.sqrt(0.5)))}


def _l2_base(desc) -> bool:
    return (desc.inner_operator is InnerOperator.DIFF and desc.inner_power is PowerType.SQUARE
            and desc.outer_power in (PowerType.NOOP, PowerType.SQRT))


def served(desc) -> bool:
    """Whether an epilogue functor serves ``desc``: a formula kernel of the l2 distance (no inner
    term of its own, the base DIFF SQUARE NOOP or SQRT; powered_exponential of p = 2) that is a
    built-in family of :data:`BUILTIN` or a user expression, with at most three hyper-parameters."""
    if not isinstance(desc, FormulaDescriptor) or desc.has_inner or not _l2_base(desc):
        return False
    if len(desc.params) > len(SLOTS):
        return False
    return desc.family in BUILTIN or desc.family == "expression"


@functools.lru_cache(maxsize=256)
def smooth_at_zero(desc) -> bool:
    """Whether dk/d(r2) is finite as the distance goes to 0 (for positive hyper-parameters): then
    the expanded form's rounding of r2 near 0 (eps times the centred norms, not times r2) moves k by
    as little; a cusp at 0 (powered exponential with q < 2, a user's exp(-sqrt(r))) needs the direct
    form's exact differences. User expressions: SymPy's one-sided limit (~0.05 s, once a descriptor)."""
    if desc.derivative:  # (its own derivative may have a cusp: Matérn 3/2's e^-t; the direct form always)
        return False
    if desc.family in BUILTIN:
        return desc.family != "powered_exponential"
    sympy = expression.sympy_module()
    e = desc.sympy_epilogue()
    rp = sympy.Symbol("kl_r", positive=True)
    subs = {s: (rp if str(s) == "r" else sympy.Symbol(str(s), positive=True)) for s in e.free_symbols}
    if not any(str(s) == "r" for s in e.free_symbols):
        return True
    d = sympy.diff(e.xreplace(subs), rp)
    if desc.outer_power is PowerType.SQRT:  # r = sqrt(r2): dk/dr2 = dk/dr / (2 r)
        d = d / (2 * rp)
    try:
        lim = sympy.limit(d, rp, 0, "+")
    except (NotImplementedError, ValueError, TypeError):
        return False
    return bool(lim.is_finite)


def derivative(desc: FormulaDescriptor) -> FormulaDescriptor:
    """The descriptor whose kernel is dk/d(r2) of ``desc`` (internal: the fused backward's products)."""
    return replace(desc, derivative=True)


def has_exponential(desc) -> bool:
    """Whether the functor's value takes an exponential (a pair's kFma choice matters)."""
    if desc.derivative:
        return False
    if desc.family in BUILTIN:
        return desc.family not in _NO_EXP
    return "exp" in desc.epilogue


def slot_names(desc: FormulaDescriptor) -> tuple:
    """The hyper-parameters of p0, p1, p2 in order: bandwidth first where the kernel has one, then
    the others in name order (FormulaDescriptor.params is sorted by name)."""
    names = desc.param_names
    return (("bandwidth",) if "bandwidth" in names else ()) + tuple(n for n in names if n != "bandwidth")


def slot_hypers(desc: FormulaDescriptor, hypers: dict) -> dict:
    """The call's hyper-parameters in the ABI's four slots: {inner_p, outer_p, bandwidth,
    regularization} with the functor's p0, p1, p2 in the bandwidth, inner_p and outer_p slots
    (0.0 where the kernel has fewer)."""
    out = {s: 0.0 for s in SLOTS}
    for slot, name in zip(SLOTS, slot_names(desc)):
        out[slot] = hypers[name]
    out["regularization"] = hypers.get("regularization")
    return {k: out[k] for k in ("inner_p", "outer_p", "bandwidth", "regularization")}


def functor(desc: FormulaDescriptor) -> tuple:
    """(C++ name of the functor, source to put in the stub: "" for a header functor)."""
    if not served(desc):
        raise ValueError(f"descriptor: no epilogue functor serves {desc!r}")
    if desc.derivative:  # dk/d(r2): the kernel's functor wrapped (the fused backward's kernel)
        name, src = functor(replace(desc, derivative=False))
        return f"kermac_like::epilogue::Derivative<{name}>", src
    if desc.family in BUILTIN:
        return BUILTIN[desc.family], ""
    body = _render_body(desc)
    h = hashlib.sha256("\0".join((RENDERER, desc.canonical(), body)).encode()).hexdigest()
    name = f"F{h}"
    src = ("namespace kermac_like {\nnamespace formula {\n"
           f"// {desc.canonical()}\n"
           f"struct {name} {{\n{body}}};\n"
           "}  // namespace formula\n}  // namespace kermac_like\n")
    return f"kermac_like::formula::{name}", src


def render(desc: FormulaDescriptor) -> str:
    """The functor struct of a user expression (:func:`functor`'s source)."""
    return functor(desc)[1]


def _c(expr, fma: str) -> str:
    """A SymPy expression in single-precision C, the functions mapped to the helpers (``fma``: the
    exponential's template argument, "kFma" in value, "false" in the derivative)."""
    sympy = expression.sympy_module()
    from sympy.codegen.ast import float32, real

    code = " ".join(sympy.ccode(expr, type_aliases={real: float32}, allow_unknown_functions=True).split())
    code = re.sub(r"\bkl_exp2\(", f"kl_exp2<{fma}>(", code)
    for f, g in _FUNCTIONS.items():
        code = re.sub(rf"\b{f}\(", f"{g}<{fma}>(" if f == "expf" else f"{g}(", code)
    for c, v in _CONSTANTS.items():
        code = re.sub(rf"\b{c}\b", v, code)
    left = re.search(r"\bM_[A-Z0-9_]+\b", code)
    if left:  # (a double constant of math.h the table lacks: NVRTC defines none of them)
        raise ValueError(f"epilogue functor: no float value for {left.group(0)} in {code}")
    return code


def _hoist(e, r, table: dict, sympy):
    """``e`` with every maximal subexpression free of ``r`` (the parameters' and the constants': 1/h,
    sqrt(5)/h, h**-2) replaced by a symbol kl_a.c<i> of ``table`` (expression -> symbol), computed
    once per batch entry in args(): a pair evaluates only what depends on r (no division, no power of
    a parameter per pair). Numbers stay (SymPy's printer writes them as float literals)."""
    if r not in e.free_symbols and isinstance(e, sympy.Expr):
        if e.is_Number:
            return e
        if e not in table:
            table[e] = sympy.Symbol(f"kl_c{len(table)}", real=True)
        return table[e]
    if isinstance(e, (sympy.Add, sympy.Mul)) and r in e.free_symbols:
        free = [a for a in e.args if r not in a.free_symbols]
        dep = [_hoist(a, r, table, sympy) for a in e.args if r in a.free_symbols]
        if free:
            dep.append(_hoist(e.func(*free), r, table, sympy))
        return e.func(*dep)
    if not e.args:
        return e
    return e.func(*(_hoist(a, r, table, sympy) if hasattr(a, "free_symbols") else a for a in e.args))


def _statements(e, fma: str, sympy) -> str:
    """``e`` as C statements: common subexpressions once (SymPy's cse; the helpers' MUFU forms are
    inline asm, which the compiler does not merge), then the value."""
    subs, (reduced,) = sympy.cse([e], symbols=sympy.numbered_symbols("kl_t"))
    lines = [f"    const float {s} = {_c(v, fma)};\n" for s, v in subs]
    return "".join(lines) + f"    return {_c(reduced, fma)};\n"


def dk_dr2_expression(epi, r, sqrt_base: bool):
    """dk/d(r2) of the epilogue ``epi`` in ``r`` (SymPy): dk/dr for a squared-distance base, dk/dr / (2 r)
    for an l2 base, its terms expanded and cancelled symbolically. SymPy's derivative of a kernel flat at
    0 is a difference of terms that cancel exactly (Matérn 5/2 of r2: sqrt(5)/(2 sqrt(r2)) e^-t twice,
    opposite signs), which float32 leaves as rounding noise over a near-zero sqrt(r2): a NaN in the fused
    backward on near-duplicate pairs (H200, session 21); cancelled, -(5/6) (1 + sqrt(5 r2)) e^-t."""
    sympy = expression.sympy_module()
    d = sympy.diff(epi, r) / (2 * r if sqrt_base else 1)
    try:
        return sympy.cancel(sympy.expand(d))
    except (sympy.PolynomialError, TypeError, ValueError):
        return d


def _render_body(desc: FormulaDescriptor) -> str:
    """The members of a user expression's functor: args() (the parameters p0, p1, p2 and every
    subexpression free of r, once per batch entry), value(z) and dk_dr2(z) with r = z (the squared
    distance) or sqrt(z) (an l2 base)."""
    sympy = expression.sympy_module()
    epi = desc.sympy_epilogue()
    subs = {}
    for i, name in enumerate(slot_names(desc)):
        for s_ in epi.free_symbols:
            if str(s_) == name:
                subs[s_] = sympy.Symbol(f"kl_p{i}", real=True)
    r = next((s_ for s_ in epi.free_symbols if str(s_) == "r"), sympy.Symbol("r", real=True))
    kr = sympy.Symbol("kl_r", real=True)
    subs[r] = kr
    sqrt_base = desc.outer_power is PowerType.SQRT
    value = epi.xreplace(subs)
    dvalue = dk_dr2_expression(epi, r, sqrt_base)
    if sqrt_base:  # 0 at r = 0: the value is flat there or the torch path takes 0
        dvalue = sympy.Piecewise((dvalue.xreplace(subs), kr > 0), (0, True))
    else:
        dvalue = dvalue.xreplace(subs)
    # e^a as 2^(a log2 e): the factor joins a's hoisted constant (no multiply per pair)
    exp2 = sympy.Function("kl_exp2")
    value, dvalue = (t.replace(sympy.exp, lambda a: exp2(a / sympy.log(2))) for t in (value, dvalue))
    table: dict = {}
    value, dvalue = _hoist(value, kr, table, sympy), _hoist(dvalue, kr, table, sympy)
    slots = {sympy.Symbol(f"kl_p{i}", real=True): sympy.Symbol(f"p.p{i}", real=True) for i in range(3)}
    consts = "".join(f"    a.{sym} = {_c(e.xreplace(slots), 'false')};\n" for e, sym in table.items())
    members = "".join(f"    float {sym};\n" for sym in table.values())
    attr = {sym: sympy.Symbol(f"kl_a.{sym}", real=True) for sym in table.values()}
    value, dvalue = value.xreplace(attr), dvalue.xreplace(attr)
    # |z|: a free operand modifier (z < 0 only by the expanded form's rounding of a zero distance)
    r_of_z = "kl_sqrt(fabsf(kl_z))" if sqrt_base else "fabsf(kl_z)"
    return (
        "  struct Args {\n"
        f"{members}"
        "  };\n"
        "  __device__ __forceinline__ static Args args(const epilogue::Params& p) {\n"
        "    Args a{};\n"
        f"{consts}"
        "    return a;\n"
        "  }\n"
        "  __device__ __forceinline__ static float scale(const Args&) { return 1.0f; }\n"
        "  template <bool kFma>\n"
        "  __device__ __forceinline__ static float value(float kl_z, const Args& kl_a) {\n"
        f"    const float kl_r = {r_of_z};\n"
        f"{_statements(value, 'kFma', sympy)}"
        "  }\n"
        "  __device__ __forceinline__ static float dk_dr2(float kl_z, const Args& kl_a) {\n"
        f"    const float kl_r = {r_of_z};\n"
        f"{_statements(dvalue, 'false', sympy)}"
        "  }\n"
        # log2 k (kernel_logsumexp of a positive kernel): of the value (underflows to -inf below ~1e-38)
        "  __device__ __forceinline__ static float log2_value(float kl_z, const Args& kl_a) {\n"
        "    return math::lg2_approx(value<false>(kl_z, kl_a));\n"
        "  }\n")
