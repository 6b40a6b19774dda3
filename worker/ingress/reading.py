"""Reading what a client posted as the ``Delivery`` the consumer would get, so that the
consumer's own checks (``worker.core.envelope.open_envelope``) decide what the ingress accepts.

Invariant: every header and byte is hostile until checked, and a body is never read past
``max_body_bytes``: a declared Content-Length over it is refused before a byte is read, and a body
sent without one (chunked) as soon as it passes the limit. The Idempotency-Key is taken as the
bytes the client sent (decoded as UTF-8 by the consumer's key check, not as Latin-1 by the HTTP
layer), and a request carrying two of them is refused rather than one picked.

The delivery carries what the event will: the key in the ingress's own key space
(``handler_key``: ``http:<client>:<key>``, so that no HTTP client can take, park or read a key
sent over AMQP, nor another client's), and the body as its canonical JSON (``open_posted``:
the one value the handler validated, whatever duplicate names, spacing or escapes the client sent),
decoded once, off the event loop when it is large.
"""

from __future__ import annotations

import functools

from starlette.requests import Request

from worker.core.codec import (
    JSON_CONTENT_TYPE,
    canonical_fingerprint,
    decode_canonical,
    is_json_content_type,
)
from worker.core.envelope import (
    IDEMPOTENCY_KEY_HEADER,
    MAX_KEY_LENGTH,
    Delivery,
    Envelope,
    check_key,
    idempotency_key,
    open_envelope,
)
from worker.core.handler import Handlers
from worker.core.keyspace import HTTP_KEY_PREFIX
from worker.core.offload import checked_by_size
from worker.errors import BodyTooLarge, InvalidKey, MissingKey
from worker.ingress.problems import unsupported_media_type
from worker.settings import MAX_CLIENT_NAME_LENGTH, Settings

_KEY_HEADER = IDEMPOTENCY_KEY_HEADER.encode("latin-1")

MAX_CLIENT_KEY_LENGTH = MAX_KEY_LENGTH - len(HTTP_KEY_PREFIX) - MAX_CLIENT_NAME_LENGTH - 1
"""The longest Idempotency-Key a client may send: its ``handler_key`` must be a key the inbox
takes (``MAX_KEY_LENGTH``) with the longest client name."""


def check_client_key(raw: object) -> str:
    """``raw`` as a client's Idempotency-Key: the consumer's key check (``check_key``), and at
    most ``MAX_CLIENT_KEY_LENGTH`` characters; ``InvalidKey`` otherwise."""
    key = check_key(raw)
    if len(key) > MAX_CLIENT_KEY_LENGTH:
        raise InvalidKey(f"Idempotency-Key is longer than {MAX_CLIENT_KEY_LENGTH} characters")
    return key


def key_header(request: Request) -> bytes | None:
    """The raw ``Idempotency-Key`` header, None without one; two of them are an ``InvalidKey``."""
    values = [value for name, value in request.scope["headers"] if name.lower() == _KEY_HEADER]
    if len(values) > 1:
        raise InvalidKey("the request carries more than one Idempotency-Key header")
    return values[0] if values else None


def client_key(request: Request, routing_key: str) -> str:
    """The request's Idempotency-Key, checked by the consumer's own key check: a ``MissingKey``
    or an ``InvalidKey`` (not UTF-8, a NUL, longer than ``MAX_CLIENT_KEY_LENGTH``) otherwise."""
    raw = key_header(request)
    if not raw:
        raise MissingKey("the request has no Idempotency-Key header (or an empty one)")
    delivery = Delivery(b"", routing_key, headers={IDEMPOTENCY_KEY_HEADER: raw})
    return check_client_key(idempotency_key(delivery))


def json_content_type(request: Request) -> str:
    """The request's content type, which must be declared and JSON (``application/json`` or a
    ``+json`` type); a ``Problem`` (415) otherwise."""
    content_type = request.headers.get("content-type")
    if not content_type or not is_json_content_type(content_type):
        raise unsupported_media_type(content_type)
    return content_type


def within_limit(content_length: bytes, limit: int) -> bool:
    """Whether a declared Content-Length is a size of at most ``limit`` (compared by its digits
    first, so that no length of thousands of digits is ever converted)."""
    digits = content_length.lstrip(b"0")
    return (
        content_length.isdigit() and len(digits) <= len(str(limit)) and int(digits or b"0") <= limit
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes; ``BodyTooLarge`` as soon as it is known to
    be longer (from its Content-Length, before reading; else once the bytes read pass it)."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and not within_limit(declared.encode(), limit):
        raise BodyTooLarge(f"Content-Length is {declared[:40]} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body passed the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def open_posted(
    body: bytes,
    content_type: str,
    router: Handlers,
    routing_key: str,
    key: str,
    settings: Settings,
) -> Envelope:
    """The posted ``body`` as the consumer's envelope of the event to append: its routing key,
    ``key`` (the client's ``handler_key``), and as its body the canonical JSON of the value
    (``codec.canonical_json``: one value per name, the last of duplicates, no insignificant
    whitespace, no needless escapes), checked by the consumer's own ``open_envelope``. The body
    is decoded and encoded once: the canonical form is the event's body and what its fingerprint
    hashes. (It may be longer than the body sent, ``1E2`` being ``100.0``: the size check, made
    on the delivery, refuses one that would pass the limit.)"""
    value, canonical = decode_canonical(
        body, content_type, max_depth=settings.max_json_depth, max_items=settings.max_json_items
    )
    delivery = Delivery(
        canonical,
        routing_key,
        headers={IDEMPOTENCY_KEY_HEADER: key},
        content_type=JSON_CONTENT_TYPE,
    )
    return open_envelope(
        delivery,
        router,
        max_body_bytes=settings.max_body_bytes,
        max_depth=settings.max_json_depth,
        max_items=settings.max_json_items,
        decoded=(value, canonical_fingerprint(canonical)),
    )


async def read_envelope(
    request: Request, router: Handlers, routing_key: str, key: str, settings: Settings
) -> Envelope:
    """The posted message, read within ``max_body_bytes`` after its content type was checked,
    as ``open_posted`` makes it: on the event loop for a small body, in the decoding thread
    for a large one (``offload.checked_by_size``)."""
    content_type = json_content_type(request)
    body = await read_body(request, settings.max_body_bytes)
    return await checked_by_size(
        body, functools.partial(open_posted, body, content_type, router, routing_key, key, settings)
    )
