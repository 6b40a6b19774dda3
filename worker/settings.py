"""The worker's settings: environment variables prefixed ``WORKER_``, overridden by CLI flags.

Every setting is declared once, as a field of ``Settings`` made by ``setting``: its type, default,
parser, group and help together. ``FIELDS`` derives from those declarations, and the CLI's flags,
each command's help and the documentation's settings table (``docs/configuration.md``, generated
when the site is built) derive from ``FIELDS``, so the environment, the flags and the
documentation cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from worker import redaction
from worker.core.codec import DEFAULT_MAX_DEPTH, DEFAULT_MAX_ITEMS
from worker.errors import ConfigurationError

ENV_PREFIX = "WORKER_"
_T = TypeVar("_T")


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


def listen_port(raw: str) -> int:
    """A TCP port to listen on; 0 for a free one the system picks."""
    value = int(raw)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port between 0 and 65535 (0: a free one)")
    return value


MIN_TOKEN_LENGTH = 16
"""The shortest bearer token accepted: a token is the only secret between a client and the
ingress, so one a person could guess is refused at start."""

_BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")
"""RFC 6750's ``b64token``: what an ``Authorization: Bearer`` header can carry."""

MAX_CLIENT_NAME_LENGTH = 64
_CLIENT_NAME = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_CLIENT_NAME_LENGTH}}}")
"""A client's name (``name:token``): what scopes its keys and results at the ingress."""


def token_client(entry: str) -> tuple[str, str]:
    """(client name, token) of one ``ingress_tokens`` entry, ``name:token`` or a bare token.

    A bare token's client is ``token-`` and 12 hex digits of its SHA-256, stable while the token
    is (``:`` is no token character, so the first one ends the name). ``ValueError`` (which never
    repeats the entry) for a name or a token out of their alphabets, or a short token."""
    name, colon, token = entry.partition(":")
    if not colon:
        name, token = "token-" + hashlib.sha256(entry.encode("utf-8")).hexdigest()[:12], entry
    if not _CLIENT_NAME.fullmatch(name):
        raise ValueError(
            f"a client name (before the colon) must be 1 to {MAX_CLIENT_NAME_LENGTH} letters, "
            "digits or -._"
        )
    if len(token) < MIN_TOKEN_LENGTH or not _BEARER_TOKEN.fullmatch(token):
        raise ValueError(
            f"each token must be at least {MIN_TOKEN_LENGTH} characters of letters, digits "
            "and -._~+/ (trailing = allowed)"
        )
    return name, token


def console_url(raw: str) -> str:
    """An ``http(s)://host[:port]`` address with nothing after the host (no path, query or
    user), without its trailing slash; empty for none."""
    url = raw.strip().rstrip("/")
    if not url:
        return ""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be http://host[:port] or https://host[:port]")
    if parts.path or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("must name a scheme, a host and a port only")
    return url


def networks(raw: str) -> tuple[str, ...]:
    """A comma-separated list of IP addresses or networks (``10.0.0.5``, ``10.0.0.0/8``,
    ``fd00::/8``), each kept as its network's text; blanks dropped."""
    found = []
    for part in _handler_list(raw):
        try:
            found.append(str(ipaddress.ip_network(part, strict=False)))
        except ValueError:
            raise ValueError(f"{part!r} is no IP address or network") from None
    return tuple(found)


def bearer_tokens(raw: str) -> tuple[str, ...]:
    """A comma-separated list of bearer tokens, each ``name:token`` or a bare token (see
    ``token_client``); a value that names no token at all (``,``) is refused, never taken as
    "no authentication"."""
    _no_placeholder(raw)
    tokens = tuple(part.strip() for part in raw.split(","))
    if not any(tokens):
        raise ValueError("names no token: leave it unset (or empty) for no authentication")
    if not all(tokens):
        raise ValueError("has an empty entry between commas")
    for token in tokens:
        token_client(token)
    return tokens


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


_NEXT_BROKER_URL = re.compile(r"\s*,\s*(?=[a-z][a-z0-9+.-]*://)", re.IGNORECASE)
"""Where one broker URL of a list ends: a comma before the next URL's scheme (``amqp://``), so
that a comma inside a URL (a password, a query) is no separator."""


