"""The cache's tables and records, its engines, and the check that a file is ours.

One program (one cubin) may hold many kernels (bulk precompile puts many name
expressions in one program), so there are two tables: a *module* row owns the cubin,
and each *kernel* row maps a key to a module and the kernel's lowered (mangled) name.
Bump ``SCHEMA_VERSION`` (location.py) with any change to the tables.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

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
    event,
)
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.pool import StaticPool

from .location import SCHEMA_VERSION

logger = logging.getLogger("kermac_like.cache")

BUSY_TIMEOUT_S = 30.0
_IN_CHUNK = 500  # keys per IN (...) clause, well below SQLite's variable limit
_KEY_RE = re.compile(r"[0-9a-f]{64}")

T = TypeVar("T")


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


# Kernel choices measured by the autotuner (kermac_like/plan/autotune.py): one row per
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


class _SchemaMismatch(sqlite3.DatabaseError):
    """The file is a SQLite database, but not a kernel cache of this schema."""


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
