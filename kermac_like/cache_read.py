"""The warm-start read path of the kernel cache, without SQLAlchemy.

A new process whose kernels are already cached needs one indexed SELECT and a
hash check. Importing SQLAlchemy and building its engine costs ~80-100 ms,
more than everything else on a warm first call, so hits are served here with
the standard library's ``sqlite3`` on a read-only connection. Anything
unexpected (no file, another schema version, a locked or corrupt file, a hash
mismatch) returns None, and the caller goes on to :class:`kermac_like.cache.KernelCache`,
which owns the schema, writes, recovery and eviction.

The file location and the schema stamp live here so that both paths agree.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["SCHEMA_VERSION", "DB_FILENAME", "default_cache_dir", "read_kernel"]

# Bump SCHEMA_VERSION with any change to the tables (kermac_like/cache.py): a file
# stamped with another version is then moved aside and rebuilt.
SCHEMA_VERSION = 2  # 2: the autotuner's table (tuning)
DB_FILENAME = "kernels-v1.sqlite"
ENV_DIR = "KERMAC_LIKE_CACHE_DIR"
TOUCH_INTERVAL_S = 60.0  # last_used_at is refreshed at most this often per module

_SELECT = (
    "SELECT k.lowered_name, k.module_sha256, m.cubin, m.last_used_at "
    "FROM kernels AS k JOIN modules AS m ON m.module_sha256 = k.module_sha256 WHERE k.key = ?"
)


def default_cache_dir() -> Path:
    """``$KERMAC_LIKE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kermac_like``, else the
    platform's user cache dir (``~/.cache/kermac_like`` on Linux)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore relative values
        return Path(xdg) / "kermac_like"
    try:
        home = Path.home()
    except (KeyError, RuntimeError):  # no HOME and no passwd entry (some containers)
        user = os.getuid() if hasattr(os, "getuid") else "user"
        return Path(tempfile.gettempdir()) / f"kermac_like-cache-{user}"
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "kermac_like"
    if sys.platform.startswith("win"):
        local = os.environ.get("LOCALAPPDATA")
        return (Path(local) if local else home / "AppData" / "Local") / "kermac_like" / "Cache"
    return home / ".cache" / "kermac_like"


def read_kernel(key: str):
    """``(cubin, lowered_name, module_sha256)`` stored under ``key`` in the
    default cache file, verified against its sha256; None on a miss or on any
    doubt (the full cache then decides)."""
    path = default_cache_dir() / DB_FILENAME
    if not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return None
    try:
        if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            return None
        row = conn.execute(_SELECT, (key,)).fetchone()
    except sqlite3.Error:
        return None
    finally:
        conn.close()
    if row is None:
        return None
    lowered, sha, cubin, last_used = row
    cubin = bytes(cubin)
    if hashlib.sha256(cubin).hexdigest() != sha:
        return None  # the full cache removes it and recompiles
    if time.time() - last_used > TOUCH_INTERVAL_S:
        _touch(path, sha)
    return cubin, lowered, sha


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