def broker_urls(raw: str) -> tuple[str, ...]:
    """The broker URLs of ``raw``: one ``amqp://`` (or ``amqps://``) URL, or several separated
    by commas, the nodes of one cluster in the order they are tried first."""
    return tuple(part for part in _NEXT_BROKER_URL.split(raw.strip()) if part)


_PLACEHOLDER = re.compile(r"<[^<>]*>")
"""A deployment example's placeholder left in a value: ``<generate: openssl rand -hex 24>``."""


def _no_placeholder(raw: str) -> None:
    if _PLACEHOLDER.search(raw):
        raise ValueError(
            "holds a placeholder (<...>) from a deployment example: replace it with a real "
            "secret, e.g. from `openssl rand -hex 24`"
        )


def postgresql_url(raw: str) -> str:
    """A PostgreSQL URL, with no placeholder of a deployment example left in it."""
    _no_placeholder(raw)
    return raw


def broker_url_list(raw: str) -> str:
    """``raw`` checked to be ``broker_urls`` of the ``amqp`` or ``amqps`` scheme, with a host,
    and no placeholder of a deployment example left in it."""
    _no_placeholder(raw)
    urls = broker_urls(raw)
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme.lower() not in {"amqp", "amqps"} or not parts.hostname:
            raise ValueError(
                "must be amqp:// or amqps:// URLs with a host, several separated by commas"
            )
    if not urls:
        raise ValueError("must be an amqp:// or amqps:// URL")
    return ",".join(urls)


QUEUE_TYPES = ("classic", "quorum")
"""The queue types ``queue_type`` may name."""


def queue_type(raw: str) -> str:
    """``classic`` or ``quorum``, in any case."""
    value = raw.strip().lower()
    if value not in QUEUE_TYPES:
        raise ValueError(f"must be one of {', '.join(QUEUE_TYPES)}, not {raw!r}")
    return value


def _handler_list(raw: str) -> tuple[str, ...]:
    """A comma-separated list of names, blanks dropped."""
    return tuple(part.strip() for part in raw.split(",") if part.strip())


class Group(enum.Enum):
    """Which commands read a setting: the settings of a group are read by the same commands (each
    command's ``reads``, in ``worker/ops/cli/``), so a command takes as flags exactly the groups it
    reads. The value titles the group's section of a command's ``--help``."""

    DEPLOYMENT = "where the database, the broker and the handler modules are"
    LOGGING = "logging"
    CONSUMER = "how the consumer takes, batches and processes deliveries"
    LIMITS = "what a message body may be, however it arrives (the broker or the HTTP ingress)"
    INGRESS = "the HTTP ingress (`worker serve`)"
    COMPONENTS = "what runs inside `worker run` beside the consumer"
    SUPERVISOR = "how many worker processes `worker run` starts"
    PROCESS = "how a long-running process shuts down, and its endpoint's capacity"
    ENDPOINT = "where /healthz and /metrics are served"
    RELAY = "the outbox relay"
    NOTIFY = "outbox notifications"
    RETRIES = "delayed retries, and the inbox retention that must outlast them"
    SWEEP = "the inbox janitor's sweep"
    CONSOLE = "the operator console (`worker console`)"


_SPEC = "worker.setting"
"""The ``dataclasses.field`` metadata key under which ``setting`` keeps a field's ``_Spec``."""


@dataclass(frozen=True)
class _Spec:
    parse: Callable[[str], Any]
    group: Group
    help: str


def setting(
    default: _T, parse: Callable[[str], _T], group: Group, help: str, *, secret: bool = False
) -> _T:
    """A field of ``Settings``: its default, how its ``WORKER_*`` variable and flag are parsed,
    the group of commands that read it, and what it is for. A ``secret`` is left out of the
    settings' ``repr``, so no log line or traceback that shows them shows it."""
    return dataclasses.field(
        default=default, repr=not secret, metadata={_SPEC: _Spec(parse, group, help)}
    )


