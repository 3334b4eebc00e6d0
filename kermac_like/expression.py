"""Kernel expressions: user-written formulas parsed, canonicalised, rendered and differentiated
with SymPy.

A user-written kernel (:func:`kermac_like.kernel_expression`) is two formulas: the inner term of
one coordinate pair, in ``t`` (= x_k - y_k) or in ``x`` and ``y`` (x_k, y_k), summed over the
coordinates into ``r``, and the epilogue in ``r`` and the descriptor's named hyper-parameters.
The grammar is closed::

    numbers, names (the variables, declared parameters, pi), + - * / ** ^ (power), unary -,
    parentheses, exp log sqrt abs sin cos min max where(cond, a, b), comparisons < <= > >=

Anything else (another function, an undeclared name, attribute access, indexing, strings,
keywords, == / !=) is a ValueError naming it and its position (0-based character offset)
before SymPy sees the text. The text is then parsed by ``sympy.parsing.sympy_parser.parse_expr``
with only the grammar's names in its dictionaries (no builtins), never by Python's ``eval`` of
the user's text. SymPy's automatic canonicalisation (term order, like terms, signs inside
``abs``) gives the canonical form, printed back in the grammar (:func:`canonical_text`): it is
the descriptor's identity, its hash and its part of the cache key, and it parses back to the
same expression.

Renderings: :func:`torch_function` (a closure tree over torch operations: no code generation,
autograd through it), :func:`cuda_source` (SymPy's C printer in single precision: ``expf``,
``powf``, ``fminf``, float literals; for the fused templates), :func:`derivative` (SymPy's
``diff``).

SymPy is imported by these functions only (``pip install kermac_like[expressions]``), never by
``import kermac_like``.
"""

from __future__ import annotations

import functools
import io
import keyword
import tokenize

__all__ = ["ALLOWED_FUNCTIONS", "VARIABLES", "parse", "canonical_text", "torch_function", "cuda_source",
           "derivative", "free_names", "is_positive", "position_of", "sympy_module"]

ALLOWED_FUNCTIONS = ("exp", "log", "sqrt", "abs", "sin", "cos", "min", "max", "where")
CONSTANTS = ("pi",)
# The variables of each part: the inner term's and the epilogue's.
VARIABLES = {"inner": ("t", "x", "y"), "epilogue": ("r",)}
_OPS = {"+", "-", "*", "/", "**", "^", "(", ")", ",", "<", "<=", ">", ">="}
_SKIP = (tokenize.ENCODING, tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)


def sympy_module():
    """SymPy, or an ImportError naming the extra that installs it."""
    try:
        import sympy
    except ImportError:
        raise ImportError("kermac_like: kernel expressions need SymPy; install the extra: "
                          "pip install 'kermac_like[expressions]' (or pip install sympy)") from None
    return sympy


def _check_tokens(text: str, names: set, argname: str) -> None:
    """Every token of ``text`` within the grammar; ValueError naming the first that is not, and
    its position."""
    if not isinstance(text, str):
        raise TypeError(f"{argname}: expected a str expression, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{argname}: empty expression")
    if "\n" in text or "\r" in text:
        raise ValueError(f"{argname}: an expression is one line (a line break at position "
                         f"{min(i for i in (text.find(chr(10)), text.find(chr(13))) if i >= 0)})")
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError) as e:
        raise ValueError(f"{argname}: not an expression ({e.args[0] if e.args else e})") from None
    prev = None
    for tok in toks:
        if tok.type in _SKIP:
            continue
        pos = tok.start[1]
        s = tok.string
        if tok.type == tokenize.NUMBER:
            if s[-1] in "jJ" or s.lower().startswith(("0x", "0o", "0b")) or "_" in s:
                raise ValueError(f"{argname}: number {s!r} at position {pos} is not a decimal real number")
        elif tok.type == tokenize.NAME:
            if keyword.iskeyword(s):
                raise ValueError(f"{argname}: {s!r} at position {pos} is not part of the expression grammar")
            if s not in names:
                if s in ALLOWED_FUNCTIONS or s in CONSTANTS:
                    pass
                else:
                    raise ValueError(f"{argname}: unknown name {s!r} at position {pos} (allowed: the variables and "
                                     f"declared parameters {sorted(names)}, the functions {list(ALLOWED_FUNCTIONS)}, "
                                     f"pi)")
            elif prev is not None and prev.type == tokenize.NAME and prev.string in names:
                raise ValueError(f"{argname}: missing operator before {s!r} at position {pos}")
            if s in ALLOWED_FUNCTIONS and s not in names:
                nxt = toks[toks.index(tok) + 1]
                if nxt.string != "(":
                    raise ValueError(f"{argname}: function {s!r} at position {pos} is not called")
        elif tok.type == tokenize.OP:
            if s not in _OPS:
                raise ValueError(f"{argname}: {s!r} at position {pos} is not part of the expression grammar "
                                 "(operators: + - * / ** ^ < <= > >=, parentheses, commas)")
        else:
            raise ValueError(f"{argname}: {s!r} at position {pos} is not part of the expression grammar")
        prev = tok


