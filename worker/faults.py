"""Named crash points for crash-consistency tests; inert unless ``WORKER_CRASH_AT`` names one.

A test starts a worker process with ``WORKER_CRASH_AT=<point>``; when the process reaches that
point it kills itself with SIGKILL, as a power cut would, with no cleanup of any kind.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

CRASH_ENV = "WORKER_CRASH_AT"

RELAY_AFTER_PUBLISH = "relay.after_publish"
"""After the relay's batch was confirmed by the broker, before its rows are deleted."""

_ARMED = os.environ.get(CRASH_ENV) or None


def crash_point(name: str) -> None:
    """Die at once with SIGKILL if this process was started to crash at ``name``."""
    if name == _ARMED:
        log.critical("crash point %s reached: killing the process", name)
        os.kill(os.getpid(), signal.SIGKILL)