@dataclass(frozen=True)
class Settings:
    """The worker's configuration. Defaults match a local PostgreSQL and RabbitMQ.

    ``Settings.load()`` reads the ``WORKER_*`` environment variables; ``Settings(...)`` is the
    values given and the defaults, nothing from the environment.
    """

    database_url: str = setting(
        "postgresql://postgres@localhost:5432/postgres",
        postgresql_url,
        Group.DEPLOYMENT,
        "PostgreSQL URL, `postgresql://user:pass@host:port/db` (asyncpg driver); libpq's TLS "
        "options go in its query (see TLS and authentication). Several hosts, tried in turn, "
        "for a failover: `postgresql://user@host1:port1,host2:port2/db"
        "?target_session_attrs=read-write` (see PostgreSQL failover)",
    )
    amqp_url: str = setting(
        "amqp://guest:guest@localhost:5672/",
        broker_url_list,
        Group.DEPLOYMENT,
        "RabbitMQ URL, `amqp://user:pass@host:port/vhost`; `amqps://` for TLS. Several, "
        "separated by commas, are the nodes of one cluster: connections try them in order, "
        "and one that is lost reconnects to the next (see RabbitMQ clusters)",
    )
    startup_timeout: float = setting(
        60.0,
        duration_or_zero,
        Group.DEPLOYMENT,
        "how long a command keeps trying to reach PostgreSQL and RabbitMQ when it starts (they "
        "may be starting too) before it exits with status 3; `0`: one attempt",
    )
    exchange: str = setting(
        "events",
        str,
        Group.DEPLOYMENT,
        "durable topic exchange the worker consumes from and publishes to",
    )
    queue: str = setting(
        "worker",
        str,
        Group.DEPLOYMENT,
        "durable work queue; dead letters go to `<queue>.dlx` → `<queue>.dlq`",
    )
    queue_type: str = setting(
        "classic",
        queue_type,
        Group.DEPLOYMENT,
        "`classic` or `quorum`: the type of the work queue, its delayed-retry queues and the "
        "dead-letter queue (quorum: replicated on a cluster, dead-lettered at least once, with "
        "`delivery_limit`); an existing deployment changes type with `worker convert-queues`",
    )
    delivery_limit: int = setting(
        20,
        non_negative_int,
        Group.DEPLOYMENT,
        "quorum queues only: deliveries of a message that ended without a settlement (its "
        "worker died holding it) after which the broker dead-letters it as `delivery-limit`; "
        "`0` for none",
    )
    prefetch: int = setting(
        400,
        positive_int,
        Group.CONSUMER,
        "unacknowledged deliveries the broker sends ahead; keep it at least "
        "`batch_size` times `concurrency`",
    )
    concurrency: int = setting(
        2,
        positive_int,
        Group.CONSUMER,
        "consumer tasks, i.e. transactions (batches) in flight at once, and workflow runs at "
        "once; the database pool has this many connections (+2)",
    )
    batch_size: int = setting(
        100,
        positive_int,
        Group.CONSUMER,
        "most deliveries one transaction takes (at most the prefetch); `1` for a transaction "
        "per message",
    )
    batch_linger: float = setting(
        0.002,
        duration_or_zero,
        Group.CONSUMER,
        "how long a free consumer task waits for a batch to fill before it runs what it has; "
        "`0` not at all",
    )
    handlers: tuple[str, ...] = setting(
        (),
        _handler_list,
        Group.DEPLOYMENT,
        "comma-separated handler modules to load, besides the installed `worker.handlers` "
        "entry points",
    )
    installed_handlers: bool = setting(
        True,
        boolean,
        Group.DEPLOYMENT,
        "serve the handler modules installed as `worker.handlers` entry points too (off: only "
        "those named in `handlers`)",
    )
    max_body_bytes: int = setting(
        1024 * 1024,
        positive_int,
        Group.LIMITS,
        "larger message bodies are dead-lettered as `body-too-large`, and refused by the "
        "ingress (413) before they are read",
    )
    max_json_depth: int = setting(
        DEFAULT_MAX_DEPTH,
        positive_int,
        Group.LIMITS,
        "bodies nesting JSON arrays and objects deeper are dead-lettered as `body-too-deep` "
        "(refused by the ingress), before they are parsed",
    )
    max_json_items: int = setting(
        DEFAULT_MAX_ITEMS,
        positive_int,
        Group.LIMITS,
        "bodies whose JSON arrays and objects hold more members and elements in all are "
        "dead-lettered as `body-too-large` (refused by the ingress, 413), before they are parsed",
    )
    failure_throttle_after: int = setting(
        20,
        non_negative_int,
        Group.CONSUMER,
        "handler failures parked in a row after which the consumer takes one message at a time "
        "(junk refused by the worker's own checks does not count); `0` never",
    )
    failure_throttle_delay: float = setting(
        1.0,
        duration,
        Group.CONSUMER,
        "while throttled, the wait between two messages, until one succeeds",
    )
    log_level: str = setting(
        "INFO",
        str,
        Group.LOGGING,
        "`DEBUG`, `INFO`, `WARNING` or `ERROR`; passwords in URLs are never logged",
    )
    log_format: str = setting(
        "text",
        log_format,
        Group.LOGGING,
        "`text`, or `json` for one JSON object per line",
    )
    shutdown_grace: float = setting(
        30.0,
        duration,
        Group.PROCESS,
        "on SIGTERM, how long in-flight messages may take to commit before they are rolled back",
    )
    http_host: str = setting(
        "127.0.0.1",
        str,
        Group.ENDPOINT,
        "address of `/healthz` and `/metrics`; `0.0.0.0` (or `::`) for every interface, as in "
        "a container",
    )
    http_port: int = setting(
        9180,
        port,
        Group.ENDPOINT,
        "port of `/healthz` and `/metrics`; `0` serves none",
    )
    sample_interval: float = setting(
        10.0,
        duration_or_zero,
        Group.ENDPOINT,
        "how often a `worker run` or `worker relay` process writes a sample of itself (state, "
        "counters, backlogs) to `process_samples`, what `worker status` and the console show "
        "of every process; `0` writes none (`worker status` then lists the processes seen in "
        "the last 30s)",
    )
    http_max_connections: int = setting(
        64,
        positive_int,
        Group.PROCESS,
        "connections the endpoint serves at once; more are closed as they arrive, unread",
    )
    processes: int = setting(
        1,
        positive_int,
        Group.SUPERVISOR,
        "worker processes sharing the queue and the outbox; above 1, `worker run` starts that "
        "many and supervises them (see Processes); process i, from 0, serves `/healthz` and "
        "`/metrics` on `http_port` + i",
    )
    relay: bool = setting(
        True,
        boolean,
        Group.COMPONENTS,
        "run the outbox relay inside `worker run` too",
    )
    relay_batch_size: int = setting(
        100,
        positive_int,
        Group.RELAY,
        "outbox rows a relay claims per transaction",
    )
    relay_max_attempts: int = setting(
        10,
        positive_int,
        Group.RELAY,
        "failed publishes of a row before it is parked in `outbox_parked`",
    )
    relay_retry_delay: float = setting(
        1.0,
        positive_float,
        Group.RELAY,
        "seconds before a failed row's first retry; doubles per attempt, at most 5 minutes",
    )
    relay_poll_interval: float = setting(
        1.0,
        positive_float,
        Group.RELAY,
        "longest wait, in seconds, of an idle relay between polls",
    )
    outbox_notify: bool = setting(
        True,
        boolean,
        Group.NOTIFY,
        "one `NOTIFY worker_outbox` per transaction that added outbox rows, which wakes the "
        "relays (off: they only poll)",
    )
    transient_attempts: int = setting(
        3,
        positive_int,
        Group.CONSUMER,
        "in-process tries of a unit of work that fails transiently (0.1 s, then doubling, "
        "jittered), before a delayed retry",
    )
    retry_delays: tuple[float, ...] = setting(
        (1.0, 10.0, 60.0),
        durations,
        Group.RETRIES,
        "delays of the delayed retries, one queue each (e.g. `1s,10s,1m`); `none` parks at once",
    )
    inbox_retention: float = setting(
        7 * 86400.0,
        duration,
        Group.RETRIES,
        "how long inbox keys are kept; must be longer than the sum of the retry delays",
    )
    janitor: bool = setting(
        True,
        boolean,
        Group.COMPONENTS,
        "run the inbox janitor inside `worker run` too",
    )
    janitor_interval: float = setting(
        60.0,
        duration,
        Group.COMPONENTS,
        "time between the in-process janitor's sweeps",
    )
    janitor_batch_size: int = setting(
        1000,
        positive_int,
        Group.SWEEP,
        "expired inbox keys deleted per transaction",
    )
    ingress_host: str = setting(
        "127.0.0.1",
        str,
        Group.INGRESS,
        "address the ingress listens on; `0.0.0.0` (or `::`) for every interface, as in a "
        "container",
    )
    ingress_port: int = setting(
        8000,
        listen_port,
        Group.INGRESS,
        "port the ingress listens on; `0` for a free one (logged at start)",
    )
    ingress_tokens: tuple[str, ...] = setting(
        (),
        bearer_tokens,
        Group.INGRESS,
        "comma-separated bearer tokens the ingress accepts (`Authorization: Bearer <token>`, "
        "each at least 16 characters), each `name:token` (the client a token speaks for: it "
        "reads back only what its name posted) or a bare token (its own client); none: no "
        "authentication. Prefer the variable to the flag, which other users of the host can read",
        secret=True,
    )
    console_host: str = setting(
        "127.0.0.1",
        str,
        Group.CONSOLE,
        "address the console listens on; only this host can reach it by default. Put it behind "
        "a TLS proxy (and set `console_url`) before you open it to a network",
    )
    console_port: int = setting(
        8100,
        listen_port,
        Group.CONSOLE,
        "port the console listens on; `0` for a free one (logged at start)",
    )
    console_viewer_tokens: tuple[str, ...] = setting(
        (),
        bearer_tokens,
        Group.CONSOLE,
        "comma-separated `name:token` entries (tokens of at least 16 characters) that log in to "
        "the console read-only: they see every page and act on nothing. The ingress's tokens "
        "may be reused here, but a client of the ingress then reads every dead letter's body",
        secret=True,
    )
    console_operator_tokens: tuple[str, ...] = setting(
        (),
        bearer_tokens,
        Group.CONSOLE,
        "comma-separated `name:token` entries that log in to the console as operators: they "
        "may also replay and purge dead letters and retry, hurry and cancel outbox rows. With "
        "neither tokens setting, `worker console` refuses to start",
        secret=True,
    )
    console_url: str = setting(
        "",
        console_url,
        Group.CONSOLE,
        "the console's address as its users reach it (`https://console.example.com`), when a "
        "proxy serves it: its host is allowed besides localhost, and `https` makes the session "
        "cookie `Secure`. Empty: served as `http://<console_host>:<console_port>`",
    )
    console_trusted_proxies: tuple[str, ...] = setting(
        (),
        networks,
        Group.CONSOLE,
        "comma-separated addresses or networks of the proxies in front of the console whose "
        "`X-Forwarded-For` it believes: a request from one of them counts (login throttle, "
        "unauthenticated requests in flight) against the last address of that header that is "
        "not itself one of them. Empty: the header is ignored and every request is its peer's",
    )
    console_audit_retention: float = setting(
        90 * 86400.0,
        duration,
        Group.SWEEP,
        "how long the console's audit entries are kept; the janitor deletes older ones",
    )
    ingress_routing_keys: tuple[str, ...] = setting(
        (),
        _handler_list,
        Group.INGRESS,
        "comma-separated routing keys the ingress accepts messages for; none: every routing key "
        "the handler modules serve except those a handler declares it publishes (`publishes=`: "
        "the worker's own events)",
    )
    ingress_pool_size: int = setting(
        10,
        positive_int,
        Group.INGRESS,
        "database connections the ingress holds; a request waits for a free one",
    )
    ingress_max_connections: int = setting(
        512,
        positive_int,
        Group.INGRESS,
        "client connections the ingress keeps open; when they are all open, a new one closes "
        "the oldest idle one, and without an idle one it is answered 503 (see Bounds)",
    )
    ingress_max_requests: int = setting(
        100,
        positive_int,
        Group.INGRESS,
        "requests the ingress handles at once, bodies being read included; more are answered "
        "503 at once (`/healthz` excepted). Times `max_body_bytes`, it bounds the bodies held",
    )
    ingress_header_timeout: float = setting(
        10.0,
        duration,
        Group.INGRESS,
        "how long a client has to send a request's headers, from its connection or from the "
        "request's first byte; then the connection is closed",
    )
    ingress_body_timeout: float = setting(
        30.0,
        duration,
        Group.INGRESS,
        "how long a client has to send a request's whole body once its headers arrived; then "
        "it is answered 408 and the connection closed",
    )
    ingress_keep_alive: float = setting(
        65.0,
        duration,
        Group.INGRESS,
        "how long an idle connection is kept open after an answer; keep it longer than the "
        "idle timeout of a load balancer in front (60 s for most)",
    )
    ingress_allowed_hosts: tuple[str, ...] = setting(
        ("localhost", "127.0.0.1", "[::1]"),
        _handler_list,
        Group.INGRESS,
        "comma-separated host names a request's `Host` may name while `ingress_tokens` is "
        "empty (against DNS rebinding); others are refused (400). `*` for any. With tokens, "
        "any host is served",
    )
    ingress_access_log: bool = setting(
        True,
        boolean,
        Group.INGRESS,
        "log one line per request: method, path, status, duration, Idempotency-Key, client",
    )
    workflow_lease: float = setting(
        30.0,
        duration,
        Group.CONSUMER,
        "how long a workflow's owner holds it between steps before another delivery may take over",
    )
    tcp_keepalive_idle: float = setting(
        5.0,
        duration_or_zero,
        Group.DEPLOYMENT,
        "seconds a PostgreSQL or RabbitMQ connection may be silent before TCP keepalive probes "
        "it (then every 2 s), on both ends; 0: the operating system's defaults (2 h on Linux). "
        "Short, so a silent network partition is noticed, and so a load balancer or NAT never "
        "sees an idle flow to expire (see Network partitions)",
    )
    tcp_user_timeout: float = setting(
        10.0,
        duration_or_zero,
        Group.DEPLOYMENT,
        "seconds sent data or keepalive probes may go unanswered before a PostgreSQL or "
        "RabbitMQ connection is dropped as dead (TCP_USER_TIMEOUT, on both ends where the "
        "platform has it); 0: TCP's retransmissions decide (about 15 min on Linux)",
    )
    database_connect_timeout: float = setting(
        5.0,
        duration,
        Group.DEPLOYMENT,
        "seconds opening one PostgreSQL connection (TCP, TLS, login) may take before the "
        "attempt counts as failed",
    )
    database_timeout: float = setting(
        30.0,
        duration,
        Group.DEPLOYMENT,
        "seconds each of the worker's own statements (a unit of work's claim and its end, the "
        "commit, the relay's) may wait on PostgreSQL before it fails transiently and is redone; "
        "a handler's own statements are not bounded by it (see Network partitions)",
    )
    broker_heartbeat: int = setting(
        10,
        positive_int,
        Group.DEPLOYMENT,
        "AMQP heartbeat in seconds the worker asks the broker for (unless `amqp_url` sets "
        "`heartbeat`): a broker connection silent for about twice as long is dropped by both "
        "ends",
    )

    def __post_init__(self) -> None:
        if self.inbox_retention <= self.retry_chain:
            raise ConfigurationError(
                f"inbox_retention ({format_duration(self.inbox_retention)}) must be longer than "
                f"the delayed-retry chain ({format_duration(self.retry_chain)}): a message "
                "redelivered after its key expired would apply its effect again"
            )

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Settings from ``environ`` (default: ``os.environ``), then non-None ``overrides``.

        This is the call that reads the ``WORKER_*`` variables; ``Settings(...)`` takes only
        the values it is given, the rest at their defaults, whatever the environment says (so
        tests and code that pass every value they mean are never changed by it).
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for spec in FIELDS:
            if environ.get(spec.env):
                values[spec.name] = spec.read(environ)
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
    def work_queue_delivery_limit(self) -> int:
        """The delivery limit the work queue is declared with: ``delivery_limit`` on a quorum
        queue, 0 (none) on a classic one, which has none."""
        return self.delivery_limit if self.queue_type == "quorum" else 0

    @property
    def amqp_urls(self) -> tuple[str, ...]:
        """The broker URLs of ``amqp_url``, one per node, in the order they are tried first."""
        return broker_urls(self.amqp_url)

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.queue}.dlx"

    @property
    def dead_letter_queue(self) -> str:
        return f"{self.queue}.dlq"

    @property
    def sqlalchemy_url(self) -> str:
        """``database_url`` as SQLAlchemy needs it (``asyncpg_url``)."""
        return asyncpg_url(self.database_url)


