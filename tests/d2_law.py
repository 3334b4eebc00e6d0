"""D^2 sampling's law on a few points, for tests of kmeans_plusplus' rounds (the rejection of
stale proposals must leave every draw exactly D^2 sampling): Pearson's statistic of many
seedings' ordered 3-tuples against the exact probabilities of every ordered triple."""

from __future__ import annotations

import itertools
import math

import torch

# six weighted points on a line in three far groups: after two centres in one group, most
# proposals of the third (from the state of the first) are rejected
POINTS = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0], [30.0]], dtype=torch.float64)
WEIGHTS = torch.tensor([1.0, 2.0, 1.0, 1.0, 0.5, 1.0], dtype=torch.float64)


def law(X: torch.Tensor, w: torch.Tensor, C: int) -> dict:
    """{ordered C-tuple of row indices: its probability under D^2 sampling with weights w}."""
    out = {}
    for seq in itertools.permutations(range(len(X)), C):
        p, d2 = 1.0, None
        for i in seq:
            q = w if d2 is None else d2 * w
            p *= float(q[i] / q.sum())
            di = ((X - X[i]) ** 2).sum(1)
            d2 = di if d2 is None else torch.minimum(d2, di)
        out[seq] = p
    return out


def statistic(seeding, n: int, C: int = 3) -> tuple:
    """(Pearson's statistic, degrees of freedom) of ``seeding(seed)`` (the drawn indices) for
    seeds 0 .. n - 1 on POINTS / WEIGHTS: cells of expected count >= 5, the rest pooled into one.
    A tuple of probability 0 fails at once."""
    probs = law(POINTS, WEIGHTS, C)
    counts = {}
    for sd in range(n):
        t = tuple(int(i) for i in seeding(sd)[:C].tolist())
        assert probs.get(t, 0.0) > 0, f"seed {sd} drew {t}, of probability 0"
        counts[t] = counts.get(t, 0) + 1
    chi, cells, rest_o, rest_e = 0.0, 0, 0, 0.0
    for t, p in probs.items():
        e, o = n * p, counts.get(t, 0)
        if e < 5:
            rest_o, rest_e = rest_o + o, rest_e + e
        else:
            chi, cells = chi + (o - e) ** 2 / e, cells + 1
    return chi + (rest_o - rest_e) ** 2 / rest_e, cells  # cells + 1 cells, cells degrees of freedom


def bound(df: int, z: float = 3.719) -> float:
    """The chi-square quantile of degrees of freedom df at 1 - 1e-4 (z: the normal's), by
    Wilson and Hilferty's approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3
