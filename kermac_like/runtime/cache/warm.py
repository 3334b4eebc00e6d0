"""The warm-start read path of the kernel cache, without SQLAlchemy.

A new process whose kernels are already cached needs one indexed SELECT and a
hash check. Importing SQLAlchemy and building its engine costs ~80-100 ms,
more than everything else on a warm first call, so hits are served here with
the standard library's ``sqlite3`` on a read-only connection, one per process (opened
on the first read, again after a fork or when the file at the cache's path is no longer
the one opened; the directory and file checks and the schema stamp are read on every
lookup). Anything
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
import stat
import threading
import time
from pathlib import Path

from ... import config
from .location import DB_FILENAME, SCHEMA_VERSION, TOUCH_INTERVAL_S, default_cache_dir, untrusted_reason

__all__ = ["SCHEMA_VERSION", "DB_FILENAME", "ENV_BUNDLE", "default_cache_dir", "read_kernel", "read_kernel_status", "read_bundled",
           "open_reader", "bundle_dirs", "package_bundle_dir"]

ENV_BUNDLE = config.SETTINGS["bundle"].env

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
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None, True
    except OSError:
        return None, False
    if not stat.S_ISREG(st.st_mode) or untrusted_reason(path.parent, path) is not None:
        return None, False  # (an untrusted file: the full cache warns and runs in memory)
    with _reader_lock:
        try:
            rows = _query(_reader(path, st), key)
        except sqlite3.Error:
            _forget_reader()
            return None, False
        found = _verified(rows[0]) if rows else None  # None on a mismatch: the full cache removes it
    if not rows:
        return None, rows is not None  # (None: another schema version)
    if found is not None and time.time() - rows[0][3] > TOUCH_INTERVAL_S:
        _touch(path, found[2])
    return found, False


def _query(conn: sqlite3.Connection, key: str):
    """The rows of ``key`` (all fetched: no statement left open) in a file of this schema
    version; None in a file of another."""
    if conn.execute("PRAGMA user_version").fetchall()[0][0] != SCHEMA_VERSION:
        return None
    return conn.execute(_SELECT, (key,)).fetchall()


# Cubins this process found equal to their sha256, by that sha256. A module's other kernels (a
# bundle's program holds 4, a call often takes 2-3 of them) are then checked by comparing the bytes
# read with these (a memcmp) instead of hashing them again: one sha256 per module and process, every
# lookup still checked against the row's sha256. Bounded (the oldest module out past _VERIFIED_MAX);
# read and written under _reader_lock.
_verified_cubins: dict = {}
_VERIFIED_MAX = 64
hash_count = 0  # sha256 computations of cubins by this process (tests count the warm lookup's work)


def _verified(row):
    """(cubin, lowered name, module sha256) of a row whose cubin matches its sha256, else None."""
    global hash_count
    lowered, sha, cubin, _ = row
    cubin = bytes(cubin)
    if _verified_cubins.get(sha) == cubin:
        return cubin, lowered, sha
    hash_count += 1
    if hashlib.sha256(cubin).hexdigest() != sha:
        return None
    if len(_verified_cubins) >= _VERIFIED_MAX:
        del _verified_cubins[next(iter(_verified_cubins))]
    _verified_cubins[sha] = cubin
    return cubin, lowered, sha


# The process's read-only connection to the cache file: (pid, (device, inode) of the file
# opened, path, connection); read under _reader_lock. A fork or another file at the path
# (moved aside and rebuilt by the full cache) opens a new one; the old one is left alone
# (a connection must not be used, nor closed, across a fork: the parent's locks).
_reader_lock = threading.Lock()
_open_reader = None
_left = []  # connections inherited through a fork, never touched again


def _reader(path: Path, st) -> sqlite3.Connection:
    global _open_reader
    ident = (os.getpid(), (st.st_dev, st.st_ino), path)
    if _open_reader is not None and _open_reader[:3] == ident:
        return _open_reader[3]
    _forget_reader()
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=1.0, check_same_thread=False)
    _open_reader = (*ident, conn)
    return conn


def _forget_reader() -> None:
    global _open_reader
    old, _open_reader = _open_reader, None
    if old is None:
        return
    if old[0] == os.getpid():
        old[3].close()
    else:
        _left.append(old[3])


def close_reader() -> None:
    """Close this process's connection to the cache file (the full cache calls it before
    moving a bad file aside); the next read opens a new one."""
    with _reader_lock:
        _forget_reader()


def _after_fork_in_child() -> None:
    global _reader_lock
    _reader_lock = threading.Lock()  # another thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _touch(path: Path, sha: str) -> None:
    """Refresh the module's LRU time; best effort (a read-only cache stays as is)."""
    try:
        conn = sqlite3.connect(str(path), timeout=0.2)
        try:
            conn.execute("PRAGMA synchronous = NORMAL")  # WAL: no fsync per commit (the full cache's setting)
            with conn:
                conn.execute("UPDATE modules SET last_used_at = ? WHERE module_sha256 = ?", (time.time(), sha))
        finally:
            conn.close()
    except sqlite3.Error:
        pass


def open_reader() -> None:
    """Open this process's read-only connections to the bundles and to the cache file and read
    their schema stamps, as the first lookup does (:func:`kermac_like.runtime.store.prepare_in_background`
    does it before the first call). A file that is not trusted is left alone; OSError where there
    is no cache file, sqlite3.Error where one cannot be read."""
    for bundle in _bundle_files(bundle_dirs()):  # the bundles' connections and schema stamps
        with _reader_lock:
            try:
                _bundle_reader(bundle).execute("PRAGMA user_version").fetchall()
            except sqlite3.Error:  # (the lookup skips it too)
                _bundle_conns.pop(bundle, None)
    path = default_cache_dir() / DB_FILENAME
    st = os.stat(path)
    if stat.S_ISREG(st.st_mode) and untrusted_reason(path.parent, path) is None:
        with _reader_lock:
            _reader(path, st).execute("PRAGMA user_version").fetchall()


@functools.lru_cache(maxsize=None)
def package_bundle_dir() -> Path:
    """``kermac_like/prebuilt/``: the bundle folder that ships with the package (resolved once per
    process: a resolve is a system call per path component, on every lookup before)."""
    return Path(__file__).resolve().parents[2] / "prebuilt"


def bundle_dirs() -> tuple:
    """The bundle folders in lookup order: ``$KERMAC_LIKE_BUNDLE``'s, then the package's."""
    dirs = [Path(p).expanduser() for p in config.get("bundle")]
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
    never written after ``precompile --bundle`` made it (one connection per bundle file and
    process)."""
    for path in _bundle_files(bundle_dirs()):
        with _reader_lock:
            try:
                rows = _query(_bundle_reader(path), key)
            except sqlite3.Error:
                _bundle_conns.pop(path, None)
                continue
            found = _verified(rows[0]) if rows else None
        if found is not None:
            return found
    return None


_bundle_conns: dict = {}  # bundle file -> (pid, read-only connection), read under _reader_lock


def _bundle_reader(path: Path) -> sqlite3.Connection:
    pid = os.getpid()
    entry = _bundle_conns.get(path)
    if entry is not None and entry[0] == pid:
        return entry[1]
    if entry is not None:
        _left.append(entry[1])  # inherited through a fork: left alone
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro&immutable=1", uri=True, check_same_thread=False)
    _bundle_conns[path] = (pid, conn)
    return conn
