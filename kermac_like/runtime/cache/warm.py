"""The warm-start read path of the kernel cache, without SQLAlchemy.

A new process whose kernels are already cached needs one indexed SELECT and a
hash check. Importing SQLAlchemy and building its engine costs ~80-100 ms,
more than everything else on a warm first call, so hits are served here with
the standard library's ``sqlite3`` on a read-only connection. Anything
unexpected (no file, a file or directory another user owns or could write, another
schema version, a locked or corrupt file, a hash mismatch) returns None, and the caller goes on to :class:`kermac_like.runtime.cache.KernelCache`,
which owns the schema, writes, recovery and eviction.

The file location and the schema stamp live in location.py, shared by both paths.

Bundles (:func:`read_bundled`): read-only kernel-cache files of prebuilt kernels that
``python -m kermac_like precompile --bundle DIR`` writes (the shipped instantiations
for one architecture), looked up after a miss in the user's cache and before any
compile: a new process with an empty cache then loads the bundle's cubins instead of
running NVRTC (bench/notes/jit.md). Where a bundle is found: the folders of
``$KERMAC_LIKE_BUNDLE`` (separated like PATH), then ``kermac_like/prebuilt/`` beside the
package. Same keys as the cache (so the same package version, templates, options and
NVRTC version); a file or folder writable by group or others, or owned by another user
than this one or root, is ignored.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sqlite3
import time
from pathlib import Path

from .location import DB_FILENAME, SCHEMA_VERSION, TOUCH_INTERVAL_S, default_cache_dir, untrusted_reason

__all__ = ["SCHEMA_VERSION", "DB_FILENAME", "ENV_BUNDLE", "default_cache_dir", "read_kernel", "read_kernel_status", "read_bundled",
           "bundle_dirs", "package_bundle_dir"]

ENV_BUNDLE = "KERMAC_LIKE_BUNDLE"

_SELECT = (
    "SELECT k.lowered_name, k.module_sha256, m.cubin, m.last_used_at "
    "FROM kernels AS k JOIN modules AS m ON m.module_sha256 = k.module_sha256 WHERE k.key = ?"
)


def read_kernel(key: str):
    """``(cubin, lowered_name, module_sha256)`` stored under ``key`` in the
    default cache file, verified against its sha256; None on a miss or on any
    doubt (the full cache then decides)."""
    return read_kernel_status(key)[0]


def read_kernel_status(key: str):
    """(:func:`read_kernel`'s answer, whether the key is known to be absent): True when
    there is no cache file yet or the file is sound and has no such row, so that the
    caller may compile without asking the full cache first; False on any doubt."""
    path = default_cache_dir() / DB_FILENAME
    if not path.exists():
        return None, True
    if not path.is_file() or untrusted_reason(path.parent, path) is not None:
        return None, False  # (an untrusted file: the full cache warns and runs in memory)
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return None, False
    try:
        if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            return None, False
        row = conn.execute(_SELECT, (key,)).fetchone()
    except sqlite3.Error:
        return None, False
    finally:
        conn.close()
    if row is None:
        return None, True
    lowered, sha, cubin, last_used = row
    cubin = bytes(cubin)
    if hashlib.sha256(cubin).hexdigest() != sha:
        return None, False  # the full cache removes it and recompiles
    if time.time() - last_used > TOUCH_INTERVAL_S:
        _touch(path, sha)
    return (cubin, lowered, sha), False


def _touch(path: Path, sha: str) -> None:
    """Refresh the module's LRU time; best effort (a read-only cache stays as is)."""
    try:
        conn = sqlite3.connect(str(path), timeout=0.2)
        try:
            with conn:
                conn.execute("UPDATE modules SET last_used_at = ? WHERE module_sha256 = ?", (time.time(), sha))
        finally:
            conn.close()
    except sqlite3.Error:
        pass


def package_bundle_dir() -> Path:
    """``kermac_like/prebuilt/``: the bundle folder that ships with the package."""
    return Path(__file__).resolve().parents[2] / "prebuilt"


def bundle_dirs() -> tuple:
    """The bundle folders in lookup order: ``$KERMAC_LIKE_BUNDLE``'s, then the package's."""
    env = os.environ.get(ENV_BUNDLE, "")
    dirs = [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    return tuple(dirs) + (package_bundle_dir(),)


def _bundle_untrusted(directory: Path, db_file: Path) -> str | None:
    """Why a bundle must not be read, or None: like the package's own files, it may belong
    to root (an installed package) or to this user, and nobody else may write it."""
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is None:
        return None
    for path in (directory, db_file):
        st = os.stat(path)
        if st.st_uid not in (uid, 0):
            return f"{path} is owned by another user (uid {st.st_uid})"
        if st.st_mode & 0o022:
            return f"{path} is writable by group or others"
    return None


@functools.lru_cache(maxsize=16)
def _bundle_files(dirs: tuple) -> tuple:
    out = []
    for d in dirs:
        f = d / DB_FILENAME
        try:
            if f.is_file() and _bundle_untrusted(d, f) is None:
                out.append(f)
        except OSError:
            continue
    return tuple(out)


def read_bundled(key: str):
    """``(cubin, lowered_name, module_sha256)`` of ``key`` from the first bundle that has
    it (verified against its sha256), else None. Read-only and immutable: a bundle is
    never written after ``precompile --bundle`` made it."""
    for path in _bundle_files(bundle_dirs()):
        try:
            conn = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True)
        except sqlite3.Error:
            continue
        try:
            if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                continue
            row = conn.execute(_SELECT, (key,)).fetchone()
        except sqlite3.Error:
            continue
        finally:
            conn.close()
        if row is None:
            continue
        lowered, sha, cubin, _ = row
        cubin = bytes(cubin)
        if hashlib.sha256(cubin).hexdigest() == sha:
            return cubin, lowered, sha
    return None
