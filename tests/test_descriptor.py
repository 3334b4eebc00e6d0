import dataclasses

import pytest

import kermac_like as km
from kermac_like import InnerOperator as I
from kermac_like import KernelDescriptor as D
from kermac_like import KernelType as T
from kermac_like import PowerType as P


def test_presets_are_immutable():
    d = km.PRESETS["l2"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.inner_power = P.ABS
    with pytest.raises(TypeError):
        km.PRESETS["l2"] = d
    assert km.KernelDescriptor.l2() is km.PRESETS["l2"]
    assert km.preset("laplace_l2").kernel_type is T.LAPLACE


def test_coercion_and_equality():
    a = D("diff", "abs", "noop", "laplace")
    b = D(I.DIFF, P.ABS, P.NOOP, T.LAPLACE)
    assert a == b and hash(a) == hash(b)
    assert a.cpp_args() == (
        "kermac_like::Inner::Diff, kermac_like::Power::Abs, kermac_like::Power::Noop, kermac_like::Epilogue::Laplace"
    )


@pytest.mark.parametrize(
    "args, word",
    [
        ((I.DIFF, P.NOOP, P.NOOP, T.NONE), "inner_power"),
        ((I.DIFF, P.SQRT, P.NOOP, T.NONE), "inner_power"),
        ((I.DIFF, P.ABS, P.ABS, T.NONE), "outer_power"),
        ((I.DIFF, P.ABS, P.SQUARE, T.NONE), "outer_power"),
        ((I.DOT, P.ABS, P.NOOP, T.NONE), "DOT"),
        ((I.DOT, P.NOOP, P.SQRT, T.NONE), "DOT"),
        ((I.DOT, P.NOOP, P.NOOP, T.GAUSSIAN), "kernel_type"),
        (("cosine", P.ABS, P.NOOP, T.NONE), "inner_operator"),
        ((I.DIFF, 17, P.NOOP, T.NONE), "inner_power"),
    ],
)
def test_impossible_combinations(args, word):
    with pytest.raises(ValueError, match=word):
        D(*args)


def test_unknown_preset():
    with pytest.raises(ValueError, match="name"):
        km.preset("nope")


def test_euclidean_flags():
    assert km.PRESETS["l2"].is_euclidean and km.PRESETS["dot"].is_euclidean
    assert km.PRESETS["gaussian_l2"].is_euclidean
    assert not km.PRESETS["l1"].is_euclidean and not km.PRESETS["p_norm"].is_euclidean
