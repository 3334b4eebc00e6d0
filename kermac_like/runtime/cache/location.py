"""Where the kernel cache lives, and what its two read paths agree on.

The file name, the schema stamp and the touch interval are shared by the full cache
(store.py, with SQLAlchemy) and the warm-start reader (warm.py, standard library only),
so this module imports nothing beyond the standard library and the package's settings
(kermac_like/config.py, itself standard library only). The directory checks decide
whether the file can be used at all (else the cache runs in memory): it must be writable,
and trusted: owned by this user and not writable by group or others (untrusted_reason).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ... import config

__all__ = ["SCHEMA_VERSION", "DB_FILENAME", "ENV_DIR", "DEFAULT_MAX_BYTES", "default_cache_dir", "untrusted_reason"]

# Bump SCHEMA_VERSION with any change to the tables (schema.py): a file
# stamped with another version is then moved aside and rebuilt.
SCHEMA_VERSION = 2  # 2: the autotuner's table (tuning)
DB_FILENAME = "kernels-v1.sqlite"
ENV_DIR = config.SETTINGS["cache_dir"].env
TOUCH_INTERVAL_S = 60.0  # last_used_at is refreshed at most this often per module

DEFAULT_MAX_BYTES = config.SETTINGS["cache_max_bytes"].default


def default_cache_dir() -> Path:
    """``$KERMAC_LIKE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kermac_like``, else the
    platform's user cache dir (``~/.cache/kermac_like`` on Linux)."""
    env = config.get("cache_dir")
    if env:
        return Path(env).expanduser()
    xdg = config.get("xdg_cache_home")
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
        local = config.get("localappdata")
        return (Path(local) if local else home / "AppData" / "Local") / "kermac_like" / "Cache"
    return home / ".cache" / "kermac_like"


def _resolve_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        return config.get("cache_max_bytes")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes must be an int or None, got {type(max_bytes).__name__}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return max_bytes


def _unwritable_reason(directory: Path, db_file: Path) -> str | None:
    """Why the cache cannot live in ``directory``, or None when it can. Creates the
    directory owner-only (0700) and the database file owner-only (0600; SQLite gives
    its -wal and -shm files the database file's mode) when they do not exist yet."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot create cache directory {directory} ({exc})"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"cache directory {directory} is not writable"
    if db_file.exists() and not os.access(db_file, os.R_OK | os.W_OK):
        return f"cache file {db_file} is not writable"
    reason = untrusted_reason(directory, db_file)
    if reason is not None:
        return reason
    try:  # an empty file is an empty SQLite database
        os.close(os.open(db_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create cache file {db_file} ({exc})"
    return None


def _euid() -> int | None:
    """This process's effective user id (None where the platform has none)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def untrusted_reason(directory: Path, db_file: Path) -> str | None:
    """Why the cache in ``directory`` must not be trusted, or None: the directory, the
    database file or its -wal / -shm files (those that exist) are owned by another user
    or writable by group or others, so that someone else could have put the kernels in
    it that this process would load and run. Both read paths (store.py, warm.py) apply
    it; the full cache then runs in memory with one warning."""
    uid = _euid()
    if uid is None:  # no POSIX owners and modes (Windows): nothing to check here
        return None
    for path in (directory, db_file, Path(f"{db_file}-wal"), Path(f"{db_file}-shm")):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"cannot inspect {path} ({exc})"
        if st.st_uid != uid:
            return f"{path} is owned by another user (uid {st.st_uid}, this process runs as {uid})"
        if st.st_mode & 0o022:
            return (f"{path} is writable by group or others (mode {st.st_mode & 0o777:o}; "
                    f"make it owner-only: chmod go-w)")
    return None