def asyncpg_url(database_url: str) -> str:
    """A PostgreSQL URL as SQLAlchemy needs it for the worker's driver: ``postgres://``,
    ``postgresql://`` (libpq's and ``psql``'s spelling, which SQLAlchemy alone would give to
    psycopg) or ``postgresql+asyncpg://`` becomes ``postgresql+asyncpg://``, and several hosts
    (``postgresql://u@h1:p1,h2:p2/db``, libpq's form) move into the query
    (``?host=h1,h2&port=p1,p2``, which SQLAlchemy's asyncpg dialect reads). Idempotent; any
    other scheme is a ``ConfigurationError``."""
    scheme, separator, rest = database_url.partition("://")
    if separator and scheme in {"postgres", "postgresql", "postgresql+asyncpg"}:
        return f"postgresql+asyncpg://{_hosts_in_query(rest)}"
    shown = f"{scheme}://" if separator else "a URL without a scheme"
    raise ConfigurationError(f"database_url must be a postgresql:// URL, not {shown}")


DEFAULT_DATABASE_PORT = "5432"
"""The port of a host listed without one in a multi-host ``database_url`` (libpq's default)."""


def _hosts_in_query(rest: str) -> str:
    """``rest`` (a PostgreSQL URL after ``scheme://``) with a comma-separated host list moved
    from its authority into its query as ``host=h1,h2&port=p1,p2`` (IPv6 addresses without
    their brackets); one host leaves it unchanged."""
    parts = urlsplit("//" + rest)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return rest
    names, ports = [], []
    for host in hosts.split(","):
        if host.startswith("["):
            name, _, port = host[1:].partition("]")
            port = port.removeprefix(":")
        else:
            name, _, port = host.partition(":")
        if not name:
            raise ConfigurationError(f"database_url: an empty host in the host list {hosts!r}")
        names.append(name)
        ports.append(port or DEFAULT_DATABASE_PORT)
    query = "&".join(
        filter(None, [f"host={','.join(names)}", f"port={','.join(ports)}", parts.query])
    )
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{userinfo}{at}{parts.path or '/'}?{query}{fragment}"


