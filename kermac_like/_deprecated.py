"""Old import paths kept for one release: the names a module held before they moved, each given with a
DeprecationWarning that names its new place."""

from __future__ import annotations

import importlib
import warnings


def moved(module: str, places: dict):
    """A module ``__getattr__`` for ``module`` giving each name of ``places`` ({new module: names}) from its
    new module, with a DeprecationWarning; other names: AttributeError."""
    where = {name: new for new, names in places.items() for name in names.split()}

    def __getattr__(name):
        if name not in where:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated; import it from {where[name]}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
