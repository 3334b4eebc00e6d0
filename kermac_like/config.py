"""The package's settings, declared once: every ``KERMAC_LIKE_*`` environment variable (and
the two of other software that the default cache directory follows), its type, default and
meaning. The rest of the package reads them through :func:`get` only, at the time of use;
tests and probes change them in a scope with :func:`override`; ``python -m kermac_like
config`` prints the effective settings.

Each type has one parser. Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any
case); an unset or empty variable means the default; any other value raises a ValueError
naming the variable and what it accepts, at the first read of that setting (an override's
value at ``override()``). A read costs one environment lookup: the parsed value is kept
while the variable's text stays the same, so ``monkeypatch.setenv`` works as well as
:func:`override`. This module imports nothing of the package (the core layer).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Callable, NamedTuple

__all__ = ["Setting", "SETTINGS", "get", "override", "describe"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_SIZE_RE = re.compile(r"(\d+)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)


class _Bad(ValueError):
    """A value its type's parser rejects (re-raised naming the setting)."""


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise _Bad


def _parse_count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise _Bad
    return int(text)


def _parse_bytes(text: str) -> int:
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise _Bad
    unit = (match.group(2) or "").lower()
    return int(match.group(1)) * 1024 ** " kmgt".index(unit or " ")


def _parse_paths(text: str) -> tuple:
    return tuple(p for p in text.split(os.pathsep) if p)


def _no_text(text: str):
    raise _Bad


class _Type(NamedTuple):
    parse: Callable  # text -> value; raises _Bad
    check: Callable  # a value given to override() -> whether it is of this type
    accepted: str


_TYPES = {
    "bool": _Type(_parse_bool, lambda v: type(v) in (bool, int) and v in (0, 1), "1/true/yes/on or 0/false/no/off"),
    "count": _Type(_parse_count, lambda v: type(v) is int and v >= 1, "a positive integer"),
    "bytes": _Type(_parse_bytes, lambda v: type(v) is int and v >= 0,
                   "a byte count such as 2147483648, 512MiB or 2G"),
    "path": _Type(str.strip, lambda v: isinstance(v, (str, os.PathLike)), "a path"),
    "paths": _Type(_parse_paths, lambda v: isinstance(v, (tuple, list)), f"paths separated by {os.pathsep!r}"),
    "choice": None,  # accepted values: the setting's own choices
    # a value only code sets, through override() (as Triton's knobs take hooks): no text parses
    "object": _Type(_no_text, lambda v: not isinstance(v, str), "a value given to override() in code (no text)"),
}


class Setting(NamedTuple):
    """One setting: ``name`` for :func:`get` and :func:`override`, read from ``env``."""

    name: str
    type: str  # a key of _TYPES
    default: object
    doc: str
    choices: tuple = ()  # a "choice" setting's values; "on" and "off" also take the boolean words
    env: str = ""  # the environment variable; "" means KERMAC_LIKE_<NAME>

    @property
    def accepted(self) -> str:
        if self.type != "choice":
            return _TYPES[self.type].accepted
        words = [str(c) for c in self.choices]
        if "on" in words:
            words = [w + (" (or 1/true/yes)" if w == "on" else " (or 0/false/no)" if w == "off" else "") for w in words]
        return ", ".join(words)

    def parse(self, text: str):
        """The value of an environment text (ValueError naming the variable if it does not parse)."""
        try:
            if self.type != "choice":
                return _TYPES[self.type].parse(text)
            t = text.strip().lower()
            if "on" in self.choices and t in _TRUE + _FALSE:
                return "on" if t in _TRUE else "off"
            for c in self.choices:
                if str(c) == t:
                    return c
            raise _Bad
        except _Bad:
            raise ValueError(f"{self.env}={text!r} is not valid; {self.env} accepts {self.accepted}") from None

    def coerce(self, value):
        """The value an override stands for: None (the default), a text (parsed), or a typed value."""
        if value is None:
            return self.default
        if isinstance(value, str):
            return self.parse(value)
        given = value
        if self.type == "choice" and isinstance(value, bool):
            value = ("off", "on")[value] if "on" in self.choices else None
        ok = value in self.choices if self.type == "choice" else _TYPES[self.type].check(value)
        if not ok:
            raise ValueError(f"override({self.name}={given!r}): {self.env} accepts {self.accepted}")
        if self.type == "paths":
            return tuple(str(p) for p in value)
        if self.type == "bool":
            return bool(value)
        return str(value) if self.type == "path" else value


def _declare(*settings: Setting) -> dict:
    out = {}
    for s in settings:
        out[s.name] = s._replace(env=s.env or f"KERMAC_LIKE_{s.name.upper()}")
    return out