def position_of(text: str, name: str) -> int:
    """The position (0-based character offset) of the first token ``name`` in ``text``; -1 if none."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string == name:
            return tok.start[1]
    return -1


def _grammar(sympy):
    def where(cond, a, b):
        if not isinstance(cond, (sympy.logic.boolalg.Boolean, bool)):
            raise TypeError("where: the first argument must be a comparison")
        return sympy.Piecewise((a, cond), (b, True))

    return {"exp": sympy.exp, "log": sympy.log, "sqrt": sympy.sqrt, "abs": sympy.Abs, "sin": sympy.sin,
            "cos": sympy.cos, "min": sympy.Min, "max": sympy.Max, "where": where, "pi": sympy.pi}


def parse(text: str, variables, params, argname: str):
    """The SymPy expression of ``text`` over the names ``variables`` and ``params`` (real
    symbols); ValueError naming ``argname`` and the position of what is outside the grammar."""
    names = set(variables) | set(params)
    _check_tokens(text, names, argname)
    sympy = sympy_module()
    from sympy.parsing.sympy_parser import auto_number, convert_xor, parse_expr

    local = {n: sympy.Symbol(n, real=True) for n in names}
    glob = {"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational,
            **_grammar(sympy)}
    try:
        expr = parse_expr(text, local_dict=local, global_dict=glob, transformations=(auto_number, convert_xor),
                          evaluate=True)
    except SyntaxError as e:
        off = (e.offset - 1) if e.offset else None
        where_ = f" at position {off}" if off is not None and off <= len(text) else ""
        raise ValueError(f"{argname}: not an expression{where_} ({e.msg})") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"{argname}: {text!r} is not a valid expression ({e})") from None
    if not isinstance(expr, sympy.Expr):  # (a symbol is both: a value)
        raise ValueError(f"{argname}: {text!r} is a condition, not a value (use where(cond, a, b))")
    if expr.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        raise ValueError(f"{argname}: {text!r} is not finite (it simplifies to {expr})")
    return expr


@functools.lru_cache(maxsize=None)
def _printer_class():
    from sympy.printing.str import StrPrinter

    class _GrammarPrinter(StrPrinter):
        """SymPy's str printer, speaking the grammar: abs, min, max, where."""

        def _print_Abs(self, e):
            return f"abs({self._print(e.args[0])})"

        def _print_Min(self, e):
            return self._minmax("min", e.args)

        def _print_Max(self, e):
            return self._minmax("max", e.args)

        def _minmax(self, name, args):
            out = self._print(args[-1])
            for a in reversed(args[:-1]):
                out = f"{name}({self._print(a)}, {out})"
            return out

        def _print_Piecewise(self, e):
            *pairs, (last, cond) = e.args
            out = self._print(last)
            if cond is not True and str(cond) != "True":
                raise ValueError(f"a piecewise expression without a default: {e}")
            for value, c in reversed(pairs):
                out = f"where({self._print(c)}, {self._print(value)}, {out})"
            return out

        def _print_Exp1(self, e):
            return "exp(1)"

    return _GrammarPrinter


