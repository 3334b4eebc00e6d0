"""The examples in the docstrings (``>>>``) run as doctests, and every public function and
estimator has one. The examples use CPU tensors of a few rows, so they run the same on any
machine; an example that needs NVRTC or a GPU carries ``# doctest: +SKIP``. The GPyTorch
kernels' examples run where gpytorch is installed (the [test] extra)."""

import doctest
import enum
import importlib
import inspect

import pytest

import kermac_like as km

# Subpackages whose __all__ is public API beside kermac_like's own.
SUBPACKAGES = ("linalg", "solvers", "neighbors", "cluster", "gpytorch", "rfm")


def _public() -> dict:
    """{qualified name: object} of the public functions and classes (enums, exceptions and
    warnings aside: the descriptor's example shows the enums)."""
    out = {}
    modules = [(None, km)]
    for sub in SUBPACKAGES:
        try:
            modules.append((sub, importlib.import_module(f"kermac_like.{sub}")))
        except ImportError:  # an optional dependency (gpytorch) is missing
            continue
    for sub, mod in modules:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if inspect.isclass(obj) and issubclass(obj, (enum.Enum, BaseException)):
                continue
            out[name if sub is None else f"{sub}.{name}"] = obj
    return out


PUBLIC = _public()


def _doctests() -> list:
    finder = doctest.DocTestFinder(exclude_empty=True)
    names = sorted({obj.__module__ for obj in PUBLIC.values()})
    tests = [t for name in names for t in finder.find(importlib.import_module(name)) if t.examples]
    return sorted(tests, key=lambda t: t.name)


DOCTESTS = _doctests()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_api_has_an_example(name):
    doc = inspect.getdoc(PUBLIC[name]) or ""
    assert ">>>" in doc, f"{name}: its docstring has no >>> example"


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_docstring_examples(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = []
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