SETTINGS = _declare(
    # -- for users ---------------------------------------------------------------------------
    Setting("debug", "bool", False, "log each step of every call (cache hit or miss, compile, launch), as debug=True"),
    Setting("cache_dir", "path", None, "the kernel cache's directory (default: $XDG_CACHE_HOME/kermac_like or the "
            "platform's user cache dir)"),
    Setting("cache_max_bytes", "bytes", 2 * 1024**3, "size cap of the kernel cache (least recently used kernels go first)"),
    Setting("bundle", "paths", (), "folders of prebuilt kernel bundles, read before the package's own"),
    Setting("prepare", "bool", True, "at import, a thread prepares the warm lookup (template hash, NVRTC version, "
            "cache connection)"),
    Setting("autotune", "bool", False, "time a distance call's candidate kernels once per problem class and keep the "
            "fastest (the ops' autotune=None)"),
    Setting("lineinfo", "bool", False, "compile with -lineinfo (source lines for compute-sanitizer and profilers; "
            "its own cache keys)"),
    Setting("linalg_streams", "count", 16, "most streams (and cuSOLVER handles) linalg uses for one batch"),
    Setting("centring_kernels", "bool", True, "the reference point and shifted copies of a 2-D float32 CUDA pair by "
            "the package's own kernels (off: torch's steps, whose first launches load torch's modules)"),
    Setting("jit_tier", "bool", True, "a low-K call whose kernel is not at hand runs the run-time-K kernel while the "
            "specialised one compiles (off: wait for it)"),
    # -- kernel paths (tests and probes compare them; on = the measured default) ---------------
    Setting("direct_eager", "bool", True, "eager calls that need nothing of the dispatcher call the op's "
            "implementation directly (off: through torch.library's dispatcher)"),
    Setting("wgmma", "choice", "on", "the wgmma kernels on sm_90 (off: mma.sync; always: also for calls of a few "
            "output tiles)", ("off", "on", "always")),
    Setting("wgmma_chunk", "choice", 2, "the wgmma distance kernel's 3xTF32 products summed in fresh partial sums "
            "of this many k-tiles (16 k each), added in float32 (128 x 128 tiles; 0: one running sum on the tensor "
            "cores, 128 x 256 tiles, 2-4x torch.cdist's error: bench/notes/data_zoo.md, session 22)", (0, 1, 2)),
    Setting("wgmma_tile", "choice", 256, "the columns of the wgmma distance kernel's tiles with partial sums: 128 "
            "(128 x 128), 192 (128 x 192: a's split and copies per product down by a third) or 256 (128 x 256, "
            "the partial sums column half by column half: a's work per product of one running sum; fastest on an "
            "H200, the same bits: bench/notes/data_zoo.md, session 23)", (128, 192, 256)),
    Setting("grad_mma", "bool", True, "cdist_grad on tensor cores where it applies (off: the SIMT kernel)"),
    Setting("topk_mma_version", "choice", 6, "the tensor-core top-k candidates' kernel version (6: wgmma on sm_90, "
            "else the highest that fits)", (2, 3, 4, 5, 6)),
    Setting("topk_fused_rescore", "bool", True, "knn's tensor-core candidates rescored by topk_rescore_kernel (off: "
            "torch's rescoring, the tests' oracle)"),
    Setting("knn_groups", "choice", "auto", "knn's uncertified rows again on tensor cores, in groups about centres "
            "near them (auto: where more than ops.knn.GROUP_SHARE of the rows failed and the groups resolve clusters, "
            "ops.knn.GROUP_RATIO; on: always, off: never)", ("auto", "on", "off")),
    Setting("formula_fused", "bool", True, "formula kernels (Matérn, RQ, ..., user expressions) on the fused kernels "
            "through epilogue functors (off: the formula's torch path; within 1e-5 of float64 on every data family "
            "since session 23: bench/notes/epilogue.md)"),
    Setting("cholesky_3xtf32", "bool", False, "the RFM estimators' Cholesky solve (float32 on a GPU) by the blocked "
            "factorisation with 3xTF32 tensor-core trailing updates (linalg.cholesky_3xtf32_; off: cuSOLVER's float32 "
            "potrf; unmeasured on a GPU: bench/notes/rfm.md, \"(b)\")"),
    Setting("kmeans_fused", "bool", True, "KMeans' k-means++ seeding on CUDA by the fused kernel (off: torch)"),
    Setting("kmeans_segsum", "bool", True, "Lloyd's centre update on CUDA by the fused segmented sum (off: torch's "
            "sort and segment_reduce)"),
    Setting("kmeans_assign_mma", "bool", True, "Lloyd's assignment (float32, K <= 16) on tensor cores (off: knn's "
            "argmin)"),
    Setting("kmeans_bounds", "bool", True, "Lloyd's iterations pruned by distance bounds (off: every point every "
            "iteration)"),
    Setting("kmeans_local", "choice", "auto", "the pruned assignment's certificate about each CTA's reference centre "
            "(auto: where the first assignment's global certificate leaves more than plan.kmeans.LOCAL_SHARE of the "
            "rows uncertified)", ("auto", "on", "off")),
    Setting("lse_expand", "bool", True, "kernel_logsumexp's expanded exponent where its error bound allows (off: "
            "the direct form's kernel)"),
    Setting("falkon_mma", "bool", True, "Falkon's Gaussian products on tensor cores (off: kernel_matvec's blocked "
            "float64 mode)"),
    Setting("distance_tune", "object", None, "the distance rule's spec functions and size limits that have no "
            "setting, replaced by tests and probes (a plan.distance.Tune: kermac_like.testing.spec_override; None: "
            "the shipped ones)"),
    Setting("gp_tc", "bool", True, "the GPyTorch operator's CG products on tensor cores (off: linear_operator's)"),
    Setting("gp_cg", "bool", True, "the GPyTorch operator's linear_cg without host waits (off: linear_operator's)"),
    Setting("gp_symgrad", "bool", True, "the GPyTorch training backward in one contraction pass (off: "
            "linear_operator's)"),
    Setting("gp_graph", "bool", True, "the GPyTorch pivoted-Cholesky loop as a CUDA graph (off: eager)"),
    Setting("gp_dense", "bool", True, "the GPyTorch operator's CPU products (and RBF training backward) on its kernel "
            "matrix, formed once per operator where it has at most gpytorch._operator.DENSE_CPU_ELEMENTS entries (off: "
            "kernel_matvec's blocks at every product)"),
    # -- other software's variables, read for the default cache directory --------------------
    Setting("xdg_cache_home", "path", None, "the XDG user cache directory (absolute paths only)", env="XDG_CACHE_HOME"),
    Setting("localappdata", "path", None, "Windows' local application data folder", env="LOCALAPPDATA"),
)