def canonical_text(expr) -> str:
    """The canonical form of a parsed expression, in the grammar (it parses back to ``expr``)."""
    return _printer_class()(dict(full_prec=False)).doprint(expr)


def free_names(expr) -> tuple:
    return tuple(sorted(str(s) for s in expr.free_symbols))


# -- rendering to torch -------------------------------------------------------------------
def torch_function(expr, names):
    """``f(**env)`` evaluating ``expr`` on torch tensors and floats (a tree of closures over
    torch operations, built once; autograd differentiates it). ``names``: the symbols ``env``
    gives."""
    import torch

    sympy = sympy_module()
    symbols = {str(s) for s in expr.free_symbols}
    missing = symbols - set(names)
    if missing:
        raise ValueError(f"expression: unknown names {sorted(missing)}")
    fn = _build(expr, sympy, torch)
    return lambda **env: fn(env)


def _num(v):
    return float(v)


def _build(e, sympy, torch):  # noqa: C901  (one branch per node type of the grammar)
    if e.is_Symbol:
        name = str(e)
        return lambda env: env[name]
    if e.is_Number or e.is_NumberSymbol or (e.is_number and not e.free_symbols and e.is_real):
        c = _num(e)
        return lambda env: c
    if isinstance(e, sympy.Add):
        parts = [_build(a, sympy, torch) for a in e.args]

        def add(env):
            out = parts[0](env)
            for p in parts[1:]:
                out = out + p(env)
            return out

        return add
    if isinstance(e, sympy.Mul):
        parts = [_build(a, sympy, torch) for a in e.args]

        def mul(env):
            out = parts[0](env)
            for p in parts[1:]:
                out = out * p(env)
            return out

        return mul
    if isinstance(e, sympy.Pow):
        base = _build(e.base, sympy, torch)
        ex = e.exp
        if ex == sympy.Rational(1, 2):
            return lambda env: _sqrt(base(env), torch)
        if ex == -sympy.Rational(1, 2):
            return lambda env: _rsqrt(base(env), torch)
        if ex == -1:
            return lambda env: 1.0 / base(env)
        if ex.is_Integer and ex > 0:
            n = int(ex)
            return lambda env: base(env) ** n
        expo = _build(ex, sympy, torch)
        return lambda env: _pow(base(env), expo(env), torch)
    unary = {sympy.exp: torch.exp, sympy.log: torch.log, sympy.sin: torch.sin, sympy.cos: torch.cos}
    for f, tf in unary.items():
        if isinstance(e, f):
            arg = _build(e.args[0], sympy, torch)
            return lambda env, tf=tf: _apply(tf, arg(env), torch)
    if isinstance(e, sympy.Abs):
        arg = _build(e.args[0], sympy, torch)
        return lambda env: abs(arg(env))
    if isinstance(e, (sympy.Min, sympy.Max)):
        parts = [_build(a, sympy, torch) for a in e.args]
        tf = torch.minimum if isinstance(e, sympy.Min) else torch.maximum
        pf = min if isinstance(e, sympy.Min) else max

        def minmax(env):
            out = parts[0](env)
            for p in parts[1:]:
                v = p(env)
                if isinstance(out, torch.Tensor) or isinstance(v, torch.Tensor):
                    out, v = _tensors(out, v, torch)
                    out = tf(out, v)
                else:
                    out = pf(out, v)
            return out

        return minmax
    if isinstance(e, sympy.Piecewise):
        branches = [(_build(v, sympy, torch), _build_cond(c, sympy, torch)) for v, c in e.args]

        def piecewise(env):
            value = branches[-1][0](env)
            for v, c in reversed(branches[:-1]):
                cond, val = c(env), v(env)
                if isinstance(cond, bool):
                    value = val if cond else value
                else:
                    val_t, value_t = _tensors(val, value, torch, like=cond)
                    value = torch.where(cond, val_t, value_t)
            return value

        return piecewise
    raise ValueError(f"expression: {type(e).__name__} ({e}) is not part of the grammar")


