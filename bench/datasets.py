"""Data families for the benchmark (issue 42): each at any size, deterministic for a seed.

    x = make("shifted100", 10000, 64, seed=0, device="cuda")           # (10000, 64) float32
    x, y = pair("pixels", 1000, 50000, 784, seed=0, near=True)          # queries near the points
    x = make("gaussian", n, d, generator=g)                              # == torch.randn(n, d, generator=g)

A family draws its structure first (blob centres, column scales, a linear map), then its
rows; ``pair`` draws the structure once and the queries x and the points y from it, x first
(for ``gaussian``: exactly ``torch.randn(m, d)`` then ``torch.randn(n, d)``, the
benchmark's data before --data). Everything comes from one
torch.Generator on ``device`` (``seed``, or the ``generator`` given), computed in float32
(float64 when ``dtype`` is float64) and returned in ``dtype``. FAMILIES says what each is.

The scikit-learn sets (SKLEARN) are the bundled files of ``sklearn.datasets.load_*`` (no
network). Rows: whole passes over the set, each pass in a new random order of its rows, the
last pass cut at n (so n <= the set's rows is a random subset without repetition, and larger
n repeats every row n // rows or n // rows + 1 times, exactly, without jitter). Columns:
column j is the set's column j mod its width (d below the width: its first d columns).
``native_shape`` gives a set's own (rows, columns).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers

import torch

__all__ = ["FAMILIES", "SKLEARN", "NEAR", "make", "pair", "native_shape", "available"]

FAMILIES: dict[str, str] = {}  # name -> what it is, in registration order
SKLEARN = ("digits", "wine", "breast_cancer", "diabetes")
NEAR = 1e-3  # pair(near=True): x = rows of y + NEAR * (y's column std) * randn
_BUILD = {}


class _Draw:
    """The draws of one generator on one device, floats in the working dtype."""

    def __init__(self, g, device, work, out):
        self.g, self.device, self.dtype, self.out = g, device, work, out

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g, device=self.device, dtype=self.dtype)

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.g, device=self.device, dtype=self.dtype)

    def randint(self, high, *shape):
        return torch.randint(0, high, shape, generator=self.g, device=self.device)

    def perm(self, n):
        return torch.randperm(n, generator=self.g, device=self.device)


def _family(name, doc):
    def register(build):
        FAMILIES[name] = doc
        _BUILD[name] = build
        return build
    return register


def _with_duplicates(r, rows, n, unique):
    """n rows, ceil(unique * n) of them drawn by ``rows``, the others exact copies of random ones
    among those, all in a random order."""
    u = max(1, math.ceil(unique * n))
    idx = torch.cat([torch.arange(u, device=r.device), r.randint(u, n - u)])
    return rows(u)[idx[r.perm(n)]]


@_family("gaussian", "torch.randn: centred, unit variance (the benchmark's data before --data)")
def _gaussian(r, d):
    return lambda n: r.randn(n, d)


for _offset in (10, 100, 1000):
    _family(f"shifted{_offset}", f"gaussian + {_offset} in every coordinate (offset x spread, spread 1)")(
        lambda r, d, c=float(_offset): (lambda n: r.randn(n, d).add_(c)))


@_family("relu", "max(gaussian, 0): half the entries exactly 0")
def _relu(r, d):
    return lambda n: r.randn(n, d).clamp_min_(0)


@_family("uniform", "torch.rand: uniform on [0, 1)")
def _uniform(r, d):
    return lambda n: r.rand(n, d)


@_family("pixels", "integers 0..255 as floats, each entry 0 with probability 0.7 (else uniform on "
                   "0..255): exact ties; 10 % of the rows exact copies of others")
def _pixels(r, d):
    def rows(u):
        return r.randint(256, u, d).to(r.dtype).masked_fill_(r.rand(u, d) < 0.7, 0.0)
    return lambda n: _with_duplicates(r, rows, n, 0.9)


@_family("onehot", "one-hot codes of categorical features: columns in groups of 4 (the last "
                   "narrower when 4 does not divide d), one 1 per group at a uniform level; 75 % "
                   "of the rows exact copies of others")
def _onehot(r, d):
    starts = torch.arange(0, d, 4, device=r.device)
    widths = (d - starts).clamp_max(4)

    def rows(u):
        level = (r.rand(u, starts.numel()) * widths).long().clamp_max_(widths - 1)
        return torch.zeros(u, d, dtype=r.dtype, device=r.device).scatter_(1, starts + level, 1.0)
    return lambda n: _with_duplicates(r, rows, n, 0.25)


@_family("blobs_wide", "8 blobs of unit spread, centres 4 * randint(0, 8) per coordinate, rows "
                       "spread evenly at random over the blobs")
def _blobs_wide(r, d):
    centres = 4.0 * r.randint(8, 8, d).to(r.dtype)
    return lambda n: r.randn(n, d).add_(centres[r.randint(8, n)])


@_family("blobs_tight", "1024 blobs of spread 1e-3 around gaussian centres, rows spread evenly at "
                        "random over the blobs")
def _blobs_tight(r, d):
    centres = r.randn(1024, d)
    return lambda n: r.randn(n, d).mul_(1e-3).add_(centres[r.randint(1024, n)])


@_family("anisotropic", "gaussian times per-column scales log-spaced from 1e-3 to 1e3 (d = 1: "
                        "1e-3), in a random column order")
def _anisotropic(r, d):
    scales = torch.logspace(-3, 3, d, dtype=r.dtype, device=r.device)[r.perm(d)]
    return lambda n: r.randn(n, d).mul_(scales)


@_family("lowrank", "intrinsic dimension k = min(4, d): gaussian rows in k-D times a gaussian "
                    "k x d map / sqrt(k)")
def _lowrank(r, d):
    k = min(4, d)
    basis = r.randn(k, d).div_(math.sqrt(k))
    return lambda n: r.randn(n, k) @ basis


@_family("student_t", "Student's t with 2 degrees of freedom per entry (heavy tails, infinite "
                      "variance): z / sqrt((a^2 + b^2) / 2), z, a, b gaussian")
def _student_t(r, d):
    tiny, big = torch.finfo(r.dtype).tiny, torch.finfo(r.out).max

    def rows(n):
        z, a, b = r.randn(3, n, d)
        return (z / (a * a + b * b).mul_(0.5).clamp_min_(tiny).sqrt_()).clamp_(-big, big)
    return rows


@functools.lru_cache(maxsize=None)
def _load(name):
    try:
        import sklearn.datasets
    except ImportError as e:
        raise ImportError(f"name: the {name!r} family needs scikit-learn (pip install scikit-learn); "
                          f"the synthetic families do not") from e
    return torch.from_numpy(getattr(sklearn.datasets, f"load_{name}")().data)


def _sklearn(name):
    def build(r, d):
        data = _load(name).to(device=r.device, dtype=r.dtype)
        rows, width = data.shape
        data = data[:, torch.arange(d, device=r.device) % width]

        def draw(n):
            order = torch.cat([r.perm(rows) for _ in range(-(-n // rows))])[:n]
            return data[order]
        return draw
    return build


for _name, _what in zip(SKLEARN, ("8 x 8 images of digits, integers 0..16", "chemistry of wines, columns "
                                  "from ~0.1 to ~1700", "cell-nucleus features, columns from ~1e-3 to ~4000",
                                  "standardised clinical features, |values| < 0.3")):
    _family(_name, f"scikit-learn's {_name} ({_what}), rows and columns as the module says")(_sklearn(_name))


def available() -> tuple:
    """The families whose packages are installed (the scikit-learn sets need scikit-learn)."""
    if importlib.util.find_spec("sklearn") is None:
        return tuple(f for f in FAMILIES if f not in SKLEARN)
    return tuple(FAMILIES)


def native_shape(name: str):
    """(rows, columns) of a scikit-learn set as it comes; None for a synthetic family."""
    _check_name(name)
    return tuple(_load(name).shape) if name in SKLEARN else None


def _check_name(name):
    if not isinstance(name, str) or name not in FAMILIES:
        raise ValueError(f"name: unknown data family {name!r}; one of {', '.join(FAMILIES)}")


def _check_size(arg, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{arg}: expected an integer >= 1, got {v!r}")
    return int(v)


def _sampler(name, d, seed, device, dtype, generator):
    d = _check_size("d", d)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    device = torch.device(device)
    if generator is None:
        generator = torch.Generator(device=device).manual_seed(seed)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    r = _Draw(generator, device, work, dtype)
    return r, _BUILD[name](r, d)


def make(name: str, n: int, d: int, *, seed: int = 0, device="cpu", dtype=torch.float32,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """n rows of d features of family ``name``: a contiguous (n, d) tensor of ``dtype`` on ``device``.
    Drawn from ``generator`` (on ``device``) when given, else from a new one seeded with ``seed``."""
    _check_name(name)
    n = _check_size("n", n)
    _, rows = _sampler(name, d, seed, device, dtype, generator)
    return rows(n).to(dtype).contiguous()


def pair(name: str, m: int, n: int, d: int, *, seed: int = 0, near: bool = False, device="cpu",
         dtype=torch.float32, generator: torch.Generator | None = None):
    """(x, y): m queries and n points of one draw of family ``name``'s structure. near=False: x
    and y drawn apart (x first); near=True: y drawn, x = m of its rows (a random subset, or with
    repetition when m > n) plus NEAR times each column's standard deviation times gaussian noise."""
    _check_name(name)
    m, n = _check_size("m", m), _check_size("n", n)
    r, rows = _sampler(name, d, seed, device, dtype, generator)
    if near:
        y = rows(n)
        idx = r.perm(n)[:m] if m <= n else r.randint(n, m)
        x = y[idx] + NEAR * y.std(0, correction=0) * r.randn(m, y.shape[1])
    else:
        x = rows(m)
        y = rows(n)
    return x.to(dtype).contiguous(), y.to(dtype).contiguous()
