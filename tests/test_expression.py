"""User-written kernel expressions (kermac_like/expression.py, kermac_like.kernel_expression):
grammar errors with positions, canonical forms, the CUDA C++ rendering, derivatives, and SymPy
imported only when an expression is built."""

import re
import subprocess
import sys

import pytest
import torch

import kermac_like as km
from kermac_like import expression

pytest.importorskip("sympy")


@pytest.mark.parametrize("text, pattern", [
    ("exp(-r) + __import__('os')", r"unknown name '__import__' at position 10"),
    ("exp(-r).real", r"'\.' at position 7"),
    ("tanh(r)", r"unknown name 'tanh' at position 0"),
    ("exp(-r/ell)", r"unknown name 'ell' at position 7"),
    ("r[0]", r"'\[' at position 1"),
    ("'r'", r"at position 0"),
    ("lambda: r", r"'lambda' at position 0"),
    ("r == 1", r"'==' at position 2"),
    ("exp(-r", r"not an expression"),
    ("r +", r"not an expression"),
    ("1j*r", r"number '1j' at position 0"),
    ("r < 1", r"condition"),
    ("exp", r"'exp' at position 0 is not called"),
    ("", r"empty"),
])
def test_grammar_errors_name_the_position(text, pattern):
    with pytest.raises(ValueError, match=pattern):
        km.kernel_expression(text)


def test_parameter_errors():
    with pytest.raises(ValueError, match="'ell' is declared but used in neither"):
        km.kernel_expression("exp(-r)", params=("ell",))
    with pytest.raises(ValueError, match="reserved"):
        km.kernel_expression("exp(-r/out)", params=("out",))
    d = km.kernel_expression("exp(-r/ell)", params=("ell",))
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"ell: .*needs a value for ell \(used at position 7 of the epilogue"):
        km.run_kernel(d, x, x)
    with pytest.raises(ValueError, match="inner: unknown name .r. at position 0"):
        km.kernel_expression("r", inner="r*t")


def test_canonical_forms():
    a = km.kernel_expression("exp(-2*r/ell)", params={"ell": 1.0})
    b = km.kernel_expression("exp(-r*2/ell)", params={"ell": 1.0})
    assert a == b and hash(a) == hash(b) and a.key() == b.key()
    assert km.kernel_expression("exp(-r)", inner="(y - x)**2") == km.kernel_expression("exp(-r)", inner="t^2")
    assert km.kernel_expression("exp(-r)", inner="abs(y - x)") == km.kernel_expression("exp(-r)", inner="abs(t)")
    assert km.kernel_expression("exp(-r)") != km.kernel_expression("exp(-r)", inner="abs(t)")
    assert km.kernel_expression("exp(-r/ell)", params={"ell": 1.0}) != km.kernel_expression(
        "exp(-r/ell)", params={"ell": 2.0})
    # the base fields of the recognised inner terms: the package's distance and product paths
    assert km.kernel_expression("exp(-r)", inner="(x-y)**2").inner == ""
    assert km.kernel_expression("r + 1", inner="x*y").inner_operator is km.InnerOperator.DOT
    assert km.kernel_expression("exp(-r)", inner="sin(x - y)**2").inner == "sin(t)**2"
    assert not km.kernel_expression("r", inner="x*y").positive and km.kernel_expression("exp(-r)").positive
    # the canonical text parses back to the same expression (where, min, max, abs)
    d = km.kernel_expression("where(r < 1, min(r, 0.5), max(abs(r - 2), 1))")
    e = d.sympy_epilogue()
    assert expression.canonical_text(expression.parse(d.epilogue, ("r",), (), "epilogue")) == d.epilogue
    x = torch.linspace(0, 3, 13, dtype=torch.float64)
    want = torch.where(x < 1, torch.clamp(x, max=0.5), torch.clamp((x - 2).abs(), min=1))
    assert torch.equal(expression.torch_function(e, ("r",))(r=x), want)


def test_cuda_source_and_derivatives():
    d = km.kernel_expression("(1 + sqrt(5)*r + 5*r**2/3) * exp(-sqrt(5)*r)")
    src = d.cuda_source()
    assert src["inner"] is None
    assert "expf(" in src["epilogue"] and "sqrtf(5)" in src["epilogue"] and "5.0F/3.0F" in src["epilogue"]
    assert "exp(" in d.cuda_source(double=True)["epilogue"] and "expf" not in d.cuda_source(double=True)["epilogue"]
    w = km.kernel_expression("where(r < c, min(r, 1), exp(-r))", params={"c": 1.0}).cuda_source()["epilogue"]
    assert "?" in w and "fminf" in w
    assert km.periodic().cuda_source()["inner"] == "powf(sinf(M_PI*t/period), 2)"
    der = d.derivatives()["epilogue/r"]
    r = d.sympy_epilogue().free_symbols.pop()
    assert float(der.subs(r, 0)) == 0.0  # Matern 5/2 is flat at zero distance
    # the derivative against autograd of the torch rendering
    fd = expression.torch_function(der, ("r",))
    rr = torch.linspace(0.1, 3, 7, dtype=torch.float64, requires_grad=True)
    km.run_kernel  # (the epilogue as the torch path renders it)
    fe = expression.torch_function(d.sympy_epilogue(), ("r",))
    (g,) = torch.autograd.grad(fe(r=rr).sum(), rr)
    assert torch.allclose(g, fd(r=rr.detach()), rtol=1e-12)
    pd = km.periodic().derivatives()
    assert set(pd) >= {"epilogue/r", "epilogue/bandwidth", "inner/t", "inner/period"}


def test_builtin_formulas_match_their_torch_forms():
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randn(5, 3, dtype=torch.float64)
    hyp = dict(bandwidth=0.9, alpha=0.6, q=1.3, period=1.4, c=0.3)
    for desc in (km.matern(1.5), km.matern(2.5), km.rational_quadratic(), km.powered_exponential(),
                 km.cauchy(), km.inverse_multiquadric(), km.additive(), km.additive("powered_exponential"),
                 km.periodic(), km.polynomial(3)):
        kw = {n: hyp[n] for n in desc.param_names}
        inner = desc.inner or {km.InnerOperator.DOT: "x*y"}.get(desc.inner_operator, "(x - y)**2")
        epi = desc.epilogue
        if desc.outer_power is km.PowerType.SQRT:
            epi = re.sub(r"\br\b", "sqrt(r)", epi)
        user = km.kernel_expression(epi, inner=inner, params={n: v for n, v in kw.items() if n != "bandwidth"}
                                    | ({"bandwidth": None} if "bandwidth" in kw else {}))
        want = km.run_kernel(desc, x, y, **kw)
        got = km.run_kernel(user, x, y, **({"bandwidth": kw["bandwidth"]} if "bandwidth" in kw else {}))
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), desc


def test_import_does_not_import_sympy():
    code = "import sys, kermac_like; kermac_like.matern(2.5); assert 'sympy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
