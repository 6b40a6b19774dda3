"""The worker's settings: environment variables prefixed ``WORKER_``, overridden by CLI flags.

Every setting is declared once in ``FIELDS``; the CLI builds its flags and help text from it, so
the environment, the flags and the documentation cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from worker.core.codec import DEFAULT_MAX_DEPTH
from worker.errors import ConfigurationError

ENV_PREFIX = "WORKER_"


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be 0 or more")
    return value


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive, finite number")
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def port(raw: str) -> int:
    """A TCP port, or 0 for none."""
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port between 0 and 65535 (0 turns it off)")
    return value


def log_format(raw: str) -> str:
    """``text`` (for people) or ``json`` (one object per line, for log collectors)."""
    value = raw.strip().lower()
    if value not in {"text", "json"}:
        raise ValueError("must be text or json")
    return value


def boolean(raw: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off`` or ``1/0``, in any case."""
    value = raw.strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ValueError("must be true or false")


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(raw: str) -> float:
    """Seconds from ``90``, ``1.5``, ``500ms``, ``10s``, ``5m``, ``2h`` or ``7d``; more than 0."""
    seconds = _seconds(raw)
    if not seconds > 0:
        raise ValueError("must be a positive, finite duration")
    return seconds


def duration_or_zero(raw: str) -> float:
    """Like ``duration``, and ``0`` (with a unit or not) for none at all."""
    seconds = _seconds(raw)
    if seconds < 0:
        raise ValueError("must be a finite duration of 0 or more")
    return seconds


def _seconds(raw: str) -> float:
    text = raw.strip().lower()
    unit = next((u for u in ("ms", "s", "m", "h", "d") if text.endswith(u)), "")
    number = text[: len(text) - len(unit)].strip()
    try:
        seconds = float(number) * _UNITS.get(unit, 1.0)
    except ValueError:
        raise ValueError("must be a duration such as 30s, 5m, 2h or 7d") from None
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError("must be a positive, finite duration")
    return seconds


def durations(raw: str) -> tuple[float, ...]:
    """A comma-separated list of durations (``1s,10s,1m``); ``none`` is the empty list."""
    if raw.strip().lower() == "none":
        return ()
    return tuple(duration(part) for part in raw.split(",") if part.strip())


def format_duration(seconds: float) -> str:
    """The shortest unit that shows ``seconds`` exactly: 604800 -> 7d, 90 -> 90s, 0.5 -> 500ms."""
    for unit in ("d", "h", "m", "s"):
        count = seconds / _UNITS[unit]
        if count >= 1 and count == int(count):
            return f"{int(count)}{unit}"
    return f"{seconds * 1000:g}ms"


def _handler_list(raw: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in raw.split(",") if part.strip())


@dataclass(frozen=True)
class Field:
    """One setting: its name, how to parse it from text, and what it is for."""

    name: str
    parse: Callable[[str], Any]
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


FIELDS: tuple[Field, ...] = (
    Field("database_url", str, "PostgreSQL URL (postgresql://user:pass@host:port/db)"),
    Field("amqp_url", str, "RabbitMQ URL (amqp://user:pass@host:port/vhost)"),
    Field("exchange", str, "durable topic exchange the worker consumes from and publishes to"),
    Field("queue", str, "durable work queue; dead letters go to <queue>.dlq"),
    Field("prefetch", positive_int, "unacknowledged deliveries the broker sends ahead"),
    Field("concurrency", positive_int, "transactions in flight at once (= database pool size)"),
    Field(
        "batch_size",
        positive_int,
        "most deliveries one transaction takes (at most prefetch; 1: a transaction per message)",
    ),
    Field(
        "batch_linger",
        duration_or_zero,
        "how long a free consumer waits for a batch to fill before it runs what it has (0: not)",
    ),
    Field("handlers", _handler_list, "comma-separated handler modules to load"),
    Field("max_body_bytes", positive_int, "larger message bodies are dead-lettered"),
    Field(
        "max_json_depth",
        positive_int,
        "bodies nesting JSON arrays/objects deeper are dead-lettered before they are parsed",
    ),
    Field(
        "failure_throttle_after",
        non_negative_int,
        "consecutive dead-lettered messages after which the worker slows down (0: never)",
    ),
    Field(
        "failure_throttle_delay",
        duration,
        "while slowed down: one message at a time, this long apart, until one succeeds",
    ),
    Field("log_level", str, "DEBUG, INFO, WARNING or ERROR"),
    Field("log_format", log_format, "text, or json for one JSON object per line"),
    Field(
        "shutdown_grace",
        duration,
        "on SIGTERM, how long in-flight messages may take to commit before they are rolled back",
    ),
    Field("http_host", str, "address of the /healthz and /metrics endpoint (0.0.0.0: every one)"),
    Field("http_port", port, "port of the /healthz and /metrics endpoint (0: none)"),
    Field(
        "http_max_connections",
        positive_int,
        "connections the endpoint serves at once; more are closed unread",
    ),
    Field("relay", boolean, "run the outbox relay inside `worker run` too"),
    Field("relay_batch_size", positive_int, "outbox rows the relay claims per transaction"),
    Field("relay_max_attempts", positive_int, "failed publishes of a row before it is parked"),
    Field(
        "relay_retry_delay",
        positive_float,
        "seconds before a failed row's first retry; doubles per attempt, at most 5 minutes",
    ),
    Field("relay_poll_interval", positive_float, "longest wait, in seconds, of an idle relay"),
    Field("outbox_notify", boolean, "NOTIFY relays after each commit that added outbox rows"),
    Field(
        "transient_attempts",
        positive_int,
        "in-process tries of a unit of work that fails transiently, before a delayed retry",
    ),
    Field(
        "retry_delays",
        durations,
        "delays of the delayed retries, one queue each (e.g. 1s,10s,1m; none: straight to DLQ)",
    ),
    Field("inbox_retention", duration, "how long inbox keys are kept (must outlast the retries)"),
    Field("janitor", boolean, "run the inbox janitor inside `worker run` too"),
    Field("janitor_interval", duration, "time between the janitor's sweeps"),
    Field("janitor_batch_size", positive_int, "expired inbox keys deleted per transaction"),
    Field(
        "workflow_lease",
        duration,
        "how long a workflow's owner keeps it between steps before another delivery may take over",
    ),
)


