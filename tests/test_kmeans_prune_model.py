"""CPU checks of the float64 model behind issue 42's round-2 predictions (tests/kmeans_prune_model.py;
bench/notes/kmeans.md, "Issue 42, round 2"): the proposed rules give the exact labels, and the local
reference's exclusion lemma holds. Lean: ~3 s."""

import numpy as np
import pytest
import torch

import kmeans_prune_model as model


@pytest.fixture(scope="module")
def blobs():
    X = model.families(3000, 8, 48, 0)["blobs_centred"]
    return X.numpy(), model.seeding(X, 48, 0)


def test_yinyang_rule_gives_exact_labels(blobs):
    """Group bounds moved by the groups' largest drift, only open groups evaluated: the labels of a full
    assignment at every step (the model asserts nothing; it counts mismatches)."""
    X, c0 = blobs
    r = model.simulate(X, c0, iters=4, G=6)
    assert r["label_mismatch"] == 0
    assert (r["y_evals"] <= r["y_work"] + 1e-12).all()  # never more than every centre per row


def test_local_reference_certifies_more(blobs):
    """The certificate about a per-warp centre leaves far fewer rows to the rescan on wide blobs."""
    X, c0 = blobs
    r = model.simulate(X, c0, iters=2, G=6)
    assert r["uncert_first_local"] < 0.5 * r["uncert_first_global"]


def test_exclusion_lemma():
    """r a centre, X' >= ||x - r||^2 for the warp's rows: a centre with ||c - r||^2 > 9 X' is farther from
    every row than 2 sqrt X' - ||x - r|| >= sqrt X' >= the row's nearest distance (so never its label)."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        c = torch.randn(64, 5, generator=g).double().numpy() * 3
        r = c[0]
        x = r + torch.randn(32, 5, generator=g).double().numpy() * float(torch.rand(1, generator=g)) * 4
        Xp = ((x - r) ** 2).sum(1).max()
        far = ((c - r) ** 2).sum(1) > 9 * Xp
        d = np.sqrt(((x[:, None, :] - c[None]) ** 2).sum(2))
        if far.any():
            bound = 2 * np.sqrt(Xp) - np.sqrt(((x - r) ** 2).sum(1))
            assert (d[:, far].min(1) >= bound - 1e-12).all()
            assert (d[:, far].min(1) > d.min(1)).all()
