"""Tests of the persistent kernel cache (kermac_like/runtime/cache/). CPU only.

Cubins are random bytes: the cache stores and hashes them, it never parses them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy import event

from kermac_like.runtime.cache import store as kc
from kermac_like.runtime.cache.store import (
    DB_FILENAME,
    SCHEMA_VERSION,
    CachedKernel,
    KernelCache,
    KernelCacheWarning,
    ModuleRecord,
)

CACHE_PY = Path(kc.__file__).resolve()


# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Never touch the user's cache; start each test with no warning issued yet."""
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.delenv("KERMAC_LIKE_CACHE_MAX_BYTES", raising=False)
    monkeypatch.setattr(kc, "_fallback_warned", False)
    kc.reset_cache()
    yield
    kc.reset_cache()


def key_of(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def make_record(
    tag: object, n_kernels: int = 2, size: int = 2048, arch: str = "sm_90", cubin: bytes | None = None
) -> ModuleRecord:
    """A module of ``n_kernels`` kernels whose keys are key_of(tag, j)."""
    kernels = tuple(
        (key_of(tag, j), f"kern<{tag},{j}>", f"_Z4kernIL{j}EEvv_{tag}") for j in range(n_kernels)
    )
    return ModuleRecord(
        cubin=os.urandom(size) if cubin is None else cubin,
        arch=arch,
        compile_seconds=0.25,
        nvrtc_version="13.0",
        options="-std=c++17 -arch=" + arch,
        kernels=kernels,
    )


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(str(path), isolation_level=None, timeout=30)


def cache_warnings(records) -> list:
    return [r for r in records if r.name == "kermac_like.cache" and r.levelno >= logging.WARNING]


def aside_files(directory: Path) -> list[Path]:
    moved = directory.glob(DB_FILENAME + ".corrupt-*")
    return sorted(p for p in moved if not p.name.endswith(("-wal", "-shm")))


def check_database(db_file: Path) -> dict[str, str]:
    """Integrity, no orphans, every cubin verifies; returns {key: module_sha256}."""
    con = raw(db_file)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
        assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        for sha, cubin, size in con.execute("SELECT module_sha256, cubin, size_bytes FROM modules"):
            assert hashlib.sha256(cubin).hexdigest() == sha
            assert len(cubin) == size
        orphans = con.execute(
            "SELECT count(*) FROM modules WHERE module_sha256 NOT IN (SELECT module_sha256 FROM kernels)"
        ).fetchone()[0]
        assert orphans == 0
        rows = con.execute("SELECT key, module_sha256 FROM kernels").fetchall()
    finally:
        con.close()
    keys = [k for k, _ in rows]
    assert len(keys) == len(set(keys))
    return dict(rows)


# --------------------------------------------------------------------------- basics


def test_put_get_roundtrip(tmp_path):
    cache = KernelCache(tmp_path)
    assert cache.path == tmp_path / DB_FILENAME and not cache.in_memory
    rec = make_record("a", n_kernels=3)
    cache.put(rec)
    sha = hashlib.sha256(rec.cubin).hexdigest()
    key, name, lowered = rec.kernels[1]
    hit = cache.get(key)
    assert hit == CachedKernel(key, name, lowered, sha, rec.cubin, "sm_90")
    assert "cubin" not in repr(hit) and "cubin" not in repr(rec)  # no megabytes in logs
    assert cache.get(key_of("missing")) is None
    many = cache.get_many([k for k, _, _ in rec.kernels] + [key_of("missing")])
    assert set(many) == {k for k, _, _ in rec.kernels}
    assert all(v.cubin is many[key].cubin for v in many.values())  # one blob per module
    assert cache.contains([key, key_of("missing")]) == {key}
    assert cache.contains([]) == set() and cache.get_many([]) == {}
    cache.close()
    # Persistent: a new object (as a new process would) finds it.
    again = KernelCache(tmp_path)
    assert again.get(key).cubin == rec.cubin
    again.close()


def test_put_is_insert_or_ignore(tmp_path):
    cache = KernelCache(tmp_path)
    first = make_record("x", n_kernels=2)
    cache.put(first)
    cache.put(first)  # same module again: nothing changes
    # A bulk module holding x's kernels and a new one: x's keys keep their module.
    y_kernel = (key_of("y"), "y<>", "_Zy")
    bulk = ModuleRecord(os.urandom(3000), "sm_90", 1.0, "13.0", "", first.kernels + (y_kernel,))
    cache.put(bulk)
    # A module whose every key is stored already is not kept (nothing could reach it).
    cache.put(ModuleRecord(os.urandom(3000), "sm_90", 1.0, "13.0", "", first.kernels))
    first_sha = hashlib.sha256(first.cubin).hexdigest()
    assert cache.get(first.kernels[0][0]).module_sha256 == first_sha
    assert cache.get(key_of("y")).module_sha256 == hashlib.sha256(bulk.cubin).hexdigest()
    info = cache.info()
    assert (info["n_modules"], info["n_kernels"]) == (2, 3)
    assert set(check_database(cache.path).values()) == {first_sha, hashlib.sha256(bulk.cubin).hexdigest()}


def test_bad_arguments(tmp_path):
    cache = KernelCache(tmp_path)
    with pytest.raises(ValueError, match="key"):
        cache.get("abc")
    with pytest.raises(ValueError, match="key"):
        cache.get(key_of(1).upper())
    with pytest.raises(TypeError, match="key"):
        cache.get(123)
    with pytest.raises(TypeError, match="keys"):
        cache.contains(key_of(1))  # a lone str is not a list of keys
    with pytest.raises(ValueError, match="keys"):
        cache.get_many(["nope"])
    with pytest.raises(TypeError, match="record"):
        cache.put({"cubin": b"x"})
    good = make_record("g")
    with pytest.raises(TypeError, match="cubin"):
        ModuleRecord("text", "sm_90", 0.0, "13.0", "", good.kernels)
    with pytest.raises(ValueError, match="cubin"):
        ModuleRecord(b"", "sm_90", 0.0, "13.0", "", good.kernels)
    with pytest.raises(ValueError, match="arch"):
        ModuleRecord(b"x", "", 0.0, "13.0", "", good.kernels)
    with pytest.raises(ValueError, match="compile_seconds"):
        ModuleRecord(b"x", "sm_90", -1.0, "13.0", "", good.kernels)
    with pytest.raises(ValueError, match="at least one"):
        ModuleRecord(b"x", "sm_90", 0.0, "13.0", "", ())
    with pytest.raises(ValueError, match="kernels"):
        ModuleRecord(b"x", "sm_90", 0.0, "13.0", "", ((key_of(1), "f"),))
    with pytest.raises(ValueError, match="twice"):
        ModuleRecord(b"x", "sm_90", 0.0, "13.0", "", good.kernels[:1] * 2)
    with pytest.raises(ValueError, match="kernels key"):
        ModuleRecord(b"x", "sm_90", 0.0, "13.0", "", (("k", "f", "_Zf"),))
    # Lists and bytearrays are accepted and frozen.
    rec = ModuleRecord(bytearray(b"xy"), "sm_80", 1, "13.0", "", [list(good.kernels[0])])
    assert rec.cubin == b"xy" and rec.kernels == (good.kernels[0],) and rec.compile_seconds == 1.0
    with pytest.raises(TypeError, match="max_bytes"):
        KernelCache(tmp_path, max_bytes=1.5)
    with pytest.raises(ValueError, match="max_bytes"):
        KernelCache(tmp_path, max_bytes=-1)
    with pytest.raises(TypeError, match="directory"):
        KernelCache(42)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path / "explicit"))
    assert kc.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KERMAC_LIKE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.default_cache_dir() == tmp_path / "xdg" / "kermac_like"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "platform", "linux")
    assert kc.default_cache_dir() == tmp_path / "home" / ".cache" / "kermac_like"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert kc.default_cache_dir() == tmp_path / "home" / "Library" / "Caches" / "kermac_like"
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert kc.default_cache_dir() == tmp_path / "local" / "kermac_like" / "Cache"