_UNSET = object()
# The environment as os.environ keeps it (encoded names and values): a read is one dict lookup
# (~30 ns, against ~700 ns for os.environ.get's encode and decode), and os.environ's writes
# (monkeypatch.setenv included) land in it. Elsewhere than CPython's os._Environ: os.environ itself.
_environ = os.environ
_data, _encode = getattr(_environ, "_data", None), getattr(_environ, "encodekey", None)
if not isinstance(_data, dict) or _encode is None:
    _data, _encode = _environ, str
_KEYS = {name: _encode(s.env) for name, s in SETTINGS.items()}
_parsed: dict = {}  # name -> (the environment's raw value, its parsed value)
_overrides: dict = {}  # name -> value, while override() scopes are open


def _unknown(name) -> ValueError:
    return ValueError(f"{name!r} is not a setting of kermac_like; the settings are: {', '.join(SETTINGS)}")


def _setting(name: str) -> Setting:
    s = SETTINGS.get(name)
    if s is None:
        raise _unknown(name)
    return s


def _read(name: str, raw):
    s = SETTINGS[name]
    text = _environ.get(s.env)
    value = s.default if text is None or not text.strip() else s.parse(text)
    _parsed[name] = (raw, value)
    return value


def get(name: str):
    """The effective value of setting ``name``: an open override's, else its environment
    variable's, else the default."""
    if _overrides:
        value = _overrides.get(name, _UNSET)
        if value is not _UNSET:
            return value
    try:
        raw = _data.get(_KEYS[name])
    except KeyError:
        raise _unknown(name) from None
    hit = _parsed.get(name)
    if hit is not None and hit[0] == raw:
        return hit[1]
    return _read(name, raw)


@contextlib.contextmanager
def override(**settings):
    """Set settings for the scope of a ``with`` block (process-wide, over the environment):
    ``with override(wgmma="off", kmeans_bounds=False): ...``. A value is the setting's type,
    its environment text, or None for the default. Unknown names and invalid values raise
    ValueError here, before anything changes."""
    values = {name: _setting(name).coerce(v) for name, v in settings.items()}
    saved = {name: _overrides.get(name, _UNSET) for name in values}
    _overrides.update(values)
    try:
        yield
    finally:
        for name, v in saved.items():
            if v is _UNSET:
                _overrides.pop(name, None)
            else:
                _overrides[name] = v


def describe() -> list:
    """Every setting's effective value: dicts of name, env, value, source ("override",
    "env" or "default"), accepted values and doc."""
    rows = []
    for name, s in SETTINGS.items():
        text = _environ.get(s.env)
        source = "override" if name in _overrides else "env" if text is not None and text.strip() else "default"
        rows.append(dict(name=name, env=s.env, value=get(name), source=source, accepted=s.accepted, doc=s.doc))
    return rows
