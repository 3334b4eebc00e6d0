"""The kernel store: compiled CUDA modules, shared by every process of a user.

The compiler computes a full sha256 key per kernel and hands each finished
NVRTC program in as a :class:`ModuleRecord`; the store only keeps and returns
bytes (tables: schema.py). Eviction removes whole modules, least recently used
first.

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
import sqlite3
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

import sqlalchemy
from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

# The parts: where the file lives (location), what it holds (schema), how trouble is
# absorbed (recovery). Their names are imported here so that this module reads whole.
from .location import (  # noqa: F401  (re-exported)
    DB_FILENAME,
    DEFAULT_MAX_BYTES,
    ENV_DIR as _ENV_DIR,
    SCHEMA_VERSION,
    TOUCH_INTERVAL_S as _TOUCH_INTERVAL_S,
    _resolve_max_bytes,
    _unwritable_reason,
    default_cache_dir,
)
from .recovery import (  # noqa: F401
    _DB_ERRORS,
    _LOCKED_RETRIES,
    _backoff,
    _classify,
    _describe,
    _interprocess_lock,
    _probe,
    _retry_locked,
)
from .schema import (  # noqa: F401
    BUSY_TIMEOUT_S,
    CachedKernel,
    ModuleRecord,
    _check_key,
    _chunks,
    _ensure_schema,
    _keys_arg,
    _make_engine,
    _metadata,
    _write,
    kernels_table,
    modules_table,
    tuning_table,
)
from .warm import close_reader

_IOERR_RETRIES = 3  # transient 'disk I/O error' while another process creates the file

__all__ = ["KernelCache", "KernelCacheWarning", "get_cache", "reset_cache"]

logger = logging.getLogger("kermac_like.cache")

_now = time.time  # one seam for tests that need a controlled clock

T = TypeVar("T")


class KernelCacheWarning(UserWarning):
    """The persistent kernel cache could not be used; kernels live in memory only."""


# --------------------------------------------------------------------------- the cache

_fallback_warned = False
_fallback_lock = threading.Lock()


def _stacklevel_outside_this_module() -> int:
    """The warnings.warn stacklevel (seen from _warn_fallback) of the first caller
    outside the cache package, so the warning names the user's line."""
    here = os.path.dirname(__file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
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
            f"this process only (set {_ENV_DIR} to a writable directory of your own, not "
            f"writable by group or others, to keep them)",
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
        try:
            return self._engine_with_schema()
        except _DB_ERRORS as exc:
            if _classify(exc) != "broken":
                raise
            self._quarantine(_describe(exc), thorough=False)
        # The new file is being created by several processes at once (each one that saw
        # the bad file): SQLite may report a transient I/O error while another sets up
        # the write-ahead log. Seen once in ~15 runs of the 4-process test under load.
        attempt = 0
        while True:
            try:
                return self._engine_with_schema()
            except _DB_ERRORS as exc:
                if attempt >= _IOERR_RETRIES or "disk i/o error" not in _describe(exc).lower():
                    raise
                attempt += 1
                time.sleep(_backoff(attempt))

    def _engine_with_schema(self) -> Engine:
        """An engine on the file with the schema in place (disposed again if that fails)."""
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
            close_reader()  # this process's warm-start reader lets go of the file first
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
