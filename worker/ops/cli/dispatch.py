"""``main``: parse the command line, load the settings, run the command, and turn how it ended
into one of ``Exit``'s statuses and one sentence on stderr (never a raw traceback)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from aio_pika.exceptions import ChannelNotFoundEntity

from worker import logs
from worker.errors import (
    ConfigurationError,
    Service,
    cannot_reach,
    innermost,
    unreachable_service,
)
from worker.ops.cli.exits import Exit, Interrupted
from worker.ops.cli.flags import load_settings
from worker.ops.cli.output import show
from worker.ops.cli.parser import build_parser
from worker.settings import Settings

log = logging.getLogger("worker")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``worker`` command; its exit status is one of ``Exit`` (or ``128 + signal``)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:  # (``worker --help | head -1``)
        _silence_stdout()
        return Exit.BROKEN_PIPE
    args.argv = argv  # (``worker run --processes N`` gives its children the same arguments)
    try:
        settings = load_settings(args)
        logs.configure(settings)
    except ConfigurationError as exc:
        parser.error(logs.redact_text(logs.printable(str(exc))))
    try:
        result: Any = args.func(settings, args)
    except (BrokenPipeError, Interrupted, KeyboardInterrupt) as exc:
        return _stopped(exc, args)
    except Exception as exc:
        return _failed(exc, args, settings)
    return int(result)


def _stopped(exc: BaseException, args: argparse.Namespace) -> int:
    """The status of a command whose output's reader went away, or that a signal stopped."""
    if isinstance(exc, BrokenPipeError):
        _silence_stdout()
        return Exit.BROKEN_PIPE
    if isinstance(exc, Interrupted):
        show(f"worker: {args.command} stopped by {exc} while starting", file=sys.stderr)
        return 128 + exc.signum
    show(f"worker: {args.command} interrupted (SIGINT)", file=sys.stderr)
    return 128 + signal.SIGINT


def _failed(exc: Exception, args: argparse.Namespace, settings: Settings) -> int:
    """The status of a command that raised ``exc``, said in one sentence (or, for an unexpected
    error, logged at CRITICAL with its traceback)."""
    if isinstance(exc, ConfigurationError):
        log.debug("worker %s failed", args.command, exc_info=exc)
        show(f"worker: error: {exc}", file=sys.stderr)
        return Exit.USAGE
    if isinstance(exc, ChannelNotFoundEntity):  # (a passive declare of a queue nobody declared)
        log.debug("worker %s failed", args.command, exc_info=exc)
        show(
            f"worker: error: RabbitMQ says {exc.args[0] if exc.args else exc}: declare the "
            "topology first (`worker declare`, or `worker migrate`), or check WORKER_QUEUE "
            "and the path of WORKER_AMQP_URL",
            file=sys.stderr,
        )
        return Exit.USAGE
    if (service := unreachable_service(exc)) is not None:
        log.debug("worker %s failed", args.command, exc_info=exc)
        url = settings.database_url if service is Service.POSTGRESQL else settings.amqp_url
        sentence = cannot_reach(service, url, logs.describe_error(innermost(exc)))
        if settings.log_format == "json":  # (what collects the logs reads one object)
            log.error("worker %s failed: %s", args.command, sentence)
        else:
            show(f"worker: error: {sentence}", file=sys.stderr)
        return Exit.UNREACHABLE
    # Through the configured handler: one JSON object with --log-format json, secrets
    # redacted, control characters escaped; never Python's raw traceback.
    log.critical("worker %s failed: %s", args.command, logs.describe_error(exc), exc_info=exc)
    return Exit.FAILED


def _silence_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and Python's flush at exit must not
    complain about it (the ``signal`` module's documented way out of a broken pipe)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