@dataclass(frozen=True)
class Settings:
    """The worker's configuration. Defaults match a local PostgreSQL and RabbitMQ."""

    database_url: str = "postgresql://postgres@localhost:5432/postgres"
    amqp_url: str = "amqp://guest:guest@localhost:5672/"
    exchange: str = "events"
    queue: str = "worker"
    prefetch: int = 400
    concurrency: int = 2
    batch_size: int = 100
    batch_linger: float = 0.002
    handlers: tuple[str, ...] = field(default_factory=tuple)
    max_body_bytes: int = 1024 * 1024
    max_json_depth: int = DEFAULT_MAX_DEPTH
    failure_throttle_after: int = 20
    failure_throttle_delay: float = 1.0
    log_level: str = "INFO"
    log_format: str = "text"
    shutdown_grace: float = 30.0
    http_host: str = "127.0.0.1"  # a container sets 0.0.0.0 to be scraped from outside
    http_port: int = 9180
    http_max_connections: int = 64
    relay: bool = True
    relay_batch_size: int = 100
    relay_max_attempts: int = 10
    relay_retry_delay: float = 1.0
    relay_poll_interval: float = 1.0
    outbox_notify: bool = True
    transient_attempts: int = 3
    retry_delays: tuple[float, ...] = (1.0, 10.0, 60.0)
    inbox_retention: float = 7 * 86400.0
    janitor: bool = True
    janitor_interval: float = 60.0
    janitor_batch_size: int = 1000
    workflow_lease: float = 30.0

    def __post_init__(self) -> None:
        if self.inbox_retention <= self.retry_chain:
            raise ConfigurationError(
                f"inbox_retention ({format_duration(self.inbox_retention)}) must be longer than "
                f"the delayed-retry chain ({format_duration(self.retry_chain)}): a message "
                "redelivered after its key expired would apply its effect again"
            )

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``environ`` (default: ``os.environ``), then non-None ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in FIELDS:
            raw = environ.get(spec.env)
            if raw is None or raw == "":
                continue
            try:
                values[spec.name] = spec.parse(raw)
            except ValueError as exc:
                raise ConfigurationError(f"{spec.env}={raw!r}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @property
    def retry_chain(self) -> float:
        """Seconds from a message's first failure to its last delayed retry, at the least."""
        return float(sum(self.retry_delays))

    def retry_queue(self, delay: float) -> str:
        """The queue where a message waits ``delay`` seconds before returning to the work queue."""
        return f"{self.queue}.retry.{format_duration(delay)}"

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.queue}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.queue}.dlq"

    @property
    def sqlalchemy_url(self) -> str:
        """``database_url`` with the asyncpg driver named, as SQLAlchemy needs it."""
        scheme, rest = self.database_url.split("://", 1)
        if scheme in {"postgres", "postgresql", "postgresql+asyncpg"}:
            return f"postgresql+asyncpg://{rest}"
        raise ConfigurationError(f"database_url must be a postgresql:// URL, not {scheme}://")


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``, safe to log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
