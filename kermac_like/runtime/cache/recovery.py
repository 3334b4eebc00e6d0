"""How the cache absorbs database trouble: sort an error (locked, read-only, full,
broken, other), retry a locked database with backoff, probe a file for damage, and
serialise the decision to move a bad file aside across processes."""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from sqlalchemy import exc as sa_exc

from .schema import BUSY_TIMEOUT_S, _inspect_schema, _SchemaMismatch

try:  # POSIX only; elsewhere the quarantine step runs without an inter-process lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

T = TypeVar("T")

_LOCKED_RETRIES = 5  # on top of the busy timeout, which already waits

_DB_ERRORS = (sa_exc.DBAPIError, sqlite3.Error)


def _classify(exc: BaseException) -> str:
    """Sort a database error: 'locked' (retry), 'readonly' (reopen, else go to
    memory), 'full' (give up on this write), 'broken' (check the file, move it
    aside if bad) or 'other' (a bug here: re-raise)."""
    err = getattr(exc, "orig", None) or exc
    if isinstance(err, _SchemaMismatch):
        return "broken"
    if isinstance(err, OSError):
        return "readonly"
    if not isinstance(err, sqlite3.DatabaseError) or isinstance(
        err, (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.DataError, sqlite3.NotSupportedError)
    ):
        return "other"
    name = getattr(err, "sqlite_errorname", "") or ""  # Python >= 3.11
    msg = str(err).lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "is locked" in msg:
        return "locked"
    if (
        name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM"))
        or "readonly database" in msg
        or "unable to open database file" in msg
    ):
        return "readonly"
    if name.startswith("SQLITE_FULL") or "database or disk is full" in msg:
        return "full"
    return "broken"


def _describe(exc: BaseException) -> str:
    """The driver's message, without SQLAlchemy's statement and link decoration."""
    return str(getattr(exc, "orig", None) or exc)


def _backoff(attempt: int) -> float:
    return min(0.05 * 2**attempt, 1.0) * (0.5 + random.random())


def _retry_locked(fn: Callable[[], T]) -> T:
    attempt = 0
    while True:
        try:
            return fn()
        except _DB_ERRORS as exc:
            if _classify(exc) != "locked" or attempt >= _LOCKED_RETRIES:
                raise
            attempt += 1
            time.sleep(_backoff(attempt))


def _probe(db_file: Path, thorough: bool) -> str | None:
    """What is wrong with the file at ``db_file``, or None if it looks usable."""
    if not db_file.exists():
        return None
    con = sqlite3.connect(str(db_file), timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        problem, _fresh = _inspect_schema(lambda sql: con.execute(sql).fetchall())
        if problem is None and thorough:
            rows = con.execute("PRAGMA quick_check").fetchall()
            if rows != [("ok",)]:
                problem = "quick_check: " + "; ".join(str(row[0]) for row in rows[:5])
        return problem
    except sqlite3.Error as exc:
        # A lock or a permission problem says nothing about the contents.
        return str(exc) if _classify(exc) == "broken" else None
    finally:
        con.close()


@contextlib.contextmanager
def _interprocess_lock(lock_file: Path) -> Iterator[None]:
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # also releases the flock
