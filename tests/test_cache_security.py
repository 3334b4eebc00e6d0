"""The kernel cache trusts only what this user alone can write.

A cache directory or database file (or its -wal / -shm) owned by another user, or
writable by group or others, is not used: one KernelCacheWarning, then the in-memory
cache; the warm-start reader (warm.py) refuses it as well. New directories are created
0700 and new database files 0600. The tests run as any user (root included): "owned by
another user" is simulated through location._euid, group/other-writable through chmod.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings

import pytest

from kermac_like.runtime.cache import location
from kermac_like.runtime.cache import store as kc
from kermac_like.runtime.cache.store import DB_FILENAME, KernelCache, KernelCacheWarning, ModuleRecord
from kermac_like.runtime.cache.warm import read_kernel

posix = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path / "default-cache"))
    monkeypatch.setattr(kc, "_fallback_warned", False)
    kc.reset_cache()
    yield
    kc.reset_cache()


def record(tag: str) -> tuple[str, ModuleRecord]:
    key = hashlib.sha256(tag.encode()).hexdigest()
    return key, ModuleRecord(os.urandom(3000), "sm_90", 0.5, "13.0", "-arch=sm_90", ((key, f"k<{tag}>", f"_Z{tag}"),))


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def fill(directory) -> str:
    key, rec = record("stored")
    with KernelCache(directory) as c:
        c.put(rec)
        assert not c.in_memory
    return key


def opened_with_one_warning(directory, match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = KernelCache(directory)
        cache2 = KernelCache(directory)
    found = [w for w in caught if issubclass(w.category, KernelCacheWarning)]
    assert len(found) == 1 and match in str(found[0].message), [str(w.message) for w in found]
    assert cache.in_memory and cache2.in_memory
    key, rec = record("in-memory")
    cache.put(rec)  # still a working cache
    assert cache.get(key).cubin == rec.cubin
    return cache


@posix
def test_new_directory_and_file_are_owner_only(tmp_path):
    target = tmp_path / "a" / "new-cache"
    fill(target)
    assert mode(target) == 0o700
    assert mode(target / DB_FILENAME) == 0o600
    for suffix in ("-wal", "-shm"):
        extra = target / (DB_FILENAME + suffix)
        assert not extra.exists() or mode(extra) & 0o077 == 0


@posix
def test_new_file_is_owner_only_under_a_permissive_umask(tmp_path):
    old = os.umask(0o002)
    try:
        fill(tmp_path / "c")
    finally:
        os.umask(old)
    assert mode(tmp_path / "c" / DB_FILENAME) == 0o600
    key, _ = record("stored")
    assert not KernelCache(tmp_path / "c").in_memory  # a later process trusts it


@posix
@pytest.mark.parametrize("bits", [0o020, 0o002], ids=["group", "others"])
def test_directory_writable_by_group_or_others_is_not_used(tmp_path, monkeypatch, bits):
    target = tmp_path / "shared"
    key = fill(target)
    os.chmod(target, 0o700 | bits)
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(target))
    assert read_kernel(key) is None  # the warm-start reader refuses it too
    cache = opened_with_one_warning(target, "writable by group or others")
    assert cache.get(key) is None  # nothing read from it


@posix
@pytest.mark.parametrize("suffix", ["", "-wal"])
def test_database_file_writable_by_others_is_not_used(tmp_path, monkeypatch, suffix):
    target = tmp_path / "c"
    key = fill(target)
    path = target / (DB_FILENAME + suffix)
    if not path.exists():
        path.write_bytes(b"")
    os.chmod(path, 0o606)
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(target))
    assert read_kernel(key) is None
    opened_with_one_warning(target, "writable by group or others")


@posix
def test_cache_owned_by_another_user_is_not_used(tmp_path, monkeypatch):
    target = tmp_path / "theirs"
    key = fill(target)
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(target))
    assert read_kernel(key) is not None  # trusted while it is ours
    monkeypatch.setattr(location, "_euid", lambda: os.geteuid() + 4242)  # now we are someone else
    assert read_kernel(key) is None
    cache = opened_with_one_warning(target, "owned by another user")
    assert cache.get(key) is None


@posix
def test_only_the_file_owned_by_another_user(tmp_path, monkeypatch):
    target = tmp_path / "mixed"
    fill(target)
    me = os.geteuid()
    real_stat = os.stat

    class Foreign:  # the database file's stat result, with another owner
        def __init__(self, st):
            self._st = st

        def __getattr__(self, name):
            return me + 1 if name == "st_uid" else getattr(self._st, name)

    def fake_stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        return Foreign(st) if str(path) == str(target / DB_FILENAME) else st

    monkeypatch.setattr(location.os, "stat", fake_stat)
    opened_with_one_warning(target, f"{target / DB_FILENAME} is owned by another user")


@posix
def test_trusted_cache_is_used_without_warning(tmp_path, monkeypatch):
    target = tmp_path / "mine"
    key = fill(target)
    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(target))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelCacheWarning)
        assert read_kernel(key) is not None
        assert not KernelCache(target).in_memory
