"""Persistent store of compiled CUDA modules, shared by every process of a user.

The compiler computes a full sha256 key per kernel and hands each finished
NVRTC program in as a :class:`ModuleRecord`; this module only stores and
returns bytes. One program (one cubin) may hold many kernels (bulk precompile
puts many name expressions in one program), so there are two tables: a
*module* row owns the cubin, and each *kernel* row maps a key to a module and
the kernel's lowered (mangled) name. Eviction removes whole modules.

The file is ``kernels-v1.sqlite`` in :func:`default_cache_dir`. The ranks of a
DDP job read and write it at once, so: WAL journal, a busy timeout on every
connection, ``BEGIN IMMEDIATE`` for writes (a deferred transaction that later
wants to write can fail at once instead of waiting), insert-or-ignore rows,
short transactions, and a few retries when SQLite still reports a lock.

Failures never take the caller down:

* a file that is not ours (garbage, another schema, another schema version)
  is renamed to ``<name>.corrupt-<timestamp>`` and rebuilt, with one logged
  warning; a database error in the middle of a run triggers the same check;
* a location that cannot be written falls back to an in-memory database with
  one :class:`KernelCacheWarning` per process;
* every cubin is checked against its sha256 before it is returned; a module
  that fails the check is deleted and reported as a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import sqlite3
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import sqlalchemy
from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    delete,
    event,
    func,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import StaticPool

try:  # POSIX only; elsewhere the quarantine step runs without an inter-process lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "CachedKernel",
    "DB_FILENAME",
    "DEFAULT_MAX_BYTES",
    "KernelCache",
    "KernelCacheWarning",
    "ModuleRecord",
    "SCHEMA_VERSION",
    "default_cache_dir",
    "get_cache",
    "reset_cache",
]

logger = logging.getLogger("kermac_like.cache")

# The file location and the schema stamp are shared with the SQLAlchemy-free
# warm-start reader (cache_read.py); bump SCHEMA_VERSION there with any change
# to the tables below.
from .cache_read import DB_FILENAME, SCHEMA_VERSION, default_cache_dir  # noqa: E402

DEFAULT_MAX_BYTES = 2 * 1024**3
BUSY_TIMEOUT_S = 30.0

_ENV_DIR = "KERMAC_LIKE_CACHE_DIR"
_ENV_MAX_BYTES = "KERMAC_LIKE_CACHE_MAX_BYTES"

from .cache_read import TOUCH_INTERVAL_S as _TOUCH_INTERVAL_S  # noqa: E402
_LOCKED_RETRIES = 5  # on top of the busy timeout, which already waits
_IN_CHUNK = 500  # keys per IN (...) clause, well below SQLite's variable limit
_KEY_RE = re.compile(r"[0-9a-f]{64}")

_now = time.time  # one seam for tests that need a controlled clock

T = TypeVar("T")


class KernelCacheWarning(UserWarning):
    """The persistent kernel cache could not be used; kernels live in memory only."""


# --------------------------------------------------------------------------- schema

_metadata = MetaData()

# Small columns come before the cubin so that scans for eviction and statistics
# read them from the row's first page instead of walking the blob's overflow pages.
modules_table = Table(
    "modules",
    _metadata,
    Column("module_sha256", String(64), primary_key=True),
    Column("arch", String, nullable=False),
    Column("size_bytes", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("last_used_at", Float, nullable=False),
    Column("compile_seconds", Float, nullable=False),
    Column("nvrtc_version", Text, nullable=False),
    Column("options", Text, nullable=False),
    Column("cubin", LargeBinary, nullable=False),
    Index("ix_modules_lru", "last_used_at", "size_bytes"),
)

kernels_table = Table(
    "kernels",
    _metadata,
    Column("key", String(64), primary_key=True),
    Column(
        "module_sha256",
        String(64),
        ForeignKey("modules.module_sha256", ondelete="CASCADE"),
        nullable=False,
        index=True,
    ),
    Column("name_expression", Text, nullable=False),
    Column("lowered_name", Text, nullable=False),
    Column("arch", String, nullable=False),
    Column("created_at", Float, nullable=False),
)


# Kernel choices measured by the autotuner (kermac_like/tuning.py): one row per
# tuning key (problem class, device, template hash), the winner and every timing.
tuning_table = Table(
    "tuning",
    _metadata,
    Column("key", Text, primary_key=True),
    Column("choice", Text, nullable=False),
    Column("timings", Text, nullable=False),  # JSON {candidate: milliseconds}
    Column("device", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class CachedKernel:
    """One kernel found in the cache, with the (verified) cubin of its module."""

    key: str
    name_expression: str
    lowered_name: str
    module_sha256: str
    cubin: bytes = field(repr=False)
    arch: str


@dataclass(frozen=True)
class ModuleRecord:
    """One compiled NVRTC program, as the compiler hands it in.

    ``kernels`` holds ``(key, name_expression, lowered_name)`` for every kernel
    of the program; ``key`` is the caller's full 64-hex sha256.
    """

    cubin: bytes = field(repr=False)
    arch: str
    compile_seconds: float
    nvrtc_version: str
    options: str
    kernels: tuple[tuple[str, str, str], ...]

    def __post_init__(self) -> None:
        cubin = self.cubin
        if isinstance(cubin, (bytearray, memoryview)):
            cubin = bytes(cubin)
            object.__setattr__(self, "cubin", cubin)
        if not isinstance(cubin, bytes):
            raise TypeError(f"cubin must be bytes, got {type(cubin).__name__}")
        if not cubin:
            raise ValueError("cubin must not be empty")
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(f"arch must be a non-empty str such as 'sm_90', got {self.arch!r}")
        seconds = self.compile_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
            raise ValueError(f"compile_seconds must be a number >= 0, got {seconds!r}")
        object.__setattr__(self, "compile_seconds", float(seconds))
        for name in ("nvrtc_version", "options"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        if isinstance(self.kernels, (str, bytes)) or not isinstance(self.kernels, Iterable):
            raise TypeError("kernels must be a sequence of (key, name_expression, lowered_name)")
        kernels = tuple(tuple(entry) for entry in self.kernels)
        if not kernels:
            raise ValueError("kernels must name at least one kernel of the module")
        seen: set[str] = set()
        for entry in kernels:
            if len(entry) != 3 or not all(isinstance(part, str) and part for part in entry):
                raise ValueError(
                    "kernels entries must be (key, name_expression, lowered_name), three "
                    f"non-empty str; got {entry!r}"
                )
            _check_key(entry[0], "kernels key")
            if entry[0] in seen:
                raise ValueError(f"kernels: key {entry[0]} appears twice")
            seen.add(entry[0])
        object.__setattr__(self, "kernels", kernels)


def _check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a str, got {type(key).__name__}")
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"{what} must be a full sha256 as 64 lowercase hex digits, got {key!r}")
    return key


def _keys_arg(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be an iterable of str keys, not a single str")
    return list(dict.fromkeys(_check_key(key, "keys item") for key in keys))


def _chunks(items: Sequence[T], size: int = _IN_CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --------------------------------------------------------------------------- locations


_SIZE_RE = re.compile(r"(\d+)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)


def _resolve_max_bytes(max_bytes: int | None) -> int:
    if max_bytes is None:
        text = os.environ.get(_ENV_MAX_BYTES, "").strip()
        if not text:
            return DEFAULT_MAX_BYTES
        match = _SIZE_RE.fullmatch(text)
        if match is None:
            raise ValueError(
                f"{_ENV_MAX_BYTES} must be a byte count such as 2147483648 or 2G, got {text!r}"
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


# --------------------------------------------------------------------------- errors


class _SchemaMismatch(sqlite3.DatabaseError):
    """The file is a SQLite database, but not a kernel cache of this schema."""


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


# --------------------------------------------------------------------------- engines


def _on_begin(conn: Connection) -> None:
    # pysqlite's own transaction handling is switched off (isolation_level=None
    # in _make_engine), so each transaction starts here. Writers take the write
    # lock up front: upgrading a deferred read transaction can fail at once with
    # SQLITE_BUSY instead of waiting for the busy timeout.
    if conn.get_execution_options().get("kermac_like_write"):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


def _make_engine(db_file: Path | None) -> Engine:
    """An engine on ``db_file``, or on a private in-memory database for None."""
    if db_file is None:
        # One connection shared by all threads (StaticPool): a new connection to
        # sqlite:// would be a new, empty database. KernelCache serialises its use.
        engine = create_engine(
            "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
    else:
        engine = create_engine(
            URL.create("sqlite", database=str(db_file)),
            connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False},
        )
    on_disk = db_file is not None

    def on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Per-connection settings only: nothing here writes to the file, which
        # may still turn out to be someone else's (WAL is set in _ensure_schema).
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            cursor.execute("PRAGMA foreign_keys = ON")
            if on_disk:
                cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", _on_begin)
    return engine


@contextlib.contextmanager
def _write(engine: Engine) -> Iterator[Connection]:
    """A connection inside one short BEGIN IMMEDIATE ... COMMIT."""
    with engine.connect() as conn:
        conn.execution_options(kermac_like_write=True)
        yield conn
        conn.commit()


def _inspect_schema(query: Callable[[str], list]) -> tuple[str | None, bool]:
    """(problem, fresh): what makes this database not our cache, if anything,
    and whether it is still empty (the tables must be created)."""
    version = query("PRAGMA user_version")[0][0]
    tables = {
        row[0]
        for row in query("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
    }
    if version == 0 and not tables:
        return None, True
    if version != SCHEMA_VERSION:
        if version == 0:
            return f"not a kermac_like kernel cache (tables: {', '.join(sorted(tables))})", False
        return f"schema version {version}, expected {SCHEMA_VERSION}", False
    for table in _metadata.sorted_tables:
        present = {row[1] for row in query(f"PRAGMA table_info({table.name})")}
        missing = sorted(column.name for column in table.columns if column.name not in present)
        if missing:
            return f"table {table.name} lacks columns {', '.join(missing)}", False
    return None, False


def _enable_wal(engine: Engine) -> None:
    """Put the file in WAL mode (stored in the file, so once is enough; checked
    on every open in case something switched it back)."""
    raw = engine.raw_connection()
    try:  # outside any transaction: the journal mode cannot change inside one
        driver = raw.driver_connection
        if str(driver.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
            mode = driver.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":  # e.g. a file system without shared memory
                logger.debug("kernel cache %s: journal_mode is %s, not wal", engine.url.database, mode)
    finally:
        raw.close()


def _ensure_schema(engine: Engine) -> None:
    """Create the tables in an empty database; raise _SchemaMismatch for a foreign one."""
    with engine.connect() as conn:
        problem, fresh = _inspect_schema(lambda sql: conn.exec_driver_sql(sql).all())
    if problem:
        raise _SchemaMismatch(problem)
    if engine.url.database:
        _enable_wal(engine)
    if not fresh:
        return
    with _write(engine) as conn:
        # Look again under the write lock: another process may have created the
        # tables (and stamped the version) since the unlocked look above.
        problem, fresh = _inspect_schema(lambda sql: conn.exec_driver_sql(sql).all())
        if problem:
            raise _SchemaMismatch(problem)
        if fresh:
            _metadata.create_all(conn)
            conn.exec_driver_sql(f"PRAGMA user_version = {SCHEMA_VERSION}")


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


# --------------------------------------------------------------------------- the cache

_fallback_warned = False
_fallback_lock = threading.Lock()


def _stacklevel_outside_this_module() -> int:
    """The warnings.warn stacklevel (seen from _warn_fallback) of the first caller
    outside this file, so the warning names the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _warn_fallback(reason: str) -> None:
    global _fallback_warned
    with _fallback_lock:
        first = not _fallback_warned
        _fallback_warned = True
    if first:
        warnings.warn(
            f"kermac_like kernel cache: {reason}; compiled kernels are kept in memory for "
            f"this process only (set {_ENV_DIR} to a writable directory to keep them)",
            KernelCacheWarning,
            stacklevel=_stacklevel_outside_this_module(),
        )
    else:
        logger.debug("kernel cache in memory: %s", reason)


