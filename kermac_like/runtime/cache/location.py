"""Where the kernel cache lives, and what its two read paths agree on.

The file name, the schema stamp and the touch interval are shared by the full cache
(store.py, with SQLAlchemy) and the warm-start reader (warm.py, standard library only),
so this module imports nothing beyond the standard library. The directory checks decide
whether the file can be used at all (else the cache runs in memory).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

__all__ = ["SCHEMA_VERSION", "DB_FILENAME", "ENV_DIR", "DEFAULT_MAX_BYTES", "default_cache_dir"]

# Bump SCHEMA_VERSION with any change to the tables (schema.py): a file
# stamped with another version is then moved aside and rebuilt.
SCHEMA_VERSION = 1
DB_FILENAME = "kernels-v1.sqlite"
ENV_DIR = "KERMAC_LIKE_CACHE_DIR"
TOUCH_INTERVAL_S = 60.0  # last_used_at is refreshed at most this often per module

DEFAULT_MAX_BYTES = 2 * 1024**3
ENV_MAX_BYTES = "KERMAC_LIKE_CACHE_MAX_BYTES"


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


_SIZE_RE = re.compile(r"(\d+)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)


def _resolve_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        text = os.environ.get(ENV_MAX_BYTES, "").strip()
        if not text:
            return DEFAULT_MAX_BYTES
        match = _SIZE_RE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"{ENV_MAX_BYTES} must be a byte count such as 2147483648 or 2G, got {text!r}"
            )
        unit = (match.group(2) or "").lower()
        return int(match.group(1)) * 1024 ** " kmgt".index(unit or " ")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes must be an int or None, got {type(max_bytes).__name__}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return max_bytes


def _unwritable_reason(directory: Path, db_file: Path) -> str | None:
    """Why the cache cannot live in ``directory``, or None when it can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create cache directory {directory} ({exc})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"cache directory {directory} is not writable"
    if db_file.exists() and not os.access(db_file, os.R_OK | os.W_OK):
        return f"cache file {db_file} is not writable"
    return None
