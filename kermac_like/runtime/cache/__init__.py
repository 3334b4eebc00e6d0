"""The persistent kernel cache, in four parts:

* ``location``: where the SQLite file lives, the schema stamp, directory checks;
* ``schema``: the tables (modules own cubins, kernels map keys to them), the records
  the compiler hands in, the engines, the check that a file is ours;
* ``recovery``: how database trouble is sorted and absorbed (retry, probe, move aside);
* ``store``: :class:`KernelCache` and the process-wide :func:`get_cache`;

plus ``warm``, the SQLAlchemy-free read path a warm process start takes first. The
names below load on first use, so that importing ``warm`` does not import SQLAlchemy.
"""

from .location import DB_FILENAME, DEFAULT_MAX_BYTES, SCHEMA_VERSION, default_cache_dir

_LAZY = {
    "CachedKernel": "schema",
    "ModuleRecord": "schema",
    "KernelCache": "store",
    "KernelCacheWarning": "store",
    "get_cache": "store",
    "reset_cache": "store",
}
__all__ = ["DB_FILENAME", "DEFAULT_MAX_BYTES", "SCHEMA_VERSION", "default_cache_dir", *_LAZY]


def __getattr__(name):
    part = _LAZY.get(name)
    if part is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{part}", __name__), name)
