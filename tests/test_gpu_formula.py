"""Formula kernels on CUDA tensors (marker ``gpu``; skipped without CUDA): the torch path on the
GPU (the fused templates do not know them yet), float32 against float64 of the same inputs."""

import pytest
import torch

import kermac_like as km

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DEV = torch.device("cuda")
CASES = [
    (km.matern(1.5), dict(bandwidth=0.8)),
    (km.matern(2.5), dict(bandwidth=1.3)),
    (km.rational_quadratic(), dict(bandwidth=0.9, alpha=0.7)),
    (km.powered_exponential(1.5, p=1.3), dict(bandwidth=1.1)),
    (km.cauchy(), dict(bandwidth=0.7)),
    (km.inverse_multiquadric(), dict(bandwidth=0.7)),
    (km.additive("powered_exponential", q=1.5), dict(bandwidth=0.6)),
    (km.periodic(1.7), dict(bandwidth=0.8)),
    (km.polynomial(2, c=0.5), {}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_values_and_products_against_float64(case):
    desc, kw = CASES[case]
    x = torch.randn(129, 5, device=DEV)
    y = torch.randn(127, 5, device=DEV)
    v = torch.randn(127, 3, device=DEV)
    want = km.run_kernel(desc, x.double(), y.double(), **kw)
    got = km.run_kernel(desc, x, y, **kw)
    if desc.family == "polynomial":  # the DOT error model (km.polynomial): relative to the
        c = dict(desc.params)["c"]                     # terms' scale, not the value (<x, y> may cancel c)
        scale = ((x.double().abs() @ y.double().abs().T) + abs(c)) ** desc.degree
        assert ((got.double() - want).abs() / scale).max() <= 1e-5
    else:
        assert ((got.double() - want) / want.abs().clamp_min(1e-5)).abs().max() <= 1e-5
    mv = km.kernel_matvec(desc, x, y, v, **kw)
    ref = want @ v.double()
    assert (mv.double() - ref).abs().max() <= 1e-5 * (want.abs() @ v.double().abs()).max()
    if desc.positive:
        lse = km.kernel_logsumexp(desc, x, y, **kw)
        assert torch.allclose(lse.double(), torch.logsumexp(want.log(), -1), rtol=1e-5, atol=1e-5)
    vals, _ = km.kernel_topk(desc, x, y, 4, **kw)
    assert torch.allclose(vals.double(), torch.topk(want, 4).values, rtol=1e-5, atol=1e-6)


def test_gradients_on_cuda_match_float64():
    desc = km.rational_quadratic()
    x = torch.randn(40, 3, device=DEV, dtype=torch.float64, requires_grad=True)
    v = torch.randn(40, 2, device=DEV, dtype=torch.float64, requires_grad=True)
    a = torch.tensor([0.8], device=DEV, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v, a: km.kernel_matvec(desc, x, x * 0.5, v, bandwidth=1.0, alpha=a),
                                    (x, v, a))
