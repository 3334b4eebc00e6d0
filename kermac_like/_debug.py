"""Debug switch shared by every op: ``debug=True`` or ``KERMAC_LIKE_DEBUG=1``.

Records go through :mod:`logging` under the ``kermac_like`` logger. When debug
is on and the application configured no handler for it, one stderr handler is
attached so that the records are visible in scripts and examples.
"""

from __future__ import annotations

import logging
import sys

from . import config

_root = logging.getLogger("kermac_like")
_handler_installed = False


def env_debug() -> bool:
    return config.get("debug")


def resolve(debug: bool) -> bool:
    """The effective debug flag of one call; makes sure its records are shown."""
    if not (debug or env_debug()):
        return False
    global _handler_installed
    if not _handler_installed:
        _handler_installed = True
        if not _root.handlers and not logging.getLogger().handlers:
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("[kermac_like %(name)s] %(message)s"))
            _root.addHandler(h)
        if _root.getEffectiveLevel() > logging.DEBUG:
            _root.setLevel(logging.DEBUG)
    return True