class KernelCache:
    """Compiled modules in one SQLite file (or in memory when that file cannot be used).

    Thread-safe; after ``fork`` the child opens its own connections. ``get``,
    ``get_many``, ``contains`` and ``put`` never raise for database trouble:
    they recover, or report a miss / skip the write with a logged warning.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, max_bytes: int | None = None):
        if directory is None:
            directory = default_cache_dir()
        elif not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory must be a str, a path or None, got {type(directory).__name__}")
        self._max_bytes = _resolve_max_bytes(max_bytes)
        self._directory = Path(directory).expanduser()
        self._file = self._directory / DB_FILENAME
        self._lock = threading.RLock()  # engine swaps; all use of the in-memory database
        self._pid = os.getpid()
        self._path: Path | None = None
        self._engine: Engine | None = None
        self._open()

    # ----------------------------------------------------------------- properties

    @property
    def path(self) -> Path | None:
        """The SQLite file, or None while the cache runs in memory."""
        return self._path

    @property
    def in_memory(self) -> bool:
        return self._path is None

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def closed(self) -> bool:
        return self._engine is None

    def __repr__(self) -> str:
        where = "memory" if self.in_memory else str(self._path)
        return f"KernelCache({where}, max_bytes={self._max_bytes})"

    def __enter__(self) -> KernelCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- public API

    def get(self, key: str) -> CachedKernel | None:
        """The kernel stored under ``key`` with its verified cubin, or None."""
        _check_key(key)
        return self._lookup([key]).get(key)

    def get_many(self, keys: Iterable[str]) -> dict[str, CachedKernel]:
        """The stored kernels among ``keys``, by key (absent keys are left out)."""
        return self._lookup(_keys_arg(keys))

    def contains(self, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` are stored (cubins are not read or verified)."""
        wanted = _keys_arg(keys)

        def op(engine: Engine) -> set[str]:
            k = kernels_table.c
            found: set[str] = set()
            with engine.connect() as conn:
                for chunk in _chunks(wanted):
                    found.update(conn.execute(select(k.key).where(k.key.in_(chunk))).scalars())
            return found

        return self._run(op, what="contains", on_give_up=set()) if wanted else set()

    def put(self, record: ModuleRecord) -> None:
        """Store a module and its kernels; rows already present are left as they are.
        Then evict least-recently-used modules while the total exceeds max_bytes."""
        if not isinstance(record, ModuleRecord):
            raise TypeError(f"record must be a ModuleRecord, got {type(record).__name__}")
        sha = hashlib.sha256(record.cubin).hexdigest()
        now = _now()
        module_row = {
            "module_sha256": sha,
            "arch": record.arch,
            "size_bytes": len(record.cubin),
            "created_at": now,
            "last_used_at": now,
            "compile_seconds": record.compile_seconds,
            "nvrtc_version": record.nvrtc_version,
            "options": record.options,
            "cubin": record.cubin,
        }
        kernel_rows = [
            {
                "key": key,
                "module_sha256": sha,
                "name_expression": name_expression,
                "lowered_name": lowered_name,
                "arch": record.arch,
                "created_at": now,
            }
            for key, name_expression, lowered_name in record.kernels
        ]

        def op(engine: Engine) -> tuple[bool, int, list[str]]:
            m, k = modules_table.c, kernels_table.c
            with _write(engine) as conn:
                insert_module = sqlite_insert(modules_table).values(module_row).on_conflict_do_nothing()
                inserted = conn.execute(insert_module).rowcount > 0
                if not inserted:
                    conn.execute(update(modules_table).where(m.module_sha256 == sha).values(last_used_at=now))
                conn.execute(sqlite_insert(kernels_table).on_conflict_do_nothing(), kernel_rows)
                count_refs = select(func.count()).select_from(kernels_table).where(k.module_sha256 == sha)
                n_refs = conn.execute(count_refs).scalar_one()
                if n_refs == 0:
                    # Every key is already served by another module (e.g. compiled
                    # alone before a bulk precompile): keep no unreachable cubin.
                    conn.execute(delete(modules_table).where(m.module_sha256 == sha))
                evicted = self._evict(conn, keep=sha)
            return inserted, n_refs, evicted

        result = self._run(op, what="put", on_give_up=None)
        if result is not None:
            inserted, n_refs, evicted = result
            logger.debug(
                "kernel cache put module %s (%s, %d bytes, %d kernels, %s); evicted %d modules",
                sha[:16], record.arch, len(record.cubin), n_refs,
                "new" if inserted else "known", len(evicted),
            )

    def info(self) -> dict[str, Any]:
        """Location, counts and sizes, overall and per arch, and library versions."""

        def op(engine: Engine) -> dict[str, Any]:
            m, k = modules_table.c, kernels_table.c
            per_arch: dict[str, dict[str, int]] = {}
            with engine.connect() as conn:
                rows = conn.execute(
                    select(m.arch, func.count(), func.coalesce(func.sum(m.size_bytes), 0)).group_by(m.arch)
                ).all()
                for arch, n_modules, n_bytes in rows:
                    per_arch[arch] = {"modules": n_modules, "kernels": 0, "bytes": n_bytes}
                for arch, n_kernels in conn.execute(select(k.arch, func.count()).group_by(k.arch)).all():
                    per_arch.setdefault(arch, {"modules": 0, "kernels": 0, "bytes": 0})["kernels"] = n_kernels
                journal_mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
            return {"per_arch": dict(sorted(per_arch.items())), "journal_mode": journal_mode}

        stats = self._run(op, what="info")
        per_arch = stats["per_arch"]
        path = self._path
        file_bytes = 0
        if path is not None:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    file_bytes += os.path.getsize(f"{path}{suffix}")
        return {
            "path": None if path is None else str(path),
            "directory": str(self._directory),
            "in_memory": path is None,
            "schema_version": SCHEMA_VERSION,
            "n_modules": sum(v["modules"] for v in per_arch.values()),
            "n_kernels": sum(v["kernels"] for v in per_arch.values()),
            "total_bytes": sum(v["bytes"] for v in per_arch.values()),
            "max_bytes": self._max_bytes,
            "file_bytes": file_bytes,
            "per_arch": per_arch,
            "journal_mode": stats["journal_mode"],
            "sqlite_version": sqlite3.sqlite_version,
            "sqlalchemy_version": sqlalchemy.__version__,
        }

    def clear(self) -> int:
        """Delete every module and kernel; return how many kernels were removed."""

        def op(engine: Engine) -> int:
            with _write(engine) as conn:
                n = conn.execute(select(func.count()).select_from(kernels_table)).scalar_one()
                conn.execute(delete(kernels_table))
                conn.execute(delete(modules_table))
            return n

        removed = self._run(op, what="clear")

        def vacuum(engine: Engine) -> None:
            raw = engine.raw_connection()
            try:  # outside any transaction: VACUUM refuses to run inside one
                raw.driver_connection.execute("VACUUM")
                if self._path is not None:
                    raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                raw.close()

        self._run(vacuum, what="vacuum", best_effort=True)
        logger.info("kernel cache %s cleared: %d kernels removed", self._path or "(memory)", removed)
        return removed

    def get_tuning(self, key: str) -> tuple[str, str] | None:
        """(choice, timings JSON) stored by the autotuner under ``key``, or None."""
        def op(engine: Engine):
            with engine.connect() as conn:
                row = conn.execute(
                    select(tuning_table.c.choice, tuning_table.c.timings).where(tuning_table.c.key == key)
                ).first()
            return None if row is None else (row[0], row[1])

        return self._run(op, what="tuning read", best_effort=True)

    def tuning_rows(self) -> list:
        """Every stored (key, choice, timings JSON, device), by key."""
        def op(engine: Engine):
            with engine.connect() as conn:
                t = tuning_table.c
                return [tuple(r) for r in conn.execute(select(t.key, t.choice, t.timings, t.device).order_by(t.key))]

        return self._run(op, what="tuning read", best_effort=True) or []

    def put_tuning(self, key: str, choice: str, timings: str, device: str) -> None:
        """Store (or replace) the autotuner's winner for ``key``; concurrent writers of
        one key leave one complete row (the last one)."""
        def op(engine: Engine):
            with _write(engine) as conn:
                conn.execute(tuning_table.delete().where(tuning_table.c.key == key))
                conn.execute(tuning_table.insert().values(key=key, choice=choice, timings=timings, device=device,
                                                          created_at=_now()))

        self._run(op, what="tuning write", on_give_up=None)

    def close(self) -> None:
        """Release all connections; the object cannot be used afterwards."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()

    # ----------------------------------------------------------------- internals

    def _lookup(self, keys: list[str]) -> dict[str, CachedKernel]:
        if not keys:
            return {}

        def op(engine: Engine) -> tuple[list, dict[str, tuple[bytes, float]]]:
            k = kernels_table.c
            m = modules_table.c
            with engine.connect() as conn:  # one read transaction: a consistent snapshot
                kernel_rows = []
                for chunk in _chunks(keys):
                    kernel_rows += conn.execute(
                        select(k.key, k.name_expression, k.lowered_name, k.module_sha256, k.arch)
                        .where(k.key.in_(chunk))
                    ).all()
                # Cubins once per module, not once per kernel row (bulk modules hold many).
                shas = sorted({row.module_sha256 for row in kernel_rows})
                cubins: dict[str, tuple[bytes, float]] = {}
                for chunk in _chunks(shas):
                    for sha, cubin, last_used in conn.execute(
                        select(m.module_sha256, m.cubin, m.last_used_at).where(m.module_sha256.in_(chunk))
                    ):
                        cubins[sha] = (bytes(cubin), last_used)
            return kernel_rows, cubins

        fetched = self._run(op, what="get", on_give_up=None)
        if fetched is None:
            return {}
        kernel_rows, cubins = fetched
        now = _now()
        verified: dict[str, bool] = {}
        bad: set[str] = set()
        stale: set[str] = set()
        found: dict[str, CachedKernel] = {}
        for key, name_expression, lowered_name, sha, arch in kernel_rows:
            module = cubins.get(sha)
            if module is None:  # cannot happen with foreign keys on; treat as a miss
                continue
            cubin, last_used = module
            ok = verified.get(sha)
            if ok is None:
                ok = verified[sha] = hashlib.sha256(cubin).hexdigest() == sha
            if not ok:
                bad.add(sha)
                continue
            if now - last_used >= _TOUCH_INTERVAL_S:
                stale.add(sha)
            found[key] = CachedKernel(key, name_expression, lowered_name, sha, cubin, arch)
        if bad:
            self._discard(sorted(bad))
        if stale:
            self._touch(sorted(stale), now)
        return found

    def _discard(self, shas: list[str]) -> None:
        def op(engine: Engine) -> int:
            with _write(engine) as conn:
                return self._delete_modules(conn, shas)

        removed = self._run(op, what="discard", on_give_up=0)
        for sha in shas:
            logger.warning(
                "kernel cache %s: module %s failed its sha256 check (the cubin changed on disk); "
                "removed it (%d kernel rows in all) and will recompile",
                self._path or "(memory)", sha, removed,
            )

    def _touch(self, shas: list[str], now: float) -> None:
        def op(engine: Engine) -> None:
            m = modules_table.c
            with _write(engine) as conn:
                for chunk in _chunks(shas):
                    conn.execute(
                        update(modules_table)
                        .where(m.module_sha256.in_(chunk), m.last_used_at < now)
                        .values(last_used_at=now)
                    )

        self._run(op, what="touch", best_effort=True)

    @staticmethod
    def _delete_modules(conn: Connection, shas: Sequence[str]) -> int:
        removed = 0
        for chunk in _chunks(shas):
            kernel_rows = delete(kernels_table).where(kernels_table.c.module_sha256.in_(chunk))
            removed += conn.execute(kernel_rows).rowcount
            conn.execute(delete(modules_table).where(modules_table.c.module_sha256.in_(chunk)))
        return removed

    def _evict(self, conn: Connection, keep: str) -> list[str]:
        """Inside a write transaction: drop least-recently-used modules (never
        ``keep``, the one just stored) until the total size fits max_bytes."""
        m = modules_table.c
        total = conn.execute(select(func.coalesce(func.sum(m.size_bytes), 0))).scalar_one()
        if total <= self._max_bytes:
            return []
        victims: list[str] = []
        candidates = conn.execute(
            select(m.module_sha256, m.size_bytes)
            .where(m.module_sha256 != keep)
            .order_by(m.last_used_at, m.created_at)
        ).all()
        for sha, size in candidates:
            if total <= self._max_bytes:
                break
            victims.append(sha)
            total -= size
        self._delete_modules(conn, victims)
        if victims:
            logger.debug("kernel cache evicted %d modules to stay under %d bytes",
                         len(victims), self._max_bytes)
        return victims

    def _serialised(self) -> contextlib.AbstractContextManager:
        # The in-memory database is one connection shared by all threads.
        return self._lock if self._path is None else contextlib.nullcontext()

    def _current_engine(self) -> Engine:
        if self._pid != os.getpid():
            self._after_fork()
        engine = self._engine
        if engine is None:
            raise RuntimeError("this KernelCache is closed")
        return engine

    def _after_fork(self) -> None:
        # Connections (and a lock some other thread may have held) are not
        # usable in a forked child: start over without touching the parent's.
        self._lock = threading.RLock()
        self._pid = os.getpid()
        old = self._engine
        if old is None:
            return
        old.dispose(close=False)
        if self._path is None:
            engine = _make_engine(None)
            _ensure_schema(engine)
            self._engine = engine
        else:
            self._engine = _make_engine(self._path)

    def _run(
        self,
        op: Callable[[Engine], T],
        *,
        what: str,
        best_effort: bool = False,
        on_give_up: Any = ...,
    ) -> T:
        """Run ``op`` against the current engine, absorbing database trouble:
        retry while locked; on a broken or read-only file recover once (check the
        file, move it aside if bad, reopen); if that fails too, go to memory.

        best_effort: any database error is logged at debug level and None returned.
        on_give_up: when given, returned (after a warning) instead of raising once
        the retries are spent or the disk is full."""
        recovered = fell_back = False
        locked_tries = 0
        while True:
            engine = self._current_engine()
            try:
                with self._serialised():
                    return op(engine)
            except _DB_ERRORS + (OSError,) as exc:
                kind = _classify(exc)
                if kind == "other":
                    raise
                if best_effort:
                    logger.debug("kernel cache %s skipped: %s", what, exc)
                    return None  # type: ignore[return-value]
                if kind == "locked" and locked_tries < _LOCKED_RETRIES:
                    locked_tries += 1
                    time.sleep(_backoff(locked_tries))
                    continue
                if kind in ("broken", "readonly") and not recovered:
                    recovered = True
                    self._recover(engine, kind, exc)
                    continue
                if kind in ("broken", "readonly") and not fell_back and self._path is not None:
                    fell_back = True
                    self._fall_back(engine, f"{self._file} still fails after recovery ({_describe(exc)})")
                    continue
                if on_give_up is not ...:
                    logger.warning("kernel cache %s failed (%s); carrying on without it",
                                   what, _describe(exc))
                    return on_give_up
                raise

    def _open(self) -> None:
        """Use the file if it can be used, else an in-memory database."""
        reason = _unwritable_reason(self._directory, self._file)
        if reason is None:
            try:
                self._engine = self._open_file()
                self._path = self._file
                return
            except _DB_ERRORS + (OSError,) as exc:
                if _classify(exc) == "other":
                    raise
                reason = f"cannot use {self._file} ({_describe(exc)})"
        self._use_memory(reason)

    def _open_file(self) -> Engine:
        engine = _make_engine(self._file)
        try:
            _retry_locked(lambda: _ensure_schema(engine))
            return engine
        except _DB_ERRORS as exc:
            engine.dispose()
            if _classify(exc) != "broken":
                raise
            self._quarantine(_describe(exc), thorough=False)
        engine = _make_engine(self._file)
        try:
            _retry_locked(lambda: _ensure_schema(engine))
        except BaseException:
            engine.dispose()
            raise
        return engine

    def _quarantine(self, reason: str, *, thorough: bool) -> bool:
        """Move the file aside if it is still bad, deciding under an inter-process
        lock: when several processes hit the same bad file, the first moves it and
        rebuilds, the others then find a good file and leave it alone."""
        with _interprocess_lock(self._file.with_name(self._file.name + ".lock")):
            problem = _probe(self._file, thorough)
            if problem is None:
                return False
            stamp = time.strftime("%Y%m%d-%H%M%S")
            aside = self._file.with_name(f"{self._file.name}.corrupt-{stamp}")
            n = 1
            while aside.exists():
                aside = self._file.with_name(f"{self._file.name}.corrupt-{stamp}-{n}")
                n += 1
            # The bad file's WAL and shared-memory files go with it, and before it:
            # once the main file is gone another process may create a new database
            # at the same path, whose own -wal/-shm must not be taken away.
            for suffix in ("-wal", "-shm", ""):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{self._file}{suffix}", f"{aside}{suffix}")
        if reason != problem:
            problem = f"{problem}; first seen as: {reason}"
        logger.warning(
            "kernel cache %s is unusable (%s); moved it to %s and started a new one",
            self._file, problem, aside,
        )
        return True

    def _recover(self, failed: Engine, kind: str, exc: BaseException) -> None:
        with self._lock:
            if self._engine is not failed:
                return  # another thread already recovered
            failed.dispose()
            if self._path is None:  # the in-memory database itself failed: start a new one
                engine = _make_engine(None)
                _ensure_schema(engine)
                self._engine = engine
                return
            logger.debug("kernel cache %s: %s error (%s); recovering", self._file, kind, exc)
            if kind == "broken":
                try:
                    self._quarantine(_describe(exc), thorough=True)
                except OSError as err:
                    logger.debug("kernel cache %s: cannot quarantine (%s)", self._file, err)
            self._open()

    def _fall_back(self, failed: Engine, reason: str) -> None:
        with self._lock:
            if self._engine is not failed:
                return
            failed.dispose()
            self._use_memory(reason)

    def _use_memory(self, reason: str) -> None:
        engine = _make_engine(None)
        _ensure_schema(engine)
        self._engine = engine
        self._path = None
        _warn_fallback(reason)


# --------------------------------------------------------------------------- singleton

_singleton: tuple[Path, KernelCache] | None = None
_singleton_lock = threading.Lock()


def get_cache() -> KernelCache:
    """The process-wide cache in :func:`default_cache_dir`, created on first use
    and created again when that directory changes (e.g. KERMAC_LIKE_CACHE_DIR)."""
    global _singleton
    directory = default_cache_dir()
    current = _singleton
    if current is not None and current[0] == directory and not current[1].closed:
        return current[1]
    with _singleton_lock:
        current = _singleton
        if current is None or current[0] != directory or current[1].closed:
            current = (directory, KernelCache(directory))
            _singleton = current
        return current[1]


def reset_cache() -> None:
    """Forget (and close) the process-wide cache; the next get_cache() opens a new one."""
    global _singleton
    with _singleton_lock:
        current, _singleton = _singleton, None
    if current is not None:
        current[1].close()


def _reinit_locks_in_child() -> None:
    global _singleton_lock, _fallback_lock
    _singleton_lock = threading.Lock()
    _fallback_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_locks_in_child)