def _build_cond(c, sympy, torch):
    if c is sympy.true or c is True:
        return lambda env: True
    if c is sympy.false or c is False:
        return lambda env: False
    ops = {sympy.StrictLessThan: "lt", sympy.LessThan: "le", sympy.StrictGreaterThan: "gt",
           sympy.GreaterThan: "ge"}
    for cls, op in ops.items():
        if isinstance(c, cls):
            lhs, rhs = _build(c.lhs, sympy, torch), _build(c.rhs, sympy, torch)

            def cmp(env, op=op):
                a, b = lhs(env), rhs(env)
                if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
                    return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op]
                a, b = _tensors(a, b, torch)
                return getattr(torch, op)(a, b)

            return cmp
    if isinstance(c, (sympy.And, sympy.Or)):
        parts = [_build_cond(a, sympy, torch) for a in c.args]
        is_and = isinstance(c, sympy.And)

        def logic(env):
            out = parts[0](env)
            for p in parts[1:]:
                v = p(env)
                out = (out & v) if is_and else (out | v)
            return out

        return logic
    if isinstance(c, sympy.Not):
        inner = _build_cond(c.args[0], sympy, torch)
        return lambda env: ~inner(env) if not isinstance(inner(env), bool) else not inner(env)
    raise ValueError(f"expression: the condition {c} is not part of the grammar")


def _tensors(a, b, torch, like=None):
    """a and b as tensors (floats become 0-d tensors of the other's dtype and device)."""
    ref = a if isinstance(a, torch.Tensor) else b if isinstance(b, torch.Tensor) else like
    if not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=ref.dtype if ref.is_floating_point() else torch.get_default_dtype(),
                         device=ref.device)
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=a.dtype, device=a.device)
    return a, b


def _apply(tf, v, torch):
    if isinstance(v, torch.Tensor):
        return tf(v)
    return float(tf(torch.tensor(v, dtype=torch.float64)))


def _sqrt(v, torch):
    return v.sqrt() if isinstance(v, torch.Tensor) else v ** 0.5


def _rsqrt(v, torch):
    return v.rsqrt() if isinstance(v, torch.Tensor) else v ** -0.5


def _pow(b, e, torch):
    if isinstance(b, torch.Tensor) or isinstance(e, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            b = torch.tensor(b, dtype=e.dtype, device=e.device)
        return torch.pow(b, e)
    return b ** e


# -- rendering to CUDA C++ and differentiation ---------------------------------------------------
def cuda_source(expr, *, double: bool = False) -> str:
    """``expr`` as one CUDA C++ expression (SymPy's C99 printer): single precision by default
    (``expf``, ``powf``, ``sqrtf``, ``fminf``, ``F`` literals), ``double`` for float64; where()
    becomes ``?:``. The variables and parameters keep their names."""
    sympy = sympy_module()
    from sympy.codegen.ast import float32, float64, real

    code = sympy.ccode(expr, type_aliases={real: float64 if double else float32})
    return " ".join(code.split())


def derivative(expr, name: str):
    """d expr / d name (SymPy's diff; the derivative of abs is sign, of min/max and where
    piecewise)."""
    sympy = sympy_module()
    sym = next((s for s in expr.free_symbols if str(s) == name), None)
    if sym is None:
        return sympy.Integer(0)
    d = sympy.diff(expr, sym)
    # sign (of abs) and Heaviside (of min/max) as where(): within the grammar and the C printer
    return d.replace(lambda e: isinstance(e, (sympy.sign, sympy.Heaviside)),
                     lambda e: e.rewrite(sympy.Piecewise))


def is_positive(expr, variable: str = "r") -> bool:
    """Whether SymPy proves ``expr`` > 0 for every ``variable`` >= 0 and positive parameters."""
    sympy = sympy_module()
    subs = {}
    for s in expr.free_symbols:
        subs[s] = sympy.Symbol(str(s), nonnegative=True) if str(s) == variable else sympy.Symbol(str(s), positive=True)
    return bool(expr.xreplace(subs).is_positive)
