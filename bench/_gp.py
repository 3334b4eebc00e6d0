"""bench/run.py's GPyTorch training step: the data of its
gp_step (x uniform in [-1, 1]^8, y a smooth function plus noise) and one ExactGP step (ScaleKernel around the
given kernel, constant mean, GPyTorch's defaults, max_cholesky_size 0): the MLL and its backward."""

from __future__ import annotations

import contextlib

import gpytorch
import torch

from kermac_like.gpytorch import ScaledExactGP


def data(n: int, device="cuda", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.rand(n, 8, device=device, generator=g) * 2 - 1
    y = torch.sin(3 * x[:, 0]) * torch.cos(x[:, 1:].sum(1)) + 0.1 * torch.randn(n, device=device, generator=g)
    return x, y


def step(kernel_cls, x, y, forward_ctx=contextlib.nullcontext, backward_ctx=contextlib.nullcontext):
    """The negative MLL (detached) after its backward; ``forward_ctx`` / ``backward_ctx`` wrap the two halves
    (e.g. profiler labels)."""
    return model_step(kernel_cls, x, y, forward_ctx, backward_ctx)[0]


def model_step(kernel_cls, x, y, forward_ctx=contextlib.nullcontext, backward_ctx=contextlib.nullcontext, seed=0):
    """(the negative MLL, the model with its gradients) of :func:`step`; ``seed`` draws the probe vectors."""
    likelihood = gpytorch.likelihoods.GaussianLikelihood().to(x.device)
    model = ScaledExactGP(x, y, likelihood, kernel_cls()).to(x.device)
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    model.train()
    likelihood.train()
    torch.manual_seed(seed)
    with gpytorch.settings.max_cholesky_size(0):
        with forward_ctx():
            loss = -mll(model(x), y)
        with backward_ctx():
            loss.backward()
    return loss.detach(), model
