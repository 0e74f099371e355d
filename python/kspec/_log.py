"""The C++ core's diagnostics in Python: every message to the `kspec` logger of `logging`, warnings also
through `warnings.warn` as `kspec.KspecWarning`, so `warnings.filterwarnings`, `pytest.warns` and
`logging` configuration see them (the C++ default, writing to stderr, is out of Python's reach).

Without any logging configured, a warning is shown once by `warnings` (not twice through logging's
last-resort handler) and KSPEC_VERBOSE=1's info lines are printed to stderr as the C++ default does."""
from __future__ import annotations

import atexit
import logging
import sys
import warnings

logger = logging.getLogger("kspec")


class KspecWarning(UserWarning):
    """A condition kspec worked around: a corrupt cache entry rebuilt, a read-only cache, a stale tuning
    record, a tuned algorithm that does not apply to a call."""


def _sink(level: str, message: str) -> None:
    # Called by C++ with the GIL taken, from any thread (compile threads included).
    configured = logger.hasHandlers()
    if level == "warning":
        if configured:
            logger.warning(message)
        warnings.warn(message, KspecWarning, stacklevel=2)
    elif configured:
        logger.info(message)
    else:
        print(f"[kspec] {message}", file=sys.stderr, flush=True)


def install(core) -> None:
    core.set_log_sink(_sink)
    # A C++ thread must not call into an interpreter that is shutting down.
    atexit.register(core.set_log_sink, None)