@dataclass(frozen=True)
class Field:
    """One setting as ``Settings`` declares it: its name, how to parse it from text, what it is
    for, the group of commands that read it, and its default."""

    name: str
    parse: Callable[[str], Any]
    help: str
    group: Group
    default: Any
    secret: bool = False
    """Kept out of the settings' ``repr``, and out of every error about its value."""

    @classmethod
    def of(cls, declared: dataclasses.Field[Any]) -> Field:
        spec: _Spec = declared.metadata[_SPEC]
        return cls(
            declared.name,
            spec.parse,
            spec.help,
            spec.group,
            declared.default,
            secret=not declared.repr,
        )

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """This setting from its ``WORKER_*`` variable in ``environ`` (default: ``os.environ``),
        parsed as ``Settings.load`` parses it, or its default when unset or empty; the other
        settings are not read. A value that does not parse is a ``ConfigurationError``."""
        raw = (os.environ if environ is None else environ).get(self.env)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            # (a secret named, never shown: not even in the chained exception; others redacted)
            raise ConfigurationError(f"{self.env}{self.shown(raw)}: {exc}") from None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def shown(self, raw: str) -> str:
        """``=<raw>`` for an error about a value of this setting, redacted; nothing for a
        secret."""
        return "" if self.secret else f"={redaction.redact(repr(raw))}"

    @property
    def switch(self) -> bool:
        """A boolean: its flag is ``--x`` / ``--no-x`` and takes no value."""
        return self.parse is boolean

    @property
    def flags(self) -> tuple[str, ...]:
        """Every spelling of the flag: ``--x``, and ``--no-x`` for a switch."""
        return (self.flag, "--no-" + self.flag[2:]) if self.switch else (self.flag,)

    @property
    def shown_default(self) -> str:
        """The default as a user writes it: ``2ms``, ``1s,10s,1m`` or ``none``, ``true``."""
        value = self.default
        if self.parse in (duration, duration_or_zero):
            return format_duration(value)
        if self.parse is durations:
            return ",".join(map(format_duration, value)) or "none"
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, tuple):
            return ",".join(value) or "(none)"
        return str(value)


FIELDS: tuple[Field, ...] = tuple(Field.of(declared) for declared in dataclasses.fields(Settings))
"""Every setting, in declaration order."""


def field(name: str) -> Field:
    """The setting called ``name``."""
    return next(spec for spec in FIELDS if spec.name == name)


def redact(url: str) -> str:
    """``url`` safe to print (``worker.redaction.redact``: its password, its secret query
    parameters); each URL of a broker list."""
    return redaction.redact(url)
