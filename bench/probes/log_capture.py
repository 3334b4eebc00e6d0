"""The messages a logger of the package emits, collected in a list (for probes that read the
debug or info log: autotune timings, CG residual histories)."""

import logging


def captured(name: str, level: int) -> list:
    """A list that receives every message of logger ``name`` at ``level`` or above from now on
    (clear it between runs)."""
    messages = []

    class _Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger(name)
    logger.addHandler(_Collect())
    logger.setLevel(level)
    return messages