def test_max_bytes_from_environment(monkeypatch, tmp_path):
    assert KernelCache(tmp_path).max_bytes == kc.DEFAULT_MAX_BYTES == 2 * 1024**3
    monkeypatch.setenv("KERMAC_LIKE_CACHE_MAX_BYTES", "12345")
    assert KernelCache(tmp_path).max_bytes == 12345
    monkeypatch.setenv("KERMAC_LIKE_CACHE_MAX_BYTES", "3G")
    assert KernelCache(tmp_path).max_bytes == 3 * 1024**3
    monkeypatch.setenv("KERMAC_LIKE_CACHE_MAX_BYTES", "512MiB")
    assert KernelCache(tmp_path).max_bytes == 512 * 1024**2
    assert KernelCache(tmp_path, max_bytes=7).max_bytes == 7  # the argument wins
    monkeypatch.setenv("KERMAC_LIKE_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="KERMAC_LIKE_CACHE_MAX_BYTES"):
        KernelCache(tmp_path)


def test_info_and_clear(tmp_path):
    cache = KernelCache(tmp_path)
    cache.put(make_record("a", n_kernels=2, size=1000, arch="sm_80"))
    cache.put(make_record("b", n_kernels=3, size=500, arch="sm_90"))
    info = cache.info()
    assert info["path"] == str(tmp_path / DB_FILENAME) and info["in_memory"] is False
    assert (info["n_modules"], info["n_kernels"], info["total_bytes"]) == (2, 5, 1500)
    assert info["per_arch"] == {
        "sm_80": {"modules": 1, "kernels": 2, "bytes": 1000},
        "sm_90": {"modules": 1, "kernels": 3, "bytes": 500},
    }
    assert info["journal_mode"] == "wal" and info["schema_version"] == SCHEMA_VERSION
    assert info["sqlite_version"] == sqlite3.sqlite_version
    assert info["sqlalchemy_version"] == sqlalchemy.__version__
    assert info["max_bytes"] == cache.max_bytes and info["file_bytes"] > 0
    assert cache.clear() == 5
    assert cache.info()["n_kernels"] == 0 and cache.get(key_of("a", 0)) is None
    cache.put(make_record("c"))  # still usable after VACUUM
    assert cache.contains([key_of("c", 0)]) == {key_of("c", 0)}


def test_schema_version_stamp(tmp_path):
    KernelCache(tmp_path).close()
    con = raw(tmp_path / DB_FILENAME)
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


def test_close(tmp_path):
    cache = KernelCache(tmp_path)
    with cache:
        cache.put(make_record("a"))
    assert cache.closed
    with pytest.raises(RuntimeError, match="closed"):
        cache.get(key_of("a", 0))


# --------------------------------------------------------------------------- eviction


def test_eviction_least_recently_used_goes_first(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(kc, "_now", lambda: clock[0])
    cache = KernelCache(tmp_path, max_bytes=3500)
    recs = {}
    for i, tag in enumerate("abc"):
        clock[0] = 1000.0 + i
        recs[tag] = make_record(tag, size=1000)
        cache.put(recs[tag])
    clock[0] = 1100.0
    assert cache.get(recs["a"].kernels[0][0]) is not None  # a is now the most recently used
    clock[0] = 1101.0
    recs["d"] = make_record("d", size=1000)
    cache.put(recs["d"])  # 4000 > 3500: one module must go, the oldest by use: b
    assert cache.contains([key_of(t, 0) for t in "abcd"]) == {key_of(t, 0) for t in "acd"}
    assert cache.info()["total_bytes"] == 3000
    # Without touches, insertion order decides: c (oldest) goes.
    clock[0] = 1102.0
    cache.put(make_record("e", size=1000))
    assert cache.contains([key_of(t, 0) for t in "acde"]) == {key_of(t, 0) for t in "ade"}
    check_database(cache.path)


def test_touch_is_rate_limited(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(kc, "_now", lambda: clock[0])
    cache = KernelCache(tmp_path)
    rec = make_record("a")
    cache.put(rec)

    def last_used() -> float:
        return raw(cache.path).execute("SELECT last_used_at FROM modules").fetchone()[0]

    clock[0] = 1030.0
    cache.get(rec.kernels[0][0])
    assert last_used() == 1000.0  # < 60 s: no write on the read path
    clock[0] = 1070.0
    cache.get(rec.kernels[0][0])
    assert last_used() == 1070.0


def test_eviction_keeps_the_module_just_stored(tmp_path):
    cache = KernelCache(tmp_path, max_bytes=1000)
    cache.put(make_record("small", size=600))
    cache.put(make_record("big", size=5000))  # larger than the cap on its own
    assert cache.contains([key_of("small", 0), key_of("big", 0)]) == {key_of("big", 0)}
    check_database(cache.path)


# --------------------------------------------------------------------------- integrity


def test_tampered_cubin_is_a_miss_and_removed(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kermac_like.cache")
    cache = KernelCache(tmp_path)
    rec, other = make_record("t", n_kernels=2), make_record("u")
    cache.put(rec)
    cache.put(other)
    sha = hashlib.sha256(rec.cubin).hexdigest()
    con = raw(cache.path)
    con.execute("UPDATE modules SET cubin = ? WHERE module_sha256 = ?", (b"\x00" + rec.cubin[1:], sha))
    con.close()
    assert cache.get(rec.kernels[0][0]) is None
    warned = cache_warnings(caplog.records)
    assert len(warned) == 1 and sha in warned[0].getMessage()
    con = raw(cache.path)
    assert con.execute("SELECT count(*) FROM modules WHERE module_sha256 = ?", (sha,)).fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM kernels WHERE module_sha256 = ?", (sha,)).fetchone()[0] == 0
    con.close()
    assert cache.get_many([k for k, _, _ in rec.kernels]) == {}
    assert cache.get(other.kernels[0][0]).cubin == other.cubin  # the rest is untouched
    cache.put(rec)  # and it can be stored again
    assert cache.get(rec.kernels[1][0]).cubin == rec.cubin


def _write_foreign(db_file: Path, kind: str) -> bytes:
    db_file.parent.mkdir(parents=True, exist_ok=True)
    if kind == "garbage":
        db_file.write_bytes(os.urandom(16384))
    else:
        con = raw(db_file)
        if kind == "foreign":
            con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
            con.execute("INSERT INTO users (name) VALUES ('someone')")
        elif kind == "old_version":
            kc._metadata.create_all(sqlalchemy.create_engine(f"sqlite:///{db_file}"))
            con.execute("PRAGMA user_version = 99")
        elif kind == "missing_column":
            con.execute("CREATE TABLE modules (module_sha256 TEXT PRIMARY KEY)")
            con.execute("CREATE TABLE kernels (key TEXT PRIMARY KEY)")
            con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        con.close()
    return db_file.read_bytes()


@pytest.mark.parametrize("kind", ["garbage", "foreign", "old_version", "missing_column"])
def test_unusable_file_is_moved_aside_and_rebuilt(tmp_path, caplog, kind):
    caplog.set_level(logging.WARNING, logger="kermac_like.cache")
    db_file = tmp_path / DB_FILENAME
    original = _write_foreign(db_file, kind)
    cache = KernelCache(tmp_path)
    assert not cache.in_memory and cache.path == db_file
    assert len(cache_warnings(caplog.records)) == 1
    moved = aside_files(tmp_path)
    assert len(moved) == 1 and moved[0].read_bytes() == original
    rec = make_record("after")
    cache.put(rec)
    assert cache.get(rec.kernels[0][0]).cubin == rec.cubin
    check_database(db_file)
    cache.close()
    KernelCache(tmp_path).close()  # the rebuilt file is accepted without another warning
    assert len(cache_warnings(caplog.records)) == 1


def test_transient_io_error_while_the_new_file_is_created_is_retried(tmp_path, caplog, monkeypatch):
    """After moving a bad file aside, the new database is created by every process that
    saw the bad one: a 'disk I/O error' from SQLite then is retried, not taken for a broken
    disk (which would send the process to memory); any other error is not."""
    import sqlite3

    caplog.set_level(logging.WARNING, logger="kermac_like.cache")
    real = kc._ensure_schema
    for message, in_memory in (("disk I/O error", False), ("database disk image is malformed", True)):
        d = tmp_path / message.replace(" ", "_").replace("/", "")
        _write_foreign(d / DB_FILENAME, "garbage")
        calls = []

        def flaky(engine, message=message, calls=calls):
            calls.append(1)
            if len(calls) == 2:  # the first try on the new file
                raise sqlite3.OperationalError(message)
            return real(engine)

        monkeypatch.setattr(kc, "_ensure_schema", flaky)
        cache = KernelCache(d)
        assert cache.in_memory is in_memory, message
        assert len(calls) == 3  # garbage, the failed try, then the retry (or the in-memory database)
        cache.close()


def test_midlife_dropped_table_recovers_once(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kermac_like.cache")
    cache = KernelCache(tmp_path)
    rec = make_record("a")
    cache.put(rec)
    con = raw(cache.path)
    con.execute("DROP TABLE kernels")
    con.close()
    assert cache.get(rec.kernels[0][0]) is None  # the error is absorbed: a miss
    assert len(cache_warnings(caplog.records)) == 1 and len(aside_files(tmp_path)) == 1
    assert not cache.in_memory
    cache.put(rec)
    assert cache.get(rec.kernels[0][0]).cubin == rec.cubin
    check_database(cache.path)


def test_midlife_garbage_file_recovers(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kermac_like.cache")
    cache = KernelCache(tmp_path)
    cache.put(make_record("a"))
    # Live pooled connections can keep serving pages they have cached; a process
    # that has let its connections go (as here) meets the garbage on reconnect.
    cache._engine.dispose()
    for suffix in ("-wal", "-shm"):
        Path(f"{cache.path}{suffix}").unlink(missing_ok=True)
    _write_foreign(cache.path, "garbage")
    rec = make_record("b")
    cache.put(rec)
    assert cache.get(rec.kernels[0][0]).cubin == rec.cubin
    assert len(cache_warnings(caplog.records)) == 1 and len(aside_files(tmp_path)) == 1
    check_database(cache.path)


def _fail_statements(engine, exc_factory, *, times: int | None, needle: str = ""):
    """Make statements on ``engine`` containing ``needle`` raise, ``times`` times (None: always)."""
    state = {"left": times}

    def before(conn, cursor, statement, parameters, context, executemany):
        if needle in statement and (state["left"] is None or state["left"] > 0):
            if state["left"] is not None:
                state["left"] -= 1
            raise exc_factory()

    event.listen(engine, "before_cursor_execute", before)
    return state


def test_midlife_database_error_reopens_without_moving_a_good_file(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kermac_like.cache")
    cache = KernelCache(tmp_path)
    rec = make_record("a")
    cache.put(rec)
    _fail_statements(
        cache._engine, lambda: sqlite3.DatabaseError("database disk image is malformed"), times=1
    )
    assert cache.get(rec.kernels[0][0]).cubin == rec.cubin  # recovered, retried, found
    assert aside_files(tmp_path) == [] and cache_warnings(caplog.records) == []


def test_midlife_persistent_error_falls_back_to_memory(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)
    rec = make_record("a")
    cache.put(rec)
    make_engine = kc._make_engine

    def break_kernel_reads(engine):
        return _fail_statements(
            engine, lambda: sqlite3.DatabaseError("disk I/O error"), times=None, needle="FROM kernels"
        )

    def failing_make_engine(db_file):
        engine = make_engine(db_file)
        if db_file is not None:  # every new file engine fails too
            break_kernel_reads(engine)
        return engine

    monkeypatch.setattr(kc, "_make_engine", failing_make_engine)
    break_kernel_reads(cache._engine)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get(rec.kernels[0][0]) is None
    assert [w.category for w in caught] == [KernelCacheWarning]
    assert cache.in_memory and cache.path is None
    assert aside_files(tmp_path) == []  # the file itself checks out: it is left alone
    cache.put(rec)
    assert cache.get(rec.kernels[0][0]).cubin == rec.cubin


def test_locked_database_is_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(kc, "_backoff", lambda attempt: 0.0)
    cache = KernelCache(tmp_path)
    def locked():
        return sqlite3.OperationalError("database is locked")

    state = _fail_statements(cache._engine, locked, times=3, needle="INSERT INTO modules")
    rec = make_record("a")
    cache.put(rec)
    assert state["left"] == 0 and cache.get(rec.kernels[0][0]).cubin == rec.cubin
    # Past the retries, put gives up with a warning instead of failing the caller.
    _fail_statements(cache._engine, locked, times=None, needle="INSERT INTO modules")
    cache.put(make_record("b"))
    assert cache.contains([key_of("b", 0)]) == set()


def test_classify_errors():
    assert kc._classify(sqlite3.OperationalError("database is locked")) == "locked"
    assert kc._classify(sqlite3.OperationalError("attempt to write a readonly database")) == "readonly"
    assert kc._classify(sqlite3.OperationalError("unable to open database file")) == "readonly"
    assert kc._classify(sqlite3.OperationalError("database or disk is full")) == "full"
    assert kc._classify(sqlite3.DatabaseError("file is not a database")) == "broken"
    assert kc._classify(sqlite3.OperationalError("no such table: kernels")) == "broken"
    assert kc._classify(sqlite3.IntegrityError("UNIQUE constraint failed")) == "other"
    assert kc._classify(ValueError("x")) == "other"


# --------------------------------------------------------------------------- read-only locations


def _kernel_cache_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, KernelCacheWarning)]


def test_uncreatable_directory_falls_back_to_memory_with_one_warning(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = KernelCache(blocker / "sub")
        second = KernelCache(blocker / "other")  # same process: no second warning
    assert len(_kernel_cache_warnings(caught)) == 1
    assert caught[0].filename == __file__  # points at the caller, not at cache.py
    assert "KERMAC_LIKE_CACHE_DIR" in str(caught[0].message)
    for c in (cache, second):
        assert c.in_memory and c.path is None and c.info()["in_memory"] is True
    rec = make_record("m")
    cache.put(rec)
    assert cache.get(rec.kernels[0][0]).cubin == rec.cubin
    assert second.get(rec.kernels[0][0]) is None  # separate memory databases
    assert cache.clear() == 2


def test_unwritable_directory_falls_back_to_memory(tmp_path, monkeypatch):
    target = tmp_path / "readonly"
    target.mkdir()
    real_access = os.access

    def access(path, mode, **kwargs):  # root ignores permission bits: pretend instead
        return False if Path(path) == target else real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    with pytest.warns(KernelCacheWarning, match="not writable"):
        cache = KernelCache(target)
    assert cache.in_memory and not (target / DB_FILENAME).exists()
    cache.put(make_record("m"))
    assert cache.contains([key_of("m", 0)]) == {key_of("m", 0)}


def test_readonly_error_midlife_falls_back_to_memory(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)
    cache.put(make_record("a"))
    # The location turns read-only under us (e.g. a remount).
    monkeypatch.setattr(kc, "_unwritable_reason", lambda directory, db_file: f"{directory} is not writable")
    _fail_statements(
        cache._engine, lambda: sqlite3.OperationalError("attempt to write a readonly database"),
        times=None, needle="INSERT",
    )
    rec = make_record("b")
    with pytest.warns(KernelCacheWarning):
        cache.put(rec)
    assert cache.in_memory and cache.get(rec.kernels[0][0]).cubin == rec.cubin


def test_memory_cache_is_thread_safe(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.warns(KernelCacheWarning):
        cache = KernelCache(blocker / "sub")
    _hammer_with_threads(cache)


# --------------------------------------------------------------------------- threads, forks, processes


def _hammer_with_threads(cache: KernelCache, n_threads: int = 8, per_thread: int = 10) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                rec = make_record(f"{t}-{i}", size=1024)
                cache.put(rec)
                shared = make_record("shared", cubin=b"same bytes for everyone")
                cache.put(shared)
                assert cache.get(rec.kernels[0][0]).cubin == rec.cubin
                assert cache.get(shared.kernels[1][0]).cubin == b"same bytes for everyone"
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    info = cache.info()
    assert info["n_modules"] == n_threads * per_thread + 1
    assert info["n_kernels"] == 2 * (n_threads * per_thread + 1)


def test_file_cache_is_thread_safe(tmp_path):
    cache = KernelCache(tmp_path)
    _hammer_with_threads(cache)
    check_database(cache.path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_opens_its_own_connections(tmp_path):
    cache = KernelCache(tmp_path)
    parent_rec, child_rec = make_record("parent"), make_record("child")
    cache.put(parent_rec)
    parent_engine = cache._engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads alive (3.12+)
        pid = os.fork()
    if pid == 0:  # child: report through the exit status only
        status = 1
        try:
            ok = cache.get(parent_rec.kernels[0][0]).cubin == parent_rec.cubin
            cache.put(child_rec)
            status = 0 if ok and cache._engine is not parent_engine else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert cache._engine is parent_engine
    assert cache.get(child_rec.kernels[0][0]).cubin == child_rec.cubin


# A rank of a DDP job: loads cache.py on its own (no torch import: 8 ranks on 2
# cores start quickly), waits for the go signal, then opens the cache and writes.
_WORKER = r"""
import hashlib, importlib.util, json, logging, os, random, sys, time
logging.basicConfig(level=logging.DEBUG, format="%(process)d %(relativeCreated)d %(message)s")
cache_py, directory, rank, n_modules, n_kernels, sync = sys.argv[1:]
rank, n_modules, n_kernels = int(rank), int(n_modules), int(n_kernels)
import types
top = os.path.dirname(os.path.dirname(os.path.dirname(cache_py)))  # kermac_like/
for name, path in (("", top), (".runtime", os.path.join(top, "runtime")), (".runtime.cache", os.path.dirname(cache_py))):
    pkg = types.ModuleType("kermac_like_standalone" + name)  # bare parents: cache.py's relative imports
    pkg.__path__ = [path]                                    # (and kermac_like.config) resolve without
    sys.modules[pkg.__name__] = pkg                          # running any __init__
spec = importlib.util.spec_from_file_location("kermac_like_standalone.runtime.cache.store", cache_py)
kc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = kc
spec.loader.exec_module(kc)

def key(*parts):
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()

def module(i):  # the same bytes and keys in every rank that builds module i
    cubin = random.Random(i).randbytes(4096 + 64 * i)
    return kc.ModuleRecord(cubin, "sm_90", 0.1, "13.0", "-arch=sm_90",
                           tuple((key("m", i, j), f"k<{i},{j}>", f"_Zk{i}_{j}") for j in range(n_kernels)))

mine = list(range(4 * rank, 4 * rank + n_modules))
random.Random(rank).shuffle(mine)
open(os.path.join(sync, f"ready-{rank}"), "w").close()
while not os.path.exists(os.path.join(sync, "go")):
    time.sleep(0.001)
cache = kc.KernelCache(directory)
for i in mine:
    cache.put(module(i))
# A bulk module that repeats two kernels other ranks also store, plus one of its own.
shared = (module(mine[0]).kernels[0], module(mine[1]).kernels[1])
bulk = kc.ModuleRecord(random.Random(1000 + rank).randbytes(3000), "sm_90", 0.5, "13.0", "-arch=sm_90",
                       shared + ((key("bulk", rank), "b<>", "_Zb"),))
cache.put(bulk)
keys = [k for i in mine for k, _, _ in module(i).kernels] + [key("bulk", rank)]
got = cache.get_many(keys)
assert set(got) == set(keys), "missing keys"
assert all(hashlib.sha256(v.cubin).hexdigest() == v.module_sha256 for v in got.values())
print(json.dumps({"rank": rank, "in_memory": cache.in_memory, "path": str(cache.path)}))
"""


def _run_ranks(
    tmp_path: Path, directory: Path, n_ranks: int, n_modules: int = 20, n_kernels: int = 3
) -> list[dict]:
    """Start n_ranks workers, release them together, then check the database."""
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(CACHE_PY), str(directory), str(rank),
             str(n_modules), str(n_kernels), str(sync)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(n_ranks)
    ]
    deadline = time.monotonic() + 60
    while len(list(sync.glob("ready-*"))) < n_ranks:  # all started: now they really overlap
        assert time.monotonic() < deadline, "workers did not start"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
        time.sleep(0.01)
    (sync / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert not result["in_memory"], err
        results.append(result)
    expected = {key_of("m", i, j) for i in range(4 * (n_ranks - 1) + n_modules) for j in range(n_kernels)}
    expected |= {key_of("bulk", r) for r in range(n_ranks)}
    stored = check_database(directory / DB_FILENAME)
    assert set(stored) == expected
    return results


def test_many_processes_write_one_fresh_cache_at_once(tmp_path):
    _run_ranks(tmp_path, tmp_path / "cache", n_ranks=8)


def test_many_processes_meet_one_corrupt_file(tmp_path):
    directory = tmp_path / "cache"
    _write_foreign(directory / DB_FILENAME, "garbage")
    _run_ranks(tmp_path, directory, n_ranks=4, n_modules=8)
    assert len(aside_files(directory)) == 1  # moved aside once, not once per rank


# --------------------------------------------------------------------------- the singleton


def test_get_cache_singleton(tmp_path, monkeypatch):
    first = kc.get_cache()
    assert first is kc.get_cache()
    assert first.path == tmp_path / "default-cache" / DB_FILENAME
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path / "elsewhere"))
    moved = kc.get_cache()
    assert moved is not first and moved.path == tmp_path / "elsewhere" / DB_FILENAME
    kc.reset_cache()
    assert moved.closed
    fresh = kc.get_cache()
    assert fresh is not moved and fresh is kc.get_cache()
    fresh.close()
    assert kc.get_cache() is not fresh  # a closed singleton is replaced


def test_get_cache_is_thread_safe(tmp_path):
    seen: list[KernelCache] = []
    barrier = threading.Barrier(8)

    def grab() -> None:
        barrier.wait()
        seen.append(kc.get_cache())

    threads = [threading.Thread(target=grab) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(seen) == 8 and all(c is seen[0] for c in seen)


# -- the SQLAlchemy-free warm-start reader ---------------------------------------------------
def test_fast_reader_agrees_with_cache(tmp_path, monkeypatch):
    import sqlite3

    from kermac_like.runtime.cache.warm import DB_FILENAME, read_kernel

    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path))
    cubin = os.urandom(5000)
    k = hashlib.sha256(b"fast-reader").hexdigest()
    with KernelCache(tmp_path) as c:
        c.put(ModuleRecord(cubin, "sm_90", 0.5, "13.0", "-arch=sm_90", ((k, "kern<1>", "_Zkern1"),)))
    got = read_kernel(k)
    assert got == (cubin, "_Zkern1", hashlib.sha256(cubin).hexdigest())
    assert read_kernel(hashlib.sha256(b"absent").hexdigest()) is None
    db = sqlite3.connect(tmp_path / DB_FILENAME)
    with db:
        db.execute("UPDATE modules SET cubin = ?", (b"tampered",))
    assert read_kernel(k) is None  # the full cache then removes the row
    with db:
        db.execute("PRAGMA user_version = 99")
    db.close()
    assert read_kernel(k) is None


_PREPARE_CHILD = r"""
import json, sys
import kermac_like
from kermac_like.runtime.cache import warm
from kermac_like.runtime import compiler, store
t = store.prepare_thread
if t is not None:
    t.join(30)
print(json.dumps(dict(
    started=t is not None,
    hash=compiler.template_hash.cache_info().currsize,
    nvrtc=compiler.nvrtc_version.cache_info().currsize,
    reader=warm._open_reader is not None and str(warm._open_reader[2]),
    threads=[th.name for th in __import__("threading").enumerate() if th.name.startswith("kermac_like")])))
"""


@pytest.mark.parametrize("off", [False, True])
def test_import_prepares_the_warm_lookup_in_a_thread(tmp_path, off):
    """import kermac_like (where cuda.core is installed) starts one daemon thread that computes the
    kernel keys' process-wide inputs and opens the read-only connection to an existing cache
    file, and ends; KERMAC_LIKE_PREPARE=0 starts none (the first call then does it)."""
    pytest.importorskip("cuda.core")
    cache = KernelCache(tmp_path)
    cache.put(make_record("a"))
    cache.close()
    env = dict(os.environ, KERMAC_LIKE_CACHE_DIR=str(tmp_path))
    env.pop("KERMAC_LIKE_PREPARE", None)
    if off:
        env["KERMAC_LIKE_PREPARE"] = "0"
    out = subprocess.run([sys.executable, "-c", _PREPARE_CHILD], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if off:
        assert got == dict(started=False, hash=0, nvrtc=0, reader=False, threads=[])
    else:
        assert got == dict(started=True, hash=1, nvrtc=1, reader=str(tmp_path / DB_FILENAME), threads=[])
