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

from worker.errors import ConfigurationError

ENV_PREFIX = "WORKER_"


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive, finite number")
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def boolean(raw: str) -> bool:
    """``true/false``, ``yes/no``, ``on/off`` or ``1/0``, in any case."""
    value = raw.strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ValueError("must be true or false")


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
    Field("handlers", _handler_list, "comma-separated handler modules to load"),
    Field("max_body_bytes", positive_int, "larger message bodies are dead-lettered"),
    Field("log_level", str, "DEBUG, INFO, WARNING or ERROR"),
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
)


@dataclass(frozen=True)
class Settings:
    """The worker's configuration. Defaults match a local PostgreSQL and RabbitMQ."""

    database_url: str = "postgresql://postgres@localhost:5432/postgres"
    amqp_url: str = "amqp://guest:guest@localhost:5672/"
    exchange: str = "events"
    queue: str = "worker"
    prefetch: int = 32
    concurrency: int = 8
    handlers: tuple[str, ...] = field(default_factory=tuple)
    max_body_bytes: int = 1024 * 1024
    log_level: str = "INFO"
    relay: bool = True
    relay_batch_size: int = 100
    relay_max_attempts: int = 10
    relay_retry_delay: float = 1.0
    relay_poll_interval: float = 1.0
    outbox_notify: bool = True

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
