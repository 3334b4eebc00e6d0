"""The warm-start read path of the kernel cache, without SQLAlchemy.

A new process whose kernels are already cached needs one indexed SELECT and a
hash check. Importing SQLAlchemy and building its engine costs ~80-100 ms,
more than everything else on a warm first call, so hits are served here with
the standard library's ``sqlite3`` on a read-only connection. Anything
unexpected (no file, a file or directory another user owns or could write, another
schema version, a locked or corrupt file, a hash mismatch) returns None, and the caller goes on to :class:`kermac_like.runtime.cache.KernelCache`,
which owns the schema, writes, recovery and eviction.

The file location and the schema stamp live in location.py, shared by both paths.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path

from .location import DB_FILENAME, SCHEMA_VERSION, TOUCH_INTERVAL_S, default_cache_dir, untrusted_reason

__all__ = ["SCHEMA_VERSION", "DB_FILENAME", "default_cache_dir", "read_kernel"]

_SELECT = (
    "SELECT k.lowered_name, k.module_sha256, m.cubin, m.last_used_at "
    "FROM kernels AS k JOIN modules AS m ON m.module_sha256 = k.module_sha256 WHERE k.key = ?"
)


def read_kernel(key: str):
    """``(cubin, lowered_name, module_sha256)`` stored under ``key`` in the
    default cache file, verified against its sha256; None on a miss or on any
    doubt (the full cache then decides)."""
    path = default_cache_dir() / DB_FILENAME
    if not path.is_file() or untrusted_reason(path.parent, path) is not None:
        return None  # (an untrusted file: the full cache warns and runs in memory)
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
